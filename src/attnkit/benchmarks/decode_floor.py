"""Benchmark: how much of a batch-1 decoding step is its weight products, family by family.

At batch 1 a decoding step multiplies one row by every weight matrix a token reads (its k experts of a
mixture, the head), and each product costs about the time to stream that matrix from memory. The products
alone, run back to back on the same arrays in the step's order, with the same BLAS threads, are the step's
floor: no rewrite of the code around them (norms, rotation, the cache, the attention of one query, residual
adds) can take the step below it. This benchmark measures, for the benchmark shape of each family
(``attnkit.benchmarks.decode``'s: SmolLM-135M's, GPT-2 small's for ``gpt2``; random weights saved by
``transformers`` and loaded by attnkit), alternately in each round:

* the step: ``generate`` of ``--new`` greedy tokens less ``generate`` of one, per step (batch 1, a 16-token
  prompt);
* the floor: one pass of one-row products over :func:`step_weights` (the same arrays, float32).

It prints the median of the rounds of each, their ratio and the difference (what the code around the products
costs). A step within a few percent of its floor can only get faster through faster products: other weight
layouts, fewer bytes, or another BLAS. For the first of these it also times, shape by shape, the same weights
stored the other way round (column-major, as :meth:`attnkit.core.Module.store_column_major` keeps one): the
floor with each shape in its faster layout is the floor of any layout choice.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m attnkit.benchmarks.decode_floor --threads 2
    python -m attnkit.benchmarks.decode_floor --families llama qwen3 --rounds 3   # quicker

Needs torch, transformers and safetensors (to make the random checkpoints).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..kernels._threads import decode_blas, thread_count_argument
from ..layers.embedding import Embedding
from ._support import engine_threads, import_torch, torch_missing_line
from .decode import FAMILIES, _build
from .machine import describe, machine_info

__all__ = ["main", "parse_args", "run", "step_weights", "products_time", "layout_times", "step_time"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.decode_floor",
                                description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    p.add_argument("--threads", type=thread_count_argument, default=2, help="BLAS and attnkit threads (default 2)")
    p.add_argument("--new", type=int, default=16, help="greedy tokens of the timed run (default 16, at least 2)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds, the median kept (default 5)")
    args = p.parse_args(argv)
    if args.new < 2 or args.rounds < 1:
        p.error(f"--new must be at least 2 and --rounds at least 1, got {args.new} and {args.rounds}")
    return args


def step_weights(lm: Any) -> list[np.ndarray]:
    """The matrices one batch-1 decoding step of ``lm`` reads whole, in the model's order, each (In, Out) as the
    step multiplies a row by it (a short convolution's (C, K) taps too): a fused group's one buffer in place of
    its members, the first k of a mixture's E
    stacked experts (a token reads k), the output head; not the token or position tables (a step reads one row).

    Returns
    -------
    list of ndarray, each 2-D (In, Out)
    """
    weights: list[np.ndarray] = []
    experts = lm.config.experts
    chosen = 0 if experts is None else experts.num_experts_per_tok
    for _, module in lm.named_modules():
        if isinstance(module, Embedding):
            continue
        members: set[str] = set()
        for buffer, names, _ in module.__dict__.get("_fused", {}).values():
            if buffer is not None and buffer.ndim == 2:
                weights.append(buffer)
                members.update(names)
        for name, param in module._parameters.items():
            if name in members or not isinstance(param, np.ndarray):
                continue
            if param.ndim == 2:
                weights.append(param)
            elif param.ndim == 3:  # (E, In, Out): the k experts a token is routed to
                weights.extend(param[:chosen])
    weights.append(lm.head_weight.T)  # (D, V)
    return weights


def products_time(weights: list[np.ndarray], dtype=np.float32) -> float:
    """Seconds for one pass of one-row products over ``weights`` (each (In, Out)), with the BLAS threads of a
    decoding step (:func:`~attnkit.kernels._threads.decode_blas`)."""
    rows = {w.shape[0]: np.ones((1, w.shape[0]), dtype) for w in weights}  # (1, In) per input width
    with decode_blas(1):
        start = time.perf_counter()
        for w in weights:
            rows[w.shape[0]] @ w  # (1, Out)
        return time.perf_counter() - start


def layout_times(weights: list[np.ndarray], dtype=np.float32) -> dict[tuple[int, int], tuple[float, float]]:
    """Per weight shape (In, Out): seconds for one-row products over every weight of that shape, as stored and
    stored the other way round (a column-major copy of a row-major array, or the reverse), each pass streaming
    its weights from memory as a step does; the median of seven passes of each, alternated."""
    def one_pass(row: np.ndarray, arrays: list[np.ndarray]) -> float:
        start = time.perf_counter()
        for w in arrays:
            row @ w  # (1, Out)
        return time.perf_counter() - start

    groups: dict[tuple[int, int], list[np.ndarray]] = {}
    for w in weights:
        groups.setdefault(w.shape, []).append(w)
    times = {}
    with decode_blas(1):
        for shape, group in groups.items():
            row = np.ones((1, shape[0]), dtype)  # (1, In)
            other = [np.asfortranarray(w) if w.flags.c_contiguous else np.ascontiguousarray(w) for w in group]
            passes = [(one_pass(row, group), one_pass(row, other)) for _ in range(7)]  # alternated
            times[shape] = (statistics.median(a for a, _ in passes), statistics.median(b for _, b in passes))
    return times


def step_time(lm: Any, ids: np.ndarray, new: int) -> float:
    """Seconds per decoding step: ``generate`` of ``new`` greedy tokens less ``generate`` of one, over
    ``new - 1`` steps."""
    def run(n: int) -> float:
        start = time.perf_counter()
        lm.generate(ids, max_new_tokens=n, min_new_tokens=n, eos_token_id=[])
        return time.perf_counter() - start
    return max(run(new) - run(1), 0.0) / (new - 1)


def _family(family: str, args: argparse.Namespace, torch: Any) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        lm, _ = _build(family, Path(tmp), torch)
    weights = step_weights(lm)
    ids = np.random.default_rng(0).integers(0, lm.config.vocab_size, size=(1, 16))  # (1, 16)
    step_time(lm, ids, 2)  # warm: first-call thread choices, the cache's first growth
    steps, floors = [], []
    for _ in range(args.rounds):
        steps.append(step_time(lm, ids, args.new))
        floors.append(min(products_time(weights) for _ in range(3)))
    step, floor = statistics.median(steps), statistics.median(floors)
    layouts = layout_times(weights)
    best = floor - sum(stored - min(stored, other) for stored, other in layouts.values())
    turned = [f"{shape[0]}x{shape[1]} {stored / other:.2f}x" for shape, (stored, other) in layouts.items()
              if other < stored]
    megabytes = sum(w.nbytes for w in weights) / 2**20
    print(f"{family}: step {step * 1e3:.2f} ms, its products alone {floor * 1e3:.2f} ms ({megabytes:.0f} MiB, "
          f"{megabytes * 2**20 / floor / 1e9:.1f} GB/s), step / products {step / floor:.2f}, the rest "
          f"{(step - floor) * 1e3:.2f} ms; each shape in its faster layout {best * 1e3:.2f} ms (faster the other way "
          f"round: {', '.join(turned) or 'none'})", flush=True)
    return {"step_s": step, "products_s": floor, "best_layout_s": best, "weights_mib": megabytes}


def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Measure every family; prints a line per family and a Markdown table, returns the figures."""
    torch = import_torch()
    if torch is None:
        print(torch_missing_line("no random checkpoints to load"))
        return {}
    for line in describe(machine_info(), threads=args.threads):
        print(line)
    with engine_threads(torch, args.threads):
        figures = {family: _family(family, args, torch) for family in args.families}
    print("| family | step | products alone | step / products | the rest | products, best layouts |")
    print("|---|---|---|---|---|---|")
    for family, row in figures.items():
        print(f"| {family} | {row['step_s'] * 1e3:.2f} ms | {row['products_s'] * 1e3:.2f} ms | "
              f"{row['step_s'] / row['products_s']:.2f} | {(row['step_s'] - row['products_s']) * 1e3:.2f} ms | "
              f"{row['best_layout_s'] * 1e3:.2f} ms |")
    return figures


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m attnkit.benchmarks.decode_floor``."""
    return 0 if run(parse_args(argv)) else 1


if __name__ == "__main__":
    sys.exit(main())
