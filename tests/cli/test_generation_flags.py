"""One set of generation flags for ``attnkit generate`` and ``attnkit chat``, equal to the API: each flag gives what
``generate`` gives with the argument of the same Hugging Face name; ``generate --chat/--system``, ``chat
--chat-template``; ``--threads`` on every command that runs a model."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from attnkit.cli._common import UsageError
from attnkit.cli._generation import add_generation_arguments, generation_kwargs
from cli_helpers import SRC, run_attnkit

GENERATION_FLAGS = ("--temperature", "--top-k", "--top-p", "--min-p", "--repetition-penalty",
                    "--no-repeat-ngram-size", "--stop", "--min-new-tokens", "--num-beams", "--seed", "--threads")


# -- the flags, in-process -------------------------------------------------------------------------------
def parse(argv, **kwargs):
    parser = argparse.ArgumentParser()
    add_generation_arguments(parser)
    return generation_kwargs(parser.parse_args(argv), "attnkit test", **kwargs)


@pytest.mark.parametrize("argv, expected", [
    ([], {}),
    (["--temperature", "0"], {"do_sample": False}),
    (["--temperature", "0", "--top-k", "5", "--seed", "1"], {"do_sample": False, "top_k": 5, "seed": 1}),
    (["--temperature", "0.7", "--top-p", "0.9", "--min-p", "0.05"],
     {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "min_p": 0.05}),
    (["--seed", "3"], {"do_sample": True, "seed": 3}),
    (["--repetition-penalty", "1.3", "--no-repeat-ngram-size", "2", "--min-new-tokens", "4"],
     {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_new_tokens": 4}),
    (["--stop", "\n", "--stop", "."], {"stop_strings": ["\n", "."]}),
    (["--num-beams", "3"], {"num_beams": 3}),
])
def test_each_flag_is_the_argument_of_the_same_name(argv, expected):
    assert parse(argv) == expected
    greedy = parse(argv, greedy_unless_asked=True)
    assert greedy == (expected if "do_sample" in expected else {**expected, "do_sample": False})


@pytest.mark.parametrize("argv, words", [
    (["--num-beams", "2", "--temperature", "0.5"], "--num-beams cannot be combined with sampling options "
                                                   "(--temperature)"),
    (["--num-beams", "2", "--top-k", "3"], "(--top-k)"),
    (["--num-beams", "2", "--stop", "x"], "--stop cannot be combined with --num-beams"),
])
def test_flags_that_cannot_go_together_are_a_usage_error(argv, words):
    with pytest.raises(UsageError, match=None) as info:
        parse(argv)
    assert words in str(info.value)


@pytest.mark.parametrize("command, extra", [("generate", ("--system", "--chat")), ("chat", ("--chat-template",))])
def test_help_lists_the_generation_flags(tmp_path, command, extra):
    proc = run_attnkit([command, "--help"], tmp_path)
    assert proc.returncode == 0
    for flag in GENERATION_FLAGS + extra:
        assert flag in proc.stdout, flag


@pytest.mark.parametrize("command", ["generate", "chat", "explain", "attention", "embed", "bench"])
def test_every_command_that_runs_a_model_takes_threads(tmp_path, command):
    proc = run_attnkit([command, "--help"], tmp_path)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "--threads N" in text and "every core this process may use" in text


# -- against the library ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    import shutil

    from hf_models import saved_model, write_word_tokenizer

    root = tmp_path_factory.mktemp("flags")
    folder = shutil.copytree(saved_model("llama_gqa", root)[0], root / "llama_tok")
    write_word_tokenizer(folder)
    return folder


def generate_json(folder, *args):
    proc = run_attnkit(["generate", folder, *args, "--json"], folder)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("args, kwargs", [
    (["--temperature", "0"], {}),
    (["--repetition-penalty", "1.3", "--no-repeat-ngram-size", "2"], dict(repetition_penalty=1.3,
                                                                          no_repeat_ngram_size=2)),
    (["--min-new-tokens", "12"], dict(min_new_tokens=12)),
    (["--temperature", "1.5", "--top-k", "20", "--min-p", "0.01", "--seed", "7"],
     dict(do_sample=True, temperature=1.5, top_k=20, min_p=0.01, seed=7)),
    (["--num-beams", "3", "--no-repeat-ngram-size", "1"], dict(num_beams=3, no_repeat_ngram_size=1)),
])
def test_generate_flags_give_what_the_library_gives(llama, args, kwargs):
    from attnkit.decoding.sampling import generate
    from attnkit.pretrained import load_causal_lm

    record = generate_json(llama, "--ids", "4,5,6", "--max-new-tokens", "12", *args)
    expected = generate(load_causal_lm(llama), np.array([[4, 5, 6]]), max_new_tokens=12, **kwargs)[0].tolist()
    eos = load_causal_lm(llama).config.tokens.eos
    cut = next((i + 1 for i, t in enumerate(expected[3:], 3) if t == eos), len(expected))
    assert record["ids"] == expected[:cut]


def test_generate_stops_at_a_stop_string(llama):
    full = generate_json(llama, "--prompt", "w4 w5", "--max-new-tokens", "12")
    words = full["new_text"].split()
    record = generate_json(llama, "--prompt", "w4 w5", "--max-new-tokens", "12", "--stop", words[2], "--stop", "w999")
    assert record["new_text"].split() == words[:words.index(words[2]) + 1]


def test_generate_chat_and_system_render_the_chat_template(chat_folder):
    from attnkit.pretrained import load

    model, tok = load(chat_folder)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    out = model.generate(np.array([ids]), max_new_tokens=8, do_sample=False, eos_token_id=list(tok.eos_token_ids))
    record = generate_json(chat_folder, "--prompt", "Hello", "--system", "Be brief.", "--max-new-tokens", "8")
    assert record["ids"] == out[0].tolist()
    proc = run_attnkit(["generate", chat_folder, "--prompt", "Hello", "--system", "Be brief.", "--max-new-tokens",
                        "8"], chat_folder)
    assert proc.returncode == 0 and proc.stdout.strip()
    assert "<|im_start|>" not in proc.stdout and "Be brief" not in proc.stdout  # the reply only, not the prompt
    plain = generate_json(chat_folder, "--prompt", "Hello", "--chat", "--max-new-tokens", "4")
    ids = tok.apply_chat_template(messages[1:], add_generation_prompt=True, return_dict=False)
    assert plain["ids"][:len(ids)] == ids


def chat_pipe(folder, args, text):
    proc = subprocess.run([sys.executable, "-m", "attnkit", "chat", str(folder), *map(str, args)],
                          input=text.encode(), capture_output=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.decode()


def test_chat_flags_and_chat_template_give_what_the_library_gives(chat_folder, tmp_path):
    from attnkit.pretrained import load

    model, tok = load(chat_folder)
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    (tmp_path / "t.jinja").write_text(template)
    messages = [{"role": "user", "content": "Hello"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, chat_template=template)
    out = model.generate(np.array([ids]), max_new_tokens=10, do_sample=False, eos_token_id=list(tok.eos_token_ids),
                         repetition_penalty=1.5, no_repeat_ngram_size=2)
    reply = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    from attnkit.cli.chat import terminal_safe

    shown = chat_pipe(chat_folder, ["--chat-template", tmp_path / "t.jinja", "--max-new-tokens", 10,
                                    "--temperature", 0, "--repetition-penalty", 1.5, "--no-repeat-ngram-size", 2],
                      "Hello\n")
    assert shown == terminal_safe(reply) + "\n"


def test_threads_set_the_kernels_and_blas(llama):
    pytest.importorskip("threadpoolctl")
    code = ("import sys, attnkit; from attnkit.cli import main; from threadpoolctl import threadpool_info;"
            f"main(['generate', {str(llama)!r}, '--ids', '1', '--max-new-tokens', '1', '--threads', '1']);"
            "blas = [i['num_threads'] for i in threadpool_info() if i['user_api'] == 'blas'];"
            "print('threads', attnkit.get_num_threads(), blas)")
    env = dict(os.environ, PYTHONPATH=str(SRC), OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("threads 1 [") and set(json.loads(last.split(" ", 2)[2])) <= {1}


def test_threads_without_threadpoolctl_set_the_kernels_and_say_blas_is_not_limited(monkeypatch, capsys):
    import attnkit
    from attnkit.cli import _common

    real = _common.importlib.util.find_spec
    monkeypatch.setattr(_common.importlib.util, "find_spec", lambda name: None if name == "threadpoolctl" else
                        real(name))
    try:
        _common.use_threads(3)
        assert attnkit.get_num_threads() == 3
    finally:
        attnkit.set_num_threads(None)
    assert "threadpoolctl is not installed, so --threads 3 sets attnkit's threads but not BLAS's" in \
        capsys.readouterr().err
