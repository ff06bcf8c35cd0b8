"""A model's cache is the list of its layers' entries, each made by the layer's token mixer: the model accepts only
a cache whose entries are of its layers' kinds, a ``ModelCache`` checks what it is given, and the state layers'
``new_cache`` takes the mixers' one signature."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.attention.cache_entry import KeysValues, Latents, PairedCache, entry_kind
from attnkit.decoding.cache import KVCache, LatentCache, ModelCache
from attnkit.layers import GatedDeltaNet, Mamba2, ShortConv
from attnkit.layers.mamba2 import Mamba2Config
from attnkit.models import AttentionConfig, CausalLM, DecoderConfig, MLPConfig
from attnkit.models.config import GatedDeltaNetConfig


def _llama(**overrides) -> CausalLM:
    base = dict(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=4, mlp=MLPConfig(6))
    base.update(overrides)
    return CausalLM(DecoderConfig(**base), rng=0)


def _hybrid() -> CausalLM:
    return _llama(family="qwen3_next", layer_types=("linear_attention", "full_attention"),
                  mixer_parts=(GatedDeltaNetConfig(num_key_heads=1, num_value_heads=2, key_head_dim=4,
                                                   value_head_dim=4),))


def test_a_model_takes_only_a_cache_of_its_layers_kinds():
    llama, hybrid = _llama(), _hybrid()
    ids = np.array([[1, 2, 3]])
    with pytest.raises(TypeError, match="its layer 0 holds keys_values, the model's layer keeps state"):
        hybrid(ids, cache=llama.new_cache(1))  # keys and values where a state layer is
    with pytest.raises(TypeError, match="its layer 0 holds latent, the model's layer keeps keys_values"):
        llama(ids, cache=LatentCache(2, 1, 6))
    with pytest.raises(TypeError, match="cache must be a ModelCache"):
        llama(ids, cache={"layers": []})
    with pytest.raises(ValueError, match="cache has 3 layers, the model 2"):
        llama(ids, cache=KVCache(3, 1, 1, 4))
    # a cache built by hand from the layers' own entries is the model's
    by_hand = ModelCache([block.attention.new_cache(1) for block in hybrid.layers], batch_size=1)
    made = hybrid.new_cache(1)
    np.testing.assert_array_equal(hybrid(ids, cache=by_hand), hybrid(ids, cache=made))
    assert by_hand.kinds == made.kinds == ("state", "keys_values")


def test_the_layers_make_their_own_entries():
    sliding = _llama(family="mistral", layer_types=("sliding_attention", "full_attention"),
                     attention=AttentionConfig(sliding_window=3))
    cache = sliding.new_cache(2, max_length=40, rollback=2)
    ring, full = cache.entries
    assert isinstance(ring, KeysValues) and (ring.window, ring.capacity, ring.rollback) == (3, 5, 2)
    assert isinstance(full, KeysValues) and full.window is None and full.max_length == 40
    wide = _llama()
    wide.astype(np.float64)
    cache64 = wide.new_cache(1)
    assert cache64.dtype == np.float64 and all(entry.dtype == np.float64 for entry in cache64.entries)


def test_a_model_cache_checks_its_entries():
    with pytest.raises(ValueError, match="one entry per layer, got none"):
        ModelCache([], batch_size=1)
    with pytest.raises(ValueError, match=r"entries\[1\] holds 2 rows but batch_size is 1"):
        ModelCache([KeysValues(1, 1, 2), KeysValues(2, 1, 2)], batch_size=1)
    with pytest.raises(ValueError, match=r"entries\[0\] holds 3 rows"):
        ModelCache([Latents(3, 6)], batch_size=1)
    with pytest.raises(TypeError, match=r"entries\[0\] must have length, nbytes, reorder, copy and cleared"):
        ModelCache([np.zeros(3)], batch_size=1)
    with pytest.raises(TypeError, match="keys_values must be a KeysValues"):
        PairedCache(np.zeros(3), GatedDeltaNet(4, 1, 1, 2, 2, rng=0).new_cache(1))
    assert [entry_kind(e) for e in (None, KeysValues(1, 1, 2), Latents(1, 4))] == ["none", "keys_values", "latent"]


@pytest.mark.parametrize("layer", [GatedDeltaNet(4, 1, 1, 2, 2, rng=0), Mamba2(8, Mamba2Config(2, 4, 4), rng=0),
                                   ShortConv(4, rng=0)], ids=["gated_deltanet", "mamba2", "short_conv"])
def test_a_state_layers_new_cache_takes_the_mixers_signature(layer):
    state = layer.new_cache(2, 100, dtype=np.float64, rollback=3)  # the bound and rollback change nothing
    assert state.length == 0 and state.nbytes == layer.new_cache(2, dtype=np.float64).nbytes
    assert all(a.dtype == np.float64 for a in vars(state).values() if isinstance(a, np.ndarray))
    with pytest.raises(TypeError, match="max_length must be an int or None, got <class 'numpy.float64'> "
                                        r"\(dtype is a keyword argument\)"):
        layer.new_cache(2, np.float64)
