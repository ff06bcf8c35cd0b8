"""Load time of one model as a GGUF file against the same model as a Hugging Face folder.

Writes (once, into DIR) a Llama of SmolLM2-135M's shape with random float32 weights and a byte-level BPE
vocabulary of SmolLM2's size (49152 tokens: 17 special ones, the 256 bytes and 48879 merges built at random),
as a folder (``save_pretrained``, ``tokenizer.json``) and as a float32 GGUF file written the way llama.cpp's
converter writes it (``tests/gguf_models.py``). Then ``attnkit.pretrained.load`` (model and tokenizer) runs on
each in fresh processes, alternating folder and file for ``--rounds`` rounds (the machine is shared: alternating
lets both see the same conditions), and the medians, ranges and their ratio are printed. ``--profile`` adds a
cProfile of one GGUF load in this process (the 25 functions of largest cumulative time).

Usage::

    python benchmarks/bench_gguf_load.py /tmp/gguf-bench --rounds 5 --profile
    python benchmarks/bench_gguf_load.py /tmp/gguf-bench --layers 2     # a small model: the fixed costs

Needs torch, transformers, tokenizers and gguf (the test environment).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the GGUF writer of the tests

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
    from attnkit.pretrained.gguf_tokenizer import _bytes_to_unicode

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


def write_models(folder: Path, layers: int) -> tuple[Path, Path]:
    """The folder and the GGUF file of the same model and vocabulary (written once)."""
    hf, path = folder / "hf", folder / "model.gguf"
    if (hf / "tokenizer.json").is_file() and path.is_file():
        return hf, path
    import tokenizers as tk
    import transformers

    import gguf_models as gm
    import torch

    tokens, merges = byte_level_vocabulary(49152)
    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=len(tokens),
                                      tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
                                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(hf)
    backend = tk.Tokenizer(tk.models.BPE({t: i for i, t in enumerate(tokens)},
                                         [tuple(m.split(" ")) for m in merges]))
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    backend.add_special_tokens(_SPECIAL)
    backend.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"bos_token": _SPECIAL[0], "eos_token": _SPECIAL[0]}))
    meta = {"model": "gpt2", "pre": "default", "tokens": tokens, "merges": merges, "bos_token_id": 0,
            "eos_token_id": 0, "token_type": [3] * len(_SPECIAL) + [1] * (len(tokens) - len(_SPECIAL))}
    gm.write_gguf(model, path, gm.Q.F32, tokenizer=meta)
    return hf, path


def time_load(path: Path) -> float:
    """Seconds of one ``load(path)`` in a fresh process (imports excluded)."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def profile(path: Path) -> str:
    """cProfile of one ``load(path)`` in this process, by cumulative time."""
    from attnkit.pretrained import load

    profiler = cProfile.Profile()
    profiler.enable()
    load(path)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", help="where the model is written (once) and read from")
    p.add_argument("--layers", type=int, default=30, help="decoder layers (default 30, SmolLM2-135M's)")
    p.add_argument("--rounds", type=int, default=5, help="rounds alternating folder and file (default 5)")
    p.add_argument("--profile", action="store_true", help="also print a cProfile of one GGUF load")
    args = p.parse_args(argv)
    from attnkit.benchmarks.machine import describe, machine_info

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
