"""Small pieces the benchmarks share: optional torch, BLAS thread limits, atomic JSON reports."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

from ..io import atomic_write

__all__ = ["import_torch", "torch_missing_line", "blas_limit", "engine_threads", "write_json"]


def import_torch() -> ModuleType | None:
    """``torch`` if it can be imported, else None (torch is a test-only dependency of attnkit)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def torch_missing_line(what: str) -> str:
    """The one line a benchmark prints when torch is not installed."""
    return f"# torch is not installed: {what} (pip install torch to compare)"


def blas_limit(threads: int) -> AbstractContextManager[Any]:
    """NumPy's BLAS limited to ``threads`` threads (a no-op without threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return nullcontext()
    return threadpool_limits(limits=threads, user_api="blas")


@contextmanager
def engine_threads(torch: ModuleType | None, threads: int) -> Iterator[None]:
    """Every engine of a comparison on ``threads`` threads: torch's intra-op pool (when torch is given), NumPy's
    BLAS and attnkit's kernels; the previous settings come back on exit."""
    from ..kernels._threads import num_threads

    old = None if torch is None else torch.get_num_threads()
    if torch is not None:
        torch.set_num_threads(threads)
    try:
        with blas_limit(threads), num_threads(threads):
            yield
    finally:
        if torch is not None:
            torch.set_num_threads(old)


def write_json(path: str | Path, report: Any) -> Path:
    """Write ``report`` as JSON to ``path`` atomically (a temporary file in the same folder, then renamed)."""
    path = Path(path)
    atomic_write(path, lambda f: f.write(json.dumps(report, indent=1).encode("utf-8")))
    return path
