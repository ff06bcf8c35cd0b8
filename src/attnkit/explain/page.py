"""One self-contained HTML page that explains a causal LM's next-token prediction.

The page shows, for a prompt: which input tokens made the model say each of its most likely next tokens
(gradient x input and saliency, with a picker for the output token), the logit lens, the attention rollout,
one head's attention with a colour scale and its legend, a thumbnail of every head of every softmax-attention
layer, and each head's, MLP's and the embeddings' direct share of the chosen token's logit; with a corrupted
prompt, heat maps of the activation patching of the residual stream and of every head; with a generation, the
attribution of each generated token to every token before it. A model with Gated DeltaNet layers (no softmax
pattern) gets the attention of its other layers and no rollout or flow.
Script, style and data are inline; the page requests nothing from the network.

Attention weights are stored as :func:`attnkit.viz.encode_attention` stores them: 8 bits per weight relative
to their row's maximum (fewer, down to 3, when the page would exceed its budget), deflated and decoded in the
page with the browser's own ``DecompressionStream``.

Shapes: N layers, H heads, L tokens, K top_k.
"""
from __future__ import annotations

import html
import importlib.resources
import json
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import _progress, viz
from .._display import readable_token
from .._validation import check_positive_int
from ..io import atomic_write
from ..models.config import PAIRED_LAYER_TYPES, STATE_LAYER_TYPES
from ..viz import encode_attention, fit_attention
from ._inputs import as_id_batch
from .attribution import embedding_gradient
from .attribution_graph import AttributionGraph, attribution_graph, check_graph_arguments
from .direct_logit import direct_logit_attribution
from .flow import attention_flow
from .generation import generation_attribution
from .logit_lens import logit_lens
from .rollout import attention_rollout

__all__ = ["encode_attention", "explain_html", "explain_similarity_html"]


def _script_json(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _rounded(values: np.ndarray, decimals: int = 6) -> list:
    """Rounded values as nested lists, NaN (a place a layer does not have) as None."""
    rounded = np.round(np.asarray(values, dtype=np.float64), decimals)
    missing = np.isnan(rounded)
    return np.where(missing, None, rounded).tolist() if missing.any() else rounded.tolist()


def _checked_page_arguments(lm, batch: np.ndarray, path: Any, candidates: Any, top_k: Any, max_bytes: Any,
                            corrupt: Any, generate: Any, progress: Any) -> tuple[int, Path, np.ndarray | None]:
    """:func:`explain_html`'s arguments checked before any forward: the page's byte budget, its path and the
    corrupted prompt's ids (1, L) or None."""
    vocab = lm.config.vocab_size
    for name, value in (("candidates", candidates), ("top_k", top_k)):
        check_positive_int(value, name, maximum=vocab)
    if generate != 0:
        check_positive_int(generate, "generate")
    _progress.check_progress(progress)
    if max_bytes is None:
        max_bytes = viz.HTML_SIZE_WARNING_BYTES  # read at call time, so it can be changed
    max_bytes = check_positive_int(max_bytes, "max_bytes")
    target = Path(path)
    if not target.parent.is_dir():
        raise ValueError(f"path's folder {str(target.parent)!r} does not exist (path={str(path)!r})")
    corrupted = None
    if corrupt is not None:
        corrupted, corrupt_single = as_id_batch(corrupt, vocab, "corrupt")
        if not corrupt_single or corrupted.shape != batch.shape:
            raise ValueError(f"corrupt must be one sequence of the prompt's length {batch.shape[1]}, got shape "
                             f"{np.shape(corrupt)}")
    return max_bytes, target, corrupted


def explain_html(lm, ids: Any, path: str | os.PathLike, *, token_text: Callable[[int], str] | None = None,
                 candidates: int = 5, top_k: int = 5, title: str = "attnkit: explain a prediction",
                 max_bytes: int | None = None, corrupt: Any = None, byte_level: bool | None = None,
                 generate: int = 0, progress: bool | None = None, transcoders: Any = None) -> dict:
    """Explain ``lm``'s next-token prediction after ``ids`` in one offline HTML page.

    Parameters
    ----------
    lm : CausalLM
        A decoder LM (its gradient buffers are left freed: zeros when read).
    ids : array_like of int (L,)
        The prompt's token ids.
    path : str or os.PathLike
        The HTML file to write (atomically; its folder must exist).
    token_text : callable int -> str, optional
        The raw tokenizer piece of an id (e.g. ``tokenizer.id_to_token``); default the id itself.
        The page shows each piece as text (:func:`attnkit._display.readable_token`: `` café`` for byte-level
        BPE's ``ĠcafÃ©``) and keeps the raw piece for its tooltip.
    candidates : int, default 5
        How many of the most likely next tokens get an attribution (the picker's choices).
    top_k : int, default 5
        Tokens per cell of the logit lens (its tooltips).
    title : str
        The page's heading (shown as text).
    max_bytes : int, optional
        The page's budget, default 5 MB: the attention weights get 8 bits each relative to their row's maximum, fewer
        (down to 3) when the page would exceed it (see :func:`attnkit.viz.encode_attention`); a warning
        says when even that is too big.
    corrupt : array_like of int (L,), optional
        A corrupted prompt of the same length: the page then adds activation patching
        (:func:`activation_patching`) of the residual stream per (layer, position) and of each head's output per
        (layer, head), for the metric ``logit[correct] - logit[incorrect]`` where ``correct`` is the model's top
        token after ``ids`` and ``incorrect`` its top token after ``corrupt`` (the second after ``ids`` when both
        are the same).
    generate : int, default 0
        Decode this many tokens greedily after ``ids`` and add the matrix of :func:`generation_attribution`
        (gradient x input): for each generated token, which tokens before it made the model choose it.
    byte_level : bool, optional
        Whether the pieces are byte-level BPE's (:func:`attnkit._display.is_byte_level_tokenizer` tells from
        the tokenizer); None: judged piece by piece.
    progress : bool or None, default None
        A line on stderr naming each step as it runs, the patching's forwards as its detail
        (:mod:`attnkit._progress`): None shows it when stderr is a terminal, True always, False never.
    transcoders : list of SAE, optional
        One transcoder per layer: the page then draws the pruned :func:`attribution_graph` of the prompt.

    Returns
    -------
    dict
        The data the page holds (``tokens``, ``raw_tokens``, ``attention_layers`` (the layers whose attention it
        draws: all but the Gated DeltaNet and short-convolution layers, listed in ``linear_layers``), ``rollout``
        (L, L), ``flow`` (L, L; up to 24 tokens, else None: :func:`attention_flow` costs L * L maximum flows; both
        None for a model with such layers, which have no shares of attention, or with attention beside a
        state-space mixer), ``candidates`` with their
        ``gradient_x_input`` and ``saliency`` (L,) and ``dla`` (:func:`direct_logit_attribution` of their logit:
        ``heads`` (N, H), ``linear_attn`` (N,), ``mlp`` (N,), ``embed`` (with the position embeddings), ``bias``
        and ``logit``),
        ``lens`` and ``vocab``, the readable text of the token ids
        it shows, ``patching``: None without ``corrupt``, else the ``correct`` and ``incorrect`` ids and texts,
        ``clean_metric``, ``corrupt_metric``, ``corrupt_tokens``, ``resid_pre`` (N, L) and ``z`` (N, H), None in the
        rows of layers without heads),
        ``generation``: None without ``generate``, else ``tokens`` and ``raw_tokens`` of all L + G tokens,
        ``prompt_length`` and ``attributions`` (G, L + G)), ``graph``: None without ``transcoders``, else the
        pruned attribution graph's kept ``nodes`` (each a dict: ``kind`` ``"feature"``, ``"error"``, ``"token"`` or
        ``"logit"``, ``layer`` (-1 for tokens, N for logits), ``pos``, ``label``, ``value``, ``influence``) and
        ``edges`` ``[source, target, weight]`` (indices into ``nodes``), and ``bits``, the bits per stored
        attention weight: what the page shows is exactly this.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> page = pathlib.Path(tempfile.mkdtemp()) / "explain.html"
    >>> data = explain_html(CausalLM(cfg, rng=0), [1, 2, 3], page, candidates=3)
    >>> len(data["candidates"]), len(data["candidates"][0]["saliency"]), "https://" in page.read_text()
    (3, 3, False)
    """
    batch, single = as_id_batch(ids, lm.config.vocab_size)
    if not single:
        raise ValueError(f"ids must be one sequence (L,), got shape {np.shape(ids)}")
    # Gated DeltaNet and short-convolution layers have no softmax pattern: the page draws the other layers'
    # attention, and leaves out rollout and flow, which compose every layer's pattern as shares of attention
    linear = [i for i, kind in enumerate(lm.config.layer_types) if kind in STATE_LAYER_TYPES]
    # a layer of the MLP alone has no pattern at all (and passes every token's stream on unmixed)
    drawn = [i for i, kind in enumerate(lm.config.layer_types) if i not in linear and kind != "mlp"]
    max_bytes, target, corrupted = _checked_page_arguments(lm, batch, path, candidates, top_k, max_bytes, corrupt,
                                                           generate, progress)
    if transcoders is not None:
        check_graph_arguments(lm, transcoders)
    piece = (lambda i: str(i)) if token_text is None else (lambda i: str(token_text(int(i))))

    def readable(raw: str) -> str:
        return readable_token(raw, byte_level)

    # the attention, the lenses, each candidate, rollout and flow, each patching, the generation, the page
    steps = 4 + candidates + (2 if corrupted is not None else 0) + (1 if generate else 0) + \
        (1 if transcoders is not None else 0) + 1
    with _progress.progress(steps, "explain: attention", enabled=progress) as line:
        weights = np.stack([w[0] for w in lm.attention_weights(batch, layers=drawn)])  # (A, H, L, L)
        line.update()
        line.set_desc("explain: logit lens")
        lens = logit_lens(lm, batch[0], top_k=top_k)  # (N, L, K) each
        best = logit_lens(lm, batch[0], top_k=candidates)  # the last layer is the model's own output
        line.update(2)
        line.set_desc("explain: attributions")
        chosen = []
        for token, prob in zip(best.token_ids[-1, -1], best.probs[-1, -1], strict=True):
            chosen.append(dict(_candidate(lm, batch, int(token)), raw=piece(token), text=readable(piece(token)),
                               prob=float(prob)))
            line.update()
        line.set_desc("explain: rollout and flow")
        raw = [piece(i) for i in batch[0]]
        # a layer whose attention sits beside a state-space mixer (Falcon-H1) moves information between tokens
        # outside its pattern too: no rollout or flow either
        composed = not linear and not any(kind in PAIRED_LAYER_TYPES for kind in lm.config.layer_types)
        data = {"tokens": [readable(t) for t in raw], "raw_tokens": raw,
                "num_layers": lm.config.num_layers, "num_heads": weights.shape[1],
                "layer_names": [f"layer {i}" for i in range(lm.config.num_layers)],
                "head_names": [f"head {j}" for j in range(weights.shape[1])],
                "attention_layers": drawn, "linear_layers": linear,
                "rollout": _rounded(attention_rollout(weights)) if composed else None,
                "flow": _flow(weights) if composed else None, "candidates": chosen,
                "lens": {"ids": lens.token_ids.tolist(), "probs": _rounded(lens.probs, 4)},
                # each id's text once: N x L x K cells repeat few distinct tokens
                "vocab": {str(t): readable(piece(t)) for t in np.unique(lens.token_ids).tolist()},
                "patching": None, "generation": None, "graph": None}
        line.update()
        _optional_views(lm, batch, data, corrupted, generate, transcoders, piece, readable, line)
        line.set_desc("explain: writing the page")
        data = _write_page(data, weights, target, title, top_k, max_bytes)
        line.update()
    return data


def _candidate(lm, batch: np.ndarray, token: int) -> dict:
    """One output token's input attributions (L,) and direct logit attribution, for the page."""
    grad, embeddings, _ = embedding_gradient(lm, batch, -1, token)  # (1, L, D) each
    parts = direct_logit_attribution(lm, batch[0], token)
    return {"id": token, "gradient_x_input": _rounded((grad * embeddings).sum(-1)[0]),
            "saliency": _rounded(np.sqrt((grad * grad).sum(-1))[0]),
            "dla": {"heads": _rounded(parts["heads"]), "linear_attn": _rounded(parts["linear_attn"]),
                    "mlp": _rounded(parts["mlp"]),
                    "embed": round(float(parts["embed"] + parts["pos_embed"]), 6),
                    "bias": round(float(parts["bias"]), 6), "logit": round(float(parts["logit"]), 6)}}


def _generation(lm, ids: np.ndarray, count: int, piece: Callable[[int], str],
                readable: Callable[[str], str]) -> dict:
    """The greedy continuation's per-token attribution matrix (G, L + G), for the page."""
    found = generation_attribution(lm, ids, max_new_tokens=count)
    raw = [piece(i) for i in found.ids]
    return {"tokens": [readable(t) for t in raw], "raw_tokens": raw, "prompt_length": found.prompt_length,
            "method": "gradient_x_input", "attributions": _rounded(found.attributions)}


def _patching(lm, clean: np.ndarray, corrupt: np.ndarray, text: Callable[[int], str],
              line: _progress.Progress) -> dict:
    """Activation patching of the residual stream and of each head, for the page (see :func:`explain_html`);
    one step of ``line`` each, their forwards shown as its detail."""
    from .patching import activation_patching

    clean_logits, corrupt_logits = lm(clean)[0, -1], lm(corrupt)[0, -1]  # (V,) each
    order = np.argsort(-clean_logits, kind="stable")
    correct, incorrect = int(order[0]), int(np.argmax(corrupt_logits))
    if incorrect == correct:  # the corruption did not change the top token: compare with the runner-up
        incorrect = int(order[1])
    answers = (correct, incorrect)
    found = {}
    for hook in ("resid_pre", "z"):
        found[hook] = _rounded(activation_patching(lm, clean[0], corrupt[0], answers, hook=hook,
                                                   progress=line.enabled))
        line.update()
    return {"correct": correct, "incorrect": incorrect, "correct_text": text(correct),
            "incorrect_text": text(incorrect),
            "clean_metric": float(clean_logits[correct] - clean_logits[incorrect]),
            "corrupt_metric": float(corrupt_logits[correct] - corrupt_logits[incorrect]),
            "corrupt_tokens": [text(i) for i in corrupt[0]], **found}  # "z": None in rows of layers without heads


FLOW_MAX_TOKENS = 24  # the pages add attention flow up to this length (L * L max-flows: seconds, not minutes)


def _optional_views(lm, batch: np.ndarray, data: dict, corrupted, generate: int, transcoders, piece: Callable,
                    readable: Callable, line) -> None:
    """The views asked for into ``data``: patching, the generation's attributions, the attribution graph."""
    if corrupted is not None:
        line.set_desc("explain: patching")
        data["patching"] = _patching(lm, batch, corrupted, lambda i: readable(piece(i)), line)
    if generate:
        line.set_desc("explain: generation")
        data["generation"] = _generation(lm, batch[0], generate, piece, readable)
        line.update()
    if transcoders is not None:
        line.set_desc("explain: attribution graph")
        data["graph"] = _graph_data(attribution_graph(lm, batch[0], transcoders), lambda i: readable(piece(i)))
        line.update()


def _graph_data(graph: AttributionGraph, text: Callable[[int], str]) -> dict:
    """The pruned graph's kept nodes and edges, as the page draws them."""
    kept = np.nonzero(graph.node_mask)[0]  # (kept,)
    k, n, length = graph.n_features, graph.n_layers, graph.n_pos
    nodes = []
    for index in kept.tolist():
        if index < k:
            layer, pos, feature = graph.active_features[index].tolist()
            node = dict(kind="feature", layer=layer, pos=pos, label=f"feature {feature} (layer {layer})",
                        value=float(graph.activation_values[index]))
        elif index < k + n * length:
            layer, pos = divmod(index - k, length)
            node = dict(kind="error", layer=layer, pos=pos, label=f"error (layer {layer})",
                        value=float(np.linalg.norm(graph.error_vectors[layer, pos])))
        elif index < k + (n + 1) * length:
            pos = index - k - n * length
            node = dict(kind="token", layer=-1, pos=pos, label=text(int(graph.input_ids[pos])), value=1.0)
        else:
            j = index - k - (n + 1) * length
            node = dict(kind="logit", layer=n, pos=length - 1, label=text(int(graph.logit_tokens[j])),
                        value=float(graph.logit_probabilities[j]))
        nodes.append(dict(node, influence=round(float(graph.cumulative_scores[index]), 6)))
    where = {int(index): j for j, index in enumerate(kept.tolist())}
    targets, sources = np.nonzero(graph.edge_mask)  # (E,) each
    edges = [[where[int(s)], where[int(t)], float(np.round(graph.adjacency_matrix[t, s], 6))]
             for t, s in zip(targets.tolist(), sources.tolist(), strict=True) if s in where and t in where]
    return {"nodes": nodes, "edges": edges, "num_layers": n}


def _flow(weights: np.ndarray) -> list | None:
    """Attention flow (L, L) for short prompts, else None (see :func:`attention_flow` for the cost)."""
    return _rounded(attention_flow(weights)) if weights.shape[-1] <= FLOW_MAX_TOKENS else None


def _write_page(data: dict, weights: np.ndarray, target: Path, title: str, top_k: int, max_bytes: int) -> dict:
    """Fill the template with ``data`` and the (N, H, L, L) ``weights`` fitted to ``max_bytes``; write it."""
    template = importlib.resources.files("attnkit").joinpath("templates/explain_page.html").read_text(encoding="utf-8")

    def render(attention: dict) -> str:
        values = {"TITLE": html.escape(str(title)), "TOPK": str(int(top_k)),
                  "DATA": _script_json(dict(data, attention=attention))}
        return re.sub(r"\{\{(TITLE|TOPK|DATA)\}\}", lambda m: values[m.group(1)], template)

    rest = len(render(dict(encode_attention(weights[:1, :1, :1]), q="", scale="")).encode("utf-8"))
    attention = fit_attention(weights, max(0, int(max_bytes) - rest))
    page = render(attention).encode("utf-8")
    if len(page) > max_bytes:
        warnings.warn(f"the explain page {str(target)!r} is {len(page) / 1e6:.1f} MB, over max_bytes={max_bytes} "
                      f"even with 3 bits per attention weight: a shorter text makes it smaller", UserWarning,
                      stacklevel=3)
    atomic_write(target, lambda f: f.write(page))
    data["bits"] = attention["bits"]
    return data


def explain_similarity_html(encoder, sentence: str, other: str, path: str | os.PathLike, *,
                            title: str = "attnkit: explain a similarity", max_bytes: int | None = None) -> dict:
    """Explain why a sentence encoder finds two sentences similar, in one offline HTML page.

    The page shows, for each of the two sentences, which of its tokens raise or lower the cosine similarity
    of the two embeddings (:func:`similarity_attribution`: gradient x input and saliency, the other sentence
    held fixed; a picker switches between the sentences), then ``sentence``'s attention rollout, the
    attention of each head with a colour scale, and a thumbnail of every head of every layer. An encoder
    has no output head, so there is no logit lens.

    Parameters
    ----------
    encoder : SentenceEncoder
        E.g. :func:`attnkit.pretrained.load_minilm` (its gradient buffers are left freed: zeros when read).
    sentence, other : str
        The two sentences; the attention shown is ``sentence``'s.
    path : str or os.PathLike
        The HTML file to write (atomically; its folder must exist).
    title : str
        The page's heading (shown as text).
    max_bytes : int, optional
        The page's budget, default 5 MB (see :func:`explain_html`).

    Returns
    -------
    dict
        The data the page holds: ``similarity``, ``tokens`` and ``raw_tokens`` of ``sentence``,
        ``rollout`` and ``flow`` (L, L; flow up to 24 tokens), ``candidates`` (one per sentence, with its
        ``tokens``, ``gradient_x_input`` and ``saliency``) and ``bits``.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from attnkit.pretrained import load_minilm
    >>> page = pathlib.Path(tempfile.mkdtemp()) / "similar.html"
    >>> data = explain_similarity_html(load_minilm(), "A man eats.", "Someone is eating.", page)
    >>> len(data["candidates"]), data["tokens"][:2], data["similarity"] > 0.5
    (2, ['[CLS]', 'a'], True)
    """
    from .similarity import encoder_attention, similarity_attribution

    if max_bytes is None:
        max_bytes = viz.HTML_SIZE_WARNING_BYTES
    max_bytes = check_positive_int(max_bytes, "max_bytes")
    target = Path(path)
    if not target.parent.is_dir():
        raise ValueError(f"path's folder {str(target.parent)!r} does not exist (path={str(path)!r})")
    chosen = []
    for label, text, against in (("A", sentence, other), ("B", other, sentence)):
        found = similarity_attribution(encoder, text, against)
        chosen.append({"text": f"sentence {label}: {text}", "raw": text, "prob": None,
                       "tokens": [readable_token(t, byte_level=False) for t in found.tokens],  # WordPiece
                       "raw_tokens": list(found.tokens),
                       "gradient_x_input": _rounded(found.gradient_x_input), "saliency": _rounded(found.saliency)})
    tokens, weights = encoder_attention(encoder, sentence)  # (N, H, L, L)
    data = {"kind": "similarity", "similarity": round(float(found.similarity), 6),
            "tokens": [readable_token(t, byte_level=False) for t in tokens], "raw_tokens": list(tokens),
            "num_layers": weights.shape[0], "num_heads": weights.shape[1],
            "layer_names": [f"layer {i}" for i in range(weights.shape[0])],
            "head_names": [f"head {j}" for j in range(weights.shape[1])],
            "rollout": _rounded(attention_rollout(weights)), "flow": _flow(weights), "candidates": chosen,
            "lens": None, "vocab": {}, "patching": None, "generation": None,
            "graph": None}
    return _write_page(data, weights, target, title, 0, int(max_bytes))
