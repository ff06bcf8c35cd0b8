"""Benchmark: attribution patching against one forward and backward, attnkit and PyTorch in the same run.

:func:`attnkit.explain.attribution_patching` runs one forward of the clean prompt (keeping the activations) and
one forward and backward of the corrupted one (keeping the activations and their gradients). The target (issue
text): at most 3x the time of one forward plus backward of the same prompt. For each prompt length this times,
in float32, batch 1, best of ``--repeats``:

* attnkit: one forward and backward of the metric ``logit[a] - logit[b]`` after the last token (the base), and
  ``attribution_patching`` of the residual stream (``resid_pre``) and of the heads' outputs (``z``), and
  ``edge_attribution`` (EAP, every edge of the graph: two caches and one backward of H + 3 copies of the batch);
  the ratios to the base;
* transformers (when torch is installed): the same base with autograd (the parameters' gradients included, as
  attnkit's backward computes them), and attribution patching of the residual stream done the usual torch way
  (``output_hidden_states`` of the clean run under ``no_grad``, then ``torch.autograd.grad`` of the metric
  with respect to the corrupted run's hidden states); its ratio, and attnkit's time over torch's.

The model is a random Llama of SmolLM-135M's shape (30 layers, 9 query and 3 key/value heads, width 576), built
by attnkit (``--layers`` makes it shallower); the transformers model has the same configuration.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m attnkit.benchmarks.patching --threads 2
    python -m attnkit.benchmarks.patching --lengths 16 --layers 4 --repeats 1   # quick
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from ..kernels._threads import num_threads, thread_count_argument
from ._support import blas_limit, import_torch, torch_missing_line
from .machine import describe, machine_info

__all__ = ["main", "parse_args", "run", "SHAPE"]

# SmolLM-135M's shape (the decode benchmark's rotary shape)
SHAPE = {"vocab_size": 49152, "hidden_size": 576, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3,
         "head_dim": 64, "intermediate_size": 1536}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.patching", description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256], help="prompt lengths (default 16 64 256)")
    p.add_argument("--layers", type=int, default=SHAPE["num_layers"], help="layers (default 30)")
    p.add_argument("--threads", type=thread_count_argument, default=2,
                   help="BLAS, attnkit and torch threads (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure, best kept (default 3)")
    args = p.parse_args(argv)
    if min(args.lengths) < 2 or args.layers < 1 or args.repeats < 1 or args.threads < 1:
        p.error("--lengths must be at least 2, --layers, --repeats and --threads at least 1")
    return args


def _best(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch pages, BLAS buffers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _attnkit_model(layers: int):
    from ..models import CausalLM, DecoderConfig, MLPConfig

    sizes = {k: v for k, v in SHAPE.items() if k != "intermediate_size"}
    cfg = DecoderConfig(family="llama", **{**sizes, "num_layers": layers}, mlp=MLPConfig(SHAPE["intermediate_size"]),
                        max_position_embeddings=2048)
    return CausalLM(cfg, rng=0).astype(np.float32)  # as transformers' model: float32 both


def _attnkit_times(lm, clean: np.ndarray, corrupt: np.ndarray, answers: tuple[int, int],
                   repeats: int) -> dict[str, float]:
    from ..explain import attribution_patching, edge_attribution

    def forward_backward():
        logits = lm(corrupt[None])  # (1, L, V)
        grad = np.zeros_like(logits)
        grad[0, -1, answers[0]], grad[0, -1, answers[1]] = 1.0, -1.0
        lm.backward(grad)
        lm.zero_grad()

    return {"base": _best(forward_backward, repeats),
            "resid_pre": _best(lambda: attribution_patching(lm, clean, corrupt, answers, "resid_pre"), repeats),
            "z": _best(lambda: attribution_patching(lm, clean, corrupt, answers, "z"), repeats),
            "eap": _best(lambda: edge_attribution(lm, clean, corrupt, answers), repeats)}


def _torch_times(torch: Any, layers: int, clean: np.ndarray, corrupt: np.ndarray, answers: tuple[int, int],
                 repeats: int) -> dict[str, float]:
    import transformers

    config = transformers.LlamaConfig(vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["hidden_size"],
                                      intermediate_size=SHAPE["intermediate_size"], num_hidden_layers=layers,
                                      num_attention_heads=SHAPE["num_heads"], num_key_value_heads=SHAPE["num_kv_heads"],
                                      head_dim=SHAPE["head_dim"], max_position_embeddings=2048,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    clean_t, corrupt_t = torch.from_numpy(clean[None]), torch.from_numpy(corrupt[None])

    def metric(logits):
        return logits[0, -1, answers[0]] - logits[0, -1, answers[1]]

    def forward_backward():
        metric(hf(corrupt_t).logits).backward()
        hf.zero_grad(set_to_none=True)

    def attribution_patching():
        with torch.no_grad():
            clean_states = hf(clean_t, output_hidden_states=True).hidden_states[:layers]
        out = hf(corrupt_t, output_hidden_states=True)
        states = out.hidden_states[:layers]  # resid_pre of each layer
        grads = torch.autograd.grad(metric(out.logits), states)
        return torch.stack([((c - s) * g).sum(-1)[0] for c, s, g in zip(clean_states, states, grads)])

    return {"base": _best(forward_backward, repeats), "resid_pre": _best(attribution_patching, repeats)}


def run(args: argparse.Namespace) -> list[dict]:
    """Time every length and print the table; returns the rows."""
    torch = import_torch()
    for line in describe(machine_info(), threads=args.threads):
        print(line)
    if torch is None:
        print(torch_missing_line("attnkit's figures only"))
    else:
        torch.set_num_threads(args.threads)
    lm = _attnkit_model(args.layers)
    rng = np.random.default_rng(0)
    print(f"llama, SmolLM-135M's shape, {args.layers} layers, float32, batch 1; seconds (best of {args.repeats}) "
          f"and ratios to one forward + backward")
    print(f"{'L':>5} {'fwd+bwd':>9} {'AP resid':>9} {'ratio':>6} {'AP z':>9} {'ratio':>6} {'EAP':>9} {'ratio':>6} | "
          f"{'torch f+b':>9} "
          f"{'torch AP':>9} {'ratio':>6} {'attnkit/torch AP':>17}")
    rows = []
    for length in args.lengths:
        clean = rng.integers(0, SHAPE["vocab_size"], length)
        corrupt = clean.copy()
        corrupt[length // 2] = (corrupt[length // 2] + 1) % SHAPE["vocab_size"]
        answers = (11, 29)
        with blas_limit(args.threads), num_threads(args.threads):
            ours = _attnkit_times(lm, clean, corrupt, answers, args.repeats)
            theirs = None if torch is None else _torch_times(torch, args.layers, clean, corrupt, answers,
                                                              args.repeats)
        row = {"length": length, "attnkit": ours, "torch": theirs}
        rows.append(row)
        line = (f"{length:>5} {ours['base']:>9.4f} {ours['resid_pre']:>9.4f} {ours['resid_pre'] / ours['base']:>5.2f}x "
                f"{ours['z']:>9.4f} {ours['z'] / ours['base']:>5.2f}x {ours['eap']:>9.4f} "
                f"{ours['eap'] / ours['base']:>5.2f}x |")
        if theirs is not None:
            line += (f" {theirs['base']:>9.4f} {theirs['resid_pre']:>9.4f} "
                     f"{theirs['resid_pre'] / theirs['base']:>5.2f}x {ours['resid_pre'] / theirs['resid_pre']:>16.2f}x")
        print(line)
    print("target: attribution patching at most 3x one forward + backward")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m attnkit.benchmarks.patching``."""
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
