"""attnkit's SAEs and transcoders against SAELens 6.54's own, on the same model and the same SAE folders.

Each SAE is made by SAELens (random weights), written by its own ``save_model`` and read by
``attnkit.explain.load_sae``. Two comparisons:

- the SAE alone: SAELens's ``encode`` / ``decode`` of the activations attnkit's spliced SAE read
  (``hook_sae_input``) equal attnkit's features and reconstruction to 1e-6 of their largest magnitude (float32
  rounding of one matrix product);
- spliced into the model: SAELens's ``SAETransformerBridge.run_with_cache_with_saes`` on TransformerLens's bridge
  of the tiny llama (booted offline, ``lens_referee``) against attnkit's ``run_with_cache_with_saes`` on the same
  folder: features and logits, with and without the error term, to 1e-6 as well (the two models agree to a few
  float32 roundings on this tiny llama).
"""
from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("transformer_lens", reason="TransformerLens carries SAELens's bridge: see constraints.txt")
if importlib.util.find_spec("sae_lens") is None:  # its package __init__ is never run (sae_referee)
    pytest.skip("SAELens is the referee: pip install --no-deps sae-lens==6.54.12", allow_module_level=True)
from attnkit.explain import load_sae, run_with_cache_with_saes  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from lens_referee import boot  # noqa: E402
from sae_referee import import_sae_lens  # noqa: E402

IDS = np.array([[5, 17, 3, 60, 42, 9, 77, 21, 3], [8, 2, 94, 13, 13, 50, 7, 66, 31]])  # (2, 9)
ALONE = 1e-6
TOL = 1e-6  # measured: 4.6e-7 at worst (the layer-norm SAE's features on the bridge)
MODEL = "llama_gqa"
# SAEs write resid_pre, resid_post, attn_out and mlp_out here, not resid_mid: the bridge's hook_resid_mid is the MLP
# norm's input (a replacement there reaches the MLP only), attnkit's the residual stream itself (HookedTransformer's).
# The transcoders read it, where the two agree.
# (label, SAELens class, config options, metadata hook names)
CASES = {
    "standard_resid_post": ("StandardSAE", {}, {"hook_name": "blocks.1.hook_resid_post"}),
    "standard_no_b_dec": ("StandardSAE", {"apply_b_dec_to_input": False}, {"hook_name": "blocks.0.hook_mlp_out"}),
    "jumprelu_resid_pre": ("JumpReLUSAE", {}, {"hook_name": "blocks.1.hook_resid_pre"}),
    "topk_attn_out": ("TopKSAE", {"k": 5}, {"hook_name": "blocks.0.hook_attn_out"}),
    "topk_rescaled": ("TopKSAE", {"k": 7, "rescale_acts_by_decoder_norm": True},
                      {"hook_name": "blocks.0.hook_resid_post"}),
    "hook_z": ("StandardSAE", {"reshape_activations": "hook_z"}, {"hook_name": "blocks.1.attn.hook_z"}),
    "layer_norm": ("StandardSAE", {"normalize_activations": "layer_norm"}, {"hook_name": "blocks.1.hook_resid_post"}),
    "norm_rescale_topk": ("TopKSAE", {"k": 6, "normalize_activations": "constant_norm_rescale"},
                          {"hook_name": "blocks.0.hook_attn_out"}),
    "transcoder": ("Transcoder", {"apply_b_dec_to_input": False},
                   {"hook_name": "blocks.0.hook_resid_mid", "hook_name_out": "blocks.0.hook_mlp_out"}),
    "jumprelu_transcoder": ("JumpReLUTranscoder", {"apply_b_dec_to_input": False},
                            {"hook_name": "blocks.1.hook_resid_mid", "hook_name_out": "blocks.1.hook_mlp_out"}),
}


@pytest.fixture(scope="module")
def lens(tmp_path_factory):
    """(SAELens's modules, its SAETransformerBridge of the tiny llama, attnkit's model of the same folder)."""
    sae_modules, bridge_module = import_sae_lens()
    root = tmp_path_factory.mktemp("hf_sae")
    bridge, folder = boot(MODEL, root)
    plain = bridge.__class__
    bridge.__class__ = bridge_module.SAETransformerBridge  # as SAETransformerBridge.boot_transformers does
    bridge._acts_to_saes, bridge._transcoder_output_hooks = {}, {}
    yield sae_modules, bridge, load_causal_lm(folder), root
    # the bridge is booted once for every referee test: give the others back the bridge they booted
    bridge.__class__ = plain
    for name in ("_acts_to_saes", "_transcoder_output_hooks"):
        bridge.__dict__.pop(name, None)


def make_sae(sae_modules, label: str, d_model: int, folder, seed: int):
    """SAELens's SAE of ``CASES[label]`` with random weights (thresholds that let about half the features fire),
    saved by SAELens into ``folder``."""
    class_name, options, metadata = CASES[label]
    sae_class = getattr(sae_modules, class_name)
    config_class = getattr(sae_modules, class_name + "Config")
    extra = {"d_out": d_model} if "Transcoder" in class_name else {}
    cfg = config_class(d_in=d_model, d_sae=24, **extra, **options)
    for key, value in metadata.items():
        cfg.metadata[key] = value
    sae = sae_class(cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sae.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * (0.3 if name != "threshold" else 1.0))
            if name == "threshold":
                param.copy_(param.abs())
    sae.eval()
    sae.save_model(folder)
    return sae


def lens_run(bridge, sae, use_error_term: bool):
    with warnings.catch_warnings():  # SAELens's and TransformerLens's notices are not attnkit's
        warnings.simplefilter("ignore")
        logits, cache = bridge.run_with_cache_with_saes(torch.from_numpy(IDS), saes=[sae],
                                                        use_error_term=use_error_term)
    acts = cache[bridge.get_sae_hook_name(sae)].detach().numpy()
    return logits.detach().numpy(), acts


def relative(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours.astype(np.float64) - theirs).max()) / max(1.0, float(np.abs(theirs).max()))


@pytest.mark.parametrize("label", sorted(CASES))
def test_features_equal_sae_lens_encode_and_decode(label, lens, tmp_path):
    sae_modules, _, lm, _ = lens
    theirs = make_sae(sae_modules, label, lm.config.hidden_size, tmp_path / label, seed=len(label))
    ours = load_sae(tmp_path / label)
    _, cache = run_with_cache_with_saes(lm, IDS, [ours], names=[])
    prefix = ours.output_hook_name
    x = cache[f"{prefix}.hook_sae_input"]  # (B, L, D)
    if label == "hook_z":  # SAELens's hook_z SAE reads the heads' outputs unflattened, (B, L, H, Dh)
        x = x.reshape(x.shape[:2] + (lm.config.num_heads, -1))
    with torch.no_grad():  # SAELens's decode undoes the normalisation of the encode just before it
        acts = theirs.encode(torch.from_numpy(x)).numpy()
        out = theirs.decode(torch.from_numpy(cache[f"{prefix}.hook_sae_acts_post"])).numpy()
    out = out.reshape(acts.shape[:2] + (-1,))
    assert all(cache[f"{prefix}.{p}"].dtype == np.float32 for p in ("hook_sae_acts_post", "hook_sae_output"))
    assert 0 < (acts > 0).mean() < 0.9, "some features fire and some do not"
    assert relative(cache[f"{prefix}.hook_sae_acts_post"], acts) <= ALONE
    assert ((cache[f"{prefix}.hook_sae_acts_post"] > 0) == (acts > 0)).all()
    assert relative(cache[f"{prefix}.hook_sae_output"], out) <= ALONE


@pytest.mark.parametrize("use_error_term", [False, True])
@pytest.mark.parametrize("label", sorted(CASES))
def test_spliced_model_equals_sae_lens_bridge(label, use_error_term, lens, tmp_path):
    sae_modules, bridge, lm, _ = lens
    theirs = make_sae(sae_modules, label, lm.config.hidden_size, tmp_path / label, seed=len(label))
    their_logits, their_acts = lens_run(bridge, theirs, use_error_term)
    logits, cache = run_with_cache_with_saes(lm, IDS, [load_sae(tmp_path / label)], use_error_term=use_error_term,
                                             names=[])
    ours = cache[f"{theirs.cfg.metadata.hook_name_out or theirs.cfg.metadata.hook_name}.hook_sae_acts_post"]
    assert relative(ours, their_acts) <= TOL
    assert relative(logits, their_logits) <= TOL
    plain = lm(IDS)
    if use_error_term:  # the model's own logits, to float32 rounding
        np.testing.assert_allclose(logits, plain, rtol=0, atol=1e-5 * max(1.0, np.abs(plain).max()))
    else:  # the splice changed them: the comparison above is not of the unspliced model
        assert np.abs(logits - plain).max() > 1e-3


def test_a_wrong_feature_is_seen(lens, tmp_path):
    """The comparison can fail: one threshold moved changes which features fire, and SAELens's features show it."""
    sae_modules, bridge, lm, _ = lens
    label = "jumprelu_resid_pre"
    theirs = make_sae(sae_modules, label, lm.config.hidden_size, tmp_path / label, seed=3)
    _, their_acts = lens_run(bridge, theirs, False)
    ours = load_sae(tmp_path / label)
    _, cache = run_with_cache_with_saes(lm, IDS, [ours], names=[])
    acts = cache["blocks.1.hook_resid_pre.hook_sae_acts_post"]
    fired = np.argwhere(acts > 0)[0]
    threshold = ours.threshold.copy()
    threshold[fired[-1]] = acts[tuple(fired)] * 2 + np.abs(threshold).max()
    moved = type(ours)(ours.W_enc, ours.b_enc, ours.W_dec, ours.b_dec, hook_name=ours.hook_name,
                       architecture="jumprelu", threshold=threshold)
    _, cache = run_with_cache_with_saes(lm, IDS, [moved], names=[])
    assert relative(cache["blocks.1.hook_resid_pre.hook_sae_acts_post"], their_acts) > 1e-3
