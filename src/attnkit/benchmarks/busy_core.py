"""Benchmark: a small decoder's greedy generation and 2-beam search, on an idle machine and beside a busy core.

On a machine whose cores are taken by other processes, threads that wait for each other wait for a
descheduled thread. This benchmark shows how much that costs: every case runs in a fresh process (``python -c``
with the attnkit of each ``--tree`` first on the path, so an older source tree can be compared with this one),
loads the model, runs one short warm-up and times ``generate`` (greedy, and ``num_beams=2``) with the default
threads and with ``--threads 1`` (attnkit's threads and BLAS's, as the command line sets them), first alone and
then while a ``python -c "while True: pass"`` process holds a core. Rounds alternate every case; the table keeps
each case's best time and the ratio of the default to one thread.

Usage::

    python -m attnkit.benchmarks.busy_core MODEL_DIR
    python -m attnkit.benchmarks.busy_core MODEL_DIR --tree before=/tmp/old/src --tree after=src --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .machine import describe, machine_info

__all__ = ["main", "parse_args", "run"]

# One timed case, in a fresh process: only the public API, so that an older attnkit runs it too.
_CASE = """
import json, sys, time
import numpy as np
from attnkit.pretrained import load_causal_lm
model, threads, task, new, prompt = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
if threads != "default":
    import attnkit
    from threadpoolctl import threadpool_limits
    attnkit.set_num_threads(int(threads))
    threadpool_limits(limits=int(threads), user_api="blas")
lm = load_causal_lm(model)
ids = (np.arange(prompt) % (lm.config.vocab_size - 1) + 1)[None]  # (1, prompt)
extra = {"num_beams": 2} if task == "beam" else {}
lm.generate(ids, max_new_tokens=2, do_sample=False, **extra)
start = time.perf_counter()
lm.generate(ids, max_new_tokens=new, do_sample=False, **extra)
print(json.dumps(time.perf_counter() - start))
"""
_SPIN = "while True: pass"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.busy_core", description=__doc__.split("\n")[0])
    p.add_argument("model", help="a Hugging Face causal-LM folder (or a GGUF file)")
    p.add_argument("--tree", action="append", default=None, metavar="NAME=SRC",
                   help="an attnkit source tree to time (repeatable; default: this one)")
    p.add_argument("--tasks", nargs="+", choices=("greedy", "beam"), default=["greedy", "beam"])
    p.add_argument("--threads", nargs="+", choices=("default", "1"), default=["default", "1"])
    p.add_argument("--loads", nargs="+", choices=("idle", "busy"), default=["idle", "busy"])
    p.add_argument("--new", type=int, default=16, help="new tokens per timed generate (default 16)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over every case, best kept (default 3)")
    return p.parse_args(argv)


def _trees(args: argparse.Namespace) -> dict[str, str]:
    if not args.tree:
        return {"this": str(Path(__file__).resolve().parents[2])}
    trees = dict(item.split("=", 1) for item in args.tree)
    return {name: str(Path(src).resolve()) for name, src in trees.items()}


def _time_case(src: str, args: argparse.Namespace, threads: str, task: str) -> float:
    env = dict(os.environ, PYTHONPATH=src)
    proc = subprocess.run([sys.executable, "-c", _CASE, args.model, threads, task, str(args.new), str(args.prompt)],
                          capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"the case {task} at threads {threads} failed:\n{proc.stderr[-2000:]}")
    return float(json.loads(proc.stdout.splitlines()[-1]))


def _round(trees: dict[str, str], args: argparse.Namespace, best: dict[tuple, float]) -> None:
    """Every case once, the busy ones beside a spinning process."""
    for load in args.loads:
        spinner = subprocess.Popen([sys.executable, "-c", _SPIN]) if load == "busy" else None
        try:
            for name, src in trees.items():
                for task in args.tasks:
                    for threads in args.threads:
                        key = (load, task, name, threads)
                        best[key] = min(best.get(key, float("inf")), _time_case(src, args, threads, task))
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every case ``args.rounds`` times, print the table and return the best times by case."""
    for line in describe(machine_info(), threads=None):
        print(line)
    trees = _trees(args)
    best: dict[tuple, float] = {}
    for _ in range(args.rounds):
        _round(trees, args, best)
    print(f"\n{'load':<5} {'task':<7} {'tree':<8} " + " ".join(f"{'threads ' + t:>15}" for t in args.threads)
          + ("  default / 1" if len(args.threads) == 2 else ""))
    for load in args.loads:
        for task in args.tasks:
            for name in trees:
                times = [best[(load, task, name, t)] for t in args.threads]
                ratio = f"  {times[0] / times[1]:11.2f}x" if len(times) == 2 else ""
                print(f"{load:<5} {task:<7} {name:<8} " + " ".join(f"{t:>13.2f} s" for t in times) + ratio)
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return {"|".join(key): seconds for key, seconds in best.items()}


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
