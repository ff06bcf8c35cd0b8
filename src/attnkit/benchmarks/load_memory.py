"""Benchmark: resident memory of loading a Hugging Face decoder folder, attnkit vs ``transformers``.

Each loader runs in a fresh Python process (so one cannot profit from the other's pages; Linux only, it reads
``/proc/self/status``): it imports its library, notes its peak resident set (the interpreter and the imports),
loads the folder in float32, then reports the peak resident set during the load and the resident set after it,
and after a 4-token greedy ``generate``. Prints both, the checkpoint size, and the ratios. The target:
attnkit's peak at most 1.2x the checkpoint plus the interpreter, and the memory after loading about the
weights.

Usage::

    python -m attnkit.benchmarks.load_memory FOLDER
    python -m attnkit.benchmarks.load_memory --make-llama /tmp/llama135m   # write a 135M-parameter folder
                                                                           # (random weights, SmolLM's shape)

Needs the ``pretrained`` extra; the ``transformers`` side needs torch and transformers (skipped, saying so,
without them).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from .machine import describe, machine_info

__all__ = ["main", "parse_args", "run", "measure"]

# The child: a library, a folder; prints one JSON line (MiB). The peak is the address space's high-water
# mark (VmHWM), which starts afresh at exec; getrusage's ru_maxrss would carry over the parent's peak.
_CHILD = r"""
import json, sys, time
def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 2**10
def rss():
    return _status("VmRSS")
def peak():
    return _status("VmHWM")
library, folder = sys.argv[1], sys.argv[2]
import numpy as np
if library == "attnkit":
    from attnkit.pretrained import load_causal_lm
    import safetensors, tokenizers
    start = peak()
    t = time.perf_counter()
    model = load_causal_lm(folder)
    seconds = time.perf_counter() - t
    loaded_peak, loaded = peak(), rss()
    model.generate(np.array([[1, 2, 3]]), max_new_tokens=4)
else:
    import torch, transformers
    start = peak()
    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    seconds = time.perf_counter() - t
    loaded_peak, loaded = peak(), rss()
    with torch.no_grad():
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
print(json.dumps({"imports_mb": start, "peak_mb": loaded_peak, "after_load_mb": loaded,
                  "after_generate_mb": rss(), "load_s": seconds}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.load_memory", description=__doc__.split("\n")[0])
    p.add_argument("folder", nargs="?", help="a Hugging Face causal LM folder (float32 safetensors)")
    p.add_argument("--make-llama", metavar="DIR", help="first write a 135M-parameter Llama folder with random "
                   "weights to DIR (needs torch and transformers), then measure it")
    args = p.parse_args(argv)
    if not args.folder and not args.make_llama:
        p.error("give a FOLDER or --make-llama DIR")
    return args


def make_llama(folder: str | Path) -> Path:
    """Write a Llama folder of SmolLM-135M's shape with random float32 weights (538 MB) to ``folder``."""
    import transformers

    import torch

    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                      tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().save_pretrained(folder)
    return Path(folder)


def measure(library: str, folder: str | Path) -> dict | None:
    """One loader's figures (see the module docstring), or None when its library is missing."""
    done = subprocess.run([sys.executable, "-c", _CHILD, library, str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        if "ModuleNotFoundError" in done.stderr:
            return None
        raise RuntimeError(f"the {library} loader failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    """Measure both loaders and print the table; returns the figures."""
    folder = make_llama(args.make_llama) if args.make_llama else Path(args.folder)
    checkpoint_mb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    for line in describe(machine_info()):
        print(line)
    print(f"checkpoint {folder}: {checkpoint_mb:.0f} MiB of safetensors")
    results = {name: measure(name, folder) for name in ("attnkit", "transformers")}
    print(f"{'loader':<13}{'imports':>9}{'peak':>9}{'peak-imports':>14}{'after load':>12}{'after generate':>16}"
          f"{'load s':>8}")
    for name, r in results.items():
        if r is None:
            print(f"{name:<13} skipped: not installed")
            continue
        print(f"{name:<13}{r['imports_mb']:>9.0f}{r['peak_mb']:>9.0f}{r['peak_mb'] - r['imports_mb']:>14.0f}"
              f"{r['after_load_mb']:>12.0f}{r['after_generate_mb']:>16.0f}{r['load_s']:>8.2f}")
    ours, theirs = results["attnkit"], results["transformers"]
    print(f"attnkit peak - imports = {(ours['peak_mb'] - ours['imports_mb']) / checkpoint_mb:.2f}x the checkpoint "
          f"(target <= 1.2)")
    if theirs is not None:
        # transformers maps the file and pages weights in as they are used: compare after a generate too.
        print(f"ratios attnkit / transformers: peak {ours['peak_mb'] / theirs['peak_mb']:.2f}, after load "
              f"{ours['after_load_mb'] / theirs['after_load_mb']:.2f}, after generate "
              f"{ours['after_generate_mb'] / theirs['after_generate_mb']:.2f}, load time "
              f"{ours['load_s'] / theirs['load_s']:.2f}")
    return {"checkpoint_mb": checkpoint_mb, **results}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m attnkit.benchmarks.load_memory``."""
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
