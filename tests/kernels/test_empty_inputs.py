"""Empty batches, empty head groups and empty sequences: both kernels and the modules built on them give
empty (or zero) results of the right shapes, forward and backward, instead of crashing."""
import numpy as np
import pytest

from attnkit.attention import MultiHeadAttention
from attnkit.kernels.reference import attention_backward, attention_forward
from attnkit.kernels.tiled import flash_attention_backward, flash_attention_forward
from attnkit.models import Seq2SeqConfig, Seq2SeqTransformer, TokenTagger, TokenTaggerConfig

KERNELS = {"reference": (attention_forward, attention_backward),
           "tiled": (lambda *a, **k: flash_attention_forward(*a, num_threads=2, **k), flash_attention_backward)}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_shape,k_shape", [((0, 2, 5, 4), (0, 2, 7, 4)), ((2, 0, 5, 4), (2, 0, 7, 4)),
                                             ((2, 2, 0, 4), (2, 2, 7, 4)), ((2, 2, 5, 4), (2, 2, 0, 4))])
def test_empty_axes_give_empty_or_zero_results(kernel, causal, q_shape, k_shape):
    forward, backward = KERNELS[kernel]
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal(q_shape).astype(np.float32), rng.standard_normal(k_shape).astype(np.float32)
    out, _, ctx = forward(q, k, k, causal=causal)
    assert out.shape == q_shape and out.dtype == np.float32 and not out.any()  # no key: zero output
    dq, dk, dv = backward(np.ones_like(out), ctx)[:3]
    assert (dq.shape, dk.shape, dv.shape) == (q_shape, k_shape, k_shape)
    assert not dq.any() and not dk.any() and not dv.any()


def test_modules_take_an_empty_batch():
    mha = MultiHeadAttention(8, 2, rng=0)
    x = np.zeros((0, 3, 8), np.float32)
    out, _ = mha(x, x, x, need_weights=False)
    assert out.shape == (0, 3, 8)
    assert [g.shape for g in mha.backward(np.zeros_like(out))] == [(0, 3, 8)] * 3
    tagger = TokenTagger(TokenTaggerConfig(10, 4, 8, d_model=8, num_heads=2, num_layers=1), rng=0)
    assert tagger(np.zeros((0, 5), np.int64)).shape == (0, 5, 4)
    s2s = Seq2SeqTransformer(Seq2SeqConfig(12, 12, 16, 2, num_encoder_layers=1, num_decoder_layers=1, d_ff=24,
                                           max_length=16), rng=0)
    for beams in (1, 3):
        out = s2s.generate(np.zeros((0, 3), np.int64), bos_token_id=1, eos_token_id=2, max_new_tokens=4,
                           num_beams=beams)
        assert out.shape == (0, 1) and out.dtype == np.int64
