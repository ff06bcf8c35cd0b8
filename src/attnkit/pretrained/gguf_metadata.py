"""Reading a GGUF file's metadata into the Hugging Face ``config.json`` a family reads, and the per-family entry
(:class:`GGUFArchitecture`) that says how: each family module states its own (``Family.gguf``), and
:mod:`.gguf_file` finds it by the file's ``general.architecture``.

The pieces here are what most families share: typed access to ``{arch}.*`` keys naming the file and the key on
any error (:class:`GGUFMetadata`), the heads and rotary features, the rotary scalings llama.cpp writes, the
special token ids, and :func:`common_config`, the keys every rotary family shares. A family with more (Gemma's
windows and soft-caps, Phi-3's longrope tensors, GPT-2's learned positions) writes its own reader from them.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._extra import import_extra

__all__ = ["GGUFArchitecture", "GGUFMetadata", "common_config", "special_token_ids", "special_ids", "vocab_size",
           "rope_factors", "rope_scaling", "head_counts", "rotated_features", "layer_counts"]

_MAX_INT = 2**31 - 1  # no size of a real model comes near it (the config reader's bound)


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one family's GGUF files are read: what llama.cpp's converter wrote, and what to undo.

    Attributes
    ----------
    name : str
        ``general.architecture`` (llama.cpp's name: ``"gemma3"`` for ``gemma3_text``).
    config : callable (GGUFFile, GGUFMetadata) -> dict
        The Hugging Face ``config.json`` dict the metadata describes (default :func:`common_config`).
    rope_tensors : tuple of str
        Tensors that hold rotary divisors rather than weights, read into the config.
    bias_flags : tuple of (str, str)
        ``(config key, tensor)`` pairs: the key is True when the tensor is present (llama.cpp loads biases
        when the file has them).
    permuted_qk : bool
        The rows of q and k are permuted per head (GGML rotates adjacent pairs): permuted back.
    norm_offset : bool
        Every RMSNorm weight is stored as ``1 + w``: 1 is subtracted.
    transposed : tuple of str
        Tensor-name endings stored transposed (GPT-2's ``Conv1D`` matrices): read back transposed.
    squeezed : tuple of str
        Tensor-name endings stored without their unit second axis (LFM2's convolution weights, (C, 1, K) as
        (C, K)): read back with it.
    renamed : tuple of (str, str)
        Hugging Face name endings the converter renames before it looks the name up in ``gguf``'s table
        (DeepSeek-V3's ``e_score_correction_bias`` as ``e_score_correction.bias``).
    nextn_blocks : bool
        The file keeps ``{arch}.nextn_predict_layers`` multi-token-prediction blocks after the model's (GLM-4.5):
        their tensors are not read.
    tokenizer_style : str
        How a SentencePiece vocabulary's spaces are read: ``"llama"``, ``"gemma"`` (no space prepended) or
        ``"phi3"`` (a normalizer's prefix space).
    plain_norms : tuple of str
        With ``norm_offset``, the norm weights (name endings) stored as they are (Qwen3.5's Gated DeltaNet norm).
    restored : tuple of str
        Tensor-name endings the converter changed in a way of the family's own: read back by ``restore``.
    restore : callable (name, values, DecoderConfig) -> ndarray, optional
        The family's undoing of them: the dequantized float32 values in their stored shape -> the Hugging Face
        tensor (any shape of the same size).
    tensors : callable (DecoderConfig, list of TensorMap) -> list of TensorMap, optional
        The family's checkpoint maps (without the base prefix) as the converter writes them, where it does not
        write each Hugging Face tensor as one GGUF tensor: a fused tensor stored as its parts becomes one map per
        part (:meth:`~attnkit.pretrained.tensor_map.TensorMap.parts_apart`), each source a Hugging Face name
        that ``gguf``'s table gives the part's GGUF name (Granite's ``input_linear`` as ``gate_proj`` and
        ``up_proj``). Default: the checkpoint maps as they are.
    """

    name: str
    config: Callable[[Any, GGUFMetadata], dict[str, Any]] | None = None
    rope_tensors: tuple[str, ...] = ()
    bias_flags: tuple[tuple[str, str], ...] = ()
    permuted_qk: bool = False
    norm_offset: bool = False
    transposed: tuple[str, ...] = ()
    squeezed: tuple[str, ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()
    nextn_blocks: bool = False
    tokenizer_style: str = "llama"
    plain_norms: tuple[str, ...] = ()
    restored: tuple[str, ...] = ()
    restore: Callable[[str, Any, Any], Any] | None = None
    tensors: Callable[[Any, list[Any]], list[Any]] | None = None

    def hf_config(self, file: Any) -> dict[str, Any]:
        """The ``config.json`` dict of ``file``'s metadata, biases read from its tensors."""
        meta = GGUFMetadata(file, self)
        config = (self.config or common_config)(file, meta)
        for key, tensor in self.bias_flags:
            config[key] = tensor in file.tensors
        return config

    def fix(self, name: str) -> str:
        """What llama.cpp changed in tensor ``name``, to undo: ``"restore"`` (the family's own), ``"permute_q"``,
        ``"permute_k"``, ``"norm_offset"``, ``"transpose"``, ``"squeeze"`` or ``""``."""
        if self.restored and name.endswith(self.restored):
            return "restore"
        if self.permuted_qk and ".attn_q." in name:
            return "permute_q"
        if self.permuted_qk and ".attn_k." in name:
            return "permute_k"
        if self.norm_offset and name.endswith("norm.weight") and not (self.plain_norms and
                                                                     name.endswith(self.plain_norms)):
            return "norm_offset"
        if self.transposed and name.endswith(self.transposed):
            return "transpose"
        if self.squeezed and name.endswith(self.squeezed):
            return "squeeze"
        return ""


class GGUFMetadata:
    """Typed access to one architecture's metadata; every error names the file and the key.

    Parameters
    ----------
    file : Any
    architecture : GGUFArchitecture
        The family's GGUF entry (its rotary tensors are read into the config).
    """

    def __init__(self, file: Any, architecture: GGUFArchitecture) -> None:
        self.file = file
        self.arch = file.architecture
        self.architecture = architecture

    def get(self, key: str, default: Any = None) -> Any:
        return self.file.metadata.get(f"{self.arch}.{key}", default)

    def int(self, key: str, default: Any = ...) -> int:
        full = f"{self.arch}.{key}"
        value = self.file.metadata.get(full, default)
        if value is ...:
            raise self.file.fail(f"the metadata has no {full!r}, which a {self.arch} model needs")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX_INT:
            raise self.file.fail(f"metadata {full!r} must be a positive integer up to {_MAX_INT}, got {value!r}")
        return value

    def float(self, key: str, default: Any = ...) -> float:
        full = f"{self.arch}.{key}"
        value = self.file.metadata.get(full, default)
        if value is ...:
            raise self.file.fail(f"the metadata has no {full!r}, which a {self.arch} model needs")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self.file.fail(f"metadata {full!r} must be a finite positive number, got {value!r}")
        return float(value)


def vocab_size(file: Any, meta: GGUFMetadata) -> int:
    """``{arch}.vocab_size``, else the tokenizer's token count (older converters write only the tokens)."""
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    if tokens is None and meta.get("vocab_size") is None:
        raise file.fail(f"the metadata has neither {file.architecture}.vocab_size nor tokenizer.ggml.tokens: the "
                        f"vocabulary's size is unknown")
    return meta.int("vocab_size", len(tokens) if tokens else ...)


def special_token_ids(file: Any) -> dict[str, int]:
    """Every ``tokenizer.ggml.*_token_id`` of the file (``"eos_token_id"`` -> its id), each checked to be a token
    of the vocabulary: below the count of ``tokenizer.ggml.tokens`` and below ``{arch}.vocab_size`` (the rows of
    the embedding), whichever the file holds.

    Raises
    ------
    ValueError
        Naming the file, the key, its id and the vocabulary's size.
    """
    bounds = []
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        bounds.append((len(tokens), f"tokenizer.ggml.tokens holds {len(tokens)} tokens"))
    vocab = file.metadata.get(f"{file.architecture}.vocab_size")
    if isinstance(vocab, int) and vocab > 0:
        bounds.append((vocab, f"{file.architecture}.vocab_size = {vocab}"))
    ids = {}
    for key, value in file.metadata.items():
        if not (key.startswith("tokenizer.ggml.") and key.endswith("_token_id")):
            continue
        past = [why for bound, why in bounds if not 0 <= value < bound]
        if past or value < 0:
            raise file.fail(f"metadata {key!r} = {value} is not a token id of the vocabulary ("
                            + ("; ".join(past) if past else "ids are non-negative") + ")")
        ids[key[len("tokenizer.ggml."):]] = value
    return ids


def special_ids(file: Any) -> dict[str, Any]:
    """bos, pad and the end-of-sequence ids: ``eos_token_id`` and the end-of-turn ids llama.cpp also stops at
    (``eot_token_id``, ``eom_token_id``), so ``generate`` stops where llama.cpp does."""
    given = special_token_ids(file)
    ids: dict[str, Any] = {}
    for key, name in (("bos_token_id", "bos_token_id"), ("padding_token_id", "pad_token_id")):
        if key in given:
            ids[name] = given[key]
    eos = list(dict.fromkeys(given[key] for key in ("eos_token_id", "eot_token_id", "eom_token_id") if key in given))
    if eos:
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return ids


def rope_factors(file: Any, name: str) -> list[float]:
    """A small F32/F16 tensor of rotary divisors as a list (the config holds them, not the model)."""
    gguf = import_extra("gguf", "read GGUF files")
    tensor = file.tensors[name]
    if tensor.tensor_type.name not in ("F32", "F16") or len(tensor.shape) != 1:
        raise file.fail(f"tensor {name!r} must be a vector of F32 or F16 divisors, got {tensor.tensor_type.name} "
                        f"of shape {tuple(int(n) for n in tensor.shape)}")
    return [float(v) for v in gguf.quants.dequantize(tensor.data, tensor.tensor_type)]


def rope_scaling(file: Any, meta: GGUFMetadata, context: int) -> dict | None:
    """The Hugging Face ``rope_scaling`` of ``{arch}.rope.scaling.*`` (and of Llama 3's ``rope_freqs``)."""
    if "rope_freqs.weight" in meta.architecture.rope_tensors and "rope_freqs.weight" in file.tensors:
        # llama.cpp divides each rotary frequency by its entry: longrope's divisors, the same at every length.
        divisors = rope_factors(file, "rope_freqs.weight")
        return {"rope_type": "longrope", "short_factor": divisors, "long_factor": divisors,
                "original_max_position_embeddings": context, "attention_factor": 1.0}
    kind = meta.get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta.float("rope.scaling.factor")}
    if kind == "yarn":
        for key in ("rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_ext_factor",
                    "rope.scaling.yarn_attn_factor"):
            if meta.get(key) is not None:  # llama.cpp's own YaRN knobs, with no Hugging Face equivalent read here
                raise file.fail(f"metadata {file.architecture}.{key} is not read by attnkit (YaRN is read from "
                                f"its factor, original context and beta_fast / beta_slow)")
        scaling = {"rope_type": "yarn", "factor": meta.float("rope.scaling.factor"),
                   "original_max_position_embeddings": meta.int("rope.scaling.original_context_length")}
        # the converter writes Hugging Face's attention_factor here (OLMo 3): the softmax's YaRN scale as given
        for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow"),
                          ("rope.scaling.attn_factor", "attention_factor")):
            if meta.get(key) is not None:
                scaling[name] = meta.float(key)
        return scaling
    if kind == "longrope" and "rope_factors_long.weight" in meta.architecture.rope_tensors:
        return None  # read from its tensors by the family's reader
    raise file.fail(f"metadata {file.architecture}.rope.scaling.type = {kind!r} is not a rotary scaling attnkit "
                    f"reads from GGUF (none, linear, yarn)")


def head_counts(meta: GGUFMetadata, hidden: int) -> tuple[int, int, int]:
    """(query heads, key/value heads, head width), their relations checked in the file's own keys."""
    arch = meta.arch
    heads = meta.int("attention.head_count")
    kv = meta.int("attention.head_count_kv", heads)
    if heads % kv:
        raise meta.file.fail(f"metadata '{arch}.attention.head_count_kv' = {kv} must divide "
                             f"'{arch}.attention.head_count' = {heads}")
    if meta.get("attention.key_length") is None and hidden % heads:
        raise meta.file.fail(f"metadata '{arch}.embedding_length' = {hidden} is not a multiple of "
                             f"'{arch}.attention.head_count' = {heads}, and there is no '{arch}.attention.key_length' "
                             f"to give the width of a head")
    return heads, kv, meta.int("attention.key_length", hidden // heads)


def layer_counts(meta: GGUFMetadata, key: str, layers: int, what: str) -> list[int]:
    """``{arch}.{key}`` as one count per layer: a hybrid's array (0 on a layer without the part, as llama.cpp's
    converter writes ``attention.head_count_kv`` and Nemotron-H's ``feed_forward_length``), or one number for
    every layer. The layers that have the part must agree: attnkit reads one size for them all.

    Raises
    ------
    ValueError
        The key missing, an array of another length than ``layers`` or with a negative count, or two different
        counts on the layers that have the part (naming the file, the key and ``what`` a 0 means).
    """
    full = f"{meta.arch}.{key}"
    value = meta.file.metadata.get(full)
    if value is None:
        raise meta.file.fail(f"the metadata has no {full!r}, which a {meta.arch} model needs (one count per layer, "
                             f"0 on {what})")
    counts = [int(n) for n in np.atleast_1d(value)]
    if np.ndim(value) == 0:
        counts *= layers
    if len(counts) != layers or min(counts) < 0:
        raise meta.file.fail(f"metadata {full!r} must hold a non-negative count for each of the {layers} layers "
                             f"('{meta.arch}.block_count'), got {counts}")
    if len(set(counts) - {0}) > 1:
        raise meta.file.fail(f"metadata {full!r} gives the layers different counts {sorted(set(counts) - {0})}; "
                             f"attnkit reads one for every layer that has one")
    return counts


def rotated_features(meta: GGUFMetadata, head_dim: int) -> int:
    """The features of a head that rotate: ``rope.dimension_count`` (default all), even and at most the head's."""
    arch = meta.arch
    rotated = meta.int("rope.dimension_count", head_dim)
    if rotated > head_dim or rotated % 2:
        source = (f"'{arch}.attention.key_length'" if meta.get("attention.key_length") is not None else
                  f"'{arch}.embedding_length' / '{arch}.attention.head_count'")
        what = (f"metadata '{arch}.rope.dimension_count' = {rotated}" if meta.get("rope.dimension_count") is not None
                else f"the head's width {head_dim} ({source}), all of which rotates,")
        raise meta.file.fail(f"{what} must be an even number of at most the {head_dim} features of a head "
                             f"({source})")
    return rotated


def common_config(file: Any, meta: GGUFMetadata) -> dict[str, Any]:
    """The keys every rotary family shares."""
    hidden = meta.int("embedding_length")
    heads, kv, head_dim = head_counts(meta, hidden)
    context = meta.int("context_length")
    config = {
        "model_type": file.model_type, "vocab_size": vocab_size(file, meta), "hidden_size": hidden,
        "intermediate_size": meta.int("feed_forward_length"), "num_hidden_layers": meta.int("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "max_position_embeddings": context, "rms_norm_eps": meta.float("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.float("rope.freq_base", 10000.0),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in file.tensors,
        **special_ids(file),
    }
    rotated = rotated_features(meta, head_dim)
    if rotated != head_dim:
        config["partial_rotary_factor"] = rotated / head_dim
    scaling = rope_scaling(file, meta, context)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config
