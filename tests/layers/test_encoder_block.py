"""TransformerEncoderBlock is its sublayers: flat names are live views, state dicts keyed by the flat
names load through ``STATE_DICT_RENAMES``, and the block and the stack share one loop.

Dimension letters: B batch, L sequence length, D model dim, F feed-forward dim.
"""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.layers import FeedForward, LayerNorm, TransformerEncoder, TransformerEncoderBlock
from attnkit.transformer_block import TransformerEncoderBlock as SpecBlock
from attnkit.transformer_block import stack_encoder_blocks

from helpers import make_rng, randn

FLAT = {"W1": "ffn.W1", "b1": "ffn.b1", "W2": "ffn.W2", "b2": "ffn.b2", "gamma1": "norm1.gamma",
        "beta1": "norm1.beta", "gamma2": "norm2.gamma", "beta2": "norm2.beta"}


def test_block_is_made_of_its_layers_and_the_spec_module_re_exports_it():
    block = TransformerEncoderBlock(8, 2, 12, rng=0)
    assert SpecBlock is TransformerEncoderBlock
    assert isinstance(block.norm1, LayerNorm) and isinstance(block.norm2, LayerNorm)
    assert isinstance(block.ffn, FeedForward)
    assert block._parameters == {}  # every parameter belongs to a sublayer
    assert TransformerEncoderBlock.STATE_DICT_RENAMES == FLAT


@pytest.mark.parametrize("flat", sorted(FLAT))
def test_flat_names_are_live_writable_views_of_the_sublayers(flat):
    rng = make_rng(40, sorted(FLAT).index(flat))
    block = TransformerEncoderBlock(8, 2, 12, rng=0)
    layer, name = FLAT[flat].split(".")
    sub = getattr(block, layer)
    assert getattr(block, flat) is getattr(sub, name)
    value = randn(rng, *getattr(block, flat).shape)
    getattr(block, flat)[...] = value  # in-place write through the flat name
    np.testing.assert_array_equal(getattr(sub, name), value)
    setattr(block, flat, 2 * value)  # assignment through the flat name
    np.testing.assert_array_equal(getattr(sub, name), 2 * value)
    assert getattr(block, flat) is getattr(sub, name)
    with pytest.raises(ValueError, match="shape"):
        setattr(block, flat, np.zeros(3))


def test_flat_names_follow_astype():
    block = TransformerEncoderBlock(8, 2, 12, rng=0).astype(np.float32)
    assert block.W1.dtype == np.float32 and block.W1 is block.ffn.W1
    block.gamma2[0] = 5.0
    assert block.norm2.gamma[0] == 5.0


def test_writing_W1_changes_the_output():
    x = randn(make_rng(41), 2, 4, 8)
    block = TransformerEncoderBlock(8, 2, 12, rng=0)
    before = block(x)
    block.W1 = 3.0 * block.W1
    assert not np.allclose(block(x), before)


def test_state_dict_with_flat_names_loads_into_the_block():
    """A state dict keyed by the flat names (W1, gamma1, ...) loads through STATE_DICT_RENAMES."""
    source = TransformerEncoderBlock(8, 2, 12, attention_bias=True, rng=1)
    for _, p in source.named_parameters():
        p += randn(make_rng(42), *p.shape)
    flat_state = {name: np.array(p) for name, p in source.named_parameters() if name.startswith("attention.")}
    flat_state.update({flat: np.array(getattr(source, flat)) for flat in FLAT})
    target = TransformerEncoderBlock(8, 2, 12, attention_bias=True, rng=2)
    target.load_state_dict(flat_state)
    for name, p in source.named_parameters():
        np.testing.assert_array_equal(dict(target.named_parameters())[name], p, err_msg=name)


def test_state_dict_with_flat_names_loads_into_a_stack():
    """Renames apply under a prefix too: ``layers.0.W1`` -> ``layers.0.ffn.W1``."""
    source = TransformerEncoder(2, 8, 2, 12, rng=1)
    state = {}
    for name, p in source.named_parameters():
        prefix, _, local = name.partition(".")
        if prefix == "layers":
            index, _, local = local.partition(".")
            flat = {v: k for k, v in FLAT.items()}.get(local, local)
            state[f"layers.{index}.{flat}"] = np.array(p) + 1.0
        else:
            state[name] = np.array(p) + 1.0
    target = TransformerEncoder(2, 8, 2, 12, rng=2)
    target.load_state_dict(state)
    np.testing.assert_array_equal(target.layers[1].ffn.W2, source.layers[1].ffn.W2 + 1.0)
    np.testing.assert_array_equal(target.layers[0].norm1.gamma, source.layers[0].norm1.gamma + 1.0)


@pytest.mark.parametrize("norm_first", [True, False])
def test_stack_encoder_blocks_equals_the_encoder_module_without_final_norm(norm_first):
    x = randn(make_rng(43), 2, 5, 8)
    enc = TransformerEncoder(3, 8, 2, 12, norm_first=norm_first, final_norm=False, rng=0)
    mask = np.tril(np.ones((5, 5), bool))
    np.testing.assert_array_equal(stack_encoder_blocks(x, list(enc.layers), mask=mask), enc(x, mask=mask))


def test_same_seed_gives_the_same_block():
    a, b = TransformerEncoderBlock(8, 2, 12, rng=5), TransformerEncoderBlock(8, 2, 12, rng=5)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=False):
        np.testing.assert_array_equal(p, q, err_msg=name)
    assert not np.array_equal(a.W1, TransformerEncoderBlock(8, 2, 12, rng=6).W1)
