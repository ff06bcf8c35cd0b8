"""The tiled flex kernel against the reference one: every modifier, shapes, block sizes, bitwise repeats."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit.flex as F

MODS = [lambda: None, lambda: F.softcap(1.2), lambda: F.alibi(F.alibi_slopes(3)),
        lambda: F.relative_position_bias(3, 8, 16, seed=1),
        lambda: F.compose(F.additive_bias(np.linspace(-1, 1, 3).reshape(3, 1, 1)), F.softcap(3.0))]
MASKS = [F.causal_mask, F.sliding_window_mask(3), F.chunked_mask(5), F.prefix_lm_mask(4),
         F.document_mask(np.arange(64) // 7), F.padding_mask(np.arange(64) % 5 != 0)]


@settings(max_examples=25, deadline=None)
@given(lq=st.integers(1, 40), lk=st.integers(1, 40), bq=st.integers(1, 17), bk=st.integers(1, 17),
       mod=st.integers(0, len(MODS) - 1), mask=st.integers(0, len(MASKS) - 1), sinks=st.booleans())
def test_tiled_matches_reference(lq, lk, bq, bk, mod, mask, sinks):
    rng = np.random.default_rng(lq * 100 + lk)
    q, k, v = rng.normal(size=(2, 3, lq, 4)), rng.normal(size=(2, 3, lk, 4)), rng.normal(size=(2, 3, lk, 5))
    bm = F.create_block_mask(MASKS[mask], None, None, lq, lk, block_size=(bq, bk))
    s = rng.normal(size=3) if sinks else None
    g = rng.normal(size=(2, 3, lq, 5))
    results = []
    for kernel in ("reference", "tiled", "tiled"):
        m = MODS[mod]()
        out, lse, ctx = F.flex_attention(q, k, v, m, bm, sinks=s, return_lse=True, kernel=kernel)
        grads = F.flex_attention_backward(g, ctx)
        results.append((out, lse, *grads, *(m.grads.values() if m is not None else ())))
    for ref, tiled in zip(results[0], results[1]):
        np.testing.assert_allclose(tiled, ref, rtol=1e-9, atol=1e-11)
    for first, second in zip(results[1], results[2]):
        assert np.array_equal(first, second)  # bitwise repeatable


def test_empty_tiles_never_reach_the_mask():
    calls = []

    def mask(b, h, q_idx, kv_idx):
        calls.append((int(np.min(q_idx)), int(np.min(kv_idx))))
        return np.asarray(kv_idx) <= np.asarray(q_idx)
    bm = F.create_block_mask(mask, None, None, 32, 32, block_size=8)
    assert (bm.kinds[0, 0] == np.tril(np.ones((4, 4)), -1) * 2 + np.eye(4)).all()
    calls.clear()
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 1, 32, 4))
    F.flex_attention(q, q, q, None, bm, kernel="tiled")
    assert sorted(calls) == [(0, 0), (8, 8), (16, 16), (24, 24)]  # only the diagonal (partial) tiles


def test_float32_in_float32_out_and_inputs_untouched():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 2, 9, 4)).astype(np.float32)
    keep = q.copy()
    out, ctx = F.flex_attention(q, q, q, F.softcap(2.0), F.create_block_mask(F.causal_mask, None, None, 9, 9, 4))
    assert out.dtype == np.float32 and np.array_equal(q, keep)
    assert all(g.dtype == np.float32 for g in F.flex_attention_backward(np.ones_like(out), ctx))


@settings(max_examples=12, deadline=None)
@given(lq=st.integers(9, 60), lk=st.integers(9, 60), block=st.integers(4, 16), mod=st.integers(0, len(MODS) - 1),
       mask=st.integers(0, len(MASKS) - 1), sinks=st.booleans())
def test_one_and_two_threads_agree_and_each_repeats_its_bits(lq, lk, block, mod, mask, sinks):
    """Query bands run in parallel forward, key bands backward (each task keeps its own partial dq)."""
    import attnkit

    rng = np.random.default_rng(lq * 61 + lk)
    q, k, v = rng.normal(size=(2, 3, lq, 4)), rng.normal(size=(2, 3, lk, 4)), rng.normal(size=(2, 3, lk, 5))
    bm = F.create_block_mask(MASKS[mask], None, None, lq, lk, block_size=block)
    s = rng.normal(size=3) if sinks else None
    g = rng.normal(size=(2, 3, lq, 5))
    runs = {}
    for threads in (1, 2, 2):
        m = MODS[mod]()
        with attnkit.num_threads(threads):
            out, lse, ctx = F.flex_attention(q, k, v, m, bm, sinks=s, return_lse=True, kernel="tiled")
            grads = F.flex_attention_backward(g, ctx)
        result = (out, lse, *grads, *(m.grads.values() if m is not None else ()))
        if threads in runs:
            for first, again in zip(runs[threads], result):
                assert np.array_equal(first, again)  # same thread count: same bits
        runs[threads] = result
    for one, two in zip(runs[1], runs[2]):
        np.testing.assert_allclose(two, one, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(runs[1][0], runs[2][0])  # the forward's bands do not interact
