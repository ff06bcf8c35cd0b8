"""attention_rollout against the formula applied to Hugging Face's output_attentions."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.explain import attention_rollout


def rollout_formula(layers):
    """Abnar and Zuidema's rollout written out directly, one layer at a time (float64)."""
    result = None
    for a in layers:  # (H, L, L)
        a = 0.5 * a.mean(0) + 0.5 * np.eye(a.shape[-1])
        a = a / a.sum(-1, keepdims=True)
        result = a if result is None else a @ result
    return result


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_matches_formula_on_hf_attentions_and_attnkit_weights(name, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from attnkit.pretrained import load_causal_lm
    from hf_models import saved_model

    folder, hf = saved_model(name, tmp_path)
    ids = np.array([[5, 17, 3, 60, 42, 9]])
    with torch.no_grad():
        hf_weights = [a[0].double().numpy() for a in hf(torch.from_numpy(ids), output_attentions=True).attentions]
    want = rollout_formula(hf_weights)
    np.testing.assert_allclose(attention_rollout(np.stack(hf_weights)), want, rtol=0, atol=1e-12)
    _, weights = load_causal_lm(folder)(ids, output_attentions=True)
    got = attention_rollout(weights)  # the list straight from forward
    assert got.dtype == np.float32 and got.shape == (6, 6)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    np.testing.assert_allclose(got.sum(-1), 1, atol=1e-6)
    assert np.triu(got, 1).max() == 0  # causal weights roll out causally


def test_without_residual_is_the_plain_product_of_head_means(rng):
    a = rng.random((3, 2, 4, 4))
    a /= a.sum(-1, keepdims=True)
    m = a.mean(1)
    np.testing.assert_allclose(attention_rollout(a, residual=False), m[2] @ m[1] @ m[0], atol=1e-12)
    assert not np.allclose(attention_rollout(a), m[2] @ m[1] @ m[0], atol=1e-3)


def test_zero_rows_stay_zero_and_bad_input_is_named():
    a = np.zeros((1, 1, 3, 3))
    assert not np.isnan(attention_rollout(a, residual=False)).any()
    with pytest.raises(ValueError, match="weights must be float attention weights"):
        attention_rollout(np.ones((2, 3, 3)))
    with pytest.raises(ValueError, match="per-layer arrays of one shape"):
        attention_rollout([np.ones((1, 3, 3)), np.ones((1, 4, 4))])
