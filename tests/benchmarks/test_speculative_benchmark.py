"""The speculative-decoding benchmark beside llama.cpp's plain decoding: the llama-bench command of a round, its
figures in every kind of prompt's table, and the options refused before anything loads. A fake ``llama-bench``
stands in for the binary; no figure here is a timing claim."""
import json
from argparse import Namespace

import numpy as np
import pytest

from attnkit.benchmarks import speculative
from attnkit.models import CausalLM, DecoderConfig, MLPConfig
from bench_helpers import fake_llama_bench, llama_bench_runs

DECODE_JSON = [{"build_commit": "abc1234", "cpu_info": "Test CPU", "model_type": "llama ?B all F32", "n_prompt": 0,
                "n_gen": 12, "avg_ts": 97.25, "stddev_ts": 1.0}]


@pytest.fixture
def lm():
    return CausalLM(DecoderConfig(family="llama", vocab_size=20, hidden_size=16, num_layers=4, num_heads=2,
                                  num_kv_heads=1, head_dim=8, mlp=MLPConfig(24)), rng=0)


def _args(tmp_path, binary, **changes):
    gguf = tmp_path / "smol-f32.gguf"
    gguf.write_bytes(b"GGUF")
    options = dict(model="folder", new=12, rounds=2, lookup=4, early_exit=None, threads=2,
                   llama_bench=str(binary), llama_gguf=str(gguf))
    return Namespace(**{**options, **changes})


def test_llama_cpp_decodes_in_every_round_beside_the_methods(lm, tmp_path):
    binary = fake_llama_bench(tmp_path, "build: abc1234\n" + json.dumps(DECODE_JSON))
    args = _args(tmp_path, binary)
    command = speculative.llama_command(args)
    ids = np.array([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    rows = speculative._measure(lm, ids, speculative._methods(lm, args, draft=None), args, command)
    runs = llama_bench_runs(tmp_path)
    # one plain decoding of --new tokens per round, no prompt test, on the F32 file
    assert runs == [["-m", args.llama_gguf, "-t", "2", "-p", "0", "-n", "12", "-r", "1", "-o", "json"]] * 2
    llama = rows[speculative.LLAMA]
    assert llama["tokens_per_s"] == 97.25
    assert llama["speedup"] == pytest.approx(97.25 / rows["plain"]["tokens_per_s"])
    table = speculative.lines("edit", rows)
    assert len(table) == 4 and table[-1].startswith("edit      llama.cpp plain (llama-bench)")
    for line, (name, row) in zip(table[:3], list(rows.items())[:3]):
        assert name in line and f"{row['tokens_per_s'] / 97.25:5.2f}x llama.cpp" in line
        assert "tokens equal plain: 100%" in line


def test_a_failing_llama_bench_is_one_line_and_the_methods_still_run(lm, tmp_path):
    binary = fake_llama_bench(tmp_path, "", status=3)
    args = _args(tmp_path, binary, rounds=1)
    ids = np.array([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    rows = speculative._measure(lm, ids, speculative._methods(lm, args, draft=None), args,
                                speculative.llama_command(args))
    assert rows[speculative.LLAMA] == {"error": "llama-bench exited with status 3: (no message)"}
    table = speculative.lines("chat", rows)
    assert table[-1].endswith("llama-bench exited with status 3: (no message)")
    assert "x llama.cpp" not in table[0] and rows["plain"]["tokens_per_s"] > 0


def test_llama_bench_needs_a_gguf_file_and_an_executable(tmp_path, capsys):
    binary = fake_llama_bench(tmp_path, "[]")
    folder = tmp_path / "model"
    folder.mkdir()
    for argv, message in (([str(folder), "--llama-bench", str(binary)], "--llama-bench runs a GGUF file"),
                          ([str(folder), "--llama-bench", str(tmp_path / "none")],
                           "--llama-bench must be an executable llama-bench binary"),
                          ([str(folder), "--llama-gguf", str(binary)], "give --llama-bench too")):
        with pytest.raises(SystemExit) as stop:
            speculative.parse_args(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    args = speculative.parse_args([str(gguf), "--llama-bench", str(binary), "--new", "40", "--threads", "1"])
    assert speculative.llama_command(args) == [str(binary), "-m", str(gguf), "-t", "1", "-p", "0", "-n", "40", "-r",
                                               "1", "-o", "json"]
    assert speculative.llama_command(speculative.parse_args([str(gguf)])) is None
