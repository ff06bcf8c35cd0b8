"""Weights kept in their file's block-quantized format, and their products (unchecked kernels).

A :class:`PackedWeight` is a weight matrix, or a stack of expert matrices, whose values stay in the blocks a file
stores them in: GGUF's Q4_0 .. Q8_0 and K-quants, gpt-oss's MXFP4. A Q4 weight then costs about 4.5 bits a value
in memory instead of float32's 32. Its product with activations (:func:`packed_product`, which
:func:`attnkit.kernels.linear.product` calls for it, so every layer takes packed weights without knowing)
dequantizes a block of a few hundred stored rows at a time into a float32 scratch that stays in cache, multiplies
it with BLAS, and moves on: the float32 copy of the weight is never whole. An embedding lookup
(``packed[ids]``) dequantizes only the rows it reads.

What a packed weight costs is the dequantization, done again at every product: a decoding step reads every
weight once, so it pays one dequantization of the model per token (``docs/benchmarks.md`` has the figures).

Stored rows. Every format packs each stored row (R of them, C values each, C a whole number of blocks) on its
own, blocks along the row. GGUF stores a matrix as (out features, in features), so the rows are output
features, and so are those of gpt-oss's MXFP4 experts: such a weight is used transposed, as the (In, Out) =
(C, R) matrix attnkit multiplies with (``transposed=True``). An embedding table (V, D) is stored row per token
and used as it is stored (``transposed=False``). ``.T`` swaps the two views without touching a byte.

Formats, by name (values per block, bytes per block): the GGML types of ``gguf.GGML_QUANT_SIZES``, decoded by
``gguf.quants.dequantize`` (the ``gguf`` package, attnkit's ``pretrained`` extra, which every file holding them
needs anyway), except Q4_0, Q8_0, Q4_K and Q6_K (the types of llama.cpp's Q4_0, Q8_0 and Q4_K_M files), decoded
here: bit for bit gguf's values, about twice as fast on a product's blocks (Q6_K: 1.5x; ``docs/benchmarks.md``).
And ``"MXFP4"``, gpt-oss's blocks as
Hugging Face stores them (codes low nibble first), each block's scale byte put before its 16 code bytes (17 bytes
a block), decoded by :func:`attnkit.kernels.mxfp4.dequantize_mxfp4`.

Dimension letters: M rows of the activations, R stored rows, C values per stored row, E experts, N looked-up ids.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ._threads import default_num_threads, in_worker, run_tasks
from .mxfp4 import dequantize_mxfp4

__all__ = ["PACKED_FORMATS", "PackedWeight", "packed_product", "expert_product", "decode_rows"]

# Format name -> (values per block, bytes per block); the GGML types' sizes are gguf.GGML_QUANT_SIZES' (a test
# checks they agree).
PACKED_FORMATS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
                  "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
                  "Q6_K": (256, 210), "MXFP4": (32, 17)}

# Values dequantized at once by one product's task: 128K float32 (512 KiB), a cache-sized scratch, and enough
# work per task that the Python around each block is a small part of it.
_BLOCK_VALUES = 1 << 17
# A product runs its blocks on attnkit's threads when the weight has this many values (decoding them is the
# work) or it has this many multiply-adds (a long prompt's); below both, on the calling thread (handing a block
# to a thread costs about 0.1 ms). Either way BLAS runs one thread per block: a block's product is small, and
# OpenBLAS's own threads woken for each of a weight's blocks made a 256-row product 10x slower on a busy
# machine (27 ms against 2.4 ms for the same weight dense).
_SPLIT_VALUES = 1 << 19
_SPLIT_WORK = 1 << 25


def _decode_q8_0(rows: np.ndarray, out: np.ndarray) -> None:
    """Q8_0: a float16 scale then 32 int8 values per block of 34 bytes."""
    blocks = rows.reshape(-1, 34)  # (blocks, 34)
    scale = blocks[:, :2].view(np.float16).astype(np.float32)  # (blocks, 1)
    np.multiply(blocks[:, 2:].view(np.int8), scale, out=out.reshape(-1, 32))


def _decode_q4_0(rows: np.ndarray, out: np.ndarray) -> None:
    """Q4_0: a float16 scale then 16 bytes per block of 18; value j is byte j's low nibble, value 16 + j its high
    nibble, each minus 8."""
    blocks = rows.reshape(-1, 18)  # (blocks, 18)
    scale = blocks[:, :2].view(np.float16).astype(np.float32)  # (blocks, 1)
    codes = blocks[:, 2:]  # (blocks, 16)
    values = out.reshape(-1, 2, 16)  # (blocks, low/high, 16)
    np.bitwise_and(codes, 15, out=values[:, 0], casting="unsafe")
    np.right_shift(codes, 4, out=values[:, 1], casting="unsafe")
    values -= 8
    values *= scale[:, :, None]


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and eight 6-bit minimums of a Q4_K / Q5_K block's 12 bytes (ggml's
    ``get_scale_min_k4``), each (blocks, 8) uint8."""
    first, second, both = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]  # (blocks, 4) each
    scales = np.concatenate([first & 0x3F, (both & 0x0F) | ((first >> 2) & 0x30)], axis=-1)  # (blocks, 8)
    minimums = np.concatenate([second & 0x3F, (both >> 4) | ((second >> 2) & 0x30)], axis=-1)  # (blocks, 8)
    return scales, minimums


def _decode_q4_k(rows: np.ndarray, out: np.ndarray) -> None:
    """Q4_K: per block of 256 values (144 bytes) a float16 scale and minimum, 6-bit scales and minimums of its
    eight sub-blocks of 32, then 128 bytes whose 32-byte chunk j holds sub-block 2j in its low nibbles and 2j + 1
    in its high ones; value = scale * sub-scale * code - minimum * sub-minimum."""
    blocks = rows.reshape(-1, 144)  # (blocks, 144)
    n = blocks.shape[0]
    scale = blocks[:, 0:2].view(np.float16).astype(np.float32)  # (blocks, 1)
    minimum = blocks[:, 2:4].view(np.float16).astype(np.float32)  # (blocks, 1)
    sub_scales, sub_minimums = _k_scales(blocks[:, 4:16])  # (blocks, 8)
    codes = blocks[:, 16:].reshape(n, 4, 32)  # (blocks, chunk, 32)
    values = out.reshape(n, 4, 2, 32)  # (blocks, chunk, low/high, 32)
    np.bitwise_and(codes, 15, out=values[:, :, 0], casting="unsafe")
    np.right_shift(codes, 4, out=values[:, :, 1], casting="unsafe")
    subs = out.reshape(n, 8, 32)  # (blocks, sub-block, 32)
    subs *= (scale * sub_scales.astype(np.float32))[:, :, None]
    subs -= (minimum * sub_minimums.astype(np.float32))[:, :, None]


def _decode_q6_k(rows: np.ndarray, out: np.ndarray) -> None:
    """Q6_K: per block of 256 values (210 bytes) the low 4 bits of each code (128 bytes), the high 2 bits (64),
    16 int8 sub-scales and a float16 scale; value = scale * sub-scale * (code - 32). The codes are assembled in
    uint8 (a quarter of a float pass each) and scaled in one float pass."""
    blocks = rows.reshape(-1, 210)  # (blocks, 210)
    n = blocks.shape[0]
    low = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)  # (n, 2, 2, 64)
    high = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    codes = (low & np.uint8(15)).reshape(n, 8, 32) | ((high & np.uint8(3)).reshape(n, 8, 32) << np.uint8(4))
    signed = codes.view(np.int8) - np.int8(32)  # (blocks, 8, 32) in [-32, 31]
    scale = blocks[:, 208:210].view(np.float16).astype(np.float32)  # (blocks, 1)
    sub_scales = blocks[:, 192:208].view(np.int8).astype(np.float32)  # (blocks, 16)
    np.multiply(signed.reshape(n, 16, 16), (scale * sub_scales)[:, :, None], out=out.reshape(n, 16, 16))


def _decode_mxfp4(rows: np.ndarray, out: np.ndarray) -> None:
    """MXFP4 as packed here: per block of 17 bytes, the E8M0 scale then 16 bytes of codes, low nibble first."""
    blocks = rows.reshape(rows.shape[0], -1, 17)  # (n, G, 17)
    out[...] = dequantize_mxfp4(blocks[..., 1:], blocks[..., 0])  # (n, G * 32)


def _decode_gguf(kind: str, rows: np.ndarray, out: np.ndarray) -> None:
    """Any other GGML type, by ``gguf.quants.dequantize``."""
    try:
        import gguf
    except ImportError:
        raise ImportError(f"dequantizing {kind} needs the gguf package: pip install 'attnkit[pretrained]'") from None
    out[...] = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[kind])


_DECODERS = {"Q8_0": _decode_q8_0, "Q4_0": _decode_q4_0, "Q4_K": _decode_q4_k, "Q6_K": _decode_q6_k,
             "MXFP4": _decode_mxfp4}


def decode_rows(kind: str, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The float32 values of stored rows of format ``kind``.

    Shapes
    ------
    rows : uint8 (n, bytes per row); out : float32 (n, C) or None -> (n, C).
    """
    if out is None:
        values, size = PACKED_FORMATS[kind]
        out = np.empty((rows.shape[0], rows.shape[1] // size * values), np.float32)  # (n, C)
    if rows.shape[0]:
        decoder = _DECODERS.get(kind)
        if decoder is None:
            _decode_gguf(kind, rows, out)
        else:
            decoder(rows, out)
    return out


class PackedWeight:
    """A weight kept in a block-quantized format: the stored blocks, the format, and how the weight is read.

    Parameters
    ----------
    blocks : uint8 array (..., R, bytes per row)
        The stored rows as the file holds them (leading axes: a stack of experts). Taken as is (not copied)
        and made read-only: a packed weight is never written, so views and :meth:`astype` share it.
    kind : str
        The format, a key of :data:`PACKED_FORMATS`.
    columns : int
        C, the values of one stored row (a whole number of blocks filling ``bytes per row``).
    transposed : bool, default False
        The weight is the stored rows transposed: (..., C, R), a matrix stored (out, in) used for ``x @ W``.
        Else it is (..., R, C), the rows as stored (an embedding table).
    dtype : float dtype, default float32
        What its values are dequantized to (products take their input's dtype, as :func:`linear` does).

    Attributes
    ----------
    shape, ndim, size : the weight's, as the float array it stands for.
    nbytes : the bytes it holds (the blocks').

    A packed weight is not an array: NumPy functions and operators refuse it (a ``TypeError``), rather than
    making a float copy of a model-sized matrix behind the caller's back. Products go through
    :func:`attnkit.kernels.linear.product` / :func:`~attnkit.kernels.linear.linear`; indexing the leading axis
    gives an expert's packed matrix (a stack) or the dequantized rows (an untransposed matrix: an embedding
    lookup); :meth:`dequantize` gives the whole float array. It has no gradient (see :class:`attnkit.core.Module`).

    Examples
    --------
    A (64, 3) weight stored as three Q8_0 rows of 64 values (scale 0.5, every value 2):

    >>> from attnkit.kernels.linear import linear
    >>> block = np.concatenate([np.array([0.5], np.float16).view(np.uint8), np.full(32, 4, np.uint8)])
    >>> w = PackedWeight(np.tile(block, (3, 2)), "Q8_0", 64, transposed=True)
    >>> w.shape, w.nbytes, float(w.dequantize()[0, 0])
    ((64, 3), 204, 2.0)
    >>> linear(np.ones((1, 64), np.float32), w).tolist()
    [[128.0, 128.0, 128.0]]
    """

    __slots__ = ("blocks", "kind", "columns", "transposed", "dtype")
    __array_ufunc__ = None  # x @ w, w + 1, np.exp(w): TypeError, never an object array

    def __init__(self, blocks: np.ndarray, kind: str, columns: int, *, transposed: bool = False,
                 dtype: Any = np.float32) -> None:
        if kind not in PACKED_FORMATS:
            raise ValueError(f"kind must be one of {', '.join(PACKED_FORMATS)}, got {kind!r}")
        if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint8 or blocks.ndim < 2:
            raise TypeError(f"blocks must be a uint8 array (..., R, bytes per row), got "
                            f"{type(blocks).__name__} {getattr(blocks, 'dtype', '')} {getattr(blocks, 'shape', '')}")
        values, size = PACKED_FORMATS[kind]
        if columns <= 0 or columns % values or blocks.shape[-1] != columns // values * size:
            raise ValueError(f"{columns} {kind} values a row take {columns // values} blocks of {values} "
                             f"({columns // values * size} bytes), but the rows hold {blocks.shape[-1]} bytes"
                             if columns > 0 and columns % values == 0 else
                             f"columns must be a positive multiple of {kind}'s {values}-value blocks, got {columns}")
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        if blocks.flags.writeable:
            blocks = blocks.view()
            blocks.flags.writeable = False
        self.blocks, self.kind, self.columns = blocks, kind, int(columns)
        self.transposed, self.dtype = bool(transposed), dtype

    # -- what it stands for --------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        rows = self.blocks.shape[-2]
        return self.blocks.shape[:-2] + ((self.columns, rows) if self.transposed else (rows, self.columns))

    @property
    def ndim(self) -> int:
        return self.blocks.ndim

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    @property
    def T(self) -> PackedWeight:
        """The transpose of a matrix (the same blocks, read the other way)."""
        if self.ndim != 2:
            raise ValueError(f"only a packed matrix has .T; this one has shape {self.shape}")
        return PackedWeight(self.blocks, self.kind, self.columns, transposed=not self.transposed, dtype=self.dtype)

    def __repr__(self) -> str:
        return (f"PackedWeight(kind={self.kind!r}, shape={self.shape}, dtype={self.dtype}, "
                f"nbytes={self.nbytes}, transposed={self.transposed})")

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(f"a {self.kind} PackedWeight of shape {self.shape} is not an array: call .dequantize() for "
                        f"its values ({self.size * self.dtype.itemsize / 2**20:.1f} MiB as {self.dtype}), or "
                        f"multiply with attnkit.kernels.linear.linear / product")

    def __rmatmul__(self, other: Any) -> np.ndarray:
        raise TypeError("x @ PackedWeight is not computed; use attnkit.kernels.linear.product(x, w) (or linear), "
                        "which dequantizes a block of rows at a time")

    # -- copies and views ------------------------------------------------------------------------------
    def astype(self, dtype: Any, copy: bool = True) -> PackedWeight:
        """The same blocks with values dequantized to ``dtype`` (the blocks are read-only, so shared)."""
        return PackedWeight(self.blocks, self.kind, self.columns, transposed=self.transposed, dtype=dtype)

    def copy(self) -> PackedWeight:
        """A packed weight with its own copy of the blocks."""
        return PackedWeight(self.blocks.copy(), self.kind, self.columns, transposed=self.transposed,
                            dtype=self.dtype)

    def take_rows(self, index: slice | np.ndarray) -> PackedWeight:
        """The packed weight of some stored rows (a slice or integer indices over R), in that order: still
        packed, the blocks contiguous (a copy unless they already are)."""
        return PackedWeight(np.ascontiguousarray(self.blocks[..., index, :]), self.kind, self.columns,
                            transposed=self.transposed, dtype=self.dtype)

    def __getitem__(self, index: Any) -> PackedWeight | np.ndarray:
        """An expert's packed matrix (``stack[e]``), or the dequantized rows of an untransposed matrix
        (``table[ids]``: ids (...) -> (..., C), only those rows decoded)."""
        if self.ndim > 2:
            if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
                return PackedWeight(self.blocks[index], self.kind, self.columns, transposed=self.transposed,
                                    dtype=self.dtype)
            raise TypeError(f"a stack of packed matrices {self.shape} is indexed by one integer, got {index!r}")
        if self.transposed:
            raise TypeError(f"the packed matrix {self.shape} stores its columns as rows: index its rows with "
                            f".T[...] or take .dequantize()")
        if isinstance(index, slice):
            return self._values(self.blocks[index])  # (n, C)
        ids = np.asarray(index)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"packed rows are looked up by integer ids or a slice, got {ids.dtype} {index!r}")
        flat = ids.reshape(-1)  # (N,)
        return self._values(self.blocks[flat]).reshape(*ids.shape, self.columns)  # (..., C)

    def _values(self, rows: np.ndarray) -> np.ndarray:
        values = decode_rows(self.kind, rows)  # (n, C) float32
        return values.astype(self.dtype, copy=False)

    def dequantize(self) -> np.ndarray:
        """The whole weight as a float array of :attr:`shape` in :attr:`dtype` (a new array, the caller's)."""
        flat = self.blocks.reshape(-1, self.blocks.shape[-1])  # (rows of every expert, bytes per row)
        out = np.empty((flat.shape[0], self.columns), self.dtype)  # (rows, C)
        step = max(1, _BLOCK_VALUES // self.columns)
        for start in range(0, flat.shape[0], step):
            out[start:start + step] = decode_rows(self.kind, flat[start:start + step])
        out = out.reshape(self.blocks.shape[:-1] + (self.columns,))  # (..., R, C)
        return out.swapaxes(-1, -2) if self.transposed else out


def packed_product(a: np.ndarray, w: PackedWeight) -> np.ndarray:
    """``a @ w`` for 2-D ``a`` (M, K) and a packed matrix ``w`` (K, N), in NumPy's result dtype of theirs.

    The stored rows are dequantized a block at a time (about 128K values, into a float32 scratch per thread) and
    each block multiplied with BLAS: a transposed ``w`` (K, N) = (C, R) fills the output's columns of its block,
    ``a @ rows.T``; an untransposed one (R, C) adds ``a[:, block] @ rows`` into the output. Blocks spread over
    attnkit's threads when the weight is large (and the call is not inside a worker already).

    Returns
    -------
    ndarray (M, N)
    """
    if w.ndim != 2:
        raise ValueError(f"packed_product takes a packed matrix, got shape {w.shape}")
    if a.shape[-1] != w.shape[0]:
        raise ValueError(f"a has {a.shape[-1]} columns but the packed weight has {w.shape[0]} rows "
                         f"(a: {a.shape}, w: {w.shape})")
    dtype = np.result_type(a.dtype, w.dtype)
    a = a.astype(dtype, copy=False)
    rows, columns = w.blocks.shape[0], w.columns
    step = max(1, _BLOCK_VALUES // columns)
    starts = list(range(0, rows, step))
    large = rows * columns >= _SPLIT_VALUES or a.shape[0] * rows * columns >= _SPLIT_WORK
    workers = min(default_num_threads(), len(starts)) if large and not in_worker() else 1
    scratch = [np.empty((min(step, rows), columns), np.float32) for _ in range(workers)]  # (block, C) each
    if w.transposed:
        out = np.empty((a.shape[0], rows), dtype)  # (M, R)
    else:
        partial = [np.zeros((a.shape[0], columns), dtype) for _ in range(workers)]  # (M, C) each

    def block(start: int, worker: int) -> None:
        stored = w.blocks[start:start + step]  # (n, bytes per row)
        values = decode_rows(w.kind, stored, scratch[worker][:len(stored)]).astype(dtype, copy=False)  # (n, C)
        if w.transposed:
            np.matmul(a, values.T, out=out[:, start:start + len(stored)])  # (M, n)
        else:
            partial[worker] += a[:, start:start + len(stored)] @ values  # (M, C)

    if a.shape[0]:
        run_tasks(starts, block, workers)  # one worker: the calling thread, BLAS on one thread
    if w.transposed:
        return out
    return partial[0] if workers == 1 else np.sum(partial, axis=0)  # (M, C)


def expert_product(x: np.ndarray, w: np.ndarray | PackedWeight, expert: int, transpose: bool = False) -> np.ndarray:
    """``x @ w[expert]`` (``x @ w[expert].T`` with ``transpose``) for a stack of expert matrices ``w``: a float
    array as NumPy multiplies it, a packed stack by :func:`packed_product` of that expert's blocks alone.

    Shapes
    ------
    x : (n, K); w : (E, K, N) (``transpose``: (E, N, K)) -> (n, N).
    """
    matrix = w[expert]  # (K, N) or (N, K): a view, or the expert's packed blocks
    if transpose:
        matrix = matrix.T
    return packed_product(x, matrix) if isinstance(matrix, PackedWeight) else x @ matrix
