"""run_with_cache and hooks against transformers on the same tiny models (float64), and the hooked backward
against torch autograd with the same replacement."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.explain import hook_names, hooks, run_with_cache  # noqa: E402
from attnkit.models import AttentionConfig, CausalLM, DecoderConfig, MLPConfig  # noqa: E402
from hf_models import TOL, float64_pair, hf_layers, hf_output_projection  # noqa: E402

IDS = np.array([[5, 17, 3, 60, 42, 9, 77, 21]])


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_hooks")


def hf_run(hf, ids, pre_hooks=None, **kwargs):
    """HF forward with forward pre-hooks ``{module: fn(args) -> args}`` installed for the call."""
    handles = [module.register_forward_pre_hook(lambda m, args, fn=fn: fn(args)) for module, fn in
               (pre_hooks or {}).items()]
    try:
        return hf(torch.from_numpy(ids), position_ids=torch.arange(ids.shape[1])[None], **kwargs)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa", "gemma2", "qwen3", "olmo2", "gpt_neox"])
def test_cache_equals_hf_hidden_states_and_attentions(name, hf_root):
    lm, hf = float64_pair(name, hf_root)
    logits, cache = run_with_cache(lm, IDS)
    inputs = {}
    handles = [hf_output_projection(layer).register_forward_pre_hook(
        lambda m, args, i=i: inputs.__setitem__(i, args[0].detach().numpy())) for i, layer in enumerate(hf_layers(hf))]
    with torch.no_grad():
        out = hf_run(hf, IDS, output_hidden_states=True, output_attentions=True)
    for handle in handles:
        handle.remove()
    n, (b, length) = lm.config.num_layers, IDS.shape
    np.testing.assert_allclose(logits, out.logits.numpy(), atol=TOL)
    for i in range(n):
        np.testing.assert_allclose(cache[f"blocks.{i}.hook_resid_pre"], out.hidden_states[i].numpy(), atol=TOL)
        np.testing.assert_allclose(cache[f"blocks.{i}.attn.hook_pattern"], out.attentions[i].numpy(), atol=TOL)
        z = cache[f"blocks.{i}.attn.hook_z"]
        assert z.shape == (b, length, lm.config.num_heads, lm.config.head_dim)
        np.testing.assert_allclose(z.reshape(b, length, -1), inputs[i], atol=TOL)
        if i + 1 < n:
            np.testing.assert_allclose(cache[f"blocks.{i}.hook_resid_post"], out.hidden_states[i + 1].numpy(),
                                       atol=TOL)
        # the residual stream is the sum of what the branches add
        pre, post = cache[f"blocks.{i}.hook_resid_pre"], cache[f"blocks.{i}.hook_resid_post"]
        np.testing.assert_allclose(pre + cache[f"blocks.{i}.hook_attn_out"] + cache[f"blocks.{i}.hook_mlp_out"], post,
                                   atol=1e-12)
    np.testing.assert_allclose(cache["ln_final.hook_normalized"], out.hidden_states[n].numpy(), atol=TOL)
    assert ("blocks.0.hook_resid_mid" in cache) == (name != "gpt_neox")  # parallel branches have no middle


def test_q_k_v_equal_hf_projections(hf_root):
    lm, hf = float64_pair("llama_gqa", hf_root)
    _, cache = run_with_cache(lm, IDS, names=lambda name: name.startswith("blocks.1.attn.hook_"))
    assert set(cache) == {f"blocks.1.attn.hook_{p}" for p in ("q", "k", "v", "rot_q", "rot_k", "pattern", "z")}
    attn, got = hf_layers(hf)[1].self_attn, {}
    handles = [getattr(attn, f"{p}_proj").register_forward_hook(
        lambda m, args, out, p=p: got.__setitem__(p, out.detach().numpy())) for p in "qkv"]
    with torch.no_grad():
        hf_run(hf, IDS)
    for handle in handles:
        handle.remove()
    heads = {"q": lm.config.num_heads, "k": lm.config.num_kv_heads, "v": lm.config.num_kv_heads}
    for p, h in heads.items():
        want = got[p].reshape(1, IDS.shape[1], h, lm.config.head_dim)
        np.testing.assert_allclose(cache[f"blocks.1.attn.hook_{p}"], want, atol=TOL)
    assert not np.allclose(cache["blocks.1.attn.hook_rot_q"], cache["blocks.1.attn.hook_q"])


def zero_head(head):
    def fn(z, name):
        z = z.copy()
        z[:, :, head] = 0.0
        return z
    return fn


def torch_zero_head(head, head_dim):
    def fn(args):
        x = args[0].detach().clone()  # hooks' replacements are constants: nothing upstream gets a gradient
        x[..., head * head_dim:(head + 1) * head_dim] = 0.0
        return (x,) + args[1:]
    return fn


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2", "gemma2"])
def test_head_ablation_equals_torch_pre_hook_forward_and_backward(name, hf_root):
    lm, hf = float64_pair(name, hf_root)
    layer, head, position, target = 1, 2, -1, 7
    # attnkit: d logit[target] / d (token embeddings) with the head ablated
    grad_logits = np.zeros((1, 1, lm.config.vocab_size))
    grad_logits[0, 0, target] = 1.0
    embed_grads = {}
    with hooks(lm, {f"blocks.{layer}.attn.hook_z": zero_head(head)},
               backward={"hook_embed": lambda g, n: embed_grads.__setitem__(n, np.array(g))}):
        logits = lm(IDS, logits_to_keep=1)
        lm.backward(grad_logits)
    lm.zero_grad()
    # transformers: zero the head's slice of the output projection's input
    embeds = hf.get_input_embeddings()(torch.from_numpy(IDS)).detach().requires_grad_(True)
    projection = hf_output_projection(hf_layers(hf)[layer])
    handle = projection.register_forward_pre_hook(lambda m, args: torch_zero_head(head, lm.config.head_dim)(args))
    try:
        out = hf(inputs_embeds=embeds, position_ids=torch.arange(IDS.shape[1])[None]).logits
    finally:
        handle.remove()
    out[0, position, target].backward()
    np.testing.assert_allclose(logits[0, -1], out[0, position].detach().numpy(), atol=TOL)
    assert not np.allclose(logits[0, -1], lm(IDS)[0, -1])  # the ablation changed something
    # transformers' embedding module applies Gemma's sqrt(D) itself, so both are after the scale
    np.testing.assert_allclose(embed_grads["hook_embed"], embeds.grad.numpy(), atol=TOL)


def test_steered_residual_is_a_constant_and_hf_agrees(hf_root):
    lm, hf = float64_pair("llama_gqa", hf_root)
    steer = np.random.default_rng(0).normal(size=lm.config.hidden_size)
    seen = {}
    with hooks(lm, {"blocks.1.hook_resid_pre": lambda x, n: x + steer},
               backward={"blocks.1.hook_resid_pre": lambda g, n: seen.__setitem__(n, np.array(g))}):
        logits = lm(IDS)
        grad = lm.backward(np.ones_like(logits))
    ours = {name: g.copy() for name, g in lm.named_gradients()}
    lm.zero_grad()
    # transformers: the same replacement as a detached tensor whose gradient torch keeps
    replaced = {}

    def pre_hook(module, args, kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        replaced["x"] = (x.detach() + torch.from_numpy(steer)).requires_grad_(True)
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": replaced["x"]}
        return (replaced["x"],) + args[1:], kwargs

    handle = hf_layers(hf)[1].register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        out = hf_run(hf, IDS).logits
    finally:
        handle.remove()
    out.sum().backward()
    np.testing.assert_allclose(logits, out.detach().numpy(), atol=TOL)
    np.testing.assert_allclose(seen["blocks.1.hook_resid_pre"], replaced["x"].grad.numpy(), atol=TOL)
    np.testing.assert_allclose(ours["layers.1.attention.W_Q"], hf_layers(hf)[1].self_attn.q_proj.weight.grad.T.numpy(),
                               atol=TOL)
    # nothing before the constant gets a gradient, in either model
    np.testing.assert_array_equal(grad, 0.0)
    np.testing.assert_array_equal(ours["layers.0.attention.W_Q"], 0.0)
    assert hf_layers(hf)[0].self_attn.q_proj.weight.grad is None
    hf.zero_grad()


def tiny(family="llama", **changes):
    cfg = dict(family=family, vocab_size=13, hidden_size=8, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2,
               mlp=MLPConfig(12))
    cfg.update(changes)
    return CausalLM(DecoderConfig(**cfg), rng=0).astype(np.float64)


def test_replaced_pattern_is_a_constant_checked_by_finite_differences(rng):
    lm = tiny()
    ids = np.array([[1, 5, 2, 9, 3]])
    fixed = rng.random((1, 4, 5, 5)) * np.tri(5)
    fixed /= fixed.sum(-1, keepdims=True)
    weights = rng.normal(size=(1, 5, 13))
    names = {"blocks.0.attn.hook_pattern": lambda p, n: fixed}
    with hooks(lm, names):
        loss = (lm(ids) * weights).sum()
        grad = lm.backward(weights)
        _, cache = run_with_cache(lm, ids, names=["blocks.0.attn.hook_pattern", "blocks.0.attn.hook_v",
                                                  "blocks.0.attn.hook_z"])
    lm.zero_grad()
    np.testing.assert_array_equal(cache["blocks.0.attn.hook_pattern"], fixed)
    v = np.repeat(cache["blocks.0.attn.hook_v"], 2, axis=2).transpose(0, 2, 1, 3)  # (1, 4, 5, 2) per query head
    np.testing.assert_allclose(cache["blocks.0.attn.hook_z"], (fixed @ v).transpose(0, 2, 1, 3), atol=1e-14)
    embeds = lm.embed.weight[ids[0]].copy()
    numeric = np.zeros_like(embeds)
    for index in np.ndindex(*embeds.shape):
        for sign in (1, -1):
            shifted = embeds.copy()
            shifted[index] += sign * 1e-6
            with hooks(lm, {**names, "hook_embed": lambda x, n, s=shifted: s[None]}):
                numeric[index] += sign * (lm(ids) * weights).sum() / 2e-6
    assert np.isfinite(loss)
    np.testing.assert_allclose(grad[0], numeric, atol=1e-7)


@pytest.mark.parametrize("point", ["blocks.0.hook_resid_pre", "blocks.1.attn.hook_v", "blocks.0.attn.hook_z",
                                   "blocks.1.hook_mlp_out", "blocks.0.attn.hook_pattern"])
def test_hooks_during_generate_equal_an_uncached_loop(point):
    lm = tiny(family="gemma2", attention=AttentionConfig(logit_softcap=5.0, sliding_window=3),
              layer_types=("sliding_attention", "full_attention"))
    shift = np.linspace(-2.0, 2.0, 8 if point.endswith(("resid_pre", "mlp_out")) else 2)

    lengths = []

    def steer(x, name):
        lengths.append(x.shape[-2] if name.endswith("hook_pattern") else x.shape[1])  # the new positions
        if name.endswith("hook_pattern"):  # every key the query sees, equally (the window's keys in layer 0)
            seen = x > 0
            return seen / seen.sum(-1, keepdims=True)
        return x + shift

    prompt = np.array([[3, 1, 4, 1, 5]])
    with hooks(lm, {point: steer}):
        generated = lm.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=[])
        assert lengths == [5, 1, 1, 1, 1, 1]  # the prompt, then every cached step
        loop = prompt
        for _ in range(6):
            loop = np.concatenate([loop, lm(loop)[:, -1:].argmax(-1)], axis=1)
        hooked = lm(prompt)
    np.testing.assert_array_equal(generated, loop)
    assert not np.allclose(hooked, lm(prompt))


def test_model_untouched_and_errors():
    lm = tiny()
    before = {name: dict(module.__dict__) for name, module in lm.named_modules()}
    ids = np.array([[1, 2, 3]])
    with hooks(lm, {"blocks.0.hook_resid_mid": lambda x, n: x * 2}):
        lm(ids)
    assert {name: dict(module.__dict__).keys() for name, module in lm.named_modules()} == \
        {name: d.keys() for name, d in before.items()}
    with pytest.raises(RuntimeError, match="needs a forward"):  # the replacement is gone: no stale backward
        lm.backward(np.ones((1, 3, 13)))
    with pytest.raises(ValueError, match="no hook point 'blocks.0.hook_resid_midd'; did you mean "
                                         "blocks.0.hook_resid_mid"):
        with hooks(lm, {"blocks.0.hook_resid_midd": lambda x, n: None}):
            pass
    with pytest.raises(TypeError, match=r"forward\['hook_embed'\] must be callable"):
        with hooks(lm, {"hook_embed": 3}):
            pass
    with pytest.raises(ValueError, match=r"the hook at blocks.1.attn.hook_z returned shape \(1, 3\), but the value "
                                         r"there has shape \(1, 3, 4, 2\)"):
        with hooks(lm, {"blocks.1.attn.hook_z": lambda z, n: z[..., 0, 0]}):
            lm(ids)
    with pytest.raises(ValueError, match="read-only"):
        with hooks(lm, {"hook_embed": lambda x, n: x.__setitem__(0, 0.0)}):
            lm(ids)
    with pytest.raises(ValueError, match="blocks.0.attn.hook_pattern takes forward hooks only"):
        with hooks(lm, backward={"blocks.0.attn.hook_pattern": lambda g, n: None}):
            pass
    with pytest.raises(TypeError, match="names must be a list of hook names or a predicate, got str"):
        run_with_cache(lm, ids, names="hook_embed")
    with pytest.raises(TypeError, match="model must have named hook points"):
        run_with_cache(object(), ids)
    assert all(module.__dict__.get("_hook_table") is None for _, module in lm.named_modules())
    # nesting: the inner hook sees the outer one's value, and both are gone after
    with hooks(lm, {"hook_embed": lambda x, n: x * 0 + 1}):
        _, cache = run_with_cache(lm, ids, names=["hook_embed"])
    np.testing.assert_array_equal(cache["hook_embed"], 1.0)
    assert len(hook_names(lm)) == 1 + 2 * (5 + 7) + 1  # embed, (block + attention) per layer, final norm


def test_a_cache_with_the_last_logits_only_holds_the_same_activations():
    lm = tiny()
    ids = np.array([[1, 2, 3, 4]])
    logits, cache = run_with_cache(lm, ids)
    last, kept = run_with_cache(lm, ids, logits_to_keep=1)
    assert last.shape == (1, 1, 13)
    np.testing.assert_allclose(last[:, 0], logits[:, -1], rtol=1e-12, atol=1e-12)
    assert list(kept) == list(cache)
    for name, value in cache.items():
        np.testing.assert_array_equal(kept[name], value, err_msg=name)


def test_module_hook_table_is_installed_and_removed():
    lm = tiny()
    block = lm.layers[0]

    def double(x, name):
        return 2 * x

    with pytest.raises(ValueError, match=r"LMBlock has no hook point 'hook_q'; it has \['hook_resid_pre'"):
        block.add_hook("hook_q", double, full_name="blocks.0.hook_q")
    with pytest.raises(ValueError, match="direction must be 'forward' or 'backward', got 'up'"):
        block.add_hook("hook_resid_pre", double, full_name="blocks.0.hook_resid_pre", direction="up")
    block.add_hook("hook_resid_pre", double, full_name="blocks.0.hook_resid_pre")
    block.add_hook("hook_resid_pre", double, full_name="blocks.0.hook_resid_pre")  # twice: applied twice
    x = np.ones((1, 2, 8))
    assert block.hook_point("hook_resid_pre", x)[0, 0, 0] == 4.0 and block.hook_replaced("hook_resid_pre")
    np.testing.assert_array_equal(block.hook_backward("hook_resid_pre", x), 0.0)  # a constant has no gradient
    block.remove_hook("hook_resid_pre", double)
    assert block.hook_point("hook_resid_pre", x)[0, 0, 0] == 2.0
    block.remove_hook("hook_resid_pre", double)
    assert "_hook_table" not in block.__dict__ and not block.hook_replaced("hook_resid_pre")
    assert block.hook_point("hook_resid_pre", x) is x and block.hook_backward("hook_resid_pre", x) is x


def test_gemma4_blocks_hooks_equal_hf_and_the_scalar_closes_the_sum(hf_root):
    """A Gemma 4 block's output (after its per-layer branch and its scalar) is transformers' hidden state, its
    patterns transformers' attentions (global layers' wider heads and reading layers' shared keys included)."""
    lm, hf = float64_pair("gemma4_text", hf_root)
    # transformers' Gemma 4 casts to float32 and back in eight RMSNorms per layer (q, k, v, the four around the
    # branches, the per-layer input's), and the post-norms magnify what a float32 softmax rounds: the residual
    # stream (growing to 11 here) differs by up to 1e-6 of its size (measured), the logits by 2.1e-6
    def close(ours, theirs):
        assert np.max(np.abs(ours - theirs)) <= 2 * TOL * max(1.0, np.max(np.abs(theirs)))
    logits, cache = run_with_cache(lm, IDS)
    inputs = {}
    handles = [hf_output_projection(layer).register_forward_pre_hook(
        lambda m, args, i=i: inputs.__setitem__(i, args[0].detach().numpy())) for i, layer in enumerate(hf_layers(hf))]
    with torch.no_grad():
        out = hf_run(hf, IDS, output_hidden_states=True, output_attentions=True)
    for handle in handles:
        handle.remove()
    close(logits, out.logits.numpy())
    for i, layer in enumerate(lm.layers):
        close(cache[f"blocks.{i}.hook_resid_pre"], out.hidden_states[i].numpy())
        close(cache[f"blocks.{i}.attn.hook_pattern"], out.attentions[i].numpy())
        z = cache[f"blocks.{i}.attn.hook_z"]
        close(z.reshape(*z.shape[:2], -1), inputs[i])
        parts = (cache[f"blocks.{i}.hook_resid_mid"] + cache[f"blocks.{i}.hook_mlp_out"]
                 + cache[f"blocks.{i}.hook_per_layer_out"])
        np.testing.assert_allclose(parts * layer.layer_scalar, cache[f"blocks.{i}.hook_resid_post"], atol=1e-12)
    assert cache["blocks.1.attn.hook_z"].shape[-1] == 16 and cache["blocks.0.attn.hook_z"].shape[-1] == 8
    assert "blocks.3.attn.hook_k" not in cache and "blocks.2.attn.hook_k" in cache  # layer 3 reads layer 2's
