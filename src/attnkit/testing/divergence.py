"""The first-divergence finder, :func:`compare`: run the same ids through two implementations of a decoder and
find where they first part.

Every trace name both sides and the float64 reference have (:mod:`attnkit.testing.trace`) is compared in forward
order. Each side is judged against attnkit's float64 run (the reference) by FlashAttention's rule: side X
diverges at a tensor when its error against the reference exceeds twice the error attnkit makes there in X's
dtype (attnkit's float32 run for a float32 side), plus a floor of ``FLOOR_ULPS`` units in the last place of X's
dtype at the tensor's scale (its largest magnitude in the reference), so a tensor attnkit happens to compute
exactly in that dtype (or a float64 side, whose baseline is the reference itself) is not held to zero. (Measured
on twelve families, transformers float32 against attnkit float32: the worst tensor uses 32% of its limit with the
floor, 80% with a floor of one ulp; the rule alone is that close to its edge.) An error is
a maximum over the tensor of ``|x - reference|``; entries equal on both sides (a masked score, -inf) count zero,
an entry finite on one side only (a key one side masks) counts infinite.

The first divergence is the first layer whose residual stream (``layers.{i}.resid``) diverges, and inside it
the first operation, in :data:`~attnkit.testing.trace.OPS` order, that does; an earlier operation that diverges
without moving its layer's residual stream is reported too, being first. ``embed`` and ``logits`` are checked
before and after the layers.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .sides import AttnkitSide, RecordedSide, _ids_2d
from .trace import order_key, split_name

__all__ = ["compare", "Comparison", "Row", "Reference", "as_side", "FLOOR_ULPS", "FACTOR"]

FACTOR = 2.0  # FlashAttention's: at most twice the error of the same dtype's reference implementation
FLOOR_ULPS = 16.0  # units in the last place of the side's dtype, at the tensor's scale


class Reference:
    """attnkit's float64 run of a model and its runs in other dtypes, each made once per ids.

    Parameters
    ----------
    model : CausalLM, str or Path
        An attnkit model (converted to float64 on a copy) or a folder / GGUF file loaded in float64.
    """

    def __init__(self, model: Any) -> None:
        if isinstance(model, (str, Path)):
            from ..pretrained import load_causal_lm

            model = load_causal_lm(model, dtype=np.float64, progress=False)
        elif not hasattr(model, "named_hook_points"):
            raise TypeError(f"the reference must be an attnkit CausalLM or a path, got {type(model).__name__}")
        elif np.dtype(model.dtype) != np.float64:
            model = copy.deepcopy(model).astype(np.float64)
        self.model = model
        self._models: dict[np.dtype, Any] = {np.dtype(np.float64): model}
        self._traces: dict[tuple, dict[str, np.ndarray]] = {}

    def model_in(self, dtype: Any) -> Any:
        """The model in ``dtype`` (a float64 copy converted once, kept)."""
        dtype = np.dtype(dtype)
        if dtype not in self._models:
            self._models[dtype] = copy.deepcopy(self.model).astype(dtype)
        return self._models[dtype]

    def trace(self, dtype: Any, ids: Any) -> dict[str, np.ndarray]:
        """attnkit's trace of ``ids`` in ``dtype`` (float16, float32 or float64), kept for later calls."""
        ids = _ids_2d(ids)
        key = (np.dtype(dtype), ids.shape, ids.tobytes())
        if key not in self._traces:
            self._traces[key] = AttnkitSide(self.model_in(dtype)).trace(ids)
        return self._traces[key]


@dataclass(frozen=True)
class Row:
    """One compared tensor: ``max_abs`` = max |a - b|, ``max_rel`` = that over the reference's largest magnitude;
    ``error_a`` / ``error_b`` each side's max |x - reference|, ``limit_a`` / ``limit_b`` what each may make."""

    name: str
    layer: int | None
    op: str
    max_abs: float
    max_rel: float
    error_a: float
    error_b: float
    limit_a: float
    limit_b: float

    @property
    def diverges(self) -> bool:
        """Whether either side's error exceeds its limit."""
        return self.error_a > self.limit_a or self.error_b > self.limit_b


@dataclass
class Comparison:
    """What :func:`compare` found: ``rows`` (every compared tensor, forward order), ``first`` (the first
    diverging row or None), the sides' names and the ids."""

    a: str
    b: str
    input_ids: list
    rows: list[Row]
    first: Row | None

    @property
    def diverged(self) -> bool:
        """Whether any compared tensor diverges."""
        return self.first is not None

    def verdict(self) -> str:
        """``first divergence: layer N, <op>`` (``first divergence: embed`` / ``logits``), or ``no divergence``."""
        if self.first is None:
            return "no divergence"
        where = self.first.op if self.first.layer is None else f"layer {self.first.layer}, {self.first.op}"
        return f"first divergence: {where}"

    def table_rows(self) -> list[Row]:
        """The rows a table shows: ``embed``, every layer's residual stream, every operation of the first
        diverging layer, ``logits``."""
        inside = None if self.first is None else self.first.layer
        return [r for r in self.rows if r.layer is None or r.op == "resid" or r.layer == inside]

    def table(self, every_row: bool = False) -> str:
        """The table of :meth:`table_rows` (every row with ``every_row``) and the verdict line, as text."""
        head = f"{'layer':>5}  {'op':<9} {'max abs':>10} {'max rel':>10} {'A vs f64':>10} {'B vs f64':>10}"
        lines = [f"A: {self.a}", f"B: {self.b}", head]
        for r in (self.rows if every_row else self.table_rows()):
            mark = "  <-" if r is self.first else ("  !" if r.diverges else "")
            layer = "" if r.layer is None else str(r.layer)
            lines.append(f"{layer:>5}  {r.op:<9} {r.max_abs:>10.3g} {r.max_rel:>10.3g} {r.error_a:>10.3g} "
                         f"{r.error_b:>10.3g}{mark}")
        lines.append(self.verdict())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record: the sides, the ids, every row (with ``diverges``) and ``first_divergence``
        (``{"layer", "op"}`` or None)."""
        rows = [{**{k: _finite(v) for k, v in asdict(r).items()}, "diverges": r.diverges} for r in self.rows]
        first = None if self.first is None else {"layer": self.first.layer, "op": self.first.op}
        return {"a": self.a, "b": self.b, "input_ids": self.input_ids, "first_divergence": first,
                "verdict": self.verdict(), "rows": rows}


def _finite(value: Any) -> Any:
    """JSON has no infinity: an infinite float becomes the string ``"inf"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    return value


def _max_difference(x: np.ndarray, y: np.ndarray) -> float:
    """max |x - y| in float64; entries equal on both sides count zero (both -inf), others that are not finite
    on both sides count infinite."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    same = x == y
    both = np.isfinite(x) & np.isfinite(y)
    diff = np.abs(np.where(both, x, 0.0) - np.where(both, y, 0.0))  # the entries finite on both sides
    diff = np.where(same, 0.0, np.where(both, diff, np.inf))
    return float(diff.max()) if diff.size else 0.0


def _scale(x: np.ndarray) -> float:
    finite = np.abs(x[np.isfinite(x)])
    return float(finite.max()) if finite.size else 0.0


def _aligned(value: np.ndarray, like: np.ndarray, name: str, side: str) -> np.ndarray:
    """``value`` in the reference's shape: a missing batch axis added, the heads of a (B, L, H*Dh) split."""
    if value.shape == like.shape:
        return value
    if value.shape == like.shape[1:]:
        return value[None]
    if value.ndim == 3 and like.ndim == 4 and value.shape[:2] == like.shape[:2] and value.size == like.size:
        return value.reshape(like.shape)  # (B, L, H, Dh)
    raise ValueError(f"{side} gives {name} of shape {value.shape}, but attnkit's is {like.shape}")


def _eps(side: Any) -> float:
    label = str(getattr(side, "torch_dtype", "")).removeprefix("torch.")
    return 2.0 ** -7 if label == "bfloat16" else float(np.finfo(side.dtype).eps)


def _baseline_dtype(side: Any) -> np.dtype:
    return side.dtype if side.dtype in (np.float16, np.float32, np.float64) else np.dtype(np.float32)


def as_side(spec: Any) -> Any:
    """A side from what :func:`compare` accepts: a side (anything with ``trace``, ``name`` and ``dtype``), an
    attnkit ``CausalLM``, a mapping of recorded arrays, an ``.npz`` path, or a folder / GGUF path (attnkit in
    float32)."""
    if hasattr(spec, "trace") and hasattr(spec, "dtype"):
        return spec
    if hasattr(spec, "named_hook_points"):
        return AttnkitSide(spec)
    if isinstance(spec, Mapping):
        return RecordedSide(spec)
    if isinstance(spec, (str, Path)):
        return RecordedSide(spec) if str(spec).endswith(".npz") else AttnkitSide(spec)
    raise TypeError(f"a side must be a side object, an attnkit CausalLM, a mapping of arrays, an .npz path or a "
                    f"model path, got {type(spec).__name__}")


def _reference_of(sides: tuple, reference: Any) -> Reference:
    if isinstance(reference, Reference):
        return reference
    if reference is not None:
        return Reference(reference)
    for side in sides:
        if isinstance(side, AttnkitSide):
            return Reference(side.model)
    raise ValueError("reference: neither side is an attnkit model, so give the model (a folder or GGUF file) whose "
                     "float64 run the errors are measured against")


def _row(name: str, a: np.ndarray, b: np.ndarray, ref: np.ndarray, base_a: np.ndarray, base_b: np.ndarray,
         eps_a: float, eps_b: float) -> Row:
    scale = _scale(ref)
    max_abs = _max_difference(a, b)
    layer, op = split_name(name)
    return Row(name=name, layer=layer, op=op, max_abs=max_abs, max_rel=max_abs / scale if scale else max_abs,
               error_a=_max_difference(a, ref), error_b=_max_difference(b, ref),
               limit_a=FACTOR * _max_difference(base_a, ref) + FLOOR_ULPS * eps_a * scale,
               limit_b=FACTOR * _max_difference(base_b, ref) + FLOOR_ULPS * eps_b * scale)


def _first(rows: list[Row]) -> Row | None:
    """The first diverging row in forward order: inside the first layer whose residual stream diverges, its
    first diverging op (or an earlier layer's op that diverged without moving its residual stream)."""
    return next((r for r in rows if r.diverges), None)


def compare(a: Any, b: Any, input_ids: Any, *, reference: Any = None) -> Comparison:
    """Run ``input_ids`` through ``a`` and ``b`` and find the first operation where they part.

    Parameters
    ----------
    a, b : side, CausalLM, mapping, str or Path
        Each an attnkit model or path (:class:`~attnkit.testing.AttnkitSide`), a transformers model
        (:func:`~attnkit.testing.transformers_side`), a PyTorch module (:class:`~attnkit.testing.TorchSide`), or
        recorded activations (a mapping or ``.npz``, :class:`~attnkit.testing.RecordedSide`).
    input_ids : array_like of int, (L,) or (B, L)
    reference : CausalLM, str, Path or Reference, optional
        The model whose attnkit float64 run the errors are measured against; default the first attnkit side's.

    Returns
    -------
    Comparison
        ``rows`` for every trace name all three have, ``first`` the first diverging one (see the module).

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0)
    >>> compare(lm, copy.deepcopy(lm).astype(np.float64), [1, 2, 3]).verdict()
    'no divergence'
    >>> broken = copy.deepcopy(lm)
    >>> broken.layers[1].attention.scale = 1 / 4  # 1/d, not 1/sqrt(d)
    >>> compare(broken, lm, [1, 2, 3, 4]).verdict()
    'first divergence: layer 1, scores'
    """
    side_a, side_b = as_side(a), as_side(b)
    ids = _ids_2d(input_ids)
    ref = _reference_of((side_a, side_b), reference)
    oracle = ref.trace(np.float64, ids)
    trace_a, trace_b = side_a.trace(ids), side_b.trace(ids)
    base_a, base_b = ref.trace(_baseline_dtype(side_a), ids), ref.trace(_baseline_dtype(side_b), ids)
    names = sorted((set(trace_a) & set(trace_b) & set(oracle)), key=order_key)
    if not names:
        raise ValueError(f"{side_a.name} and {side_b.name} have no activation in common with attnkit's "
                         f"(names like 'layers.0.q'; see attnkit.testing.OPS)")
    rows = []
    for name in names:
        like = oracle[name]
        x = _aligned(np.asarray(trace_a[name]), like, name, side_a.name)
        y = _aligned(np.asarray(trace_b[name]), like, name, side_b.name)
        rows.append(_row(name, x, y, like, base_a[name], base_b[name], _eps(side_a), _eps(side_b)))
    return Comparison(a=side_a.name, b=side_b.name, input_ids=ids.tolist(), rows=rows, first=_first(rows))
