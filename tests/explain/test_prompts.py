"""to_str_tokens splits as TransformerLens does (each token decoded alone by the ``transformers`` tokenizer), and
test_prompt prints TransformerLens's report and returns the ranks, logits and probabilities the model gives, on a
tiny chat model with a byte-level BPE tokenizer."""
from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("transformers")
from attnkit import explain  # noqa: E402  (test_prompt is no test: call it through the package)
from attnkit.pretrained import load_causal_lm, load_tokenizer  # noqa: E402

PROMPT = "The cat sat on the"


@pytest.fixture(scope="module")
def chat(chat_folder):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(chat_folder / "tokenizer.json"))
    return load_causal_lm(chat_folder, dtype=np.float64), load_tokenizer(chat_folder), hf


def test_to_str_tokens_decodes_each_token_as_transformer_lens(chat):
    _, tokenizer, hf = chat
    ids = hf.encode(PROMPT)
    want = hf.batch_decode([[t] for t in ids], clean_up_tokenization_spaces=False)  # TransformerLens's way
    assert explain.to_str_tokens(tokenizer, PROMPT) == want
    assert explain.to_str_tokens(tokenizer, np.array(ids)) == want == explain.to_str_tokens(tokenizer, [ids])
    assert "".join(want) == PROMPT and any(piece.startswith(" ") for piece in want)  # " cat", not "Ġcat"
    texts = explain.to_str_tokens(tokenizer, [PROMPT, "a dog"])
    assert texts[0] == want and "".join(texts[1]) == "a dog"
    with_bos = explain.to_str_tokens(tokenizer, PROMPT, prepend_bos=True)
    assert with_bos == ["<s>"] + want


def test_test_prompt_prints_and_returns_the_models_ranks(chat, capsys):
    lm, tokenizer, _ = chat
    found = explain.test_prompt(PROMPT, "mat", lm, tokenizer, top_k=3)
    printed = capsys.readouterr().out.splitlines()
    answer = tokenizer.encode(" mat", add_special_tokens=False)
    ids = np.array([tokenizer.encode(PROMPT) + answer])
    logits = lm(ids)[0, -len(answer) - 1:-1]  # (T, V): before each answer token
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for t, token in enumerate(answer):
        assert found.ranks[t, 0] == int((probs[t] > probs[t, token]).sum())
        np.testing.assert_allclose(found.logits[t, 0], logits[t, token], rtol=1e-12)
        np.testing.assert_allclose(found.probs[t, 0], probs[t, token], rtol=1e-12)
        np.testing.assert_array_equal(found.top_ids[t], np.argsort(-probs[t], kind="stable")[:3])
    assert printed[0] == f"Tokenized prompt: {explain.to_str_tokens(tokenizer, PROMPT)}"
    assert printed[1] == f"Tokenized answer: {found.answer_tokens[0]}" and found.answer_tokens[0][0].startswith(" ")
    assert printed[2] == "Performance on answer token:"
    rank, logit, prob, text = re.fullmatch(r"Rank: (\d+) +Logit: +(-?\d+\.\d\d) Prob: +(\d+\.\d\d)% Token: \|(.*)\|",
                                           printed[3]).groups()
    assert (int(rank), float(logit), float(prob), text) == (
        found.ranks[0, 0], round(found.logits[0, 0], 2), round(100 * found.probs[0, 0], 2), found.answer_tokens[0][0])
    assert re.fullmatch(r"Top 0th token\. Logit: +-?\d+\.\d\d Prob: +\d+\.\d\d% Token: \|.*\|", printed[4])
    ranks = [(token, int(rank)) for token, rank in zip(found.answer_tokens[0], found.ranks[:, 0])]
    assert printed[-1] == f"Ranks of the answer tokens: {ranks}"
    assert found.report.splitlines() == printed


def test_several_answers_are_compared_at_the_next_token(chat, capsys):
    lm, tokenizer, _ = chat
    found = explain.test_prompt(PROMPT, ["mat", "dog", " cat"], lm, tokenizer, print_details=False)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].startswith("Ranks of the answer tokens: [[(")
    assert found.ranks.shape == (1, 3) and found.probs.shape == (1, 3)
    firsts = [tokenizer.encode(a, add_special_tokens=False)[0] for a in (" mat", " dog", " cat")]
    logits = lm(np.array([tokenizer.encode(PROMPT)]))[0, -1]
    np.testing.assert_allclose(found.logits[0], logits[firsts], rtol=1e-12)
    order = np.argsort(-logits, kind="stable")
    assert found.ranks[0].tolist() == [int(np.flatnonzero(order == f)[0]) for f in firsts]
    with pytest.raises(TypeError, match="answer must be a str or a non-empty list of str"):
        explain.test_prompt(PROMPT, [], lm, tokenizer)
