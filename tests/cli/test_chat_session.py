"""``attnkit chat`` as a session: messages of several lines, the commands (/system, /reset, /save, /load, /help),
line editing and history on a terminal, the settings banner; and the pieces behind them, the message reader and
the conversation file, in-process."""
from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from attnkit.cli._chat_input import MessageReader, Typed
from attnkit.cli._conversation import MAX_CONVERSATION_BYTES, read_conversation, write_conversation
from attnkit.cli.chat import terminal_safe
from cli_helpers import Chat, greedy_reply, run_attnkit


# -- the message reader, in-process ----------------------------------------------------------------------
def read_all(text):
    said = []
    reader = MessageReader(io.StringIO(text), io.StringIO(), interactive=False, say=said.append)
    messages = []
    while (typed := reader.read()) is not None:
        messages.append(typed)
    return messages, said


def test_a_line_ending_in_a_backslash_continues_on_the_next():
    messages, said = read_all("first \\\nsecond\\\nthird\nalone\r\n")
    assert messages == [Typed("first \nsecond\nthird", lines=3), Typed("alone\r")] and said == []


def test_a_triple_quoted_block_is_one_message_and_never_a_command():
    text = '"""\n/not a command\n  indented \\\n\n"""\n"""one line"""\n"""opened here\nclosed here"""\n'
    messages, said = read_all(text)
    assert messages == [Typed("/not a command\n  indented \\\n", block=True, lines=5),
                        Typed("one line", block=True),
                        Typed("opened here\nclosed here", block=True, lines=2)]
    assert said == []


@pytest.mark.parametrize("text, where", [('"""\nnever closed\n', 'inside a """ block'),
                                         ("cut \\\n", "after a line ending in \\")])
def test_end_of_input_inside_a_message_drops_it_and_says_so(text, where):
    messages, said = read_all("sent\n" + text)
    assert messages == [Typed("sent")]
    assert said == [f"end of input {where}: that message was not sent"]


# -- the conversation file, in-process -------------------------------------------------------------------
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " caf\u00e9 \u2019\n"},
                {"role": "assistant", "content": ""}]


def test_a_saved_conversation_loads_as_it_was(tmp_path):
    path = write_conversation(tmp_path / "chat.json", CONVERSATION)
    assert read_conversation(path) == CONVERSATION
    assert json.loads(path.read_text(encoding="utf-8")) == CONVERSATION
    assert os.listdir(tmp_path) == ["chat.json"]  # no temporary file left beside it


@pytest.mark.parametrize("content, words", [
    (b'{"role": "user", "content": "hi"}', "must hold a JSON list of messages, got dict"),
    (b"null", "got null"),
    (b"[1]", "message 1 must be an object with role and content, got 1"),
    (b'[{"role": "user", "content": "a"}, {"role": "user"}]', "message 2 has no content"),
    (b'[{"content": "a"}]', "message 1 has no role"),
    (b'[{"role": 3, "content": "a"}]', "message 1's role must be a string, got 3"),
    (b'[{"role": "user", "content": ["a"]}]', "message 1's content must be a string, got ['a']"),
    (b'[{"role": "user", "content": null}]', "message 1's content must be a string, got None"),
    (b'[{"role": " ", "content": "a"}]', "message 1's role is empty"),
    (b'[{"role": "user", "content": "a", "name": "x"}]', "message 1 has the key 'name'"),
    (b'[{"role": "user", "content": "\\udcff"}]', "message 1's content is not UTF-8 text"),
    (b'[{"role": "user", "content": "caf\xe9"}]', "not UTF-8 text: byte 0xe9 at byte 34"),
    (b'[{"role": "user", "content": "a"}', "not JSON: Expecting ',' delimiter at line 1"),
    (b"", "not JSON: Expecting value at line 1, column 1"),
    (b"[" * 100_000 + b"]" * 100_000, "not JSON attnkit can read"),
    (b"[" + b"1" * 5000 + b"]", "not JSON attnkit can read"),
])
def test_a_bad_conversation_file_is_refused_naming_what_is_wrong(tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=None) as info:
        read_conversation(path)
    assert words in str(info.value)


def test_paths_that_are_not_regular_files_or_too_large_are_refused_without_reading(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, words in [(fifo, "not a regular file"), (tmp_path, "not a regular file"),
                        (tmp_path / "missing.json", "no such file")]:
        with pytest.raises(ValueError, match=words):
            read_conversation(path)
    large = tmp_path / "large.json"
    with open(large, "wb") as f:
        f.truncate(MAX_CONVERSATION_BYTES + 1)  # sparse: nothing is written, the size is what counts
    with pytest.raises(ValueError, match="larger than 64 MB"):
        read_conversation(large)


# -- the chat on a terminal ------------------------------------------------------------------------------
def session(args, home):
    chat = Chat(args, env={"HOME": str(home)})
    assert chat.read_until(lambda shown: shown.endswith(b"> ")), chat.shown
    return chat


def continue_with(chat, line: bytes) -> None:
    """Type a line that continues the message: wait for the continuation prompt first."""
    mark = len(chat.shown)
    chat.type(line)
    assert chat.read_until(lambda shown: shown[mark:].endswith(b"... ")), chat.shown


def test_system_save_reset_and_multi_line_messages(folder, tmp_path):
    saved = tmp_path / "out" / "chat.json"
    chat = session(["--max-new-tokens", 6, "--temperature", 0, folder], tmp_path)
    chat.say(b"/system")
    chat.say(b"/system Be brief.")
    chat.say(b"/system You are a helpful assistant.")
    chat.say(b"/system")
    continue_with(chat, b"Hello \\")
    chat.say(b"how are you")
    continue_with(chat, b'"""')
    continue_with(chat, b"/not a command")
    chat.say(b'"""')
    chat.say(b"/save " + str(saved).encode())
    first = json.loads(saved.read_text())
    chat.say(b"/reset")
    chat.say(b"/save '" + str(saved).encode() + b"'")  # quoted, as a path with spaces would be
    chat.type(b"/exit")
    shown, stderr, code = chat.finish()
    assert code == 0, stderr
    assert "(no system message; /system TEXT sets one)" in shown and "(system message set)" in shown
    assert "(system message replaced)" in shown and "(system message: You are a helpful assistant.)" in shown
    system = {"role": "system", "content": "You are a helpful assistant."}
    user = {"role": "user", "content": "Hello \nhow are you"}
    reply = greedy_reply(folder, [system, user], 6)
    second = {"role": "user", "content": "/not a command"}
    assert first[:3] == [system, user, {"role": "assistant", "content": reply}] and first[3] == second
    assert first[4]["role"] == "assistant" and len(first) == 5
    assert terminal_safe(reply) in shown
    assert json.loads(saved.read_text()) == [system]  # /reset keeps the system message
    assert f"(saved 5 messages to {saved})" in shown and f"(saved 1 message to {saved})" in shown
    assert "unknown command" not in shown and stderr == ""


def test_load_replaces_the_conversation_and_a_bad_file_changes_nothing(folder, tmp_path):
    good = tmp_path / "good.json"
    loaded = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}]
    good.write_text(json.dumps(loaded))
    bad = tmp_path / "bad.json"
    bad.write_text('[{"role": "user", "content": 5}]')
    saved = tmp_path / "after.json"
    chat = session(["--max-new-tokens", 5, "--temperature", 0, "--system", "Be brief.", folder], tmp_path)
    chat.say(b"/load " + str(good).encode())
    chat.say(b"/load " + str(bad).encode())
    chat.say(b"/load " + str(tmp_path / "missing.json").encode())
    chat.say(b"/load")
    chat.say(b"how are you")
    chat.say(b"/save " + str(saved).encode())
    chat.say(b"/save " + str(tmp_path / "chat.txt").encode())
    chat.type(b"/exit")
    shown, stderr, code = chat.finish()
    assert code == 0, stderr
    assert f"(loaded 2 messages from {good})" in shown
    assert (f"cannot load '{bad}': message 1's content must be a string, got 5; the conversation is unchanged"
            in stderr)
    assert f"cannot load '{tmp_path / 'missing.json'}': no such file; the conversation is unchanged" in stderr
    assert "/load needs a file: /load PATH" in stderr
    assert "/save's file must end in one of .json" in stderr and not (tmp_path / "chat.txt").exists()
    user = {"role": "user", "content": "how are you"}
    reply = greedy_reply(folder, [*loaded, user], 5)  # the loaded conversation replaced the --system one
    assert json.loads(saved.read_text()) == [*loaded, user, {"role": "assistant", "content": reply}]
    assert "Traceback" not in stderr and "internal error" not in stderr


def test_the_line_editor_recalls_earlier_lines_and_writes_no_history_file(folder, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    saved = tmp_path / "chat.json"
    chat = session(["--max-new-tokens", 3, "--temperature", 0, folder], home)
    chat.say(b"Hello")
    chat.say(b"\x1b[A")  # the up arrow: the line typed before, sent again
    chat.say(b"wrold\x1b[D\x1b[D\x1b[D\x7f\x1b[Cr")  # left three times, delete "w"'s neighbour, right, "r"
    chat.say(b"/sa\t" + str(saved).encode())  # Tab completes the command
    chat.type(b"/exit")
    shown, stderr, code = chat.finish()
    assert code == 0, stderr
    users = [m["content"] for m in json.loads(saved.read_text()) if m["role"] == "user"]
    assert users == ["Hello", "Hello", "world"]
    assert os.listdir(home) == []  # the history stayed in memory


def test_the_banner_shows_the_settings_once(folder, tmp_path):
    chat = session(["--max-new-tokens", 7, "--temperature", 0, folder], tmp_path)
    chat.say(b"/help")
    chat.type(b"/exit")
    shown, stderr, code = chat.finish()
    assert code == 0, stderr
    assert shown.count("context 128 tokens, replies up to 7 new tokens") == 1
    assert "greedy: the same conversation always gets the same reply, so a reply that repeats itself is the " \
           "model's own; to sample, try --temperature 0.7 --top-p 0.9" in shown
    assert "/save PATH" in shown and '""" opens a block' in shown  # /help
    chat = session(["--temperature", "0.7", "--top-k", "5", "--seed", "3", "--threads", "1",
                    "--no-repeat-ngram-size", "3", "--stop", "\n\n", folder], tmp_path)
    chat.type(b"/exit")
    shown, stderr, code = chat.finish()
    assert "1 thread; sampling: temperature 0.7, top-k 5, seed 3; no-repeat n-gram size 3; stops at '\\n\\n'" \
        in shown


def test_help_describes_typing_and_the_commands(tmp_path):
    proc = run_attnkit(["chat", "--help"], tmp_path)
    assert proc.returncode == 0
    for words in ("/system TEXT", "/save PATH", "/load PATH", "/reset", "/exit", "/help", "/set NAME VALUE", "/show",
                  "/stats", "settings: max_new_tokens, temperature, top_k",
                  "a line ending in \\ continues", '""" opens a block'):
        assert words in proc.stdout


@pytest.mark.concurrency
def test_ctrl_c_at_a_continuation_prompt_drops_the_unfinished_message(folder, tmp_path):
    import signal

    saved = tmp_path / "chat.json"
    chat = session(["--max-new-tokens", 3, "--temperature", 0, folder], tmp_path)
    continue_with(chat, b"never \\")
    count = chat.prompts()
    chat.proc.send_signal(signal.SIGINT)
    assert chat.read_until(lambda _: chat.prompts() > count), chat.shown
    chat.say(b"/save " + str(saved).encode())
    chat.type(b"/exit")
    shown, stderr, code = chat.finish()
    assert code == 0, stderr
    assert "(message dropped)" in shown and json.loads(saved.read_text()) == []


# -- /set, /show and /save's suffix, on a pipe -----------------------------------------------------------
def chat_lines(folder, args, lines, cwd):
    import subprocess
    import sys

    from cli_helpers import SRC

    proc = subprocess.run([sys.executable, "-m", "attnkit", "chat", str(folder), *map(str, args)],
                          input="".join(line + "\n" for line in lines).encode(), capture_output=True, timeout=300,
                          cwd=cwd, env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.decode(), proc.stderr.decode()


def test_set_changes_the_settings_and_the_next_reply_uses_them(folder, tmp_path):
    saved = tmp_path / "chat.json"
    out, err = chat_lines(folder, ["--temperature", "0.7", "--max-new-tokens", "20"], [
        "/set max_new_tokens 5", "/set temperature 0", "/set stop NEVER\\tSEEN", "/set system Be\\nbrief.",
        "/set repetition-penalty 1.5", "/show", "Hello", f"/save {saved}"], tmp_path)
    system, user = {"role": "system", "content": "Be\nbrief."}, {"role": "user", "content": "Hello"}
    from attnkit.pretrained import load

    model, tok = load(folder)
    ids = tok.apply_chat_template([system, user], add_generation_prompt=True, return_dict=False)
    new = model.generate(np.array([ids]), max_new_tokens=5, do_sample=False, repetition_penalty=1.5,
                         eos_token_id=list(tok.eos_token_ids))[0, len(ids):]
    reply = tok.decode(new, skip_special_tokens=True)
    assert json.loads(saved.read_text()) == [system, user, {"role": "assistant", "content": reply}]
    assert err == ""
    assert "(max_new_tokens set; context 128 tokens, replies up to 5 new tokens" in out
    for line in ("  max_new_tokens 5", "  temperature 0 (greedy)", "  repetition_penalty 1.5", "  stop 'NEVER\\tSEEN'",
                 "  system 'Be\\nbrief.'", "conversation: 1 message"):
        assert f"\n{line}\n" in out, line
    assert f"model {folder}: llama family, 2 layers, context 128 tokens, vocabulary" in out


def test_a_value_the_flag_would_refuse_is_a_message_and_changes_nothing(folder, tmp_path):
    refused = {"top_p 2": "argument --top-p: must be a number in [0, 1], got 2",
               "temperature -1": "argument --temperature: must be a finite number >= 0, got -1",
               "max_new_tokens 0": "argument --max-new-tokens: must be a positive integer, got 0",
               "stop \\q": "argument --stop: invalid escape \\q at character 1",
               "num_beams 2": "--num-beams cannot be combined with sampling options (--temperature)"}
    for setting, words in refused.items():  # the command line says the same of the flag
        flag, value = setting.split(" ")
        proc = run_attnkit(["chat", folder, f"--{flag.replace('_', '-')}", value, "--temperature", "0.7"], tmp_path)
        assert proc.returncode == 2 and words in proc.stderr, (setting, proc.stderr)
    out, err = chat_lines(folder, ["--max-new-tokens", "4"], [
        "/set temperature 0.7", *(f"/set {setting}" for setting in refused), "/set temperature", "/set colour red",
        "/set", "/system \\x", "/show"], tmp_path)
    said = err.splitlines()
    for (setting, words), line in zip(refused.items(), said):
        assert line.startswith(f"attnkit chat: /set {setting.split()[0]}: ") and words in line
        assert line.endswith("; the settings are as they were")
    assert said[len(refused):] == ["attnkit chat: /set temperature needs a value: /set temperature VALUE",
                                   "attnkit chat: /system: invalid escape \\x at character 1 (escapes: \\n \\r \\t "
                                   "\\\\ \\\" \\' \\uXXXX; \\\\ writes a backslash); the system message is as it was"]
    assert "(unknown setting 'colour'; /set NAME VALUE, NAME one of: max_new_tokens, temperature" in out
    for line in ("  temperature 0.7", "  top_p none", "  max_new_tokens 4", "  num_beams 1", "  stop none",
                 "  system none"):
        assert f"\n{line}\n" in out, line


def test_save_adds_json_to_a_name_without_a_suffix_and_load_finds_it(folder, tmp_path):
    out, err = chat_lines(folder, ["--max-new-tokens", "3", "--temperature", "0"], [
        "Hello", "/save chat", "/save other.json", "/save notes.txt", "/reset", "/load chat", "/save again"],
        tmp_path)
    assert "(saved 2 messages to chat.json)" in out and "(saved 2 messages to other.json)" in out
    assert "(loaded 2 messages from chat.json)" in out and "(saved 2 messages to again.json)" in out
    assert "/save's file must end in one of .json, got 'notes.txt'; nothing was saved" in err
    assert sorted(os.listdir(tmp_path)) == ["again.json", "chat.json", "other.json"]
    conversation = read_conversation(tmp_path / "chat.json")
    assert [m["role"] for m in conversation] == ["user", "assistant"]
    assert read_conversation(tmp_path / "other.json") == read_conversation(tmp_path / "again.json") == conversation
