"""Former home of :mod:`attnkit.demos.addition`, kept so that old imports still work."""
from .demos.addition import *  # noqa: F403
