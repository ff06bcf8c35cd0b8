"""Every hook point a model declares fires, on every family of the tiny-model registry: each forward point in a
forward, in a backward (except the two that take forward hooks only), and in every step of ``generate`` (the
decoding steps run the hooked forward, not the fast step). A declared point that never fires is a hook a user
would install and never see called."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
from attnkit.explain import hook_names, hooks  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import FAMILY_MODELS, saved_model  # noqa: E402

FORWARD_ONLY = ("hook_pattern", "hook_expert_indices")  # their values are not differentiable inputs


def recorder(seen):
    def record(value, name):
        seen.append(name)
    return record


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_every_declared_hook_point_fires_in_forward_backward_and_generate(name, tmp_path):
    lm = load_causal_lm(saved_model(name, tmp_path)[0], dtype=np.float64)
    names = hook_names(lm)
    assert len(names) == len(set(names)) and len(names) >= 4 * lm.config.num_layers
    differentiable = [n for n in names if not n.endswith(FORWARD_ONLY)]
    forward, backward = [], []
    ids = np.array([[5, 17, 3, 60, 42, 9]])
    with hooks(lm, forward={n: recorder(forward) for n in names},
               backward={n: recorder(backward) for n in differentiable}):
        logits = lm(ids)  # (1, 6, V)
        lm.backward(np.ones_like(logits))
        fired_forward, fired_backward = set(forward), set(backward)
        forward.clear()
        lm.generate(ids, max_new_tokens=3, min_new_tokens=3)  # a prefill and two decoding steps
        steps = {n: forward.count(n) for n in names}
    assert fired_forward == set(names), sorted(set(names) - fired_forward)
    assert fired_backward == set(differentiable), sorted(set(differentiable) - fired_backward)
    assert min(steps.values()) >= 3, sorted(n for n, count in steps.items() if count < 3)


@pytest.mark.parametrize("point", ["hook_k", "hook_v"])
def test_a_replaced_latent_key_or_value_holds_in_cached_decoding_steps(point, tmp_path):
    """Latent attention decodes in its absorbed form, which never forms per-head keys and values; with hooks it
    runs the explicit form, so a replacement there changes a cached step exactly as it changes the whole
    sequence."""
    lm = load_causal_lm(saved_model("deepseek_v3", tmp_path)[0], dtype=np.float64)
    ids = np.array([[5, 17, 3, 60, 42, 9]])

    def scaled(value, name):
        return value * 0.5

    plain = lm(ids)[:, -1]  # (1, V)
    with hooks(lm, forward={f"blocks.0.attn.{point}": scaled}):
        whole = lm(ids)[:, -1]  # (1, V)
        cache = lm.new_cache(1)
        lm(ids[:, :5], cache=cache)
        stepped = lm(ids[:, 5:], cache=cache)[:, -1]  # (1, V): a cached decoding step
    assert np.abs(whole - plain).max() > 1e-3  # the replacement matters
    np.testing.assert_allclose(stepped, whole, rtol=1e-11, atol=1e-11)
