"""Benchmark: speculative decoding on a real chat model, each method against plain greedy decoding in one run.

For three kinds of prompt (edit a given paragraph, answer from a given document, free chat), rendered with the
model's chat template, every method decodes ``--new`` greedy tokens in rounds that alternate the methods (a
shared machine's speed moves within minutes): plain decoding, prompt lookup (``prompt_lookup_num_tokens``), the
model's own first layers as the draft (``assistant_early_exit``) and, given ``--draft PATH``, a smaller model
with the same tokenizer. Each row reports the median tokens/s over the rounds, its ratio to plain decoding in
the same rounds, the acceptance rate (draft tokens kept / proposed), the rounds that drafted, and whether the
tokens equal plain greedy's. Given ``--llama-bench PATH`` (llama.cpp's ``llama-bench`` binary) and a GGUF file
(the model, or ``--llama-gguf``: an F32 file for llama.cpp's plain F32 decoding), every round also runs
``llama-bench -p 0 -n NEW`` (plain decoding of ``--new`` tokens), and each row gives its ratio to llama.cpp's
median tokens/s too.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m attnkit.benchmarks.speculative smol.gguf --threads 2 \\
        --llama-bench llama.cpp/build/bin/llama-bench --llama-gguf smol-f32.gguf
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..decoding.speculative import DraftModel, PromptLookup, draft_step_cost
from ..kernels._threads import default_num_threads, num_threads
from .machine import describe, machine_info
from .runtime import llama_bench_command, llama_bench_round

__all__ = ["PROMPTS", "LLAMA", "main", "parse_args", "run", "lines", "llama_command"]

_PARAGRAPH = ("The tiled attention kernel splits the queries and keys into blocks that fit in the cache. For "
              "every block of queries it walks over the blocks of keys, keeps a running maximum and a running "
              "sum of the exponentials, and rescales the partial output whenever the maximum grows. Nothing of "
              "the size of the full score matrix is ever allocated, so the memory grows linearly with the "
              "length of the sequence rather than with its square.")
_DOCUMENT = ("Gated DeltaNet is a linear attention layer. Instead of keeping every key and value, it keeps a "
             "fixed-size state matrix per head, which it updates with the delta rule: each new key first removes "
             "what the state predicted for it, then writes its value, and a learned decay lets old information "
             "fade. Because the state has a fixed size, decoding costs the same for every token, however long "
             "the text. Qwen3.5 and Qwen3-Next use three Gated DeltaNet layers for every full attention layer.")

PROMPTS: dict[str, str] = {
    "edit": f"Rewrite this paragraph in the same words, but replace 'block' with 'tile':\n\n{_PARAGRAPH}",
    "document": f"{_DOCUMENT}\n\nUsing the text above, explain how Gated DeltaNet keeps decoding cheap.",
    "chat": "Write a short story about a lighthouse keeper who befriends a seagull.",
}
"""The three kinds of prompt: a user message each."""

LLAMA = "llama.cpp plain (llama-bench)"
"""The row of llama.cpp's plain decoding, when ``--llama-bench`` is given."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.speculative", description=__doc__.split("\n")[0])
    p.add_argument("model", help="a chat model: a Hugging Face folder or a GGUF file")
    p.add_argument("--threads", type=int, default=default_num_threads())
    p.add_argument("--new", type=int, default=96, help="greedy tokens per run (default 96)")
    p.add_argument("--rounds", type=int, default=3, help="rounds alternating the methods (default 3)")
    p.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens (default 10)")
    p.add_argument("--early-exit", type=int, default=None, metavar="N",
                   help="assistant_early_exit layers (default: a quarter of the model's)")
    p.add_argument("--draft", default=None, metavar="PATH", help="a smaller model with the same tokenizer")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-bench binary: its plain decoding in the same rounds")
    p.add_argument("--llama-gguf", default=None, metavar="PATH",
                   help="the GGUF file llama-bench runs (default: the model, which must then be a GGUF file)")
    args = p.parse_args(argv)
    if args.llama_bench is not None:
        binary = Path(args.llama_bench)
        if not binary.is_file() or not os.access(binary, os.X_OK):
            p.error(f"--llama-bench must be an executable llama-bench binary, got {args.llama_bench!r}")
        gguf = Path(args.llama_gguf or args.model)
        if gguf.suffix.lower() != ".gguf" or not gguf.is_file():
            p.error(f"--llama-bench runs a GGUF file: give the model as one or --llama-gguf, got {str(gguf)!r}")
    elif args.llama_gguf is not None:
        p.error("--llama-gguf is the file --llama-bench runs: give --llama-bench too")
    return args


def llama_command(args: argparse.Namespace) -> list[str] | None:
    """The ``llama-bench`` command of one round (plain decoding of ``--new`` tokens, no prompt test), or None."""
    if args.llama_bench is None:
        return None
    return llama_bench_command(args.llama_bench, args.llama_gguf or args.model, args.threads, 0, args.new)


def _methods(lm: Any, args: argparse.Namespace, draft: Any) -> dict[str, Any]:
    """Each method's proposer factory (a fresh proposer per run), plain decoding first."""
    exit_layers = args.early_exit or max(1, lm.config.num_layers // 4)
    early = lm.early_exit(exit_layers)
    methods = {"plain": lambda: None,
               f"prompt lookup ({args.lookup})": lambda: PromptLookup(args.lookup),
               f"early exit ({exit_layers} of {lm.config.num_layers} layers)":
                   lambda: DraftModel(early, 4, vocab_size=lm.config.vocab_size,
                                      draft_cost=draft_step_cost(early, lm))}
    if draft is not None:
        methods["draft model"] = lambda: DraftModel(draft, 4, vocab_size=lm.config.vocab_size,
                                                    draft_cost=draft_step_cost(draft, lm))
    return methods


def run(args: argparse.Namespace) -> dict[str, dict[str, dict[str, float]]]:
    """Measure every method on every prompt; prints the table and returns {prompt: {method: figures}}."""
    from ..pretrained import load

    for line in describe(machine_info(), threads=args.threads):
        print(line)
    lm, tokenizer = load(args.model)
    draft = None if args.draft is None else load(args.draft)[0]
    methods = _methods(lm, args, draft)
    command = llama_command(args)
    figures: dict[str, dict[str, dict[str, float]]] = {}
    with num_threads(args.threads):
        for kind, message in PROMPTS.items():
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                     add_generation_prompt=True)
            ids = np.array([rendered["input_ids"]], dtype=np.int64)
            figures[kind] = _measure(lm, ids, methods, args, command)
            for line in lines(kind, figures[kind]):
                print(line, flush=True)
    return figures


def lines(kind: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    """The table's lines of one kind of prompt: each method's tokens/s and ratios (and llama.cpp's row)."""
    out = []
    llama = rows.get(LLAMA, {})
    for method, row in rows.items():
        if method == LLAMA:
            out.append(f"{kind:9s} {method:34s} " + (f"{row['tokens_per_s']:7.1f} tok/s  {row['speedup']:5.2f}x plain"
                                                      if "tokens_per_s" in row else row["error"]))
            continue
        versus = f"  {row['tokens_per_s'] / llama['tokens_per_s']:5.2f}x llama.cpp" if "tokens_per_s" in llama else ""
        out.append(f"{kind:9s} {method:34s} {row['tokens_per_s']:7.1f} tok/s  {row['speedup']:5.2f}x plain{versus}  "
                   f"acceptance {row['acceptance']:6.1%}  drafting rounds {row['rounds']:4.1f}  "
                   f"tokens equal plain: {row['equal']:.0%}")
    return out



def _measure(lm: Any, ids: np.ndarray, methods: dict[str, Any], args: argparse.Namespace,
             command: list[str] | None = None) -> dict[str, dict]:
    """Each method's figures over ``args.rounds`` rounds that alternate them (and ``llama-bench``'s, given its
    ``command``)."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    counts: dict[str, list[int]] = {name: [0, 0, 0] for name in methods}
    outputs: dict[str, np.ndarray] = {}
    llama: list[dict[str, Any]] = []
    options = dict(max_new_tokens=args.new, do_sample=False)
    lm.generate(ids, max_new_tokens=2)  # warm the pages
    for _ in range(args.rounds):
        for name, make in methods.items():
            proposer = make()
            start = time.perf_counter()
            out = lm.generate(ids, assistant_model=proposer, **options)
            times[name].append(time.perf_counter() - start)
            outputs[name] = out[0, ids.shape[1]:]
            if proposer is not None:
                counts[name][0] += proposer.kept
                counts[name][1] += proposer.proposed
                counts[name][2] += proposer.rounds
        if command is not None:
            llama.append(llama_bench_round(command))
    plain = statistics.median(times["plain"])
    rows = {}
    for name in methods:
        produced = len(outputs[name])
        middle = statistics.median(times[name])
        same = outputs[name][:len(outputs["plain"])]
        rows[name] = dict(tokens_per_s=produced / middle, speedup=plain / middle,
                          acceptance=counts[name][0] / counts[name][1] if counts[name][1] else 0.0,
                          rounds=counts[name][2] / args.rounds,
                          equal=float(np.mean(same == outputs["plain"][:len(same)])) if len(same) else 1.0)
    if command is not None:
        rates = [r["decode_tps"] for r in llama if "decode_tps" in r]
        rows[LLAMA] = dict(tokens_per_s=statistics.median(rates),
                           speedup=statistics.median(rates) / rows["plain"]["tokens_per_s"]) if rates else \
            {"error": next((r["error"] for r in llama if "error" in r), "llama-bench gave no decoding result")}
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line."""
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
