"""``python -m attnkit.torch.train``: data-parallel training of a causal LM twin, launched with ``torchrun``.

::

    torchrun --nproc_per_node=K -m attnkit.torch.train --config CONFIG.json --data TOKENS.npy --steps N \\
        --global-batch B --seq-len L --lr LR --seed S --dtype float32 --out DIR

The backend is chosen from the machine: NCCL with one GPU per process when CUDA is available, gloo on CPU
processes otherwise; without ``torchrun`` it runs as one plain process. ``CONFIG.json`` is a Hugging Face
``config.json`` of a family attnkit loads (any of ``supported_model_types()``), read by
:func:`attnkit.pretrained.decoder_config_from_hf`.

Data: step t draws B windows of L + 1 tokens from ``TOKENS.npy`` (a 1-D integer array) with a generator
seeded by ``(seed, t)``; rank r of K takes rows ``r*B/K .. (r+1)*B/K``. Each rank averages the loss over its
rows and DDP averages the gradients over ranks, so K processes compute the gradient of the same global batch
as one process (equal up to the order of the reductions) and end with the same weights.

Optimiser: AdamW (betas 0.9, 0.95), linear warmup over ``--warmup`` steps times a cosine decay to zero
(``attnkit.optim.warmup_cosine``), global gradient-norm clipping at ``--grad-clip`` (0 = off). ``--dtype
bfloat16`` keeps float32 weights and runs the forward under bfloat16 autocast; float32 and float64 train in
that dtype.

Output: ``DIR/config.json`` and ``DIR/model.safetensors`` under Hugging Face names (the inverse of attnkit's
checkpoint map), loadable by :func:`attnkit.pretrained.load_causal_lm` and by ``transformers``;
``DIR/checkpoint.pt`` (model, optimiser, step) every ``--checkpoint-every`` steps and at the end, for
``--resume``; a fresh run refuses an ``--out`` that holds one unless ``--overwrite`` is given, and ``--out``
must be writable before training starts. Every file is written atomically. Rank 0 logs one line per step
(``--quiet``: none). Bad arguments: one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
import torch.nn.functional as F

import torch

from .._arguments import Parser, UsageError, non_negative_float, non_negative_int, positive_float, positive_int
from ..io import atomic_write, read_json
from ..optim.schedules import warmup_cosine
from ..pretrained.checkpoint import SINGLE_FILE, checkpoint_tensors
from ..pretrained.families import REGISTRY
from ..pretrained.hf_config import decoder_config_from_hf
from .models import CausalLM

__all__ = ["main", "build_parser", "batch_windows", "ARCHITECTURES", "UsageError"]

PROG = "python -m attnkit.torch.train"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
# The transformers class of each family's causal LM, written into config.json's "architectures".
ARCHITECTURES = {name: entry.architecture for name, entry in REGISTRY.items()}
CHECKPOINT = "checkpoint.pt"


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser (errors raise :class:`UsageError` instead of exiting)."""
    p = Parser(prog=PROG, description="Data-parallel training of an attnkit causal LM twin (launch with torchrun).")
    p.add_argument("--config", required=True, type=Path, help="Hugging Face config.json of a family attnkit loads")
    p.add_argument("--data", required=True, type=Path, help="1-D integer token array (.npy)")
    p.add_argument("--steps", required=True, type=positive_int, help="optimiser steps in total")
    p.add_argument("--global-batch", required=True, type=positive_int,
                   help="sequences per step over all processes (a multiple of the process count)")
    p.add_argument("--seq-len", required=True, type=positive_int, help="tokens per sequence")
    p.add_argument("--lr", required=True, type=positive_float, help="peak learning rate")
    p.add_argument("--seed", type=non_negative_int, default=0, help="initial weights and batch sampling")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--out", required=True, type=Path, help="output folder (Hugging Face layout)")
    p.add_argument("--warmup", type=non_negative_int, default=0, help="linear warmup steps")
    p.add_argument("--grad-clip", type=non_negative_float, default=1.0, help="max global gradient norm (0 = off)")
    p.add_argument("--weight-decay", type=non_negative_float, default=0.0, help="AdamW weight decay")
    p.add_argument("--checkpoint-every", type=non_negative_int, default=0,
                   help="write DIR/checkpoint.pt every N steps (0 = only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a DIR that holds a run (its checkpoint and weights are removed first)")
    p.add_argument("--quiet", action="store_true", help="no log lines (e.g. when called from Python)")
    return p


def batch_windows(tokens: np.ndarray, *, seed: int, step: int, global_batch: int, seq_len: int, rank: int = 0,
                  world_size: int = 1) -> np.ndarray:
    """This rank's rows of step ``step``'s global batch: windows of ``seq_len + 1`` consecutive tokens.

    Shapes
    ------
    tokens (N,) int -> (global_batch / world_size, seq_len + 1) int64

    Examples
    --------
    >>> tokens = np.arange(100)
    >>> full = batch_windows(tokens, seed=0, step=3, global_batch=4, seq_len=5)
    >>> halves = [batch_windows(tokens, seed=0, step=3, global_batch=4, seq_len=5, rank=r, world_size=2)
    ...           for r in range(2)]
    >>> bool(np.array_equal(np.concatenate(halves), full)), full.shape
    (True, (4, 6))
    """
    starts = np.random.default_rng([seed, step]).integers(0, tokens.shape[0] - seq_len, size=global_batch)  # (B,)
    share = global_batch // world_size
    mine = starts[rank * share:(rank + 1) * share]  # (B/K,)
    return np.asarray(tokens[mine[:, None] + np.arange(seq_len + 1)], dtype=np.int64)  # (B/K, L + 1)


# -- checking the arguments ------------------------------------------------------------------------------
def _read_config(path: Path) -> tuple[dict, Any]:
    try:
        raw = read_json(path)
    except OSError as exc:
        raise UsageError(f"--config: cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"--config: {exc}") from None
    try:
        return raw, decoder_config_from_hf(raw)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--config: {exc}") from None


def _read_tokens(path: Path, vocab_size: int, seq_len: int) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--data: cannot read {path} as a .npy array: {exc}") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise UsageError(f"--data: {path} must hold a 1-D integer array, got shape {tokens.shape} and dtype "
                         f"{tokens.dtype}")
    if tokens.shape[0] < seq_len + 1:
        raise UsageError(f"--data: {path} holds {tokens.shape[0]} tokens, fewer than --seq-len + 1 = {seq_len + 1}")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise UsageError(f"--data: token ids must lie in [0, vocab_size={vocab_size}), got {low}..{high}")
    return tokens


def _check(args: argparse.Namespace, world_size: int) -> tuple[dict, Any, np.ndarray]:
    raw, config = _read_config(args.config)
    if args.global_batch % world_size:
        raise UsageError(f"--global-batch {args.global_batch} must be a multiple of the {world_size} processes")
    if config.rotary is None and args.seq_len > config.max_position_embeddings:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the config's max_position_embeddings = "
                         f"{config.max_position_embeddings}")
    if args.warmup > args.steps:
        raise UsageError(f"--warmup {args.warmup} exceeds --steps {args.steps}")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out: {args.out} exists and is not a folder")
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the run in --out and --overwrite replaces it: pass one of them")
    if args.resume and not (args.out / CHECKPOINT).is_file():
        raise UsageError(f"--resume: {args.out / CHECKPOINT} does not exist")
    held = _run_files(args.out)
    if held and not (args.resume or args.overwrite):
        raise UsageError(f"--out: {args.out} already holds a run ({', '.join(p.name for p in held)}): pass --resume "
                         f"to continue it, --overwrite to start afresh, or another folder")
    _check_writable(args.out)  # before training, not after it
    tokens = _read_tokens(args.data, config.vocab_size, args.seq_len)
    windows = tokens.shape[0] - args.seq_len
    if args.global_batch > windows:
        raise UsageError(f"--global-batch {args.global_batch} exceeds the {windows} distinct windows of --seq-len "
                         f"{args.seq_len} in --data")
    return raw, config, tokens


def _run_files(out: Path) -> list[Path]:
    """The files of an earlier run in ``out`` (what a fresh run would overwrite or leave stale)."""
    return [out / name for name in (CHECKPOINT, SINGLE_FILE, "config.json") if (out / name).exists()]


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise UsageError(f"--out: cannot write to {out}: {exc.strerror or exc}") from None


# -- files -----------------------------------------------------------------------------------------------
def _save_checkpoint(path: Path, model: CausalLM, optimizer: torch.optim.Optimizer, step: int, raw: dict) -> None:
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "config": raw}
    atomic_write(path, lambda f: torch.save(state, f))


def _save_hf_folder(out: Path, model: CausalLM, raw: dict, dtype_name: str) -> None:
    from safetensors.numpy import save

    params = {name: p.detach().cpu().numpy() for name, p in model.named_parameters()}
    tensors = checkpoint_tensors(model.config, params)
    config = dict(raw, architectures=[ARCHITECTURES[model.config.family]],
                  dtype="float32" if dtype_name == "bfloat16" else dtype_name)
    atomic_write(out / SINGLE_FILE, lambda f: f.write(save(tensors, metadata={"format": "pt"})))
    atomic_write(out / "config.json", lambda f: f.write((json.dumps(config, indent=2) + "\n").encode("utf-8")))


def _resume(args: argparse.Namespace, raw: dict, model: CausalLM, optimizer: torch.optim.Optimizer,
            device: torch.device) -> int:
    """Load the checkpoint of ``--out`` into the model and optimizer; returns the step to continue from."""
    path = args.out / CHECKPOINT
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        config, step = state["config"], int(state["step"])
    except Exception as exc:  # torch raises many types for a damaged file (EOFError, RuntimeError, pickle errors)
        raise UsageError(f"--resume: {path} is not a checkpoint this trainer wrote: {type(exc).__name__}: "
                         f"{str(exc)[:200]}") from None
    if config != raw:
        raise UsageError(f"--resume: {path} was trained with a different --config")
    if step > args.steps:
        raise UsageError(f"--resume: {path} is at step {step}, beyond --steps {args.steps}")
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except Exception as exc:
        raise UsageError(f"--resume: {path} does not fit this model: {type(exc).__name__}: {str(exc)[:200]}") \
            from None
    return step


def _clip(model: CausalLM, max_norm: float) -> float:
    """Clip the gradients to ``max_norm`` (if positive); returns their norm before clipping."""
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    return float(torch.linalg.vector_norm(torch.stack(
        [p.grad.detach().norm() for p in model.parameters() if p.grad is not None])))


# -- training --------------------------------------------------------------------------------------------
def _train(args: argparse.Namespace, raw: dict, config: Any, tokens: np.ndarray, rank: int, world_size: int,
           device: torch.device) -> None:
    dtype = DTYPES[args.dtype]
    weight_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    model = CausalLM(config, rng=args.seed).to(device=device, dtype=weight_dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=args.weight_decay)
    start = _resume(args, raw, model, optimizer, device) if args.resume else 0
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        net = model
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16 else nullcontext())
    tokens_per_step = args.global_batch * args.seq_len
    for step in range(start, args.steps):
        began = time.perf_counter()
        lr = warmup_cosine(step, peak=args.lr, warmup=args.warmup, total=args.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        windows = torch.from_numpy(batch_windows(tokens, seed=args.seed, step=step, global_batch=args.global_batch,
                                                 seq_len=args.seq_len, rank=rank,
                                                 world_size=world_size)).to(device)  # (B/K, L + 1)
        with autocast:
            logits = net(windows[:, :-1])  # (B/K, L, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(weight_dtype),
                               windows[:, 1:].reshape(-1))  # mean over this rank's tokens
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients over ranks: the global batch's mean-loss gradient
        grad_norm = _clip(model, args.grad_clip)
        optimizer.step()
        logged = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(logged)
            logged /= world_size
        done = step + 1
        if args.checkpoint_every and done % args.checkpoint_every == 0 and done < args.steps:
            if rank == 0:
                _save_checkpoint(args.out / CHECKPOINT, model, optimizer, done, raw)
            if world_size > 1:
                dist.barrier()
        if rank == 0 and not args.quiet:
            seconds = time.perf_counter() - began
            print(f"step {done}/{args.steps} loss {float(logged):.6f} lr {lr:.4e} grad_norm {grad_norm:.4f} "
                  f"tokens/s {tokens_per_step / seconds:.0f}", flush=True)
    if rank == 0:
        _save_checkpoint(args.out / CHECKPOINT, model, optimizer, args.steps, raw)
        _save_hf_folder(args.out, model, raw, args.dtype)
        if not args.quiet:
            print(f"wrote {args.out / 'config.json'} and {args.out / SINGLE_FILE}", flush=True)
    if world_size > 1:
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    """Run the trainer; returns the exit status (2 for bad arguments, with one line on stderr)."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = build_parser().parse_args(argv)
        raw, config, tokens = _check(args, world_size)
    except UsageError as exc:
        if rank == 0:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        if args.overwrite:
            for stale in _run_files(args.out):
                stale.unlink()
    if world_size > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
        dist.barrier()
    try:
        _train(args, raw, config, tokens, rank, world_size, device)
    except UsageError as exc:
        if rank == 0:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if rank == 0:
            print(f"{PROG}: interrupted (the last checkpoint in {args.out} is intact)", file=sys.stderr)
        return 130
    finally:
        if world_size > 1:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
