"""Rotary position embedding (RoPE): frequencies with the scalings of real checkpoints, rotation, gradient.

Dimension letters: B batch, H heads, L positions, Dh features per head, R rotated features (R <= Dh, even).

A rotary embedding turns feature pair ``(a, b)`` of a token at position p by the angle ``p * inv_freq[i]``.
Two layouts pair the features differently:

- half-split (Hugging Face checkpoints): pair i is ``(x[i], x[i + R/2])``; ``cos``/``sin`` are
  ``cat(c, c)`` over the last axis;
- interleaved (the original RoFormer / Meta layout): pair i is ``(x[2i], x[2i + 1])``; ``cos``/``sin`` repeat
  every entry twice.

In both, ``rotated = x * cos + turn(x) * sin`` where ``turn`` maps each pair ``(a, b)`` to ``(-b, a)``. ``turn``
is antisymmetric, so the gradient is ``grad * cos - turn(grad * sin)``. Features past R pass through unchanged
(partial rotary).

Frequency scalings (Hugging Face ``rope_type``): ``default``; ``linear`` (positions divided by ``factor``);
``dynamic`` (NTK: the base grows with the sequence length once it passes ``max_position_embeddings``);
``yarn`` (a ramp between interpolated and original frequencies, plus an attention factor multiplying cos and
sin); ``llama3`` (low frequencies divided by ``factor``, high ones kept, a smooth blend between);
``longrope`` (Phi-3: one divisor per frequency, ``short_factor`` up to ``original_max_position_embeddings`` and
``long_factor`` past it, and an attention factor); ``proportional`` (Gemma 4's global layers: the table spans the
whole head, its first ``partial_rotary_factor * Dh / 2`` frequencies are the default ones of a Dh-wide rotary and
the rest are zero, so the pairs ``(x[i], x[i + Dh/2])`` past them pass through; all divided by ``factor``).
Frequencies and angles are computed in float64 and cast once at the end.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["rotary_apply", "rotary_apply_in_place", "rotary_backward", "rotary_cos_sin", "rotary_frequencies",
           "rotary_table_fault", "TABLE_DTYPE", "turn"]

# The narrowest dtype the cos/sin tables are computed in (a model loaded in float16): tables finite in it are
# finite in every float dtype.
TABLE_DTYPE = np.dtype(np.float16)


def _base_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)  # (R/2,)


def _yarn(rotary_dim: int, theta: float, scaling: dict, max_position_embeddings: int):
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The feature index whose wavelength fits `rotations` times into the original context.
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)  # (R/2,)
    keep = 1.0 - ramp  # 1: original (extrapolated) frequency, 0: interpolated
    base = _base_inv_freq(rotary_dim, theta)  # (R/2,)
    return base / factor * (1.0 - keep) + base * keep, float(attention_factor)


def _llama3(rotary_dim: int, theta: float, scaling: dict):
    base = _base_inv_freq(rotary_dim, theta)  # (R/2,)
    factor = scaling["factor"]
    low_factor, high_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / base  # (R/2,)
    low_wavelength, high_wavelength = context / low_factor, context / high_factor
    scaled = np.where(wavelength > low_wavelength, base / factor, base)  # (R/2,)
    smooth = (context / wavelength - low_factor) / (high_factor - low_factor)  # (R/2,)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return np.where(medium, blended, scaled), 1.0


def _longrope(rotary_dim: int, theta: float, scaling: dict, max_position_embeddings: int, seq_len: int | None):
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    divisors = scaling["long_factor"] if seq_len and seq_len > original else scaling["short_factor"]
    return _base_inv_freq(rotary_dim, theta) / np.asarray(divisors, dtype=np.float64), float(attention_factor)


def _proportional(rotary_dim: int, theta: float, scaling: dict):
    # The rotated share keeps the frequencies of a rotary over the whole head (exponents over Dh, not over the
    # rotated width); the remaining pairs turn by angle 0, that is, not at all.
    angles = int(scaling.get("partial_rotary_factor", 1.0) * rotary_dim // 2)
    inv_freq = np.zeros(rotary_dim // 2, dtype=np.float64)  # (R/2,)
    inv_freq[:angles] = 1.0 / theta ** (np.arange(0, 2 * angles, 2, dtype=np.float64) / rotary_dim)
    return inv_freq / scaling.get("factor", 1.0), 1.0


def rotary_frequencies(rotary_dim: int, theta: float, scaling: dict | None = None, *,
                       max_position_embeddings: int = 2048, seq_len: int | None = None):
    """Inverse frequencies and the cos/sin multiplier of one rotary configuration.

    Parameters
    ----------
    rotary_dim : int
        R, the rotated features per head (even).
    theta : float
        The base.
    scaling : dict, optional
        Hugging Face ``rope_scaling`` with ``"rope_type"``; ``None`` is the default (unscaled) rotary.
    max_position_embeddings : int
        The model's context (``dynamic`` scales past it; ``yarn`` derives ``factor`` from it when missing).
    seq_len : int, optional
        ``dynamic`` and ``longrope`` only: the length being processed (the largest position + 1).

    Returns
    -------
    inv_freq : (R/2,) float64
    attention_factor : float
    """
    kind = "default" if scaling is None else scaling.get("rope_type", "default")
    if kind == "default":
        return _base_inv_freq(rotary_dim, theta), 1.0
    if kind == "linear":
        return _base_inv_freq(rotary_dim, theta) / scaling["factor"], 1.0
    if kind == "dynamic":
        length = max(seq_len or 0, max_position_embeddings)
        factor = scaling["factor"]
        grown = theta * (factor * length / max_position_embeddings - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return _base_inv_freq(rotary_dim, grown), 1.0
    if kind == "yarn":
        return _yarn(rotary_dim, theta, scaling, max_position_embeddings)
    if kind == "llama3":
        return _llama3(rotary_dim, theta, scaling)
    if kind == "longrope":
        return _longrope(rotary_dim, theta, scaling, max_position_embeddings, seq_len)
    if kind == "proportional":
        return _proportional(rotary_dim, theta, scaling)
    raise ValueError(f"unknown rope_type {kind!r}")


def rotary_cos_sin(position_ids: np.ndarray, inv_freq: np.ndarray, attention_factor: float = 1.0, *,
                   interleaved: bool = False, dtype=np.float32):
    """``cos`` and ``sin`` of every position's angles, laid out for :func:`rotary_apply`.

    Shapes
    ------
    position_ids (B, L) int, inv_freq (R/2,) -> cos, sin (B, L, R) in ``dtype``.
    """
    angles = position_ids[..., None].astype(np.float64) * inv_freq  # (B, L, R/2)
    if interleaved:
        angles = np.repeat(angles, 2, axis=-1)  # (B, L, R)
    else:
        angles = np.concatenate([angles, angles], axis=-1)  # (B, L, R)
    cos = (np.cos(angles) * attention_factor).astype(dtype)  # (B, L, R)
    sin = (np.sin(angles) * attention_factor).astype(dtype)  # (B, L, R)
    return cos, sin


def rotary_table_fault(inv_freq: np.ndarray, attention_factor: float, max_position_embeddings: int,
                       dtype=TABLE_DTYPE) -> str | None:
    """What would make the cos/sin tables of positions [0, ``max_position_embeddings``) not finite in ``dtype``.

    The tables are ``cos(p * inv_freq) * attention_factor`` and ``sin(...)``, as :func:`rotary_cos_sin`
    computes them. Their largest entry is at position 0, where cos is 1 (so it is the attention factor
    itself), and the angles grow with the position: the rows of the first and the last position decide for
    every row, and they are computed here exactly as the tables are.

    Returns
    -------
    None, ``"frequencies"`` or ``"attention factor"``
        ``"frequencies"``: some angle ``p * inv_freq`` is not finite (the tables would hold NaN whatever the
        factor); ``"attention factor"``: the angles are finite, but the factor is not a positive number or its
        tables overflow ``dtype``.

    Examples
    --------
    >>> inv_freq = rotary_frequencies(4, 10000.0)[0]
    >>> rotary_table_fault(inv_freq, 1.0, 4096), rotary_table_fault(inv_freq, 1e5, 4096)
    (None, 'attention factor')
    >>> rotary_table_fault(inv_freq * 1e306, 1.0, 4096)   # finite, but 4095 times it is not
    'frequencies'
    """
    positions = np.array([[0, max(int(max_position_embeddings) - 1, 0)]])  # (1, 2)
    with np.errstate(all="ignore"):  # an overflow here is the answer, not a warning
        unit = rotary_cos_sin(positions, np.asarray(inv_freq, np.float64), 1.0, dtype=np.float64)  # (1, 2, R) each
        tables = rotary_cos_sin(positions, np.asarray(inv_freq, np.float64), attention_factor, dtype=dtype)
    if not all(np.isfinite(t).all() for t in unit):
        return "frequencies"
    if not attention_factor > 0 or not all(np.isfinite(t).all() for t in tables):
        return "attention factor"
    return None


def turn(x: np.ndarray, interleaved: bool = False) -> np.ndarray:
    """Map every feature pair ``(a, b)`` to ``(-b, a)`` (a quarter turn) in the given layout."""
    out = np.empty_like(x)
    if interleaved:
        out[..., 0::2] = -x[..., 1::2]
        out[..., 1::2] = x[..., 0::2]
    else:
        half = x.shape[-1] // 2
        out[..., :half] = -x[..., half:]
        out[..., half:] = x[..., :half]
    return out


def rotary_apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool = False) -> np.ndarray:
    """Rotate the first R features of every head of ``x``; the rest pass through.

    Shapes
    ------
    x (B, H, L, Dh), cos/sin (B, L, R) -> (B, H, L, Dh) in ``x``'s dtype (a fresh array).
    """
    r = cos.shape[-1]
    c, s = cos[:, None].astype(x.dtype, copy=False), sin[:, None].astype(x.dtype, copy=False)  # (B, 1, L, R)
    rot = x[..., :r]  # (B, H, L, R)
    rotated = rot * c + turn(rot, interleaved) * s  # (B, H, L, R)
    if r == x.shape[-1]:
        return rotated
    return np.concatenate([rotated, x[..., r:]], axis=-1)  # (B, H, L, Dh)


def rotary_apply_in_place(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool = False) -> np.ndarray:
    """:func:`rotary_apply` written over ``x`` itself, the same numbers bit for bit, in five NumPy calls.

    For a decoding step, whose query and key heads are a few hundred numbers: the cost is the calls, not the
    arithmetic. Each pair ``(a, b)`` becomes ``(a cos - b sin, b cos + a sin)``, which is what
    ``x * cos + turn(x) * sin`` rounds to (``a cos + (-b) sin`` and ``a cos - b sin`` are the same float).
    ``x`` must be an array the caller owns (a fresh projection), never a caller's input.

    Shapes
    ------
    x (B, H, L, Dh) writable, cos/sin (B, L, R) -> ``x``, its first R features rotated.
    """
    r = cos.shape[-1]
    c, s = cos[:, None].astype(x.dtype, copy=False), sin[:, None].astype(x.dtype, copy=False)  # (B, 1, L, R)
    first, second = (slice(0, r, 2), slice(1, r, 2)) if interleaved else (slice(0, r // 2), slice(r // 2, r))
    rot = x[..., :r]  # (B, H, L, R)
    minus = rot[..., second] * s[..., first]  # (B, H, L, R/2): b sin, before x changes
    plus = rot[..., first] * s[..., second]  # (B, H, L, R/2): a sin
    rot *= c
    rot[..., first] -= minus
    rot[..., second] += plus
    return x


def rotary_backward(grad: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool = False) -> np.ndarray:
    """Gradient of :func:`rotary_apply` with respect to ``x`` (the rotation transposed: by ``-angle``)."""
    r = cos.shape[-1]
    c, s = cos[:, None].astype(grad.dtype, copy=False), sin[:, None].astype(grad.dtype, copy=False)  # (B, 1, L, R)
    g = grad[..., :r]  # (B, H, L, R)
    back = g * c - turn(g * s, interleaved)  # (B, H, L, R)
    if r == grad.shape[-1]:
        return back
    return np.concatenate([back, grad[..., r:]], axis=-1)  # (B, H, L, Dh)
