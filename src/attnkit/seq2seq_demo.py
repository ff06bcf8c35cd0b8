"""Former home of :mod:`attnkit.demos.dates`, kept so that old imports still work."""
from .demos.dates import *  # noqa: F403
