"""RotaryEmbedding against Hugging Face's LlamaRotaryEmbedding + apply_rotary_pos_emb, for every rope type."""
from __future__ import annotations

import numpy as np
import pytest
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

import torch
from attnkit.kernels.rotary import rotary_apply, rotary_frequencies
from attnkit.layers.rotary import RotaryEmbedding
from attnkit.models import DecoderConfig, MLPConfig, RotaryConfig

from helpers import make_rng, randn

THETA, MAX_POS, HEAD_DIM = 500.0, 64, 16
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.7,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn_untruncated": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                         "truncate": False, "attention_factor": 1.2},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def _configs(scaling):
    ours = DecoderConfig(family="llama", vocab_size=8, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                         head_dim=HEAD_DIM, mlp=MLPConfig(8), max_position_embeddings=MAX_POS,
                         rotary=RotaryConfig(theta=THETA, scaling=scaling))
    params = {"rope_type": "default", "rope_theta": THETA} if scaling is None else {**scaling, "rope_theta": THETA}
    theirs = LlamaConfig(vocab_size=8, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=HEAD_DIM, max_position_embeddings=MAX_POS, rope_parameters=params)
    return ours, theirs


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("max_position", [40, 150])  # 150: past the context, where dynamic/yarn/llama3 differ
def test_cos_sin_and_rotated_qk_match_hugging_face(name, max_position):
    ours_cfg, hf_cfg = _configs(SCALINGS[name])
    rng = make_rng(len(name), max_position)
    pos = rng.integers(0, max_position, size=(2, 7))
    pos[0, -1] = max_position - 1
    q, k = randn(rng, 2, 2, 7, HEAD_DIM), randn(rng, 2, 2, 7, HEAD_DIM)
    hf = LlamaRotaryEmbedding(hf_cfg)
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), torch.from_numpy(pos))
    ours = RotaryEmbedding(ours_cfg.rotary, ours_cfg.head_dim, ours_cfg.max_position_embeddings)
    cos, sin = ours(pos, dtype=np.float32)
    # HF rounds its angles (position * inv_freq) to float32, ours are float64: the tables can differ by a few
    # float32 ulps of the largest angle.
    tol = 4 * max_position * np.finfo(np.float32).eps
    np.testing.assert_allclose(cos, hf_cos.numpy(), rtol=0, atol=tol)
    np.testing.assert_allclose(sin, hf_sin.numpy(), rtol=0, atol=tol)
    np.testing.assert_allclose(ours.inv_freq, hf.inv_freq.double().numpy() if name != "dynamic" else ours.inv_freq,
                               rtol=1e-6)
    # The rotation itself: HF's apply_rotary_pos_emb in float64 on our float64 tables agrees to rounding.
    cos64, sin64 = ours(pos, dtype=np.float64)
    hq, hk = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(cos64),
                                  torch.from_numpy(sin64))
    np.testing.assert_allclose(rotary_apply(q, cos64, sin64), hq.numpy(), rtol=0, atol=1e-14)
    np.testing.assert_allclose(rotary_apply(k, cos64, sin64), hk.numpy(), rtol=0, atol=1e-14)
    # float32 end to end against HF's float32 tables and rotation.
    hq32, _ = apply_rotary_pos_emb(torch.from_numpy(q.astype(np.float32)), torch.from_numpy(k.astype(np.float32)),
                                   hf_cos, hf_sin)
    ours32 = rotary_apply(q.astype(np.float32), cos, sin)
    err = np.max(np.abs(ours32 - hq32.numpy())) / np.max(np.abs(hq32.numpy()))
    assert err < tol, err


def test_dynamic_inv_freq_follows_the_length():
    ours_cfg, hf_cfg = _configs(SCALINGS["dynamic"])
    ours = RotaryEmbedding(ours_cfg.rotary, ours_cfg.head_dim, ours_cfg.max_position_embeddings)
    short, _ = ours(np.array([[0, 10]]), dtype=np.float64)
    long, _ = ours(np.array([[0, 10, 200]]), dtype=np.float64)
    assert not np.allclose(short[0, 1], long[0, 1])  # a longer call rescales every position
    hf = LlamaRotaryEmbedding(hf_cfg)
    hf(torch.zeros(1), torch.tensor([[0, 10, 200]]))
    grown = rotary_frequencies(HEAD_DIM, THETA, SCALINGS["dynamic"], max_position_embeddings=MAX_POS, seq_len=201)
    np.testing.assert_allclose(grown[0], hf.inv_freq.double().numpy(), rtol=1e-6)


def test_bad_position_ids():
    ours_cfg, _ = _configs(None)
    with pytest.raises(ValueError, match="position_ids"):
        RotaryEmbedding(ours_cfg.rotary, ours_cfg.head_dim, 64)(np.zeros((3,), dtype=np.int64))


@pytest.mark.parametrize("scaling, fault", [
    ({**SCALINGS["yarn_mscale"], "mscale": 1e308}, r"the attention factor: attention factor 1.2\d*e\+307"),
    ({**SCALINGS["yarn_untruncated"], "attention_factor": 70000.0}, "the attention factor: attention factor 70000.0"),
    ({**SCALINGS["linear"], "factor": 1e-307}, r"the frequencies: attention factor 1.0, inverse frequencies up to "
                                               r"1.0\d*e\+307"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7 + [5e-324],
      "attention_factor": 1.1, "original_max_position_embeddings": 16}, "the frequencies"),
])
def test_a_scaling_whose_tables_overflow_is_refused_by_the_layer(scaling, fault):
    """A DecoderConfig built by hand reaches RotaryEmbedding without the config reader's check: the layer
    refuses tables that would hold inf or NaN (in float16, the narrowest dtype it makes them in), where the
    forward used to return them."""
    cfg, _ = _configs(scaling)
    with pytest.raises(ValueError, match=rf"RotaryEmbedding: rope_scaling .* makes the cos/sin tables of positions "
                                         rf"below 64 not finite in float16 \({fault}"):
        RotaryEmbedding(cfg.rotary, cfg.head_dim, cfg.max_position_embeddings)


def test_the_largest_attention_factor_float16_holds_is_accepted():
    cfg, _ = _configs({**SCALINGS["yarn_untruncated"], "attention_factor": 65504.0})
    rotary = RotaryEmbedding(cfg.rotary, cfg.head_dim, cfg.max_position_embeddings)
    cos, sin = rotary(np.array([[0, 63]]), dtype=np.float16)
    assert cos[0, 0, 0] == 65504.0 and np.isfinite(cos).all() and np.isfinite(sin).all()
