"""OLMo 2: Llama, except an RMSNorm over the whole q and k projections (not per head), and norms after the
attention and the MLP instead of before (``post_attention_layernorm`` is the attention's output norm,
``post_feedforward_layernorm`` the MLP's).

llama.cpp writes OLMo 3 as ``olmo2`` too, with a sliding window and one flag per layer saying which layers slide:
such a file is read as ``olmo3``."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig
from ..gguf_metadata import GGUFArchitecture
from . import Family
from ._reader import COMMON_KEYS, Reader
from .llama import BENCHMARK_SHAPE, GGUF_ATTENTION_BIAS, LLAMA3_ROPE_TENSORS, plain_tensors, rotary_config
from .olmo3 import olmo_gguf_config

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": None,
            "eos_token_id": 50279, "num_key_value_heads": None, "rms_norm_eps": 1e-5}


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    bias = read.bool("attention_bias", False)
    return dict(attention=AttentionConfig(bias=bias, output_bias=bias, qk_norm="projection"))


FAMILY = Family(
    model_type="olmo2", keys=frozenset(COMMON_KEYS + ("attention_bias",)),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields, norm_placement="post"), tensors=plain_tensors,
    architecture="Olmo2ForCausalLM", hf_config_class="Olmo2Config", benchmark=dict(BENCHMARK_SHAPE),
    gguf=GGUFArchitecture("olmo2", olmo_gguf_config, rope_tensors=LLAMA3_ROPE_TENSORS, bias_flags=GGUF_ATTENTION_BIAS))
