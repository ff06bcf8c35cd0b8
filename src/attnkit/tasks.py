"""Former home of :mod:`attnkit.demos.tasks`, kept so that old imports still work."""
from .demos.tasks import *  # noqa: F403
