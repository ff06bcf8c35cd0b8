"""Benchmark: load time of one model as a GGUF file against the same model as a Hugging Face folder.

Writes (once, into DIR) a Llama of SmolLM2-135M's shape with random float32 weights and a byte-level BPE
vocabulary of SmolLM2's size (49152 tokens: 17 special ones, the 256 bytes and 48879 merges built at random),
as a folder (``save_pretrained``, ``tokenizer.json``) and as a float32 GGUF file of the same weights, written as
llama.cpp's converter writes a Llama (its metadata keys and tensor names, q and k rows permuted per head). Then
``attnkit.pretrained.load`` (model and tokenizer) runs on each in fresh processes, alternating folder and file
for ``--rounds`` rounds (a shared machine's speed moves within minutes: alternating lets both see the same
conditions); the medians, ranges and their ratio are printed. ``--profile`` adds a cProfile of one GGUF load in
this process (the 25 functions of largest cumulative time).

Usage::

    python -m attnkit.benchmarks.gguf_load /tmp/gguf-bench --rounds 5 --profile
    python -m attnkit.benchmarks.gguf_load /tmp/gguf-bench-2 --layers 2     # a small model: the fixed costs

Writing the model needs torch, transformers, tokenizers and gguf; loading needs the ``pretrained`` extra.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from .machine import describe, machine_info

__all__ = ["main", "byte_level_vocabulary", "write_models", "time_load", "profile"]

_CHILD = r"""
import sys, time
from attnkit.pretrained import load
import gguf, safetensors, tokenizers  # imported before the clock starts, as attnkit imports them on first use
t = time.perf_counter()
model, tokenizer = load(sys.argv[1])
print(time.perf_counter() - t)
"""

_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *(f"<|reserved_{i}|>" for i in range(14))]


def byte_level_vocabulary(size: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``size`` tokens (special ones, GPT-2's 256 byte characters, then one per merge) and the merges
    (``"left right"``), each merge joining two earlier tokens into a new one of at most 16 characters."""
    from ..pretrained.gguf_tokenizer import _bytes_to_unicode

    rng = np.random.default_rng(seed)
    tokens = _SPECIAL + list(_bytes_to_unicode().values())
    pieces = tokens[len(_SPECIAL):]
    known, merges = set(tokens), []
    while len(tokens) < size:
        # short pieces are picked more often, as in a trained vocabulary
        left, right = (pieces[int(len(pieces) * rng.random() ** 2)] for _ in range(2))
        joined = left + right
        if len(joined) > 16 or joined in known:
            continue
        known.add(joined)
        tokens.append(joined)
        pieces.append(joined)
        merges.append(f"{left} {right}")
    return tokens, merges


def _write_folder(folder: Path, layers: int, tokens: list[str], merges: list[str]) -> dict:
    """The Hugging Face folder (random weights, seed 0) and its ``tokenizer.json``; returns its config."""
    import tokenizers as tk
    import transformers

    import torch

    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=len(tokens),
                                      tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
                                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().save_pretrained(folder)
    backend = tk.Tokenizer(tk.models.BPE({t: i for i, t in enumerate(tokens)},
                                         [tuple(m.split(" ")) for m in merges]))
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    backend.add_special_tokens(_SPECIAL)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": _SPECIAL[0], "eos_token": _SPECIAL[0]}))
    return json.loads((folder / "config.json").read_text())


def _permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: each head's rows from (2, Dh/2) to (Dh/2, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path, folder: Path, config: dict, tokens: list[str], merges: list[str]) -> None:
    """The folder's weights as a float32 GGUF file, with llama.cpp's Llama metadata and tensor names."""
    import gguf
    from safetensors.numpy import load_file

    writer = gguf.GGUFWriter(str(path), "llama")
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3] * len(_SPECIAL) + [1] * (len(tokens) - len(_SPECIAL)))
    writer.add_uint32("tokenizer.ggml.bos_token_id", 0)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    for name, w in load_file(str(folder / "model.safetensors")).items():
        stem, suffix = name.rsplit(".", 1)
        target = f"{names.get_name(stem)}.{suffix}"
        if ".attn_q." in target or ".attn_k." in target:
            w = _permuted(w, heads if ".attn_q." in target else kv)
        writer.add_tensor(target, np.ascontiguousarray(w, dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()


def write_models(folder: Path, layers: int) -> tuple[Path, Path]:
    """The folder and the GGUF file of the same model and vocabulary (written once)."""
    hf, path = folder / "hf", folder / "model.gguf"
    if (hf / "tokenizer.json").is_file() and path.is_file():
        return hf, path
    tokens, merges = byte_level_vocabulary(49152)
    config = _write_folder(hf, layers, tokens, merges)
    _write_gguf(path, hf, config, tokens, merges)
    return hf, path


def time_load(path: Path) -> float:
    """Seconds of one ``load(path)`` in a fresh process (imports excluded)."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def profile(path: Path) -> str:
    """cProfile of one ``load(path)`` in this process, by cumulative time."""
    from ..pretrained import load

    profiler = cProfile.Profile()
    profiler.enable()
    load(path)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m attnkit.benchmarks.gguf_load``."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.gguf_load", description=__doc__.split("\n")[0])
    p.add_argument("folder", help="where the model is written (once) and read from")
    p.add_argument("--layers", type=int, default=30, help="decoder layers (default 30, SmolLM2-135M's)")
    p.add_argument("--rounds", type=int, default=5, help="rounds alternating folder and file (default 5)")
    p.add_argument("--profile", action="store_true", help="also print a cProfile of one GGUF load")
    args = p.parse_args(argv)
    hf, path = write_models(Path(args.folder), args.layers)
    for line in describe(machine_info()):
        print(line)
    print(f"folder {hf}: {sum(f.stat().st_size for f in hf.iterdir()) / 2**20:.0f} MiB; "
          f"GGUF {path}: {path.stat().st_size / 2**20:.0f} MiB")
    times: dict[str, list[float]] = {"folder": [], "gguf": []}
    for _ in range(args.rounds):
        times["folder"].append(time_load(hf))
        times["gguf"].append(time_load(path))
    for name, values in times.items():
        print(f"{name:<7} load(model, tokenizer): median {statistics.median(values):.2f} s "
              f"(range {min(values):.2f}-{max(values):.2f}, {len(values)} rounds)")
    print(f"gguf / folder: {statistics.median(times['gguf']) / statistics.median(times['folder']):.2f}")
    if args.profile:
        print(profile(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
