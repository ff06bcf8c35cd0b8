"""Attribution graphs: every target's incoming edges plus its constant equal its input (a feature's pre-activation,
a logit minus the mean logit) in float64, and every edge equals the one a plain loop-by-loop replacement model gives
when that one source is removed.

circuit-tracer 0.5 cannot referee here: its TransformerLens backend imports ``HookedTransformer``, which
TransformerLens 4 removed (4.3 is installed), its nnsight backend needs nnsight (not installed, and circuit-tracer
pins transformers <= 4.57.3), and its hub helper imports ``HF_HUB_ENABLE_HF_TRANSFER``, which the installed
huggingface_hub no longer has. The reference below is written from the method's definition instead.
"""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.explain import SAE, attribution_graph, prune_graph, run_with_cache
from attnkit.explain.attribution_graph import AttributionGraph
from attnkit.layers.identity import Identity, Scale
from attnkit.layers.layer_norm import LayerNorm
from attnkit.models import CausalLM, ScalesConfig
from decoder_cases import tiny_config

PROMPT = [1, 5, 7, 2, 9, 3]


def _model(family="llama", **overrides):
    return CausalLM(tiny_config(family, **overrides), rng=3).astype(np.float64)


def _transcoders(model, read="hook_resid_mid", b_dec=0.3, architecture="transcoder", seed=0, width=24):
    rng = np.random.default_rng(seed)
    d = model.config.hidden_size
    out = []
    for i in range(model.config.num_layers):
        extra = {"threshold": np.abs(rng.normal(size=width)) * 0.3} if architecture == "jumprelu_transcoder" else {}
        out.append(SAE(rng.normal(size=(d, width)) / np.sqrt(d), rng.normal(size=width) * 0.5,
                       rng.normal(size=(width, d)) * 0.3, b_dec * rng.normal(size=d),
                       hook_name=f"blocks.{i}.{read}", hook_name_out=f"blocks.{i}.hook_mlp_out",
                       architecture=architecture, apply_b_dec_to_input=False, **extra))
    return out


# -- an independent replacement model, one position and head at a time -------------------------------------------
def _norm_at(norm, x):
    """The norm frozen at x (D,): ``(scale (D,), shift (D,), center)`` from its formula."""
    if isinstance(norm, Identity):
        return np.ones_like(x), np.zeros_like(x), False
    if isinstance(norm, Scale):
        return np.full_like(x, norm.factor), np.zeros_like(x), False
    if isinstance(norm, LayerNorm):
        var = ((x - x.mean()) ** 2).mean()
        return norm.gamma / np.sqrt(var + norm.eps), norm.beta.astype(np.float64), True
    return (norm.gamma + norm.offset) / np.sqrt((x * x).mean() + norm.eps), np.zeros_like(x), False


def _apply(frozen, x):
    scale, shift, center = frozen
    return ((x - x.mean()) if center else x) * scale + shift


class _Reference:
    """The replacement model built from the definition: frozen norms and patterns from the prompt's run, the MLPs
    replaced by what the sources write."""

    def __init__(self, model, ids, transcoders, normed):
        self.model, self.tcs, self.normed = model, transcoders, normed
        n = model.config.num_layers
        self.n = n
        names = ["hook_embed", *(f"hook_{t}" for t in model.position_tables)]
        names += [f"blocks.{i}.{p}" for i in range(n) for p in ("hook_resid_pre", "hook_resid_mid", "hook_resid_post",
                                                                 "attn.hook_pattern", "hook_mlp_out")]
        self.logits, cache = run_with_cache(model, np.array([ids]), names=names)
        self.cache = {k: v[0] for k, v in cache.items()}
        self.length = len(ids)
        # the frozen parts: per layer and position, each norm's (scale, shift, center)
        self.ln1 = [[_norm_at(layer.attn_norm, self.cache[f"blocks.{i}.hook_resid_pre"][p])
                     for p in range(self.length)] for i, layer in enumerate(model.layers)]
        self.ln2 = [[_norm_at(layer.mlp_norm, self.cache[f"blocks.{i}.hook_resid_mid"][p])
                     for p in range(self.length)] for i, layer in enumerate(model.layers)]
        self.post = [[None] * self.length for _ in range(self.n)]
        self.final = [_norm_at(model.norm, self.cache[f"blocks.{n - 1}.hook_resid_post"][p])
                      for p in range(self.length)]
        self.forward(self.cache["hook_embed"], None, None, freeze_post=True)

    def _attention(self, i, r):
        layer = self.model.layers[i]
        att = layer.attention
        p = att._parameters
        heads, kv, dh = att.num_heads, att.num_kv_heads, att.head_dim
        pattern = self.cache[f"blocks.{i}.attn.hook_pattern"]  # (Hq, L, L)
        v = np.array([_apply(self.ln1[i][q], r[q]) @ p["W_V"] + (p["b_V"] if "b_V" in p else 0)
                      for q in range(self.length)])  # (L, Hkv*Dh)
        out = np.zeros((self.length, p["W_O"].shape[1]))
        for q in range(self.length):
            z = np.zeros(heads * dh)
            for h in range(heads):
                g = h // (heads // kv)
                for key in range(self.length):
                    z[h * dh:(h + 1) * dh] += pattern[h, q, key] * v[key, g * dh:(g + 1) * dh]
            out[q] = z @ p["W_O"] + (p["b_O"] if "b_O" in p else 0)
        return out

    def forward(self, embed, acts, errors, freeze_post=False):
        """The feature inputs (N, L, D) and the final norm's output (L, D) given what each source writes; with
        ``acts`` None the MLPs write the run's own outputs."""
        r = embed + sum((self.cache[f"hook_{t}"] for t in self.model.position_tables), 0)
        inputs = []
        for i, layer in enumerate(self.model.layers):
            o = self._attention(i, r)
            if freeze_post:
                factor = _norm_at(layer.attn_scale, o[0])[0]
                self.post[i] = [tuple(x * factor if j < 2 else x for j, x in enumerate(_norm_at(layer.attn_post_norm,
                                                                                                 o[q])))
                                for q in range(self.length)]
            mid = r + np.array([_apply(self.post[i][q], o[q]) for q in range(self.length)])
            inputs.append(np.array([_apply(self.ln2[i][q], mid[q]) if self.normed[i] else mid[q]
                                    for q in range(self.length)]))
            if acts is None:
                written = self.cache[f"blocks.{i}.hook_mlp_out"]
            else:
                written = acts[i] @ self.tcs[i].W_dec + self.tcs[i].b_dec + errors[i]
                written[0] = self.cache[f"blocks.{i}.hook_mlp_out"][0]  # the first position: no nodes
            r = mid + written
        return np.array(inputs), np.array([_apply(self.final[q], r[q]) for q in range(self.length)])

    def targets(self, graph, embed, acts, errors):
        """Every target's input: the features' pre-activations, the logits minus their mean."""
        inputs, final = self.forward(embed, acts, errors)
        pres = np.array([inputs[i, p] @ self.tcs[i].W_enc[:, f] + self.tcs[i].b_enc[f]
                         for i, p, f in graph.active_features])
        head = self.model.head_weight * self.model.config.scales.logit
        logits = head @ final[-1]
        return np.concatenate([pres, logits[graph.logit_tokens] - logits.mean()])


def _reference_adjacency(model, graph, transcoders, normed):
    """Each edge as the change in its target's input when its one source is removed."""
    ref = _Reference(model, list(graph.input_ids), transcoders, normed)
    n, length, k = graph.n_layers, graph.n_pos, graph.n_features
    embed = ref.cache["hook_embed"]
    acts = np.zeros((n, length, transcoders[0].d_sae))
    for (i, p, f), a in zip(graph.active_features, graph.activation_values):
        acts[i, p, f] = a
    errors = np.array([ref.cache[f"blocks.{i}.hook_mlp_out"] - (acts[i] @ transcoders[i].W_dec + transcoders[i].b_dec)
                       for i in range(n)])
    full = ref.targets(graph, embed, acts, errors)
    columns = []
    for i, p, f in graph.active_features:
        cut = acts.copy()
        cut[i, p, f] = 0
        columns.append(full - ref.targets(graph, embed, cut, errors))
    for i in range(n):
        for p in range(length):
            cut = errors.copy()
            cut[i, p] = 0
            columns.append(full - ref.targets(graph, embed, acts, cut))
    for p in range(length):
        cut = embed.copy()
        cut[p] = 0
        columns.append(full - ref.targets(graph, cut, acts, errors))
    edges = np.array(columns).T  # (T, sources)
    return edges, full, k


CASES = {
    "llama_resid_mid": dict(family="llama", read="hook_resid_mid"),
    "llama_ln2": dict(family="llama", read="ln2.hook_normalized"),
    "gpt2_layernorm_biases": dict(family="gpt2", read="ln2.hook_normalized"),
    "mistral_window": dict(family="mistral", read="hook_resid_mid", attention=dict(sliding_window=3),
                           layer_types=("sliding_attention", "full_attention")),
    "sandwich_jumprelu": dict(family="llama", read="mlp.hook_in", norm=dict(placement="sandwich"),
                              architecture="jumprelu_transcoder"),
}


def _case(name):
    spec = dict(CASES[name])
    family, read = spec.pop("family"), spec.pop("read")
    architecture = spec.pop("architecture", "transcoder")
    model = _model(family, **spec)
    tcs = _transcoders(model, read, architecture=architecture)
    return model, tcs, [read != "hook_resid_mid"] * len(tcs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_edges_plus_constant_equal_each_target_input(name):
    model, tcs, _ = _case(name)
    graph = attribution_graph(model, PROMPT, tcs, max_logits=5, desired_logit_prob=0.99)
    k, m = graph.n_features, graph.n_logits
    assert k > 10 and m >= 2
    a = graph.adjacency_matrix
    features = a[:k].sum(axis=1) + graph.constants[:k]
    logits_in = a[-m:].sum(axis=1) + graph.constants[-m:]
    scale = max(1.0, np.abs(graph.pre_activations).max())
    np.testing.assert_allclose(features, graph.pre_activations, rtol=0, atol=1e-10 * scale)
    np.testing.assert_allclose(logits_in, graph.logit_values, rtol=0, atol=1e-10)
    # the pre-activations and logits are the model's own, from an uncut forward
    logits = model(np.array([PROMPT]))[0, -1]
    np.testing.assert_allclose(graph.logit_values, logits[graph.logit_tokens] - logits.mean(), atol=1e-12)
    _, cache = run_with_cache(model, [PROMPT], names=[f"blocks.{i}.hook_resid_mid" for i in range(2)])
    layer, pos, feat = graph.active_features[-1]
    if CASES[name]["read"] == "hook_resid_mid":
        direct = cache[f"blocks.{layer}.hook_resid_mid"][0, pos] @ tcs[layer].W_enc[:, feat] + tcs[layer].b_enc[feat]
        assert graph.pre_activations[-1] == pytest.approx(direct, abs=1e-12)
    assert (graph.activation_values > 0).all()


@pytest.mark.parametrize("name", sorted(CASES))
def test_edges_equal_removing_each_source_from_a_loop_reference(name):
    model, tcs, normed = _case(name)
    graph = attribution_graph(model, PROMPT, tcs, max_logits=4, desired_logit_prob=0.99, batch_size=7)
    edges, full, k = _reference_adjacency(model, graph, tcs, normed)
    a = graph.adjacency_matrix
    rows = np.r_[np.arange(k), np.arange(a.shape[0] - graph.n_logits, a.shape[0])]
    got = a[rows][:, :a.shape[0] - graph.n_logits]
    scale = np.abs(edges).max()
    assert scale > 0.1
    np.testing.assert_allclose(got, edges, rtol=0, atol=1e-10 * scale)
    np.testing.assert_allclose(full[:k], graph.pre_activations, atol=1e-10 * scale)
    # rows of error and token nodes, and edges into the future or within a layer, are zero
    assert not a[k:a.shape[0] - graph.n_logits].any()
    layers, positions = graph.active_features[:, 0], graph.active_features[:, 1]
    later = (layers[None, :k] >= layers[:, None]) | (positions[None, :k] > positions[:, None])
    assert not a[:k, :k][later].any()


def test_constant_is_the_encoder_bias_without_other_constants():
    """Llama has no biases and RMSNorm no shift: with zero decoder biases and every position a node, nothing but
    the encoder bias reaches a feature from no node; the first position's MLPs otherwise add to it."""
    model = _model("llama")
    tcs = _transcoders(model, "ln2.hook_normalized", b_dec=0.0)
    graph = attribution_graph(model, PROMPT, tcs, exclude_first=False)
    k = graph.n_features
    b_enc = np.array([tcs[i].b_enc[f] for i, _, f in graph.active_features])
    np.testing.assert_allclose(graph.constants[:k], b_enc, rtol=0, atol=1e-13)
    np.testing.assert_allclose(graph.constants[-graph.n_logits:], 0.0, atol=1e-13)
    assert (graph.active_features[:, 1] == 0).any()
    cut = attribution_graph(model, PROMPT, tcs)  # the first position's MLPs become constants
    assert not (cut.active_features[:, 1] == 0).any()
    assert not cut.error_vectors[:, 0].any() and cut.error_vectors[:, 1:].any()
    assert np.abs(cut.constants[:cut.n_features] - np.array([tcs[i].b_enc[f] for i, _, f in
                                                             cut.active_features])).max() > 1e-3


def test_logit_nodes_are_the_most_probable_until_the_desired_probability():
    model = _model("llama")
    tcs = _transcoders(model)
    logits = model(np.array([PROMPT]))[0, -1]
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    for desired, cap in ((0.5, 10), (0.9, 10), (0.99, 3), (0.0, 10)):
        graph = attribution_graph(model, PROMPT, tcs, max_logits=cap, desired_logit_prob=desired)
        expect = min(int(np.searchsorted(np.cumsum(probs[order]), desired)) + 1, cap)
        assert graph.logit_tokens.tolist() == order[:expect].tolist()
        np.testing.assert_allclose(graph.logit_probabilities, probs[order[:expect]], rtol=1e-12)


def test_batches_of_targets_give_the_same_graph():
    model = _model("gpt2")
    tcs = _transcoders(model, "ln2.hook_normalized")
    one = attribution_graph(model, PROMPT, tcs, batch_size=1)
    many = attribution_graph(model, PROMPT, tcs, batch_size=1000)
    np.testing.assert_allclose(one.adjacency_matrix, many.adjacency_matrix, rtol=0, atol=1e-12)
    assert len(one.node_labels()) == one.adjacency_matrix.shape[0]
    assert one.node_labels()[-one.n_logits] == f"L{one.logit_tokens[0]}"


def test_float32_model_gives_a_float32_graph_within_float32_rounding_of_float64():
    wide = _model("llama")
    narrow = CausalLM(tiny_config("llama"), rng=3).astype(np.float32)
    tcs = _transcoders(wide, "ln2.hook_normalized")
    g64, g32 = attribution_graph(wide, PROMPT, tcs), attribution_graph(narrow, PROMPT, tcs)
    for name in ("adjacency_matrix", "constants", "pre_activations", "activation_values", "logit_values",
                 "logit_probabilities", "error_vectors"):
        assert getattr(g32, name).dtype == np.float32, name
    assert (g32.active_features == g64.active_features).all()
    scale = np.abs(g64.adjacency_matrix).max()
    np.testing.assert_allclose(g32.adjacency_matrix, g64.adjacency_matrix, rtol=0, atol=1e-6 * scale)


# -- pruning ---------------------------------------------------------------------------------------------------
def _toy(adjacency, n_features, n_pos, n_layers, probs):
    m = len(probs)
    return AttributionGraph(input_ids=np.arange(n_pos), active_features=np.zeros((n_features, 3), np.int64),
                            activation_values=np.ones(n_features), pre_activations=np.zeros(n_features),
                            logit_tokens=np.arange(m), logit_probabilities=np.asarray(probs, float),
                            logit_values=np.zeros(m), adjacency_matrix=np.asarray(adjacency, float),
                            constants=np.zeros(len(adjacency)), error_vectors=np.zeros((n_layers, n_pos, 1)),
                            n_layers=n_layers)


def test_pruning_keeps_the_influential_nodes_and_edges():
    # nodes: features f0, f1, f2; one error (1 layer x 1 position); token t; logit l (probability 1)
    # l <- f0 (3), f1 (1); f0 <- t (1); f1 <- t (1); f2 <- t (5) but f2 reaches no logit; error -> l (0.01)
    a = np.zeros((6, 6))
    f0, f1, f2, err, tok, logit = range(6)
    a[logit, [f0, f1, err]] = [3.0, 1.0, 0.01]
    a[[f0, f1, f2], tok] = [1.0, 1.0, 5.0]
    graph = _toy(a, 3, 1, 1, [1.0])
    # influence: f0 3/4.01, f1 1/4.01, err 0.01/4.01, token (3 + 1)/4.01, f2 0
    node_mask, edge_mask, cumulative = prune_graph(graph, node_threshold=0.5, edge_threshold=1.0)
    assert node_mask.tolist() == [True, False, False, False, True, True]
    assert edge_mask[logit, f0] and edge_mask[f0, tok] and not edge_mask[logit, f1] and not edge_mask[f2, tok]
    influence = np.array([3, 1, 0, 0.01, 4, 0]) / 4.01
    order = np.argsort(-influence, kind="stable")
    expect = np.zeros(6)
    expect[order] = np.cumsum(influence[order]) / influence.sum()
    np.testing.assert_allclose(cumulative, expect)
    # everything that reaches the logit is kept at full thresholds; the dead-end f2 never
    node_mask, edge_mask, _ = prune_graph(graph, node_threshold=1.0, edge_threshold=1.0)
    assert node_mask.tolist() == [True, True, False, True, True, True]
    assert edge_mask[logit, err] and not edge_mask[f2].any()


def test_pruning_thresholds_shrink_the_real_graph():
    model = _model("llama")
    tcs = _transcoders(model, "ln2.hook_normalized")
    loose = attribution_graph(model, PROMPT, tcs, node_threshold=1.0, edge_threshold=1.0)
    tight = attribution_graph(model, PROMPT, tcs, node_threshold=0.5, edge_threshold=0.8)
    assert tight.node_mask.sum() < loose.node_mask.sum()
    assert tight.edge_mask.sum() < loose.edge_mask.sum()
    assert not (tight.node_mask & ~loose.node_mask).any()
    kept = tight.node_mask
    assert kept[-tight.n_logits - tight.n_pos:].all()
    assert not tight.edge_mask[~kept].any() and not tight.edge_mask[:, ~kept].any()
    assert np.isclose(tight.cumulative_scores.max(), 1.0)


# -- bad input -------------------------------------------------------------------------------------------------
def test_bad_input_is_refused_by_name():
    model = _model("llama")
    tcs = _transcoders(model)
    with pytest.raises(TypeError, match="transcoders must be a list of 2"):
        attribution_graph(model, PROMPT, tcs[:1])
    with pytest.raises(ValueError, match=r"transcoders\[1\] must read blocks.1.hook_resid_mid"):
        attribution_graph(model, PROMPT, [tcs[0], _transcoders(model)[0]])
    with pytest.raises(ValueError, match="input_ids must be one prompt"):
        attribution_graph(model, [PROMPT, PROMPT], tcs)
    with pytest.raises(ValueError, match="node_threshold must be a number in"):
        attribution_graph(model, PROMPT, tcs, node_threshold=1.5)
    with pytest.raises(ValueError, match="max_logits must be a positive int"):
        attribution_graph(model, PROMPT, tcs, max_logits=0)
    with pytest.raises(ValueError, match="sequential attention blocks"):
        attribution_graph(_model("llama", residual="parallel"), PROMPT, tcs)
    with pytest.raises(ValueError, match="soft-cap"):
        attribution_graph(_model("llama", scales=ScalesConfig(final_logit_softcap=30.0)), PROMPT, tcs)


# -- on the explain page and the command line ------------------------------------------------------------------
def _page_data(page) -> dict:
    import json
    import re

    return json.loads(re.search(r'id="attnkit-data" type="application/json">(.*?)</script>',
                                page.read_text(encoding="utf-8"), flags=re.DOTALL).group(1))


def test_the_explain_page_draws_the_pruned_graph(tmp_path):
    from attnkit.explain import explain_html

    model = _model("llama")
    tcs = _transcoders(model, "ln2.hook_normalized")
    page = tmp_path / "graph.html"
    data = explain_html(model, PROMPT, page, candidates=2, transcoders=tcs, progress=False)
    graph = attribution_graph(model, PROMPT, tcs)
    shown = _page_data(page)["graph"]
    assert shown == data["graph"]
    kept = np.nonzero(graph.node_mask)[0]
    assert len(shown["nodes"]) == len(kept) and len(shown["edges"]) > 0
    assert [n["kind"] for n in shown["nodes"]].count("token") == len(PROMPT)
    assert [n["kind"] for n in shown["nodes"]].count("logit") == graph.n_logits
    for source, target, weight in shown["edges"]:
        assert weight == pytest.approx(graph.adjacency_matrix[kept[target], kept[source]], abs=1e-6)
        assert graph.edge_mask[kept[target], kept[source]]
    assert len(shown["edges"]) == graph.edge_mask[np.ix_(kept, kept)].sum()
    assert 'id="graph-panel"' in page.read_text(encoding="utf-8")
    with pytest.raises(ValueError, match=r"transcoders\[0\] must read"):
        explain_html(model, PROMPT, page, transcoders=_transcoders(model)[::-1], progress=False)


def _write_transcoder(folder, tc):
    import json

    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    cfg = {"d_in": tc.d_in, "d_sae": tc.d_sae, "d_out": tc.d_out, "architecture": "transcoder",
           "apply_b_dec_to_input": False, "normalize_activations": "none",
           "metadata": {"hook_name": tc.hook_name, "hook_name_out": tc.output_hook_name}}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file({name: np.ascontiguousarray(getattr(tc, name), dtype=np.float32)
               for name in ("W_enc", "b_enc", "W_dec", "b_dec")}, str(folder / "sae_weights.safetensors"))


def test_attnkit_explain_graph_adds_the_graph_and_refuses_missing_layers(tmp_path, capsys):
    pytest.importorskip("transformers")
    from attnkit.cli import main
    from attnkit.explain import load_sae
    from attnkit.pretrained import load_causal_lm
    from hf_models import saved_model

    folder = saved_model("llama_gqa", tmp_path)[0]
    model = load_causal_lm(folder)
    tcs = _transcoders(model, "ln2.hook_normalized")
    for i, tc in enumerate(tcs):
        _write_transcoder(tmp_path / "tcs" / f"layer_{i:02d}", tc)
    page = tmp_path / "page.html"
    ids = "3,17,5,40,8"
    assert main(["explain", str(folder), "--ids", ids, "--html", str(page), "--candidates", "2",
                 "--graph", str(tmp_path / "tcs")]) == 0
    assert "attribution graph: kept" in capsys.readouterr().out
    loaded = [load_sae(tmp_path / "tcs" / f"layer_{i:02d}") for i in range(len(tcs))]
    graph = attribution_graph(model, [3, 17, 5, 40, 8], loaded)
    assert len(_page_data(page)["graph"]["nodes"]) == graph.node_mask.sum()
    # a layer without its transcoder: one line, exit 2
    import shutil

    shutil.rmtree(tmp_path / "tcs" / "layer_01")
    assert main(["explain", str(folder), "--ids", ids, "--html", str(page), "--graph", str(tmp_path / "tcs")]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs one transcoder per layer" in err and len(err.splitlines()) == 1
