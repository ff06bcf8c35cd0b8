"""Load a Hugging Face decoder folder (any of ``supported_model_types()``) or a GGUF file as an attnkit
:class:`CausalLM`.

``config.json`` becomes a :class:`~attnkit.models.DecoderConfig` (:mod:`.hf_config`), the safetensors headers
are checked against it (:mod:`.checkpoint`), then what its sizes make (the rotary tables), and only then is the
model built and each tensor read into it.
A path ending in ``.gguf`` that is a file is read by :mod:`.gguf_file` the same way (metadata, then the tensor
table, then the model). Needs the ``pretrained`` extra (``safetensors``, or ``gguf`` for GGUF files); never
imports torch or transformers.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .. import _progress
from ..decoding.config import GenerationConfig
from ..decoding.sampling import check_generation_config
from ..init import empty_init
from ..io import read_json
from .checkpoint import (
    check_model_matches,
    load_tensors_into,
    pack_mxfp4_tensors,
    read_checkpoint_index,
    validate_checkpoint,
)
from .gguf_file import (
    GGUFFile,
    gguf_hf_config,
    is_gguf_path,
    load_gguf_tensors_into,
    pack_gguf_tensors,
    read_gguf,
    read_gguf_config,
    read_gguf_strings,
    validate_gguf_tensors,
)
from .gguf_tokenizer import gguf_tokenizer
from .hf_config import check_rope_tables, read_decoder_keys
from .tokenizer import chat_templates_of_folder, load_tokenizer, read_generation_config

__all__ = ["load", "load_causal_lm", "read_decoder_config", "read_chat_templates"]

_DTYPES = (np.float16, np.float32, np.float64)


def _check_dtype(dtype: Any) -> np.dtype:
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float16, float32 or float64, got {dtype!r}") from None
    if dtype not in [np.dtype(d) for d in _DTYPES]:
        raise TypeError(f"dtype must be float16, float32 or float64, got {dtype}")
    return dtype


def read_decoder_config(folder: str | Path):
    """The :class:`~attnkit.models.DecoderConfig` of a Hugging Face model folder's ``config.json``.

    Raises
    ------
    FileNotFoundError
        The folder or its ``config.json`` does not exist.
    ValueError
        ``config.json`` is not a JSON object, or describes a model attnkit does not load (naming the file and
        the key).
    """
    file, raw, config = _read_config_keys(folder)
    _check_tables(file, config, raw)
    return config


def _read_config_keys(folder: str | Path) -> tuple[Path, dict, Any]:
    """``(config.json's path, its dict, its DecoderConfig)`` read by :func:`~.hf_config.read_decoder_keys`:
    checked, in time and memory that do not grow with the sizes it claims (errors name the file)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    file = folder / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    raw = read_json(file)
    try:
        return file, raw, read_decoder_keys(raw)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from None


def _check_tables(file: Path, config: Any, raw: dict) -> None:
    try:
        check_rope_tables(config, raw)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from None


def load_causal_lm(path: str | Path, dtype: Any = np.float32, *, keep_quantized: bool = False,
                   progress: bool | None = None):
    """Load a Hugging Face causal LM folder onto attnkit.

    Parameters
    ----------
    path : str or Path
        A folder with ``config.json`` and ``model.safetensors`` (or ``model.safetensors.index.json`` and its
        shards), as written by ``save_pretrained``; ``model_type`` one of
        ``attnkit.pretrained.hf_config.SUPPORTED_MODEL_TYPES``. Or a GGUF file (a path ending in ``.gguf``)
        of an architecture in ``attnkit.pretrained.gguf_file.GGUF_ARCHITECTURES``.
    dtype : numpy float dtype, default float32
        Dtype of the weights and computations; F64/F32/F16/BF16 tensors are converted to it, GGUF tensors
        (any of ``GGUF_TENSOR_TYPES``) dequantized to float32 and converted to it.
    keep_quantized : bool, default False
        Keep quantized weights as their files store them: a GGUF file's quantized matrices (Q4_0 .. Q8_0, Q2_K ..
        Q6_K) and gpt-oss's MXFP4 experts become :class:`~attnkit.kernels.packed.PackedWeight` parameters, which
        every product dequantizes a block of rows at a time; a Q4 file then costs about its size in memory
        instead of 4-8 times it, and every token pays a dequantization of the weights (``docs/benchmarks.md``).
        Float tensors (F32/F16/BF16), norms and biases are read as usual. Packed weights take no gradient (an
        input gradient, as the explanations take, is exact). With it off, everything is dequantized at load.
    progress : bool or None, default None
        A line on stderr counting the bytes read, tensor by tensor (:mod:`attnkit._progress`): None shows it
        when stderr is a terminal, True always, False never.

    Returns
    -------
    CausalLM
        In eval mode; ``lm.config`` is its :class:`~attnkit.models.DecoderConfig`, ``lm.generation_config``
        the folder's ``generation_config.json`` as a :class:`~attnkit.decoding.config.GenerationConfig` (the
        defaults without one): the defaults of ``lm.generate``.

    Raises
    ------
    FileNotFoundError
        No such folder or file, no ``config.json``, no safetensors file.
    ValueError
        A config attnkit does not load, or a checkpoint that does not match it: a missing or unexpected
        tensor, a wrong shape or dtype (each named); a ``generation_config.json`` whose defaults ``generate``
        would refuse (naming the file and key). For a GGUF file, naming it: not GGUF, truncated or corrupt,
        an unknown architecture or metadata, a tensor type attnkit does not dequantize. Raised before any
        tensor is read.
    TypeError
        ``dtype`` is not float16, float32 or float64, or ``progress`` is not None, True or False.
    ImportError
        ``safetensors`` (``gguf`` for a GGUF file) is not installed (naming ``pip install 'attnkit[pretrained]'``).

    Examples
    --------
    A one-layer Llama folder with random weights, written the way ``save_pretrained`` names them:

    >>> import json, tempfile
    >>> from safetensors.numpy import save_file
    >>> from attnkit.pretrained import decoder_config_from_hf
    >>> from attnkit.pretrained.checkpoint import checkpoint_map
    >>> hf = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
    ...       "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "config.json").write_text(json.dumps(hf))
    >>> maps, prefix = checkpoint_map(decoder_config_from_hf(hf))
    >>> rng = np.random.default_rng(0)
    >>> save_file({("" if m.source == "lm_head.weight" else prefix) + m.source:
    ...            rng.standard_normal(m.shape).astype(np.float32) for m in maps}, str(folder / "model.safetensors"))
    >>> lm = load_causal_lm(folder)
    >>> lm(np.array([[1, 2, 3]])).shape, lm.config.num_kv_heads
    ((1, 3, 64), 2)
    """
    dtype = _check_dtype(dtype)
    keep_quantized = _check_flag(keep_quantized, "keep_quantized")
    _progress.check_progress(progress)
    if is_gguf_path(path):
        return _load_gguf(read_gguf(path), dtype, keep_quantized, progress)
    folder = Path(path)
    # Loading validates before it allocates: the config's sizes meet the checkpoint's tensor shapes before
    # anything is computed per feature, per layer or per expert (the rotary tables' check included).
    file, raw, config = _read_config_keys(folder)
    index = read_checkpoint_index(folder)
    stored = validate_checkpoint(index, config)
    _check_tables(file, config, raw)
    try:
        generation = check_generation_config(read_generation_config(folder), config.vocab_size)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{folder / 'generation_config.json'}: {exc}") from None

    model = _empty_model(config, dtype, stored, keep_quantized)
    if keep_quantized:
        packed, stored = pack_mxfp4_tensors(index, stored)
        _give_storage(model, packed)
    with _weights_line(sum(index.tensors[name].nbytes for name in stored), progress) as line:
        load_tensors_into(dict(model.named_parameters()), index, stored, step=line.update)
    model.generation_config = generation
    return model.eval()


def _check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def _empty_model(config: Any, dtype: np.dtype, maps: dict[str, Any], keep_quantized: bool):
    """The model to fill, checked against the tensor maps: uninitialised parameters of ``dtype``, or (to keep
    quantized weights) placeholders that :func:`_give_storage` replaces."""
    from ..models import CausalLM

    with empty_init(dtype, placeholders=keep_quantized):  # every parameter is overwritten: no random weights
        model = CausalLM(config)
    check_model_matches(dict(model.named_parameters()), maps)
    return model


def _give_storage(model: Any, packed: dict[str, Any]) -> None:
    """The packed weights set in place, then storage for every other parameter (fused where every member of a
    group is dense): what the dense loaders copy into."""
    for name, weight in packed.items():
        model.set_parameter(name, weight)
    model.allocate_parameters()


def _weights_line(nbytes: int, progress: bool | None):
    """The progress line of loading: the file's bytes of the tensors read so far, of ``nbytes``."""
    return _progress.progress(nbytes, "loading weights", unit="B", enabled=progress, scale=True)


def _load_gguf(file: GGUFFile, dtype: np.dtype, keep_quantized: bool = False, progress: bool | None = None):
    """A parsed GGUF file's model: its metadata and tensor table checked, then the model built and filled."""
    config = read_gguf_config(file)
    entries = validate_gguf_tensors(file, config)
    try:
        check_rope_tables(config, gguf_hf_config(file))
    except ValueError as exc:
        raise file.fail(f"its metadata describes a model attnkit does not load: {exc}") from None
    model = _empty_model(config, dtype, {name: entry.mapping for name, entry in entries.items()}, keep_quantized)
    if keep_quantized:
        packed, entries = pack_gguf_tensors(file, entries, config)
        _give_storage(model, packed)
    with _weights_line(sum(int(file.tensors[name].n_bytes) for name in entries), progress) as line:
        load_gguf_tensors_into(dict(model.named_parameters()), file, entries, config, step=line.update)
    model.generation_config = GenerationConfig()
    return model.eval()


def load(folder: str | Path, dtype: Any = np.float32, *, keep_quantized: bool = False,
         progress: bool | None = None):
    """A Hugging Face causal LM folder (or a GGUF file) as ``(model, tokenizer)``: :func:`load_causal_lm` and
    :func:`~attnkit.pretrained.load_tokenizer` of the same folder (for a GGUF file, the tokenizer its metadata
    describes). ``progress`` as :func:`load_causal_lm`'s.

    The tokenizer is read first, so a folder without a usable ``tokenizer.json`` (a GGUF file without a
    usable vocabulary) fails before any weight is read. ``keep_quantized`` is :func:`load_causal_lm`'s (a Q4
    file stays about its size in memory). Raises what those two functions raise.

    Examples
    --------
    With a chat model's folder (not run here: no such folder ships with attnkit)::

        model, tokenizer = load("SmolLM2-135M-Instruct")
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
        out = model.generate([prompt["input_ids"]], max_new_tokens=32)
        print(tokenizer.decode(out[0, len(prompt["input_ids"]):], skip_special_tokens=True))
    """
    if is_gguf_path(folder):
        dtype = _check_dtype(dtype)
        keep_quantized = _check_flag(keep_quantized, "keep_quantized")
        file = read_gguf(folder)
        tokenizer = gguf_tokenizer(file)
        config = read_gguf_config(file)
        if tokenizer.vocab_size > config.vocab_size:
            raise file.fail(f"its tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocabulary of "
                            f"{config.vocab_size}: ids past {config.vocab_size - 1} have no embedding")
        return _load_gguf(file, dtype, keep_quantized, _progress.check_progress(progress)), tokenizer
    tokenizer = load_tokenizer(folder)
    check_tokenizer_fits(tokenizer, _read_config_keys(folder)[2], Path(folder))
    return load_causal_lm(folder, dtype=dtype, keep_quantized=keep_quantized, progress=progress), tokenizer


def read_chat_templates(path: str | Path) -> dict[str, str]:
    """The chat templates of a model folder or GGUF file, by name (``"default"`` is the one the tokenizer
    renders with), read without the weights or the vocabulary: a folder's ``tokenizer_config.json``,
    ``chat_template.jinja`` and ``additional_chat_templates/``, a GGUF file's ``tokenizer.chat_template`` keys
    (its header alone). What the tokenizer :func:`load` returns would hold, in milliseconds rather than the
    seconds a model takes to load.

    Raises
    ------
    FileNotFoundError
        No such folder or file.
    ValueError
        A file that cannot be read (naming it).
    """
    prefix = "tokenizer.chat_template"
    if is_gguf_path(path):
        found = read_gguf_strings(path, lambda key: key == prefix or key.startswith(prefix + "."))
        return {"default" if key == prefix else key[len(prefix) + 1:]: value for key, value in found.items()}
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    return chat_templates_of_folder(folder)


def check_tokenizer_fits(tokenizer: Any, config: Any, folder: Path) -> None:
    """Refuse a tokenizer that can produce ids the model has no embedding for: a vocabulary larger than the
    model's, or end-of-sequence ids (``generation_config.json``'s, which need not be tokens of it) past it.

    Raises
    ------
    ValueError
        Naming the file, the count or id, and the model's ``vocab_size``.
    """
    vocab = config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"{folder / 'tokenizer.json'} has {tokenizer.vocab_size} tokens, more than the model's "
                         f"vocabulary of {vocab} (config.json's vocab_size): ids past {vocab - 1} have no embedding")
    past = [token for token in tokenizer.eos_token_ids if token >= vocab]
    if past:
        raise ValueError(f"{folder}: the tokenizer's eos_token_id {past[0]} is past the model's vocabulary of "
                         f"{vocab} (config.json's vocab_size)")
