"""Benchmark: one decoding step of a Gated DeltaNet layer against one of softmax attention, as the context grows.

A Gated DeltaNet layer keeps a fixed-size state (its convolution's last inputs and a (Hv, Dk, Dv) delta-rule
state), so a decoding step costs the same at 1k and at 16k tokens: O(1) in the length. Softmax attention reads
every cached key and value at every step: O(N). The table prints the time per token of one layer of each
kind after N cached tokens, for attnkit and for ``transformers``' own layers (Qwen3-Next's GatedDeltaNet
and gated attention, their cache a ``DynamicCache``) in the same run, each time relative to its own
time at the first N. The Gated DeltaNet's N tokens are really prefilled (the chunked form); the
attention's cache is filled with random keys and values (a step's cost does not depend on them).

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m attnkit.benchmarks.linear_decode
    python -m attnkit.benchmarks.linear_decode --contexts 1024 4096 --steps 8   # quicker
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from ..attention.gated import GatedAttention
from ..decoding.cache import KVCache
from ..kernels._threads import num_threads, thread_count_argument
from ..layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from ..layers.rotary import RotaryEmbedding
from ..models.config import AttentionConfig, DecoderConfig, MLPConfig, NormConfig, RotaryConfig
from ._support import blas_limit, import_torch, torch_missing_line
from .machine import describe

__all__ = ["main", "parse_args", "run"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.linear_decode",
                                description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                   help="cached tokens N before the timed steps (default 1k .. 16k)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size D (default 1024)")
    p.add_argument("--heads", type=int, default=8, help="query heads (attention) and value heads (Gated DeltaNet)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim of both layers (default 128)")
    p.add_argument("--steps", type=int, default=32, help="decoding steps timed per context (default 32)")
    p.add_argument("--threads", type=thread_count_argument, default=1)
    p.add_argument("--no-torch", action="store_true", help="attnkit only")
    return p.parse_args(argv)


def _config(args: argparse.Namespace) -> DecoderConfig:
    """One gated-attention layer and one Gated DeltaNet layer of Qwen3-Next's proportions (half as many key as
    value heads, a quarter of each attention head rotated, 4 key/value heads)."""
    h, dh = args.heads, args.head_dim
    # a family only names checkpoint tensors, and these two layers are never saved
    return DecoderConfig(family="benchmark", vocab_size=8, hidden_size=args.hidden, num_layers=2, num_heads=h,
                         num_kv_heads=max(1, h // 4), head_dim=dh, mlp=MLPConfig(8),
                         rotary=RotaryConfig(partial_factor=0.25), norm=NormConfig(offset=1.0),
                         attention=AttentionConfig(qk_norm="head"), layer_types=("linear_attention", "gated_attention"),
                         mixer_parts=(GatedDeltaNetConfig(max(1, h // 2), h, dh, dh),))


def _per_token_us(step, steps: int) -> float:
    """The median time of ``steps`` calls of ``step(t)`` after two warm-up calls, in microseconds."""
    step(0)
    step(1)
    times = []
    for t in range(steps):
        start = time.perf_counter()
        step(t)
        times.append(time.perf_counter() - start)
    return 1e6 * float(np.median(times))


def _attnkit_us(cfg: DecoderConfig, context: int, steps: int) -> tuple[float, float]:
    """attnkit's (Gated DeltaNet, gated attention) time per decoding step after ``context`` tokens."""
    rng = np.random.default_rng(0)
    gdn_shape = cfg.mixer_part(GatedDeltaNetConfig)
    gdn = GatedDeltaNet(cfg.hidden_size, gdn_shape.num_key_heads, gdn_shape.num_value_heads, gdn_shape.key_head_dim,
                        gdn_shape.value_head_dim, rng=0).astype(np.float32)
    x = rng.standard_normal((1, context + steps + 2, cfg.hidden_size)).astype(np.float32)  # (1, N + T, D)
    state = gdn.new_cache(1)
    gdn(x[:, :context], cache=state)  # the prefill: the chunked form over N tokens
    gdn_us = _per_token_us(lambda t: gdn(x[:, context + t:context + t + 1], cache=state), steps)
    attn = GatedAttention(cfg, 1, rng=0).astype(np.float32)
    cache = KVCache(2, 1, cfg.num_kv_heads, cfg.head_dim, np.float32)
    past = rng.standard_normal((1, cfg.num_kv_heads, context, cfg.head_dim)).astype(np.float32)  # (1, Hkv, N, Dh)
    cache.update(1, past, past)
    rotary = RotaryEmbedding(cfg.rotary, cfg.head_dim, cfg.max_position_embeddings)

    def attend(t: int) -> None:
        position = np.array([[context + t]])
        attn(x[:, context + t:context + t + 1], rotary=rotary(position, dtype=np.float32), cache=cache)

    return gdn_us, _per_token_us(attend, steps)


def _torch_us(torch: Any, cfg: DecoderConfig, context: int, steps: int) -> tuple[float, float]:
    """transformers' (Qwen3NextGatedDeltaNet, Qwen3NextAttention) time per decoding step after ``context`` tokens."""
    from transformers import DynamicCache, Qwen3NextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    shape = cfg.mixer_part(GatedDeltaNetConfig)
    hf_cfg = Qwen3NextConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                             num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, num_hidden_layers=2,
                             layer_types=["linear_attention", "full_attention"],
                             linear_num_key_heads=shape.num_key_heads, linear_num_value_heads=shape.num_value_heads,
                             linear_key_head_dim=shape.key_head_dim, linear_value_head_dim=shape.value_head_dim,
                             vocab_size=8)
    hf_cfg._attn_implementation = "sdpa"
    gdn, attn = hf.Qwen3NextGatedDeltaNet(hf_cfg, 0).eval(), hf.Qwen3NextAttention(hf_cfg, 1).eval()
    rotary = hf.Qwen3NextRotaryEmbedding(hf_cfg)
    x = torch.randn(1, context + steps + 2, cfg.hidden_size)
    with torch.inference_mode():
        cache = DynamicCache(config=hf_cfg)
        gdn(x[:, :context], cache=cache)
        past = torch.randn(1, cfg.num_kv_heads, context, cfg.head_dim)
        cache.update(past, past, 1)
        gdn_us = _per_token_us(lambda t: gdn(x[:, context + t:context + t + 1], cache=cache), steps)

        def attend(t: int) -> None:
            position = torch.tensor([[context + t]])
            attn(x[:, context + t:context + t + 1], rotary(x, position), None, cache=cache)

        return gdn_us, _per_token_us(attend, steps)


def _row(label: str, context: int, times: tuple[float, float], first: tuple[float, float]) -> str:
    gdn, attention = times
    return (f"{label:>12} {context:>7} {gdn:>10.0f} {gdn / first[0]:>6.2f}x {attention:>10.0f} "
            f"{attention / first[1]:>6.2f}x")


def run(args: argparse.Namespace) -> dict[str, list[float]]:
    """Time both layers at every context; print the table and return the times (microseconds per token)."""
    cfg = _config(args)
    for line in describe(threads=args.threads):
        print(line)
    print(f"# float32, B=1, D={cfg.hidden_size}; Gated DeltaNet Hk={cfg.mixer_part(GatedDeltaNetConfig).num_key_heads} "
          f"Hv={cfg.num_heads} Dk=Dv={cfg.head_dim}; gated attention Hq={cfg.num_heads} Hkv={cfg.num_kv_heads} "
          f"Dh={cfg.head_dim}; median of {args.steps} steps")
    print(f"{'':>12} {'N':>7} {'GDN us/tok':>10} {'vs 1st':>7} {'attn us/tok':>10} {'vs 1st':>7}")
    torch = None if args.no_torch else import_torch()
    if torch is None and not args.no_torch:
        print(torch_missing_line("no transformers lines"))
    figures: dict[str, list[float]] = {"contexts": list(args.contexts)}
    # attnkit's kernels set the BLAS threads to their own count: both limits, or a 2-thread GEMV would run
    with blas_limit(args.threads), num_threads(args.threads):
        if torch is not None:
            torch.set_num_threads(args.threads)
        for name, measure in (("attnkit", lambda n: _attnkit_us(cfg, n, args.steps)),
                              ("transformers", None if torch is None else lambda n: _torch_us(torch, cfg, n,
                                                                                              args.steps))):
            if measure is None:
                continue
            times = [measure(n) for n in args.contexts]
            for context, pair in zip(args.contexts, times):
                print(_row(name, context, pair, times[0]))
            figures[f"{name}_gdn_us"] = [t[0] for t in times]
            figures[f"{name}_attention_us"] = [t[1] for t in times]
    return figures


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m attnkit.benchmarks.linear_decode``."""
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
