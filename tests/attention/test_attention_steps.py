"""An attention layer's decoding step writes the keys and values its forward over one position writes, bit for
bit, and gives the same logits to rounding: q/k norms per head and over the whole projection, Gemma 4's owners
(a global layer's values its keys' projection, a sliding layer's their own) and readers, latent attention's
normalised, turned latents (queries through a bottleneck), one fused projection or separate ones, float16 to
float64. Large projections check that half-precision norms square in float32, as the
forward does. The first layer's entry is compared bit for bit (both paths hand it the same input; later layers
read attention outputs whose kernels round differently); tests/models/test_decode_step.py runs every family's
step against its whole sequence."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.attention.latent import LatentAttentionConfig
from attnkit.kernels.decode_step import rms_norm_into
from attnkit.kernels.rms_norm import rms_norm_forward
from attnkit.models import (
    AttentionConfig,
    CausalLM,
    DecoderConfig,
    LayerwiseConfig,
    MLPConfig,
    NormConfig,
    RotaryConfig,
)

BASE = dict(vocab_size=19, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4, mlp=MLPConfig(24),
            rotary=RotaryConfig(theta=100.0), max_position_embeddings=64)
GEMMA4_TYPES = ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention")


def _gemma4(layer_types: tuple[str, ...]) -> DecoderConfig:
    return DecoderConfig(family="gemma4_text", num_layers=5, layer_types=layer_types,
                         attention=AttentionConfig(sliding_window=3), norm=NormConfig(placement="sandwich", offset=1.0),
                         layerwise=LayerwiseConfig(global_head_dim=8, global_kv_heads=1, keys_are_values=True,
                                                   shared_kv_layers=2), **BASE)


CONFIGS = {
    "head_norm": DecoderConfig(family="qwen3", num_layers=2, attention=AttentionConfig(qk_norm="head"), **BASE),
    "projection_norm": DecoderConfig(family="olmo2", num_layers=2, norm=NormConfig(placement="post"),
                                     attention=AttentionConfig(qk_norm="projection"), **BASE),
    "latent": DecoderConfig(family="deepseek_v3", num_layers=2, **BASE, mixer_parts=(LatentAttentionConfig(
        hidden_size=16, num_heads=4, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
        q_lora_rank=5, rope_interleaved=False),)),
    "shared_kv_sliding_first": _gemma4(GEMMA4_TYPES),
    "shared_kv_global_first": _gemma4(GEMMA4_TYPES[1:] + GEMMA4_TYPES[:1]),
}
TOLERANCE = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}


def _model(name: str, dtype, *, fused: bool, gain: float) -> CausalLM:
    lm = CausalLM(CONFIGS[name], rng=3).astype(dtype)
    for layer in lm.layers:
        attention = layer.attention
        for weight in ("W_Q", "W_K", "W_QA", "W_KVA"):  # in place: the fused arrays' views stay views
            if weight in attention._parameters:
                attention._parameters[weight][...] *= gain
        if not fused:  # new storage for every parameter ends the fused groups: separate products
            for weight, value in list(attention._parameters.items()):
                attention.register_parameter(weight, value.copy())
            assert attention.fused_parameter("W_QKV") is None
    return lm


def _after_a_step(lm: CausalLM, ids: np.ndarray, *, through_steps: bool):
    """The last position's logits and the cache's arrays after a prefill of all but it and one step."""
    if not through_steps:  # a hook that changes nothing sends the step through the sequence path
        lm.add_hook("hook_embed", lambda value, name: None, full_name="hook_embed")
    cache = lm.new_cache(ids.shape[0])
    lm(ids[:, :-1], cache=cache)
    logits = lm(ids[:, -1:], cache=cache)  # (B, 1, V)
    return logits, cache.arrays()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_step_writes_the_forwards_keys_and_values_bit_for_bit(name, fused, dtype):
    gain = 40.0 if dtype == np.float16 else 1.0  # half-precision q and k past 256: float16 squares overflow
    ids = np.random.default_rng(len(name)).integers(0, BASE["vocab_size"], size=(2, 6))
    stepped = _after_a_step(_model(name, dtype, fused=fused, gain=gain), ids, through_steps=True)
    reference = _after_a_step(_model(name, dtype, fused=fused, gain=gain), ids, through_steps=False)
    assert stepped[1].keys() == reference[1].keys()
    first = [key for key in reference[1] if key.startswith("layers.0.")]  # keys and values, or latents
    assert first
    for key in first:
        assert np.isfinite(reference[1][key]).all() and np.abs(reference[1][key]).max() > 0
        np.testing.assert_array_equal(stepped[1][key], reference[1][key], err_msg=key)
    assert stepped[0].dtype == dtype and np.isfinite(stepped[0]).all()
    tolerance = TOLERANCE[dtype]
    np.testing.assert_allclose(stepped[0], reference[0], rtol=tolerance, atol=tolerance * np.abs(reference[0]).max())


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_in_place_norm_is_the_forwards_norm_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    for scale in (1.0, 300.0):  # 300: float16 squares past its largest finite number
        x = (rng.normal(size=(3, 2, 1, 8)) * scale).astype(dtype)
        gain = rng.normal(size=8).astype(dtype)
        want = rms_norm_forward(x, gain, 1e-6)[0]
        assert np.isfinite(want).all()
        out = np.empty_like(x)
        np.testing.assert_array_equal(rms_norm_into(x, gain, 1e-6, out, np.empty_like(x)), want)
        inside = x.copy()  # written over its own input
        np.testing.assert_array_equal(rms_norm_into(inside, gain, 1e-6, inside, np.empty_like(x)), want)
