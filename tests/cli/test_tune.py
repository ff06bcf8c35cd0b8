"""``attnkit tune``: writes this machine's choices where the kernels read them, shows them, and answers bad
input with one line and exit 2 (before measuring anything)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attnkit.cli import main
from attnkit.kernels import calibration, tuning
from attnkit.kernels.tuning import Choices
from cli_helpers import SRC

PLANTED = Choices(tile_l2_forward=256 << 10, split_rows=512, single_blas_rows=2, num_threads=1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("ATTNKIT_TUNE", "1")
    tuning.forget_cached()
    yield tuning.cache_path()
    tuning.forget_cached()


@pytest.fixture
def fake_calibration(monkeypatch):
    """calibrate() without timing: the planted choices, and what it was asked."""
    asked = []

    def fake(measure=None, busy=None, repeats=3, usable=None, keep=None):
        asked.append({"repeats": repeats, "ignores_load": busy is not None and busy() is False, "keep": keep})
        return calibration.Calibration(PLANTED, {"num_threads": [[None, 0.2], [1, 0.1]]}, False, 0.01)

    monkeypatch.setattr(calibration, "calibrate", fake)
    return asked


def test_tune_writes_the_choices_the_kernels_then_use(cache, fake_calibration, capsys):
    assert main(["tune", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "num_threads: default 200.00 ms; 1 100.00 ms" in out and str(cache) in out
    assert fake_calibration == [{"repeats": 2, "ignores_load": False, "keep": tuning.DEFAULT_CHOICES}]
    assert json.loads(cache.read_text())["choices"]["split_rows"] == 512
    assert tuning.current_choices() == PLANTED  # read again after the write
    assert main(["tune", "--show"]) == 0
    shown = capsys.readouterr().out
    assert "split from 512 rows" in shown and f"tuned ({cache})" in shown


def test_ignore_load_takes_every_measurement(cache, fake_calibration):
    assert main(["tune", "--ignore-load"]) == 0
    assert fake_calibration == [{"repeats": 3, "ignores_load": True, "keep": tuning.DEFAULT_CHOICES}]


def test_a_second_tune_keeps_the_first_ones_choices_where_the_machine_is_busy(cache, fake_calibration):
    """calibrate() is given the cached choices to keep for what it measures beside a busy core."""
    assert main(["tune"]) == 0 and main(["tune"]) == 0
    assert [a["keep"] for a in fake_calibration] == [tuning.DEFAULT_CHOICES, PLANTED]


def test_tune_with_tuning_off_writes_and_says_it_is_not_used(cache, fake_calibration, capsys, monkeypatch):
    monkeypatch.setenv("ATTNKIT_TUNE", "0")
    assert main(["tune"]) == 0
    assert "ATTNKIT_TUNE=0 is set here" in capsys.readouterr().out and cache.is_file()


def _run(args, env):
    return subprocess.run([sys.executable, "-m", "attnkit", *args], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(SRC), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env})


@pytest.mark.parametrize("case", ["cache folder is a file", "bad ATTNKIT_TUNE", "repeats 0"])
def test_bad_input_is_one_line_and_exit_2(case, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    env, args = {"XDG_CACHE_HOME": str(tmp_path)}, ["tune"]
    if case == "cache folder is a file":
        env["XDG_CACHE_HOME"] = str(blocker)
    elif case == "bad ATTNKIT_TUNE":
        env["ATTNKIT_TUNE"] = "sometimes"
    else:
        args.append("--repeats=0")
    proc = _run(args, env)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert proc.stdout == ""  # nothing measured
    assert {"cache folder is a file": "cannot write the tuning file", "bad ATTNKIT_TUNE": "ATTNKIT_TUNE must be",
            "repeats 0": "--repeats"}[case] in proc.stderr
