"""Loading checks an archive's headers before it reads (or allocates) any array data.

Crafted archives (a tiny zip declaring a billion floats, a member claiming more than deflate can produce,
a compressed wrong-shaped array of tens of megabytes) are refused with a ValueError naming the entry while
tracemalloc shows a peak far below the declared size. Unknown, missing, duplicate, mis-shaped and wrongly
typed entries are refused naming the entry, nothing is unpickled, each entry is read once, and a refused
file changes no parameter.
"""
from __future__ import annotations

import io
import struct
import tracemalloc
import warnings
import zipfile

import numpy as np
import pytest
from numpy.lib import format as npy_format

from attnkit.core import Module
from attnkit.io import ArrayArchive
from attnkit.layers import Projection

MB = 1 << 20


def npy_header_bytes(shape, descr="<f4", fortran_order=False) -> bytes:
    buffer = io.BytesIO()
    npy_format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": fortran_order, "shape": shape})
    return buffer.getvalue()


def write_zip(path, members, compression=zipfile.ZIP_STORED) -> None:
    """A zip with the given (member name, bytes) pairs, duplicates allowed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile warns about duplicate names, which we want
        with zipfile.ZipFile(path, "w", compression=compression) as zf:
            for name, data in members:
                zf.writestr(name, data)


def npy_bytes(array, allow_pickle=False) -> bytes:
    buffer = io.BytesIO()
    npy_format.write_array(buffer, np.asanyarray(array), allow_pickle=allow_pickle)
    return buffer.getvalue()


def peak_bytes(call) -> tuple[int, BaseException | None]:
    """Peak traced allocation while ``call()`` runs, and the exception it raised."""
    tracemalloc.start()
    try:
        call()
        raised = None
    except BaseException as exc:  # noqa: BLE001 - returned to the test, which asserts its type
        raised = exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak, raised


def unchanged(module: Module, before: dict[str, np.ndarray]) -> bool:
    return all(np.array_equal(p, before[n]) for n, p in module.named_parameters())


def test_tiny_archive_declaring_a_billion_floats_is_refused_without_allocating(tmp_path):
    path = tmp_path / "crafted.npz"
    write_zip(path, [("W.npy", npy_header_bytes((10**9,)))])
    assert path.stat().st_size < 1024
    proj = Projection(2, 2, rng=0)
    before = proj.state_dict()
    peak, raised = peak_bytes(lambda: proj.load(path))
    assert isinstance(raised, ValueError), raised
    assert "entry 'W' declares shape (1000000000,) float32" in str(raised)
    assert peak < 2 * MB, peak  # the declared array is 4 GB
    assert unchanged(proj, before)


def test_member_claiming_more_than_deflate_can_produce_is_refused(tmp_path):
    # A deflated member of header + 1000 bytes whose zip sizes are forged to the 400 MB its header declares.
    path = tmp_path / "forged.npz"
    header = npy_header_bytes((10**8,))
    write_zip(path, [("W.npy", header + bytes(1000))], compression=zipfile.ZIP_DEFLATED)
    raw = bytearray(path.read_bytes())
    forged = len(header) + 4 * 10**8
    local, central = raw.find(b"PK\x03\x04"), raw.find(b"PK\x01\x02")
    struct.pack_into("<I", raw, local + 22, forged)
    struct.pack_into("<I", raw, central + 24, forged)
    path.write_bytes(bytes(raw))
    peak, raised = peak_bytes(lambda: Projection(2, 2, rng=0).load(path))
    assert isinstance(raised, ValueError), raised
    assert "entry 'W' claims" in str(raised) and "more than deflate can produce" in str(raised)
    assert peak < 2 * MB, peak


def test_compressed_wrong_shape_is_refused_before_its_data_is_read(tmp_path):
    # 32 MB of zeros compress to a few tens of kB: the shape must be refused from the header alone.
    path = tmp_path / "big.npz"
    np.savez_compressed(path, W=np.zeros((2000, 2000)), b=np.zeros(2))
    assert path.stat().st_size < MB
    proj = Projection(2, 2, rng=0)
    before = proj.state_dict()
    peak, raised = peak_bytes(lambda: proj.load(path))
    assert isinstance(raised, ValueError), raised
    assert "entry 'W' has shape (2000, 2000), expected (2, 2)" in str(raised)
    assert peak < 2 * MB, peak
    assert unchanged(proj, before)


@pytest.mark.parametrize("case, error, message", [
    ("unknown", KeyError, r"unknown keys \['extra'\]"),
    ("missing", KeyError, r"missing keys \['b'\]"),
    ("duplicate", ValueError, r"entry 'W' appears more than once"),
    ("misshaped", ValueError, r"entry 'b' has shape \(3,\), expected \(2,\)"),
    ("integer", TypeError, r"entry 'b' has dtype int64, expected a real floating dtype"),
    ("complex", TypeError, r"entry 'b' has dtype complex128"),
    ("object", ValueError, r"entry 'b' has dtype object; only plain numeric arrays are read"),
    ("structured", ValueError, r"entry 'b' has dtype .*only plain numeric arrays are read"),
    ("not_npy", ValueError, r"member 'notes.txt' is not an .npy array"),
    ("truncated_data", ValueError, r"entry 'W' declares shape \(2, 2\) float64 \(32 bytes of data\) but holds 8"),
    ("bad_header", ValueError, r"entry 'W' has no valid .npy header"),
    ("bzip2", ValueError, r"entry 'W' uses zip compression method 12"),
    ("negative_shape", ValueError, r"entry 'W' declares shape \(-2, -2\) with a negative length"),
])
def test_bad_entries_are_refused_naming_the_entry(tmp_path, case, error, message):
    good_W, good_b = npy_bytes(np.ones((2, 2))), npy_bytes(np.ones(2))
    members = {
        "unknown": [("W.npy", good_W), ("b.npy", good_b), ("extra.npy", good_b)],
        "missing": [("W.npy", good_W)],
        "duplicate": [("W.npy", good_W), ("b.npy", good_b), ("W.npy", good_W)],
        "misshaped": [("W.npy", good_W), ("b.npy", npy_bytes(np.ones(3)))],
        "integer": [("W.npy", good_W), ("b.npy", npy_bytes(np.ones(2, dtype=np.int64)))],
        "complex": [("W.npy", good_W), ("b.npy", npy_bytes(np.ones(2, dtype=complex)))],
        "object": [("W.npy", good_W), ("b.npy", npy_bytes(np.array([1.0, None], dtype=object), allow_pickle=True))],
        "structured": [("W.npy", good_W), ("b.npy", npy_bytes(np.zeros(2, dtype=[("x", "f8")])))],
        "not_npy": [("W.npy", good_W), ("b.npy", good_b), ("notes.txt", b"hello")],
        "truncated_data": [("W.npy", good_W[:-24]), ("b.npy", good_b)],
        "bad_header": [("W.npy", b"\x93NUMPY\x01\x00\x10\x00{'descr': oops}"), ("b.npy", good_b)],
        "negative_shape": [("W.npy", npy_header_bytes((-2, -2), "<f8") + bytes(32)), ("b.npy", good_b)],
    }
    path = tmp_path / f"{case}.npz"
    if case == "bzip2":
        write_zip(path, [("W.npy", good_W), ("b.npy", good_b)], compression=zipfile.ZIP_BZIP2)
    else:
        write_zip(path, members[case])
    proj = Projection(2, 2, rng=0)
    before = proj.state_dict()
    with pytest.raises(error, match=message):
        proj.load(path)
    assert unchanged(proj, before)


@pytest.mark.parametrize("n", [2, 64])  # a member read whole with its header, and one read in chunks
def test_damaged_data_is_refused_by_the_checksum(tmp_path, n):
    path = tmp_path / "damaged.npz"
    Projection(n, n, rng=0).save(path)
    raw = bytearray(path.read_bytes())
    at = raw.find(np.ascontiguousarray(Projection(n, n, rng=0).W).tobytes())
    assert at > 0
    raw[at + 8 * n * n - 1] ^= 0xFF  # the last byte of W's data
    path.write_bytes(bytes(raw))
    proj = Projection(n, n, rng=1)
    before = proj.state_dict()
    with pytest.raises(ValueError, match="entry 'W' is damaged"):
        proj.load(path)
    assert unchanged(proj, before)


@pytest.mark.parametrize("content", [b"", b"not a zip at all", b"PK\x03\x04 truncated"])
def test_a_file_that_is_not_an_archive_is_a_value_error(tmp_path, content):
    path = tmp_path / "junk.npz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not an .npz archive"):
        Projection(2, 2, rng=0).load(path)


def test_a_cut_off_archive_is_a_value_error(tmp_path):
    path = tmp_path / "cut.npz"
    Projection(20, 20, rng=0).save(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="cut.npz"):
        Projection(20, 20, rng=1).load(path)


def test_each_entry_is_read_exactly_once(tmp_path, monkeypatch):
    path = tmp_path / "model.npz"
    Projection(3, 4, rng=0).save(path)
    reads = []
    original = ArrayArchive.read
    monkeypatch.setattr(ArrayArchive, "read", lambda self, name: reads.append(name) or original(self, name))
    Projection(3, 4, rng=1).load(path)
    assert sorted(reads) == ["W", "b"]
    with ArrayArchive(path) as archive:
        archive.read("W")
        with pytest.raises(ValueError, match="entry 'W' was already read once"):
            archive.read("W")


@pytest.mark.parametrize("writer", ["savez", "savez_compressed"])
def test_numpy_archives_load_with_any_float_dtype_order_and_byte_order(tmp_path, writer):
    rng = np.random.default_rng(0)
    W, b = rng.normal(size=(3, 4)), rng.normal(size=4)
    path = tmp_path / "numpy.npz"
    getattr(np, writer)(path, W=np.asfortranarray(W).astype(">f8"), b=b.astype(np.float32))
    proj = Projection(3, 4, rng=0)
    proj.load(path)
    assert np.array_equal(proj.W, W) and np.array_equal(proj.b, b.astype(np.float32).astype(np.float64))
    assert proj.W.dtype == np.float64 and proj.W.flags.c_contiguous


def test_headers_are_read_without_the_data(tmp_path):
    path = tmp_path / "h.npz"
    np.savez(path, a=np.zeros((3, 5), dtype=np.float16), c=np.zeros((0,)))
    with ArrayArchive(path) as archive:
        assert {n: (h.shape, h.dtype, h.fortran_order) for n, h in archive.headers.items()} == {
            "a": ((3, 5), np.dtype(np.float16), False), "c": ((0,), np.dtype(np.float64), False)}
        assert archive.read("c").shape == (0,)
        with pytest.raises(KeyError, match="has no entry 'x'"):
            archive.read("x")
