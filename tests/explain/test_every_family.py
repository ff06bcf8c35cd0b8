"""Every explanation runs on every family of the tiny-model registry (``hf_models.FAMILY_MODELS``): direct logit
attribution sums to the logit, activation and path patching give the numbers the definitions give, edge
attribution's identities hold (or a block that is not a plain residual sum is refused), and ``attnkit explain``
writes its page, on grouped-query, latent (DeepSeek-V3), hybrid Gated DeltaNet (Qwen3.5,
Qwen3-Next) and shared-KV (Gemma 4) models alike."""
from __future__ import annotations

import contextlib
import io
import json
import re

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.cli import main  # noqa: E402
from attnkit.explain import (  # noqa: E402
    SAE,
    activation_patching,
    direct_logit_attribution,
    edge_attribution,
    feature_attribution,
    hook_names,
    hooks,
    path_patching,
    run_with_cache_with_saes,
    saes,
)
from attnkit.models.config import PAIRED_LAYER_TYPES, STATE_LAYER_TYPES  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import FAMILY_MODELS, saved_model  # noqa: E402

CLEAN = np.array([5, 17, 3, 60, 42, 9, 77, 21])
CORRUPT = np.array([5, 17, 8, 60, 42, 30, 77, 21])  # differs at positions 2 and 5
ANSWERS = (11, 40)


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_every_family")


def shares_total(parts):
    return parts["embed"] + parts["pos_embed"] + parts["heads"].sum(axis=(-2, -1)) + parts["linear_attn"].sum(-1) + \
        parts["mlp"].sum(-1) + parts["per_layer"].sum(-1) + parts["bias"]


def logit_difference(lm, ids):
    logits = lm(np.asarray(ids)[None])[0, -1]
    return logits[ANSWERS[0]] - logits[ANSWERS[1]]


def with_heads(lm):
    """The layers that have attention heads (``hook_z``)."""
    names = set(hook_names(lm))
    return [i for i in range(lm.config.num_layers) if f"blocks.{i}.attn.hook_z" in names]


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_direct_logit_attribution_sums_to_the_logit(name, hf_root):
    lm = load_causal_lm(saved_model(name, hf_root)[0], dtype=np.float64)
    parts = direct_logit_attribution(lm, CLEAN, target=7, target_position=5)
    np.testing.assert_allclose(parts["logit"], lm(CLEAN[None])[0, 5, 7], rtol=1e-12, atol=1e-14)
    assert abs(shares_total(parts) - parts["logit"]) < 1e-10
    heads = with_heads(lm)
    mlp_alone = [i for i, kind in enumerate(lm.config.layer_types) if kind == "mlp"]  # no token mixer at all
    headless = sorted(set(range(lm.config.num_layers)) - set(heads) - set(mlp_alone))
    # every head of a layer with heads writes something; a layer without heads is one share, never zero, and so
    # is the state-space half beside the heads of a paired layer (Falcon-H1's)
    paired = [i for i, kind in enumerate(lm.config.layer_types) if kind in PAIRED_LAYER_TYPES]
    attention_only = sorted(set(heads) - set(paired))
    assert np.abs(parts["heads"][heads]).min() > 0 and not parts["heads"][headless].any()
    assert np.abs(parts["linear_attn"][headless + paired]).min(initial=1.0) > 0
    assert not parts["linear_attn"][attention_only].any()
    assert headless == [i for i, kind in enumerate(lm.config.layer_types) if kind in STATE_LAYER_TYPES]
    assert not parts["linear_attn"][mlp_alone].any() and not parts["heads"][mlp_alone].any()


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_activation_patching_gives_the_corrupted_metric_where_nothing_differs(name, hf_root):
    """Block 0's input at a position where the prompts agree is the same in both runs: patching it there gives the
    corrupted metric, and where they differ it moves it; a head's patch exists exactly where the layer has heads."""
    lm = load_causal_lm(saved_model(name, hf_root)[0], dtype=np.float64)
    corrupt_metric = logit_difference(lm, CORRUPT)
    resid = activation_patching(lm, CLEAN, CORRUPT, ANSWERS, hook="resid_pre")  # (N, L)
    np.testing.assert_allclose(resid[0, [0, 1, 3, 4, 6, 7]], corrupt_metric, rtol=0, atol=1e-10)
    assert np.abs(resid[0, [2, 5]] - corrupt_metric).max() > 1e-6
    z = activation_patching(lm, CLEAN, CORRUPT, ANSWERS, hook="z")  # (N, H)
    heads = with_heads(lm)
    assert not np.isnan(z[heads]).any()
    assert np.isnan(np.delete(z, heads, axis=0)).all()


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_path_patching_runs_over_the_heads_that_exist(name, hf_root):
    """Senders are the heads of the layers that have them, into the last attention layer's queries: with nothing to
    carry (clean = corrupt) every path gives the corrupted metric, and with a difference some path moves it."""
    lm = load_causal_lm(saved_model(name, hf_root)[0], dtype=np.float64)
    heads = with_heads(lm)
    receivers = [(heads[-1], 0), (heads[-1], lm.config.num_heads - 1)]
    found = path_patching(lm, CLEAN, CORRUPT, ANSWERS, receivers)  # (N, H)
    senders = [i for i in heads if i < heads[-1]]
    assert not np.isnan(found[senders]).any() and np.isnan(np.delete(found, senders, axis=0)).all()
    if not senders:  # a Gated DeltaNet layer, then the only attention layer: no head sends
        return
    assert np.nanmax(np.abs(found - logit_difference(lm, CORRUPT))) > 1e-9
    same = path_patching(lm, CORRUPT, CORRUPT, ANSWERS, receivers)
    np.testing.assert_allclose(same[senders], logit_difference(lm, CORRUPT), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_edge_attribution_identities_hold(name, hf_root):
    """The scores into and out of every node sum to its attribution at float64 rounding, for EAP and EAP-IG;
    Gemma 4's layers (a layer scalar, per-layer inputs) and Nemotron-H's one-branch blocks are refused naming the
    block, Falcon-H1's attention beside Mamba-2 naming the mixer."""
    lm = load_causal_lm(saved_model(name, hf_root)[0], dtype=np.float64)
    if lm.config.layerwise is not None or lm.config.residual == "single":
        with pytest.raises(ValueError, match="layer 0 is a .*Block, which scales or adds to it otherwise"):
            edge_attribution(lm, CLEAN, CORRUPT, ANSWERS)
        return
    if set(lm.config.layer_types) & set(PAIRED_LAYER_TYPES):
        with pytest.raises(ValueError, match="layer 0's AttentionMamba2Mixer writes heads and a second mixer"):
            edge_attribution(lm, CLEAN, CORRUPT, ANSWERS)
        return
    for method in ("eap", "eap-ig"):
        found = edge_attribution(lm, CLEAN, CORRUPT, ANSWERS, method=method, steps=2)
        assert found.residuals["incoming"] < 1e-10 and found.residuals["outgoing"] < 1e-10
        assert np.abs(found.node_inputs).max() > 1e-6
        heads = [node for node in found.upstream if ".h" in node]
        assert len(heads) == len(with_heads(lm)) * lm.config.num_heads


def _embedded(page) -> dict:
    text = page.read_text(encoding="utf-8")
    return json.loads(re.search(r'id="attnkit-data" type="application/json">(.*?)</script>', text,
                                flags=re.DOTALL).group(1))


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_the_explain_command_writes_its_page(name, hf_root, tmp_path):
    folder, _ = saved_model(name, hf_root)
    page = tmp_path / f"{name}.html"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["explain", str(folder), "--ids", ",".join(map(str, CLEAN)), "--corrupt-ids",
                     ",".join(map(str, CORRUPT)), "--html", str(page), "--candidates", "2"])
    assert code == 0 and f"wrote {page}" in printed.getvalue()
    data = _embedded(page)
    lm = load_causal_lm(folder)
    linear = [i for i, kind in enumerate(lm.config.layer_types) if kind in STATE_LAYER_TYPES]
    paired = any(kind in PAIRED_LAYER_TYPES for kind in lm.config.layer_types)  # attention beside a state space
    assert data["linear_layers"] == linear and (data["rollout"] is None) == (bool(linear) or paired)
    for candidate in data["candidates"]:
        parts = direct_logit_attribution(lm, CLEAN, candidate["id"])
        np.testing.assert_allclose(candidate["dla"]["heads"], parts["heads"], atol=1e-6)
        np.testing.assert_allclose(candidate["dla"]["linear_attn"], parts["linear_attn"], atol=1e-6)
    patched = np.array(data["patching"]["z"], dtype=np.float64)  # None (no heads) reads as NaN
    headless = sorted(set(range(lm.config.num_layers)) - set(data["attention_layers"]))  # state layers, MLPs alone
    assert np.isnan(patched[headless]).all() and not np.isnan(np.delete(patched, headless, axis=0)).any()


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_a_spliced_sae_keeps_the_logits_and_its_gradients_are_exact(name, hf_root):
    """An SAE on block 0's output: with the error term the logits are the model's; without it, a feature's gradient
    and the gradient reaching block 0's input through the SAE's encoder equal central differences (float64)."""
    lm = load_causal_lm(saved_model(name, hf_root)[0], dtype=np.float64)
    d = lm.config.hidden_size
    rng = np.random.default_rng(0)
    sae = SAE(rng.normal(size=(d, 24)) * 0.3, rng.normal(size=24) * 0.1, rng.normal(size=(24, d)) * 0.3,
              rng.normal(size=d) * 0.1, hook_name="blocks.0.hook_resid_post")
    ids = CLEAN[None]
    logits, _ = run_with_cache_with_saes(lm, ids, [sae], use_error_term=True, names=[])
    np.testing.assert_allclose(logits, lm(ids), rtol=0, atol=1e-10 * max(1.0, np.abs(logits).max()))
    result = feature_attribution(lm, ids, [sae], target_token=7, target_position=5, use_error_term=False)
    _, pos, f = np.argwhere(result.activations["blocks.0.hook_resid_post"][:, :6] > 0)[-1]

    def nudged(delta, point, edit):
        with saes(lm, [sae], forward={point: edit(delta)}):
            return lm(ids)[0, 5, 7]

    def feature(delta):
        def edit(value, _):
            value = value.copy()
            value[0, pos, f] += delta
            return value
        return edit

    fd = (nudged(1e-6, "blocks.0.hook_resid_post.hook_sae_acts_post", feature) -
          nudged(-1e-6, "blocks.0.hook_resid_post.hook_sae_acts_post", feature)) / 2e-6
    np.testing.assert_allclose(result.gradients["blocks.0.hook_resid_post"][0, pos, f], fd, rtol=1e-6, atol=1e-9)
    direction = rng.normal(size=(1, len(CLEAN), d))
    found = {}
    with saes(lm, [sae]), hooks(lm, backward={"blocks.0.hook_resid_pre": lambda g, n: found.update(g=np.array(g))}):
        lm(ids)
        grad_logits = np.zeros(logits.shape)
        grad_logits[0, 5, 7] = 1.0
        with lm.input_gradients_only():
            lm.backward(grad_logits)
    # a small step: a pre-activation 1.2e-6 from ReLU's kink (Qwen3.5) is crossed by a step of 1e-6 along direction
    fd = (nudged(1e-8, "blocks.0.hook_resid_pre", lambda e: lambda v, n: v + e * direction) -
          nudged(-1e-8, "blocks.0.hook_resid_pre", lambda e: lambda v, n: v + e * direction)) / 2e-8
    assert abs(fd) > 1e-6
    np.testing.assert_allclose((found["g"] * direction).sum(), fd, rtol=1e-6, atol=1e-8)
