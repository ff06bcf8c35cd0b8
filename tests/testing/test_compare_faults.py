"""compare finds a one-operation fault injected into one layer of a transformers copy of a tiny model, in the
right layer and at the right operation, over randomized families, faults, layers and prompts; and equal
implementations (transformers float32 against attnkit float32 or float64) report no divergence."""
from __future__ import annotations

import sys
from contextlib import contextmanager

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.testing import AttnkitSide, Reference, compare, transformers_side  # noqa: E402
from hf_models import VOCAB, saved_model  # noqa: E402

FAMILIES = ("llama_gqa", "mistral_window", "qwen2_mixed", "qwen3", "olmo2", "gemma2", "gemma3_text", "mixtral")
LENGTH = 10
TRIALS = 200


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per family: (transformers model, attnkit float32 side, reference)."""
    root = tmp_path_factory.mktemp("compare_faults")
    out = {}
    for name in FAMILIES:
        folder, hf = saved_model(name, root)
        reference = Reference(folder)
        out[name] = (hf, AttnkitSide(folder), reference)
    return out


# -- the faults: each a context manager changing layer ``i`` of a transformers model --------------------------
@contextmanager
def _attribute(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextmanager
def rotary_off_by_one(hf, i, rng):
    """Layer i rotates every position as the next one (cos/sin advanced by the angle of position 1)."""
    def shift(_module, args, kwargs):
        cos, sin = kwargs["position_embeddings"]  # (B, L, Dh)
        c1, s1 = cos[:, 1:2], sin[:, 1:2]
        kwargs["position_embeddings"] = (cos * c1 - sin * s1, sin * c1 + cos * s1)
        return args, kwargs

    handle = hf.model.layers[i].self_attn.register_forward_pre_hook(shift, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def wrong_norm_eps(hf, i, rng):
    """Layer i's input RMSNorm with its epsilon ten times too large (1e-4 for 1e-5: ten times smaller moves
    Gemma 2's outputs, whose stream is large, by about ten float32 rounding errors only)."""
    norm = hf.model.layers[i].input_layernorm
    name = "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps"
    return _attribute(norm, name, getattr(norm, name) * 10)


@contextmanager
def missing_one_plus_w(hf, i, rng):
    """Layer i's Gemma RMSNorm scaled by w instead of 1 + w."""
    weight = hf.model.layers[i].input_layernorm.weight
    with torch.no_grad():
        weight -= 1
    try:
        yield
    finally:
        with torch.no_grad():
            weight += 1


def swapped_softcap(hf, i, rng):
    """Layer i's attention soft-capped with the final logits' cap."""
    return _attribute(hf.model.layers[i].self_attn, "attn_logit_softcapping", hf.config.final_logit_softcapping)


def scale_one_over_d(hf, i, rng):
    """Layer i's scores scaled by 1/d, not 1/sqrt(d)."""
    attn = hf.model.layers[i].self_attn
    return _attribute(attn, "scaling", 1.0 / attn.head_dim)


@contextmanager
def _eager_of_layer(hf, i, change):
    """The modeling module's eager attention, with ``change(module, query, key, value, mask)`` applied to layer
    i's call (returning the arguments to call the original with)."""
    modeling = sys.modules[type(hf.model.layers[i].self_attn).__module__]
    original = modeling.eager_attention_forward

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if module.layer_idx == i:
            query, key, value, attention_mask = change(module, query, key, value, attention_mask)
            groups, module.num_key_value_groups = module.num_key_value_groups, query.shape[1] // key.shape[1]
            try:
                return original(module, query, key, value, attention_mask, *args, **kwargs)
            finally:
                module.num_key_value_groups = groups
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    modeling.eager_attention_forward = attention
    try:
        yield
    finally:
        modeling.eager_attention_forward = original


def wrong_gqa_mapping(hf, i, rng):
    """Layer i's query head h reads key/value head h mod Hkv instead of h // (H / Hkv)."""
    def tile(module, query, key, value, mask):
        g = query.shape[1] // key.shape[1]
        return query, key.repeat(1, g, 1, 1), value.repeat(1, g, 1, 1), mask  # (B, H, S, Dh)
    return _eager_of_layer(hf, i, tile)


def window_off_by_one(hf, i, rng, window):
    """Layer i's sliding window one key wider or narrower."""
    wrong = window + int(rng.choice([-1, 1]))

    def widen(module, query, key, value, mask):
        q = torch.arange(query.shape[2])[:, None]
        k = torch.arange(key.shape[2])[None, :]
        allowed = (k <= q) & (q - k < wrong)  # (L, S)
        additive = torch.zeros(allowed.shape, dtype=query.dtype).masked_fill(~allowed, torch.finfo(query.dtype).min)
        return query, key, value, additive[None, None]  # (1, 1, L, S)
    return _eager_of_layer(hf, i, widen)


@contextmanager
def router_not_renormalised(hf, i, rng):
    """Layer i's mixture of experts weights its k experts by their softmax probabilities, not renormalised."""
    def raw(_module, _inputs, output):
        logits, _, indices = output
        return logits, logits.float().softmax(-1).gather(-1, indices).to(logits.dtype), indices

    handle = hf.model.layers[i].mlp.gate.register_forward_hook(raw)
    try:
        yield
    finally:
        handle.remove()


def _applicable(name, hf, reference):
    """(fault, layers it applies to, the op it must be found at) for one family."""
    n = len(hf.model.layers)
    layers = range(n)
    attn = hf.model.layers[0].self_attn
    heads, kv = hf.config.num_attention_heads, hf.config.num_key_value_heads
    gemma = name.startswith("gemma")
    out = [(rotary_off_by_one, list(layers), "rotary_q"), (scale_one_over_d, list(layers), "scores")]
    if hasattr(hf.model.layers[0], "input_layernorm"):
        out.append((wrong_norm_eps, list(layers), "norm"))
    if gemma:
        out.append((missing_one_plus_w, list(layers), "norm"))
    if getattr(attn, "attn_logit_softcapping", None) and hf.config.final_logit_softcapping:
        out.append((swapped_softcap, list(layers), "scores"))
    if 1 < kv < heads:
        out.append((wrong_gqa_mapping, list(layers), "scores"))
    routed = [j for j in layers if getattr(hf.model.layers[j].mlp, "gate", None) is not None
              and getattr(hf.model.layers[j].mlp.gate, "norm_topk_prob", True)]
    if routed:
        out.append((router_not_renormalised, routed, "router"))
    windowed = [j for j in layers if reference.model.layers[j].attention.window]
    if windowed:
        out.append((window_off_by_one, windowed, "scores"))
    return out


def draw_trial(rng, models):
    """(family, fault, layer, op): a fault kind drawn uniformly, then a family it applies to, then a layer."""
    options = [(name, fault, layers, op) for name in FAMILIES
               for fault, layers, op in _applicable(name, models[name][0], models[name][2])]
    kinds = sorted({fault.__name__ for _, fault, _, _ in options})
    kind = kinds[rng.integers(len(kinds))]
    fitting = [option for option in options if option[1].__name__ == kind]
    name, fault, layers, op = fitting[rng.integers(len(fitting))]
    return name, fault, int(rng.choice(layers)), op


def test_an_injected_fault_is_found_at_its_layer_and_operation(models):
    rng = np.random.default_rng(47)
    prompts = [rng.integers(2, VOCAB - 1, size=LENGTH) for _ in range(4)]
    found, misses, kinds = 0, [], set()
    for _ in range(TRIALS):
        name, fault, layer, op = draw_trial(rng, models)
        hf, attnkit32, reference = models[name]
        ids = prompts[rng.integers(len(prompts))]
        extra = {"window": reference.model.layers[layer].attention.window} if fault is window_off_by_one else {}
        with fault(hf, layer, rng, **extra):
            result = compare(transformers_side(hf), attnkit32, ids, reference=reference)
        kinds.add(fault.__name__)
        if result.first is not None and (result.first.layer, result.first.op) == (layer, op):
            found += 1
        else:
            misses.append((name, fault.__name__, layer, op, result.verdict()))
    assert len(kinds) == 8
    assert found >= 0.99 * TRIALS, misses
    # the faults are undone: the copy agrees again
    for name in FAMILIES:
        hf, attnkit32, reference = models[name]
        assert not compare(transformers_side(hf), attnkit32, prompts[0], reference=reference).diverged


@pytest.mark.parametrize("name", FAMILIES)
def test_equal_implementations_do_not_diverge(models, name):
    hf, attnkit32, reference = models[name]
    ids = np.arange(3, 3 + LENGTH)
    result = compare(transformers_side(hf), attnkit32, ids, reference=reference)
    assert result.verdict() == "no divergence", result.table()
    # every layer's operations were compared, and were within a third of their limits
    ops = {r.op for r in result.rows if r.layer == 0}
    assert {"q", "k", "v", "rotary_q", "scores", "probs", "heads", "attn_out", "mlp", "resid"} <= ops
    assert ("router" in ops) == (name == "mixtral")
    assert max(max(r.error_a / r.limit_a, r.error_b / r.limit_b) for r in result.rows) < 0.5
    # attnkit in float64 against transformers in float32: the float64 side is held to its own rounding
    assert not compare(transformers_side(hf), reference.model, ids, reference=reference).diverged
