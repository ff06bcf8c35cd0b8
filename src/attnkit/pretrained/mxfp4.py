"""MXFP4, the 4-bit block format of gpt-oss's expert weights, dequantized to float.

Each byte holds two FP4 (E2M1) codes, low nibble first; a block of 32 values shares one power-of-two scale
stored as a biased exponent byte (value = code's number * 2 ** (scale - 127)). Hugging Face folders of gpt-oss
keep each expert matrix as ``<name>_blocks`` (E, R, C / 32, 16) uint8 and ``<name>_scales`` (E, R, C / 32)
uint8, rows R being the matrix's output features; dequantized, the rows are (E, R, C) and the weight attnkit
and ``transformers`` multiply with is its transpose (E, C, R).
"""
from __future__ import annotations

import numpy as np

__all__ = ["FP4_VALUES", "dequantize_mxfp4"]

# The 16 numbers an E2M1 code stands for: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """The float values of MXFP4 blocks.

    Parameters
    ----------
    blocks : uint8 array (..., G, 16)
        Two codes per byte, the low nibble first.
    scales : uint8 array (..., G)
        One biased exponent per block of 32 values.
    dtype : float dtype
        Of the result. Every MXFP4 value is exact in float32 unless its scale leaves float32's range.

    Returns
    -------
    ndarray (..., G * 32)

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
    lut = FP4_VALUES.astype(dtype)
    values = np.empty(blocks.shape[:-1] + (32,), dtype=dtype)  # (..., G, 32)
    values[..., 0::2] = lut[blocks & 0x0F]
    values[..., 1::2] = lut[blocks >> 4]
    exponents = scales.astype(np.int32) - 127  # (..., G)
    values = np.ldexp(values, exponents[..., None]).astype(dtype, copy=False)  # (..., G, 32)
    return values.reshape(*blocks.shape[:-2], -1)  # (..., G * 32)
