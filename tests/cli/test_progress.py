"""Long waits show a progress line on a terminal's stderr, and nothing on a pipe or with ``--quiet``.

Each command runs in a real process whose stderr is a pseudo-terminal (:func:`cli_helpers.run_on_terminal`) or a
pipe (:func:`cli_helpers.run_attnkit`); stdout is a pipe in both, so the text never shares the terminal here.
"""
from __future__ import annotations

import pytest

from cli_helpers import run_attnkit, run_on_terminal

pytest.importorskip("transformers")


def test_generate_shows_the_loading_the_prefill_and_the_tokens_on_a_terminal(folder, tmp_path):
    code, out, shown = run_on_terminal(["generate", folder, "--ids", "1,2,3,4", "--max-new-tokens", 3], tmp_path)
    assert code == 0, shown
    assert "loading weights" in shown and "prefill (4 tokens)" in shown and "generating" in shown
    assert shown.endswith("\r")  # each line cleared itself: only the results stay on the screen
    assert out.strip()  # the text itself went to stdout


def test_beam_search_shows_its_steps(folder, tmp_path):
    code, out, shown = run_on_terminal(["generate", folder, "--ids", "1,2,3", "--max-new-tokens", 3,
                                        "--num-beams", 2], tmp_path)
    assert code == 0, shown
    assert "beam search" in shown and out.strip()


@pytest.mark.parametrize("command", [
    ["generate", "{folder}", "--ids", "1,2,3", "--max-new-tokens", "3"],
    ["generate", "{folder}", "--ids", "1,2,3", "--max-new-tokens", "3", "--num-beams", "2"],
])
def test_quiet_shows_nothing_on_the_terminal(folder, tmp_path, command):
    args = [str(folder) if a == "{folder}" else a for a in command]
    code, out, shown = run_on_terminal([*args, "--quiet"], tmp_path)
    assert code == 0, shown
    assert shown == "" and out.strip()


def test_a_pipe_gets_no_progress(folder, tmp_path):
    for extra in (["--json"], ["--num-beams", "2"]):
        proc = run_attnkit(["generate", folder, "--ids", "1,2,3", "--max-new-tokens", "3", *extra], tmp_path)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_chat_shows_its_loading_unless_quiet(folder, tmp_path):
    code, _, shown = run_on_terminal(["chat", folder, "--max-new-tokens", 2], tmp_path, stdin=b"/exit\n")
    assert code == 0, shown
    assert "loading weights" in shown
    code, _, shown = run_on_terminal(["chat", folder, "--max-new-tokens", 2, "--quiet"], tmp_path, stdin=b"/exit\n")
    assert code == 0 and shown == "", shown


def test_explain_shows_each_step_and_the_patching_as_its_detail(folder, tmp_path):
    page = tmp_path / "page.html"
    code, out, shown = run_on_terminal(["explain", folder, "--ids", "1,2,3", "--corrupt-ids", "1,5,3",
                                        "--html", page], tmp_path)
    assert code == 0, shown
    assert "loading weights" in shown and "explain: attributions" in shown
    assert "activation patching (z)" in shown  # the inner step, on the same line
    assert page.is_file() and "wrote" in out
    code, out, shown = run_on_terminal(["explain", folder, "--ids", "1,2,3", "--html", page, "--quiet"], tmp_path)
    assert code == 0 and shown == "", shown


def test_bench_shows_the_runs_of_each_case_unless_quiet(tmp_path):
    args = ["bench", "--sizes", "16", "--repeats", "2", "--threads", "1", "--heads", "1", "--dim", "8",
            "--out", tmp_path / "out"]
    code, out, shown = run_on_terminal(args, tmp_path)
    assert code == 0, shown
    assert "L = 16:" in shown and "L = 16" in out
    code, out, shown = run_on_terminal([*args, "--quiet"], tmp_path)
    assert code == 0 and shown == "", shown


def test_demo_draws_one_line_on_a_terminal_and_plain_lines_with_no_progress(tmp_path):
    pytest.importorskip("matplotlib")
    code, _, shown = run_on_terminal(["demo", "--steps", "20", "--out", tmp_path / "a"], tmp_path)
    assert code == 0, shown
    assert "training (sort)" in shown and "\n" not in shown.replace("\r\n", "")  # redrawn in place
    code, _, shown = run_on_terminal(["demo", "--steps", "20", "--out", tmp_path / "b", "--no-progress"], tmp_path)
    assert code == 0 and "training (sort): step 20/20" in shown, shown
