"""The addition demo: its data is what it says, and its cached greedy decoding equals an uncached argmax loop."""
from __future__ import annotations

import numpy as np

from attnkit.demos.addition import (
    EOS,
    AdditionConfig,
    decode_answer,
    encode,
    greedy_answers,
    make_batch,
    train_addition,
)
from attnkit.models import CausalLM


def test_batch_holds_the_sum_reversed_and_targets_only_the_answer():
    ids, targets, a, b = make_batch(np.random.default_rng(0), 16, 3)
    assert ids.shape == (16, 3 + 1 + 3 + 1 + 4)
    for row in range(16):
        np.testing.assert_array_equal(ids[row, :8], encode(int(a[row]), int(b[row]), 3))
        answer = list(ids[row, 8:]) + [targets[row, -1]]
        assert decode_answer(answer) == a[row] + b[row]
        assert (targets[row, :7] == -100).all() and targets[row, -1] == EOS


def test_decode_answer_refuses_malformed_text():
    assert decode_answer([1, 2]) is None  # no eos
    assert decode_answer([1, 10, EOS]) is None
    assert decode_answer([EOS]) is None


def test_cached_greedy_equals_uncached_argmax_loop():
    model = CausalLM(AdditionConfig().model_config(), rng=3).astype(np.float32)
    for name, p in model.named_parameters():
        p[...] += 0.3 * np.random.default_rng(len(name)).standard_normal(p.shape)
    prompts = make_batch(np.random.default_rng(1), 5, 2)[0][:, :6]
    cached = greedy_answers(model, prompts, 4)
    text = prompts
    for _ in range(4):
        text = np.concatenate([text, model(text)[:, -1].argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(cached, text[:, 6:])


def test_a_short_run_lowers_the_loss():
    result = train_addition(AdditionConfig(steps=60, batch_size=32, eval_size=16, hidden_size=32, lr=1e-2))
    assert np.mean(result.losses[-10:]) < 0.8 * np.mean(result.losses[:5])
