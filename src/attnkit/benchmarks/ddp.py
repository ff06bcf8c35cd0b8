"""Training throughput of ``python -m attnkit.torch.train``: tokens/s with 1 and 2 CPU processes (gloo).

The same global batch, sequence length and steps run three ways: one process on one thread, ``torchrun
--nproc_per_node=2`` with one thread per process, and one process on two threads (what the two cores give
without data parallelism). Throughput is the median of the per-step ``tokens/s`` the trainer logs, the first
``--skip`` steps left out (allocation, first collectives). With CUDA the same command runs on GPUs
(``--cuda``: one process per GPU, NCCL).

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m attnkit.benchmarks.ddp

Needs torch.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ._support import import_torch, torch_missing_line
from .machine import describe

__all__ = ["main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(prefix: list[str], train_args: list[str], threads: int) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    done = subprocess.run([*prefix, "-m", "attnkit.torch.train", *train_args], capture_output=True, text=True,
                          env=env, timeout=3600)
    if done.returncode:
        raise SystemExit(f"trainer failed:\n{done.stderr[-3000:]}")
    return [float(line.split("tokens/s")[1]) for line in done.stdout.splitlines() if line.startswith("step ")]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m attnkit.benchmarks.ddp``; 1 without torch."""
    parser = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.ddp", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    if import_torch() is None:
        print("\n".join(describe(threads="1 per process")))
        print(torch_missing_line("the trainer is PyTorch's"))
        return 1
    config = {"model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
              "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers,
              "num_attention_heads": args.hidden // 64, "num_key_value_heads": max(1, args.hidden // 128),
              "max_position_embeddings": args.seq_len}
    print("\n".join(describe(threads="1 per process")))
    print(f"# llama-style {args.layers} layers, D={args.hidden}, V={args.vocab}, L={args.seq_len}, "
          f"global batch {args.global_batch}, {args.dtype}, median tokens/s of steps {args.skip + 1}..{args.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(config))
        np.save(folder / "tokens.npy", np.random.default_rng(0).integers(0, args.vocab, size=200_000))

        def train_args(out: str) -> list[str]:
            return ["--config", str(folder / "config.json"), "--data", str(folder / "tokens.npy"),
                    "--steps", str(args.steps), "--global-batch", str(args.global_batch), "--seq-len",
                    str(args.seq_len), "--lr", "1e-3", "--dtype", args.dtype, "--out", str(folder / out)]

        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    "--master_addr=127.0.0.1", f"--master_port={_free_port()}"]
        runs = [("1 process, 1 thread", [sys.executable], 1), ("2 processes (gloo), 1 thread each", torchrun, 1),
                ("1 process, 2 threads", [sys.executable], 2)]
        results = {}
        for name, prefix, threads in runs:
            rates = _run(prefix, train_args(name.replace(" ", "_").replace(",", "")), threads)
            results[name] = statistics.median(rates[args.skip:])
        base = results["1 process, 1 thread"]
        print(f"{'run':>36} {'tokens/s':>10} {'vs 1 process':>13}")
        for name, rate in results.items():
            print(f"{name:>36} {rate:>10.0f} {rate / base:>12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
