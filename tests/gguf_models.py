"""GGUF files written in the test, the way llama.cpp's ``convert_hf_to_gguf.py`` writes them.

:func:`write_gguf` turns a ``transformers`` causal LM (and optionally its fast tokenizer) into a GGUF file with
the ``gguf`` package's own ``GGUFWriter``: llama.cpp's metadata keys, its tensor names (from ``gguf``'s
``TensorNameMap``, as the converter takes them), and the changes its converter makes to the weights:

- Llama (and Mistral, which llama.cpp writes as ``llama``): the rows of q and k permuted per head from
  Hugging Face's half-split rotary layout to GGML's interleaved one;
- Gemma 2 / 3: every RMSNorm weight stored as ``1 + w`` (GGML's RMSNorm multiplies by the weight alone);
- GPT-2: the ``Conv1D`` weights stored as (out, in), like every other GGML matrix;
- LFM2: the short convolution's (C, 1, K) weights stored as (C, K), the key/value head count one per layer (0
  for a convolution), the MLP's width as adjusted;
- OLMo 3, written as ``olmo2``: the full layers' rotary base and scaling, the window and one flag per layer;
- GLM-4.5 (``glm4moe``): each matrix's experts stacked in one tensor, the mixture as ``expert_*`` keys, and a
  multi-token-prediction block after the model's (``nextn_predict_layers``), as its checkpoints carry one;
- Qwen3.5 (``qwen35``): every RMSNorm but the Gated DeltaNet's stored as ``1 + w``, ``A_log`` as ``-exp(A_log)``,
  ``dt_bias`` as ``ssm_dt.bias``, the convolution squeezed to (C, K), and, when there are more value heads than key
  heads, the value heads reordered from grouped (by key head) to tiled;
- Bamba and Granite 4 hybrid (both ``granitehybrid``): the Mamba-2 layers' ``A_log`` as ``-exp(A_log)`` and ``A``,
  ``D`` as (H, 1), ``dt_bias`` as ``ssm_dt.bias``, the convolution squeezed to (C, K), the gated norm as (groups,
  features per group); the attention layers' q and k permuted as Llama's; each fused ``input_linear`` split into
  its gate and up tensors; one key/value head count per layer (0 on a Mamba-2 layer); ``rope.scaling.finetuned``
  true for Bamba (rotary) and false for Granite 4 hybrid (position-free, context 2**20);
- a tied head written once (no ``output.weight``).

Matrices are stored in the requested quantisation type (``gguf.quants.quantize`` where it implements it), and
vectors in F32 as llama.cpp keeps them. The K-quants (Q2_K .. Q6_K) have no quantizer in ``gguf``: their
blocks are written from random bits with small finite scales, and tests compare the loaded weights against
``gguf.quants.dequantize`` of those blocks.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

# The HF model_type -> the GGUF architecture llama.cpp's converter writes.
ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
         "gemma3_text": "gemma3", "phi3": "phi3", "gpt2": "gpt2", "olmo2": "olmo2", "olmo3": "olmo2", "glm4": "glm4",
         "lfm2": "lfm2", "glm4_moe": "glm4moe",
         "qwen3_5_text": "qwen35", "bamba": "granitehybrid", "granitemoehybrid": "granitehybrid",
         "nemotron_h": "nemotron_h"}
# the multi-token-prediction block's own tensors (llama.cpp's NEXTN tensors) and their shapes in units of (V, D)
NEXTN = {"eh_proj.weight": ("D", "2D"), "embed_tokens.weight": ("V", "D"), "enorm.weight": ("D",),
         "hnorm.weight": ("D",), "shared_head.head.weight": ("V", "D"), "shared_head.norm.weight": ("D",)}

# Byte offsets of the float16 scale fields in each K-quant block (the rest is quantized bits).
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}

QUANT_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
               Q.Q6_K)


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from (2, Dh/2) to (Dh/2, 2) order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_divisors(params: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama 3's scaling: each frequency's divisor (1, ``factor`` or between)."""
    freqs = 1.0 / (params["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    context = params["original_max_position_embeddings"]
    divisors = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            divisors.append(1.0)
        elif wavelength > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(divisors, dtype=np.float32)


def raw_k_quant_blocks(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks for a float tensor of ``shape``: random bits, float16 scales in [0.002, 0.02]."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    blocks = rng.integers(0, 256, size=(rows * shape[-1] // block, size), dtype=np.uint8)
    for offset in K_QUANT_SCALES[qtype]:
        scale = rng.uniform(0.002, 0.02, size=len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def _hf_tensors(model: Any) -> dict[str, np.ndarray]:
    return {name: p.detach().float().numpy().copy() for name, p in model.state_dict().items()}


def _attention_layers(cfg: Any) -> list[int]:
    """GraniteHybridModel.get_attn_layers: Granite's ``layer_types`` "attention", or Bamba's ``attn_layer_indices``
    (transformers names the kinds "full_attention" / "linear_attention" in both)."""
    return [i for i, kind in enumerate(cfg.layers_block_type) if kind in ("attention", "full_attention")]


def _granite_hybrid_metadata(writer: gguf.GGUFWriter, cfg: Any, model_type: str) -> None:
    """GraniteHybridModel.set_gguf_parameters (through GraniteMoeModel, GraniteModel and LlamaModel)."""
    heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    head_dim = hidden // heads  # GraniteModel drops any head_dim
    attention = _attention_layers(cfg)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    # Bamba's published config.json states attn_rotary_emb (the rotated features), which the converter writes
    rotated = int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(rotated if model_type == "bamba" else head_dim)
    if model_type == "granitemoehybrid":
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        for value, add in ((cfg.attention_multiplier, writer.add_attention_scale),
                           (cfg.embedding_multiplier, writer.add_embedding_scale),
                           (cfg.residual_multiplier, writer.add_residual_scale),
                           (cfg.logits_scaling, writer.add_logit_scale)):
            if value:
                add(value)
        writer.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    writer.add_ssm_conv_kernel(cfg.mamba_d_conv)
    writer.add_ssm_state_size(cfg.mamba_d_state)
    writer.add_ssm_group_count(cfg.mamba_n_groups)
    writer.add_ssm_inner_size(cfg.mamba_expand * hidden)
    writer.add_ssm_time_step_rank(cfg.mamba_n_heads)
    writer.add_head_count_kv([cfg.num_key_value_heads if i in attention else 0 for i in range(cfg.num_hidden_layers)])
    use_rope = model_type == "bamba" or len(attention) == cfg.num_hidden_layers
    writer.add_rope_scaling_finetuned(use_rope)
    writer.add_context_length(cfg.max_position_embeddings if use_rope else 2**20)


# transformers' names of Granite's expert tensors in memory -> in the checkpoint (its conversion_mapping)
_GRANITE_SAVED_NAMES = (("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"),
                        ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"),
                        ("block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight"))


def _granite_hybrid_tensors(name_map: Any, hf_name: str, w: np.ndarray, cfg: Any) -> list[tuple[str, np.ndarray]]:
    """GraniteHybridModel.modify_tensors for one tensor: (GGUF name, stored array) pairs, the Mamba-2 layers'
    through Mamba2Model's, the attention layers' through LlamaModel's permutation, ``input_linear`` split."""
    layer = int(hf_name.split(".")[2]) if hf_name.startswith("model.layers.") else None
    experts = bool(getattr(cfg, "num_local_experts", 0))
    for loaded, saved in _GRANITE_SAVED_NAMES:  # the converter reads the checkpoint's names
        hf_name = hf_name.replace(loaded, saved)
    if hf_name.endswith("input_linear.weight"):
        half = w.shape[-2] // 2
        kinds = ((gguf.MODEL_TENSOR.FFN_GATE_EXP, gguf.MODEL_TENSOR.FFN_UP_EXP) if "block_sparse_moe" in hf_name
                 else (gguf.MODEL_TENSOR.FFN_GATE_SHEXP, gguf.MODEL_TENSOR.FFN_UP_SHEXP) if experts
                 else (gguf.MODEL_TENSOR.FFN_GATE, gguf.MODEL_TENSOR.FFN_UP))
        return [(gguf.TENSOR_NAMES[kind].format(bid=layer) + ".weight", part)
                for kind, part in zip(kinds, (w[..., :half, :], w[..., half:, :]))]
    if hf_name.endswith("shared_mlp.output_linear.weight") and not experts:
        return [(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_DOWN].format(bid=layer) + ".weight", w)]
    if hf_name.endswith(".dt_bias"):
        hf_name = hf_name[:-len("dt_bias")] + "dt_proj.bias"
    gguf_name = _tensor_name(name_map, hf_name)
    assert gguf_name is not None, f"no GGUF name for {hf_name}"
    return [(gguf_name, _mamba2_or_attention(gguf_name, w, cfg, cfg.mamba_n_groups))]


def _mamba2_or_attention(gguf_name: str, w: np.ndarray, cfg: Any, groups: int) -> np.ndarray:
    """Mamba2Model.modify_tensors on a Mamba-2 layer's tensor (the convolution squeezed, A and D as (H, 1), A as
    -exp(A_log), the norm as (groups, features per group)), LlamaModel's permutation on q and k; others as they
    are."""
    if gguf_name.endswith("ssm_conv1d.weight"):
        return w.squeeze()
    if gguf_name.endswith("ssm_a"):
        return -np.exp(w.reshape(-1, 1))
    if gguf_name.endswith("ssm_d"):
        return w.reshape(-1, 1)
    if gguf_name.endswith("ssm_norm.weight"):
        return w.reshape(groups, -1)
    if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        return llama_permute(w, cfg.num_attention_heads)
    if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        return llama_permute(w, cfg.num_key_value_heads)
    return w


def _nemotron_h_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """NemotronHModel.set_gguf_parameters (GraniteHybridModel's, then the key length and one MLP width per
    layer): no rotary, so context 2**20."""
    kinds = cfg.layers_block_type
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_block_count(len(kinds))
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    # published Nemotron-H configs state rms_norm_eps beside layer_norm_epsilon (llama.cpp needs the first)
    writer.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
    writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    writer.add_ssm_conv_kernel(cfg.conv_kernel)
    writer.add_ssm_state_size(cfg.ssm_state_size)
    writer.add_ssm_group_count(cfg.n_groups)
    writer.add_ssm_inner_size(cfg.mamba_num_heads * cfg.mamba_head_dim)
    writer.add_ssm_time_step_rank(cfg.mamba_num_heads)
    writer.add_head_count_kv([cfg.num_key_value_heads if k == "full_attention" else 0 for k in kinds])
    writer.add_feed_forward_length([cfg.intermediate_size if k == "mlp" else 0 for k in kinds])
    writer.add_rope_scaling_finetuned(False)
    writer.add_context_length(2**20)


def _nemotron_h_tensors(name_map: Any, hf_name: str, w: np.ndarray, cfg: Any) -> list[tuple[str, np.ndarray]]:
    """NemotronHModel.modify_tensors (a dense model's: GraniteHybridModel's) for one tensor, read under the
    checkpoint's ``backbone.`` names."""
    hf_name = "backbone." + hf_name.removeprefix("model.") if hf_name.startswith("model.") else hf_name
    if hf_name.endswith(".dt_bias"):
        hf_name = hf_name[:-len("dt_bias")] + "dt_proj.bias"
    gguf_name = _tensor_name(name_map, hf_name)
    assert gguf_name is not None, f"no GGUF name for {hf_name}"
    return [(gguf_name, _mamba2_or_attention(gguf_name, w, cfg, cfg.n_groups))]


def _metadata(writer: gguf.GGUFWriter, arch: str, cfg: Any, model_type: str) -> None:
    """What llama.cpp's converter writes for each family (``set_gguf_parameters``)."""
    if arch == "granitehybrid":
        _granite_hybrid_metadata(writer, cfg, model_type)
        return
    if arch == "nemotron_h":
        _nemotron_h_metadata(writer, cfg)
        return
    if model_type == "gpt2":
        writer.add_block_count(cfg.n_layer)
        writer.add_context_length(cfg.n_positions)
        writer.add_embedding_length(cfg.n_embd)
        writer.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        writer.add_head_count(cfg.n_head)
        writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
        return
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    # GLM-4.5's blocks include the multi-token-prediction one
    writer.add_block_count(cfg.num_hidden_layers + (model_type == "glm4_moe"))
    writer.add_head_count(heads)
    params = cfg.rope_parameters
    if model_type == "lfm2":  # LFM2Model.set_gguf_parameters
        writer.add_head_count_kv([cfg.num_key_value_heads if kind != "conv" else 0 for kind in cfg.layer_types])
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_shortconv_l_cache(cfg.conv_L_cache)
        writer.add_layer_norm_rms_eps(cfg.norm_eps)
        width = cfg.intermediate_size
        if cfg.block_auto_adjust_ff_dim:
            width = int(2 * width / 3)
            if cfg.block_ffn_dim_multiplier is not None:
                width = int(cfg.block_ffn_dim_multiplier * width)
            width = cfg.block_multiple_of * ((width + cfg.block_multiple_of - 1) // cfg.block_multiple_of)
        writer.add_feed_forward_length(width)
        writer.add_rope_freq_base(params["rope_theta"])
        return
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if model_type == "olmo3":  # Olmo2Model: the full layers' rotary, the window, a flag per layer
        full = params["full_attention"]
        assert params["sliding_attention"] == {"rope_type": "default", "rope_theta": full["rope_theta"]}, \
            "llama.cpp rotates OLMo 3's sliding layers with the full layers' base, unscaled"
        writer.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type", "default") == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(full["factor"])
            writer.add_rope_scaling_attn_factors(full["attention_factor"])
            writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        elif full.get("rope_type", "default") != "default":
            raise NotImplementedError("llama.cpp's converter writes OLMo 3's YaRN only")
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in cfg.layer_types])
        return
    if model_type == "gemma3_text":
        full, sliding = params["full_attention"], params["sliding_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type", "default") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        assert sliding["rope_theta"] == 10000.0, "llama.cpp's gemma3 rotates sliding layers with base 10000"
        flags = [kind == "sliding_attention" for kind in cfg.layer_types]
        if flags != [(i + 1) % 6 != 0 for i in range(cfg.num_hidden_layers)]:  # not llama.cpp's default period
            writer.add_sliding_window_pattern(flags)
    else:
        writer.add_rope_freq_base(params["rope_theta"])
        kind = params.get("rope_type", "default")
        if kind == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(params["factor"])
        elif kind == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(params["factor"])
            writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        elif kind == "llama3":  # llama.cpp's LlamaModel: one divisor per frequency, as a tensor
            writer.add_tensor("rope_freqs.weight", llama3_divisors(params, head_dim))
        elif kind == "longrope" and model_type == "phi3":
            original = cfg.original_max_position_embeddings
            factor = cfg.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(original))
                                                 if factor > 1 else 1.0)
            writer.add_rope_scaling_orig_ctx_len(original)
            for which in ("long", "short"):
                writer.add_tensor(f"rope_factors_{which}.weight", np.asarray(params[f"{which}_factor"], np.float32))
        elif kind != "default":
            raise NotImplementedError(f"this test converter does not write rope_type {kind}")
    if model_type in ("llama", "mistral"):
        writer.add_rope_dimension_count(head_dim)
    if model_type == "glm4_moe":  # Glm4MoeModel.set_gguf_parameters, and TextModel's expert groups
        writer.add_expert_count(cfg.n_routed_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_count(cfg.n_shared_experts)
        writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(cfg.routed_scaling_factor)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
        writer.add_nextn_predict_layers(1)
    if model_type in ("qwen3", "gemma2", "gemma3_text", "glm4", "glm4_moe", "qwen3_5_text"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if model_type in ("glm4", "glm4_moe"):  # Glm4Model, Glm4MoeModel: the rotated half of each head
        writer.add_rope_dimension_count(int(head_dim * params.get("partial_rotary_factor", 0.5)))
    if model_type == "qwen3_5_text":
        full = [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"]
        interval = full[0] + 1
        assert full == list(range(interval - 1, cfg.num_hidden_layers, interval)), "llama.cpp reads an interval"
        writer.add_rope_dimension_count(int(head_dim * params.get("partial_rotary_factor", 0.25)))
        writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
        writer.add_ssm_state_size(cfg.linear_key_head_dim)
        writer.add_ssm_group_count(cfg.linear_num_key_heads)
        writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
        writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
        writer.add_full_attention_interval(interval)
    if model_type == "phi3":
        writer.add_rope_dimension_count(int(head_dim * params.get("partial_rotary_factor", 1.0)))
        if cfg.sliding_window is not None:
            writer.add_sliding_window(cfg.sliding_window)
    if model_type in ("gemma2", "gemma3_text"):
        writer.add_sliding_window(cfg.sliding_window)
    if model_type == "gemma2":
        if cfg.attn_logit_softcapping is not None:
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if cfg.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)


def _tiled(w: np.ndarray, axis: int, key_heads: int, width: int) -> np.ndarray:
    """llama.cpp's ``_reorder_v_heads``: value heads grouped by key head (K, R, W) -> tiled (R, K, W) on ``axis``."""
    shape = w.shape
    grouped = w.reshape(shape[:axis] + (key_heads, shape[axis] // (key_heads * width), width) + shape[axis + 1:])
    return np.swapaxes(grouped, axis, axis + 1).reshape(shape)


def _qwen35_tensor(hf_name: str, w: np.ndarray, cfg: Any) -> tuple[str, np.ndarray]:
    """Qwen3NextModel's and _LinearAttentionVReorderBase's ``modify_tensors`` for one Qwen3.5 tensor."""
    k, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if "linear_attn." in hf_name and k != cfg.linear_num_value_heads:
        qk = 2 * k * dk
        if ".in_proj_qkv." in hf_name:
            w = np.concatenate([w[:qk], _tiled(w[qk:], 0, k, dv)])
        elif ".in_proj_z." in hf_name:
            w = _tiled(w, 0, k, dv)
        elif ".in_proj_b." in hf_name or ".in_proj_a." in hf_name or hf_name.endswith((".A_log", ".dt_bias")):
            w = _tiled(w, 0, k, 1)
        elif ".conv1d." in hf_name:
            w = w.squeeze()
            w = np.concatenate([w[:qk], _tiled(w[qk:], 0, k, dv)])
        elif ".out_proj." in hf_name:
            w = _tiled(w, 1, k, dv)
    if hf_name.endswith(".A_log"):
        w = -np.exp(w)
    elif hf_name.endswith(".dt_bias"):
        hf_name = hf_name[:-len("dt_bias")] + "dt_proj.bias"
    elif "conv1d" in hf_name:
        w = w.squeeze()
    elif hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        w = w + 1.0
    return hf_name, w


def _glm4_moe_tensors(tensors: dict[str, np.ndarray], cfg: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The tensors as Glm4MoeModel converts them: each expert matrix stacked (E, ...) under the name without an
    expert index (transformers fuses gate and up in memory: split back), the routing bias as
    ``e_score_correction.bias``, and a multi-token-prediction layer after the last (the last layer's tensors
    under the next index, with the NEXTN tensors, random) as GLM-4.5's checkpoints carry it."""
    out = {}
    for name, w in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # (E, 2F, D): gate rows, then up rows
            base, f = name[:-len("gate_up_proj")], w.shape[1] // 2
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = w[:, :f], w[:, f:]
        elif name.endswith("mlp.experts.down_proj"):
            out[name + ".weight"] = w
        else:
            out[name.replace("e_score_correction_bias", "e_score_correction.bias")] = w
    last, after = f"model.layers.{cfg.num_hidden_layers - 1}.", f"model.layers.{cfg.num_hidden_layers}."
    out.update({after + n[len(last):]: w for n, w in list(out.items()) if n.startswith(last)})
    sizes = {"V": cfg.vocab_size, "D": cfg.hidden_size, "2D": 2 * cfg.hidden_size}
    out.update({after + n: rng.standard_normal([sizes[u] for u in units]).astype(np.float32)
                for n, units in NEXTN.items()})
    return out


def _tensor_name(name_map: Any, hf_name: str) -> str | None:
    if hf_name == "lm_head.weight":
        return "output.weight"
    whole = name_map.get_name(hf_name)  # a name gguf maps whole, without .weight / .bias (A_log)
    if whole is not None:
        return whole
    stem, suffix = hf_name.rsplit(".", 1)
    gguf_name = name_map.get_name(stem)
    return None if gguf_name is None else f"{gguf_name}.{suffix}"


def write_gguf(model: Any, path: Path, qtype: Q = Q.F32, tokenizer: dict | None = None, *,
               rng: np.random.Generator | None = None, name: str = "tiny") -> dict[str, np.ndarray]:
    """Write ``model`` (a ``transformers`` causal LM) to ``path`` as llama.cpp would, matrices in ``qtype``.

    ``tokenizer``: metadata from :func:`byte_level_metadata` or :func:`sentencepiece_metadata` (else a plain
    vocabulary of ``<t{i}>`` tokens). Returns GGUF tensor name -> the stored array (blocks for quantized types).
    """
    cfg = model.config
    model_type = cfg.model_type
    arch = ARCHS[model_type]
    rng = rng or np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    _metadata(writer, arch, cfg, model_type)
    tokenizer = tokenizer or plain_vocabulary(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    _add_tokenizer(writer, tokenizer)
    writer.add_file_type(int(qtype) if qtype in (Q.F32, Q.F16) else 7)
    tensors = _hf_tensors(model)
    blocks = cfg.num_hidden_layers
    if model_type == "glm4_moe":
        tensors, blocks = _glm4_moe_tensors(tensors, cfg, rng), blocks + 1
    # gguf's own names of its architectures: "glm4moe" is GLM4_MOE, "granitehybrid" GRANITE_HYBRID
    model_arch = {n: a for a, n in gguf.MODEL_ARCH_NAMES.items()}[arch]
    name_map = gguf.get_tensor_name_map(model_arch, blocks)
    stored = {}
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for hf_name, w in tensors.items():
        hf_name = hf_name.removeprefix("model.").removeprefix("transformer.")
        if hf_name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue
        if hf_name == "lm_head.weight" and tied:
            continue
        full = ("model." if model_type != "gpt2" else "transformer.") + hf_name
        if arch in ("granitehybrid", "nemotron_h"):
            source = "lm_head.weight" if hf_name == "lm_head.weight" else full
            convert = _granite_hybrid_tensors if arch == "granitehybrid" else _nemotron_h_tensors
            for gguf_name, part in convert(name_map, source, w, cfg):
                stored[gguf_name] = _add_tensor(writer, gguf_name, part, qtype, rng)
            continue
        if model_type == "qwen3_5_text":
            full, w = _qwen35_tensor(full, w, cfg)
        gguf_name = _tensor_name(name_map, "lm_head.weight" if hf_name == "lm_head.weight" else full)
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        if model_type in ("llama", "mistral"):
            if gguf_name.endswith("attn_q.weight") or gguf_name.endswith("attn_q.bias"):
                w = llama_permute(w, cfg.num_attention_heads)
            elif gguf_name.endswith("attn_k.weight") or gguf_name.endswith("attn_k.bias"):
                w = llama_permute(w, cfg.num_key_value_heads)
        if model_type == "lfm2" and gguf_name.endswith("shortconv.conv.weight"):
            w = w.squeeze(1)  # (C, 1, K) -> (C, K): "conv op requires 2d tensor"
        if model_type in ("gemma2", "gemma3_text") and gguf_name.endswith("norm.weight"):
            w = w + 1.0
        if model_type == "gpt2" and gguf_name.endswith(("attn_qkv.weight", "attn_output.weight", "ffn_up.weight",
                                                         "ffn_down.weight")):
            w = np.ascontiguousarray(w.T)
        stored[gguf_name] = _add_tensor(writer, gguf_name, w, qtype, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _add_tensor(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    # the converter keeps vectors, norms, routers and Mamba's A, D and convolution in float32
    kept = name.endswith(("_norm.weight", "ffn_gate_inp.weight", "ssm_a", "ssm_d", "ssm_conv1d.weight"))
    if w.ndim == 1 or kept or qtype == Q.F32 or w.shape[-1] % block:
        data = w.astype(np.float32)
        writer.add_tensor(name, data)
        return data
    if qtype == Q.F16:
        data = w.astype(np.float16)
        writer.add_tensor(name, data)
        return data
    if qtype in K_QUANT_SCALES:
        data = raw_k_quant_blocks(w.shape, qtype, rng)
    else:
        data = gguf.quants.quantize(w.astype(np.float32), qtype)
    writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    return data


def plain_vocabulary(vocab: int, bos: int | None, eos: int | None) -> dict:
    """Tokenizer metadata for models without a real tokenizer: byte-level tokens ``t0`` .. ``t{V-1}``."""
    meta = {"model": "gpt2", "pre": "default", "tokens": [f"t{i}" for i in range(vocab)], "merges": [],
            "token_type": [1] * vocab, "padding_token_id": 0}
    if bos is not None:
        meta["bos_token_id"] = bos
    if eos is not None:
        meta["eos_token_id"] = eos
    return meta


def byte_level_metadata(hf_tokenizer: Any, pre: str = "default") -> dict:
    """llama.cpp's ``_set_vocab_gpt2`` for a byte-level BPE ``tokenizer.json``: tokens by id, merges, types
    (3 = control for the special tokens), the special ids and the chat template."""
    import json

    backend = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    vocab = backend["model"]["vocab"]
    added = {t["id"]: t for t in backend["added_tokens"]}
    tokens = [None] * (max(max(vocab.values()), max(added, default=0)) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    types = [1] * len(tokens)
    for index, entry in added.items():
        tokens[index] = entry["content"]
        types[index] = 3 if entry["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
    meta = {"model": "gpt2", "pre": pre, "tokens": tokens, "merges": merges, "token_type": types,
            "add_bos_token": False}
    for key, token in (("bos_token_id", hf_tokenizer.bos_token), ("eos_token_id", hf_tokenizer.eos_token),
                       ("padding_token_id", hf_tokenizer.pad_token), ("unknown_token_id", hf_tokenizer.unk_token)):
        if token is not None:
            meta[key] = tokens.index(token)
    if hf_tokenizer.chat_template:
        meta["chat_template"] = hf_tokenizer.chat_template
    return meta


def _add_tokenizer(writer: gguf.GGUFWriter, meta: dict) -> None:
    writer.add_tokenizer_model(meta["model"])
    if "pre" in meta:
        writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    if meta.get("merges"):
        writer.add_token_merges(meta["merges"])
    if "scores" in meta:
        writer.add_token_scores(meta["scores"])
    writer.add_token_types(meta["token_type"])
    for key in ("bos_token_id", "eos_token_id", "eot_token_id", "padding_token_id", "unknown_token_id"):
        if key in meta:
            writer.add_uint32(f"tokenizer.ggml.{key}", meta[key])
    for key in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        if key in meta:
            writer.add_bool(f"tokenizer.ggml.{key}", meta[key])
    if "chat_template" in meta:
        writer.add_chat_template(meta["chat_template"])


def sentencepiece_metadata(texts: list[str], vocab_size: int = 400, chat_template: str | None = None) -> dict:
    """A SentencePiece-style BPE vocabulary as llama.cpp's ``_set_vocab_sentencepiece`` writes it: ``<unk>``,
    ``<s>``, ``</s>``, the 256 byte tokens ``<0x00>`` .. ``<0xFF>`` (type 6), then pieces spelled with ``▁``
    scored by their merge rank (no merges stored: readers rebuild them from the scores)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[], show_progress=False)
    backend.train_from_iterator(texts, trainer)
    learned = sorted(backend.get_vocab().items(), key=lambda item: item[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for rank, (token, _) in enumerate(learned):
        tokens.append(token)
        types.append(1)
        scores.append(-float(rank))
    meta = {"model": "llama", "tokens": tokens, "scores": scores, "token_type": types, "bos_token_id": 1,
            "eos_token_id": 2, "unknown_token_id": 0, "add_bos_token": True, "add_eos_token": False}
    if chat_template is not None:
        meta["chat_template"] = chat_template
    return meta


_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, bos_token_id=1, eos_token_id=95, rms_norm_eps=1e-5)

# Tiny models whose whole config a GGUF file states. transformers' own GGUF loader reads fewer keys (no head_dim
# for Qwen3, no softcaps or query_pre_attn_scalar for Gemma, no rope scaling or biases) and falls back on its
# config classes' defaults; these specs use those defaults (head_dim 128 / 256, Gemma's softcaps) so it reads
# the same model. name -> (transformers config class, keyword arguments).
TRANSFORMERS_READABLE = {
    # transformers reads GGUF's context_length into GPT2Config's n_ctx, not n_positions (default 1024)
    "gpt2": ("GPT2Config", dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=1024, bos_token_id=1,
                                eos_token_id=95)),
    "llama": ("LlamaConfig", dict(_COMMON, num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(_COMMON, num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(_COMMON, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(_COMMON, num_key_value_heads=2, head_dim=128)),
    "phi3": ("Phi3Config", dict(_COMMON, num_key_value_heads=2, pad_token_id=0)),
    "gemma2": ("Gemma2Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=256,
                                    query_pre_attn_scalar=256, sliding_window=3, pad_token_id=0)),
    "gemma3": ("Gemma3TextConfig", dict(_COMMON, num_hidden_layers=7, num_key_value_heads=2, head_dim=256,
                                        query_pre_attn_scalar=256, sliding_window=3, pad_token_id=0)),
    # rows of 256 values, the K-quants' block (the quantisation tests)
    "llama_wide": ("LlamaConfig", dict(_COMMON, hidden_size=256, intermediate_size=512, num_key_value_heads=2)),
}
# What llama.cpp reads and transformers' GGUF loader drops (compared with the float model only).
FLOAT_ONLY = {
    "gemma2_softcaps": ("Gemma2Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=1, head_dim=12,
                                             query_pre_attn_scalar=12, sliding_window=3, attn_logit_softcapping=2.0,
                                             final_logit_softcapping=3.0, pad_token_id=0)),
    "gemma3_linear": ("Gemma3TextConfig", dict(_COMMON, num_hidden_layers=7, num_key_value_heads=2, head_dim=8,
                                               query_pre_attn_scalar=8, sliding_window=3, pad_token_id=0,
                                               rope_parameters={"full_attention": {"rope_type": "linear",
                                                                                   "factor": 2.0,
                                                                                   "rope_theta": 1000.0},
                                                                "sliding_attention": {"rope_type": "default",
                                                                                      "rope_theta": 10000.0}})),
    # OLMo 3 as llama.cpp writes it (olmo2): YaRN with its attention factor on the full layers, the sliding ones
    # with the same base unscaled, the default pattern (each fourth layer full)
    "olmo3_yarn": ("Olmo3Config", dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, sliding_window=3,
                                       rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                                           "original_max_position_embeddings": 16,
                                                                           "attention_factor": 1.3,
                                                                           "rope_theta": 1000.0},
                                                        "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 1000.0}})),
    # full and sliding layers in an order of their own, biases, a tied head, no scaling
    "olmo3_layer_types": ("Olmo3Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=1, sliding_window=2,
                                              attention_bias=True, tie_word_embeddings=True,
                                              layer_types=["full_attention", "sliding_attention", "full_attention"],
                                              rope_parameters={"full_attention": {"rope_type": "default",
                                                                                  "rope_theta": 500.0},
                                                               "sliding_attention": {"rope_type": "default",
                                                                                     "rope_theta": 500.0}})),
    # Qwen3.5: more value heads than key heads (reordered by the converter), then as many
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=8,
                                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                               linear_value_head_dim=6, full_attention_interval=2)),
    "qwen3_5_text_even": ("Qwen3_5TextConfig", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=1, head_dim=16,
                                                    linear_num_key_heads=2, linear_num_value_heads=2,
                                                    linear_key_head_dim=4, linear_value_head_dim=8,
                                                    linear_conv_kernel_dim=3, full_attention_interval=3)),
    # Granite 4 hybrid as llama.cpp runs it (position-free): Mamba-2 layers (4 heads of 16, 2 groups of 8 state
    # channels) beside attention, Granite's four scalars, the top 2 of 4 experts beside a shared MLP
    "granitemoehybrid_nope": ("GraniteMoeHybridConfig", dict(_COMMON, intermediate_size=12, num_hidden_layers=3,
                                                             num_key_value_heads=2, num_local_experts=4,
                                                             num_experts_per_tok=2, shared_intermediate_size=24,
                                                             layer_types=["mamba", "attention", "mamba"],
                                                             mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8,
                                                             mamba_d_conv=3, mamba_chunk_size=4,
                                                             position_embedding_type="nope", embedding_multiplier=3.0,
                                                             attention_multiplier=0.3, residual_multiplier=0.5,
                                                             logits_scaling=2.0)),
    # Nemotron-H with no floor on dt that can act (llama.cpp holds it at none; transformers' initialisation takes
    # the log of the floor, so 1e-9, below any step size softplus gives here): Mamba-2 with 2 groups,
    # position-free attention, the squared-ReLU MLP; then one group, projection and MLP biases, no convolution
    # bias, the MLP first
    "nemotron_h_no_floor": ("NemotronHConfig", dict(vocab_size=96, hidden_size=32, intermediate_size=48,
                                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                    max_position_embeddings=64, bos_token_id=1, eos_token_id=95,
                                                    layers_block_type=["linear_attention", "full_attention", "mlp",
                                                                       "linear_attention", "full_attention", "mlp"],
                                                    mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                                                    ssm_state_size=8, conv_kernel=3, chunk_size=4,
                                                    time_step_min=1e-9)),
    "nemotron_h_bias_no_floor": ("NemotronHConfig", dict(vocab_size=96, hidden_size=32, intermediate_size=40,
                                                         num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                                         max_position_embeddings=64, bos_token_id=1, eos_token_id=95,
                                                         hybrid_override_pattern="-M*M", mamba_num_heads=2,
                                                         mamba_head_dim=16, n_groups=1, ssm_state_size=6,
                                                         conv_kernel=4, chunk_size=3, use_bias=True, mlp_bias=True,
                                                         use_conv_bias=False, time_step_min=1e-9)),
    # sliding and full layers in an order of their own: one flag per layer in the metadata
    "gemma3_layer_types": ("Gemma3TextConfig", dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=8,
                                                    query_pre_attn_scalar=8, sliding_window=3, pad_token_id=0,
                                                    layer_types=["full_attention", "sliding_attention",
                                                                 "full_attention", "sliding_attention"])),
}


def build_model(name: str, seed: int = 0):
    """The (random, seeded) transformers model of ``TRANSFORMERS_READABLE`` or ``FLOAT_ONLY``, in eval mode."""
    import transformers

    import torch

    class_name, kwargs = {**TRANSFORMERS_READABLE, **FLOAT_ONLY}[name]
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # larger weights than the 0.02 init, so logits differ clearly between tokens
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.08)
    return model.eval()


def transformers_gguf_model(folder: Path, file_name: str):
    """transformers' own loading of a GGUF file (``from_pretrained(folder, gguf_file=...)``), float32, eager.

    transformers asks for ``accelerate`` before reading a GGUF file although its GGUF path never uses it; the
    test environment does not install accelerate, so the check is answered for this one call.
    """
    from unittest import mock

    import transformers
    import transformers.modeling_utils

    import torch

    with mock.patch.object(transformers.modeling_utils, "is_accelerate_available", return_value=True):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=file_name,
                                                                  dtype=torch.float32, attn_implementation="eager")
    return model.eval()


# -- raw files: any header, written byte by byte (fast for large arrays, and able to write what GGUFWriter won't) --
_RAW_SCALARS = {"uint8": "<B", "int8": "<b", "uint16": "<H", "int16": "<h", "uint32": "<I", "int32": "<i",
                "float32": "<f", "bool": "<?", "uint64": "<Q", "int64": "<q", "float64": "<d"}
_RAW_IDS = {"uint8": 0, "int8": 1, "uint16": 2, "int16": 3, "uint32": 4, "int32": 5, "float32": 6, "bool": 7,
            "string": 8, "array": 9, "uint64": 10, "int64": 11, "float64": 12}
_RAW_DTYPES = {"uint8": "u1", "int8": "i1", "uint16": "<u2", "int16": "<i2", "uint32": "<u4", "int32": "<i4",
               "float32": "<f4", "bool": "u1", "uint64": "<u8", "int64": "<i8", "float64": "<f8"}


def _raw_text(text: str | bytes) -> bytes:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return len(data).to_bytes(8, "little") + data


def _raw_value(kind: str, value: Any) -> bytes:
    import struct

    if kind == "string":
        return _raw_text(value)
    if kind in _RAW_SCALARS:
        return struct.pack(_RAW_SCALARS[kind], value)
    item = kind[len("array["):-1]
    head = _RAW_IDS[item].to_bytes(4, "little") + len(value).to_bytes(8, "little")
    if item == "string":
        return head + b"".join(_raw_text(v) for v in value)
    return head + np.ascontiguousarray(value, dtype=_RAW_DTYPES[item]).tobytes()


def write_raw_gguf(path: Path, metadata: dict[str, tuple[str, Any]], tensors: tuple = (), *,
                   offsets: list[int] | None = None, alignment: int = 32) -> Path:
    """A GGUF file written field by field: ``metadata`` key -> (GGUF type name, value), e.g. ``("uint32", 7)``,
    ``("array[string]", [...])``, or ``("raw", bytes)`` (the type id and the value's bytes, written as given);
    ``tensors`` (name, float32 array) written as F32 in order. ``offsets`` replaces the data offsets the table
    states (the data stays where it is written), to make a corrupt layout."""
    out = [b"GGUF", (3).to_bytes(4, "little"), len(tensors).to_bytes(8, "little"), len(metadata).to_bytes(8, "little")]
    for key, (kind, value) in metadata.items():
        if kind == "raw":  # the value type id and the value's bytes, as given
            out += [_raw_text(key), value]
            continue
        type_id = _RAW_IDS["array" if kind.startswith("array[") else kind]
        out += [_raw_text(key), type_id.to_bytes(4, "little"), _raw_value(kind, value)]
    data, at = [], 0
    for index, (name, array) in enumerate(tensors):
        array = np.ascontiguousarray(array, dtype=np.float32)
        offset = at if offsets is None else offsets[index]
        out += [_raw_text(name), array.ndim.to_bytes(4, "little"),
                *(int(n).to_bytes(8, "little") for n in reversed(array.shape)), (0).to_bytes(4, "little"),
                offset.to_bytes(8, "little")]
        blob = array.tobytes() + b"\0" * (-array.nbytes % alignment)
        data.append(blob)
        at += len(blob)
    header = b"".join(out)
    path.write_bytes(header + b"\0" * (-len(header) % alignment) + b"".join(data))
    return path
