"""Positional encodings and the masks every Transformer needs.

Masks are boolean, ``True`` = may attend / real token.
"""
from __future__ import annotations

import numpy as np

from ._validation import as_float_array, check_ndim, check_positive_int, returns_input_precision
from .init import as_generator, normal
from .kernels.reference import causal_mask

__all__ = ["sinusoidal_encoding", "add_positional_encoding", "learned_positional_encoding",
           "create_causal_mask", "create_padding_mask"]


def sinusoidal_encoding(max_length: int, d_model: int) -> np.ndarray:
    """Sinusoidal positional encodings of "Attention Is All You Need".

    ``PE[pos, 2i] = sin(pos / 10000^(2i / d_model))`` and ``PE[pos, 2i+1] = cos(pos / 10000^(2i / d_model))``;
    an odd ``d_model`` ends on a sine column.

    Parameters
    ----------
    max_length : int
        Number of positions (>= 0).
    d_model : int
        Model dimension (>= 1).

    Returns
    -------
    encodings : ndarray of float64, shape (max_length, d_model)

    Examples
    --------
    >>> pe = sinusoidal_encoding(100, 512)
    >>> pe.shape
    (100, 512)
    >>> pe[1, :4].round(4)
    array([0.8415, 0.5403, 0.8219, 0.5697])
    """
    max_length = check_positive_int(max_length, "max_length", allow_zero=True)
    d_model = check_positive_int(d_model, "d_model")
    pos = np.arange(max_length, dtype=np.float64)[:, None]  # (L, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)  # (ceil(D/2),)
    angles = pos / np.power(10000.0, two_i / d_model)  # (L, ceil(D/2))
    pe = np.empty((max_length, d_model))
    pe[:, 0::2] = np.sin(angles)
    pe[:, 1::2] = np.cos(angles[:, : d_model // 2])
    return pe


@returns_input_precision
def add_positional_encoding(x: np.ndarray, pe: np.ndarray) -> np.ndarray:
    """Add positional encodings to embeddings: ``x + pe[:seq_len]``.

    Parameters
    ----------
    x : ndarray, shape (batch, seq_len, d_model)
    pe : ndarray, shape (max_len, d_model), ``max_len >= seq_len``

    Returns
    -------
    output : ndarray, same shape as ``x``, in ``x``'s dtype (a new array)

    Examples
    --------
    >>> add_positional_encoding(np.zeros((1, 2, 4)), sinusoidal_encoding(8, 4))[0, 1].round(3)
    array([0.841, 0.54 , 0.01 , 1.   ])
    """
    x = as_float_array(x, "x")
    pe = as_float_array(pe, "pe")
    check_ndim(x, "x", ndim=3, expected="3-D (batch, seq_len, d_model)")
    check_ndim(pe, "pe", ndim=2, expected="2-D (max_len, d_model)")
    if pe.shape[1] != x.shape[2]:
        raise ValueError(f"pe has d_model = {pe.shape[1]} but x has {x.shape[2]} (x: {x.shape}, pe: {pe.shape})")
    if x.shape[1] > pe.shape[0]:
        raise ValueError(f"sequence length {x.shape[1]} of x {x.shape} exceeds the positional table's "
                         f"max_len = {pe.shape[0]} (pe: {pe.shape})")
    return x + pe[: x.shape[1]].astype(x.dtype, copy=False)


def learned_positional_encoding(max_length: int, d_model: int, *,
                                rng: np.random.Generator | int | None = None) -> np.ndarray:
    """Initial table of learned positional embeddings, ``N(0, 0.02^2)`` as in BERT and GPT-2.

    Parameters
    ----------
    max_length : int
    d_model : int
    rng : numpy.random.Generator or int, optional
        Source of randomness (a seed gives a reproducible table).

    Returns
    -------
    embeddings : ndarray of float64, shape (max_length, d_model)

    Examples
    --------
    >>> learned_positional_encoding(16, 8, rng=0).shape
    (16, 8)
    """
    max_length = check_positive_int(max_length, "max_length", allow_zero=True)
    d_model = check_positive_int(d_model, "d_model")
    return normal(as_generator(rng), (max_length, d_model), std=0.02)  # (max_length, d_model)


def create_causal_mask(seq_length: int) -> np.ndarray:
    """Causal (look-ahead) mask for autoregressive attention.

    Parameters
    ----------
    seq_length : int

    Returns
    -------
    mask : ndarray of bool, shape (seq_length, seq_length)
        Lower triangular: ``True`` on and below the diagonal (position i may attend to j <= i).

    Examples
    --------
    >>> mask = create_causal_mask(4)
    >>> mask
    array([[ True, False, False, False],
           [ True,  True, False, False],
           [ True,  True,  True, False],
           [ True,  True,  True,  True]])
    """
    seq_length = check_positive_int(seq_length, "seq_length", allow_zero=True)
    return causal_mask(seq_length, seq_length)


def create_padding_mask(lengths: np.ndarray, max_length: int) -> np.ndarray:
    """Padding mask from sequence lengths.

    Parameters
    ----------
    lengths : array of int, shape (batch,)
        Real lengths, each in ``[0, max_length]``.
    max_length : int

    Returns
    -------
    mask : ndarray of bool, shape (batch, max_length)
        ``True`` for real tokens, ``False`` for padding. For attention scores reshape it, e.g.
        ``mask[:, None, None, :]`` against (batch, heads, seq_q, seq_k).

    Examples
    --------
    >>> mask = create_padding_mask(np.array([3, 2]), max_length=4)
    >>> mask
    array([[ True,  True,  True, False],
           [ True,  True, False, False]])
    """
    max_length = check_positive_int(max_length, "max_length", allow_zero=True)
    lengths = np.asarray(lengths)
    if lengths.dtype.kind not in "iu":
        if lengths.dtype.kind == "f" and np.all(lengths == np.round(lengths)):
            lengths = lengths.astype(np.int64)
        else:
            raise TypeError(f"lengths must be integers, got dtype {lengths.dtype}")
    check_ndim(lengths, "lengths", ndim=1, expected="1-D (batch,)")
    if lengths.size and (lengths.min() < 0 or lengths.max() > max_length):
        raise ValueError(f"lengths must lie in [0, max_length={max_length}], got min {lengths.min()} and max "
                         f"{lengths.max()}")
    return np.arange(max_length)[None, :] < lengths[:, None]  # (B, max_length)
