"""integrated_gradients: the same quadrature done with torch autograd on transformers' model, the
completeness gap shrinking with the number of points, and the quadrature rules."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.explain import integrated_gradients  # noqa: E402
from attnkit.explain.integrated_gradients import QUADRATURES, quadrature  # noqa: E402
from attnkit.models import CausalLM, DecoderConfig, MLPConfig  # noqa: E402
from hf_models import EOS, TOL, float64_pair  # noqa: E402

IDS = np.array([5, 17, 3, 60, 42, 9, 77, 21])


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_ig")


def torch_ig(hf, ids, target, alphas, weights, baseline_token=None):
    """The same sum with torch autograd: embeddings on the path as one batch, log p(target) at the last position."""
    embed = hf.get_input_embeddings()
    with torch.no_grad():
        x = embed(torch.from_numpy(ids[None]))[0]  # (L, D)
        start = torch.zeros_like(x) if baseline_token is None else embed(torch.tensor([baseline_token]))[0].expand_as(x)
    path = (start + torch.from_numpy(alphas)[:, None, None] * (x - start)).requires_grad_(True)  # (K, L, D)
    logits = hf(inputs_embeds=path, position_ids=torch.arange(len(ids)).expand(len(alphas), -1)).logits[:, -1]
    log_p = torch.log_softmax(logits, -1)[:, target]
    (grad,) = torch.autograd.grad(log_p.sum(), path)
    return ((x - start) * torch.einsum("k,kld->ld", torch.from_numpy(weights), grad)).sum(-1).detach().numpy()


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
def test_equals_torch_autograd(name, hf_root):
    lm, hf = float64_pair(name, hf_root)
    for method, baseline in (("gausslegendre", None), ("riemann_trapezoid", EOS)):
        got = integrated_gradients(lm, IDS, target=7, steps=12, baseline=baseline, method=method, batch_size=5)
        want = torch_ig(hf, IDS, 7, *quadrature(method, 12), baseline_token=baseline)
        np.testing.assert_allclose(got.attributions, want, atol=TOL)
        np.testing.assert_allclose(got.completeness_gap, got.attributions.sum() - got.difference, atol=1e-15)
    assert all(not g.any() for _, g in lm.named_gradients())


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
def test_completeness_gap_shrinks_with_steps(name, hf_root):
    lm, _ = float64_pair(name, hf_root)
    for method in ("gausslegendre", "riemann_middle"):
        gaps = [abs(integrated_gradients(lm, IDS, target=7, steps=steps, method=method).completeness_gap)
                for steps in (4, 16, 64)]
        # strictly smaller each time, until the sum is exact to rounding (GPT-2's gap is 1e-17 at 16 points)
        assert gaps[0] > gaps[1] and (gaps[1] > gaps[2] or gaps[2] < 1e-14), (method, gaps)
    result = integrated_gradients(lm, IDS, target=7, steps=64)
    assert abs(result.completeness_gap) < 1e-6 * abs(result.difference)


def test_target_position_and_rules():
    cfg = DecoderConfig(family="llama", vocab_size=13, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(12))
    lm = CausalLM(cfg, rng=0).astype(np.float64)
    ids = np.array([1, 2, 3, 4, 5])
    middle = integrated_gradients(lm, ids, target=3, steps=8, target_position=2)
    np.testing.assert_array_equal(middle.attributions[3:], 0.0)
    np.testing.assert_allclose(middle.attributions[:3], integrated_gradients(lm, ids[:3], 3, steps=8).attributions,
                               atol=1e-14)
    for method in QUADRATURES:
        alphas, weights = quadrature(method, 9)
        assert np.isclose(weights.sum(), 1.0) and (0 <= alphas).all() and (alphas <= 1).all()
        assert np.isclose(weights @ alphas ** 2, 1 / 3, atol=0.1)  # each integrates x^2 roughly
    alphas, weights = quadrature("gausslegendre", 5)
    assert np.isclose(weights @ alphas ** 9, 1 / 10)  # exact up to degree 2K - 1
    with pytest.raises(ValueError, match="method must be one of 'gausslegendre', "):
        integrated_gradients(lm, ids, 3, method="simpson")
    with pytest.raises(ValueError, match=r"target must be a token id in \[0, 13\), got 13"):
        integrated_gradients(lm, ids, 13)
    with pytest.raises(ValueError, match=r"baseline must be None, a token id or float embeddings of shape \(L, D\) = "
                                         r"\(5, 8\), got ndarray of shape \(4, 8\)"):
        integrated_gradients(lm, ids, 3, baseline=np.zeros((4, 8)))
    with pytest.raises(ValueError, match="input_ids must be one sequence"):
        integrated_gradients(lm, [[1, 2], [3, 4]], 3)
    with pytest.raises(ValueError, match="steps must be at least 2 for riemann_trapezoid, got 1"):
        integrated_gradients(lm, ids, 3, steps=1, method="riemann_trapezoid")
