"""Attention flow (Abnar and Zuidema, 2020): the maximum flow from each input token to each output position
through the layered graph of the attention weights.

Rollout multiplies the layers' attention, so a token reached by many weak paths scores like one reached by a
strong one; flow treats each weight as a pipe's capacity, so a path carries no more than its narrowest
pipe. The graph has a node per layer and position (layer 0 = the input tokens); the edge from ``(l - 1, j)``
to ``(l, i)`` has capacity ``A_l[i, j]``, layer ``l``'s head-averaged attention with the residual
connection, rows renormalised (as in :func:`attention_rollout`). One maximum flow is solved per (output,
input) pair, ``L * L`` of them on ``(N + 1) * L`` nodes: affordable for tens of tokens and a few dozen
layers, not for hundreds of tokens.

Shapes: N layers, H heads, L tokens.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .rollout import _as_weights, mixed_attention

_MAX_TOKENS = 128  # beyond this the L * L flows take minutes: refuse rather than hang


def _max_flow(capacity: np.ndarray, source: int, sink: int, tol: float) -> float:
    """Edmonds-Karp on a dense (V, V) capacity matrix: shortest augmenting paths found by a breadth-first
    search that expands a whole frontier at once."""
    residual = capacity.copy()  # (V, V); the reverse edges start at zero capacity
    total = 0.0
    n = residual.shape[0]
    while True:
        parent = np.full(n, -1)
        parent[source] = source
        frontier = np.array([source])
        while frontier.size and parent[sink] < 0:
            reach = (residual[frontier] > tol) & (parent < 0)[None, :]  # (F, V)
            found = np.flatnonzero(reach.any(axis=0))
            if found.size == 0:
                break
            parent[found] = frontier[reach[:, found].argmax(axis=0)]  # the first frontier node that reaches it
            frontier = found
        if parent[sink] < 0:
            return total
        path = [sink]
        while path[-1] != source:  # the path is at most V nodes long
            path.append(int(parent[path[-1]]))
        heads, tails = np.array(path[1:]), np.array(path[:-1])  # edges heads[k] -> tails[k]
        bottleneck = residual[heads, tails].min()
        residual[heads, tails] -= bottleneck
        residual[tails, heads] += bottleneck
        total += float(bottleneck)


def attention_flow(weights: Any, residual: bool = True) -> np.ndarray:
    """Attention flow: the maximum flow from each input token to each output position.

    Parameters
    ----------
    weights : array_like (N, H, L, L), or a list of N arrays (H, L, L) or (1, H, L, L)
        Attention weights of one sequence, layer by layer, rows = queries (as for :func:`attention_rollout`).
        At most 128 tokens: the cost is ``L * L`` maximum flows.
    residual : bool, default True
        Add the identity for the residual connection (``0.5 * A + 0.5 * I``).

    Returns
    -------
    ndarray (L, L), float64
        ``F[i, j]``: the maximum flow from input token ``j`` to position ``i`` of the last layer, in [0, 1]
        (position ``i`` takes in at most its row's total, 1). With one layer ``F`` is that layer's mixed
        attention; with two, ``F[i, j] = sum_k min(A_2[i, k], A_1[k, j])`` (the paths through the middle
        positions are disjoint). 6 layers x 24 tokens take about 10 s.

    Examples
    --------
    >>> w = np.tril(np.ones((3, 3)))
    >>> w = np.broadcast_to(w / w.sum(-1, keepdims=True), (2, 1, 3, 3))  # 2 layers, 1 head, uniform causal
    >>> f = attention_flow(w)
    >>> f.shape, float(f[0, 0]), float(f[0, 2])
    ((3, 3), 1.0, 0.0)
    """
    arr = _as_weights(weights)
    layers, length = arr.shape[0], arr.shape[-1]
    if length > _MAX_TOKENS:
        raise ValueError(f"attention_flow solves L * L maximum flows; {length} tokens are too many (at most "
                         f"{_MAX_TOKENS}): use attention_rollout, or fewer tokens")
    mixed = mixed_attention(arr.astype(np.float64), residual)  # (N, L, L)
    nodes = (layers + 1) * length
    capacity = np.zeros((nodes, nodes))  # (V, V); node (l, i) is l * L + i
    for layer in range(layers):  # edges from layer l to l + 1: capacity[(l, j), (l + 1, i)] = A[i, j]
        block = slice(layer * length, (layer + 1) * length), slice((layer + 1) * length, (layer + 2) * length)
        capacity[block] = mixed[layer].T  # (L, L)
    tol = 1e-12 * max(1.0, float(capacity.max()))
    flow = np.zeros((length, length))  # (L, L)
    top = layers * length
    for i in range(length):  # one flow problem per pair: the solver's loop, not a vectorisable sum
        for j in range(length):
            flow[i, j] = _max_flow(capacity, j, top + i, tol)
    return flow
