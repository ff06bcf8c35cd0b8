"""The runtime benchmark on a tiny model: every engine's figures, the GEMV share, llama-bench's JSON read back.

Timings of a tiny model are noise; these tests check what the run reports and that it reads what it ran, never
how fast anything was.
"""
import json
import os
import sys
from argparse import Namespace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")
from attnkit.benchmarks import runtime  # noqa: E402
from bench_helpers import fake_llama_bench, llama_bench_runs  # noqa: E402
from gguf_models import write_gguf  # noqa: E402
from hf_models import saved_model  # noqa: E402

LLAMA_JSON = [
    {"build_commit": "abc1234", "cpu_info": "Test CPU", "model_type": "llama ?B all F32", "n_prompt": 8, "n_gen": 0,
     "avg_ts": 812.5, "stddev_ts": 3.0},
    {"build_commit": "abc1234", "cpu_info": "Test CPU", "model_type": "llama ?B all F32", "n_prompt": 0, "n_gen": 3,
     "avg_ts": 97.25, "stddev_ts": 1.0},
]


def _options(model, **changes) -> Namespace:
    options = dict(model=str(model), threads=1, prefill=8, new=3, batches=[1, 2], repeats=2, llama_bench=None)
    return Namespace(**{**options, **changes})


@pytest.fixture
def tiny_gguf(tmp_path):
    _, hf = saved_model("llama_mqa", tmp_path)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, path)
    return path


def test_a_folder_reports_both_engines_the_gemv_share_and_equal_greedy_tokens(tmp_path, monkeypatch, capsys):
    folder, _ = saved_model("llama_gqa", tmp_path)
    monkeypatch.setattr(runtime, "gemv_bandwidth", lambda **_: 1e10)
    figures = runtime.run(_options(folder))
    for engine in ("attnkit", "transformers"):
        assert set(figures[engine]) == {"prefill_tps", "decode_b1_tps", "decode_b2_tps"}
        for spread in figures[engine].values():
            assert 0 < spread["min"] <= spread["median"] <= spread["max"]
    assert figures["greedy_equal"] == {"b1": 1.0, "b2": 1.0}
    share = figures["gemv"]
    assert share["gemv_GBps"] == 10.0 and share["fraction"] == pytest.approx(share["decode_GBps"] / 10.0)
    assert "llama.cpp" not in figures
    out = capsys.readouterr().out
    assert out.startswith("# machine: ") and "| attnkit | " in out and "| transformers | " in out
    assert "attnkit / transformers: prefill time " in out and "of the GEMV bandwidth sustained beside it" in out


def test_a_gguf_file_runs_transformers_and_llama_cpp_on_the_same_file(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runtime, "gemv_bandwidth", lambda **_: 1e10)
    binary = fake_llama_bench(tmp_path, json.dumps(LLAMA_JSON))
    figures = runtime.run(_options(tiny_gguf, batches=[1], llama_bench=str(binary)))
    assert figures["greedy_equal"] == {"b1": 1.0}  # transformers read the same dequantized weights
    llama = figures["llama.cpp"]
    assert llama["prefill_tps"]["median"] == 812.5 and llama["decode_b1_tps"]["median"] == 97.25
    assert llama["build"] == "abc1234" and llama["cpu"] == "Test CPU"
    argv = llama_bench_runs(tmp_path)[-1]
    assert argv == ["-m", str(tiny_gguf), "-t", "1", "-p", "8", "-n", "3", "-r", "1", "-o", "json"]
    out = capsys.readouterr().out
    assert "| llama.cpp | 812.5 (812.5-812.5) | 97.2 (97.2-97.2) |" in out
    assert "attnkit / llama.cpp: prefill time " in out and "# llama.cpp build abc1234, CPU Test CPU" in out
    rounds = [line for line in out.splitlines() if line.startswith("#   tokens/s (prefill/decode per batch): ")]
    assert len(rounds) == 2 and all("llama.cpp 812.5/97.2, GEMV 10.0 GB/s" in line for line in rounds)


def test_a_failing_llama_bench_is_one_line_and_the_run_goes_on(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runtime, "gemv_bandwidth", lambda **_: 1e10)
    binary = fake_llama_bench(tmp_path, "", status=3)
    figures = runtime.run(_options(tiny_gguf, batches=[1], repeats=1, llama_bench=str(binary)))
    assert figures["llama.cpp"] == {"error": "llama-bench exited with status 3: (no message)"}
    assert figures["attnkit"]["decode_b1_tps"]["median"] > 0
    assert "# llama.cpp: llama-bench exited with status 3" in capsys.readouterr().out


def test_without_torch_attnkit_runs_alone(tmp_path, monkeypatch, capsys):
    folder, _ = saved_model("llama_gqa", tmp_path)
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(runtime, "gemv_bandwidth", lambda **_: 1e10)
    figures = runtime.run(_options(folder, batches=[1], repeats=1))
    assert "transformers" not in figures and figures["greedy_equal"] == {}
    assert "# torch is not installed: no comparison with transformers" in capsys.readouterr().out


def test_llama_bench_json_is_read_with_the_text_before_it():
    text = "main: some log line\n" + json.dumps(LLAMA_JSON)
    assert runtime.parse_llama_bench(text) == {"prefill_tps": 812.5, "decode_tps": 97.25, "build": "abc1234",
                                               "cpu": "Test CPU", "type": "llama ?B all F32"}
    with pytest.raises(ValueError, match="no JSON result"):
        runtime.parse_llama_bench("error: failed to load model")
    with pytest.raises(ValueError, match="no prompt or generation result"):
        runtime.parse_llama_bench("[]")


@pytest.mark.parametrize(("changes", "message"), [
    (dict(new=1), "--new must be at least 2, got 1"),
    (dict(repeats=0), "--repeats must be at least 1, got 0"),
    (dict(batches=[0]), "--batches must be positive batch sizes, got [0]"),
    (dict(model="missing.gguf"), "got 'missing.gguf' (no such file)"),
])
def test_options_that_cannot_run_are_refused_before_loading(tmp_path, changes, message):
    folder, _ = saved_model("llama_gqa", tmp_path)
    with pytest.raises(ValueError) as info:
        runtime.check_args(_options(changes.pop("model", folder), **changes))
    assert message in str(info.value)


def test_llama_bench_needs_a_gguf_file_and_an_executable(tmp_path, tiny_gguf):
    folder, _ = saved_model("llama_mqa", tmp_path)
    with pytest.raises(ValueError, match="runs llama.cpp on a GGUF file, but the model is a folder"):
        runtime.check_args(_options(folder, llama_bench=sys.executable))
    not_executable = tmp_path / "llama-bench.txt"
    not_executable.write_text("")
    with pytest.raises(ValueError, match="must be an executable llama-bench binary"):
        runtime.check_args(_options(tiny_gguf, llama_bench=str(not_executable)))
    assert os.access(sys.executable, os.X_OK)
    runtime.check_args(_options(tiny_gguf, llama_bench=sys.executable))  # accepted: an executable file


@pytest.mark.parametrize("cut", ["header", "tensors"])
def test_cli_runtime_on_a_corrupt_gguf_file_is_one_line_and_exit_2(tiny_gguf, tmp_path, capsys, cut):
    from attnkit.cli import main

    data = tiny_gguf.read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[:3000] if cut == "header" else data[:-100])
    assert main(["bench", "runtime", str(broken), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "broken.gguf is truncated" in err and "internal error" not in err
    assert runtime.main([str(broken)]) == 2


@pytest.mark.parametrize("options, message", [
    (["--prefill", "65"], "--prefill 65 is longer than the 64 positions"),
    (["--prefill", "8", "--new", "49"], "--new 49 after the 16-token prompt is longer than the 64 positions"),
])
def test_cli_runtime_past_the_models_positions_is_one_line_and_exit_2(tmp_path, capsys, options, message):
    from attnkit.cli import main

    folder, _ = saved_model("gpt2", tmp_path)  # 64 learned positions
    capsys.readouterr()  # transformers' progress bar while saving
    assert main(["bench", "runtime", str(folder), *options, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "internal error" not in err


def test_main_answers_bad_options_with_exit_2(capsys):
    assert runtime.main(["missing-folder"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_summary_ratios_are_time_for_prefill_and_speed_for_decoding():
    spread = lambda v: {"median": v, "min": v, "max": v}  # noqa: E731
    figures = {"prefill": 8, "batches": [1], "weights_MiB": 1.0, "gemv": None, "greedy_equal": {},
               "attnkit": {"prefill_tps": spread(100.0), "decode_b1_tps": spread(30.0)},
               "transformers": {"prefill_tps": spread(50.0), "decode_b1_tps": spread(10.0)}}
    lines = runtime.summary(figures)
    assert lines[2] == "| attnkit | 100.0 (100.0-100.0) | 30.0 (30.0-30.0) |"
    assert lines[-1] == "attnkit / transformers: prefill time 0.50x, decode batch 1 speed 3.00x"
