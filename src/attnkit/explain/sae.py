"""Sparse autoencoders and transcoders: SAELens's folders loaded, spliced into a model at a hook point, their
features read, ablated, steered and attributed with the exact gradient.

An SAE reads the activation x at one hook point and writes a reconstruction there; a transcoder reads one point
(an MLP's input stream) and writes another (that MLP's output). Both encode
``pre = (x - b_dec * apply_b_dec_to_input) @ W_enc + b_enc``, then ``acts = f(pre)`` with f one of

- ``"standard"`` (and ``"transcoder"``): ``relu(pre)``;
- ``"jumprelu"`` (and ``"jumprelu_transcoder"``): ``relu(pre)`` where ``pre > threshold``, else 0;
- ``"topk"``: the k largest ``pre`` of each position through ``relu``, the others 0 (``pre`` times the decoder
  rows' norms first, and ``acts`` divided by them before decoding, with ``rescale_acts_by_decoder_norm``);

and decode ``acts @ W_dec + b_dec``. An SAE may normalise each position first, as SAELens's
``normalize_activations`` does (``"layer_norm"``: ``(x - mean) / (std + 1e-5)``; ``"constant_norm_rescale"``:
``x * sqrt(D) / |x|``), and restore the output with the same statistics. With the error term the model's value is
kept whole: what the spliced point passes on is ``recons(acts) + (x - recons(clean acts))``, the error computed
from the features before any feature hook ran, so without hooks the model's outputs are unchanged (to rounding)
and with them only the hooks' edits reach the model. As in SAELens, the error is a constant for the backward (it
is computed under ``no_grad`` there): the gradient reaches the point's input through the encoder only.

:func:`load_sae` reads a SAELens folder (``cfg.json`` and ``sae_weights.safetensors``, as ``SAE.save_model``
writes them) with attnkit's own safetensors reader; SAELens is never imported. Hook names are SAELens's, which
are TransformerLens's and so attnkit's (``blocks.{i}.hook_resid_post``, ``blocks.{i}.hook_mlp_out``,
``blocks.{i}.attn.hook_z`` flattened to (B, L, H*Dh), ``ln_final.hook_normalized``, ...); points attnkit does not
have (``blocks.{i}.ln2.hook_normalized``, ``blocks.{i}.hook_mlp_in``, ``blocks.{i}.mlp.hook_post``) are refused
by name. A spliced SAE's own points are named after the point it writes, as in SAELens's cache:
``{hook}.hook_sae_input``, ``.hook_sae_acts_pre``, ``.hook_sae_acts_post`` (the features), ``.hook_sae_recons``,
``.hook_sae_error`` (with the error term) and ``.hook_sae_output``.

Shapes: B batch, L tokens, D the hooked activation's width (``d_in``; ``d_out`` for a transcoder's output),
S features (``d_sae``).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..io import read_json
from ..pretrained.checkpoint import read_file_headers, read_tensor
from ._inputs import as_id_batch, check_position
from .cache import ActivationCache
from .hooks import _check_hooks, absent_point_error, hook_names, hooks

__all__ = ["SAE", "FeatureAttribution", "feature_attribution", "load_sae", "run_with_cache_with_saes",
           "saes"]

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
ARCHITECTURES = ("standard", "jumprelu", "topk", "transcoder", "jumprelu_transcoder")
# SAELens's normalisations of each position, undone on the output: none; (x - mean) / (std + 1e-5), std with
# Bessel's correction, out = recons * std + mean; x * sqrt(D) / |x|, out = recons * |x| / sqrt(D).
NORMALIZATIONS = ("none", "layer_norm", "constant_norm_rescale")
_LN_EPS = 1e-5
SAE_POINTS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error",
              "hook_sae_output")
_HOOKABLE = {"forward": ("hook_sae_acts_pre", "hook_sae_acts_post"), "backward": ("hook_sae_acts_post",)}
# TransformerLens points that attnkit's models do not have, and what to hook instead.
_NOT_IN_ATTNKIT = {
    "ln2.hook_normalized": "the MLP's normed input (hook blocks.{i}.hook_resid_mid, the stream it normalises)",
    "ln1.hook_normalized": "the attention's normed input (hook blocks.{i}.hook_resid_pre)",
    "hook_mlp_in": "the MLP's input (blocks.{i}.hook_resid_mid is the same stream in a sequential block)",
    "hook_attn_in": "the attention's input (blocks.{i}.hook_resid_pre is the same stream)",
    "mlp.hook_pre": "the MLP's hidden pre-activation", "mlp.hook_post": "the MLP's hidden activation",
}


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


# -- splicing into a model --------------------------------------------------------------------------------
def _check_point(model: Any, name: str, table: list[str], what: str) -> None:
    if name in table:
        return
    local = name.split(".", 2)[2] if name.startswith("blocks.") and name.count(".") >= 2 else name
    if local in _NOT_IN_ATTNKIT:
        raise ValueError(f"{what}: attnkit's models have no hook point {name!r}, {_NOT_IN_ATTNKIT[local]}")
    raise absent_point_error(model, name, what)


class _Splice:
    """One SAE in a model: the forward hook at the point it writes (and, for a transcoder, the one that keeps its
    input), the backward hooks that carry the gradient through it, and what the last forward kept."""

    def __init__(self, model: Any, sae: SAE, use_error_term: bool, user_forward: dict, user_backward: dict,
                 keep: dict | None) -> None:
        table = hook_names(model)
        _check_point(model, sae.hook_name, table, f"the SAE's hook_name ({sae!r})")
        _check_point(model, sae.output_hook_name, table, f"the transcoder's hook_name_out ({sae!r})")
        if table.index(sae.output_hook_name) < table.index(sae.hook_name):
            raise ValueError(f"{sae!r} writes {sae.output_hook_name}, which the forward reaches before "
                             f"{sae.hook_name}, the point it reads")
        self.sae, self.use_error_term, self.keep = sae, use_error_term, keep
        self.prefix = sae.output_hook_name
        self.user_forward = {p: user_forward.pop(f"{self.prefix}.{p}") for p in _HOOKABLE["forward"]
                             if f"{self.prefix}.{p}" in user_forward}
        self.user_backward = {p: user_backward.pop(f"{self.prefix}.{p}") for p in _HOOKABLE["backward"]
                              if f"{self.prefix}.{p}" in user_backward}
        self.captured: np.ndarray | None = None
        self.saved: tuple | None = None  # what the backward needs: (open, pre replaced, acts replaced, input shape)
        self.acts: np.ndarray | None = None  # the last forward's features (B, L, S), after the feature hooks
        self.error: np.ndarray | None = None  # and its error term (B, L, D_out), or None without one
        self.input_grad: np.ndarray | None = None
        self.feature_grad: np.ndarray | None = None
        self.output_grad: np.ndarray | None = None
        self.recons_grad: np.ndarray | None = None
        self.forward_hook = _passing(self.splice) if not sae.is_transcoder else self.splice

    def _user(self, point: str, value: np.ndarray, direction: str) -> tuple[np.ndarray, bool]:
        fn = (self.user_forward if direction == "forward" else self.user_backward).get(point)
        if fn is None:
            return value, False
        seen = value.view()
        seen.flags.writeable = False
        out = fn(seen, f"{self.prefix}.{point}")
        if out is None or out is seen:
            return value, False
        out = np.asarray(out)
        if out.shape != value.shape or out.dtype.kind not in "fiu":
            raise ValueError(f"the hook at {self.prefix}.{point} returned {out.dtype} {out.shape}, expected numbers "
                             f"of shape {value.shape}")
        return out.astype(value.dtype, copy=False), True

    def capture(self, value: np.ndarray, name: str) -> None:
        """The transcoder's input, kept until the forward reaches the point it writes."""
        self.captured = np.array(value)

    def splice(self, value: np.ndarray, name: str) -> np.ndarray:
        """The SAE's output in place of ``value`` (B, L, ...)."""
        sae = self.sae
        source = value if not sae.is_transcoder else self.captured
        if source is None:
            raise RuntimeError(f"{sae!r}: the forward reached {name} without passing {sae.hook_name}")
        self.captured = None
        x = source.reshape(source.shape[:2] + (-1,))  # (B, L, D): attn.hook_z flattened to H*Dh
        if x.shape[-1] != sae.d_in:
            raise ValueError(f"{sae!r} reads {sae.d_in} features, but {sae.hook_name} has {x.shape[-1]} "
                             f"(shape {source.shape})")
        if value.reshape(value.shape[:2] + (-1,)).shape[-1] != sae.d_out:
            raise ValueError(f"{sae!r} writes {sae.d_out} features, but {name} has shape {value.shape}")
        x = x.astype(value.dtype, copy=False)
        xn, scale, shift = sae.normalize(x)  # (B, L, D); (B, L, 1) each or None

        def restored(recons: np.ndarray) -> np.ndarray:
            return recons if scale is None else recons * scale + shift  # (B, L, D_out)

        clean_pre = sae._pre(xn)  # (B, L, S)
        pre, pre_cut = self._user("hook_sae_acts_pre", clean_pre, "forward")
        opened = sae._open(pre)  # (B, L, S)
        acts, acts_cut = self._user("hook_sae_acts_post", pre * opened, "forward")
        recons = sae.decode(acts)  # (B, L, D_out)
        out = restored(recons)
        error = None
        if self.use_error_term:
            clean = out if not (pre_cut or acts_cut) else restored(sae.decode(sae.activate(clean_pre)))
            error = value.reshape(recons.shape) - clean  # (B, L, D_out)
            out = out + error
        self.saved = (opened, pre_cut, acts_cut, source.shape, x, scale, shift, recons)
        self.acts, self.error = acts, error
        if self.keep is not None:
            found = {"hook_sae_input": x, "hook_sae_acts_pre": pre, "hook_sae_acts_post": acts,
                     "hook_sae_recons": recons, "hook_sae_error": error, "hook_sae_output": out}
            for point, array in found.items():
                if array is not None:
                    self.keep[f"{self.prefix}.{point}"] = np.array(array)
        return out.reshape(value.shape)

    def backward_out(self, grad: np.ndarray, name: str) -> np.ndarray | None:
        """The gradient at the point written (B, L, ...): through the decoder to the features and through the
        encoder to the input; an SAE returns the input's gradient, a transcoder keeps it for its input point."""
        if self.saved is None:
            raise RuntimeError(f"{self.sae!r}: backward without a forward through the SAE")
        sae = self.sae
        opened, pre_cut, acts_cut, source_shape, x, scale, shift, recons = self.saved
        self.output_grad = np.array(grad)
        w_enc, _, w_dec, _, norms = sae._weights(grad.dtype)
        g = grad.reshape(grad.shape[:2] + (-1,))  # (B, L, D_out)
        self.recons_grad = g if scale is None else g * scale  # (B, L, D_out): the normalised reconstruction's
        g_acts = self.recons_grad @ w_dec.T  # (B, L, S)
        if sae.rescale_acts_by_decoder_norm:
            g_acts = g_acts / norms
        g_acts, _ = self._user("hook_sae_acts_post", g_acts, "backward")
        self.feature_grad = g_acts
        if acts_cut or pre_cut:
            g_in = np.zeros(g.shape[:2] + (sae.d_in,), dtype=grad.dtype)  # (B, L, D)
        else:
            g_pre = g_acts * opened  # (B, L, S)
            if sae.rescale_acts_by_decoder_norm:
                g_pre = g_pre * norms
            g_in = g_pre @ w_enc.T  # (B, L, D)
        if scale is not None:  # through the normalisation, and the output's scale and shift (the error is constant)
            g_in = sae.normalize_backward(x, g_in, (g * recons).sum(-1, keepdims=True), g.sum(-1, keepdims=True))
        g_in = g_in.reshape(source_shape)
        if not sae.is_transcoder:
            return g_in
        self.input_grad = g_in
        return None

    def backward_in(self, grad: np.ndarray, name: str) -> np.ndarray:
        """A transcoder's input point: its own gradient plus what reached it through the transcoder."""
        if self.input_grad is None:
            return grad
        out, self.input_grad = grad + self.input_grad, None
        return out


def _passing(fn: Callable) -> Callable:
    """``fn`` marked as a differentiable replacement (:mod:`attnkit.core.hooks`): its point's gradient goes on,
    mapped by the backward hook installed with it."""

    def hook(value: np.ndarray, name: str) -> np.ndarray:
        return fn(value, name)

    hook.passes_gradient = True
    return hook


def _check_saes(sae_list: Any) -> list[SAE]:
    if isinstance(sae_list, SAE):
        sae_list = [sae_list]
    if isinstance(sae_list, (str, bytes)) or not isinstance(sae_list, Sequence) or not sae_list:
        raise TypeError(f"saes must be a non-empty list of SAE (attnkit.explain.load_sae), got "
                        f"{type(sae_list).__name__}")
    seen: dict[str, SAE] = {}
    for sae in sae_list:
        if not isinstance(sae, SAE):
            raise TypeError(f"saes must hold SAE objects (attnkit.explain.load_sae), got {type(sae).__name__}")
        for point in {sae.hook_name, sae.output_hook_name}:
            if point in seen:
                raise ValueError(f"two SAEs use {point}: {seen[point]!r} and {sae!r}; each point may be read or "
                                 f"written by one SAE")
            seen[point] = sae
    return list(sae_list)


@contextmanager
def saes(model: Any, sae_list: Any, *, use_error_term: bool = False,
         forward: Mapping[str, Callable] | None = None,
         backward: Mapping[str, Callable] | None = None) -> Iterator[None]:
    """Run ``model`` with SAEs spliced in (SAELens's ``HookedSAETransformer.saes``), under forward, ``generate``
    and the exact backward.

    Parameters
    ----------
    model : CausalLM
    sae_list : SAE or list of SAE
        At most one SAE writing each point.
    use_error_term : bool, default False
        Add each SAE's error, so the model's values are unchanged unless a feature hook edits the features.
    forward, backward : mapping of str to callable, optional
        Hooks ``fn(value, name)`` as :func:`~attnkit.explain.hooks` takes them, by name: the model's points, and
        each SAE's ``{hook}.hook_sae_acts_pre`` / ``.hook_sae_acts_post`` (forward; ``hook_sae_acts_post``
        backward too, the features' gradient). A feature hook that returns a replacement ablates or steers the
        features; as at the model's points, a replaced value is a constant (the gradient below it stops).

    The block holds the model for the calling thread (as :func:`~attnkit.explain.hooks`); leaving it discards the
    spliced forward's saved state, so a backward after it raises instead of differentiating the wrong model.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, intermediate_size=12)
    >>> lm = CausalLM(cfg, rng=0)
    >>> rng = np.random.default_rng(0)
    >>> sae = SAE(rng.normal(size=(8, 16)), rng.normal(size=16), rng.normal(size=(16, 8)), np.zeros(8),
    ...           hook_name="blocks.0.hook_resid_post")
    >>> with saes(lm, [sae], use_error_term=True):
    ...     spliced = lm(np.array([[1, 2, 3]]))
    >>> bool(np.allclose(spliced, lm(np.array([[1, 2, 3]])), atol=1e-5))
    True
    """
    with _spliced(model, sae_list, use_error_term, forward, backward, None):
        yield


@contextmanager
def _spliced(model: Any, sae_list: Any, use_error_term: bool, forward: Any, backward: Any,
             keep: dict | None) -> Iterator[list[_Splice]]:
    sae_list = _check_saes(sae_list)
    if not isinstance(use_error_term, bool):
        raise TypeError(f"use_error_term must be a bool, got {type(use_error_term).__name__}")
    user_forward, user_backward = _check_hooks(forward, "forward"), _check_hooks(backward, "backward")
    splices = [_Splice(model, sae, use_error_term, user_forward, user_backward, keep) for sae in sae_list]
    for direction, left in (("forward", user_forward), ("backward", user_backward)):
        stray = [n for n in left if any(n.endswith(f".{p}") for p in SAE_POINTS)]
        if stray:
            raise ValueError(f"{direction} hook {stray[0]!r}: no spliced SAE has it (SAE points take "
                             f"{direction} hooks at {', '.join(_HOOKABLE[direction])})")
    fwd: dict[str, Callable] = {}
    bwd: dict[str, Callable] = {}
    for splice in splices:
        sae = splice.sae
        if sae.is_transcoder:
            fwd[sae.hook_name] = splice.capture
            bwd[sae.hook_name] = splice.backward_in
        fwd[sae.output_hook_name] = splice.forward_hook
        bwd[sae.output_hook_name] = splice.backward_out
    with hooks(model, fwd, backward=bwd), hooks(model, user_forward, backward=user_backward):
        yield splices


def run_with_cache_with_saes(model: Any, input_ids: Any, saes: Any, *, use_error_term: bool = False,
                             attention_mask: Any = None, names: Any = None,
                             forward: Mapping[str, Callable] | None = None) -> tuple[np.ndarray, ActivationCache]:
    """The logits and activations of one forward with SAEs spliced in (SAELens's ``run_with_cache_with_saes``).

    Parameters
    ----------
    model : CausalLM
    input_ids : array_like of int, (L,) or (B, L)
    saes : SAE or list of SAE
    use_error_term : bool, default False
        As :func:`saes`: with it the logits are the model's own (to rounding).
    attention_mask : array_like (B, L), optional
    names : list of str or callable, optional
        Which of the model's points to keep as well (default all; a spliced point holds what the SAE passed on).
    forward : mapping of str to callable, optional
        Forward hooks during the run, as :func:`saes` takes them (feature hooks: ablation, steering); the cache
        holds the values after them.

    Returns
    -------
    logits : ndarray (B, L, V)
    cache : ActivationCache
        The model's points and each SAE's ``{hook}.hook_sae_input`` (B, L, D), ``.hook_sae_acts_pre`` and
        ``.hook_sae_acts_post`` (B, L, S), ``.hook_sae_recons`` and ``.hook_sae_output`` (B, L, D_out),
        ``.hook_sae_error`` with the error term; ``{hook}`` is the point the SAE writes.
    """
    everything = hook_names(model)
    if names is None:
        chosen = everything
    elif callable(names):
        chosen = [name for name in everything if names(name)]
    elif isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
        raise TypeError(f"names must be a list of hook names or a predicate, got {type(names).__name__}")
    else:
        chosen = list(names)
        for name in chosen:
            _check_point(model, name, everything, "names")
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]  # (1, L)
    found: dict[str, np.ndarray] = {}

    def keep(value: np.ndarray, name: str) -> None:
        found[name] = np.array(value)

    with _spliced(model, saes, use_error_term, forward, None, found), hooks(model, {n: keep for n in chosen}):
        logits = model(ids, attention_mask)
    order = {name: i for i, name in enumerate(everything)}

    def position(name: str) -> tuple[int, int]:
        base, _, point = name.rpartition(".")
        if point in SAE_POINTS:
            return order[base], SAE_POINTS.index(point)
        return order[name], len(SAE_POINTS)

    return logits, ActivationCache({name: found[name] for name in sorted(found, key=position)}, model)


# -- attribution ----------------------------------------------------------------------------------------------
@dataclass
class FeatureAttribution:
    """Each spliced SAE's features' share of a logit (or logit difference): gradient times activation.

    Attributes
    ----------
    metric : ndarray (B,)
        The logit (difference) explained, of the spliced model.
    activations, gradients, attributions : dict of str to ndarray (B, L, S)
        By the point each SAE writes: the features, the metric's exact gradient with respect to them (the error
        terms constant, as in SAELens), and their product.
    error_attributions, bias_attributions : dict of str to ndarray (B, L)
        The error term's and ``b_dec``'s share (the gradient at the written point dotted with them; the error's
        is zero without the error term; ``b_dec``'s includes a layer-norm normalisation's restored mean). Where
        the metric is linear in the written point (an SAE at ``ln_final.hook_normalized``) the three sum to the
        metric exactly.
    target : ndarray (B,) int64
        The explained token of each row.
    """

    metric: np.ndarray
    activations: dict[str, np.ndarray]
    gradients: dict[str, np.ndarray]
    attributions: dict[str, np.ndarray]
    error_attributions: dict[str, np.ndarray]
    bias_attributions: dict[str, np.ndarray]
    target: np.ndarray


def feature_attribution(model: Any, input_ids: Any, saes: Any, *, target_position: int = -1,
                        target_token: Any = None, incorrect_token: Any = None,
                        use_error_term: bool = True) -> FeatureAttribution:
    """Gradient times activation of every feature of the spliced SAEs for one logit (or a logit difference), from
    attnkit's exact backward of the spliced model.

    Parameters
    ----------
    model : CausalLM
    input_ids : array_like of int, (L,) or (B, L)
    saes : SAE or list of SAE
    target_position : int, default -1
        The position whose logit is explained.
    target_token : int or array_like (B,), optional
        The token whose logit is explained; default the spliced model's top token there.
    incorrect_token : int or array_like (B,), optional
        Explain ``logit[target] - logit[incorrect]`` instead.
    use_error_term : bool, default True
        As :func:`saes`; the error is a constant of the backward.

    Returns
    -------
    FeatureAttribution
    """
    batch, _ = as_id_batch(input_ids, model.config.vocab_size, "input_ids")
    b, length = batch.shape
    position = check_position(target_position, length)
    sae_list = _check_saes(saes)
    with _spliced(model, sae_list, use_error_term, None, None, None) as splices:
        logits = model(batch)  # (B, L, V)
        row = logits[:, position]  # (B, V)
        target = row.argmax(axis=-1) if target_token is None else _tokens(target_token, b, model, "target_token")
        grad_logits = np.zeros(logits.shape, dtype=logits.dtype)  # (B, L, V)
        grad_logits[np.arange(b), position, target] += 1
        metric = row[np.arange(b), target].astype(np.float64)  # (B,)
        if incorrect_token is not None:
            wrong = _tokens(incorrect_token, b, model, "incorrect_token")
            grad_logits[np.arange(b), position, wrong] -= 1
            metric = metric - row[np.arange(b), wrong]
        with model.input_gradients_only():
            model.backward(grad_logits)
        result = FeatureAttribution(metric, {}, {}, {}, {}, {}, target.astype(np.int64))
        for splice in splices:
            sae, name = splice.sae, splice.prefix
            acts, error = splice.acts, splice.error
            g_out = splice.output_grad.reshape(acts.shape[:2] + (-1,))  # (B, L, D_out)
            result.activations[name] = acts
            result.gradients[name] = splice.feature_grad
            result.attributions[name] = acts * splice.feature_grad  # (B, L, S)
            result.error_attributions[name] = (error * g_out).sum(-1) if error is not None else \
                np.zeros(acts.shape[:2], acts.dtype)  # (B, L)
            shift = splice.saved[6]  # the normalisation's shift (B, L, 1), or None
            result.bias_attributions[name] = splice.recons_grad.reshape(g_out.shape) @ sae.b_dec.astype(g_out.dtype) \
                + (0 if shift is None else (g_out * shift).sum(-1))  # (B, L)
    return result


def _tokens(tokens: Any, b: int, model: Any, name: str) -> np.ndarray:
    given = np.asarray(tokens)
    vocab = model.config.vocab_size
    if given.dtype.kind not in "iu" or given.shape not in ((), (b,)) or (given < 0).any() or (given >= vocab).any():
        raise ValueError(f"{name} must be token ids in [0, {vocab}) (an int or one per row), got {tokens!r}")
    return np.broadcast_to(given, (b,)).astype(np.int64)
