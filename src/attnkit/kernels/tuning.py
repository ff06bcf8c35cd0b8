"""The kernels' machine-dependent choices, and the cache of those measured on this machine by ``attnkit tune``.

Four choices depend on the CPU more than on anything in the code: how large the tiled kernel's tiles are, from
how many rows a product is split over attnkit's threads, up to how many rows a decoding step keeps BLAS on one
thread, and how many threads the kernels use. Their defaults (:data:`DEFAULT_CHOICES`) were tuned on AMD EPYC
and were up to 2x off on an Intel Xeon; :mod:`attnkit.kernels.calibration` measures them on the machine at hand
(``attnkit tune``: a few seconds) and writes them here.

Which choices the kernels use (:func:`current_choices`):

* the choices :func:`pinned` holds, inside its ``with`` block (the calibration and tests);
* else the defaults when the environment variable ``ATTNKIT_TUNE`` is ``0`` (read with the file, once);
* else the cached file of this machine (:func:`cache_path`), read once per process, when it is valid: our
  format, this machine's key (:func:`machine_key`: CPU model, core counts, NumPy, its BLAS, Python and attnkit
  versions) and every value in range; anything else (missing, foreign, corrupt, another machine's, a version
  upgraded since) is ignored and the defaults apply, with the reason in :func:`choices_source`.

Nothing is measured implicitly: a library call that stalls a few seconds on first use, on a machine that may
be busy at that moment, and writes a file the user did not ask for, is a worse surprise than default tiles.

The choices change which tiles and tasks the work is cut into, so the last bits of a result may differ between
a tuned and an untuned run (as between two thread counts); one set of choices is one computation.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from .._cpu import cpu_model, usable_cores
from ..io import atomic_write

__all__ = ["Choices", "DEFAULT_CHOICES", "ENV_TUNE", "FORMAT", "MAX_FILE_BYTES", "current_choices",
           "choices_source", "pinned", "machine_key", "cache_folder", "cache_path", "load_choices", "save_choices",
           "describe_choices", "forget_cached", "with_defaults", "tuning_enabled"]

ENV_TUNE = "ATTNKIT_TUNE"
FORMAT = "attnkit-tuning/1"
MAX_FILE_BYTES = 1 << 20  # a tuning file is a few KiB; anything larger is not one, and is not read
_MAX_ROWS = 1 << 20  # split_rows at this value: products are never split


@dataclass(frozen=True)
class Choices:
    """The kernels' machine-dependent choices; ``None`` means "as without tuning" for that field.

    Attributes
    ----------
    tile_l2_forward, tile_l2_backward : int or None
        The cache size (bytes) the tile cost model of :mod:`attnkit.kernels._tile_sizes` sizes the forward's /
        the backward's tiles for: the size whose tiles ran fastest here, which may differ from the L2 the
        hardware reports. None: the machine's per-core L2.
    split_rows : int
        A product of at least this many rows (and enough work) is split by rows over attnkit's threads
        (:func:`attnkit.kernels.linear.product`); 1048576: never.
    single_blas_rows : int or None
        A model forward of at most this many tokens (a decoding step) runs BLAS on one thread, beyond on the
        free cores; 0: never on one thread. None: one token only, and only if a per-process measurement says
        so (:func:`attnkit.kernels._threads.one_row_blas`).
    num_threads : int or None
        The kernels' thread count when neither a call nor :func:`attnkit.set_num_threads` says. None: every
        core this process may run on.
    """

    tile_l2_forward: int | None = None
    tile_l2_backward: int | None = None
    split_rows: int = 256
    single_blas_rows: int | None = None
    num_threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("tile_l2_forward", "tile_l2_backward"):
            _check_int(name, getattr(self, name), 16 << 10, 1 << 30, optional=True)
        _check_int("split_rows", self.split_rows, 1, _MAX_ROWS)
        _check_int("single_blas_rows", self.single_blas_rows, 0, _MAX_ROWS, optional=True)
        _check_int("num_threads", self.num_threads, 1, 1024, optional=True)


def _check_int(name: str, value: Any, low: int, high: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}]{' or None' if optional else ''}, "
                         f"got {value!r}")


DEFAULT_CHOICES = Choices()

_lock = threading.Lock()
_loaded: tuple[Choices, str] | None = None  # the cached file's choices and where they came from, once read
_pins: list[Choices] = []  # pinned(...) blocks, innermost last


def tuning_enabled() -> bool:
    """Whether ``ATTNKIT_TUNE`` lets the cached choices be used (unset or 1: yes; 0: no; else ``ValueError``)."""
    text = os.environ.get(ENV_TUNE, "").strip().lower()
    if text in ("", "1", "on", "yes", "true"):
        return True
    if text in ("0", "off", "no", "false"):
        return False
    raise ValueError(f"{ENV_TUNE} must be 0 (use the default choices) or 1 (use the tuned ones, the default), "
                     f"got {text!r}")


def current_choices() -> Choices:
    """The choices the kernels use now (see the module docstring for the order).

    ``ATTNKIT_TUNE`` and the file are read on the first call (and after :func:`forget_cached`); every later call
    is a lookup, cheap enough for every product and thread count.
    """
    if _pins:
        return _pins[-1]
    return (_loaded or _load())[0]


def choices_source() -> str:
    """Where :func:`current_choices` comes from, in words (``attnkit bench`` and ``attnkit tune`` print it)."""
    if _pins:
        return "pinned"
    return (_loaded or _load())[1]


def _load() -> tuple[Choices, str]:
    global _loaded
    with _lock:
        if _loaded is None:
            if not tuning_enabled():
                _loaded = DEFAULT_CHOICES, f"defaults ({ENV_TUNE}=0)"
                return _loaded
            path = cache_path()
            try:
                _loaded = load_choices(path), f"tuned ({path})"
            except FileNotFoundError:
                _loaded = DEFAULT_CHOICES, "defaults (not tuned on this machine: run 'attnkit tune')"
            except (OSError, ValueError) as exc:
                _loaded = DEFAULT_CHOICES, f"defaults (ignored {path}: {exc})"
        return _loaded


def forget_cached() -> None:
    """Read ``ATTNKIT_TUNE`` and the cache file again at the next :func:`current_choices` (after ``attnkit tune``
    wrote the file, or the environment changed)."""
    global _loaded
    with _lock:
        _loaded = None


@contextmanager
def pinned(choices: Choices):
    """Use ``choices`` inside a ``with`` block, whatever the cache and ``ATTNKIT_TUNE`` say (process-wide).

    Examples
    --------
    >>> with pinned(Choices(split_rows=512)):
    ...     current_choices().split_rows
    512
    """
    if not isinstance(choices, Choices):
        raise TypeError(f"choices must be a Choices, got {type(choices).__name__}")
    _pins.append(choices)
    try:
        yield choices
    finally:
        _pins.remove(choices)


def _blas_build() -> str:
    """NumPy's BLAS as built (name and version), from ``numpy.__config__`` (no library inspection)."""
    import numpy as np

    try:
        blas = np.__config__.CONFIG["Build Dependencies"]["blas"]
        return f"{blas.get('name')} {blas.get('version')}"
    except (AttributeError, KeyError, TypeError):
        return "unknown"


def machine_key() -> dict[str, Any]:
    """What a tuning is valid for: CPU model, cores (all, and usable by this process), NumPy, its BLAS, Python
    and attnkit versions. A file made under any other key is not used."""
    import numpy as np

    attnkit = sys.modules.get("attnkit")
    return {"cpu": cpu_model(), "machine": platform.machine(), "cores": os.cpu_count() or 1,
            "usable_cores": usable_cores(), "numpy": np.__version__, "blas": _blas_build(),
            "python": platform.python_version(), "attnkit": getattr(attnkit, "__version__", "unknown")}


def cache_folder() -> Path:
    """``$XDG_CACHE_HOME/attnkit``, else ``~/.cache/attnkit``."""
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base and os.path.isabs(base) else Path.home() / ".cache") / "attnkit"


def cache_path(key: dict[str, Any] | None = None) -> Path:
    """This machine's tuning file: one per :func:`machine_key` (a home folder shared by machines keeps each
    machine's own), named by a hash of the key."""
    key = machine_key() if key is None else key
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_folder() / f"tuning-{digest}.json"


def save_choices(path: str | os.PathLike, choices: Choices, measured: dict[str, Any] | None = None,
                 key: dict[str, Any] | None = None) -> Path:
    """Write ``choices`` for this machine (``key``, default :func:`machine_key`) to ``path`` atomically, with
    the ``measured`` record (timings, date, load) beside them; the folder is created if missing."""
    document = {"format": FORMAT, "machine": machine_key() if key is None else key, "choices": asdict(choices),
                "measured": measured or {}}
    text = (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda f: f.write(text))


def load_choices(path: str | os.PathLike, key: dict[str, Any] | None = None) -> Choices:
    """The choices of the tuning file ``path``, checked before use.

    Raises
    ------
    FileNotFoundError
        No file.
    ValueError
        Not a tuning file (too large, not JSON, another format), made for another machine or other library
        versions than ``key`` (default :func:`machine_key`), or a value out of range.
    """
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes: not a tuning file")
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc.__class__.__name__})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"not an {FORMAT} file")
    expected = machine_key() if key is None else key
    if document.get("machine") != expected:
        raise ValueError("made on another machine or with other library versions")
    values = document.get("choices")
    names = {f.name for f in fields(Choices)}
    if not isinstance(values, dict) or set(values) != names:
        raise ValueError(f"its choices must name exactly {', '.join(sorted(names))}")
    return Choices(**values)


def _kib(n: int | None) -> str:
    return "L2" if n is None else f"{n >> 10} KiB"


def describe_choices(choices: Choices | None = None, source: str | None = None) -> str:
    """One line naming the choices in use (default :func:`current_choices`) and where they come from.

    >>> print(describe_choices(Choices(tile_l2_forward=256 << 10, split_rows=512, single_blas_rows=2), "pinned"))
    tiles for 256 KiB / L2 (fwd / bwd); split from 512 rows; 1 BLAS thread to 2 tokens; threads all; pinned
    """
    c = current_choices() if choices is None else choices
    source = choices_source() if source is None else source
    split = "never split" if c.split_rows >= _MAX_ROWS else f"split from {c.split_rows} rows"
    single = ("1 BLAS thread: 1 token if faster" if c.single_blas_rows is None
              else "BLAS threaded at every size" if c.single_blas_rows == 0
              else f"1 BLAS thread to {c.single_blas_rows} tokens")
    threads = "all" if c.num_threads is None else str(c.num_threads)
    return (f"tiles for {_kib(c.tile_l2_forward)} / {_kib(c.tile_l2_backward)} (fwd / bwd); {split}; {single}; "
            f"threads {threads}; {source}")


def with_defaults(**values: Any) -> Choices:
    """:data:`DEFAULT_CHOICES` with ``values`` replaced."""
    return replace(DEFAULT_CHOICES, **values)
