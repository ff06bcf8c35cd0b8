"""Two source trees of attnkit side by side: ``attnkit bench decode`` and the attention benchmark, alternating.

A change that is meant to leave the numbers alone (a redesign) is checked here for speed: each case runs in a
fresh process on one tree, then the other, round after round, so a shared machine's drift falls on both. Each
tree's figures are the median over the rounds; decoding and prefill are also shown against transformers in
the same process, which cancels most of the machine's drift.

Usage (the tree before the change checked out with ``git worktree add /tmp/before <commit>``)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/compare_trees.py /tmp/before . --rounds 3

Needs torch, transformers and safetensors (the decode benchmark's needs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

DECODE = """
import json, contextlib, io
from attnkit.benchmarks import decode
args = decode.parse_args(["--families", {family!r}, "--new", "16", "--batches", "1", "--prefill", "256",
                          "--repeats", "2", "--threads", "2"])
with contextlib.redirect_stdout(io.StringIO()):
    figures = decode.run(args)
print(json.dumps(figures[{family!r}]))
"""

ATTENTION = """
import json, contextlib, io, tempfile, pathlib
from attnkit.benchmarks import attention
out = pathlib.Path(tempfile.mkdtemp()) / "a.json"
args = attention.parse_args(["--sizes", "1024", "2048", "--threads", "2", "--repeats", "3", "--impls", "tiled",
                             "torch", "--no-memory", "--json", str(out)])
with contextlib.redirect_stdout(io.StringIO()):
    attention.run(args)
rows = json.loads(out.read_text())["results"]
print(json.dumps({f"{r['mode']} L{r['L']} causal={r['causal']}": r["time_ms"] for r in rows
                  if r["impl"] == "tiled" and "time_ms" in r}))
"""


def _run(tree: Path, code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _families(tree: Path) -> list[str]:
    code = "from attnkit.pretrained.families import REGISTRY; print(__import__('json').dumps(list(REGISTRY)))"
    return _run(tree, code)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("before", type=Path, help="the source tree before the change (holding src/attnkit)")
    p.add_argument("after", type=Path, help="the source tree after it")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--families", nargs="+", help="default: every family both trees load")
    args = p.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    families = args.families or [f for f in _families(trees["before"]) if f in _families(trees["after"])]
    print(f"before: {trees['before']}\nafter:  {trees['after']}\nrounds: {args.rounds}, threads 2, "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}")
    print("\n| family | decode b1 tok/s before -> after | b1 vs transformers before -> after | "
          "prefill 256 ms before -> after | prefill vs transformers before -> after |\n|---|---|---|---|---|")
    for family in families:
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(_run(tree, DECODE.format(family=family)))

        cells = []
        for key, fmt in ((lambda r: r["decode_b1_attnkit"], "{:.1f}"),
                         (lambda r: r["decode_b1_attnkit"] / r["decode_b1_hf"], "{:.2f}x"),
                         (lambda r: r["prefill_attnkit_s"] * 1e3, "{:.0f}"),
                         (lambda r: r["prefill_attnkit_s"] / r["prefill_hf_s"], "{:.2f}x")):
            before, after = (statistics.median(key(r) for r in runs[name]) for name in ("before", "after"))
            cells.append(f"{fmt.format(before)} -> {fmt.format(after)}")
        print(f"| {family} | " + " | ".join(cells) + " |", flush=True)
    times: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            times[name].append(_run(tree, ATTENTION))
    print("\n| attention (tiled, B 1, H 8, D 64), ms | before | after | after / before |\n|---|---|---|---|")
    for case in times["before"][0]:
        before = statistics.median(t[case] for t in times["before"])
        after = statistics.median(t[case] for t in times["after"])
        print(f"| {case} | {before:.1f} | {after:.1f} | {after / before:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
