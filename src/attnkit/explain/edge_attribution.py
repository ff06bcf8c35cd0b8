"""Edge attribution patching (EAP) and EAP with integrated gradients (EAP-IG): a score for every edge of the
model's computational graph, from exact gradients.

The graph is the residual stream's (Elhage et al.'s framing; Syed et al. 2023, Hanna et al. 2024 "Have faith in
faithfulness"). Its upstream nodes are what writes into the residual stream: ``input`` (everything before the
first block: the token embeddings times ``scales.embedding``, plus learned position embeddings), every attention
head ``a{i}.h{h}`` (its ``z`` through its rows of ``W_O``, after the branch's frozen post-norm and scale: what
:func:`~attnkit.explain.direct_logit_attribution` splits), a token mixer without heads as a whole ``a{i}`` (a
Gated DeltaNet, short-convolution or Mamba-2 layer) and every MLP ``m{i}`` (a mixture of experts as one node).
Its downstream nodes are what reads the residual stream: each head's input, each MLP's input and ``logits`` (the
final norm's input, read by the metric). A downstream node reads the sum of every upstream node before it, so
there is an edge from each upstream node to each later downstream node (in a parallel block the layer's MLP
does not read its attention).

A head's input is its whole input residual: its query, key and value together, one edge from each upstream
node, which works the same for every attention (latent, gated, grouped) and does not depend on how a family
computes q, k and v. Implementations that split it into ``<q>``, ``<k>`` and ``<v>`` edges (the eap-ig library,
TransformerLens's split q/k/v inputs) get three edges that sum to the edge here, with one key/value head per
query head: the gradient is linear in them. With grouped queries, head h's input gradient is the part of the layer's
input gradient that flows through head h's output ``z_h`` (its query and its use of the shared key and value), so
the heads' input gradients sum to the attention's.

The score of edge u -> v is ``(u(clean) - u(corrupted)) . g_v``, summed over the batch, the positions and the
features, where ``g_v`` is the gradient of the metric with respect to v's input alone (the gradient that flows
through v and no other reader):

- ``"eap"``: ``g_v`` at the corrupted run (attribution patching per edge);
- ``"eap-ig"``: ``g_v`` averaged along the straight path from the corrupted to the clean input embeddings
  (``blocks.0.hook_resid_pre``, Hanna et al.'s "EAP-IG inputs"), with a quadrature rule of
  :func:`~attnkit.explain.integrated_gradients.quadrature`; the upstream differences are the real runs'.

Identities, exact for both methods (the scores are linear in the gradients), checked and returned as residuals:

- incoming: for every downstream node v, the scores into v sum to ``(x_v(clean) - x_v(corrupted)) . g_v``,
  its input difference times its input gradient (so the scores into ``logits`` sum to that of the final
  residual stream);
- outgoing: for every upstream node u, the scores out of u sum to ``(u(clean) - u(corrupted)) . G_u``, G_u the
  whole gradient at u's output; for the MLPs and the input that is :func:`attribution_patching`'s estimate
  (``hook="mlp_out"``, and ``"resid_pre"`` of block 0), summed over the positions, and for the heads of a layer
  together its ``"attn_out"`` one;
- completeness: the scores out of ``input`` sum to the integrated gradients of the metric on the input
  embeddings, which equal ``metric(clean) - metric(corrupted)`` up to the quadrature's error (the completeness
  axiom); the residual returned is that error (for ``"eap"``, the first-order estimate's). It is zero, to
  rounding, where the rule integrates the metric's derivative along the path exactly: Gauss-Legendre with
  ``steps >= p / 2`` points when the metric is a polynomial of degree p along the path, ``"riemann_trapezoid"`` and
  ``"riemann_middle"`` when it is quadratic, every rule (``"riemann_left"``, ``"riemann_right"`` too) when it is
  linear, as with frozen attention patterns, no norms and linear MLPs, where EAP is exact as well.

Shapes: B prompt pairs, L tokens, D model width, N layers, H query heads, U upstream nodes, V downstream nodes,
R = H + 3 copies of the batch in one backward (the true gradient, one per head, the mixer's, the MLP's).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _progress
from .._validation import check_positive_int
from ..layers.lm_block import LMBlock, ParallelLMBlock
from .direct_logit import head_writes
from .hooks import hook_names, hooks, run_with_cache
from .integrated_gradients import QUADRATURES, quadrature
from .patching import _check, logit_difference, logit_difference_grad

__all__ = ["EdgeAttribution", "METHODS", "edge_attribution"]

METHODS = ("eap", "eap-ig")


@dataclass(frozen=True)
class EdgeAttribution:
    """Every edge's score, the graph's nodes, and how far the identities hold.

    Attributes
    ----------
    upstream : tuple of str
        The U nodes that write into the residual stream: ``input``, ``a{i}.h{h}`` (or ``a{i}`` for a mixer
        without heads), ``m{i}``, in forward order.
    downstream : tuple of str
        The V nodes that read it: ``a{i}.h{h}`` (or ``a{i}``), ``m{i}``, ``logits``.
    scores : ndarray (U, V), float64
        ``scores[u, v]`` the edge u -> v's score; 0 where there is no edge.
    mask : ndarray (U, V) of bool
        Where there is an edge (u before v).
    method : str
        ``"eap"`` or ``"eap-ig"``.
    steps : int
        Points of the quadrature (1 for ``"eap"``).
    metric_clean, metric_corrupted : float
        The metric of the clean and corrupted runs.
    node_inputs : ndarray (V,)
        Each downstream node's attribution: input difference times input gradient.
    node_outputs : ndarray (U,)
        Each upstream node's attribution: output difference times the whole gradient at its output.
    residuals : dict of str to float
        ``"incoming"``: max over v of |sum of the scores into v - node_inputs[v]|; ``"outgoing"``: max over u of
        |sum of the scores out of u - node_outputs[u]|; ``"completeness"``: sum of the scores out of ``input``
        minus ``metric_clean - metric_corrupted``.
    """

    upstream: tuple[str, ...]
    downstream: tuple[str, ...]
    scores: np.ndarray
    mask: np.ndarray
    method: str
    steps: int
    metric_clean: float
    metric_corrupted: float
    node_inputs: np.ndarray
    node_outputs: np.ndarray
    residuals: dict[str, float] = field(default_factory=dict)

    @property
    def nodes(self) -> list[str]:
        """Every node once, in forward order: ``input``, the heads and MLPs layer by layer, ``logits``."""
        return list(self.upstream) + ["logits"]

    def score(self, upstream: str, downstream: str) -> float:
        """The score of the edge ``upstream -> downstream`` (a ValueError if there is no such edge)."""
        if upstream not in self.upstream or downstream not in self.downstream:
            raise ValueError(f"no node {upstream!r} upstream or {downstream!r} downstream; see .upstream and "
                             f".downstream")
        u, v = self.upstream.index(upstream), self.downstream.index(downstream)
        if not self.mask[u, v]:
            raise ValueError(f"there is no edge {upstream} -> {downstream}: {downstream} does not read {upstream}")
        return float(self.scores[u, v])

    def top_edges(self, n: int = 10, *, absolute: bool = True) -> list[tuple[str, str, float]]:
        """The ``n`` edges with the largest scores (by magnitude, or signed with ``absolute=False``), as
        ``(upstream, downstream, score)``, largest first."""
        n = check_positive_int(n, "n")
        us, vs = np.nonzero(self.mask)
        values = self.scores[us, vs]  # (E,)
        order = np.argsort(-(np.abs(values) if absolute else values), kind="stable")[:n]
        return [(self.upstream[us[k]], self.downstream[vs[k]], float(values[k])) for k in order]

    def to_dict(self) -> dict[str, Any]:
        """A graph for JSON: ``nodes``, ``edges`` (``{"from", "to", "score"}``, every edge), the method, the
        metrics and the residuals."""
        us, vs = np.nonzero(self.mask)
        return {"method": self.method, "steps": self.steps, "nodes": self.nodes,
                "edges": [{"from": self.upstream[u], "to": self.downstream[v], "score": float(self.scores[u, v])}
                          for u, v in zip(us, vs)],
                "metric_clean": self.metric_clean, "metric_corrupted": self.metric_corrupted,
                "residuals": dict(self.residuals)}

    def to_json(self) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict())


def _check_blocks(model) -> list[bool]:
    """For each layer, whether its MLP reads its attention (a sequential block); blocks whose residual stream is
    not a plain sum (Gemma 4's layer scalars and per-layer inputs) are refused."""
    sequential = []
    for i, layer in enumerate(model.layers):
        if type(layer) not in (LMBlock, ParallelLMBlock) or getattr(model, "layer_inputs", None):
            raise ValueError(f"edge_attribution needs a residual stream that is the sum of what the layers write; "
                             f"layer {i} is a {type(layer).__name__}, which scales or adds to it otherwise")
        if hasattr(layer.attention, "head_writer"):  # attention and another mixer summed in one branch
            raise ValueError(f"edge_attribution takes a layer's attention as its heads or as one mixer node; layer "
                             f"{i}'s {type(layer.attention).__name__} writes heads and a second mixer in one branch")
        sequential.append(type(layer) is LMBlock)
    return sequential


def _metric_and_grad(metric: Callable | None, answers: np.ndarray | None, vocab: int):
    """``logits (B, 1, V) -> (value, d value / d logits (B, 1, V))``: the logit difference, or the caller's pair,
    checked."""
    if metric is None:
        return lambda logits: (logit_difference(logits, answers),
                               logit_difference_grad(answers, vocab, logits.dtype))

    def checked(logits: np.ndarray):
        out = metric(logits)
        if not isinstance(out, tuple) or len(out) != 2:
            raise ValueError(f"metric must return (value, gradient with respect to the logits), got "
                             f"{type(out).__name__}")
        value, grad = np.asarray(out[0]), np.asarray(out[1])
        if value.shape != () or value.dtype.kind not in "fiu" or grad.shape != logits.shape:
            raise ValueError(f"metric must return one real number and its gradient of the logits' shape "
                             f"{logits.shape}, got shapes {value.shape} and {grad.shape}")
        return float(value), grad.astype(logits.dtype)

    return checked


def edge_attribution(model, clean_ids: Any, corrupted_ids: Any, answer_ids: Any = None, *,
                     metric: Callable[[np.ndarray], Any] | None = None, method: str = "eap", steps: int = 16,
                     rule: str = "gausslegendre", progress: bool | None = None) -> EdgeAttribution:
    """Score every edge of the residual-stream graph by EAP or EAP-IG (see the module's description).

    Parameters
    ----------
    model : CausalLM
        Any family whose residual stream is the sum of what its layers write (sequential or parallel blocks,
        any attention, Gated DeltaNet, short-convolution and Mamba-2 mixers, dense MLPs or experts).
    clean_ids, corrupted_ids : array_like of int, (L,) or (B, L)
        Prompt pairs of the same length, as for :func:`activation_patching`.
    answer_ids : (int, int) or array_like (B, 2), optional
        ``(correct, incorrect)``: the metric is ``logit[correct] - logit[incorrect]`` after the last token,
        averaged over the pairs.
    metric : callable, optional
        Instead of ``answer_ids``: ``metric(logits) -> (value, gradient)`` of the last position's logits
        (B, 1, V), the gradient of the value with respect to them (B, 1, V).
    method : {"eap", "eap-ig"}, default "eap"
    steps : int, default 16
        Quadrature points of ``"eap-ig"`` (a forward and a backward of R * B rows each).
    rule : str, default "gausslegendre"
        The quadrature of ``"eap-ig"``: one of :data:`~attnkit.explain.integrated_gradients.QUADRATURES`.
    progress : bool or None, default None
        A line on stderr counting the runs (:mod:`attnkit._progress`): the two caches, then one forward and
        backward per point; None shows it when stderr is a terminal, True always, False never.

    Returns
    -------
    EdgeAttribution

    Notes
    -----
    All the input gradients come from one backward per point (one for ``"eap"``): the batch goes through
    R = H + 3 times, and backward hooks give each copy one node's gradient (copy 1 + h keeps only head h's
    gradient at every layer's ``hook_z``, the last two only the mixers' or the MLPs' branch); a node's input
    gradient is the difference of the gradients at its layer's ``hook_resid_pre`` and ``hook_resid_post`` in its
    copy. Float64 models give the identities to rounding.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0).astype(np.float64)
    >>> found = edge_attribution(lm, [1, 2, 3], [1, 5, 3], answer_ids=(4, 7))
    >>> found.scores.shape, found.upstream[:3], found.downstream[-1]
    ((7, 7), ('input', 'a0.h0', 'a0.h1'), 'logits')
    >>> bool(found.residuals["incoming"] < 1e-12 and found.residuals["outgoing"] < 1e-12)
    True
    """
    clean, corrupt, answers, _ = _check(model, clean_ids, corrupted_ids, answer_ids, "resid_pre", metric)
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    if rule not in QUADRATURES:
        raise ValueError(f"rule must be one of {', '.join(map(repr, QUADRATURES))}, got {rule!r}")
    steps = check_positive_int(steps, "steps", maximum=100_000)
    alphas, weights = quadrature(rule, steps) if method == "eap-ig" else (np.array([0.0]), np.array([1.0]))
    sequential = _check_blocks(model)
    score = _metric_and_grad(metric, answers, model.config.vocab_size)
    _progress.check_progress(progress)
    with _progress.progress(2 + len(alphas), f"edge attribution ({method})", unit="run",
                            enabled=progress) as line:
        return _edges(model, clean, corrupt, score, sequential, method, alphas, weights, line)


def _layer_names(model) -> tuple[list[str], list[bool]]:
    """The points read: every layer's residual stream, branch outputs and heads; and which layers have heads."""
    present = set(hook_names(model))
    names, headed = [], []
    for i in range(model.config.num_layers):
        z = f"blocks.{i}.attn.hook_z"
        headed.append(z in present)
        names += [f"blocks.{i}.{p}" for p in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out",
                                             "hook_resid_post") if f"blocks.{i}.{p}" in present]
        names += [z] if z in present else []
    return names, headed


def _writes(model, cache: dict, headed: list[bool]) -> list[np.ndarray]:
    """Every upstream node's output (B, L, D), in the order of :func:`_node_names`; a layer's output bias (the
    part of ``hook_attn_out`` that belongs to no head) is shared equally among its heads, so the heads' writes sum
    to the attention's."""
    out = [cache["blocks.0.hook_resid_pre"]]
    for i, layer in enumerate(model.layers):
        attn_out = cache[f"blocks.{i}.hook_attn_out"]  # (B, L, D)
        if headed[i]:
            per_head, _ = head_writes(layer, cache[f"blocks.{i}.attn.hook_z"])  # (B, L, H, D)
            rest = (attn_out - per_head.sum(axis=2)) / per_head.shape[2]  # (B, L, D)
            out += [per_head[:, :, h] + rest for h in range(per_head.shape[2])]
        else:
            out.append(attn_out)
        out.append(cache[f"blocks.{i}.hook_mlp_out"])
    return out


def _node_names(model, headed: list[bool]) -> tuple[list[str], list[tuple[int, int]]]:
    """Upstream names and their places ``(layer, 0 for the mixer / 1 for the MLP)``; the input is (-1, 1)."""
    names, places = ["input"], [(-1, 1)]
    for i in range(model.config.num_layers):
        mixers = [f"a{i}.h{h}" for h in range(model.config.num_heads)] if headed[i] else [f"a{i}"]
        names += mixers + [f"m{i}"]
        places += [(i, 0)] * len(mixers) + [(i, 1)]
    return names, places


def _gradients(model, ids: np.ndarray, score: Callable, headed: list[bool], path: np.ndarray | None):
    """One tiled forward and backward: the true gradients at the layers' points (copy 0) and each node's input
    gradient (B, L, D) by its copy; ``path`` (B, L, D), when given, replaces ``blocks.0.hook_resid_pre``."""
    b, n, heads = ids.shape[0], model.config.num_layers, model.config.num_heads
    copies = heads + 3  # R: true, one per head, the mixer's, the MLP's
    mixer, mlp = heads + 1, heads + 2
    kept: dict[str, np.ndarray] = {}

    def copies_of(g: np.ndarray) -> np.ndarray:
        return np.array(g).reshape((copies, b) + g.shape[1:])  # (R, B, ...), a copy

    def zeros(g: np.ndarray) -> np.ndarray:
        return np.zeros((copies, b) + g.shape[1:], g.dtype)  # (R, B, ...)

    def z_grad(g: np.ndarray, name: str) -> np.ndarray:
        out = zeros(g)  # (R, B, L, H, Dh)
        true = np.asarray(g)[:b]  # (B, L, H, Dh)
        out[0] = out[mixer] = true
        out[1 + np.arange(heads), :, :, np.arange(heads)] = true.transpose(2, 0, 1, 3)  # head h alone in copy 1 + h
        return out.reshape(g.shape)

    def attn_grad(g: np.ndarray, name: str) -> np.ndarray:
        kept[name] = np.array(g[:b])
        out = zeros(g)  # (R, B, L, D): the heads' copies get theirs at hook_z (a layer without heads: none)
        out[0] = out[mixer] = g[:b]
        return out.reshape(g.shape)

    def mlp_grad(g: np.ndarray, name: str) -> np.ndarray:
        kept[name] = np.array(g[:b])
        out = zeros(g)  # (R, B, L, D)
        out[0] = out[mlp] = g[:b]
        return out.reshape(g.shape)

    def keep(g: np.ndarray, name: str) -> None:
        kept[name] = copies_of(g)

    backward: dict[str, Callable] = {}
    for i in range(n):
        backward[f"blocks.{i}.hook_resid_pre"] = backward[f"blocks.{i}.hook_resid_post"] = keep
        backward[f"blocks.{i}.hook_attn_out"] = attn_grad
        backward[f"blocks.{i}.hook_mlp_out"] = mlp_grad
        if headed[i]:
            backward[f"blocks.{i}.attn.hook_z"] = z_grad
    forward = {} if path is None else {"blocks.0.hook_resid_pre": lambda x, name: np.tile(path, (copies, 1, 1))}
    with model.input_gradients_only(), hooks(model, forward, backward=backward):
        logits = model(np.tile(ids, (copies, 1)), logits_to_keep=1)  # (R * B, 1, V)
        _, grad_logits = score(logits[:b])
        model.backward(np.tile(grad_logits, (copies, 1, 1)))
    inputs = []  # the downstream nodes' input gradients, in order
    for i in range(n):
        branch = kept[f"blocks.{i}.hook_resid_pre"] - kept[f"blocks.{i}.hook_resid_post"]  # (R, B, L, D)
        inputs += list(branch[1:heads + 1]) if headed[i] else [branch[mixer]]
        inputs.append(branch[mlp])
    inputs.append(kept[f"blocks.{n - 1}.hook_resid_post"][0])
    outputs = [kept["blocks.0.hook_resid_pre"][0]]  # the whole gradient at each upstream node's output
    for i in range(n):
        outputs += [kept[f"blocks.{i}.hook_attn_out"]] * (heads if headed[i] else 1)
        outputs.append(kept[f"blocks.{i}.hook_mlp_out"])
    return np.stack(inputs), np.stack(outputs)  # (V, B, L, D), (U, B, L, D)


def _edges(model, clean: np.ndarray, corrupt: np.ndarray, score: Callable, sequential: list[bool], method: str,
           alphas: np.ndarray, weights: np.ndarray, line: _progress.Progress) -> EdgeAttribution:
    """:func:`edge_attribution`'s runs: the two caches, then one tiled backward per quadrature point."""
    names, headed = _layer_names(model)
    clean_logits, clean_cache = run_with_cache(model, clean, names=names, logits_to_keep=1)
    corrupt_logits, corrupt_cache = run_with_cache(model, corrupt, names=names, logits_to_keep=1)
    metric_clean, metric_corrupted = score(clean_logits)[0], score(corrupt_logits)[0]
    line.update(2)
    delta = np.stack([c - r for c, r in zip(_writes(model, clean_cache, headed),
                                            _writes(model, corrupt_cache, headed))])  # (U, B, L, D)
    start = corrupt_cache["blocks.0.hook_resid_pre"]  # (B, L, D)
    g_in = g_out = 0.0
    for alpha, weight in zip(alphas, weights):
        path = None if method == "eap" else start + alpha * delta[0]  # (B, L, D)
        inputs, outputs = _gradients(model, corrupt, score, headed, path)
        g_in, g_out = g_in + weight * inputs.astype(np.float64), g_out + weight * outputs.astype(np.float64)
        line.update()
    up, places = _node_names(model, headed)
    down = up[1:] + ["logits"]
    down_places = places[1:] + [(model.config.num_layers, 0)]
    u_layer, u_kind = np.array(places).T  # (U,)
    v_layer, v_kind = np.array(down_places).T  # (V,)
    reads_attention = np.array(sequential + [True])[np.minimum(v_layer, len(sequential))]  # (V,)
    mask = (u_layer[:, None] < v_layer[None]) | ((u_layer[:, None] == v_layer[None]) & (u_kind[:, None] == 0)
                                                 & (v_kind[None] == 1) & reads_attention[None])  # (U, V)
    flat_delta = delta.reshape(len(up), -1).astype(np.float64)  # (U, B * L * D)
    scores = flat_delta @ g_in.reshape(len(down), -1).T * mask  # (U, V)
    node_outputs = np.einsum("uk,uk->u", flat_delta, g_out.reshape(len(up), -1))  # (U,)
    # each downstream node's input difference, from the runs themselves (so the sum over the edges is checked)
    n = model.config.num_layers
    x_names = []
    for i in range(n):
        mlp_in = f"blocks.{i}.hook_resid_mid" if sequential[i] else f"blocks.{i}.hook_resid_pre"
        x_names += [f"blocks.{i}.hook_resid_pre"] * (model.config.num_heads if headed[i] else 1) + [mlp_in]
    x_names.append(f"blocks.{n - 1}.hook_resid_post")
    node_inputs = np.array([((clean_cache[x] - corrupt_cache[x]).astype(np.float64) * g).sum()
                            for x, g in zip(x_names, g_in)])  # (V,)
    residuals = {"incoming": float(np.abs(scores.sum(axis=0) - node_inputs).max()),
                 "outgoing": float(np.abs(scores.sum(axis=1) - node_outputs).max()),
                 "completeness": float(scores[0].sum() - (metric_clean - metric_corrupted))}
    return EdgeAttribution(tuple(up), tuple(down), scores, mask, method, len(alphas), metric_clean,
                           metric_corrupted, node_inputs, node_outputs, residuals)
