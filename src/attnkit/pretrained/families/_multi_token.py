"""The checkpoint tensors of a model's multi-token-prediction layers, for any family whose layers are stored as its
decoder layers are (DeepSeek-V3's layout, which GLM-4.5 shares): layer ``k`` of the predictor is checkpoint layer
``num_hidden_layers + k`` with ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` beside the decoder
layer's own tensors, and copies of the embedding and head (``embed_tokens``, ``shared_head.head``) that are not
read (the predictor shares the model's)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ...models.config import DecoderConfig
from ...models.multi_token import mtp_config
from ..tensor_map import TensorMap
from ._reader import Reader

__all__ = ["MTP_KEYS", "mtp_layer_count", "multi_token_tensors"]

# transformers writes num_mtp_layers (default 1), the checkpoints' own config.json num_nextn_predict_layers
MTP_KEYS = ("num_mtp_layers", "num_nextn_predict_layers")


def mtp_layer_count(read: Reader, default: int = 1) -> int:
    """The multi-token-prediction layers a config declares, under either of its names (which must agree)."""
    given = {key: read.count(key) for key in MTP_KEYS if read.raw(key, None) is not None}
    if len(set(given.values())) > 1:
        raise ValueError(f"{read.family} config: {' and '.join(f'{k!r} ({v})' for k, v in given.items())} name the "
                         f"same count and must agree")
    return next(iter(given.values()), default)


def multi_token_tensors(cfg: DecoderConfig, tensors: Callable[..., tuple[list[TensorMap], str]]
                        ) -> tuple[list[TensorMap], frozenset[str]]:
    """``Family.mtp_tensors`` of a family whose checkpoint map is ``tensors``: the prediction layers' maps (into a
    :class:`~attnkit.models.multi_token.MultiTokenPredictor`'s names) and the tensors there that are not read.
    Nothing when ``cfg.mtp_layers`` is 0."""
    if not cfg.mtp_layers:
        return [], frozenset()
    layers = mtp_config(cfg)
    every, _ = tensors(layers)  # the decoder layers of the predictor's config, as the family maps them
    d = cfg.hidden_size
    maps, copies = [], set()
    for k in range(layers.num_layers):
        own, hf = f"layers.{k}.", f"layers.{cfg.num_layers + k}."
        block = [replace(m, source=hf + m.source[len(own):],
                         targets=tuple(own + "block." + t[len(own):] for t in m.targets))
                 for m in every if m.source.startswith(own)]
        maps += [TensorMap(hf + "enorm.weight", (d,), (own + "enorm.gamma",), "copy"),
                 TensorMap(hf + "hnorm.weight", (d,), (own + "hnorm.gamma",), "copy"),
                 TensorMap(hf + "eh_proj.weight", (d, 2 * d), (own + "eh_proj.W",), "transpose"),
                 *block,
                 TensorMap(hf + "shared_head.norm.weight", (d,), (own + "post_norm.gamma",), "copy")]
        copies |= {hf + "embed_tokens.weight", hf + "shared_head.head.weight"}
    return maps, frozenset(copies)
