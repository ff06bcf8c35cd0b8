"""Tuned against default choices (:mod:`attnkit.kernels.tuning`), alternating: ``python -m attnkit.benchmarks.tuning``.

Dimension letters: B batch, H heads, L sequence length, Dh head features, M rows.

The tuned choices are this machine's cached ones (``attnkit tune``), else measured now (``--calibrate`` measures
now in any case; ``--ignore-load`` keeps what was measured beside other processes). Each round times every
workload under both sets of choices, pinned in turn, the first of the two alternating from round to round;
the report gives per workload the median over rounds of each set's best time and the ratio tuned / default
(below 1: the tuning is faster), with the lowest and highest per-round ratio.

Workloads: the tiled attention forward (B 1, H 8, L ``--length``, Dh 64, causal and not) and forward + backward
(not causal); a prefill's projection (a (1024, 576) x (576, 1536) product, as ``kernels.linear`` runs it);
decoding steps' products at 1 and 8 rows (six (1024, 2048) weights under the decoding BLAS threads).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..kernels import _threads, tuning
from ..kernels.linear import product
from ..kernels.tiled import flash_attention_backward, flash_attention_forward
from ._support import write_json
from .machine import describe, machine_info

__all__ = ["parse_args", "run", "main", "workloads"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=2048, help="attention sequence length (default 2048)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per workload in a round, best kept (default 3)")
    p.add_argument("--calibrate", action="store_true", help="measure the tuned choices now, not from the cache")
    p.add_argument("--ignore-load", action="store_true", help="with a calibration here: keep what was measured "
                                                              "beside other processes")
    p.add_argument("--json", default=None, help="write the report here")
    return p.parse_args(argv)


def workloads(length: int) -> dict[str, Callable[[], Any]]:
    """The timed functions, by name."""
    rng = np.random.default_rng(0)
    q, k, v, grad = (rng.standard_normal((1, 8, length, 64), dtype=np.float32) for _ in range(4))  # (B, H, L, Dh)
    x = rng.standard_normal((1024, 576), dtype=np.float32)  # (M, 576)
    w = rng.standard_normal((576, 1536), dtype=np.float32)  # (576, 1536)
    weights = [np.full((1024, 2048), 0.5, dtype=np.float32) for _ in range(6)]  # 48 MiB

    def step(rows: int) -> Callable[[], None]:
        row = np.full((rows, 1024), 0.5, dtype=np.float32)  # (M, 1024)

        def run() -> None:
            with _threads.decode_blas(rows):
                for weight in weights:
                    row @ weight  # (M, 2048)
        return run

    return {
        f"attention forward L {length}": lambda: flash_attention_forward(q, k, v),
        f"causal forward L {length}": lambda: flash_attention_forward(q, k, v, causal=True),
        f"forward + backward L {length}": lambda: flash_attention_backward(grad, flash_attention_forward(q, k, v)[2]),
        "product (1024, 576) x (576, 1536)": lambda: product(x, w),
        "decode products, 1 row": step(1),
        "decode products, 8 rows": step(8),
    }


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _tuned_choices(args: argparse.Namespace) -> tuple[tuning.Choices, str]:
    if not args.calibrate:
        try:
            return tuning.load_choices(tuning.cache_path()), f"cached ({tuning.cache_path()})"
        except (OSError, ValueError):
            pass
    from ..kernels.calibration import calibrate

    result = calibrate(busy=(lambda: False) if args.ignore_load else None)
    return result.choices, f"measured now in {result.seconds:.1f} s" + (" (busy: defaults kept)" if result.busy
                                                                          else "")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every workload under both choices, alternating; print and return the report."""
    info = machine_info()
    for line in describe(info):
        print(line)
    tuned, source = _tuned_choices(args)
    sets = {"default": tuning.DEFAULT_CHOICES, "tuned": tuned}
    print(f"# default: {tuning.describe_choices(tuning.DEFAULT_CHOICES, 'the constants')}")
    print(f"# tuned:   {tuning.describe_choices(tuned, source)}")
    cases = workloads(args.length)
    times: dict[str, dict[str, list[float]]] = {name: {"default": [], "tuned": []} for name in cases}
    adaptive = _threads.get_adaptive_threads()
    _threads.set_adaptive_threads(False)  # both sets on the threads they name, whatever the load
    try:
        for r in range(args.rounds):
            order = ["default", "tuned"] if r % 2 == 0 else ["tuned", "default"]
            for label in order:
                with tuning.pinned(sets[label]):
                    for name, fn in cases.items():
                        times[name][label].append(_best(fn, args.repeats))
    finally:
        _threads.set_adaptive_threads(adaptive)
    rows = []
    print("| workload | default ms | tuned ms | tuned / default (per-round range) |")
    print("|---|---:|---:|---|")
    for name, t in times.items():
        ratios = [a / b for a, b in zip(t["tuned"], t["default"])]
        row = {"workload": name, "default_ms": statistics.median(t["default"]) * 1e3,
               "tuned_ms": statistics.median(t["tuned"]) * 1e3, "ratio": statistics.median(ratios),
               "ratio_min": min(ratios), "ratio_max": max(ratios)}
        rows.append(row)
        print(f"| {name} | {row['default_ms']:.2f} | {row['tuned_ms']:.2f} | {row['ratio']:.2f} "
              f"({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) |")
    report = {"machine": info, "tuned": tuning.describe_choices(tuned, source), "rounds": args.rounds,
              "repeats": args.repeats, "results": rows}
    if args.json:
        write_json(args.json, report)
    return report


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
