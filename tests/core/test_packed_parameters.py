"""Modules holding packed (quantized) parameters where dense ones would be, and models built on placeholders.

The reference of every packed module is the same module holding the dequantized values as dense arrays: float64
results within 1e-12 of its (the same numbers summed in another order), float32 within 1e-6.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from attnkit.core.module import Module  # noqa: E402
from attnkit.init import empty_init, is_placeholder  # noqa: E402
from attnkit.kernels.packed import PackedWeight  # noqa: E402
from attnkit.layers import GatedMLP  # noqa: E402
from attnkit.models import CausalLM, DecoderConfig, MLPConfig  # noqa: E402
from attnkit.optim import Adam  # noqa: E402

CFG = DecoderConfig(family="llama", vocab_size=40, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp=MLPConfig(96))


def _packed(w: np.ndarray, kind: str = "Q8_0") -> PackedWeight:
    """``w`` (In, Out) quantized the way GGUF stores a matrix: (Out, In) rows."""
    stored = gguf.quants.quantize(np.ascontiguousarray(w.T, dtype=np.float32), gguf.GGMLQuantizationType[kind])
    return PackedWeight(stored, kind, w.shape[0], transposed=True)


def _pack(module: Module, names) -> Module:
    """``module`` with the parameters ``names`` (dotted) replaced by their Q8_0 blocks."""
    params = dict(module.named_parameters())
    for name in names:
        module.set_parameter(name, _packed(params[name]))
    return module


def _twins(dtype=np.float64):
    """A GatedMLP whose three weights are packed, and a dense one holding their dequantized values."""
    packed = _pack(GatedMLP(CFG.hidden_size, CFG.mlp.intermediate_size, rng=0),
                   ("W_gate", "W_up", "W_down")).astype(dtype)
    dense = GatedMLP(CFG.hidden_size, CFG.mlp.intermediate_size, rng=1).astype(dtype)
    for name in ("W_gate", "W_up", "W_down"):
        setattr(dense, name, getattr(packed, name).dequantize())
    return packed, dense


def _rel(ours, reference) -> float:
    return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


def test_a_packed_mlp_computes_what_its_dequantized_twin_computes():
    packed, dense = _twins()
    assert packed.fused_weight_and_bias("W_gate_up", "b_gate_up") is None  # packed weights are never fused
    assert isinstance(packed.W_up, PackedWeight) and packed.W_up.dtype == np.float64
    x = np.random.default_rng(0).standard_normal((2, 5, 64))
    assert _rel(packed(x), dense(x)) <= 1e-12
    assert _rel(packed.step(x[:, 0]), dense.step(x[:, 0])) <= 1e-12
    np.testing.assert_array_equal(packed.step(x[:, 0]), packed(x[:, :1])[:, 0])  # the step is the forward's kernel


def test_a_step_after_a_parameter_got_new_storage_is_the_forward():
    """The broken gate/up group: the step takes the forward's two products (it used to concatenate the
    weights at every step), for dense weights given new storage and packed ones alike."""
    mlp = GatedMLP(CFG.hidden_size, CFG.mlp.intermediate_size, rng=0).astype(np.float64)
    mlp.set_parameter("W_up", mlp.W_up * 2)
    assert mlp.fused_weight_and_bias("W_gate_up", "b_gate_up") is None
    x = np.random.default_rng(1).standard_normal((3, 64))
    np.testing.assert_array_equal(mlp.step(x), mlp(x[:, None])[:, 0])


def test_a_packed_weight_has_no_gradient_but_the_input_gradient_is_exact():
    packed, dense = _twins()
    x = np.random.default_rng(2).standard_normal((2, 5, 64))
    g = np.random.default_rng(3).standard_normal((2, 5, 64))
    packed(x)
    with pytest.raises(TypeError, match=r"parameter 'W_\w+' is a packed Q8_0 weight \(kept quantized\): it has no "
                                        r"gradient. Run the backward inside module.input_gradients_only\(\)"):
        packed.backward(g)
    packed(x)
    dense(x)
    with packed.input_gradients_only():
        grad_x = packed.backward(g)
    assert _rel(grad_x, dense.backward(g)) <= 1e-12
    packed.zero_grad()
    packed.zero_grad(set_to_none=True)
    with pytest.raises(TypeError, match="packed"):
        Adam(packed)


def test_astype_state_dict_and_loading_keep_the_rules_of_packed_weights(tmp_path):
    packed, dense = _twins(np.float32)
    assert packed.num_parameters() == dense.num_parameters()
    state = packed.state_dict()
    assert isinstance(state["W_gate"], PackedWeight)
    assert not np.shares_memory(state["W_gate"].blocks, packed.W_gate.blocks)
    packed.astype(np.float64)
    assert isinstance(packed.W_gate, PackedWeight) and packed.W_gate.dtype == np.float64
    with pytest.raises(TypeError, match=r"GatedMLP holds 3 packed weights \('W_gate', \.\.\.\): save writes float "
                                        r"arrays"):
        packed.save(tmp_path / "mlp.npz")
    twin = GatedMLP(CFG.hidden_size, CFG.mlp.intermediate_size, rng=5).astype(np.float32)
    twin.load_state_dict(state)  # a packed value into a dense parameter: dequantized
    np.testing.assert_array_equal(twin.W_down, dense.W_down)
    packed.load_state_dict(dense.state_dict())  # a dense value replaces a packed parameter
    assert type(packed.W_down) is np.ndarray and packed.W_down.dtype == np.float64
    np.testing.assert_array_equal(packed.W_down, dense.W_down)
    packed.W_gate = _packed(dense.W_gate)  # assigning a packed weight replaces the parameter
    assert isinstance(packed.W_gate, PackedWeight)
    packed.W_gate = dense.W_gate  # and a dense value replaces a packed one
    assert type(packed.W_gate) is np.ndarray
    with pytest.raises(ValueError, match=r"parameter W_up has shape \(64, 96\), got a value of shape \(96, 64\)"):
        packed.set_parameter("W_up", dense.W_up.T)
    with pytest.raises(KeyError, match="no parameter 'mlp.W_up'"):
        packed.set_parameter("mlp.W_up", dense.W_up)


def test_placeholders_take_no_memory_until_allocated():
    cfg = DecoderConfig(family="llama", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4,
                        num_kv_heads=2, head_dim=64, mlp=MLPConfig(768))
    tracemalloc.start()
    try:
        with empty_init(np.float32, placeholders=True):
            model = CausalLM(cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    weights = model.num_parameters() * 4  # 17 MB of float32
    assert peak < 2e6 < weights
    assert all(is_placeholder(p) for _, p in model.named_parameters() if p.size > 1)
    attention = model.layers[0].attention
    assert attention.fused_weight_and_bias("W_QKV", "b_QKV") is None
    model.set_parameter("layers.0.attention.W_K", _packed(np.zeros((256, 128), np.float32)))
    model.allocate_parameters()
    assert not any(is_placeholder(p) for _, p in model.named_parameters())
    assert attention.fused_weight_and_bias("W_QKV", "b_QKV") is None  # a packed member: never fused
    assert model.layers[1].attention.fused_weight_and_bias("W_QKV", "b_QKV") is not None
    assert model.layers[0].mlp.fused_weight_and_bias("W_gate_up", "b_gate_up") is not None
    assert model.head.weight.flags.f_contiguous  # the head's layout, as CausalLM asked for it


def test_every_family_builds_on_placeholders():
    """Every family's layers at its benchmark shape (SmolLM-sized, 125-390 million parameters) allocate nothing
    but their norms' and small vectors' bookkeeping."""
    from attnkit.pretrained import supported_model_types
    from attnkit.pretrained.families import family
    from attnkit.pretrained.hf_config import decoder_config_from_hf

    for model_type in supported_model_types():
        config = decoder_config_from_hf({"model_type": model_type, **family(model_type).benchmark})
        tracemalloc.start()
        try:
            with empty_init(np.float32, placeholders=True):
                model = CausalLM(config)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2e6 and model.num_parameters() > 1e8, model_type
        assert all(is_placeholder(p) for _, p in model.named_parameters() if p.size > 1), model_type
