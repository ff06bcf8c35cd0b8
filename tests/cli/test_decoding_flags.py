"""The decoding flags of ``attnkit generate`` and ``attnkit chat``: speculative decoding (one flag per way of
drafting; greedy text unchanged), ``--prompt-cache FILE`` (reused when the prompt starts with its ids, refused
with one line when foreign), and the chat keeping its cache across turns (each turn reads only its new tail)."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from attnkit.cli import main  # noqa: E402
from attnkit.decoding.sampling import generate  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from cli_helpers import greedy_reply, run_attnkit  # noqa: E402
from hf_models import edit_config, saved_model, write_word_tokenizer  # noqa: E402

SPEED = re.compile(r"prompt (\d+) tokens?(?: \((\d+) cached\))?")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoding_flags")
    folder = shutil.copytree(saved_model("llama_gqa", root)[0], root / "llama_tok")
    write_word_tokenizer(folder)
    return folder


def generated(capsys, *argv):
    assert main(["generate", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["ids"]


PROMPT = "5,6,7,8,5,6,7,8,5,6"


@pytest.mark.parametrize("flags", [["--prompt-lookup-num-tokens", "4"],
                                   ["--prompt-lookup-num-tokens", "2", "--max-matching-ngram-size", "1"],
                                   ["--assistant-early-exit", "1"],
                                   ["--assistant-early-exit", "1", "--num-assistant-tokens", "3"],
                                   ["--assistant-model", "SELF"]])
def test_each_way_of_drafting_leaves_greedy_text_unchanged(llama, capsys, flags):
    flags = [str(llama) if flag == "SELF" else flag for flag in flags]
    plain = generate(load_causal_lm(llama), np.array([[int(i) for i in PROMPT.split(",")]]), max_new_tokens=16)
    eos = load_causal_lm(llama).config.tokens.eos
    ids = plain[0].tolist()
    cut = next((i + 1 for i, t in enumerate(ids[10:], 10) if t == eos), len(ids))
    assert generated(capsys, llama, "--ids", PROMPT, "--max-new-tokens", 16, *flags) == ids[:cut]


@pytest.mark.parametrize("flags, words", [
    (["--prompt-lookup-num-tokens", "3", "--assistant-early-exit", "1"], "two ways of drafting: give one"),
    (["--max-matching-ngram-size", "2"], "--max-matching-ngram-size needs --prompt-lookup-num-tokens"),
    (["--num-assistant-tokens", "4"], "--num-assistant-tokens needs --assistant-model or --assistant-early-exit"),
    (["--prompt-lookup-num-tokens", "3", "--num-beams", "2"], "cannot be combined with --num-beams"),
    (["--prompt-lookup-num-tokens", "0"], "--prompt-lookup-num-tokens"),
    (["--assistant-early-exit", "2"], "the draft must be fewer layers than the model's 2"),
    (["--prompt-cache", "x.cache", "--num-beams", "2"], "--prompt-cache cannot be combined with --num-beams"),
])
def test_flags_that_cannot_work_are_one_line_and_exit_2(llama, flags, words):
    proc = run_attnkit(["generate", llama, "--ids", "1,2", *flags], cwd=llama)
    assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_draft_model_with_another_tokenizer_is_refused(llama, tmp_path):
    other = shutil.copytree(llama, tmp_path / "other")
    vocab = json.loads((other / "tokenizer.json").read_text())
    vocab["model"]["vocab"] = {(f"x{word}" if word.startswith("w") else word): i
                               for word, i in vocab["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    proc = run_attnkit(["generate", llama, "--prompt", "w1 w2", "--assistant-model", other], cwd=tmp_path)
    assert proc.returncode == 2 and "has another tokenizer than the model" in proc.stderr, proc.stderr


def test_generate_reuses_its_prompt_cache_and_says_so(llama, tmp_path):
    path = tmp_path / "prompt.cache"
    args = ["generate", llama, "--ids", PROMPT, "--max-new-tokens", "6", "--json", "--verbose", "--prompt-cache", path]
    first = run_attnkit(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    saved = path.read_bytes()
    again = run_attnkit(args, cwd=tmp_path)
    assert again.returncode == 0 and json.loads(again.stdout) == json.loads(first.stdout)
    assert SPEED.search(first.stderr).groups() == ("10", None)
    assert SPEED.search(again.stderr).groups() == ("1", "9")  # only the last id is read again
    assert path.read_bytes() == saved  # the same prompt: nothing new to save
    longer = run_attnkit([*args[:3], PROMPT + ",9,9", *args[4:]], cwd=tmp_path)
    assert SPEED.search(longer.stderr).groups() == ("3", "9") and path.read_bytes() != saved
    want = generate(load_causal_lm(llama), np.array([[*map(int, PROMPT.split(",")), 9, 9]]), max_new_tokens=6)
    assert json.loads(longer.stdout)["ids"] == want[0].tolist()[:len(json.loads(longer.stdout)["ids"])]


def test_a_foreign_or_damaged_prompt_cache_is_refused_and_left_alone(llama, tmp_path):
    other, _ = saved_model("qwen3", tmp_path)
    foreign = tmp_path / "qwen3.cache"
    assert run_attnkit(["generate", other, "--ids", "1,2,3", "--prompt-cache", foreign], cwd=tmp_path).returncode == 0
    (tmp_path / "notes.cache").write_text("my notes")
    for path, words in ((foreign, "written for another model"), (tmp_path / "notes.cache", "not a prompt cache")):
        before = path.read_bytes()
        proc = run_attnkit(["generate", llama, "--ids", "1,2,3", "--prompt-cache", path], cwd=tmp_path)
        assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert "delete it or name another file" in proc.stderr and path.read_bytes() == before


def chat(folder, lines, *flags):
    proc = run_attnkit(["chat", folder, "--temperature", "0", "--max-new-tokens", "6", "--verbose", *flags],
                       cwd=folder, stdin="\n".join(lines) + "\n")
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def long_chat(chat_folder, tmp_path_factory):
    """The chat model with room for eight turns (its context made 1024)."""
    return edit_config(chat_folder, tmp_path_factory.mktemp("long_chat") / "chat", max_position_embeddings=1024)


def test_each_chat_turn_reads_only_its_new_tail_and_replies_as_without_a_cache(long_chat):
    chat_folder = long_chat
    system = "You are terse."
    turns = ["hello", "what is two and two", "and three", "tell me more", "why", "ok", "thanks", "bye now"]
    proc = chat(chat_folder, turns, "--system", system)
    read = [line for line in proc.stderr.splitlines() if line.startswith("load ")]
    assert len(read) == 8
    counts = [tuple(int(n or 0) for n in SPEED.search(line).groups()) for line in read]
    from attnkit.pretrained import load_tokenizer

    tokenizer = load_tokenizer(chat_folder)
    messages = [{"role": "system", "content": system}]
    previous = 0  # the last turn's prompt length
    for (tokens, cached), text in zip(counts, turns):
        messages.append({"role": "user", "content": text})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        # the turns replied as the library does on the whole conversation (so the prompts are these), and all of
        # the last turn's prompt came from the cache: only the reply and the new message were read
        assert tokens + cached == len(prompt) and cached >= previous, (tokens, cached, previous)
        messages.append({"role": "assistant", "content": greedy_reply(chat_folder, messages, 6)})
        previous = len(prompt)


def test_chat_saves_its_first_prompt_and_a_later_chat_starts_from_it(long_chat, tmp_path):
    chat_folder = long_chat
    path = tmp_path / "system.cache"
    system = "You are a careful assistant who answers in one line. " * 4
    first = chat(chat_folder, ["hello"], "--system", system, "--prompt-cache", path)
    assert path.exists()
    second = chat(chat_folder, ["something else entirely"], "--system", system, "--prompt-cache", path)
    (read1, cached1), = [tuple(int(n or 0) for n in SPEED.search(line).groups())
                         for line in first.stderr.splitlines() if line.startswith("load ")]
    (read2, cached2), = [tuple(int(n or 0) for n in SPEED.search(line).groups())
                         for line in second.stderr.splitlines() if line.startswith("load ")]
    assert cached1 == 0 and cached2 > 40  # the system message's tokens
    assert second.stdout == chat(chat_folder, ["something else entirely"], "--system", system).stdout
    proc = run_attnkit(["chat", chat_folder, "--prompt-cache", tmp_path], cwd=tmp_path, stdin="hi\n")
    assert proc.returncode == 2 and "--prompt-cache" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
