"""activation_patching against transformers runs with the same patch put in by torch hooks, and
attribution_patching against torch autograd's product, on tiny float64 models."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.explain import activation_patching, attribution_patching, run_with_cache  # noqa: E402
from attnkit.models import CausalLM, DecoderConfig, MLPConfig  # noqa: E402
from hf_models import TOL, float64_pair, hf_layers, hf_output_projection  # noqa: E402

CLEAN = np.array([5, 17, 3, 60, 42, 9, 77, 21])
CORRUPT = np.array([5, 17, 8, 60, 42, 30, 77, 21])
ANSWERS = (11, 40)


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_patching")


def run(hf, ids, hooks=(), output_hidden_states=False):
    """HF logits of one sequence with ``(module, kind, fn)`` hooks (kind "pre" or "post") installed."""
    handles = [module.register_forward_pre_hook(fn) if kind == "pre" else module.register_forward_hook(fn)
               for module, kind, fn in hooks]
    try:
        return hf(torch.from_numpy(ids[None]), position_ids=torch.arange(len(ids))[None],
                  output_hidden_states=output_hidden_states)
    finally:
        for handle in handles:
            handle.remove()


def metric(out):
    return float(out.logits[0, -1, ANSWERS[0]] - out.logits[0, -1, ANSWERS[1]])


def capture(module, kind, store, key):
    def fn(m, args, *output):
        store[key] = (args[0] if kind == "pre" else output[0]).detach().clone()
    return module, kind, fn


def put_back(module, kind, clean, where):
    """A hook that writes ``clean[where]`` into the module's input ("pre") or output ("post")."""
    def fn(m, args, *output):
        x = (args[0] if kind == "pre" else output[0]).clone()
        x[where] = clean[where]
        return ((x,) + args[1:]) if kind == "pre" else x
    return module, kind, fn


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
def test_activation_patching_equals_transformers_with_hooks(name, hf_root):
    lm, hf = float64_pair(name, hf_root)
    head_dim = lm.config.head_dim
    with torch.no_grad():
        clean_states = run(hf, CLEAN, output_hidden_states=True).hidden_states
        corrupt_metric = metric(run(hf, CORRUPT))
        clean_metric = metric(run(hf, CLEAN))
        resid = activation_patching(lm, CLEAN, CORRUPT, ANSWERS, hook="resid_pre")  # (N, L)
        assert resid.shape == (lm.config.num_layers, len(CLEAN))
        for layer, position in ((0, 2), (1, 5), (1, 7), (0, 0)):
            want = metric(run(hf, CORRUPT, [put_back(hf_layers(hf)[layer], "pre", clean_states[layer],
                                                     (slice(None), position))]))
            np.testing.assert_allclose(resid[layer, position], want, atol=TOL)
        # block 0's input where the prompts agree is the same in both runs; where they differ, it matters
        np.testing.assert_allclose(resid[0, [0, 1, 3, 4, 6, 7]], corrupt_metric, atol=TOL)
        assert abs(resid[0, 2] - corrupt_metric) > 1e-3
        z = activation_patching(lm, CLEAN, CORRUPT, ANSWERS, hook="z")  # (N, H)
        assert z.shape == (lm.config.num_layers, lm.config.num_heads)
        for layer, head in ((0, 1), (1, 3)):
            projection = hf_output_projection(hf_layers(hf)[layer])
            clean_in = {}
            run(hf, CLEAN, [capture(projection, "pre", clean_in, "z")])
            cols = slice(head * head_dim, (head + 1) * head_dim)
            want = metric(run(hf, CORRUPT, [put_back(projection, "pre", clean_in["z"], (slice(None), slice(None),
                                                                                          cols))]))
            np.testing.assert_allclose(z[layer, head], want, atol=TOL)
    assert not np.isclose(clean_metric, corrupt_metric)


def test_attention_and_mlp_outputs_equal_transformers(hf_root):
    lm, hf = float64_pair("llama_gqa", hf_root)
    with torch.no_grad():
        for hook, module_of in (("attn_out", lambda layer: layer.self_attn.o_proj),
                                ("mlp_out", lambda layer: layer.mlp)):
            got = activation_patching(lm, CLEAN, CORRUPT, ANSWERS, hook=hook)
            for layer, position in ((0, 5), (1, 7)):
                module, clean_out = module_of(hf_layers(hf)[layer]), {}
                run(hf, CLEAN, [capture(module, "post", clean_out, "out")])
                want = metric(run(hf, CORRUPT, [put_back(module, "post", clean_out["out"],
                                                         (slice(None), position))]))
                np.testing.assert_allclose(got[layer, position], want, atol=TOL)


# hook -> (the module of a transformers layer, whether the activation is its input ("pre") or output ("post"))
TORCH_POINTS = {"resid_pre": (lambda layer: layer, "pre"), "z": (hf_output_projection, "pre"),
                "attn_out": (hf_output_projection, "post"), "mlp_out": (lambda layer: layer.mlp, "post")}


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
def test_attribution_patching_equals_torch_autograd(name, hf_root):
    lm, hf = float64_pair(name, hf_root)
    for hook, (module_of, kind) in TORCH_POINTS.items():
        got = attribution_patching(lm, CLEAN, CORRUPT, ANSWERS, hook=hook)
        modules = [module_of(layer) for layer in hf_layers(hf)]
        values = {}

        def keep(run_name, values=values, modules=modules, kind=kind):
            def fn(module, args, kwargs, *output):  # a decoder layer may take its input as hidden_states=
                if kind == "post":
                    x = output[0][0] if isinstance(output[0], tuple) else output[0]
                else:
                    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                if x.requires_grad:
                    x.retain_grad()  # the very tensor of the graph: its gradient counts every path after it
                values[run_name, modules.index(module)] = x
            return fn

        for run_name, ids in (("clean", CLEAN), ("corrupt", CORRUPT)):
            handles = [m.register_forward_pre_hook(keep(run_name), with_kwargs=True) if kind == "pre" else
                       m.register_forward_hook(keep(run_name), with_kwargs=True) for m in modules]
            try:
                out = run(hf, ids)
            finally:
                for handle in handles:
                    handle.remove()
        (out.logits[0, -1, ANSWERS[0]] - out.logits[0, -1, ANSWERS[1]]).backward()
        want = []
        for i in range(len(modules)):
            x = values["corrupt", i]
            product = ((values["clean", i] - x) * x.grad)[0].detach()  # (L, D) or (L, H * Dh)
            if hook == "z":
                product = product.reshape(len(CLEAN), lm.config.num_heads, lm.config.head_dim).sum((0, 2))
            else:
                product = product.sum(-1)
            want.append(product.numpy())
        hf.zero_grad()
        np.testing.assert_allclose(got, np.stack(want), atol=TOL, err_msg=hook)
    assert all(not g.any() for _, g in lm.named_gradients())  # gradient buffers left at zero


def test_errors():
    cfg = DecoderConfig(family="llama", vocab_size=13, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(12))
    lm = CausalLM(cfg, rng=0)
    for function in (activation_patching, attribution_patching):
        with pytest.raises(ValueError, match="hook must be one of 'resid_pre', 'attn_out', 'mlp_out', 'z', got 'q'"):
            function(lm, [1, 2], [1, 3], (4, 5), hook="q")
        with pytest.raises(ValueError, match=r"clean_ids and corrupt_ids must have the same shape .* got \(2,\) "
                                             r"and \(3,\)"):
            function(lm, [1, 2], [1, 3, 4], (4, 5))
        with pytest.raises(ValueError, match=r"answer_ids must be two token ids \(correct, incorrect\) in \[0, 13\)"):
            function(lm, [1, 2], [1, 3], (4, 13))


def _tiny(rng_seed=1):
    cfg = DecoderConfig(family="llama", vocab_size=50, hidden_size=16, num_layers=3, num_heads=4, num_kv_heads=2,
                        head_dim=4, mlp=MLPConfig(32))
    lm = CausalLM(cfg, rng=rng_seed).astype(np.float64)
    for weight in lm.parameters():  # initial weights are small: patches would barely move the metric
        weight *= 6.0
    return lm


PAIRS_CLEAN = np.array([[3, 14, 15, 9, 26, 5], [7, 1, 15, 2, 8, 5], [3, 3, 33, 9, 4, 40]])
PAIRS_CORRUPT = np.array([[3, 14, 40, 9, 26, 5], [7, 1, 20, 2, 8, 6], [3, 3, 33, 11, 4, 40]])


@pytest.mark.parametrize("hook", ["resid_pre", "z"])
def test_a_batch_of_pairs_is_the_mean_of_each_pair_alone(hook):
    """The default metric over three prompt pairs (answers per pair) is the mean of each pair patched alone."""
    lm = _tiny()
    answers = np.array([[7, 21], [30, 2], [11, 12]])
    together = activation_patching(lm, PAIRS_CLEAN, PAIRS_CORRUPT, answers, hook=hook)
    alone = [activation_patching(lm, c, k, a, hook=hook) for c, k, a in zip(PAIRS_CLEAN, PAIRS_CORRUPT, answers)]
    np.testing.assert_allclose(together, np.mean(alone, axis=0), rtol=0, atol=1e-12)
    assert np.std(together) > 1e-3
    estimate = attribution_patching(lm, PAIRS_CLEAN, PAIRS_CORRUPT, answers, hook=hook)
    alone = [attribution_patching(lm, c, k, a, hook=hook) for c, k, a in zip(PAIRS_CLEAN, PAIRS_CORRUPT, answers)]
    np.testing.assert_allclose(estimate, np.mean(alone, axis=0), rtol=0, atol=1e-12)


def test_any_metric_of_the_logits():
    """TransformerLens's normalised logit difference (0 at the corrupted run, 1 at the clean one), and a metric
    over every position's logits (logits_to_keep=0), each against the same patch put in by hand with hooks."""
    from attnkit.explain import hooks

    lm = _tiny()
    answers = np.array([[7, 21], [30, 2], [11, 12]])
    rows = np.arange(3)

    def difference(logits):
        return np.mean(logits[rows, -1, answers[:, 0]] - logits[rows, -1, answers[:, 1]])

    clean, corrupt = difference(lm(PAIRS_CLEAN)), difference(lm(PAIRS_CORRUPT))
    normalised = activation_patching(lm, PAIRS_CLEAN, PAIRS_CORRUPT, hook="mlp_out",
                                     metric=lambda logits: (difference(logits) - corrupt) / (clean - corrupt))
    plain = activation_patching(lm, PAIRS_CLEAN, PAIRS_CORRUPT, answers, hook="mlp_out")
    np.testing.assert_allclose(normalised, (plain - corrupt) / (clean - corrupt), rtol=0, atol=1e-10)

    def mean_log_prob(logits):  # of token 7 at every position: needs every position's logits
        shifted = logits - logits.max(-1, keepdims=True)
        return np.mean(shifted[..., 7] - np.log(np.exp(shifted).sum(-1)))

    found = activation_patching(lm, PAIRS_CLEAN, PAIRS_CORRUPT, hook="attn_out", metric=mean_log_prob,
                                logits_to_keep=0)
    _, clean_cache = run_with_cache(lm, PAIRS_CLEAN, names=["blocks.1.hook_attn_out"])

    def put_back(value, name):
        value = value.copy()
        value[:, 2] = clean_cache[name][:, 2]
        return value

    with hooks(lm, {"blocks.1.hook_attn_out": put_back}):
        want = mean_log_prob(lm(PAIRS_CORRUPT))
    np.testing.assert_allclose(found[1, 2], want, rtol=0, atol=1e-12)


def test_metric_arguments_are_checked():
    lm = _tiny()
    with pytest.raises(ValueError, match="give answer_ids or metric, not both"):
        activation_patching(lm, [1, 2], [1, 3], (4, 5), metric=lambda logits: 0.0)
    with pytest.raises(ValueError, match=r"give answer_ids \(correct, incorrect\) for the logit-difference metric"):
        activation_patching(lm, [1, 2], [1, 3])
    with pytest.raises(ValueError, match=r"metric must return one real number for the logits of a batch "
                                         r"\(1, 1, 50\), got ndarray of shape \(1,\)"):
        activation_patching(lm, [1, 2], [1, 3], metric=lambda logits: logits[:, -1, 4])
    with pytest.raises(TypeError, match="metric must be callable"):
        activation_patching(lm, [1, 2], [1, 3], metric="logit_diff")
    with pytest.raises(ValueError, match=r"or one such pair per prompt \(2, 2\)"):
        activation_patching(lm, [[1, 2], [2, 2]], [[1, 3], [2, 3]], [[4, 5], [4, 5], [4, 5]])
