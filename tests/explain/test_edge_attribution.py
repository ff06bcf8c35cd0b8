"""edge_attribution (EAP and EAP-IG): the identities hold at float64 rounding on every kind of block; the scores
out of a node are attribution patching's estimate for it and the scores out of the input integrated gradients';
on a model made linear (attention patterns frozen, no norms, identity MLPs) the scores equal the patching of
single edges exactly, and on the real model they approach it at first order."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.explain import (  # noqa: E402
    attribution_patching,
    edge_attribution,
    hooks,
    integrated_gradients,
    path_patching,
    run_with_cache,
)
from attnkit.layers.identity import Identity  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import saved_model  # noqa: E402

CLEAN = np.array([[5, 17, 3, 60, 42, 9], [7, 8, 9, 10, 11, 12]])
CORRUPT = np.array([[5, 17, 30, 60, 42, 9], [7, 8, 19, 10, 11, 12]])
ANSWERS = (4, 7)


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_eap")


def _lm(name, hf_root):
    return load_causal_lm(saved_model(name, hf_root)[0], dtype=np.float64)


def _metric(logits):
    return float(np.mean(logits[:, -1, ANSWERS[0]] - logits[:, -1, ANSWERS[1]]))


# sequential and parallel blocks, post-norms and soft-caps, Gated DeltaNet layers, experts, short convolutions,
# Mamba-2 layers, latent attention, LayerNorm with learned positions
@pytest.mark.parametrize("name", ["llama_gqa", "gpt_neox", "gemma2", "qwen3_next", "gpt_oss", "lfm2", "bamba",
                                  "deepseek_v3", "gpt2"])
@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_incoming_and_outgoing_scores_sum_to_the_nodes_attributions(name, method, hf_root):
    lm = _lm(name, hf_root)
    found = edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS, method=method, steps=4)
    assert found.residuals["incoming"] < 1e-10 and found.residuals["outgoing"] < 1e-10
    np.testing.assert_allclose(found.scores.sum(axis=0), found.node_inputs, rtol=0, atol=1e-10)
    np.testing.assert_allclose(found.scores.sum(axis=1), found.node_outputs, rtol=0, atol=1e-10)
    assert np.abs(found.node_inputs).max() > 1e-3  # the identities are not about zeros
    # no score off the edges; on them, zeros only where no difference reaches (the tokens before the corrupted
    # one, a sliding window's reach, the last position's own input)
    assert (found.scores[~found.mask] == 0).all() and (found.scores[found.mask] != 0).mean() > 0.8
    assert found.metric_clean == pytest.approx(_metric(lm(CLEAN)), abs=1e-12)
    assert found.metric_corrupted == pytest.approx(_metric(lm(CORRUPT)), abs=1e-12)


@pytest.mark.parametrize("name", ["llama_gqa", "gpt_neox"])
def test_the_scores_out_of_a_node_are_attribution_patching(name, hf_root):
    """The MLPs' against ``hook="mlp_out"``, each layer's heads together against ``"attn_out"``, the input against
    block 0's ``"resid_pre"``, all summed over the positions."""
    lm = _lm(name, hf_root)
    found = edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS)
    out = found.scores.sum(axis=1)
    mlp = attribution_patching(lm, CLEAN, CORRUPT, ANSWERS, hook="mlp_out").sum(axis=1)
    attn = attribution_patching(lm, CLEAN, CORRUPT, ANSWERS, hook="attn_out").sum(axis=1)
    resid = attribution_patching(lm, CLEAN, CORRUPT, ANSWERS, hook="resid_pre").sum(axis=1)
    for i in range(lm.config.num_layers):
        assert out[found.upstream.index(f"m{i}")] == pytest.approx(mlp[i], abs=1e-12)
        heads = [found.upstream.index(f"a{i}.h{h}") for h in range(lm.config.num_heads)]
        assert out[heads].sum() == pytest.approx(attn[i], abs=1e-12)
    assert out[0] == pytest.approx(resid[0], abs=1e-12)
    # and the scores into the logits are that of the final residual stream
    assert found.scores[:, -1].sum() == pytest.approx(found.node_inputs[-1], abs=1e-12)


def test_a_layers_heads_input_gradients_sum_to_its_attentions(hf_root):
    """Independently of the copies: the heads' input attributions of a layer sum to the input difference times
    the attention branch's input gradient, ``grad(resid_pre) - grad(resid_mid)`` of a plain backward (grouped
    queries: each head's share of the shared keys and values)."""
    lm = _lm("llama_gqa", hf_root)
    found = edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS)
    grads = {}
    names = [f"blocks.{i}.hook_resid_{p}" for i in range(lm.config.num_layers) for p in ("pre", "mid")]
    _, clean = run_with_cache(lm, CLEAN, names=names)
    with hooks(lm, backward={n: lambda g, name: grads.__setitem__(name, np.array(g)) for n in names}):
        _, corrupt = run_with_cache(lm, CORRUPT, names=names, logits_to_keep=1)
        grad_logits = np.zeros((2, 1, lm.config.vocab_size))
        grad_logits[:, 0, ANSWERS[0]], grad_logits[:, 0, ANSWERS[1]] = 0.5, -0.5
        lm.backward(grad_logits)
    for i in range(lm.config.num_layers):
        pre = f"blocks.{i}.hook_resid_pre"
        want = ((clean[pre] - corrupt[pre]) * (grads[pre] - grads[f"blocks.{i}.hook_resid_mid"])).sum()
        heads = [found.downstream.index(f"a{i}.h{h}") for h in range(lm.config.num_heads)]
        assert found.node_inputs[heads].sum() == pytest.approx(want, abs=1e-12)
        assert np.ptp(found.node_inputs[heads]) > 1e-6  # the heads differ


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
@pytest.mark.parametrize("rule", ["gausslegendre", "riemann_trapezoid"])
def test_the_scores_out_of_the_input_are_integrated_gradients(name, rule, hf_root):
    """EAP-IG interpolates the input embeddings: its scores out of ``input`` sum to integrated gradients of the
    logit difference from the corrupted prompt's embeddings (``foil``), gap for gap."""
    lm = _lm(name, hf_root)
    found = edge_attribution(lm, CLEAN[0], CORRUPT[0], answer_ids=ANSWERS, method="eap-ig", steps=6, rule=rule)
    _, cache = run_with_cache(lm, CORRUPT[0], names=["hook_embed"])
    ig = integrated_gradients(lm, CLEAN[0], target=ANSWERS[0], foil=ANSWERS[1], steps=6, method=rule,
                              baseline=cache["hook_embed"][0])
    assert found.scores[0].sum() == pytest.approx(ig.attributions.sum(), abs=1e-10)
    assert found.residuals["completeness"] == pytest.approx(ig.completeness_gap, abs=1e-10)


def test_eap_ig_completeness_gap_shrinks_with_the_steps(hf_root):
    lm = _lm("gemma2", hf_root)
    gaps = [abs(edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS, method="eap-ig",
                                 steps=steps).residuals["completeness"]) for steps in (2, 4, 8, 32)]
    first_order = abs(edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS).residuals["completeness"])
    assert gaps[3] < gaps[2] < gaps[1] < gaps[0] < first_order
    assert gaps[3] < 1e-10


def _linearised(name, hf_root):
    """The model with no norms, identity MLPs, and (by the hooks returned) every attention pattern frozen to the
    causal mean: the metric is affine in every node's output, so first order is exact."""
    lm = _lm(name, hf_root)
    lm.norm = Identity()
    for layer in lm.layers:
        layer.attn_norm, layer.mlp_norm, layer.mlp = Identity(), Identity(), Identity()
    length = CLEAN.shape[1]
    causal = np.tril(np.ones((length, length))) / np.arange(1, length + 1)[:, None]  # (L, L)

    def freeze(pattern, name):
        return np.broadcast_to(causal, pattern.shape).copy()

    frozen = {f"blocks.{i}.attn.hook_pattern": freeze for i in range(lm.config.num_layers)}
    return lm, frozen


def _patch_into_logits(lm, delta, scale=1.0):
    """The metric with one upstream node's difference (B, L, D), times ``scale``, added to the logits' input only."""
    last = f"blocks.{lm.config.num_layers - 1}.hook_resid_post"
    with hooks(lm, {last: lambda x, name: x + scale * delta}):
        return _metric(lm(CORRUPT, logits_to_keep=1))


def _differences(lm, found):
    """Each upstream node's clean - corrupted output (U, B, L, D), from the caches by the definition: the input,
    each head's z through its rows of W_O, each MLP's output."""
    _, clean = run_with_cache(lm, CLEAN)
    _, corrupt = run_with_cache(lm, CORRUPT)
    out = {"input": clean["blocks.0.hook_resid_pre"] - corrupt["blocks.0.hook_resid_pre"]}
    width = lm.config.head_dim
    for i, layer in enumerate(lm.layers):
        dz = clean[f"blocks.{i}.attn.hook_z"] - corrupt[f"blocks.{i}.attn.hook_z"]  # (B, L, H, Dh)
        for h in range(lm.config.num_heads):
            out[f"a{i}.h{h}"] = dz[:, :, h] @ layer.attention.W_O[h * width:(h + 1) * width]  # (B, L, D)
        out[f"m{i}"] = clean[f"blocks.{i}.hook_mlp_out"] - corrupt[f"blocks.{i}.hook_mlp_out"]
    return [out[name] for name in found.upstream]


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_on_a_linear_model_the_scores_are_single_edge_patching(name, hf_root):
    lm, frozen = _linearised(name, hf_root)
    with hooks(lm, frozen):
        found = edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS)
        ig = edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS, method="eap-ig", steps=3,
                              rule="riemann_left")
        base = _metric(lm(CORRUPT, logits_to_keep=1))
        deltas = _differences(lm, found)
        into_logits = [_patch_into_logits(lm, d) - base for d in deltas]
    np.testing.assert_allclose(found.scores[:, -1], into_logits, rtol=0, atol=1e-10)
    np.testing.assert_allclose(ig.scores, found.scores, rtol=0, atol=1e-10)  # a constant gradient: any rule
    assert abs(found.residuals["completeness"]) < 1e-10 and abs(ig.residuals["completeness"]) < 1e-10
    assert found.scores[:, -1].sum() == pytest.approx(found.metric_clean - found.metric_corrupted, abs=1e-10)
    # the input's direct edge reads the last position alone, which the corruption leaves as it is
    assert found.scores[0, -1] == 0 and np.abs(found.scores[1:, -1]).min() > 1e-6


def test_on_a_linear_model_head_to_head_scores_are_path_patching(hf_root):
    """A head -> head edge patched alone: the sender's clean output reaching the receiver's query, key and value
    only (path patching, one key/value head per query head)."""
    lm, frozen = _linearised("gpt2", hf_root)
    with hooks(lm, frozen):
        found = edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS)
        base = _metric(lm(CORRUPT, logits_to_keep=1))
        for receiver in range(lm.config.num_heads):
            patched = path_patching(lm, CLEAN, CORRUPT, ANSWERS, receivers=[(1, receiver)],
                                    receiver_input=("q", "k", "v"))[0] - base  # (H,): senders of layer 0
            scores = [found.score(f"a0.h{h}", f"a1.h{receiver}") for h in range(lm.config.num_heads)]
            np.testing.assert_allclose(scores, patched, rtol=0, atol=1e-10)
            assert np.abs(patched).min() > 1e-8


@pytest.mark.parametrize("name", ["llama_gqa", "gpt_neox"])
def test_the_scores_are_the_first_order_of_single_edge_patching(name, hf_root):
    """The real model: an edge into the logits patched by a fraction eps of the difference changes the metric by
    eps times the score plus O(eps^2)."""
    lm = _lm(name, hf_root)
    found = edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS)
    base = _metric(lm(CORRUPT, logits_to_keep=1))
    deltas = _differences(lm, found)
    # an edge into the logits reads the last position, which the corruption leaves as it is: the input's edge,
    # and a parallel block's m0 (reading the input alone) score 0 and change nothing
    reaching = [u for u in range(len(found.upstream)) if deltas[u][:, -1].any()]
    assert found.scores[[u for u in range(len(found.upstream)) if u not in reaching], -1].tolist() == \
        [0.0] * (len(found.upstream) - len(reaching))
    assert len(reaching) >= len(found.upstream) - 2
    for u in reaching:
        errors = [abs((_patch_into_logits(lm, deltas[u], eps) - base) / eps - found.scores[u, -1])
                  for eps in (1e-2, 1e-3)]
        assert errors[1] < errors[0] / 5  # the error is first order in eps
        assert errors[1] < 1e-2 * abs(found.scores[u, -1])


def test_a_metric_with_its_gradient_is_the_logit_difference(hf_root):
    lm = _lm("llama_gqa", hf_root)

    def metric(logits):
        grad = np.zeros_like(logits)
        grad[:, -1, ANSWERS[0]], grad[:, -1, ANSWERS[1]] = 0.5, -0.5
        return _metric(logits), grad

    mine = edge_attribution(lm, CLEAN, CORRUPT, metric=metric, method="eap-ig", steps=3)
    theirs = edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS, method="eap-ig", steps=3)
    np.testing.assert_allclose(mine.scores, theirs.scores, rtol=0, atol=1e-14)


def test_top_edges_and_the_json_graph(hf_root):
    lm = _lm("llama_gqa", hf_root)
    found = edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS)
    top = found.top_edges(5)
    assert len(top) == 5 and [abs(s) for _, _, s in top] == sorted((abs(s) for _, _, s in top), reverse=True)
    assert abs(top[0][2]) == np.abs(found.scores).max()
    assert found.score(top[0][0], top[0][1]) == top[0][2]
    signed = found.top_edges(3, absolute=False)
    assert signed[0][2] == found.scores[found.mask].max()
    graph = json.loads(found.to_json())
    n, heads = lm.config.num_layers, lm.config.num_heads
    assert graph["nodes"][0] == "input" and graph["nodes"][-1] == "logits"
    assert len(graph["nodes"]) == 2 + n * (heads + 1)
    assert len(graph["edges"]) == int(found.mask.sum())
    # each head reads the input and every node of the earlier layers; an MLP also its own layer's heads
    assert found.mask[:, found.downstream.index("a1.h0")].sum() == 1 + heads + 1
    assert found.mask[:, found.downstream.index("m1")].sum() == 1 + 2 * heads + 1
    assert found.mask[:, -1].all()
    assert {"from": "a0.h1", "to": "logits", "score": found.score("a0.h1", "logits")} in graph["edges"]
    assert graph["residuals"] == found.residuals and graph["method"] == "eap"


def test_a_parallel_blocks_mlp_does_not_read_its_attention(hf_root):
    lm = _lm("gpt_neox", hf_root)
    found = edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS)
    m1 = found.downstream.index("m1")
    assert not found.mask[found.upstream.index("a1.h0"), m1] and found.mask[found.upstream.index("a0.h0"), m1]
    with pytest.raises(ValueError, match="no edge a1.h0 -> m1"):
        found.score("a1.h0", "m1")


def test_bad_arguments_are_refused(hf_root):
    lm = _lm("llama_gqa", hf_root)
    with pytest.raises(ValueError, match="method must be one of"):
        edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS, method="acdc")
    with pytest.raises(ValueError, match="rule must be one of"):
        edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS, method="eap-ig", rule="simpson")
    with pytest.raises(ValueError, match="steps"):
        edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS, method="eap-ig", steps=0)
    with pytest.raises(ValueError, match="same shape"):
        edge_attribution(lm, CLEAN, CORRUPT[:, :4], answer_ids=ANSWERS)
    with pytest.raises(ValueError, match="give answer_ids"):
        edge_attribution(lm, CLEAN, CORRUPT)
    with pytest.raises(ValueError, match=r"metric must return \(value, gradient"):
        edge_attribution(lm, CLEAN, CORRUPT, metric=_metric)
    with pytest.raises(ValueError, match="its gradient of the logits' shape"):
        edge_attribution(lm, CLEAN, CORRUPT, metric=lambda logits: (1.0, np.zeros(3)))
    with pytest.raises(ValueError, match="layer 0 is a PerLayerInputBlock"):
        edge_attribution(_lm("gemma4_text", hf_root), CLEAN, CORRUPT, answer_ids=ANSWERS)


def test_a_float32_model_gives_float64_scores_near_the_float64_models(hf_root):
    lm = _lm("llama_gqa", hf_root)
    wide = edge_attribution(lm, CLEAN, CORRUPT, answer_ids=ANSWERS, method="eap-ig", steps=2)
    narrow = edge_attribution(lm.astype(np.float32), CLEAN, CORRUPT, answer_ids=ANSWERS, method="eap-ig", steps=2)
    assert narrow.scores.dtype == np.float64
    np.testing.assert_allclose(narrow.scores, wide.scores, rtol=0, atol=1e-6 * np.abs(wide.scores).max())
    assert narrow.residuals["incoming"] < 1e-6 and narrow.residuals["outgoing"] < 1e-6
