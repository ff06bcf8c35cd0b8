"""Sliding-window against full causal attention in the tiled kernel: the window's time as a ratio.

The tiled kernel skips tiles wholly outside the window, so W = 256 at L = 8192 should cost about
``W / (L / 2)`` of full causal attention plus the band-edge tiles (target: at most 0.5x).

Run with ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src python benchmarks/bench_window.py``.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from attnkit.kernels.tiled import flash_attention_backward, flash_attention_forward


def _best_ms(fn, repeats: int) -> float:
    fn()  # warm-up: pools, scratch buffers, BLAS
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def _machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown"
    try:
        from threadpoolctl import threadpool_info
        blas = [(lib["internal_api"], lib.get("version"), lib.get("architecture"))
                for lib in threadpool_info() if lib.get("user_api") == "blas"]
    except ImportError:
        blas = "threadpoolctl not installed"
    return f"# {cpu}, {os.cpu_count()} cores; numpy {np.__version__}; BLAS {blas}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    shape = (1, args.heads, args.length, args.dim)
    q, k, v, grad = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    print(_machine())
    print(f"# float32, B=1, H={args.heads}, D={args.dim}, L={args.length}, threads={args.threads}, "
          f"best of {args.repeats}")
    print(f"{'mode':>10} {'causal ms':>11} {'W=' + str(args.window) + ' ms':>11} {'ratio':>7}")
    for mode in ("fwd", "fwdbwd"):
        times = []
        for window in (None, args.window):
            def call(window=window, mode=mode):
                out, _, ctx = flash_attention_forward(q, k, v, causal=True, window=window,
                                                      num_threads=args.threads)
                if mode == "fwdbwd":
                    flash_attention_backward(grad, ctx)
            times.append(_best_ms(call, args.repeats))
        print(f"{mode:>10} {times[0]:11.1f} {times[1]:11.1f} {times[1] / times[0]:6.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
