"""Benchmark attnkit's attention kernels against a naive NumPy version and PyTorch.

Compares, in one run and on the same inputs (float32, B=1, H=8, D=64 by default):

* ``tiled``      attnkit.kernels.tiled.flash_attention_forward / _backward (threads, no L x L memory)
* ``reference``  attnkit.kernels.reference.attention_forward / _backward (materialised scores)
* ``naive``      the textbook ``softmax(Q K^T / sqrt(d)) V`` in straight NumPy (:mod:`.naive`)
* ``torch``      torch.nn.functional.scaled_dot_product_attention on the CPU, same thread count
  (skipped, with one line saying so, when torch is not installed)

for the forward and the forward + backward, causal and not, at each length; prints the best-of-N time,
GFLOP/s, the ratio to PyTorch and the peak traced memory (tracemalloc) of the attnkit calls. Then checks
the memory target: L = 32768, H = 1, the tiled forward + backward's peak memory beyond its inputs,
outputs and gradients.

FLOPs counted: forward ``4 B H Lq Lk D`` (two matmuls), halved when causal; forward + backward 3.5x the
forward (five more matmuls of the same size in the backward, FlashAttention's convention).

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m attnkit.benchmarks.attention \\
        --threads 2 1 --json results.json --plot docs/bench_attention.png

(also ``attnkit bench``, and ``benchmarks/bench_attention.py`` in a checkout.)
"""
from __future__ import annotations

import argparse
import gc
import os
import time
import tracemalloc
from pathlib import Path

import numpy as np

from .. import _progress
from ..kernels._threads import get_adaptive_threads, set_adaptive_threads, thread_count_argument
from ..kernels.reference import attention_backward, attention_forward
from ..kernels.tiled import flash_attention_backward, flash_attention_forward
from . import naive
from ._support import blas_limit, import_torch, torch_missing_line, write_json
from .machine import describe, machine_info

__all__ = ["IMPLS", "parse_args", "run", "main", "bench_case", "memory_target", "plot"]

IMPLS = ("tiled", "reference", "naive", "torch")
MiB = 1 << 20


def _flops(seq, heads, batch, dim, causal, mode):
    fwd = 4.0 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
    return fwd if mode == "fwd" else 3.5 * fwd


def _numpy_runners(q, k, v, g, causal, mode, threads) -> dict:
    """The tiled, reference and naive implementations as zero-argument callables."""
    def tiled():
        out, _, ctx = flash_attention_forward(q, k, v, causal=causal, num_threads=threads)
        if mode == "fwdbwd":
            flash_attention_backward(g, ctx)
        return out

    def reference():
        out, _, ctx = attention_forward(q, k, v, causal=causal)
        if mode == "fwdbwd":
            attention_backward(g, ctx)
        return out

    def naive_run():
        out, cache = naive.naive_forward(q, k, v, causal=causal)
        if mode == "fwdbwd":
            naive.naive_backward(g, cache)
        return out

    return {"tiled": tiled, "reference": reference, "naive": naive_run}


def _torch_runner(torch, q, k, v, g, causal, mode):
    """PyTorch's fused ``scaled_dot_product_attention`` on the same arrays."""
    F = torch.nn.functional
    tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
    if mode == "fwdbwd":
        tq, tk, tv = (x.clone().requires_grad_() for x in (tq, tk, tv))

    def torch_run():
        if mode == "fwd":
            with torch.no_grad():
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        for x in (tq, tk, tv):
            x.grad = None
        out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        out.backward(tg)
        return out

    return torch_run


def _peak_traced(fn) -> float:
    """Peak traced memory (MiB) of one call, allocations before the call excluded."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / MiB
    finally:
        tracemalloc.stop()


def _active(runners: dict, seq: int, args) -> tuple[list[str], dict[str, str]]:
    """The implementations to time at length ``seq``, and why the others are skipped."""
    active = [name for name in args.impls if name in runners]
    skipped = {}
    for name in ("reference", "naive"):
        if name in active and seq > args.max_dense:
            active.remove(name)
            skipped[name] = f"skipped: L > --max-dense {args.max_dense} (L x L scores per head)"
    if "torch" in args.impls and "torch" not in runners:
        skipped["torch"] = "skipped: torch is not installed"
    return active, skipped


def _best_times(runners: dict, active: list[str], args, line: _progress.Progress) -> dict[str, float]:
    """Best-of-``args.repeats`` seconds of each implementation, runs interleaved; each run a step of ``line``."""
    best = {name: float("inf") for name in active}
    for name in active:
        for _ in range(args.warmup):
            runners[name]()
            line.update()
    for _ in range(args.repeats):  # interleaved, so that load changes hit every column alike
        for name in active:
            if args.settle:
                time.sleep(args.settle)  # let the previous column's spinning pool threads go idle
            t0 = time.perf_counter()
            runners[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
            line.update()
    return best


def bench_case(seq, causal, mode, threads, args, torch=None) -> list[dict]:
    """One row per implementation for one (length, causal, mode, threads) case."""
    rng = np.random.default_rng(seq)
    shape = (args.batch, args.heads, seq, args.dim)
    q, k, v, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))  # (B, H, L, D) each
    runners = _numpy_runners(q, k, v, g, causal, mode, threads)
    if torch is not None:
        runners["torch"] = _torch_runner(torch, q, k, v, g, causal, mode)
    active, skipped = _active(runners, seq, args)
    # cleared before the case's rows are printed: the line never shares the terminal with the table
    with _progress.progress(len(active) * (args.warmup + args.repeats), f"L = {seq}", unit="run",
                            enabled=False if args.quiet else None) as line:
        best = _best_times(runners, active, args, line)
    flops = _flops(seq, args.heads, args.batch, args.dim, causal, mode)
    rows = []
    for name in args.impls:
        row = {"impl": name, "L": seq, "causal": causal, "mode": mode, "threads": threads}
        if name in best:
            row.update(time_ms=best[name] * 1e3, gflops=flops / best[name] / 1e9)
            if "torch" in best:
                row["vs_torch"] = best[name] / best["torch"]
            if name in ("tiled", "reference") and not args.no_memory:
                row["peak_mib"] = _peak_traced(runners[name])
        else:
            row["note"] = skipped.get(name, "not run")
        rows.append(row)
    del runners
    gc.collect()
    return rows


def memory_target(args) -> dict:
    """Peak traced memory of the tiled forward + backward at L = ``args.memory_len``, H = 1, beyond
    its inputs, outputs and gradients."""
    seq, dim = args.memory_len, args.dim
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, 1, seq, dim), dtype=np.float32) for _ in range(4))  # (1, 1, L, D)
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out, lse, ctx = flash_attention_forward(q, k, v, causal=False, num_threads=args.threads[0])
        grads = flash_attention_backward(g, ctx)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    elapsed = time.perf_counter() - t0
    kept = out.nbytes + lse.nbytes + sum(x.nbytes for x in grads[:3])
    return {"L": seq, "heads": 1, "dim": dim, "peak_mib": peak / MiB, "outputs_and_grads_mib": kept / MiB,
            "extra_mib": (peak - kept) / MiB, "inputs_mib": 4 * q.nbytes / MiB, "target_mib": 64.0,
            "seconds": elapsed, "scores_one_head_mib": seq * seq * 4 / MiB}


def _fmt(row) -> str:
    if "time_ms" not in row:
        return f"{row['impl']:>9}  {row['note']}"
    ratio = f"{row['vs_torch']:6.2f}x" if "vs_torch" in row else "      -"
    mem = f"{row['peak_mib']:9.1f}" if "peak_mib" in row else "        -"
    return f"{row['impl']:>9}  {row['time_ms']:10.1f}  {row['gflops']:7.1f}  {ratio}  {mem}"


def _plot_panel(ax, results, mode, causal, threads) -> None:
    styles = {"tiled": ("C0", "o"), "reference": ("C1", "s"), "naive": ("C2", "^"), "torch": ("C3", "x")}
    for impl, (color, marker) in styles.items():
        pts = sorted((r["L"], r["time_ms"]) for r in results if r["impl"] == impl and r["mode"] == mode
                     and r["causal"] == causal and r["threads"] == threads and "time_ms" in r)
        if pts:
            ax.plot(*zip(*pts), color=color, marker=marker, label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{'fwd+bwd' if mode == 'fwdbwd' else 'fwd'}, {'causal' if causal else 'full'}, "
                 f"{threads} thread{'s' if threads > 1 else ''}", fontsize=10)
    ax.set_xlabel("sequence length L")
    ax.grid(True, which="both", alpha=0.3)


def plot(results, path, title="attention, float32 (lower is better)") -> None:
    """Time against L, one panel per (mode, causal) and thread count; needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads_list = sorted({r["threads"] for r in results}, reverse=True)
    fig, axes = plt.subplots(len(threads_list), 4, figsize=(16, 3.6 * len(threads_list)), squeeze=False)
    for row_i, threads in enumerate(threads_list):
        for col, (mode, causal) in enumerate([("fwd", False), ("fwd", True), ("fwdbwd", False), ("fwdbwd", True)]):
            ax = axes[row_i][col]
            _plot_panel(ax, results, mode, causal, threads)
            if col == 0:
                ax.set_ylabel("time (ms), best of N")
                ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    """The benchmark's options (``--help`` lists them)."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.attention", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192], help="lengths L")
    p.add_argument("--threads", type=thread_count_argument, nargs="+", default=[os.cpu_count() or 1],
                   help="thread counts to run (e.g. 2 1); BLAS, torch and the tiled kernel all get this many")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case (best is kept)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per case first")
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds to sleep before each timed call (OpenBLAS and OpenMP worker threads "
                        "spin-wait after a call and can slow the next implementation's first run)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--causal", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    p.add_argument("--max-dense", type=int, default=4096,
                   help="skip reference and naive above this length (their L x L scores: 2 GiB at 8192)")
    p.add_argument("--memory-len", type=int, default=32768, help="length of the memory-target check (0: skip)")
    p.add_argument("--no-memory", action="store_true", help="skip tracemalloc peaks and the memory target")
    p.add_argument("--json", type=Path, help="write all results here")
    p.add_argument("--plot", type=Path, help="write a plot of time against L here (needs matplotlib)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress line on stderr while a case runs (it shows only on a terminal)")
    return p.parse_args(argv)


def _print_header(args, info) -> None:
    for line in describe(info, threads=args.threads):
        print(line)
    if info["torch"] is None and "torch" in args.impls:
        print(torch_missing_line("the torch column and the ratios are skipped"))
    print(f"# attnkit attention benchmark: float32, B={args.batch}, H={args.heads}, D={args.dim}; best of "
          f"{args.repeats} after {args.warmup} warmup; peak = tracemalloc peak of one call (MiB)", flush=True)


def _run_threads(args, threads, torch) -> list[dict]:
    results = []
    if torch is not None:
        torch.set_num_threads(threads)
    with blas_limit(threads):
        for mode in args.modes:
            for causal in [c == "yes" for c in args.causal]:
                print(f"\n## {threads} thread(s), {'forward+backward' if mode == 'fwdbwd' else 'forward'}, "
                      f"{'causal' if causal else 'non-causal'}")
                print(f"{'impl':>9}  {'time ms':>10}  {'GFLOP/s':>7}  {'/torch':>7}  {'peak MiB':>9}")
                for seq in args.sizes:
                    print(f"L = {seq}", flush=True)
                    rows = bench_case(seq, causal, mode, threads, args, torch)
                    for row in rows:
                        print(_fmt(row), flush=True)
                    results.extend(rows)
    return results


def _print_memory(memory) -> None:
    verdict = "met" if memory["extra_mib"] <= memory["target_mib"] else "MISSED"
    print(f"\n## memory target: L={memory['L']}, H=1, D={memory['dim']}, tiled forward+backward")
    print(f"peak traced {memory['peak_mib']:.1f} MiB, of which outputs and gradients "
          f"{memory['outputs_and_grads_mib']:.1f} MiB: extra {memory['extra_mib']:.1f} MiB "
          f"(target <= 64 MiB: {verdict}; one head's L x L float32 scores would be "
          f"{memory['scores_one_head_mib']:.0f} MiB); {memory['seconds']:.1f} s")


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark described by ``args`` (from :func:`parse_args`); print it and return the report."""
    torch = import_torch() if "torch" in args.impls else None
    info = machine_info()
    _print_header(args, info)
    results = []
    adaptive = get_adaptive_threads()
    set_adaptive_threads(False)  # each column runs on the threads it names, whatever else the machine runs
    try:
        for threads in args.threads:
            results.extend(_run_threads(args, threads, torch))
    finally:
        set_adaptive_threads(adaptive)
    memory = None
    if not args.no_memory and args.memory_len:
        with blas_limit(args.threads[0]):
            memory = memory_target(args)
        _print_memory(memory)
    report = {"machine": info, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "results": results, "memory": memory}
    if args.json:
        write_json(args.json, report)
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(results, args.plot, title=f"attention, float32, B={args.batch}, H={args.heads}, D={args.dim} "
                                       f"(lower is better)")
        print(f"wrote {args.plot}")
    return report


def main(argv=None) -> int:
    """``python -m attnkit.benchmarks.attention [options]``."""
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
