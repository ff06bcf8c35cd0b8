"""Benchmark: one model's prefill and decoding on attnkit, ``transformers`` and llama.cpp, on the same weights.

Given a Hugging Face folder or a GGUF file, attnkit loads it with :func:`attnkit.pretrained.load_causal_lm`,
``transformers`` (when installed) with ``from_pretrained`` (a GGUF file through its ``gguf_file`` reader, which
dequantizes to the same float32 numbers attnkit does), and, given ``--llama-bench PATH`` (a ``llama-bench``
binary of llama.cpp that the user built) and a GGUF file, llama.cpp runs the same file. Measured in rounds that
alternate the engines (a shared machine's speed moves within minutes; alternating lets every engine see the same
conditions), each figure reported as the median of the rounds with its range:

* prefill tokens/s: one forward of ``--prefill`` random tokens, batch 1, into a cache, one logit row kept, the
  faster of two back to back (the first after another engine ran pays for fresh pages: attnkit's took 2.4-3.0 s
  where the second took 1.9-2.1 s), for attnkit and ``transformers`` alike (llama.cpp: ``llama-bench -p``);
* decode tokens/s at each ``--batches``: the decoding steps alone, a run of ``--new`` greedy tokens after a
  16-token prompt less a run of one token (llama.cpp: ``llama-bench -n``, batch 1), and whether attnkit's and
  ``transformers``' greedy tokens agree;
* the GEMV bandwidth, ``y = W @ x`` on a float32 matrix larger than the last-level cache sustained for as long as
  attnkit's batch-1 decoding steps took, right after them, and the fraction of it those steps reach (the
  weights a token reads times the steps' rate).

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE attnkit bench runtime smol-f32.gguf --threads 2 \\
        --llama-bench llama.cpp/build/bin/llama-bench
    python -m attnkit.benchmarks.runtime SmolLM2-135M/ --prefill 512 --new 32   # a folder

transformers needs torch; llama.cpp needs a GGUF file.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..kernels._threads import check_num_threads, default_num_threads, thread_count_argument
from ._support import engine_threads, import_torch, torch_missing_line
from .decode import gemv_bandwidth, weights_read_per_token
from .machine import describe, machine_info

__all__ = ["main", "parse_args", "check_args", "load_model", "run", "summary", "load_transformers",
           "llama_bench_command", "parse_llama_bench", "llama_bench_round", "PROMPT_TOKENS"]

PROMPT_TOKENS = 16  # the decode runs' prompt
_LLAMA_TIMEOUT_S = 3600


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.runtime", description=__doc__.split("\n")[0])
    p.add_argument("model", help="a Hugging Face causal LM folder or a GGUF file")
    p.add_argument("--threads", type=thread_count_argument, default=default_num_threads(),
                   help="threads of every engine (default: every core this process may use)")
    p.add_argument("--prefill", type=int, default=1024, help="prefill length (default 1024)")
    p.add_argument("--new", type=int, default=32, help="greedy tokens per decode run, at least 2 (default 32)")
    p.add_argument("--batches", type=int, nargs="+", default=[1], help="decode batch sizes (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="rounds alternating the engines (default 3)")
    p.add_argument("--llama-bench", default=None, metavar="PATH", help="llama.cpp's llama-bench binary")
    p.add_argument("--keep-quantized", action="store_true",
                   help="attnkit keeps the file's quantized weights packed (load(..., keep_quantized=True))")
    args = p.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming the first option that cannot run (before any model is loaded)."""
    try:
        check_num_threads(args.threads, "--threads")
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None
    for name, low in (("prefill", 1), ("new", 2), ("repeats", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name} must be at least {low}, got {getattr(args, name)}")
    if not args.batches or min(args.batches) < 1:
        raise ValueError(f"--batches must be positive batch sizes, got {args.batches}")
    path = Path(args.model)
    gguf = path.suffix.lower() == ".gguf"
    if not (path.is_file() if gguf else path.is_dir()):
        raise ValueError(f"model must be a Hugging Face folder or a .gguf file, got {args.model!r} "
                         f"({'no such file' if gguf else 'not a folder'})")
    if args.llama_bench is not None:
        if not gguf:
            raise ValueError(f"--llama-bench runs llama.cpp on a GGUF file, but the model is a folder: {args.model}")
        binary = Path(args.llama_bench)
        if not binary.is_file() or not os.access(binary, os.X_OK):
            raise ValueError(f"--llama-bench must be an executable llama-bench binary, got {args.llama_bench!r}")


def load_model(args: argparse.Namespace) -> Any:
    """attnkit's float32 model of ``args.model`` (its quantized weights kept packed with ``--keep-quantized``),
    checked to run the lengths the options ask for.

    Raises
    ------
    ValueError
        The folder or file cannot be loaded (naming it and what is wrong: a corrupt or truncated GGUF file, a
        config attnkit does not read, ...), or ``--prefill`` or the decode runs (``--new`` tokens after the
        16-token prompt) are longer than the model's learned positions.
    """
    from ..pretrained import load_causal_lm

    lm = load_causal_lm(Path(args.model), keep_quantized=getattr(args, "keep_quantized", False))
    limit = lm.max_sequence_length
    if limit is not None and args.prefill > limit:
        raise ValueError(f"--prefill {args.prefill} is longer than the {limit} positions {args.model} has "
                         f"(max_position_embeddings / context length)")
    if limit is not None and PROMPT_TOKENS + args.new > limit:
        raise ValueError(f"--new {args.new} after the {PROMPT_TOKENS}-token prompt is longer than the {limit} "
                         f"positions {args.model} has (max_position_embeddings / context length)")
    return lm


# -- engines ---------------------------------------------------------------------------------------------
def load_transformers(path: Path, torch: Any) -> tuple[Any, str]:
    """``(model, note)``: ``transformers``' float32 model of the folder or GGUF file, or ``(None, why not)``."""
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed (pip install transformers)"
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        if path.suffix.lower() == ".gguf":
            model = _transformers_from_gguf(path, torch, transformers)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    except Exception as exc:  # an architecture or file transformers does not read: the run goes on without it
        return None, f"transformers could not load {path.name}: {str(exc).splitlines()[0][:200]}"
    return model.eval(), "loaded"


def _transformers_from_gguf(path: Path, torch: Any, transformers: Any) -> Any:
    """``transformers``' model of a GGUF file through its own GGUF reader (config and dequantized tensors).

    ``from_pretrained(gguf_file=...)`` would do the same but insists on ``accelerate``; this needs only the
    ``gguf`` package transformers reads with.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, _ = model.load_state_dict(tensors, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing:
        raise ValueError(f"its GGUF reader left {len(missing)} weights unset, e.g. {missing[0]}")
    return model


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _faster_of_two(fn: Callable[[], Any]) -> float:
    """Seconds of the faster of two back-to-back calls of ``fn``."""
    return min(_timed(fn)[0], _timed(fn)[0])


def _attnkit_round(lm: Any, prompts: dict[int, np.ndarray], long: np.ndarray, new: int) -> dict[str, Any]:
    """One round of attnkit's figures: prefill seconds, decode seconds per batch (steps only), tokens."""
    row: dict[str, Any] = {"prefill_s": _faster_of_two(lambda: lm(long, cache=lm.new_cache(1), logits_to_keep=1))}
    for batch, ids in prompts.items():
        one, _ = _timed(lambda ids=ids: lm.generate(ids, max_new_tokens=1, min_new_tokens=1, eos_token_id=[]))
        every, tokens = _timed(lambda ids=ids: lm.generate(ids, max_new_tokens=new, min_new_tokens=new,
                                                           eos_token_id=[]))
        row[f"decode_b{batch}_s"], row[f"tokens_b{batch}"] = max(every - one, 1e-9), tokens[:, PROMPT_TOKENS:]
    return row


def _transformers_round(hf: Any, torch: Any, prompts: dict[int, np.ndarray], long: np.ndarray,
                        new: int) -> dict[str, Any]:
    """One round of ``transformers``' figures, measured as :func:`_attnkit_round` measures attnkit's."""
    def generate(ids: Any, count: int) -> Any:
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, min_new_tokens=count,
                           do_sample=False, pad_token_id=0)

    tlong = torch.from_numpy(long)
    row: dict[str, Any] = {"prefill_s": _faster_of_two(lambda: hf(tlong, use_cache=True, logits_to_keep=1))}
    for batch, ids in prompts.items():
        tids = torch.from_numpy(ids)
        one, _ = _timed(lambda t=tids: generate(t, 1))
        every, tokens = _timed(lambda t=tids: generate(t, new))
        row[f"decode_b{batch}_s"] = max(every - one, 1e-9)
        row[f"tokens_b{batch}"] = tokens.numpy()[:, PROMPT_TOKENS:]
    return row


def llama_bench_command(binary: str | Path, gguf: str | Path, threads: int, prefill: int, new: int) -> list[str]:
    """The ``llama-bench`` command of one round: one repetition (after its own warm-up), JSON output."""
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prefill), "-n", str(new), "-r", "1",
            "-o", "json"]


def parse_llama_bench(text: str) -> dict[str, Any]:
    """``{"prefill_tps", "decode_tps", "build", "cpu", "type"}`` from ``llama-bench -o json``'s output.

    Raises ``ValueError`` when the text holds no prompt and no generation result.
    """
    try:
        records = json.loads(text[text.index("["):])
    except ValueError:
        raise ValueError(f"llama-bench printed no JSON result: {text.strip()[:200]!r}") from None
    figures: dict[str, Any] = {}
    for record in records:
        rate = float(record["avg_ts"])
        if record.get("n_prompt", 0) and not record.get("n_gen", 0):
            figures["prefill_tps"] = rate
        elif record.get("n_gen", 0) and not record.get("n_prompt", 0):
            figures["decode_tps"] = rate
        figures.update(build=record.get("build_commit"), cpu=record.get("cpu_info"), type=record.get("model_type"))
    if "prefill_tps" not in figures and "decode_tps" not in figures:
        raise ValueError(f"llama-bench's JSON holds no prompt or generation result: {text.strip()[:200]!r}")
    return figures


def llama_bench_round(command: list[str]) -> dict[str, Any]:
    """One llama-bench run's figures, or ``{"error": ...}`` (the run goes on without llama.cpp)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_LLAMA_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"llama-bench did not run: {exc}"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        return {"error": f"llama-bench exited with status {done.returncode}: {last[:200]}"}
    try:
        return parse_llama_bench(done.stdout)
    except ValueError as exc:
        return {"error": str(exc)}


# -- the run ---------------------------------------------------------------------------------------------
def _rounds(args: argparse.Namespace, lm: Any, hf: Any, torch: Any) -> list[dict[str, Any]]:
    """Every round's raw figures, the engines alternated within each round."""
    rng = np.random.default_rng(0)
    vocab = lm.config.vocab_size
    prompts = {b: rng.integers(0, vocab, size=(b, PROMPT_TOKENS)) for b in args.batches}  # (B, 16) each
    long = rng.integers(0, vocab, size=(1, args.prefill))  # (1, P)
    per_token = weights_read_per_token(lm)
    command = None if args.llama_bench is None else llama_bench_command(
        args.llama_bench, args.model, args.threads, args.prefill, args.new)
    # Untimed warm-up of both engines. A process's first large allocations are fresh pages from the kernel
    # (first-touch faults), and glibc's malloc only keeps blocks this size on its heap after it has freed some:
    # without this, attnkit's prefill ran 264, 348 and 457 tokens/s in its first three rounds.
    for _ in range(2):
        _attnkit_round(lm, prompts, long, 2)
        if hf is not None:
            with torch.inference_mode():
                _transformers_round(hf, torch, prompts, long, 2)
    rounds = []
    for index in range(args.repeats):
        print(f"# round {index + 1} of {args.repeats}", flush=True)
        row: dict[str, Any] = {"attnkit": _attnkit_round(lm, prompts, long, args.new)}
        steps = row["attnkit"].get("decode_b1_s")
        if steps is not None:
            row["gemv_Bps"] = gemv_bandwidth(seconds=steps)
            row["decode_Bps"] = per_token * (args.new - 1) / steps
        if hf is not None:
            with torch.inference_mode():
                row["transformers"] = _transformers_round(hf, torch, prompts, long, args.new)
        if command is not None:
            row["llama.cpp"] = llama_bench_round(command)
        rounds.append(row)
        print(_round_line(row, args), flush=True)
    return rounds


def _round_line(row: dict[str, Any], args: argparse.Namespace) -> str:
    """One round's tokens/s per engine (``prefill/decode b1/...``), the GEMV bandwidth and the load average."""
    parts = []
    for engine in ("attnkit", "transformers"):
        if engine in row:
            rates = [args.prefill / row[engine]["prefill_s"],
                     *(b * (args.new - 1) / row[engine][f"decode_b{b}_s"] for b in args.batches)]
            parts.append(f"{engine} " + "/".join(f"{r:.1f}" for r in rates))
    llama = row.get("llama.cpp", {})
    if "prefill_tps" in llama or "decode_tps" in llama:
        parts.append(f"llama.cpp {llama.get('prefill_tps', 0):.1f}/{llama.get('decode_tps', 0):.1f}")
    if "gemv_Bps" in row:
        parts.append(f"GEMV {row['gemv_Bps'] / 1e9:.1f} GB/s")
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    return "#   tokens/s (prefill/decode per batch): " + ", ".join(parts) + load


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _rates(rounds: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """tokens/s of every engine and figure, as median, min and max over the rounds."""
    figures: dict[str, dict[str, Any]] = {}
    for engine in ("attnkit", "transformers"):
        rows = [r[engine] for r in rounds if engine in r]
        if not rows:
            continue
        figures[engine] = {"prefill_tps": _spread([args.prefill / r["prefill_s"] for r in rows])}
        for b in args.batches:
            figures[engine][f"decode_b{b}_tps"] = _spread([b * (args.new - 1) / r[f"decode_b{b}_s"] for r in rows])
    llama = [r["llama.cpp"] for r in rounds if "llama.cpp" in r]
    good = [r for r in llama if "error" not in r]
    if good:
        figures["llama.cpp"] = {key: _spread([r[key] for r in good]) for key in ("prefill_tps", "decode_tps")
                                if key in good[0]}
        figures["llama.cpp"]["build"], figures["llama.cpp"]["cpu"] = good[0]["build"], good[0]["cpu"]
        figures["llama.cpp"]["decode_b1_tps"] = figures["llama.cpp"].pop("decode_tps", None)
    if llama and not good:
        figures["llama.cpp"] = {"error": llama[0]["error"]}
    return figures


def _fraction(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The batch-1 decoding steps' share of the GEMV bandwidth measured beside them: the median round's."""
    pairs = sorted((r["decode_Bps"] / r["gemv_Bps"], r["decode_Bps"], r["gemv_Bps"]) for r in rounds
                   if "gemv_Bps" in r)
    if not pairs:
        return None
    fraction, decode, gemv = pairs[len(pairs) // 2]
    return {"fraction": fraction, "decode_GBps": decode / 1e9, "gemv_GBps": gemv / 1e9,
            "fraction_min": pairs[0][0], "fraction_max": pairs[-1][0]}


def _agreement(rounds: list[dict[str, Any]], batches: list[int]) -> dict[str, float]:
    """Share of the greedy tokens where attnkit and ``transformers`` agree, per batch (first round)."""
    first = rounds[0]
    if "transformers" not in first:
        return {}
    return {f"b{b}": float(np.mean(first["attnkit"][f"tokens_b{b}"] == first["transformers"][f"tokens_b{b}"]))
            for b in batches}


def _cell(spread: dict[str, float] | None) -> str:
    if spread is None:
        return "-"
    return f"{spread['median']:.1f} ({spread['min']:.1f}-{spread['max']:.1f})"


def summary(figures: dict[str, Any]) -> list[str]:
    """The Markdown table (tokens/s, median of the rounds and their range) and the ratio lines of a run."""
    prefill, batches = figures["prefill"], figures["batches"]
    engines = [e for e in ("attnkit", "transformers", "llama.cpp") if e in figures and "error" not in figures[e]]
    head = ["engine", f"prefill {prefill}, tok/s", *(f"decode batch {b}, tok/s" for b in batches)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for engine in engines:
        row = figures[engine]
        cells = [engine, _cell(row.get("prefill_tps")), *(_cell(row.get(f"decode_b{b}_tps")) for b in batches)]
        lines.append("| " + " | ".join(cells) + " |")
    ours = figures["attnkit"]
    for other in engines[1:]:
        theirs = figures[other]
        parts = []
        if theirs.get("prefill_tps"):
            parts.append(f"prefill time {theirs['prefill_tps']['median'] / ours['prefill_tps']['median']:.2f}x")
        for b in batches:
            if theirs.get(f"decode_b{b}_tps"):
                speed = ours[f"decode_b{b}_tps"]["median"] / theirs[f"decode_b{b}_tps"]["median"]
                parts.append(f"decode batch {b} speed {speed:.2f}x")
        lines.append(f"attnkit / {other}: " + ", ".join(parts))
    share = figures.get("gemv")
    if share:
        lines.append(f"attnkit batch-1 decoding reads {figures['weights_MiB']:.0f} MiB of weights per token at "
                     f"{share['decode_GBps']:.1f} GB/s: {share['fraction']:.0%} of the GEMV bandwidth sustained "
                     f"beside it ({share['gemv_GBps']:.1f} GB/s; median round, rounds "
                     f"{share['fraction_min']:.0%}-{share['fraction_max']:.0%})")
    for key, value in figures.get("greedy_equal", {}).items():
        lines.append(f"greedy tokens equal, attnkit and transformers, batch {key[1:]}: {value:.0%}")
    return lines


def run(args: argparse.Namespace, lm: Any = None) -> dict[str, Any]:
    """Load the engines (attnkit's with :func:`load_model` unless ``lm`` is that model already), measure the
    rounds, print the machine, the table and the ratios; return the figures."""
    path = Path(args.model)
    for line in describe(machine_info(), threads=args.threads):
        print(line)
    lm = load_model(args) if lm is None else lm
    keep = getattr(args, "keep_quantized", False)
    torch = import_torch()
    hf, note = (None, torch_missing_line("no comparison with transformers")) if torch is None else \
        load_transformers(path, torch)
    if hf is None:
        print(note if note.startswith("#") else f"# {note}")
    print(f"# model: {path} ({lm.config.family}, {lm.config.num_layers} layers, float32"
          f"{', quantized weights kept packed' if keep else ''}); prefill {args.prefill}, "
          f"{args.new} new tokens after a {PROMPT_TOKENS}-token prompt, {args.repeats} rounds", flush=True)
    with engine_threads(torch, args.threads):
        rounds = _rounds(args, lm, hf, torch)
    figures: dict[str, Any] = {"model": str(path), "keep_quantized": keep, "prefill": args.prefill, "new": args.new,
                               "batches": list(args.batches), "threads": args.threads, "repeats": args.repeats,
                               "weights_MiB": weights_read_per_token(lm) / 2**20, **_rates(rounds, args),
                               "gemv": _fraction(rounds), "greedy_equal": _agreement(rounds, args.batches),
                               "load_average_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if "error" in figures.get("llama.cpp", {}):
        print(f"# llama.cpp: {figures['llama.cpp']['error']}")
    elif "llama.cpp" in figures:
        print(f"# llama.cpp build {figures['llama.cpp']['build']}, CPU {figures['llama.cpp']['cpu']}")
    for line in summary(figures):
        print(line)
    return figures


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m attnkit.benchmarks.runtime``."""
    try:
        args = parse_args(argv)
        lm = load_model(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run(args, lm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
