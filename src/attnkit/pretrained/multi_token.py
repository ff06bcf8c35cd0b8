"""Read a checkpoint's multi-token-prediction layers (DeepSeek-V3's and GLM-4.5's ``layers.{num_layers + k}``) as a
:class:`~attnkit.models.multi_token.MultiTokenPredictor` of a loaded model: the draft of
``generate(..., assistant_model=predictor)`` and ``attnkit generate --draft-mtp``.

:func:`~attnkit.pretrained.load_causal_lm` skips these tensors (as transformers does): a model that never drafts
with them does not pay their memory (one expert layer: about 1/60 of DeepSeek-V3).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..init import empty_init
from ..models.multi_token import MultiTokenPredictor
from .checkpoint import check_headers, check_model_matches, checkpoint_map, load_tensors_into, read_checkpoint_index
from .families import family
from .gguf_file import is_gguf_path

__all__ = ["load_multi_token_predictor"]


def load_multi_token_predictor(path: str | Path, model: Any) -> MultiTokenPredictor:
    """The multi-token-prediction layers of the checkpoint folder ``path``, for ``model`` (loaded from it).

    Parameters
    ----------
    path : str or Path
        The folder ``model`` was loaded from (``config.json`` and its safetensors files).
    model : CausalLM
        Its embedding, rotary tables and head serve the layers; its dtype is theirs.

    Returns
    -------
    MultiTokenPredictor
        ``model.config.mtp_layers`` layers, in eval mode.

    Raises
    ------
    ValueError
        The family has no prediction layers attnkit reads, the config declares none, the checkpoint holds none
        (``save_pretrained`` of transformers leaves them out) or only some of them, or a tensor has the wrong shape
        or dtype (each named); a GGUF file. Raised before any tensor is read.
    TypeError
        ``model`` is not a CausalLM.
    """
    from ..models import CausalLM

    if not isinstance(model, CausalLM):
        raise TypeError(f"model must be the CausalLM loaded from {path}, got {type(model).__name__}")
    config = model.config
    if is_gguf_path(path):
        raise ValueError(f"{path}: attnkit reads multi-token-prediction layers from safetensors folders, not GGUF "
                         f"files")
    spec = family(config.family).mtp_tensors
    if spec is None:
        raise ValueError(f"{config.family} checkpoints have no multi-token-prediction layers attnkit reads (they "
                         f"are read for deepseek_v3, deepseek_v32 and glm4_moe)")
    if not config.mtp_layers:
        raise ValueError(f"{path}: the config declares no multi-token-prediction layers (num_mtp_layers = 0)")
    folder = Path(path)
    index = read_checkpoint_index(folder)
    maps, _ = spec(config)
    prefix = checkpoint_map(config)[1]
    prefixed = any(name.startswith(prefix) for name in index.tensors)
    stored = {(prefix if prefixed else "") + m.source: m for m in maps}
    missing = [name for name in stored if name not in index.tensors]
    if len(missing) == len(stored):
        raise ValueError(f"{folder}: the config declares {config.mtp_layers} multi-token-prediction layer(s) after "
                         f"layer {config.num_layers - 1}, but the checkpoint holds none of their tensors (no "
                         f"{missing[0]!r}; transformers' save_pretrained leaves them out): this checkpoint cannot "
                         f"draft with them")
    if missing:
        raise ValueError(f"{folder}: the checkpoint has no tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else "")
                         + " of its multi-token-prediction layers")
    check_headers(index, stored)
    with empty_init(model.dtype):  # every parameter is overwritten: no random weights
        predictor = MultiTokenPredictor(model)
    params = dict(predictor.named_parameters())
    check_model_matches(params, stored)
    load_tensors_into(params, index, stored)
    return predictor.eval()
