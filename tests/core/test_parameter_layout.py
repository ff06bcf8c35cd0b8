"""A parameter stored column-major: its transpose is the contiguous array, everything else unchanged."""
import numpy as np
import pytest

from attnkit.core.module import Module
from attnkit.init import empty_init
from attnkit.models import CausalLM, DecoderConfig, MLPConfig


class Table(Module):
    def __init__(self):
        super().__init__()
        self.register_parameter("W", np.arange(6.0).reshape(2, 3))
        self.register_parameter("b", np.zeros(3))


def test_a_column_major_parameter_keeps_its_shape_values_and_everything_else():
    table = Table()
    table.store_column_major("W")
    w = table.W
    assert w.flags.f_contiguous and not w.flags.c_contiguous and w.T.flags.c_contiguous
    assert np.array_equal(w, np.arange(6.0).reshape(2, 3))
    table.store_column_major("W")  # already column-major: the same array
    assert table.W is w
    state = table.state_dict()
    assert state["W"].flags.c_contiguous and np.array_equal(state["W"], w)
    grad = table.grads["W"]
    assert grad.flags.c_contiguous and grad.shape == (2, 3) and not grad.any()
    table.W = np.ones((2, 3))  # assignment copies into it
    assert table.W is w and np.array_equal(w, np.ones((2, 3)))
    table.astype(np.float32)
    assert table.W.dtype == np.float32 and table.W.flags.f_contiguous


def test_only_a_two_dimensional_parameter_can_be_stored_column_major():
    with pytest.raises(ValueError, match=r"only a 2-D parameter .* 'b' has shape \(3,\)"):
        Table().store_column_major("b")


def test_under_empty_init_the_column_major_array_is_allocated_in_the_target_dtype():
    with empty_init(np.float32):
        table = Table()
        table.store_column_major("W")
    assert table.W.dtype == np.float32 and table.W.flags.f_contiguous


@pytest.mark.parametrize("tied", [True, False])
def test_the_language_model_head_is_column_major_and_gives_the_same_logits_and_gradients(tied):
    cfg = DecoderConfig(family="llama", vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=8, mlp=MLPConfig(24), tie_word_embeddings=tied)
    lm = CausalLM(cfg, rng=0)
    owner = lm.embed if tied else lm.head
    assert lm.head_weight.flags.f_contiguous and lm.head_weight is owner.weight
    ids = np.random.default_rng(1).integers(0, 40, size=(2, 5))
    logits = lm(ids)
    lm.backward(np.ones_like(logits))
    grad = owner.grads["weight"].copy()
    assert owner.grads["weight"].flags.c_contiguous

    row_major = CausalLM(cfg, rng=0)
    row_owner = row_major.embed if tied else row_major.head
    row_owner.register_parameter("weight", np.ascontiguousarray(row_owner.weight))
    assert row_major.head_weight.flags.c_contiguous
    expected = row_major(ids)
    row_major.backward(np.ones_like(expected))
    np.testing.assert_allclose(logits, expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(grad, row_owner.grads["weight"], rtol=1e-12, atol=1e-14)

    reloaded = CausalLM(cfg, rng=5)
    reloaded.load_state_dict(lm.state_dict())
    assert reloaded.head_weight.flags.f_contiguous and np.array_equal(reloaded(ids), logits)
