"""The ``attnkit`` command line: demo, attention, bench; --help everywhere; bad command lines exit 2 in one line."""
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="the demo draws with the viz extra: pip install 'attnkit[viz]'")
import matplotlib.image  # noqa: E402

from attnkit import bench, demo  # noqa: E402
from attnkit.cli import main  # noqa: E402
from attnkit.models import TokenTagger  # noqa: E402
from attnkit.viz import attention_figsize  # noqa: E402

DPI = 100  # the CLI writes its pictures at 100 dpi: figsize * 100 pixels
SRC = Path(__file__).resolve().parents[2] / "src"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def assert_image(path: Path, size_inches: tuple[float, float]) -> None:
    assert path.is_file(), f"{path} was not written"
    expected = (round(size_inches[0] * DPI), round(size_inches[1] * DPI))
    assert png_size(path) == expected
    pixels = matplotlib.image.imread(path)  # decodes the whole file: a truncated PNG fails here
    assert pixels.shape[:2] == (expected[1], expected[0])
    assert pixels.std() > 0.05, f"{path} is blank"


@pytest.fixture(scope="module")
def small_demo(tmp_path_factory):
    """A 30-step demo run through main() (not accurate, but every file is written)."""
    out = tmp_path_factory.mktemp("demo") / "nested" / "out"
    code = main(["demo", "--steps", "30", "--seed", "1", "--out", str(out), "--no-progress"])
    assert code == 0
    return out


def test_demo_writes_pictures_and_a_loadable_model(small_demo):
    assert_image(small_demo / "attention.png", attention_figsize(2, 4, 10, 10))
    assert_image(small_demo / "loss.png", (10.0, 3.6))
    meta = json.loads((small_demo / "model.json").read_text())
    assert meta["task"] == "sort" and meta["seq_len"] == 10 and meta["training"]["steps"] == 30
    model = TokenTagger(**meta["model"])  # rebuilt from the JSON alone, then Module.load
    model.load(small_demo / "model.npz")
    loaded, _ = demo.load_model(small_demo)
    loaded_npz, _ = demo.load_model(small_demo / "model.npz")
    ids = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    np.testing.assert_allclose(loaded(ids), loaded_npz(ids))
    np.testing.assert_allclose(loaded(ids), model.astype(np.float32)(ids), rtol=1e-6, atol=1e-6)


def test_demo_prints_accuracy_and_what_it_wrote(tmp_path, capsys):
    assert main(["demo", "--steps", "3", "--task", "reverse", "--seq-len", "6", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "held-out accuracy:" in out and "example: input" in out
    for name in ("attention.png", "loss.png", "model.npz", "model.json"):
        assert f"{tmp_path / name}" in out
    assert "training (reverse)" in err  # the progress bar (or its plain fallback) goes to stderr
    assert_image(tmp_path / "attention.png", attention_figsize(2, 4, 6, 6))


def test_demo_without_tqdm_prints_plain_progress(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert main(["demo", "--steps", "10", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "tqdm is not installed" in err
    assert "step 10/10" in err and "accuracy" in err


def test_demo_without_matplotlib_stops_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["demo", "--steps", "5", "--out", str(tmp_path / "out")]) == 1
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "pip install 'attnkit[viz]'" in err
    assert "held-out" not in out and not (tmp_path / "out").exists()


def test_python_dash_m_attnkit_runs_the_demo(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "attnkit", "demo", "--steps", "5", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "held-out accuracy" in proc.stdout
    for name in ("attention.png", "loss.png", "model.npz", "model.json"):
        assert (tmp_path / name).is_file()
    assert_image(tmp_path / "loss.png", (10.0, 3.6))


def test_attention_command_draws_a_saved_model(small_demo, tmp_path, capsys):
    target = tmp_path / "all.png"
    assert main(["attention", "--model", str(small_demo), "--input", "3 1 4 1 5 9 2 6 5 3", "-o", str(target)]) == 0
    assert_image(target, attention_figsize(2, 4, 10, 10))
    out = capsys.readouterr().out
    assert "input  3 1 4 1 5 9 2 6 5 3" in out and f"wrote {target}" in out
    one = tmp_path / "one.png"
    assert main(["attention", "--model", str(small_demo / "model.npz"), "31415", "--layer", "1", "--head", "2",
                 "-o", str(one)]) == 0
    assert_image(one, attention_figsize(1, 1, 5, 5))


@pytest.mark.slow
def test_default_demo_reaches_95_percent(tmp_path, capsys):
    """The full default run (about 15-30 s on two cores)."""
    assert main(["demo", "--out", str(tmp_path), "--no-progress"]) == 0
    meta = json.loads((tmp_path / "model.json").read_text())
    assert meta["training"]["steps"] == demo.DemoConfig().steps
    assert meta["heldout_token_accuracy"] >= 0.95, meta
    assert "held-out accuracy: " in capsys.readouterr().out


@pytest.mark.skipif(not bench.benchmark_path().is_file(), reason="benchmarks/bench_attention.py is not there")
def test_bench_prints_the_table_and_writes_a_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    code = main(["bench", "--sizes", "32", "--repeats", "1", "--heads", "2", "--dim", "16", "--threads", "1",
                 "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "torch is not installed" in out
    assert "tiled" in out and "reference" in out and "L = 32" in out
    png = tmp_path / "attention-benchmark.png"
    assert png.is_file() and png_size(png)[0] > 100
    report = json.loads((tmp_path / "attention-benchmark.json").read_text())
    assert {r["impl"] for r in report["results"]} >= {"tiled", "reference", "naive"}


@pytest.mark.parametrize("command", [[], ["demo"], ["attention"], ["bench"], ["embed"]])
def test_every_command_has_help(command, capsys):
    assert main([*command, "--help"]) == 0
    assert "usage: attnkit" in capsys.readouterr().out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("attnkit ")


BAD_COMMAND_LINES = {
    "no command": ([], "choose a command"),
    "unknown command": (["train"], "invalid choice"),
    "unknown task": (["demo", "--task", "translate"], "invalid choice: 'translate'"),
    "negative steps": (["demo", "--steps", "-5"], "--steps: must be a positive integer, got -5"),
    "zero steps": (["demo", "--steps", "0"], "must be a positive integer"),
    "steps not a number": (["demo", "--steps", "many"], "must be a positive integer"),
    "negative seed": (["demo", "--seed", "-1"], "non-negative"),
    "negative lr": (["demo", "--lr", "-0.1"], "positive number"),
    "unknown option": (["demo", "--epochs", "3"], "unrecognized arguments"),
    "unwritable output folder": (["demo", "--out", "{file}/out"], "cannot write to the output folder"),
    "missing model folder": (["attention", "--model", "{tmp}/nowhere", "--input", "1 2"], "no such file"),
    "missing model file": (["attention", "--model", "{tmp}/nowhere.npz", "--input", "1 2"], "no such file"),
    "not a model": (["attention", "--model", "{file}", "--input", "1 2"], "no such file"),
    "no input": (["attention", "--model", "{model}"], "no input"),
    "unknown token": (["attention", "--model", "{model}", "--input", "1 x 2"], "unknown tokens ['x']"),
    "too long": (["attention", "--model", "{model}", "--input", "1 " * 11], "at most 10"),
    "layer out of range": (["attention", "--model", "{model}", "--input", "1 2", "--layer", "2"], "0..1"),
    "not an image file": (["attention", "--model", "{model}", "--input", "1 2", "-o", "{tmp}/a.txt"], ".png"),
    "unwritable image": (["attention", "--model", "{model}", "--input", "1 2", "-o", "{file}/a.png"], "cannot write"),
    "bench sizes": (["bench", "--sizes", "-64"], "positive integer"),
    "bench repeats": (["bench", "--repeats", "0"], "positive integer"),
}


@pytest.mark.parametrize("case", list(BAD_COMMAND_LINES))
def test_bad_command_lines_exit_2_with_one_line(case, small_demo, tmp_path, capsys):
    argv, message = BAD_COMMAND_LINES[case]
    file = tmp_path / "a-file.txt"
    file.write_text("not a folder")
    argv = [a.format(file=file, tmp=tmp_path, model=small_demo) for a in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert err.startswith("attnkit") and ": error: " in err
    assert message in err
    assert "Traceback" not in err + out


def test_bad_command_line_in_a_real_process_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "attnkit", "demo", "--steps", "-3"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == "attnkit demo: error: argument --steps: must be a positive integer, got -3\n"
    proc = subprocess.run([sys.executable, "-m", "attnkit", "attention", "--input", "1 2"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)  # no attnkit-demo folder here
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "train one with 'attnkit demo'" in proc.stderr


def test_bench_outside_a_source_checkout_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "benchmark_path", lambda: tmp_path / "benchmarks" / "bench_attention.py")
    monkeypatch.delitem(sys.modules, bench._MODULE_NAME, raising=False)
    assert main(["bench", "--sizes", "32", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "source checkout" in err and "Traceback" not in err
