"""Generation logic on a stand-in model whose logits are a fixed bigram table: warpers equal HF's, sampling
frequencies match HF's warped distribution (chi-square), seeds, eos/pad handling, the prefill-then-one-token
cache protocol, streaming and argument checks. Real checkpoints are in tests/pretrained/test_causal_lm.py."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from attnkit.decoding.sampling import (
    generate,
    generate_stream,
    min_p_filter,
    sample_tokens,
    temperature_warp,
    top_k_filter,
    top_p_filter,
    warp_logits,
)

torch = pytest.importorskip("torch")
logits_process = pytest.importorskip("transformers.generation.logits_process")
stats = pytest.importorskip("scipy.stats")

V = 12


class BigramLM:
    """Logits of the next token depend on the current token only: ``table[token]``. Records every call."""

    def __init__(self, table: np.ndarray, eos=None, pad=None, position="rotary", max_positions=64):
        self.table = table.astype(np.float32)
        self.config = SimpleNamespace(vocab_size=table.shape[0], tokens=SimpleNamespace(eos=eos, pad=pad))
        # what the decoding loop asks the model: how long a sequence it can run (a learned table's rows)
        self.max_sequence_length = max_positions if position == "learned" else None
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def new_cache(self, batch_size, max_length=None):
        return SimpleNamespace(length=0, batch_size=batch_size, max_length=max_length)

    def forward(self, input_ids, attention_mask=None, *, cache=None):
        assert attention_mask.shape == (input_ids.shape[0], cache.length + input_ids.shape[1])
        cache.length += input_ids.shape[1]
        self.calls.append((input_ids.shape, attention_mask.shape))
        return self.table[input_ids]  # (B, L, V)


def hf_warped(logits: np.ndarray, temperature=1.0, top_k=None, top_p=None, min_p=None) -> np.ndarray:
    """HF's warpers in the order and with the skip rules of GenerationMixin._get_logits_processor."""
    scores = torch.from_numpy(np.asarray(logits, dtype=np.float32))
    procs = []
    if temperature != 1.0:
        procs.append(logits_process.TemperatureLogitsWarper(float(temperature)))
    if top_k is not None and top_k != 0:
        procs.append(logits_process.TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        procs.append(logits_process.TopPLogitsWarper(top_p))
    if min_p is not None:
        procs.append(logits_process.MinPLogitsWarper(min_p))
    for proc in procs:
        scores = proc(None, scores)
    return scores.numpy()


def same_filtered(ours, theirs):
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(theirs))
    np.testing.assert_allclose(ours[np.isfinite(ours)], theirs[np.isfinite(theirs)], rtol=1e-6)


@pytest.fixture
def logits(rng):
    return (rng.standard_normal((32, 40)) * 2.5).astype(np.float32)


@pytest.mark.parametrize("k", [1, 2, 7, 40, 100])
@pytest.mark.parametrize("keep", [1, 5])
def test_top_k_equals_hf(logits, k, keep):
    theirs = logits_process.TopKLogitsWarper(k, min_tokens_to_keep=keep)(None, torch.from_numpy(logits)).numpy()
    same_filtered(top_k_filter(logits, k, min_tokens_to_keep=keep), theirs)


@pytest.mark.parametrize("p", [0.0, 0.05, 0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("keep", [1, 3])
def test_top_p_equals_hf(logits, p, keep):
    theirs = logits_process.TopPLogitsWarper(p, min_tokens_to_keep=keep)(None, torch.from_numpy(logits)).numpy()
    same_filtered(top_p_filter(logits, p, min_tokens_to_keep=keep), theirs)


@pytest.mark.parametrize("p", [0.0, 0.02, 0.2, 0.6, 1.0])
@pytest.mark.parametrize("keep", [1, 4])
def test_min_p_equals_hf(logits, p, keep):
    theirs = logits_process.MinPLogitsWarper(p, min_tokens_to_keep=keep)(None, torch.from_numpy(logits)).numpy()
    same_filtered(min_p_filter(logits, p, min_tokens_to_keep=keep), theirs)


@pytest.mark.parametrize("settings", [dict(temperature=0.7), dict(temperature=1.6, top_k=5),
                                      dict(top_k=10, top_p=0.6), dict(temperature=0.5, top_p=0.9, min_p=0.1),
                                      dict(temperature=2.0, top_k=8, top_p=0.8, min_p=0.05), dict(top_k=0),
                                      dict(top_p=1.0, min_p=0.0)])
def test_warp_order_equals_hf(logits, settings):
    same_filtered(warp_logits(logits, **settings), hf_warped(logits, **settings))


def test_warpers_keep_dtype_and_leave_input_alone(logits):
    before = logits.copy()
    for out in (temperature_warp(logits, 0.5), top_k_filter(logits, 3), top_p_filter(logits, 0.5),
                min_p_filter(logits, 0.1), warp_logits(logits, temperature=0.3, top_k=4)):
        assert out.dtype == np.float32 and out.shape == logits.shape
    np.testing.assert_array_equal(logits, before)


def test_top_k_keeps_ties_with_the_kth():
    out = top_k_filter(np.array([[1.0, 2.0, 2.0, 0.5]]), 2)
    np.testing.assert_array_equal(out, [[-np.inf, 2.0, 2.0, -np.inf]])
    assert np.isfinite(top_k_filter(np.array([[1.0, 2.0, 2.0, 0.5]]), 1)).sum() == 2


# -- sampling distribution -----------------------------------------------------------------------------------
@pytest.mark.parametrize("settings", [dict(), dict(temperature=0.6), dict(temperature=1.5, top_k=6),
                                      dict(top_p=0.8), dict(temperature=1.3, min_p=0.08),
                                      dict(temperature=0.9, top_k=9, top_p=0.9, min_p=0.02)])
def test_sampled_frequencies_match_hf_warped_distribution(settings):
    row = (np.random.default_rng(3).standard_normal(V) * 0.8).astype(np.float32)
    theirs = hf_warped(row[None], **settings)[0].astype(np.float64)
    expected = np.exp(theirs - theirs.max())
    expected /= expected.sum()
    draws = 20000
    tokens = sample_tokens(np.repeat(warp_logits(row[None], **settings), draws, axis=0), np.random.default_rng(7))
    counts = np.bincount(tokens, minlength=V)
    assert counts[expected == 0].sum() == 0  # filtered tokens are never drawn
    kept = expected > 0
    assert kept.sum() >= 3  # a real distribution, not a forced choice
    statistic, p_value = stats.chisquare(counts[kept], expected[kept] * draws)
    assert p_value > 1e-4, (counts, expected * draws)


def test_generate_samples_through_the_model_with_hf_frequencies():
    table = (np.random.default_rng(5).standard_normal((V, V)) * 2).astype(np.float32)
    model = BigramLM(table)
    rows = 4000
    out = generate(model, np.full((rows, 1), 3), max_new_tokens=1, do_sample=True, temperature=0.8, top_p=0.9,
                   seed=11)
    theirs = hf_warped(table[3][None], temperature=0.8, top_p=0.9)[0].astype(np.float64)
    expected = np.exp(theirs - theirs.max())
    expected /= expected.sum()
    counts = np.bincount(out[:, 1], minlength=V)
    kept = expected > 0
    assert counts[~kept].sum() == 0
    assert stats.chisquare(counts[kept], expected[kept] * rows).pvalue > 1e-4


def test_seed_reproducible_and_different_seeds_differ():
    model = BigramLM(np.random.default_rng(1).standard_normal((V, V)))
    prompt = np.array([[1, 2], [3, 4], [5, 6]])
    a = generate(model, prompt, max_new_tokens=12, do_sample=True, seed=123)
    b = generate(model, prompt, max_new_tokens=12, do_sample=True, seed=123)
    c = generate(model, prompt, max_new_tokens=12, do_sample=True, seed=124)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    gen = np.random.default_rng(9)
    d = generate(model, prompt, max_new_tokens=12, do_sample=True, seed=gen)
    np.testing.assert_array_equal(d, generate(model, prompt, max_new_tokens=12, do_sample=True, seed=9))


def test_top_k_one_equals_greedy():
    model = BigramLM(np.random.default_rng(2).standard_normal((V, V)))
    prompt = np.array([[1], [4], [7]])
    greedy = generate(model, prompt, max_new_tokens=10)
    sampled = generate(model, prompt, max_new_tokens=10, do_sample=True, top_k=1, temperature=3.0, seed=0)
    np.testing.assert_array_equal(greedy, sampled)
    # greedy follows the table's argmax chain
    expected = [1]
    for _ in range(10):
        expected.append(int(np.argmax(model.table[expected[-1]])))
    np.testing.assert_array_equal(greedy[0], expected)


# -- eos, padding, stopping, cache protocol ----------------------------------------------------------------------
def chain_table(next_of: dict[int, int]) -> np.ndarray:
    table = np.zeros((V, V), dtype=np.float32)
    for a, b in next_of.items():
        table[a, b] = 10.0
    return table


def test_rows_after_eos_are_padded_and_generation_stops_when_all_done():
    # 1 -> 2 -> 3 -> eos(9); 5 -> eos; 6 -> 6 -> ... never ends
    model = BigramLM(chain_table({1: 2, 2: 3, 3: 9, 5: 9, 9: 4, 6: 6}), eos=9, pad=0)
    out = generate(model, np.array([[1], [5]]), max_new_tokens=10)
    np.testing.assert_array_equal(out, [[1, 2, 3, 9], [5, 9, 0, 0]])  # stops after 3 steps: both rows done
    out = generate(model, np.array([[1], [6]]), max_new_tokens=5)
    np.testing.assert_array_equal(out, [[1, 2, 3, 9, 0, 0], [6, 6, 6, 6, 6, 6]])


def test_several_eos_ids_and_pad_defaults_to_first_eos():
    model = BigramLM(chain_table({1: 8, 5: 9, 8: 2, 9: 2}))
    out = generate(model, np.array([[1], [5]]), max_new_tokens=4, eos_token_id=[9, 8])
    np.testing.assert_array_equal(out, [[1, 8], [5, 9]])
    out = generate(model, np.array([[1], [2]]), max_new_tokens=3, eos_token_id=(8,), pad_token_id=None)
    np.testing.assert_array_equal(out[0], [1, 8, 8, 8])  # HF: without a pad id, finished rows repeat the eos


def test_model_config_supplies_eos_and_explicit_arguments_win():
    model = BigramLM(chain_table({1: 9, 9: 2, 2: 2}), eos=9, pad=7)
    np.testing.assert_array_equal(generate(model, [[1]], max_new_tokens=3), [[1, 9]])
    np.testing.assert_array_equal(generate(model, [[1]], max_new_tokens=3, eos_token_id=2, pad_token_id=0),
                                  [[1, 9, 2]])


def test_prefill_once_then_one_token_per_step():
    model = BigramLM(np.random.default_rng(4).standard_normal((V, V)))
    prompt = np.array([[0, 0, 3, 4], [5, 6, 7, 8]])
    mask = np.array([[0, 0, 1, 1], [1, 1, 1, 1]])
    out = generate(model, prompt, mask, max_new_tokens=5)
    assert out.shape == (2, 9) and out.dtype == np.int64
    assert model.calls == [((2, 4), (2, 4))] + [((2, 1), (2, 4 + i)) for i in range(1, 5)]


def test_the_loop_runs_the_whole_sequence_again_where_the_model_says_its_cache_goes_stale():
    model = BigramLM(np.eye(V)[np.roll(np.arange(V), -1)])
    model.reprefill_length = 5  # the model's answer; the loop knows nothing of why (Phi-3's longrope)
    generate(model, [[1, 2, 3, 4], [1, 2, 3, 4]], max_new_tokens=4)
    # prefill 4; step 1 makes 5 tokens (not past 5): one token; step 2 makes 6: all 6 again, once; then one each
    assert model.calls == [((2, 4), (2, 4)), ((2, 1), (2, 5)), ((2, 6), (2, 6)), ((2, 1), (2, 7))]


def test_stream_yields_each_step_and_matches_generate():
    model = BigramLM(np.random.default_rng(6).standard_normal((V, V)))
    prompt = np.array([[1, 2], [3, 4]])
    steps = list(generate_stream(model, prompt, max_new_tokens=6, do_sample=True, seed=5, min_p=0.1))
    assert len(steps) == 6 and all(s.shape == (2,) and s.dtype == np.int64 for s in steps)
    full = generate(model, prompt, max_new_tokens=6, do_sample=True, seed=5, min_p=0.1)
    np.testing.assert_array_equal(full[:, 2:], np.stack(steps, axis=1))


def test_zero_new_tokens_returns_a_copy_of_the_prompt():
    model = BigramLM(np.zeros((V, V)))
    prompt = np.array([[1, 2, 3]])
    out = generate(model, prompt, max_new_tokens=0)
    np.testing.assert_array_equal(out, prompt)
    assert out is not prompt and model.calls == []


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(input_ids=[1, 2]), ValueError, "input_ids must be"),
    (dict(input_ids=[[1.5, 2.0]]), ValueError, "input_ids must be"),
    (dict(input_ids=np.zeros((1, 0), int)), ValueError, "input_ids must be"),
    (dict(input_ids=[[1, V]]), ValueError, r"token ids in \[0, 12\)"),
    (dict(input_ids=[[1, -1]]), ValueError, r"token ids in \[0, 12\)"),
    (dict(attention_mask=[[1, 1, 1]]), ValueError, "attention_mask must have"),
    (dict(attention_mask=[[1, 2]]), ValueError, "only 0 and 1"),
    (dict(attention_mask=[[1, 0]]), ValueError, "left-padded"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=2.0), TypeError, "max_new_tokens"),
    (dict(do_sample="yes"), TypeError, "do_sample"),
    (dict(temperature=0.0), ValueError, "do_sample=False"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(min_p=-0.1), ValueError, "min_p"),
    (dict(seed=-3), ValueError, "seed"),
    (dict(seed="abc"), ValueError, "seed"),
    (dict(eos_token_id="9"), ValueError, "eos_token_id"),
    (dict(eos_token_id=[1, -1]), ValueError, "eos_token_id"),
    (dict(pad_token_id=-1), ValueError, "pad_token_id"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    model = BigramLM(np.zeros((V, V)))
    args = dict(input_ids=[[1, 2]], max_new_tokens=3, do_sample=True)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        generate(model, **args)
    assert model.calls == []  # checked before the model runs


def test_learned_positions_cannot_run_past_the_table():
    model = BigramLM(np.zeros((V, V)), position="learned", max_positions=6)
    assert generate(model, [[1, 2]], max_new_tokens=4).shape == (1, 6)
    with pytest.raises(ValueError, match="exceeds the model's 6 learned positions"):
        generate(model, [[1, 2]], max_new_tokens=5)


@pytest.mark.parametrize("call, match", [
    (lambda: temperature_warp(np.ones(3), -1.0), "temperature"),
    (lambda: top_k_filter(np.ones(3), 0), "top_k must be positive"),
    (lambda: top_p_filter(np.ones(3), 0.5, min_tokens_to_keep=0), "min_tokens_to_keep"),
    (lambda: min_p_filter(np.ones(3, dtype=int), 0.5), "floating"),
    (lambda: sample_tokens(np.ones(3), np.random.default_rng(0)), r"\(B, V\)"),
])
def test_warper_argument_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_causal_lm_answers_the_loop_from_its_own_parts():
    from attnkit.models import CausalLM
    from decoder_cases import tiny_config

    plain = CausalLM(tiny_config(), rng=0)
    assert plain.reprefill_length is None and plain.max_sequence_length is None
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 16, "short_factor": [1.0, 1.0],
               "long_factor": [2.0, 3.0]}
    assert CausalLM(tiny_config(rotary=dict(scaling=scaling)), rng=0).reprefill_length == 16
    learned = CausalLM(tiny_config("gpt2"), rng=0)  # max_position_embeddings=64 learned rows
    assert learned.reprefill_length is None and learned.max_sequence_length == 64
