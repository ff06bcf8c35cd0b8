"""Seq2SeqTransformer: exact gradients, cached decoding equal to full recomputation, exact beam search."""
import itertools

import numpy as np
import pytest

from attnkit.decoding.beam_search import beam_search
from attnkit.models import Seq2SeqConfig, Seq2SeqTransformer

from helpers import assert_gradient, make_rng, numerical_gradient

PAD, BOS, EOS = 0, 1, 2


def _model(vocab=7, cross_attention="dot", seed=0, d_model=8):
    model = Seq2SeqTransformer(Seq2SeqConfig(9, vocab, d_model=d_model, num_heads=2, num_encoder_layers=2,
                                             num_decoder_layers=2, d_ff=12, max_length=12,
                                             cross_attention=cross_attention), rng=seed)
    head = model.head
    head.W = 3.0 * head.W  # peakier next-token distributions: hypotheses end at different lengths
    return model


def _source(rng, lengths, length=6):
    ids = rng.integers(3, 9, size=(len(lengths), length))  # (B, Ls)
    pad = np.arange(length)[None, :] < np.asarray(lengths)[:, None]  # (B, Ls)
    return np.where(pad, ids, PAD), pad


def _log_probs(model, src, pad, tgt):
    logits = model(np.repeat(src, len(tgt), axis=0), tgt, np.repeat(pad, len(tgt), axis=0))  # (R, L, V)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # (R, L, V)


def _uncached_greedy(model, src, pad, max_new_tokens):
    tgt = np.full((1, 1), BOS)
    for _ in range(max_new_tokens):
        nxt = _log_probs(model, src, pad, tgt)[0, -1].argmax()
        tgt = np.concatenate([tgt, [[nxt]]], axis=1)
        if nxt == EOS:
            break
    return tgt[0]


def test_gradients_match_finite_differences():
    rng = make_rng(1)
    model = Seq2SeqTransformer(Seq2SeqConfig(6, 5, d_model=4, num_heads=2, num_encoder_layers=1,
                                             num_decoder_layers=1, d_ff=6, max_length=8), rng=rng)
    src, pad = _source(rng, [5, 3], length=5)
    src = np.where(pad, src % 6, PAD)
    tgt = rng.integers(0, 5, size=(2, 4))
    tgt_pad = np.arange(4)[None, :] < np.array([[4], [3]])
    weight = rng.standard_normal((2, 4, 5))
    loss = lambda: float(np.sum(model(src, tgt, pad, tgt_pad) * weight))  # noqa: E731
    model.zero_grad()
    loss()
    model.backward(weight)
    analytic = {name: g.copy() for name, g in model.named_gradients()}
    for name, p in model.named_parameters():
        if name.endswith("b_K") or name.endswith("b"):
            continue
        assert_gradient(loss, p, analytic[name], name)
    np.testing.assert_allclose(numerical_gradient(loss, model.head.b), analytic["head.b"], atol=1e-8)


@pytest.mark.parametrize("cross_attention", ["dot", "additive"])
def test_cached_greedy_equals_uncached_argmax_loop(cross_attention):
    model = _model(cross_attention=cross_attention, seed=2)
    rng = make_rng(2)
    src, pad = _source(rng, [6, 4, 2])
    ids = model.generate(src, pad, bos_token_id=BOS, eos_token_id=EOS, max_new_tokens=8)
    assert ids.shape[0] == 3 and ids.shape[1] <= 9 and np.all(ids[:, 0] == BOS)
    for row in range(3):
        expected = _uncached_greedy(model, src[row:row + 1], pad[row:row + 1], 8)
        np.testing.assert_array_equal(ids[row, :len(expected)], expected)
        assert np.all(ids[row, len(expected):] == PAD)


def _exhaustive(model, src, pad, vocab, max_new_tokens, length_penalty):
    """The best-scoring sequence over every sequence ending in eos (or reaching max_new_tokens)."""
    best, best_score = None, -np.inf
    others = [t for t in range(vocab) if t != EOS]
    for n in range(1, max_new_tokens + 1):
        bodies = list(itertools.product(others, repeat=n - 1))
        last = [[EOS]] if n < max_new_tokens else [[t] for t in range(vocab)]
        seqs = np.array([list(b) + t for b in bodies for t in last]).reshape(-1, n)  # (S, n)
        tgt = np.concatenate([np.full((len(seqs), 1), BOS), seqs[:, :-1]], axis=1)  # (S, n)
        lp = _log_probs(model, src, pad, tgt)  # (S, n, V)
        sums = np.take_along_axis(lp, seqs[..., None], axis=2)[..., 0].sum(axis=1)  # (S,)
        scores = sums / n ** length_penalty
        i = int(scores.argmax())
        if scores[i] > best_score:
            best, best_score = seqs[i], scores[i]
    return np.concatenate([[BOS], best])


@pytest.mark.parametrize("length_penalty", [0.0, 0.6, 1.0, 2.0, -1.0])
def test_beam_search_with_enough_beams_is_exhaustive_search(length_penalty):
    vocab, n_max = 5, 3
    rng = make_rng(3)
    src, pad = _source(rng, [6, 3, 5, 4])
    found = []
    for seed in range(4):
        model = _model(vocab=vocab, seed=10 + seed)
        ids = model.generate(src, pad, bos_token_id=BOS, eos_token_id=EOS, max_new_tokens=n_max,
                             num_beams=(vocab - 1) ** (n_max - 1), length_penalty=length_penalty)
        for row in range(len(src)):
            expected = _exhaustive(model, src[row:row + 1], pad[row:row + 1], vocab, n_max, length_penalty)
            np.testing.assert_array_equal(ids[row, :len(expected)], expected)
            assert np.all(ids[row, len(expected):] == PAD)
            found.append(len(expected))
    assert len(set(found)) > 1, "every winner had the same length: the test would not see length handling"


def test_one_beam_is_greedy():
    model = _model(seed=4)
    src, pad = _source(make_rng(4), [6, 5, 3])
    greedy = model.generate(src, pad, bos_token_id=BOS, eos_token_id=EOS, max_new_tokens=8)
    one_beam = model.generate(src, pad, bos_token_id=BOS, eos_token_id=EOS, max_new_tokens=8, num_beams=1)
    np.testing.assert_array_equal(one_beam, greedy)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_padded_batch_rows_equal_each_row_alone(num_beams):
    model = _model(seed=5)
    src, pad = _source(make_rng(5), [6, 2, 4, 5])
    kwargs = dict(bos_token_id=BOS, eos_token_id=EOS, max_new_tokens=8, num_beams=num_beams)
    batch = model.generate(src, pad, **kwargs)
    for row in range(len(src)):
        alone = model.generate(src[row:row + 1, :pad[row].sum()], **kwargs)[0]
        np.testing.assert_array_equal(batch[row, :len(alone)], alone)
        assert np.all(batch[row, len(alone):] == PAD)


def test_beam_search_prunes_to_the_best_sums():
    """A hand-made distribution where greedy and 2-beam search disagree, as in the textbook example."""
    table = {(): [0.0, 0.0, 0.0, 0.5, 0.5 - 1e-9],  # first token: 3 (0.5) or 4 (just below)
             (3,): [0.0, 0.0, 0.3, 0.35, 0.35], (4,): [0.0, 0.0, 0.9, 0.05, 0.05]}

    class State:
        def __init__(self):
            self.rows = [()]

        def step(self, tokens, t):
            if t > 0:
                self.rows = [r + (int(tok),) for r, tok in zip(self.rows, tokens, strict=True)]
            probs = np.array([table.get(r, [0.0, 0.0, 1.0, 0.0, 0.0]) for r in self.rows]) + 1e-12
            return np.log(probs / probs.sum(1, keepdims=True))

        def reorder(self, index):
            self.rows = [self.rows[i] for i in index]

    common = dict(bos_token_id=BOS, eos_token_id=EOS, max_new_tokens=3, length_penalty=0.0)
    np.testing.assert_array_equal(beam_search(State(), 1, num_beams=2, **common), [[BOS, 4, EOS]])
    np.testing.assert_array_equal(beam_search(State(), 1, num_beams=1, **common)[0, :2], [BOS, 3])


def test_generate_rejects_bad_arguments():
    model = _model()
    src = np.array([[3, 4]])
    with pytest.raises(ValueError, match="eos_token_id"):
        model.generate(src, bos_token_id=BOS, eos_token_id=99, max_new_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(src, bos_token_id=BOS, eos_token_id=EOS, max_new_tokens=50)
    with pytest.raises(ValueError, match="src_key_padding_mask"):
        model.generate(src, np.ones((1, 2), int), bos_token_id=BOS, eos_token_id=EOS, max_new_tokens=3)
    with pytest.raises(ValueError, match="src_ids"):
        model(np.array([[3.0]]), np.array([[1]]))


def test_generate_restores_training_mode_and_float32():
    model = _model().astype(np.float32)
    ids = model.generate(np.array([[3, 4, 5]]), bos_token_id=BOS, eos_token_id=EOS, max_new_tokens=4, num_beams=2)
    assert model.training and ids.dtype == np.int64
    assert model(np.array([[3, 4]]), np.array([[1, 3]])).dtype == np.float32


def test_generate_takes_a_generation_config_and_arguments_replace_its_options():
    from attnkit.decoding import GenerationConfig
    model = _model()
    src, pad = _source(make_rng(5), [6, 4, 2])
    by_arguments = model.generate(src, pad, bos_token_id=BOS, eos_token_id=EOS, max_new_tokens=6, num_beams=3,
                                  length_penalty=0.5)
    config = GenerationConfig(eos_token_id=EOS, max_new_tokens=6, num_beams=3, length_penalty=0.5,
                              early_stopping="never")
    np.testing.assert_array_equal(model.generate(src, pad, bos_token_id=BOS, generation_config=config), by_arguments)
    greedy = model.generate(src, pad, bos_token_id=BOS, generation_config=config, num_beams=1)
    np.testing.assert_array_equal(greedy, model.generate(src, pad, bos_token_id=BOS, eos_token_id=EOS,
                                                         max_new_tokens=6))
    model.generation_config = config  # the model's defaults, as a loaded folder's would be
    np.testing.assert_array_equal(model.generate(src, pad, bos_token_id=BOS), by_arguments)


@pytest.mark.parametrize("options, error, match", [
    (dict(do_sample=True), ValueError, r"generation_config also sets do_sample=True"),
    (dict(repetition_penalty=1.2), ValueError, r"also sets repetition_penalty=1.2"),
    (dict(eos_token_id=[EOS, 3]), ValueError, r"eos_token_id must be an id in \[0, 7\), got \[2, 3\]"),
    (dict(max_new_tokens=0), ValueError, r"max_new_tokens must be in \[1, max_length = 12\], got 0"),
    (dict(pad_token_id=7), ValueError, r"pad_token_id must be an id in \[0, 7\), got 7"),
])
def test_generate_refuses_options_greedy_and_beam_search_do_not_implement(options, error, match):
    from attnkit.decoding import GenerationConfig
    config = GenerationConfig(**{"eos_token_id": EOS, "max_new_tokens": 4, **options})
    with pytest.raises(error, match=match):
        _model().generate(np.array([[3, 4]]), bos_token_id=BOS, generation_config=config)
    with pytest.raises(TypeError, match="generation_config must be a GenerationConfig, got dict"):
        _model().generate(np.array([[3, 4]]), bos_token_id=BOS, generation_config={"num_beams": 2})
