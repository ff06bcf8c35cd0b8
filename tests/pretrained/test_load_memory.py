"""Loading costs the weights and nothing else: no gradient buffers, no random or float64 copy of the model,
no mapped file. Measured with tracemalloc (NumPy reports its allocations to it), so the figures are exact
byte counts, not timings."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import transformers

import torch
from attnkit.init import empty_init
from attnkit.layers import Projection
from attnkit.pretrained import load_causal_lm


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Llama folder of about 8 MB of float32 weights (big enough that fixed costs do not blur the ratio)."""
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama8mb")
    transformers.LlamaForCausalLM(config).float().save_pretrained(path)
    return path


def _peak_bytes(fn):
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_loading_peaks_at_the_weights_and_allocates_no_gradients(folder, dtype):
    lm, peak = _peak_bytes(lambda: load_causal_lm(folder, dtype=dtype))
    weights = sum(p.nbytes for p in lm.parameters())
    assert weights > 4e6 if dtype == np.float32 else weights > 2e6
    # The largest temporary is one converted tensor (the 2 MB head in float32); nothing is model-sized.
    largest = max(p.nbytes for p in lm.parameters())
    assert peak <= weights + 1.5 * largest + 1e6, (peak, weights, largest)
    assert all(mod.grads.allocated() == [] for _, mod in lm.named_modules())
    ids = np.array([[1, 2, 3]])
    lm.generate(ids, max_new_tokens=3)  # inference creates none either
    assert all(mod.grads.allocated() == [] for _, mod in lm.named_modules())


def test_a_backward_creates_the_buffers_and_zero_grad_can_free_them(folder):
    lm = load_causal_lm(folder, dtype=np.float64)
    logits = lm(np.array([[1, 2, 3]]))
    lm.backward(np.ones_like(logits))
    grads = dict(lm.named_gradients())
    assert set(grads) == {name for name, _ in lm.named_parameters()}
    assert any(np.abs(g).max() > 0 for g in grads.values())
    lm.zero_grad()
    assert all(not g.any() for _, g in lm.named_gradients())
    lm.zero_grad(set_to_none=True)
    assert all(mod.grads.allocated() == [] for _, mod in lm.named_modules())


def test_empty_init_draws_nothing_and_allocates_once_in_the_dtype():
    gen = np.random.default_rng(0)
    state = gen.bit_generator.state
    (proj, peak) = _peak_bytes(lambda: _build_empty(gen))
    assert proj.W.dtype == np.float16 and proj.W.shape == (512, 256)
    assert gen.bit_generator.state == state  # no random numbers drawn
    assert peak <= 2 * proj.W.nbytes + 64 * 1024  # the float16 parameter (and its initialiser's array), no float64
    seeded = Projection(512, 256, rng=0)  # outside the block, initialisation is back
    assert seeded.W.dtype == np.float64 and np.abs(seeded.W).max() > 0


def _build_empty(gen):
    with empty_init(np.float16):
        return Projection(512, 256, rng=gen)
