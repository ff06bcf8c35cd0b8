"""SAEs and transcoders spliced into attnkit's models: the error term keeps the model's outputs, a splice is the
composition it claims to be, feature hooks edit what reaches the model, the exact gradient through every splice
(central differences in float64), the sum identity of feature attributions where the metric is linear in the
point, and ``load_sae``'s refusals. SAELens's own numbers are in test_sae_lens.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from attnkit.explain import SAE, feature_attribution, hooks, load_sae, run_with_cache_with_saes, saes
from attnkit.models import CausalLM, DecoderConfig, MLPConfig

IDS = np.array([[1, 4, 2, 7, 3, 9], [5, 5, 0, 8, 6, 2]])  # (2, 6)
D, HZ = 12, 8  # the model width, and attn.hook_z flattened (2 heads of 4)


@pytest.fixture(scope="module")
def lm():
    cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=D, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(16))
    return CausalLM(cfg, rng=0).astype(np.float64)


def random_sae(hook_name, *, d_in=D, d_out=None, architecture="standard", seed=0, **options):
    rng = np.random.default_rng(seed)
    d_out = d_in if d_out is None else d_out
    s = 20
    if architecture.startswith("jumprelu"):
        options["threshold"] = np.abs(rng.normal(size=s)) * 0.3
    return SAE(rng.normal(size=(d_in, s)) * 0.5, rng.normal(size=s) * 0.2, rng.normal(size=(s, d_out)) * 0.3,
               rng.normal(size=d_out) * 0.1, hook_name=hook_name, architecture=architecture,
               apply_b_dec_to_input=not architecture.endswith("transcoder") and options.pop("apply", True),
               **options)


SPLICES = {
    "resid_post": lambda: random_sae("blocks.0.hook_resid_post"),
    "hook_z": lambda: random_sae("blocks.1.attn.hook_z", d_in=HZ, architecture="jumprelu", seed=1),
    "mlp_out_topk": lambda: random_sae("blocks.1.hook_mlp_out", architecture="topk", k=4, seed=2),
    "final_norm": lambda: random_sae("ln_final.hook_normalized", seed=3, rescale_acts_by_decoder_norm=False),
    "transcoder": lambda: random_sae("blocks.0.hook_resid_mid", architecture="transcoder", seed=4,
                                     hook_name_out="blocks.0.hook_mlp_out"),
    "layer_norm": lambda: random_sae("blocks.1.hook_resid_pre", seed=8, normalize_activations="layer_norm"),
    "norm_rescale": lambda: random_sae("blocks.0.hook_attn_out", architecture="topk", k=6, seed=9,
                                       normalize_activations="constant_norm_rescale"),
}


@pytest.mark.parametrize("where", sorted(SPLICES))
def test_the_error_term_keeps_the_models_logits(lm, where):
    sae = SPLICES[where]()
    logits, cache = run_with_cache_with_saes(lm, IDS, [sae], use_error_term=True)
    np.testing.assert_allclose(logits, lm(IDS), rtol=0, atol=1e-12)
    error = cache[f"{sae.output_hook_name}.hook_sae_error"]
    assert np.abs(error).max() > 1e-2  # the reconstruction alone is off: the error term carries the difference
    spliced, _ = run_with_cache_with_saes(lm, IDS, [sae], names=[])
    assert np.abs(spliced - logits).max() > 1e-3


@pytest.mark.parametrize("where", sorted(SPLICES))
def test_a_splice_is_the_reconstruction_in_place_of_the_value(lm, where):
    """Without the error term the spliced point holds ``decode(encode(x))``, as a plain hook would put it there."""
    sae = SPLICES[where]()
    logits, cache = run_with_cache_with_saes(lm, IDS, [sae])
    kept = {}

    def keep(value, name):
        kept[name] = np.array(value)

    def replace(value, name):
        x = kept[sae.hook_name].reshape(value.shape[:2] + (-1,))  # (B, L, D)
        return sae(x).reshape(value.shape)

    table = {sae.hook_name: keep, sae.output_hook_name: replace} if sae.is_transcoder else \
        {sae.hook_name: lambda v, n: (keep(v, n), replace(v, n))[1]}
    with hooks(lm, table):
        expected = lm(IDS)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-12)
    acts = cache[f"{sae.output_hook_name}.hook_sae_acts_post"]
    assert acts.shape == IDS.shape + (20,) and 0 < (acts > 0).mean() < 1
    if sae.k is not None:
        assert ((acts > 0).sum(-1) <= sae.k).all()
    assert list(cache)[:1] == ["hook_embed"]


def test_generation_with_the_error_term_is_the_models(lm):
    """Every decoding step runs the splice on its new positions only; with the error term the greedy tokens are the
    model's, without it (the reconstruction alone) they differ."""
    prompt = IDS[:1]
    plain = lm.generate(prompt, max_new_tokens=8, do_sample=False)
    sae = SPLICES["mlp_out_topk"]()
    with saes(lm, [sae], use_error_term=True):
        kept = lm.generate(prompt, max_new_tokens=8, do_sample=False)
    with saes(lm, [sae, SPLICES["resid_post"]()]):
        changed = lm.generate(prompt, max_new_tokens=8, do_sample=False)
    np.testing.assert_array_equal(kept, plain)
    assert (changed != plain).any()


def test_feature_hooks_ablate_and_steer_what_reaches_the_model(lm):
    """With the error term the point passes on ``x + (edited - clean features) @ W_dec``: zeroing a feature takes
    its decoder row away, adding to one adds the row."""
    sae = SPLICES["resid_post"]()
    name = "blocks.0.hook_resid_post"
    _, clean = run_with_cache_with_saes(lm, IDS, [sae], use_error_term=True)
    acts, x = clean[f"{name}.hook_sae_acts_post"], clean[f"{name}.hook_sae_input"]
    feature = int(np.argmax((acts > 0).sum((0, 1))))

    def ablate(value, _):
        value = value.copy()
        value[..., feature] = 0.0
        return value

    def steer(value, _):
        value = value.copy()
        value[..., feature] += 3.0
        return value

    for fn, change in ((ablate, -acts[..., feature, None] * sae.W_dec[feature]),
                       (steer, 3.0 * sae.W_dec[feature] + 0 * acts[..., :1])):
        edited, cache = run_with_cache_with_saes(lm, IDS, [sae], use_error_term=True, names=[name],
                                                 forward={f"{name}.hook_sae_acts_post": fn})
        np.testing.assert_allclose(cache[name], x + change, rtol=0, atol=1e-12)
        np.testing.assert_allclose(cache[f"{name}.hook_sae_output"], x + change, rtol=0, atol=1e-12)
        assert np.abs(edited - lm(IDS)).max() > 1e-4


def embedding_fd(lm, splices, error, direction, eps=1e-6):
    def run(delta):
        with saes(lm, splices, use_error_term=error, forward={"hook_embed": lambda v, n: v + delta}):
            return lm(IDS)[:, -1, 3].sum()

    return (run(eps * direction) - run(-eps * direction)) / (2 * eps)


def test_gradients_through_every_splice_match_finite_differences(lm):
    """Four splices in a row (an SAE on block 0's output, a JumpReLU SAE on block 1's head outputs, a transcoder
    after it, a TopK SAE after all): every feature's gradient, and the input embeddings' (which reaches them through
    each encoder), match central differences in float64."""
    chain = [SPLICES["resid_post"](), SPLICES["hook_z"](),
             random_sae("blocks.1.hook_resid_mid", architecture="jumprelu_transcoder", seed=5,
                        hook_name_out="blocks.1.hook_mlp_out"),
             random_sae("blocks.1.hook_resid_post", architecture="topk", k=5, seed=6)]
    target = np.full(2, 3)
    result = feature_attribution(lm, IDS, chain, target_token=target, use_error_term=False)
    rng = np.random.default_rng(7)
    for sae in chain:
        name = sae.output_hook_name
        acts = result.activations[name]
        active = np.argwhere(acts > 0)
        for b, pos, f in active[rng.choice(len(active), 4, replace=False)]:
            def run(delta, b=b, pos=pos, f=f, name=name):
                def nudge(value, _):
                    value = value.copy()
                    value[b, pos, f] += delta
                    return value
                with saes(lm, chain, forward={f"{name}.hook_sae_acts_post": nudge}):
                    return lm(IDS)[b, -1, 3]
            fd = (run(1e-6) - run(-1e-6)) / 2e-6
            np.testing.assert_allclose(result.gradients[name][b, pos, f], fd, rtol=1e-6, atol=1e-9)
        assert np.abs(result.gradients[name]).max() > 1e-3
    # the embeddings' gradient of the spliced model, from the same backward
    with saes(lm, chain):
        lm(IDS)
        grad_logits = np.zeros((2, IDS.shape[1], 11))
        grad_logits[:, -1, 3] = 1.0
        with lm.input_gradients_only():
            grad = lm.backward(grad_logits)  # (B, L, D)
    direction = rng.normal(size=grad.shape)
    np.testing.assert_allclose((grad * direction).sum(), embedding_fd(lm, chain, False, direction), rtol=1e-6)


def test_gradients_through_normalising_saes_match_finite_differences(lm):
    """SAELens's two normalisations of each position (layer norm, constant norm), undone on the output: the
    features' and the input embeddings' gradients through both equal central differences."""
    chain = [SPLICES["norm_rescale"](), SPLICES["layer_norm"](),
             random_sae("ln_final.hook_normalized", seed=10, normalize_activations="layer_norm")]
    result = feature_attribution(lm, IDS, chain, target_token=3, use_error_term=False)
    for sae in chain:
        name = sae.output_hook_name
        b, pos, f = np.argwhere(result.activations[name] > 0)[-1]

        def run(delta, b=b, pos=pos, f=f, name=name):
            def nudge(value, _):
                value = value.copy()
                value[b, pos, f] += delta
                return value
            with saes(lm, chain, forward={f"{name}.hook_sae_acts_post": nudge}):
                return lm(IDS)[b, -1, 3]
        fd = (run(1e-6) - run(-1e-6)) / 2e-6
        np.testing.assert_allclose(result.gradients[name][b, pos, f], fd, rtol=1e-6, atol=1e-9)
    with saes(lm, chain):
        lm(IDS)
        grad_logits = np.zeros((2, IDS.shape[1], 11))
        grad_logits[:, -1, 3] = 1.0
        with lm.input_gradients_only():
            grad = lm.backward(grad_logits)  # (B, L, D)
    direction = np.random.default_rng(11).normal(size=grad.shape)
    np.testing.assert_allclose((grad * direction).sum(), embedding_fd(lm, chain, False, direction), rtol=1e-6)


def test_a_backward_after_the_block_is_refused(lm):
    """Leaving the block discards the spliced forward's saved state: the backward cannot silently differentiate
    the unspliced model at the spliced forward's activations."""
    with saes(lm, [SPLICES["transcoder"]()]):
        lm(IDS)
    with pytest.raises(RuntimeError, match="forward without a cache"):
        lm.backward(np.zeros((2, IDS.shape[1], 11)))


def test_a_replaced_feature_is_a_constant_of_the_backward(lm):
    """Ablating every feature of the first SAE leaves the model's input nothing to change through it: the input
    embeddings' gradient is then that of the path around the splice (zero for a resid_post SAE without error)."""
    sae = SPLICES["resid_post"]()
    name = "blocks.0.hook_resid_post"
    with saes(lm, [sae], forward={f"{name}.hook_sae_acts_post": lambda v, n: np.zeros_like(v)}):
        lm(IDS)
        grad_logits = np.zeros((2, IDS.shape[1], 11))
        grad_logits[:, -1, 3] = 1.0
        with lm.input_gradients_only():
            grad = lm.backward(grad_logits)
    assert not grad.any()


@pytest.mark.parametrize("normalize", ["none", "layer_norm"])
@pytest.mark.parametrize("use_error_term", [True, False])
def test_attributions_sum_to_the_logit_difference_at_the_final_norm(lm, use_error_term, normalize):
    """Logits are linear in the final norm's output, so features, error and b_dec (with a layer-norm SAE's restored
    mean) account for the whole logit difference of the spliced model."""
    sae = random_sae("ln_final.hook_normalized", seed=3, normalize_activations=normalize)
    result = feature_attribution(lm, IDS, [sae], target_token=[3, 5], incorrect_token=7,
                                 use_error_term=use_error_term)
    name = "ln_final.hook_normalized"
    total = result.attributions[name].sum((1, 2)) + result.error_attributions[name].sum(1) + \
        result.bias_attributions[name].sum(1)
    np.testing.assert_allclose(total, result.metric, rtol=0, atol=1e-12)
    logits, _ = run_with_cache_with_saes(lm, IDS, [sae], use_error_term=use_error_term, names=[])
    np.testing.assert_allclose(result.metric, logits[[0, 1], -1, [3, 5]] - logits[:, -1, 7], rtol=0, atol=1e-12)
    assert (result.error_attributions[name] != 0).any() == use_error_term
    assert np.abs(result.attributions[name][:, :-1]).max() == 0  # only the explained position's features count


def test_the_sum_identity_fails_where_the_metric_is_not_linear(lm):
    """Before a norm and an MLP the features' gradient times activation is only a first-order estimate: the sum
    misses the logit (the identity above is not a tautology of the bookkeeping)."""
    sae = SPLICES["resid_post"]()
    result = feature_attribution(lm, IDS, [sae], target_token=3, use_error_term=True)
    name = sae.output_hook_name
    total = result.attributions[name].sum((1, 2)) + result.error_attributions[name].sum(1) + \
        result.bias_attributions[name].sum(1)
    assert np.abs(total - result.metric).max() > 1e-3


def test_passes_gradient_lets_a_replacement_carry_the_gradient(lm):
    """The hook mechanism under splices: a forward hook marked ``passes_gradient`` with a backward hook mapping the
    gradient is differentiated through; the same replacement unmarked is a constant (zero gradient below it)."""
    def doubled(value, name):
        return 2.0 * value

    def twice(grad, name):
        return 2.0 * grad

    grad_logits = np.zeros((2, IDS.shape[1], 11))
    grad_logits[:, -1, 3] = 1.0
    marked = lambda v, n: doubled(v, n)  # noqa: E731
    marked.passes_gradient = True
    grads = {}
    for label, forward in (("marked", marked), ("plain", doubled)):
        with hooks(lm, {"blocks.0.hook_resid_post": forward}, backward={"blocks.0.hook_resid_post": twice}):
            lm(IDS)
            with lm.input_gradients_only():
                grads[label] = lm.backward(grad_logits)
    assert not grads["plain"].any()
    direction = np.random.default_rng(0).normal(size=grads["marked"].shape)

    def run(delta):
        with hooks(lm, {"hook_embed": lambda v, n: v + delta, "blocks.0.hook_resid_post": doubled}):
            return lm(IDS)[:, -1, 3].sum()

    fd = (run(1e-6 * direction) - run(-1e-6 * direction)) / 2e-6
    np.testing.assert_allclose((grads["marked"] * direction).sum(), fd, rtol=1e-6)


# -- loading ---------------------------------------------------------------------------------------------------
def write_folder(folder, cfg, tensors):
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
              str(folder / "sae_weights.safetensors"))
    return folder


def standard_files(d_in=D, s=6):
    rng = np.random.default_rng(0)
    cfg = {"d_in": d_in, "d_sae": s, "architecture": "standard", "apply_b_dec_to_input": True,
           "normalize_activations": "none", "metadata": {"hook_name": "blocks.0.hook_resid_post"}}
    tensors = {"W_enc": rng.normal(size=(d_in, s)), "b_enc": rng.normal(size=s), "W_dec": rng.normal(size=(s, d_in)),
               "b_dec": rng.normal(size=d_in)}
    return cfg, tensors


def test_load_sae_reads_a_folder(tmp_path):
    cfg, tensors = standard_files()
    sae = SAE.load_from_disk(write_folder(tmp_path / "sae", cfg, tensors))
    assert sae.W_enc.dtype == np.float32 and not sae.W_enc.flags.writeable
    np.testing.assert_array_equal(sae.W_dec, tensors["W_dec"].astype(np.float32))
    assert (sae.hook_name, sae.d_in, sae.d_sae, sae.is_transcoder) == ("blocks.0.hook_resid_post", D, 6, False)


@pytest.mark.parametrize("edit, message", [
    (lambda c, t: c.update(normalize_activations="covariance_whitening"), "'covariance_whitening' is not supp"),
    (lambda c, t: c.update(normalize_activations="layer_norm", architecture="transcoder", d_out=D,
                           apply_b_dec_to_input=False), "'layer_norm' on a transcoder"),
    (lambda c, t: c.update(normalize_activations="expected_average_only_in"), "expected_average_only_in"),
    (lambda c, t: c.update(architecture="gated"), "architecture 'gated'"),
    (lambda c, t: c.update(metadata={}), "no hook name"),
    (lambda c, t: t.update(W_enc=np.zeros((D, 5))), "tensor 'W_enc' has shape"),
    (lambda c, t: t.pop("b_dec"), "no tensor 'b_dec'"),
    (lambda c, t: t.update(W_skip=np.zeros((D, D))), "unexpected tensor 'W_skip'"),
    (lambda c, t: c.update(architecture="jumprelu"), "no tensor 'threshold'"),
    (lambda c, t: c.update(architecture="topk", k=0), "k must be an int in \\[1, d_sae = 6\\]"),
    (lambda c, t: c.update(architecture="topk"), "k must be an int"),
    (lambda c, t: c.update(architecture="transcoder", d_out=D), "apply_b_dec_to_input must be False"),
])
def test_load_sae_refuses_by_name(tmp_path, edit, message):
    cfg, tensors = standard_files()
    edit(cfg, tensors)
    with pytest.raises(ValueError, match=message):
        load_sae(write_folder(tmp_path / "sae", cfg, tensors))


def test_load_sae_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load_sae(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="cfg.json"):
        load_sae(tmp_path / "empty")


@pytest.mark.parametrize("hook_name, message", [
    ("blocks.0.ln2.hook_normalized", "no hook point 'blocks.0.ln2.hook_normalized', the MLP's normed input"),
    ("blocks.1.hook_mlp_in", "hook_mlp_in"),
    ("blocks.0.hook_resid_pots", "did you mean blocks.0.hook_resid_post"),
])
def test_points_attnkit_does_not_have_are_refused_by_name(lm, hook_name, message):
    sae = random_sae(hook_name)
    with pytest.raises(ValueError, match=message):
        run_with_cache_with_saes(lm, IDS, [sae])


def test_splice_argument_errors(lm):
    sae = SPLICES["resid_post"]()
    with pytest.raises(ValueError, match="reads 12 features, but blocks.1.attn.hook_z has 8"):
        run_with_cache_with_saes(lm, IDS, [random_sae("blocks.1.attn.hook_z")])
    with pytest.raises(ValueError, match="two SAEs use blocks.0.hook_resid_post"):
        run_with_cache_with_saes(lm, IDS, [sae, SPLICES["resid_post"]()])
    with pytest.raises(TypeError, match="non-empty list of SAE"):
        run_with_cache_with_saes(lm, IDS, [])
    with pytest.raises(ValueError, match="no spliced SAE has it"):
        with saes(lm, [sae], forward={"blocks.1.hook_resid_post.hook_sae_acts_post": lambda v, n: None}):
            pass
    with pytest.raises(ValueError, match="before blocks.1.hook_resid_pre"):
        run_with_cache_with_saes(lm, IDS, [random_sae("blocks.1.hook_resid_pre", architecture="transcoder",
                                                      hook_name_out="blocks.0.hook_mlp_out")])


def test_loading_and_splicing_import_neither_sae_lens_nor_torch(tmp_path):
    """SAELens is a test-only referee: attnkit reads its folders itself."""
    import subprocess
    import sys

    folder = write_folder(tmp_path / "sae", *standard_files())
    code = ("import sys, numpy as np\n"
            "from attnkit.explain import load_sae, run_with_cache_with_saes\n"
            "from attnkit.models import CausalLM, DecoderConfig, MLPConfig\n"
            f"sae = load_sae({str(folder)!r})\n"
            f"lm = CausalLM(DecoderConfig(family='llama', vocab_size=11, hidden_size={D}, num_layers=1, num_heads=2,"
            " num_kv_heads=1, head_dim=4, mlp=MLPConfig(16)), rng=0)\n"
            "run_with_cache_with_saes(lm, np.array([[1, 2, 3]]), [sae])\n"
            "print(sorted(m for m in ('sae_lens', 'torch', 'transformer_lens') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
