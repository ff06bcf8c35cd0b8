"""The attention heads: Attention, Additive, Causal, LearnedBias, PhysicsGuided.

Dimension letters: B batch, H heads, Lq/Lk query/key length, D (= Dh) query/key features, Dv value features,
E = H * Dh model dim. Masks are boolean, ``True`` = may attend.

- finite differences (float64, central, relative error < 1e-6) for every head, input and parameter, with and
  without masks, Lq != Lk, with dropout (fixed seed), and through MultiHeadAttention;
- MultiHeadAttention with each head equals the heads computed one by one by hand (explicit numpy formulas);
- a custom head written in a few lines plugs into MultiHeadAttention;
- Positional score modifiers asked tile by tile equal the full matrix, and so do their gradients.
"""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.attention import (
    AdditiveAttention,
    Attention,
    CausalAttention,
    LearnedBiasAttention,
    MultiHeadAttention,
    PhysicsGuidedAttention,
)
from attnkit.core import BaseAttention
from attnkit.kernels import reference as ref

from head_cases import DV, HEADS, LK, LQ, B, D, H, prior_fn, randomise, t5_bucket_reference
from helpers import FD_TOL, assert_gradient, make_rng, numerical_gradient, randn, relative_error


def _inputs(rng, per_head: bool, seq_q: int = LQ, seq_k: int = LK):
    lead = (B, H) if per_head else (B,)
    return randn(rng, *lead, seq_q, D), randn(rng, *lead, seq_k, D), randn(rng, *lead, seq_k, DV), lead


def _mask(kind: str, rng, lead, seq_q: int, seq_k: int):
    """none | padding (B, 1.., Lk) | dead (full random mask with fully masked rows) | causal (is_causal)."""
    if kind in ("none", "causal"):
        return None
    if kind == "padding":
        m = np.arange(seq_k)[None, :] < rng.integers(1, seq_k + 1, size=B)[:, None]  # (B, Lk)
        return m.reshape((B,) + (1,) * len(lead) + (seq_k,))  # (B, 1, .., 1, Lk)
    m = rng.random(lead + (seq_q, seq_k)) < 0.6  # (..., Lq, Lk)
    m[..., 0, :] = False  # a fully masked query row in every matrix
    m[..., 1, 0] = True
    return m


def check_head(factory, q, k, v, mask, is_causal, G, seed=3):
    """FD-check every input and every parameter of a fresh head; returns the head of the analytic pass.

    Each probe builds a new head with the same seed and (perturbed) parameters, so that dropout draws the
    same entries every time.
    """
    params = {n: p.copy() for n, p in factory(seed).named_parameters()}

    def run():
        h = factory(seed)
        h.load_state_dict(params)
        out, _ = h(q, k, v, mask, is_causal=is_causal)
        return h, out

    head, out = run()
    assert out.shape == G.shape and np.all(np.isfinite(out))
    dq, dk, dv = head.backward(G)

    def loss():
        return np.sum(run()[1] * G)

    for name, x, g in (("q", q, dq), ("k", k, dk), ("v", v, dv)):
        assert_gradient(loss, x, g, name)
    for name, p in params.items():
        assert_gradient(loss, p, head.grads[name], name)
    return head


SEQS = {"Lq<Lk": (LQ, LK), "Lq=Lk": (4, 4), "Lq>Lk": (LK, LQ)}
GRAD_CASES = [(name, seqs) for name in sorted(HEADS) for seqs in SEQS
              if (name != "physics_pair" or seqs == "Lq<Lk")  # the coordinate pair has (LQ, LK) points
              and (name != "physics_points" or seqs != "Lq>Lk")]  # one grid needs Lq <= Lk


@pytest.mark.parametrize("mask_kind", ["none", "padding", "dead", "causal"])
@pytest.mark.parametrize("name,seq_case", GRAD_CASES)
def test_head_gradients(name, seq_case, mask_kind):
    """Every head: grad of q, k, v and of every parameter equal central finite differences."""
    factory, per_head = HEADS[name]
    seqs = SEQS[seq_case]
    rng = make_rng(1, sorted(HEADS).index(name), ["none", "padding", "dead", "causal"].index(mask_kind), *seqs)
    q, k, v, lead = _inputs(rng, per_head, *seqs)
    mask = _mask(mask_kind, rng, lead, *seqs)
    G = randn(rng, *lead, seqs[0], DV)
    check_head(factory, q, k, v, mask, mask_kind == "causal", G)


def test_additive_gradients_with_different_query_and_key_sizes():
    """AdditiveAttention with d_q != d_k and broadcast leading dims: every gradient matches FD."""
    rng = make_rng(2)
    q, k, v = randn(rng, 2, 1, 3, 4), randn(rng, 1, 2, 5, 6), randn(rng, 2, 2, 5, 3)
    mask = np.arange(5) < 4  # (Lk,)
    check_head(lambda s: AdditiveAttention(4, 6, 3, rng=1), q, k, v, mask, True, randn(rng, 2, 2, 3, 3))


def test_additive_gradients_with_values_broadcast_over_queries_and_keys():
    rng = make_rng(7)
    q, k, v = randn(rng, 1, 3, 4), randn(rng, 1, 5, 4), randn(rng, 2, 5, 3)
    check_head(lambda s: AdditiveAttention(4, 4, 3, rng=1), q, k, v, None, False, randn(rng, 2, 3, 3))


# --------------------------------------------------------------------------------------------------------
# Through MultiHeadAttention
# --------------------------------------------------------------------------------------------------------
MHA_HEADS = [n for n in sorted(HEADS) if "dropout" not in n and n != "physics_pair" and n != "physics_callable"]
E = H * D


def assert_gradient_or_zero(f, x, analytic, name):
    """:func:`assert_gradient`, except that a gradient that is exactly zero in theory (b_K of a dot-product
    head: softmax ignores a per-query shift) is accepted when both sides are at rounding level."""
    numeric = numerical_gradient(f, x)
    if np.max(np.abs(numeric)) < 1e-8 and np.max(np.abs(analytic)) < 1e-12:
        return
    err = relative_error(analytic, numeric)
    assert err < FD_TOL, f"grad of {name}: relative error {err:.3e} >= {FD_TOL:.0e}"


def _mha(name: str, rng_seed: int = 0, kdim=None, vdim=None, bias=False):
    return MultiHeadAttention(E, H, attention=HEADS[name][0](0), rng=rng_seed, kdim=kdim, vdim=vdim, bias=bias)


@pytest.mark.parametrize("name", MHA_HEADS + ["physics_callable_eval"])
def test_mha_gradients(name):
    """FD through MultiHeadAttention (cross-attention, kdim/vdim, biases, attn_mask + key padding, causal)."""
    if name == "physics_callable_eval":
        mha = MultiHeadAttention(E, H, attention=HEADS["physics_callable"][0](0), rng=0, kdim=4, vdim=5, bias=True)
        mha.eval()  # dropout off: a single module instance is reused by every probe
    else:
        mha = _mha(name, kdim=4, vdim=5, bias=True)
    rng = make_rng(3, len(name))
    query, key, value = randn(rng, B, LQ, E), randn(rng, B, LK, 4), randn(rng, B, LK, 5)
    attn_mask = rng.random((LQ, LK)) < 0.7  # (Lq, Lk)
    attn_mask[:, -1] = True
    kpm = np.ones((B, LK), bool)
    kpm[0, :2] = False  # (B, Lk)
    G = randn(rng, B, LQ, E)
    out, w = mha(query, key, value, attn_mask=attn_mask, key_padding_mask=kpm, is_causal=True)
    assert w.shape == (B, H, LQ, LK)
    mha.zero_grad()
    dq, dk, dv = mha.backward(G)

    def loss():
        return np.sum(mha(query, key, value, attn_mask=attn_mask, key_padding_mask=kpm, is_causal=True)[0] * G)

    for nm, x, g in (("query", query, dq), ("key", key, dk), ("value", value, dv)):
        assert_gradient(loss, x, g, nm)
    grads = dict(mha.named_gradients())
    for nm, p in mha.named_parameters():
        assert_gradient_or_zero(loss, p, grads[nm], nm)


def _softmax(scores, mask):
    """Explicit masked softmax (no fully masked rows in these tests)."""
    s = np.where(mask, scores, -np.inf)  # (..., Lq, Lk)
    e = np.exp(s - s.max(axis=-1, keepdims=True))  # (..., Lq, Lk)
    return e / e.sum(axis=-1, keepdims=True)


def _head_bias_by_hand(head, h: int, seq_q: int, seq_k: int) -> np.ndarray:
    """The (Lq, Lk) bias of head h, from the head's parameters and the papers' formulas."""
    i = np.arange(seq_q)[:, None] + seq_k - seq_q  # (Lq, 1) bottom-right aligned query positions
    j = np.arange(seq_k)[None, :]  # (1, Lk)
    if isinstance(head, LearnedBiasAttention) and head.mode == "t5":
        buckets = t5_bucket_reference(j - i, head.bidirectional, head.num_buckets, head.max_distance)
        return head.rel_bias[buckets, h]
    if isinstance(head, LearnedBiasAttention):
        dist = np.abs(i - j) if head.bidirectional else i - j  # one-sided: the paper's, meant with causal masks
        return -head.slopes[h] * dist
    if isinstance(head, PhysicsGuidedAttention):
        s = head.strength[h if head.strength.size > 1 else 0]
        if head.prior is prior_fn:
            return s * np.cos(0.7 * (i - j))
        c = head.coordinates
        if c is None:
            d2 = (i - j) ** 2.0
        else:
            d2 = ((c[i[:, 0]][:, None] - c[j[0]][None, :]) ** 2).sum(-1)  # (Lq, Lk)
        ls = head.length_scale
        return s * (-d2 / (2 * ls**2) if head.prior == "gaussian" else -np.sqrt(d2) / ls)
    return np.zeros((seq_q, seq_k))


def _head_by_hand(head, qh, kh, vh, mask, h):
    """Output and weights of head h from (B, L, Dh) slices, written out explicitly."""
    if isinstance(head, AdditiveAttention):
        hidden = np.tanh((qh @ head.W_q)[:, :, None, :] + (kh @ head.W_k)[:, None, :, :])  # (B, Lq, Lk, A)
        scores = hidden @ head.v  # (B, Lq, Lk)
    else:
        scale = getattr(head, "scale", None) or 1 / np.sqrt(qh.shape[-1])
        scores = scale * qh @ kh.swapaxes(1, 2) + _head_bias_by_hand(head, h, qh.shape[1], kh.shape[1])
    w = _softmax(scores, mask)  # (B, Lq, Lk)
    return w @ vh, w


@pytest.mark.parametrize("name", MHA_HEADS + ["physics_callable", "custom"])
def test_mha_equals_heads_by_hand(name):
    """MultiHeadAttention with any head = Concat(head_1 .. head_H) W_O, each head computed by hand."""
    if name == "custom":
        mha = MultiHeadAttention(E, H, attention=_LocalWindowAttention(), rng=1)
    else:
        mha = _mha(name, rng_seed=1)
    mha.eval()
    rng = make_rng(4, len(name))
    query, key, value = randn(rng, B, LQ, E), randn(rng, B, LK, E), randn(rng, B, LK, E)
    attn_mask = rng.random((LQ, LK)) < 0.6  # (Lq, Lk)
    attn_mask[np.arange(LQ), np.arange(LQ) + LK - LQ] = True  # every query sees its own position ...
    kpm = np.ones((B, LK), bool)
    kpm[1, 1] = False  # (B, Lk) ... which is never padded
    out, w = mha(query, key, value, attn_mask=attn_mask, key_padding_mask=kpm, is_causal=True)
    causal = np.arange(LK)[None, :] <= np.arange(LQ)[:, None] + LK - LQ  # (Lq, Lk)
    mask = attn_mask & causal & kpm[:, None, :]  # (B, Lq, Lk)
    if name == "custom":
        mask = mask & (np.abs(np.arange(LQ)[:, None] + LK - LQ - np.arange(LK)[None, :]) <= 2)
    heads, weights = [], []
    for h in range(H):
        cols = slice(h * D, (h + 1) * D)
        qh, kh, vh = query @ mha.W_Q[:, cols], key @ mha.W_K[:, cols], value @ mha.W_V[:, cols]  # (B, L, Dh)
        o, wh = _head_by_hand(mha.attention, qh, kh, vh, mask, h)
        heads.append(o)
        weights.append(wh)
    expected = np.concatenate(heads, axis=-1) @ mha.W_O  # (B, Lq, E)
    np.testing.assert_allclose(w, np.stack(weights, axis=1), rtol=0, atol=1e-13)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-13)


class _LocalWindowAttention(BaseAttention):
    """A custom head in a few lines: scaled dot-product attention within a window of +-2 positions."""

    def forward(self, q, k, v, mask=None, *, is_causal=False, need_weights=True):
        window = np.abs(ref.causal_mask(q.shape[-2], k.shape[-2]).sum(-1, keepdims=True) - 1
                        - np.arange(k.shape[-2])) <= 2  # (Lq, Lk): |pos(i) - j| <= 2
        mask = window if mask is None else mask & window
        out, w, self._ctx = ref.attention_forward(q, k, v, mask=mask, causal=is_causal)
        return out, w

    def backward(self, grad_output):
        return ref.attention_backward(grad_output, self._ctx)[:3]


def test_custom_head_gradients_through_mha():
    """The few-line custom head trains inside MultiHeadAttention: its gradients match FD."""
    mha = MultiHeadAttention(E, H, attention=_LocalWindowAttention(), rng=2)
    rng = make_rng(5)
    x, G = randn(rng, B, 4, E), randn(rng, B, 4, E)
    out, _ = mha(x, x, x)
    dq, dk, dv = mha.backward(G)

    def loss():
        return np.sum(mha(x, x, x)[0] * G)

    assert_gradient(loss, x, dq + dk + dv, "x")
    grads = dict(mha.named_gradients())
    for nm, p in mha.named_parameters():
        assert_gradient(loss, p, grads[nm], nm)


# --------------------------------------------------------------------------------------------------------
# Positional score modifiers: a tiled kernel asks tile by tile and must get the same values and gradients
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["t5", "t5_causal", "alibi", "alibi_causal", "physics_points",
                                  "physics_gauss_heads", "physics_callable"])
def test_score_mod_tiles_equal_full_tile(name):
    from attnkit.kernels.flex import score_index
    head = HEADS[name][0](0)
    seq_q, seq_k = 5, 7 if name != "physics_points" else LK + 2
    G = randn(make_rng(6), B, H, seq_q, seq_k)
    zeros = np.zeros((B, H, seq_q, seq_k))
    mod = head.score_mod_for(seq_q, seq_k)
    full = mod.forward(zeros, *score_index(B, H, 0, seq_q, 0, seq_k))  # (B, H, Lq, Lk)
    mod.backward(G, zeros, *score_index(B, H, 0, seq_q, 0, seq_k))
    full_grads = {n: g.copy() for n, g in head.grads.items()}
    head.zero_grad()
    mod = head.score_mod_for(seq_q, seq_k)
    for q0, q1 in ((0, 2), (2, 5)):
        for k0, k1 in ((0, 3), (3, 6), (6, 7)):
            index = score_index(B, H, q0, q1, k0, k1)
            np.testing.assert_array_equal(mod.forward(zeros[..., q0:q1, k0:k1], *index), full[..., q0:q1, k0:k1])
            mod.backward(G[..., q0:q1, k0:k1], zeros[..., q0:q1, k0:k1], *index)
    for n, g in head.grads.items():
        np.testing.assert_allclose(g, full_grads[n], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,twin", [
    ("attention_dropout", lambda: Attention()),
    ("causal_dropout", lambda: CausalAttention()),
    ("t5_dropout", lambda: randomise(LearnedBiasAttention(H, max_distance=6, num_buckets=8))),
    ("physics_callable", lambda: randomise(PhysicsGuidedAttention(prior_fn, num_heads=H))),
])
def test_dropout_is_training_only_and_weights_are_pre_dropout(name, twin):
    """Training mode drops weights (same seed, same result); eval mode equals the head without dropout; the
    returned weights are the softmax before dropout; need_weights=False returns None."""
    factory, per_head = HEADS[name]
    rng = make_rng(8)
    q, k, v, _ = _inputs(rng, per_head)
    ref_out, ref_w = twin()(q, k, v)
    out_a, w_a = factory(4)(q, k, v)
    out_b, _ = factory(4)(q, k, v)
    np.testing.assert_array_equal(out_a, out_b)
    assert not np.allclose(out_a, ref_out)
    np.testing.assert_allclose(w_a, ref_w, rtol=0, atol=1e-15)
    head = factory(4).eval()
    out_e, w_e = head(q, k, v, need_weights=False)
    assert w_e is None
    np.testing.assert_allclose(out_e, ref_out, rtol=0, atol=1e-15)
