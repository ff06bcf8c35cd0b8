"""attention_flow against independent computations: the mixed attention itself for one layer, the closed form
``sum_k min(A2[i, k], A1[k, j])`` for two, and scipy's maximum_flow on integer capacities for deeper stacks."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.explain import attention_flow
from attnkit.explain.rollout import mixed_attention

scipy_sparse = pytest.importorskip("scipy.sparse")
csgraph = pytest.importorskip("scipy.sparse.csgraph")


def _weights(layers, heads, length, seed=0, causal=False):
    w = np.random.default_rng(seed).random((layers, heads, length, length)) ** 3  # uneven, like real heads
    if causal:
        w = w * np.tril(np.ones((length, length)))
    return w / w.sum(-1, keepdims=True)


def _scipy_flow(mixed: np.ndarray, scale: float = 2.0**20) -> np.ndarray:
    """The same layered graph handed to scipy's maximum_flow, capacities rounded to multiples of 1/scale."""
    layers, length = mixed.shape[0], mixed.shape[-1]
    nodes = (layers + 1) * length
    capacity = np.zeros((nodes, nodes), dtype=np.int64)
    for layer in range(layers):
        capacity[layer * length:(layer + 1) * length, (layer + 1) * length:(layer + 2) * length] = \
            np.rint(mixed[layer].T * scale)
    graph = scipy_sparse.csr_matrix(capacity.astype(np.int32))
    out = np.zeros((length, length))
    for i in range(length):
        for j in range(length):
            out[i, j] = csgraph.maximum_flow(graph, j, layers * length + i).flow_value / scale
    return out


def test_one_layer_is_the_mixed_attention():
    w = _weights(1, 3, 5)
    np.testing.assert_allclose(attention_flow(w), mixed_attention(w, True)[0], atol=1e-12)
    np.testing.assert_allclose(attention_flow(w, residual=False), w.mean(1)[0], atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_two_layers_is_the_sum_of_path_minima(causal):
    w = _weights(2, 2, 7, seed=1, causal=causal)
    m = mixed_attention(w, True)
    want = np.minimum(m[1][:, :, None], m[0][None, :, :]).sum(axis=1)  # (L, L): path j -> k -> i
    np.testing.assert_allclose(attention_flow(w), want, atol=1e-12)


@pytest.mark.parametrize("layers, length, causal", [(3, 6, False), (4, 5, True), (5, 4, False)])
def test_deeper_stacks_equal_scipy_maximum_flow(layers, length, causal):
    w = _weights(layers, 2, length, seed=layers, causal=causal)
    got = attention_flow(w)
    want = _scipy_flow(mixed_attention(w, True))
    # scipy's capacities are rounded to 2**-21: a cut of at most layers * length edges moves by that much each.
    np.testing.assert_allclose(got, want, atol=layers * length * 2.0**-21 + 1e-12)
    assert got.min() >= 0 and got.max() <= 1 + 1e-12
    if causal:
        assert (np.triu(got, 1) == 0).all()  # nothing flows from a later token to an earlier position


def test_list_input_float32_and_limits():
    w = _weights(2, 2, 4).astype(np.float32)
    np.testing.assert_allclose(attention_flow(list(w[:, None])), attention_flow(w), atol=1e-12)
    with pytest.raises(ValueError, match="129 tokens are too many"):
        attention_flow(np.full((1, 1, 129, 129), 1 / 129))
    with pytest.raises(ValueError, match=r"\(layers, heads, L, L\)"):
        attention_flow(np.ones((2, 3, 3)))
