"""Benchmark: a sliding window against full causal attention in the tiled kernel, and the same in PyTorch.

The tiled kernel skips tiles wholly outside the window, so W = 256 at L = 8192 should cost about
``W / (L / 2)`` of full causal attention plus the band-edge tiles (target: at most 0.5x). PyTorch has no
window in ``scaled_dot_product_attention``; its line passes the band as a boolean mask (what a torch user
writes), so it computes every score and shows what skipping buys.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m attnkit.benchmarks.window
    attnkit bench window --length 4096
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from ..kernels._threads import thread_count_argument
from ..kernels.tiled import flash_attention_backward, flash_attention_forward
from ._support import import_torch, torch_missing_line
from .machine import describe

__all__ = ["main", "parse_args", "run"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.window", description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=8192, help="sequence length L (default 8192)")
    p.add_argument("--window", type=int, default=256, help="window W (default 256)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--threads", type=thread_count_argument, default=2)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def best_ms(fn, repeats: int) -> float:
    """The best of ``repeats`` timed calls of ``fn`` after one warm-up call, in milliseconds."""
    fn()  # warm-up: pools, scratch buffers, BLAS
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def _torch_times(torch: Any, arrays, window: int, args) -> tuple[float, float]:
    q, k, v, grad = (torch.from_numpy(a) for a in arrays)
    n = args.length
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None]
    band = (cols <= rows) & (cols > rows - window)  # (L, L)
    torch.set_num_threads(args.threads)

    def fwd(mask, causal):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    def fwdbwd(mask, causal):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=causal).backward(grad)

    with torch.inference_mode():
        causal_fwd = best_ms(lambda: fwd(None, True), args.repeats)
        band_fwd = best_ms(lambda: fwd(band, False), args.repeats)
    return causal_fwd, band_fwd, best_ms(lambda: fwdbwd(None, True), args.repeats), \
        best_ms(lambda: fwdbwd(band, False), args.repeats)


def run(args: argparse.Namespace) -> dict[str, float]:
    """Time causal and windowed attention (forward, forward + backward); print the table, return the times."""
    rng = np.random.default_rng(0)
    shape = (1, args.heads, args.length, args.dim)
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]
    q, k, v, grad = arrays
    for line in describe(threads=args.threads):
        print(line)
    print(f"# float32, B=1, H={args.heads}, D={args.dim}, L={args.length}, W={args.window}, best of {args.repeats}")
    figures: dict[str, float] = {}
    print(f"{'':>22} {'causal ms':>10} {'W=' + str(args.window) + ' ms':>10} {'ratio':>7}")
    for mode in ("fwd", "fwdbwd"):
        times = []
        for window in (None, args.window):
            def call(window=window, mode=mode):
                _, _, ctx = flash_attention_forward(q, k, v, causal=True, window=window, num_threads=args.threads)
                if mode == "fwdbwd":
                    flash_attention_backward(grad, ctx)
            times.append(best_ms(call, args.repeats))
        figures[f"attnkit_{mode}_causal_ms"], figures[f"attnkit_{mode}_window_ms"] = times
        print(f"{'attnkit ' + mode:>22} {times[0]:10.1f} {times[1]:10.1f} {times[1] / times[0]:6.3f}x")
    torch = import_torch()
    if torch is None:
        print(torch_missing_line("no PyTorch lines"))
        return figures
    causal_fwd, band_fwd, causal_bwd, band_bwd = _torch_times(torch, arrays, args.window, args)
    for mode, causal, band in (("fwd", causal_fwd, band_fwd), ("fwdbwd", causal_bwd, band_bwd)):
        figures[f"torch_{mode}_causal_ms"], figures[f"torch_{mode}_window_ms"] = causal, band
        ours = figures[f"attnkit_{mode}_window_ms"]
        print(f"{'torch sdpa ' + mode:>22} {causal:10.1f} {band:10.1f} {band / causal:6.3f}x   "
              f"(attnkit's window takes {ours / band:.2f}x torch's masked band)")
    return figures


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m attnkit.benchmarks.window``."""
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
