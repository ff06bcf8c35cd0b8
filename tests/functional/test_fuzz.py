"""Reference fuzzing: 300 seeded random configurations of scaled dot-product attention against PyTorch.

Each seed draws batch 1-3, heads 1-4, Lq and Lk independently from {1, 2, 3, 5, 8, 17, 64, 129}, d_k and d_v
independently from {1, 3, 8, 17, 64}, an input scale, and a mask (none, broadcast (Lq, Lk), causal,
padding (B, 1, 1, Lk), or random (B, H, Lq, Lk) with fully masked rows). In float64 with a random upstream
gradient, the output and the gradients of Q, K and V must match torch.nn.functional.scaled_dot_product_attention
to 1e-10 (relative to the largest reference magnitude); rows that may attend nothing must be exactly zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from attnkit.attention_core import scaled_dot_product_attention, scaled_dot_product_attention_backward

from helpers import assert_close_rel, dead_rows, group_scale, make_mask, make_rng, torch_sdpa

N_CONFIGS = 300
LENGTHS = (1, 2, 3, 5, 8, 17, 64, 129)
FEATURES = (1, 3, 8, 17, 64)
FUZZ_MASKS = ("none", "broadcast", "causal", "padding", "fully_masked")


@dataclass(frozen=True)
class Config:
    seed: int
    B: int
    H: int
    Lq: int
    Lk: int
    Dk: int
    Dv: int
    scale: float
    mask: str

    @classmethod
    def draw(cls, seed: int) -> Config:
        r = make_rng(9000, seed)
        return cls(seed=seed, B=int(r.integers(1, 4)), H=int(r.integers(1, 5)), Lq=int(r.choice(LENGTHS)),
                   Lk=int(r.choice(LENGTHS)), Dk=int(r.choice(FEATURES)), Dv=int(r.choice(FEATURES)),
                   scale=float(r.choice([0.5, 1.0, 3.0])), mask=FUZZ_MASKS[seed % len(FUZZ_MASKS)])


CONFIGS = [Config.draw(s) for s in range(N_CONFIGS)]


def test_fuzz_grid_covers_every_choice():
    """The 300 draws cover every length, feature size, mask kind, batch size and head count."""
    assert len(CONFIGS) >= 300
    assert {c.Lq for c in CONFIGS} == set(LENGTHS) and {c.Lk for c in CONFIGS} == set(LENGTHS)
    assert {c.Dk for c in CONFIGS} == set(FEATURES) and {c.Dv for c in CONFIGS} == set(FEATURES)
    assert {c.mask for c in CONFIGS} == set(FUZZ_MASKS)
    assert {c.B for c in CONFIGS} == {1, 2, 3} and {c.H for c in CONFIGS} == {1, 2, 3, 4}
    assert any(c.Lq != c.Lk for c in CONFIGS)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"seed{c.seed}")
def test_sdpa_fuzz_against_torch(cfg: Config):
    """Output and grads of Q, K, V equal PyTorch in float64 for one random configuration."""
    rng = make_rng(9001, cfg.seed)
    lead = (cfg.B, cfg.H)
    Q = cfg.scale * rng.standard_normal(lead + (cfg.Lq, cfg.Dk))
    K = cfg.scale * rng.standard_normal(lead + (cfg.Lk, cfg.Dk))
    V = rng.standard_normal(lead + (cfg.Lk, cfg.Dv))
    G = rng.standard_normal(lead + (cfg.Lq, cfg.Dv))
    mask = make_mask(cfg.mask, rng, lead, cfg.Lq, cfg.Lk)

    out, w = scaled_dot_product_attention(Q, K, V, mask=mask)
    dQ, dK, dV = scaled_dot_product_attention_backward(G, Q, K, V, w)
    t_out, t_dQ, t_dK, t_dV = torch_sdpa(Q, K, V, mask, G)

    dead = dead_rows(mask, lead + (cfg.Lq, cfg.Lk))  # (B, H, Lq)
    live = ~dead
    gs = group_scale(t_dQ[live], t_dK, t_dV)  # the scale of the whole input gradient
    for name, ours, ref, scale in (("output", out, t_out, None), ("grad_Q", dQ, t_dQ, gs)):
        assert ours.shape == ref.shape, f"{cfg}: {name} shape {ours.shape} != {ref.shape}"
        assert np.all(np.isfinite(ours)), f"{cfg}: {name} not finite"
        assert np.all(ours[dead] == 0), f"{cfg}: {name} not zero on fully masked rows"
        assert np.all(np.isfinite(ref[live])), f"{cfg}: torch {name} undefined on a live row"
        if live.any():
            assert_close_rel(ours[live], ref[live], np.float64, f"{cfg}: {name}", scale)
    assert_close_rel(dK, t_dK, np.float64, f"{cfg}: grad_K", gs)
    assert_close_rel(dV, t_dV, np.float64, f"{cfg}: grad_V", gs)
    assert np.all(w[dead] == 0), f"{cfg}: weights not zero on fully masked rows"
    np.testing.assert_allclose(w.sum(axis=-1)[live], 1.0, rtol=0, atol=1e-12, err_msg=str(cfg))
