"""Parameters kept side by side in one array: one product for several weights, everything else unchanged."""
import numpy as np
import pytest

from attnkit.attention import GroupedQueryAttention
from attnkit.core.module import Module
from attnkit.layers.gated_mlp import GatedMLP
from attnkit.models import AttentionConfig, CausalLM, DecoderConfig, MLPConfig

CFG = DecoderConfig(family="qwen2", vocab_size=16, hidden_size=12, num_layers=2, num_heads=3, num_kv_heads=1,
                    head_dim=4, mlp=MLPConfig(10), attention=AttentionConfig(bias=True))


class Pair(Module):
    def __init__(self):
        super().__init__()
        self.register_parameter("A", np.arange(6.0).reshape(2, 3))
        self.register_parameter("B", -np.arange(4.0).reshape(2, 2))
        self.fuse_parameters("AB", ("A", "B"))


def test_the_parameters_become_views_of_one_array_with_their_values():
    pair = Pair()
    fused = pair.fused_parameter("AB")
    assert fused.shape == (2, 5) and np.shares_memory(fused, pair.A) and np.shares_memory(fused, pair.B)
    assert np.array_equal(fused, np.concatenate([np.arange(6.0).reshape(2, 3), -np.arange(4.0).reshape(2, 2)], 1))
    pair.A = np.ones((2, 3))  # assignment copies into the view
    assert np.array_equal(pair.fused_parameter("AB")[:, :3], np.ones((2, 3)))
    assert sorted(pair.state_dict()) == ["A", "B"]


def test_rebinding_a_parameter_ends_the_group_and_astype_keeps_it():
    pair = Pair().astype(np.float32)
    fused = pair.fused_parameter("AB")
    assert fused is not None and fused.dtype == np.float32 and np.shares_memory(fused, pair.B)
    pair.register_parameter("A", np.zeros((2, 3)))
    assert pair.fused_parameter("AB") is None


def test_parameters_of_different_leading_shapes_cannot_be_fused():
    pair = Pair()
    pair.register_parameter("C", np.zeros((3, 2)))
    with pytest.raises(ValueError, match="must share their leading shape and dtype"):
        pair.fuse_parameters("AC", ("A", "C"))


@pytest.mark.parametrize("fused", [True, False])
def test_the_layers_give_the_same_output_and_gradients_fused_or_not(fused):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 12))
    attn = GroupedQueryAttention(CFG, 0, rng=1)
    mlp = GatedMLP(CFG.hidden_size, CFG.mlp.intermediate_size, CFG.mlp.activation, rng=2)
    reference = {}
    for layer in (attn, mlp):
        y = layer(x)
        reference[type(layer).__name__] = (y, layer.backward(np.ones_like(y)),
                                           {k: v.copy() for k, v in layer.grads.items()})
    if not fused:  # rebinding every parameter ends the groups: the layers take the separate products
        for layer in (attn, mlp):
            for name, value in list(layer._parameters.items()):
                layer.register_parameter(name, value.copy())
        assert attn.fused_parameter("W_QKV") is None and mlp.fused_parameter("W_gate_up") is None
    else:
        assert attn.fused_parameter("W_QKV") is not None and mlp.fused_parameter("W_gate_up") is not None
    for layer in (attn, mlp):
        y0, gx0, grads0 = reference[type(layer).__name__]
        layer.zero_grad()
        y = layer(x)
        np.testing.assert_allclose(y, y0, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(layer.backward(np.ones_like(y)), gx0, rtol=1e-12, atol=1e-14)
        for name, value in grads0.items():
            np.testing.assert_allclose(layer.grads[name], value, rtol=1e-12, atol=1e-14)


def test_a_model_loaded_through_its_state_dict_keeps_its_groups():
    source, target = CausalLM(CFG, rng=0), CausalLM(CFG, rng=1)
    target.load_state_dict(source.state_dict())
    layer = target.layers[0]
    assert layer.attention.fused_parameter("W_QKV") is not None
    ids = np.array([[1, 2, 3, 4]])
    np.testing.assert_array_equal(target(ids), source(ids))
