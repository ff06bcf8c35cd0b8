"""MXFP4, the 4-bit block format of gpt-oss's expert weights, dequantized to float.

Each byte holds two FP4 (E2M1) codes, low nibble first; a block of 32 values shares one power-of-two scale
stored as a biased exponent byte (E8M0: value = code's number * 2 ** (scale - 127); the byte 0xFF is not an
exponent but NaN, so a block scaled by it has no value and is refused). Hugging Face folders of gpt-oss
keep each expert matrix as ``<name>_blocks`` (E, R, C / 32, 16) uint8 and ``<name>_scales`` (E, R, C / 32)
uint8, rows R being the matrix's output features; dequantized, the rows are (E, R, C) and the weight attnkit
and ``transformers`` multiply with is its transpose (E, C, R).

Dimension letters: G blocks of 32 values.
"""
from __future__ import annotations

import numpy as np

__all__ = ["FP4_VALUES", "NAN_SCALE", "check_scales", "dequantize_mxfp4"]

# The 16 numbers an E2M1 code stands for: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

# The E8M0 scale byte that means NaN in the OCP Microscaling (MX) format. Read as an exponent it is 2 ** 128,
# which turns every non-zero code of its block into inf in float32 (and a model's logits into NaN).
NAN_SCALE = 0xFF

# Every byte's two values, low nibble first: one gather (np.take) decodes a byte, where indexing a table per
# nibble took two gathers and two masks (a gather by np.take ran 10x faster than fancy indexing here).
_PAIRS = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]], axis=-1)  # (256, 2)
_PAIRS_BY_DTYPE = {np.dtype(d): _PAIRS.astype(d) for d in (np.float32, np.float64)}


def check_scales(scales: np.ndarray, name: str = "scales") -> None:
    """Refuse MXFP4 scales that hold the NaN code.

    Parameters
    ----------
    scales : uint8 array (..., G)
    name : str
        Named in the error (a checkpoint's tensor name).

    Raises
    ------
    ValueError
        Some scale is 0xFF; the message gives the first one's index and how many there are.
    """
    bad = scales == NAN_SCALE  # (..., G)
    if bad.any():
        first = ", ".join(str(int(i)) for i in np.argwhere(bad)[0])
        count = int(np.count_nonzero(bad))
        raise ValueError(f"MXFP4 scales {name!r} hold 0xFF (the NaN code of the E8M0 scale) at [{first}]"
                         + (f" and {count - 1} more places" if count > 1 else "")
                         + ": those blocks have no value")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32, *, name: str = "scales"
                     ) -> np.ndarray:
    """The float values of MXFP4 blocks.

    Every value is computed exactly (a code's number times a power of two) and rounded once to ``dtype``.

    Parameters
    ----------
    blocks : uint8 array (..., G, 16)
        Two codes per byte, the low nibble first.
    scales : uint8 array (..., G)
        One biased exponent per block of 32 values (0xFF, the NaN code, is refused).
    dtype : float dtype
        Of the result. Every MXFP4 value is exact in float32 unless its scale leaves float32's range.
    name : str
        The scales' name in errors.

    Returns
    -------
    ndarray (..., G * 32)

    Raises
    ------
    ValueError
        A scale is 0xFF (see :func:`check_scales`), or the shapes do not pair up.

    Examples
    --------
    >>> blocks = np.zeros((1, 16), np.uint8); blocks[0, 0] = 0x72   # codes 2 (1.0) then 7 (6.0)
    >>> dequantize_mxfp4(blocks, np.array([128], np.uint8))[:3].tolist()
    [2.0, 12.0, 0.0]
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise TypeError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks must be (..., G, 16) and scales (..., G), got {blocks.shape} and {scales.shape}")
    check_scales(scales, name)
    exact = np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)  # every product exact in it
    values = np.take(_PAIRS_BY_DTYPE[exact], blocks, axis=0).reshape(*blocks.shape[:-1], 32)  # (..., G, 32)
    # 2 ** (scale - 127) lies in [2**-127, 2**127], inside float32's range (subnormal at the bottom, exact)
    powers = np.ldexp(np.ones((), exact), scales.astype(np.int32) - 127)  # (..., G)
    values *= powers[..., None]
    return values.reshape(*blocks.shape[:-2], -1).astype(dtype, copy=False)  # (..., G * 32)
