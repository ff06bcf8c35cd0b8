"""The tiled kernel against the reference kernel: forward, backward, masks, biases, dropout, memory.

float64 results must agree with the reference within 1e-10; float32 results must be within twice the
reference's own float32 error, both measured against a float64 computation on the same (rounded) inputs.
Block sizes are small so that every case runs through many tiles, partial edge tiles included.
"""
from __future__ import annotations

import functools
import tracemalloc

import numpy as np
import pytest

from attnkit.kernels.reference import attention_backward, attention_forward, causal_mask
from attnkit.kernels.tiled import default_blocks, flash_attention_backward, flash_attention_forward
from attnkit.kernels.tiled.plan import _PlanRequest, _tile_plan

from kernel_cases import RelativeTable, run_attention

LENGTH_PAIRS = [(1, 1), (7, 7), (63, 64), (64, 64), (65, 63), (1, 65), (65, 7), (7, 1000), (1000, 65),
                (1000, 1000)]


def _blocks(seq_q, seq_k):
    """Small tiles (many of them, with ragged edges) for short sequences, moderate ones for 1000."""
    return (16, 24) if max(seq_q, seq_k) < 200 else (96, 160)


def _ref(q, k, v, grad, **kw):
    return run_attention(attention_forward, attention_backward, q, k, v, grad, **kw)


def _tiled(q, k, v, grad, block_q=None, block_k=None, num_threads=2, **kw):
    fwd = functools.partial(flash_attention_forward, block_q=block_q, block_k=block_k, num_threads=num_threads)
    return run_attention(fwd, flash_attention_backward, q, k, v, grad, **kw)


def _cast_bias(bias, dtype):
    if isinstance(bias, RelativeTable):
        return RelativeTable(bias.table.astype(dtype))
    return None if bias is None else bias.astype(dtype)


def _compare(q, k, v, grad, dtype, block_q, block_k, factor=2.0, **kw):
    """Assert the tiled kernel matches the reference under the dtype's tolerance rule.

    float32: the tiled error at most ``factor`` times the reference's (both against float64).
    """
    args = [x.astype(dtype) for x in (q, k, v, grad)]
    bias = _cast_bias(kw.pop("bias", None), dtype)
    tiled = _tiled(*args, block_q=block_q, block_k=block_k, bias=bias, **kw)
    for name, val in tiled.items():
        assert val.dtype == dtype, (name, val.dtype)
    if dtype == np.float64:
        ref = _ref(*args, bias=bias, **kw)
        assert ref.keys() == tiled.keys()
        for name in ref:
            np.testing.assert_allclose(tiled[name], ref[name], rtol=0, atol=1e-10, err_msg=name)
        return
    # float32: the reference's own error against float64 on the same rounded inputs bounds ours
    ref32 = _ref(*args, bias=bias, **kw)
    exact = _ref(*[x.astype(np.float64) for x in args], bias=_cast_bias(bias, np.float64), **kw)
    for name in exact:
        scale = max(1.0, float(np.abs(exact[name]).max()))
        ref_err = float(np.abs(ref32[name] - exact[name]).max())
        tiled_err = float(np.abs(tiled[name] - exact[name]).max())
        assert np.isfinite(tiled[name]).all(), name
        assert tiled_err <= factor * ref_err + 8 * np.finfo(np.float32).eps * scale, (name, tiled_err, ref_err)


def _inputs(rng, lead, seq_q, seq_k, d=16, dv=12):
    q = rng.standard_normal(lead + (seq_q, d))
    k = rng.standard_normal(lead + (seq_k, d))
    v = rng.standard_normal(lead + (seq_k, dv))
    grad = rng.standard_normal(lead + (seq_q, dv))
    return q, k, v, grad


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", LENGTH_PAIRS)
def test_matches_reference_on_length_grid(seq_q, seq_k, causal, dtype):
    rng = np.random.default_rng(seq_q * 1009 + seq_k)
    lead = (2, 3) if max(seq_q, seq_k) < 200 else (1, 2)
    q, k, v, grad = _inputs(rng, lead, seq_q, seq_k)
    _compare(q, k, v, grad, dtype, *_blocks(seq_q, seq_k), causal=causal)


def _padding_mask(rng, batch, seq_k):
    """(B, 1, 1, Lk) with random padding; the last batch element is padded entirely."""
    mask = rng.random((batch, 1, 1, seq_k)) < 0.7
    mask[..., 0] = True
    mask[-1] = False
    return mask


MASK_KINDS = ["padding", "full", "rows", "query_col", "two_d"]


def _mask(kind, rng, lead, seq_q, seq_k):
    if kind == "padding":
        return _padding_mask(rng, lead[0], seq_k)
    if kind == "full":  # (B, H, Lq, Lk), a few fully masked rows
        mask = rng.random(lead + (seq_q, seq_k)) < 0.5
        mask[..., ::5, :] = False
        return mask
    if kind == "rows":  # (B, 1, Lq, 1): whole query rows masked
        return rng.random((lead[0], 1, seq_q, 1)) < 0.6
    if kind == "query_col":  # (1, H, 1, Lk): per-head key masks, some keys dead for every query
        return rng.random((1, lead[1], 1, seq_k)) < 0.5
    return rng.random((seq_q, seq_k)) < 0.3  # (Lq, Lk) shared by all


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("seq_q,seq_k", [(65, 63), (7, 64), (130, 200)])
def test_masks(kind, causal, dtype, seq_q, seq_k):
    rng = np.random.default_rng(7)
    lead = (3, 2)
    q, k, v, grad = _inputs(rng, lead, seq_q, seq_k)
    mask = _mask(kind, rng, lead, seq_q, seq_k)
    _compare(q, k, v, grad, dtype, 16, 24, mask=mask, causal=causal)


def test_fully_masked_rows_are_zero_with_zero_grads():
    rng = np.random.default_rng(3)
    q, k, v, grad = _inputs(rng, (2, 2), 40, 50)
    mask = rng.random((2, 2, 40, 50)) < 0.5
    mask[:, :, 3] = False
    mask[1] = False  # a whole batch element masked
    out, lse, ctx = flash_attention_forward(q, k, v, mask=mask, block_q=16, block_k=16)
    dq, dk, dv, _ = flash_attention_backward(grad, ctx)
    assert np.all(out[:, :, 3] == 0) and np.all(out[1] == 0)
    assert np.all(np.isposinf(lse[:, :, 3])) and np.all(np.isposinf(lse[1]))
    assert np.all(dq[:, :, 3] == 0) and np.all(dq[1] == 0) and np.all(dk[1] == 0) and np.all(dv[1] == 0)
    # causal with more queries than keys: the first Lq - Lk queries see nothing
    out, lse, ctx = flash_attention_forward(q, k[..., :30, :], v[..., :30, :], causal=True, block_q=8)
    assert np.all(out[..., :10, :] == 0) and np.all(np.isposinf(lse[..., :10]))
    assert np.all(flash_attention_backward(grad, ctx)[0][..., :10, :] == 0)


def test_lse_is_the_log_sum_exp_of_the_scores():
    rng = np.random.default_rng(4)
    q, k, v, _ = _inputs(rng, (2,), 33, 47)
    bias = rng.standard_normal((33, 47))
    for scale in (None, 3.0):  # 3.0: large logits, the lazy shift has to move
        _, lse, _ = flash_attention_forward(q, k, v, causal=True, scale=scale, bias=bias, block_q=8, block_k=8)
        _, lse_nb, _ = flash_attention_forward(q, k, v, causal=True, scale=scale, block_q=8, block_k=8)
        s = q @ k.swapaxes(-1, -2) * (scale or 0.25)  # (2, Lq, Lk)
        for logits, got in ((s + bias, lse), (s, lse_nb)):
            logits = np.where(causal_mask(33, 47), logits, -np.inf)
            top = logits.max(axis=-1, keepdims=True)
            want = (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))[..., 0]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias_shape", ["full", "heads", "keys"])
def test_array_bias(bias_shape, causal, dtype):
    rng = np.random.default_rng(11)
    seq_q, seq_k = 70, 90
    q, k, v, grad = _inputs(rng, (2, 3), seq_q, seq_k)
    shape = {"full": (2, 3, seq_q, seq_k), "heads": (3, seq_q, seq_k), "keys": (2, 1, 1, seq_k)}[bias_shape]
    bias = 2.0 * rng.standard_normal(shape)
    mask = _padding_mask(rng, 2, seq_k)
    _compare(q, k, v, grad, dtype, 16, 24, bias=bias, causal=causal)
    _compare(q, k, v, grad, dtype, 16, 24, bias=bias, mask=mask, causal=causal)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", [(65, 63), (40, 130)])
def test_score_mod_with_learnable_table(seq_q, seq_k, causal, dtype):
    rng = np.random.default_rng(12)
    q, k, v, grad = _inputs(rng, (2, 3), seq_q, seq_k)
    table = RelativeTable(rng.standard_normal((3, 2 * 20 + 1)))
    _compare(q, k, v, grad, dtype, 16, 24, bias=table, causal=causal)


def test_large_logits_and_biases_keep_a_proper_softmax():
    """Logits far from zero (finite -1e5 biases, scale 10) still give the reference's softmax.

    In float32 with logits of +-100 the recomputing backward is allowed 4x the reference's error, not 2x:
    ``D = rowsum(dO * O)`` inherits the forward's rounding of O, and ``dq = scale * dS @ k`` multiplies
    it by the scale, whereas the reference's softmax backward reuses its own weights consistently.
    """
    rng = np.random.default_rng(13)
    q, k, v, grad = _inputs(rng, (2,), 50, 60)
    bias = np.full((50, 60), -1e5) + rng.standard_normal((50, 60))
    _compare(q, k, v, grad, np.float64, 16, 16, bias=bias)
    _compare(q, k, v, grad, np.float64, 16, 16, scale=10.0, causal=True)
    _compare(q, k, v, grad, np.float32, 16, 16, scale=10.0, causal=True, factor=4.0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_regenerated_from_seed(causal, dtype):
    rng = np.random.default_rng(14)
    seq_q, seq_k = 65, 100
    q, k, v, grad = _inputs(rng, (2, 3), seq_q, seq_k)
    mask = _padding_mask(rng, 2, seq_k)
    table = RelativeTable(rng.standard_normal((3, 41)))
    for extra in ({}, {"mask": mask}, {"bias": table}):
        _compare(q, k, v, grad, dtype, 16, 24, causal=causal, dropout_p=0.3, dropout_seed=1234, **extra)
    # the same seed drops the same weights: out differs from the no-dropout output, reproducibly
    a = flash_attention_forward(q, k, v, dropout_p=0.3, dropout_seed=5, block_q=8)[0]
    b = flash_attention_forward(q, k, v, dropout_p=0.3, dropout_seed=5, block_q=32)[0]
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    assert not np.allclose(a, flash_attention_forward(q, k, v)[0])


def test_broadcast_leading_dims():
    rng = np.random.default_rng(15)
    q = rng.standard_normal((2, 3, 20, 8))
    k = rng.standard_normal((1, 3, 30, 8))  # shared over the batch
    v = rng.standard_normal((30, 5))  # shared over batch and heads
    grad = rng.standard_normal((2, 3, 20, 5))
    for kw in ({}, {"causal": True}, {"mask": rng.random((2, 1, 20, 30)) < 0.6}):
        ref = _ref(q, k, v, grad, **kw)
        tiled = _tiled(q, k, v, grad, block_q=8, block_k=8, **kw)
        for name in ref:
            assert tiled[name].shape == ref[name].shape
            np.testing.assert_allclose(tiled[name], ref[name], rtol=0, atol=1e-10, err_msg=name)


def test_nan_in_padded_keys_does_not_leak():
    rng = np.random.default_rng(16)
    q, k, v, grad = _inputs(rng, (2, 2), 40, 50)
    mask = np.ones((2, 1, 1, 50), bool)
    mask[0, ..., 30:] = False
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[0, :, 30:] = np.nan
    v_bad[0, :, 30:] = np.inf
    for causal in (False, True):
        clean = _tiled(q, np.where(mask[..., 0, :, None], k, 0), np.where(mask[..., 0, :, None], v, 0), grad,
                       block_q=16, block_k=16, mask=mask, causal=causal)
        dirty = _tiled(q, k_bad, v_bad, grad, block_q=16, block_k=16, mask=mask, causal=causal)
        for name in clean:
            assert np.isfinite(dirty[name]).all(), name
            np.testing.assert_allclose(dirty[name], clean[name], rtol=0, atol=1e-12, err_msg=name)


@pytest.mark.concurrency
def test_threads_agree_with_one_thread():
    rng = np.random.default_rng(17)
    q, k, v, grad = _inputs(rng, (2, 4), 300, 260, d=32, dv=32)
    mask = _padding_mask(rng, 2, 260)
    for kw in ({}, {"causal": True, "mask": mask}):
        one = _tiled(q, k, v, grad, block_q=32, block_k=64, num_threads=1, **kw)
        for threads in (2, 4):
            many = _tiled(q, k, v, grad, block_q=32, block_k=64, num_threads=threads, **kw)
            np.testing.assert_array_equal(many["out"], one["out"])  # same tiles, same order per row
            for name in one:
                np.testing.assert_allclose(many[name], one[name], rtol=1e-12, atol=1e-13, err_msg=name)


def test_inputs_untouched_and_dtypes_kept():
    rng = np.random.default_rng(18)
    q, k, v, grad = (x.astype(np.float32) for x in _inputs(rng, (2,), 30, 40))
    bias = rng.standard_normal((30, 40)).astype(np.float32)
    mask = rng.random((30, 40)) < 0.8
    copies = [x.copy() for x in (q, k, v, grad, bias, mask)]
    out, lse, ctx = flash_attention_forward(q, k, v, mask=mask, bias=bias, causal=True, block_q=8, block_k=8)
    grads = flash_attention_backward(grad, ctx)
    for before, after in zip(copies, (q, k, v, grad, bias, mask)):
        np.testing.assert_array_equal(before, after)
    assert out.dtype == lse.dtype == np.float32
    assert all(g.dtype == np.float32 for g in grads)


def test_bad_arguments_are_reported():
    q = np.zeros((2, 5, 8))
    with pytest.raises(ValueError, match="query has 8 features but key has 4"):
        flash_attention_forward(q, np.zeros((2, 6, 4)), np.zeros((2, 6, 3)))
    with pytest.raises(ValueError, match="key has length 6 but value has length 7"):
        flash_attention_forward(q, np.zeros((2, 6, 8)), np.zeros((2, 7, 3)))
    with pytest.raises(ValueError, match="dropout_seed is required"):
        flash_attention_forward(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="block_q must be positive, got 0"):
        flash_attention_forward(q, q, q, block_q=0)
    with pytest.raises(TypeError, match="mask must be boolean"):
        flash_attention_forward(q, q, q, mask=np.ones((5, 5)))
    _, _, ctx = flash_attention_forward(q, q, q)
    with pytest.raises(ValueError, match="grad_out of shape"):
        flash_attention_backward(np.zeros((3, 5, 8)), ctx)


def test_default_blocks_give_every_thread_work():
    l2 = 512 << 10  # the cache the tiles are chosen from (tests/kernels/test_tile_sizes.py varies it)
    assert default_blocks(8, 4096, 4096, 2, l2=l2) == (256, 256)
    assert default_blocks(8, 512, 512, 2, "q", l2=l2) == (128, 256)  # forward: tasks are query blocks
    assert default_blocks(8, 512, 512, 2, "k", l2=l2) == (256, 128)  # backward: tasks are key blocks
    assert default_blocks(1, 5, 3) == (5, 3)


def test_a_causal_forward_takes_key_tiles_no_longer_than_its_query_tiles():
    def plan(causal, seq_q=1024, seq_k=1024, fixed=(None, None)):
        return _tile_plan(_PlanRequest(lead=(1, 8), splittable=(False, True), seq_q=seq_q, seq_k=seq_k, head_dim=64,
                                       value_dim=64, itemsize=4, num_threads=2, fixed=fixed, l2=1 << 20,
                                       causal=causal))
    assert (plan(False).block_q, plan(False).block_k) == (256, 512)
    assert (plan(True).block_q, plan(True).block_k) == (256, 256)  # the diagonal tile: half masked, not 3/4
    assert plan(True, seq_q=1).block_k == 512  # one query block (a decoding step): nothing straddles
    assert plan(True, fixed=(128, 512)).block_k == 512  # the caller's tiles are kept


def _peak_bytes(seq, **kw):
    rng = np.random.default_rng(19)
    q, k, v, grad = (x.astype(np.float32) for x in _inputs(rng, (1, 2), seq, seq, d=32, dv=32))
    tracemalloc.start()
    try:
        out, lse, ctx = flash_attention_forward(q, k, v, block_q=128, block_k=256, **kw)
        flash_attention_backward(grad, ctx)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_peak_memory_grows_linearly():
    pad_small = np.ones((1, 1, 1, 1024), bool)
    pad_small[..., -100:] = False
    pad_big = np.ones((1, 1, 1, 4096), bool)
    pad_big[..., -400:] = False
    small = _peak_bytes(1024, causal=True, mask=pad_small)
    big = _peak_bytes(4096, causal=True, mask=pad_big)
    assert big / small < 6, (small, big)  # linear: 4x the length, ~4x the memory (quadratic: 16x)
    assert big < 2 * 4096 * 4096, big  # less than half of one head's Lq x Lk float32 scores
