"""Benchmark one training step of a 4-layer pre-norm Transformer encoder: attnkit vs PyTorch (CPU).

One step = forward, MSE loss against a fixed random target, backward, Adam step, on

* ``attnkit``  ``attnkit.layers.TransformerEncoder(4, 256, 8, 1024, norm_first=True, attention_bias=True)``
  cast to float32, with ``attnkit.optim.Adam``;
* ``torch``    ``torch.nn.TransformerEncoder(TransformerEncoderLayer(256, 8, 1024, dropout=0.0,
  batch_first=True, norm_first=True, layer_norm_eps=1e-6), 4, norm=LayerNorm(256, eps=1e-6))`` with
  ``torch.optim.Adam``,

float32, batch 8, L = 512 by default. attnkit's weights (attention biases included, made non-zero) are
copied into the torch model, so both compute the same function; the script checks that before timing
(outputs, loss and every parameter gradient but the key biases', whose true gradient is zero; it stops
if they disagree beyond float32 tolerance) and
prints the largest differences.

Threads: "n threads" means ``torch.set_num_threads(n)``, NumPy's BLAS limited to ``n`` threads
(threadpoolctl) and attnkit's own thread pool (tiled attention, chunked float32 GELU) run with ``n``
threads (its default is every core, so the script sets :func:`attnkit.num_threads` for the run).

Timing: best of ``--repeats`` steps after ``--warmup`` untimed ones, attnkit and torch alternating step by
step so that a change in machine load hits both alike; the best step's forward / backward / optimizer
split is printed too. The ratio is attnkit time / torch time (target: at most 1.2x).

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m attnkit.benchmarks.encoder --threads 2 1
    ... attnkit.benchmarks.encoder --threads 1 --profile   # + cProfile of one attnkit step (top functions)

(also ``benchmarks/bench_encoder.py`` in a checkout). Needs torch; without it the benchmark says so in one
line and exits with status 1.

(OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, when set, make OpenBLAS pick slower kernels; unset them here.)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..kernels._threads import num_threads, thread_count_argument
from ..layers import TransformerEncoder
from ..optim import Adam
from ._support import blas_limit, import_torch, torch_missing_line, write_json
from .machine import describe, machine_info

__all__ = ["parse_args", "run", "main", "build_models", "check_agreement", "Steps"]


def parse_args(argv=None) -> argparse.Namespace:
    """The benchmark's options (``--help`` lists them)."""
    p = argparse.ArgumentParser(prog="python -m attnkit.benchmarks.encoder", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=thread_count_argument, nargs="+", default=[2],
                   help="thread counts to run, e.g. 2 1 (default 2); torch, BLAS and attnkit's tiles alike")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--seq", type=int, default=512, help="sequence length L")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5, help="timed steps of each (best is kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each first")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="after timing, print a cProfile of one attnkit step (top functions by own time)")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


@contextmanager
def thread_limit(n: int):
    """torch intra-op threads, NumPy's BLAS threads and attnkit's tile threads all set to ``n``."""
    import torch

    old_torch = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with blas_limit(n), num_threads(n):  # attnkit's tiles and chunked float32 GELU
            yield
    finally:
        torch.set_num_threads(old_torch)


def build_models(args):
    """The attnkit encoder (float32) and a torch copy with the same weights."""
    import torch

    rng = np.random.default_rng(args.seed)
    ours = TransformerEncoder(args.layers, args.d_model, args.heads, args.d_ff, norm_first=True,
                              activation="relu", eps=1e-6, attention_bias=True, rng=rng).astype(np.float32)
    # Non-trivial biases and norm parameters, so that the copy is checked for every parameter.
    for name, p in ours.named_parameters():
        if name.rsplit(".", 1)[-1].startswith(("b", "beta")):
            p[...] = rng.normal(0.0, 0.02, size=p.shape)
        elif name.rsplit(".", 1)[-1].startswith("gamma"):
            p[...] = 1.0 + rng.normal(0.0, 0.02, size=p.shape)

    layer = torch.nn.TransformerEncoderLayer(args.d_model, args.heads, args.d_ff, dropout=0.0, activation="relu",
                                             layer_norm_eps=1e-6, batch_first=True, norm_first=True)
    theirs = torch.nn.TransformerEncoder(layer, args.layers, norm=torch.nn.LayerNorm(args.d_model, eps=1e-6),
                                         enable_nested_tensor=False)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    with torch.no_grad():
        for block, tl in zip(ours.layers, theirs.layers):
            mha = block.attention
            tl.self_attn.in_proj_weight.copy_(t(np.concatenate([mha.W_Q.T, mha.W_K.T, mha.W_V.T])))
            tl.self_attn.in_proj_bias.copy_(t(np.concatenate([mha.b_Q, mha.b_K, mha.b_V])))
            tl.self_attn.out_proj.weight.copy_(t(mha.W_O.T))
            tl.self_attn.out_proj.bias.copy_(t(mha.b_O))
            tl.linear1.weight.copy_(t(block.W1.T))
            tl.linear1.bias.copy_(t(block.b1))
            tl.linear2.weight.copy_(t(block.W2.T))
            tl.linear2.bias.copy_(t(block.b2))
            tl.norm1.weight.copy_(t(block.gamma1))
            tl.norm1.bias.copy_(t(block.beta1))
            tl.norm2.weight.copy_(t(block.gamma2))
            tl.norm2.bias.copy_(t(block.beta2))
        theirs.norm.weight.copy_(t(ours.norm.gamma))
        theirs.norm.bias.copy_(t(ours.norm.beta))
    theirs.train()
    return ours, theirs


def torch_grads_as_attnkit(theirs, layers: int) -> dict[str, np.ndarray]:
    """The torch model's gradients under attnkit's parameter names and layouts."""
    out = {}
    for i, tl in enumerate(theirs.layers[:layers]):
        e = tl.self_attn.embed_dim
        w, b = tl.self_attn.in_proj_weight.grad.numpy(), tl.self_attn.in_proj_bias.grad.numpy()
        for j, name in enumerate("QKV"):
            out[f"layers.{i}.attention.W_{name}"] = w[j * e:(j + 1) * e].T
            out[f"layers.{i}.attention.b_{name}"] = b[j * e:(j + 1) * e]
        out[f"layers.{i}.attention.W_O"] = tl.self_attn.out_proj.weight.grad.numpy().T
        out[f"layers.{i}.attention.b_O"] = tl.self_attn.out_proj.bias.grad.numpy()
        ffn, norm1, norm2 = f"layers.{i}.ffn", f"layers.{i}.norm1", f"layers.{i}.norm2"  # the block's sublayers
        out[f"{ffn}.W1"], out[f"{ffn}.b1"] = tl.linear1.weight.grad.numpy().T, tl.linear1.bias.grad.numpy()
        out[f"{ffn}.W2"], out[f"{ffn}.b2"] = tl.linear2.weight.grad.numpy().T, tl.linear2.bias.grad.numpy()
        out[f"{norm1}.gamma"], out[f"{norm1}.beta"] = tl.norm1.weight.grad.numpy(), tl.norm1.bias.grad.numpy()
        out[f"{norm2}.gamma"], out[f"{norm2}.beta"] = tl.norm2.weight.grad.numpy(), tl.norm2.bias.grad.numpy()
    out["norm.gamma"], out["norm.beta"] = theirs.norm.weight.grad.numpy(), theirs.norm.bias.grad.numpy()
    return out


class Steps:
    """One training step of each model, timed by phase (forward + loss, backward, optimizer)."""

    def __init__(self, args, ours, theirs):
        import torch

        self.torch = torch
        rng = np.random.default_rng(args.seed + 1)
        shape = (args.batch, args.seq, args.d_model)
        self.x = rng.standard_normal(shape, dtype=np.float32)
        self.target = rng.standard_normal(shape, dtype=np.float32)
        self.tx, self.ttarget = torch.from_numpy(self.x), torch.from_numpy(self.target)
        self.ours, self.theirs = ours, theirs
        self.opt_ours = Adam(ours, lr=args.lr)
        self.opt_theirs = torch.optim.Adam(theirs.parameters(), lr=args.lr)

    def attnkit(self, step: bool = True):
        t0 = time.perf_counter()
        self.ours.zero_grad()
        y = self.ours.forward(self.x)  # (B, L, D)
        diff = y - self.target
        loss = float(np.mean(diff * diff))
        grad = diff * np.float32(2.0 / diff.size)  # d loss / d y
        t1 = time.perf_counter()
        self.ours.backward(grad)
        t2 = time.perf_counter()
        if step:
            self.opt_ours.step()
        t3 = time.perf_counter()
        return y, loss, (t1 - t0, t2 - t1, t3 - t2)

    def torch_step(self, step: bool = True):
        t0 = time.perf_counter()
        self.opt_theirs.zero_grad(set_to_none=True)
        y = self.theirs(self.tx)
        loss = self.torch.nn.functional.mse_loss(y, self.ttarget)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if step:
            self.opt_theirs.step()
        t3 = time.perf_counter()
        return y.detach().numpy(), loss.item(), (t1 - t0, t2 - t1, t3 - t2)


def check_agreement(steps: Steps) -> dict:
    """Forward, loss and gradients of both models on the same input (no optimizer step)."""
    y_ours, loss_ours, _ = steps.attnkit(step=False)
    y_theirs, loss_theirs, _ = steps.torch_step(step=False)
    grads_theirs = torch_grads_as_attnkit(steps.theirs, len(steps.ours.layers))
    grad_rel = {}
    for name, g in steps.ours.named_gradients():
        if name.endswith(".b_K"):
            continue  # the key bias shifts every score of a query alike: its true gradient is 0, both give noise
        ref = grads_theirs[name]
        grad_rel[name] = float(np.linalg.norm(g - ref) / max(np.linalg.norm(ref), 1e-30))
    worst = max(grad_rel, key=grad_rel.get)
    report = {"output_max_abs_diff": float(np.abs(y_ours - y_theirs).max()),
              "output_max_abs": float(np.abs(y_theirs).max()),
              "loss_attnkit": loss_ours, "loss_torch": loss_theirs,
              "grad_max_rel_diff": grad_rel[worst], "grad_worst_param": worst}
    steps.ours.zero_grad()
    steps.opt_theirs.zero_grad(set_to_none=True)
    return report


def _agree_or_stop(steps: Steps) -> dict:
    """Check that both models compute the same function before timing them; stop if they do not."""
    agree = check_agreement(steps)
    # float32 through 4 layers: ~1e-6 in the outputs. The gradients differ more, by up to ~1e-3 in norm:
    # a few of the 4M ReLU inputs per layer lie within float32 rounding of 0 and switch sides between the
    # two implementations, each moving one column of W1's gradient (in float64 everything agrees to 1e-14).
    ok = agree["output_max_abs_diff"] <= 1e-4 * max(1.0, agree["output_max_abs"]) and \
        agree["grad_max_rel_diff"] <= 1e-2
    print(f"  agreement: max |y_attnkit - y_torch| = {agree['output_max_abs_diff']:.2e} "
          f"(max |y| = {agree['output_max_abs']:.2f}); loss {agree['loss_attnkit']:.6f} vs "
          f"{agree['loss_torch']:.6f}; largest gradient difference ||g_attnkit - g_torch|| / ||g_torch|| = "
          f"{agree['grad_max_rel_diff']:.1e} ({agree['grad_worst_param']}): {'ok' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        raise SystemExit("attnkit and torch disagree beyond float32 tolerance; not timing")
    return agree


def _best_steps(steps: Steps, args) -> dict[str, tuple[float, tuple]]:
    """Best total step time of each model and its (forward, backward, optimizer) split, runs interleaved."""
    runners = {"attnkit": steps.attnkit, "torch": steps.torch_step}
    for fn in runners.values():
        for _ in range(args.warmup):
            fn()
    best = {name: (float("inf"), None) for name in runners}
    for _ in range(args.repeats):
        for name, fn in runners.items():
            phases = fn()[2]
            if sum(phases) < best[name][0]:
                best[name] = (sum(phases), phases)
    return best


def _profile(steps: Steps) -> str:
    prof = cProfile.Profile()
    prof.runcall(steps.attnkit)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(20)
    return buf.getvalue()


def bench(args, threads: int) -> dict:
    """Agreement, best step times and their ratio at ``threads`` threads."""
    with thread_limit(threads):
        ours, theirs = build_models(args)
        steps = Steps(args, ours, theirs)
        agree = _agree_or_stop(steps)
        best = _best_steps(steps, args)
        profile_text = _profile(steps) if args.profile else None
    row = {"threads": threads, "agreement": agree}
    for name, (total, phases) in best.items():
        row[name] = {"step_ms": total * 1e3, "forward_ms": phases[0] * 1e3, "backward_ms": phases[1] * 1e3,
                     "optimizer_ms": phases[2] * 1e3}
    row["ratio"] = best["attnkit"][0] / best["torch"][0]
    if profile_text:
        row["profile"] = profile_text
    return row


def _print_row(row: dict) -> None:
    for name in ("attnkit", "torch"):
        r = row[name]
        print(f"  {name:8s} step {r['step_ms']:8.1f} ms  (forward+loss {r['forward_ms']:7.1f}, backward "
              f"{r['backward_ms']:7.1f}, optimizer {r['optimizer_ms']:6.1f})")
    print(f"  ratio attnkit / torch: {row['ratio']:.2f}x (target <= 1.2x: "
          f"{'met' if row['ratio'] <= 1.2 else 'MISSED'})", flush=True)
    if "profile" in row:
        print(f"\n  cProfile of one attnkit step, {row['threads']} thread(s):\n{row['profile']}")


def run(args: argparse.Namespace) -> dict | None:
    """Run the benchmark described by ``args``; print it and return the report (None without torch)."""
    info = machine_info()
    for line in describe(info, threads=args.threads):
        print(line)
    if import_torch() is None:
        print(torch_missing_line("the encoder benchmark times attnkit against torch and cannot run"))
        return None
    print(f"# {args.layers}-layer pre-norm encoder, d_model={args.d_model}, heads={args.heads}, d_ff={args.d_ff}, "
          f"L={args.seq}, batch={args.batch}, float32; step = forward + MSE + backward + Adam; "
          f"best of {args.repeats} after {args.warmup} warmup, interleaved")
    rows = []
    for threads in args.threads:
        print(f"\n## {threads} thread(s)", flush=True)
        row = bench(args, threads)
        _print_row(row)
        rows.append(row)
    report = {"machine": info, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "results": rows}
    if args.json:
        write_json(args.json, report)
        print(f"\nwrote {args.json}")
    return report


def main(argv=None) -> int:
    """``python -m attnkit.benchmarks.encoder [options]``; 1 when torch is missing."""
    return 0 if run(parse_args(argv)) is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
