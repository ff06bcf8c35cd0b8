"""Sparse autoencoders and transcoders (an :class:`SAE`), and SAELens's folders read into them (:func:`load_sae`).

An SAE reads the activation x at one hook point and writes a reconstruction there; a transcoder reads one point
(an MLP's input stream) and writes another (that MLP's output). Both encode
``pre = (x - b_dec * apply_b_dec_to_input) @ W_enc + b_enc``, then ``acts = f(pre)`` with f one of

- ``"standard"`` (and ``"transcoder"``): ``relu(pre)``;
- ``"jumprelu"`` (and ``"jumprelu_transcoder"``): ``relu(pre)`` where ``pre > threshold``, else 0;
- ``"topk"``: the k largest ``pre`` of each position through ``relu``, the others 0 (``pre`` times the decoder
  rows' norms first, and ``acts`` divided by them before decoding, with ``rescale_acts_by_decoder_norm``);

and decode ``acts @ W_dec + b_dec``. An SAE may normalise each position first, as SAELens's
``normalize_activations`` does (``"layer_norm"``: ``(x - mean) / (std + 1e-5)``; ``"constant_norm_rescale"``:
``x * sqrt(D) / |x|``), and restore the output with the same statistics.

:func:`load_sae` reads a SAELens folder (``cfg.json`` and ``sae_weights.safetensors``, as ``SAE.save_model``
writes them) with attnkit's own safetensors reader; SAELens is never imported. Splicing an SAE into a model is
:mod:`attnkit.explain.sae_splice`.

Shapes: D the activation's width (``d_in``; ``d_out`` for a transcoder's output), S features (``d_sae``).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..io import read_json
from ..pretrained.checkpoint import read_file_headers, read_tensor

__all__ = ["SAE", "load_sae"]

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
ARCHITECTURES = ("standard", "jumprelu", "topk", "transcoder", "jumprelu_transcoder")
# SAELens's normalisations of each position, undone on the output: none; (x - mean) / (std + 1e-5), std with
# Bessel's correction, out = recons * std + mean; x * sqrt(D) / |x|, out = recons * |x| / sqrt(D).
NORMALIZATIONS = ("none", "layer_norm", "constant_norm_rescale")
_LN_EPS = 1e-5


class SAE:
    """A sparse autoencoder or transcoder: its weights, activation function and the hook points it reads and writes.

    Parameters
    ----------
    W_enc : array_like (D, S)
    b_enc : array_like (S,)
    W_dec : array_like (S, D_out)
    b_dec : array_like (D_out,)
    hook_name : str
        The point read (SAELens's ``metadata.hook_name``).
    architecture : {"standard", "jumprelu", "topk", "transcoder", "jumprelu_transcoder"}
    threshold : array_like (S,), optional
        JumpReLU's thresholds (the jumprelu architectures only).
    k : int, optional
        TopK's k (``"topk"`` only).
    apply_b_dec_to_input : bool, default True
        Subtract ``b_dec`` from the input before encoding (never for a transcoder).
    normalize_activations : {"none", "layer_norm", "constant_norm_rescale"}
        SAELens's normalisation of each position's input, undone on its output (SAEs only).
    rescale_acts_by_decoder_norm : bool, default False
        TopK's scaling of the pre-activations by the decoder rows' norms.
    hook_name_out : str, optional
        The point a transcoder writes (default ``hook_name``).
    cfg : dict, optional
        The ``cfg.json`` it came from, kept as read.

    Attributes
    ----------
    W_enc, b_enc, W_dec, b_dec, threshold : ndarray
        Read-only copies, float32 or float64 as given (float16 widened to float32).
    d_in, d_sae, d_out : int
    is_transcoder : bool
        Whether it writes another point than it reads (or to another width).

    Examples
    --------
    >>> sae = SAE(np.eye(2), np.zeros(2), np.eye(2), np.zeros(2), hook_name="blocks.0.hook_resid_post")
    >>> sae
    SAE(architecture='standard', hook_name='blocks.0.hook_resid_post', d_in=2, d_sae=2)
    >>> sae.encode(np.array([[0.5, -1.0]])).tolist()
    [[0.5, 0.0]]
    """

    def __init__(self, W_enc: Any, b_enc: Any, W_dec: Any, b_dec: Any, *, hook_name: str,
                 architecture: str = "standard", threshold: Any = None, k: int | None = None,
                 apply_b_dec_to_input: bool = True, rescale_acts_by_decoder_norm: bool = False,
                 hook_name_out: str | None = None, normalize_activations: str = "none",
                 cfg: Mapping | None = None) -> None:
        if architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {', '.join(ARCHITECTURES)}, got {architecture!r}")
        if not isinstance(hook_name, str) or not hook_name:
            raise ValueError(f"hook_name must be a hook point's name, got {hook_name!r}")
        if hook_name_out is not None and (not isinstance(hook_name_out, str) or not hook_name_out):
            raise ValueError(f"hook_name_out must be None or a hook point's name, got {hook_name_out!r}")
        self.W_enc, self.b_enc = _weight(W_enc, "W_enc", 2), _weight(b_enc, "b_enc", 1)
        self.W_dec, self.b_dec = _weight(W_dec, "W_dec", 2), _weight(b_dec, "b_dec", 1)
        d_in, d_sae = self.W_enc.shape
        shapes = {"b_enc": (d_sae,), "W_dec": (d_sae, self.W_dec.shape[1]), "b_dec": (self.W_dec.shape[1],)}
        for name, shape in shapes.items():
            if getattr(self, name).shape != shape:
                raise ValueError(f"{name} has shape {getattr(self, name).shape}, but W_enc {self.W_enc.shape} "
                                 f"and W_dec {self.W_dec.shape} imply {shape}")
        self.architecture, self.hook_name = architecture, hook_name
        self.hook_name_out = hook_name_out
        self.is_transcoder = architecture.endswith("transcoder") or self.W_dec.shape[1] != d_in or \
            (hook_name_out is not None and hook_name_out != hook_name)
        if self.is_transcoder and apply_b_dec_to_input:
            raise ValueError("apply_b_dec_to_input must be False for a transcoder (b_dec has the output's width)")
        self.apply_b_dec_to_input = bool(apply_b_dec_to_input)
        self.threshold = None
        if architecture.startswith("jumprelu"):
            if threshold is None:
                raise ValueError(f"a {architecture} SAE needs threshold (S,)")
            self.threshold = _weight(threshold, "threshold", 1)
            if self.threshold.shape != (d_sae,):
                raise ValueError(f"threshold has shape {self.threshold.shape}, expected ({d_sae},)")
        elif threshold is not None:
            raise ValueError(f"threshold is for the jumprelu architectures, not {architecture!r}")
        self.k = None
        if architecture == "topk":
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= d_sae:
                raise ValueError(f"k must be an int in [1, {d_sae}] for a topk SAE, got {k!r}")
            self.k = int(k)
        elif k is not None:
            raise ValueError(f"k is for the topk architecture, not {architecture!r}")
        if rescale_acts_by_decoder_norm and architecture != "topk":
            raise ValueError("rescale_acts_by_decoder_norm is TopK's option")
        self.rescale_acts_by_decoder_norm = bool(rescale_acts_by_decoder_norm)
        if normalize_activations not in NORMALIZATIONS:
            raise ValueError(f"normalize_activations must be one of {', '.join(NORMALIZATIONS)}, got "
                             f"{normalize_activations!r}")
        if normalize_activations != "none" and self.is_transcoder:
            raise ValueError(f"normalize_activations {normalize_activations!r} is for SAEs, not transcoders")
        self.normalize_activations = normalize_activations
        self.cfg = dict(cfg) if cfg is not None else {}

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_out(self) -> int:
        return self.W_dec.shape[1]

    @property
    def output_hook_name(self) -> str:
        """The point written: ``hook_name_out`` for a transcoder, else ``hook_name``; its SAE points are named
        after it."""
        return self.hook_name_out or self.hook_name

    def __repr__(self) -> str:
        out = f", hook_name_out={self.hook_name_out!r}" if self.hook_name_out else ""
        return (f"SAE(architecture={self.architecture!r}, hook_name={self.hook_name!r}{out}, d_in={self.d_in}, "
                f"d_sae={self.d_sae})")

    @classmethod
    def load_from_disk(cls, path: str | os.PathLike) -> SAE:
        """SAELens's name for :func:`load_sae`."""
        return load_sae(path)

    # -- the computation -----------------------------------------------------------------------------------
    def _weights(self, dtype: np.dtype) -> tuple[np.ndarray, ...]:
        """W_enc, b_enc, W_dec, b_dec and the decoder rows' norms (S,) in ``dtype`` (the activation's)."""
        key = np.dtype(dtype)
        cached = getattr(self, "_cast", None)
        if cached is None or cached[0] != key:
            arrays = tuple(a.astype(key) for a in (self.W_enc, self.b_enc, self.W_dec, self.b_dec))
            norms = np.linalg.norm(arrays[2], axis=-1)  # (S,)
            cached = (key, arrays + (norms,))
            self._cast = cached
        return cached[1]

    def normalize(self, x: Any) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """``(x normalised (..., D), scale (..., 1), shift (..., 1))``: the input the encoder reads, and how the
        output is restored (``recons * scale + shift``); scale and shift None without a normalisation."""
        x = _activation(x, self.d_in, "x")
        if self.normalize_activations == "layer_norm":
            shift = x.mean(axis=-1, keepdims=True)  # (..., 1)
            centred = x - shift  # (..., D)
            scale = np.sqrt((centred * centred).sum(axis=-1, keepdims=True) / (x.shape[-1] - 1))  # (..., 1)
            return centred / (scale + _LN_EPS), scale, shift
        if self.normalize_activations == "constant_norm_rescale":
            root = x.dtype.type(np.sqrt(x.shape[-1]))  # in x's dtype: a float64 scalar would widen float32
            scale = np.linalg.norm(x, axis=-1, keepdims=True) / root  # (..., 1)
            return x / scale, scale, np.zeros_like(scale)
        return x, None, None

    def normalize_backward(self, x: np.ndarray, grad_xn: np.ndarray, grad_scale: np.ndarray,
                           grad_shift: np.ndarray) -> np.ndarray:
        """The gradient (..., D) with respect to x of what reached :meth:`normalize`'s outputs: ``grad_xn``
        (..., D) the normalised input's, ``grad_scale`` and ``grad_shift`` (..., 1) those of scale and shift."""
        d = x.shape[-1]
        if self.normalize_activations == "layer_norm":
            centred = x - x.mean(axis=-1, keepdims=True)  # (..., D)
            std = np.sqrt((centred * centred).sum(axis=-1, keepdims=True) / (d - 1))  # (..., 1)
            d_std = centred / ((d - 1) * std)  # (..., D): d std / dx (centred already)
            a = std + _LN_EPS
            g_centred = grad_xn / a - (grad_xn * centred).sum(axis=-1, keepdims=True) / (a * a) * d_std
            g = g_centred - g_centred.mean(axis=-1, keepdims=True)  # through the centring
            return g + grad_scale * d_std + grad_shift / d
        root = x.dtype.type(np.sqrt(d))
        norm = np.linalg.norm(x, axis=-1, keepdims=True)  # (..., 1)
        unit = x / norm  # (..., D)
        g = root * (grad_xn - unit * (unit * grad_xn).sum(axis=-1, keepdims=True)) / norm
        return g + grad_scale * unit / root

    def encode_pre(self, x: Any) -> np.ndarray:
        """The pre-activations ``(x - b_dec) @ W_enc + b_enc`` (..., S) of x normalised, in ``x``'s float dtype
        (TopK's scaled by the decoder rows' norms with ``rescale_acts_by_decoder_norm``)."""
        return self._pre(self.normalize(x)[0])

    def _pre(self, x: np.ndarray) -> np.ndarray:
        w_enc, b_enc, _, b_dec, norms = self._weights(x.dtype)
        if self.apply_b_dec_to_input:
            x = x - b_dec  # (..., D)
        pre = x @ w_enc + b_enc  # (..., S)
        return pre * norms if self.rescale_acts_by_decoder_norm else pre

    def activate(self, pre: np.ndarray) -> np.ndarray:
        """The feature activations (..., S) of pre-activations (..., S)."""
        return pre * self._open(pre)

    def _open(self, pre: np.ndarray) -> np.ndarray:
        """Where the activation passes ``pre`` on (and so its derivative, 1 there, 0 elsewhere), as ``pre``'s
        dtype (..., S)."""
        positive = pre > 0  # (..., S)
        if self.threshold is not None:
            positive &= pre > self.threshold.astype(pre.dtype)
        elif self.k is not None:
            top = np.argpartition(-pre, self.k - 1, axis=-1)[..., :self.k]  # (..., k): any order, as torch.topk
            chosen = np.zeros(pre.shape, dtype=bool)  # (..., S)
            np.put_along_axis(chosen, top, True, axis=-1)
            positive &= chosen
        return positive.astype(pre.dtype)

    def encode(self, x: Any) -> np.ndarray:
        """The feature activations (..., S) of activations x (..., D)."""
        return self.activate(self.encode_pre(x))

    def decode(self, acts: Any) -> np.ndarray:
        """The reconstruction ``acts @ W_dec + b_dec`` (..., D_out) of feature activations (..., S); for a
        normalising SAE in the normalised space (SAELens's ``hook_sae_recons``: :meth:`__call__` restores it)."""
        acts = _activation(acts, self.d_sae, "acts")
        _, _, w_dec, b_dec, norms = self._weights(acts.dtype)
        if self.rescale_acts_by_decoder_norm:
            acts = acts / norms  # (..., S)
        return acts @ w_dec + b_dec  # (..., D_out)

    def __call__(self, x: Any) -> np.ndarray:
        """The output (..., D_out): ``decode(encode(x))``, the normalisation undone."""
        xn, scale, shift = self.normalize(x)
        recons = self.decode(self.activate(self._pre(xn)))
        return recons if scale is None else recons * scale + shift


def _weight(value: Any, name: str, ndim: int) -> np.ndarray:
    arr = np.array(value)  # a copy: never the caller's array
    if arr.dtype.kind not in "fiu" or arr.ndim != ndim or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty {ndim}-D array of numbers, got shape {arr.shape} and dtype "
                         f"{arr.dtype}")
    arr = arr.astype(np.float64 if arr.dtype == np.float64 else np.float32, copy=False)
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} holds NaN or infinite values")
    arr.flags.writeable = False
    return arr


def _activation(x: Any, width: int, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        arr = arr.astype(np.float64)
    if arr.ndim == 0 or arr.shape[-1] != width:
        raise ValueError(f"{name} must have {width} features on its last axis, got shape {arr.shape}")
    return arr


# -- loading SAELens's folders ------------------------------------------------------------------------------

def load_sae(path: str | os.PathLike) -> SAE:
    """An SAE or transcoder from a SAELens folder: ``cfg.json`` and ``sae_weights.safetensors`` (what SAELens's
    ``SAE.save_model`` writes and ``SAE.load_from_disk`` reads).

    The config is checked before any weight is read: a supported architecture (``standard``, ``jumprelu``,
    ``topk``, ``transcoder``, ``jumprelu_transcoder``), ``normalize_activations`` ``"none"``, ``"layer_norm"`` or
    ``"constant_norm_rescale"`` (SAEs), the hook names; then
    every tensor's name, dtype and shape from the safetensors header against ``d_in``, ``d_sae``, ``d_out``.

    Parameters
    ----------
    path : str or os.PathLike
        The folder.

    Returns
    -------
    SAE
        Its arrays float32 (float64 if stored so).

    Raises
    ------
    FileNotFoundError
        No such folder, or a file missing from it.
    ValueError
        Naming the file and the key or tensor: an architecture or normalisation attnkit does not run (named), a
        missing hook name, a tensor missing, unexpected, of the wrong shape or not a float.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; a SAELens SAE is a folder with {CFG_FILE} and "
                                f"{WEIGHTS_FILE}")
    for name in (CFG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder} has no {name} (a SAELens SAE folder holds {CFG_FILE} and "
                                    f"{WEIGHTS_FILE})")
    cfg = read_json(folder / CFG_FILE)
    options = _check_cfg(folder / CFG_FILE, cfg)
    weights = folder / WEIGHTS_FILE
    headers = read_file_headers(weights)
    expected = {"W_enc": (options["d_in"], options["d_sae"]), "b_enc": (options["d_sae"],),
                "W_dec": (options["d_sae"], options["d_out"]), "b_dec": (options["d_out"],)}
    if options["architecture"].startswith("jumprelu"):
        expected["threshold"] = (options["d_sae"],)
    for name, shape in expected.items():
        if name not in headers:
            raise ValueError(f"{weights}: no tensor {name!r}, which a {options['architecture']} SAE needs")
        header = headers[name]
        if header.dtype not in ("F64", "F32", "F16", "BF16"):
            raise ValueError(f"{weights}: tensor {name!r} has dtype {header.dtype}; attnkit reads F64, F32, F16, "
                             f"BF16")
        if header.shape != shape:
            raise ValueError(f"{weights}: tensor {name!r} has shape {header.shape}; {CFG_FILE} implies {shape}")
    unexpected = sorted(set(headers) - set(expected))
    if unexpected:
        raise ValueError(f"{weights}: unexpected tensor {unexpected[0]!r} for a {options['architecture']} SAE "
                         f"(a skip transcoder's W_skip or a training SAE's log_threshold is not read)")
    with open(weights, "rb") as fh:
        arrays = {name: read_tensor(fh, headers[name], name) for name in expected}
    try:
        return SAE(arrays["W_enc"], arrays["b_enc"], arrays["W_dec"], arrays["b_dec"],
                   hook_name=options["hook_name"], architecture=options["architecture"],
                   threshold=arrays.get("threshold"), k=options["k"],
                   apply_b_dec_to_input=options["apply_b_dec_to_input"],
                   rescale_acts_by_decoder_norm=options["rescale_acts_by_decoder_norm"],
                   hook_name_out=options["hook_name_out"], normalize_activations=options["norm"], cfg=cfg)
    except ValueError as exc:
        raise ValueError(f"{folder}: {exc}") from None


def _check_cfg(path: Path, cfg: dict) -> dict[str, Any]:
    """The options of a SAELens ``cfg.json``, or a ValueError naming the key."""
    architecture = cfg.get("architecture", "standard")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {architecture!r} is not one attnkit runs (it runs "
                         f"{', '.join(ARCHITECTURES)})")
    norm = cfg.get("normalize_activations", "none")
    if norm not in NORMALIZATIONS:
        raise ValueError(f"{path}: normalize_activations {norm!r} is not supported (attnkit runs "
                         f"{', '.join(NORMALIZATIONS)}; SAELens's from_pretrained folds 'expected_average_only_in' "
                         f"into the weights with a scaling factor the folder does not hold)")
    if norm != "none" and architecture.endswith("transcoder"):
        raise ValueError(f"{path}: normalize_activations {norm!r} on a transcoder is not supported")
    reshape = cfg.get("reshape_activations", "none")
    if reshape not in ("none", "hook_z"):
        raise ValueError(f"{path}: reshape_activations {reshape!r} is not 'none' or 'hook_z'")
    metadata = cfg.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: metadata must be an object, got {type(metadata).__name__}")
    hook_name = metadata.get("hook_name", cfg.get("hook_name"))
    if not isinstance(hook_name, str) or not hook_name:
        raise ValueError(f"{path}: no hook name (metadata.hook_name): which point the SAE reads")
    hook_name_out = metadata.get("hook_name_out", cfg.get("hook_name_out"))
    if metadata.get("hook_head_index") is not None:
        raise ValueError(f"{path}: metadata.hook_head_index {metadata['hook_head_index']!r}: SAEs on one head's "
                         f"slice are not supported")
    sizes = {}
    for key in ("d_in", "d_sae"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}: {key} must be a positive int, got {value!r}")
        sizes[key] = value
    transcoder = architecture.endswith("transcoder")
    d_out = cfg.get("d_out", sizes["d_in"]) if transcoder else sizes["d_in"]
    if isinstance(d_out, bool) or not isinstance(d_out, int) or d_out < 1:
        raise ValueError(f"{path}: d_out must be a positive int, got {d_out!r}")
    apply = cfg.get("apply_b_dec_to_input", not transcoder)
    if not isinstance(apply, bool):
        raise ValueError(f"{path}: apply_b_dec_to_input must be true or false, got {apply!r}")
    k = cfg.get("k") if architecture == "topk" else None
    if architecture == "topk" and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= sizes["d_sae"]):
        raise ValueError(f"{path}: k must be an int in [1, d_sae = {sizes['d_sae']}] for a topk SAE, got {k!r}")
    return {"architecture": architecture, "hook_name": hook_name, "hook_name_out": hook_name_out, "norm": norm,
            "d_out": d_out, "apply_b_dec_to_input": apply, "k": k,
            "rescale_acts_by_decoder_norm": bool(cfg.get("rescale_acts_by_decoder_norm", False)) and
            architecture == "topk", **sizes}
