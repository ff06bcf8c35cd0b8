"""The attention kernels by name: kernel="auto" | "reference" | "tiled" through one signature."""
import numpy as np
import pytest

from attnkit.kernels import ATTENTION_KERNELS, attention_backward, attention_forward, reference, tiled
from attnkit.kernels.registry import AttentionKernel, register_attention_kernel


def _qkv():
    rng = np.random.default_rng(1)
    return tuple(rng.standard_normal((2, 2, 9, 4)) for _ in range(3))


def test_auto_is_reference_with_weights_and_tiled_without():
    q, k, v = _qkv()
    _, w, ctx = attention_forward(q, k, v, causal=True)
    assert isinstance(ctx, reference.AttentionContext) and w.shape == (2, 2, 9, 9)
    _, w, ctx = attention_forward(q, k, v, causal=True, need_weights=False)
    assert isinstance(ctx, tiled.FlashContext) and w is None


def test_named_kernels_agree_forward_and_backward():
    q, k, v = _qkv()
    g = np.random.default_rng(2).standard_normal((2, 2, 9, 4))
    results = {}
    for name in ("reference", "tiled"):
        out, _, ctx = attention_forward(q, k, v, causal=True, need_weights=False, kernel=name)
        results[name] = (out, *attention_backward(g, ctx)[:3])
    assert isinstance(attention_forward(q, k, v, need_weights=False, kernel="reference")[2],
                      reference.AttentionContext)
    for a, b in zip(results["reference"], results["tiled"]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_bad_kernel_choices_are_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of"):
        attention_forward(q, k, v, kernel="flash")
    with pytest.raises(ValueError, match="does not form the attention weights"):
        attention_forward(q, k, v, kernel="tiled", need_weights=True)
    with pytest.raises(ValueError, match="already registered"):
        register_attention_kernel(AttentionKernel("tiled", None, None, object, False))
    with pytest.raises(TypeError, match="registered attention kernel"):
        attention_backward(q, object())
    assert sorted(ATTENTION_KERNELS) == ["one_query", "reference", "tiled"]
