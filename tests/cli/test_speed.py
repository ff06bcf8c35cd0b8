"""The speed line of ``attnkit chat`` and ``attnkit generate``, as llama.cpp and ollama show it: the load time, the
prompt's tokens and their rate, the generated tokens and their rate (the decode steps, apart from the prompt's
pass), the total; after each reply with ``--verbose`` (stderr), and with ``/stats`` in the chat (the last reply
and the session)."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from attnkit.cli._speed import Speed, Stopwatch
from cli_helpers import SRC, greedy_reply, run_attnkit

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

LINE = re.compile(r"load (?P<load>\d+\.\d\d) s, "
                  r"prompt (?P<prompt>\d+) tokens?(?: \((?P<cached>\d+) cached\))?"
                  r"(?: at (?P<prompt_rate>[\d.]+) tokens/s)?, "
                  r"generated (?P<new>\d+) tokens?(?: at (?P<rate>[\d.]+) tokens/s)?, "
                  r"total (?P<total>\d+\.\d\d) s")


def fields(line: str) -> dict:
    """The numbers of one speed line (a rate left out is None)."""
    match = LINE.fullmatch(line.strip())
    assert match, line
    return {k: None if v is None else (float(v) if "." in v else int(v)) for k, v in match.groupdict().items()}


@pytest.fixture(scope="module")
def endless(chat_folder, tmp_path_factory):
    """The chat model with no end-of-sequence token: every reply is exactly --max-new-tokens long."""
    path = shutil.copytree(chat_folder, tmp_path_factory.mktemp("endless") / "model")
    config = json.loads((path / "config.json").read_text())
    config.update(eos_token_id=None)
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    return path


def prompt_length(folder, messages) -> int:
    from attnkit.pretrained import load_tokenizer

    return len(load_tokenizer(folder).apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def test_chat_prints_the_speed_of_each_reply_and_stats_sums_the_session(endless):
    proc = subprocess.run([sys.executable, "-m", "attnkit", "chat", str(endless), "--max-new-tokens", "6",
                           "--temperature", "0", "--verbose"], input=b"/stats\nHello\n/stats\nhow are you\n/stats\n",
                          capture_output=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert proc.returncode == 0, proc.stderr
    out, err = proc.stdout.decode(), proc.stderr.decode()
    replies = [fields(line) for line in err.splitlines() if line.startswith("load ")]
    assert len(replies) == 2
    user = {"role": "user", "content": "Hello"}
    first_reply = greedy_reply(endless, [user], 6)
    lengths = [prompt_length(endless, [user]),
               prompt_length(endless, [user, {"role": "assistant", "content": first_reply},
                                       {"role": "user", "content": "how are you"}])]
    assert [r["prompt"] + (r["cached"] or 0) for r in replies] == lengths
    assert replies[0]["cached"] is None and replies[1]["cached"] >= lengths[0]  # the first turn came from the cache
    for reply in replies:
        assert reply["new"] == 6 and reply["prompt_rate"] > 0 and reply["rate"] > 0
        assert reply["total"] >= 0 and reply["load"] >= 0
    assert len({r["load"] for r in replies}) == 1  # the model loaded once
    stats = [line for line in out.splitlines() if line.startswith(("last reply: ", "session, ", "(no reply"))]
    assert stats[0] == "(no reply yet)"
    assert stats[3].startswith("last reply: ") and fields(stats[3].split(": ", 1)[1]) == replies[1]
    session = fields(stats[4].split(": ", 1)[1])
    assert stats[4].startswith("session, 2 replies: ")
    assert session["prompt"] == replies[0]["prompt"] + replies[1]["prompt"] and session["new"] == 12
    assert session["cached"] == replies[1]["cached"]
    assert fields(stats[2].split(": ", 1)[1]) == replies[0]  # after one reply, the session is that reply


def test_generate_verbose_prints_the_speed_line_on_stderr(endless, tmp_path):
    from attnkit.pretrained import load_tokenizer

    proc = run_attnkit(["generate", endless, "--prompt", "Hello world", "--max-new-tokens", "5", "--verbose",
                        "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)  # stdout holds the JSON alone
    line = fields(proc.stderr)
    assert line["prompt"] == len(load_tokenizer(endless).encode("Hello world")) == len(record["ids"]) - 5
    assert line["new"] == 5 and line["prompt_rate"] > 0 and line["rate"] > 0
    beams = run_attnkit(["generate", endless, "--prompt", "Hello world", "--max-new-tokens", "3", "--num-beams",
                         "2", "--verbose"], tmp_path)
    line = fields(beams.stderr)  # beam search decides every token before it shows one: no rates
    assert line["new"] == 3 and line["prompt_rate"] is None and line["rate"] is None
    quiet = run_attnkit(["generate", endless, "--prompt", "Hello world", "--max-new-tokens", "2"], tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_the_rates_are_the_prompts_pass_and_the_decode_steps_apart():
    speed = Speed(prompt_tokens=100, prompt_seconds=0.5, new_tokens=11, decode_steps=10, decode_seconds=2.0, replies=1)
    line = fields(speed.line(1.25))
    assert line == {"load": 1.25, "prompt": 100, "cached": None, "prompt_rate": 200.0, "new": 11, "rate": 5.0,
                    "total": 2.5}
    both = fields((speed + speed).line(1.25))
    assert both == {**line, "prompt": 200, "new": 22, "total": 5.0}  # the rates of a sum are the same rates
    one = fields(Speed(100, 0.5, 1, 0, 0.0, 1).line(0))
    assert one["rate"] is None and one["prompt_rate"] == 200.0 and one["new"] == 1


def test_the_stopwatch_times_the_first_token_apart_from_the_rest(monkeypatch):
    clock = iter([10.0, 10.5, 11.0, 11.25, 11.5])  # start, then each of the four tokens
    monkeypatch.setattr("attnkit.cli._speed.time.perf_counter", lambda: next(clock))
    watch = Stopwatch(prompt_tokens=7)
    assert list(watch.watch("abcd")) == list("abcd")
    speed = watch.speed()
    assert (speed.prompt_tokens, speed.new_tokens, speed.decode_steps, speed.replies) == (7, 4, 3, 1)
    assert math.isclose(speed.prompt_seconds, 0.5) and math.isclose(speed.decode_seconds, 1.0)
