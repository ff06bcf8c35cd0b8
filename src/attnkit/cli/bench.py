"""``attnkit bench [NAME]``: time attnkit against naive NumPy, PyTorch and ``transformers`` (:mod:`attnkit.benchmarks`).

``attention`` (the default) times the attention kernels; ``decode`` times every decoder family's generation and
prefill against ``transformers``; ``window`` a sliding window against full causal attention (and PyTorch's
masked band); ``runtime MODEL`` one model's prefill and decoding on attnkit, ``transformers`` and (with
``--llama-bench``) llama.cpp on the same weights, and the share of the GEMV bandwidth decoding reaches.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

from ..benchmarks.decode import FAMILIES as _FAMILIES
from ..io import atomic_write
from ..kernels._threads import MAX_NUM_THREADS, default_num_threads, thread_count_argument
from ._common import UsageError, bounded_int, output_folder, printable

_DECODE_FAMILIES = tuple(_FAMILIES)

__all__ = ["NAME", "add_parser", "run"]

NAME = "bench"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``attnkit bench`` and its arguments."""
    p = subparsers.add_parser(
        NAME, help="time the attention kernels (or every model family's decoding) against PyTorch",
        description="attnkit bench [attention]: the attention benchmark (attnkit.benchmarks.attention): "
                    "attnkit's tiled and reference kernels, a naive NumPy version and PyTorch (skipped, with a "
                    "line saying so, when torch is not installed), forward and forward+backward, causal and not, "
                    "float32. Prints where it ran (CPU, caches, BLAS and its kernel, threads, the tuned choices of "
                    "attnkit tune or the defaults), the table, and writes OUT/attention-benchmark.json (and .png "
                    "with matplotlib). Run it with "
                    "'env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE' where those are set. The encoder and MiniLM "
                    "benchmarks: python -m attnkit.benchmarks.encoder / .minilm. "
                    "attnkit bench decode: every decoder family's greedy decoding (tokens/s at each --batches) and "
                    "prefill against transformers in the same run, with the share of the GEMV bandwidth "
                    "(attnkit.benchmarks.decode; needs torch and transformers). "
                    "attnkit bench window: a sliding window (--window, at --length) against full causal attention "
                    "in the tiled kernel, forward and backward, and PyTorch with the band as a mask. "
                    "attnkit bench runtime MODEL (a Hugging Face folder or a GGUF file): prefill and decode "
                    "tokens/s of attnkit and transformers (when installed) on the same weights, in rounds that "
                    "alternate the engines, the GEMV bandwidth measured right after attnkit's decoding and the "
                    "share of it decoding reaches; with --llama-bench PATH llama.cpp's llama-bench on the same "
                    "GGUF file in the same rounds (attnkit.benchmarks.runtime).")
    p.add_argument("name", nargs="?", default="attention", choices=("attention", "decode", "window", "runtime"),
                   help="which benchmark (default attention)")
    p.add_argument("model", nargs="?", default=None,
                   help="runtime only: a Hugging Face causal LM folder or a GGUF file")
    p.add_argument("--sizes", type=bounded_int(1, 1 << 20), nargs="+", default=[256, 512, 1024, 2048],
                   help="sequence lengths L (default 256 512 1024 2048)")
    p.add_argument("--repeats", type=bounded_int(1, 10_000), default=3,
                   help="timed runs per case, best kept (default 3)")
    p.add_argument("--threads", type=thread_count_argument, nargs="+", default=None, metavar="N",
                   help=f"thread counts to run, each for attnkit's kernels and BLAS, 1 to {MAX_NUM_THREADS} "
                        f"(default: every core this process may use)")
    p.add_argument("--heads", type=bounded_int(1, 4096), default=8, help="heads H (default 8)")
    p.add_argument("--dim", type=bounded_int(1, 65_536), default=64, help="head dimension D (default 64)")
    p.add_argument("--memory-check", action="store_true",
                   help="also measure the tiled kernel's memory at L = 32768 (slow)")
    p.add_argument("--out", default="attnkit-bench", help="output folder (default attnkit-bench)")
    p.add_argument("--quiet", action="store_true",
                   help="attention: no progress line on stderr between the table's rows (it shows only on a "
                        "terminal)")
    decode_options = p.add_argument_group("decode")
    decode_options.add_argument("--families", nargs="+", choices=_DECODE_FAMILIES, default=None,
                                help="families to time (default: all)")
    decode_options.add_argument("--new", type=bounded_int(1, 100_000), default=32,
                                help="greedy tokens per decode run (default 32)")
    decode_options.add_argument("--batches", type=bounded_int(1, 4096), nargs="+", default=None,
                                help="decode batch sizes (default 1 8; runtime: 1)")
    decode_options.add_argument("--prefill", type=bounded_int(1, 1 << 20), default=1024,
                                help="prefill length (default 1024)")
    runtime_options = p.add_argument_group("runtime (also --new, --batches, --prefill, --repeats, --threads)")
    runtime_options.add_argument("--llama-bench", default=None, metavar="PATH",
                                 help="a llama.cpp llama-bench binary: run it on the same GGUF file")
    runtime_options.add_argument("--keep-quantized", action="store_true",
                                 help="load attnkit's model with its quantized weights kept packed")
    window_options = p.add_argument_group("window")
    window_options.add_argument("--length", type=bounded_int(1, 1 << 20), default=8192,
                                help="sequence length (default 8192)")
    window_options.add_argument("--window", type=bounded_int(1, 1 << 20), default=256,
                                help="window size (default 256)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Translate the options into the benchmark's own and run it."""
    if args.model is not None and args.name != "runtime":
        raise UsageError(f"attnkit bench {args.name} takes no model (got {args.model!r}); "
                         f"attnkit bench runtime MODEL times a model")
    if args.llama_bench is not None and args.name != "runtime":
        raise UsageError("--llama-bench belongs to attnkit bench runtime MODEL")
    if args.keep_quantized and args.name != "runtime":
        raise UsageError("--keep-quantized belongs to attnkit bench runtime MODEL")
    if args.name == "runtime":
        return _run_runtime(args)
    if args.name == "decode":
        return _run_decode(args)
    if args.name == "window":
        return _run_window(args)
    from ..benchmarks import attention

    out = output_folder(args.out)
    argv = ["--sizes", *map(str, args.sizes), "--repeats", str(args.repeats), "--heads", str(args.heads),
            "--dim", str(args.dim), "--json", str(out / "attention-benchmark.json")]
    if args.threads:
        argv += ["--threads", *map(str, args.threads)]
    if not args.memory_check:
        argv += ["--memory-len", "0"]
    if args.quiet:
        argv += ["--quiet"]
    if importlib.util.find_spec("matplotlib") is None:
        print("# matplotlib is not installed: no plot (pip install 'attnkit[viz]')")
    else:
        argv += ["--plot", str(out / "attention-benchmark.png")]
    attention.run(attention.parse_args(argv))
    return 0


def _run_decode(args: argparse.Namespace) -> int:
    from ..benchmarks import decode

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        raise UsageError("attnkit bench decode compares with transformers: pip install torch transformers")
    argv = ["--new", str(args.new), "--batches", *map(str, args.batches or [1, 8]), "--prefill", str(args.prefill),
            "--repeats", str(args.repeats), "--threads", str((args.threads or [default_num_threads()])[0])]
    if args.families:
        argv += ["--families", *args.families]
    figures = decode.run(decode.parse_args(argv))
    out = output_folder(args.out)
    text = (json.dumps(figures, indent=2) + "\n").encode()
    atomic_write(out / "decode-benchmark.json", lambda f: f.write(text))
    return 0


def _run_window(args: argparse.Namespace) -> int:
    from ..benchmarks import window

    argv = ["--length", str(args.length), "--window", str(args.window), "--heads", str(args.heads),
            "--dim", str(args.dim), "--repeats", str(args.repeats),
            "--threads", str((args.threads or [default_num_threads()])[0])]
    figures = window.run(window.parse_args(argv))
    text = (json.dumps(figures, indent=2) + "\n").encode()
    atomic_write(output_folder(args.out) / "window-benchmark.json", lambda f: f.write(text))
    return 0


def _run_runtime(args: argparse.Namespace) -> int:
    from ..benchmarks import runtime

    if args.model is None:
        raise UsageError("attnkit bench runtime needs a model: a Hugging Face folder or a GGUF file")
    if args.new < 2:
        raise UsageError(f"--new must be at least 2 for runtime (one token is the prompt's forward alone), "
                         f"got {args.new}")
    options = argparse.Namespace(model=args.model, threads=(args.threads or [default_num_threads()])[0],
                                 prefill=args.prefill, new=args.new, batches=args.batches or [1],
                                 repeats=args.repeats, llama_bench=args.llama_bench,
                                 keep_quantized=args.keep_quantized)
    try:
        runtime.check_args(options)
        lm = runtime.load_model(options)  # a file that cannot be loaded, or lengths past its positions
    except ValueError as exc:
        raise UsageError(printable(str(exc))) from None
    out = output_folder(args.out)
    figures = runtime.run(options, lm)
    text = (json.dumps(figures, indent=2) + "\n").encode()
    atomic_write(out / "runtime-benchmark.json", lambda f: f.write(text))
    return 0
