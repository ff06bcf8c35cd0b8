"""Pictures of attention weights and training curves, and an interactive attention explorer page.

`plot_attention`, `plot_training_curve`, and `plot_block_mask` / `plot_score_mod` (how an
:mod:`attnkit.flex` variant looks: its tiles, and its scores before and after the modifier) draw with
matplotlib (imported only when a plot is drawn; install it with ``pip install 'attnkit[viz]'``) and return a
`matplotlib.figure.Figure`, so the same call shows inline in a notebook and saves to a file from a script
(``fig.savefig("attention.png")``). On a machine without a display the non-interactive Agg backend is chosen,
unless ``MPLBACKEND`` says otherwise.

`attention_html` needs nothing but NumPy: it writes one self-contained HTML page (script, style and
data inline; it loads nothing from the network) in which a browser picks a layer and a head, hovers tokens
and sees where each one attends.

Dimension letters: H heads, N layers, Lq query length (rows), Lk key length (columns).
"""
from __future__ import annotations

import base64
import html
import importlib.resources
import json
import math
import os
import re
import sys
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._validation import check_positive_int
from .io import atomic_write

__all__ = ["HTML_SIZE_WARNING_BYTES", "VIZ_INSTALL_HINT", "attention_figsize", "attention_html", "encode_attention",
           "fit_attention", "plot_attention", "plot_block_mask", "plot_score_mod", "plot_training_curve"]

VIZ_INSTALL_HINT = "pip install 'attnkit[viz]'"

_CELL_INCHES = 0.32  # side of one attention cell in the picture
_MIN_PANEL_INCHES = 2.4  # no heatmap smaller than this, however short the sequence
_MAX_TICK_LABELS = 40  # label every token up to this length, every k-th beyond
_MAX_COLUMNS_ONE_LAYER = 4  # the heads of one layer wrap into rows of this many
HTML_SIZE_WARNING_BYTES = 5_000_000  # pages are kept under this (browsers get slow to open bigger ones)
_MAX_BITS, _MIN_BITS = 8, 3  # bits per stored weight: 8 unless the page would exceed its budget
_PROBABILITY_SLACK = 1e-4  # rounding room around [0, 1] for weights computed in float32


def _pyplot():
    """Import ``matplotlib.pyplot`` (Agg backend when there is no display), or explain how to install it."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - exercised with a monkeypatched import in the tests
        raise ImportError(f"attnkit.viz needs matplotlib, which is not installed: {VIZ_INSTALL_HINT}") from exc
    headless = sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    if headless and "MPLBACKEND" not in os.environ and "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _as_4d(weights: Any) -> np.ndarray:
    w = np.asarray(weights)
    if w.dtype.kind not in "fiub":
        raise TypeError(f"weights must be a real numeric array, got dtype {w.dtype} (shape {w.shape})")
    if w.ndim not in (2, 3, 4):
        raise ValueError(f"weights must be (Lq, Lk), (H, Lq, Lk) or (layers, H, Lq, Lk), got shape {w.shape}")
    if 0 in w.shape:
        raise ValueError(f"weights must not be empty, got shape {w.shape}")
    return w.reshape((1,) * (4 - w.ndim) + w.shape).astype(np.float64)  # (N, H, Lq, Lk)


def _check_tokens(tokens: Sequence[Any] | None, n: int, name: str, what: str) -> list[str] | None:
    if tokens is None:
        return None
    if isinstance(tokens, str):
        raise TypeError(f"{name} must be a sequence of tokens, not a string (split it first: {name}=text.split())")
    labels = [str(t) for t in tokens]
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} tokens, but the weights have {n} {what}")
    return labels


def _check_names(names: Sequence[Any] | None, n: int, name: str, default: str) -> list[str]:
    if names is None:
        return [f"{default} {i}" for i in range(n)]
    labels = [str(s) for s in names]
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} names, but the weights have {n}")
    return labels


def _grid_shape(n_layers: int, n_heads: int) -> tuple[int, int]:
    """Rows and columns of panels: layers x heads, except that the heads of a single layer wrap at 4 columns."""
    if n_layers == 1 and n_heads > _MAX_COLUMNS_ONE_LAYER:
        return math.ceil(n_heads / _MAX_COLUMNS_ONE_LAYER), _MAX_COLUMNS_ONE_LAYER
    return n_layers, n_heads


def attention_figsize(n_layers: int, n_heads: int, seq_q: int, seq_k: int) -> tuple[float, float]:
    """Size in inches of the figure :func:`plot_attention` draws for a (layers, H, Lq, Lk) array.

    One panel per head and layer (layers are rows, heads are columns; the heads of a single layer wrap
    into rows of 4) plus room for the colour bar.

    Examples
    --------
    >>> attention_figsize(2, 4, 8, 8)
    (13.44, 6.32)
    >>> attention_figsize(1, 12, 8, 8)  # 3 rows of 4 heads
    (13.44, 9.48)
    """
    rows, cols = _grid_shape(n_layers, n_heads)
    panel_w = max(_MIN_PANEL_INCHES, _CELL_INCHES * seq_k) + 0.55  # + the query labels
    panel_h = max(_MIN_PANEL_INCHES, _CELL_INCHES * seq_q) + 0.6  # + title and key labels
    return round(cols * panel_w + 1.0, 2), round(rows * panel_h, 2)


def _tick_positions(n: int) -> np.ndarray:
    step = max(1, int(np.ceil(n / _MAX_TICK_LABELS)))
    return np.arange(0, n, step)


def plot_attention(weights: Any, query_tokens: Sequence[Any] | None = None, key_tokens: Sequence[Any] | None = None,
                   *, title: str | None = None, layer_names: Sequence[Any] | None = None,
                   head_names: Sequence[Any] | None = None, ax: Any = None, cmap: str = "viridis",
                   vmin: float = 0.0, vmax: float | None = None):
    """Draw attention weights as a grid of heatmaps, one per head (columns) and layer (rows).

    The heads of a single layer wrap into rows of four (12 heads: 3 x 4).

    Parameters
    ----------
    weights : array_like, shape (Lq, Lk), (H, Lq, Lk) or (N, H, Lq, Lk)
        Attention weights of one example (e.g. ``weights[0]`` of a ``MultiHeadAttention`` output, or one
        example's weights of every layer stacked). Row ``i`` is what query ``i`` attends to.
    query_tokens : sequence of Lq tokens, optional
        Labels of the rows (the queries); default the positions ``0 .. Lq-1``.
    key_tokens : sequence of Lk tokens, optional
        Labels of the columns (the keys); default ``query_tokens`` when ``Lq == Lk`` (self-attention),
        else the positions.
    title : str, optional
        Title of the whole figure.
    layer_names, head_names : sequence of str, optional
        Names of the N layers and H heads in the panel titles (default ``"layer i"``, ``"head j"``).
    ax : matplotlib Axes, optional
        Draw a single (Lq, Lk) map into this existing axes (the figure is then ``ax.figure``). Only for
        weights with one layer and one head.
    cmap : str, default "viridis"
    vmin, vmax : float
        The colour scale, shared by every panel of the figure. ``vmax`` defaults to the largest weight
        (at most 1), so heads are comparable with one another.

    Returns
    -------
    matplotlib.figure.Figure
        With one colour bar for the whole figure. Panels are ``fig.axes[:-1]`` (the last axes is the
        colour bar), in row-major order (layer 0 head 0, layer 0 head 1, ...).

    Raises
    ------
    ImportError
        If matplotlib is not installed (the message names ``pip install 'attnkit[viz]'``).
    ValueError
        Wrong number of dimensions, or token/name lists whose length does not match the weights.

    Shapes
    ------
    N layers, H heads, Lq queries (rows), Lk keys (columns). A fully masked query row (all-zero weights,
    attnkit's convention) shows as the bottom of the colour scale.

    Examples
    --------
    >>> w = np.full((2, 3, 3), 1 / 3)  # (H, Lq, Lk)
    >>> fig = plot_attention(w, ["the", "cat", "sat"], title="uniform")
    >>> len(fig.axes)  # two heads and the colour bar
    3
    >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
    ['the', 'cat', 'sat']
    """
    w = _as_4d(weights)  # (N, H, Lq, Lk)
    n_layers, n_heads, seq_q, seq_k = w.shape
    q_labels = _check_tokens(query_tokens, seq_q, "query_tokens", "queries (rows)")
    if key_tokens is None and q_labels is not None and seq_q == seq_k:
        k_labels = q_labels
    else:
        k_labels = _check_tokens(key_tokens, seq_k, "key_tokens", "keys (columns)")
    layer_labels = _check_names(layer_names, n_layers, "layer_names", "layer")
    head_labels = _check_names(head_names, n_heads, "head_names", "head")
    if vmax is None:
        vmax = float(min(1.0, np.nanmax(w))) if np.nanmax(w) > vmin else vmin + 1.0
    if not vmax > vmin:
        raise ValueError(f"vmax must be greater than vmin, got vmin={vmin}, vmax={vmax}")

    plt = _pyplot()
    rows, cols = _grid_shape(n_layers, n_heads)
    if ax is not None:
        if n_layers * n_heads != 1:
            raise ValueError(f"ax= draws one heatmap, but the weights hold {n_layers} layers x {n_heads} heads "
                             f"(shape {np.shape(weights)}); leave ax=None to get a grid")
        fig, grid = ax.figure, np.array([[ax]])
    else:
        fig, grid = plt.subplots(rows, cols, squeeze=False, layout="constrained",
                                 figsize=attention_figsize(n_layers, n_heads, seq_q, seq_k))
    panels = grid.ravel()[: n_layers * n_heads]
    for unused in grid.ravel()[n_layers * n_heads:]:  # the last row of wrapped heads may be short
        unused.remove()
    image = None
    q_ticks, k_ticks = _tick_positions(seq_q), _tick_positions(seq_k)
    for n, a in enumerate(panels):
        i, j = divmod(n, n_heads)  # layer, head
        image = a.imshow(w[i, j], cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
        name = []
        if n_layers > 1 or layer_names is not None:
            name.append(layer_labels[i])
        if n_heads > 1 or head_names is not None:
            name.append(head_labels[j])
        if name:
            a.set_title(", ".join(name), fontsize=10)
        a.set_xticks(k_ticks)
        a.set_yticks(q_ticks)
        a.set_xticklabels([k_labels[t] for t in k_ticks] if k_labels else [str(t) for t in k_ticks],
                          rotation=90 if k_labels and max(map(len, k_labels)) > 2 else 0, fontsize=8)
        a.set_yticklabels([q_labels[t] for t in q_ticks] if q_labels else [str(t) for t in q_ticks], fontsize=8)
        a.tick_params(length=0)
        if n + cols >= len(panels):  # no panel below this one
            a.set_xlabel("key")
        if n % cols == 0:
            a.set_ylabel("query")
    bar = fig.colorbar(image, ax=list(panels), shrink=0.9 if rows > 1 else 1.0, pad=0.02)
    bar.set_label("attention weight")
    if title:
        fig.suptitle(title)
    return fig


def _moving_average(values: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or values.size < 2:
        return values
    window = min(window, values.size)
    kernel = np.ones(window) / window
    head = np.cumsum(values[: window - 1]) / np.arange(1, window)  # (window-1,) warm-up means
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])  # (T,)


def plot_training_curve(loss: Any, accuracy: Any = None, *, steps: Any = None, eval_steps: Any = None,
                        eval_accuracy: Any = None, smooth: int | None = None, title: str | None = None):
    """Draw a training curve: the loss (log scale) and, if given, the accuracy, side by side.

    Parameters
    ----------
    loss : array_like, shape (T,)
        Training loss per step (or per logging point).
    accuracy : array_like, shape (T,), optional
        Training accuracy in [0, 1] at the same points.
    steps : array_like, shape (T,), optional
        The step numbers of the points (default ``1 .. T``).
    eval_steps, eval_accuracy : array_like, shape (E,), optional
        Held-out accuracy measured at some steps, drawn as markers on the accuracy panel.
    smooth : int, optional
        Moving-average window drawn over the raw (faint) curves; default about T / 50.
    title : str, optional

    Returns
    -------
    matplotlib.figure.Figure
        One axes (loss) or two (loss, accuracy).

    Examples
    --------
    >>> fig = plot_training_curve([2.3, 1.0, 0.5], [0.1, 0.6, 0.9])
    >>> [a.get_ylabel() for a in fig.axes]
    ['loss', 'accuracy']
    """
    loss = np.asarray(loss, dtype=np.float64).ravel()  # (T,)
    if loss.size == 0:
        raise ValueError("loss must hold at least one value")
    x = np.arange(1, loss.size + 1) if steps is None else np.asarray(steps, dtype=np.float64).ravel()
    if x.shape != loss.shape:
        raise ValueError(f"steps has {x.size} values but loss has {loss.size}")
    acc = None if accuracy is None else np.asarray(accuracy, dtype=np.float64).ravel()
    if acc is not None and acc.shape != loss.shape:
        raise ValueError(f"accuracy has {acc.size} values but loss has {loss.size}")
    if (eval_steps is None) != (eval_accuracy is None):
        raise ValueError("give eval_steps and eval_accuracy together")
    window = max(1, loss.size // 50) if smooth is None else int(smooth)

    plt = _pyplot()
    n_panels = 1 if acc is None else 2
    fig, axes = plt.subplots(1, n_panels, squeeze=False, layout="constrained", figsize=(5.0 * n_panels, 3.6))
    a = axes[0, 0]
    a.plot(x, loss, color="C0", alpha=0.3, linewidth=0.8, label="per step" if window > 1 else "loss")
    if window > 1:
        a.plot(x, _moving_average(loss, window), color="C0", linewidth=1.8, label=f"mean of {window} steps")
    if np.all(loss > 0):
        a.set_yscale("log")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.set_title("training loss (cross-entropy)", fontsize=10)
    a.grid(True, which="major", alpha=0.3)
    a.legend(fontsize=8)
    if acc is not None:
        b = axes[0, 1]
        b.plot(x, acc, color="C1", alpha=0.3, linewidth=0.8, label="train (per batch)" if window > 1 else "train")
        if window > 1:
            b.plot(x, _moving_average(acc, window), color="C1", linewidth=1.8, label=f"train (mean of {window})")
        if eval_steps is not None:
            b.plot(np.asarray(eval_steps, dtype=np.float64), np.asarray(eval_accuracy, dtype=np.float64), "o-",
                   color="C2", markersize=4, linewidth=1.2, label="held-out")
        b.set_ylim(0.0, 1.02)
        b.set_xlabel("step")
        b.set_ylabel("accuracy")
        b.set_title("token accuracy", fontsize=10)
        b.grid(True, alpha=0.3)
        b.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    return fig


# -- the interactive explorer page -------------------------------------------------------------------------
def encode_attention(weights: Any, bits: int = _MAX_BITS) -> dict:
    """Attention weights as a page stores them: ``bits`` per weight relative to its row's maximum, deflated.

    Row ``r`` of the weights (the last axis) is stored as the integers ``q = round(w / s * (2**bits - 1))``
    with ``s`` its maximum (a float32), so a decoded weight ``q * s / (2**bits - 1)`` is within
    ``s / (2 * (2**bits - 1))`` of the original: ``s / 510`` at 8 bits. A causal model's upper triangle and the
    near-zero weights of peaked heads cost almost nothing once deflated (zlib); the pages decode the data
    with the browser's own ``DecompressionStream``.

    Parameters
    ----------
    weights : array_like (..., Lq, Lk)
        Non-negative weights, e.g. (N, H, Lq, Lk) attention probabilities.
    bits : int, default 8
        From 3 to 8.

    Returns
    -------
    dict
        ``{"bits": bits, "shape": list, "q": base64 of the deflated uint8 codes (C order),
        "scale": base64 of the little-endian float32 row maxima (shape[:-1])}``.

    Examples
    --------
    >>> enc = encode_attention(np.array([[[[1.0, 0.0], [0.25, 0.75]]]]))
    >>> q = zlib.decompress(base64.b64decode(enc["q"]))
    >>> enc["bits"], list(q), np.frombuffer(base64.b64decode(enc["scale"]), np.float32).tolist()
    (8, [255, 0, 85, 255], [1.0, 0.75])
    """
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not _MIN_BITS <= bits <= _MAX_BITS:
        raise ValueError(f"bits must be an int from {_MIN_BITS} to {_MAX_BITS}, got {bits!r}")
    w = np.asarray(weights, dtype=np.float64)  # (..., Lq, Lk)
    if w.ndim < 2 or w.size == 0 or not np.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"weights must be a non-empty finite non-negative array (..., Lq, Lk), got shape {w.shape}")
    levels = (1 << int(bits)) - 1
    scale = w.max(axis=-1).astype("<f4")  # (..., Lq): the row maxima the page multiplies by
    safe = np.where(scale > 0, scale, 1).astype(np.float64)[..., None]  # (..., Lq, 1)
    q = np.rint(np.clip(w / safe, 0.0, 1.0) * levels).astype(np.uint8)  # (..., Lq, Lk)
    return {"bits": int(bits), "shape": list(w.shape),
            "q": base64.b64encode(zlib.compress(q.tobytes(), 6)).decode("ascii"),
            "scale": base64.b64encode(scale.tobytes()).decode("ascii")}


def fit_attention(weights: Any, max_bytes: int) -> dict:
    """:func:`encode_attention` with the most bits (8 down to 3) whose encoding takes at most ``max_bytes``.

    Returns the 3-bit encoding when even that is larger (the caller decides whether to warn).

    Examples
    --------
    >>> w = np.random.default_rng(0).random((4, 64, 64))
    >>> fit_attention(w, 10**6)["bits"], fit_attention(w, 12_000)["bits"] < 8
    (8, True)
    """
    for bits in range(_MAX_BITS, _MIN_BITS - 1, -1):
        encoded = encode_attention(weights, bits)
        if len(encoded["q"]) + len(encoded["scale"]) <= max_bytes:
            break
    return encoded


def _explorer_weights(weights: Any, square: bool) -> np.ndarray:
    """Check the explorer's weights: real, finite, in [0, 1]; returned as (N, H, Lq, Lk) float64."""
    w = np.asarray(weights)
    if w.dtype.kind not in "fiub":
        raise TypeError(f"weights must be a real numeric array, got dtype {w.dtype} (shape {w.shape})")
    if w.ndim not in (2, 3, 4):
        raise ValueError(f"weights must be (L, L), (heads, L, L) or (layers, heads, L, L), got shape {w.shape}")
    if 0 in w.shape:
        raise ValueError(f"weights must not be empty, got shape {w.shape}")
    if square and w.shape[-1] != w.shape[-2]:
        raise ValueError(f"weights must be self-attention with as many keys as queries (..., L, L), got shape "
                         f"{w.shape} (pass query_tokens for cross-attention)")
    w = w.reshape((1,) * (4 - w.ndim) + w.shape).astype(np.float64)  # (N, H, Lq, Lk)
    if not np.isfinite(w).all():
        raise ValueError(f"weights must be finite, got {int(np.size(w) - np.isfinite(w).sum())} NaN or infinite values")
    low, high = float(w.min()), float(w.max())
    if low < -_PROBABILITY_SLACK or high > 1 + _PROBABILITY_SLACK:
        raise ValueError(f"weights must be attention probabilities in [0, 1], got values from {low:.4g} to {high:.4g}")
    return np.clip(w, 0.0, 1.0)


def _script_json(value: Any) -> str:
    """JSON that is safe inside a ``<script>`` element: ``<``, ``>`` and ``&`` become escapes JSON reads back."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def attention_html(tokens: Sequence[Any], weights: Any, path: str | os.PathLike, *,
                   title: str = "attnkit attention explorer", layer_names: Sequence[Any] | None = None,
                   head_names: Sequence[Any] | None = None, raw_tokens: Sequence[Any] | None = None,
                   query_tokens: Sequence[Any] | None = None, raw_query_tokens: Sequence[Any] | None = None,
                   max_bytes: int | None = None) -> Path:
    """Write an interactive attention explorer: one self-contained HTML file that needs no network.

    The page shows the tokens, a heat map and a line view of one head with a colour scale (auto: 0 to the
    head's maximum, 0..1, or log) and its legend, a layer and a head control, and a thumbnail of every head
    of every layer (click one to select it). Hovering, clicking or tabbing to a token highlights where it
    attends and what attends to it, and shows the raw token; arrow keys move between tokens, ``[`` and ``]``
    switch heads, ``{`` and ``}`` switch layers. Long sequences stay readable: the heat map's axis labels
    thin out and beyond 48 tokens the line view draws the selected token's lines only (up to 1,024 tokens
    and more). Script, style and data are inline, so the file opens from disk, from an e-mail or from a
    static web server alike. Once decoded, the page's script exposes the data as ``window.attnkitData =
    {tokens, raw_tokens, query_tokens, bits, attention: [layer][head][query][key]}``.

    Parameters
    ----------
    tokens : sequence of Lk tokens
        The labels of the positions (of the keys, for cross-attention); anything ``str`` accepts. They are
        shown as text, never read as HTML.
    weights : array_like, shape (Lq, Lk), (H, Lq, Lk) or (N, H, Lq, Lk)
        Attention probabilities of one example, e.g. ``weights[0]`` of a ``MultiHeadAttention`` call,
        or every layer's stacked. Row ``i`` is what query ``i`` attends to. Values must lie in [0, 1];
        ``Lq == Lk`` unless ``query_tokens`` is given.
    path : str or os.PathLike
        The HTML file to write (its folder must exist). Written atomically: a temporary file in the same
        folder, then ``os.replace``.
    title : str, default "attnkit attention explorer"
        The page's heading and window title (shown as text).
    layer_names, head_names : sequence of str, optional
        Names of the N layers and H heads in the controls (default ``"layer i"``, ``"head j"``).
    raw_tokens : sequence of Lk str, optional
        The raw tokenizer pieces, shown on hover (default: ``tokens``).
    query_tokens, raw_query_tokens : sequence of Lq str, optional
        Cross-attention: the labels of the queries (rows), e.g. a decoder's tokens reading an encoder's.
    max_bytes : int, optional
        The page's budget, default :data:`HTML_SIZE_WARNING_BYTES` (5 MB). Weights are stored with 8 bits
        each relative to their row's maximum (see :func:`encode_attention`: a decoded weight is within
        ``row max / 510`` of the original); when that would exceed the budget they get fewer bits, down to
        3 (``row max / 14``). ``window.attnkitData.bits`` says which.

    Returns
    -------
    pathlib.Path
        The file written.

    Raises
    ------
    TypeError
        ``tokens`` is a string, or ``weights`` is not numeric.
    ValueError
        ``weights`` of another rank, not square (without ``query_tokens``), empty, not finite or outside
        [0, 1]; as many tokens or names as the weights need; ``max_bytes`` not a positive int.

    Warns
    -----
    UserWarning
        When the page exceeds ``max_bytes`` even with 3 bits per weight; it is still written. Fewer layers,
        heads or tokens make it smaller.

    Shapes
    ------
    N layers, H heads, Lq queries, Lk keys. At 8 bits, deflated, a weight takes from almost nothing (zeros,
    a causal mask's upper triangle) to 1.4 bytes (noise): 30 layers x 9 heads x 256 tokens of a randomly
    initialised decoder fit in 4.8 MB at 4 bits, six MiniLM layers x 12 heads x 254 tokens in 2.8 MB at 8.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> w = np.full((2, 3, 3, 3), 1 / 3)  # (N, H, L, L)
    >>> page = attention_html(["the", "cat", "sat"], w, folder / "attention.html", title="uniform")
    >>> text = page.read_text(encoding="utf-8")
    >>> 'data-testid="layer"' in text, "http://" in text or "https://" in text
    (True, False)
    >>> attention_html(["the", "cat"], w, folder / "bad.html")
    Traceback (most recent call last):
    ...
    ValueError: tokens has 2 tokens, but the weights have 3 positions
    """
    w = _explorer_weights(weights, square=query_tokens is None)  # (N, H, Lq, Lk)
    n_layers, n_heads, seq_q, seq_k = w.shape
    labels = _check_tokens(tokens, seq_k, "tokens", "positions" if query_tokens is None else "keys (columns)")
    if labels is None:
        raise TypeError("tokens must be a sequence of L tokens, got None")
    raw = _check_tokens(raw_tokens, seq_k, "raw_tokens", "keys") or labels
    data: dict[str, Any] = {"tokens": labels, "raw_tokens": raw}
    if query_tokens is not None:
        q_labels = _check_tokens(query_tokens, seq_q, "query_tokens", "queries (rows)")
        data["query_tokens"] = q_labels
        data["raw_query_tokens"] = _check_tokens(raw_query_tokens, seq_q, "raw_query_tokens", "queries") or q_labels
    elif raw_query_tokens is not None:
        raise ValueError("raw_query_tokens needs query_tokens (cross-attention); for self-attention pass raw_tokens")
    data["layer_names"] = _check_names(layer_names, n_layers, "layer_names", "layer")
    data["head_names"] = _check_names(head_names, n_heads, "head_names", "head")
    if max_bytes is None:
        max_bytes = HTML_SIZE_WARNING_BYTES  # read at call time, so it can be changed
    max_bytes = check_positive_int(max_bytes, "max_bytes")
    target = Path(path)
    if not target.parent.is_dir():
        raise ValueError(f"path's folder {str(target.parent)!r} does not exist (path={str(path)!r})")
    if target.is_dir():
        raise ValueError(f"path must be a file name, got the folder {str(path)!r}")

    template = importlib.resources.files("attnkit").joinpath("templates/attention_explorer.html")
    text = template.read_text(encoding="utf-8")

    def render(attention: dict) -> str:
        values = {"TITLE": html.escape(str(title)), "DATA": _script_json(dict(data, attention=attention))}
        return re.sub(r"\{\{(TITLE|DATA)\}\}", lambda m: values[m.group(1)], text)

    rest = len(render({"bits": 8, "shape": list(w.shape), "q": "", "scale": ""}).encode("utf-8"))
    page = render(fit_attention(w, max(0, int(max_bytes) - rest)))
    size = len(page.encode("utf-8"))
    if size > max_bytes:
        warnings.warn(f"the attention page {str(target)!r} is {size / 1e6:.1f} MB ({n_layers} layers x {n_heads} "
                      f"heads x {seq_q} x {seq_k} weights at 3 bits each), over max_bytes={max_bytes}; browsers "
                      f"open such pages slowly: pass fewer layers, heads or tokens", UserWarning, stacklevel=2)
    atomic_write(target, lambda f: f.write(page.encode("utf-8")))
    return target


_TILE_COLOURS = ("#f2f2f2", "#f4b183", "#c55a11", "#2f5597")  # skipped tile, masked / kept in a partial tile, full
_DENSE_LIMIT = 4_000_000  # cells drawn one by one up to this many, tiles only beyond


def plot_block_mask(block_mask: Any, *, batch: int = 0, head: int = 0, ax: Any = None, title: str | None = None):
    """Draw a :class:`~attnkit.flex.BlockMask`: which tiles the tiled kernel skips, masks or runs unmasked.

    Up to 4 million cells, every cell is drawn: skipped tiles pale grey, cells of partial tiles light (masked)
    or dark orange (attended), full tiles blue; beyond that, one colour per tile. Tile borders are drawn when
    the tiles are at least a few pixels wide.

    Parameters
    ----------
    block_mask : attnkit.flex.BlockMask
    batch, head : int
        Which (b, h) to draw (0 when the mask was built for all batches / heads at once).
    ax : matplotlib Axes, optional
        Draw into this axes instead of a new figure.
    title : str, optional
        Default: the share of tiles skipped, partial and full.

    Returns
    -------
    matplotlib.figure.Figure
        ``fig.axes[0].images[0].get_array()`` holds the drawn codes: 0 skipped, 1 masked cell of a partial
        tile, 2 attended cell of a partial tile, 3 full tile; shape (Lq, Lk) or, beyond the cell limit,
        (nQ, nK) with 1 for partial tiles.

    Examples
    --------
    >>> from attnkit.flex import create_block_mask, sliding_window_mask
    >>> bm = create_block_mask(sliding_window_mask(3), None, None, 8, 8, block_size=4)
    >>> fig = plot_block_mask(bm)
    >>> fig.axes[0].images[0].get_array()[:, :4].astype(int).tolist()[:4]
    [[2, 1, 1, 1], [2, 2, 1, 1], [2, 2, 2, 1], [1, 2, 2, 2]]
    """
    from .flex.masks import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be an attnkit.flex.BlockMask, got {type(block_mask).__name__}")
    kinds_all = block_mask.kinds
    b = _check_index(batch, kinds_all.shape[0], "batch")
    h = _check_index(head, kinds_all.shape[1], "head")
    kinds = kinds_all[b, h]  # (nQ, nK)
    lq, lk, bq, bk = block_mask.q_len, block_mask.kv_len, block_mask.block_q, block_mask.block_k
    if lq * lk <= _DENSE_LIMIT:
        tile_kind = np.repeat(np.repeat(kinds, bq, axis=0), bk, axis=1)[:lq, :lk]  # (Lq, Lk)
        allowed = np.broadcast_to(block_mask.tile_mask(0, lq, 0, lk), (*kinds_all.shape[:2], lq, lk))[b, h]
        codes = np.where(tile_kind == 0, 0, np.where(tile_kind == 2, 3, np.where(allowed, 2, 1)))  # (Lq, Lk)
        extent = (-0.5, lk - 0.5, lq - 0.5, -0.5)
    else:
        codes = np.where(kinds == 2, 3, kinds)  # (nQ, nK)
        extent = (-0.5, kinds.shape[1] * bk - 0.5, kinds.shape[0] * bq - 0.5, -0.5)
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(6, 6 * min(2.0, max(0.5, lq / lk))),
                                                                  layout="constrained")
    ax.imshow(codes.astype(float), cmap=ListedColormap(_TILE_COLOURS), vmin=0, vmax=3, extent=extent,
              interpolation="nearest", aspect="auto")
    n_q, n_k = kinds.shape
    if n_q <= 64 and n_k <= 64:  # tile borders, while they stay visible
        for i in range(1, n_q):
            ax.axhline(i * bq - 0.5, color="white", linewidth=0.6)
        for j in range(1, n_k):
            ax.axvline(j * bk - 0.5, color="white", linewidth=0.6)
    ax.set_xlim(-0.5, lk - 0.5)
    ax.set_ylim(lq - 0.5, -0.5)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    shares = [float(np.mean(kinds == kind)) for kind in (0, 1, 2)]
    ax.set_title(title if title is not None else
                 f"{lq} x {lk}, tiles {bq} x {bk}: {shares[0]:.0%} skipped, {shares[1]:.0%} partial, "
                 f"{shares[2]:.0%} full", fontsize=10)
    ax.legend(handles=[Patch(color=c, label=t) for c, t in zip(_TILE_COLOURS, (
        "skipped tile", "masked (partial tile)", "attended (partial tile)", "full tile"))],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, framealpha=0.9)
    return fig


def _check_index(value: Any, size: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if size == 1:  # built for every batch / head at once
        return 0
    if not 0 <= value < size:
        raise ValueError(f"{name} must be in [0, {size}), got {value}")
    return int(value)


def plot_score_mod(score_mod: Any, q: Any, k: Any, *, mask_mod: Any = None, batch: int = 0, head: int = 0,
                   scale: float | None = None, ax: Any = None):
    """Scores of one head before and after a score modifier (and the mask), side by side.

    Parameters
    ----------
    score_mod : ScoreMod or callable ``(score, b, h, q_idx, kv_idx) -> score``
    q : array_like (B, H, Lq, D)
    k : array_like (B, H, Lk, D)
        Keys with the query heads' count (expand grouped K/V first).
    mask_mod : callable ``(b, h, q_idx, kv_idx) -> bool``, optional
        Masked cells are left blank in the right panel.
    batch, head : int
    scale : float, optional
        Default ``D ** -0.5``.
    ax : sequence of two matplotlib Axes, optional

    Returns
    -------
    matplotlib.figure.Figure
        ``fig.axes[0]`` the raw scores ``scale * q k^T``, ``fig.axes[1]`` the modified (masked: NaN) ones,
        each with its colour bar.

    Examples
    --------
    >>> from attnkit.flex import softcap
    >>> q = np.linspace(-3, 3, 8).reshape(1, 1, 4, 2); k = q.copy()
    >>> fig = plot_score_mod(softcap(1.0), q, k)
    >>> float(np.nanmax(fig.axes[1].images[0].get_array())) < 1.0 < float(fig.axes[0].images[0].get_array().max())
    True
    """
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    if q.ndim != 4 or k.ndim != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q must be (B, H, Lq, D) and k (B, H, Lk, D) with the same B, H and D, got {q.shape} "
                         f"and {k.shape}")
    b = _check_index(batch, q.shape[0], "batch")
    h = _check_index(head, q.shape[1], "head")
    lq, lk = q.shape[2], k.shape[2]
    scale = q.shape[3] ** -0.5 if scale is None else float(scale)
    raw = scale * (q[b, h] @ k[b, h].T)  # (Lq, Lk)
    idx = (np.full((1, 1, 1, 1), b), np.full((1, 1, 1, 1), h), np.arange(lq).reshape(1, 1, -1, 1),
           np.arange(lk).reshape(1, 1, 1, -1))
    forward = getattr(score_mod, "forward", score_mod)
    if not callable(forward):
        raise TypeError(f"score_mod must be a ScoreMod or a callable, got {type(score_mod).__name__}")
    modified = np.broadcast_to(forward(raw[None, None], *idx), (1, 1, lq, lk))[0, 0].astype(np.float64)  # (Lq, Lk)
    if mask_mod is not None:
        keep = np.broadcast_to(mask_mod(*idx), (1, 1, lq, lk))[0, 0]  # (Lq, Lk)
        modified = np.where(keep, modified, np.nan)
    plt = _pyplot()
    if ax is None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.5 * min(2.0, max(0.5, lq / lk))), layout="constrained")
    else:
        axes = list(ax)
        if len(axes) != 2:
            raise ValueError(f"ax must hold two Axes (before, after), got {len(axes)}")
        fig = axes[0].figure
    for a, values, name in ((axes[0], raw, "scores"), (axes[1], modified, "after the modifier"
                                                        + (" and mask" if mask_mod is not None else ""))):
        image = a.imshow(values, cmap="viridis", aspect="auto", interpolation="nearest")
        a.set_title(name, fontsize=10)
        a.set_xlabel("key")
        a.set_ylabel("query")
        fig.colorbar(image, ax=a)
    return fig
