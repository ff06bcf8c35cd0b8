"""DeepSeek-V3 and V3.2 as whole models (latent attention, sparse in V3.2, + group-routed shared experts): every
parameter's gradient by float64 finite differences and against transformers' autograd, the absorbed (cached)
decoding equal to the explicit forward, the latent cache's size, attention weights against transformers' eager
attention, and the hook points. Logits, greedy, beam, cached and padded-row parity are in test_causal_lm.py
(FAMILY_MODELS)."""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek  # noqa: E402

from attnkit.attention.latent import LatentAttentionConfig  # noqa: E402
from attnkit.explain import hooks  # noqa: E402
from attnkit.models import AttentionConfig, CausalLM, DecoderConfig, ExpertsConfig, MLPConfig, RotaryConfig  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from attnkit.pretrained.checkpoint import HEAD_NAMES, checkpoint_map  # noqa: E402
from hf_models import left_padded_batch, positions_from_mask, saved_model  # noqa: E402

from helpers import assert_gradient, make_rng, randn  # noqa: E402

SPECS = ("deepseek_v3", "deepseek_v3_plain", "deepseek_v32", "deepseek_v32_mixed")


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_deepseek")


def _tiny(q_lora: bool) -> DecoderConfig:
    latent = LatentAttentionConfig(hidden_size=8, num_heads=2, kv_lora_rank=5, qk_nope_head_dim=3, qk_rope_head_dim=2,
                                   v_head_dim=3, q_lora_rank=4 if q_lora else None, attention_bias=not q_lora,
                                   rope_interleaved=q_lora, attention_scale=0.4 if q_lora else None)
    experts = ExpertsConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=3,
                            layers=(1,) if q_lora else (0, 1), router="sigmoid_group_topk", n_group=2,
                            topk_group=1 if q_lora else 2, norm_topk_prob=q_lora, routed_scaling_factor=2.5,
                            shared_expert_intermediate_size=3 if q_lora else 6)
    return DecoderConfig(family="deepseek_v3", vocab_size=7, hidden_size=8, num_layers=2, num_heads=2,
                         num_kv_heads=2, head_dim=2, mlp=MLPConfig(6),
                         rotary=RotaryConfig(theta=100.0, interleaved=q_lora), mixer_parts=(latent,),
                         experts=experts)


def _tiny_sparse() -> DecoderConfig:
    """DeepSeek-V3.2: the q_lora model with an indexer keeping 2 keys per query."""
    cfg = _tiny(True)
    return dataclasses.replace(cfg, family="deepseek_v32", mixer_parts=(dataclasses.replace(
        cfg.mixer_part(LatentAttentionConfig), index_topk=2, index_n_heads=4, index_head_dim=3),))


@pytest.mark.parametrize("q_lora", [True, False, "sparse"])
def test_whole_model_gradients_by_finite_differences(q_lora):
    rng = make_rng(41, 2 if q_lora == "sparse" else q_lora)
    lm = CausalLM(_tiny_sparse() if q_lora == "sparse" else _tiny(q_lora), rng=rng).astype(np.float64)
    for name, p in lm.named_parameters():  # larger weights than the init, so that every path matters
        p[...] = (1.0 + 0.3 * rng.standard_normal(p.shape)) if name.endswith(("gamma", "norm")) else \
            0.4 * rng.standard_normal(p.shape)
    ids, mask = left_padded_batch(rng, (5, 3))
    ids = ids % 7
    g = randn(rng, 2, 5, 7)

    def loss():
        return np.sum(lm(ids, mask) * g)

    lm.zero_grad()
    loss()
    lm.backward(g)
    grads = dict(lm.named_gradients())
    routed = [name for name in grads if name.endswith("W_router")]
    assert routed and all(np.abs(grads[name]).max() > 1e-3 for name in routed)  # the router does get a gradient
    for name, p in lm.named_parameters():
        if ".indexer." in name:  # it only chooses the keys (held by the probes' small steps): no gradient
            assert not grads[name].any(), name
        else:
            assert_gradient(loss, p, grads[name], name)


class _Float64Router:
    """transformers' module namespace with ``torch.float32`` read as float64 (its router computes in float32
    whatever the model's dtype), so that a float64 comparison is not bounded by float32 routing."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


def _hf_gradients(hf) -> dict[str, np.ndarray]:
    """transformers' parameter gradients under their checkpoint names: the stacked experts of memory split into
    the per-expert tensors of disk."""
    grads = {}
    for name, p in hf.named_parameters():
        if p.grad is None:  # DeepSeek-V3.2's indexer: it only chooses, under no_grad
            continue
        grad = p.grad.double().numpy()
        if name.endswith("experts.gate_up_proj"):
            f = grad.shape[1] // 2
            for j in range(grad.shape[0]):
                grads[name.replace("gate_up_proj", f"{j}.gate_proj.weight")] = grad[j, :f]
                grads[name.replace("gate_up_proj", f"{j}.up_proj.weight")] = grad[j, f:]
        elif name.endswith("experts.down_proj"):
            for j in range(grad.shape[0]):
                grads[name.replace("down_proj", f"{j}.down_proj.weight")] = grad[j]
        else:
            grads[name] = grad
    return grads


@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-4), (np.float64, 2e-6)])
@pytest.mark.parametrize("name", SPECS)
def test_gradients_match_transformers_autograd(name, dtype, tol, hf_root, monkeypatch):
    """Every parameter's gradient against torch autograd through the transformers model, each HF gradient
    brought to attnkit's layout by the loader's own tensor map. float64 is bounded by transformers' rotary
    tables, which it computes in float32 for every dtype (its router is made float64 here)."""
    folder, hf = saved_model(name, hf_root)
    lm = load_causal_lm(folder, dtype=dtype)
    ids, mask = left_padded_batch(np.random.default_rng(5), (6, 3))
    g = np.random.default_rng(6).standard_normal((2, 6, lm.config.vocab_size)).astype(dtype)
    g[~mask] = 0
    lm.zero_grad()
    lm(ids, mask)
    lm.backward(g)
    if dtype == np.float64:
        monkeypatch.setattr(hf_deepseek, "torch", _Float64Router())
        monkeypatch.setattr(sys.modules[type(hf).__module__], "torch", _Float64Router())
        hf.double().set_attn_implementation("sdpa")  # eager softmax of a fully masked row is NaN in float64
    try:
        hf.zero_grad()
        out = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                 position_ids=torch.from_numpy(positions_from_mask(mask)))
        (out.logits * torch.from_numpy(g)).sum().backward()
        theirs = _hf_gradients(hf)
    finally:
        hf.float().set_attn_implementation("eager")
    maps, prefix = checkpoint_map(lm.config)
    ours = dict(lm.named_gradients())
    checked = set()
    for m in maps:
        hf_name = "lm_head.weight" if m.source in HEAD_NAMES else prefix + m.source
        if hf_name not in theirs:  # a tied head is the embedding's parameter; the correction bias is a buffer
            continue
        for target, expected in m.convert(theirs[hf_name]).items():
            mine = m.destination(ours, target)
            err = np.max(np.abs(mine - expected)) / max(np.max(np.abs(expected)), 1e-30)
            assert err <= tol, (target, m.stack_index, err)
            checked.add(target)
    # the routing correction and the sparse attention's indexer only choose: a zero gradient
    choosers = {n for n in ours if n.endswith("e_score_correction_bias") or ".indexer." in n}
    assert checked | choosers == set(ours)
    assert choosers and not any(ours[n].any() for n in choosers)


@pytest.mark.parametrize("name", SPECS)
def test_absorbed_decoding_equals_the_explicit_forward(name, hf_root):
    """The cached path attends in the latent space (absorbed form); token by token, on a left-padded batch, its
    logits equal the uncached explicit forward's to float64 round-off."""
    lm = load_causal_lm(saved_model(name, hf_root)[0], dtype=np.float64)
    ids, mask = left_padded_batch(np.random.default_rng(7), (7, 4))
    full = lm(ids, mask)
    cache = lm.new_cache(2)
    assert set(cache.kinds) == {"latent"}  # each layer's entry its latents
    steps = [lm(ids[:, :3], mask[:, :3], cache=cache)]
    for t in range(3, 7):
        steps.append(lm(ids[:, t:t + 1], mask[:, :t + 1], cache=cache))
    cached = np.concatenate(steps, axis=1)
    err = np.max(np.abs(cached - full)[mask]) / np.max(np.abs(full[mask]))
    assert err < 1e-12, err


def test_the_cache_holds_the_latent_and_the_rotary_key_only(hf_root):
    lm = load_causal_lm(saved_model("deepseek_v3", hf_root)[0])
    latent = lm.config.mixer_part(LatentAttentionConfig)
    cache = lm.new_cache(3, max_length=8)
    lm(np.ones((3, 8), dtype=np.int64), cache=cache)
    per_token_layer = cache.nbytes // (3 * 8 * lm.config.num_layers)
    assert per_token_layer == (latent.kv_lora_rank + latent.qk_rope_head_dim) * 4  # float32: (10 + 4) * 4
    # the keys and values the explicit form attends to would be H * (Dn + R + Dv) numbers per token
    assert latent.num_heads * (latent.qk_head_dim + latent.v_head_dim) == 60 > 14
    with pytest.raises(TypeError, match="its layer 0 holds keys_values, the model's layer keeps latent"):
        from attnkit.decoding.cache import KVCache
        lm(np.ones((1, 2), dtype=np.int64), cache=KVCache(3, 1, 4, 4))


@pytest.mark.parametrize("name", SPECS)
def test_attention_weights_equal_transformers_eager_attention(name, hf_root):
    folder, hf = saved_model(name, hf_root)
    lm = load_causal_lm(folder)
    ids, mask = left_padded_batch(np.random.default_rng(8), (6, 4))
    _, weights = lm(ids, mask, output_attentions=True)
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                 position_ids=torch.from_numpy(positions_from_mask(mask)), output_attentions=True)
    assert len(weights) == len(out.attentions) == lm.config.num_layers
    for ours, theirs in zip(weights, out.attentions):
        theirs = theirs.numpy()
        assert ours.shape == theirs.shape == (2, 4, 6, 6)
        real = mask[:, None, :, None] & mask[:, None, None, :]  # rows of real queries, over real keys
        np.testing.assert_allclose(np.where(real, ours, 0), np.where(real, theirs, 0), atol=2e-6)


def test_hook_points_see_the_heads_and_the_pattern(hf_root):
    lm = load_causal_lm(saved_model("deepseek_v3", hf_root)[0])
    names = [full for full, _, _ in lm.named_hook_points()]
    for point in ("hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z"):
        assert f"blocks.1.attn.{point}" in names
    ids = np.array([[3, 9, 4, 17, 5]])
    seen = {}
    with hooks(lm, {"blocks.1.attn.hook_pattern": lambda v, n: seen.setdefault("pattern", v.copy()),
                    "blocks.1.attn.hook_k": lambda v, n: seen.setdefault("k", v.copy())}):
        logits = lm(ids)
    latent = lm.config.layers[1].part
    assert seen["k"].shape == (1, 5, 4, latent.qk_head_dim)
    np.testing.assert_allclose(seen["pattern"], lm.attention_weights(ids, layers=[1])[0], atol=1e-7)
    # a reading hook changes nothing but the kernel (a hooked pattern is computed by the reference kernel)
    np.testing.assert_allclose(logits, lm(ids), atol=2e-6)
    with hooks(lm, {"blocks.1.attn.hook_z": lambda v, n: np.zeros_like(v)}):
        ablated = lm(ids)
    assert np.abs(ablated - logits).max() > 1e-3


@pytest.mark.parametrize("name", SPECS)
def test_saving_gives_back_the_checkpoint_tensor_for_tensor(name, hf_root):
    """checkpoint_tensors (the trainer's save) is the loader's inverse: each expert's matrix leaves its (E, ...)
    stack as the one tensor per expert it came from, bit for bit."""
    from safetensors.numpy import load_file

    from attnkit.pretrained.checkpoint import checkpoint_tensors

    folder = saved_model(name, hf_root)[0]
    lm = load_causal_lm(folder)
    on_disk = {}
    for file in folder.glob("*.safetensors"):
        on_disk.update(load_file(file))
    saved = checkpoint_tensors(lm.config, dict(lm.named_parameters()))
    assert any(".experts.3.down_proj" in key for key in saved)
    assert set(saved) == set(on_disk) - ({"lm_head.weight"} if lm.config.tie_word_embeddings else set())
    for key, value in saved.items():
        np.testing.assert_array_equal(value, on_disk[key], err_msg=key)


def test_the_block_is_built_from_the_parts():
    """The latent part picks the token mixer and the experts part the routed layers' MLP, when built."""
    from attnkit.attention.latent import MultiHeadLatentAttention
    from attnkit.layers.experts import MixtureOfExperts
    from attnkit.layers.gated_mlp import GatedMLP

    lm = CausalLM(_tiny(True), rng=0)
    assert [type(layer.attention) for layer in lm.layers] == [MultiHeadLatentAttention] * 2
    assert [type(layer.mlp) for layer in lm.layers] == [GatedMLP, MixtureOfExperts]  # experts.layers=(1,)
    assert [layer.attention.layer_index for layer in lm.layers] == [0, 1]


@pytest.mark.parametrize("change, match", [
    (dict(rotary=None), "needs a rotary part"),
    (dict(rotary=RotaryConfig(theta=100.0, interleaved=False)), "rope_interleaved as interleaved"),
    (dict(rotary=RotaryConfig(theta=100.0, interleaved=True, partial_factor=0.5)), "partial_factor 1"),
    (dict(head_dim=4), "head_dim = qk_rope_head_dim"),
    (dict(attention=AttentionConfig(bias=True)), "no setting of the attention part"),
    (dict(num_heads=1, num_kv_heads=1), "the LatentAttentionConfig in mixer_parts describes hidden_size 8 and 2 heads"),
    (dict(mlp=MLPConfig(6, kind="plain")), "the other layers' mlp.kind 'gated'"),
])
def test_the_parts_must_fit_the_model(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(_tiny(True), **change)


@pytest.mark.parametrize("name, value, match", [
    ("mixer_parts", ({"kv_lora_rank": 5},), "mixer_parts must hold parts of the classes .*LatentAttentionConfig.*, "
                                            "got dict"),
    ("experts", 3, "experts must be a ExpertsConfig or None, got int")])
def test_a_part_must_be_its_dataclass(name, value, match):
    with pytest.raises(TypeError, match=match):
        dataclasses.replace(_tiny(True), **{name: value})


def test_the_parts_survive_to_dict():
    cfg = _tiny(False)
    assert DecoderConfig.from_dict(cfg.to_dict()) == cfg


def test_deepseek_v32_caches_the_indexers_keys_beside_the_latent(hf_root):
    """Cached decoding selects over the cached index keys: the cache holds C + R + Di numbers per token and layer."""
    lm = load_causal_lm(saved_model("deepseek_v32", hf_root)[0])
    latent = lm.config.mixer_part(LatentAttentionConfig)
    cache = lm.new_cache(3, max_length=8)
    lm(np.ones((3, 8), dtype=np.int64), cache=cache)
    per_token_layer = cache.nbytes // (3 * 8 * lm.config.num_layers)
    assert per_token_layer == (latent.kv_lora_rank + latent.qk_rope_head_dim + latent.index_head_dim) * 4
    assert DecoderConfig.from_dict(lm.config.to_dict()) == lm.config and latent.index_topk == 4


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["full_attention"] * 3), "'layer_types' must be 3 x 'indexed_attention'"),
    (dict(mlp_layer_types=["dense", "moe", "sparse"]), "'mlp_layer_types' must list 3 of"),
    (dict(q_lora_rank=None), "'q_lora_rank' must be a positive integer"),
    (dict(mlp_bias=True), "'mlp_bias' must be false"),
    (dict(index_head_dim=2), "index_head_dim \\(2\\) must be at least qk_rope_head_dim \\(4\\)"),
    (dict(index_topk=0), "'index_topk' must be a positive integer"),
])
def test_deepseek_v32_config_errors_name_the_key(change, match, hf_root, tmp_path):
    from hf_models import edit_config

    with pytest.raises(ValueError, match=match):
        load_causal_lm(edit_config(saved_model("deepseek_v32", hf_root)[0], tmp_path / "edited", **change))
