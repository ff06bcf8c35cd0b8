"""``run_with_cache``'s ActivationCache: TransformerLens's short names, and its residual-stream helpers held to their
sums in float64: ``decompose_resid`` adds up to the stream it decomposes, ``accumulated_resid`` ends at the final
residual, and ``logit_attrs`` adds up to the logit difference with the final norm frozen at the run's scale."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.explain import ActivationCache, run_with_cache  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import saved_model  # noqa: E402

IDS = np.array([[5, 17, 3, 60, 42, 9, 77, 21], [8, 2, 40, 60, 13, 9, 1, 33]])
CORRECT, INCORRECT = np.array([7, 30]), np.array([11, 7])

# RMSNorm; LayerNorm with its shift and learned positions; parallel branches; post-norms, layer scalars, per-layer
# inputs and a soft-capped head; Gated DeltaNet layers; latent attention
FAMILIES = ["llama_gqa", "gpt2", "gpt_neox", "gemma4_text", "qwen3_5_text", "deepseek_v3"]


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_cache")


def cached(name, hf_root):
    lm = load_causal_lm(saved_model(name, hf_root)[0], dtype=np.float64)
    logits, cache = run_with_cache(lm, IDS)
    return lm, logits, cache


def scale_of(values):
    return np.abs(values).max()


@pytest.mark.parametrize("name", FAMILIES)
def test_decompose_resid_sums_to_the_stream_it_decomposes(name, hf_root):
    lm, _, cache = cached(name, hf_root)
    n = lm.config.num_layers
    final = cache[f"blocks.{n - 1}.hook_resid_post"]
    stack, labels = cache.decompose_resid(return_labels=True)  # (C, B, L, D)
    assert stack.shape == (len(labels),) + final.shape
    np.testing.assert_allclose(stack.sum(0), final, rtol=0, atol=1e-12 * scale_of(final))
    assert labels[:2] == (["embed", "pos_embed"] if name == "gpt2" else ["embed", "0_attn_out"])
    for layer in range(n):  # the stream entering each block, and (sequential blocks) each MLP's input
        np.testing.assert_allclose(cache.decompose_resid(layer).sum(0), cache["resid_pre", layer], rtol=0,
                                   atol=1e-12 * scale_of(final))
        if f"blocks.{layer}.hook_resid_mid" in cache:
            np.testing.assert_allclose(cache.decompose_resid(layer, mlp_input=True).sum(0), cache["resid_mid", layer],
                                       rtol=0, atol=1e-12 * scale_of(final))
    attn, mlp = cache.decompose_resid(mode="attn", incl_embeds=False), cache.decompose_resid(mode="mlp")
    assert attn.shape[0] == n and mlp.shape[0] == n + 1 + (name == "gpt2")


@pytest.mark.parametrize("name", FAMILIES)
def test_accumulated_resid_ends_at_the_final_residual(name, hf_root):
    lm, _, cache = cached(name, hf_root)
    n = lm.config.num_layers
    stack, labels = cache.accumulated_resid(return_labels=True)
    assert labels == [f"{i}_pre" for i in range(n)] + ["final_post"]
    np.testing.assert_array_equal(stack[-1], cache[f"blocks.{n - 1}.hook_resid_post"])
    np.testing.assert_array_equal(stack[1], cache["resid_pre", 1])
    # through the final norm with each entry's own statistics (the logit lens): the last is the norm's output
    normed = cache.accumulated_resid(apply_ln=True, pos_slice=-1)  # (N + 1, B, D)
    np.testing.assert_allclose(normed[-1], cache["ln_final.hook_normalized"][:, -1], rtol=0, atol=1e-12)
    mids = cache.accumulated_resid(layer=1, incl_mid=True, return_labels=True)[1]
    assert mids == (["0_pre", "1_pre"] if name == "gpt_neox" else ["0_pre", "0_mid", "1_pre"])


@pytest.mark.parametrize("name", FAMILIES)
def test_logit_attrs_sum_to_the_logit_difference_with_the_final_norm_frozen(name, hf_root):
    lm, logits, cache = cached(name, hf_root)
    stack = cache.decompose_resid(pos_slice=-1)  # (C, B, D): the last position's stream, decomposed
    attrs = cache.logit_attrs(stack, CORRECT, INCORRECT, pos_slice=-1)  # (C, B)
    assert attrs.shape == stack.shape[:2]
    direction = lm.head_weight[CORRECT] - lm.head_weight[INCORRECT]  # (B, D)
    # the final norm's shift (a LayerNorm's beta: GPT-2, GPT-NeoX) belongs to no component; a soft-cap acts after
    beta = lm.norm.beta if "beta" in lm.norm._parameters else np.zeros(lm.config.hidden_size)
    shift = direction @ beta
    rows = np.arange(2)
    want = logits[rows, -1, CORRECT] - logits[rows, -1, INCORRECT]
    cap = lm.config.scales.final_logit_softcap
    if cap is not None:
        uncapped = cap * np.arctanh(logits[:, -1] / cap)  # (B, V)
        want = uncapped[rows, CORRECT] - uncapped[rows, INCORRECT]
        np.testing.assert_allclose(want, (cache["ln_final.hook_normalized"][:, -1] * direction).sum(-1), rtol=1e-10)
    np.testing.assert_allclose(attrs.sum(0), want - shift, rtol=0, atol=1e-10)
    assert np.abs(attrs).min() > 0
    # one token: the logit itself, and the frozen norm is linear, so the parts of a part add up too
    single = cache.logit_attrs(stack, 7, pos_slice=-1)  # (C, B)
    normed = cache.apply_ln_to_stack(stack, pos_slice=-1)
    np.testing.assert_allclose(single, normed @ lm.head_weight[7], rtol=0, atol=1e-12)
    np.testing.assert_allclose(normed.sum(0), cache["ln_final.hook_normalized"][:, -1] - beta, rtol=0, atol=1e-12)
    first = cache.logit_attrs(stack[:, :1], CORRECT[:1], INCORRECT[:1], pos_slice=-1, batch_slice=[0])
    np.testing.assert_allclose(first, attrs[:, :1], rtol=0, atol=1e-13)


def test_every_position_and_transformer_lens_short_names(hf_root):
    lm, logits, cache = cached("llama_gqa", hf_root)
    assert isinstance(cache, ActivationCache) and len(cache) == len(dict(cache.items()))
    assert cache["resid_pre", 1] is cache["blocks.1.hook_resid_pre"]
    assert cache["z", -1] is cache["blocks.1.attn.hook_z"] and cache["k1"] is cache["blocks.1.attn.hook_k"]
    assert cache["embed"] is cache["hook_embed"] and cache["attn", 0] is cache["blocks.0.attn.hook_pattern"]
    with pytest.raises(KeyError, match=r"\('resid_pre', 7\) \(blocks.7.hook_resid_pre\) is not in this cache"):
        cache["resid_pre", 7]
    stack = cache.decompose_resid()  # (C, B, L, D): every position, one token per row and position
    tokens = (IDS * 7 + 3) % lm.config.vocab_size  # (B, L)
    attrs = cache.logit_attrs(stack, tokens)  # (C, B, L)
    want = np.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]  # (B, L)
    np.testing.assert_allclose(attrs.sum(0), want, rtol=0, atol=1e-10)


def test_a_cache_without_the_points_needed_says_so(hf_root):
    lm = load_causal_lm(saved_model("llama_gqa", hf_root)[0], dtype=np.float64)
    _, cache = run_with_cache(lm, IDS, names=lambda name: name.endswith("hook_attn_out"))
    with pytest.raises(KeyError, match=r"hook_embed.*is not in this cache.*run_with_cache keeps every point with "
                                       r"names=None"):
        cache.decompose_resid()
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\]"):
        cache.accumulated_resid(layer=3)
    with pytest.raises(ValueError, match="mode must be 'all', 'attn' or 'mlp'"):
        cache.decompose_resid(mode="heads")
