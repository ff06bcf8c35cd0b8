r"""Text flags take backslash escapes as llama.cpp's do: ``--stop``, ``--system`` and ``--prompt`` read ``\n``,
``\r``, ``\t``, ``\\``, ``\"``, ``\'`` and ``\uXXXX`` (one helper, ``cli._common.unescape``), so ``--stop "\n\n"``
as the docs write it stops at a blank line; any other escape is a one-line error naming the flag."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from attnkit.cli._common import unescape
from attnkit.cli._generation import add_generation_arguments, generation_kwargs
from cli_helpers import assert_one_line_error, run_attnkit


@pytest.mark.parametrize("typed, meant", [
    (r"\n\n", "\n\n"), (r"a\tb\r\n", "a\tb\r\n"), (r"\\n", "\\n"), (r"say \"hi\" it\'s", "say \"hi\" it's"),
    (r"caf\u00e9 \u00E9", "caf\u00e9 \u00e9"), (r"\ud83d\ude00", "\U0001f600"),
    ("no escapes: \u00e9\n", "no escapes: \u00e9\n"), ("", ""),
])
def test_the_escapes_of_llama_cpp_and_unicode(typed, meant):
    assert unescape(typed) == meant


@pytest.mark.parametrize("typed, words", [
    (r"C:\dir", r"invalid escape \d at character 3"), ("end\\", "a backslash ends the text at character 4"),
    (r"\u12", r"\u needs four hexadecimal digits, got '12'"), (r"\uzzzz", "got 'zzzz'"),
    (r"\ud800", r"\ud800 is a lone surrogate"), (r"x\udc00", r"\udc00 is a lone surrogate, not a character, at "
                                                             r"character 2"),
    (r"\x41", r"invalid escape \x"),
])
def test_any_other_escape_is_an_error_that_says_where(typed, words):
    with pytest.raises(ValueError, match=None) as info:
        unescape(typed)
    assert words in str(info.value) and r"\\ writes a backslash" in str(info.value)


def test_stop_as_the_docs_write_it_is_a_blank_line():
    parser = argparse.ArgumentParser()
    add_generation_arguments(parser)
    args = parser.parse_args(["--stop", r"\n\n", "--stop", r"\u00e9"])
    assert generation_kwargs(args, "attnkit") == {"stop_strings": ["\n\n", "\u00e9"]}


@pytest.mark.parametrize("command, flag", [("generate", "--stop"), ("generate", "--system"),
                                           ("generate", "--prompt"), ("chat", "--stop"), ("chat", "--system")])
def test_an_invalid_escape_is_one_line_naming_the_flag(chat_folder, tmp_path, command, flag):
    args = [command, chat_folder, flag, r"C:\dir"]
    if command == "generate" and flag != "--prompt":
        args += ["--prompt", "Hello"]
    proc = run_attnkit(args, tmp_path)
    assert proc.returncode == 2
    assert_one_line_error(proc.stderr, f"argument {flag}: invalid escape \\d at character 3")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_says_which_flags_take_escapes(tmp_path, command):
    proc = run_attnkit([command, "--help"], tmp_path)
    text = " ".join(proc.stdout.split())
    flags = ("--stop", "--system", "--prompt") if command == "generate" else ("--stop", "--system")
    for flag in flags:
        after = text.rsplit(f"{flag} TEXT ", 1)[1][:200]  # the option's help, after the usage line
        assert r"escapes: \n \r \t \\ \" \' \uXXXX" in after, (flag, after)


def generate_json(folder, *args):
    proc = run_attnkit(["generate", folder, *args, "--json"], folder)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_an_escaped_stop_string_stops_where_the_character_itself_does(chat_folder):
    full = generate_json(chat_folder, "--prompt", "Hello", "--max-new-tokens", "12")["new_text"]
    target = next(c for c in full[2:] if c.isprintable() and c != "\\")  # a character the reply writes
    literal = generate_json(chat_folder, "--prompt", "Hello", "--max-new-tokens", "12", "--stop", target)
    escaped = generate_json(chat_folder, "--prompt", "Hello", "--max-new-tokens", "12", "--stop",
                            f"\\u{ord(target):04x}")
    assert escaped == literal and literal["new_text"].endswith(target) and len(literal["new_ids"]) < 12


def test_system_and_prompt_escapes_reach_the_model(chat_folder):
    from attnkit.pretrained import load

    model, tok = load(chat_folder)
    messages = [{"role": "system", "content": "Be\nbrief, \"please\"."}, {"role": "user", "content": "Hi\tthere"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    out = model.generate(np.array([ids]), max_new_tokens=4, do_sample=False, eos_token_id=list(tok.eos_token_ids))
    record = generate_json(chat_folder, "--prompt", r"Hi\tthere", "--system", r"Be\nbrief, \"please\".",
                           "--max-new-tokens", "4")
    assert record["ids"] == out[0].tolist()
    plain = generate_json(chat_folder, "--prompt", r"caf\u00e9\n", "--max-new-tokens", "1")
    assert plain["ids"][:-1] == tok.encode("caf\u00e9\n")
