"""Cost of flex masks and modifiers on the tiled kernel: what tile skipping buys, what a softcap costs.

Each line times ``attnkit.flex.flex_attention`` (tiled, forward) for a variant and for its baseline in the
same run and prints the ratio: a document mask of 8 equal documents and a sliding window against full
causal attention, a softcap against plain attention. Run: ``python -m attnkit.benchmarks.flex``.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from .. import flex as F
from .machine import describe, machine_info


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _time(q, k, v, mask, score_mod, block, repeats):
    L = q.shape[2]
    bm = None if mask is None else F.create_block_mask(mask, None, None, L, L, block_size=block)
    return _best(lambda: F.flex_attention(q, k, v, score_mod, bm, kernel="tiled"), repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192, help="sequence length for the document mask")
    parser.add_argument("--window-length", type=int, default=16384, help="sequence length for the window")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    for line in describe(machine_info()):
        print(line)
    print(f"# kernel: attnkit.flex_attention(kernel='tiled') (the tiled FlashAttention kernel), block "
          f"{args.block}, float32, B=1, H={args.heads}, D={args.dim}, forward")
    rng = np.random.default_rng(0)

    def qkv(L):
        return [rng.standard_normal((1, args.heads, L, args.dim), dtype=np.float32) for _ in range(3)]
    L = args.length
    q, k, v = qkv(L)
    causal = _time(q, k, v, F.causal_mask, None, args.block, args.repeats)
    docs = _time(q, k, v, F.document_mask(np.arange(L) * 8 // L), None, args.block, args.repeats)
    print(f"document mask (8 docs) L={L}: {docs:.3f} s vs causal {causal:.3f} s = {docs / causal:.2f}x")
    plain = _time(q, k, v, None, None, args.block, args.repeats)
    capped = _time(q, k, v, None, F.softcap(30.0), args.block, args.repeats)
    print(f"softcap L={L}: {capped:.3f} s vs plain {plain:.3f} s = {capped / plain:.2f}x")
    L = args.window_length
    q, k, v = qkv(L)
    causal = _time(q, k, v, F.causal_mask, None, args.block, args.repeats)
    window = _time(q, k, v, F.sliding_window_mask(args.window), None, args.block, args.repeats)
    print(f"sliding window W={args.window} L={L}: {window:.3f} s vs causal {causal:.3f} s = "
          f"{window / causal:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
