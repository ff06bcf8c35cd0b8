"""Shared test code for decoder parts: tiny configs and copies of attnkit weights into Hugging Face modules.

attnkit stores weights for ``x @ W`` (In, Out); torch's ``nn.Linear.weight`` is (Out, In), so every matrix is
transposed on the way; GPT-2's ``Conv1D`` already stores (In, Out).
"""
from __future__ import annotations

import numpy as np

import torch
from attnkit.models import (
    AttentionConfig,
    DecoderConfig,
    ExpertsConfig,
    MLPConfig,
    NormConfig,
    RotaryConfig,
    ScalesConfig,
)


def tiny_config(family="llama", *, attention=None, rotary=None, norm=None, mlp=None, **overrides) -> DecoderConfig:
    """A small DecoderConfig of ``family``; ``attention``, ``rotary``, ``norm`` and ``mlp`` are dicts of the parts'
    fields that differ from the tiny defaults (``rotary`` with ``learned=True``: learned positions)."""
    gpt2 = family == "gpt2"
    base = {"family": family, "vocab_size": 23, "hidden_size": 16, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
            "head_dim": 4, "max_position_embeddings": 64}
    parts = dict(norm=dict(eps=1e-6), rotary=dict(theta=100.0), attention={}, mlp=dict(intermediate_size=24))
    if gpt2:
        base.update(num_kv_heads=4, tie_word_embeddings=True)
        parts = dict(norm=dict(kind="layernorm", eps=1e-5), rotary=None,
                     attention=dict(bias=True, output_bias=True),
                     mlp=dict(intermediate_size=24, kind="plain", activation="gelu_tanh"))
    base.update(overrides)
    rotary = None if parts["rotary"] is None else RotaryConfig(**{**parts["rotary"], **(rotary or {})})
    return DecoderConfig(**base, norm=NormConfig(**{**parts["norm"], **(norm or {})}), rotary=rotary,
                         attention=AttentionConfig(**{**parts["attention"], **(attention or {})}),
                         mlp=MLPConfig(**{**parts["mlp"], **(mlp or {})}))


def with_mlp(fields: dict, intermediate_size: int) -> dict:
    """``fields`` (a variant's DecoderConfig fields) with its ``mlp`` entry, a dict of the MLP part's fields that
    differ from the default, made the part, ``intermediate_size`` wide unless it says otherwise."""
    return {**fields, "mlp": MLPConfig(**{"intermediate_size": intermediate_size, **fields.get("mlp", {})})}


HF_ACT = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}


def hf_config(cfg: DecoderConfig):
    """The Hugging Face config of the same architecture (llama, mistral, qwen2, qwen3 or gpt2)."""
    import transformers

    if cfg.family == "gpt2":
        return transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings,
                                       n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_heads,
                                       n_inner=cfg.mlp.intermediate_size, activation_function="gelu_new",
                                       layer_norm_epsilon=cfg.norm.eps, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, tie_word_embeddings=cfg.tie_word_embeddings)
    params = {"rope_type": "default", "rope_theta": cfg.rotary.theta}
    if cfg.rotary.scaling is not None:
        params = {**cfg.rotary.scaling, "rope_theta": cfg.rotary.theta}
    common = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
                  "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
                  "head_dim": cfg.head_dim,
                  "intermediate_size": cfg.mlp.intermediate_size,
                  "max_position_embeddings": cfg.max_position_embeddings,
                  "rms_norm_eps": cfg.norm.eps, "hidden_act": HF_ACT[cfg.mlp.activation], "rope_parameters": params,
                  "tie_word_embeddings": cfg.tie_word_embeddings, "attention_dropout": 0.0}
    if cfg.family == "llama":
        return transformers.LlamaConfig(attention_bias=cfg.attention.bias, mlp_bias=cfg.mlp.bias, **common)
    if cfg.family == "mistral":
        return transformers.MistralConfig(sliding_window=cfg.attention.sliding_window, **common)
    if cfg.family == "qwen2":
        return transformers.Qwen2Config(sliding_window=cfg.attention.sliding_window, layer_types=list(cfg.layer_types),
                                        use_sliding_window=cfg.attention.sliding_window is not None,
                                        max_window_layers=cfg.num_layers, **common)
    if cfg.family == "qwen3":
        return transformers.Qwen3Config(attention_bias=cfg.attention.bias, sliding_window=cfg.attention.sliding_window,
                                        layer_types=list(cfg.layer_types),
                                        use_sliding_window=cfg.attention.sliding_window is not None, **common)
    raise ValueError(cfg.family)


def _t(a, transpose=True, dtype=torch.float64):
    a = np.asarray(a)
    return torch.from_numpy(np.ascontiguousarray(a.T if transpose else a)).to(dtype)


def copy_attention(ours, theirs, dtype=torch.float64):
    """Copy a GroupedQueryAttention's weights into a HF LlamaAttention-like module (q/k/v/o_proj)."""
    with torch.no_grad():
        for name, proj in (("Q", "q_proj"), ("K", "k_proj"), ("V", "v_proj"), ("O", "o_proj")):
            getattr(theirs, proj).weight.copy_(_t(getattr(ours, f"W_{name}"), dtype=dtype))
            if f"b_{name}" in ours._parameters:
                getattr(theirs, proj).bias.copy_(_t(getattr(ours, f"b_{name}"), False, dtype))


def copy_gated_mlp(ours, theirs, dtype=torch.float64):
    with torch.no_grad():
        for name, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            getattr(theirs, proj).weight.copy_(_t(getattr(ours, f"W_{name}"), dtype=dtype))
            if f"b_{name}" in ours._parameters:
                getattr(theirs, proj).bias.copy_(_t(getattr(ours, f"b_{name}"), False, dtype))


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """A CausalLM's parameters under the Hugging Face names of its family (float64 tensors)."""
    cfg = model.config
    p = dict(model.named_parameters())
    out = {}
    if cfg.family == "gpt2":
        out["transformer.wte.weight"] = _t(p["embed.weight"], False)
        out["transformer.wpe.weight"] = _t(p["pos_embed.weight"], False)
        for i in range(cfg.num_layers):
            pre, hf = f"layers.{i}.", f"transformer.h.{i}."
            for ours_norm, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                out[hf + theirs + ".weight"] = _t(p[pre + ours_norm + ".gamma"], False)
                out[hf + theirs + ".bias"] = _t(p[pre + ours_norm + ".beta"], False)
            a = pre + "attention."
            out[hf + "attn.c_attn.weight"] = _t(np.concatenate([p[a + "W_Q"], p[a + "W_K"], p[a + "W_V"]], 1), False)
            out[hf + "attn.c_attn.bias"] = _t(np.concatenate([p[a + "b_Q"], p[a + "b_K"], p[a + "b_V"]]), False)
            out[hf + "attn.c_proj.weight"] = _t(p[a + "W_O"], False)
            out[hf + "attn.c_proj.bias"] = _t(p[a + "b_O"], False)
            out[hf + "mlp.c_fc.weight"] = _t(p[pre + "mlp.W1"], False)
            out[hf + "mlp.c_fc.bias"] = _t(p[pre + "mlp.b1"], False)
            out[hf + "mlp.c_proj.weight"] = _t(p[pre + "mlp.W2"], False)
            out[hf + "mlp.c_proj.bias"] = _t(p[pre + "mlp.b2"], False)
        out["transformer.ln_f.weight"] = _t(p["norm.gamma"], False)
        out["transformer.ln_f.bias"] = _t(p["norm.beta"], False)
        out["lm_head.weight"] = _t(p.get("head.weight", p["embed.weight"]), False)
        return out
    out["model.embed_tokens.weight"] = _t(p["embed.weight"], False)
    for i in range(cfg.num_layers):
        pre, hf = f"layers.{i}.", f"model.layers.{i}."
        out[hf + "input_layernorm.weight"] = _t(p[pre + "attn_norm.gamma"], False)
        out[hf + "post_attention_layernorm.weight"] = _t(p[pre + "mlp_norm.gamma"], False)
        for name, proj in (("Q", "q_proj"), ("K", "k_proj"), ("V", "v_proj"), ("O", "o_proj")):
            out[hf + f"self_attn.{proj}.weight"] = _t(p[pre + f"attention.W_{name}"])
            if pre + f"attention.b_{name}" in p:
                out[hf + f"self_attn.{proj}.bias"] = _t(p[pre + f"attention.b_{name}"], False)
        for norm in ("q_norm", "k_norm"):
            if pre + f"attention.{norm}" in p:
                out[hf + f"self_attn.{norm}.weight"] = _t(p[pre + f"attention.{norm}"], False)
        for name, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            out[hf + f"mlp.{proj}.weight"] = _t(p[pre + f"mlp.W_{name}"])
            if pre + f"mlp.b_{name}" in p:
                out[hf + f"mlp.{proj}.bias"] = _t(p[pre + f"mlp.b_{name}"], False)
    out["model.norm.weight"] = _t(p["norm.gamma"], False)
    out["lm_head.weight"] = _t(p.get("head.weight", p["embed.weight"]), False)
    return out


def hf_model(model, dtype=torch.float64):
    """A Hugging Face causal LM holding a CausalLM's weights, in eval mode."""
    import transformers

    hf_cfg = hf_config(model.config)
    # sdpa rather than eager: eager takes its softmax in float32 even for float64 models, and its fully masked
    # (left-pad) rows turn into NaN that the next layer spreads into real rows through 0 * NaN.
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa").to(dtype).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    assert not unexpected, unexpected
    assert all("lm_head" in m or "attn.bias" in m or "masked_bias" in m for m in missing), missing
    return hf


def without_float32_internals(hf, model) -> None:
    """Make a float64 HF Llama-family model compute in float64 throughout, for a float64 comparison.

    Hugging Face computes RMSNorm statistics and rotary angles in float32 whatever the model's dtype, which
    limits any float64 comparison to ~1e-7. Here the RMSNorms compute in their input dtype and the rotary
    tables come from attnkit's float64 RotaryEmbedding (its frequencies are compared with HF's separately).
    """
    from attnkit.layers.rotary import RotaryEmbedding

    cfg = model.config
    rotary = None if cfg.rotary is None else RotaryEmbedding(cfg.rotary, cfg.head_dim, cfg.max_position_embeddings)

    def rms_forward(self, hidden):
        rstd = torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * (hidden * rstd)

    def rotary_forward(x, position_ids):
        cos, sin = rotary(position_ids.numpy(), dtype=np.float64)
        return torch.from_numpy(cos).to(x.dtype), torch.from_numpy(sin).to(x.dtype)

    for module in hf.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = rms_forward.__get__(module)
        if type(module).__name__.endswith("RotaryEmbedding"):
            module.forward = rotary_forward


# The newer families' switches at tiny sizes, as ``DecoderConfig`` keywords beside the sizes a test chooses (the
# float64 gradient checks and the PyTorch twin's parity both run them).
DECODER_VARIANTS = {
    # OLMo 2: q/k RMSNorm over the whole projection, post-norms only
    "olmo2": dict(family="olmo2", norm=NormConfig(placement="post"),
                  attention=AttentionConfig(bias=True, output_bias=True, qk_norm="projection")),
    # OLMo 3: OLMo 2's norms, a sliding layer with a rotary base of its own, linear scaling on the full layer
    "olmo3": dict(family="olmo3", norm=NormConfig(placement="post"),
                  layer_types=("sliding_attention", "full_attention"),
                  rotary=RotaryConfig(scaling={"rope_type": "linear", "factor": 2.0}, sliding_theta=7.0),
                  attention=AttentionConfig(qk_norm="projection", sliding_window=2)),
    # GLM-4: norms before and after each branch, interleaved rotary pairs on half of each head, q/k/v biases only
    "glm4": dict(family="glm4", norm=NormConfig(placement="sandwich"), rotary=RotaryConfig(partial_factor=0.5,
                                                                                          interleaved=True),
                 attention=AttentionConfig(bias=True)),
    # GLM-4.5: q/k/v biases, per-head q/k norms, rotary on half of each head, a dense layer and then group-routed
    # sigmoid experts beside a shared expert
    "glm4_moe": dict(family="glm4_moe", rotary=RotaryConfig(partial_factor=0.5),
                     attention=AttentionConfig(bias=True, qk_norm="head"),
                     experts=ExpertsConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=3, layers=(1,),
                                           router="sigmoid_group_topk", n_group=2, topk_group=1,
                                           routed_scaling_factor=2.5, shared_expert_intermediate_size=3)),
    # Granite: scaled embeddings, scores, branch outputs and logits, biases on every projection
    "granite": dict(family="granite", scales=ScalesConfig(embedding=1.5, residual=0.4, logit=0.7), mlp=dict(bias=True),
                    attention=AttentionConfig(bias=True, output_bias=True, scale=0.3)),
    # Seed-OSS: the output bias without the q/k/v biases (each has its own switch), MLP biases
    "seed_oss": dict(family="seed_oss", mlp=dict(bias=True), attention=AttentionConfig(output_bias=True)),
    # EXAONE 4: post-norms, per-head q/k norms, a sliding layer with rotary and a full one without
    "exaone4": dict(family="exaone4", norm=NormConfig(placement="post"), rotary=RotaryConfig(skip_layers=(1,)),
                    layer_types=("sliding_attention", "full_attention"),
                    attention=AttentionConfig(qk_norm="head", sliding_window=2)),
    # ERNIE 4.5: interleaved rotary over the whole head, biases on every projection
    "ernie4_5": dict(family="ernie4_5", mlp=dict(bias=True), rotary=RotaryConfig(interleaved=True),
                     attention=AttentionConfig(bias=True, output_bias=True)),
    # HunYuan: per-head q/k norms after the rotation, biases
    "hunyuan_v1_dense": dict(family="hunyuan_v1_dense",
                             attention=AttentionConfig(bias=True, output_bias=True, qk_norm="head_after_rotary")),
    # Apertus: the ungated xIELU MLP with its learned slopes, per-head q/k norms
    "apertus": dict(family="apertus", mlp=dict(kind="xielu"), attention=AttentionConfig(qk_norm="head")),
    # SmolLM3: a NoPE layer beside a rotary one, the NoPE layer sliding
    "smollm3": dict(family="smollm3", layer_types=("full_attention", "sliding_attention"), mlp=dict(bias=True),
                    rotary=RotaryConfig(skip_layers=(1,)), attention=AttentionConfig(sliding_window=2)),
    # GPT-NeoX: LayerNorm, plain MLP, partial rotary, parallel residual
    "gpt_neox": dict(family="gpt_neox", mlp=dict(kind="plain", activation="gelu", bias=True), residual="parallel",
                     norm=NormConfig(kind="layernorm"), rotary=RotaryConfig(partial_factor=0.5),
                     attention=AttentionConfig(bias=True, output_bias=True)),
    # Gemma 2: soft-capped scores and logits, (1 + w) norms before and after each branch, scaled embeddings
    "gemma2": dict(family="gemma2", scales=ScalesConfig(embedding=2.5, final_logit_softcap=2.0),
                   mlp=dict(activation="gelu_tanh"),
                   layer_types=("sliding_attention", "full_attention"),
                   norm=NormConfig(offset=1.0, placement="sandwich"),
                   attention=AttentionConfig(scale=0.3, logit_softcap=1.5, sliding_window=2)),
    # Gemma 3: (1 + w) per-head q/k norms and a rotary base of its own on the sliding layers
    "gemma3_text": dict(family="gemma3_text", scales=ScalesConfig(embedding=1.5),
                        layer_types=("sliding_attention", "full_attention"),
                        norm=NormConfig(offset=1.0, placement="sandwich"), rotary=RotaryConfig(sliding_theta=7.0),
                        attention=AttentionConfig(sliding_window=2, qk_norm="head")),
    # gpt-oss: learned sinks, biases, a top-2-of-3 mixture of clamped-SwiGLU experts (limit low enough to clamp)
    "gpt_oss": dict(family="gpt_oss", layer_types=("sliding_attention", "full_attention"),
                    attention=AttentionConfig(sinks=True, bias=True, output_bias=True, sliding_window=2),
                    experts=ExpertsConfig(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=6, layers=(0, 1),
                                          router="topk_softmax", router_bias=True, expert_bias=True,
                                          swiglu_limit=0.6)),
    # Qwen3-MoE: per-head q/k norms, a dense layer, then the top 2 of a softmax over 3 experts, not renormalised
    "qwen3_moe": dict(family="qwen3_moe", attention=AttentionConfig(qk_norm="head"),
                      experts=ExpertsConfig(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=5, layers=(1,),
                                            norm_topk_prob=False)),
    # Mixtral: a window on every layer, every MLP the top 2 of 4 experts, renormalised
    "mixtral": dict(family="mixtral", layer_types=("sliding_attention",) * 2,
                    attention=AttentionConfig(sliding_window=2),
                    experts=ExpertsConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6,
                                          layers=(0, 1))),

}
