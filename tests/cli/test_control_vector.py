"""``--control-vector FILE[:SCALE]`` and ``--control-vector-layer-range START END`` on ``attnkit generate`` and
``attnkit chat``: the tokens are the library's under ``steering`` with the files' sum, and every bad file or flag
is one line and exit 2, before the model's weights are read."""
from __future__ import annotations

import io
import shutil
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("gguf")
from attnkit.cli import main  # noqa: E402
from attnkit.decoding.sampling import generate  # noqa: E402
from attnkit.explain import ControlVector, save_control_vector, steering  # noqa: E402
from attnkit.pretrained import load, load_causal_lm  # noqa: E402
from cli_helpers import run_attnkit  # noqa: E402
from hf_models import saved_model, write_word_tokenizer  # noqa: E402

WIDTH = 32  # the tiny models' hidden size


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    """A tiny Llama (2 layers, width 32) with a word tokenizer (token i is ``w{i}``)."""
    root = tmp_path_factory.mktemp("control_vector_models")
    folder = shutil.copytree(saved_model("llama_gqa", root)[0], root / "llama_words")
    write_word_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def vectors(tmp_path_factory):
    """Two control-vector files for the tiny models (layer 1) and their vectors."""
    root = tmp_path_factory.mktemp("control_vectors")
    rng = np.random.default_rng(5)
    happy = ControlVector({1: rng.standard_normal(WIDTH)}, "llama")
    calm = ControlVector({1: rng.standard_normal(WIDTH)}, "llama")
    return (save_control_vector(happy, root / "happy.gguf"), happy), (save_control_vector(calm, root / "calm.gguf"),
                                                                        calm)


def generated_ids(capsys, folder, *flags):
    import json

    assert main(["generate", str(folder), "--prompt", "w3 w4 w5", "--max-new-tokens", "8", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)["ids"]


def test_generate_is_the_library_steered_by_the_scaled_sum_of_the_files(word_model, vectors, capsys):
    (happy_file, happy), (calm_file, calm) = vectors
    lm = load_causal_lm(word_model)
    prompt = np.array([[3, 4, 5]])
    with steering(lm, 6.0 * happy - 2.0 * calm):
        expected = generate(lm, prompt, max_new_tokens=8)[0].tolist()
    got = generated_ids(capsys, word_model, "--control-vector", f"{happy_file}:6",
                        "--control-vector", f"{calm_file}:-2.0")
    assert got == expected
    assert got != generate(lm, prompt, max_new_tokens=8)[0].tolist()  # the steering changed the tokens
    assert generated_ids(capsys, word_model, "--control-vector", f"{happy_file}:6") != got


def test_a_layer_range_that_leaves_the_vectors_layers_out_steers_nothing(word_model, vectors, capsys):
    (happy_file, _), _ = vectors
    plain = generated_ids(capsys, word_model)
    assert generated_ids(capsys, word_model, "--control-vector", f"{happy_file}:6",
                         "--control-vector-layer-range", "0", "0") == plain
    assert generated_ids(capsys, word_model, "--control-vector", f"{happy_file}:6",
                         "--control-vector-layer-range", "1", "9") != plain


def test_chat_replies_are_steered_turn_after_turn(chat_folder, vectors, capsys, monkeypatch):
    """Each reply is the library's steered greedy reply to the whole conversation so far."""
    from attnkit.cli.chat import terminal_safe

    (happy_file, happy), _ = vectors
    model, tok = load(chat_folder)

    def reply(messages, scale):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        with steering(model, scale * happy):
            out = model.generate(np.array([ids]), max_new_tokens=10, do_sample=False,
                                 eos_token_id=list(tok.eos_token_ids))
        return tok.decode(out[0, len(ids):], skip_special_tokens=True)

    first = reply([{"role": "user", "content": "Hello"}], 8.0)
    second = reply([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first},
                    {"role": "user", "content": "how are you"}], 8.0)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nhow are you\n"))
    assert main(["chat", str(chat_folder), "--temperature", "0", "--max-new-tokens", "10",
                 "--control-vector", f"{happy_file}:8"]) == 0
    assert capsys.readouterr().out == f"{terminal_safe(first)}\n{terminal_safe(second)}\n"
    assert first != reply([{"role": "user", "content": "Hello"}], 0.0)


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_control_vectors")
    (root / "text.gguf").write_text("not a gguf file")
    save_control_vector(ControlVector({1: np.ones(16)}), root / "narrow.gguf")
    save_control_vector(ControlVector({5: np.ones(WIDTH)}), root / "deep.gguf")
    return root


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flags, match", [
    (["--control-vector", "{root}/absent.gguf"], "--control-vector '{root}/absent.gguf': {root}/absent.gguf does "
                                                 "not exist"),
    (["--control-vector", "{root}/text.gguf:2"], "is not a GGUF file: it does not start with b'GGUF'"),
    (["--control-vector", "{root}/narrow.gguf"], "the vectors have 16 features, but the model's residual stream "
                                                 "has 32"),
    (["--control-vector", "{root}/deep.gguf"], "a direction for layer 5, but the model has 2 layers (0 to 1)"),
    (["--control-vector", "{root}/deep.gguf", "--control-vector", "{root}/narrow.gguf"],
     "narrow.gguf' has 16 features, the files before it 32"),
    (["--control-vector", "{root}/deep.gguf:nan"], "must be a finite number"),
    (["--control-vector-layer-range", "1", "1"], "--control-vector-layer-range needs --control-vector"),
    (["--control-vector", "{root}/deep.gguf", "--control-vector-layer-range", "2", "1"], "START 2 is after END 1"),
    (["--control-vector", "{root}/deep.gguf", "--control-vector-layer-range", "x", "1"],
     "must be a layer index (a non-negative integer), got 'x'"),
])
def test_bad_control_vectors_are_one_line_and_exit_2(command, flags, match, bad_files, word_model, chat_folder,
                                                     capsys):
    folder = word_model if command == "generate" else chat_folder
    prompt = ["--prompt", "w3"] if command == "generate" else []
    flags = [flag.format(root=bad_files) for flag in flags]
    assert main([command, str(folder), *prompt, *flags]) == 2
    err = capsys.readouterr().err
    assert match.format(root=bad_files) in err and len(err.strip().splitlines()) == 1, err


def test_a_bad_file_is_refused_before_the_weights_are_read(word_model, bad_files, capsys, monkeypatch):
    import attnkit.pretrained

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(attnkit.pretrained, "load_causal_lm", never)
    monkeypatch.setattr(attnkit.pretrained, "load", never)
    assert main(["generate", str(word_model), "--prompt", "w3", "--control-vector", f"{bad_files}/text.gguf"]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err


def test_a_real_process_reports_a_bad_file_without_a_traceback(word_model, bad_files):
    proc = run_attnkit(["generate", word_model, "--prompt", "w3", "--control-vector", bad_files / "narrow.gguf"],
                       cwd=bad_files)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("attnkit generate: error: --control-vector") and len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("beams", ["1", "2"])
def test_on_a_terminal_the_progress_lines_run_inside_the_steering(word_model, vectors, capsys, tmp_path, beams):
    """The prefill line counts layers with hooks of its own, nested in the steering's; beam search is steered too."""
    from cli_helpers import run_on_terminal

    (happy_file, happy), _ = vectors
    lm = load_causal_lm(word_model)
    with steering(lm, 6.0 * happy):
        expected = generate(lm, np.array([[3, 4, 5]]), max_new_tokens=6, num_beams=int(beams))[0].tolist()
    code, out, shown = run_on_terminal(["generate", word_model, "--ids", "3,4,5", "--max-new-tokens", 6,
                                        "--num-beams", beams, "--control-vector", f"{happy_file}:6"], tmp_path)
    assert code == 0, shown
    assert ("prefill (3 tokens)" if beams == "1" else "beam search") in shown
    assert out.split() == [f"w{i}" for i in expected]


def test_chat_shows_the_steering_in_its_settings(chat_folder, vectors, capsys, monkeypatch):
    (happy_file, _), (calm_file, _) = vectors
    monkeypatch.setattr(sys, "stdin", io.StringIO("/show\n"))
    assert main(["chat", str(chat_folder), "--control-vector", f"{happy_file}:0.8", "--control-vector",
                 f"{calm_file}:-0.3", "--control-vector-layer-range", "1", "1"]) == 0
    assert "; steered by happy.gguf x0.8, calm.gguf x-0.3 (layers 1 to 1)" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_prompt_cache_file_is_refused_with_a_control_vector(command, word_model, chat_folder, vectors, tmp_path,
                                                              capsys):
    """A cache file holds the keys and values of the model that wrote it: a steered model is another model."""
    from attnkit.cli import build_parser

    prompt = ["--prompt", "w3"] if command == "generate" else []
    if not hasattr(build_parser().parse_args([command, "x", *prompt]), "prompt_cache"):
        pytest.skip(f"attnkit {command} has no --prompt-cache in this tree")
    (happy_file, _), _ = vectors
    folder = word_model if command == "generate" else chat_folder
    assert main([command, str(folder), *prompt, "--prompt-cache", str(tmp_path / "cache.bin"), "--control-vector",
                 str(happy_file)]) == 2
    err = capsys.readouterr().err
    assert "--prompt-cache cannot be combined with --control-vector" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cache.bin").exists()


@pytest.mark.parametrize("flags", [["--assistant-early-exit", "1"], ["--prompt-lookup-num-tokens", "3"]])
def test_speculative_decoding_keeps_the_steered_greedy_tokens(flags, word_model, vectors, capsys):
    """Drafts are checked by the steered model, so greedy speculation gives the steered greedy tokens."""
    from attnkit.cli import build_parser

    if not hasattr(build_parser().parse_args(["generate", "x", "--ids", "1"]), flags[0][2:].replace("-", "_")):
        pytest.skip(f"attnkit generate has no {flags[0]} in this tree")
    (happy_file, _), _ = vectors
    import json

    def ids(*more):
        assert main(["generate", str(word_model), "--prompt", "w3 w4 w5 w3 w4", "--max-new-tokens", "10", "--json",
                     "--control-vector", f"{happy_file}:6", *more]) == 0
        return json.loads(capsys.readouterr().out)["ids"]

    assert ids(*flags) == ids()
