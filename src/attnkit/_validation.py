"""Input checks shared by the public functions.

Every public function converts and checks its arguments here, so that bad input fails at the boundary
with a message naming the argument, the shape it got and the shape it expected, and never as a numpy
traceback from deep inside a kernel. Checks raise explicitly (never ``assert``, which ``python -O`` drops).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

__all__ = [
    "as_array",
    "as_float_array",
    "check_features",
    "check_grad_output",
    "common_float_dtype",
    "returns_input_precision",
    "check_ndim",
    "check_mask",
    "check_positive_int",
    "check_real",
    "check_factor",
    "check_scale",
    "FACTOR_RANGE",
    "shown",
    "unbroadcast",
    "check_qkv",
    "check_qkv_shapes",
    "as_bool_mask",
    "check_mha_mask",
    "check_head_size",
    "check_eps",
    "check_finite",
]


def as_array(x: Any, name: str) -> np.ndarray:
    """``np.asarray(x)``, with a ragged nesting (rows of different lengths) reported naming ``name``.

    Raises
    ------
    ValueError
        If ``x`` is a nested sequence whose rows differ in length.
    """
    try:
        return np.asarray(x)
    except ValueError as exc:
        if "inhomogeneous" not in str(exc):
            raise
        lengths = sorted({len(row) for row in x if hasattr(row, "__len__")}) if hasattr(x, "__iter__") else []
        raise ValueError(f"{name} must be a rectangular array: its rows have different lengths {lengths} (pad "
                         f"them to one length and pass attention_mask)") from None


def as_float_array(x: Any, name: str) -> np.ndarray:
    """Return ``x`` as a floating ndarray without copying floats; integers and bools become float64.

    Raises
    ------
    TypeError
        If ``x`` is not numeric (strings, objects, complex numbers).
    """
    arr = np.asarray(x)
    if arr.dtype.kind == "f":
        return arr
    if arr.dtype.kind in "iub":
        return arr.astype(np.float64)
    raise TypeError(f"{name} must be a real numeric array, got dtype {arr.dtype} (shape {arr.shape})")


def common_float_dtype(*arrays: np.ndarray) -> np.dtype:
    """The dtype every computation on ``arrays`` runs in: float32 only if all are float32 (or narrower)."""
    return np.result_type(*[a.dtype for a in arrays], np.float32)


def _narrow_floats(result: Any, dtype: np.dtype) -> Any:
    if isinstance(result, np.ndarray) and result.dtype.kind == "f" and result.dtype.itemsize > dtype.itemsize:
        return result.astype(dtype)
    if isinstance(result, tuple):
        return tuple(_narrow_floats(r, dtype) for r in result)
    if isinstance(result, list):
        return [_narrow_floats(r, dtype) for r in result]
    if isinstance(result, dict):
        return {key: _narrow_floats(value, dtype) for key, value in result.items()}
    return result


def returns_input_precision(fn):
    """Decorate a public function that computes in :func:`common_float_dtype` (float32 at least) so that it
    returns what its float inputs were: with only float16 arrays in, every float array it returns is float16
    (float32 and float64 inputs already come back unchanged). Lists, ints and bools in are left alone.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        floats = [a.dtype for a in (*args, *kwargs.values()) if isinstance(a, np.ndarray) and a.dtype.kind == "f"]
        result = fn(*args, **kwargs)
        if floats and np.result_type(*floats) == np.float16:
            return _narrow_floats(result, np.dtype(np.float16))
        return result

    return wrapper


def check_ndim(x: np.ndarray, name: str, ndim: int | None = None, min_ndim: int | None = None,
               expected: str = "") -> None:
    """Raise ``ValueError`` unless ``x`` has exactly ``ndim`` (or at least ``min_ndim``) dimensions."""
    bad = (ndim is not None and x.ndim != ndim) or (min_ndim is not None and x.ndim < min_ndim)
    if bad:
        want = expected or (f"{ndim}-D" if ndim is not None else f"at least {min_ndim}-D")
        raise ValueError(f"{name} must be {want}, got shape {x.shape}")


_LONG_INTEGER = 20  # digits past which an integer is described by its length in messages

# Scales, multipliers and soft-caps of a model (a config's routed_scaling_factor, soft-caps, query_pre_attn_scalar,
# SwiGLU's alpha and limit, the attention scale): float16's normal range. Real models use 0.01 to 100; a factor
# past either end overflows or vanishes in the narrowest dtype a model runs in (DeepSeek's routed_scaling_factor of
# 1e308 made every logit NaN; a soft-cap of 1e-320 is 0 in float32 and divides the scores by it).
FACTOR_RANGE = (2.0 ** -14, 65504.0)


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, except that an integer of more than 20 digits is described by its
    length: ``an integer of 401 digits`` (Python refuses to print one of more than 4300).

    >>> shown(3), shown("a"), shown(10**400)
    ('3', "'a'", 'an integer of 401 digits')
    """
    if isinstance(value, int) and not isinstance(value, bool):
        magnitude = abs(value)
        digits = max(1, int(magnitude.bit_length() * math.log10(2)) + 1)  # exact or one too many
        if digits > 1 and magnitude < 10 ** (digits - 1):
            digits -= 1
        if digits > _LONG_INTEGER:
            return f"{'a negative' if value < 0 else 'an'} integer of {digits} digits"
    return repr(value)


def check_positive_int(value: Any, name: str, allow_zero: bool = False, *, maximum: int | None = None) -> int:
    """``value`` as a Python int: the one check of a size, count or length argument.

    ``TypeError`` for anything that is not an integer (bools included: ``True`` is not a size),
    ``ValueError`` below 1 (below 0 with ``allow_zero``) or above ``maximum``.

    >>> check_positive_int(np.int64(3), "num_heads")
    3
    >>> check_positive_int(0, "num_heads")
    Traceback (most recent call last):
    ValueError: num_heads must be positive, got 0
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {shown(value)}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'non-negative' if allow_zero else 'positive'}, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {shown(value)}")
    return int(value)


def _range_text(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if high is None and low == 0:
        return "a finite positive number" if low_open else "a finite non-negative number"
    if low is None and high is None:
        return "a finite number"
    if high is None:
        return f"a finite number {'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"a finite number {'<' if high_open else '<='} {high:g}"
    return f"a finite number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_real(value: Any, name: str, *, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False, expected: str | None = None) -> float:
    """``value`` as a finite Python float, optionally within ``[low, high]`` (each end open when asked): the one
    conversion of every number attnkit reads from a file or takes as an argument. ``expected`` words the range
    in messages (default: from the bounds).

    Raises
    ------
    TypeError
        ``value`` is not a real number (bools, strings, arrays and None included), naming ``name``.
    ValueError
        NaN, an infinity, an integer beyond a float's range (``10**400``: Python's own conversion would raise
        ``OverflowError``) or a number outside the range, naming ``name`` and the range.

    Examples
    --------
    >>> check_real(np.float32(0.5), "top_p", low=0, high=1)
    0.5
    >>> check_real(10**400, "rope_theta", low=0, low_open=True)
    Traceback (most recent call last):
    ValueError: rope_theta must be a finite positive number, got an integer of 401 digits
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # a Python int beyond float's range
        number = math.inf
    below = low is not None and (number <= low if low_open else number < low)
    above = high is not None and (number >= high if high_open else number > high)
    if not math.isfinite(number) or below or above:
        expected = expected or _range_text(low, high, low_open, high_open)
        raise ValueError(f"{name} must be {expected}, got {shown(value)}")
    return number


def check_scale(value: Any, name: str = "scale") -> float:
    """``value`` as the factor of the scores ``q k^T``: a number of magnitude at most 65504 (0 and negative
    scales included), through :func:`check_real`. A scale of ±1e308 makes scores of inf and a NaN softmax; one
    that large is nobody's (real ones are ``1 / sqrt(D)``), and float16's largest number bounds it as it bounds
    :func:`check_factor`.

    >>> check_scale(-0.25)
    -0.25
    >>> check_scale(-1e308)
    Traceback (most recent call last):
    ValueError: scale must be a finite number in [-65504, 65504], got -1e+308
    """
    return check_real(value, name, low=-FACTOR_RANGE[1], high=FACTOR_RANGE[1])


def check_factor(value: Any, name: str) -> float:
    """``value`` as a scale, multiplier or soft-cap of a model: a number in :data:`FACTOR_RANGE` (float16's normal
    range, ``[2**-14, 65504]``), through :func:`check_real`.

    >>> check_factor(2.5, "routed_scaling_factor")
    2.5
    >>> check_factor(1e308, "routed_scaling_factor")
    Traceback (most recent call last):
    ValueError: routed_scaling_factor must be a number in [2**-14, 65504] (float16's normal range), got 1e+308
    """
    return check_real(value, name, low=FACTOR_RANGE[0], high=FACTOR_RANGE[1],
                      expected="a number in [2**-14, 65504] (float16's normal range)")


def check_mask(mask: Any, name: str, target_shape: tuple[int, ...], target_desc: str = "scores") -> np.ndarray | None:
    """Validate a boolean attention mask (``True`` = may attend) against the scores it will mask.

    The mask must be boolean and broadcast to ``target_shape`` by numpy's rules without enlarging it:
    a mask may not add batch dimensions the scores do not have.

    Returns
    -------
    numpy.ndarray or None
        The mask as a boolean array (``None`` passes through).
    """
    if mask is None:
        return None
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise TypeError(
            f"{name} must be a boolean array (True = may attend), got dtype {m.dtype} with shape {m.shape}; "
            f"convert a 0/1 mask with `{name}.astype(bool)`"
        )
    try:
        out_shape = np.broadcast_shapes(m.shape, target_shape)
    except ValueError:
        out_shape = None
    if out_shape != tuple(target_shape):
        raise ValueError(
            f"{name} of shape {m.shape} does not broadcast to the {target_desc} shape {tuple(target_shape)}; "
            f"a (batch, seq_k) padding mask must be reshaped, e.g. mask[:, None, None, :] for (B, H, Lq, Lk)"
        )
    return m


def unbroadcast(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``grad`` over the axes that broadcasting added or stretched, so that it has ``shape``."""
    if grad.shape == tuple(shape):
        return grad
    extra = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(extra))) if extra > 0 else grad
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if stretched:
        grad = grad.sum(axis=stretched, keepdims=True)
    return grad


def check_qkv(q: Any, k: Any, v: Any = None, owner: str = "", *, names: tuple[str, str, str] = ("q", "k", "v"),
              same_features: bool = False, same_rank: bool = True,
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, tuple[int, ...]]:
    """Convert and check the queries, keys and (optionally) values of an attention call: the one q/k/v check.

    Converts to floating arrays of one common dtype (ints become float64; the caller's arrays are never
    modified) and checks the ranks, that keys and values have the same length and that the leading dims
    broadcast.

    Parameters
    ----------
    q, k, v : array_like, shapes (..., Lq, Dq), (..., Lk, Dk), (..., Lk, Dv); ``v`` may be None
    owner : str
        Name of the caller, prefixed to error messages ("" for none).
    names : tuple of str
        How the caller's signature spells the three arguments (``("Q", "K", "V")`` in the functional API).
    same_features : bool
        Require ``Dq == Dk`` (dot-product scores; additive heads project each side and need not).
    same_rank : bool
        Require one rank for all three (the heads); the functional API broadcasts leading dims freely.

    Returns
    -------
    q, k, v : ndarrays of the common float dtype (``v`` None when not given)
    lead : tuple of int
        The broadcast leading shape ``...`` of all given arrays (of the output (..., Lq, Dv)).

    Raises
    ------
    TypeError
        Non-numeric input.
    ValueError
        Fewer than 2 dims, different ranks, Dq != Dk, Lk of k and v differ, leading dims that do not broadcast.

    >>> q, k, v, lead = check_qkv(np.ones((2, 3, 4)), np.ones((2, 5, 4)), np.ones((2, 5, 6), np.float32))
    >>> q.dtype, lead
    (dtype('float64'), (2,))
    >>> check_qkv(np.ones((3, 4)), np.ones((5, 2)), None, "Attention", same_features=True)
    Traceback (most recent call last):
    ValueError: Attention: q has 4 features but k has 2; they must match (q: (3, 4), k: (5, 2))
    """
    given = [(n, as_float_array(x, n)) for n, x in zip(names, (q, k, v)) if x is not None]
    lead = check_qkv_shapes(*(x for _, x in given), owner=owner, names=names, same_features=same_features,
                            same_rank=same_rank)
    dtype = common_float_dtype(*(x for _, x in given))
    q, k = (x.astype(dtype, copy=False) for _, x in given[:2])
    v = None if v is None else given[2][1].astype(dtype, copy=False)
    return q, k, v, lead


def check_qkv_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray | None = None, *, owner: str = "",
                     names: tuple[str, str, str] = ("q", "k", "v"), same_features: bool = False,
                     same_rank: bool = True) -> tuple[int, ...]:
    """The shape rules of :func:`check_qkv` on arrays that are already arrays (no conversion): for the kernels,
    which keep their inputs' dtypes. Returns the broadcast leading shape."""
    prefix = f"{owner}: " if owner else ""
    given = [(n, x) for n, x in zip(names, (q, k, v)) if x is not None]
    listed = ", ".join(n for n, _ in given[:-1]) + f" and {given[-1][0]}"  # "q, k and v"
    for name, x in given:
        if x.ndim < 2:
            raise ValueError(f"{prefix}{name} must be at least 2-D (..., seq, features), got shape {x.shape}")
    shapes = ", ".join(f"{n}: {x.shape}" for n, x in given)
    if same_rank and len({x.ndim for _, x in given}) > 1:
        raise ValueError(f"{prefix}{listed} must have the same number of dimensions, "
                         f"got shapes {shapes}")
    (nq, q), (nk, k) = given[:2]
    if same_features and q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{prefix}{nq} has {q.shape[-1]} features but {nk} has {k.shape[-1]}; they must match "
                         f"({nq}: {q.shape}, {nk}: {k.shape})")
    if v is not None:
        nv = names[2]
        if k.shape[-2] != v.shape[-2]:
            raise ValueError(f"{prefix}{nk} has length {k.shape[-2]} but {nv} has length {v.shape[-2]} "
                             f"({nk}: {k.shape}, {nv}: {v.shape})")
    try:
        return tuple(np.broadcast_shapes(*(x.shape[:-2] for _, x in given)))
    except ValueError:
        raise ValueError(f"{prefix}the leading (batch/head) dims of {listed} do not "
                         f"broadcast ({shapes})") from None


def as_bool_mask(mask: Any, name: str = "mask", allow_int: bool = False) -> np.ndarray | None:
    """``mask`` as a boolean array (``True`` = may attend); ``None`` passes through.

    With ``allow_int`` an integer array of 0s and 1s is accepted too (1 = may attend, 0 = masked), the way
    the ``Attention`` module documents its masks; any other value, and floating masks (easily confused with
    additive biases), are refused.
    """
    if mask is None:
        return None
    m = np.asarray(mask)
    if m.dtype == np.bool_:
        return m
    if allow_int and m.dtype.kind in "iu":
        if not np.all((m == 0) | (m == 1)):
            raise ValueError(f"{name} holds integers other than 0 and 1 (shape {m.shape}); 1 = may attend, "
                             f"0 = masked")
        return m.astype(bool)
    accepted = "boolean or a 0/1 integer array" if allow_int else "boolean"
    raise TypeError(f"{name} must be {accepted} (True = may attend), got dtype {m.dtype} with shape {m.shape}")


def check_mha_mask(mask: Any, name: str, batch: int, num_heads: int, seq_q: int, seq_k: int) -> np.ndarray | None:
    """Validate a mask for (B, H, Lq, Lk) scores: 1-D (Lk,), 2-D (Lq, Lk) or 4-D (B|1, H|1, Lq|1, Lk).

    A 3-D mask is refused: numpy would read (B, Lq, Lk) as (H, Lq, Lk), silently wrong when B == H.
    """
    if mask is None:
        return None
    if np.ndim(mask) == 3:
        raise ValueError(f"{name} of shape {np.shape(mask)} is ambiguous for (batch, heads, seq_q, seq_k) "
                         f"scores {(batch, num_heads, seq_q, seq_k)}: give it as (seq_q, seq_k) or 4-D, "
                         f"e.g. mask[:, None] for a (batch, seq_q, seq_k) mask")
    return check_mask(mask, name, (batch, num_heads, seq_q, seq_k), "(batch, heads, seq_q, seq_k) scores")


def check_head_size(features: int, num_heads: int, name: str = "d_model") -> int:
    """The head size ``features // num_heads``; ``ValueError`` naming ``name`` unless it is a positive integer.

    A head of size 0 (``features < num_heads``, or no features at all) would silently attend with empty
    vectors, so it is refused like a size that ``num_heads`` does not divide.
    """
    if features < num_heads or features % num_heads:
        why = "is not divisible by" if features % num_heads else "gives heads of size 0 for"
        raise ValueError(f"{name} = {features} {why} num_heads = {num_heads}: num_heads = {num_heads} must divide "
                         f"it, with at least one feature per head")
    return features // num_heads


def check_eps(eps: Any, name: str = "eps") -> float:
    """``eps`` as a float; ``ValueError`` unless it is a number in (0, 65504]: above 0 it keeps
    ``1 / sqrt(var + eps)`` finite, and it is added in the input's dtype (float16 too), where 1e308 overflows."""
    expected = "a positive number up to 65504"
    try:
        return check_real(eps, name, low=0, low_open=True, high=FACTOR_RANGE[1], expected=expected)
    except TypeError:
        raise ValueError(f"{name} must be {expected}, got {shown(eps)}") from None


def check_finite(x: np.ndarray, name: str) -> np.ndarray:
    """``x`` unchanged; ``ValueError`` naming it if any entry is NaN or infinite."""
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must be finite, got NaN or inf (shape {np.shape(x)})")
    return x


def check_features(x: Any, name: str, features: int, owner: str, feature_name: str) -> np.ndarray:
    """``x`` as a float array of at least 1 dim whose last axis has ``features`` entries."""
    x = as_float_array(x, name)
    check_ndim(x, name, min_ndim=1, expected=f"at least 1-D (..., {feature_name}={features})")
    if x.shape[-1] != features:
        raise ValueError(f"{owner}: {name} has {x.shape[-1]} features, expected {feature_name} = {features} "
                         f"(got shape {x.shape})")
    return x


def check_grad_output(grad_output: Any, expected_shape: tuple[int, ...], dtype: np.dtype, owner: str) -> np.ndarray:
    """``grad_output`` as an array of the forward output's shape, in the forward's compute dtype."""
    g = as_float_array(grad_output, "grad_output")
    if g.shape != tuple(expected_shape):
        raise ValueError(f"{owner}: grad_output has shape {g.shape}, expected the output shape {tuple(expected_shape)}")
    return g.astype(dtype, copy=False)
