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


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "runtime"], "attnkit bench runtime needs a model: a Hugging Face folder or a GGUF file"),
    (["bench", "runtime", "missing.gguf"], "model must be a Hugging Face folder or a .gguf file, got 'missing.gguf'"),
    (["bench", "runtime", "{folder}", "--new", "1"], "--new must be at least 2 for runtime"),
    (["bench", "runtime", "{folder}", "--llama-bench", "{python}"], "--llama-bench runs llama.cpp on a GGUF file"),
    (["bench", "runtime", "{gguf}", "--llama-bench", "missing-llama-bench"],
     "--llama-bench must be an executable llama-bench binary, got 'missing-llama-bench'"),
    (["bench", "decode", "{folder}"], "attnkit bench decode takes no model"),
    (["bench", "window", "--llama-bench", "{python}"], "--llama-bench belongs to attnkit bench runtime MODEL"),
])
def test_bench_runtime_arguments_that_cannot_run_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # refused before it is read
    names = {"folder": str(tmp_path), "gguf": str(gguf), "python": sys.executable}
    assert main([a.format(**names) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err
    assert "Traceback" not in captured.err


def test_bench_runtime_passes_its_options_and_writes_the_figures(tmp_path, monkeypatch, capsys):
    from attnkit.benchmarks import runtime

    seen, figures = {}, {"attnkit": {"prefill_tps": {"median": 1.0}}}

    def fake_run(options, lm=None):
        seen.update(vars(options))
        return figures

    monkeypatch.setattr(runtime, "run", fake_run)
    monkeypatch.setattr(runtime, "load_model", lambda options: None)  # the file is four bytes: never loaded here
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert main(["bench", "runtime", str(gguf), "--threads", "2", "--prefill", "64", "--new", "5", "--repeats", "4",
                 "--llama-bench", sys.executable, "--keep-quantized", "--out", str(tmp_path / "out")]) == 0
    assert seen == {"model": str(gguf), "threads": 2, "prefill": 64, "new": 5, "batches": [1], "repeats": 4,
                    "llama_bench": sys.executable, "keep_quantized": True}
    assert json.loads((tmp_path / "out" / "runtime-benchmark.json").read_text()) == figures
