"""``attnkit demo``: pictures, a loadable model, progress output, the task table, and a real process."""
import json
import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="the demo draws with the viz extra: pip install 'attnkit[viz]'")

from attnkit.cli import build_parser, main  # noqa: E402
from attnkit.cli import demo as demo_command  # noqa: E402
from attnkit.demos import encoder as demo  # noqa: E402
from attnkit.models import TokenTagger, TokenTaggerConfig  # noqa: E402
from attnkit.viz import attention_figsize  # noqa: E402
from cli_helpers import assert_image, assert_one_line_error, run_attnkit  # noqa: E402


def test_demo_writes_pictures_and_a_loadable_model(small_demo):
    assert_image(small_demo / "attention.png", attention_figsize(2, 4, 10, 10))
    assert_image(small_demo / "loss.png", (10.0, 3.6))
    meta = json.loads((small_demo / "model.json").read_text())
    assert meta["task"] == "sort" and meta["seq_len"] == 10 and meta["training"]["steps"] == 30
    model = TokenTagger(TokenTaggerConfig(**meta["model"]))  # rebuilt from the JSON alone, then Module.load
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


def test_demo_off_a_terminal_prints_plain_progress_lines(tmp_path, capsys):
    assert main(["demo", "--steps", "10", "--out", str(tmp_path)]) == 0  # capsys's stderr: not a terminal
    err = capsys.readouterr().err
    assert "step 10/10" in err and "accuracy" in err and "\r" not in err  # lines, not a redrawn bar


def test_demo_without_matplotlib_stops_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["demo", "--steps", "5", "--out", str(tmp_path / "out")]) == 1
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "pip install 'attnkit[viz]'" in err
    assert "held-out" not in out and not (tmp_path / "out").exists()


def test_python_dash_m_attnkit_runs_the_demo(tmp_path):
    proc = run_attnkit(["demo", "--steps", "5", "--out", str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "held-out accuracy" in proc.stdout
    for name in ("attention.png", "loss.png", "model.npz", "model.json"):
        assert (tmp_path / name).is_file()
    assert_image(tmp_path / "loss.png", (10.0, 3.6))


def test_task_choices_and_help_come_from_the_task_table(monkeypatch, tmp_path, capsys):
    calls = []

    def count_task(args, out):
        calls.append((args.task, out))
        print("counted")
        return 0

    tasks = dict(demo_command.DEMO_TASKS, count=demo_command.DemoTask("count the digits", count_task))
    monkeypatch.setattr(demo_command, "DEMO_TASKS", tasks)
    demo_parser = build_parser()._subparsers._group_actions[0].choices["demo"]
    assert "count: count the digits" in " ".join(demo_parser.format_help().split())
    assert main(["demo", "--task", "count", "--out", str(tmp_path)]) == 0
    assert calls == [("count", tmp_path)] and capsys.readouterr().out == "counted\n"


def test_every_synthetic_task_is_a_demo_task():
    from attnkit.demos import tasks

    assert set(tasks.TASKS) <= set(demo_command.DEMO_TASKS)


@pytest.mark.slow
def test_default_demo_reaches_95_percent(tmp_path, capsys):
    """The full default run (about 15-30 s on two cores)."""
    assert main(["demo", "--out", str(tmp_path), "--no-progress"]) == 0
    meta = json.loads((tmp_path / "model.json").read_text())
    assert meta["training"]["steps"] == demo.DemoConfig().steps
    assert meta["heldout_token_accuracy"] >= 0.95, meta
    assert "held-out accuracy: " in capsys.readouterr().out


@pytest.mark.parametrize("task", ["sort", "addition", "dates"])
def test_a_learning_rate_that_diverges_is_one_line_and_saves_nothing(task, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["demo", "--task", task, "--lr", "1e30", "--steps", "6", "--out", str(out), "--no-progress"]) == 2
    last = capsys.readouterr().err.splitlines(keepends=True)[-1]  # after the plain progress lines
    if task == "addition":  # its configuration bounds lr itself
        assert_one_line_error(last, "lr must be in (0, 1), got 1e+30 (from --steps, --lr)")
    else:
        assert_one_line_error(last, "training diverged at step", "with learning rate 1e+30", "(--lr)")
    assert not any(out.glob("model*")) and not any(out.glob("*.png"))
