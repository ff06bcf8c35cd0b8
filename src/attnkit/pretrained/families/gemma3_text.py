"""Gemma 3 (text): Gemma 2, except per-head RMSNorms of queries and keys (``q_norm``, ``k_norm``), five sliding
layers to one full (``layer_types``, or every ``sliding_window_pattern``-th layer full), a rotary base (and
scaling) per layer type (``rope_parameters`` keyed by layer type, or ``rope_local_base_freq`` for the sliding
layers), no soft-caps by default, and a context of 131072 positions."""
from __future__ import annotations

from ..gguf_metadata import GGUFArchitecture
from . import Family
from .gemma2 import GEMMA_KEYS, GGUF_BIASES, GemmaRules, gemma_config, gemma_gguf_config
from .llama import BENCHMARK_SHAPE, plain_tensors

__all__ = ["FAMILY"]

RULES = GemmaRules(max_positions=131072, full_every=None, rope_theta=1000000.0, rope_per_layer_type=True,
                   softcaps=(None, None), qk_norm=True)

FAMILY = Family(
    model_type="gemma3_text",
    keys=frozenset(GEMMA_KEYS + ("sliding_window_pattern", "rope_local_base_freq")),
    read_config=lambda read: gemma_config(read, RULES),
    tensors=plain_tensors, architecture="Gemma3ForCausalLM", hf_config_class="Gemma3TextConfig",
    benchmark=dict(BENCHMARK_SHAPE, head_dim=64, query_pre_attn_scalar=64, sliding_window=512),
    gguf=GGUFArchitecture("gemma3", lambda file, meta: gemma_gguf_config(file, meta, three=True),
                          bias_flags=GGUF_BIASES, norm_offset=True,
                          tokenizer_style="gemma"))
