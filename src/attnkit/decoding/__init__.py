"""Decoding: the key/value cache, sampling (greedy, temperature, top-k/top-p, streaming) and beam search.

- :mod:`attnkit.decoding.cache`: a model's :class:`~attnkit.decoding.cache.ModelCache`, one entry per layer
  made by the layer (:class:`~attnkit.decoding.cache.KeysValues`, :class:`~attnkit.decoding.cache.Latents` for
  multi-head latent attention, a state layer's state); :class:`~attnkit.decoding.cache.KVCache` and
  :class:`~attnkit.decoding.cache.LatentCache` make one from sizes alone.
- :mod:`attnkit.decoding.config`: :class:`~attnkit.decoding.config.GenerationConfig`, generate's options with
  Hugging Face's names and defaults, validated once.
- :mod:`attnkit.decoding.sampling`: ``generate``, ``generate_stream`` and the logits warpers.
- :mod:`attnkit.decoding.beam_search`: greedy and beam search for encoder-decoder models.
"""

from .config import GenerationConfig

__all__ = ["GenerationConfig"]
