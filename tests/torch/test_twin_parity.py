"""float64 parity of every attnkit.torch twin with its attnkit module: forward within 1e-10 (relative to the
output's largest entry), every parameter gradient (matched by name) and input gradient within 1e-9, and the
exact round trip ``to_numpy(from_numpy(m))``."""
from __future__ import annotations

import numpy as np
import pytest

import torch
from attnkit import layers as L
from attnkit.attention.grouped_query import GroupedQueryAttention
from attnkit.attention.latent import LatentAttentionConfig
from attnkit.attention.multi_head_attention import MultiHeadAttention
from attnkit.layers import GatedDeltaNetConfig, KimiDeltaAttentionConfig, Mamba2Config, ShortConvConfig
from attnkit.layers.gated_mlp import GatedMLP
from attnkit.layers.lm_block import LMBlock
from attnkit.layers.rms_norm import RMSNorm
from attnkit.layers.rotary import RotaryEmbedding
from attnkit.models import (
    AttentionConfig,
    AttentionMamba2Config,
    CausalLM,
    DecoderConfig,
    ExpertsConfig,
    LayerwiseConfig,
    NormConfig,
    RotaryConfig,
    ScalesConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
)
from attnkit.torch import from_numpy, to_numpy
from decoder_cases import DECODER_VARIANTS, with_mlp

from helpers import group_scale, max_rel_diff

FORWARD_TOL, GRAD_TOL = 1e-10, 1e-9

# Figures printed at the end of the module (the report quotes them).
WORST = {"forward": 0.0, "grad": 0.0}


def _config(family="llama", **overrides) -> DecoderConfig:
    base = dict(family=family, vocab_size=13, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=4)
    base.update(overrides)
    return DecoderConfig(**with_mlp(base, 24))


def _to_torch(value, requires_grad: bool):
    if isinstance(value, tuple):
        return tuple(_to_torch(v, False) for v in value)
    if isinstance(value, np.ndarray):
        return torch.tensor(value, requires_grad=requires_grad and value.dtype.kind == "f")
    return value


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def check_parity(module, args, kwargs=None, *, seed=0):
    """Run ``module`` and its twin on the same float64 inputs; compare outputs and every gradient."""
    kwargs = kwargs or {}
    twin = from_numpy(module)
    assert [n for n, _ in twin.named_parameters()] == [n for n, _ in module.named_parameters()]
    out = _first(module(*args, **kwargs))
    grad_out = np.random.default_rng(seed).normal(size=out.shape)
    grads_in = module.backward(grad_out)
    grads_in = () if grads_in is None else (grads_in if isinstance(grads_in, tuple) else (grads_in,))

    targs = [_to_torch(a, True) for a in args]
    tkwargs = {k: _to_torch(v, False) for k, v in kwargs.items()}
    # A model fed token ids returns the gradient at its input embeddings; the twin's is read off the
    # embedding layer's output.
    embedded = []
    hook = None
    if hasattr(twin, "embed") and not any(isinstance(a, np.ndarray) and a.dtype.kind == "f" for a in args):
        def keep(_module, _inputs, out):
            out.retain_grad()
            embedded.append(out)

        hook = twin.embed.register_forward_hook(keep)
    tout = _first(twin(*targs, **tkwargs))
    (tout * torch.from_numpy(grad_out)).sum().backward()
    if hook is not None:
        hook.remove()

    rel = max_rel_diff(tout.detach().numpy(), out)
    WORST["forward"] = max(WORST["forward"], rel)
    assert rel <= FORWARD_TOL, f"forward differs by {rel:.2e}"
    tgrads = dict(twin.named_parameters())
    # A block that is zero in exact arithmetic (a key bias: softmax ignores shifts) holds rounding noise in
    # both libraries; such blocks are compared relative to the whole gradient (tests/helpers.group_scale).
    whole = group_scale(*(g for _, g in module.named_gradients()))
    for name, grad in module.named_gradients():
        tgrad = tgrads[name].grad
        got = np.zeros_like(grad) if tgrad is None else tgrad.numpy()
        own = float(np.abs(grad).max())
        scale = own if own >= 1e-8 * whole else whole
        rel = float(np.abs(got - grad).max()) / max(scale, 1e-300)
        WORST["grad"] = max(WORST["grad"], rel)
        assert rel <= GRAD_TOL, f"gradient of {name} differs by {rel:.2e}"
    float_inputs = [t for t in targs if isinstance(t, torch.Tensor) and t.requires_grad] + embedded
    assert len(float_inputs) == len(grads_in)
    for i, (t, g) in enumerate(zip(float_inputs, grads_in, strict=True)):
        rel = max_rel_diff(t.grad.numpy(), g)
        WORST["grad"] = max(WORST["grad"], rel)
        assert rel <= GRAD_TOL, f"gradient of input {i} differs by {rel:.2e}"
    return twin


def randn(*shape, seed=1):
    return np.random.default_rng(seed).normal(size=shape)


def left_padding(batch, length, real):
    return np.arange(length)[None, :] >= (length - np.asarray(real))[:, None]  # (B, L) True = real token


# -- layers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_feed_forward(activation):
    check_parity(L.FeedForward(6, 10, activation, rng=0), [randn(2, 3, 6)])


@pytest.mark.parametrize("activation,bias", [("silu", False), ("gelu_tanh", True)])
def test_gated_mlp(activation, bias):
    mlp = GatedMLP(6, 10, activation, bias, rng=0)
    if bias:
        for name in ("b_gate", "b_up", "b_down"):
            setattr(mlp, name, randn(*getattr(mlp, name).shape, seed=7))
    check_parity(mlp, [randn(2, 3, 6)])


@pytest.mark.parametrize("make", [lambda: L.LayerNorm(6, eps=1e-5), lambda: RMSNorm(6, eps=1e-6)])
def test_norms(make):
    norm = make()
    norm.gamma = randn(6, seed=3)
    check_parity(norm, [randn(2, 3, 6)])


def test_embedding_and_projection():
    check_parity(L.Embedding(7, 5, padding_idx=0, rng=0), [np.array([[0, 3, 3], [6, 0, 1]])])
    check_parity(L.Projection(5, 4, rng=0), [randn(2, 3, 5)])


def test_positions():
    pe = L.SinusoidalPositionalEncoding(10, 6)
    check_parity(pe, [randn(2, 4, 6)])


@pytest.mark.parametrize("overrides", [
    {}, {"interleaved": True}, {"partial_factor": 0.5},
    {"scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    {"scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 16}},
    {"scaling": {"rope_type": "dynamic", "factor": 2.0}},
])
def test_rotary_tables(overrides):
    dynamic = overrides.get("scaling", {}).get("rope_type") == "dynamic"
    rotary = RotaryEmbedding(RotaryConfig(**overrides), head_dim=4, max_position_embeddings=8 if dynamic else 2048)
    positions = np.array([[0, 1, 2, 40], [3, 3, 9, 11]])
    cos, sin = rotary(positions, dtype=np.float64)
    tcos, tsin = from_numpy(rotary)(torch.from_numpy(positions), dtype=torch.float64)
    assert max_rel_diff(tcos.numpy(), cos) <= FORWARD_TOL and max_rel_diff(tsin.numpy(), sin) <= FORWARD_TOL


# -- attention -------------------------------------------------------------------------------------------
def test_multi_head_self_attention_with_masks():
    mha = MultiHeadAttention(8, 2, bias=True, rng=0)
    x = randn(3, 5, 8)
    kpm = left_padding(3, 5, [5, 3, 1])
    attn_mask = np.random.default_rng(4).random((5, 5)) < 0.6
    attn_mask[2] = False  # a query with nothing to attend: zeros, never NaN
    check_parity(mha, [x, x.copy(), x.copy()], dict(attn_mask=attn_mask, key_padding_mask=kpm, need_weights=False))


def test_multi_head_cross_attention_causal_bottom_right():
    mha = MultiHeadAttention(8, 4, kdim=6, vdim=5, rng=0)
    check_parity(mha, [randn(2, 3, 8), randn(2, 7, 6, seed=2), randn(2, 7, 5, seed=3)],
                 dict(is_causal=True, need_weights=False))


@pytest.mark.parametrize("overrides", [
    {}, {"num_kv_heads": 1, "attention": AttentionConfig(bias=True, output_bias=True)},
    {"family": "mistral", "attention": AttentionConfig(sliding_window=3),
     "layer_types": ("sliding_attention", "full_attention")},
    {"rotary": RotaryConfig(interleaved=True, partial_factor=0.5)},
])
@pytest.mark.parametrize("padded", [False, True])
def test_grouped_query_attention(overrides, padded):
    cfg = _config(**overrides)
    attn = GroupedQueryAttention(cfg, 0, rng=0)
    for name in ("b_Q", "b_K", "b_V", "b_O"):
        if name in attn._parameters:
            setattr(attn, name, randn(*getattr(attn, name).shape, seed=9))
    positions = np.tile(np.arange(6), (2, 1))
    mask = left_padding(2, 6, [6, 4]) if padded else None
    rotary = RotaryEmbedding(cfg.rotary, cfg.head_dim, cfg.max_position_embeddings)(positions, dtype=np.float64)
    check_parity(attn, [randn(2, 6, 16)], dict(rotary=rotary, attention_mask=mask))


# -- blocks and stacks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_first", [True, False])
def test_encoder_block(norm_first):
    block = L.TransformerEncoderBlock(8, 2, 12, norm_first=norm_first, activation="gelu", attention_bias=True,
                                      rng=0)
    x = randn(2, 5, 8)
    x[1, 4] = np.nan  # padding garbage never reaches a real position or a gradient
    check_parity(block, [x], dict(key_padding_mask=left_padding(2, 5, [5, 4])[:, ::-1].copy(), is_causal=True))


def test_encoder_stack():
    enc = L.TransformerEncoder(2, 8, 2, 12, rng=0)
    check_parity(enc, [randn(2, 5, 8)], dict(mask=np.tril(np.ones((5, 5), bool))))


@pytest.mark.parametrize("norm_first", [True, False])
def test_decoder_block(norm_first):
    block = L.TransformerDecoderBlock(8, 2, 12, norm_first=norm_first, attention_bias=True, rng=0)
    memory_pad = np.array([[True] * 6, [True] * 3 + [False] * 3])
    check_parity(block.eval(), [randn(2, 4, 8), randn(2, 6, 8, seed=5)],
                 dict(memory_key_padding_mask=memory_pad, tgt_is_causal=True))


def test_decoder_stack_and_transformer():
    check_parity(L.TransformerDecoder(2, 8, 2, rng=0), [randn(2, 4, 8), randn(2, 6, 8, seed=5)],
                 dict(tgt_is_causal=True))
    src_pad = np.array([[True] * 6, [True] * 2 + [False] * 4])
    check_parity(L.Transformer(8, 2, 1, 2, 12, rng=0), [randn(2, 6, 8, seed=5), randn(2, 4, 8)],
                 dict(src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad, tgt_is_causal=True))


def test_lm_block():
    cfg = _config()
    table = RotaryEmbedding(cfg.rotary, cfg.head_dim, cfg.max_position_embeddings)
    rotary = table(np.tile(np.arange(5), (2, 1)), dtype=np.float64)
    check_parity(LMBlock(cfg, 1, rng=0), [randn(2, 5, 16)], dict(rotary=rotary))


@pytest.mark.parametrize("padded", [False, True])
def test_gated_deltanet(padded):
    layer = L.GatedDeltaNet(16, 2, 4, 4, 3, conv_kernel_size=3, chunk_size=4, rng=0)
    for _, p in layer.named_parameters():
        p += 0.3 * np.random.default_rng(p.size).normal(size=p.shape)
    mask = left_padding(2, 7, [7, 4]) if padded else None
    check_parity(layer, [randn(2, 7, 16)], dict(attention_mask=mask))


@pytest.mark.parametrize("padded", [False, True])
def test_kimi_delta_attention(padded):
    layer = L.KimiDeltaAttention(16, 2, 4, conv_kernel_size=3, chunk_size=4, rng=0)
    for _, p in layer.named_parameters():
        p += 0.3 * np.random.default_rng(p.size).normal(size=p.shape)
    mask = left_padding(2, 7, [7, 4]) if padded else None
    check_parity(layer, [randn(2, 7, 16)], dict(attention_mask=mask))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_short_conv(padded, bias):
    layer = L.ShortConv(16, kernel_size=3, bias=bias, rng=0)
    for _, p in layer.named_parameters():
        p += 0.3 * np.random.default_rng(p.size).normal(size=p.shape)
    mask = left_padding(2, 7, [7, 4]) if padded else None
    check_parity(layer, [randn(2, 7, 16)], dict(attention_mask=mask))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("groups, bias", [(1, False), (2, True)])
def test_mamba2(padded, groups, bias):
    layer = L.Mamba2(16, Mamba2Config(num_heads=4, head_dim=3, state_size=2, n_groups=groups, conv_kernel_size=3,
                                      conv_bias=not bias, proj_bias=bias, chunk_size=3), rng=0)
    for _, p in layer.named_parameters():
        p += 0.3 * np.random.default_rng(p.size).normal(size=p.shape)
    mask = left_padding(2, 7, [7, 4]) if padded else None
    check_parity(layer, [randn(2, 7, 16)], dict(attention_mask=mask))


@pytest.mark.parametrize("normalise", [True, False])
def test_gated_attention_and_shared_experts(normalise):
    from attnkit.attention.gated import GatedAttention
    from attnkit.layers import MixtureOfExperts

    cfg = _config(family="qwen3_next", norm=NormConfig(offset=1.0), rotary=RotaryConfig(partial_factor=0.5),
                  attention=AttentionConfig(qk_norm="head"), layer_types=("gated_attention",) * 2,
                  experts=ExpertsConfig(4, 2, 5, layers=(0,), norm_topk_prob=normalise,
                                        shared_expert_intermediate_size=6, shared_expert_gate=True))
    rotary = RotaryEmbedding(cfg.rotary, cfg.head_dim, cfg.max_position_embeddings)(np.tile(np.arange(5), (2, 1)),
                                                                                   dtype=np.float64)
    check_parity(GatedAttention(cfg, 1, rng=0), [randn(2, 5, 16)], dict(rotary=rotary))
    check_parity(MixtureOfExperts(cfg.hidden_size, cfg.experts, cfg.mlp.activation, rng=0), [randn(2, 5, 16)])


# -- models ----------------------------------------------------------------------------------------------
FAMILIES = {
    "llama": dict(),
    "llama_tied": dict(tie_word_embeddings=True, num_kv_heads=1),
    "gpt2": dict(family="gpt2", mlp=dict(kind="plain", activation="gelu_tanh"), num_kv_heads=4,
                 tie_word_embeddings=True,
                 max_position_embeddings=16, norm=NormConfig(kind="layernorm", eps=1e-5), rotary=None,
                 attention=AttentionConfig(bias=True, output_bias=True)),
    "mistral": dict(family="mistral", layer_types=("sliding_attention",) * 2,
                    attention=AttentionConfig(sliding_window=2)),
    "qwen2": dict(family="qwen2", layer_types=("full_attention", "sliding_attention"),
                  attention=AttentionConfig(bias=True, sliding_window=3)),
    "qwen3": dict(family="qwen3", layer_types=("sliding_attention", "full_attention"),
                  attention=AttentionConfig(sliding_window=3, qk_norm="head")),
    **DECODER_VARIANTS,
    "gpt_neox": dict(DECODER_VARIANTS["gpt_neox"], num_kv_heads=4),
    "gemma4_text": dict(family="gemma4_text", num_layers=4, scales=ScalesConfig(embedding=1.5, final_logit_softcap=2.0),
                        mlp=dict(activation="gelu_tanh"),
                        layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
                        norm=NormConfig(placement="sandwich"),
                        rotary=RotaryConfig(scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5},
                                            sliding_theta=7.0),
                        attention=AttentionConfig(scale=1.0, sliding_window=2, qk_norm="head"),
                        layerwise=LayerwiseConfig(global_head_dim=8, global_kv_heads=1, keys_are_values=True,
                                                  shared_kv_layers=2, wide_shared_mlp=True, per_layer_input_size=3,
                                                  per_layer_vocab_size=13)),
    "phi3": dict(family="phi3", max_position_embeddings=32, head_dim=8,
                 rotary=RotaryConfig(partial_factor=0.5,
                                     scaling={"rope_type": "longrope", "original_max_position_embeddings": 4,
                               "short_factor": (1.0, 2.0), "long_factor": (3.0, 5.0)})),
    "deepseek_v3": dict(family="deepseek_v3", num_kv_heads=4, head_dim=2, rotary=RotaryConfig(interleaved=True),
                        mixer_parts=(LatentAttentionConfig(hidden_size=16, num_heads=4, kv_lora_rank=5,
                                                           qk_nope_head_dim=3, qk_rope_head_dim=2, v_head_dim=3,
                                                           q_lora_rank=4, attention_scale=0.4),),
                        experts=ExpertsConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=3,
                                              layers=(1,), router="sigmoid_group_topk", n_group=2, topk_group=1,
                                              routed_scaling_factor=2.5, shared_expert_intermediate_size=3)),
    "deepseek_v3_plain": dict(family="deepseek_v3", num_kv_heads=4, head_dim=2,
                              mixer_parts=(LatentAttentionConfig(hidden_size=16, num_heads=4, kv_lora_rank=5,
                                                                 qk_nope_head_dim=3, qk_rope_head_dim=2, v_head_dim=3,
                                                                 attention_bias=True, rope_interleaved=False),),
                              experts=ExpertsConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=3,
                                                    layers=(0, 1), router="sigmoid_group_topk", norm_topk_prob=False,
                                                    shared_expert_intermediate_size=6)),
    "deepseek_v32": dict(family="deepseek_v32", num_kv_heads=4, head_dim=2, rotary=RotaryConfig(interleaved=True),
                         mixer_parts=(LatentAttentionConfig(hidden_size=16, num_heads=4, kv_lora_rank=5,
                                                            qk_nope_head_dim=3, qk_rope_head_dim=2, v_head_dim=3,
                                                            q_lora_rank=4, attention_scale=0.4, index_topk=2,
                                                            index_n_heads=8, index_head_dim=4),),
                         experts=ExpertsConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=3,
                                               layers=(1,), router="sigmoid_group_topk", n_group=2, topk_group=1,
                                               routed_scaling_factor=2.5, shared_expert_intermediate_size=3)),
    "kimi_linear": dict(family="kimi_linear", num_kv_heads=4, head_dim=2, num_layers=3,
                        rotary=RotaryConfig(interleaved=False, skip_layers=(0, 1, 2)),
                        layer_types=("kimi_delta_attention", "full_attention", "kimi_delta_attention"),
                        mixer_parts=(KimiDeltaAttentionConfig(num_heads=2, head_dim=3, conv_kernel_size=3),
                                     LatentAttentionConfig(hidden_size=16, num_heads=4, kv_lora_rank=5,
                                                           qk_nope_head_dim=3, qk_rope_head_dim=2, v_head_dim=3,
                                                           q_lora_rank=4, rope_interleaved=False)),
                        experts=ExpertsConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=3,
                                              layers=(1, 2), router="sigmoid_group_topk", n_group=2, topk_group=1,
                                              routed_scaling_factor=2.5, shared_expert_intermediate_size=3)),
    "qwen3_5_text": dict(family="qwen3_5_text", norm=NormConfig(offset=1.0), rotary=RotaryConfig(partial_factor=0.5),
                         attention=AttentionConfig(qk_norm="head"), layer_types=("linear_attention", "gated_attention"),
                         mixer_parts=(GatedDeltaNetConfig(1, 2, 4, 3),)),
    "qwen3_next": dict(family="qwen3_next", norm=NormConfig(offset=1.0), rotary=RotaryConfig(partial_factor=0.5),
                       attention=AttentionConfig(qk_norm="head"), num_layers=3,
                       layer_types=("linear_attention", "gated_attention", "linear_attention"),
                       mixer_parts=(GatedDeltaNetConfig(2, 4, 4, 3),),
                       experts=ExpertsConfig(3, 2, 5, layers=(0, 1), norm_topk_prob=False,
                                             shared_expert_intermediate_size=6, shared_expert_gate=True)),
    "qwen3_5_moe_text": dict(family="qwen3_5_moe_text", norm=NormConfig(offset=1.0),
                             rotary=RotaryConfig(partial_factor=0.5), attention=AttentionConfig(qk_norm="head"),
                             layer_types=("linear_attention", "gated_attention"),
                             mixer_parts=(GatedDeltaNetConfig(1, 2, 4, 3),),
                             experts=ExpertsConfig(3, 2, 5, layers=(0, 1), norm_topk_prob=True,
                                                   shared_expert_intermediate_size=6, shared_expert_gate=True)),
    "lfm2": dict(family="lfm2", attention=AttentionConfig(qk_norm="head"), num_layers=3,
                 layer_types=("short_conv", "full_attention", "short_conv"),
                 mixer_parts=(ShortConvConfig(3, bias=True),)),
    "llama4_text": dict(family="llama4_text", num_layers=3, rotary=RotaryConfig(interleaved=True, skip_layers=(1,)),
                        attention=AttentionConfig(qk_norm="unit_after_rotary", chunk_size=2,
                                                  query_temperature=(2.0, 0.5)),
                        layer_types=("chunked_attention", "full_attention", "chunked_attention"),
                        experts=ExpertsConfig(3, 2, 5, layers=(1, 2), router="topk_sigmoid", norm_topk_prob=False,
                                              shared_expert_intermediate_size=5, weigh_inputs=True)),
    "bamba": dict(family="bamba", rotary=RotaryConfig(partial_factor=0.5), num_layers=3,
                  layer_types=("mamba2", "full_attention", "mamba2"),
                  mixer_parts=(Mamba2Config(num_heads=4, head_dim=8, state_size=3, n_groups=2, conv_kernel_size=3,
                                            chunk_size=2),)),
    "granitemoehybrid": dict(family="granitemoehybrid", rotary=RotaryConfig(skip_layers=(0, 1, 2)), num_layers=3,
                             layer_types=("mamba2", "full_attention", "mamba2"),
                             scales=ScalesConfig(embedding=2.0, residual=0.6, logit=0.5),
                             attention=AttentionConfig(scale=0.3),
                             mixer_parts=(Mamba2Config(num_heads=4, head_dim=8, state_size=3, n_groups=2,
                                                       conv_kernel_size=3, chunk_size=2),),
                             experts=ExpertsConfig(3, 2, 5, layers=(0, 1, 2), router="topk_softmax",
                                                   shared_expert_intermediate_size=6)),
    "nemotron_h": dict(family="nemotron_h", rotary=RotaryConfig(skip_layers=(0, 1, 2, 3)), num_layers=4,
                       residual="single", mlp=dict(kind="ungated", activation="relu2", bias=True),
                       layer_types=("mamba2", "full_attention", "mlp", "mamba2"),
                       mixer_parts=(Mamba2Config(num_heads=4, head_dim=8, state_size=3, n_groups=2,
                                                 conv_kernel_size=3, chunk_size=2, time_step_min=0.5),)),
    # attention beside Mamba-2 in every layer, every multiplier away from 1, the norm before the gate
    "falcon_h1": dict(family="falcon_h1", attention=AttentionConfig(scale=0.3), mlp=dict(kind="scaled_gated"),
                      scales=ScalesConfig(embedding=2.0, logit=0.5, mlp_gate=0.7, mlp_output=1.3),
                      layer_types=("attention_mamba2",) * 2,
                      mixer_parts=(AttentionMamba2Config(
                          Mamba2Config(num_heads=4, head_dim=6, state_size=3, n_groups=2, conv_kernel_size=3,
                                       chunk_size=2, norm="before_gate", out_bias=True,
                                       projection_multipliers=(0.5, 1.5, 0.75, 1.25, 2.0)), 0.6, 1.5, 1.3, 0.7),)),
    # no Mamba norm, projection biases, MLP biases
    "falcon_h1_bias": dict(family="falcon_h1", mlp=dict(kind="scaled_gated", bias=True),
                           scales=ScalesConfig(mlp_gate=1.2, mlp_output=0.8),
                           layer_types=("attention_mamba2",) * 2,
                           mixer_parts=(AttentionMamba2Config(Mamba2Config(num_heads=2, head_dim=8, state_size=4,
                                                                           chunk_size=3, norm=None, proj_bias=True),
                                                              mamba_out=1.2),)),
}


def _larger_weights(lm, seed=4):
    """Weights large enough that soft-caps, clamps, sinks and norms all act (the 0.02 init leaves them idle)."""
    rng = np.random.default_rng(seed)
    for name, p in lm.named_parameters():
        if name.endswith(("gamma", "q_norm", "k_norm")):
            p[...] = 1.0 - lm.config.norm.offset + 0.3 * rng.standard_normal(p.shape)
        else:
            p[...] = 0.4 * rng.standard_normal(p.shape)
    return lm


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("padded", [False, True])
def test_causal_lm(family, padded):
    lm = _larger_weights(CausalLM(_config(**FAMILIES[family]), rng=0))
    ids = np.random.default_rng(2).integers(0, 13, size=(2, 6))
    mask = left_padding(2, 6, [6, 3]) if padded else None
    check_parity(lm, [ids], dict(attention_mask=mask))


def test_seq2seq_transformer():
    model = Seq2SeqTransformer(Seq2SeqConfig(9, 7, d_model=8, num_heads=2, num_encoder_layers=1,
                                             num_decoder_layers=2, max_length=12), rng=0)
    src = np.random.default_rng(2).integers(0, 9, size=(2, 6))
    tgt = np.random.default_rng(3).integers(0, 7, size=(2, 4))
    check_parity(model, [src, tgt], dict(src_key_padding_mask=np.array([[True] * 6, [True] * 4 + [False] * 2])))


def test_worst_figures_are_recorded():
    # Runs last in this module: the largest discrepancies of the whole file, for the report.
    print(f"\nworst forward rel {WORST['forward']:.2e}, worst gradient rel {WORST['grad']:.2e}")
    assert 0 < WORST["forward"] <= FORWARD_TOL


# -- conversion ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_round_trip_is_exact(dtype):
    lm = CausalLM(_config(**FAMILIES["qwen2"]), rng=3).astype(dtype)
    twin = from_numpy(lm)
    assert {t.dtype for t in twin.parameters()} == {torch.float32 if dtype == np.float32 else torch.float64}
    back = to_numpy(twin)
    assert type(back) is CausalLM
    for (name, a), (name_b, b) in zip(lm.named_parameters(), back.named_parameters(), strict=True):
        assert name == name_b and a.dtype == b.dtype and np.array_equal(a, b)
    ids = np.array([[1, 2, 3, 4]])
    assert np.array_equal(back(ids), lm(ids))


def test_trained_twin_comes_back_with_its_weights():
    ffn = L.FeedForward(4, 6, rng=0)
    twin = from_numpy(ffn)
    with torch.no_grad():
        twin.W1.add_(1.0)
    back = to_numpy(twin)
    np.testing.assert_array_equal(back.W1, ffn.W1 + 1.0)
    back.W2 = back.W2 * 0  # the rebuilt module owns its arrays
    assert np.abs(twin.W2.detach().numpy()).max() > 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_module_back_from_its_twin_trains_as_the_original_does(family):
    """to_numpy gave every module a plain dict of zero gradients, so zero_grad() raised AttributeError ('dict'
    has no 'allocated') and every buffer was allocated up front. The rebuilt module now starts from Module's
    own state: the same gradient buffers as a freshly built module (none allocated), its own fused groups (not
    the source's buffers), and forward, backward, zero_grad and Adam steps equal the original's bit for bit."""
    from attnkit.core.module import GradientBuffers
    from attnkit.optim import Adam

    cfg = _config(**FAMILIES[family])
    original = CausalLM(cfg, rng=3)
    back = to_numpy(from_numpy(original))
    fresh = CausalLM(cfg, rng=3)
    for (name, mod), (_, mod_fresh) in zip(back.named_modules(), fresh.named_modules(), strict=True):
        assert type(mod.grads) is type(mod_fresh.grads) is GradientBuffers, name
        assert list(mod.grads) == list(mod_fresh.grads) and mod.grads.allocated() == [], name
    attention, source = back.layers[0].attention, original.layers[0].attention
    fused = attention.fused_parameter("W_QKV")
    assert fused is not None and not np.shares_memory(fused, source.fused_parameter("W_QKV"))
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    grad = np.random.default_rng(0).standard_normal((2, 4, cfg.vocab_size))
    optimizers = [Adam(model, lr=1e-2) for model in (original, back)]
    for _ in range(3):
        for model, optimizer in zip((original, back), optimizers):
            model.zero_grad()
            model(ids)
            model.backward(grad)
            optimizer.step()
        for (name, a), (_, b) in zip(original.named_gradients(), back.named_gradients(), strict=True):
            assert np.array_equal(a, b), name
    for (name, a), (_, b) in zip(original.named_parameters(), back.named_parameters(), strict=True):
        assert np.array_equal(a, b), name
    back.zero_grad(set_to_none=True)
    assert all(mod.grads.allocated() == [] for _, mod in back.named_modules())


def test_twin_constructor_matches_attnkit_initial_weights():
    from attnkit.torch import CausalLM as TwinCausalLM
    cfg = _config()
    twin, ref = TwinCausalLM(cfg, rng=5), CausalLM(cfg, rng=5)
    for (name, t), (_, a) in zip(twin.named_parameters(), ref.named_parameters(), strict=True):
        assert np.array_equal(t.detach().numpy(), a), name


def test_untwinnable_head_is_refused():
    model = L.TransformerDecoderBlock(8, 2, cross_attention="additive", rng=0)
    with pytest.raises(ValueError, match="AdditiveAttention"):
        from_numpy(model)
    with pytest.raises(ValueError, match="no weights"):
        from_numpy(MultiHeadAttention(8, 2, rng=0))(*(torch.zeros(1, 2, 8),) * 3, need_weights=True)
    with pytest.raises(TypeError, match="attnkit Module"):
        from_numpy(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="twin"):
        to_numpy(torch.nn.Linear(2, 2))


def test_round_trip_of_shared_keys_and_values_links_the_copy_to_itself():
    lm = CausalLM(_config(**FAMILIES["gemma4_text"]), rng=0)
    back = to_numpy(from_numpy(lm))
    ids = np.array([[1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(back(ids), lm(ids))
    assert back.layers[3].attention.shared is back.layers[1].attention.shared  # layer 3 reads layer 1's
    assert back.layers[3].attention.shared is not lm.layers[3].attention.shared
