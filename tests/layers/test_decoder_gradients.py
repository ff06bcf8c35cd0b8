"""Finite-difference checks (float64) of the decoder block, the decoder stack and the encoder-decoder Transformer.

Every backward is compared with central differences of ``sum(output * R)`` for a fixed random ``R``, for the
inputs (target and memory / source) and every parameter, pre- and post-norm, relu and gelu, with masks.
"""
import numpy as np
import pytest

from attnkit.attention import AdditiveAttention
from attnkit.layers import Transformer, TransformerDecoder, TransformerDecoderBlock

from helpers import assert_gradient, make_rng, numerical_gradient, randn

B, LT, LS, D, H, F = 2, 3, 4, 4, 2, 6


def _padding(lengths, length):
    return np.arange(length)[None, :] < np.asarray(lengths)[:, None]  # (B, L)


def _check_all(run, backward, inputs, module, out_shape, rng):
    weight = randn(rng, *out_shape)
    loss = lambda: float(np.sum(run() * weight))  # noqa: E731
    module.zero_grad()
    run()
    grads = backward(weight)
    for (name, x), g in zip(inputs.items(), grads, strict=True):
        assert_gradient(loss, x, g, name)
    analytic = {name: g.copy() for name, g in module.named_gradients()}
    owners = dict(module.named_modules())
    for name, p in module.named_parameters():
        owner = owners[name.rpartition(".")[0]]
        if name.endswith("b_K") and not isinstance(owner.attention, AdditiveAttention):
            # Under dot-product scores a key bias shifts every score of a query alike: its gradient is 0.
            np.testing.assert_allclose(analytic[name], 0.0, atol=1e-12)
            np.testing.assert_allclose(numerical_gradient(loss, p), 0.0, atol=1e-8)
        else:
            assert_gradient(loss, p, analytic[name], name)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("cross_attention", ["dot", "additive"])
def test_decoder_block_gradients(norm_first, activation, cross_attention):
    rng = make_rng(1, norm_first, len(activation), len(cross_attention))
    block = TransformerDecoderBlock(D, H, F, norm_first=norm_first, activation=activation, attention_bias=True,
                                    cross_attention=cross_attention, rng=rng)
    for _, p in block.named_parameters():  # non-trivial norms and biases
        p += 0.1 * rng.standard_normal(p.shape)
    x, memory = randn(rng, B, LT, D), randn(rng, B, LS, D)
    tgt_pad, mem_pad = _padding([3, 2], LT), _padding([4, 2], LS)

    def run():
        return block(x, memory, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=mem_pad, tgt_is_causal=True)

    _check_all(run, block.backward, {"x": x, "memory": memory}, block, (B, LT, D), rng)


def test_decoder_stack_gradients_with_explicit_masks():
    rng = make_rng(2)
    dec = TransformerDecoder(2, D, H, F, norm_first=True, rng=rng)
    x, memory = randn(rng, B, LT, D), randn(rng, B, LS, D)
    tgt_mask = np.tril(np.ones((LT, LT), bool))
    memory_mask = rng.random((LT, LS)) < 0.7
    memory_mask[:, 0] = True

    def run():
        return dec(x, memory, tgt_mask=tgt_mask, memory_mask=memory_mask)

    _check_all(run, dec.backward, {"x": x, "memory": memory}, dec, (B, LT, D), rng)


@pytest.mark.parametrize("norm_first", [True, False])
def test_transformer_gradients(norm_first):
    rng = make_rng(3, norm_first)
    model = Transformer(D, H, 1, 2, F, norm_first=norm_first, activation="gelu", attention_bias=True, rng=rng)
    src, tgt = randn(rng, B, LS, D), randn(rng, B, LT, D)
    src_pad = _padding([4, 3], LS)

    def run():
        return model(src, tgt, src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad,
                     tgt_key_padding_mask=_padding([3, 3], LT), tgt_is_causal=True)

    _check_all(run, model.backward, {"src": src, "tgt": tgt}, model, (B, LT, D), rng)


def test_decoder_block_float32_in_float32_out():
    block = TransformerDecoderBlock(D, H, F, rng=0).astype(np.float32)
    rng = make_rng(4)
    x, memory = randn(rng, B, LT, D, dtype=np.float32), randn(rng, B, LS, D, dtype=np.float32)
    y = block(x, memory, tgt_is_causal=True)
    grad_x, grad_memory = block.backward(np.ones_like(y))
    assert y.dtype == grad_x.dtype == grad_memory.dtype == np.float32


def test_decoder_block_fully_masked_queries_are_zero_not_nan():
    rng = make_rng(5)
    block = TransformerDecoderBlock(D, H, F, norm_first=True, rng=rng)
    x, memory = randn(rng, B, LT, D), randn(rng, B, LS, D)
    memory_mask = np.zeros((LT, LS), bool)  # no query may see the memory: cross-attention adds nothing
    y = block(x, memory, memory_mask=memory_mask, tgt_is_causal=True)
    grad_x, grad_memory = block.backward(np.ones_like(y))
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(grad_x))
    np.testing.assert_array_equal(grad_memory, 0.0)


def test_decoder_block_rejects_bad_inputs():
    block = TransformerDecoderBlock(D, H, rng=0)
    with pytest.raises(ValueError, match="memory has 5 features"):
        block(np.zeros((1, 2, D)), np.zeros((1, 3, 5)))
    with pytest.raises(ValueError, match="batch size"):
        block(np.zeros((1, 2, D)), np.zeros((2, 3, D)))
    with pytest.raises(ValueError, match="cross_attention"):
        TransformerDecoderBlock(D, H, cross_attention="luong")
    with pytest.raises(RuntimeError, match="before forward"):
        TransformerDecoderBlock(D, H, rng=0).backward(np.zeros((1, 2, D)))


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("cross_attention", ["dot", "additive"])
def test_incremental_decode_equals_full_forward(norm_first, cross_attention):
    from attnkit.decoding.cache import EncoderDecoderCache, KVCache
    rng = make_rng(6, norm_first, len(cross_attention))
    dec = TransformerDecoder(2, D, H, F, norm_first=norm_first, final_norm=True, attention_bias=True,
                             cross_attention=cross_attention, rng=rng)
    x, memory = randn(rng, B, 5, D), randn(rng, B, LS, D)
    mem_pad = _padding([4, 2], LS)
    full, full_cross = dec(x, memory, memory_key_padding_mask=mem_pad, tgt_is_causal=True, need_weights=True)
    cache = EncoderDecoderCache(KVCache(2, B, H, D // H, np.float64))

    def step(chunk):
        return dec(chunk, memory, memory_key_padding_mask=mem_pad, tgt_is_causal=True, need_weights=True, cache=cache)

    pieces = [step(x[:, :3])]  # a 3-position chunk, then one position at a time
    pieces += [step(x[:, t:t + 1]) for t in (3, 4)]
    np.testing.assert_allclose(np.concatenate([out for out, _ in pieces], axis=1), full, rtol=1e-12, atol=1e-12)
    for layer in range(2):  # the cross-attention weights of every step are rows of the full ones
        cross = np.concatenate([weights[layer] for _, weights in pieces], axis=2)  # (B, H, Lt, Ls)
        np.testing.assert_allclose(cross, full_cross[layer], rtol=1e-12, atol=1e-12)
    assert cache.length == 5
    assert cache.cross_attention.stored(1).keys.shape == (B, H, LS, D // H)  # projected on the first step only
    with pytest.raises(RuntimeError, match="a cached forward keeps nothing"):
        dec.layers[0].backward(np.ones((B, 1, D)))  # the cached path keeps nothing for a backward


def test_decoder_block_backward_checks_the_gradient_shape():
    block = TransformerDecoderBlock(D, H, rng=0)
    block(np.zeros((1, 2, D)), np.zeros((1, 3, D)))
    with pytest.raises(ValueError, match=r"TransformerDecoderBlock: grad_output has shape \(1, 3, 4\)"):
        block.backward(np.zeros((1, 3, D)))
