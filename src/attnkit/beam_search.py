"""Former home of :mod:`attnkit.decoding.beam_search`, kept so that old imports still work."""
from .decoding.beam_search import *  # noqa: F403
