"""Packed weights (attnkit.kernels.packed): a file's quantized blocks kept as stored, multiplied a block of stored
rows at a time.

References. Every GGUF format decodes to ``gguf.quants.dequantize``'s values bit for bit (the format's own NumPy
reader, which llama.cpp's Python tools use; Q4_0 and Q8_0 have decoders of their own, the rest are gguf's).
MXFP4 decodes to ``dequantize_mxfp4`` of the blocks and scales as Hugging Face stores them, and that to each code's
number times its power of two in float64. A product is compared with NumPy's product of the dequantized array:
float32 within 1e-6 of the result's largest value (BLAS adds the same products in another order), float64
within 1e-12.
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
import gguf_models as gm  # noqa: E402
from attnkit.kernels import packed as packed_module  # noqa: E402
from attnkit.kernels.linear import linear, linear_backward, product  # noqa: E402
from attnkit.kernels.mxfp4 import FP4_VALUES, dequantize_mxfp4  # noqa: E402
from attnkit.kernels.packed import PACKED_FORMATS, PackedWeight, decode_rows, expert_product  # noqa: E402

GGML_KINDS = [kind for kind in PACKED_FORMATS if kind != "MXFP4"]


def _blocks(kind: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) of ``kind``: quantized normal values, or random K-quant blocks with finite scales."""
    qtype = gguf.GGMLQuantizationType[kind]
    if qtype in gm.K_QUANT_SCALES:
        return gm.raw_k_quant_blocks((rows, columns), qtype, rng)
    return gguf.quants.quantize(rng.standard_normal((rows, columns)).astype(np.float32), qtype)


def _mxfp4(rng: np.random.Generator, lead: tuple[int, ...], rows: int, columns: int):
    """Hugging Face's MXFP4 pair (..., R, G, 16), (..., R, G) and the same as packed 17-byte blocks (..., R, G*17)."""
    blocks = rng.integers(0, 256, size=(*lead, rows, columns // 32, 16), dtype=np.uint8)
    scales = rng.integers(127 - 8, 127 + 3, size=(*lead, rows, columns // 32), dtype=np.uint8)
    packed = np.concatenate([scales[..., None], blocks], axis=-1).reshape(*lead, rows, -1)
    return blocks, scales, packed


def _rel(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


def test_block_sizes_are_ggufs():
    for kind in GGML_KINDS:
        assert PACKED_FORMATS[kind] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]


@pytest.mark.parametrize("kind", GGML_KINDS)
def test_rows_decode_to_gguf_dequantize_bit_for_bit(kind):
    rng = np.random.default_rng(0)
    columns = 512
    blocks = _blocks(kind, 37, columns, rng)
    np.testing.assert_array_equal(decode_rows(kind, blocks),
                                  gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]))


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_the_own_decoders_agree_with_gguf_on_any_finite_scale(kind):
    """Random bytes: every code and sub-scale, negative and tiny float16 scales (subnormals) and large ones."""
    rng = np.random.default_rng(1)
    values, size = PACKED_FORMATS[kind]
    blocks = rng.integers(0, 256, size=(512, size), dtype=np.uint8)
    for offset in gm.K_QUANT_SCALES.get(gguf.GGMLQuantizationType[kind], (0,)):
        scales = np.concatenate([rng.uniform(-2, 2, 300), rng.uniform(-6e-5, 6e-5, 100),
                                 rng.uniform(-6e4, 6e4, 112)])
        blocks[:, offset:offset + 2] = rng.permutation(scales).astype(np.float16).view(np.uint8).reshape(-1, 2)
    rows = blocks.reshape(64, -1)
    with np.errstate(over="ignore"):
        expected = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[kind])
    np.testing.assert_array_equal(decode_rows(kind, rows), expected)


def test_mxfp4_rows_decode_to_each_codes_number_times_its_power_of_two():
    rng = np.random.default_rng(2)
    blocks, scales, rows = _mxfp4(rng, (), 9, 96)
    values = decode_rows("MXFP4", rows)  # (9, 96)
    np.testing.assert_array_equal(values, dequantize_mxfp4(blocks, scales))
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(9, 3, 32)  # low nibble first
    exact = FP4_VALUES[codes] * 2.0 ** (scales.astype(np.float64) - 127)[..., None]  # (9, 3, 32) float64
    np.testing.assert_array_equal(values, exact.reshape(9, 96))


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6), (np.float64, 1e-12)])
@pytest.mark.parametrize("transposed", [True, False], ids=["transposed", "as_stored"])
@pytest.mark.parametrize("kind, rows, columns, batch", [
    ("Q4_0", 3, 64, 1),  # fewer rows than a block
    ("Q8_0", 700, 256, 5),  # two blocks of rows, the second short
    ("Q4_K", 2304, 256, 3),  # large enough for the threads
    ("Q6_K", 257, 512, 2),
    ("MXFP4", 600, 320, 4),
])
def test_a_product_is_the_product_of_the_dequantized_weight(kind, rows, columns, batch, transposed, dtype, tol):
    rng = np.random.default_rng(3)
    stored = _mxfp4(rng, (), rows, columns)[2] if kind == "MXFP4" else _blocks(kind, rows, columns, rng)
    w = PackedWeight(stored, kind, columns, transposed=transposed, dtype=dtype)
    dense = w.dequantize()  # (C, R) or (R, C)
    assert dense.shape == w.shape == ((columns, rows) if transposed else (rows, columns)) and dense.dtype == dtype
    a = rng.standard_normal((batch, w.shape[0])).astype(dtype)
    ours = product(a, w)
    assert ours.dtype == dtype and ours.shape == (batch, w.shape[1])
    assert _rel(ours, a @ dense) <= tol


def test_linear_and_its_input_gradient_take_a_packed_weight():
    rng = np.random.default_rng(4)
    w = PackedWeight(_blocks("Q5_1", 48, 96, rng), "Q5_1", 96, transposed=True)  # (96, 48)
    dense = w.dequantize()
    x = rng.standard_normal((2, 3, 96)).astype(np.float32)
    b = rng.standard_normal(48).astype(np.float32)
    assert _rel(linear(x, w, b), linear(x, dense, b)) <= 1e-6
    g = rng.standard_normal((2, 3, 48)).astype(np.float32)
    grad_x, grad_w, grad_b = linear_backward(g, x, w, need_bias=True, need_weight=False)
    assert grad_w is None and grad_b is None
    assert _rel(grad_x, linear_backward(g, x, dense)[0]) <= 1e-6


def test_a_lookup_decodes_only_the_rows_it_reads(monkeypatch):
    rng = np.random.default_rng(5)
    table = PackedWeight(_blocks("Q8_0", 50, 64, rng), "Q8_0", 64, dtype=np.float64)  # (V, D) as stored
    dense = table.dequantize()
    decoded = []
    original = packed_module.decode_rows

    def counting(kind, rows, out=None):
        decoded.append(rows.shape[0])
        return original(kind, rows, out)

    monkeypatch.setattr(packed_module, "decode_rows", counting)
    ids = np.array([[3, 7, 3], [49, 0, 1]])
    got = table[ids]
    assert decoded == [6] and got.dtype == np.float64
    np.testing.assert_array_equal(got, dense[ids])
    np.testing.assert_array_equal(table[4], dense[4])
    np.testing.assert_array_equal(table[10:13], dense[10:13])


def test_a_packed_weight_is_not_an_array():
    rng = np.random.default_rng(6)
    w = PackedWeight(_blocks("Q4_0", 8, 64, rng), "Q4_0", 64, transposed=True)  # (64, 8)
    with pytest.raises(TypeError, match=r"a Q4_0 PackedWeight of shape \(64, 8\) is not an array: call "
                                        r"\.dequantize\(\)"):
        np.asarray(w)
    with pytest.raises(TypeError, match="attnkit.kernels.linear.product"):
        np.ones((1, 64), np.float32) @ w
    with pytest.raises(TypeError):
        w + 1
    with pytest.raises(TypeError, match="stores its columns as rows"):
        w[0]
    with pytest.raises(ValueError, match="assignment destination is read-only"):
        w.blocks[0, 0] = 1


def test_views_share_the_blocks_and_copies_do_not():
    rng = np.random.default_rng(7)
    stored = _blocks("Q8_0", 6, 64, rng)
    w = PackedWeight(stored, "Q8_0", 64, transposed=True)
    assert np.shares_memory(w.T.blocks, stored) and np.shares_memory(w.astype(np.float64).blocks, stored)
    assert w.T.shape == (6, 64) and w.T.T.shape == (64, 6) and w.astype(np.float64).dtype == np.float64
    assert not np.shares_memory(w.copy().blocks, stored)
    part = w.take_rows(np.array([4, 1]))  # (64, 2): stored rows 4 and 1
    np.testing.assert_array_equal(part.dequantize(), w.dequantize()[:, [4, 1]])
    assert w.nbytes == stored.nbytes and w.size == 64 * 6 and w.ndim == 2


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_an_experts_product_is_its_matrix_product(packed):
    rng = np.random.default_rng(8)
    _, _, rows = _mxfp4(rng, (3,), 40, 64)  # (E, R, G*17): three experts (64, 40)
    stack = PackedWeight(rows, "MXFP4", 64, transposed=True)
    dense = stack.dequantize()  # (3, 64, 40)
    assert stack.shape == (3, 64, 40) and stack[1].shape == (64, 40)
    np.testing.assert_array_equal(stack[1].dequantize(), dense[1])
    w = stack if packed else dense
    x, g = rng.standard_normal((5, 64)).astype(np.float32), rng.standard_normal((5, 40)).astype(np.float32)
    assert _rel(expert_product(x, w, 2), x @ dense[2]) <= 1e-6
    assert _rel(expert_product(g, w, 0, transpose=True), g @ dense[0].T) <= 1e-6
    with pytest.raises(TypeError, match="indexed by one integer"):
        stack[np.array([0, 1])]


def test_bad_blocks_are_refused_by_what_is_wrong():
    with pytest.raises(ValueError, match="kind must be one of"):
        PackedWeight(np.zeros((2, 18), np.uint8), "Q4_9", 32)
    with pytest.raises(TypeError, match="uint8"):
        PackedWeight(np.zeros((2, 18), np.float32), "Q4_0", 32)
    with pytest.raises(ValueError, match=r"64 Q4_0 values a row take 2 blocks of 32 \(36 bytes\), but the rows "
                                         r"hold 18"):
        PackedWeight(np.zeros((2, 18), np.uint8), "Q4_0", 64)
    with pytest.raises(ValueError, match="multiple of Q4_K's 256-value blocks, got 100"):
        PackedWeight(np.zeros((2, 144), np.uint8), "Q4_K", 100)
