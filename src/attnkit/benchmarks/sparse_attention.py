"""Benchmark: DeepSeek Sparse Attention (top-k keys per query) against dense latent attention, and the same in
PyTorch.

Three pairs of lines, each timed in the same run with the engines alternating (best of ``--repeats``):

- the attention kernel alone (:func:`attnkit.flex.flex_attention`, tiled): causal against causal and the top-k
  selection as a boolean mask, which the kernel reads tile by tile, skipping the tiles no query chose a key in;
- the whole layer (:class:`~attnkit.attention.latent.MultiHeadLatentAttention`, the training form): dense against
  sparse, the sparse one including its lightning indexer (every query against every key, few narrow heads) and
  the top-k choice;
- the whole layer's inference form (absorbed, as in cached decoding and prefill): dense against sparse, which
  gathers each query's chosen latents and scores only those; and one decoding step after L - 1 cached tokens;
- PyTorch's ``scaled_dot_product_attention``: causal against the same selection as a boolean mask (what
  ``transformers``' DeepSeek-V3.2 does on CPU).

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m attnkit.benchmarks.sparse_attention
    python benchmarks/bench_sparse_attention.py --length 2048 --top-k 256
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from ..attention.latent import LatentAttentionConfig, MultiHeadLatentAttention
from ..decoding.cache import LatentCache
from ..flex import (
    and_masks,
    boolean_mask,
    causal_lower_right,
    create_block_mask,
    flex_attention,
    flex_attention_backward,
)
from ..kernels._threads import thread_count_argument
from ..kernels.rotary import rotary_cos_sin, rotary_frequencies
from ._support import engine_threads, import_torch, torch_missing_line
from .machine import describe

__all__ = ["main", "parse_args", "run"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.sparse_attention",
                                description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=2048, help="sequence length L (default 2048)")
    p.add_argument("--top-k", type=int, default=256, help="keys each query keeps (default 256)")
    p.add_argument("--hidden", type=int, default=576, help="model width D (default 576)")
    p.add_argument("--heads", type=int, default=9, help="attention heads H (default 9)")
    p.add_argument("--index-heads", type=int, default=4, help="indexer heads (default 4)")
    p.add_argument("--index-dim", type=int, default=32, help="indexer head width (default 32)")
    p.add_argument("--threads", type=thread_count_argument, default=2)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def _config(args, top_k: int | None) -> LatentAttentionConfig:
    """DeepSeek-V3's family benchmark shape (attnkit.pretrained.families.deepseek_v3), with or without an indexer."""
    indexer = {} if top_k is None else dict(index_topk=top_k, index_n_heads=args.index_heads,
                                            index_head_dim=args.index_dim)
    return LatentAttentionConfig(hidden_size=args.hidden, num_heads=args.heads, q_lora_rank=192, kv_lora_rank=128,
                                 qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64, **indexer)


def alternating_best_ms(calls: dict[str, Any], repeats: int) -> dict[str, float]:
    """Each call's best of ``repeats`` timings in milliseconds, the calls alternating (one warm-up each first),
    so that a busy machine's slow spells fall on every engine alike."""
    for fn in calls.values():
        fn()
    best = {name: float("inf") for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], 1e3 * (time.perf_counter() - start))
    return best


def _layer_calls(args, x, rotary, grad) -> tuple[dict[str, Any], np.ndarray]:
    """The dense and sparse layers' forward and forward + backward; and the selection (B, L, L) they make."""
    sparse = MultiHeadLatentAttention(_config(args, args.top_k), rng=0)
    dense = MultiHeadLatentAttention(_config(args, None), rng=0)
    for name in dense._parameters:
        dense._parameters[name] = sparse._parameters[name]

    def step(layer, mode):
        def call():
            layer(x, rotary=rotary, form="absorbed" if mode == "absorbed fwd" else "explicit")
            if mode == "fwd+bwd":
                layer.backward(grad)
        return call
    _, weights = sparse(x[:, :], rotary=rotary, output_attentions=True)
    selection = weights[:, 0] > 0  # (B, L, L): the keys the indexer chose
    calls = {f"{kind} {mode}": step(layer, mode) for kind, layer in (("dense", dense), ("sparse", sparse))
             for mode in ("fwd", "fwd+bwd", "absorbed fwd")}
    calls.update({f"{kind} decode step": _decode_step(layer, x, rotary) for kind, layer in (("dense", dense),
                                                                                           ("sparse", sparse))})
    return calls, selection


def _decode_step(layer, x, rotary):
    """One cached token after the first L - 1 (then the cache is cropped back, ready for the next call)."""
    length = x.shape[1]
    cache = LatentCache(1, 1, layer.config.cache_dim, np.float32, max_length=length)
    layer(x[:, :-1], rotary=tuple(t[:, :-1] for t in rotary), cache=cache)
    last = tuple(t[:, -1:] for t in rotary)

    def call():
        layer(x[:, -1:], rotary=last, cache=cache)
        cache.crop(length - 1)
    return call


def _kernel_calls(q, k, v, grad, selection) -> tuple[dict[str, Any], float]:
    """flex_attention causal and with the selection as a mask; and the share of causal tiles the mask skips."""
    b, _, length, _ = q.shape
    causal = create_block_mask(causal_lower_right(length, length), None, None, length, length)
    chosen = create_block_mask(and_masks(causal_lower_right(length, length), boolean_mask(selection[:, None])), b,
                               None, length, length)

    def step(mask, backward):
        def call():
            out, ctx = flex_attention(q, k, v, block_mask=mask, kernel="tiled")
            if backward:
                flex_attention_backward(grad, ctx)
        return call
    kinds = create_block_mask(boolean_mask(selection[:, None]), b, None, length, length).kinds
    lower = np.tril(np.ones(kinds.shape[-2:], bool))  # the causal tiles
    skipped = float((kinds[..., lower] == 0).mean())
    return {f"{kind} {mode}": step(mask, mode == "fwd+bwd") for kind, mask in (("dense", causal), ("sparse", chosen))
            for mode in ("fwd", "fwd+bwd")}, skipped


def _torch_calls(torch, q, k, v, grad, selection) -> dict[str, Any]:
    tq, tk, tv, tg = (torch.from_numpy(a) for a in (q, k, v, grad))
    mask = torch.from_numpy(selection[:, None])  # (B, 1, L, L), True = attend
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step(attn_mask, backward):
        def call():
            if not backward:
                with torch.inference_mode():
                    sdpa(tq, tk, tv, attn_mask=attn_mask, is_causal=attn_mask is None)
                return
            qq, kk, vv = (t.detach().requires_grad_() for t in (tq, tk, tv))
            sdpa(qq, kk, vv, attn_mask=attn_mask, is_causal=attn_mask is None).backward(tg)
        return call
    return {f"{kind} {mode}": step(m, mode == "fwd+bwd") for kind, m in (("dense", None), ("sparse", mask))
            for mode in ("fwd", "fwd+bwd")}


def _print_pair(label: str, times: dict[str, float], figures: dict[str, float]) -> None:
    modes = sorted({name.split(" ", 1)[1] for name in times},
                   key=("fwd", "fwd+bwd", "absorbed fwd", "decode step").index)
    for mode in modes:
        dense, sparse = times[f"dense {mode}"], times[f"sparse {mode}"]
        key = label.replace(" ", "_") + "_" + mode.replace("+", "").replace(" ", "_")
        figures[key + "_dense_ms"], figures[key + "_sparse_ms"] = dense, sparse
        print(f"{label + ' ' + mode:>28} {dense:10.1f} {sparse:10.1f} {sparse / dense:7.3f}x")


def run(args: argparse.Namespace) -> dict[str, float]:
    """Time dense and top-k attention (kernel, layer, PyTorch); print the table, return the times."""
    torch = import_torch()
    for line in describe(threads=args.threads):
        print(line)
    length, h = args.length, args.heads
    print(f"# float32, B=1, L={length}, top-k {args.top_k}; latent attention D={args.hidden}, H={h}, q_lora 192, "
          f"kv_lora 128, qk 48+16, v 64; indexer {args.index_heads} heads of {args.index_dim}; "
          f"best of {args.repeats}, engines alternating")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, length, args.hidden)).astype(np.float32)
    grad_x = rng.standard_normal(x.shape).astype(np.float32)
    inv_freq, factor = rotary_frequencies(16, 10000.0)
    rotary = rotary_cos_sin(np.arange(length)[None], inv_freq, factor, interleaved=True)
    q, k = (rng.standard_normal((1, h, length, 64)).astype(np.float32) for _ in range(2))
    v, grad = (rng.standard_normal((1, h, length, 64)).astype(np.float32) for _ in range(2))
    figures: dict[str, float] = {}
    print(f"{'':>28} {'dense ms':>10} {'sparse ms':>10} {'ratio':>8}")
    with engine_threads(torch, args.threads):
        layer_calls, selection = _layer_calls(args, x, rotary, grad_x)
        kernel_calls, skipped = _kernel_calls(q, k, v, grad, selection)
        figures["skipped_causal_tiles"] = skipped
        _print_pair("attnkit kernel", alternating_best_ms(kernel_calls, args.repeats), figures)
        _print_pair("attnkit layer", alternating_best_ms(layer_calls, args.repeats), figures)
        if torch is None:
            print(torch_missing_line("no PyTorch lines"))
        else:
            _print_pair("torch sdpa", alternating_best_ms(_torch_calls(torch, q, k, v, grad, selection),
                                                          args.repeats), figures)
    print(f"# the selection leaves {skipped:.1%} of the causal 128x128 tiles without a chosen key (skipped); "
          f"a query keeps {args.top_k} of up to {length} keys")
    return figures


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m attnkit.benchmarks.sparse_attention``."""
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
