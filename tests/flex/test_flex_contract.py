"""What ``flex_attention`` takes and gives, the same on the reference and the tiled kernel.

A modifier's result of the wrong shape or kind, a bias that does not fit the scores, a scale that is not a
finite number: a ValueError or TypeError naming the argument, on both kernels. Empty feature and key axes:
results of the right shape. One dtype rule for every kernel.
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
@pytest.mark.parametrize("result", [None, "1.0", True])
def test_a_score_mod_that_returns_no_numbers_is_a_type_error(kernel, result):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="score_mod must return real numbers"):
        F.flex_attention(q, k, v, lambda s, b, h, q_idx, kv_idx: result if result is not True else s > 0,
                         kernel=kernel)


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
