"""The ``attnkit`` parser: commands registered from ``COMMANDS``, ``--help`` everywhere, and every bad command
line (out of range, absurd, not UTF-8, control characters, unwritable paths) is one line on stderr and exit 2."""
import argparse
import os
import sys

import pytest

from attnkit import cli
from attnkit.cli import COMMANDS, build_parser, main
from attnkit.cli._common import UsageError, bounded_int, printable, run_command
from cli_helpers import assert_one_line_error, run_attnkit


def _command_names():
    return [command.NAME for command in COMMANDS]


def test_commands_follow_the_module_pattern():
    assert _command_names() == ["demo", "attention", "explain", "bench", "tune", "embed", "generate", "chat",
                               "compare"]
    sub = build_parser()._subparsers._group_actions[0]
    assert list(sub.choices) == _command_names()
    for command in COMMANDS:
        assert command.__name__ == f"attnkit.cli.{command.NAME}"
        assert callable(command.add_parser) and callable(command.run)
        assert sub.choices[command.NAME].get_default("run") is command.run


def test_a_command_added_to_commands_is_registered(monkeypatch, capsys):
    class Hello:
        NAME = "hello"

        @staticmethod
        def add_parser(subparsers):
            p = subparsers.add_parser("hello", help="say hello")
            p.add_argument("--times", type=bounded_int(1, 3), default=1)
            p.set_defaults(run=Hello.run)
            return p

        @staticmethod
        def run(args):
            print("hello " * args.times)
            return 0

    monkeypatch.setattr(cli, "COMMANDS", (*COMMANDS, Hello))
    assert main(["hello", "--times", "2"]) == 0
    assert capsys.readouterr().out == "hello hello \n"
    assert main(["hello", "--times", "4"]) == 2
    assert_one_line_error(capsys.readouterr().err, "attnkit hello: error: argument --times: must be at most 3")
    assert main([]) == 2
    assert_one_line_error(capsys.readouterr().err,
                          "choose a command: demo, attention, explain, bench, tune, embed, generate, chat, compare, "
                          "hello")


@pytest.mark.parametrize("command", [[], ["demo"], ["attention"], ["explain"], ["bench"], ["embed"], ["generate"]])
def test_every_command_has_help(command, capsys):
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: attnkit {' '.join(command)}".rstrip())


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("attnkit ")


def test_embed_help_states_the_token_limit(capsys):
    assert main(["embed", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "at most 256 tokens" in out and "truncated" in out


BAD_COMMAND_LINES = {
    "no command": ([], "choose a command"),
    "unknown command": (["train"], "invalid choice"),
    "unknown task": (["demo", "--task", "translate"], "invalid choice: 'translate'"),
    "negative steps": (["demo", "--steps", "-5"], "--steps: must be a positive integer, got -5"),
    "zero steps": (["demo", "--steps", "0"], "must be a positive integer"),
    "steps not a number": (["demo", "--steps", "many"], "must be a positive integer"),
    "steps a float": (["demo", "--steps", "1e3"], "must be a positive integer, got '1e3'"),
    "30-digit steps": (["demo", "--steps", "1" + "0" * 29], "--steps: must be at most 10000000, got 1" + "0" * 29),
    "31-digit steps": (["demo", "--steps", "9" * 31], "must be at most 10000000, got a 31-digit number"),
    "5000-digit steps": (["demo", "--steps", "9" * 5000], "got a 5000-digit number"),
    "5000-digit negative seed": (["demo", "--seed", "-" + "9" * 5000], "non-negative integer, got a 5000-digit"),
    "huge seed": (["demo", "--seed", str(2**64)], "must be at most"),
    "huge batch": (["demo", "--batch-size", "10000000"], "must be at most 65536"),
    "negative seed": (["demo", "--seed", "-1"], "non-negative"),
    "negative lr": (["demo", "--lr", "-0.1"], "positive number"),
    "nan lr": (["demo", "--lr", "nan"], "positive number"),
    "infinite lr": (["demo", "--lr", "1e400"], "positive number"),
    "unknown option": (["demo", "--epochs", "3"], "unrecognized arguments"),
    "unwritable output folder": (["demo", "--out", "{file}/out"], "cannot write to the output folder"),
    "output folder name too long": (["demo", "--out", "{tmp}/" + "x" * 5000], "cannot write to the output folder"),
    "missing model folder": (["attention", "--model", "{tmp}/nowhere", "--input", "1 2"], "no such file"),
    "missing model file": (["attention", "--model", "{tmp}/nowhere.npz", "--input", "1 2"], "no such file"),
    "not a model": (["attention", "--model", "{file}", "--input", "1 2"], "no such file"),
    "no input": (["attention", "--model", "{model}"], "no input"),
    "input twice": (["attention", "--model", "{model}", "1", "--input", "2"], "not both"),
    "unknown token": (["attention", "--model", "{model}", "--input", "1 x 2"], "unknown tokens ['x']"),
    "too long": (["attention", "--model", "{model}", "--input", "1 " * 11], "at most 10"),
    "layer out of range": (["attention", "--model", "{model}", "--input", "1 2", "--layer", "2"], "0..1"),
    "absurd layer": (["attention", "--model", "{model}", "--input", "1 2", "--layer", "9" * 30], "at most 100000"),
    "not an image file": (["attention", "--model", "{model}", "--input", "1 2", "-o", "{tmp}/a.txt"], ".png"),
    "unwritable image": (["attention", "--model", "{model}", "--input", "1 2", "-o", "{file}/a.png"], "cannot write"),
    "bench sizes": (["bench", "--sizes", "-64"], "positive integer"),
    "bench repeats": (["bench", "--repeats", "0"], "positive integer"),
    "bench absurd sizes": (["bench", "--sizes", "9" * 30], "must be at most 1048576"),
    "bench absurd threads": (["bench", "--threads", "100000"], "must be at most 1024, got 100000"),
    "embed batch size": (["embed", "hello", "--batch-size", "0"], "positive integer"),
    "embed missing input": (["embed", "--input", "{tmp}/none.txt"], "is not a file"),
    "embed text and input": (["embed", "hi", "--input", "{file}"], "not both"),
    "embed output not npy": (["embed", "hi", "--output", "{tmp}/x.txt"], "--output must end in one of .npy"),
    "control characters": (["demo", "--task", "\x1b[2J\x07"], "invalid choice: '\\x1b[2J\\x07'"),
    "control characters in an unknown option": (["demo", "--x\x1b]0;pwned\x07"], "unrecognized arguments: --x\\x1b"),
    "C1 control and bidi override": (["bench", "--sizes", "\x9b\u202e1"], "\\x9b\\u202e1"),
}


@pytest.mark.parametrize("case", list(BAD_COMMAND_LINES))
def test_bad_command_lines_exit_2_with_one_line(case, small_demo, tmp_path, capsys):
    argv, message = BAD_COMMAND_LINES[case]
    file = tmp_path / "a-file.txt"
    file.write_text("not a folder")
    argv = [a.format(file=file, tmp=tmp_path, model=small_demo) for a in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert_one_line_error(err, message)
    assert "Traceback" not in out and len(err) < 600


def test_arguments_that_are_not_utf8_exit_2(capsys):
    undecodable = b"out\xff\xfe".decode("utf-8", "surrogateescape")  # how Python hands such bytes over
    assert main(["demo", "--out", undecodable]) == 2
    assert_one_line_error(capsys.readouterr().err, "argument 3 (out\\xff\\xfe) is not valid UTF-8")


def test_real_process_bad_arguments_have_no_traceback(tmp_path):
    cases = [
        ([b"demo", b"--steps", b"-3"], "attnkit demo: error: argument --steps: must be a positive integer, got -3"),
        ([b"demo", b"--steps", b"1" * 30], "must be at most 10000000"),
        ([b"demo", b"--out", b"\xff\xfeabc"], "is not valid UTF-8"),
        ([b"embed", b"\xc3\x28"], "is not valid UTF-8"),
        ([b"attention", b"--input", b"1 2"], "train one with 'attnkit demo'"),  # no attnkit-demo folder here
        ([b"demo", b"--task", b"\x1b[31mred"], "invalid choice: '\\x1b[31mred'"),
        ([b"attention", b"--model", b"/" + b"x" * 5000, b"--input", b"1"], "cannot load the model"),
    ]
    for argv, message in cases:
        proc = run_attnkit(argv, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, (argv[:3], proc.stderr)
        assert_one_line_error(proc.stderr, message)
        assert proc.stdout == ""


def test_error_handler_exit_codes(capsys, monkeypatch):
    def raises(exc):
        def run():
            raise exc
        return run

    assert run_command(raises(UsageError("bad", "attnkit x"))) == 2
    assert capsys.readouterr().err == "attnkit x: error: bad\n"
    assert run_command(raises(ImportError("needs foo: pip install 'attnkit[viz]'"))) == 1
    assert run_command(raises(PermissionError(13, "Permission denied", "/root/x"))) == 2
    assert_one_line_error(capsys.readouterr().err[-200:].split("\n", 1)[-1], "Permission denied (/root/x)")
    assert run_command(raises(MemoryError())) == 2
    assert_one_line_error(capsys.readouterr().err, "not enough memory")
    assert run_command(raises(KeyboardInterrupt())) == 130
    capsys.readouterr()
    assert run_command(raises(BrokenPipeError(32, "Broken pipe"))) == 141  # the reader left: quietly
    assert capsys.readouterr() == ("", "")
    monkeypatch.delenv("ATTNKIT_TRACEBACK", raising=False)
    assert run_command(raises(RuntimeError("boom\x1b[2J"))) == 1
    assert_one_line_error(capsys.readouterr().err, "internal error: RuntimeError: boom\\x1b[2J", "ATTNKIT_TRACEBACK=1")
    monkeypatch.setenv("ATTNKIT_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        run_command(raises(RuntimeError("boom")))


def test_printable_escapes_what_a_terminal_would_act_on():
    assert printable("caf\u00e9 \u6771\u4eac \U0001f642") == "caf\u00e9 \u6771\u4eac \U0001f642"
    assert printable("a\x1b[31mb\x07\x7f\x9b\u202e\u2066") == "a\\x1b[31mb\\x07\\x7f\\x9b\\u202e\\u2066"
    assert printable("\udcff") == "\\udcff"
    assert printable("x" * 100, limit=3) == "xxx..."


def test_bounded_int_accepts_what_int_does_within_range():
    parse = bounded_int(0, 100)
    assert [parse(t) for t in ("0", "+7", " 42 ", "0100")] == [0, 7, 42, 100]
    for text in ("", "1.0", "0x10", "1_000", "--1", "١٢"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_main_reads_sys_argv(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["attnkit", "--version"])
    assert main() == 0 and capsys.readouterr().out.startswith("attnkit ")


def test_pictures_are_written_atomically(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from attnkit.cli._common import save_figure

    target = tmp_path / "picture.png"
    target.write_bytes(b"the previous picture")
    fig = plt.figure()

    def fail_midway(file, **kwargs):
        file.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    fig.savefig = fail_midway
    with pytest.raises(OSError):
        save_figure(fig, target)
    assert target.read_bytes() == b"the previous picture" and sorted(tmp_path.iterdir()) == [target]
    fig = plt.figure()
    save_figure(fig, target)
    assert target.read_bytes()[:4] == b"\x89PNG" and sorted(tmp_path.iterdir()) == [target]
    mask = os.umask(0o022)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask  # as a plain savefig would leave it


@pytest.mark.parametrize("command", ["attention", "explain", "generate", "chat"])
def test_the_help_of_every_model_command_names_every_family(command, capsys):
    from attnkit import supported_model_types

    assert main([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    missing = [name for name in supported_model_types() if name not in out.replace("- ", "-")]
    assert missing == [] and ("GGUF" in out or command == "attention")
