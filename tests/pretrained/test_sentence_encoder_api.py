"""SentenceEncoder.encode and similarity with sentence-transformers' arguments, against sentence-transformers
itself on the MiniLM folder (loaded the way any sentence-transformers folder is: load_sentence_encoder)."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.pretrained import default_model_dir, load_sentence_encoder

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e \U0001f600"]


@pytest.fixture(scope="module")
def models():
    st = pytest.importorskip("sentence_transformers")
    return load_sentence_encoder(default_model_dir()), st.SentenceTransformer(str(default_model_dir()), device="cpu")


@pytest.mark.parametrize("batch_size", [1, 2, 32])
@pytest.mark.parametrize("normalize_embeddings", [False, True])
def test_encode_equals_sentence_transformers(models, batch_size, normalize_embeddings):
    ours, st = models
    kwargs = dict(batch_size=batch_size, normalize_embeddings=normalize_embeddings)
    expected = st.encode(SENTENCES, **kwargs)
    np.testing.assert_allclose(ours.encode(SENTENCES, **kwargs), expected, atol=2e-6)
    np.testing.assert_allclose(ours.encode(SENTENCES[0], **kwargs), st.encode(SENTENCES[0], **kwargs), atol=2e-6)
    listed = ours.encode(SENTENCES, convert_to_numpy=False, **kwargs)
    assert isinstance(listed, list) and len(listed) == len(SENTENCES) and listed[0].shape == (384,)
    np.testing.assert_allclose(np.stack(listed), expected, atol=2e-6)


def test_normalize_embeddings_normalises_a_raw_pipeline(models):
    ours, _ = models
    raw = ours.encode(SENTENCES, normalize=False)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    np.testing.assert_allclose(np.linalg.norm(ours.encode(SENTENCES, normalize=False, normalize_embeddings=True),
                                              axis=1), 1.0, rtol=1e-6)


def test_similarity_equals_sentence_transformers(models):
    ours, st = models
    a, b = st.encode(SENTENCES[:2]), st.encode(SENTENCES[2:])
    expected = st.similarity(a, b).numpy()
    got = ours.similarity(a, b)
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    np.testing.assert_allclose(ours.similarity(a * 3.0, b), expected, atol=1e-6)  # cosine, whatever the norms
    np.testing.assert_allclose(ours.similarity(SENTENCES), st.similarity(st.encode(SENTENCES),
                                                                         st.encode(SENTENCES)).numpy(), atol=2e-6)
    with pytest.raises(ValueError, match="same embedding size"):
        ours.similarity(a, b[:, :10])


def test_progress_bar_goes_to_stderr(models, capsys):
    pytest.importorskip("tqdm")
    ours, _ = models
    ours.encode(SENTENCES, batch_size=2, show_progress_bar=True)
    err = capsys.readouterr().err
    assert "Batches" in err and "3/3" in err
