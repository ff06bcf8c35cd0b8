"""Which kernel runs a flex description, and that every kernel gives the same answer for it.

``tiled`` runs every description; a described mask (causal at the bottom-right corner, window, padding)
becomes its arguments, any other block mask is read tile by tile. ``reference`` runs a described mask (with
any score modifier) on the reference attention kernel, anything else on the flex reference kernel. Wrapping a
built-in mask in a plain function hides its description, which sends the same mask down the other path.
"""
import numpy as np
import pytest

import attnkit
import attnkit.flex as F
from attnkit.attention import LearnedBiasAttention
from attnkit.attention.physics_guided import PhysicsPriorBias


def _qkv(B=2, Hq=6, Hkv=3, Lq=19, Lk=19, D=4, Dv=5, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(B, Hq, Lq, D)), rng.normal(size=(B, Hkv, Lk, D)), rng.normal(size=(B, Hkv, Lk, Dv)),
            rng.normal(size=(B, Hq, Lq, Dv)))


def _mask(name, lq, lk, key_mask):
    if name == "causal":
        return F.causal_lower_right(lq, lk)
    if name == "window":
        return F.sliding_window_mask(4, offset=lk - lq)
    if name == "padded causal":
        return F.and_masks(F.causal_lower_right(lq, lk), F.padding_mask(key_mask))
    return F.and_masks(F.padding_mask(key_mask), F.sliding_window_mask(6, offset=lk - lq))


def _hidden(mask):
    """The same mask as a plain function: no KernelMask."""
    return lambda b, h, q_idx, kv_idx: mask(b, h, q_idx, kv_idx)


def _run(q, k, v, g, score_mod, bm, kernel, sinks=None, return_lse=False):
    out, *lse, ctx = F.flex_attention(q, k, v, score_mod, bm, enable_gqa=True, kernel=kernel, sinks=sinks,
                                      return_lse=return_lse)
    return ctx.kernel, (out, *lse, *F.flex_attention_backward(g, ctx))


@pytest.mark.parametrize("mask_name", ["causal", "window", "padded causal", "padded window"])
@pytest.mark.parametrize("lq, lk", [(19, 19), (7, 23), (1, 30)])
@pytest.mark.parametrize("with_softcap", [False, True])
def test_a_mask_gives_the_same_answer_described_or_not_on_every_kernel(mask_name, lq, lk, with_softcap):
    q, k, v, g = _qkv(Lq=lq, Lk=lk, seed=lq + lk)
    key_mask = np.arange(2 * lk).reshape(2, lk) % 7 != 3
    mask = _mask(mask_name, lq, lk, key_mask)
    mod = F.softcap(1.5) if with_softcap else None
    described = F.create_block_mask(mask, 2, None, lq, lk, block_size=(4, 8))
    hidden = F.create_block_mask(_hidden(mask), 2, None, lq, lk, block_size=(4, 8))
    runs = {}
    for name, bm in (("described", described), ("hidden", hidden)):
        for kernel in ("tiled", "reference"):
            runs[name, kernel] = _run(q, k, v, g, mod, bm, kernel)
    assert runs["described", "tiled"][0] == runs["hidden", "tiled"][0] == "tiled"
    assert runs["hidden", "reference"][0] == "flex-reference"
    assert runs["described", "reference"][0] == "reference"
    want = runs["hidden", "reference"][1]
    for key, (_, got) in runs.items():
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11, err_msg=str(key))


def test_a_grouped_query_block_mask_with_sinks_and_a_softcap_runs_tiled_on_any_thread_count():
    q, k, v, g = _qkv(Lq=37, Lk=37, seed=3)
    bm = F.create_block_mask(F.document_mask(np.arange(37) // 10), None, None, 37, 37, block_size=8)
    sinks = np.linspace(-1, 1, 6)
    _, want = _run(q, k, v, g, F.softcap(2.0), bm, "reference", sinks, return_lse=True)
    for threads in (1, 2, 2):
        with attnkit.num_threads(threads):
            kernel, got = _run(q, k, v, g, F.softcap(2.0), bm, "tiled", sinks, return_lse=True)
        assert kernel == "tiled" and len(got) == 6  # out, lse, dq, dk, dv, dsinks
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)


def test_and_masks_with_two_causal_offsets_is_left_to_its_function():
    both = F.and_masks(F.causal_lower_right(4, 9), F.causal_mask)
    assert both.kernel_mask is None
    assert F.and_masks(F.causal_mask, F.sliding_window_mask(3)).kernel_mask == F.KernelMask(0, 3, None)


def test_described_masks_are_classified_only_when_asked_and_then_as_their_function():
    key_mask = np.arange(40).reshape(2, 20) % 6 != 1
    mask = F.and_masks(F.sliding_window_mask(5, offset=3), F.padding_mask(key_mask))
    bm = F.create_block_mask(mask, 2, None, 17, 20, block_size=(4, 3))
    assert bm._kinds is None
    dense = bm.to_dense()  # (2, 1, 17, 20)
    tiles = np.pad(dense, ((0, 0), (0, 0), (0, 3), (0, 1))).reshape(2, 1, 5, 4, 7, 3).sum(axis=(3, 5))
    sizes = np.minimum(4, 17 - 4 * np.arange(5))[:, None] * np.minimum(3, 20 - 3 * np.arange(7))[None, :]
    expected = np.where(tiles == 0, F.masks.EMPTY, np.where(tiles == sizes, F.masks.FULL, F.masks.PARTIAL))
    assert np.array_equal(bm.kinds, expected)


def _learned(mode, bidirectional):
    head = LearnedBiasAttention(num_heads=6, num_buckets=8, max_distance=12, mode=mode,
                                bidirectional=bidirectional)
    if mode == "t5":
        head.rel_bias[...] = np.random.default_rng(3).normal(size=head.rel_bias.shape)
    return head


@pytest.mark.parametrize("mode, bidirectional", [("t5", True), ("t5", False), ("alibi", True), ("alibi", False)])
@pytest.mark.parametrize("lq, lk", [(11, 11), (5, 14)])
def test_a_learned_bias_head_is_flex_attention_with_its_bias(mode, bidirectional, lq, lk):
    q, k, v, g = _qkv(Hkv=6, Lq=lq, Lk=lk, seed=5)
    head = _learned(mode, bidirectional)
    out, _ = head(q, k, v, is_causal=True, need_weights=False)
    grads = head.backward(g)
    name = "rel_bias" if mode == "t5" else "slopes"
    head_grad = head.grads[name].copy()
    causal = F.causal_lower_right(lq, lk)
    for mask in (causal, _hidden(causal)):
        bm = F.create_block_mask(mask, None, None, lq, lk, block_size=4)
        for kernel in ("tiled", "reference"):
            head.zero_grad()
            flex_out, ctx = F.flex_attention(q, k, v, head.score_mod_for(lq, lk), bm, kernel=kernel)
            np.testing.assert_allclose(flex_out, out, rtol=1e-10, atol=1e-12)
            for got, want in zip(F.flex_attention_backward(g, ctx), grads):
                np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)
            np.testing.assert_allclose(head.grads[name], head_grad, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("kernel", ["tiled", "reference"])
def test_a_physics_prior_is_a_flex_modifier_with_exact_gradients_next_to_sinks(kernel):
    q, k, v, g = _qkv(B=1, Hq=2, Hkv=2, Lq=6, Lk=9, seed=7)
    sinks = np.array([0.3, -0.2])
    strength = np.array([0.7, -0.4])

    def loss(strength, log_scale):
        grad_s, grad_l = np.zeros(2), np.zeros(1)
        bias = PhysicsPriorBias("gaussian", strength, length_scale=float(np.exp(log_scale)), offset=9 - 6,
                                grad_strength=grad_s, grad_log_length_scale=grad_l)
        bm = F.create_block_mask(F.causal_lower_right(6, 9), None, None, 6, 9, block_size=4)
        out, ctx = F.flex_attention(q, k, v, bias, bm, sinks=sinks, kernel=kernel)
        F.flex_attention_backward(g, ctx)
        return float((out * g).sum()), grad_s, grad_l

    _, grad_s, grad_l = loss(strength, np.log(1.5))
    eps = 1e-6
    for i in range(2):
        step = np.eye(2)[i] * eps
        numeric = (loss(strength + step, np.log(1.5))[0] - loss(strength - step, np.log(1.5))[0]) / (2 * eps)
        assert abs(numeric - grad_s[i]) < 1e-7 * max(1.0, abs(numeric))
    numeric = (loss(strength, np.log(1.5) + eps)[0] - loss(strength, np.log(1.5) - eps)[0]) / (2 * eps)
    assert abs(numeric - grad_l[0]) < 1e-7 * max(1.0, abs(numeric))
