"""Benchmark: what keeping a GGUF file's quantized weights packed costs per token, and what it saves in memory.

The same file is loaded twice, ``load_causal_lm(path)`` (every weight dequantized to float32) and
``load_causal_lm(path, keep_quantized=True)`` (the quantized matrices kept as their blocks), each in a fresh
Python process, in rounds that alternate the two (a shared machine's speed moves within minutes). Each run
reports its resident memory (``VmHWM`` peak and ``VmRSS`` after loading, MiB; Linux only), the load time, the
prefill time of a ``--prefill``-token prompt (batch 1, into a cache, one logit row kept, the faster of two back to
back) and the decode tokens/s at batch 1 after a 16-token prompt (one over the median of ``--new`` greedy
steps, each timed alone). The summary gives each figure's median over the rounds and the packed / dequantized
ratio of every round.

Usage::

    python -m attnkit.benchmarks.packed --make /tmp/smol-q4_0.gguf --type Q4_0   # write the file, then measure
    python -m attnkit.benchmarks.packed FILE.gguf --rounds 3
    python -m attnkit.benchmarks.packed --decoders   # attnkit's block decoders against gguf's

``--make`` writes a Llama file of SmolLM2-135M's shape (30 layers, width 576, 9 query and 3 key/value heads, MLP
1536, vocabulary 49152, tied head) with random N(0, 0.02^2) weights, quantized by ``gguf.quants.quantize`` and
written with ``gguf``'s own writer, as llama.cpp's converter lays a model out (matrices in ``--type``, norms F32).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .machine import describe, machine_info

__all__ = ["main", "parse_args", "run", "make_gguf", "decoder_speeds", "SMOLLM2_135M"]

SMOLLM2_135M = dict(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, vocab=49152, context=2048)

# The child: loads the file one way, times it, prints one JSON line.
_CHILD = r"""
import json, statistics, sys, time
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 2**10
import numpy as np
from attnkit.pretrained import load_causal_lm
path, keep, prefill, new = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
before = status("VmRSS")
start = time.perf_counter()
lm = load_causal_lm(path, keep_quantized=keep)
load_s = time.perf_counter() - start
peak, after = status("VmHWM"), status("VmRSS")
rng = np.random.default_rng(0)
long = rng.integers(0, lm.config.vocab_size, (1, prefill))
times = []
for _ in range(2):
    cache = lm.new_cache(1)
    start = time.perf_counter()
    lm(long, cache=cache, logits_to_keep=1)
    times.append(time.perf_counter() - start)
cache = lm.new_cache(1)
token = lm(rng.integers(0, lm.config.vocab_size, (1, 16)), cache=cache, logits_to_keep=1)[:, -1].argmax(-1)
steps, tokens = [], []
for _ in range(new):  # greedy decoding steps, each timed alone: a busy machine's pauses stay in a few of them
    start = time.perf_counter()
    logits = lm(token[:, None], cache=cache)
    steps.append(time.perf_counter() - start)
    token = logits[:, -1].argmax(-1)
    tokens.append(int(token[0]))
print(json.dumps({"keep_quantized": keep, "interpreter_MiB": before, "peak_MiB": peak, "after_load_MiB": after,
                  "weights_MiB": sum(p.nbytes for p in lm.parameters()) / 2**20, "load_s": load_s,
                  "prefill_s": min(times), "decode_tps": 1 / statistics.median(steps), "tokens": tokens}))
"""


# Where each own decoder's float16 scales lie in its block.
_SCALE_BYTES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def decoder_speeds(rounds: int = 20, rows: int = 64, columns: int = 2048) -> dict[str, dict[str, float]]:
    """Million values a second decoded into float32 by attnkit's own decoders and by ``gguf.quants.dequantize``,
    on the same random blocks, best of ``rounds`` alternating the two. The default is one block of a product
    (``rows`` x ``columns`` = 128K values, the float32 in L2), the size a product decodes at a time."""
    import gguf

    from ..kernels.packed import _DECODERS

    rng = np.random.default_rng(0)
    speeds = {}
    for kind in (k for k in _DECODERS if k != "MXFP4"):
        qtype = gguf.GGMLQuantizationType[kind]
        values, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, columns // values * size), dtype=np.uint8)
        for offset in _SCALE_BYTES[kind]:  # finite float16 scales, random codes
            data.reshape(-1, size)[:, offset:offset + 2] = np.full(1, 0.01, np.float16).view(np.uint8)
        out = np.empty((rows, columns), np.float32)
        best = {"attnkit": np.inf, "gguf": np.inf}
        for _ in range(rounds):
            start = time.perf_counter()
            _DECODERS[kind](data, out)
            best["attnkit"] = min(best["attnkit"], time.perf_counter() - start)
            start = time.perf_counter()
            gguf.quants.dequantize(data, qtype)
            best["gguf"] = min(best["gguf"], time.perf_counter() - start)
        speeds[kind] = {name: rows * columns / t / 1e6 for name, t in best.items()}
        print(f"{kind}: attnkit {speeds[kind]['attnkit']:.0f} Mvalues/s, gguf {speeds[kind]['gguf']:.0f} Mvalues/s "
              f"({speeds[kind]['attnkit'] / speeds[kind]['gguf']:.1f}x)", flush=True)
    return speeds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.packed", description=__doc__.split("\n")[0])
    p.add_argument("file", nargs="?", help="a GGUF file with quantized matrices")
    p.add_argument("--make", metavar="PATH", help="first write a SmolLM2-135M-shaped GGUF file to PATH")
    p.add_argument("--type", default="Q4_0", choices=("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"),
                   help="the matrices' type for --make (default Q4_0)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running both loads (default 3)")
    p.add_argument("--prefill", type=int, default=256, help="prefill length (default 256)")
    p.add_argument("--new", type=int, default=8, help="greedy tokens per decode run, at least 2 (default 8)")
    p.add_argument("--decoders", action="store_true",
                   help="only time attnkit's own block decoders against gguf's (no file needed)")
    args = p.parse_args(argv)
    if not args.decoders and (args.file is None) == (args.make is None):
        p.error("give a FILE or --make PATH")
    if args.rounds < 1 or args.prefill < 1 or args.new < 2:
        p.error("--rounds and --prefill must be at least 1, --new at least 2")
    return args


def make_gguf(path: str | Path, kind: str = "Q4_0", shape: dict[str, int] | None = None, seed: int = 0) -> Path:
    """Write a Llama GGUF file of ``shape`` (default :data:`SMOLLM2_135M`) with random N(0, 0.02^2) weights, the
    matrices quantized to ``kind`` and the norms F32, with ``gguf``'s writer."""
    import gguf

    s = dict(SMOLLM2_135M, **(shape or {}))
    d, f, head_dim = s["hidden"], s["intermediate"], s["hidden"] // s["heads"]
    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_name("random SmolLM2-135M shape")
    for add, value in ((writer.add_context_length, s["context"]), (writer.add_embedding_length, d),
                       (writer.add_block_count, s["layers"]), (writer.add_feed_forward_length, f),
                       (writer.add_head_count, s["heads"]), (writer.add_head_count_kv, s["kv_heads"]),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, 100000.0),
                       (writer.add_vocab_size, s["vocab"]), (writer.add_rope_dimension_count, head_dim)):
        add(value)

    def matrix(name: str, rows: int, columns: int) -> None:  # GGUF's (out, in) rows, quantized
        blocks = gguf.quants.quantize((rng.standard_normal((rows, columns)) * 0.02).astype(np.float32), qtype)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)

    matrix("token_embd.weight", s["vocab"], d)
    writer.add_tensor("output_norm.weight", np.ones(d, np.float32))
    kv = s["kv_heads"] * head_dim
    for i in range(s["layers"]):
        for name, rows, columns in (("attn_q", d, d), ("attn_k", kv, d), ("attn_v", kv, d), ("attn_output", d, d),
                                    ("ffn_gate", f, d), ("ffn_up", f, d), ("ffn_down", d, f)):
            matrix(f"blk.{i}.{name}.weight", rows, columns)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(d, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _one(path: Path, keep: bool, args: argparse.Namespace) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), "1" if keep else "0", str(args.prefill),
                          str(args.new)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


_FIGURES = ("peak_MiB", "after_load_MiB", "weights_MiB", "load_s", "prefill_s", "decode_tps")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the rounds, print each run, the medians and the per-round ratios; return the figures."""
    path = make_gguf(args.make, args.type) if args.make else Path(args.file)
    for line in describe(machine_info()):
        print(line)
    print(f"# file {path}: {path.stat().st_size / 2**20:.0f} MiB; prefill {args.prefill}, {args.new} new tokens, "
          f"{args.rounds} rounds alternating the loads", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"dequantized": [], "packed": []}
    for r in range(args.rounds):
        for name, keep in ((("packed", True), ("dequantized", False)) if r % 2 else
                           (("dequantized", False), ("packed", True))):
            row = _one(path, keep, args)
            runs[name].append(row)
            print(f"#   round {r + 1} {name:11s} " + ", ".join(f"{k} {row[k]:.2f}" for k in _FIGURES), flush=True)
    same = all(p["tokens"] == d["tokens"] for p, d in zip(runs["packed"], runs["dequantized"]))
    figures = {"file": str(path), "file_MiB": path.stat().st_size / 2**20, "prefill": args.prefill, "new": args.new,
               "greedy_tokens_equal": same, "machine": machine_info()}
    print("| load | " + " | ".join(_FIGURES) + " |\n|" + "---|" * (len(_FIGURES) + 1))
    for name, rows in runs.items():
        figures[name] = {k: statistics.median(row[k] for row in rows) for k in _FIGURES}
        print(f"| {name} | " + " | ".join(f"{figures[name][k]:.2f}" for k in _FIGURES) + " |")
    ratios = {k: [p[k] / d[k] for p, d in zip(runs["packed"], runs["dequantized"])] for k in _FIGURES}
    figures["ratios"] = ratios
    for k, values in ratios.items():
        print(f"packed / dequantized {k}: " + ", ".join(f"{v:.3f}" for v in values))
    print(f"greedy tokens equal: {same}")
    return figures


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    args = parse_args(argv)
    if args.decoders:
        for line in describe(machine_info()):
            print(line)
        decoder_speeds()
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
