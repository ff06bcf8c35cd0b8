"""Benchmark: decoding and prefill of real model shapes, attnkit vs Hugging Face ``transformers`` (torch CPU).

For each family (``gpt2``: GPT-2 small's shape, 124M parameters; every other family: SmolLM-135M's shape, 30
layers, GQA, with the family's own parts: q/k norms, post-norms, soft-caps, sinks, experts...), a random
``transformers`` model is saved with ``save_pretrained`` and loaded by attnkit's own loader, so
both run the same float32 weights. Measured in one run, alternating the two:

* decode tokens/s: a 16-token prompt, ``--new`` greedy tokens, batch 1 and 8 (``generate`` on both sides, the
  greedy tokens compared);
* prefill: one forward of ``--prefill`` tokens, batch 1, into a cache;
* the machine's GEMV bandwidth: the best of ``y = W @ x`` on a float32 matrix larger than the last-level
  cache, and the fraction of it that batch-1 decoding reaches: the weights a token reads times the decoding
  steps' rate (a run of ``--new`` tokens less a run of one, so the prompt's forward is not counted as
  decoding), against the GEMV bandwidth sustained for as long as those steps took, right after them (on a
  shared machine a single product's bandwidth moves by a third within minutes; side by side and over the
  same length of time, both figures see the same conditions); the median of at least three such pairs.

Targets (issue text): prefill at most 0.8x ``transformers``' time; decode at least 1.5x its speed at batch 1 and
1.2x at batch 8; batch-1 decoding at least 75% of the GEMV bandwidth.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m attnkit.benchmarks.decode --threads 2
    python -m attnkit.benchmarks.decode --families llama --new 16 --prefill 256   # quicker

Needs torch, transformers and safetensors.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..kernels._threads import thread_count_argument
from ..pretrained.families import REGISTRY
from ._support import engine_threads, import_torch, torch_missing_line
from .machine import describe, machine_info

__all__ = ["main", "parse_args", "run", "summary", "gemv_bandwidth", "weights_read_per_token", "FAMILIES"]

# transformers config class and keyword arguments of each family's benchmark shape, from the families'
# registry: every rotary family at one shape (SmolLM-135M's), so the ratios compare what each family adds
# rather than model sizes; GPT-2 keeps GPT-2 small's own shape.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {name: (entry.hf_config_class, dict(entry.benchmark))
                                                   for name, entry in REGISTRY.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.decode", description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    p.add_argument("--threads", type=thread_count_argument, default=2,
                   help="torch, BLAS and attnkit threads (default 2)")
    p.add_argument("--new", type=_at_least_two, default=32, help="greedy tokens per decode run (default 32)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prefill", type=int, default=1024, help="prefill length (default 1024)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per measurement, best kept (default 2)")
    return p.parse_args(argv)


def _at_least_two(text: str) -> int:
    # one token is the prompt's forward alone: the decoding steps' rate needs a second
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {value}")
    return value


def gemv_bandwidth(megabytes: int = 256, repeats: int = 10, *, seconds: float | None = None) -> float:
    """Bytes per second NumPy's float32 matrix-vector product streams from memory: the best of ``repeats``
    products, or with ``seconds``, the average over back-to-back products for that long (comparable with a
    run of that length; a single product can catch a moment when the machine's other tenants are quiet)."""
    rows = megabytes * 2**20 // (4 * 4096)
    w = np.full((rows, 4096), 0.5, dtype=np.float32)  # (R, 4096): the values do not change the traffic
    x = np.ones(4096, np.float32)
    w @ x  # warm the pages
    if seconds is None:
        return w.nbytes / min(_timed(lambda: w @ x) for _ in range(repeats))
    count, start = 0, time.perf_counter()
    while count == 0 or time.perf_counter() - start < seconds:
        w @ x
        count += 1
    return count * w.nbytes / (time.perf_counter() - start)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _best(fn, repeats: int):
    times, first = [], None
    for i in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        first = result if i == 0 else first
    return min(times), first


def _decoding_fraction(lm: Any, ids: np.ndarray, new: int, repeats: int,
                       per_token: int) -> tuple[float, float, float]:
    """``(fraction, decoding bytes per second, GEMV bytes per second)`` of the median of at least three pairs
    of measurements: the decoding steps alone (a ``new``-token run less a one-token run, each step reading
    ``per_token`` bytes of weights) and, right after them, the GEMV bandwidth sustained for as long as those
    steps took. Each fraction compares figures taken side by side; the median pair is the one reported."""
    pairs = []
    for _ in range(max(repeats, 3)):
        one = _timed(lambda: lm.generate(ids, max_new_tokens=1, min_new_tokens=1, eos_token_id=[]))
        every = _timed(lambda: lm.generate(ids, max_new_tokens=new, min_new_tokens=new, eos_token_id=[]))
        steps = max(every - one, 1e-9)
        rate, bandwidth = per_token * (new - 1) / steps, gemv_bandwidth(seconds=steps)
        pairs.append((rate / bandwidth, rate, bandwidth))
    return sorted(pairs)[len(pairs) // 2]


def weights_read_per_token(lm: Any) -> int:
    """Bytes of weights one decoded token reads: every matrix, but only one row of an input-only table."""
    total = sum(p.nbytes for p in lm.parameters())
    if not lm.config.tie_word_embeddings:
        total -= lm.embed.weight.nbytes  # the head is separate: the table gives one row
    if lm.config.rotary is None:
        total -= lm.pos_embed.weight.nbytes
    experts = lm.config.experts
    if experts is not None:  # a token reads only its k experts of E
        unused = 1 - experts.num_experts_per_tok / experts.num_experts
        for i in experts.layers:
            total -= int(unused * sum(p.nbytes for p in lm.layers[i].mlp._parameters.values()))
    return total


def _build(family: str, folder: Path, torch: Any):
    import transformers

    from ..pretrained import load_causal_lm

    # the benchmark's output is its table: no progress bars or config notices from transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    config_class, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    hf_config = getattr(transformers, config_class)(**kwargs)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    hf.save_pretrained(folder)
    return load_causal_lm(folder), hf


def _family(family: str, args: argparse.Namespace, torch: Any) -> dict[str, float]:
    """One family's rows of the table (printed) and figures (returned)."""
    with tempfile.TemporaryDirectory() as tmp:
        ours, hf = _build(family, Path(tmp), torch)
    rng = np.random.default_rng(0)
    vocab = ours.config.vocab_size
    row: dict[str, float] = {}
    for batch in args.batches:
        ids = rng.integers(0, vocab, size=(batch, 16))  # (B, 16)
        tids = torch.from_numpy(ids)
        t_ours, mine = _best(lambda ids=ids: ours.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new,
                                                           eos_token_id=[]), args.repeats)
        t_hf, theirs = _best(lambda t=tids: hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=args.new,
                                                        min_new_tokens=args.new, do_sample=False, pad_token_id=0),
                             args.repeats)
        same = float(np.mean(mine[:, 16:] == theirs.numpy()[:, 16:]))
        tokens = batch * args.new
        row[f"decode_b{batch}_attnkit"], row[f"decode_b{batch}_hf"] = tokens / t_ours, tokens / t_hf
        print(f"{family} decode batch {batch}: attnkit {tokens / t_ours:7.1f} tok/s, transformers "
              f"{tokens / t_hf:7.1f} tok/s, speed ratio {t_hf / t_ours:.2f}x (greedy tokens equal: {same:.0%})")
        if batch == 1:
            per_token = weights_read_per_token(ours)
            row["gemv_fraction"], rate, beside = _decoding_fraction(ours, ids, args.new, args.repeats, per_token)
            print(f"{family} batch-1 decoding steps read {per_token / 2**20:.0f} MiB of weights "
                  f"per token at {rate / 1e9:.1f} GB/s: {row['gemv_fraction']:.0%} of the GEMV bandwidth sustained "
                  f"beside them ({beside / 1e9:.1f} GB/s; median of the pairs)")
    ids = rng.integers(0, vocab, size=(1, args.prefill))  # (1, P)
    tids = torch.from_numpy(ids)
    t_ours, _ = _best(lambda: ours(ids, cache=ours.new_cache(1, max_length=args.prefill)), args.repeats)
    t_hf, _ = _best(lambda: hf(tids, use_cache=True), args.repeats)
    row["prefill_attnkit_s"], row["prefill_hf_s"] = t_ours, t_hf
    print(f"{family} prefill {args.prefill}: attnkit {t_ours * 1e3:.0f} ms, transformers {t_hf * 1e3:.0f} ms, "
          f"time ratio {t_ours / t_hf:.2f}x")
    return row


def run(args: argparse.Namespace) -> dict:
    """Measure every family; prints the table and returns the figures."""
    torch = import_torch()
    if torch is None:
        print(torch_missing_line("no comparison with transformers"))
        return {}
    for line in describe(machine_info(), threads=args.threads):
        print(line)
    with engine_threads(torch, args.threads), torch.inference_mode():
        print(f"GEMV bandwidth (float32, 256 MiB matrix): {gemv_bandwidth() / 1e9:.1f} GB/s")
        figures = {family: _family(family, args, torch) for family in args.families}
    for line in summary(figures):
        print(line)
    return figures


def summary(figures: dict[str, dict[str, float]]) -> list[str]:
    """A Markdown table of the ratios per family: decode speed (attnkit / transformers, higher is better),
    prefill time (attnkit / transformers, lower is better) and the GEMV bandwidth fraction."""
    batches = sorted({int(k[8:-8]) for row in figures.values() for k in row if k.endswith("_attnkit")
                      and k.startswith("decode_b")})
    head = ["family", *(f"decode b{b} speed" for b in batches), "prefill time", "batch-1 GEMV fraction"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family, row in figures.items():
        cells = [family, *(f"{row[f'decode_b{b}_attnkit'] / row[f'decode_b{b}_hf']:.2f}x" for b in batches),
                 f"{row['prefill_attnkit_s'] / row['prefill_hf_s']:.2f}x", f"{row.get('gemv_fraction', 0):.0%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m attnkit.benchmarks.decode``."""
    return 0 if run(parse_args(argv)) else 1


if __name__ == "__main__":
    sys.exit(main())
