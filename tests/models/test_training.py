"""Training end to end: a 2-layer encoder built from attnkit modules learns to sort (and to reverse) short
digit sequences to >= 95% token accuracy on held-out data, in float32, with a fixed seed; the trained
model saved through a file (np.savez) and loaded into a fresh model reproduces its outputs bit for bit.

Training runs with BLAS limited to one thread (``blas_single_thread``, a no-op without threadpoolctl): the
matrices are tiny, and OpenBLAS's threads spinning on them cost 5-25x the single-threaded time on 2 busy
cores. Budget measured that way: sort ~4 s of CPU for 600 steps (held-out accuracy >= 99.98% over seeds
0-4), reverse ~3 s for 300 steps (100%). No timing is asserted.
"""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.demos.tasks import make_batch
from attnkit.kernels._threads import blas_single_thread
from attnkit.models import TokenTagger, TokenTaggerConfig, token_accuracy, train_step
from attnkit.optim import Adam, AdamW

SEQ_LEN, DIGITS, BATCH = 8, 10, 64


def warmup_cosine(base_lr: float, step: int, steps: int, warmup: int = 50) -> float:
    return base_lr * min(1.0, (step + 1) / warmup) * 0.5 * (1.0 + np.cos(np.pi * step / steps))


def train(task: str, model: TokenTagger, optimizer, steps: int, seed: int, base_lr: float) -> list[float]:
    rng = np.random.default_rng(seed)
    losses = []
    with blas_single_thread():
        for step in range(steps):
            optimizer.lr = warmup_cosine(base_lr, step, steps)
            ids, targets = make_batch(task, BATCH, SEQ_LEN, DIGITS, rng)
            losses.append(train_step(model, optimizer, ids, targets, max_grad_norm=1.0))
    return losses


@pytest.fixture(scope="module")
def sorter():
    model = TokenTagger(TokenTaggerConfig(DIGITS, DIGITS, SEQ_LEN, d_model=64, num_heads=4, num_layers=2, d_ff=128),
                        rng=0).astype(np.float32)
    losses = train("sort", model, Adam(model, lr=3e-3), steps=600, seed=100, base_lr=3e-3)
    return model, losses


def test_encoder_learns_to_sort_digits(sorter):
    model, losses = sorter
    held_out_ids, held_out_targets = make_batch("sort", 2000, SEQ_LEN, DIGITS, rng=999)
    accuracy = token_accuracy(model, held_out_ids, held_out_targets)
    print(f"\nsort: held-out token accuracy {accuracy:.4%}, final loss {losses[-1]:.4f}")
    assert accuracy >= 0.95
    assert np.mean(losses[-50:]) < 0.1 * np.mean(losses[:10])
    assert model.head.W.dtype == np.float32


def test_trained_model_round_trips_through_a_file_bit_for_bit(sorter, tmp_path):
    model, _ = sorter
    path = tmp_path / "sorter.npz"
    model.save(path)
    fresh = TokenTagger(TokenTaggerConfig(DIGITS, DIGITS, SEQ_LEN, d_model=64, num_heads=4, num_layers=2, d_ff=128),
                        rng=123).astype(np.float32)
    ids, _ = make_batch("sort", 64, SEQ_LEN, DIGITS, rng=5)
    assert not np.array_equal(fresh(ids), model(ids))
    fresh.load(path)
    logits, weights = model(ids, need_weights=True)
    fresh_logits, fresh_weights = fresh(ids, need_weights=True)
    assert np.array_equal(logits, fresh_logits)
    assert all(np.array_equal(a, b) for a, b in zip(weights, fresh_weights, strict=False))


def test_post_norm_gelu_encoder_with_learned_positions_learns_to_reverse():
    model = TokenTagger(TokenTaggerConfig(DIGITS, DIGITS, SEQ_LEN, d_model=64, num_heads=4, num_layers=2, d_ff=128,
                                          norm_first=False, activation="gelu", positional="learned"),
                        rng=1).astype(np.float32)
    train("reverse", model, AdamW(model, lr=3e-3, weight_decay=0.01), steps=300, seed=200, base_lr=3e-3)
    ids, targets = make_batch("reverse", 2000, SEQ_LEN, DIGITS, rng=998)
    accuracy = token_accuracy(model, ids, targets)
    print(f"\nreverse (post-norm, gelu, learned positions): held-out token accuracy {accuracy:.4%}")
    assert accuracy >= 0.95
