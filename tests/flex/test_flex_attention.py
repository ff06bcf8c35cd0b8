"""attnkit.flex against torch's FlexAttention (forward) and torch autograd on the full score matrix (backward)."""
import math

import numpy as np
import pytest

import attnkit.flex as F

torch = pytest.importorskip("torch")
flex_mod = pytest.importorskip("torch.nn.attention.flex_attention")

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.filterwarnings("ignore:return_lse is deprecated:FutureWarning")]


def _inputs(B=2, Hq=4, Hkv=2, Lq=37, Lk=37, D=8, Dv=6, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(B, Hq, Lq, D)), rng.normal(size=(B, Hkv, Lk, D)), rng.normal(size=(B, Hkv, Lk, Dv)))


DOCS = np.repeat(np.arange(4), 10)[:37]
PAD = np.ones((2, 37), dtype=bool)
PAD[1, 30:] = False
MASKS = {
    "none": (None, None),
    "causal": (F.causal_mask, lambda b, h, q, k: k <= q),
    "window": (F.sliding_window_mask(5), lambda b, h, q, k: (k <= q) & (k > q - 5)),
    "chunked": (F.chunked_mask(8), lambda b, h, q, k: (q // 8 == k // 8) & (k <= q)),
    "document": (F.document_mask(DOCS), lambda b, h, q, k: torch.as_tensor(DOCS)[q] == torch.as_tensor(DOCS)[k]),
    "prefix": (F.prefix_lm_mask(6), lambda b, h, q, k: (k < 6) | (k <= q)),
    "padding": (F.padding_mask(PAD), lambda b, h, q, k: torch.as_tensor(PAD)[b, k]),
    "and_or": (F.or_masks(F.and_masks(F.causal_mask, F.sliding_window_mask(4)), lambda b, h, q, k: k < 3),
               lambda b, h, q, k: ((k <= q) & (k > q - 4)) | (k < 3)),
}
SLOPES = F.alibi_slopes(4)
REL = F.relative_position_bias(4, num_buckets=8, max_distance=20, seed=3)
BIAS = np.random.default_rng(5).normal(size=(1, 4, 37, 37))


def _torch_rel(score, b, h, q, k):
    buckets = torch.as_tensor(F.t5_relative_position_bucket(np.arange(-40, 40), True, 8, 20))
    return score + torch.as_tensor(REL.params["table"])[buckets[k - q + 40], h]


SCORES = {
    "none": (lambda: None, None),
    "softcap": (lambda: F.softcap(1.5), lambda s, b, h, q, k: 1.5 * torch.tanh(s / 1.5)),
    "alibi": (lambda: F.alibi(SLOPES), lambda s, b, h, q, k: s + torch.as_tensor(SLOPES)[h] * (k - q)),
    "t5": (lambda: REL, _torch_rel),
    "additive": (lambda: F.additive_bias(BIAS), lambda s, b, h, q, k: s + torch.as_tensor(BIAS)[0, h, q, k]),
    "compose": (lambda: F.compose(F.alibi(SLOPES), F.softcap(2.0)),
                lambda s, b, h, q, k: 2.0 * torch.tanh((s + torch.as_tensor(SLOPES)[h] * (k - q)) / 2.0)),
}


def _torch_flex(q, k, v, score_mod, mask_mod, gqa):
    t = [torch.as_tensor(x) for x in (q, k, v)]
    bm = None
    if mask_mod is not None:
        bm = flex_mod.create_block_mask(mask_mod, q.shape[0], q.shape[1], q.shape[2], k.shape[2], device="cpu")
    out = flex_mod.flex_attention(*t, score_mod=score_mod, block_mask=bm, enable_gqa=gqa)
    return out.numpy()


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("score", sorted(SCORES))
@pytest.mark.parametrize("kernel", ["reference", "tiled"])
def test_forward_matches_torch_flex(mask, score, kernel):
    q, k, v = _inputs()
    ours_mask, torch_mask = MASKS[mask]
    make_mod, torch_mod = SCORES[score]
    bm = None if ours_mask is None else F.create_block_mask(ours_mask, 2, None, 37, 37, block_size=16)
    out, ctx = F.flex_attention(q, k, v, make_mod(), bm, enable_gqa=True, kernel=kernel)
    with torch.no_grad():
        expected = _torch_flex(q, k, v[..., :], torch_mod, torch_mask, True)
    # torch's flex gives NaN-free zeros for dead rows as we do; padding makes none dead here
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)


def test_lq_ne_lk_and_dead_rows_give_zeros():
    q, k, v = _inputs(Lq=19, Lk=41)
    mask = F.and_masks(F.causal_mask, lambda b, h, qi, ki: qi != 3)  # row 3 fully masked
    bm = F.create_block_mask(mask, None, None, 19, 41, block_size=(8, 16))
    for kernel in ("reference", "tiled"):
        out, lse, _ = F.flex_attention(q, k, v, None, bm, enable_gqa=True, return_lse=True, kernel=kernel)
        assert np.all(out[:, :, 3] == 0) and np.all(np.isneginf(lse[:, :, 3]))
        tm = flex_mod.create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (qi != 3), None, None, 19, 41,
                                        device="cpu")
        with torch.no_grad():
            exp, exp_lse = flex_mod.flex_attention(*[torch.as_tensor(x) for x in (q, k, v)], block_mask=tm,
                                                   enable_gqa=True, return_lse=True)
        np.testing.assert_allclose(out, exp.numpy(), rtol=1e-10, atol=1e-12)
        live = np.isfinite(lse)
        np.testing.assert_allclose(lse[live], exp_lse.numpy()[live], rtol=1e-12)


def _torch_reference(q, k, v, mod_torch, keep, sinks, scale):
    """Autograd reference on the full score matrix: the same formula as attnkit.flex."""
    group = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = scale * q @ kx.transpose(-1, -2)
    B, H, Lq, Lk = s.shape
    idx = (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1), torch.arange(Lq).view(1, 1, Lq, 1),
           torch.arange(Lk).view(1, 1, 1, Lk))
    if mod_torch is not None:
        s = mod_torch(s, *idx)
    s = s.masked_fill(~torch.as_tensor(np.broadcast_to(keep, s.shape).copy()), -torch.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, H, 1, 1).expand(B, H, Lq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)
    return p[..., :Lk] @ vx


@pytest.mark.parametrize("kernel", ["reference", "tiled"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_gradients_match_torch_autograd(kernel, with_sinks):
    q, k, v = _inputs(Lq=23, Lk=29, seed=1)
    slopes = F.alibi_slopes(4) * 1.3
    table = np.random.default_rng(2).normal(size=(8, 4))
    bias = np.random.default_rng(4).normal(size=(4, 1, 29))
    mod = F.compose(F.alibi(slopes), F.relative_position_bias(4, 8, 20, table=table), F.additive_bias(bias),
                    F.softcap(2.5))
    mask = F.or_masks(F.sliding_window_mask(9), F.prefix_lm_mask(2))
    bm = F.create_block_mask(mask, None, None, 23, 29, block_size=(8, 8))
    sinks = np.array([0.3, -1.0, 2.0, 0.0]) if with_sinks else None
    out, ctx = F.flex_attention(q, k, v, mod, bm, sinks=sinks, enable_gqa=True, kernel=kernel, scale=0.4)
    g = np.random.default_rng(9).normal(size=out.shape)
    grads = F.flex_attention_backward(g, ctx)

    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    ts, tt, tb = (torch.tensor(x, requires_grad=True) for x in (slopes, table, bias))
    tsink = torch.tensor(sinks, requires_grad=True) if with_sinks else None
    buckets = torch.as_tensor(F.t5_relative_position_bucket(np.arange(-40, 40), True, 8, 20))

    def tmod(s, b, h, qi, ki):
        s = s + ts[h] * (ki - qi)
        s = s + tt[buckets[ki - qi + 40], h]
        s = s + tb[h, 0, ki]
        return 2.5 * torch.tanh(s / 2.5)
    keep = bm.to_dense()
    ref = _torch_reference(tq, tk, tv, tmod, keep, tsink, 0.4)
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-10, atol=1e-12)
    ref.backward(torch.as_tensor(g))
    for ours, theirs in zip(grads[:3], (tq, tk, tv)):
        np.testing.assert_allclose(ours, theirs.grad.numpy(), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(mod.grads["0.slopes"], ts.grad.numpy(), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(mod.grads["1.table"], tt.grad.numpy(), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(mod.grads["2.bias"][0], tb.grad.numpy(), rtol=1e-9, atol=1e-11)
    if with_sinks:
        assert len(grads) == 4
        np.testing.assert_allclose(grads[3], tsink.grad.numpy(), rtol=1e-9, atol=1e-11)
        assert ctx.sinks_grad is grads[3]


def test_finite_differences_float64():
    q, k, v = _inputs(B=1, Hq=2, Hkv=1, Lq=7, Lk=9, D=3, Dv=2, seed=7)
    sinks = np.array([0.5, -0.2])
    bm = F.create_block_mask(F.prefix_lm_mask(2), None, None, 7, 9, block_size=4)
    g = np.random.default_rng(1).normal(size=(1, 2, 7, 2))

    def loss(q, k, v, sinks, slopes):
        mod = F.compose(F.alibi(slopes), F.softcap(1.7))
        out, ctx = F.flex_attention(q, k, v, mod, bm, sinks=sinks, enable_gqa=True, kernel="tiled")
        return float((out * g).sum()), ctx, mod
    slopes = np.array([0.3, 0.8])
    _, ctx, mod = loss(q, k, v, sinks, slopes)
    dq, dk, dv, ds = F.flex_attention_backward(g, ctx)
    args = [q, k, v, sinks, slopes]
    for pos, analytic in enumerate([dq, dk, dv, ds, mod.grads["0.slopes"]]):
        x = args[pos]
        numeric = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[pos][i] += 1e-6
            minus[pos][i] -= 1e-6
            numeric[i] = (loss(*plus)[0] - loss(*minus)[0]) / 2e-6
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


def test_plain_function_is_forward_only():
    q, k, v = _inputs(Hkv=4)
    out, ctx = F.flex_attention(q, k, v, lambda s, b, h, qi, ki: s * 0.5)
    with pytest.raises(TypeError, match="no backward"):
        F.flex_attention_backward(np.ones_like(out), ctx)


def test_bad_inputs_name_the_argument():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="enable_gqa"):
        F.flex_attention(q, k, v)
    with pytest.raises(ValueError, match="sinks"):
        F.flex_attention(q, k, v, enable_gqa=True, sinks=np.zeros(3))
    with pytest.raises(ValueError, match="kernel"):
        F.flex_attention(q, k, v, enable_gqa=True, kernel="fast")


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize("lq, lk", [(5, 23), (23, 23), (30, 12)])
@pytest.mark.parametrize("kernel", ["reference", "tiled"])
def test_causal_lower_right_matches_torch_and_attnkit_causal(lq, lk, kernel):
    """New tokens after a cache: queries aligned at the bottom-right corner, as torch's causal_lower_right and
    attnkit's own ``causal=True``; queries with no key left (Lq > Lk) give zeros there too."""
    from torch.nn.attention.bias import causal_lower_right

    from attnkit.kernels import attention_forward

    q, k, v = _inputs(Hq=2, Hkv=2, Lq=lq, Lk=lk)
    bm = F.create_block_mask(F.causal_lower_right(lq, lk), None, None, lq, lk, block_size=8)
    out, _ = F.flex_attention(q, k, v, None, bm, kernel=kernel)
    own, _, _ = attention_forward(q, k, v, causal=True)
    np.testing.assert_allclose(out, own, rtol=1e-12, atol=1e-14)
    with torch.no_grad():
        expected = torch.nn.functional.scaled_dot_product_attention(
            *[torch.as_tensor(x) for x in (q, k, v)], attn_mask=causal_lower_right(lq, lk)).numpy()
    live = np.arange(lq) + lk - lq >= 0  # torch gives NaN rows where no key is left
    np.testing.assert_allclose(out[:, :, live], expected[:, :, live], rtol=1e-10, atol=1e-12)
    assert np.all(out[:, :, ~live] == 0)


def test_sliding_window_offset_aligns_the_window_at_the_bottom_right():
    from attnkit.kernels import attention_forward

    q, k, v = _inputs(Hq=2, Hkv=2, Lq=6, Lk=29)
    bm = F.create_block_mask(F.sliding_window_mask(4, offset=29 - 6), None, None, 6, 29, block_size=8)
    out, _ = F.flex_attention(q, k, v, None, bm, kernel="tiled")
    own, _, _ = attention_forward(q, k, v, causal=True, window=4)
    np.testing.assert_allclose(out, own, rtol=1e-12, atol=1e-14)
    with pytest.raises(TypeError, match="offset must be an int"):
        F.sliding_window_mask(4, offset=1.5)


def _kept_key_heads(kernel_ctx) -> tuple[int, int]:
    """How many key and value heads a kernel's context keeps (per batch row)."""
    if hasattr(kernel_ctx, "k_aug"):  # the tiled kernel: (B, Hkv, 1, Lk, D + 2) for grouped keys
        return math.prod(kernel_ctx.k_aug.shape[1:-2]), math.prod(kernel_ctx.v_aug.shape[1:-2])
    return kernel_ctx.k.shape[1], kernel_ctx.v.shape[1]


@pytest.mark.parametrize("kernel", ["reference", "tiled"])
def test_grouped_keys_are_read_in_place_and_equal_repeated_keys(kernel):
    """Grouped-query K/V stay (B, Hkv, Lk, D) in the context (no copy per query head) and give what the same
    keys repeated per query head give, gradients summed over each group."""
    q, k, v = _inputs(Hq=6, Hkv=2, Lq=21, Lk=21, seed=12)
    bm = F.create_block_mask(F.causal_mask, None, None, 21, 21, block_size=(8, 8))
    mod = F.softcap(2.0)
    out, ctx = F.flex_attention(q, k, v, mod, bm, enable_gqa=True, kernel=kernel)
    assert _kept_key_heads(ctx.kernel_ctx) == (2, 2)
    rep_k, rep_v = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)  # (2, 6, 21, *)
    expected, rep_ctx = F.flex_attention(q, rep_k, rep_v, mod, bm, kernel=kernel)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    g = np.random.default_rng(13).normal(size=out.shape)
    dq, dk, dv = F.flex_attention_backward(g, ctx)
    rq, rk, rv = F.flex_attention_backward(g, rep_ctx)
    np.testing.assert_allclose(dq, rq, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dk, rk.reshape(2, 2, 3, 21, 8).sum(axis=2), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dv, rv.reshape(2, 2, 3, 21, 6).sum(axis=2), rtol=1e-12, atol=1e-12)
