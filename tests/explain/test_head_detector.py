"""TransformerLens's head detector on attnkit: the detection patterns and scores by hand, on heads whose pattern is
set through a hook, and equal to ``transformer_lens.head_detector`` on the same tiny models and prompts (its
``TransformerBridge`` booted offline, float32: within 1e-6, the "abs" scores, rounded to 3 decimals there and here,
exactly or by one rounding step where a float32 difference straddles a rounding boundary)."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.explain import detect_head, hook_names, hooks, run_with_cache
from attnkit.explain.head_detector import (
    HEAD_NAMES,
    compute_head_attention_similarity_score,
    get_duplicate_token_head_detection_pattern,
    get_induction_head_detection_pattern,
    get_previous_token_head_detection_pattern,
)
from attnkit.models import CausalLM, DecoderConfig, MLPConfig

TOKENS = [1, 7, 8, 9, 7, 8, 9, 7]  # BOS, then A B C A B C A


def tiny(dtype=np.float64):
    cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(12))
    return CausalLM(cfg, rng=0).astype(dtype)


def test_the_detection_patterns_mark_the_expected_keys():
    prev = get_previous_token_head_detection_pattern(TOKENS)
    assert prev.shape == (8, 8) and prev.dtype == np.float64
    assert np.array_equal(np.argwhere(prev), [[i, i - 1] for i in range(1, 8)])
    dup = get_duplicate_token_head_detection_pattern(TOKENS)  # 7 at 1, 4, 7; 8 at 2, 5; 9 at 3, 6
    assert sorted(map(tuple, np.argwhere(dup).tolist())) == [(4, 1), (5, 2), (6, 3), (7, 1), (7, 4)]
    induction = get_induction_head_detection_pattern(TOKENS)  # the key after each earlier occurrence
    assert sorted(map(tuple, np.argwhere(induction).tolist())) == [(4, 2), (5, 3), (6, 4), (7, 2), (7, 5)]
    # a token repeated at once: the key after its earlier occurrence is the query's own (TransformerLens's too)
    assert np.array_equal(get_induction_head_detection_pattern(np.array([[3, 3]])), [[0, 0], [0, 1]])


def test_scores_by_hand():
    """A head spreading attention evenly over the prefix: query i puts 1/(i+1) on each of its keys."""
    length = 5
    pattern = np.tril(np.ones((length, length))) / np.arange(1, length + 1)[:, None]  # (L, L)
    prev = get_previous_token_head_detection_pattern(range(length))

    def score(**kw):
        kw = {"exclude_bos": False, "exclude_current_token": False, "error_measure": "mul", **kw}
        return compute_head_attention_similarity_score(pattern, prev, **kw)

    # mul: (1/2 + 1/3 + 1/4 + 1/5) / 5 of the attention is on the previous token
    assert score() == pytest.approx((1 / 2 + 1 / 3 + 1 / 4 + 1 / 5) / 5, abs=1e-15)
    # without the first key the attention left is 5 - (1 + 1/2 + 1/3 + 1/4 + 1/5); query 1's previous key is key 0
    assert score(exclude_bos=True) == pytest.approx((1 / 3 + 1 / 4 + 1 / 5) / (5 - 137 / 60), abs=1e-15)
    # without each query's own key: the previous token's share of the rest
    assert score(exclude_current_token=True) == pytest.approx((1 / 2 + 1 / 3 + 1 / 4 + 1 / 5) / (5 - 137 / 60),
                                                              abs=1e-15)
    # abs: sum |pattern - prev| = 1 + sum_{i=1..4} (i / (i + 1)... ) written out: row i has i keys at 1/(i+1) off
    # the mark plus (1 - 1/(i+1)) on it, so 2 i / (i + 1); rows sum to 1 + 1 + 4/3 + 3/2 + 8/5 = 6.4333; / 5
    assert score(error_measure="abs") == pytest.approx(1 - round(6.4333333333 / 5, 3), abs=1e-12)
    assert score(error_measure="abs") == pytest.approx(-0.287, abs=1e-12)


def test_a_head_set_to_a_pattern_scores_one():
    """Through a hook, head 0 of layer 1 becomes an exact induction head and head 1 of layer 0 an exact
    previous-token head (query 0 on itself); they score 1 and the other heads less."""
    lm = tiny()
    ids = np.array(TOKENS)
    induction = get_induction_head_detection_pattern(ids)
    induction[~induction.any(axis=1), 0] = 1.0  # queries with no earlier occurrence look at the BOS
    induction /= induction.sum(axis=1, keepdims=True)
    prev = get_previous_token_head_detection_pattern(ids)
    prev[0, 0] = 1.0

    def set_head(head, target):
        def fn(pattern, name):
            pattern = pattern.copy()
            pattern[:, head] = target
            return pattern
        return fn

    with hooks(lm, {"blocks.1.attn.hook_pattern": set_head(0, induction),
                    "blocks.0.attn.hook_pattern": set_head(1, prev)}):
        ind = detect_head(lm, ids, "induction_head", exclude_bos=True)
        previous = detect_head(lm, ids, "previous_token_head", exclude_bos=True, exclude_current_token=True)
        previous_abs = detect_head(lm, ids, "previous_token_head", error_measure="abs")
    assert ind[1, 0] == pytest.approx(1.0, abs=1e-15) and ind[[0, 0, 1], [0, 1, 1]].max() < 0.9
    assert previous[0, 1] == pytest.approx(1.0, abs=1e-15)
    # abs: only query 0's weight on itself differs from the detection pattern: 1 / L off
    assert previous_abs[0, 1] == pytest.approx(1 - round(1 / 8, 3), abs=1e-15)
    assert detect_head(lm, ids, "induction_head")[1, 0] < 0.9  # the hooks are gone


def test_several_prompts_heads_and_cache():
    lm = tiny(np.float32)
    a, b = np.array(TOKENS), np.array([1, 4, 5, 4, 5])
    one, two = detect_head(lm, a, "duplicate_token_head"), detect_head(lm, b, "duplicate_token_head")
    assert one.dtype == np.float32
    np.testing.assert_allclose(detect_head(lm, [a, b], "duplicate_token_head"), (one + two) / 2, rtol=0, atol=1e-7)
    same_length = detect_head(lm, np.stack([a, a[::-1]]), "induction_head")
    np.testing.assert_allclose(same_length, (detect_head(lm, a, "induction_head") +
                                             detect_head(lm, a[::-1], "induction_head")) / 2, rtol=0, atol=1e-7)
    only = detect_head(lm, a, "duplicate_token_head", heads=[(1, 0)])
    assert only[1, 0] == one[1, 0] and (np.delete(only.ravel(), 2) == -1).all()
    np.testing.assert_array_equal(detect_head(lm, a, "duplicate_token_head", heads={0: [0, 1]})[0], one[0])
    _, cache = run_with_cache(lm, a)
    np.testing.assert_array_equal(detect_head(lm, a, "duplicate_token_head", cache=cache), one)
    custom = get_duplicate_token_head_detection_pattern(a)
    np.testing.assert_array_equal(detect_head(lm, a, custom), one)


def test_bad_arguments_are_named():
    lm = tiny()
    ids = np.array(TOKENS)
    with pytest.raises(ValueError, match="one of previous_token_head"):
        detect_head(lm, ids, "copy_head")
    with pytest.raises(ValueError, match="error_measure"):
        detect_head(lm, ids, "induction_head", error_measure="l2")
    with pytest.raises(ValueError, match="lower triangular"):
        detect_head(lm, ids, np.ones((8, 8)))
    with pytest.raises(ValueError, match="lower triangular"):
        detect_head(lm, ids, np.eye(7))
    with pytest.raises(ValueError, match="several prompts"):
        detect_head(lm, [ids, ids[:4]], np.eye(8))
    with pytest.raises(ValueError, match="several prompts"):
        detect_head(lm, [ids, ids[:4]], "induction_head", cache=run_with_cache(lm, ids)[1])
    with pytest.raises(ValueError, match="cache must be of this one prompt: it holds 2 of 8 tokens"):
        detect_head(lm, ids, "induction_head", cache=run_with_cache(lm, np.stack([ids, ids]))[1])
    with pytest.raises(ValueError, match="it holds 1 of 8 tokens, input_ids is 1 of 5"):
        detect_head(lm, ids[:5], "induction_head", cache=run_with_cache(lm, ids)[1])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        detect_head(lm, [3], "induction_head")
    with pytest.raises(ValueError, match=r"heads must be \(layer, head\)"):
        detect_head(lm, ids, "induction_head", heads=[(2, 0)])
    with pytest.raises(ValueError, match="input_ids must lie in"):
        detect_head(lm, [1, 99], "induction_head")
    from attnkit.models.config import GatedDeltaNetConfig

    only_linear = DecoderConfig(family="qwen3_5_text", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
                                num_kv_heads=1, head_dim=4, mlp=MLPConfig(12),
                                layer_types=("linear_attention", "linear_attention"),
                                mixer_parts=(GatedDeltaNetConfig(1, 2, 4, 3),))
    with pytest.raises(ValueError, match="no layer with attention heads"):
        detect_head(CausalLM(only_linear, rng=0), [1, 2, 3], "induction_head")


# -- TransformerLens as the referee ---------------------------------------------------------------------------------
PROMPTS = ["w2 w5 w3 w7 w9 w2 w5 w3 w7 w9 w2", "w4 w4 w6 w8 w4 w6 w8"]
REFEREE_MODELS = ("gpt2", "llama_gqa", "gemma2", "qwen3_5_text", "gpt_oss")


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_head_detector")


@pytest.mark.parametrize("name", REFEREE_MODELS)
def test_scores_equal_transformer_lens(name, hf_root):
    pytest.importorskip("torch")
    pytest.importorskip("transformer_lens", reason="TransformerLens is the referee: pip install --no-deps "
                        "transformer-lens==4.3.0 and its imported dependencies (see constraints.txt)")
    import warnings

    from transformer_lens import head_detector as lens_detector

    from attnkit.pretrained import load_causal_lm
    from lens_referee import boot

    bridge, folder = boot(name, hf_root)
    lm = load_causal_lm(folder)
    points = set(hook_names(lm))
    with_heads = [i for i in range(lm.config.num_layers) if f"blocks.{i}.attn.hook_pattern" in points]
    every_head = {i: list(range(lm.config.num_heads)) for i in with_heads}
    ids = [bridge.to_tokens(p)[0].numpy() for p in PROMPTS]  # TransformerLens adds the BOS
    worst = 0.0
    for head_name in HEAD_NAMES:
        for kw in ({}, {"exclude_bos": True}, {"exclude_current_token": True, "error_measure": "abs"},
                   {"exclude_bos": True, "exclude_current_token": True, "error_measure": "abs"}):
            for prompts, texts in ((ids[0], PROMPTS[0]), (ids, PROMPTS)):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    theirs = lens_detector.detect_head(bridge, texts, head_name, heads=every_head, **kw).numpy()
                ours = detect_head(lm, prompts, head_name, **kw)
                assert np.isnan(ours[[i for i in range(lm.config.num_layers) if i not in with_heads]]).all()
                step = 1e-3 + 1e-6 if kw.get("error_measure") == "abs" else 1e-6
                diff = np.abs(ours[with_heads] - theirs[with_heads])
                assert diff.max() <= step, (head_name, kw, diff.max())
                if kw.get("error_measure") == "abs":  # a boundary case at most now and then, not the rule
                    assert (diff <= 1e-6).mean() >= 0.9
                worst = max(worst, float(diff.max()))
    assert 0 < np.nanmax(np.abs(ours))  # real scores were compared
