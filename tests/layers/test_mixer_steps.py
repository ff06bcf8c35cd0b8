"""The token mixers and the mixture of experts decode through a ``step`` of their own (never ``Module.step``'s
forward on a sequence of one): Gated DeltaNet, Kimi Delta Attention, Mamba-2, the mixture of experts and
multi-head latent attention. On a batch of two rows, one left-padded, in float32 and float64, each step equals
its layer's cached forward of the same position (bit for bit where the same operations run in the same order;
latent attention's step groups the H queries into one product with the cached latent, within rounding), leaves
the caches in the same state, keeps its input's dtype, saves nothing and writes into no array it was given."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.attention.latent import LatentAttentionConfig, MultiHeadLatentAttention
from attnkit.core.module import Module
from attnkit.decoding.cache import LatentCache
from attnkit.kernels.rotary import rotary_cos_sin, rotary_frequencies
from attnkit.layers import Mamba2, Mamba2Config
from attnkit.layers.experts import GatedSharedExpert, MixtureOfExperts
from attnkit.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetMixer
from attnkit.layers.identity import Zero
from attnkit.layers.kimi_delta_attention import KimiDeltaAttention, KimiDeltaAttentionMixer
from attnkit.layers.mamba2 import Mamba2Mixer
from attnkit.layers.router import Router
from attnkit.models import ExpertsConfig

from helpers import make_rng, randn

D = 8
PROMPT, LENGTH = 3, 7
# row 1 is left-padded: its first two positions are padding, in the prompt and so in what the steps attend to
MASK = np.ones((2, LENGTH), bool)
MASK[1, :2] = False

DTYPES = [np.float32, np.float64]


def _randomised(module: Module, seed: int, dtype) -> Module:
    """``module`` in ``dtype`` with every parameter moved off its initial value (zero biases, unit gains and skips
    would hide a part the step got wrong)."""
    rng = make_rng(seed)
    for _, value in module.named_parameters():
        value += randn(rng, *value.shape, scale=0.3).astype(value.dtype)
    module.astype(dtype)
    return module


def _assert_untouched(before: dict, arrays: dict) -> None:
    for name, value in before.items():
        np.testing.assert_array_equal(arrays[name], value, err_msg=f"{name} was written")


# -- the recurrent mixers: Gated DeltaNet, Kimi Delta Attention, Mamba-2 ------------------------------------
RECURRENT = {
    "gated_deltanet": lambda: GatedDeltaNet(D, num_key_heads=2, num_value_heads=4, key_head_dim=4, value_head_dim=3,
                                            conv_kernel_size=3, rng=0),
    "kimi_delta_attention": lambda: KimiDeltaAttention(D, num_heads=2, head_dim=4, rng=0),
    "mamba2_after_gate": lambda: Mamba2(D, Mamba2Config(num_heads=4, head_dim=3, state_size=4, n_groups=2,
                                                        chunk_size=2), rng=0),
    "mamba2_before_gate": lambda: Mamba2(D, Mamba2Config(num_heads=2, head_dim=3, state_size=4, norm="before_gate",
                                                         time_step_min=0.5, proj_bias=True, out_bias=True,
                                                         projection_multipliers=(0.5, 2.0, 1.5, 0.25, 3.0)), rng=0),
    "mamba2_no_norm": lambda: Mamba2(D, Mamba2Config(num_heads=2, head_dim=3, state_size=4, norm=None,
                                                     conv_bias=False), rng=0),
}


def _states(cache) -> dict:
    return {name: value for name, value in vars(cache).items() if isinstance(value, np.ndarray)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_a_recurrent_step_is_the_cached_forward_bit_for_bit(name, dtype):
    layer = _randomised(RECURRENT[name](), 1, dtype)
    x = randn(make_rng(2), 2, LENGTH, D, dtype=dtype)  # (B, L, D)
    by_forward, by_step = layer.new_cache(2), layer.new_cache(2)
    for cache in (by_forward, by_step):
        layer(x[:, :PROMPT], cache, attention_mask=MASK[:, :PROMPT])
    for t in range(PROMPT, LENGTH):
        want = layer(x[:, t:t + 1], by_forward, attention_mask=MASK[:, t:t + 1])[:, 0]  # (B, D)
        row, held = x[:, t].copy(), {k: v.copy() for k, v in _states(by_step).items()}
        before = _states(by_step)
        got = layer.step(x[:, t], cache=by_step, attention_mask=MASK[:, :t + 1])  # (B, D)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want)
        for key, value in _states(by_forward).items():
            np.testing.assert_array_equal(getattr(by_step, key), value)
        assert by_step.length == by_forward.length == t + 1
        np.testing.assert_array_equal(x[:, t], row)  # the caller's input is not written
        _assert_untouched(held, before)  # nor are the states the cache held before the step


@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_a_recurrent_step_saves_nothing(name):
    """A step between a training forward and its backward leaves what the backward reads alone."""
    layer = _randomised(RECURRENT[name](), 3, np.float64)
    x = randn(make_rng(4), 2, 4, D)
    y = layer(x)
    saved = layer.saved_tensors
    layer.step(x[:, 0], cache=layer.new_cache(2))
    assert layer.saved_tensors is saved
    layer.backward(np.ones_like(y))


# -- the mixture of experts ---------------------------------------------------------------------------------
EXPERTS = {
    "softmax_topk": dict(num_experts=6, num_experts_per_tok=2),
    "gated_shared_expert": dict(num_experts=6, num_experts_per_tok=2, shared_expert_intermediate_size=7,
                                shared_expert_gate=True),
    "sigmoid_group_topk": dict(num_experts=8, num_experts_per_tok=3, router="sigmoid_group_topk", n_group=4,
                               topk_group=2, shared_expert_intermediate_size=7, routed_scaling_factor=2.5),
    "clamped_swiglu": dict(num_experts=4, num_experts_per_tok=2, router="topk_softmax", router_bias=True,
                           expert_bias=True, swiglu_limit=1.5),
    "weighed_inputs": dict(num_experts=4, num_experts_per_tok=1, router="topk_sigmoid", norm_topk_prob=False,
                           weigh_inputs=True, shared_expert_intermediate_size=3),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(EXPERTS))
def test_the_experts_step_is_the_forward_of_one_position_bit_for_bit(name, dtype):
    part = ExpertsConfig(moe_intermediate_size=5, layers=(0,), **EXPERTS[name])
    moe = _randomised(MixtureOfExperts(D, part, "silu", rng=0), 5, dtype)
    x = randn(make_rng(6), 5, 1, D, dtype=dtype)  # five rows: several experts serve more than one
    want = moe(x)[:, 0]  # (B, D)
    saved, routed = moe.saved_tensors, moe.router.saved_tensors
    row = x[:, 0].copy()
    got = moe.step(x[:, 0])  # (B, D)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, want)
    assert moe.saved_tensors is saved and moe.router.saved_tensors is routed
    np.testing.assert_array_equal(x[:, 0], row)


def test_the_experts_step_runs_only_the_chosen_experts(monkeypatch):
    from attnkit.kernels import experts as kernel

    part = ExpertsConfig(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=5, layers=(0,))
    moe = _randomised(MixtureOfExperts(D, part, "silu", rng=0), 7, np.float64)
    ran = []
    real = kernel._gated_step
    monkeypatch.setattr(kernel, "_gated_step", lambda xe, *args: ran.append(xe.shape[0]) or real(xe, *args))
    x = randn(make_rng(8), 1, D)
    chosen, _ = moe.router.step(x)
    moe.step(x)
    assert len(ran) == 2 and sum(ran) == 2 and len(set(chosen[0].tolist())) == 2


# -- multi-head latent attention ------------------------------------------------------------------------------
LATENT = {
    "q_lora": LatentAttentionConfig(hidden_size=16, num_heads=3, q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4,
                                    qk_rope_head_dim=2, v_head_dim=3),
    "window_bias_half_split": LatentAttentionConfig(hidden_size=16, num_heads=3, kv_lora_rank=6, qk_nope_head_dim=4,
                                                    qk_rope_head_dim=4, v_head_dim=3, attention_bias=True,
                                                    rope_interleaved=False, sliding_window=3),
    "sparse_indexer": LatentAttentionConfig(hidden_size=16, num_heads=3, q_lora_rank=8, kv_lora_rank=6,
                                            qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3, index_topk=2,
                                            index_n_heads=2, index_head_dim=4),
}
# the step multiplies the H absorbed queries by the cached latent in one product where the forward's kernel takes
# one per head: the same sums, rounded differently (measured: 1e-7 relative in float32, 1e-16 in float64)
LATENT_RTOL = {np.float32: 1e-5, np.float64: 1e-12}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, rotary", [(name, True) for name in sorted(LATENT)] + [("q_lora", False)],
                         ids=lambda v: {True: "rope", False: "nope"}.get(v, v) if isinstance(v, bool) else v)
def test_the_latent_step_is_the_cached_absorbed_forward(name, rotary, dtype):
    cfg = LATENT[name]
    attn = _randomised(MultiHeadLatentAttention(cfg, rng=0), 9, dtype)
    x = randn(make_rng(10), 2, LENGTH, cfg.hidden_size, dtype=dtype)  # (B, L, D)
    positions = np.maximum(np.cumsum(MASK, axis=1) - 1, 0)  # (B, L)
    frequencies = rotary_frequencies(cfg.qk_rope_head_dim, 10000.0)[0]
    cos, sin = rotary_cos_sin(positions, frequencies, interleaved=cfg.rope_interleaved)  # (B, L, R) each

    def tables(start, stop):
        return (cos[:, start:stop], sin[:, start:stop]) if rotary else None

    by_forward, by_step = (LatentCache(1, 2, cfg.cache_dim, dtype) for _ in range(2))
    for cache in (by_forward, by_step):
        attn(x[:, :PROMPT], rotary=tables(0, PROMPT), attention_mask=MASK[:, :PROMPT], cache=cache)
    for t in range(PROMPT, LENGTH):
        want = attn(x[:, t:t + 1], rotary=tables(t, t + 1), attention_mask=MASK[:, :t + 1], cache=by_forward)[:, 0]
        row, saved = x[:, t].copy(), attn.saved_tensors
        got = attn.step(x[:, t], rotary=tables(t, t + 1), attention_mask=MASK[:, :t + 1], cache=by_step)  # (B, D)
        assert got.dtype == dtype and attn.saved_tensors is saved
        np.testing.assert_allclose(got, want, rtol=LATENT_RTOL[dtype], atol=LATENT_RTOL[dtype] * np.abs(want).max())
        np.testing.assert_array_equal(x[:, t], row)


def test_the_latent_step_needs_a_cache():
    attn = MultiHeadLatentAttention(LATENT["q_lora"], rng=0)
    with pytest.raises(ValueError, match="needs a cache"):
        attn.step(np.ones((1, 16)), rotary=None)


# -- every one of them defines its step ---------------------------------------------------------------------
@pytest.mark.parametrize("cls", [GatedDeltaNet, GatedDeltaNetMixer, KimiDeltaAttention, KimiDeltaAttentionMixer,
                                 Mamba2, Mamba2Mixer, MixtureOfExperts, Router, GatedSharedExpert, Zero,
                                 MultiHeadLatentAttention], ids=lambda cls: cls.__name__)
def test_the_class_has_a_step_of_its_own(cls):
    assert cls.step is not Module.step
