"""``attnkit generate`` on tiny saved HF models: streamed text, --json ids equal to the library's generate,
--ids without a tokenizer, seeded sampling, and bad folders / configs / prompts as one line on stderr, exit 2."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from attnkit.cli import main  # noqa: E402
from attnkit.decoding.sampling import generate  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from cli_helpers import SRC  # noqa: E402
from hf_models import VOCAB, edit_config, saved_model, write_word_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """(llama folder with tokenizer.json, gpt2 folder without one)."""
    root = tmp_path_factory.mktemp("cli_models")
    llama = shutil.copytree(saved_model("llama_gqa", root)[0], root / "llama_tok")
    write_word_tokenizer(llama)
    return llama, saved_model("gpt2", root)[0]


def test_prompt_streams_text(model_dirs, capsys):
    llama, _ = model_dirs
    assert main(["generate", str(llama), "--prompt", "w3 w4 w5", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    words = out.split()
    assert words[:3] == ["w3", "w4", "w5"] and 3 < len(words) <= 9
    assert all(w.startswith("w") for w in words) and out.endswith("\n")


def test_json_ids_equal_library_generate(model_dirs, capsys):
    llama, _ = model_dirs
    assert main(["generate", str(llama), "--prompt", "w10 w11", "--max-new-tokens", "5", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    lm = load_causal_lm(llama)
    expected = generate(lm, np.array([[10, 11]]), max_new_tokens=5)[0].tolist()
    assert record["ids"] == expected and record["new_ids"] == expected[2:]
    assert record["text"] == " ".join(f"w{i}" for i in expected)
    assert record["new_text"].split() == [f"w{i}" for i in expected[2:]]


def test_ids_without_tokenizer_print_ids(model_dirs, capsys):
    _, gpt2 = model_dirs
    assert not (gpt2 / "tokenizer.json").exists()
    assert main(["generate", str(gpt2), "--ids", "1, 2,3", "--max-new-tokens", "4"]) == 0
    tokens = [int(t) for t in capsys.readouterr().out.split()]
    lm = load_causal_lm(gpt2)
    assert tokens == generate(lm, np.array([[1, 2, 3]]), max_new_tokens=4)[0].tolist()
    assert main(["generate", str(gpt2), "--ids", "1,2,3", "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] is None


def test_seeded_sampling_is_reproducible(model_dirs, capsys):
    llama, _ = model_dirs
    argv = ["generate", str(llama), "--ids", "4,5", "--max-new-tokens", "8", "--temperature", "1.5", "--top-k", "20",
            "--top-p", "0.95", "--min-p", "0.01", "--seed", "7", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)["ids"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == first
    lm = load_causal_lm(llama)
    assert first == generate(lm, np.array([[4, 5]]), max_new_tokens=8, do_sample=True, temperature=1.5, top_k=20,
                             top_p=0.95, min_p=0.01, seed=7)[0].tolist()


def test_learned_positions_stop_at_the_table_end(model_dirs, capsys):
    _, gpt2 = model_dirs
    ids = ",".join(["5"] * 62)
    assert main(["generate", str(gpt2), "--ids", ids, "--max-new-tokens", "10", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) <= 64


@pytest.fixture(scope="session")
def bad_folders(model_dirs, tmp_path_factory):
    llama, gpt2 = model_dirs
    root = tmp_path_factory.mktemp("bad")
    bert = edit_config(gpt2, root / "bert", model_type="bert")
    no_heads = edit_config(gpt2, root / "no_heads", n_head=...)
    no_weights = shutil.copytree(gpt2, root / "no_weights")
    (no_weights / "model.safetensors").unlink()
    bad_tok = shutil.copytree(llama, root / "bad_tok")
    (bad_tok / "tokenizer.json").write_text("{oops")
    return {"bert": bert, "no_heads": no_heads, "no_weights": no_weights, "bad_tok": bad_tok}


@pytest.mark.parametrize("case, words", [
    (lambda d, b: [str(d[1]) + "/nowhere", "--ids", "1"], "is not a folder"),
    (lambda d, b: [str(b["bert"]), "--ids", "1"], "model_type 'bert' is not supported"),
    (lambda d, b: [str(b["no_heads"]), "--ids", "1"], "'n_head' is missing"),
    (lambda d, b: [str(b["no_weights"]), "--ids", "1"], "neither model.safetensors"),
    (lambda d, b: [str(b["bad_tok"]), "--prompt", "w1"], "cannot read"),
    (lambda d, b: [str(d[1]), "--prompt", "hello"], "no tokenizer.json"),
    (lambda d, b: [str(d[1]), "--ids", ",".join(["1"] * 65)], "65 tokens, longer than the model's context of 64"),
    (lambda d, b: [str(d[0]), "--prompt", " ".join(["w1"] * 65)], "65 tokens, longer than the model's context of 64"),
    (lambda d, b: [str(d[1]), "--ids", "1,x"], "--ids must be"),
    (lambda d, b: [str(d[1]), "--ids", f"1,{VOCAB}"], f"token id {VOCAB} is outside"),
    (lambda d, b: [str(d[0]), "--prompt", "   "], "prompt is empty"),
    (lambda d, b: [str(d[1]), "--ids", "1", "--top-p", "1.5"], "--top-p"),
    (lambda d, b: [str(d[1]), "--ids", "1", "--temperature", "-1"], "--temperature"),
    (lambda d, b: [str(d[1]), "--ids", "1", "--stop", "x"], "--stop needs its tokenizer.json"),
    (lambda d, b: [str(d[1]), "--ids", "1", "--stop", ""], "--stop: must not be empty"),
    (lambda d, b: [str(d[0]), "--prompt", "w1", "--num-beams", "2", "--stop", "w"], "--stop cannot be combined"),
    (lambda d, b: [str(d[1]), "--ids", "1", "--chat"], "--chat, --system and --chat-template need --prompt"),
    (lambda d, b: [str(d[0]), "--prompt", "w1", "--system", "x"], "no chat template"),
    (lambda d, b: [str(d[1]), "--ids", "1", "--max-new-tokens", "0"], "--max-new-tokens"),
    (lambda d, b: [str(d[1])], "one of the arguments --prompt --ids is required"),
    (lambda d, b: [str(d[1]), "--ids", "1", "--prompt", "w1"], "not allowed with"),
])
def test_bad_input_is_one_line_and_exit_2(case, words, model_dirs, bad_folders, capsys):
    assert main(["generate", *case(model_dirs, bad_folders)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and err.startswith("attnkit generate: error:")
    assert words in err


def test_real_process_streams_and_fails_cleanly(model_dirs, tmp_path):
    llama, _ = model_dirs
    ok = subprocess.run([sys.executable, "-m", "attnkit", "generate", str(llama), "--prompt", "w7 w8",
                         "--max-new-tokens", "3"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("w7 w8")
    bad = subprocess.run([sys.executable, "-m", "attnkit", "generate", str(tmp_path), "--ids", "1"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no config.json" in bad.stderr


def _attnkit_process(args, **kwargs):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    env.pop("ATTNKIT_TRACEBACK", None)
    return subprocess.Popen([sys.executable, "-m", "attnkit", *args], env=env, stderr=subprocess.PIPE, **kwargs)


@pytest.mark.parametrize("json_output", [False, True])
def test_a_reader_that_leaves_ends_the_command_quietly(model_dirs, json_output):
    """``attnkit generate ... | head -c0``: the pipe is closed before anything is written; exit 141 (128 +
    SIGPIPE, as a Unix tool that SIGPIPE ends), nothing on stderr."""
    llama, _ = model_dirs
    args = ["generate", str(llama), "--prompt", "w3 w4", "--max-new-tokens", "30"] + (["--json"] if json_output else [])
    with _attnkit_process(args, stdout=subprocess.PIPE) as proc:
        proc.stdout.close()  # the reader is gone before the first write
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=300) == 141 and err == ""


def test_a_closed_stdout_is_taken_as_dev_null(model_dirs):
    """``attnkit generate ... >&-``: no error, no traceback, exit 0."""
    llama, _ = model_dirs
    with _attnkit_process(["generate", str(llama), "--prompt", "w3 w4", "--max-new-tokens", "5"],
                          stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(1)) as proc:
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=300) == 0 and err == ""


def test_beam_search_option_prints_the_best_beam(model_dirs, capsys):
    llama, _ = model_dirs
    assert main(["generate", str(llama), "--prompt", "w10 w11", "--max-new-tokens", "6", "--num-beams", "3",
                 "--length-penalty", "0.5", "--early-stopping", "never", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    lm = load_causal_lm(llama)
    best = generate(lm, np.array([[10, 11]]), max_new_tokens=6, num_beams=3, length_penalty=0.5,
                    early_stopping="never")[0].tolist()
    eos = lm.config.tokens.eos
    cut = next((i + 1 for i, t in enumerate(best[2:], 2) if t == eos), len(best))
    assert record["ids"] == best[:cut] and record["text"] == " ".join(f"w{i}" for i in best[:cut])
    assert main(["generate", str(llama), "--prompt", "w10 w11", "--num-beams", "2", "--seed", "1"]) == 2
    assert "--num-beams cannot be combined with sampling options (--seed)" in capsys.readouterr().err
    assert main(["generate", str(llama), "--prompt", "w10", "--num-beams", "2", "--length-penalty", "nan"]) == 2
    assert "finite number" in capsys.readouterr().err


@pytest.mark.parametrize("beams", ["1025", "1" + "0" * 30])
def test_num_beams_beyond_the_bound_is_one_line(model_dirs, capsys, beams):
    llama, _ = model_dirs
    assert main(["generate", str(llama), "--prompt", "w10 w11", "--num-beams", beams]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--num-beams" in err and "1024" in err, err


def test_a_prompt_longer_than_the_context_by_its_length_is_refused_before_it_is_tokenized(chat_folder, monkeypatch,
                                                                                          capsys):
    from attnkit.cli import generate as command
    from attnkit.pretrained.tokenizer import Tokenizer

    class Checked:
        """The folder's tokenizer, failing the test when asked to tokenize more than 100,000 characters."""

        def __init__(self, backend):
            self.backend = backend

        def __getattr__(self, name):
            return getattr(self.backend, name)

        def encode(self, text, *args, **kwargs):
            assert len(text) < 100_000, f"tokenized {len(text)} characters"
            return self.backend.encode(text, *args, **kwargs)

    plain = command.tokenizer_for_command
    monkeypatch.setattr(command, "tokenizer_for_command", lambda *args, **kwargs: Checked(plain(*args, **kwargs)))
    chat_encode = Tokenizer.encode  # --chat and --system tokenize with the folder's chat tokenizer

    def checked_encode(self, text, *args, **kwargs):
        assert len(text) < 100_000, f"tokenized {len(text)} characters"
        return chat_encode(self, text, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", checked_encode)
    long = "word " * 2_000_000  # 10 MB: tokenizing it took 17 s and 2 GB
    assert main(["generate", str(chat_folder), "--prompt", long]) == 2
    assert ("the prompt has at least 769,231 tokens (10,000,000 characters, and a token of this vocabulary holds at "
            "most 13), longer than the model's context of 128") in capsys.readouterr().err
    assert main(["generate", str(chat_folder), "--prompt", "Hello", "--system", long]) == 2
    assert "the conversation has at least 769,238 tokens (10,000,085 characters" in capsys.readouterr().err
    assert main(["generate", str(chat_folder), "--prompt", long, "--chat"]) == 2
    assert "the conversation has at least 769,235 tokens (10,000,050 characters" in capsys.readouterr().err
    assert main(["generate", str(chat_folder), "--prompt", "Hello " * 10, "--max-new-tokens", "2"]) == 0  # fits
