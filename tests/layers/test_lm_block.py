"""LMBlock: the pre-norm block's backward is exact for both norm/MLP kinds."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.layers.gated_mlp import GatedMLP
from attnkit.layers.layer_norm import LayerNorm
from attnkit.layers.lm_block import LMBlock
from attnkit.layers.rms_norm import RMSNorm
from attnkit.layers.rotary import RotaryEmbedding
from decoder_cases import tiny_config

from helpers import assert_gradient, make_rng, randn


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_block_gradients_by_finite_differences(family):
    rng = make_rng(len(family))
    cfg = tiny_config(family, hidden_size=8, num_heads=2, num_kv_heads=1 if family == "llama" else 2, head_dim=4,
                      mlp=dict(intermediate_size=6))
    block = LMBlock(cfg, 1, rng=rng)
    for name, p in block.named_parameters():
        p[...] = (1.0 if name.endswith("gamma") else 0.0) + 0.4 * rng.standard_normal(p.shape)
    assert isinstance(block.attn_norm, RMSNorm if family == "llama" else LayerNorm)
    assert isinstance(block.mlp, GatedMLP) == (family == "llama")
    mask = np.array([[True] * 4, [False, True, True, True]])
    rotary = None
    if family == "llama":
        table = RotaryEmbedding(cfg.rotary, cfg.head_dim, cfg.max_position_embeddings)
        rotary = table(np.maximum(np.cumsum(mask, 1) - 1, 0), np.float64)
    x, g = randn(rng, 2, 4, 8), randn(rng, 2, 4, 8)

    def loss():
        return np.sum(block(x, rotary=rotary, attention_mask=mask) * g)

    loss()
    grad_x = block.backward(g)
    assert_gradient(loss, x, grad_x, "x")
    grads = dict(block.named_gradients())
    for name, p in block.named_parameters():
        if name.endswith("b_K") and rotary is None:  # softmax ignores a per-query constant: exactly zero
            assert np.max(np.abs(grads[name])) < 1e-12
            continue
        assert_gradient(loss, p, grads[name], name)
