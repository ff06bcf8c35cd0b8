"""The one ALiBi and the one T5 bias (:class:`attnkit.flex.ALiBi`, :class:`attnkit.flex.RelativePositionBias`):
values by formula at any query offset, exact parameter gradients on every kernel (float64 central finite
differences, the tests' FD tolerance), arrays shared with their owner, bad arguments named. Also the other
entries of the front door the heads use: :func:`attnkit.flex.boolean_mask`, dropout, and the one kernel rule.
"""
from __future__ import annotations

import numpy as np
import pytest

import attnkit.flex as F
from attnkit.kernels import attention_backward, attention_forward
from attnkit.kernels.registry import resolve_kernel

from head_cases import modifier_values, t5_bucket_reference
from helpers import assert_gradient, make_rng, randn

B, H, D = 2, 3, 4


def _loss_and_grads(mod, q, k, v, g, kernel, block_mask=None):
    """``sum(out * g)`` through flex attention, and the modifier's parameter gradients from its backward."""
    mod.zero_grad()
    out, ctx = F.flex_attention(q, k, v, mod, block_mask, kernel=kernel)
    F.flex_attention_backward(g, ctx)
    return float((out * g).sum()), {name: grad.copy() for name, grad in mod.grads.items()}


@pytest.mark.parametrize("kernel", ["tiled", "reference"])
@pytest.mark.parametrize("lq, lk", [(5, 5), (3, 8)])
@pytest.mark.parametrize("which", ["alibi", "alibi bidirectional", "t5", "t5 causal"])
def test_positional_modifier_gradients_equal_finite_differences(kernel, lq, lk, which):
    rng = make_rng(len(which), lq, lk)
    q, k, v, g = randn(rng, B, H, lq, D), randn(rng, B, H, lk, D), randn(rng, B, H, lk, D), randn(rng, B, H, lq, D)
    offset = lk - lq
    if which.startswith("alibi"):
        mod = F.ALiBi(rng.uniform(0.1, 1.0, H), bidirectional="bidirectional" in which, offset=offset)
    else:
        mod = F.RelativePositionBias(rng.normal(size=(8, H)), max_distance=6, bidirectional=which == "t5",
                                     offset=offset)
    block_mask = None
    if which in ("alibi", "t5 causal"):  # the one-sided forms are meant with the causal mask
        block_mask = F.create_block_mask(F.causal_lower_right(lq, lk), None, None, lq, lk, block_size=2)
    _, grads = _loss_and_grads(mod, q, k, v, g, kernel, block_mask)
    (name, param), = mod.params.items()
    assert_gradient(lambda: _loss_and_grads(mod, q, k, v, g, kernel, block_mask)[0], param, grads[name], name)


@pytest.mark.parametrize("offset", [0, 3, -2])
def test_alibi_and_t5_values_by_formula_at_any_offset(offset):
    i = np.arange(4)[:, None] + offset  # (Lq, 1) the queries' key positions
    j = np.arange(6)[None, :]  # (1, Lk)
    slopes = np.array([0.5, 0.25])
    np.testing.assert_array_equal(modifier_values(F.ALiBi(slopes, offset=offset), 2, 4, 6),
                                  slopes[:, None, None] * (j - i))
    np.testing.assert_array_equal(modifier_values(F.ALiBi(slopes, bidirectional=True, offset=offset), 2, 4, 6),
                                  -slopes[:, None, None] * np.abs(j - i))
    table = make_rng(4).normal(size=(8, 2))  # (NB, H)
    expected = table[t5_bucket_reference(j - i, False, 8, 10)].transpose(2, 0, 1)  # (H, Lq, Lk)
    np.testing.assert_array_equal(
        modifier_values(F.RelativePositionBias(table, 10, bidirectional=False, offset=offset), 2, 4, 6), expected)


def test_a_modifier_adds_into_the_gradient_array_it_was_given():
    slopes, grad = np.array([0.5, 0.25, 0.125]), np.full(3, 10.0)
    mod = F.ALiBi(slopes, grad=grad)
    assert mod.params["slopes"] is slopes and mod.grads["slopes"] is grad
    rng = make_rng(5)
    q, g = randn(rng, 1, H, 4, D), randn(rng, 1, H, 4, D)
    _, ctx = F.flex_attention(q, q, q, mod)
    F.flex_attention_backward(g, ctx)
    fresh = F.ALiBi(slopes)
    _, ctx = F.flex_attention(q, q, q, fresh)
    F.flex_attention_backward(g, ctx)
    np.testing.assert_allclose(grad, 10.0 + fresh.grads["slopes"], rtol=1e-14)  # accumulated, not replaced


@pytest.mark.parametrize("make, error, match", [
    (lambda: F.ALiBi(np.ones((2, 2))), ValueError, r"alibi: slopes must be one float per head, shape \(H,\), got "
                                                   r"shape \(2, 2\)"),
    (lambda: F.ALiBi([0.5, 0.25]), ValueError, "got list"),
    (lambda: F.ALiBi(np.ones(2), grad=np.zeros(3)), ValueError, r"grad for 'slopes' has shape \(3,\), expected "
                                                                r"the parameter's \(2,\)"),
    (lambda: F.ALiBi(np.ones(2), offset=True), TypeError, "offset must be an int, got bool"),
    (lambda: F.RelativePositionBias(np.ones(8)), ValueError, r"table must be floats of shape \(num_buckets, "
                                                             r"num_heads\), got shape \(8,\)"),
    (lambda: F.RelativePositionBias(np.ones((8, 2)), max_distance=0), ValueError, "max_distance"),
])
def test_bad_modifier_arguments_are_named(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("kernel", ["tiled", "reference"])
@pytest.mark.parametrize("shape", [(1, 1, 6, 9), (B, 1, 1, 9), (B, H, 6, 9), (1, H, 6, 1)])
def test_a_boolean_mask_is_the_kernels_mask_argument_and_equals_its_function(kernel, shape):
    rng = make_rng(6, *shape)
    q, k, v, g = randn(rng, B, H, 6, D), randn(rng, B, H, 9, D), randn(rng, B, H, 9, D), randn(rng, B, H, 6, D)
    mask = rng.random(shape) < 0.7
    mask[..., :1] = True  # every row sees a key
    described = F.boolean_mask(mask)
    assert described.kernel_mask.dense is mask
    hidden = F.create_block_mask(lambda b, h, qi, ki: described(b, h, qi, ki), B, H, 6, 9, block_size=4)
    bm = F.create_block_mask(described, shape[0] if shape[0] > 1 else None, shape[1] if shape[1] > 1 else None,
                             6, 9, block_size=4)
    out, ctx = F.flex_attention(q, k, v, None, bm, kernel=kernel)
    want, want_ctx = F.flex_attention(q, k, v, None, hidden, kernel="reference")
    assert ctx.kernel == kernel and want_ctx.kernel == "flex-reference"
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    for a, b in zip(F.flex_attention_backward(g, ctx), F.flex_attention_backward(g, want_ctx)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"a boolean mask of shape \(3, 1, 6, 9\) does not fit"):
        F.create_block_mask(F.boolean_mask(np.ones((3, 1, 6, 9), bool)), B, None, 6, 9)
    with pytest.raises(ValueError, match="boolean_mask: mask must be a 4-D boolean array"):
        F.boolean_mask(np.ones((6, 9)))


@pytest.mark.parametrize("kernel", ["tiled", "reference"])
def test_flex_dropout_drops_what_the_kernels_drop_and_is_refused_on_the_flex_reference_kernel(kernel):
    rng = make_rng(7)
    q, k, v, g = randn(rng, B, H, 6, D), randn(rng, B, H, 9, D), randn(rng, B, H, 9, D), randn(rng, B, H, 6, D)
    causal = F.create_block_mask(F.causal_lower_right(6, 9), None, None, 6, 9)
    out, ctx = F.flex_attention(q, k, v, None, causal, kernel=kernel, dropout_p=0.25, dropout_seed=11)
    want, _, want_ctx = attention_forward(q, k, v, causal=True, dropout_p=0.25, dropout_seed=11,
                                          need_weights=False, kernel=kernel)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    for a, b in zip(F.flex_attention_backward(g, ctx), attention_backward(g, want_ctx)[:3]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    hidden = F.create_block_mask(lambda b, h, qi, ki: ki <= qi + 3, None, None, 6, 9)
    with pytest.raises(ValueError, match="dropout_p needs the reference or tiled attention kernel"):
        F.flex_attention(q, k, v, None, hidden, kernel="reference", dropout_p=0.25, dropout_seed=11)


def test_the_one_kernel_rule():
    rule = {(w, lq): resolve_kernel("auto", need_weights=w, seq_q=lq).name for w in (True, False) for lq in (1, 7)}
    assert rule == {(True, 1): "reference", (True, 7): "reference", (False, 1): "reference", (False, 7): "tiled"}
    q = randn(make_rng(8), 1, H, 7, D)
    assert F.flex_attention(q, q, q)[1].kernel == "tiled"
    assert F.flex_attention(q, q, q, need_weights=True)[1].weights.shape == (1, H, 7, 7)
    assert F.flex_attention(q[:, :, :1], q, q)[1].kernel == "reference"
    assert attention_forward(q[:, :, :1], q, q, need_weights=False)[1] is None  # the weights stay unreturned
    with pytest.raises(ValueError, match="kernel 'tiled' does not form the attention weights"):
        F.flex_attention(q, q, q, need_weights=True, kernel="tiled")
