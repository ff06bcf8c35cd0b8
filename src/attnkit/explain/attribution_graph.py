"""Attribution graphs: the direct effects between transcoder features, error nodes, token embeddings and logits of
one prompt, as circuit-tracer builds them (Ameisen et al., "Circuit Tracing", 2025), on a CPU in any float dtype.

The local replacement model: every MLP is replaced by its transcoder (one per layer, reading the MLP's input and
writing its output, ``hook_mlp_out``) plus an error node (the true MLP output minus the transcoder's) per layer and
position; the attention patterns and every norm's scale are frozen at the prompt's values. The residual stream is
then an affine function of the node activations, and a target node's input is

    ``input_t = sum_s A[t, s] + constant_t``,

``A[t, s]`` the direct effect of source s on t: the source's vector (a feature's activation times its decoder row,
an error vector, a token's embedding) dotted with the gradient of ``input_t`` at the point it is written, through
the frozen model with the MLPs cut (a feature's effect reaches later features only through the residual stream and
the attention's values). A feature's input is its pre-activation (``constant_t`` holds its encoder bias); a logit
node's is its logit minus the mean logit over the vocabulary (circuit-tracer's demeaned unembedding). The constant
holds everything that is no node: the encoder bias, the transcoders' decoder biases, the attention's value and
output biases and the norms' shifts (learned position embeddings; and, as circuit-tracer does, what the first
position's MLPs write, which has no feature or error nodes there).

Pruning keeps the nodes that carry ``node_threshold`` of the influence on the logits (circuit-tracer's
``prune_graph``: influence through the row-normalised absolute adjacency, weighted by the logits' probabilities),
then the edges that carry ``edge_threshold``.

Nodes are ordered as circuit-tracer orders them: the active features by (layer, position, feature), the error nodes
by (layer, position), the token embeddings by position, the logits by probability.

Shapes: L tokens, N layers, D model width, S transcoder features, K active features, T target nodes
(features and logits), M nodes (``K + N L + L + n_logits``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..attention.grouped_query import GroupedQueryAttention
from ..layers.lm_block import LMBlock
from ._frozen_norm import frozen_norm
from ._inputs import as_id_batch
from .hooks import run_with_cache
from .sae import SAE

__all__ = ["AttributionGraph", "attribution_graph", "prune_graph"]

# the points a transcoder may read: the residual stream between the branches, or it through the MLP's norm
# (TransformerLens's ln2.hook_normalized, circuit-tracer's mlp.hook_in), frozen; and the points it may write
_READS_RAW = ("hook_resid_mid",)
_READS_NORMED = ("ln2.hook_normalized", "mlp.hook_in")
_WRITES = ("hook_mlp_out", "mlp.hook_out")


@dataclass
class AttributionGraph:
    """An attribution graph (see :mod:`attnkit.explain.attribution_graph`).

    Attributes
    ----------
    input_ids : ndarray (L,) int64
    active_features : ndarray (K, 3) int64
        ``(layer, position, feature)`` of each feature node.
    activation_values : ndarray (K,)
    pre_activations : ndarray (K,)
        Each feature's pre-activation: the sum of its incoming edges and its constant.
    logit_tokens : ndarray (n_logits,) int64
        The tokens of the logit nodes, most probable first.
    logit_probabilities : ndarray (n_logits,)
    logit_values : ndarray (n_logits,)
        Each logit minus the mean logit at the last position: the sum of its incoming edges and its constant.
    adjacency_matrix : ndarray (M, M)
        ``A[target, source]``: the direct effect; rows of error and token nodes are zero.
    constants : ndarray (M,)
        What reaches each target from no node (the encoder bias included); 0 for error and token nodes.
    error_vectors : ndarray (N, L, D)
        The MLP outputs the transcoders miss (0 at positions without error nodes).
    node_mask : ndarray (M,) bool
        The nodes pruning keeps (tokens and logits always).
    edge_mask : ndarray (M, M) bool
    cumulative_scores : ndarray (M,)
        Each node's share of the influence, cumulated from the most influential.
    n_layers : int
    """

    input_ids: np.ndarray
    active_features: np.ndarray
    activation_values: np.ndarray
    pre_activations: np.ndarray
    logit_tokens: np.ndarray
    logit_probabilities: np.ndarray
    logit_values: np.ndarray
    adjacency_matrix: np.ndarray
    constants: np.ndarray
    error_vectors: np.ndarray
    n_layers: int
    node_mask: np.ndarray = field(default=None, repr=False)
    edge_mask: np.ndarray = field(default=None, repr=False)
    cumulative_scores: np.ndarray = field(default=None, repr=False)

    @property
    def n_features(self) -> int:
        return len(self.active_features)

    @property
    def n_pos(self) -> int:
        return len(self.input_ids)

    @property
    def n_logits(self) -> int:
        return len(self.logit_tokens)

    def node_labels(self) -> list[str]:
        """A short name for every node, in the adjacency's order: ``"F{layer}.{pos}.{feature}"``,
        ``"E{layer}.{pos}"``, ``"T{pos}"``, ``"L{token}"``."""
        labels = [f"F{layer}.{pos}.{feat}" for layer, pos, feat in self.active_features.tolist()]
        labels += [f"E{layer}.{pos}" for layer in range(self.n_layers) for pos in range(self.n_pos)]
        labels += [f"T{pos}" for pos in range(self.n_pos)]
        return labels + [f"L{tok}" for tok in self.logit_tokens.tolist()]


class _Frozen:
    """The replacement model of one prompt: each layer's frozen norm scales and shifts, attention pattern and value
    and output weights, and its transcoder's reading; :meth:`forward` and :meth:`backward` are its affine map and
    that map's transpose (the linear part)."""

    def __init__(self, model, cache: dict, transcoders: list[SAE], normed_input: list[bool], dtype) -> None:
        n = model.config.num_layers
        self.layers = []
        for i, layer in enumerate(model.layers):
            attention = layer.attention
            p = attention._parameters
            resid_pre, resid_mid = cache[f"blocks.{i}.hook_resid_pre"], cache[f"blocks.{i}.hook_resid_mid"]
            pattern = cache[f"blocks.{i}.attn.hook_pattern"].astype(dtype)  # (Hq, L, L)
            s1, t1, c1 = frozen_norm(layer.attn_norm, resid_pre)  # (L, D), (D,)
            w_v, w_o = p["W_V"].astype(dtype), p["W_O"].astype(dtype)  # (D, Hkv*Dh), (Hq*Dh, D)
            b_v = p["b_V"].astype(dtype) if "b_V" in p else np.zeros(w_v.shape[1], dtype)
            b_o = p["b_O"].astype(dtype) if "b_O" in p else np.zeros(w_o.shape[1], dtype)
            entry = dict(s1=s1, t1=t1, c1=c1, pattern=pattern, w_v=w_v, w_o=w_o, b_v=b_v, b_o=b_o,
                         kv=attention.num_kv_heads, heads=attention.num_heads, dh=attention.head_dim)
            o = self._attention_core(entry, self._norm(resid_pre, s1, t1, c1))  # (L, D) before the post-norm
            sp, tp, cp = frozen_norm(layer.attn_post_norm, o)  # (L, D), (D,)
            factor = frozen_norm(layer.attn_scale, o)[0]  # (L, D): the branch's fixed factor
            entry.update(sp=sp * factor, tp=tp * factor, cp=cp)
            if normed_input[i]:
                entry["s2"], entry["t2"], entry["c2"] = frozen_norm(layer.mlp_norm, resid_mid)
            self.layers.append(entry)
        self.final = frozen_norm(model.norm, cache[f"blocks.{n - 1}.hook_resid_post"])
        self.normed_input = normed_input
        self.transcoders = transcoders

    @staticmethod
    def _norm(x: np.ndarray, scale: np.ndarray, shift: np.ndarray, center: bool) -> np.ndarray:
        if center:
            x = x - x.mean(axis=-1, keepdims=True)  # (..., L, D)
        return x * scale + shift

    @staticmethod
    def _norm_t(g: np.ndarray, scale: np.ndarray, center: bool) -> np.ndarray:
        """The transpose of the frozen norm's linear part: centring is a symmetric projection."""
        g = g * scale  # (..., L, D)
        return g - g.mean(axis=-1, keepdims=True) if center else g

    @staticmethod
    def _attention_core(e: dict, normed: np.ndarray) -> np.ndarray:
        """``z @ W_O + b_O`` (L, D) of the frozen pattern over the values of ``normed`` (L, D)."""
        length = normed.shape[0]
        v = (normed @ e["w_v"] + e["b_v"]).reshape(length, e["kv"], e["dh"]).transpose(1, 0, 2)  # (Hkv, L, Dh)
        v = np.repeat(v, e["heads"] // e["kv"], axis=0)  # (Hq, L, Dh): query head h*G+g reads kv head h
        z = e["pattern"] @ v  # (Hq, L, Dh)
        return z.transpose(1, 0, 2).reshape(length, -1) @ e["w_o"] + e["b_o"]  # (L, D)

    def feature_input(self, i: int, mid: np.ndarray) -> np.ndarray:
        """What layer i's transcoder reads (L, D) from the residual ``mid`` (L, D)."""
        e = self.layers[i]
        return self._norm(mid, e["s2"], e["t2"], e["c2"]) if self.normed_input[i] else mid

    def forward(self, embed: np.ndarray, mlp_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The residual between the branches of every layer (N, L, D) and the final norm's output (L, D), from what
        the embeddings (L, D) and the MLPs (N, L, D) write."""
        r = embed
        mids = []
        for i, e in enumerate(self.layers):
            o = self._attention_core(e, self._norm(r, e["s1"], e["t1"], e["c1"]))  # (L, D)
            mid = r + self._norm(o, e["sp"], e["tp"], e["cp"])  # (L, D)
            mids.append(mid)
            r = mid + mlp_out[i]  # (L, D)
        return np.stack(mids), self._norm(r, *self.final)  # (N, L, D), (L, D)

    def backward(self, g_final: np.ndarray, inject: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The gradients (T, N, L, D) at each MLP's output and (T, L, D) at the embeddings of T targets: ``g_final``
        (T, L, D) at the final norm's output, ``inject[i]`` (T, L, D) at layer i's residual between the branches.
        The MLPs are cut: nothing passes from an MLP's output to its input."""
        g = self._norm_t(g_final, self.final[0], self.final[2])  # (T, L, D)
        at_mlp = np.empty((len(self.layers),) + g.shape, g.dtype)  # (N, T, L, D)
        for i in reversed(range(len(self.layers))):
            e = self.layers[i]
            at_mlp[i] = g
            g = g + inject[i]  # (T, L, D): the residual between the branches
            g_o = self._norm_t(g, e["sp"], e["cp"])  # (T, L, D)
            t, length = g.shape[:2]
            g_z = (g_o @ e["w_o"].T).reshape(t, length, e["heads"], e["dh"]).transpose(0, 2, 1, 3)  # (T, Hq, L, Dh)
            g_v = np.einsum("hqk,thqd->thkd", e["pattern"], g_z)  # (T, Hq, L, Dh)
            g_v = g_v.reshape(t, e["kv"], e["heads"] // e["kv"], length, e["dh"]).sum(axis=2)  # (T, Hkv, L, Dh)
            g_n = g_v.transpose(0, 2, 1, 3).reshape(t, length, -1) @ e["w_v"].T  # (T, L, D)
            g = g + self._norm_t(g_n, e["s1"], e["c1"])  # (T, L, D)
        return at_mlp.transpose(1, 0, 2, 3), g  # (T, N, L, D), (T, L, D)


def _check_model(model) -> None:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "layers") or not hasattr(model, "named_hook_points"):
        raise TypeError(f"model must be a CausalLM, got {type(model).__name__}")
    for i, layer in enumerate(model.layers):
        if type(layer) is not LMBlock or type(layer.attention) is not GroupedQueryAttention:
            kind = model.layer_kind(i) if hasattr(model, "layer_kind") else type(layer).__name__
            raise ValueError(f"attribution_graph needs sequential attention blocks (pre-norm or sandwich, grouped-"
                             f"query attention without a gate): layer {i} is {kind} ({type(layer).__name__} with "
                             f"{type(layer.attention).__name__})")
    if cfg.scales.final_logit_softcap is not None:
        raise ValueError("attribution_graph: a final logit soft-cap is not linear in the residual stream "
                         f"(scales.final_logit_softcap={cfg.scales.final_logit_softcap}); the logit nodes would not "
                         "be exact")


def _check_transcoders(model, transcoders: Any) -> tuple[list[SAE], list[bool]]:
    n = model.config.num_layers
    if isinstance(transcoders, SAE) or isinstance(transcoders, (str, bytes)) or \
            not hasattr(transcoders, "__len__") or len(transcoders) != n:
        raise TypeError(f"transcoders must be a list of {n} SAE transcoders, one per layer, got "
                        f"{type(transcoders).__name__}" + (f" of {len(transcoders)}" if hasattr(transcoders, "__len__")
                                                           and not isinstance(transcoders, (str, bytes, SAE)) else ""))
    normed = []
    d = model.config.hidden_size
    for i, tc in enumerate(transcoders):
        if not isinstance(tc, SAE):
            raise TypeError(f"transcoders[{i}] must be an SAE (attnkit.explain.load_sae), got {type(tc).__name__}")
        reads = tc.hook_name.split(".", 2)[2] if tc.hook_name.startswith(f"blocks.{i}.") else None
        writes = tc.output_hook_name.split(".", 2)[2] if tc.output_hook_name.startswith(f"blocks.{i}.") else None
        if reads not in _READS_RAW + _READS_NORMED or writes not in _WRITES:
            raise ValueError(f"transcoders[{i}] must read blocks.{i}.hook_resid_mid (or ln2.hook_normalized / "
                             f"mlp.hook_in) and write blocks.{i}.hook_mlp_out, got {tc!r}")
        if tc.d_in != d or tc.d_out != d:
            raise ValueError(f"transcoders[{i}] maps {tc.d_in} to {tc.d_out} features; the model's width is {d}")
        if tc.apply_b_dec_to_input or tc.rescale_acts_by_decoder_norm or tc.normalize_activations != "none":
            raise ValueError(f"transcoders[{i}] ({tc!r}): a transcoder's pre-activation must be x @ W_enc + b_enc "
                             f"(no b_dec on the input, no normalisation or decoder-norm scaling)")
        normed.append(reads in _READS_NORMED)
    return list(transcoders), normed


def check_graph_arguments(model, transcoders: Any) -> None:
    """Refuse, before any forward, a model or transcoders :func:`attribution_graph` cannot take (by name)."""
    _check_model(model)
    _check_transcoders(model, transcoders)


def _check_fraction(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) or \
            not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _logit_targets(logits: np.ndarray, max_logits: int, desired_logit_prob: float):
    """The most probable tokens (circuit-tracer's salient logits): until their probabilities sum to
    ``desired_logit_prob``, at most ``max_logits``; ``(tokens, probabilities)``."""
    shifted = logits - logits.max()  # (V,)
    probs = np.exp(shifted) / np.exp(shifted).sum()  # (V,)
    top = np.argsort(-probs, kind="stable")[:max_logits]  # (k,)
    cutoff = int(np.searchsorted(np.cumsum(probs[top]), desired_logit_prob, side="left")) + 1
    top = top[:cutoff]
    return top.astype(np.int64), probs[top]


def attribution_graph(model, input_ids: Any, transcoders: Any, *, max_logits: int = 10,
                      desired_logit_prob: float = 0.95, node_threshold: float = 0.8, edge_threshold: float = 0.98,
                      exclude_first: bool = True, batch_size: int = 256) -> AttributionGraph:
    """The attribution graph of one prompt through ``model`` with every MLP replaced by its transcoder.

    Parameters
    ----------
    model : CausalLM
        Sequential attention blocks (Llama-like, GPT-2-like, Gemma's sandwich norms); computed in its dtype.
    input_ids : array_like of int (L,) or (1, L)
    transcoders : list of SAE
        One per layer, layer i's reading ``blocks.{i}.hook_resid_mid`` (or ``ln2.hook_normalized`` /
        ``mlp.hook_in``: the MLP's normed input, the norm frozen) and writing ``blocks.{i}.hook_mlp_out``.
    max_logits : int, default 10
    desired_logit_prob : float, default 0.95
        Logit nodes: the most probable next tokens after the last position until their probabilities reach this.
    node_threshold, edge_threshold : float, default 0.8 and 0.98
        Pruning's cumulative influence thresholds (:func:`prune_graph`).
    exclude_first : bool, default True
        As circuit-tracer: the first position (BOS) has no feature or error nodes; what its MLPs write is in the
        constants.
    batch_size : int, default 256
        Targets per backward pass (memory ``batch_size * N * L * D``).

    Returns
    -------
    AttributionGraph
        With ``adjacency_matrix[t].sum() + constants[t]`` equal to target t's input (a feature's pre-activation,
        a logit minus the mean logit) to rounding.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0).astype(np.float64)
    >>> rng = np.random.default_rng(0)
    >>> tcs = [SAE(rng.normal(size=(8, 16)), rng.normal(size=16), rng.normal(size=(16, 8)), np.zeros(8),
    ...            hook_name=f"blocks.{i}.hook_resid_mid", hook_name_out=f"blocks.{i}.hook_mlp_out",
    ...            architecture="transcoder", apply_b_dec_to_input=False) for i in range(2)]
    >>> graph = attribution_graph(lm, [1, 2, 3, 4], tcs)
    >>> k = graph.n_features
    >>> bool(np.allclose(graph.adjacency_matrix[:k].sum(1) + graph.constants[:k], graph.pre_activations))
    True
    """
    _check_model(model)
    transcoders, normed_input = _check_transcoders(model, transcoders)
    cfg = model.config
    ids, _ = as_id_batch(input_ids, cfg.vocab_size, "input_ids")
    if ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one prompt (L,) or (1, L), got shape {ids.shape}")
    if isinstance(max_logits, bool) or not isinstance(max_logits, (int, np.integer)) or max_logits < 1:
        raise ValueError(f"max_logits must be a positive int, got {max_logits!r}")
    desired_logit_prob = _check_fraction(desired_logit_prob, "desired_logit_prob")
    node_threshold = _check_fraction(node_threshold, "node_threshold")
    edge_threshold = _check_fraction(edge_threshold, "edge_threshold")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    n = cfg.num_layers
    wanted = {"hook_embed", *(f"hook_{name}" for name in model.position_tables)}
    wanted |= {f"blocks.{i}.{p}" for i in range(n) for p in ("hook_resid_pre", "hook_resid_mid", "attn.hook_pattern",
                                                             "hook_mlp_out", "hook_resid_post")}
    logits, cache = run_with_cache(model, ids, names=lambda name: name in wanted)
    cache = {name: value[0] for name, value in cache.items()}  # (L, ...) each
    dtype = logits.dtype
    frozen = _Frozen(model, cache, transcoders, normed_input, dtype)
    nodes = _nodes(frozen, cache, transcoders, 1 if exclude_first else 0, dtype)

    last = logits[0, -1]  # (V,)
    tokens, probs = _logit_targets(last, int(max_logits), desired_logit_prob)
    head = model.head_weight.astype(dtype) * dtype.type(cfg.scales.logit)  # (V, D)
    nodes["logit_vecs"] = head[tokens] - head.mean(axis=0)  # (n_logits, D): circuit-tracer's demeaned unembedding

    # the constants: every target's input with every node at zero
    embed_const = sum((cache[f"hook_{name}"] for name in model.position_tables), np.zeros_like(nodes["embed"]))
    zero_mids, zero_final = frozen.forward(embed_const, nodes["mlp_const"])  # (N, L, D), (L, D)
    features = nodes["features"]
    k = len(features)
    feature_const = np.empty(k, dtype)
    for i, tc in enumerate(transcoders):
        rows = features[:, 0] == i
        x0 = frozen.feature_input(i, zero_mids[i])  # (L, D)
        p, f = features[rows, 1], features[rows, 2]
        feature_const[rows] = np.einsum("kd,dk->k", x0[p], tc.W_enc.astype(dtype)[:, f]) + tc.b_enc.astype(dtype)[f]
    constants = np.concatenate([feature_const, np.zeros((n + 1) * ids.shape[1], dtype),
                                nodes["logit_vecs"] @ zero_final[-1]])  # (M,)

    adjacency = _edges(frozen, nodes, transcoders, int(batch_size))
    graph = AttributionGraph(input_ids=ids[0].copy(), active_features=features, activation_values=nodes["acts"],
                             pre_activations=nodes["pres"], logit_tokens=tokens, logit_probabilities=probs,
                             logit_values=last[tokens] - last.mean(), adjacency_matrix=adjacency,
                             constants=constants, error_vectors=nodes["errors"], n_layers=n)
    graph.node_mask, graph.edge_mask, graph.cumulative_scores = prune_graph(graph, node_threshold, edge_threshold)
    return graph


def _nodes(frozen: _Frozen, cache: dict, transcoders: list[SAE], first: int, dtype) -> dict:
    """The active features ``(layer, position, feature)`` (K, 3) with their activations and pre-activations (K,),
    the error vectors (N, L, D), the token embeddings (L, D), and what the MLPs write that is no node (N, L, D)."""
    embed = cache["hook_embed"]  # (L, D): the token embeddings, times any embedding scale
    mlp_out = np.stack([cache[f"blocks.{i}.hook_mlp_out"] for i in range(len(transcoders))])  # (N, L, D)
    errors = np.zeros_like(mlp_out)  # (N, L, D)
    mlp_const = np.empty_like(mlp_out)  # (N, L, D)
    found, pres, acts_found = [], [], []
    for i, tc in enumerate(transcoders):
        x = frozen.feature_input(i, cache[f"blocks.{i}.hook_resid_mid"]).astype(dtype)  # (L, D)
        pre = tc._pre(x)  # (L, S)
        acts = tc.activate(pre)  # (L, S)
        acts[:first] = 0
        errors[i, first:] = (mlp_out[i] - tc.decode(acts))[first:]
        mlp_const[i] = np.broadcast_to(tc.b_dec.astype(dtype), embed.shape)
        mlp_const[i, :first] = mlp_out[i, :first]  # the first position's MLPs: no nodes, so constants
        pos, feat = np.nonzero(acts)  # (K_i,) each, by position then feature
        found.append(np.stack([np.full_like(pos, i), pos, feat], axis=1))
        pres.append(pre[pos, feat])
        acts_found.append(acts[pos, feat])
    return {"features": np.concatenate(found).astype(np.int64), "pres": np.concatenate(pres),
            "acts": np.concatenate(acts_found), "errors": errors, "embed": embed, "mlp_const": mlp_const}


def _injections(frozen: _Frozen, nodes: dict, transcoders: list[SAE], batch: np.ndarray, k: int):
    """Where each target of ``batch`` (T,) (a feature index below k, a logit k + j) reads the residual stream: the
    gradient (T, L, D) at the final norm's output and (T, L, D) per layer at the residual between the branches."""
    features, embed = nodes["features"], nodes["embed"]
    g_final = np.zeros((len(batch),) + embed.shape, embed.dtype)  # (T, L, D)
    inject = [np.zeros_like(g_final) for _ in transcoders]
    for row, j in enumerate(batch.tolist()):
        if j >= k:
            g_final[row, -1] = nodes["logit_vecs"][j - k]
            continue
        layer, pos, feat = features[j]
        vec = np.zeros(embed.shape, embed.dtype)  # (L, D)
        vec[pos] = transcoders[layer].W_enc[:, feat]
        if frozen.normed_input[layer]:
            e = frozen.layers[layer]
            vec = frozen._norm_t(vec, e["s2"], e["c2"])  # through the frozen MLP norm
        inject[layer][row] = vec
    return g_final, inject


def _edges(frozen: _Frozen, nodes: dict, transcoders: list[SAE], batch_size: int) -> np.ndarray:
    """The adjacency (M, M): each target's gradients from one backward per batch, dotted with every source's
    vector (a feature's activation times its decoder row, an error vector, a token's embedding)."""
    features, errors, embed = nodes["features"], nodes["errors"], nodes["embed"]
    n, length = errors.shape[:2]
    k, n_logits = len(features), len(nodes["logit_vecs"])
    total = k + n * length + length + n_logits
    adjacency = np.zeros((total, total), embed.dtype)
    by_layer = [np.nonzero(features[:, 0] == i)[0] for i in range(n)]
    targets = np.arange(k + n_logits)
    for start in range(0, len(targets), batch_size):
        batch = targets[start:start + batch_size]  # (T,)
        at_mlp, at_embed = frozen.backward(*_injections(frozen, nodes, transcoders, batch, k))  # (T, N, L, D)
        rows = np.where(batch < k, batch, batch - k + total - n_logits)  # (T,)
        for i in range(n):
            src = by_layer[i]
            if len(src):
                vecs = transcoders[i].W_dec.astype(embed.dtype)[features[src, 2]] * nodes["acts"][src, None]  # (Ki, D)
                adjacency[rows[:, None], src[None]] = np.einsum("tkd,kd->tk", at_mlp[:, i][:, features[src, 1]],
                                                                vecs)
            adjacency[rows, k + i * length:k + (i + 1) * length] = np.einsum("tld,ld->tl", at_mlp[:, i], errors[i])
        adjacency[rows, k + n * length:k + (n + 1) * length] = np.einsum("tld,ld->tl", at_embed, embed)
    return adjacency


# -- pruning (circuit-tracer's graph.prune_graph) ---------------------------------------------------------------
def _normalize(matrix: np.ndarray) -> np.ndarray:
    a = np.abs(matrix)  # (M, M)
    return a / np.maximum(a.sum(axis=1, keepdims=True), 1e-10)


def _influence(a: np.ndarray, weights: np.ndarray, max_iter: int = 1000) -> np.ndarray:
    """``weights @ (A + A^2 + ...)`` (M,); A is nilpotent (the graph is acyclic), so the sum ends."""
    current = weights @ a  # (M,)
    influence = current.copy()
    for _ in range(max_iter):
        if not current.any():
            return influence
        current = current @ a
        influence += current
    raise RuntimeError(f"the influence did not converge in {max_iter} iterations (is the graph acyclic?)")


def _threshold(scores: np.ndarray, threshold: float) -> float:
    ordered = np.sort(scores)[::-1]  # (n,)
    cumulative = np.cumsum(ordered) / ordered.sum()  # (n,)
    index = min(int(np.searchsorted(cumulative, threshold, side="left")), len(cumulative) - 1)
    return ordered[index]


def prune_graph(graph: AttributionGraph, node_threshold: float = 0.8,
                edge_threshold: float = 0.98) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(node_mask (M,), edge_mask (M, M), cumulative_scores (M,))``: circuit-tracer's pruning by influence.

    A node's influence is its weight in ``p @ (B + B^2 + ...)``, B the row-normalised absolute adjacency and p the
    logits' probabilities on the logit nodes; the nodes whose influence reaches ``node_threshold`` of the total
    (from the largest) are kept, with every token and logit. The edges of the kept nodes are scored by
    ``B[t, s] * (influence[t] + p[t])`` and kept up to ``edge_threshold``; then, until nothing changes, feature and
    error nodes without an outgoing kept edge and feature nodes without an incoming one are dropped.
    """
    node_threshold = _check_fraction(node_threshold, "node_threshold")
    edge_threshold = _check_fraction(edge_threshold, "edge_threshold")
    a = graph.adjacency_matrix
    n_logits, n_tokens, n_features = graph.n_logits, graph.n_pos, graph.n_features
    weights = np.zeros(a.shape[0], a.dtype)  # (M,)
    weights[-n_logits:] = graph.logit_probabilities
    node_influence = _influence(_normalize(a), weights)  # (M,)
    node_mask = node_influence >= _threshold(node_influence, node_threshold)
    node_mask[-n_logits - n_tokens:] = True
    pruned = a.copy()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    normalized = _normalize(pruned)
    edge_scores = normalized * (_influence(normalized, weights) + weights)[:, None]  # (M, M)
    edge_mask = edge_scores >= _threshold(edge_scores.ravel(), edge_threshold)
    inner = slice(0, a.shape[0] - n_logits - n_tokens)  # features and errors
    before = node_mask.copy()
    node_mask[inner] &= edge_mask[:, inner].any(axis=0)  # an outgoing edge kept
    node_mask[:n_features] &= edge_mask[:n_features].any(axis=1)  # and an incoming one
    while (node_mask != before).any():  # each round may strand more nodes (at most N + 1 rounds)
        before = node_mask.copy()
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask[inner] &= edge_mask[:, inner].any(axis=0)
        node_mask[:n_features] &= edge_mask[:n_features].any(axis=1)
    order = np.argsort(-node_influence, kind="stable")
    cumulative = np.zeros_like(node_influence)
    cumulative[order] = np.cumsum(node_influence[order]) / node_influence.sum()
    return node_mask, edge_mask, cumulative
