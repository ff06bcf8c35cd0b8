"""The attribution-patching benchmark (edge attribution too) times both sides on a one-layer model and refuses
bad arguments."""
import numpy as np
import pytest

from attnkit.benchmarks import patching


def test_run_times_attnkit_and_torch(capsys):
    rows = patching.run(patching.parse_args(["--lengths", "4", "--layers", "1", "--repeats", "1", "--threads", "1"]))
    ours = rows[0]["attnkit"]
    assert rows[0]["length"] == 4 and min(ours.values()) > 0 and set(ours) == {"base", "resid_pre", "z", "eap"}
    out = capsys.readouterr().out
    assert out.startswith("# machine: ") and "target: attribution patching at most 3x" in out
    if rows[0]["torch"] is not None:
        assert min(rows[0]["torch"].values()) > 0


def test_both_sides_run_in_float32():
    assert patching._attnkit_model(1).dtype == np.float32  # transformers' side is float32


def test_command_line_refuses_a_length_of_one(capsys):
    with pytest.raises(SystemExit) as exc:
        patching.parse_args(["--lengths", "1"])
    assert exc.value.code == 2 and "--lengths must be at least 2" in capsys.readouterr().err
