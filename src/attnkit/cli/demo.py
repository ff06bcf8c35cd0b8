"""``attnkit demo``: train a small Transformer on a synthetic task, draw its attention, save the model.

The tasks are the rows of :data:`DEMO_TASKS`: a name, a one-line help and a ``run(args, out) -> int``
that trains, prints and writes into the checked output folder ``out``. Adding a task is adding a row
(the ``--task`` choices and help are built from the table); options that only one task uses are added by
:func:`add_parser` and ignored by the others.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .. import _progress
from ._common import (
    UsageError,
    bounded_int,
    output_folder,
    positive_float,
    printable,
    query_labels,
    require_matplotlib,
    save_figure,
    write_explorer,
)

__all__ = ["NAME", "DEMO_TASKS", "DemoTask", "add_parser", "run"]

NAME = "demo"
MAX_STEPS = 10_000_000
MAX_BATCH = 65_536
MAX_SEQ_LEN = 1024


class DemoTask(NamedTuple):
    """One ``--task`` of the demo: what it teaches (for ``--help``) and how it runs."""

    help: str
    run: Callable[[argparse.Namespace, Path], int]


def _task_config(config_class: Any, args: argparse.Namespace, **fixed: Any) -> Any:
    """A task's configuration: its own defaults, overridden by ``--steps``, ``--batch-size`` and ``--lr`` where
    the command line gives them (each task has its own defaults, so the options default to None)."""
    given = {name: getattr(args, name) for name in ("steps", "batch_size", "lr") if getattr(args, name) is not None}
    try:
        return config_class(seed=args.seed, **fixed, **given)
    except (TypeError, ValueError) as exc:  # a value this task refuses: the message names the field
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        raise UsageError(f"{exc} (from {flags})" if flags else str(exc)) from None


# -- the token-tagging tasks (sort, reverse, copy_offset) ------------------------------------------------
class _Progress:
    """The training's progress: on a terminal, the one progress line (:mod:`attnkit._progress`) with the running
    loss and accuracy as its detail; elsewhere (a pipe, a file, a log) or with ``--no-progress``, a plain line
    every 10% of the steps."""

    def __init__(self, total: int, desc: str, plain: bool) -> None:
        self.total, self.desc = total, desc
        self.line = None if plain or not _progress.wanted(None) else _progress.progress(total, desc)
        self.every = max(1, total // 10)
        self.loss = self.acc = None

    def __call__(self, step: int, loss: float, acc: float | None = None) -> None:
        k = 0.9 if step > 1 else 0.0  # exponential running means, for a readable line
        self.loss = loss if self.loss is None else k * self.loss + (1 - k) * loss
        if acc is not None:
            self.acc = acc if self.acc is None else k * self.acc + (1 - k) * acc
        if self.line is not None:
            if step % 10 == 0 or step == self.total:
                self.line.set_detail(f"loss {self.loss:.4f}" + ("" if self.acc is None else f", acc {self.acc:6.1%}"))
            self.line.update(1)
        elif step % self.every == 0 or step == self.total:
            shown = f"loss {self.loss:.4f}" + ("" if self.acc is None else f"  accuracy {self.acc:6.1%}")
            print(f"{self.desc}: step {step:>{len(str(self.total))}}/{self.total}  {shown}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.line is not None:
            self.line.close()


def _with_progress(args: argparse.Namespace, steps: int, train: Callable[[_Progress], Any]) -> Any:
    """``train(progress)`` under a progress bar labelled with the task, closed however training ends."""
    from ..demos.training import TrainingDiverged

    progress = _Progress(steps, f"training ({args.task})", plain=args.no_progress)
    try:
        # Overflow warnings of a diverging run would precede the one line that says what happened.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return train(progress)
    except TrainingDiverged as exc:  # a bad --lr: one line, exit 2, nothing saved
        raise UsageError(f"{exc} (--lr)") from None
    finally:
        progress.close()


def _words(ids: Sequence[int], tokens: Sequence[str]) -> str:
    return printable(" ".join(tokens[t] for t in ids))


def _train(args: argparse.Namespace) -> Any:
    from ..demos import encoder as demo

    config = _task_config(demo.DemoConfig, args, task=args.task, seq_len=args.seq_len)
    model = demo.build_model(config)
    print(f"attnkit demo: learn to {args.task.replace('_', ' ')} {config.seq_len} digits with a "
          f"{config.num_layers}-layer, {config.num_heads}-head Transformer encoder (d_model {config.d_model}, "
          f"{model.num_parameters():,} parameters, float32), {config.steps} steps of Adam, batch "
          f"{config.batch_size}, seed {config.seed}", flush=True)
    if importlib.util.find_spec("threadpoolctl") is None:
        print("note: threadpoolctl is not installed, so BLAS may run several threads on these tiny matrices, "
              "which is slow on a busy machine (pip install 'attnkit[fast]')", file=sys.stderr)
    return _with_progress(args, config.steps, lambda progress: demo.train(config, on_step=progress))


def _report(result: Any) -> None:
    from ..demos import tasks

    config, tokens = result.config, tasks.token_names(result.config.num_digits)
    ex, pred, want = result.example, result.example_prediction, result.example_target
    verdict = "correct" if (pred == want).all() else f"expected {_words(want, tokens)}"
    print(f"held-out accuracy: {result.heldout_accuracy:.2%} of tokens, {result.heldout_sequence_accuracy:.2%} "
          f"of whole sequences ({config.eval_size} new sequences); trained in {result.seconds:.1f} s")
    print(f"example: input  {_words(ex, tokens)}")
    print(f"         output {_words(pred, tokens)}  ({verdict})")


def _draw(result: Any, out: Path) -> None:
    from ..demos import encoder as demo
    from ..demos import tasks
    from ..viz import plot_attention, plot_training_curve

    config, tokens = result.config, tasks.token_names(result.config.num_digits)
    ex, pred = result.example, result.example_prediction
    weights = demo.attention_maps(result.model, ex)  # (N, H, L, L)
    fig = plot_attention(weights, query_labels(ex, pred, tokens), [tokens[t] for t in ex],
                         title=f"{config.task}: attention of every layer and head for the input "
                               f"{_words(ex, tokens)}  (rows: input\u2192output of the query)")
    save_figure(fig, out / "attention.png")
    fig = plot_training_curve(result.losses, result.accuracies, eval_steps=result.eval_steps,
                              eval_accuracy=result.eval_accuracies,
                              title=f"attnkit demo: {config.task}, held-out token accuracy "
                                    f"{result.heldout_accuracy:.2%}")
    save_figure(fig, out / "loss.png")
    write_explorer([tokens[t] for t in ex], weights, out / "attention.html",
                   f"{config.task}: {_words(ex, tokens)} \u2192 {_words(pred, tokens)}",
                   [f"layer {i}" for i in range(config.num_layers)], [f"head {j}" for j in range(config.num_heads)])


def run_tagging_task(args: argparse.Namespace, out: Path) -> int:
    """Train a :class:`~attnkit.models.TokenTagger` on ``args.task``; write pictures and the model to ``out``."""
    from ..demos import encoder as demo
    from ..demos import tasks

    result = _train(args)
    _report(result)
    _draw(result, out)
    model_path, config_path = demo.save_model(result, out)
    config, tokens = result.config, tasks.token_names(result.config.num_digits)
    print(f"wrote {printable(out / 'attention.png')} (attention of {config.num_layers} layers x "
          f"{config.num_heads} heads for the example)")
    print(f"wrote {printable(out / 'loss.png')} (training loss and accuracy)")
    print(f"wrote {printable(model_path)} and {printable(config_path)}; draw the attention for another input with:")
    print(f"  attnkit attention --model {printable(out)} --input \"{_words(result.example[::-1], tokens)}\" "
          f"-o attention2.png")
    return 0


# -- the sequence-to-sequence task (dates) ---------------------------------------------------------------
def run_dates_task(args: argparse.Namespace, out: Path) -> int:
    """Train a :class:`~attnkit.models.Seq2SeqTransformer` to write dates as ISO; write the cross-attention
    alignment picture, the training curve and the model to ``out``."""
    from ..demos import dates as seq2seq_demo
    from ..viz import plot_attention, plot_training_curve

    config = _task_config(seq2seq_demo.DatesConfig, args)
    model = seq2seq_demo.build_model(config)
    print(f"attnkit demo: learn to write dates as YYYY-MM-DD with a {config.num_layers}+{config.num_layers}-layer, "
          f"{config.num_heads}-head encoder-decoder Transformer (d_model {config.d_model}, "
          f"{model.num_parameters():,} parameters, float32), {config.steps} steps of Adam, batch "
          f"{config.batch_size}, seed {config.seed}", flush=True)
    result = _with_progress(args, config.steps, lambda progress: seq2seq_demo.train(config, on_step=progress))
    print(f"held-out exact match ({config.eval_size} dates never seen in training): greedy "
          f"{result.greedy_exact_match:.2%}, beam search ({config.num_beams} beams) {result.beam_exact_match:.2%}; "
          f"trained in {result.train_seconds:.1f} s ({config.steps} steps, {result.train_cpu_seconds:.1f} s of CPU), "
          f"scored in {result.eval_seconds:.1f} s")
    for source, expected, got in result.examples[:4]:
        verdict = "correct" if got == expected else f"expected {expected}"
        print(f"  {printable(source):<34} -> {printable(got)}  ({verdict})")
    source = result.examples[0][0]
    weights, out_tokens, src_tokens = seq2seq_demo.alignment(result.model, source)
    fig = plot_attention(weights, out_tokens, src_tokens,
                         title=f"cross-attention of the last decoder block (mean over heads): "
                               f"{printable(source)} -> {printable(''.join(out_tokens[:-1]))}")
    save_figure(fig, out / "alignment.png")
    save_figure(plot_training_curve(result.losses, title="attnkit demo: dates, training loss"), out / "loss.png")
    model_path, config_path = seq2seq_demo.save_model(result, out)
    print(f"wrote {printable(out / 'alignment.png')} (output characters against source characters)")
    maps = seq2seq_demo.attention_maps(result.model, source)
    src_shown = [printable(t) for t in maps.source_tokens]
    reads = [printable(t) for t in maps.decoder_tokens]
    writes = [f"{r}\u2192{printable(w)}" for r, w in zip(reads, maps.output_tokens, strict=True)]
    layers = [f"layer {i}" for i in range(maps.cross.shape[0])]
    heads = [f"head {j}" for j in range(maps.cross.shape[1])]
    said = f"{printable(source)} \u2192 {printable(''.join(maps.output_tokens[:-1]))}"
    write_explorer(src_shown, maps.cross, out / "cross_attention.html", f"cross-attention: {said}", layers, heads,
                   query_tokens=writes)
    write_explorer(reads, maps.decoder, out / "decoder_attention.html", f"decoder self-attention: {said}", layers,
                   heads)
    write_explorer(src_shown, maps.encoder, out / "encoder_attention.html", f"encoder self-attention: {said}",
                   [f"layer {i}" for i in range(maps.encoder.shape[0])], heads)
    print(f"wrote {printable(out / 'loss.png')} (training loss)")
    print(f"wrote {printable(model_path)} and {printable(config_path)}")
    return 0


# -- the decoder-only language model task (addition) -------------------------------------------------------
def run_addition_task(args: argparse.Namespace, out: Path) -> int:
    """Train a Llama-style :class:`~attnkit.models.CausalLM` to add two numbers; decode held-out sums with the
    KV cache; write the training curve and the model to ``out``."""
    from ..demos import addition as lm_demo
    from ..io import atomic_write
    from ..viz import plot_training_curve

    config = _task_config(lm_demo.AdditionConfig, args)
    cfg = config.model_config()
    print(f"attnkit demo: learn {config.digits}-digit addition with a {cfg.num_layers}-layer decoder-only language "
          f"model (Llama-style: RMSNorm, SwiGLU, rotary, {cfg.num_heads} query / {cfg.num_kv_heads} key-value heads, "
          f"d_model {cfg.hidden_size}, float32), {config.steps} steps of Adam, batch {config.batch_size}, "
          f"seed {config.seed}", flush=True)
    result = _with_progress(args, config.steps, lambda progress: lm_demo.train_addition(config, progress=progress))
    print(f"held-out exact match ({config.eval_size} new sums, greedy decoding with the KV cache): "
          f"{result.accuracy:.2%}; trained in {result.seconds:.1f} s")
    for line in result.examples[:4]:
        print(f"  {printable(line)}")
    save_figure(plot_training_curve(result.losses, title="attnkit demo: addition, training loss"), out / "loss.png")
    result.model.save(out / "model.npz")
    atomic_write(out / "config.json", lambda f: f.write(json.dumps(cfg.to_dict(), indent=2).encode()))
    print(f"wrote {printable(out / 'loss.png')} (training loss)")
    print(f"wrote {printable(out / 'model.npz')} and {printable(out / 'config.json')} (the DecoderConfig)")
    print(f"explain an answer with: attnkit explain {printable(out)} --prompt \"07+35=\" --html add.html")
    return 0


DEMO_TASKS: dict[str, DemoTask] = {
    "sort": DemoTask("sort the digits", run_tagging_task),
    "reverse": DemoTask("reverse them", run_tagging_task),
    "copy_offset": DemoTask("shift them one place", run_tagging_task),
    "dates": DemoTask("rewrite dates like \"3rd of March 1998\" as 1998-03-03 (encoder-decoder, beam search)",
                      run_dates_task),
    "addition": DemoTask("add two 2-digit numbers (decoder-only language model, KV-cache decoding)",
                         run_addition_task),
}


# -- the command -----------------------------------------------------------------------------------------
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``attnkit demo`` and its arguments."""
    from ..demos.addition import AdditionConfig
    from ..demos.dates import DatesConfig
    from ..demos.encoder import DemoConfig

    d = DemoConfig()
    p = subparsers.add_parser(
        NAME, help="train a small Transformer on a synthetic task and draw its attention",
        description="Train a small Transformer encoder (attnkit modules, Adam, pure NumPy) on a synthetic task "
                    "that needs attention, generated in-process from a seed. Prints the held-out accuracy and "
                    "writes OUT/attention.png (one heatmap per layer and head for a held-out example), "
                    "OUT/attention.html (the same weights in an interactive page), OUT/loss.png (training "
                    "curve) and OUT/model.npz + OUT/model.json (reload them with "
                    "'attnkit attention --model OUT').")
    tasks_help = "; ".join(f"{name}: {task.help}" for name, task in DEMO_TASKS.items())
    p.add_argument("--task", choices=tuple(DEMO_TASKS), default=d.task, help=f"{tasks_help} (default {d.task})")
    p.add_argument("--steps", type=bounded_int(1, MAX_STEPS), default=None,
                   help=f"training steps (default {d.steps}; dates: {DatesConfig().steps}; "
                        f"addition: {AdditionConfig().steps})")
    p.add_argument("--seed", type=bounded_int(0, 2**63 - 1), default=d.seed,
                   help=f"seed of the data and the initial weights (default {d.seed})")
    p.add_argument("--out", default="attnkit-demo", help="output folder (default attnkit-demo)")
    p.add_argument("--batch-size", type=bounded_int(1, MAX_BATCH), default=None,
                   help=f"sequences per step (default {d.batch_size}; dates: {DatesConfig().batch_size})")
    p.add_argument("--lr", type=positive_float, default=None,
                   help=f"peak Adam learning rate (default {d.lr}; dates: {DatesConfig().lr})")
    p.add_argument("--seq-len", type=bounded_int(1, MAX_SEQ_LEN), default=d.seq_len,
                   help=f"digits per sequence (default {d.seq_len})")
    p.add_argument("--no-progress", action="store_true",
                   help="print a line every 10%% instead of a progress line (as on a pipe)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Check the output folder and the plotting extra, then run the chosen task."""
    require_matplotlib("attnkit demo draws its pictures with matplotlib and")
    out = output_folder(args.out)
    return DEMO_TASKS[args.task].run(args, out)
