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
