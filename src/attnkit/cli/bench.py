"""``attnkit bench``: time attnkit's attention kernels against naive NumPy and PyTorch (:mod:`attnkit.benchmarks`)."""
from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from ._common import bounded_int, output_folder

__all__ = ["NAME", "add_parser", "run"]

NAME = "bench"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``attnkit bench`` and its arguments."""
    p = subparsers.add_parser(
        NAME, help="time the attention kernels against naive NumPy and PyTorch",
        description="Run the attention benchmark (attnkit.benchmarks.attention): attnkit's tiled and reference "
                    "kernels, a naive NumPy version and PyTorch (skipped, with a line saying so, when torch is "
                    "not installed), forward and forward+backward, causal and not, float32. Prints where it ran "
                    "(CPU, caches, BLAS and its kernel, threads), the table, and writes "
                    "OUT/attention-benchmark.json (and .png with matplotlib). Run it with "
                    "'env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE' where those are set. The encoder and MiniLM "
                    "benchmarks: python -m attnkit.benchmarks.encoder / .minilm.")
    p.add_argument("--sizes", type=bounded_int(1, 1 << 20), nargs="+", default=[256, 512, 1024, 2048],
                   help="sequence lengths L (default 256 512 1024 2048)")
    p.add_argument("--repeats", type=bounded_int(1, 10_000), default=3,
                   help="timed runs per case, best kept (default 3)")
    p.add_argument("--threads", type=bounded_int(1, 4096), nargs="+", default=None,
                   help="thread counts to run (default: every core)")
    p.add_argument("--heads", type=bounded_int(1, 4096), default=8, help="heads H (default 8)")
    p.add_argument("--dim", type=bounded_int(1, 65_536), default=64, help="head dimension D (default 64)")
    p.add_argument("--memory-check", action="store_true",
                   help="also measure the tiled kernel's memory at L = 32768 (slow)")
    p.add_argument("--out", default="attnkit-bench", help="output folder (default attnkit-bench)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Translate the options into the benchmark's own and run it."""
    from ..benchmarks import attention

    out = output_folder(args.out)
    argv = ["--sizes", *map(str, args.sizes), "--repeats", str(args.repeats), "--heads", str(args.heads),
            "--dim", str(args.dim), "--json", str(out / "attention-benchmark.json")]
    if args.threads:
        argv += ["--threads", *map(str, args.threads)]
    if not args.memory_check:
        argv += ["--memory-len", "0"]
    if importlib.util.find_spec("matplotlib") is None:
        print("# matplotlib is not installed: no plot (pip install 'attnkit[viz]')")
    else:
        argv += ["--plot", str(out / "attention-benchmark.png")]
    attention.run(attention.parse_args(argv))
    return 0
