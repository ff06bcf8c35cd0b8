"""state_dict / load_state_dict and Module.save / Module.load (np.savez): exact round trips through a file,
refusal of unknown, missing and wrongly shaped entries, and saving exactly at the path given."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.layers import Embedding, LayerNorm, Projection, TransformerEncoder
from attnkit.models import TokenTagger, TokenTaggerConfig

from helpers import make_rng


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_model_round_trip_through_a_file_is_bitwise(tmp_path, dtype):
    a = TokenTagger(TokenTaggerConfig(10, 10, 8, d_model=16, num_heads=4, positional="learned"), rng=0).astype(dtype)
    b = TokenTagger(TokenTaggerConfig(10, 10, 8, d_model=16, num_heads=4, positional="learned"), rng=1).astype(dtype)
    ids = make_rng(1).integers(0, 10, size=(3, 8))
    assert not np.array_equal(a(ids), b(ids))
    path = tmp_path / "model.npz"
    a.save(path)
    b.load(path)
    assert np.array_equal(a(ids), b(ids))
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pa.dtype == pb.dtype == dtype and np.array_equal(pa, pb), n
    # the archive holds exactly the state dict
    with np.load(path) as archive:
        assert sorted(archive.files) == sorted(a.state_dict())


def test_save_writes_exactly_at_the_given_path(tmp_path):
    path = tmp_path / "weights.bin"  # no .npz suffix is appended
    Projection(2, 3, rng=0).save(str(path))
    assert path.exists() and not (tmp_path / "weights.bin.npz").exists()
    p = Projection(2, 3, rng=1)
    p.load(str(path))
    assert np.array_equal(p.W, Projection(2, 3, rng=0).W)


def test_state_dict_is_a_copy():
    ln = LayerNorm(3)
    state = ln.state_dict()
    state["gamma"][:] = 5.0
    assert np.all(ln.gamma == 1.0)


def test_load_refuses_unknown_keys(tmp_path):
    enc = TransformerEncoder(1, 4, 2, rng=0)
    state = enc.state_dict()
    state["layers.0.W3"] = np.zeros(3)
    with pytest.raises(KeyError, match=r"unknown keys \['layers.0.W3'\]"):
        enc.load_state_dict(state)
    np.savez(tmp_path / "x.npz", **state)
    with pytest.raises(KeyError, match="unknown keys"):
        enc.load(tmp_path / "x.npz")


def test_load_refuses_missing_keys_unless_not_strict():
    enc = TransformerEncoder(1, 4, 2, rng=0)
    state = enc.state_dict()
    del state["norm.beta"]
    with pytest.raises(KeyError, match=r"missing keys \['norm.beta'\]"):
        enc.load_state_dict(state)
    enc.load_state_dict(state, strict=False)


def test_load_refuses_wrong_shapes_and_leaves_parameters_untouched():
    emb = Embedding(5, 3, rng=0)
    before = emb.weight.copy()
    with pytest.raises(ValueError, match=r"'weight' has shape \(3, 5\), expected \(5, 3\)"):
        emb.load_state_dict({"weight": np.ones((3, 5))})
    assert np.array_equal(emb.weight, before)


@pytest.mark.parametrize("value", [np.array(["a", "b"]), np.array([1, 2]), np.array([1j, 2j]),
                                   np.array([True, False])])
def test_load_refuses_entries_that_are_not_real_floats(value):
    ln = LayerNorm(2)
    with pytest.raises(TypeError, match=r"'gamma' has dtype .*expected a real floating dtype"):
        ln.load_state_dict({"gamma": value, "beta": np.zeros(2)})
    assert np.all(ln.gamma == 1.0)


def test_state_dict_names_of_the_model():
    model = TokenTagger(TokenTaggerConfig(10, 7, 8, d_model=8, num_heads=2, num_layers=1), rng=0)
    names = list(model.state_dict())
    assert names[0] == "embedding.weight" and names[-2:] == ["head.W", "head.b"]
    assert "encoder.layers.0.attention.W_Q" in names and "encoder.norm.gamma" in names
