"""generation_attribution: each generated token's row equals torch autograd on transformers' model, the
single-prediction functions on its prefix, and (contrastive) the difference of the two tokens' rows; integrated
gradients' rows sum to their differences up to the gap they report."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.explain import generation_attribution, gradient_x_input, integrated_gradients, saliency  # noqa: E402
from attnkit.models import CausalLM, DecoderConfig, MLPConfig  # noqa: E402
from hf_models import TOL, float64_pair  # noqa: E402

PROMPT = np.array([5, 17, 3, 60, 42])
NEW = np.array([9, 77, 21, 9])


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_generation")


def _tiny(dtype=np.float64):
    cfg = DecoderConfig(family="llama", vocab_size=100, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=4, mlp=MLPConfig(24))
    return CausalLM(cfg, rng=3).astype(dtype)


def torch_rows(hf, ids, prompt_length, targets, foils=None):
    """Gradient x input per generated token with torch autograd: (G, L)."""
    embed = hf.get_input_embeddings()
    rows = []
    for i, target in enumerate(targets):
        x = embed(torch.from_numpy(ids[None])).detach().requires_grad_(True)  # (1, L, D)
        logits = hf(inputs_embeds=x).logits[0, prompt_length - 1 + i]  # (V,)
        f = torch.log_softmax(logits, -1)[target] if foils is None else logits[target] - logits[foils[i]]
        (grad,) = torch.autograd.grad(f, x)
        rows.append((grad * x).sum(-1)[0].detach().numpy())
    return np.stack(rows)


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
def test_rows_equal_torch_autograd(name, hf_root):
    lm, hf = float64_pair(name, hf_root)
    ids = np.concatenate([PROMPT, NEW])
    found = generation_attribution(lm, PROMPT, new_ids=NEW)
    np.testing.assert_allclose(found.attributions, torch_rows(hf, ids, len(PROMPT), NEW), atol=TOL)
    foils = np.array([4, 8, 15, 16])
    contrast = generation_attribution(lm, PROMPT, new_ids=NEW, foil=foils)
    np.testing.assert_allclose(contrast.attributions, torch_rows(hf, ids, len(PROMPT), NEW, foils), atol=TOL)
    assert all(not g.any() for _, g in lm.named_gradients())


def test_rows_equal_the_single_prediction_functions_on_each_prefix():
    lm = _tiny()
    found = generation_attribution(lm, PROMPT, new_ids=NEW)
    shown = generation_attribution(lm, PROMPT, new_ids=NEW, method="saliency")
    np.testing.assert_array_equal(found.ids, np.concatenate([PROMPT, NEW]))
    assert found.attributions.shape == (4, 9) and found.prompt_length == 5 and found.completeness_gaps is None
    for i, target in enumerate(NEW):
        prefix = found.ids[:5 + i]
        np.testing.assert_allclose(found.attributions[i, :5 + i], gradient_x_input(lm, prefix, target_token=target),
                                   rtol=0, atol=1e-13)
        np.testing.assert_allclose(shown.attributions[i, :5 + i], saliency(lm, prefix, target_token=target),
                                   rtol=0, atol=1e-13)
        assert not found.attributions[i, 5 + i:].any() and not shown.attributions[i, 5 + i:].any()
    assert (found.attributions[:, :5] != 0).all()


def test_contrastive_rows_are_the_difference_of_the_two_logits_rows():
    """log p(t) - log p(f) = logit[t] - logit[f]: its gradient is the two log-probabilities' difference."""
    lm = _tiny()
    foil = 11
    contrast = generation_attribution(lm, PROMPT, new_ids=NEW, foil=foil)
    for i, target in enumerate(NEW):
        prefix = contrast.ids[:5 + i]
        want = gradient_x_input(lm, prefix, target_token=target) - gradient_x_input(lm, prefix, target_token=foil)
        np.testing.assert_allclose(contrast.attributions[i, :5 + i], want, rtol=0, atol=1e-13)
    np.testing.assert_array_equal(contrast.foils, [11] * 4)


def test_integrated_gradients_rows_sum_to_their_difference_up_to_the_gap():
    lm = _tiny()
    for foil in (None, 11):
        found = generation_attribution(lm, PROMPT, new_ids=NEW, method="integrated_gradients", steps=32, foil=foil)
        for i, target in enumerate(NEW):
            single = integrated_gradients(lm, found.ids, int(target), steps=32, target_position=4 + i, foil=foil)
            np.testing.assert_allclose(found.attributions[i], single.attributions, rtol=0, atol=1e-15)
            assert found.completeness_gaps[i] == single.completeness_gap
            np.testing.assert_allclose(found.attributions[i].sum() - single.difference, found.completeness_gaps[i],
                                       atol=1e-14)
        if foil is not None:  # contrastive: the difference is of logit differences, at the input and at zeros
            # integrated gradients is linear in the function: the contrastive row is the two tokens' difference
            want = integrated_gradients(lm, found.ids, int(NEW[1]), steps=32, target_position=5).attributions - \
                integrated_gradients(lm, found.ids, foil, steps=32, target_position=5).attributions
            np.testing.assert_allclose(found.attributions[1], want, rtol=0, atol=1e-13)
            row = lm(found.ids[None])[0, 4]  # (V,)
            first = integrated_gradients(lm, found.ids[:5], int(NEW[0]), steps=2, foil=foil)
            np.testing.assert_allclose(first.difference, row[NEW[0]] - row[foil]
                                       - _zero_input_logit_diff(lm, 5, NEW[0], foil), rtol=0, atol=1e-12)


def _zero_input_logit_diff(lm, length, target, foil):
    from attnkit.explain import hooks

    with hooks(lm, {"hook_embed": lambda x, name: np.zeros_like(x)}):
        row = lm(np.zeros((1, length), np.int64))[0, -1]
    return row[target] - row[foil]


def test_max_new_tokens_explains_the_greedy_continuation_and_keeps_float32():
    lm = _tiny(np.float32)
    found = generation_attribution(lm, PROMPT, max_new_tokens=3)
    greedy = lm.generate(PROMPT[None], max_new_tokens=3, do_sample=False, eos_token_id=[])[0]
    np.testing.assert_array_equal(found.ids, greedy)
    np.testing.assert_array_equal(found.targets, greedy[5:])
    assert found.attributions.dtype == np.float32 and found.attributions.shape == (3, 8)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "give the generation once"),
    ({"max_new_tokens": 2, "new_ids": [1]}, "give the generation once"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"new_ids": [[1, 2]]}, "new_ids must be one sequence"),
    ({"new_ids": [1, 2], "foil": [3]}, "foil must be a token id in [0, 100) or one per generated token (2,)"),
    ({"new_ids": [1, 2], "foil": 100}, "foil must be a token id"),
    ({"new_ids": [1, 2], "method": "lime"}, "method must be one of"),
])
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        generation_attribution(_tiny(), PROMPT, **kwargs)
