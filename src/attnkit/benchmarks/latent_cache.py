"""Benchmark: the decoding cache's bytes per token of multi-head latent attention against grouped-query attention.

At DeepSeek-V3's width (hidden 7168, 128 heads, latent C = 512, rotary key R = 64, heads Dn = 128 + R, Dv = 128,
61 layers) three caches are filled with the same number of tokens, in the same run, and their bytes measured:

* attnkit's :class:`~attnkit.decoding.cache.LatentCache` (what ``deepseek_v3`` decodes with: C + R per token);
* attnkit's :class:`~attnkit.decoding.cache.KVCache` for Llama-style grouped-query attention at the same width
  (8 key/value heads of 128, Llama-3-70B's shape: 2 * 8 * 128 per token);
* ``transformers``' ``DynamicCache`` fed exactly what its DeepseekV3Attention and LlamaAttention feed it (the
  compressed latent and the rotary key; keys and values), when torch is installed.

It prints bytes per token and layer, per token for the whole model, and the ratios; the expected ratio is the
shapes' ``2 * Hkv * Dh / (C + R)`` = 2048 / 576 = 3.56, and against the per-head keys and values the explicit
form attends to, ``H * (Dn + R + Dv) / (C + R)`` = 40960 / 576 = 71.1. No arithmetic is timed: memory depends
on the shapes only, and the measurement checks that each cache holds what its shapes say and nothing more.

Usage::

    python -m attnkit.benchmarks.latent_cache [--tokens 1024] [--dtype bfloat16|float16|float32]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from ..decoding.cache import KVCache, LatentCache
from ._support import import_torch, torch_missing_line
from .machine import describe, machine_info

__all__ = ["main", "measure"]

# DeepSeek-V3's attention and a grouped-query attention of the same width (Llama-3-70B's 8 key/value heads)
SHAPE = dict(layers=61, heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
             gqa_kv_heads=8, gqa_head_dim=128)
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _attnkit_bytes(tokens: int) -> dict[str, int]:
    """Bytes per token and layer of attnkit's two caches after ``tokens`` slots of one layer (float32 storage)."""
    s = SHAPE
    latent = LatentCache(1, 1, s["kv_lora_rank"] + s["qk_rope_head_dim"], np.float32, max_length=tokens)
    latent.update(0, np.zeros((1, tokens, s["kv_lora_rank"] + s["qk_rope_head_dim"]), np.float32))
    kv = KVCache(1, 1, s["gqa_kv_heads"], s["gqa_head_dim"], np.float32, max_length=tokens)
    k = np.zeros((1, s["gqa_kv_heads"], tokens, s["gqa_head_dim"]), np.float32)
    kv.update(0, k, k)
    return {"latent": latent.nbytes // tokens, "gqa": kv.nbytes // tokens}


def _transformers_bytes(torch, tokens: int) -> dict[str, int]:
    """Bytes per token and layer of transformers' DynamicCache fed what its attentions feed it (float32)."""
    from transformers import DynamicCache

    s = SHAPE
    latent = DynamicCache()
    latent.update(torch.zeros(1, 1, tokens, s["kv_lora_rank"]), torch.zeros(1, 1, tokens, s["qk_rope_head_dim"]), 0)
    gqa = DynamicCache()
    k = torch.zeros(1, s["gqa_kv_heads"], tokens, s["gqa_head_dim"])
    gqa.update(k, k.clone(), 0)

    def held(cache) -> int:
        layer = cache.layers[0]
        return (layer.keys.nelement() * layer.keys.element_size()
                + layer.values.nelement() * layer.values.element_size())

    return {"latent": held(latent) // tokens, "gqa": held(gqa) // tokens}


def measure(tokens: int = 1024) -> dict[str, dict[str, int]]:
    """``{"attnkit": {"latent": b, "gqa": b}, "transformers": {...}}``: float32 bytes per token and layer
    (transformers' entry only with torch)."""
    found = {"attnkit": _attnkit_bytes(tokens)}
    torch = import_torch()
    if torch is not None:
        found["transformers"] = _transformers_bytes(torch, tokens)
    return found


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m attnkit.benchmarks.latent_cache``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens cached (default 1024)")
    parser.add_argument("--dtype", choices=tuple(_ITEMSIZE), default="bfloat16",
                        help="the storage dtype the whole-model line is given in (default bfloat16, as published)")
    args = parser.parse_args(argv)
    s = SHAPE
    print("\n".join(describe(machine_info())))
    found = measure(args.tokens)
    if "transformers" not in found:
        print(torch_missing_line("transformers' DynamicCache"))
    explicit = s["heads"] * (s["qk_nope_head_dim"] + s["qk_rope_head_dim"] + s["v_head_dim"])
    scale = _ITEMSIZE[args.dtype] / 4
    print(f"\nDeepSeek-V3 width, {args.tokens} tokens cached; bytes per token and layer in float32 "
          f"(per token, all {s['layers']} layers, in {args.dtype})")
    for library, sizes in found.items():
        for kind, label in (("latent", "MLA latent cache (C + R = 576)"),
                            ("gqa", "GQA, 8 kv heads of 128 (2 * 1024)")):
            whole = sizes[kind] * scale * s["layers"] / 2**10
            print(f"  {library:12s} {label:36s} {sizes[kind]:7d} B  ({whole:8.1f} KiB)")
        print(f"  {library:12s} GQA / MLA: {sizes['gqa'] / sizes['latent']:.2f}x")
    print(f"  shapes: GQA / MLA = {2 * s['gqa_kv_heads'] * s['gqa_head_dim'] / 576:.2f}x; the explicit form's "
          f"per-head keys and values / MLA = {explicit / 576:.1f}x ({explicit} numbers per token and layer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
