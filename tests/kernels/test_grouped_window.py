"""Grouped-query attention and sliding-window causal masks in both kernels.

Both kernels are checked against an explicit-mask computation (float64, 1e-10), grouped k/v against the
same k/v repeated per query head (gradients summed over the group), finite differences in float64, and
PyTorch's ``scaled_dot_product_attention`` (``enable_gqa=True``, an explicit window mask).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch.nn.functional as F

import torch
from attnkit import kernels
from attnkit.flex import ScoreMod
from attnkit.kernels import reference, tiled

from helpers import assert_gradient, numerical_gradient


def explicit_window_mask(seq_q, seq_k, window):
    """(Lq, Lk) written out position by position: query i at i' = i + Lk - Lq sees i' - W < j <= i'."""
    mask = np.zeros((seq_q, seq_k), bool)
    for i in range(seq_q):
        pos = i + seq_k - seq_q
        for j in range(seq_k):
            mask[i, j] = pos - window < j <= pos
    return mask


def _inputs(rng, q_lead, kv_lead, seq_q, seq_k, d=8, dv=6):
    q = rng.standard_normal(q_lead + (seq_q, d))
    k = rng.standard_normal(kv_lead + (seq_k, d))
    v = rng.standard_normal(kv_lead + (seq_k, dv))
    grad = rng.standard_normal(q_lead + (seq_q, dv))
    return q, k, v, grad


def _tiled_fwd(block_q, block_k, num_threads=2):
    return functools.partial(tiled.flash_attention_forward, block_q=block_q, block_k=block_k,
                             num_threads=num_threads)


def _run(forward, backward, q, k, v, grad, **kw):
    out, _, ctx = forward(q, k, v, **kw)
    dq, dk, dv, _ = backward(grad, ctx)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def _explicit(q, k, v, grad, mask):
    """Reference kernel with the window given as an ordinary boolean mask (no window argument)."""
    return _run(reference.attention_forward, reference.attention_backward, q, k, v, grad, mask=mask)


KERNELS = {
    "reference": lambda bq, bk: (reference.attention_forward, reference.attention_backward),
    "tiled": lambda bq, bk: (_tiled_fwd(bq, bk), tiled.flash_attention_backward),
}

# lengths around the tile boundaries of blocks (16, 24), windows from 1 to the whole sequence
WINDOW_CASES = [
    (1, 1, 1), (16, 16, 1), (16, 16, 16), (17, 17, 16), (47, 47, 24), (48, 48, 25), (49, 49, 23),
    (64, 64, 64), (64, 64, 100), (40, 72, 24), (72, 40, 9), (1, 73, 24), (33, 97, 48), (97, 97, 8),
]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("seq_q,seq_k,window", WINDOW_CASES)
def test_window_matches_explicit_mask(kernel, seq_q, seq_k, window):
    rng = np.random.default_rng(seq_q * 131 + seq_k * 7 + window)
    q, k, v, grad = _inputs(rng, (2, 3), (2, 3), seq_q, seq_k)
    fwd, bwd = KERNELS[kernel](16, 24)
    got = _run(fwd, bwd, q, k, v, grad, causal=True, window=window)
    want = _explicit(q, k, v, grad, explicit_window_mask(seq_q, seq_k, window))
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-10, err_msg=name)


def test_window_of_one_attends_only_to_itself():
    rng = np.random.default_rng(1)
    q, k, v, grad = _inputs(rng, (2,), (2,), 30, 30)
    for fwd in (reference.attention_forward, _tiled_fwd(8, 8)):
        out = fwd(q, k, v, causal=True, window=1)[0]
        np.testing.assert_allclose(out, v, rtol=0, atol=1e-12)


def test_window_as_long_as_the_keys_is_plain_causal():
    rng = np.random.default_rng(2)
    q, k, v, grad = _inputs(rng, (2, 2), (2, 2), 50, 70)
    for name, make in KERNELS.items():
        fwd, bwd = make(16, 24)
        windowed = _run(fwd, bwd, q, k, v, grad, causal=True, window=70)
        causal = _run(fwd, bwd, q, k, v, grad, causal=True)
        for key in causal:
            np.testing.assert_array_equal(windowed[key], causal[key], err_msg=(name, key))


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_window_combines_with_masks_and_bias(kernel):
    rng = np.random.default_rng(3)
    seq_q, seq_k, window = 45, 60, 20
    q, k, v, grad = _inputs(rng, (2, 3), (2, 3), seq_q, seq_k)
    mask = rng.random((2, 1, seq_q, seq_k)) < 0.7
    mask[0, :, 5] = False  # a fully masked row
    bias = rng.standard_normal((3, seq_q, seq_k))
    fwd, bwd = KERNELS[kernel](16, 24)
    out, _, ctx = fwd(q, k, v, mask=mask, bias=bias, causal=True, window=window)
    got = dict(zip(("dq", "dk", "dv", "dbias"), bwd(grad, ctx)), out=out)
    both = mask & explicit_window_mask(seq_q, seq_k, window)
    out, _, ctx = reference.attention_forward(q, k, v, mask=both, bias=bias)
    want = dict(zip(("dq", "dk", "dv", "dbias"), reference.attention_backward(grad, ctx)), out=out)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-10, err_msg=name)
    assert np.all(got["out"][0, :, 5] == 0)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("kv_lead,q_lead", [((2, 3, 1), (2, 3, 4)), ((2, 1, 1), (2, 1, 5)),
                                            ((1, 2, 1), (3, 2, 2))])
def test_grouped_equals_repeated_keys_and_values(kernel, window, kv_lead, q_lead):
    rng = np.random.default_rng(4)
    seq_q, seq_k = 37, 53
    q, k, v, grad = _inputs(rng, q_lead, kv_lead, seq_q, seq_k)
    fwd, bwd = KERNELS[kernel](16, 24)
    causal = window is not None
    grouped = _run(fwd, bwd, q, k, v, grad, causal=causal, window=window)
    k_rep = np.broadcast_to(k, q_lead + k.shape[-2:]).copy()  # (B, Hkv, G, Lk, D) materialised
    v_rep = np.broadcast_to(v, q_lead + v.shape[-2:]).copy()
    repeated = _run(fwd, bwd, q, k_rep, v_rep, grad, causal=causal, window=window)
    assert grouped["dk"].shape == k.shape and grouped["dv"].shape == v.shape
    np.testing.assert_allclose(grouped["out"], repeated["out"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(grouped["dq"], repeated["dq"], rtol=0, atol=1e-12)
    sum_axes = tuple(i for i, n in enumerate(kv_lead) if n == 1 and q_lead[i] != 1)
    for name in ("dk", "dv"):
        summed = repeated[name].sum(axis=sum_axes, keepdims=True)
        np.testing.assert_allclose(grouped[name], summed, rtol=0, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_finite_differences_grouped_window(kernel):
    rng = np.random.default_rng(6)
    q, k, v, grad = _inputs(rng, (1, 2, 3), (1, 2, 1), 11, 13, d=4, dv=3)
    mask = rng.random((1, 1, 1, 11, 13)) < 0.8
    fwd, bwd = KERNELS[kernel](4, 5)
    kw = dict(mask=mask, causal=True, window=4)
    out, _, ctx = fwd(q, k, v, **kw)
    dq, dk, dv, _ = bwd(grad, ctx)

    def loss():  # reads q, k, v, which the finite differences perturb in place
        return float((fwd(q, k, v, **kw)[0] * grad).sum())

    assert_gradient(loss, q, dq, "dq")
    assert_gradient(loss, k, dk, "dk")
    assert_gradient(loss, v, dv, "dv")
    assert np.abs(numerical_gradient(loss, k)).max() > 1e-3  # the check has teeth


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("window", [None, 5, 16])
def test_torch_parity_grouped_query_and_window(kernel, window):
    rng = np.random.default_rng(7)
    batch, h_kv, group, seq_q, seq_k, d = 2, 2, 3, 19, 29, 8
    q = rng.standard_normal((batch, h_kv * group, seq_q, d))  # torch layout (B, Hq, Lq, D)
    k = rng.standard_normal((batch, h_kv, seq_k, d))
    v = rng.standard_normal((batch, h_kv, seq_k, d))
    grad = rng.standard_normal((batch, h_kv * group, seq_q, d))
    mask = explicit_window_mask(seq_q, seq_k, window or seq_k)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    ref = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.tensor(mask), enable_gqa=True)
    ref.backward(torch.tensor(grad))

    fwd, bwd = KERNELS[kernel](8, 8)
    q5 = q.reshape(batch, h_kv, group, seq_q, d)  # query head h_kv * G + g uses key head h_kv
    out, _, ctx = fwd(q5, k[:, :, None], v[:, :, None], causal=True, window=window)
    dq, dk, dv, _ = bwd(grad.reshape(batch, h_kv, group, seq_q, d), ctx)
    np.testing.assert_allclose(out.reshape(q.shape), ref.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(dq.reshape(q.shape), tq.grad.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(dk[:, :, 0], tk.grad.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(dv[:, :, 0], tv.grad.numpy(), rtol=0, atol=1e-12)


def test_dispatcher_passes_window_and_groups_to_both_kernels():
    rng = np.random.default_rng(8)
    q, k, v, grad = _inputs(rng, (2, 2, 3), (2, 2, 1), 30, 30)
    results = []
    for need_weights in (True, False):
        out, weights, ctx = kernels.attention_forward(q, k, v, causal=True, window=6, need_weights=need_weights)
        results.append((out,) + kernels.attention_backward(grad, ctx)[:3])
        if need_weights:
            assert weights.shape == (2, 2, 3, 30, 30)
            assert (weights > 0).sum(axis=-1).max() == 6
    for a, b in zip(*results):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_window_arguments_are_checked(kernel):
    fwd, _ = KERNELS[kernel](8, 8)
    x = np.zeros((4, 8))
    with pytest.raises(ValueError, match="requires causal=True"):
        fwd(x, x, x, window=3)
    for bad, error in ((0, ValueError), (-2, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="window"):
            fwd(x, x, x, causal=True, window=bad)


def test_grouped_tiled_keeps_keys_in_their_own_shape():
    """The tiled context holds k/v at the key heads' size, not repeated once per query head."""
    rng = np.random.default_rng(9)
    q, k, v, grad = _inputs(rng, (1, 2, 8), (1, 2, 1), 40, 40)
    _, _, ctx = tiled.flash_attention_forward(q, k, v, causal=True, block_q=16, block_k=16)
    assert ctx.k_aug.shape == (1, 2, 1, 40, 8 + 2)
    assert ctx.v_aug.shape == (1, 2, 1, 40, 6 + 2)
    dq, dk, dv, _ = tiled.flash_attention_backward(grad, ctx)
    assert dk.shape == k.shape and dv.shape == v.shape


class _CountingMod(ScoreMod):
    """A score modifier that changes nothing and counts the tiles the kernel computes scores of."""

    def __init__(self):
        super().__init__()
        self.tiles = 0

    def forward(self, score, b, h, q_idx, kv_idx):
        self.tiles += 1
        return score

    def backward(self, grad, score, b, h, q_idx, kv_idx):
        return grad


@pytest.mark.parametrize("seq_q,seq_k", [(256, 256), (100, 256)])
def test_tiled_kernel_visits_only_tiles_touching_the_window(seq_q, seq_k):
    """Forward and backward each visit about L / block * (W / block + 2) tiles, not the causal triangle."""
    rng = np.random.default_rng(10)
    q, k, v, grad = _inputs(rng, (1,), (1,), seq_q, seq_k)
    counts = {}
    for window in (None, 16):
        bias = _CountingMod()
        out, _, ctx = tiled.flash_attention_forward(q, k, v, score_mod=bias, causal=True, window=window,
                                                    block_q=16, block_k=16, num_threads=1)
        tiled.flash_attention_backward(grad, ctx)
        counts[window] = bias.tiles
    q_blocks = -(-seq_q // 16)
    assert counts[16] <= 2 * q_blocks * 3  # forward + backward, at most three key tiles per query block
    band = explicit_window_mask(seq_q, seq_k, 16)
    touching = sum(band[q0:q0 + 16, k0:k0 + 16].any() for q0 in range(0, seq_q, 16) for k0 in range(0, seq_k, 16))
    assert counts[16] == 2 * touching  # exactly the tiles with at least one visible entry
    assert counts[None] > 3 * counts[16]


@pytest.mark.parametrize("window", [None, 7])
def test_dropout_with_grouped_keys_drops_the_same_weights_in_both_kernels(window):
    rng = np.random.default_rng(11)
    q, k, v, grad = _inputs(rng, (2, 2, 3), (2, 2, 1), 30, 40)
    kw = dict(causal=window is not None, window=window, dropout_p=0.2, dropout_seed=3)
    want = _run(reference.attention_forward, reference.attention_backward, q, k, v, grad, **kw)
    got = _run(_tiled_fwd(8, 16), tiled.flash_attention_backward, q, k, v, grad, **kw)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-10, err_msg=name)
    no_drop = _run(reference.attention_forward, reference.attention_backward, q, k, v, grad,
                   causal=kw["causal"], window=window)
    assert not np.allclose(no_drop["out"], want["out"])  # dropout did drop something
