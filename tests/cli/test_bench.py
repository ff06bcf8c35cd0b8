"""``attnkit bench``: runs from the package (no source tree needed), says where it ran, works without torch."""
import json
import sys
from pathlib import Path

import pytest

from attnkit.cli import main
from cli_helpers import png_size


def test_bench_prints_the_machine_the_table_and_writes_results(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    code = main(["bench", "--sizes", "32", "--repeats", "1", "--heads", "2", "--dim", "16", "--threads", "1",
                 "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("# torch is not installed") == 1 and "Traceback" not in out
    for line in ("# machine: ", "# caches: ", "# BLAS: ", "# threads: "):
        assert line in out
    assert "tiled" in out and "reference" in out and "L = 32" in out
    report = json.loads((tmp_path / "attention-benchmark.json").read_text())
    assert {r["impl"] for r in report["results"]} >= {"tiled", "reference", "naive"}
    assert report["machine"]["cores"] >= 1 and "caches" in report["machine"]
    assert next(r for r in report["results"] if r["impl"] == "torch")["note"] == "skipped: torch is not installed"
    png = tmp_path / "attention-benchmark.png"
    has_matplotlib = __import__("importlib.util").util.find_spec("matplotlib") is not None
    assert png.is_file() == has_matplotlib and (not has_matplotlib or png_size(png)[0] > 100)


def test_bench_with_torch_reports_ratios(tmp_path, capsys):
    pytest.importorskip("torch")
    assert main(["bench", "--sizes", "16", "--repeats", "1", "--heads", "1", "--dim", "8", "--threads", "1",
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "attention-benchmark.json").read_text())
    tiled = [r for r in report["results"] if r["impl"] == "tiled"]
    assert len(tiled) == 4 and all(r["vs_torch"] > 0 for r in tiled)  # fwd/fwdbwd x causal/not
    assert "torch is not installed" not in capsys.readouterr().out


def test_bench_does_not_read_the_source_tree():
    """The benchmark is a module of the package: nothing is loaded from a path outside it."""
    import attnkit.benchmarks.attention as bench_module
    import attnkit.cli.bench as command

    source = "".join(Path(m.__file__).read_text(encoding="utf-8") for m in (command, bench_module))
    assert "spec_from_file_location" not in source and "parents[" not in source


def test_bench_decode_times_the_chosen_families_and_writes_their_figures(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from attnkit.benchmarks import decode

    tiny = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=40, max_position_embeddings=64)
    monkeypatch.setattr(decode, "FAMILIES", {"llama": ("LlamaConfig", tiny),
                                             "gpt_oss": ("GptOssConfig", dict(tiny, head_dim=8, num_local_experts=3,
                                                                              num_experts_per_tok=2,
                                                                              sliding_window=4))})
    monkeypatch.setattr(decode, "gemv_bandwidth", lambda **_: 1e10)
    assert main(["bench", "decode", "--families", "llama", "gpt_oss", "--new", "3", "--batches", "1", "2",
                 "--prefill", "8", "--repeats", "1", "--threads", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| family | decode b1 speed | decode b2 speed | prefill time | batch-1 GEMV fraction |" in out
    assert "| gpt_oss |" in out and "greedy tokens equal: 100%" in out
    figures = json.loads((tmp_path / "decode-benchmark.json").read_text())
    assert set(figures) == {"llama", "gpt_oss"}
    assert all(figures[f]["decode_b2_attnkit"] > 0 and figures[f]["prefill_hf_s"] > 0 for f in figures)


def test_bench_window_times_the_window_against_causal_attention(tmp_path, capsys):
    assert main(["bench", "window", "--length", "64", "--window", "8", "--heads", "1", "--dim", "8",
                 "--repeats", "1", "--threads", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "W=8" in out and "attnkit fwdbwd" in out and out.startswith("# machine: ")
    figures = json.loads((tmp_path / "window-benchmark.json").read_text())
    assert figures["attnkit_fwd_window_ms"] > 0 and figures["attnkit_fwdbwd_causal_ms"] > 0
    if "torch_fwd_window_ms" in figures:  # torch is a test dependency, but the benchmark runs without it
        assert "torch sdpa fwd" in out
