"""Former home of :mod:`attnkit.decoding.sampling`, kept so that old imports still work."""
from .decoding.sampling import *  # noqa: F403
