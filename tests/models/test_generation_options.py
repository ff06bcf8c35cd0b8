"""Generation options with Hugging Face's names against transformers' generate on tiny random models:
repetition_penalty, no_repeat_ngram_size, min_new_tokens, stop_strings, num_return_sequences, and the
generation_config.json defaults."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from attnkit.decoding.sampling import apply_repetition_penalty, banned_ngram_tokens
from attnkit.pretrained import load_causal_lm, load_tokenizer
from hf_models import EOS, VOCAB, left_padded_batch, saved_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
logits_process = pytest.importorskip("transformers.generation.logits_process")
stats = pytest.importorskip("scipy.stats")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder, hf = saved_model("llama_gqa", tmp_path_factory.mktemp("models"))
    return load_causal_lm(folder), hf


def hf_generate(hf, ids, mask, **kwargs):
    with torch.no_grad():
        out = hf.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                          num_beams=1, top_k=None, top_p=None, temperature=None, pad_token_id=0, **kwargs)
    return out.numpy()


@pytest.mark.parametrize("options", [
    dict(repetition_penalty=1.5), dict(repetition_penalty=0.7), dict(no_repeat_ngram_size=2),
    dict(no_repeat_ngram_size=1), dict(repetition_penalty=1.3, no_repeat_ngram_size=3),
])
def test_greedy_with_processors_equals_transformers(pair, options):
    lm, hf = pair
    ids, mask = left_padded_batch(np.random.default_rng(1), (5, 3, 7))
    expected = hf_generate(hf, ids, mask, max_new_tokens=12, do_sample=False, eos_token_id=EOS, **options)
    got = lm.generate(ids, mask, max_new_tokens=12, eos_token_id=EOS, pad_token_id=0, **options)
    np.testing.assert_array_equal(got, expected)
    plain = lm.generate(ids, mask, max_new_tokens=12, eos_token_id=EOS, pad_token_id=0)
    assert not np.array_equal(plain, got)  # the option changed the output: the comparison means something


def test_min_new_tokens_equals_transformers(pair):
    lm, hf = pair
    ids, mask = left_padded_batch(np.random.default_rng(2), (4, 6))
    first = lm.generate(ids, mask, max_new_tokens=3, eos_token_id=EOS)[:, ids.shape[1]:]
    eos = int(first[0, 1])  # row 0's second token: without min_new_tokens it ends there
    expected = hf_generate(hf, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=eos, min_new_tokens=5)
    got = lm.generate(ids, mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=0, min_new_tokens=5)
    np.testing.assert_array_equal(got, expected)
    assert eos not in got[0, ids.shape[1]:ids.shape[1] + 5]


def test_generation_config_defaults_and_explicit_arguments_win(pair, tmp_path):
    lm, hf = pair
    folder = shutil.copytree(saved_model("llama_gqa", tmp_path)[0], tmp_path / "copy")
    (folder / "generation_config.json").write_text(json.dumps(
        {"repetition_penalty": 1.5, "max_new_tokens": 9, "eos_token_id": [EOS], "do_sample": False}))
    configured = load_causal_lm(folder)
    ids, mask = left_padded_batch(np.random.default_rng(1), (5, 3))
    np.testing.assert_array_equal(configured.generate(ids, mask, pad_token_id=0),
                                  lm.generate(ids, mask, max_new_tokens=9, repetition_penalty=1.5, pad_token_id=0))
    np.testing.assert_array_equal(configured.generate(ids, mask, repetition_penalty=1.0, max_new_tokens=4),
                                  lm.generate(ids, mask, max_new_tokens=4))


def test_repetition_penalty_and_ngram_ban_equal_the_hf_processors():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, VOCAB)).astype(np.float32)
    sequences = rng.integers(0, 8, size=(3, 20))
    for penalty in (0.5, 1.7):
        expected = logits_process.RepetitionPenaltyLogitsProcessor(penalty)(
            torch.from_numpy(sequences), torch.from_numpy(logits.copy())).numpy()
        np.testing.assert_array_equal(apply_repetition_penalty(logits, sequences, penalty), expected)
        # transformers leaves each row's left padding out (its length from the attention mask)
        padding = np.array([0, 5, 19])
        expected = logits_process.RepetitionPenaltyLogitsProcessor(penalty, torch.from_numpy(padding))(
            torch.from_numpy(sequences), torch.from_numpy(logits.copy())).numpy()
        ours = apply_repetition_penalty(logits, sequences, penalty, padding)
        np.testing.assert_array_equal(ours, expected)
        assert (ours != apply_repetition_penalty(logits, sequences, penalty)).any()
    for n in (1, 2, 3, 4):
        expected = logits_process.NoRepeatNGramLogitsProcessor(n)(
            torch.from_numpy(sequences), torch.from_numpy(logits.copy())).numpy()
        banned = np.zeros(logits.shape, dtype=bool)
        b = banned_ngram_tokens(sequences, n)
        banned[:, :b.shape[1]] = b
        np.testing.assert_array_equal(np.isneginf(expected), banned)


def test_num_return_sequences_samples_with_transformers_frequencies(pair):
    """First sampled token of 2 prompts x 400 sequences: each prompt's counts against HF's probabilities."""
    lm, hf = pair
    ids, mask = left_padded_batch(np.random.default_rng(3), (4, 6))
    n = 400
    out = lm.generate(ids, mask, max_new_tokens=1, do_sample=True, top_k=8, num_return_sequences=n, seed=0)
    assert out.shape == (2 * n, ids.shape[1] + 1)
    np.testing.assert_array_equal(out[:n, :-1], np.repeat(ids[:1], n, axis=0))
    with torch.no_grad():
        positions = torch.from_numpy(np.maximum(mask.cumsum(1) - 1, 0))
        scores = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                    position_ids=positions).logits[:, -1, :].float()
        probs = torch.softmax(logits_process.TopKLogitsWarper(8)(None, scores), -1).double().numpy()
    for row in range(2):
        counts = np.bincount(out[row * n:(row + 1) * n, -1], minlength=VOCAB)
        kept = probs[row] > 0
        assert counts[~kept].sum() == 0
        expected = probs[row][kept] / probs[row][kept].sum() * n
        assert stats.chisquare(counts[kept], expected).pvalue > 1e-4


def test_stop_strings_end_rows_as_transformers_does(tmp_path):
    from text_models import write_chat_model

    hf, hf_tok = write_chat_model(tmp_path)
    lm, tok = load_causal_lm(tmp_path), load_tokenizer(tmp_path)
    ids = np.array([tok.encode("Hello world, how")[-3:], tok.encode("The quick brown")[-3:]], dtype=np.int64)
    mask = np.ones(ids.shape, dtype=bool)
    plain = lm.generate(ids, mask, max_new_tokens=16, eos_token_id=hf.config.eos_token_id, pad_token_id=0)
    texts = [tok.decode(row[ids.shape[1]:]) for row in plain]
    # Stop strings taken from what each row writes (its first two-letter ASCII piece after the first few
    # characters), so both rows stop early.
    stops = [next(t[i:i + 2] for i in range(3, len(t) - 1) if t[i:i + 2].isascii() and t[i:i + 2].isalpha())
             for t in texts]
    with torch.no_grad():
        expected = hf.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.ones_like(torch.from_numpy(ids)),
                               max_new_tokens=16, do_sample=False, stop_strings=stops, tokenizer=hf_tok,
                               eos_token_id=hf.config.eos_token_id, pad_token_id=0, top_k=None, top_p=None,
                               temperature=None).numpy()
    got = lm.generate(ids, mask, max_new_tokens=16, eos_token_id=hf.config.eos_token_id, pad_token_id=0,
                      stop_strings=stops, tokenizer=tok)
    np.testing.assert_array_equal(got, expected)
    assert got.shape[1] < plain.shape[1]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(repetition_penalty=0.0), ValueError, "repetition_penalty must be a finite positive"),
    (dict(no_repeat_ngram_size=-1), ValueError, "no_repeat_ngram_size must be non-negative, got -1"),
    (dict(min_new_tokens=1.5), TypeError, "min_new_tokens must be an integer, got float"),
    (dict(num_return_sequences=2), ValueError, "needs do_sample=True"),
    (dict(num_return_sequences=0, do_sample=True), ValueError, "num_return_sequences must be positive, got 0"),
    (dict(stop_strings=["x"]), ValueError, "stop_strings needs tokenizer"),
    (dict(stop_strings=[""], tokenizer=object()), ValueError, "stop_strings must be"),
])
def test_option_errors_name_the_argument(pair, kwargs, error, match):
    lm, _ = pair
    with pytest.raises(error, match=match):
        lm.generate(np.array([[1, 2]]), **kwargs)
