"""path_patching equals a plain one-sender-at-a-time implementation with hooks, and transformers runs with the
same freezing and patching done by torch hooks; its arguments are checked."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.explain import hooks, path_patching, run_with_cache
from attnkit.models import CausalLM, DecoderConfig, MLPConfig

CLEAN = np.array([3, 14, 15, 9, 26, 5])
CORRUPT = np.array([3, 14, 40, 9, 33, 5])
ANSWERS = (7, 21)


def _lm(family="llama", layers=4, kv_heads=2):
    cfg = DecoderConfig(family=family, vocab_size=50, hidden_size=16, num_layers=layers, num_heads=4,
                        num_kv_heads=kv_heads, head_dim=4, mlp=MLPConfig(32), max_position_embeddings=16)
    lm = CausalLM(cfg, rng=1).astype(np.float64)
    for weight in lm.parameters():  # initial weights are small: heads would barely differ
        weight *= 6.0
    return lm


def _metric(logits):
    return logits[0, -1, ANSWERS[0]] - logits[0, -1, ANSWERS[1]]


def brute_path_patching(lm, sender, receivers, inputs):
    """One sender (layer, head), one row, every hook written out: the definition, step by step."""
    n, group = lm.config.num_layers, lm.config.num_heads // lm.config.num_kv_heads
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
        step_one[f"blocks.{later}.hook_mlp_out"] = freeze
        if later > layer:
            step_one[f"blocks.{later}.attn.hook_z"] = freeze
    with hooks(lm, step_one):
        _, kept = run_with_cache(lm, CORRUPT, names=lambda name: name.endswith(("hook_q", "hook_k", "hook_v")))
    step_two = {}
    for r_layer, r_head in receivers:
        if r_layer <= layer:
            continue
        for x in inputs:
            name = f"blocks.{r_layer}.attn.hook_{x}"
            index = r_head if x == "q" else r_head // group
            previous = step_two.get(name)

            def receive(value, name, index=index, previous=previous):
                value = value.copy() if previous is None else previous(value, name)
                value[0, :, index] = kept[name][0, :, index]
                return value

            step_two[name] = receive
    with hooks(lm, step_two):
        return _metric(lm(CORRUPT[None]))


@pytest.mark.parametrize("family, kv_heads, receivers, inputs", [
    ("llama", 2, [(2, 1), (3, 0)], ("q",)),
    ("llama", 2, [(3, 3), (3, 2)], ("k", "v")),
    ("llama", 1, [(1, 0), (3, 2)], ("q", "k", "v")),
    ("gpt2", 4, [(2, 0), (3, 3)], ("v",)),
])
def test_equals_one_sender_at_a_time_with_hooks(family, kv_heads, receivers, inputs):
    lm = _lm(family, kv_heads=kv_heads)
    got = path_patching(lm, CLEAN, CORRUPT, ANSWERS, receivers, receiver_input=inputs if len(inputs) > 1 else inputs[0])
    last = max(layer for layer, _ in receivers)
    assert got.shape == (4, 4) and np.isnan(got[last:]).all() and not np.isnan(got[:last]).any()
    for layer in range(last):
        for head in range(4):
            want = brute_path_patching(lm, (layer, head), receivers, inputs)
            np.testing.assert_allclose(got[layer, head], want, rtol=0, atol=1e-12)
    corrupt_metric = _metric(lm(CORRUPT[None]))
    # the paths carry part of the difference, and not all the same part
    assert np.nanmax(np.abs(got - corrupt_metric)) > 1e-2 and np.nanstd(got) > 1e-3


def test_with_nothing_to_carry_every_path_gives_the_corrupted_metric():
    lm = _lm()
    got = path_patching(lm, CORRUPT, CORRUPT, ANSWERS, [(3, 0), (2, 1)], receiver_input=("q", "k", "v"))
    np.testing.assert_allclose(got[:3], _metric(lm(CORRUPT[None])), rtol=0, atol=1e-12)


def test_equals_transformers_with_torch_hooks(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from hf_models import TOL, float64_pair, hf_layers

    lm, hf = float64_pair("llama_gqa", tmp_path)
    clean, corrupt = np.array([5, 17, 3, 60, 42, 9]), np.array([5, 17, 8, 60, 30, 9])
    receivers, answers = [(1, 1), (1, 2)], (7, 21)
    got = path_patching(lm, clean, corrupt, answers, receivers, receiver_input=("q", "v"))
    layers = hf_layers(hf)
    heads, dh = lm.config.num_heads, lm.config.head_dim
    group = heads // lm.config.num_kv_heads

    def run(ids, pre=None, post=None):
        """Logits with forward pre-hooks / hooks ``{module: fn}``; the caller's captures in closures."""
        handles = [m.register_forward_pre_hook(f) for m, f in (pre or {}).items()]
        handles += [m.register_forward_hook(f) for m, f in (post or {}).items()]
        try:
            with torch.no_grad():
                return hf(torch.from_numpy(ids[None])).logits[0, -1].numpy()
        finally:
            for h in handles:
                h.remove()

    def capture(store, key, what):
        def hook(module, args, output=None):
            store[key] = (args[0] if what == "input" else output).clone()
        return hook

    clean_z, corrupt_z, corrupt_mlp = {}, {}, {}
    run(clean, pre={layer.self_attn.o_proj: capture(clean_z, i, "input") for i, layer in enumerate(layers)})
    run(corrupt, pre={layer.self_attn.o_proj: capture(corrupt_z, i, "input") for i, layer in enumerate(layers)},
        post={layer.mlp: capture(corrupt_mlp, i, "output") for i, layer in enumerate(layers)})
    for head in range(heads):
        sender = slice(head * dh, (head + 1) * dh)

        def send(module, args, sender=sender):
            z = args[0].clone()
            z[..., sender] = clean_z[0][..., sender]
            return (z,)

        kept = {}
        run(corrupt, pre={layers[0].self_attn.o_proj: send, layers[1].self_attn.o_proj: lambda m, a: (corrupt_z[1],)},
            post={layers[0].mlp: lambda m, a, o: corrupt_mlp[0], layers[1].mlp: lambda m, a, o: corrupt_mlp[1],
                  layers[1].self_attn.q_proj: capture(kept, "q", "output"),
                  layers[1].self_attn.v_proj: capture(kept, "v", "output")})

        def receive(key, index, kept=kept):
            def hook(module, args, output):
                out = output.clone()
                for i in index:
                    out[..., i * dh:(i + 1) * dh] = kept[key][..., i * dh:(i + 1) * dh]
                return out
            return hook

        logits = run(corrupt, post={layers[1].self_attn.q_proj: receive("q", [1, 2]),
                                    layers[1].self_attn.v_proj: receive("v", sorted({1 // group, 2 // group}))})
        np.testing.assert_allclose(got[0, head], logits[answers[0]] - logits[answers[1]], rtol=0, atol=TOL)


@pytest.mark.parametrize("kwargs, message", [
    ({"receivers": []}, "receivers must be (layer, head) pairs"),
    ({"receivers": [(0, 1)]}, "receivers must be (layer, head) pairs with layer in [1, 4)"),
    ({"receivers": [(2, 4)]}, "query head in [0, 4)"),
    ({"receivers": [(2, 1, 0)]}, "receivers must be"),
    ({"receivers": [(2, 1)], "receiver_input": "o"}, "receiver_input must be 'q', 'k', 'v'"),
    ({"receivers": [(2, 1)], "receiver_input": ("q", "q")}, "receiver_input must be"),
])
def test_bad_receivers_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        path_patching(_lm(), CLEAN, CORRUPT, ANSWERS, **kwargs)
