"""Former home of :mod:`attnkit.demos.encoder`, kept so that old imports still work."""
from .demos.encoder import *  # noqa: F403
