"""The newer Hugging Face families (OLMo 2, SmolLM3, GPT-NeoX, Gemma, Phi-3, the mixtures of experts) loaded from
tiny random save_pretrained folders: float32 gradients of every parameter against torch autograd through the
transformers model (each HF gradient brought to attnkit's layout by the loader's own tensor map), unknown config
keys refused by name, ``supported_model_types``, gpt-oss's MXFP4 experts. Logits and greedy parity are in
test_causal_lm.py (FAMILY_MODELS)."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.pretrained import load_causal_lm, supported_model_types  # noqa: E402
from attnkit.pretrained.checkpoint import HEAD_NAMES, checkpoint_map  # noqa: E402
from hf_models import (  # noqa: E402
    edit_config,
    left_padded_batch,
    mxfp4_folder,
    mxfp4_pair,
    positions_from_mask,
    saved_model,
)

NEW_FAMILY_MODELS = ("olmo2_bias_mqa", "smollm3_window", "gpt_neox", "gpt_neox_sequential", "gemma2",
                     "gemma2_mqa_untied", "gemma3_text", "phi3_longrope", "phi3_partial_window",
                     "gpt_oss", "gpt_oss_clamped", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next",
                     "qwen3_next_unnormalised",
                     "qwen3_moe", "qwen3_moe_window", "mixtral", "gemma4_text", "lfm2", "lfm2_bias", "bamba",
                     "bamba_bias", "olmo3", "glm4", "granite", "seed_oss", "exaone4", "ernie4_5", "hunyuan_v1_dense",
                     "apertus", "glm4_moe", "glm4_moe_plain", "granitemoehybrid", "granitemoehybrid_dense",
                     "nemotron_h", "nemotron_h_bias", "falcon_h1", "falcon_h1_bias", "kimi_linear", "kimi_linear_plain",
                     "llama4_text")
GRAD_TOL = 2e-4  # max |ours - HF| / max |HF| per parameter, float32 through a two-layer model


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_families")


@pytest.mark.parametrize("name", NEW_FAMILY_MODELS)
def test_gradients_match_hf_autograd(name, hf_root):
    folder, hf = saved_model(name, hf_root)
    lm = load_causal_lm(folder)
    ids, mask = left_padded_batch(np.random.default_rng(5), (6, 3))
    g = np.random.default_rng(6).standard_normal((2, 6, lm.config.vocab_size)).astype(np.float32)
    g[~mask] = 0
    lm.zero_grad()
    lm(ids, mask)
    lm.backward(g)
    hf.zero_grad()
    # Gemma 4's layer scalars and xIELU's beta and eps (Apertus) are buffers in torch and parameters in attnkit:
    # torch differentiates them on request
    scalars = {n: b for n, b in hf.named_buffers() if n.endswith(("layer_scalar", "act_fn.beta", "act_fn.eps"))}
    for buffer in scalars.values():
        buffer.requires_grad_(True)
    out = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)),
             position_ids=torch.from_numpy(positions_from_mask(mask)))
    (out.logits * torch.from_numpy(g)).sum().backward()
    theirs_by_name = {n: p.grad.double().numpy() for n, p in [*hf.named_parameters(), *scalars.items()]
                      if p.grad is not None}
    for buffer in scalars.values():
        buffer.requires_grad_(False)
        buffer.grad = None
    if lm.config.family in EXPERT_NAMES:
        theirs_by_name = _experts_one_by_one(theirs_by_name, *EXPERT_NAMES[lm.config.family])
    for memory, disk in FUSED_EXPERT_NAMES.get(lm.config.family, {}).items():
        theirs_by_name = {n.replace(memory, disk): g for n, g in theirs_by_name.items()}
    if lm.config.family == "kimi_linear":
        theirs_by_name = _kimi_delta_names(theirs_by_name)
    maps, prefix = checkpoint_map(lm.config)
    prefix = MEMORY_PREFIXES.get(lm.config.family, prefix)
    ours = dict(lm.named_gradients())
    checked = set()
    for m in maps:
        # transformers names every head lm_head in memory (it renames GPT-NeoX's embed_out on load and save)
        hf_name = "lm_head.weight" if m.source in HEAD_NAMES else prefix + m.source
        if hf_name not in theirs_by_name:  # a tied head is the embedding's parameter in torch
            continue
        for target, expected in m.convert(theirs_by_name[hf_name]).items():
            got = m.destination(ours, target)  # one expert's slice of a stacked parameter, or the parameter
            scale = np.max(np.abs(expected))
            if target.endswith("b_K") and not lm.config.layers[int(target.split(".")[1])].rotary:
                # Without rotary a key bias adds one constant to a query's scores, which softmax ignores: both
                # gradients are rounding noise, measured against the key weights' gradient.
                scale = np.max(np.abs(ours[target[:-3] + "W_K"]))
            if target == f"layers.{lm.config.num_layers - 1}.layer_scalar":
                # The final RMSNorm undoes a scale of the last layer's output but for its eps: both gradients are
                # near zero (float64 finite differences agree with attnkit's), measured against the other scalars'.
                scale = max(np.max(np.abs(v)) for k, v in ours.items() if k.endswith("layer_scalar"))
            err = np.max(np.abs(got - expected)) / max(scale, 1e-30)
            assert err <= GRAD_TOL, (target, m.source, err)
            checked.add(target)
    # a router's correction bias only picks the experts (torch gives it no gradient): attnkit's is zero
    unused = {n for n, grad in ours.items() if n.endswith("e_score_correction_bias") and not grad.any()}
    assert checked == set(ours) - unused


# the checkpoint's name of a mixture's module and of each expert's gate, up and down matrices
EXPERT_NAMES = {"qwen3_next": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
                "qwen3_5_moe_text": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
                "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
                "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
                "glm4_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
                "kimi_linear": ("block_sparse_moe.", ("w1", "w3", "w2"))}

# the base model's prefix in memory where transformers renames the checkpoint's on load (Nemotron-H's backbone.)
MEMORY_PREFIXES = {"nemotron_h": "model."}
# families whose checkpoints keep the experts fused, under names of their own: transformers' name in memory ->
# the checkpoint's (its conversion mapping, read backwards)
_MOE = "block_sparse_moe."
FUSED_EXPERT_NAMES = {"granitemoehybrid": {_MOE + "experts.gate_up_proj": _MOE + "input_linear.weight",
                                           _MOE + "experts.down_proj": _MOE + "output_linear.weight",
                                           _MOE + "router.weight": _MOE + "router.layer.weight"}}


def _kimi_delta_names(grads: dict) -> dict:
    """transformers' in-memory Kimi Delta Attention names as its checkpoints' (Moonshot's): the forget gate's
    parameters directly under ``self_attn.``, the one (3 E, 1, K) ``conv1d`` as ``q_conv1d``, ``k_conv1d`` and
    ``v_conv1d``."""
    out = {}
    for name, grad in grads.items():
        if name.endswith("self_attn.conv1d.weight"):
            base = name[:-len("conv1d.weight")]
            out.update({f"{base}{part}_conv1d.weight": piece for part, piece in zip("qkv", np.split(grad, 3))})
        else:
            out[name.replace("self_attn.forget_gate.", "self_attn.")] = grad
    return out


def _experts_one_by_one(grads: dict, moe: str, names: tuple[str, str, str]) -> dict:
    """transformers keeps a mixture's experts fused in memory (``mlp.experts.gate_up_proj`` (E, 2F, D),
    ``mlp.experts.down_proj`` (E, D, F)); its checkpoints, and so attnkit's map, name each expert's matrices
    (under ``moe``, Mixtral's ``block_sparse_moe.``)."""
    out = {}
    for name, grad in grads.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, f = name[:-len("mlp.experts.gate_up_proj")] + moe + "experts.", grad.shape[1] // 2
            for e in range(grad.shape[0]):
                out[f"{base}{e}.{names[0]}.weight"], out[f"{base}{e}.{names[1]}.weight"] = grad[e, :f], grad[e, f:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[:-len("mlp.experts.down_proj")] + moe + "experts."
            out.update({f"{base}{e}.{names[2]}.weight": grad[e] for e in range(grad.shape[0])})
        else:
            out[name.replace(".mlp.", "." + moe)] = grad
    return out


@pytest.mark.parametrize("name, key", [("olmo2", "use_sliding_window"), ("smollm3", "qk_layernorm"),
                                       ("gpt_neox", "num_key_value_heads"), ("gemma3_text", "rope_scaling_mode"),
                                       ("phi3", "attention_bias"), ("gpt_oss", "num_experts"),
                                       ("qwen3_moe", "shared_expert_intermediate_size"), ("mixtral", "norm_topk_prob"),
                                       ("lfm2", "rms_norm_eps"), ("bamba", "head_dim_ratio"),
                                       ("qwen3_5_moe_text", "decoder_sparse_step"),
                                       ("olmo3", "use_sliding_window"), ("glm4", "attention_out_bias"),
                                       ("granite", "residual_scale"), ("seed_oss", "qk_layernorm"),
                                       ("exaone4", "sliding_window_size"), ("ernie4_5", "attention_bias"),
                                       ("hunyuan_v1_dense", "qk_layernorm"), ("apertus", "xielu_beta"),
                                       ("glm4_moe", "scoring_func"),
                                       ("deepseek_v32", "rope_interleave"),
                                       ("granitemoehybrid", "router_jitter_noise"),
                                       ("nemotron_h", "rms_norm_eps"),
                                       ("falcon_h1", "mamba_d_inner"),
                                       ("kimi_linear", "rope_interleave"),
                                       ("llama4_text", "sliding_window")])
def test_unknown_config_keys_are_refused_by_name(name, key, hf_root, tmp_path):
    folder, _ = saved_model(name, hf_root)
    with pytest.raises(ValueError, match=f"{key!r} is not understood"):
        load_causal_lm(edit_config(folder, tmp_path / "edited", **{key: True}))


def test_a_multimodal_llama4_folder_is_refused_naming_the_text_family(hf_root, tmp_path):
    folder, _ = saved_model("llama4_text", hf_root)
    text = json.loads((folder / "config.json").read_text())
    edited = edit_config(folder, tmp_path / "llama4", model_type="llama4", text_config=text, vision_config={})
    with pytest.raises(ValueError, match="'llama4' is a multimodal folder .* load a text-only 'llama4_text' folder "
                                         r"\(Llama4ForCausalLM\)"):
        load_causal_lm(edited)
    with pytest.raises(ValueError, match="model_type 'llama5' is not supported"):
        load_causal_lm(edit_config(folder, tmp_path / "llama5", model_type="llama5"))


def test_supported_model_types_lists_the_new_families():
    families = {"qwen3", "olmo2", "smollm3", "gpt_neox", "gemma2", "gemma3_text", "phi3", "gpt_oss"}
    assert families <= set(supported_model_types())


def test_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path):
    """gpt-oss is published with MXFP4 experts: a folder holding blocks and scales (and a quantization_config)
    loads into the same logits as transformers' float model with its own dequantization of those bytes."""
    from safetensors.numpy import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from hf_models import build_hf_model, hf_logits

    hf = build_hf_model("gpt_oss_wide")
    cfg = hf.config
    e, d, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    rng = np.random.default_rng(9)
    tensors = {name: p.detach().numpy().copy() for name, p in hf.state_dict().items()}
    for i in range(cfg.num_hidden_layers):
        base = f"model.layers.{i}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
            blocks, scales = mxfp4_pair(rng, e, rows, cols)
            weight = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                dtype=torch.float32)  # (E, C, R) as transformers multiplies
            with torch.no_grad():
                getattr(hf.model.layers[i].mlp.experts, name).copy_(weight)
            del tensors[base + name]
            tensors[base + name + "_blocks"], tensors[base + name + "_scales"] = blocks, scales
    folder = tmp_path / "gpt_oss_mxfp4"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    config = cfg.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    lm = load_causal_lm(folder)
    ids, mask = left_padded_batch(np.random.default_rng(4), (6, 3))
    ours, theirs = lm(ids, mask), hf_logits(hf, ids, mask)
    err = np.max(np.abs(ours[mask] - theirs[mask])) / np.max(np.abs(theirs[mask]))
    assert err < 2e-6, err


@pytest.mark.parametrize("matrix, position", [("down_proj", (2, 5, 0)), ("gate_up_proj", (0, 0, 0))])
def test_an_mxfp4_nan_scale_is_refused_naming_the_tensor(matrix, position, hf_root, tmp_path):
    """0xFF is the E8M0 scale's NaN code (OCP MX format): read as an exponent it turned a block into inf and the
    logits into NaN. It is refused with the tensor and the block named."""
    name = f"model.layers.1.mlp.experts.{matrix}_scales"

    def nan_scale(tensors):
        tensors[name][position] = 0xFF

    folder = mxfp4_folder("gpt_oss_wide", hf_root, tmp_path / "nan_scale", nan_scale)
    where = ", ".join(map(str, position))
    with pytest.raises(ValueError, match=rf"MXFP4 scales {name!r} hold 0xFF \(the NaN code of the E8M0 scale\) "
                                         rf"at \[{where}\]"):
        load_causal_lm(folder)
    assert np.isfinite(load_causal_lm(mxfp4_folder("gpt_oss_wide", hf_root, tmp_path / "clean"))(
        np.array([[3, 4, 5]]))).all()


def test_dequantize_mxfp4_refuses_the_nan_scale():
    from attnkit.pretrained.mxfp4 import dequantize_mxfp4

    blocks = np.full((2, 16), 0x22, np.uint8)  # every code 2 (1.0)
    assert dequantize_mxfp4(blocks, np.array([127, 0xFE], np.uint8))[[0, 32]].tolist() == [1.0, 2.0 ** 127]
    with pytest.raises(ValueError, match=r"'scales' hold 0xFF \(the NaN code of the E8M0 scale\) at \[1\]"):
        dequantize_mxfp4(blocks, np.array([127, 0xFF], np.uint8))


def test_an_mxfp4_width_that_is_not_whole_blocks_is_refused_before_reading(hf_root, tmp_path, monkeypatch):
    """gpt_oss's intermediate_size 48 is the column count of down_proj: 1.5 MXFP4 blocks. The header (C / 32 = 1
    block) used to pass and NumPy then failed to broadcast 32 columns into 48; now the header check names it and
    no tensor is read."""
    import attnkit.pretrained.checkpoint as checkpoint

    folder = mxfp4_folder("gpt_oss", hf_root, tmp_path / "ragged")

    def never(*args, **kwargs):
        raise AssertionError("a tensor was read before the MXFP4 widths were checked")

    monkeypatch.setattr(checkpoint, "read_tensor", never)
    monkeypatch.setattr(checkpoint, "_read_into", never)
    with pytest.raises(ValueError, match=r"MXFP4 tensor 'model.layers.0.mlp.experts.down_proj_blocks' would hold "
                                         r"48 columns \(its dequantized shape is \(4, 48, 32\)\), not a multiple "
                                         r"of MXFP4's 32-value blocks"):
        load_causal_lm(folder)


def test_a_quantization_other_than_gpt_oss_mxfp4_is_refused(hf_root, tmp_path):
    folder, _ = saved_model("llama_gqa", hf_root)
    with pytest.raises(ValueError, match="quantization_config.*'gptq'"):
        load_causal_lm(edit_config(folder, tmp_path / "q", quantization_config={"quant_method": "gptq"}))


def test_a_hybrid_models_weights_are_its_linear_layers_token_weights(hf_root, tmp_path):
    """attention_weights gives a Gated DeltaNet layer's effective token weights (signed, no softmax), which times
    its values are the layer's core output; the explain page draws the softmax layers only and composes no rollout."""
    from attnkit.explain.page import explain_html

    folder, _ = saved_model("qwen3_5_text", hf_root)
    lm = load_causal_lm(folder, dtype=np.float64)
    ids = np.array([[3, 9, 4, 17, 5, 8]])
    linear, gated = lm.attention_weights(ids, layers=[0, 1])
    layer = lm.layers[0]
    expected, _ = layer.attention.token_weights(layer.attn_norm(lm.embed(ids)))
    np.testing.assert_allclose(linear, expected, rtol=1e-12, atol=1e-15)
    assert linear.min() < 0 and np.allclose(gated.sum(-1), 1.0)  # signed weights beside softmax rows
    data = explain_html(lm, [3, 9, 4], tmp_path / "page.html")
    assert (data["attention_layers"], data["linear_layers"], data["rollout"]) == ([1, 3], [0, 2], None)


@pytest.mark.parametrize("model_type, config_class", [("qwen3_5_text", "Qwen3_5TextConfig"),
                                                      ("qwen3_next", "Qwen3NextConfig"),
                                                      ("qwen3_5_moe_text", "Qwen3_5MoeTextConfig"),
                                                      ("qwen3_moe", "Qwen3MoeConfig"), ("mixtral", "MixtralConfig"),
                                                      ("lfm2", "Lfm2Config"), ("bamba", "BambaConfig"),
                                                      ("olmo3", "Olmo3Config"), ("glm4", "Glm4Config"),
                                                      ("granite", "GraniteConfig"), ("seed_oss", "SeedOssConfig"),
                                                      ("ernie4_5", "Ernie4_5Config"),
                                                      ("hunyuan_v1_dense", "HunYuanDenseV1Config"),
                                                      ("apertus", "ApertusConfig"),
                                                      ("glm4_moe", "Glm4MoeConfig"),
                                                      ("deepseek_v32", "DeepseekV32Config"),
                                                      ("granitemoehybrid", "GraniteMoeHybridConfig"),
                                                      ("falcon_h1", "FalconH1Config"),
                                                      ("llama4_text", "Llama4TextConfig")])
def test_a_config_without_optional_keys_reads_as_transformers_defaults_it(model_type, config_class):
    """Every default of the family's reader is transformers': a config.json holding only the required sizes reads
    as the full config transformers writes for the same sizes."""
    import transformers

    from attnkit.pretrained.families import family

    # a vocabulary that holds every family's default special ids (GLM-4's 151329, ...)
    sizes = dict(vocab_size=160000, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
                 num_attention_heads=8)
    full = json.loads(getattr(transformers, config_class)(**sizes).to_json_string())
    assert family(model_type).config_from_hf(dict(sizes, model_type=model_type)) == \
        family(model_type).config_from_hf(full)


# the keys LiquidAI's LFM2 config.json files carry beside transformers' (LFM2-2.6B's values, at the tiny sizes)
LIQUID_KEYS = dict(block_dim=32, conv_dim=32, conv_dim_out=32, num_heads=4, block_ff_dim=48, block_use_swiglu=True,
                   use_pos_enc=True, block_mlp_init_scale=1.0, block_out_init_scale=1.0, block_use_xavier_init=True,
                   conv_use_xavier_init=True, block_norm_eps=1e-5, theta=1e6, tie_embedding=True)


def test_lfm2_reads_liquidais_own_config_keys_and_refuses_a_repeat_that_disagrees(hf_root, tmp_path):
    folder, _ = saved_model("lfm2", hf_root)
    ids = np.array([[3, 4, 5, 6]])
    expected = load_causal_lm(folder)(ids)
    np.testing.assert_array_equal(load_causal_lm(edit_config(folder, tmp_path / "liquid", **LIQUID_KEYS))(ids),
                                  expected)
    for key, value, said in (("conv_dim", 16, r"'conv_dim' \(16\) must equal 'hidden_size' \(32\)"),
                             ("num_heads", 8, r"'num_heads' \(8\) must equal 'num_attention_heads' \(4\)"),
                             ("block_use_swiglu", False, "'block_use_swiglu' must be true")):
        with pytest.raises(ValueError, match=said):
            load_causal_lm(edit_config(folder, tmp_path / key, **{**LIQUID_KEYS, key: value}))


def test_granitemoehybrid_reads_the_layer_kinds_under_every_name_transformers_accepts(hf_root, tmp_path):
    """IBM's config.json files name the layers "mamba" and "attention" (transformers reads them as linear_attention
    and full_attention, and accepts ``layers_block_type`` for ``layer_types``) and the norm ("rmsnorm"): the same
    model either way."""
    folder, _ = saved_model("granitemoehybrid", hf_root)
    ids = np.array([[3, 4, 5, 6, 7]])
    expected = load_causal_lm(folder)(ids)
    legacy = ["mamba", "attention", "mamba"]
    for name, changes in (("legacy", dict(layer_types=legacy, normalization_function="rmsnorm")),
                          ("block_type", dict(layer_types=..., layers_block_type=legacy))):
        np.testing.assert_array_equal(load_causal_lm(edit_config(folder, tmp_path / name, **changes))(ids), expected)
    dense, _ = saved_model("granitemoehybrid_dense", hf_root)  # IBM's dense models: no experts, none per token
    np.testing.assert_array_equal(load_causal_lm(edit_config(dense, tmp_path / "dense", num_experts_per_tok=0))(ids),
                                  load_causal_lm(dense)(ids))


@pytest.mark.parametrize("changes, said", [
    (dict(position_embedding_type="alibi"), "'position_embedding_type' must be 'rope', 'nope' or null"),
    (dict(normalization_function="layernorm"), "'normalization_function' must be 'rmsnorm'"),
    (dict(layer_types=["mamba", "moe", "mamba"]), "'layer_types' must list one of"),
    (dict(layer_types=["mamba", "attention"]), "for each of the 3 layers"),
    (dict(layers_block_type=["attention", "attention", "mamba"]), "'layer_types' and 'layers_block_type' disagree"),
])
def test_granitemoehybrid_refuses_what_it_cannot_read_by_name(changes, said, hf_root, tmp_path):
    folder, _ = saved_model("granitemoehybrid", hf_root)
    with pytest.raises(ValueError, match=said):
        load_causal_lm(edit_config(folder, tmp_path / "edited", **changes))


def test_nemotron_h_reads_the_pattern_string_and_the_older_key_names(hf_root, tmp_path):
    """NVIDIA's config.json files give the layers as hybrid_override_pattern ("M*-M*-"), some Mamba keys under
    older names (mamba_n_groups, mamba_d_conv, mamba_chunk_size, ...), which transformers reads, the heads' width as
    attention_head_dim and their remote code's classes: the same model."""
    folder, _ = saved_model("nemotron_h", hf_root)
    ids = np.array([[3, 4, 5, 6, 7]])
    expected = load_causal_lm(folder)(ids)
    older = dict(layers_block_type=..., hybrid_override_pattern="M*-M*-", num_hidden_layers=6, n_groups=...,
                 mamba_n_groups=2, conv_kernel=..., mamba_d_conv=3, chunk_size=..., mamba_chunk_size=4,
                 attention_head_dim=8, auto_map={"AutoConfig": "configuration_nemotron_h.NemotronHConfig"})
    np.testing.assert_array_equal(load_causal_lm(edit_config(folder, tmp_path / "older", **older))(ids), expected)


@pytest.mark.parametrize("changes, said", [
    (dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "mlp", "mlp"]),
     "'moe' layers \\(layer 1: a mixture of ungated experts\\) are not supported"),
    (dict(layers_block_type=..., hybrid_override_pattern="M*E-"), "'moe' layers"),
    (dict(hybrid_override_pattern="M*X-", layers_block_type=...), "'hybrid_override_pattern' must be a string"),
    (dict(num_nextn_predict_layers=1), "'num_nextn_predict_layers' > 0"),
    (dict(mamba_hidden_act="gelu"), "'mamba_hidden_act' must be 'silu'"),
    (dict(time_step_min=-1.0), "'time_step_min' must be a finite number >= 0"),
    (dict(attention_head_dim=16), "'attention_head_dim' \\(16\\) must equal head_dim \\(8\\)"),
])
def test_nemotron_h_refuses_what_it_cannot_read_by_name(changes, said, hf_root, tmp_path):
    folder, _ = saved_model("nemotron_h", hf_root)
    with pytest.raises(ValueError, match=said):
        load_causal_lm(edit_config(folder, tmp_path / "edited", **changes))


def test_a_nemotron_h_config_without_optional_keys_reads_as_transformers_defaults_it():
    """transformers' default layers include a mixture of experts (refused): with the layers given, every other
    default of the reader is transformers'."""
    import transformers

    from attnkit.pretrained.families import family

    sizes = dict(vocab_size=1000, hidden_size=64, intermediate_size=48, num_attention_heads=8,
                 layers_block_type=["linear_attention", "full_attention", "mlp"])
    full = json.loads(transformers.NemotronHConfig(**sizes).to_json_string())
    reader = family("nemotron_h")
    assert reader.config_from_hf(dict(sizes, model_type="nemotron_h")) == reader.config_from_hf(full)


@pytest.mark.parametrize("model_type, config_class, keys, rotary", [
    # OLMo 3 reads the older keys into its full layers only: the sliding ones keep the default of base 500000
    ("olmo3", "Olmo3Config", dict(rope_theta=1000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}),
     dict(theta=1000.0, sliding_theta=500000.0, sliding_scaling=None)),
    # HunYuan's "dynamic" scaling with an alpha is the default rotary of base theta * alpha ** (Dh / (Dh - 2))
    ("hunyuan_v1_dense", "HunYuanDenseV1Config", dict(rope_theta=1000.0, rope_scaling={
        "type": "dynamic", "alpha": 50.0, "factor": 1.0}), dict(theta=1000.0 * 50.0 ** (8 / 6), scaling=None)),
])
def test_older_rotary_keys_read_as_transformers_reads_them(model_type, config_class, keys, rotary):
    import transformers

    from attnkit.pretrained.families import family

    sizes = dict(vocab_size=160000, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
                 num_attention_heads=8)
    full = json.loads(getattr(transformers, config_class)(**sizes, **keys).to_json_string())
    ours = family(model_type).config_from_hf(dict(sizes, model_type=model_type, **keys))
    assert ours == family(model_type).config_from_hf(full)
    assert {name: getattr(ours.rotary, name) for name in rotary} == pytest.approx(rotary)


def test_gemma4_key_value_tensors_of_the_reusing_layers_are_ignored_as_transformers_does(hf_root, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder, _ = saved_model("gemma4_text", hf_root)
    ids = np.array([[3, 4, 5, 6]])
    expected = load_causal_lm(folder)(ids)
    tensors = load_file(str(folder / "model.safetensors"))
    # layer 3 reuses layer 2's keys and values: a checkpoint may still carry its own, which nothing reads
    extra = {"model.layers.3.self_attn.k_proj.weight": np.ones((16, 32), np.float32),
             "model.layers.3.self_attn.k_norm.weight": np.ones(8, np.float32)}
    stray = {"model.layers.2.self_attn.z_proj.weight": np.ones(2, np.float32)}
    for name, files in (("kept", {**tensors, **extra}), ("stray", {**tensors, **extra, **stray})):
        target = edit_config(folder, tmp_path / name)
        save_file(files, str(target / "model.safetensors"), metadata={"format": "pt"})
        if name == "kept":
            np.testing.assert_array_equal(load_causal_lm(target)(ids), expected)
        else:
            with pytest.raises(ValueError, match="unexpected tensor 'model.layers.2.self_attn.z_proj.weight'"):
                load_causal_lm(target)


def _with_extra_layer(folder, target, index: int, extra: tuple[str, ...]):
    """A copy of a saved GLM-4.5 folder whose checkpoint also holds layer ``index``: the last layer's tensors
    under that index, and ``extra`` (names under the layer) as a multi-token-prediction layer adds them."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, target)
    tensors = load_file(str(target / "model.safetensors"))
    last = json.loads((target / "config.json").read_text())["num_hidden_layers"] - 1
    before, after = f"model.layers.{last}.", f"model.layers.{index}."
    tensors.update({after + n[len(before):]: v for n, v in list(tensors.items()) if n.startswith(before)})
    rng = np.random.default_rng(0)
    tensors.update({after + name: rng.standard_normal((4, 4)).astype(np.float32) for name in extra})
    save_file(tensors, str(target / "model.safetensors"))
    return target


MTP_NAMES = ("eh_proj.weight", "embed_tokens.weight", "enorm.weight", "hnorm.weight", "shared_head.head.weight",
             "shared_head.norm.weight")


@pytest.mark.parametrize("name", ["glm4_moe", "glm4_moe_plain"])
def test_glm4_moe_leaves_the_multi_token_prediction_layer_unread(name, hf_root, tmp_path):
    """GLM-4.5 publishes a multi-token-prediction layer after the last one (layers.92 of 92), which transformers
    ignores: the folder loads, with the logits of the folder without it."""
    folder, _ = saved_model(name, hf_root)
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    ids, mask = left_padded_batch(np.random.default_rng(3), (5, 3))
    plain = load_causal_lm(folder)(ids, mask)
    with_mtp = load_causal_lm(_with_extra_layer(folder, tmp_path / "mtp", layers, MTP_NAMES))(ids, mask)
    np.testing.assert_array_equal(with_mtp, plain)


@pytest.mark.parametrize("index, extra", [(4, MTP_NAMES), (3, ("eh_proj.weight", "other.weight"))])
def test_glm4_moe_refuses_tensors_past_the_multi_token_prediction_layer(index, extra, hf_root, tmp_path):
    """Only the one layer after the last, and only its known tensors, are left unread: a second such layer, or an
    unknown tensor in it, is refused by name."""
    folder, _ = saved_model("glm4_moe", hf_root)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.[34]\."):
        load_causal_lm(_with_extra_layer(folder, tmp_path / "extra", index, extra))


# the keys of TII's Falcon-H1-0.5B config.json beyond transformers' (at the tiny model's sizes)
TII_FALCON_H1_KEYS = dict(attn_layer_indices=None, mamba_use_mlp=True, mlp_expansion_factor=8, time_step_min=0.001,
                          time_step_max=0.1, time_step_floor=1e-4)


def test_falcon_h1_reads_tiis_config_keys_and_refuses_attention_on_some_layers_only(hf_root, tmp_path):
    folder, _ = saved_model("falcon_h1", hf_root)
    ids = np.array([[3, 17, 5, 40, 2]])
    ours, plain = load_causal_lm(edit_config(folder, tmp_path / "tii", **TII_FALCON_H1_KEYS)), load_causal_lm(folder)
    assert ours.config == plain.config  # none of them changes the computation
    np.testing.assert_array_equal(ours(ids), plain(ids))
    with pytest.raises(ValueError, match=r"'attn_layer_indices' other than null is not supported"):
        load_causal_lm(edit_config(folder, tmp_path / "some", attn_layer_indices=[1]))
    # key_multiplier is the attention's scale (head_dim ** -0.5 times it): the tiny model's head_dim is 8
    assert ours.config.attention.scale == pytest.approx(0.8 * 8 ** -0.5)


def test_kimi_linear_reads_moonshots_own_config_keys_as_transformers_does():
    """Moonshot's config.json nests the linear attention's shape and 1-based layer lists in ``linear_attn_config``
    and names the experts' settings its own way; transformers' KimiLinearConfig reads them into its flat keys, and
    so does attnkit: the two configs read alike, and a layer number out of range is refused by name."""
    import transformers

    from attnkit.pretrained.families import family

    moonshot = dict(model_type="kimi_linear", vocab_size=100, hidden_size=32, intermediate_size=48, bos_token_id=1,
                    eos_token_id=2, pad_token_id=0,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8,
                    qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, moe_intermediate_size=8,
                    num_experts=4, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=2,
                    linear_attn_config={"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 3,
                                        "kda_layers": [1, 2, 4], "full_attn_layers": [3]})
    flat = json.loads(transformers.KimiLinearConfig(**{k: v for k, v in moonshot.items()
                                                       if k != "model_type"}).to_json_string())
    ours = family("kimi_linear").config_from_hf(moonshot)
    assert ours == family("kimi_linear").config_from_hf(flat)
    assert ours.layer_types == ("kimi_delta_attention", "kimi_delta_attention", "full_attention",
                                "kimi_delta_attention")
    kda = ours.layers[0].part
    assert (type(kda).__name__, kda.num_heads, kda.head_dim, kda.conv_kernel_size) == ("KimiDeltaAttentionConfig",
                                                                                      2, 8, 3)
    assert ours.experts.layers == (2, 3)
    bad = dict(moonshot, linear_attn_config=dict(moonshot["linear_attn_config"], full_attn_layers=[5]))
    with pytest.raises(ValueError, match=r"linear_attn_config\['full_attn_layers'\] must hold layer numbers"):
        family("kimi_linear").config_from_hf(bad)
