"""``CausalLM.forward(..., output_attentions=True)``: per-layer weights equal to Hugging Face's eager ones."""
from __future__ import annotations

import numpy as np
import pytest

import torch
from attnkit.pretrained import load_causal_lm
from hf_models import left_padded_batch, positions_from_mask, saved_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_attentions")
    return {name: saved_model(name, root) for name in ("llama_gqa", "mistral_window")}


def hf_attentions(hf, ids, mask):
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                 position_ids=torch.from_numpy(positions_from_mask(mask)), output_attentions=True)
    return [a.double().numpy() for a in out.attentions]


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_window"])
def test_weights_equal_hugging_face_eager_attention(folders, name):
    folder, hf = folders[name]
    ids, mask = left_padded_batch(np.random.default_rng(0), (7, 4))
    lm = load_causal_lm(folder)
    logits, weights = lm(ids, mask, output_attentions=True)
    theirs = hf_attentions(hf, ids, mask)
    assert len(weights) == len(theirs) == 2
    for ours, ref in zip(weights, theirs, strict=True):
        assert ours.shape == ref.shape == (2, 4, 7, 7)
        assert ours.dtype == np.float32
        # HF's rows of pad queries are not defined the same way (all keys masked); real queries are compared.
        real = mask[:, None, :, None]  # (B, 1, L, 1)
        np.testing.assert_allclose(np.where(real, ours, 0), np.where(real, ref, 0), atol=2e-6)
        np.testing.assert_allclose(ours.sum(-1)[np.broadcast_to(mask[:, None], ours.shape[:-1])], 1.0, atol=1e-5)
        assert (ours[1][..., :3] == 0).all()  # row 1's three left pads are never attended
        assert (ours[~np.broadcast_to(mask[:, None, :, None], ours.shape)] == 0).all()  # pad queries: zero rows
    # Reference and tiled kernels sum in different orders: equal to float32 rounding.
    np.testing.assert_allclose(logits, lm(ids, mask), rtol=0, atol=2e-6)


def test_sliding_window_keeps_weights_inside_the_window(folders):
    lm = load_causal_lm(folders["mistral_window"][0])
    ids = np.arange(2, 10)[None]  # (1, 8)
    _, weights = lm(ids, output_attentions=True)
    query, key = np.indices((8, 8))
    inside = (key <= query) & (key > query - 4)  # sliding_window = 4
    for w in weights:
        assert (w[..., ~inside] == 0).all()
        assert (w[..., inside] > 0).all()
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)


def test_returned_weights_are_copies_and_backward_is_unchanged(folders):
    lm = load_causal_lm(folders["llama_gqa"][0], dtype=np.float64)
    ids, mask = left_padded_batch(np.random.default_rng(1), (6, 5))
    grad = np.random.default_rng(2).standard_normal((2, 6, lm.config.vocab_size))

    lm.zero_grad()
    plain = lm(ids, mask)
    lm.backward(grad)
    expected = {name: g.copy() for name, g in lm.named_gradients()}

    lm.zero_grad()
    logits, weights = lm(ids, mask, output_attentions=True)
    for w in weights:
        w[...] = np.nan  # the caller owns them: backward must not read these arrays
    lm.backward(grad)
    np.testing.assert_allclose(logits, plain, rtol=0, atol=1e-13)
    got = dict(lm.named_gradients())
    assert expected.keys() == got.keys()
    for name, g in expected.items():
        np.testing.assert_allclose(got[name], g, rtol=1e-9, atol=1e-12, err_msg=name)
    assert any(np.abs(g).max() > 1e-3 for g in expected.values())


def test_chosen_layers_only_and_nothing_past_the_last(folders, monkeypatch):
    from attnkit.models import CausalLM, DecoderConfig, MLPConfig

    config = DecoderConfig(family="llama", vocab_size=32, hidden_size=16, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=4, mlp=MLPConfig(24))
    lm = CausalLM(config, rng=0)
    ids = np.array([[1, 5, 9, 2, 7], [3, 3, 7, 30, 4]])
    mask = np.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
    _, every = lm(ids, attention_mask=mask, output_attentions=True)
    ran = []
    for index, layer in enumerate(lm.layers):
        original = layer.forward
        monkeypatch.setattr(layer, "forward", lambda *a, _i=index, _f=original, **k: (ran.append(_i), _f(*a, **k))[1])
    chosen = lm.attention_weights(ids, mask, layers=[2, 0])
    assert ran == [0, 1, 2]  # layer 3 never runs
    np.testing.assert_allclose(chosen[0], every[2], rtol=0, atol=1e-12)
    np.testing.assert_allclose(chosen[1], every[0], rtol=0, atol=1e-12)
    for bad in ([], [4], [-1], [True], "0"):
        with pytest.raises(ValueError, match=r"layers must be a non-empty sequence of layer indices in \[0, 4\)"):
            lm.attention_weights(ids, mask, layers=bad)
