"""gradient_x_input and saliency against torch autograd on the same (Hugging Face) model, and by finite
differences in float64."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.explain import gradient_x_input, saliency  # noqa: E402
from attnkit.explain.attribution import embedding_gradient  # noqa: E402
from attnkit.models import CausalLM, DecoderConfig, MLPConfig  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import saved_model  # noqa: E402

IDS = np.array([5, 17, 3, 60, 42, 9, 77, 21])


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_explain")


def torch_attributions(hf, ids, position, target=None):
    """(gradient x input, saliency, target) of log p(target) at ``position`` w.r.t. HF's input embeddings."""
    ids_t = torch.from_numpy(ids[None].astype(np.int64))
    embeds = hf.get_input_embeddings()(ids_t).detach().requires_grad_(True)
    logits = hf(inputs_embeds=embeds, position_ids=torch.arange(len(ids))[None]).logits[0, position]
    logp = torch.log_softmax(logits, dim=-1)
    target = int(logp.argmax()) if target is None else target
    logp[target].backward()
    grad = embeds.grad[0]
    return ((grad * embeds[0]).sum(-1).detach().numpy(), grad.norm(dim=-1).numpy(), target)


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa", "qwen2_mixed"])
@pytest.mark.parametrize("position", [-1, 4])
def test_matches_torch_autograd_float32(name, position, hf_root):
    folder, hf = saved_model(name, hf_root)
    lm = load_causal_lm(folder)
    want_gxi, want_sal, target = torch_attributions(hf, IDS, position)
    gxi = gradient_x_input(lm, IDS, target_position=position)
    sal = saliency(lm, IDS, target_position=position)
    assert gxi.dtype == np.float32 and gxi.shape == (len(IDS),)
    np.testing.assert_allclose(gxi, want_gxi, rtol=0, atol=1e-5)
    np.testing.assert_allclose(sal, want_sal, rtol=0, atol=1e-5)
    assert np.abs(want_sal).max() > 1e-2  # the comparison is not between two near-zero vectors
    # An explicit, non-top target token goes through the same path.
    other = (target + 7) % 96
    want_other, _, _ = torch_attributions(hf, IDS, position, target=other)
    np.testing.assert_allclose(gradient_x_input(lm, IDS, position, target_token=other), want_other, atol=1e-5)
    assert not np.allclose(want_other, want_gxi, atol=1e-3)


def test_causal_positions_after_target_are_zero_and_grads_left_clean(hf_root):
    folder, _ = saved_model("llama_gqa", hf_root)
    lm = load_causal_lm(folder)
    sal = saliency(lm, IDS, target_position=3)
    assert (sal[4:] == 0).all() and (sal[:4] > 0).all()
    assert all(not g.any() for _, g in lm.named_gradients())


def test_gradient_matches_finite_differences_float64():
    cfg = DecoderConfig(family="llama", vocab_size=13, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(12))
    lm = CausalLM(cfg, rng=3).astype(np.float64)
    ids = np.array([2, 7, 4, 11, 5])  # distinct tokens: perturbing a row of the table moves one input
    grad, _, target = embedding_gradient(lm, ids, target_position=-1)

    def logp():
        z = lm(ids[None])[0, -1]
        return z[target[0]] - z.max() - np.log(np.exp(z - z.max()).sum())

    eps = 1e-6
    numeric = np.zeros((len(ids), cfg.hidden_size))
    for pos, token in enumerate(ids):
        for d in range(cfg.hidden_size):
            lm.embed.weight[token, d] += eps
            up = logp()
            lm.embed.weight[token, d] -= 2 * eps
            down = logp()
            lm.embed.weight[token, d] += eps
            numeric[pos, d] = (up - down) / (2 * eps)
    np.testing.assert_allclose(grad[0], numeric, rtol=1e-6, atol=1e-9)


def test_batch_rows_equal_single_sequences():
    cfg = DecoderConfig(family="llama", vocab_size=13, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(12))
    lm = CausalLM(cfg, rng=1)
    batch = np.array([[2, 7, 4, 11], [1, 1, 9, 3]])
    together = gradient_x_input(lm, batch, target_token=[4, 5])
    assert together.shape == (2, 4)
    for row, token in zip(range(2), [4, 5]):
        np.testing.assert_allclose(together[row], gradient_x_input(lm, batch[row], target_token=token), atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(ids=np.array([[[1]]])), "ids must be"),
    (dict(ids=np.array([1.0, 2.0])), "ids must be"),
    (dict(ids=np.array([1, 13])), r"ids must lie in \[0, 13\)"),
    (dict(ids=np.array([1, 2]), target_position=2), "target_position must be in"),
    (dict(ids=np.array([1, 2]), target_token=13), "target_token must be"),
])
def test_bad_arguments(kwargs, match):
    cfg = DecoderConfig(family="llama", vocab_size=13, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(12))
    with pytest.raises(ValueError, match=match):
        saliency(CausalLM(cfg, rng=0), **kwargs)
