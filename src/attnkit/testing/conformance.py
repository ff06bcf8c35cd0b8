"""An attention conformance suite: any attention function against attnkit's float64 kernels, case by case.

:func:`check_attention` runs a function over a grid of cases (:func:`default_cases`: shapes, grouped and
multi-query heads, causal with ``Lq != Lk``, padding masks, fully masked rows, sliding windows, soft-capped
scores, sinks, ALiBi, each in float16, bfloat16, float32 and float64) and compares its output, and its
gradients when it has them, with :func:`attnkit.flex.flex_attention` computed in float64 on the same (rounded)
inputs. Where the output differs, the suite tries the usual other semantics (:data:`VARIANTS`): a top-left
causal corner, NaN or a uniform average in a fully masked row, a default scale of ``1/D``, heads grouped the
other way, a window one key off or ignored, a soft-cap, sinks or ALiBi ignored, and names the one that fits.

The function's calling convention
---------------------------------
``fn(q, k, v, spec) -> out``, with

=========  ======================  ===================================================================
argument   shape                   meaning
=========  ======================  ===================================================================
``q``      (B, Hq, Lq, D)          queries (heads before positions, as torch's SDPA takes them)
``k``      (B, Hkv, Lk, D)         keys; ``Hkv`` divides ``Hq``: query head h reads key head
                                   ``h // (Hq // Hkv)`` (consecutive query heads share a key head)
``v``      (B, Hkv, Lk, Dv)        values
``spec``   :class:`AttentionSpec`  what to compute: causal, window, masks, scale, soft-cap, sinks, ALiBi
``out``    (B, Hq, Lq, Dv)         the function's result, in the type and dtype of ``q``
=========  ======================  ===================================================================

``q``, ``k`` and ``v`` are NumPy arrays, or torch tensors when ``fn.framework == "torch"`` (then with
``requires_grad`` set, and the suite calls ``out.backward``, unless ``fn.differentiable`` is False). A NumPy
function may return ``(out, backward)`` with ``backward(grad_out) -> (dq, dk, dv)`` to have its gradients
checked. The spec's arrays are always NumPy. A function that cannot express a case raises
:class:`NotImplementedError` (the case reads "unsupported", with its message). Adapters for torch's SDPA,
``flex_attention`` and transformers' attention functions are in :mod:`attnkit.testing.attention_adapters`.

Errors are ``max |got - expected| / max |expected|`` over the whole output (each gradient against its own
scale; NaN where the reference has NaN counts as equal, anywhere else as an infinite error). A case passes
when its error is at most :data:`TOLERANCE` of its dtype.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from ..flex import alibi, compose, create_block_mask, flex_attention, flex_attention_backward, softcap
from ..flex.masks import boolean_mask

__all__ = ["AttentionSpec", "Case", "CaseResult", "ConformanceReport", "TOLERANCE", "VARIANTS", "check_attention",
           "default_cases", "reference_attention"]

# Largest error (relative to the output's scale) a correct function may make in each dtype: a few times what the
# dtype's rounding of scores, weights and output gives (float16 and bfloat16 keep 11 and 8 significant bits).
TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True, eq=False)  # arrays inside: equality would be ambiguous, so it is identity
class AttentionSpec:
    """What one case asks the function to compute (the arrays are NumPy, whatever the function's framework).

    Attributes
    ----------
    causal : bool
        Query i may attend key j iff ``j <= i + Lk - Lq``: the causal corner is at the bottom right, so with
        ``Lq < Lk`` the queries are the last ``Lq`` positions (a decoding step after a cache).
    window : int or None
        With ``causal``: also ``j > i + Lk - Lq - window`` (the last ``window`` keys, the query's own included).
    key_padding : ndarray of bool, shape (B, Lk), or None
        ``True`` = a real key (the convention of transformers' ``attention_mask``).
    mask : ndarray of bool, shape (B, 1, Lq, Lk), or None
        ``True`` = may attend (torch SDPA's boolean ``attn_mask`` convention); ANDed with the rest.
    scale : float or None
        Multiplier of ``q @ k.T``; None asks for the function's default, which should be ``1 / sqrt(D)``.
    softcap : float or None
        Scores become ``softcap * tanh(scores / softcap)`` after scaling (Gemma 2).
    sinks : ndarray, shape (Hq,), or None
        A logit per query head that joins each row's softmax and carries no value (gpt-oss).
    alibi_slopes : ndarray, shape (Hq,), or None
        ALiBi: ``slopes[h] * (j - i)`` added to the scaled scores (a constant per row aside, alignment-free).
    dropout_p : float
        Always 0: the suite checks deterministic attention; adapters pass it on so dropout is off.

    A query whose mask allows no key should give a zero output row (and zero gradients), never NaN.
    """

    causal: bool = False
    window: int | None = None
    key_padding: np.ndarray | None = None
    mask: np.ndarray | None = None
    scale: float | None = None
    softcap: float | None = None
    sinks: np.ndarray | None = None
    alibi_slopes: np.ndarray | None = None
    dropout_p: float = 0.0

    def allowed(self, seq_q: int, seq_k: int, *, top_left: bool = False) -> np.ndarray | None:
        """The boolean mask (B|1, 1, Lq, Lk) this spec describes (None: every key), True = may attend."""
        pos = np.arange(seq_q)[:, None] + (0 if top_left else seq_k - seq_q)  # (Lq, 1)
        j = np.arange(seq_k)[None, :]  # (1, Lk)
        allowed = None
        if self.causal:
            allowed = (j <= pos) if self.window is None else (j <= pos) & (j > pos - self.window)  # (Lq, Lk)
            allowed = allowed[None, None]  # (1, 1, Lq, Lk)
        for extra in (None if self.key_padding is None else self.key_padding[:, None, None, :], self.mask):
            if extra is not None:
                allowed = extra if allowed is None else allowed & extra  # (B, 1, Lq, Lk)
        return allowed


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """One point of the grid: the shapes, the spec and the seed of its random inputs."""

    name: str
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    dim: int
    dim_v: int
    spec: AttentionSpec = AttentionSpec()
    seed: int = 0

    def inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(q, k, v, grad_out) in float64, of standard-normal entries."""
        rng = np.random.default_rng(self.seed)
        q = rng.standard_normal((self.batch, self.heads_q, self.seq_q, self.dim))  # (B, Hq, Lq, D)
        k = rng.standard_normal((self.batch, self.heads_kv, self.seq_k, self.dim))  # (B, Hkv, Lk, D)
        v = rng.standard_normal((self.batch, self.heads_kv, self.seq_k, self.dim_v))  # (B, Hkv, Lk, Dv)
        grad_out = rng.standard_normal((self.batch, self.heads_q, self.seq_q, self.dim_v))  # (B, Hq, Lq, Dv)
        return q, k, v, grad_out


def default_cases() -> list[Case]:
    """The grid: one feature per case, so a difference names its cause.

    Shapes are small (at most 2 x 4 x 9 x 11) so that the whole grid runs in seconds in every dtype; head
    dimensions 8 and 16 (and a value dimension unlike the key's) make a wrong default scale visible.
    """
    pad = np.array([[True] * 9 + [False] * 2, [True] * 6 + [False] * 5])  # (2, 11): right padding
    left = np.array([[False] * 3 + [True] * 6, [True] * 9])  # (2, 9): left padding
    dead_rows = np.ones((2, 1, 7, 7), dtype=bool)
    dead_rows[0, 0, [1, 4]] = False  # (2, 1, 7, 7): two queries of batch 0 may attend nothing
    slopes = 2.0 ** -np.arange(1.0, 5.0)  # (4,): ALiBi's slopes for 4 heads, steep enough to matter
    return [
        Case("plain", 2, 4, 4, 7, 7, 16, 16, AttentionSpec(scale=0.3), seed=1),
        Case("default scale", 2, 4, 4, 7, 7, 16, 16, AttentionSpec(), seed=2),
        Case("grouped heads (GQA 4:2)", 2, 4, 2, 7, 7, 8, 8, AttentionSpec(scale=0.5), seed=3),
        Case("one key head (MQA)", 2, 4, 1, 7, 9, 8, 8, AttentionSpec(scale=0.5), seed=4),
        Case("value width 12, key width 8", 2, 4, 4, 7, 9, 8, 12, AttentionSpec(scale=0.5), seed=16),
        Case("causal, Lq = Lk", 2, 4, 4, 9, 9, 8, 8, AttentionSpec(causal=True, scale=0.5), seed=5),
        Case("causal, Lq < Lk", 2, 4, 4, 5, 11, 8, 8, AttentionSpec(causal=True, scale=0.5), seed=6),
        Case("causal GQA, Lq < Lk", 2, 4, 2, 5, 11, 8, 8, AttentionSpec(causal=True, scale=0.5), seed=7),
        Case("key padding", 2, 4, 4, 7, 11, 8, 8, AttentionSpec(key_padding=pad, scale=0.5), seed=8),
        Case("causal + left padding (dead rows)", 2, 4, 2, 9, 9, 8, 8,
             AttentionSpec(causal=True, key_padding=left, scale=0.5), seed=9),
        Case("fully masked rows", 2, 4, 4, 7, 7, 8, 8, AttentionSpec(mask=dead_rows, scale=0.5), seed=10),
        Case("sliding window 3", 2, 4, 2, 9, 9, 8, 8, AttentionSpec(causal=True, window=3, scale=0.5), seed=11),
        Case("sliding window 3, Lq < Lk", 2, 4, 4, 4, 9, 8, 8, AttentionSpec(causal=True, window=3, scale=0.5),
             seed=12),
        Case("soft-cap 2", 2, 4, 4, 7, 7, 16, 16, AttentionSpec(causal=True, softcap=2.0, scale=1.0), seed=13),
        Case("sinks", 2, 4, 2, 7, 7, 8, 8, AttentionSpec(causal=True, sinks=np.array([0.5, -1.0, 2.0, 1.0]),
                                                         scale=0.5), seed=14),
        Case("ALiBi", 2, 4, 4, 7, 7, 8, 8, AttentionSpec(causal=True, alibi_slopes=slopes, scale=0.5), seed=15),
    ]


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, spec: AttentionSpec, *,
                        top_left: bool = False, grad_out: np.ndarray | None = None):
    """attnkit's attention of ``spec`` in float64 (:func:`attnkit.flex.flex_attention`, reference kernel).

    Parameters
    ----------
    q : ndarray, shape (B, Hq, Lq, D)
    k : ndarray, shape (B, Hkv, Lk, D)
    v : ndarray, shape (B, Hkv, Lk, Dv)
    spec : AttentionSpec
    top_left : bool
        Put the causal corner at the top left instead (query i attends keys ``j <= i``).
    grad_out : ndarray, shape (B, Hq, Lq, Dv), optional
        Also return the gradients.

    Returns
    -------
    out : ndarray (B, Hq, Lq, Dv) float64, or ``(out, (dq, dk, dv))`` with ``grad_out``
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    seq_q, dim, seq_k = q.shape[2], q.shape[3], k.shape[2]
    allowed = spec.allowed(seq_q, seq_k, top_left=top_left)
    block_mask = None if allowed is None else create_block_mask(boolean_mask(allowed), allowed.shape[0], None,
                                                                     seq_q, seq_k)
    mods = []
    if spec.alibi_slopes is not None:
        mods.append(alibi(np.asarray(spec.alibi_slopes, dtype=np.float64)))
    if spec.softcap is not None:
        mods.append(softcap(spec.softcap))
    score_mod = None if not mods else mods[0] if len(mods) == 1 else compose(*mods)
    scale = 1.0 / math.sqrt(dim) if spec.scale is None else spec.scale
    sinks = None if spec.sinks is None else np.asarray(spec.sinks, dtype=np.float64)
    out, ctx = flex_attention(q, k, v, score_mod, block_mask, scale=scale, sinks=sinks, enable_gqa=True,
                              kernel="reference")
    if grad_out is None:
        return out
    return out, flex_attention_backward(np.asarray(grad_out, dtype=np.float64), ctx)[:3]


@dataclasses.dataclass(frozen=True)
class Variant:
    """Another semantics a function may have: its name, whether it applies to a case, and its outputs."""

    name: str
    applies: Callable[[Case], bool]
    reference: Callable  # (case, q, k, v, grad_out) -> (out, grads or None)


def _changed(changes: Callable[[Case], dict]):
    """A variant that computes the reference with the spec's fields ``changes(case)`` changed."""
    def run(case, q, k, v, grad_out):
        return reference_attention(q, k, v, dataclasses.replace(case.spec, **changes(case)), grad_out=grad_out)
    return run


def _dead_rows(case: Case) -> np.ndarray:
    """(B, 1, Lq, 1) bool: the queries the case's mask lets attend nothing."""
    allowed = case.spec.allowed(case.seq_q, case.seq_k)
    if allowed is None:
        return np.zeros((1, 1, case.seq_q, 1), dtype=bool)
    return ~np.broadcast_to(allowed, (allowed.shape[0], 1, case.seq_q, case.seq_k)).any(axis=-1, keepdims=True)


def _rows_replaced(fill: str):
    """A variant whose fully masked rows are NaN, or the plain mean of the values (a finite mask value)."""
    def run(case, q, k, v, grad_out):
        out = reference_attention(q, k, v, case.spec)
        group = case.heads_q // case.heads_kv
        if fill == "nan":
            return np.where(_dead_rows(case), np.nan, out), None
        mean = np.repeat(np.asarray(v, dtype=np.float64).mean(axis=2, keepdims=True), group, axis=1)  # (B, Hq, 1, Dv)
        return np.where(_dead_rows(case), mean, out), None
    return run


def _heads_interleaved(case, q, k, v, grad_out):
    """Query head h reading key head ``h % Hkv`` (``k.repeat`` where ``repeat_interleave`` was meant)."""
    reps = case.heads_q // case.heads_kv
    tiled = [np.tile(x, (1, reps, 1, 1)) for x in (k, v)]  # (B, Hq, Lk, *)
    out = reference_attention(q, tiled[0], tiled[1], case.spec, grad_out=grad_out)
    if grad_out is None:
        return out, None
    out, (dq, dk, dv) = out
    fold = [g.reshape(g.shape[0], reps, case.heads_kv, *g.shape[2:]).sum(axis=1) for g in (dk, dv)]  # (B, Hkv, ...)
    return out, (dq, *fold)


def _top_left(case, q, k, v, grad_out):
    result = reference_attention(q, k, v, case.spec, top_left=True, grad_out=grad_out)
    return result if grad_out is not None else (result, None)


# The finding of a float64 call whose result is only as accurate as float32 (a float32 step inside).
FLOAT32_PRECISION = "float64 inputs computed at float32 precision"

VARIANTS: tuple[Variant, ...] = (
    Variant("causal corner at the top left (query i sees keys j <= i)",
            lambda c: c.spec.causal and c.seq_q != c.seq_k, _top_left),
    Variant("fully masked rows are NaN", lambda c: bool(_dead_rows(c).any()), _rows_replaced("nan")),
    Variant("fully masked rows average every value (uniform weights)", lambda c: bool(_dead_rows(c).any()),
            _rows_replaced("mean")),
    Variant("default scale is 1/D", lambda c: c.spec.scale is None,
            _changed(lambda c: dict(scale=1.0 / c.dim))),
    Variant("default scale is 1", lambda c: c.spec.scale is None, _changed(lambda c: dict(scale=1.0))),
    Variant("query head h reads key head h % Hkv (heads interleaved)",
            lambda c: 1 < c.heads_kv < c.heads_q, _heads_interleaved),
    Variant("window one key wider", lambda c: c.spec.window is not None,
            _changed(lambda c: dict(window=c.spec.window + 1))),
    Variant("window one key narrower", lambda c: c.spec.window is not None and c.spec.window > 1,
            _changed(lambda c: dict(window=c.spec.window - 1))),
    Variant("window ignored", lambda c: c.spec.window is not None, _changed(lambda c: dict(window=None))),
    Variant("key padding ignored", lambda c: c.spec.key_padding is not None,
            _changed(lambda c: dict(key_padding=None))),
    Variant("soft-cap ignored", lambda c: c.spec.softcap is not None, _changed(lambda c: dict(softcap=None))),
    Variant("sinks ignored", lambda c: c.spec.sinks is not None, _changed(lambda c: dict(sinks=None))),
    Variant("ALiBi ignored", lambda c: c.spec.alibi_slopes is not None, _changed(lambda c: dict(alibi_slopes=None))),
    Variant("ALiBi with the opposite sign", lambda c: c.spec.alibi_slopes is not None,
            _changed(lambda c: dict(alibi_slopes=-c.spec.alibi_slopes))),
)


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    """``max |got - expected| / max |expected|``; NaN counts as equal only where ``expected`` is NaN too."""
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if got.shape != expected.shape:
        return math.inf
    nan_got, nan_expected = np.isnan(got), np.isnan(expected)
    if (nan_got != nan_expected).any():
        return math.inf
    finite = ~nan_expected
    if not finite.any():
        return 0.0
    scale = np.max(np.abs(expected[finite]))
    return float(np.max(np.abs(got[finite] - expected[finite])) / max(scale, 1e-300))


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (round to nearest even) and returned as float64: the values a function in that
    dtype is given. bfloat16, which NumPy lacks, is float32 with its low 16 bits rounded away."""
    if dtype != "bfloat16":
        return np.asarray(x).astype(dtype).astype(np.float64)
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000  # round the low half to nearest even
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """One case in one dtype.

    ``status`` is ``"pass"`` (forward, and gradients where checked, within :data:`TOLERANCE`), ``"differs"``
    (with ``finding`` naming the other semantics that fits, or None when none does), ``"unsupported"`` (the
    function raised NotImplementedError) or ``"error"`` (it raised something else; ``detail`` says what).
    Errors are relative to the float64 reference's scale; ``gradient_error`` is the largest of dq, dk and dv
    (None when gradients were not checked).
    """

    case: str
    dtype: str
    status: str
    forward_error: float | None = None
    gradient_error: float | None = None
    finding: str | None = None
    detail: str = ""


def _check_output(shape, grad_out: np.ndarray) -> None:
    """The function's output must have the shape of ``grad_out`` (B, Hq, Lq, Dv) before any backward."""
    if tuple(shape) != grad_out.shape:
        raise ValueError(f"output shape {tuple(shape)}, expected (B, Hq, Lq, Dv) = {grad_out.shape}")


def _as_numpy_run(fn, q, k, v, grad_out, spec, dtype, gradients):
    """(out, grads or None) of a NumPy function, in float64."""
    result = fn(*(x.astype(dtype) for x in (q, k, v)), spec)
    out, backward = result if isinstance(result, tuple) else (result, None)
    _check_output(np.shape(out), grad_out)
    grads = None
    if gradients and backward is not None:
        grads = tuple(np.asarray(g, dtype=np.float64) for g in backward(grad_out.astype(dtype)))
    return np.asarray(out, dtype=np.float64), grads


def _as_torch_run(fn, q, k, v, grad_out, spec, dtype, gradients):
    """(out, grads or None) of a torch function, in float64: the tensors require gradients when checked."""
    import torch

    tdtype = getattr(torch, dtype)
    tensors = [torch.from_numpy(x).to(tdtype).requires_grad_(gradients) for x in (q, k, v)]
    out = fn(*tensors, spec)
    _check_output(out.shape, grad_out)
    grads = None
    if gradients and out.requires_grad:
        out.backward(torch.from_numpy(grad_out).to(tdtype))
        grads = tuple(np.zeros(t.shape) if t.grad is None else t.grad.double().numpy() for t in tensors)
    return out.detach().double().numpy(), grads


def _grad_error(got, expected) -> float | None:
    if got is None or expected is None:
        return None
    return max(relative_error(g, e) for g, e in zip(got, expected))


def _diagnose(case: Case, dtype: str, inputs, got_out, got_grads) -> CaseResult:
    """Compare with the reference; when the output differs, name the variant it matches.

    A variant is named when the output is as close to it as the dtype allows (float32's tolerance at least, so
    that float64 inputs computed in float32 still show which semantics they have) and the variant is clearly
    not the reference (they differ by more than four times that).
    """
    q, k, v, grad_out = inputs
    tol = TOLERANCE[dtype]
    expected, expected_grads = reference_attention(q, k, v, case.spec, grad_out=grad_out)
    err, grad_err = relative_error(got_out, expected), _grad_error(got_grads, expected_grads)
    if err <= tol:
        ok = grad_err is None or grad_err <= tol
        return CaseResult(case.name, dtype, "pass" if ok else "differs", err, grad_err,
                          None if ok else "gradients differ (the output agrees)")
    match_tol = max(tol, TOLERANCE["float32"])
    for variant in VARIANTS:
        if not variant.applies(case):
            continue
        alt, alt_grads = variant.reference(case, q, k, v, grad_out if got_grads is not None else None)
        if relative_error(alt, expected) > 4 * match_tol and relative_error(got_out, alt) <= match_tol:
            # the gradients are judged against the semantics the output has, where the variant has them
            alt_err = _grad_error(got_grads, alt_grads)
            return CaseResult(case.name, dtype, "differs", err, grad_err if alt_err is None else alt_err,
                              variant.name)
    if dtype == "float64" and err <= match_tol and (grad_err is None or grad_err <= match_tol):
        return CaseResult(case.name, dtype, "differs", err, grad_err, FLOAT32_PRECISION)
    return CaseResult(case.name, dtype, "differs", err, grad_err, None, "no known variant fits")


def _run_case(fn, framework: str, case: Case, dtype: str, gradients: bool) -> CaseResult:
    q, k, v, grad_out = (round_to(x, dtype) for x in case.inputs())
    run = _as_torch_run if framework == "torch" else _as_numpy_run
    try:
        got_out, got_grads = run(fn, q, k, v, grad_out, case.spec, dtype, gradients)
    except NotImplementedError as exc:
        return CaseResult(case.name, dtype, "unsupported", detail=str(exc).splitlines()[0] if str(exc) else "")
    except Exception as exc:  # noqa: BLE001 - a referee's failure is a finding, reported with its type
        return CaseResult(case.name, dtype, "error", detail=f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                          if str(exc) else type(exc).__name__)
    return _diagnose(case, dtype, (q, k, v, grad_out), got_out, got_grads)


@dataclasses.dataclass
class ConformanceReport:
    """What :func:`check_attention` found: one :class:`CaseResult` per case and dtype."""

    name: str
    results: list[CaseResult]

    @property
    def passed(self) -> bool:
        """Every case that ran (not unsupported) passed."""
        return all(r.status in ("pass", "unsupported") for r in self.results)

    def findings(self) -> dict[str, list[str]]:
        """Each semantic difference found, with the cases (``"case (dtype)"``) that showed it."""
        found: dict[str, list[str]] = {}
        for r in self.results:
            if r.status in ("differs", "error"):
                key = r.finding or (r.detail if r.status == "error" else "differs, no known variant fits")
                found.setdefault(key, []).append(f"{r.case} ({r.dtype})")
        return found

    def result(self, case: str, dtype: str) -> CaseResult:
        """The result of ``case`` in ``dtype`` (KeyError when it was not run)."""
        for r in self.results:
            if (r.case, r.dtype) == (case, dtype):
                return r
        raise KeyError(f"no result for case {case!r} in {dtype}")

    def table(self) -> str:
        """A Markdown table: one row per case, the forward and gradient errors per dtype and what was found."""
        dtypes = list(dict.fromkeys(r.dtype for r in self.results))
        cases = list(dict.fromkeys(r.case for r in self.results))
        lines = ["| case | " + " | ".join(dtypes) + " | finding |", "|---|" + "---|" * len(dtypes) + "---|"]
        for case in cases:
            row = [self.result(case, d) for d in dtypes]
            found = sorted({r.finding or r.detail for r in row if r.status != "pass" and (r.finding or r.detail)})
            lines.append(f"| {case} | " + " | ".join(_cell(r) for r in row) + " | " + "; ".join(found) + " |")
        return "\n".join(lines)

    def __str__(self) -> str:
        found = self.findings()
        summary = "\n".join(f"- {key}: {', '.join(where)}" for key, where in found.items()) or "- none"
        return f"{self.name}\n\n{self.table()}\n\nsemantic differences found:\n{summary}"


def _cell(r: CaseResult) -> str:
    """``forward / gradient`` errors, with a mark: ✓ within tolerance, ✗ not; "unsupported" or "error"."""
    if r.status in ("unsupported", "error"):
        return r.status
    grad = "" if r.gradient_error is None else f" / {r.gradient_error:.1e}"
    return f"{'✓' if r.status == 'pass' else '✗'} {r.forward_error:.1e}{grad}"


def check_attention(fn: Callable, *, name: str | None = None, cases: Sequence[Case] | None = None,
                    dtypes: Sequence[str] | None = None, gradients: bool = True,
                    verbose: bool = False) -> ConformanceReport:
    """Run ``fn`` over the grid and compare it with attnkit's float64 attention, case by case.

    Parameters
    ----------
    fn : callable ``fn(q, k, v, spec) -> out``
        The calling convention of this module's docstring. ``fn.framework`` (``"numpy"`` when absent, or
        ``"torch"``) says which arrays it takes; ``fn.differentiable = False`` skips its gradients.
    name : str, optional
        The report's title (default: ``fn.__name__``).
    cases : sequence of Case, optional
        Default :func:`default_cases`.
    dtypes : sequence of str, optional
        Of ``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float64"``; default all four for torch and all but
        bfloat16 (which NumPy lacks) for NumPy. The inputs are the same numbers rounded to each dtype, and the
        reference runs in float64 on the rounded numbers, so an error is the function's own.
    gradients : bool
        Check the gradients too when ``fn`` gives them.
    verbose : bool
        Print the report.

    Returns
    -------
    ConformanceReport

    Examples
    --------
    >>> from attnkit.flex import flex_attention
    >>> def mine(q, k, v, spec):  # attention without masks, in the function's convention
    ...     if spec.causal or spec.mask is not None or spec.key_padding is not None or spec.softcap \\
    ...             or spec.sinks is not None or spec.alibi_slopes is not None:
    ...         raise NotImplementedError("masks and score modifiers")
    ...     return flex_attention(q, k, v, scale=spec.scale, enable_gqa=True, kernel="reference")[0]
    >>> report = check_attention(mine, dtypes=["float64"])
    >>> report.passed, report.result("default scale", "float64").status
    (True, 'pass')
    """
    framework = getattr(fn, "framework", "numpy")
    if framework not in ("numpy", "torch"):
        raise ValueError(f"fn.framework must be 'numpy' or 'torch', got {framework!r}")
    if dtypes is None:
        dtypes = DTYPES if framework == "torch" else tuple(d for d in DTYPES if d != "bfloat16")
    unknown = [d for d in dtypes if d not in TOLERANCE]
    if unknown or (framework == "numpy" and "bfloat16" in dtypes):
        raise ValueError(f"dtypes must be among {list(TOLERANCE)} (no bfloat16 for a NumPy function), got "
                         f"{list(dtypes)}")
    differentiable = gradients and getattr(fn, "differentiable", True)
    results = [_run_case(fn, framework, case, dtype, differentiable)
               for case in (default_cases() if cases is None else cases) for dtype in dtypes]
    report = ConformanceReport(name or getattr(fn, "__name__", type(fn).__name__), results)
    if verbose:
        print(report)
    return report
