"""attnkit.simple: attention on plain (L, d) matrices given as nested lists or arrays (lists in, lists out).

List in -> nested list of Python floats out; array in -> array out in the inputs' float dtype. Compared with
torch's F.scaled_dot_product_attention (per head, on feature slices, for the multi-head version).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch.nn.functional as F

import torch
from attnkit.simple import multi_head_attention, scaled_dot_product_attention

from helpers import make_rng, randn


def torch_heads(q, k, v, num_heads):
    """Reference: per-head F.sdpa on feature slices, concatenated."""
    tq, tk, tv = (torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in (q, k, v))
    split = lambda t: t.reshape(t.shape[0], num_heads, -1).transpose(0, 1)  # (H, L, d/H)  # noqa: E731
    out = F.scaled_dot_product_attention(split(tq), split(tk), split(tv))  # (H, Lq, Dv/H)
    return out.transpose(0, 1).reshape(tq.shape[0], -1).numpy()


def test_sdpa_lists_in_lists_out():
    rng = make_rng(1)
    q, k, v = randn(rng, 3, 4).tolist(), randn(rng, 5, 4).tolist(), randn(rng, 5, 2).tolist()
    out = scaled_dot_product_attention(q, k, v)
    assert isinstance(out, list) and len(out) == 3
    assert all(isinstance(row, list) and len(row) == 2 and all(type(x) is float for x in row) for row in out)
    np.testing.assert_allclose(out, torch_heads(q, k, v, 1), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sdpa_arrays_in_array_out_dtype_kept(dtype):
    rng = make_rng(2)
    q, k, v = randn(rng, 3, 4, dtype=dtype), randn(rng, 5, 4, dtype=dtype), randn(rng, 5, 2, dtype=dtype)
    out = scaled_dot_product_attention(q, k, v)
    assert isinstance(out, np.ndarray) and out.dtype == dtype and out.shape == (3, 2)
    np.testing.assert_allclose(out, torch_heads(q, k, v, 1), rtol=1e-5 if dtype == np.float32 else 1e-12,
                               atol=1e-6 if dtype == np.float32 else 1e-14)


def test_integer_lists_are_computed_in_float64():
    out = scaled_dot_product_attention([[1, 0]], [[1, 0], [0, 1]], [[1], [3]])
    assert isinstance(out[0][0], float)


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_multi_head_matches_per_head_torch(num_heads):
    rng = make_rng(3)
    q, k, v = randn(rng, 6, 8), randn(rng, 7, 8), randn(rng, 7, 12)
    out = multi_head_attention(q, k, v, num_heads)
    assert out.shape == (6, 12)
    np.testing.assert_allclose(out, torch_heads(q, k, v, num_heads), rtol=1e-12, atol=1e-14)
    out_list = multi_head_attention(q.tolist(), k.tolist(), v.tolist(), num_heads)
    assert isinstance(out_list, list)
    np.testing.assert_array_equal(np.array(out_list), out)


def test_multi_head_with_one_head_is_sdpa():
    rng = make_rng(4)
    q, k, v = randn(rng, 3, 4), randn(rng, 3, 4), randn(rng, 3, 4)
    np.testing.assert_allclose(multi_head_attention(q, k, v, 1), scaled_dot_product_attention(q, k, v),
                               rtol=1e-14)


def test_multi_head_equals_hand_split_heads():
    rng = make_rng(5)
    q, k, v = randn(rng, 4, 6), randn(rng, 5, 6), randn(rng, 5, 6)
    by_hand = np.concatenate([scaled_dot_product_attention(q[:, s], k[:, s], v[:, s])
                              for s in (slice(0, 2), slice(2, 4), slice(4, 6))], axis=1)
    np.testing.assert_allclose(multi_head_attention(q, k, v, 3), by_hand, rtol=1e-14)


def test_inputs_not_modified():
    rng = make_rng(6)
    q = randn(rng, 3, 4)
    q_copy = q.copy()
    q_list = q.tolist()
    multi_head_attention(q, q, q, 2)
    scaled_dot_product_attention(q_list, q_list, q_list)
    assert np.array_equal(q, q_copy) and q_list == q_copy.tolist()


@pytest.mark.parametrize("args,exc,match", [
    (([[1.0, 2.0]], [[1.0, 2.0, 3.0]], [[1.0]]), ValueError, "features"),
    (([[1.0, 2.0]], [[1.0, 2.0]], [[1.0], [2.0]]), ValueError, "rows"),
    (([1.0, 2.0], [[1.0, 2.0]], [[1.0]]), ValueError, "query must be 2-D"),
    (([[1.0, 2.0], [3.0]], [[1.0, 2.0]], [[1.0]]), ValueError, "rectangular"),
    ((np.ones((1, 2, 2)), np.ones((2, 2)), np.ones((2, 1))), ValueError, "2-D"),
    (([["a", "b"]], [[1.0, 2.0]], [[1.0]]), TypeError, "query"),
])
def test_sdpa_bad_input(args, exc, match):
    with pytest.raises(exc, match=match):
        scaled_dot_product_attention(*args)


def test_multi_head_bad_num_heads():
    x = np.ones((3, 6))
    with pytest.raises(ValueError, match="num_heads = 4 must divide"):
        multi_head_attention(x, x, x, 4)
    with pytest.raises(ValueError, match="value"):
        multi_head_attention(x, x, np.ones((3, 5)), 2)
    with pytest.raises(TypeError, match="num_heads"):
        multi_head_attention(x, x, x, 2.0)
    with pytest.raises(ValueError, match="num_heads"):
        multi_head_attention(x, x, x, 0)
