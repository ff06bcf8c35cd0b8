"""The benchmark modules and their thin callers in ``benchmarks/``: every one prints where it ran, and the
torch comparisons say in one line when torch is missing instead of crashing."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
MODULES = ("attention", "encoder", "minilm", "decode", "window", "ddp", "patching", "linear_decode", "gguf_load",
           "busy_core", "tuning", "sparse_attention")


def _run(args, tmp_path, block_torch=False):
    prelude = "import sys; sys.modules['torch'] = None; " if block_torch else ""
    code = prelude + "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("name", ["encoder", "minilm"])
def test_torch_benchmarks_without_torch_say_so_in_one_line(name, tmp_path):
    proc = _run([ROOT / "benchmarks" / f"bench_{name}.py"], tmp_path, block_torch=True)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert sum("torch is not installed" in line for line in lines) == 1
    assert lines[0].startswith("# machine: ") and any(line.startswith("# BLAS: ") for line in lines)


def test_attention_script_without_torch_runs_and_skips_the_column(tmp_path):
    proc = _run([ROOT / "benchmarks" / "bench_attention.py", "--sizes", "16", "--repeats", "1", "--threads", "1",
                 "--heads", "1", "--dim", "8", "--no-memory", "--modes", "fwd", "--causal", "no"],
                tmp_path, block_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert "# torch is not installed" in proc.stdout and "skipped: torch is not installed" in proc.stdout
    assert "# caches: " in proc.stdout and "tiled" in proc.stdout


def test_encoder_benchmark_runs_a_tiny_model_against_torch(capsys):
    pytest.importorskip("torch")
    from attnkit.benchmarks import encoder

    report = encoder.run(encoder.parse_args(["--threads", "1", "--layers", "1", "--d-model", "16", "--heads", "2",
                                             "--d-ff", "32", "--seq", "8", "--batch", "2", "--repeats", "1",
                                             "--warmup", "0"]))
    row = report["results"][0]
    assert row["ratio"] > 0 and row["agreement"]["grad_max_rel_diff"] < 1e-2
    assert "# machine: " in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py")))
def test_scripts_are_thin_callers(name):
    source = (ROOT / "benchmarks" / f"{name}.py").read_text()
    tree = ast.parse(source)
    assert len(source.splitlines()) <= 8
    assert not any(isinstance(node, (ast.FunctionDef, ast.ClassDef)) for node in tree.body)


@pytest.mark.parametrize("name", MODULES)
def test_no_benchmark_function_is_over_60_lines(name):
    path = SRC / "attnkit" / "benchmarks" / f"{name}.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) else node.body
            lines = body[-1].end_lineno - body[0].lineno + 1
            assert lines <= 60, f"{name}.{node.name}: {lines} lines"


def test_ddp_benchmark_without_torch_says_so_in_one_line(tmp_path):
    proc = _run([ROOT / "benchmarks" / "bench_ddp.py"], tmp_path, block_torch=True)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert sum("torch is not installed" in line for line in lines) == 1 and lines[0].startswith("# machine: ")


def test_linear_decode_benchmark_times_both_layers_at_every_context(capsys):
    from attnkit.benchmarks import linear_decode

    figures = linear_decode.run(linear_decode.parse_args(["--contexts", "8", "32", "--steps", "2", "--hidden", "16",
                                                          "--heads", "2", "--head-dim", "8", "--no-torch"]))
    assert figures["contexts"] == [8, 32] and len(figures["attnkit_gdn_us"]) == 2
    assert all(t > 0 for t in figures["attnkit_gdn_us"] + figures["attnkit_attention_us"])
    out = capsys.readouterr().out
    assert out.startswith("# machine: ") and "transformers" not in out.split("\n", 6)[-1]


def test_the_speculative_benchmark_measures_every_method_against_plain_decoding():
    import argparse

    import numpy as np

    from attnkit.benchmarks import speculative
    from attnkit.models import CausalLM, DecoderConfig, MLPConfig

    lm = CausalLM(DecoderConfig(family="llama", vocab_size=20, hidden_size=16, num_layers=4, num_heads=2,
                                num_kv_heads=1, head_dim=8, mlp=MLPConfig(24)), rng=0)
    args = argparse.Namespace(new=12, rounds=2, lookup=4, early_exit=None)
    ids = np.array([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    rows = speculative._measure(lm, ids, speculative._methods(lm, args, draft=lm), args)
    assert list(rows) == ["plain", "prompt lookup (4)", "early exit (1 of 4 layers)", "draft model"]
    assert rows["plain"]["speedup"] == 1.0 and rows["plain"]["rounds"] == 0
    # the model drafting itself costs a whole step a token: no round of 12 tokens can pay, and none is sent
    assert rows["draft model"]["rounds"] == 0 and rows["draft model"]["acceptance"] == 0.0
    assert all(row["equal"] == 1.0 and row["tokens_per_s"] > 0 for row in rows.values())
    assert set(speculative.PROMPTS) == {"edit", "document", "chat"}


def test_sparse_attention_benchmark_times_both_engines_on_the_same_selection(capsys):
    pytest.importorskip("torch")
    from attnkit.benchmarks import sparse_attention

    figures = sparse_attention.run(sparse_attention.parse_args(
        ["--length", "64", "--top-k", "8", "--hidden", "32", "--heads", "2", "--index-heads", "2", "--index-dim",
         "16", "--threads", "1", "--repeats", "1"]))
    out = capsys.readouterr().out
    assert out.startswith("# machine: ") and "# BLAS: " in out and "torch sdpa fwd+bwd" in out
    assert all(figures[f"{engine}_{mode}_{kind}_ms"] > 0 for engine in ("attnkit_kernel", "attnkit_layer",
                                                                         "torch_sdpa")
               for mode in ("fwd", "fwdbwd") for kind in ("dense", "sparse"))
    assert figures["attnkit_layer_absorbed_fwd_sparse_ms"] > 0 and figures["attnkit_layer_decode_step_sparse_ms"] > 0
    assert 0.0 <= figures["skipped_causal_tiles"] <= 1.0
