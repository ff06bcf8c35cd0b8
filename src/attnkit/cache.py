"""Former home of :mod:`attnkit.decoding.cache`, kept so that old imports still work."""
from .decoding.cache import *  # noqa: F403
