"""attnkit's activation cache equals TransformerLens's, hook for hook by name, on every family TransformerLens 4.3
loads (its ``TransformerBridge``, booted offline on the tiny models of ``hf_models``, weights unprocessed), in
float32: every activation within 2e-5 of the larger of 1 and its largest magnitude (float32's rounding over a few
layers), the experts chosen exactly. The name table is ``lens_referee.lens_name``; the families TransformerLens cannot
load are ``lens_referee.NOT_LOADED`` and are checked to fail."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("transformer_lens", reason="TransformerLens is the referee: pip install --no-deps "
                    "transformer-lens==4.3.0 and its imported dependencies (see constraints.txt)")
from attnkit.explain import run_with_cache  # noqa: E402
from attnkit.models.config import STATE_LAYER_TYPES  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import FAMILY_MODELS, saved_model  # noqa: E402
from lens_referee import NOT_LOADED, boot, compare, lens_cache  # noqa: E402

IDS = np.array([[5, 17, 3, 60, 42, 9, 77, 21, 3], [8, 2, 94, 13, 13, 50, 7, 66, 31]])  # (2, 9): 9 tokens, no head count
TOL = 2e-5
# families TransformerLens boots but whose blocks it does not know: it hooks their residual stream only
RESIDUAL_ONLY = ("nemotron_h", "nemotron_h_bias")
LOADED = [name for name in FAMILY_MODELS if name not in NOT_LOADED and name not in RESIDUAL_ONLY]
# attnkit's points TransformerLens's bridge has no hook for, per family: exactly these (one more missing is a
# failure, and so is one fewer: the guide's table would be out of date)
ATTNKIT_ONLY = {
    "gpt_neox": {"attn.hook_rot_q", "attn.hook_rot_k"},
    "phi3": {"attn.hook_rot_q", "attn.hook_rot_k"},
    "phi3_longrope": {"attn.hook_rot_q", "attn.hook_rot_k"},
    "phi3_partial_window": {"attn.hook_rot_q", "attn.hook_rot_k"},
    "gemma4_text": {"attn.hook_rot_q", "attn.hook_rot_k"},
    # DeepSeek-V3's bridge routes through no expert hooks
    "deepseek_v3": {"mlp.hook_expert_indices", "mlp.hook_router_weights"},
    "deepseek_v3_plain": {"mlp.hook_expert_indices", "mlp.hook_router_weights"},
    # the short-convolution and Mamba-2 layers: the bridge hooks neither their insides nor their output
    "lfm2": {"attn.hook_conv_in", "attn.hook_conv_out", "hook_attn_out"},
    "lfm2_bias": {"attn.hook_conv_in", "attn.hook_conv_out", "hook_attn_out"},
    "bamba": {"attn.hook_conv_out", "attn.hook_ssm_out", "hook_attn_out"},
    "bamba_bias": {"attn.hook_conv_out", "attn.hook_ssm_out", "hook_attn_out"},
    # and Granite 4 hybrid's mixture and shared MLP: no hook on the routing, nor on the MLP's sum
    "granitemoehybrid": {"attn.hook_conv_out", "attn.hook_ssm_out", "hook_attn_out", "mlp.hook_expert_indices",
                         "mlp.hook_router_weights", "hook_mlp_out"},
    "falcon_h1": {"attn.hook_conv_out", "attn.hook_ssm_out"},
    "falcon_h1_bias": {"attn.hook_conv_out", "attn.hook_ssm_out"},
    # Llama 4: the bridge hooks neither the rotated queries and keys nor the router
    "llama4_text": {"attn.hook_rot_q", "attn.hook_rot_k", "mlp.hook_expert_indices", "mlp.hook_router_weights"},
}


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_lens")


def local(name: str) -> str:
    """``blocks.3.attn.hook_q`` -> ``attn.hook_q``."""
    return name.split(".", 2)[2] if name.startswith("blocks.") else name


@pytest.mark.parametrize("name", LOADED)
def test_the_cache_equals_transformer_lens_hook_for_hook(name, hf_root):
    bridge, folder = boot(name, hf_root)
    lens = lens_cache(bridge, IDS)
    lm = load_causal_lm(folder)
    logits, cache = run_with_cache(lm, IDS)
    assert cache["hook_embed"].dtype == np.float32
    diffs, absent = compare(lm, cache, lens)
    assert {local(n) for n in absent} == ATTNKIT_ONLY.get(name, set()), absent
    assert len(diffs) >= 8 * lm.config.num_layers // 2, sorted(diffs)  # most points are compared, not skipped
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= TOL, f"{worst}: {diffs[worst]:.2e}"
    np.testing.assert_allclose(logits, lens["logits"], rtol=0, atol=TOL * max(1.0, np.abs(logits).max()))


@pytest.mark.parametrize("name", LOADED[:1] + ["qwen3", "gpt_oss", "deepseek_v3"])
def test_a_wrong_activation_is_seen(name, hf_root):
    """The comparison can fail: one head's output moved by 1e-3 (or another token's experts) is reported."""
    bridge, folder = boot(name, hf_root)
    lens = lens_cache(bridge, IDS)
    lm = load_causal_lm(folder)
    _, cache = run_with_cache(lm, IDS)
    cache.cache_dict["blocks.1.attn.hook_z"][0, 3, 1, 0] += 1e-3
    cache.cache_dict["blocks.0.attn.hook_q"] = cache["blocks.0.attn.hook_q"][:, ::-1].copy()
    diffs, _ = compare(lm, cache, lens)
    assert 5e-4 < diffs["blocks.1.attn.hook_z"] < 2e-3
    assert diffs["blocks.0.attn.hook_q"] > 1e-2
    if "blocks.1.mlp.hook_expert_indices" in diffs:
        cache.cache_dict["blocks.1.mlp.hook_expert_indices"] = cache["blocks.1.mlp.hook_expert_indices"][:, ::-1]
        assert compare(lm, cache, lens)[0]["blocks.1.mlp.hook_expert_indices"] >= 1


@pytest.mark.parametrize("name", sorted(NOT_LOADED))
def test_the_families_transformer_lens_does_not_load(name, hf_root):
    """What attnkit loads and TransformerLens 4.3 does not: the guide's table says so; this test says when that
    changes."""
    with pytest.raises((ValueError, AssertionError, RuntimeError)):  # booting, or the first forward
        lens_cache(boot(name, hf_root)[0], IDS)
    lm = load_causal_lm(saved_model(name, hf_root)[0])
    first = next(i for i, kind in enumerate(lm.config.layer_types) if kind not in STATE_LAYER_TYPES)
    assert run_with_cache(lm, IDS)[1][f"blocks.{first}.attn.hook_pattern"].shape == (2, lm.config.num_heads, 9, 9)


@pytest.mark.parametrize("name", RESIDUAL_ONLY)
def test_the_families_transformer_lens_hooks_only_the_residual_stream_of(name, hf_root):
    """Nemotron-H: TransformerLens 4.3 boots it with no hook inside a block; the residual stream it does hook
    equals attnkit's, and so do the logits (the guide's table says so; this test says when that changes)."""
    bridge, folder = boot(name, hf_root)
    lens = lens_cache(bridge, IDS)
    lm = load_causal_lm(folder)
    logits, cache = run_with_cache(lm, IDS)
    diffs, _ = compare(lm, cache, lens)
    assert {local(n) for n in diffs} == {"hook_embed", "hook_resid_pre", "hook_resid_post", "ln_final.hook_normalized"}
    assert max(diffs.values()) <= TOL
    np.testing.assert_allclose(logits, lens["logits"], rtol=0, atol=TOL * max(1.0, np.abs(logits).max()))
