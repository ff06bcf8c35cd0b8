"""Former home of :mod:`attnkit.demos.date_data`, kept so that old imports still work."""
from .demos.date_data import *  # noqa: F403
