"""Decoding: the key/value cache, sampling (greedy, temperature, top-k/top-p, streaming) and beam search.

- :mod:`attnkit.decoding.cache`: :class:`~attnkit.decoding.cache.KVCache`, and
  :class:`~attnkit.decoding.cache.LatentCache` for multi-head latent attention.
- :mod:`attnkit.decoding.sampling`: ``generate``, ``generate_stream`` and the logits warpers.
- :mod:`attnkit.decoding.beam_search`: greedy and beam search for encoder-decoder models.
"""
