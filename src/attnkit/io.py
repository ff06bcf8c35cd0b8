"""Writing and reading files: atomic writes, and ``.npz`` archives of arrays checked before they are read.

Every file attnkit writes goes through :func:`atomic_write` (or :func:`atomic_write_files` for a group of
files that belong together): the bytes go to a temporary file in the destination's folder, are flushed and
``fsync``-ed, and only then does ``os.replace`` put the file in place. A write that fails (disk full, a
file-size limit, an exception in the middle, Ctrl-C) removes its temporary file and leaves the previous
file untouched; a process killed mid-write leaves the previous file too (plus, at worst, one hidden
``.<name>.<pid>.*.tmp`` file beside it, which the next write to the same path removes once that process is
gone). Only regular files are replaced: a path naming a FIFO, a device or a socket is refused.

Arrays are stored as ``.npz`` archives (a zip of ``.npy`` members, readable by ``np.load``), written by
:func:`save_arrays`. :class:`ArrayArchive` opens one and reads every member's ``.npy`` header (name,
dtype, shape, memory order) without reading any array data, and checks that the sizes recorded in the zip
agree with the headers; the caller compares the headers with what it expects and only then reads each
array, once, into an array of exactly the declared size. Nothing is ever unpickled.

Examples
--------
>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "arrays.npz")
>>> save_arrays(path, {"W": np.ones((2, 3), dtype=np.float32)})
>>> with ArrayArchive(path) as archive:
...     header = archive.headers["W"]
...     (header.shape, header.dtype.name)
...     archive.read("W").sum()
((2, 3), 'float32')
np.float32(6.0)
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import sys
import tempfile
import threading
import zipfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.lib import format as npy_format

__all__ = ["atomic_write", "atomic_write_files", "save_arrays", "write_arrays", "ArrayHeader", "ArrayArchive",
           "read_json"]

NPY_SUFFIX = ".npy"
# Deflate cannot shrink data by more than about 1032:1; a member claiming more is not a real deflate stream.
MAX_DEFLATE_RATIO = 1032
DEFLATE_SLACK = 1 << 16  # bytes of headroom for tiny members, whose fixed overheads dominate the ratio
MAX_HEADER_SIZE = 10_000  # numpy's own default limit on a .npy header (it is parsed with ast.literal_eval)
READ_CHUNK = 1 << 22

Writer = Callable[[IO[bytes]], None]
_umask_lock = threading.Lock()


# --------------------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------------------
def _destination(path: Any, name: str = "path") -> Path:
    """``path`` as a ``Path`` to write to (a symlink's target, so the link survives), checked."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike file path, got {type(path).__name__}")
    dest = Path(path)
    if dest.is_symlink():
        try:
            dest = dest.resolve(strict=False)
        except (RuntimeError, OSError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
            raise ValueError(f"{name} {str(path)!r} is a symbolic link that cannot be resolved: {exc}") from None
    if dest.is_dir():
        raise IsADirectoryError(f"{name} {str(dest)!r} is a folder, expected a file path")
    if not dest.parent.is_dir():
        raise FileNotFoundError(f"cannot write {str(dest)!r}: folder {str(dest.parent)!r} does not exist")
    try:
        mode = os.stat(dest).st_mode
    except FileNotFoundError:
        return dest
    if not stat.S_ISREG(mode):
        # Replacing a FIFO or a device node with a regular file would break whatever uses it (as root,
        # /dev/null itself): write only over regular files.
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
                else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")
        raise ValueError(f"{name} {str(dest)!r} is {kind}, not a regular file: attnkit only replaces regular files")
    return dest


def _file_mode(dest: Path) -> int:
    """The permission bits the written file gets: the replaced file's, or what ``open`` would give."""
    try:
        return os.stat(dest).st_mode & 0o7777
    except FileNotFoundError:
        return 0o666 & ~_current_umask()


def _current_umask() -> int:
    """The process umask, read from /proc where possible (setting it, the only portable way, races threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:
        umask = os.umask(0o022)
        os.umask(umask)
    return umask


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# Bytes of the destination's name kept in a temporary's name: with the dot, the pid, mkstemp's 8 random
# characters and ".tmp", the name stays within the 255 bytes file systems allow.
_NAME_BYTES = 200


def _temporary_prefix(dest: Path) -> str:
    """``.<name>.`` with ``name`` cut to at most ``_NAME_BYTES`` bytes (a cut character stays bytes, which the
    file system takes as they are)."""
    return "." + os.fsdecode(os.fsencode(dest.name)[:_NAME_BYTES]) + "."


def _remove_orphans(dest: Path) -> None:
    """Remove temporaries of ``dest`` left by writers that were killed (their process no longer exists)."""
    prefix = _temporary_prefix(dest)
    try:
        names = os.listdir(dest.parent)
    except OSError:
        return
    for entry in names:
        if not (entry.startswith(prefix) and entry.endswith(".tmp")):
            continue
        pid = entry[len(prefix):].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _process_exists(int(pid)):
            _remove_quietly(os.path.join(dest.parent, entry))


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists but belongs to someone else
        return True
    return True


def _write_temporary(dest: Path, write: Writer) -> str:
    """Write a complete, fsync-ed temporary file beside ``dest``; returns its path (removed on failure)."""
    _remove_orphans(dest)
    fd, tmp = tempfile.mkstemp(prefix=f"{_temporary_prefix(dest)}{os.getpid()}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _file_mode(dest))
    except BaseException:  # also Ctrl-C: a half-written temporary file never stays behind
        _remove_quietly(tmp)
        raise
    return tmp


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (best effort: not every platform can open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Writer) -> Path:
    """Create or replace the file ``path`` with what ``write(f)`` writes to a binary file object ``f``.

    Either the whole file written is in place afterwards or, if anything fails (an exception from ``write``,
    disk full, a file-size limit, Ctrl-C), the previous file is untouched and no temporary file remains.

    Parameters
    ----------
    path : str or os.PathLike
        The file to write, in an existing folder (a symlink is followed: its target is replaced).
    write : callable
        Called once with a binary file object open for writing.

    Returns
    -------
    Path
        The path written.

    Examples
    --------
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "note.txt")
    >>> _ = atomic_write(path, lambda f: f.write(b"first"))
    >>> def fails(f):
    ...     f.write(b"half of the second")
    ...     raise RuntimeError("interrupted")
    >>> atomic_write(path, fails)
    Traceback (most recent call last):
    RuntimeError: interrupted
    >>> Path(path).read_bytes(), os.listdir(os.path.dirname(path))
    (b'first', ['note.txt'])
    """
    return atomic_write_files({path: write})[0]


def atomic_write_files(writers: Mapping[str | os.PathLike, Writer]) -> list[Path]:
    """Write several files that belong together: every file is written in full before any is replaced.

    All temporary files are written and ``fsync``-ed first; only when all succeeded are they renamed into
    place, one ``os.replace`` after the other. A failure while writing leaves every previous file as it
    was. (The renames themselves do not fail for lack of space; only a process killed in the
    microseconds between two renames can leave some files replaced and some previous.)

    Parameters
    ----------
    writers : mapping of path to callable
        For each file, a function given a binary file object to write to; files are renamed in this order.

    Returns
    -------
    list of Path
        The paths written, in order.
    """
    dests = [_destination(p) for p in writers]
    if len(set(dests)) != len(dests):
        raise ValueError(f"atomic_write_files got the same file twice: {[str(d) for d in dests]}")
    temporaries: list[str] = []
    try:
        for dest, write in zip(dests, writers.values(), strict=True):
            temporaries.append(_write_temporary(dest, write))
        for i, (tmp, dest) in enumerate(zip(temporaries, dests, strict=True)):
            os.replace(tmp, dest)
            temporaries[i] = ""
    except BaseException:
        for tmp in temporaries:
            if tmp:
                _remove_quietly(tmp)
        raise
    for folder in {d.parent for d in dests}:
        _sync_folder(folder)
    return dests


# --------------------------------------------------------------------------------------------------------
# Writing arrays
# --------------------------------------------------------------------------------------------------------
def _check_entry_name(name: Any) -> str:
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        raise ValueError(f"array names must be non-empty strings without a leading '/' or '\\', got {name!r}")
    return name


def write_arrays(f: IO[bytes], arrays: Mapping[str, Any]) -> None:
    """Write ``arrays`` as an ``.npz`` archive (uncompressed, as ``np.savez``) to the open binary file ``f``.

    Each value is stored as ``<name>.npy``; object arrays are refused (nothing is ever pickled).

    Shapes
    ------
    Any shape and any non-object dtype; the archive records both.
    """
    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in arrays.items():
            array = np.asanyarray(value)
            if array.dtype.hasobject:
                raise ValueError(f"array {name!r} has dtype {array.dtype}, which cannot be saved without pickle")
            with zf.open(_check_entry_name(name) + NPY_SUFFIX, mode="w", force_zip64=True) as member:
                npy_format.write_array(member, array, allow_pickle=False)


def save_arrays(path: str | os.PathLike, arrays: Mapping[str, Any]) -> None:
    """Atomically write ``arrays`` to ``path`` as an ``.npz`` archive (exactly at ``path``: no suffix added).

    Examples
    --------
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "weights.bin")
    >>> save_arrays(path, {"b": np.zeros(3)})
    >>> sorted(np.load(path).files)
    ['b']
    """
    atomic_write(path, lambda f: write_arrays(f, arrays))


# --------------------------------------------------------------------------------------------------------
# Reading arrays
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ArrayHeader:
    """What an ``.npz`` member declares about its array, read without reading the array.

    Attributes
    ----------
    name : str
        The entry's name (the member name without ``.npy``).
    shape : tuple of int
    dtype : numpy.dtype
    fortran_order : bool
        Whether the data is stored column-major.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool

    @property
    def size(self) -> int:
        """Number of elements (a Python int: no overflow however large the declared shape)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


class ArrayArchive:
    """An ``.npz`` archive opened for checked reading: every header first, then each array at most once.

    Opening reads the zip directory and each member's ``.npy`` header only (no array data). It refuses,
    with a ``ValueError`` naming the file and the entry: a file that is not a zip archive, members that are
    not ``.npy`` arrays, the same entry twice, compression other than none or deflate, object or structured
    dtypes, and members whose recorded sizes disagree with their header (a tiny archive declaring a
    billion-element array is refused here, before anything is allocated).

    Parameters
    ----------
    path : str or os.PathLike
        The archive (``np.savez``, ``np.savez_compressed`` and :func:`save_arrays` files all work).

    Attributes
    ----------
    path : Path
    headers : dict of str to ArrayHeader
        Every entry's declared name, shape and dtype, in archive order.

    Examples
    --------
    >>> import io, zipfile
    >>> from numpy.lib import format as npy_format
    >>> buffer = io.BytesIO()  # a crafted archive: a header declaring 10**9 floats, and no data
    >>> with zipfile.ZipFile(buffer, "w") as zf:
    ...     with zf.open("W.npy", "w") as member:
    ...         npy_format.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False,
    ...                                                      "shape": (10**9,)})
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "crafted.npz")
    >>> _ = Path(path).write_bytes(buffer.getvalue())
    >>> ArrayArchive(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: ...entry 'W' declares shape (1000000000,) float32 (4000000000 bytes of data) but holds 0 bytes...
    """

    def __init__(self, path: str | os.PathLike) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike file path, got {type(path).__name__}")
        self.path = Path(path)
        self._read: set[str] = set()
        try:
            self._zip = zipfile.ZipFile(self.path, mode="r")
        except zipfile.BadZipFile as exc:
            raise ValueError(f"{self.path} is not an .npz archive (not a zip file: {exc})") from exc
        try:
            self._members: dict[str, zipfile.ZipInfo] = {}
            self._data_start: dict[str, int] = {}
            self.headers: dict[str, ArrayHeader] = {}
            for info in self._zip.infolist():
                header, data_start = self._read_header(info)
                self._members[header.name] = info
                self._data_start[header.name] = data_start
                self.headers[header.name] = header
        except BaseException:
            self._zip.close()
            raise

    def _error(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: {message}")

    def _read_header(self, info: zipfile.ZipInfo) -> tuple[ArrayHeader, int]:
        """The member's header and the offset of its data, after checking both against the zip's sizes."""
        if not info.filename.endswith(NPY_SUFFIX) or info.is_dir():
            raise self._error(f"member {info.filename!r} is not an .npy array")
        name = info.filename[: -len(NPY_SUFFIX)]
        if name in self.headers:
            raise self._error(f"entry {name!r} appears more than once")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise self._error(f"entry {name!r} uses zip compression method {info.compress_type}; "
                              "only stored (np.savez) and deflate (np.savez_compressed) are read")
        try:
            with self._zip.open(info) as member:
                version = npy_format.read_magic(member)
                if version == (1, 0):
                    shape, fortran_order, dtype = npy_format.read_array_header_1_0(member, MAX_HEADER_SIZE)
                elif version == (2, 0):
                    shape, fortran_order, dtype = npy_format.read_array_header_2_0(member, MAX_HEADER_SIZE)
                else:
                    raise ValueError(f".npy format version {version} is not read (1.0 and 2.0 are)")
                header_bytes = member.tell()
        except (EOFError, OSError, zipfile.BadZipFile, zlib.error) as exc:  # small members are read whole here
            raise self._error(f"entry {name!r} is damaged: {exc}") from exc
        except (ValueError, SyntaxError) as exc:
            raise self._error(f"entry {name!r} has no valid .npy header: {exc}") from exc
        header = ArrayHeader(name, tuple(int(n) for n in shape), np.dtype(dtype), bool(fortran_order))
        if any(n < 0 for n in header.shape):
            raise self._error(f"entry {name!r} declares shape {header.shape} with a negative length")
        if header.dtype.hasobject or header.dtype.fields is not None or header.dtype.subdtype is not None:
            raise self._error(f"entry {name!r} has dtype {header.dtype}; only plain numeric arrays are read")
        declared = header_bytes + header.nbytes
        if info.file_size != declared:
            raise self._error(f"entry {name!r} declares shape {header.shape} {header.dtype} ({header.nbytes} "
                              f"bytes of data) but holds {max(info.file_size - header_bytes, 0)} bytes")
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise self._error(f"entry {name!r} is stored uncompressed but takes {info.compress_size} bytes "
                              f"for {info.file_size}")
        if (info.compress_type == zipfile.ZIP_DEFLATED
                and info.file_size > MAX_DEFLATE_RATIO * info.compress_size + DEFLATE_SLACK):
            raise self._error(f"entry {name!r} claims {info.file_size} bytes from {info.compress_size} compressed "
                              f"bytes, more than deflate can produce")
        return header, header_bytes

    def read(self, name: str) -> np.ndarray:
        """The array of entry ``name``, read from the archive (each entry can be read once).

        Call only after checking ``headers[name]``: the array of the declared shape is allocated here.

        Raises
        ------
        KeyError
            ``name`` is not in the archive.
        ValueError
            The entry was read before, or its data is shorter, longer or not what the zip's checksum says.
        """
        if name not in self._members:
            raise KeyError(f"{self.path} has no entry {name!r}; it has {list(self.headers)}")
        if name in self._read:
            raise self._error(f"entry {name!r} was already read once")
        self._read.add(name)
        header = self.headers[name]
        flat = np.empty(header.size, dtype=header.dtype)  # (size,)
        buffer = memoryview(flat.view(np.uint8))
        try:
            with self._zip.open(self._members[name]) as member:
                skipped = len(member.read(self._data_start[name]))  # the header, validated on opening
                if skipped != self._data_start[name]:
                    raise self._error(f"entry {name!r} changed since it was opened")
                filled = 0
                while filled < len(buffer):
                    got = member.readinto(buffer[filled:filled + READ_CHUNK])
                    if not got:
                        raise self._error(f"entry {name!r} ends after {filled} of {len(buffer)} data bytes")
                    filled += got
                if member.read(1):
                    raise self._error(f"entry {name!r} has data beyond its declared {len(buffer)} bytes")
        except (EOFError, OSError, zipfile.BadZipFile, zlib.error) as exc:
            raise self._error(f"entry {name!r} is damaged: {exc}") from exc
        if header.fortran_order:
            return flat.reshape(header.shape[::-1]).T  # (*shape)
        return flat.reshape(header.shape)  # (*shape)

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> ArrayArchive:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------------
# JSON files
# --------------------------------------------------------------------------------------------------------
MAX_JSON_BYTES = 1 << 28  # 256 MiB: far above any config or tokenizer file, far below a memory problem


def read_text(path: str | os.PathLike) -> str:
    """The text of a UTF-8 file (a chat template, say), every way it can be wrong one ``ValueError`` naming it.

    Raises
    ------
    ValueError
        Not UTF-8, or larger than 256 MiB.
    FileNotFoundError, OSError
        A missing or unreadable file.

    Examples
    --------
    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "chat_template.jinja"
    >>> _ = path.write_bytes(b"{{ 'caf\\xe9' }}")
    >>> read_text(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: ...chat_template.jinja is not UTF-8 text: invalid continuation byte at byte 7
    """
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{path} is not a text file attnkit reads: {size:,} bytes, the limit is {MAX_JSON_BYTES:,}")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None


def read_json(path: str | os.PathLike, *, expect: type | None = dict) -> Any:
    """The value of a UTF-8 JSON file, every way it can be wrong reported as one ``ValueError`` naming it.

    Parameters
    ----------
    path : str or os.PathLike
        The file. A missing file raises ``FileNotFoundError`` (``OSError`` for other reading failures).
    expect : type or None, default dict
        The type the top-level value must have (``dict`` for a JSON object, ``list`` for an array); None
        accepts any value.

    Raises
    ------
    ValueError
        Not UTF-8, not JSON, nested too deeply for the parser, larger than 256 MiB, holding an integer longer than
        Python reads (4300 digits), or not of type ``expect``.

    Examples
    --------
    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "config.json"
    >>> _ = path.write_text('{"hidden_size": 16}')
    >>> read_json(path)
    {'hidden_size': 16}
    >>> _ = path.write_text("[" * 100000)
    >>> read_json(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: ...config.json is not valid JSON: nested too deeply
    """
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{path} is not a JSON file attnkit reads: {size:,} bytes, the limit is {MAX_JSON_BYTES:,}")
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path} is not valid JSON: nested too deeply") from None
    except ValueError:  # json's int() refuses a number of more than sys.get_int_max_str_digits() digits
        raise ValueError(f"{path} is not a JSON file attnkit reads: it holds an integer of more than "
                         f"{sys.get_int_max_str_digits()} digits") from None
    if expect is not None and not isinstance(value, expect):
        wanted = {dict: "a JSON object", list: "a JSON array"}.get(expect, expect.__name__)
        raise ValueError(f"{path} must hold {wanted}, got {type(value).__name__}")
    return value

