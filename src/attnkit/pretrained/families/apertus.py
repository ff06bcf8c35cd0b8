"""Apertus: Llama, except an ungated MLP ``xielu(x W_up) W_down`` whose xIELU activation has two learned slopes
per layer (``mlp.act_fn.alpha_p``, ``alpha_n``; with its ``beta`` and ``eps``, buffers transformers saves),
per-head RMSNorms of queries and keys before the rotation (``q_norm``, ``k_norm``), the norms named
``attention_layernorm`` and ``feedforward_layernorm``, and llama3 rotary scaling of base 12000000 by default."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig, DecoderConfig
from ..tensor_map import TensorMap
from . import Family
from ._reader import COMMON_KEYS, Reader
from .llama import BENCHMARK_SHAPE, rotary_config, rotary_tensors, with_norm_names

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 65536, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 3, "num_key_value_heads": None, "rms_norm_eps": 1e-5}
# transformers' ApertusConfig without rope_parameters
ROPE = {"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0, "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_NORM_NAMES = {"input_layernorm": "attention_layernorm", "post_attention_layernorm": "feedforward_layernorm"}


def _config(read: Reader):
    if read.raw("hidden_act", "xielu") != "xielu":
        raise ValueError(f"apertus config: 'hidden_act' {read.raw('hidden_act')!r} is not supported; attnkit reads "
                         f"Apertus's xielu MLP")
    config = {k: v for k, v in read.config.items() if k != "hidden_act"}
    if not config.get("rope_scaling") and config.get("rope_parameters") is None:
        config["rope_parameters"] = dict(ROPE)
    return rotary_config(Reader(config, read.family), DEFAULTS, _fields)


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    bias = read.bool("attention_bias", False)
    return dict(attention=AttentionConfig(bias=bias, output_bias=bias, qk_norm="head"), mlp_kind="xielu")


def _xielu_mlp_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    d, f = cfg.hidden_size, cfg.mlp.intermediate_size
    return [TensorMap(hf + "mlp.up_proj.weight", (f, d), (ak + "mlp.W_up",), "transpose"),
            TensorMap(hf + "mlp.down_proj.weight", (d, f), (ak + "mlp.W_down",), "transpose"),
            TensorMap(hf + "mlp.act_fn.alpha_p", (1,), (ak + "mlp.alpha_p",), "copy"),
            TensorMap(hf + "mlp.act_fn.alpha_n", (1,), (ak + "mlp.alpha_n",), "copy"),
            # transformers saves beta and eps as 0-d buffers
            TensorMap(hf + "mlp.act_fn.beta", (), (ak + "mlp.beta",), "reshape", sizes=(1,)),
            TensorMap(hf + "mlp.act_fn.eps", (), (ak + "mlp.eps",), "reshape", sizes=(1,))]


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    """Llama's checkpoint with the xIELU MLP and Apertus's norm names."""
    maps, prefix = rotary_tensors(cfg, _xielu_mlp_tensors)
    return with_norm_names(maps, _NORM_NAMES), prefix


FAMILY = Family(
    model_type="apertus", keys=frozenset(COMMON_KEYS + ("attention_bias",)),
    read_config=_config, tensors=_tensors,
    architecture="ApertusForCausalLM", hf_config_class="ApertusConfig", benchmark=dict(BENCHMARK_SHAPE, head_dim=64))
