"""Benchmark decoding with a GPT-2-small-shaped model: attnkit's CausalLM + KVCache vs Hugging Face on torch CPU.

Model: 12 layers, d = 768, 12 heads, vocab 50257, 1024 positions, random weights (float32), the same weights
in both (copied from the HF ``GPT2LMHeadModel`` into attnkit, then checked: logits of one prompt agree and the
greedy tokens of the first run are equal).

Measured, each in the same run for both:

* decode tokens/s: prompt of 16 tokens, 48 new tokens, greedy, batch 1 and 8 (attnkit: prefill into a
  :class:`~attnkit.decoding.cache.KVCache` then one token per step; HF: ``model.generate(do_sample=False)``);
* prefill: one forward of 1024 tokens, batch 1 (attnkit: into a cache, as generation would; HF: forward with
  ``use_cache=True``);
* the memory of the attnkit cache after the prefill.

Threads: torch, NumPy's BLAS (threadpoolctl) and attnkit's tile threads all set to ``--threads``. Timing:
best of ``--repeats`` (the first run also gives the tokens compared), attnkit then HF per measurement.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_decode.py --threads 2
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from contextlib import contextmanager

import numpy as np

import attnkit
from attnkit.models import CausalLM, DecoderConfig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prefill", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


@contextmanager
def thread_limit(n: int):
    """torch intra-op threads, NumPy's BLAS threads and attnkit's tile threads all set to ``n``."""
    from threadpoolctl import threadpool_limits

    import torch

    old_torch = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with threadpool_limits(limits=n, user_api="blas"), attnkit.num_threads(n):
            yield
    finally:
        torch.set_num_threads(old_torch)


def build(args):
    """A random HF GPT-2 (float32, eval) and an attnkit CausalLM holding the same weights."""
    import transformers

    import torch

    torch.manual_seed(args.seed)
    hf_cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    cfg = DecoderConfig(family="gpt2", vocab_size=50257, hidden_size=768, num_layers=args.layers, num_heads=12,
                        num_kv_heads=12, head_dim=64, intermediate_size=3072, max_position_embeddings=1024,
                        norm="layernorm", norm_eps=1e-5, activation="gelu_tanh", mlp="plain", position="learned",
                        attention_bias=True, output_bias=True, tie_word_embeddings=True)
    ours = CausalLM(cfg, rng=args.seed).astype(np.float32)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    ours.embed.weight = sd["transformer.wte.weight"]
    ours.pos_embed.weight = sd["transformer.wpe.weight"]
    for i, block in enumerate(ours.layers):
        pre = f"transformer.h.{i}."
        w, b = sd[pre + "attn.c_attn.weight"], sd[pre + "attn.c_attn.bias"]
        for j, name in enumerate("QKV"):
            setattr(block.attention, f"W_{name}", w[:, j * 768:(j + 1) * 768])
            setattr(block.attention, f"b_{name}", b[j * 768:(j + 1) * 768])
        block.attention.W_O, block.attention.b_O = sd[pre + "attn.c_proj.weight"], sd[pre + "attn.c_proj.bias"]
        block.attn_norm.gamma, block.attn_norm.beta = sd[pre + "ln_1.weight"], sd[pre + "ln_1.bias"]
        block.mlp_norm.gamma, block.mlp_norm.beta = sd[pre + "ln_2.weight"], sd[pre + "ln_2.bias"]
        block.mlp.W1, block.mlp.b1 = sd[pre + "mlp.c_fc.weight"], sd[pre + "mlp.c_fc.bias"]
        block.mlp.W2, block.mlp.b2 = sd[pre + "mlp.c_proj.weight"], sd[pre + "mlp.c_proj.bias"]
    ours.norm.gamma, ours.norm.beta = sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"]
    ours.eval()
    return ours, hf


def greedy(model: CausalLM, ids: np.ndarray, new: int) -> np.ndarray:
    """Prefill into a cache, then one greedy token per step (what attnkit.decoding.sampling does, minus warpers)."""
    cache = model.new_cache(ids.shape[0], max_length=ids.shape[1] + new)
    logits = model(ids, cache=cache)[:, -1]  # (B, V)
    out = [ids]
    for step in range(new):
        token = logits.argmax(axis=-1)[:, None]  # (B, 1)
        out.append(token)
        if step + 1 < new:
            logits = model(token, cache=cache)[:, -1]  # (B, V)
    return np.concatenate(out, axis=1)  # (B, L + new)


def best_of(fn, repeats: int):
    """(best time, the first run's result)."""
    times, first = [], None
    for i in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        first = result if i == 0 else first
    return min(times), first


def main(argv=None) -> dict:
    from threadpoolctl import threadpool_info

    import torch

    args = parse_args(argv)
    blas = ", ".join(f"{lib.get('internal_api')} {lib.get('version')} ({lib.get('architecture')})"
                     for lib in threadpool_info() if lib.get("user_api") == "blas")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"CPU {cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; BLAS {blas}; threads {args.threads}; "
          f"torch {torch.__version__}")
    ours, hf = build(args)
    rng = np.random.default_rng(args.seed)
    results = {}
    with thread_limit(args.threads), torch.inference_mode():
        probe = rng.integers(0, 50257, size=(1, 16))
        diff = np.max(np.abs(ours(probe) - hf(torch.from_numpy(probe)).logits.numpy()))
        print(f"logit agreement on a 16-token prompt: max |diff| = {diff:.2e}")
        for batch in args.batches:
            ids = rng.integers(0, 50257, size=(batch, args.prompt))
            tid = torch.from_numpy(ids)
            t_ours, ours_tokens = best_of(lambda ids=ids: greedy(ours, ids, args.new), args.repeats)
            t_hf, hf_tokens = best_of(lambda tid=tid: hf.generate(tid, attention_mask=torch.ones_like(tid),
                                                          max_new_tokens=args.new, min_new_tokens=args.new,
                                                          do_sample=False, pad_token_id=0), args.repeats)
            same = float(np.mean(ours_tokens[:, args.prompt:] == hf_tokens.numpy()[:, args.prompt:]))
            tok = batch * args.new
            results[f"decode_b{batch}"] = (tok / t_ours, tok / t_hf)
            print(f"decode batch {batch}: attnkit {tok / t_ours:7.1f} tok/s, HF {tok / t_hf:7.1f} tok/s, "
                  f"speed ratio attnkit/HF {t_hf / t_ours:.2f}x (greedy tokens equal: {same:.0%})")
        ids = rng.integers(0, 50257, size=(1, args.prefill))
        tid = torch.from_numpy(ids)

        def ours_prefill():
            cache = ours.new_cache(1, max_length=args.prefill)
            ours(ids, cache=cache)
            return cache

        t_ours, cache = best_of(ours_prefill, args.repeats)
        t_hf, _ = best_of(lambda: hf(tid, use_cache=True), args.repeats)
        results["prefill"] = (t_ours, t_hf)
        print(f"prefill {args.prefill}: attnkit {t_ours * 1e3:.0f} ms, HF {t_hf * 1e3:.0f} ms, time ratio "
              f"attnkit/HF {t_ours / t_hf:.2f}x; cache {cache.nbytes / 2**20:.1f} MiB "
              f"({args.layers} layers x K,V x {args.prefill} slots x 768 float32)")
    return results


if __name__ == "__main__":
    main()
