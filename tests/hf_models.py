"""Tiny random Hugging Face decoder models, built offline and saved once per test session.

``saved_model(name, root)`` builds the model described by ``SPECS[name]`` with ``transformers`` (seeded),
writes it with ``save_pretrained`` under ``root / name`` and returns ``(folder, hf_model)``; later calls with the
same name return the cached pair, so every test file shares one build. ``hf_logits`` runs the HF model the
way attnkit's ``CausalLM`` is specified: positions from the mask (cumulative sum - 1).

All models have a 96-token vocabulary, width 32 and 4 query heads of 8 features, small enough that a whole
family's parity check takes well under a second.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np

import torch

VOCAB = 96
EOS = 95

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, bos_token_id=1, eos_token_id=EOS, rms_norm_eps=1e-5)

# name -> (transformers config class, keyword arguments, save_pretrained keyword arguments)
SPECS: dict[str, tuple[str, dict, dict]] = {
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                                eos_token_id=EOS), {}),
    "gpt2_untied": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                       activation_function="gelu", tie_word_embeddings=False, bos_token_id=1,
                                       eos_token_id=EOS),
                    {}),
    "llama_gqa": ("LlamaConfig", dict(_COMMON, num_key_value_heads=2, attention_bias=True, mlp_bias=True), {}),
    "llama_mqa": ("LlamaConfig", dict(_COMMON, num_key_value_heads=1, tie_word_embeddings=True,
                                      rope_theta=500.0), {}),
    "llama_linear": ("LlamaConfig", dict(_COMMON, num_key_value_heads=2,
                                         rope_scaling={"rope_type": "linear", "factor": 2.0}), {}),
    "llama_dynamic": ("LlamaConfig", dict(_COMMON, num_key_value_heads=2, max_position_embeddings=8,
                                          rope_scaling={"type": "dynamic", "factor": 2.0}), {}),
    "llama_yarn": ("LlamaConfig", dict(_COMMON, num_key_value_heads=2, max_position_embeddings=32,
                                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000.0,
                                                        "original_max_position_embeddings": 8}), {}),
    "llama_llama3": ("LlamaConfig", dict(_COMMON, num_key_value_heads=2,
                                         rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 16}), {}),
    "mistral_window": ("MistralConfig", dict(_COMMON, num_key_value_heads=2, sliding_window=4), {}),
    # Ministral: Mistral with a window on the layers layer_types marks
    "ministral": ("MinistralConfig", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=8,
                                          sliding_window=3,
                                          layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                  {}),
    "qwen2_mixed": ("Qwen2Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, use_sliding_window=True,
                                        sliding_window=4, max_window_layers=1, tie_word_embeddings=True), {}),
    "qwen2_layer_types": ("Qwen2Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=1,
                                              use_sliding_window=True, sliding_window=3,
                                              layer_types=["sliding_attention", "full_attention",
                                                           "sliding_attention"]), {}),
    "llama_sharded": ("LlamaConfig", dict(_COMMON, num_key_value_heads=2), {"max_shard_size": "20KB"}),
    # head_dim 12 is not hidden_size / heads = 8: Qwen3 sizes its heads explicitly
    "qwen3": ("Qwen3Config", dict(_COMMON, num_key_value_heads=2, head_dim=12), {}),
    "qwen3_window": ("Qwen3Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=1, head_dim=8,
                                         attention_bias=True, use_sliding_window=True, sliding_window=3,
                                         max_window_layers=1, tie_word_embeddings=True), {}),
    # OLMo 2: RMSNorm over the whole q/k projections, post-norms only
    "olmo2": ("Olmo2Config", dict(_COMMON, num_key_value_heads=2), {}),
    "olmo2_bias_mqa": ("Olmo2Config", dict(_COMMON, num_key_value_heads=1, attention_bias=True,
                                           tie_word_embeddings=True, rope_parameters={"rope_type": "linear",
                                                                                      "factor": 2.0,
                                                                                      "rope_theta": 500.0}), {}),
    # OLMo 3: OLMo 2 with sliding layers, linear scaling on the full layers only, a base of its own on the sliding
    "olmo3": ("Olmo3Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, sliding_window=3,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1000.0},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 50.0}}), {}),
    # GLM-4: norms before and after each branch, interleaved rotary on half of each head, q/k/v biases, fused
    # gate_up_proj
    "glm4": ("Glm4Config", dict(_COMMON, num_key_value_heads=2, head_dim=8, pad_token_id=0), {}),
    # Granite: scaled embeddings, scores, branch outputs and logits; biases everywhere
    "granite": ("GraniteConfig", dict(_COMMON, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                                      embedding_multiplier=2.5, attention_multiplier=0.3, residual_multiplier=0.4,
                                      logits_scaling=2.5), {}),
    # Seed-OSS: q/k/v biases and an output bias of their own switch, a gated MLP with biases
    "seed_oss": ("SeedOssConfig", dict(_COMMON, num_key_value_heads=2, head_dim=12, attention_out_bias=True,
                                       mlp_bias=True, pad_token_id=0), {}),
    # EXAONE 4: OLMo 2's post-norms, per-head q/k norms, sliding layers and a full layer without rotary
    "exaone4": ("Exaone4Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, sliding_window=3,
                                      sliding_window_pattern=2), {}),
    # ERNIE 4.5: interleaved rotary over the whole head, biases on every projection, a tied head
    "ernie4_5": ("Ernie4_5Config", dict(_COMMON, num_key_value_heads=2, head_dim=8, use_bias=True), {}),
    # HunYuan: per-head q/k norms after the rotation, the "dynamic" scaling with a fixed alpha, biases
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(_COMMON, num_key_value_heads=2, head_dim=8, attention_bias=True,
                                                      rope_parameters={"rope_type": "dynamic", "alpha": 20.0,
                                                                       "factor": 1.0, "rope_theta": 1000.0}), {}),
    # Apertus: an ungated MLP with xIELU's learned slopes, per-head q/k norms, llama3 scaling
    "apertus": ("ApertusConfig", dict(_COMMON, num_key_value_heads=2, head_dim=8,
                                      rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 16}), {}),
    # SmolLM3: every second layer without rotary; with a window on a NoPE layer
    "smollm3": ("SmolLM3Config", dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, no_rope_layer_interval=2,
                                      tie_word_embeddings=False, pad_token_id=None), {}),
    "smollm3_window": ("SmolLM3Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=1, mlp_bias=True,
                                             attention_bias=True, use_sliding_window=True, sliding_window=3,
                                             no_rope_layers=[1, 0, 1], pad_token_id=None), {}),
    # GPT-NeoX: a quarter (then a half) of each head rotated, parallel (then sequential) residual
    "gpt_neox": ("GPTNeoXConfig", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=64, bos_token_id=1,
                                       eos_token_id=EOS), {}),
    "gpt_neox_sequential": ("GPTNeoXConfig", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  max_position_embeddings=64, bos_token_id=1, eos_token_id=EOS,
                                                  use_parallel_residual=False, attention_bias=False,
                                                  hidden_act="gelu_new", tie_word_embeddings=True,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 300.0,
                                                                   "partial_rotary_factor": 0.5}), {}),
    # Gemma 2: soft-capped scores and logits, alternating sliding/full layers, (1 + w) norms, scaled embeddings
    "gemma2": ("Gemma2Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=12,
                                    query_pre_attn_scalar=16, sliding_window=3, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=3.0, pad_token_id=0), {}),
    "gemma2_mqa_untied": ("Gemma2Config", dict(_COMMON, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8,
                                               sliding_window=4, attention_bias=True, tie_word_embeddings=False,
                                               final_logit_softcapping=None, pad_token_id=0), {}),
    # Gemma 3: q/k norms, a rotary base per layer type (linear scaling on the full layers), no soft-caps
    "gemma3_text": ("Gemma3TextConfig", dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=8,
                                             query_pre_attn_scalar=8, sliding_window=3, pad_token_id=0,
                                             layer_types=["sliding_attention", "sliding_attention",
                                                          "full_attention", "sliding_attention"],
                                             rope_parameters={"full_attention": {"rope_type": "linear",
                                                                                 "factor": 2.0,
                                                                                 "rope_theta": 1000.0},
                                                              "sliding_attention": {"rope_type": "default",
                                                                                    "rope_theta": 50.0}}), {}),
    # Gemma 4: wider global layers (proportional rotary) whose keys are the values, the last two layers reusing
    # keys and values (with double-wide MLPs), per-layer inputs, a soft-capped head
    "gemma4_text": ("Gemma4TextConfig", dict(_COMMON, num_hidden_layers=5, num_key_value_heads=2, head_dim=8,
                                             global_head_dim=16, num_global_key_value_heads=1, sliding_window=3,
                                             pad_token_id=0, attention_k_eq_v=True, num_kv_shared_layers=2,
                                             use_double_wide_mlp=True, final_logit_softcapping=3.0,
                                             hidden_size_per_layer_input=4, vocab_size_per_layer_input=VOCAB,
                                             layer_types=["sliding_attention", "full_attention",
                                                          "sliding_attention", "sliding_attention",
                                                          "full_attention"],
                                             rope_parameters={"full_attention": {"rope_type": "proportional",
                                                                                 "partial_rotary_factor": 0.5,
                                                                                 "rope_theta": 1000.0},
                                                              "sliding_attention": {"rope_type": "default",
                                                                                    "rope_theta": 50.0}}), {}),
    # Phi-3: fused qkv_proj and gate_up_proj; longrope (short factors up to 8 positions, long past); partial rotary
    "phi3": ("Phi3Config", dict(_COMMON, num_key_value_heads=2, pad_token_id=None), {}),
    "phi3_longrope": ("Phi3Config", dict(_COMMON, num_key_value_heads=1, pad_token_id=None,
                                         original_max_position_embeddings=8,
                                         rope_parameters={"rope_type": "longrope", "rope_theta": 1000.0,
                                                          "short_factor": [1.0, 1.3, 2.0, 3.5],
                                                          "long_factor": [1.5, 2.5, 4.0, 9.0]}), {}),
    "phi3_partial_window": ("Phi3Config", dict(_COMMON, num_key_value_heads=4, pad_token_id=None, sliding_window=4,
                                               tie_word_embeddings=True,
                                               rope_parameters={"rope_type": "default", "rope_theta": 300.0,
                                                                "partial_rotary_factor": 0.5}), {}),
    # gpt-oss: learned sinks, biases, alternating sliding/full layers, YaRN, a top-2-of-4 mixture of experts
    "gpt_oss": ("GptOssConfig", dict(_COMMON, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=4,
                                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000.0,
                                                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                      "original_max_position_embeddings": 16}), {}),
    # widths that are multiples of MXFP4's 32-value blocks (the MXFP4 loading test)
    "gpt_oss_wide": ("GptOssConfig", dict(_COMMON, intermediate_size=64, num_key_value_heads=2, head_dim=8,
                                          num_local_experts=3, num_experts_per_tok=2, sliding_window=4), {}),
    # YaRN's truncated ramp, three layers, top-3 of 5 and a SwiGLU limit low enough that the clamps act
    "gpt_oss_clamped": ("GptOssConfig", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=1, head_dim=8,
                                             num_local_experts=5, num_experts_per_tok=3, sliding_window=3,
                                             swiglu_limit=0.3, swiglu_alpha=1.2, tie_word_embeddings=True,
                                             rope_parameters={"rope_type": "yarn", "factor": 8.0,
                                                              "rope_theta": 500.0, "truncate": True,
                                                              "original_max_position_embeddings": 8}), {}),
    # Qwen3.5 (text): Gated DeltaNet layers (2 key heads, 4 value heads) and gated full layers, partial rotary
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=8,
                                               linear_num_key_heads=2, linear_num_value_heads=4,
                                               linear_key_head_dim=8, linear_value_head_dim=6,
                                               layer_types=["linear_attention", "full_attention",
                                                            "linear_attention", "full_attention"]), {}),
    # Qwen3.5-MoE: Qwen3.5's layers, every MLP top-2-of-4 experts (renormalised) and a gated shared expert
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict({k: v for k, v in _COMMON.items() if k != "intermediate_size"},
                                                      num_hidden_layers=4, num_key_value_heads=2, head_dim=8,
                                                      linear_num_key_heads=2, linear_num_value_heads=4,
                                                      linear_key_head_dim=8, linear_value_head_dim=6, num_experts=4,
                                                      num_experts_per_tok=2, moe_intermediate_size=16,
                                                      shared_expert_intermediate_size=24,
                                                      layer_types=["linear_attention", "full_attention",
                                                                   "linear_attention", "full_attention"]), {}),
    # Qwen3-Next: Qwen3.5's layers with fused projections; layer 2 dense, the others top-2-of-4 experts and a
    # shared expert (renormalised top-k)
    "qwen3_next": ("Qwen3NextConfig", dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=8,
                                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                           linear_value_head_dim=6, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                           mlp_only_layers=[2],
                                           layer_types=["linear_attention", "full_attention", "linear_attention",
                                                        "full_attention"]), {}),
    # the full softmax's probabilities as weights (norm_topk_prob false), every second layer sparse
    "qwen3_next_unnormalised": ("Qwen3NextConfig", dict(_COMMON, num_hidden_layers=2, num_key_value_heads=1,
                                                        head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
                                                        linear_key_head_dim=8, linear_value_head_dim=8,
                                                        num_experts=3, num_experts_per_tok=2, norm_topk_prob=False,
                                                        moe_intermediate_size=12, shared_expert_intermediate_size=8,
                                                        decoder_sparse_step=2, tie_word_embeddings=True,
                                                        layer_types=["linear_attention", "full_attention"]), {}),
    # LFM2: gated short convolutions (kernel 3) beside Qwen3-style attention, the MLP width adjusted to 48
    "lfm2": ("Lfm2Config", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                bos_token_id=1, eos_token_id=EOS, block_multiple_of=16, block_ffn_dim_multiplier=1.5,
                                layer_types=["conv", "full_attention", "conv", "full_attention"]), {}),
    # biases in the convolution layers, kernel 4, full_attn_idxs, the MLP width as given, an untied head
    "lfm2_bias": ("Lfm2Config", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                     bos_token_id=1, eos_token_id=EOS, conv_bias=True, conv_L_cache=4,
                                     block_auto_adjust_ff_dim=False, full_attn_idxs=[1], tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "default", "rope_theta": 500.0}), {}),
    # Bamba: Mamba-2 layers (4 heads of 16, 2 groups of 8 state channels, kernel 3, chunks of 4) beside attention
    "bamba": ("BambaConfig", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, attn_layer_indices=[1],
                                  mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=3,
                                  mamba_chunk_size=4), {}),
    # one group, projection biases, no convolution bias, attention and MLP biases, a tied head
    "bamba_bias": ("BambaConfig", dict(_COMMON, num_key_value_heads=1, attn_layer_indices=[1], mamba_n_heads=2,
                                       mamba_d_state=6, mamba_d_conv=4, mamba_chunk_size=3, mamba_proj_bias=True,
                                       mamba_conv_bias=False, attention_bias=True, mlp_bias=True,
                                       tie_word_embeddings=True), {}),
    # Granite 4 hybrid: Bamba's Mamba-2 layers beside rotary attention, Granite's four scalars, every MLP the top
    # 2 of 4 experts (a softmax over the chosen logits) plus a shared MLP
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(_COMMON, intermediate_size=16, num_hidden_layers=3,
                                                        num_key_value_heads=2, num_local_experts=4,
                                                        num_experts_per_tok=2, shared_intermediate_size=24,
                                                        layer_types=["mamba", "attention", "mamba"],
                                                        mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8,
                                                        mamba_d_conv=3, mamba_chunk_size=4,
                                                        position_embedding_type="rope", embedding_multiplier=3.0,
                                                        attention_multiplier=0.3, residual_multiplier=0.5,
                                                        logits_scaling=2.0), {}),
    # no experts (the shared MLP alone), no rotary, attention first, projection and attention biases, a tied head
    "granitemoehybrid_dense": ("GraniteMoeHybridConfig", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=1,
                                                              num_local_experts=0, shared_intermediate_size=20,
                                                              layer_types=["attention", "mamba", "attention"],
                                                              mamba_n_heads=2,
                                                              mamba_d_state=6, mamba_d_conv=4, mamba_chunk_size=3,
                                                              mamba_proj_bias=True, mamba_conv_bias=False,
                                                              attention_bias=True, tie_word_embeddings=True,
                                                              embedding_multiplier=2.0, residual_multiplier=0.7,
                                                              logits_scaling=1.5), {}),
    # Nemotron-H: one branch per layer (Mamba-2 with 2 groups, attention without positions, a squared-ReLU MLP)
    "nemotron_h": ("NemotronHConfig", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           max_position_embeddings=64, bos_token_id=1, eos_token_id=EOS,
                                           layers_block_type=["linear_attention", "full_attention", "mlp",
                                                              "linear_attention", "full_attention", "mlp"],
                                           mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8,
                                           conv_kernel=3, chunk_size=4), {}),
    # projection and MLP biases, one group, no convolution bias, MLP first, the pattern string, a higher dt floor
    "nemotron_h_bias": ("NemotronHConfig", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40,
                                                num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                                max_position_embeddings=64, bos_token_id=1, eos_token_id=EOS,
                                                hybrid_override_pattern="-M*M", mamba_num_heads=2,
                                                mamba_head_dim=16, n_groups=1, ssm_state_size=6, conv_kernel=4,
                                                chunk_size=3, use_bias=True, mlp_bias=True, use_conv_bias=False,
                                                time_step_min=0.01), {}),
    # Falcon-H1: attention and Mamba-2 (4 heads of 12 in mamba_d_ssm = 48, 2 groups of 8 state channels, kernel 3,
    # chunks of 4) side by side in every layer, the group norm before the gate, every muP multiplier away from 1
    "falcon_h1": ("FalconH1Config", dict(_COMMON, num_key_value_heads=2, mamba_d_ssm=48, mamba_n_heads=4,
                                         mamba_d_head=12, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=3,
                                         mamba_chunk_size=4, mamba_rms_norm=True, embedding_multiplier=3.0,
                                         lm_head_multiplier=0.4, attention_in_multiplier=0.6,
                                         attention_out_multiplier=1.5, ssm_in_multiplier=1.3, ssm_out_multiplier=0.7,
                                         key_multiplier=0.8, mlp_multipliers=[0.9, 1.4],
                                         ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0]), {}),
    # no Mamba norm (the gate alone), the inner width from mamba_expand, one group, the output projections'
    # biases (projectors_bias), attention and MLP biases, a tied head, three layers
    "falcon_h1_bias": ("FalconH1Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=1, mamba_d_ssm=None,
                                              mamba_n_heads=4, mamba_d_state=6, mamba_d_conv=4, mamba_chunk_size=3,
                                              projectors_bias=True, attention_bias=True, mlp_bias=True,
                                              tie_word_embeddings=True, embedding_multiplier=0.5,
                                              lm_head_multiplier=2.0, attention_out_multiplier=0.8,
                                              ssm_out_multiplier=1.2, key_multiplier=1.5,
                                              mlp_multipliers=[1.2, 0.7],
                                              ssm_multipliers=[1.1, 0.9, 1.3, 0.8, 0.6]), {}),
    # Qwen3-MoE: Qwen3's attention, layer 1 dense, the others the top 2 of a softmax over 4 experts (not
    # renormalised)
    "qwen3_moe": ("Qwen3MoeConfig", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=8, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1]), {}),
    # a window on every layer, every second layer sparse, renormalised top 3 of 5, biases, a tied head
    "qwen3_moe_window": ("Qwen3MoeConfig", dict(_COMMON, num_key_value_heads=1, head_dim=8, num_experts=5,
                                                num_experts_per_tok=3, moe_intermediate_size=12, norm_topk_prob=True,
                                                decoder_sparse_step=2, use_sliding_window=True, sliding_window=3,
                                                attention_bias=True, tie_word_embeddings=True), {}),
    # Mixtral: every MLP the top 2 of 4 experts (renormalised), a window on every layer
    "mixtral": ("MixtralConfig", dict(_COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=4, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
                {}),
    # DeepSeek-V3: latent attention (queries through a rank-12 bottleneck, interleaved rotary, YaRN with the
    # softmax's mscale), one dense layer, then 3 of 8 experts within the 2 best of 4 groups, two shared experts
    "deepseek_v3": ("DeepseekV3Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=12,
                                             kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                                             moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=3,
                                             n_group=4, topk_group=2, n_shared_experts=2, first_k_dense_replace=1,
                                             routed_scaling_factor=2.5, pad_token_id=0,
                                             rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                              "rope_theta": 1000.0, "mscale": 1.0,
                                                              "mscale_all_dim": 0.8,
                                                              "original_max_position_embeddings": 16}), {}),
    # one query projection, half-split rotary, biases, unnormalised weights, every layer routed, a tied head
    "deepseek_v3_plain": ("DeepseekV3Config", dict(_COMMON, num_key_value_heads=4, q_lora_rank=None,
                                                   kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=6,
                                                   v_head_dim=7, moe_intermediate_size=6, n_routed_experts=4,
                                                   num_experts_per_tok=2, n_group=1, topk_group=1,
                                                   n_shared_experts=1, first_k_dense_replace=0,
                                                   norm_topk_prob=False, routed_scaling_factor=1.5,
                                                   rope_interleave=False, attention_bias=True,
                                                   tie_word_embeddings=True, pad_token_id=0), {}),
    # GLM-4.5: q/k norms per head, q/k/v biases, rotary on half of each head (two halves), one dense layer, then 3
    # of 8 experts within the 2 best of 4 groups, scaled, beside one shared expert
    "glm4_moe": ("Glm4MoeConfig", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, use_qk_norm=True,
                                       attention_bias=True, moe_intermediate_size=8, n_routed_experts=8,
                                       num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                                       first_k_dense_replace=1, routed_scaling_factor=2.5, pad_token_id=0,
                                       rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                        "partial_rotary_factor": 0.5}), {}),
    # no q/k norms or biases, wider heads, one key/value head, every layer routed (one group, weights not
    # renormalised), two shared experts, a tied head
    "glm4_moe_plain": ("Glm4MoeConfig", dict(_COMMON, num_key_value_heads=1, head_dim=12, moe_intermediate_size=6,
                                             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
                                             first_k_dense_replace=0, norm_topk_prob=False,
                                             tie_word_embeddings=True, pad_token_id=0), {}),
    # DeepSeek-V3.2: DeepSeek-V3's layers with sparse attention, each query keeping the 4 best of the keys an
    # 8-head indexer scores (fewer than the tests' lengths, so the choice matters)
    "deepseek_v32": ("DeepseekV32Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=12,
                                               kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                                               moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=3,
                                               n_group=4, topk_group=2, n_shared_experts=2, first_k_dense_replace=1,
                                               routed_scaling_factor=2.5, pad_token_id=0, index_topk=4,
                                               index_n_heads=8, index_head_dim=8,
                                               rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                "rope_theta": 1000.0, "mscale": 1.0,
                                                                "mscale_all_dim": 0.8,
                                                                "original_max_position_embeddings": 16}), {}),
    # three of the 6-wide indexer's keys per query, every feature rotated; the MLP layers named by mlp_layer_types
    # (experts first), biases, unnormalised expert weights, a tied head
    "deepseek_v32_mixed": ("DeepseekV32Config", dict(_COMMON, num_key_value_heads=4, q_lora_rank=8, kv_lora_rank=6,
                                                     qk_nope_head_dim=4, qk_rope_head_dim=6, v_head_dim=7,
                                                     moe_intermediate_size=6, n_routed_experts=4,
                                                     num_experts_per_tok=2, n_group=1, topk_group=1,
                                                     n_shared_experts=1, mlp_layer_types=["sparse", "dense"],
                                                     norm_topk_prob=False, routed_scaling_factor=1.5,
                                                     attention_bias=True, tie_word_embeddings=True, pad_token_id=0,
                                                     index_topk=3, index_n_heads=8, index_head_dim=6), {}),
    # Kimi Linear: Kimi Delta Attention layers beside NoPE latent attention, a dense first layer, then grouped
    # sigmoid-routed experts with a shared expert
    "kimi_linear": ("KimiLinearConfig", dict(_COMMON, num_hidden_layers=4, num_key_value_heads=4, q_lora_rank=12,
                                             kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
                                             moe_intermediate_size=6, num_local_experts=4, num_experts_per_tok=2,
                                             n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                                             routed_scaling_factor=2.5, linear_num_heads=2, linear_head_dim=8,
                                             linear_conv_kernel_dim=3, pad_token_id=0,
                                             layer_types=["linear_attention", "full_attention", "linear_attention",
                                                          "full_attention"]), {}),
    # its defaults: every fourth layer latent (layer 4), one query projection; MLP kinds listed, unnormalised weights
    "kimi_linear_plain": ("KimiLinearConfig", dict(_COMMON, num_hidden_layers=5, num_key_value_heads=2,
                                                   num_attention_heads=2, q_lora_rank=None, kv_lora_rank=8,
                                                   qk_nope_head_dim=6, qk_rope_head_dim=2, v_head_dim=8,
                                                   moe_intermediate_size=8, num_local_experts=3,
                                                   num_experts_per_tok=2, n_shared_experts=2,
                                                   norm_topk_prob=False, linear_num_heads=4, linear_head_dim=4,
                                                   mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse"],
                                                   pad_token_id=0), {}),
    # Llama 4 (text): chunks of 3 on the rotary layers (0, 2), NoPE layers 1 and 3 seeing everything, the weightless
    # q/k norm, interleaved rotary; layers 1 and 2 the top 2 of 4 input-weighted experts beside a shared expert,
    # layers 0 and 3 a dense MLP of intermediate_size_mlp (the temperature's default floor keeps it at one here)
    "llama4_text": ("Llama4TextConfig", dict(_COMMON, intermediate_size=16, intermediate_size_mlp=48,
                                             num_hidden_layers=4, num_key_value_heads=2, head_dim=8,
                                             num_local_experts=4, num_experts_per_tok=2, moe_layers=[1, 2],
                                             no_rope_layers=[1, 0, 1, 0], attention_chunk_size=3,
                                             rope_parameters={"rope_type": "default", "rope_theta": 500.0}), {}),
    # the query temperature acting from position 1 (floor_scale 2), every second layer sparse (top 1 of 3), every
    # second layer NoPE by the interval, chunks of 4, no q/k norm, llama3 scaling, a tied head. transformers counts
    # the temperature's positions over the cache's slots, pads included: compared on unpadded rows only
    "llama4_text_tuned": ("Llama4TextConfig", dict(_COMMON, intermediate_size=12, intermediate_size_mlp=40,
                                                   num_hidden_layers=4, num_key_value_heads=1, head_dim=8,
                                                   num_local_experts=3, num_experts_per_tok=1,
                                                   interleave_moe_layer_step=2, no_rope_layer_interval=2,
                                                   attention_chunk_size=4, floor_scale=2, attn_scale=0.5,
                                                   use_qk_norm=False, tie_word_embeddings=True,
                                                   rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                                    "rope_theta": 500.0, "low_freq_factor": 1.0,
                                                                    "high_freq_factor": 4.0,
                                                                    "original_max_position_embeddings": 16}), {}),
}

FAMILY_MODELS = ("gpt2", "gpt2_untied", "llama_gqa", "llama_mqa", "llama_linear", "llama_dynamic", "llama_yarn",
                 "llama_llama3", "mistral_window", "ministral", "qwen2_mixed", "qwen2_layer_types", "llama_sharded",
                 "qwen3", "qwen3_window", "olmo2", "olmo2_bias_mqa", "smollm3", "smollm3_window", "gpt_neox",
                 "gpt_neox_sequential", "gemma2", "gemma2_mqa_untied", "gemma3_text", "gemma4_text",
                 "phi3", "phi3_longrope", "phi3_partial_window", "gpt_oss", "gpt_oss_clamped",
                 "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_next_unnormalised", "qwen3_moe",
                 "qwen3_moe_window", "mixtral",
                 "deepseek_v3", "deepseek_v3_plain", "deepseek_v32", "deepseek_v32_mixed", "lfm2", "lfm2_bias", "bamba",
                 "bamba_bias", "olmo3", "glm4", "granite", "seed_oss", "exaone4", "ernie4_5", "hunyuan_v1_dense",
                 "apertus", "glm4_moe", "glm4_moe_plain", "granitemoehybrid", "granitemoehybrid_dense", "nemotron_h",
                 "nemotron_h_bias", "falcon_h1", "falcon_h1_bias", "kimi_linear", "kimi_linear_plain", "llama4_text")

_LOOPED_EXPERTS = ("DeepseekV3Config", "DeepseekV32Config", "Glm4MoeConfig", "KimiLinearConfig")

_CACHE: dict[str, tuple[Path, Any]] = {}


def build_hf_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The (random, seeded) ``transformers`` causal LM of ``SPECS[name]``, in eval mode."""
    import transformers

    class_name, kwargs, _ = SPECS[name]
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(seed)
    # torch's grouped_mm needs 16-byte strides, which experts this small do not have: their plain loop instead
    experts = {"experts_implementation": "eager"} if class_name in _LOOPED_EXPERTS else {}
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", **experts)
    with torch.no_grad():  # larger weights than the 0.02 init, so logits differ clearly between tokens
        for p in model.parameters():
            if p.ndim >= 1:
                p.add_(torch.randn_like(p) * 0.08)
        for buffer_name, buffer in model.named_buffers():
            # Gemma 4's per-layer output scalars are saved buffers: move them off one
            if buffer_name.endswith("layer_scalar"):
                buffer.mul_(0.5 + torch.rand_like(buffer))
            # DeepSeek-V3's routing correction starts at zero: move it
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.05)
    return model.to(dtype).eval()


def saved_model(name: str, root: Path):
    """(folder, hf_model) of ``SPECS[name]`` saved with ``save_pretrained`` under ``root``; built once."""
    if name not in _CACHE:
        model = build_hf_model(name)
        folder = Path(root) / name
        model.save_pretrained(folder, **SPECS[name][2])
        _CACHE[name] = (folder, model)
    return _CACHE[name]


def mxfp4_pair(rng, experts, rows, cols):
    """Random MXFP4 blocks (E, R, C / 32, 16) and scales (E, R, C / 32) of weights about 2^-4 .. 2^-2."""
    blocks = rng.integers(0, 256, size=(experts, rows, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(127 - 6, 127 - 3, size=(experts, rows, cols // 32), dtype=np.uint8)
    return blocks, scales


def mxfp4_folder(name: str, root: Path, target: Path, edit=None) -> Path:
    """A copy of the saved ``SPECS[name]`` folder with every expert matrix stored as random MXFP4 blocks and
    scales, as gpt-oss is published (:func:`mxfp4_copy`)."""
    return mxfp4_copy(saved_model(name, root)[0], target, edit)


def mxfp4_copy(folder: Path, target: Path, edit=None) -> Path:
    """A copy of a saved gpt-oss ``folder`` with every expert matrix stored as random MXFP4 blocks and scales, as
    gpt-oss is published; ``edit(tensors)`` may change the tensors before they are written."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    e, d, f = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    tensors = load_file(str(folder / "model.safetensors"))
    rng = np.random.default_rng(11)
    for i in range(config["num_hidden_layers"]):
        base = f"model.layers.{i}.mlp.experts."
        for matrix, rows, cols in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
            del tensors[base + matrix]
            blocks, scales = mxfp4_pair(rng, e, rows, cols)  # C // 32 blocks, as the header check expects
            tensors[base + matrix + "_blocks"], tensors[base + matrix + "_scales"] = blocks, scales
    if edit is not None:
        edit(tensors)
    target.mkdir()
    save_file(tensors, str(target / "model.safetensors"))
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (target / "config.json").write_text(json.dumps(config))
    return target


def positions_from_mask(mask: np.ndarray) -> np.ndarray:
    """Position ids of a left-padded batch: cumulative count of real tokens - 1, clipped at 0."""
    return np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int64)


def hf_logits(model, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    """HF logits (B, L, V) as float64 numpy, positions taken from the mask."""
    ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))
    mask = np.ones(ids.shape, dtype=bool) if attention_mask is None else np.asarray(attention_mask, dtype=bool)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.from_numpy(mask.astype(np.int64)),
                    position_ids=torch.from_numpy(positions_from_mask(mask)))
    return out.logits.double().numpy()


def hf_greedy(model, input_ids: np.ndarray, attention_mask: np.ndarray, max_new_tokens: int,
              eos_token_id: int | None = None, pad_token_id: int | None = None) -> np.ndarray:
    """HF ``generate`` greedy continuation (B, L + T), sampling warpers off."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(np.asarray(input_ids, dtype=np.int64)),
                             attention_mask=torch.from_numpy(np.asarray(attention_mask, dtype=np.int64)),
                             max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             eos_token_id=eos_token_id, pad_token_id=pad_token_id, top_k=None, top_p=None,
                             temperature=None)
    return out.numpy()


def left_padded_batch(rng: np.random.Generator, lengths: tuple[int, ...], pad_id: int = 0):
    """(input_ids, mask) of rows of the given real lengths, left-padded to the longest with ``pad_id``."""
    width = max(lengths)
    ids = np.full((len(lengths), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(lengths), width), dtype=bool)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = rng.integers(2, VOCAB - 1, size=n)
        mask[row, width - n:] = True
    return ids, mask


def edit_config(folder: Path, target: Path, **changes) -> Path:
    """Copy ``folder`` to ``target`` with ``config.json`` keys changed (a value ``...`` deletes the key)."""
    import shutil

    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    (target / "config.json").write_text(json.dumps(config))
    return target


def write_word_tokenizer(folder: Path) -> Path:
    """A word-level ``tokenizer.json`` for the tiny models: token i is the word ``w{i}`` (``w0`` = unknown)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = Path(folder) / "tokenizer.json"
    tokenizer.save(str(path))
    return path


# -- float64 pairs for the explain tests ------------------------------------------------------------------------
# transformers keeps three float32 islands in a float64 model: the rotary angles, the eager softmax and the
# RMSNorms (each casts to float32 and back). Values of order one then differ by a few 1e-7 (measured: at most
# 4.5e-7, Gemma 2's logits); everything attnkit computes alone (sums of the cache, hooked backward against its
# own finite differences) is checked at float64 rounding.
TOL = 2e-6


def float64_pair(name: str, root: Path):
    """(attnkit float64 model, transformers float64 copy) of the tiny model ``name``."""
    from attnkit.pretrained import load_causal_lm

    folder, hf = saved_model(name, root)
    return load_causal_lm(folder, dtype=np.float64), copy.deepcopy(hf).double()


def hf_layers(hf):
    return hf.transformer.h if hasattr(hf, "transformer") else (
        hf.gpt_neox.layers if hasattr(hf, "gpt_neox") else hf.model.layers)


def hf_output_projection(layer):
    """The module whose input is the heads' outputs side by side (B, L, H*Dh)."""
    for path in ("self_attn.o_proj", "attn.c_proj", "attention.dense"):
        module = layer
        try:
            for part in path.split("."):
                module = getattr(module, part)
            return module
        except AttributeError:
            continue
    raise AssertionError(f"no output projection in {type(layer).__name__}")
