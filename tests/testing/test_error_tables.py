"""The published error tables hold: one family model of each type recomputed (attnkit against transformers in
float32 and with bfloat16 weights, attnkit float32 against float64) stays within the bounds recorded in
error_bounds.json (written with docs/conformance/error-tables.md by docs/tools/error_tables.py), and a number
that moves is caught."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.testing import error_tables  # noqa: E402
from attnkit.testing.error_tables import COMPARISONS, QUANTITIES, measure_model  # noqa: E402
from hf_models import FAMILY_MODELS, saved_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BOUNDS = json.loads((Path(__file__).with_name("error_bounds.json")).read_text(encoding="utf-8"))
PAGE = (ROOT / "docs" / "conformance" / "error-tables.md").read_text(encoding="utf-8")
# One model of each model_type (the variants of a type share its code paths).
SUBSET = ("gpt2", "llama_gqa", "mistral_window", "qwen3_window", "olmo2", "smollm3", "gpt_neox", "gemma2",
          "gemma3_text", "gemma4_text", "phi3_longrope", "gpt_oss", "qwen3_5_text", "qwen3_next", "qwen3_moe",
          "mixtral", "deepseek_v3")


def input_ids() -> np.ndarray:
    """The ids docs/tools/error_tables.py measured with (seeded, shape from the bounds file)."""
    return np.random.default_rng(0).integers(2, 95, size=tuple(BOUNDS["input_shape"]))


def exceeded(name: str, row: dict) -> list[str]:
    """The (comparison, quantity) numbers of ``row`` past their recorded bounds."""
    bounds = BOUNDS["families"][name]
    return [f"{name} {c} {q}: {row[c][q]:.2e} > {bounds[c][q]['bound']:.2e}" for c in COMPARISONS for q in QUANTITIES
            if not row[c][q] <= bounds[c][q]["bound"]]


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_error_tables")


def test_the_tables_cover_every_family_and_every_number_has_a_bound_with_margin():
    assert list(BOUNDS["families"]) == list(FAMILY_MODELS)
    for name, row in BOUNDS["families"].items():
        assert f"| {name} | " in PAGE
        for c in COMPARISONS:
            for q in QUANTITIES:
                entry = row[c][q]
                assert entry["bound"] >= BOUNDS["margin"] * entry["measured"] and entry["bound"] >= \
                    BOUNDS["floor"][c], (name, c, q)
    assert set(SUBSET) <= set(FAMILY_MODELS)


def test_float32_attnkit_and_transformers_agree_to_float32_rounding_in_the_published_table():
    """The recorded float32 numbers are float32 rounding (at most a few 1e-6 relative), for every family."""
    for name, row in BOUNDS["families"].items():
        for c in ("ak32_vs_hf32", "ak32_vs_ak64", "hf32_vs_ak64", "ak32_vs_hf32_bf16w"):
            assert max(row[c][q]["measured"] for q in QUANTITIES) < 5e-5, (name, c)


@pytest.mark.parametrize("name", SUBSET)
def test_recomputed_errors_stay_within_their_recorded_bounds(name, hf_root, tmp_path):
    folder, model = saved_model(name, hf_root)
    row = measure_model(folder, model, input_ids(), tmp_path)
    assert exceeded(name, row) == []
    # the bfloat16 run really is bfloat16: its error is bfloat16's, far above attnkit's float32 one
    assert row["hfbf16_vs_ak64"]["logits"] > 1e-3 > 1e-5 > row["ak32_vs_ak64_bf16w"]["logits"]


def test_a_number_that_moves_past_its_bound_is_caught(hf_root, tmp_path, monkeypatch):
    """attnkit's float32 logits off by one part in 10^4 (a wrong epsilon's size) fail every comparison of them."""
    real = error_tables._attnkit_run

    def nudged(folder, dtype, ids):
        run = real(folder, dtype, ids)
        if dtype == np.float32:
            run["logits"] = run["logits"] * (1 + 1e-4)
        return run
    monkeypatch.setattr(error_tables, "_attnkit_run", nudged)
    folder, model = saved_model("llama_gqa", hf_root)
    failed = exceeded("llama_gqa", measure_model(folder, model, input_ids(), tmp_path))
    assert [f.split(":")[0] for f in failed] == [
        "llama_gqa ak32_vs_hf32 logits", "llama_gqa ak32_vs_ak64 logits", "llama_gqa ak32_vs_ak64_bf16w logits",
        "llama_gqa ak32_vs_hf32_bf16w logits"]


def test_measure_model_refuses_a_sequence_of_one_token(hf_root, tmp_path):
    folder, model = saved_model("llama_gqa", hf_root)
    with pytest.raises(ValueError, match=r"input_ids must have shape \(B, L\) with L >= 2, got \(2, 1\)"):
        measure_model(folder, model, np.ones((2, 1), dtype=np.int64), tmp_path)
