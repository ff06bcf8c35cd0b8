"""``attnkit chat`` driven through a pseudo-terminal: streamed replies equal the library's greedy reply, the
conversation grows turn by turn, /reset and /exit, --verbose reports, and bad input is one line with exit 2."""
from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from attnkit.cli.chat import terminal_safe
from cli_helpers import SRC, greedy_reply, run_attnkit

pytest.importorskip("transformers")
pytest.importorskip("jinja2")


def chat_in_pty(args, lines, timeout=120):
    """Run ``attnkit chat *args`` on a pseudo-terminal, typing each line once the prompt shows; returns
    (everything the terminal showed, stderr, exit code)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "attnkit", "chat", *map(str, args)], stdin=follower,
                            stdout=follower, stderr=subprocess.PIPE, env=env, close_fds=True)
    os.close(follower)
    shown = b""
    pending = list(lines)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
            if pending and shown.endswith(b"> "):
                os.write(leader, pending.pop(0).encode() + b"\n")
        elif proc.poll() is not None:
            break
    code = proc.wait(timeout=timeout)
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    os.close(leader)
    return shown.decode().replace("\r\n", "\n"), stderr, code


def test_chat_streams_replies_keeps_the_conversation_and_resets(folder):
    system = "You are a helpful assistant."
    first = greedy_reply(folder, [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}], 12)
    second = greedy_reply(folder, [{"role": "system", "content": system}, {"role": "user", "content": "Hello"},
                                   {"role": "assistant", "content": first},
                                   {"role": "user", "content": "how are you"}], 12)
    shown, stderr, code = chat_in_pty(["--system", system, "--max-new-tokens", 12, "--temperature", 0, "--verbose",
                                       folder], ["Hello", "how are you", "/reset", "Hello", "/exit"])
    assert code == 0, stderr
    first, second = terminal_safe(first), terminal_safe(second)  # random weights write control characters too
    assert f"> Hello\n{first}\n> how are you\n{second}\n> /reset\n(conversation reset)\n> Hello\n{first}\n> /exit" \
        in shown
    assert first != second  # the second turn saw the first: the conversation grows
    assert "loaded" in stderr and stderr.count(", generated 12 tokens at ") == 3  # one speed line per reply


def test_end_of_input_ends_the_chat(folder):
    proc = run_attnkit(["chat", folder, "--max-new-tokens", "3"], cwd=folder)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""


@pytest.mark.parametrize("args, match", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "2"], "argument --top-p: must be a number in [0, 1], got 2"),
    (["--num-beams", "2"], "--num-beams: beam search settles its tokens only at the end"),
    (["--chat-template", "missing.jinja"], "--chat-template 'missing.jinja' is not a file"),
])
def test_bad_options_are_one_line_and_exit_2(folder, args, match):
    proc = run_attnkit(["chat", folder, *args], cwd=folder)
    err = proc.stderr
    assert proc.returncode == 2 and match in err and len(err.strip().splitlines()) == 1


def test_a_folder_without_a_chat_template_is_exit_2(folder, tmp_path):
    import shutil

    copy = shutil.copytree(folder, tmp_path / "copy")
    (copy / "chat_template.jinja").unlink()
    proc = run_attnkit(["chat", copy], cwd=tmp_path)
    err = proc.stderr
    assert proc.returncode == 2 and "no chat template" in err and "Traceback" not in err
    proc = run_attnkit(["chat", tmp_path / "missing"], cwd=tmp_path)
    assert proc.returncode == 2 and "is not a folder" in proc.stderr
