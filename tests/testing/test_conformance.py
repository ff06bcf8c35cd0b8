"""check_attention: a correct attention function passes every case; each deliberately different one (the causal
corner at the top left, NaN or averaged fully masked rows, a default scale of 1/D, heads grouped the other way,
a window ignored or one key wider, a wrong gradient) is named in exactly the cases where it shows, and only
there. The planted functions are a plain PyTorch attention written here, independent of attnkit."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from attnkit.flex import flex_attention, flex_attention_backward
from attnkit.testing import check_attention, default_cases
from attnkit.testing.conformance import FLOAT32_PRECISION, TOLERANCE, AttentionSpec, Case, relative_error, round_to

torch = pytest.importorskip("torch")

DTYPES = ("float32", "float64")
ALL_CASES = {case.name for case in default_cases()}
LQ_BELOW_LK = {"causal, Lq < Lk", "causal GQA, Lq < Lk", "sliding window 3, Lq < Lk"}
DEAD_ROWS = {"causal + left padding (dead rows)", "fully masked rows"}
GROUPED = {"grouped heads (GQA 4:2)", "causal GQA, Lq < Lk", "causal + left padding (dead rows)", "sliding window 3",
           "sinks"}
WINDOWS = {"sliding window 3", "sliding window 3, Lq < Lk"}


def _cases(*names: str) -> list[Case]:
    by_name = {case.name: case for case in default_cases()}
    return [by_name[name] for name in names]


class _ScaledGradient(torch.autograd.Function):
    """The identity whose backward multiplies the gradient by ``factor``: a planted backward bug."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def planted(*, top_left=False, dead="zero", default_scale=None, interleave=False, window_delta=0,
            ignore_window=False, grad_factor=1.0, ignore=()):
    """A plain PyTorch attention in the suite's convention, with at most one planted difference (``ignore``:
    spec fields it never reads)."""
    def attend(q, k, v, spec: AttentionSpec):
        spec = dataclasses.replace(spec, **{name: None for name in ignore})
        (_, hq, lq, d), hkv, lk = q.shape, k.shape[1], k.shape[2]
        group = hq // hkv
        k, v = ((x.repeat(1, group, 1, 1) if interleave else x.repeat_interleave(group, 1)) for x in (k, v))
        scale = spec.scale if spec.scale is not None else default_scale(d) if default_scale else d ** -0.5
        s = (q @ k.transpose(-1, -2)) * scale  # (B, Hq, Lq, Lk)
        i = torch.arange(lq)[:, None] + (0 if top_left else lk - lq)
        j = torch.arange(lk)[None, :]
        if spec.alibi_slopes is not None:
            s = s + torch.from_numpy(spec.alibi_slopes).to(s.dtype)[:, None, None] * (j - i)
        if spec.softcap is not None:
            s = spec.softcap * torch.tanh(s / spec.softcap)
        allowed = torch.ones(1, 1, lq, lk, dtype=torch.bool)
        if spec.causal:
            allowed = allowed & (j <= i)
            if spec.window is not None and not ignore_window:
                allowed = allowed & (j > i - (spec.window + window_delta))
        if spec.key_padding is not None:
            allowed = allowed & torch.from_numpy(spec.key_padding)[:, None, None, :]
        if spec.mask is not None:
            allowed = allowed & torch.from_numpy(spec.mask)
        dead_row = ~allowed.any(-1, keepdim=True)  # (B, 1, Lq, 1)
        if dead == "zero":
            s = torch.where(dead_row, 0.0, s.masked_fill(~allowed, -math.inf))
        else:
            s = s.masked_fill(~allowed, -math.inf if dead == "nan" else torch.finfo(s.dtype).min)
        if spec.sinks is not None:
            sink = torch.from_numpy(spec.sinks).to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)
            w = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]  # (B, Hq, Lq, Lk)
        else:
            w = torch.softmax(s, dim=-1)
        if dead == "zero":
            w = torch.where(dead_row, 0.0, w)
        return _ScaledGradient.apply(w @ v, grad_factor)  # (B, Hq, Lq, Dv)

    attend.framework = "torch"
    return attend


def _differs(report) -> dict[str, set[str]]:
    """finding -> the cases (any dtype) where it was reported."""
    found: dict[str, set[str]] = {}
    for r in report.results:
        if r.status != "pass":
            found.setdefault(r.finding or r.detail or r.status, set()).add(r.case)
    return found


def test_a_correct_function_passes_every_case_with_its_dtypes_rounding_error():
    report = check_attention(planted(), dtypes=DTYPES)
    assert report.passed and report.findings() == {}
    assert {r.case for r in report.results} == ALL_CASES and len(report.results) == 2 * len(ALL_CASES)
    f32 = [r for r in report.results if r.dtype == "float32"]
    f64 = [r for r in report.results if r.dtype == "float64"]
    # float32 computes with float32 rounding (a few 1e-8 .. 1e-7), float64 with float64's
    assert 1e-9 < max(r.forward_error for r in f32) <= TOLERANCE["float32"]
    assert max(r.gradient_error for r in f32) <= TOLERANCE["float32"]
    assert max(max(r.forward_error, r.gradient_error) for r in f64) < 1e-13


@pytest.mark.parametrize("planted_difference, finding, where", [
    (dict(top_left=True), "causal corner at the top left (query i sees keys j <= i)", LQ_BELOW_LK),
    (dict(dead="nan"), "fully masked rows are NaN", DEAD_ROWS),
    (dict(dead="uniform"), "fully masked rows average every value (uniform weights)", DEAD_ROWS),
    (dict(default_scale=lambda d: 1.0 / d), "default scale is 1/D", {"default scale"}),
    (dict(default_scale=lambda d: 1.0), "default scale is 1", {"default scale"}),
    (dict(interleave=True), "query head h reads key head h % Hkv (heads interleaved)", GROUPED),
    (dict(ignore_window=True), "window ignored", WINDOWS),
    (dict(window_delta=1), "window one key wider", WINDOWS),
    (dict(window_delta=-1), "window one key narrower", WINDOWS),
    (dict(ignore=("key_padding",)), "key padding ignored", {"key padding", "causal + left padding (dead rows)"}),
    (dict(ignore=("softcap",)), "soft-cap ignored", {"soft-cap 2"}),
    (dict(ignore=("sinks",)), "sinks ignored", {"sinks"}),
    (dict(ignore=("alibi_slopes",)), "ALiBi ignored", {"ALiBi"}),
])
def test_each_planted_difference_is_named_where_it_shows_and_nowhere_else(planted_difference, finding, where):
    report = check_attention(planted(**planted_difference), dtypes=DTYPES)
    assert _differs(report) == {finding: where}
    for r in report.results:
        if r.case in where:
            assert r.status == "differs" and r.forward_error > 1e-2, r  # a real difference, not rounding
        else:
            assert r.status == "pass", r


def test_the_dead_row_findings_hold_in_half_precision_too():
    report = check_attention(planted(dead="uniform"), dtypes=("float16", "bfloat16"))
    assert _differs(report) == {"fully masked rows average every value (uniform weights)": DEAD_ROWS}


def test_a_wrong_backward_is_found_where_the_output_agrees():
    report = check_attention(planted(grad_factor=1.01), dtypes=DTYPES)
    assert _differs(report) == {"gradients differ (the output agrees)": ALL_CASES}
    r = report.result("plain", "float64")
    assert r.forward_error < 1e-13 and r.gradient_error == pytest.approx(0.01, rel=1e-6)


def test_float32_inside_a_float64_call_is_named():
    """transformers' eager attention takes its softmax in float32 even for float64 inputs."""
    def float32_inside(q, k, v, spec):
        return planted()(q.float(), k.float(), v.float(), spec).double()
    float32_inside.framework = "torch"
    report = check_attention(float32_inside, cases=_cases("plain", "default scale", "sinks"), dtypes=("float64",))
    assert {r.finding for r in report.results} == {FLOAT32_PRECISION}
    assert all(1e-9 < r.forward_error <= TOLERANCE["float32"] for r in report.results)


def test_a_numpy_function_with_a_backward_has_its_gradients_checked():
    def mine(q, k, v, spec):
        if any(x is not None for x in (spec.key_padding, spec.mask, spec.window, spec.softcap, spec.sinks,
                                       spec.alibi_slopes)) or spec.causal:
            raise NotImplementedError("no masks or modifiers")
        out, ctx = flex_attention(q, k, v, scale=spec.scale, enable_gqa=True, kernel="tiled")
        return out, lambda g: flex_attention_backward(g, ctx)
    report = check_attention(mine, dtypes=("float32", "float64"))
    ran = [r for r in report.results if r.status != "unsupported"]
    assert {r.case for r in ran} == {"plain", "default scale", "grouped heads (GQA 4:2)", "one key head (MQA)",
                                     "value width 12, key width 8"}
    assert report.passed and all(r.gradient_error is not None for r in ran)
    assert report.result("sinks", "float32").detail == "no masks or modifiers"
    assert max(r.gradient_error for r in ran if r.dtype == "float64") < 1e-13


def test_a_raising_function_and_a_wrong_shape_are_errors_not_crashes():
    def broken(q, k, v, spec):
        raise RuntimeError("boom\nsecond line")
    report = check_attention(broken, cases=_cases("plain"), dtypes=("float32",))
    assert report.result("plain", "float32").detail == "RuntimeError: boom" and not report.passed

    def transposed(q, k, v, spec):
        return planted()(q, k, v, spec).transpose(1, 2)  # (B, Lq, H, Dv), as transformers' functions return
    transposed.framework = "torch"
    r = check_attention(transposed, cases=_cases("plain"), dtypes=("float32",)).result("plain", "float32")
    assert r.status == "error" and "output shape (2, 7, 4, 16)" in r.detail


def test_the_table_and_the_findings_read_as_documented():
    report = check_attention(planted(top_left=True), cases=_cases("causal, Lq = Lk", "causal, Lq < Lk"),
                             dtypes=("float64",), name="mine")
    text = str(report)
    assert text.startswith("mine\n\n| case | float64 | finding |")
    assert "| causal, Lq = Lk | ✓ " in text and "| causal, Lq < Lk | ✗ 2.0e+00 / " in text
    assert report.findings() == {"causal corner at the top left (query i sees keys j <= i)":
                                 ["causal, Lq < Lk (float64)"]}


def test_bad_arguments_are_refused_by_name():
    fn = planted()
    with pytest.raises(ValueError, match="no bfloat16 for a NumPy function"):
        check_attention(lambda q, k, v, spec: q, dtypes=("bfloat16",))
    with pytest.raises(ValueError, match="dtypes must be among"):
        check_attention(fn, dtypes=("float8",))
    fn.framework = "jax"
    with pytest.raises(ValueError, match="fn.framework must be 'numpy' or 'torch', got 'jax'"):
        check_attention(fn)


def test_bfloat16_rounding_is_torchs():
    x = np.random.default_rng(0).standard_normal(10_000) * 10.0 ** np.random.default_rng(1).integers(-8, 8, 10_000)
    assert np.array_equal(round_to(x, "bfloat16"), torch.from_numpy(x).float().bfloat16().double().numpy())


def test_relative_error_counts_nan_as_equal_only_where_expected():
    assert relative_error(np.array([np.nan, 1.0]), np.array([np.nan, 2.0])) == 0.5
    assert relative_error(np.array([np.nan, 2.0]), np.array([0.0, 2.0])) == math.inf
    assert relative_error(np.zeros(3), np.zeros(4)) == math.inf


def test_a_case_of_the_users_own_runs():
    case = Case("wide heads", 1, 2, 1, 3, 5, 64, 64, AttentionSpec(causal=True, scale=0.125), seed=3)
    report = check_attention(planted(top_left=True), cases=[case], dtypes=("float32",))
    assert report.result("wide heads", "float32").finding == "causal corner at the top left (query i sees keys j <= i)"


def _attnkit_tiled(q, k, v, spec: AttentionSpec):
    """attnkit's own tiled kernel through its flex API (its masks and modifiers, not the suite's), gradients
    included: the twin of the float64 reference over the whole grid."""
    from attnkit import flex as F

    (batch, _, seq_q, _), seq_k = q.shape, k.shape[2]
    masks = []
    if spec.causal:
        masks.append(F.sliding_window_mask(spec.window, offset=seq_k - seq_q) if spec.window
                     else F.causal_lower_right(seq_q, seq_k))
    if spec.key_padding is not None:
        masks.append(F.padding_mask(spec.key_padding))
    if spec.mask is not None:
        masks.append(F.boolean_mask(spec.mask))
    block_mask = None if not masks else F.create_block_mask(F.and_masks(*masks) if len(masks) > 1 else masks[0],
                                                            batch, None, seq_q, seq_k)
    mods = [m for m in (None if spec.alibi_slopes is None else F.alibi(spec.alibi_slopes),
                        None if spec.softcap is None else F.softcap(spec.softcap)) if m is not None]
    out, ctx = F.flex_attention(q, k, v, F.compose(*mods) if mods else None, block_mask, scale=spec.scale,
                                sinks=spec.sinks, enable_gqa=True, kernel="tiled")
    return out, lambda g: F.flex_attention_backward(g, ctx)[:3]


def test_attnkits_tiled_kernel_passes_every_case_with_gradients():
    report = check_attention(_attnkit_tiled, dtypes=("float16", "float32", "float64"))
    assert report.passed and all(r.status == "pass" and r.gradient_error is not None for r in report.results)
    assert max(r.gradient_error for r in report.results if r.dtype == "float64") < 1e-13
    assert max(r.forward_error for r in report.results if r.dtype == "float32") < 2e-6
