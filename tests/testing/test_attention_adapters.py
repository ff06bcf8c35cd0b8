"""The adapters of torch's SDPA, flex_attention and transformers' attention functions: what the conformance
pages (docs/conformance/) report about each holds on the installed versions, on a few cases in float32."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from attnkit.testing import check_attention, default_cases
from attnkit.testing.attention_adapters import sdpa_backends, torch_flex_attention, torch_sdpa, transformers_attention

torch = pytest.importorskip("torch")

DOCS = Path(__file__).resolve().parents[2] / "docs" / "conformance"
TOP_LEFT = "causal corner at the top left (query i sees keys j <= i)"


def _cases(*names: str):
    by_name = {case.name: case for case in default_cases()}
    return [by_name[name] for name in names]


def test_the_cpu_has_the_math_and_flash_backends():
    assert {"math", "flash"} <= set(sdpa_backends())


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_sdpa_is_causal_puts_the_corner_at_the_top_left(backend):
    report = check_attention(torch_sdpa(backend), dtypes=("float32",),
                             cases=_cases("plain", "default scale", "causal, Lq = Lk", "causal, Lq < Lk",
                                          "fully masked rows", "sliding window 3", "causal + left padding (dead rows)"))
    statuses = {r.case: (r.status, r.finding) for r in report.results}
    assert statuses == {"plain": ("pass", None), "default scale": ("pass", None), "causal, Lq = Lk": ("pass", None),
                        "causal, Lq < Lk": ("differs", TOP_LEFT), "fully masked rows": ("pass", None),
                        "sliding window 3": ("unsupported", None),
                        "causal + left padding (dead rows)": ("unsupported", None)}
    plain = report.result("plain", "float32")
    assert plain.forward_error < 1e-6 and plain.gradient_error < 1e-6
    assert report.result("causal, Lq < Lk", "float32").forward_error > 1.0


def test_an_unknown_sdpa_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be None or one of"):
        torch_sdpa("fast")


def test_flex_attention_with_the_documented_causal_mask_is_top_left_and_zeroes_dead_rows():
    report = check_attention(torch_flex_attention(), dtypes=("float32",),
                             cases=_cases("causal, Lq < Lk", "fully masked rows", "soft-cap 2", "sinks"))
    assert report.result("causal, Lq < Lk", "float32").finding == TOP_LEFT
    assert report.result("fully masked rows", "float32").status == "pass"
    assert report.result("soft-cap 2", "float32").status == "pass"
    assert report.result("sinks", "float32").status == "unsupported"
    assert all(r.gradient_error is None for r in report.results)  # no CPU backward in torch


def test_transformers_eager_averages_dead_rows_and_ignores_soft_cap_and_sinks():
    pytest.importorskip("transformers")
    report = check_attention(transformers_attention("eager"), dtypes=("float32", "float64"),
                             cases=_cases("plain", "causal, Lq < Lk", "fully masked rows", "soft-cap 2", "sinks",
                                          "default scale"))
    found = {(r.case, r.dtype): r.finding for r in report.results if r.status == "differs"}
    assert found == {
        ("plain", "float64"): "float64 inputs computed at float32 precision",
        ("causal, Lq < Lk", "float64"): "float64 inputs computed at float32 precision",
        ("fully masked rows", "float32"): "fully masked rows average every value (uniform weights)",
        ("fully masked rows", "float64"): "fully masked rows are NaN",
        ("soft-cap 2", "float32"): "soft-cap ignored", ("soft-cap 2", "float64"): "soft-cap ignored",
        ("sinks", "float32"): "sinks ignored", ("sinks", "float64"): "sinks ignored"}
    assert report.result("causal, Lq < Lk", "float32").status == "pass"  # the models' masks are bottom-right
    assert report.result("default scale", "float32").status == "unsupported"


def test_transformers_sdpa_refuses_soft_cap_and_ignores_sinks():
    pytest.importorskip("transformers")
    report = check_attention(transformers_attention("sdpa"), dtypes=("float32",),
                             cases=_cases("causal, Lq < Lk", "causal + left padding (dead rows)", "soft-cap 2",
                                          "sinks"))
    assert [r.status for r in report.results] == ["pass", "pass", "error", "differs"]
    assert "does not support `softcap`" in report.result("soft-cap 2", "float32").detail
    assert report.result("sinks", "float32").finding == "sinks ignored"


def _without_numbers(table: str) -> str:
    """A report table with its errors removed: the marks, statuses and findings stay."""
    return re.sub(r"([✓✗]) [0-9.e+-]+(?: / [0-9.e+-]+)?", r"\1", table)


def _published_table(page: str, heading: str) -> str:
    text = (DOCS / page).read_text(encoding="utf-8")
    section = text[text.index(f"## {heading}\n"):].split("\n\n")  # heading, table, prose, ...
    return section[1]


@pytest.mark.parametrize("page, heading, adapter", [
    ("torch-sdpa.md", "Backend: math", lambda: torch_sdpa("math")),
    ("transformers.md", "eager_attention_forward", lambda: transformers_attention("eager")),
    ("transformers.md", "sdpa_attention_forward", lambda: transformers_attention("sdpa")),
])
def test_the_published_conformance_tables_are_current(page, heading, adapter):
    """Every mark, status and finding of the checked-in page is what the suite finds now (make
    conformance-pages rewrites the pages when the suite or a referee changes)."""
    pytest.importorskip("transformers")
    published, table = _published_table(page, heading), check_attention(adapter()).table()
    assert published.startswith("| case |") and published.count("\n") == len(default_cases()) + 1
    assert _without_numbers(published) == _without_numbers(table)
