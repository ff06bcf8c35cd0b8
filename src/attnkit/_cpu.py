"""The CPU the process runs on: its model name, usable cores, data-cache sizes and how busy its cores are.

One reader for the kernels (tile sizes from the per-core L2, :mod:`attnkit.kernels._tile_sizes`; threads given up
to other processes, :mod:`attnkit.kernels._threads`) and for the benchmarks (which print where they ran,
:mod:`attnkit.benchmarks.machine`).

Cache sizes come from the Linux sysfs cache topology (``/sys/devices/system/cpu/cpu0/cache/index*/``:
``level``, ``type``, ``size`` and ``shared_cpu_list``), else from ``os.sysconf`` (``SC_LEVEL1_DCACHE_SIZE``,
``SC_LEVEL2_CACHE_SIZE``, ``SC_LEVEL3_CACHE_SIZE``; glibc), else they are unknown and the callers use their
documented fallbacks.

How busy the cores are comes from the Linux ``/proc/stat`` counters (:func:`busy_seconds`); elsewhere it is
unknown (None).
"""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["cpu_model", "usable_cores", "usable_cpu_ids", "cache_sizes", "l2_bytes", "busy_seconds", "SYSFS_CACHE",
           "PROC_STAT", "FALLBACK_L2_BYTES"]

SYSFS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
PROC_STAT = Path("/proc/stat")
# Per-core L2 assumed when neither sysfs nor sysconf knows it: the smallest L2 of current x86 server cores
# (AMD Zen 2/3: 512 KiB; Intel Skylake-SP..Sapphire Rapids and Zen 4: 1-2 MiB), so tiles chosen for it
# fit everywhere.
FALLBACK_L2_BYTES = 512 << 10
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``), else ``platform.processor()``, else the architecture."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def usable_cpu_ids() -> frozenset[int] | None:
    """The ids of the CPUs this process may run on (its affinity mask), or None where the OS does not say."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def busy_seconds(cpus: frozenset[int] | None = None, stat: Path = PROC_STAT) -> float | None:
    """CPU-seconds the CPUs ``cpus`` (None: all of them) have spent not idling since boot, whoever ran on them.

    Read from the ``cpuN`` lines of ``/proc/stat``: user, nice, system, irq, softirq and steal time (steal is
    time a virtual machine's CPU was not running: taken by the host); idle and iowait are idle. The counters
    tick ``os.sysconf("SC_CLK_TCK")`` times a second (100 on Linux). None where there is no such file (not
    Linux) or it cannot be read.

    Examples
    --------
    >>> busy = busy_seconds()
    >>> busy is None or busy > 0
    True
    """
    try:
        text = Path(stat).read_text(encoding="ascii", errors="replace")
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    total = 0
    seen = False
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        fields = rest.split()
        if len(fields) < 5 or not all(f.isdigit() for f in fields[:8]):
            continue
        counts = [int(f) for f in fields[:8]] + [0] * (8 - len(fields[:8]))
        user, nice, system, _idle, _iowait, irq, softirq, steal = counts
        total += user + nice + system + irq + softirq + steal
        seen = True
    return total / tick if seen and tick > 0 else None


def _size_bytes(text: str) -> int | None:
    text = text.strip().upper()
    scale = _UNITS.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in _UNITS else text
    return int(digits) * scale if digits.isdigit() else None


def _sysfs_caches(root: Path) -> dict[str, dict[str, Any]]:
    caches = {}
    for index in sorted(root.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = _size_bytes((index / "size").read_text())
            shared = (index / "shared_cpu_list").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction" or size is None:
            continue
        name = f"L{level}" + ("d" if kind == "Data" else "")
        caches[name] = {"bytes": size, "shared_cpu_list": shared}
    return caches


def _sysconf_caches() -> dict[str, dict[str, Any]]:
    caches = {}
    for name, key in (("L1d", "SC_LEVEL1_DCACHE_SIZE"), ("L2", "SC_LEVEL2_CACHE_SIZE"), ("L3", "SC_LEVEL3_CACHE_SIZE")):
        try:
            size = os.sysconf(key)
        except (ValueError, OSError, AttributeError):
            continue
        if size and size > 0:
            caches[name] = {"bytes": int(size), "shared_cpu_list": None}
    return caches


def cache_sizes(sysfs_root: Path = SYSFS_CACHE) -> dict[str, Any]:
    """Data and unified cache sizes of CPU 0: ``{"L1d": {...}, "L2": {...}, "L3": {...}, "source": ...}``.

    Each cache is ``{"bytes": int, "shared_cpu_list": str or None}``; ``source`` is ``"sysfs"``,
    ``"sysconf"`` or ``"unknown"`` (then no cache entries).

    Examples
    --------
    >>> info = cache_sizes()
    >>> info["source"] in ("sysfs", "sysconf", "unknown")
    True
    """
    sysfs_root = Path(sysfs_root)
    caches = _sysfs_caches(sysfs_root) if sysfs_root.is_dir() else {}
    source = "sysfs"
    if not caches:
        caches, source = _sysconf_caches(), "sysconf"
    if not caches:
        source = "unknown"
    return {**caches, "source": source}


@functools.lru_cache(maxsize=8)
def _l2_cached(sysfs_root: Path) -> int:
    caches = cache_sizes(sysfs_root)
    return caches["L2"]["bytes"] if "L2" in caches else FALLBACK_L2_BYTES


def l2_bytes(sysfs_root: Path = SYSFS_CACHE) -> int:
    """Per-core L2 size in bytes (:func:`cache_sizes`), else :data:`FALLBACK_L2_BYTES`; read once per root.

    Examples
    --------
    >>> l2_bytes() >= 64 << 10
    True
    """
    return _l2_cached(Path(sysfs_root))
