"""Layers of different kinds have different hook points, and the model says which: a Gated DeltaNet layer has no
attention points, a layer that reuses an earlier layer's keys and values no ``hook_k`` / ``hook_v``. A point a layer
does not have is refused saying what the layer is and which points it has (not as a misspelling, not as a bare
KeyError), and path patching runs over the points that exist, equal to its definition written out one sender at a
time."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.explain import hook_names, hooks, path_patching, run_with_cache  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import saved_model  # noqa: E402

CLEAN = np.array([5, 17, 3, 60, 42, 9, 77, 21])
CORRUPT = np.array([5, 17, 8, 60, 42, 30, 77, 21])
ANSWERS = (11, 40)
BLOCK = ["hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"]


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_layer_points")


def model(name, hf_root):
    return load_causal_lm(saved_model(name, hf_root)[0], dtype=np.float64)


def test_a_gated_deltanet_layer_says_it_has_no_attention_points(hf_root):
    lm = model("qwen3_5_text", hf_root)
    assert lm.layer_kind(0) == "a linear_attention (Gated DeltaNet) layer"
    assert lm.layer_kind(1) == "a gated_attention layer"
    assert lm.layer_hook_points(0) == [f"blocks.0.{p}" for p in BLOCK]
    assert "blocks.1.attn.hook_pattern" in lm.layer_hook_points(1)
    every = [name for name in hook_names(lm) if name.startswith("blocks.")]
    assert sum((lm.layer_hook_points(i) for i in range(4)), []) == every
    said = (r"forward: 'blocks.0.attn.hook_pattern': layer 0 is a linear_attention \(Gated DeltaNet\) layer: it has "
            r"points hook_resid_pre, hook_attn_out, hook_resid_mid, hook_mlp_out, hook_resid_post, not "
            r"attn.hook_pattern \(the layers with attn.hook_pattern: 1, 3\)")
    with pytest.raises(ValueError, match=said):
        with hooks(lm, {"blocks.0.attn.hook_pattern": lambda x, name: None}):
            pass
    with pytest.raises(ValueError, match=r"names: 'blocks.2.attn.hook_z': layer 2 is a linear_attention"):
        run_with_cache(lm, CLEAN, names=["blocks.2.attn.hook_z"])
    # a misspelling is still one, with the nearest names
    with pytest.raises(ValueError, match=r"no hook point 'blocks.1.attn.hook_patern'; did you mean "
                                         r"blocks.1.attn.hook_pattern"):
        run_with_cache(lm, CLEAN, names=["blocks.1.attn.hook_patern"])
    with pytest.raises(ValueError, match=r"index must be a layer index in \[0, 4\), got 4"):
        lm.layer_hook_points(4)


def test_a_short_convolution_layer_has_its_own_points_and_no_attention_ones(hf_root):
    lm = model("lfm2", hf_root)
    assert lm.layer_kind(0) == "a short_conv (gated short convolution) layer"
    assert lm.layer_hook_points(0) == ["blocks.0.hook_resid_pre", "blocks.0.attn.hook_conv_in",
                                       "blocks.0.attn.hook_conv_out", *(f"blocks.0.{p}" for p in BLOCK[1:])]
    logits, cache = run_with_cache(lm, CLEAN, names=["blocks.2.attn.hook_conv_in", "blocks.2.attn.hook_conv_out"])
    assert cache["blocks.2.attn.hook_conv_in"].shape == (1, len(CLEAN), lm.config.hidden_size)
    # a zero convolution output makes the (bias-free) layer add nothing: the model with that branch cut
    with hooks(lm, {"blocks.2.attn.hook_conv_out": lambda value, name: np.zeros_like(value)}):
        cut, cut_cache = run_with_cache(lm, CLEAN, names=["blocks.2.hook_attn_out"])
    assert not cut_cache["blocks.2.hook_attn_out"].any() and not np.allclose(cut, logits)
    with pytest.raises(ValueError, match=r"'blocks.0.attn.hook_q': layer 0 is a short_conv \(gated short "
                                         r"convolution\) layer: it has points .*attn.hook_conv_in"):
        run_with_cache(lm, CLEAN, names=["blocks.0.attn.hook_q"])


def test_a_mamba2_layer_has_its_own_points_and_no_attention_ones(hf_root):
    lm = model("bamba", hf_root)
    assert lm.layer_kind(2) == "a mamba2 (Mamba-2 state space) layer"
    assert lm.layer_hook_points(2)[1:3] == ["blocks.2.attn.hook_conv_out", "blocks.2.attn.hook_ssm_out"]
    _, cache = run_with_cache(lm, CLEAN, names=["blocks.0.attn.hook_ssm_out"])
    shape = lm.config.layers[0].part
    assert cache["blocks.0.attn.hook_ssm_out"].shape == (1, len(CLEAN), shape.num_heads, shape.head_dim)
    with pytest.raises(ValueError, match=r"'blocks.0.attn.hook_z': layer 0 is a mamba2 \(Mamba-2 state space\) "
                                         r"layer: it has points .*attn.hook_ssm_out"):
        run_with_cache(lm, CLEAN, names=["blocks.0.attn.hook_z"])


def test_an_attention_beside_mamba2_layer_has_both_mixers_points(hf_root):
    """Falcon-H1's layer: the attention's points then the Mamba-2 half's, under ``attn.``; cutting the Mamba-2
    half's scan output changes the model, and hook_attn_out is both halves' sum."""
    lm = model("falcon_h1", hf_root)
    assert lm.layer_kind(1) == "an attention_mamba2 layer (attention beside a Mamba-2 mixer)"
    points = lm.layer_hook_points(1)
    assert points.index("blocks.1.attn.hook_z") < points.index("blocks.1.attn.hook_conv_out") < \
        points.index("blocks.1.attn.hook_ssm_out") < points.index("blocks.1.hook_attn_out")
    names = ["blocks.1.attn.hook_ssm_out", "blocks.1.attn.hook_z"]
    logits, cache = run_with_cache(lm, CLEAN, names=names)
    shape = lm.config.layers[1].part.mamba2
    assert cache["blocks.1.attn.hook_ssm_out"].shape == (1, len(CLEAN), shape.num_heads, shape.head_dim)
    assert cache["blocks.1.attn.hook_z"].shape == (1, len(CLEAN), lm.config.num_heads, lm.config.head_dim)
    with hooks(lm, {"blocks.1.attn.hook_ssm_out": lambda value, name: np.zeros_like(value)}):
        cut = lm(np.asarray(CLEAN)[None])
    assert not np.allclose(cut, logits)


def test_a_layer_reusing_keys_and_values_says_it_has_none_of_its_own(hf_root):
    lm = model("gemma4_text", hf_root)  # layers 3 and 4 reuse layers 2's and 1's keys and values
    assert lm.layer_kind(3) == "a sliding_attention layer that reuses layer 2's keys and values"
    assert lm.layer_kind(4) == "a full_attention layer that reuses layer 1's keys and values"
    assert "blocks.4.attn.hook_k" not in lm.layer_hook_points(4) and "blocks.4.attn.hook_q" in lm.layer_hook_points(4)
    with pytest.raises(ValueError, match=r"'blocks.4.attn.hook_v': layer 4 is a full_attention layer that reuses "
                                         r"layer 1's keys and values: it has points .*hook_q.*, not attn.hook_v"):
        run_with_cache(lm, CLEAN, names=["blocks.4.attn.hook_v"])
    with pytest.raises(ValueError, match=r"receivers \(4, 0\): 'blocks.4.attn.hook_k': layer 4 is a full_attention "
                                         r"layer that reuses layer 1's keys and values"):
        path_patching(lm, CLEAN, CORRUPT, ANSWERS, receivers=[(4, 0)], receiver_input="k")


def path_patching_written_out(lm, sender, receivers, inputs):
    """One sender (layer, head), every hook written out: the definition, step by step. Later components frozen
    at the corrupted run are whatever each layer writes: its heads' z, or a Gated DeltaNet layer's whole output,
    and the MLP's and the per-layer input's outputs."""
    names, n = set(hook_names(lm)), lm.config.num_layers
    _, clean = run_with_cache(lm, CLEAN)
    _, corrupt = run_with_cache(lm, CORRUPT)
    layer, head = sender

    def send(z, name):
        z = z.copy()
        z[0, :, head] = clean[name][0, :, head]
        return z

    def freeze(value, name):
        return corrupt[name]

    step_one = {f"blocks.{layer}.attn.hook_z": send}
    for later in range(layer, n):
        for point in ("hook_mlp_out", "hook_per_layer_out"):
            if f"blocks.{later}.{point}" in names:
                step_one[f"blocks.{later}.{point}"] = freeze
        if later > layer:
            z = f"blocks.{later}.attn.hook_z"
            step_one[z if z in names else f"blocks.{later}.hook_attn_out"] = freeze
    with hooks(lm, step_one):
        _, kept = run_with_cache(lm, CORRUPT, names=lambda name: name.endswith(("hook_q", "hook_k", "hook_v")))
    step_two = {}
    for r_layer, r_head in receivers:
        if r_layer <= layer:
            continue
        for x in inputs:
            name = f"blocks.{r_layer}.attn.hook_{x}"
            group = lm.config.num_heads // kept[name].shape[2]  # this layer's key/value heads
            index = r_head if x == "q" else r_head // group
            previous = step_two.get(name)

            def receive(value, name, index=index, previous=previous):
                value = value.copy() if previous is None else previous(value, name)
                value[0, :, index] = kept[name][0, :, index]
                return value

            step_two[name] = receive
    with hooks(lm, step_two):
        logits = lm(CORRUPT[None])
    return logits[0, -1, ANSWERS[0]] - logits[0, -1, ANSWERS[1]]


@pytest.mark.parametrize("name, receivers, inputs", [
    ("qwen3_5_text", [(3, 0), (3, 2)], ("q", "k", "v")),  # Gated DeltaNet layers 0 and 2 send nothing, 2 is frozen
    ("gemma4_text", [(1, 3), (2, 1)], ("k", "v")),  # layer 1's one global key/value head feeds all four queries
    ("gemma4_text", [(4, 2)], ("q",)),  # a reader's queries; per-layer inputs frozen on the way
])
def test_path_patching_equals_its_definition_over_the_points_that_exist(name, receivers, inputs, hf_root):
    lm = model(name, hf_root)
    got = path_patching(lm, CLEAN, CORRUPT, ANSWERS, receivers, receiver_input=inputs)
    names = set(hook_names(lm))
    senders = [i for i in range(max(r for r, _ in receivers)) if f"blocks.{i}.attn.hook_z" in names]
    assert not np.isnan(got[senders]).any() and np.isnan(np.delete(got, senders, axis=0)).all()
    for layer in senders:
        for head in range(lm.config.num_heads):
            want = path_patching_written_out(lm, (layer, head), receivers, inputs)
            np.testing.assert_allclose(got[layer, head], want, rtol=0, atol=1e-12)
    assert np.nanstd(got) > 1e-6  # the senders differ: the paths carry something
