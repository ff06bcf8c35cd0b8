"""Where a benchmark ran: CPU model, cores, caches, the BLAS library and kernel, thread counts, the kernels'
tuned choices (:mod:`attnkit.kernels.tuning`: tile sizes, product splits, threads, and whether they were
measured here by ``attnkit tune`` or are the defaults), versions.

Every benchmark prints :func:`describe` at the top of its output and stores :func:`machine_info` in its
JSON report, so a table can always be traced to the machine that produced it.

Cache sizes come from :mod:`attnkit._cpu` (Linux sysfs, else ``os.sysconf``, else unknown), the same
reader the tiled kernel sizes its tiles from. The BLAS library and the kernel OpenBLAS chose
(``architecture``) come from threadpoolctl's ``threadpool_info()`` (the ``fast`` extra); without it the report says so.
"""
from __future__ import annotations

import datetime
import os
import platform
import sys
from typing import Any

import numpy as np

from .._cpu import cache_sizes, cpu_model, usable_cores

__all__ = ["machine_info", "describe", "cpu_model", "cache_sizes", "blas_info", "usable_cores",
           "OPENBLAS_OVERRIDES"]

OPENBLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")  # make a current OpenBLAS pick slower kernels


def blas_info() -> list[dict[str, Any]] | str:
    """NumPy's BLAS libraries (threadpoolctl): ``internal_api``, ``architecture`` (the kernel chosen),
    ``version``, ``num_threads``, ``threading_layer``, ``filepath``; a sentence when threadpoolctl is missing."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (threadpoolctl is not installed: pip install 'attnkit[fast]')"
    keys = ("internal_api", "architecture", "version", "num_threads", "threading_layer", "filepath")
    return [{k: lib.get(k) for k in keys} for lib in threadpool_info() if lib.get("user_api") == "blas"]


def _torch_version() -> str | None:
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return None
    return getattr(torch, "__version__", None)


def machine_info() -> dict[str, Any]:
    """Everything :func:`describe` prints, as a JSON-ready dict."""
    from ..kernels._threads import default_num_threads
    from ..kernels.tuning import describe_choices

    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cpu": cpu_model(), "machine": platform.machine(), "cores": os.cpu_count(),
            "usable_cores": usable_cores(), "caches": cache_sizes(), "blas": blas_info(),
            "attnkit_threads": default_num_threads(), "tuning": describe_choices(), "python": platform.python_version(),
            "numpy": np.__version__, "torch": _torch_version(), "load_average": load,
            "openblas_env": {k: os.environ[k] for k in OPENBLAS_OVERRIDES if k in os.environ}}


def _format_bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KiB"


def _describe_caches(caches: dict[str, Any]) -> str:
    if caches["source"] == "unknown":
        return "cache sizes unknown (no sysfs cache topology, no sysconf values)"
    parts = []
    for name in ("L1d", "L2", "L3"):
        if name in caches:
            shared = caches[name]["shared_cpu_list"]
            parts.append(f"{name} {_format_bytes(caches[name]['bytes'])}" + (f" (CPUs {shared})" if shared else ""))
    return ", ".join(parts) + f" [{caches['source']}]"


def _describe_blas(blas: list[dict[str, Any]] | str) -> str:
    if isinstance(blas, str):
        return blas
    if not blas:
        return "none found by threadpoolctl"
    return "; ".join(f"{b['internal_api']} {b['version']}, kernel {b['architecture']}, {b['num_threads']} threads"
                     + (f" ({b['threading_layer']})" if b.get("threading_layer") else "") for b in blas)


def _join(threads: Any) -> str:
    return ", ".join(map(str, threads)) if isinstance(threads, (list, tuple)) else str(threads)


def describe(info: dict[str, Any] | None = None, threads: Any = None) -> list[str]:
    """The lines (``# ...``) a benchmark prints about its machine; ``threads`` = the thread counts it runs."""
    info = machine_info() if info is None else info
    load = "" if info["load_average"] is None else f", load average {info['load_average']:.2f}"
    lines = [f"# machine: {info['cpu']} ({info['machine']}), {info['cores']} cores, {info['usable_cores']} usable"
             f"{load}; {info['date']}",
             f"# caches: {_describe_caches(info['caches'])}",
             f"# BLAS: {_describe_blas(info['blas'])}",
             f"# threads: attnkit default {info['attnkit_threads']}"
             + ("" if threads is None else f", this run {_join(threads)}"),
             f"# python {info['python']}, numpy {info['numpy']}, torch {info['torch'] or 'not installed'}"]
    if info.get("tuning"):
        lines.insert(4, f"# tuning: {info['tuning']}")
    if info["openblas_env"]:
        lines.append(f"# WARNING: {info['openblas_env']} set; OpenBLAS may use slower kernels "
                     f"(run with env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE)")
    return lines
