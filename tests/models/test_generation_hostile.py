"""Generation under hostile numbers: values that pass a range check but overflow, non-finite penalties, and
token ids out of range. Each gives a correct result or a ValueError/TypeError naming the argument."""
import numpy as np
import pytest

from attnkit.decoding.sampling import generate_stream, sample_tokens, warp_logits
from attnkit.models import CausalLM, DecoderConfig, MLPConfig, Seq2SeqConfig, Seq2SeqTransformer


@pytest.fixture(scope="module")
def lm():
    config = DecoderConfig(family="llama", vocab_size=32, hidden_size=16, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=4, mlp=MLPConfig(24), max_position_embeddings=64)
    return CausalLM(config, rng=3)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_a_vanishing_temperature_samples_the_greedy_token(lm, temperature):
    ids = np.array([[1, 5, 9, 2], [3, 3, 7, 30]])
    greedy = lm.generate(ids, max_new_tokens=6, do_sample=False)
    sampled = lm.generate(ids, max_new_tokens=6, do_sample=True, temperature=temperature, seed=0)
    np.testing.assert_array_equal(sampled, greedy)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_limit_of_a_vanishing_temperature_is_uniform_over_the_largest_logits(dtype):
    logits = np.array([[1.0, 3.0, 3.0, -2.0], [-7.0, -1.0, -3.0, -1.5]], dtype)
    warped = warp_logits(logits, temperature=1e-45)
    assert warped.dtype == dtype and not np.isnan(warped).any()
    rng = np.random.default_rng(0)
    draws = np.array([sample_tokens(warped, rng) for _ in range(2000)])  # (N, 2)
    counts = np.bincount(draws[:, 0], minlength=4)
    assert counts[0] == counts[3] == 0 and 900 < counts[1] < 1100  # the two tied maxima, evenly
    assert (draws[:, 1] == 1).all()
    np.testing.assert_array_equal(warp_logits(logits, temperature=0.5), logits / dtype(0.5))  # no change above


def test_nan_logits_are_refused_rather_than_sampled_as_token_zero():
    with pytest.raises(ValueError, match=r"logits must not be NaN \(rows \[1\]\)"):
        sample_tokens(np.array([[0.0, 1.0], [np.nan, 1.0]]), np.random.default_rng(0))


@pytest.fixture(scope="module")
def s2s():
    return Seq2SeqTransformer(Seq2SeqConfig(12, 12, 16, 2, num_encoder_layers=1, num_decoder_layers=1, d_ff=24,
                                            max_length=16), rng=0)


@pytest.mark.parametrize("penalty,error,match", [
    (float("nan"), ValueError, "length_penalty must be a finite number, got nan"),
    (float("inf"), ValueError, "length_penalty must be a finite number, got inf"),
    (10**400, ValueError, "length_penalty must be a finite number, got an integer of 401 digits"),
    ("1.0", TypeError, "length_penalty must be a number, got str"),
    (True, TypeError, "length_penalty must be a number, got bool"),
])
def test_a_non_finite_length_penalty_is_refused(s2s, penalty, error, match):
    with pytest.raises(error, match=match):
        s2s.generate(np.array([[3, 4, 5]]), bos_token_id=1, eos_token_id=2, max_new_tokens=4, num_beams=2,
                     length_penalty=penalty)


@pytest.mark.parametrize("penalty", [1e308, -1e308, 745.0, -745.0])
def test_an_extreme_finite_length_penalty_still_decodes(s2s, penalty):
    src = np.array([[3, 4, 5], [6, 7, 8]])
    out = s2s.generate(src, bos_token_id=1, eos_token_id=2, max_new_tokens=5, num_beams=3, length_penalty=penalty)
    assert out.dtype == np.int64 and out.shape[0] == 2 and 2 <= out.shape[1] <= 6
    assert (out[:, 0] == 1).all() and ((out >= 0) & (out < 12)).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(pad_token_id=32), r"pad_token_id must be a token id in \[0, 32\), got 32"),
    (dict(pad_token_id=[]), r"pad_token_id must be a token id, got \[\]"),
    (dict(pad_token_id=[1, 2]), r"pad_token_id must be a token id, got \[1, 2\]"),
    (dict(pad_token_id=-1), r"pad_token_id must be a token id in \[0, 32\), got -1"),
    (dict(eos_token_id=10**30), r"eos_token_id must be a token id in \[0, 32\), got 10{30}"),
    (dict(eos_token_id=[3, 40]), r"eos_token_id must be a token id in \[0, 32\), got 40"),
    (dict(eos_token_id="2"), r"eos_token_id must be a token id or a sequence of them, got '2'"),
    (dict(eos_token_id=[[1]]), r"eos_token_id must be a token id or a sequence of them, got \[\[1\]\]"),
    (dict(max_new_tokens=2**31), r"max_new_tokens must be at most 2147483647, got 2147483648"),
])
def test_token_ids_and_lengths_are_checked_before_decoding(lm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        lm.generate(np.array([[1, 2, 3]]), **{"max_new_tokens": 3, **kwargs})


def test_a_0d_array_is_one_token_id(lm):
    ids = np.array([[1, 2, 3]])
    given_as_arrays = lm.generate(ids, max_new_tokens=4, eos_token_id=np.array(7), pad_token_id=np.int64(0))
    np.testing.assert_array_equal(given_as_arrays, lm.generate(ids, max_new_tokens=4, eos_token_id=7, pad_token_id=0))


def test_a_huge_max_new_tokens_reserves_no_memory_up_front(lm):
    import tracemalloc

    ids = np.array([[1, 2, 3]])
    tracemalloc.start()
    try:
        steps = generate_stream(lm, ids, max_new_tokens=2**31 - 1)
        first = [next(steps) for _ in range(3)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [t.shape for t in first] == [(1,)] * 3
    assert peak < 5e6  # a cache sized for 2**31 tokens would be terabytes


@pytest.mark.parametrize("beams,error,match", [
    (1025, ValueError, "num_beams must be at most 1024"),
    (10**12, ValueError, "num_beams must be at most 1024"),
    (0, ValueError, "num_beams must be positive"),
    ("3", TypeError, "num_beams must be an integer"),
    (2.0, TypeError, "num_beams must be an integer"),
])
def test_num_beams_is_bounded_naming_the_argument(s2s, beams, error, match):
    from attnkit.decoding.beam_search import beam_search

    with pytest.raises(error, match=match):
        s2s.generate(np.array([[3, 4, 5]]), bos_token_id=1, eos_token_id=2, max_new_tokens=4, num_beams=beams)

    class NeverStepped:
        def reorder(self, index):
            raise AssertionError("the state must not be touched before num_beams is checked")

    with pytest.raises(error, match=match):
        beam_search(NeverStepped(), 1, num_beams=beams, bos_token_id=1, eos_token_id=2, max_new_tokens=4)


def test_beams_that_cannot_change_the_result_are_not_allocated(s2s):
    """With 12 tokens and 2 new ones at most 11 prefixes are ever open: 1024 beams decode as 11 do, and the
    state holds 11 rows per source row, not 1024."""
    import tracemalloc

    src = np.array([[3, 4, 5], [6, 7, 8]])
    kwargs = dict(bos_token_id=1, eos_token_id=2, max_new_tokens=2)
    exact = s2s.generate(src, num_beams=11, **kwargs)
    tracemalloc.start()
    try:
        most = s2s.generate(src, num_beams=1024, **kwargs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(most, exact)
    assert peak < 2 * 2**20, peak


def test_editing_what_generate_stream_yields_does_not_change_what_it_generates(lm):
    """Each step's array is the caller's own: the model reads its own copy of the tokens it feeds back."""
    ids = np.array([[1, 5, 9, 2], [3, 3, 7, 30]])
    kept = [step.copy() for step in generate_stream(lm, ids, max_new_tokens=6, do_sample=False)]
    edited = []
    for step in generate_stream(lm, ids, max_new_tokens=6, do_sample=False):
        edited.append(step.copy())
        step[:] = 0  # a caller reusing the array (as a buffer, say)
    np.testing.assert_array_equal(np.stack(edited), np.stack(kept))
    assert len({id(step) for step in kept}) == len(kept)


@pytest.mark.parametrize("beams", [1025, 10**12])
def test_a_decoder_lm_bounds_num_beams_too(lm, beams):
    with pytest.raises(ValueError, match="num_beams must be at most 1024"):
        lm.generate(np.array([[1, 5, 9]]), max_new_tokens=3, num_beams=beams)
