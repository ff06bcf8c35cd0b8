"""Benchmark: all-MiniLM-L6-v2 sentence embeddings, attnkit (NumPy) vs sentence-transformers (torch CPU).

Embeds the same sentences with both in one process, in batches of the same size, with the same number of
threads (torch intra-op threads, NumPy's BLAS threads and attnkit's own threads), alternating the two so
that a change in machine load hits both alike. Prints the median and best time of each and the ratio
attnkit / torch (target: at most 1.2), and the largest difference between the two sets of embeddings.

Usage::

    python -m attnkit.benchmarks.minilm                    # 256 sentences, batches of 32, every core
    python -m attnkit.benchmarks.minilm --threads 1 --repeats 5
    python -m attnkit.benchmarks.minilm --profile          # + where attnkit's time goes (cProfile)

(also ``benchmarks/bench_minilm.py`` in a checkout). Needs the ``pretrained`` extra, torch and
sentence-transformers; without torch it says so in one line and exits with status 1.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import sys
import time
from contextlib import contextmanager

import numpy as np

from ..kernels._threads import thread_count_argument
from ._support import blas_limit, import_torch, torch_missing_line
from .machine import describe, machine_info, usable_cores

__all__ = ["parse_args", "make_sentences", "run", "main"]

WORDS = ("the a of and to in is was for on that with as by at from it this be are an which or have has not "
         "attention model token layer head weight query key value matrix softmax gradient network language "
         "sentence word vector embedding training data learning neural transformer encoder decoder memory "
         "city river mountain music history science garden kitchen morning evening friend teacher student "
         "quickly slowly carefully often never always really simply because although while after before "
         "run walk read write build carry open close think believe remember forget explain describe compute "
         "Köln café naïve déjà 東京 données").split()


def parse_args(argv=None) -> argparse.Namespace:
    """The benchmark's options (``--help`` lists them)."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.minilm", description=__doc__.split("\n\n")[0])
    p.add_argument("--sentences", type=int, default=256, help="number of sentences (default 256)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per batch (default 32)")
    p.add_argument("--threads", type=thread_count_argument, default=usable_cores(),
                   help="threads for both (default: every usable core, %(default)s here)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each (default 3)")
    p.add_argument("--profile", action="store_true", help="print attnkit's cProfile top functions")
    return p.parse_args(argv)


def make_sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` deterministic sentences of 3 to 60 words (about 5 to 80 tokens).

    Examples
    --------
    >>> len(make_sentences(3)), make_sentences(2) == make_sentences(2)
    (3, True)
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 61, size=n)  # (n,)
    return [" ".join(rng.choice(WORDS, size=k)).capitalize() + "." for k in lengths]


@contextmanager
def _threads(torch, n: int):
    """torch, NumPy's BLAS and attnkit's own pools all at ``n`` threads."""
    from ..kernels._threads import num_threads

    old_torch = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with blas_limit(n), num_threads(n):
            yield
    finally:
        torch.set_num_threads(old_torch)


def _time_both(run_attnkit, run_torch, repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"attnkit": [], "torch": []}
    for _ in range(repeats):  # interleaved
        for name, fn in (("attnkit", run_attnkit), ("torch", run_torch)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _print_times(times: dict[str, list[float]], n: int) -> dict[str, float]:
    for name, ts in times.items():
        print(f"  {name:8s} median {statistics.median(ts):7.3f} s   best {min(ts):7.3f} s   "
              f"({n / statistics.median(ts):7.1f} sentences/s)")
    ratio_median = statistics.median(times["attnkit"]) / statistics.median(times["torch"])
    ratio_best = min(times["attnkit"]) / min(times["torch"])
    print(f"  ratio attnkit / torch: {ratio_median:.2f}x (median), {ratio_best:.2f}x (best); target <= 1.2x")
    return {"median": ratio_median, "best": ratio_best}


def _measure(args, torch, sentences: list[str]) -> dict:
    from sentence_transformers import SentenceTransformer

    from ..pretrained import load_minilm

    encoder = load_minilm()
    reference = SentenceTransformer(str(encoder.model_dir), device="cpu").eval()

    def run_attnkit():
        return encoder.encode(sentences, batch_size=args.batch_size)

    def run_torch():
        with torch.inference_mode():
            return reference.encode(sentences, batch_size=args.batch_size, convert_to_numpy=True)

    ours, theirs = run_attnkit(), run_torch()  # warm-up, and the agreement check
    times = _time_both(run_attnkit, run_torch, args.repeats)
    tokens = int(encoder.tokenize(sentences).lengths.sum())
    print(f"# all-MiniLM-L6-v2, {len(sentences)} sentences ({tokens} tokens), batches of {args.batch_size}, "
          f"{args.threads} thread(s), {args.repeats} runs each")
    ratios = _print_times(times, len(sentences))
    print(f"  max |attnkit - torch| over the embeddings: {np.abs(ours - theirs).max():.2e}")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(run_attnkit)
        print("\nattnkit encode, top functions by own time:")
        import pstats

        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(12)
    return {"times": times, "ratio": ratios, "tokens": tokens}


def run(args: argparse.Namespace) -> dict | None:
    """Run the benchmark described by ``args``; print it and return the report (None without torch)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference model is read from the installed package
    info = machine_info()
    for line in describe(info, threads=args.threads):
        print(line)
    torch = import_torch()
    if torch is None:
        print(torch_missing_line("the MiniLM benchmark times attnkit against sentence-transformers and cannot run"))
        return None
    with _threads(torch, args.threads):
        result = _measure(args, torch, make_sentences(args.sentences))
    return {"machine": info, "args": vars(args), **result}


def main(argv=None) -> int:
    """``python -m attnkit.benchmarks.minilm [options]``; 1 when torch is missing."""
    return 0 if run(parse_args(argv)) is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
