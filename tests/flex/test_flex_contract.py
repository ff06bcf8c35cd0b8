"""What ``flex_attention`` takes and gives, the same on the reference and the tiled kernel.

A score or mask modifier's result of the wrong shape or kind, modifier parameters that do not fit the
scores, a scale that is not a finite number, sinks that are not numbers: a ValueError or TypeError naming
the argument, on both kernels. Empty key, feature, head, batch and query axes: correct results of the right
shape. One dtype rule for every kernel: the result type of q, k and v, float16 computed in float32.
"""
import numpy as np
import pytest

import attnkit.flex as F

KERNELS = ["reference", "tiled"]


def _qkv(B=1, H=2, Lq=5, Lk=7, D=4, Dv=3, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=shape).astype(dtype) for shape in ((B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv)))


def _transposed(s, b, h, q_idx, kv_idx):
    return s.swapaxes(-1, -2).copy()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mod, got", [
    (_transposed, r"\(1, 2, 7, 5\)"),
    (lambda s, b, h, q_idx, kv_idx: 1.0, r"\(\) \(a scalar\)"),
    (lambda s, b, h, q_idx, kv_idx: np.float64(2.0), r"\(\) \(a scalar\)"),
    (lambda s, b, h, q_idx, kv_idx: s[:, :, :1].copy(), r"\(1, 2, 1, 7\)"),
    (lambda s, b, h, q_idx, kv_idx: s.reshape(-1), r"\(70,\)"),
])
def test_a_score_mod_result_of_another_shape_is_refused_naming_both_shapes(kernel, mod, got):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"score_mod returned shape {got} for scores of shape \(1, 2, 5, 7\)"):
        F.flex_attention(q, k, v, mod, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("result", [lambda s: None, lambda s: "1.0", lambda s: s > 0],
                         ids=["None", "str", "booleans"])
def test_a_score_mod_that_returns_no_numbers_is_a_type_error(kernel, result):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="score_mod must return real numbers"):
        F.flex_attention(q, k, v, lambda s, b, h, q_idx, kv_idx: result(s), kernel=kernel)


class _TransposedGradient(F.ScoreMod):
    """Scores unchanged, but a backward that returns its gradient transposed."""

    def forward(self, score, b, h, q_idx, kv_idx):
        return score * 1.0

    def backward(self, grad, score, b, h, q_idx, kv_idx):
        return grad.swapaxes(-1, -2)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_score_mod_backward_of_another_shape_is_refused(kernel):
    q, k, v = _qkv()
    out, ctx = F.flex_attention(q, k, v, _TransposedGradient(), kernel=kernel)
    with pytest.raises(ValueError, match=r"score_mod.backward returned shape \(1, 2, 7, 5\) for scores of shape "
                                         r"\(1, 2, 5, 7\)"):
        F.flex_attention_backward(np.ones_like(out), ctx)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_score_mod_result_of_the_right_shape_still_works_in_any_real_dtype(kernel):
    # an integer result (every score replaced by 0) is a correct uniform average; a float32 result of
    # float64 scores is computed in float64
    q, k, v = _qkv()
    out, _ = F.flex_attention(q, k, v, lambda s, b, h, q_idx, kv_idx: np.zeros(s.shape, int), kernel=kernel)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=2, keepdims=True), out.shape), rtol=1e-12)
    out32, _ = F.flex_attention(q, k, v, lambda s, b, h, q_idx, kv_idx: s.astype(np.float32), kernel=kernel)
    assert out32.dtype == np.float64
    np.testing.assert_allclose(out32, F.flex_attention(q, k, v, kernel=kernel)[0], rtol=1e-5)


def _partial_block_mask(mask_mod, lq=5, lk=7):
    """A block mask whose every tile is partial, so that both kernels call ``mask_mod`` on their tiles."""
    return F.BlockMask(mask_mod, 1, 1, lq, lk, 4, 4, kinds=np.ones((1, 1, 2, 2), np.int8))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [np.int64, np.uint8, np.float64])
def test_a_mask_mod_that_returns_numbers_is_a_type_error(kernel, dtype):
    def counted(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 2).astype(dtype)

    q, k, v = _qkv()
    with pytest.raises(TypeError, match=rf"mask_mod must return booleans \(True = may attend\), got dtype "
                                        rf"{np.dtype(dtype)}"):
        F.create_block_mask(counted, None, None, 5, 7, block_size=4)
    with pytest.raises(TypeError, match="mask_mod must return booleans"):
        F.flex_attention(q, k, v, None, _partial_block_mask(counted), kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_mask_mod_result_that_does_not_fit_the_tile_is_refused(kernel):
    def transposed(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx).swapaxes(-1, -2)

    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"mask_mod returned shape \(1, 1, 7, 5\), which does not broadcast to "
                                         r"the mask's tile of shape \(1, 1, 5, 7\)"):
        F.create_block_mask(transposed, None, None, 5, 7, block_size=8)
    # the reference kernel asks for the whole (5, 7) mask, the tiled one for tiles of (4, 4) or less: whichever
    # non-square tile a thread reaches first is named, with its transpose
    with pytest.raises(ValueError, match=r"mask_mod returned shape \(1, 1, (\d), (\d)\), which does not broadcast "
                                         r"to the mask's tile of shape \(1, 1, \2, \1\)"):
        F.flex_attention(q, k, v, None, _partial_block_mask(transposed), kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("make, message", [
    (lambda: F.additive_bias(np.zeros((3, 5, 7))),
     r"additive_bias: the bias, of shape \(1, 3, 5, 7\) as \(B, H, Lq, Lk\), does not broadcast to the scores "
     r"of shape \(1, 2, 5, 7\)"),
    (lambda: F.additive_bias(np.zeros((5, 6))), r"additive_bias: the bias, of shape \(1, 1, 5, 6\)"),
    (lambda: F.additive_bias(np.zeros((2, 1, 1, 7))), r"additive_bias: the bias, of shape \(2, 1, 1, 7\)"),
    (lambda: F.additive_bias(np.zeros((1, 2, 9, 7))), r"additive_bias: the bias, of shape \(1, 2, 9, 7\)"),
    (lambda: F.compose(F.softcap(2.0), F.additive_bias(np.zeros(8))), r"additive_bias: the bias"),
    (lambda: F.alibi(F.alibi_slopes(3)), r"alibi: 3 slopes for scores of 2 heads"),
    (lambda: F.relative_position_bias(4), r"relative_position_bias: a table of 4 heads for scores of 2 heads"),
])
def test_a_modifier_whose_parameters_do_not_fit_the_scores_is_refused(kernel, make, message):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=message):
        F.flex_attention(q, k, v, make(), kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", [(), (7,), (5, 1), (2, 5, 7), (1, 2, 1, 7)])
def test_a_bias_that_broadcasts_is_still_added(kernel, shape):
    q, k, v = _qkv()
    bias = np.random.default_rng(1).normal(size=shape)
    got, _ = F.flex_attention(q, k, v, F.additive_bias(bias), kernel=kernel)
    want, _ = F.flex_attention(q, k, v, lambda s, b, h, q_idx, kv_idx: s + np.broadcast_to(bias, s.shape),
                               kernel=kernel)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def _run(q, k, v, g, mod=None, sinks=None, kernel="tiled", block_mask=None):
    """``(out, lse, dq, dk, dv[, dsinks])`` of one flex call."""
    out, lse, ctx = F.flex_attention(q, k, v, mod, block_mask, sinks=sinks, return_lse=True, kernel=kernel)
    return (out, lse, *F.flex_attention_backward(g, ctx))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("with_mod", [False, True])
def test_no_keys_with_sinks_puts_all_the_mass_on_the_sink(kernel, with_mod):
    q, k, v = _qkv(Lk=0)
    g = np.random.default_rng(1).normal(size=(1, 2, 5, 3))
    sinks = np.array([-0.5, 2.0])
    out, lse, dq, dk, dv, dsinks = _run(q, k, v, g, F.alibi(np.ones(2)) if with_mod else None, sinks, kernel)
    assert (out.shape, dq.shape, dk.shape, dv.shape, dsinks.shape) == ((1, 2, 5, 3), (1, 2, 5, 4), (1, 2, 0, 4),
                                                                      (1, 2, 0, 3), (2,))
    assert not out.any() and not dq.any() and not dsinks.any()
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[:, None], (1, 2, 5)))
    out, lse, *_ = _run(q, k, v, g, kernel=kernel)  # no sink: every row fully masked
    assert not out.any() and np.isneginf(lse).all()


def _uniform(v, sinks=None):
    """The output and log-sum-exp of all-zero scores: each of the Lk keys (and the sink) weighs the same."""
    lk = v.shape[2]
    total = lk + (0 if sinks is None else np.exp(sinks)[:, None])  # (H, 1) or a number
    out = v.sum(axis=2, keepdims=True) / np.reshape(total, (-1, 1, 1))  # (B, H, 1, Dv)
    return out, np.log(total)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dv_size", [3, 0])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_no_features_make_every_score_zero(kernel, dv_size, with_sinks):
    q, k, v = _qkv(D=0, Dv=dv_size)
    sinks = np.array([-0.5, 2.0]) if with_sinks else None
    g = np.random.default_rng(1).normal(size=(1, 2, 5, dv_size))
    out, lse, dq, dk, dv, *dsinks = _run(q, k, v, g, sinks=sinks, kernel=kernel)
    want_out, want_lse = _uniform(v, sinks)
    np.testing.assert_allclose(out, np.broadcast_to(want_out, (1, 2, 5, dv_size)), rtol=1e-12)
    np.testing.assert_allclose(lse, np.broadcast_to(want_lse, (1, 2, 5)), rtol=1e-12)
    assert (dq.shape, dk.shape) == ((1, 2, 5, 0), (1, 2, 7, 0))
    weight = 1.0 / (7 + (0 if sinks is None else np.exp(sinks)))  # each key's weight, per head or one
    np.testing.assert_allclose(dv, np.broadcast_to(g.sum(axis=2, keepdims=True) * np.reshape(weight, (-1, 1, 1)),
                                                   dv.shape), rtol=1e-12)
    if with_sinks and dv_size == 0:
        assert not dsinks[0].any()  # nothing to carry: the output does not depend on the sink


@pytest.mark.parametrize("kernel", KERNELS)
def test_no_features_gradients_match_finite_differences(kernel):
    from helpers import assert_gradient

    q, k, v = _qkv(D=0)
    slopes, sinks = np.array([0.3, -0.7]), np.array([-0.5, 2.0])
    mod = F.alibi(slopes)
    g = np.random.default_rng(1).normal(size=(1, 2, 5, 3))

    def loss():
        mod.params["slopes"][...] = slopes
        out, _ = F.flex_attention(q, k, v, mod, sinks=sinks, kernel=kernel)
        return (out * g).sum()

    out, ctx = F.flex_attention(q, k, v, mod, sinks=sinks, kernel=kernel)
    mod.zero_grad()
    _, _, dv, dsinks = F.flex_attention_backward(g, ctx)
    assert_gradient(loss, v, dv, "v")
    assert_gradient(loss, sinks, dsinks, "sinks")
    assert_gradient(loss, slopes, mod.grads["slopes"].copy(), "slopes")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", [(0, 2, 5, 7), (1, 0, 5, 7), (1, 2, 0, 7)])
def test_empty_batch_heads_or_queries_give_empty_results_with_sinks(kernel, shape):
    B, H, Lq, Lk = shape
    q, k, v = _qkv(B, H, Lq, Lk)
    out, lse, dq, dk, dv, dsinks = _run(q, k, v, np.zeros((B, H, Lq, 3)), sinks=np.zeros(H), kernel=kernel)
    assert (out.shape, lse.shape, dq.shape, dsinks.shape) == ((B, H, Lq, 3), (B, H, Lq), q.shape, (H,))
    assert (dk.shape, dv.shape) == (k.shape, v.shape) and not dk.any() and not dv.any()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("scale, error, message", [
    (float("nan"), ValueError, r"scale must be a finite number in \[-65504, 65504\], got nan"),
    (float("inf"), ValueError, r"scale must be a finite number in \[-65504, 65504\], got inf"),
    (-np.inf, ValueError, r"scale must be a finite number in \[-65504, 65504\], got -inf"),
    (10 ** 400, ValueError, r"scale must be a finite number in \[-65504, 65504\], got an integer of 401 digits"),
    ("0.5", TypeError, r"scale must be a number, got str '0.5'"),
    (True, TypeError, r"scale must be a number, got bool True"),
    (np.bool_(False), TypeError, r"scale must be a number, got bool"),
    (np.array([0.5]), TypeError, r"scale must be a number, got ndarray"),
    ([0.5], TypeError, r"scale must be a number, got list"),
], ids=["nan", "inf", "-inf", "10**400", "str", "bool", "numpy bool", "array", "list"])
def test_a_scale_that_is_not_a_finite_number_is_refused(kernel, scale, error, message):
    q, k, v = _qkv()
    with pytest.raises(error, match=message):
        F.flex_attention(q, k, v, kernel=kernel, scale=scale)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("scale", [1e308, -1e308, 65505.0, -1e5, np.float64(1e300)])
def test_a_finite_scale_whose_scores_overflow_is_refused(kernel, scale):
    """±1e308 is finite, yet its scores were inf and the output NaN on both kernels, silently: a scale is a
    number of magnitude at most 65504 (float16's largest)."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"scale must be a finite number in \[-65504, 65504\], got "):
        F.flex_attention(q, k, v, kernel=kernel, scale=scale)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("scale", [65504.0, -65504])
def test_a_scale_at_the_bound_still_gives_numbers(kernel, scale):
    q, k, v = _qkv()
    got, _ = F.flex_attention(q, k, v, kernel=kernel, scale=scale)
    want, _ = F.flex_attention(q * float(scale), k, v, kernel=kernel, scale=1.0)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("scale", [0, 0.0, -0.25, 2, np.float32(0.5), np.int64(3)])
def test_any_finite_scale_still_scales_the_scores(kernel, scale):
    q, k, v = _qkv()
    got, _ = F.flex_attention(q, k, v, kernel=kernel, scale=scale)
    want, _ = F.flex_attention(q * float(scale), k, v, kernel=kernel, scale=1.0)
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("sinks", [["0.5", "1"], [True, False], [None, None]])
def test_sinks_that_are_not_real_numbers_are_a_type_error(kernel, sinks):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="sinks must be real numbers, one per query head, got dtype"):
        F.flex_attention(q, k, v, sinks=np.array(sinks), kernel=kernel)


F16, F32, F64 = np.float16, np.float32, np.float64
TOL = {np.dtype(F16): 2e-2, np.dtype(F32): 1e-5, np.dtype(F64): 1e-12}


def _variant(name, lq, lk):
    """``(score_mod, block_mask, sinks)`` of a variant that takes each route of ``kernel="reference"``."""
    from attnkit.attention import LearnedBiasAttention

    hidden = F.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + lk - lq, None, None, lq, lk, 4)
    return {
        "none": (None, None, None),  # the reference attention kernel
        "causal": (None, F.create_block_mask(F.causal_lower_right(lq, lk), None, None, lq, lk, 4), None),
        "positional bias": (LearnedBiasAttention(num_heads=2, mode="alibi").score_mod_for(lq, lk), None, None),
        "mask function": (None, hidden, None),  # the flex reference kernel
        "softcap": (F.softcap(3.0), hidden, None),
        "sinks": (None, None, np.array([0.5, -1.0])),
    }[name]


def _all_results(q, k, v, g, variant, kernel):
    """Every array a forward and backward give but the weights: out, [lse,] dq, dk, dv, [dsinks]; and the
    weights (None on the tiled kernel)."""
    mod, bm, sinks = variant
    out, *lse, ctx = F.flex_attention(q, k, v, mod, bm, sinks=sinks, kernel=kernel, return_lse=sinks is not None)
    return [out, *lse, *F.flex_attention_backward(g, ctx)], ctx.weights


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["none", "causal", "positional bias", "mask function", "softcap", "sinks"])
@pytest.mark.parametrize("dtypes", [(F32, F64, F32), (F32, F64, F64), (F64, F32, F32), (F32, F32, F64),
                                    (F16, F32, F16), (F16, F16, F32), (F16, F16, F16), (F32, F32, F32)],
                         ids=lambda d: "-".join(np.dtype(t).name for t in d))
def test_every_result_has_the_result_type_of_q_k_v_on_every_kernel(kernel, name, dtypes):
    q, k, v = _qkv(Lq=6, Lk=9, seed=3)
    g = np.random.default_rng(4).normal(size=(1, 2, 6, 3))
    variant = _variant(name, 6, 9)
    q, k, v = (x.astype(t) for x, t in zip((q, k, v), dtypes))
    dtype = np.result_type(*dtypes)
    want, _ = _all_results(*(x.astype(F64) for x in (q, k, v)), g, variant, "reference")  # the same inputs
    got, weights = _all_results(q, k, v, g.astype(dtype), variant, kernel)
    assert len(got) == len(want) and (weights is None or weights.dtype == dtype)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == dtype, f"result {i} of {kernel}/{name} is {a.dtype}, expected {dtype}"
        np.testing.assert_allclose(a.astype(F64), b, rtol=0, atol=TOL[dtype] * 4 * max(1.0, np.abs(b).max()),
                                   err_msg=f"result {i}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_gradients_keep_the_result_type_whatever_grad_out_is(kernel):
    q, k, v = _qkv(dtype=F32)
    out, ctx = F.flex_attention(q, k, v, F.softcap(3.0), kernel=kernel)
    grads = F.flex_attention_backward(np.ones(out.shape, F64), ctx)
    assert [x.dtype for x in grads] == [np.dtype(F32)] * 3


def _float16_beyond_65504(seed=0):
    """float16 q (1, 2, 5, 64) and k (1, 2, 7, 64) of entries +-40 whose dot products reach 102400, beyond
    float16's 65504: key j is query j % 5 with 6 j of its signs flipped (1600 (64 - 12 j) with that query)."""
    rng = np.random.default_rng(seed)
    q = 40 * np.sign(rng.normal(size=(1, 2, 5, 64)))
    k = q[:, :, np.arange(7) % 5].copy()  # (1, 2, 7, 64)
    for j in range(7):
        k[:, :, j, :6 * j] *= -1
    return q.astype(F16), k.astype(F16), rng.normal(size=(1, 2, 7, 3)).astype(F16)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["none", "causal", "mask function", "softcap", "sinks"])
def test_float16_scores_beyond_its_range_are_computed_in_float32(kernel, name):
    # the raw products q.k reach 102400; scaled by 1e-4 the scores are within [-10, 10]
    q, k, v = _float16_beyond_65504()
    g = np.random.default_rng(1).normal(size=(1, 2, 5, 3))
    mod, bm, sinks = _variant(name, 5, 7)

    def results(q, k, v, g):
        out, ctx = F.flex_attention(q, k, v, mod, bm, sinks=sinks, kernel=kernel, scale=1e-4)
        return [out, *F.flex_attention_backward(g, ctx)]

    want = results(*(x.astype(F64) for x in (q, k, v, g)))
    got = results(q, k, v, g.astype(F16))
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == F16 and np.isfinite(a).all(), f"result {i}"
        np.testing.assert_allclose(a.astype(F64), b, rtol=0, atol=2e-2 * np.abs(b).max(), err_msg=f"result {i}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_float16_log_sum_exp_beyond_its_range_is_inf_without_a_warning(kernel):
    # key 0 equals every query: its score, 40 * 40 * 64 = 102400, is beyond float16's range
    q, k, v = _float16_beyond_65504()
    q[...] = 40
    k[:, :, 0] = 40
    out, lse, _ = F.flex_attention(q, k, v, sinks=np.zeros(2), scale=1.0, kernel=kernel, return_lse=True)
    assert lse.dtype == F16 and np.isposinf(lse).all()
    np.testing.assert_array_equal(out, np.broadcast_to(v[:, :, :1], out.shape))  # all the weight on key 0
