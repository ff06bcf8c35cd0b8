"""The model families attnkit loads: one module per Hugging Face ``model_type``, and the one registry of them.

Each module of this package (``llama.py``, ``mistral.py``, ...) is everything attnkit knows about one family,
read top to bottom: a docstring that says what the family is ("Llama, except ..."), the ``config.json`` keys it
understands and their defaults, how they become a :class:`~attnkit.models.DecoderConfig`, and its checkpoint's
tensor names, stated as a difference from Llama's where they are one. Each ends with ``FAMILY``, a
:class:`Family`. :data:`REGISTRY` is built from the modules found in this folder, and every list of families in
attnkit reads it: loading, :func:`~attnkit.pretrained.supported_model_types`, the command line's help, the
decode benchmark, the trainer's ``architectures`` and the tests.

Adding a family is adding a module here (and a tiny model of it to the tests' specs); see the recipe in
docs/architecture.md.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...models.config import DecoderConfig
from ..gguf_metadata import GGUFArchitecture
from ..tensor_map import TensorMap
from ._reader import Reader, refuse_unknown_keys

__all__ = ["Family", "REGISTRY", "family", "model_types"]


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes
    ----------
    model_type : str
        ``config.json``'s ``model_type``.
    keys : frozenset of str
        The ``config.json`` keys its reader understands beyond metadata (the key policy refuses the rest).
    read_config : callable (Reader) -> DecoderConfig
        Reads the keys, with the family's defaults.
    tensors : callable (DecoderConfig, mxfp4: bool) -> (list of TensorMap, str)
        The checkpoint's tensors in order, and the base model's name prefix (``"model."``, ...).
    architecture : str
        transformers' causal-LM class (written into ``config.json``'s ``architectures`` by the trainer).
    hf_config_class : str
        transformers' config class (the benchmarks and tests build models with it).
    benchmark : dict
        Keyword arguments of ``hf_config_class`` for the decode benchmark's shape.
    quantizations : tuple of str
        ``quantization_config`` methods its checkpoints may use (gpt-oss: ``"mxfp4"``).
    unused_tensors : callable (DecoderConfig) -> frozenset of str, optional
        Checkpoint tensors (under the base prefix) that may be present and are not read, as transformers
        ignores them (Gemma 4's key/value projections of the layers that reuse another layer's).
    mtp_tensors : callable (DecoderConfig) -> (list of TensorMap, frozenset of str), optional
        The multi-token-prediction layers' tensors a checkpoint may hold after its last layer (under the base
        prefix), mapped to a :class:`~attnkit.models.multi_token.MultiTokenPredictor`'s parameters, and the ones
        among them that are not read; skipped when the model is loaded, read by
        :func:`~attnkit.pretrained.load_multi_token_predictor`. None where the family has none.
    multimodal_model_types : tuple of str
        The ``model_type`` of the multimodal folders whose text decoder this family is (Llama 4's ``"llama4"``):
        such a folder is refused naming this family.
    gguf : GGUFArchitecture, optional
        How llama.cpp's GGUF files of this family are read (its ``general.architecture`` name, metadata reader
        and what the converter changed); None where attnkit reads no GGUF file of it.
    summary : str
        What the family is, as a difference from Llama where it is one: the first paragraph of its module's
        docstring (filled in by the registry).
    """

    model_type: str
    keys: frozenset[str]
    read_config: Callable[[Reader], DecoderConfig]
    tensors: Callable[[DecoderConfig, bool], tuple[list[TensorMap], str]]
    architecture: str
    hf_config_class: str
    benchmark: dict[str, Any] = field(default_factory=dict)
    quantizations: tuple[str, ...] = ()
    unused_tensors: Callable[[DecoderConfig], frozenset[str]] | None = None
    mtp_tensors: Callable[[DecoderConfig], tuple[list[TensorMap], frozenset[str]]] | None = None
    multimodal_model_types: tuple[str, ...] = ()
    gguf: GGUFArchitecture | None = None
    summary: str = ""

    def config_from_hf(self, config: dict) -> DecoderConfig:
        """``config`` (a parsed ``config.json`` of this family) as a DecoderConfig, after the key policy."""
        refuse_unknown_keys(config, self.model_type, self.keys)
        quantization = config.get("quantization_config")
        if quantization is not None:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
            if method not in self.quantizations:
                supported = f"its {', '.join(self.quantizations)} checkpoints" if self.quantizations else "float " \
                    "checkpoints"
                raise ValueError(f"{self.model_type} config: 'quantization_config' with quant_method {method!r} is "
                                 f"not supported; attnkit reads {supported}")
        return self.read_config(Reader(config, self.model_type))


def _discover() -> dict[str, Family]:
    """Every module of this folder not starting with ``_`` contributes its ``FAMILY``, in model_type order."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        entry = module.FAMILY
        if entry.model_type != info.name:
            raise RuntimeError(f"{module.__name__} declares model_type {entry.model_type!r}: a family module is "
                               f"named after its model_type")
        summary = " ".join(module.__doc__.split("\n\n")[0].split())
        found[entry.model_type] = dataclasses.replace(entry, summary=summary)
    return dict(sorted(found.items()))


REGISTRY: dict[str, Family] = _discover()


def model_types() -> list[str]:
    """The model_type of every family, sorted."""
    return list(REGISTRY)


def family(model_type: Any) -> Family:
    """The :class:`Family` of ``model_type``.

    Raises
    ------
    ValueError
        Not a family attnkit loads (the message lists them; for a multimodal folder, the text family to load).
    """
    text = next((f for f in REGISTRY.values() if model_type in f.multimodal_model_types), None)
    if text is not None:
        raise ValueError(f"model_type {model_type!r} is a multimodal folder (its decoder in 'text_config', a vision "
                         f"tower beside it), which attnkit does not read; load a text-only {text.model_type!r} folder "
                         f"({text.architecture})")
    if model_type not in REGISTRY:
        raise ValueError(f"model_type {model_type!r} is not supported; attnkit loads " + ", ".join(REGISTRY))
    return REGISTRY[model_type]
