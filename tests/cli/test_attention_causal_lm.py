"""``attnkit attention`` on a Hugging Face causal-LM folder: the explorer page holds the model's weights, and bad
folders / prompts are one line on stderr with exit 2."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from attnkit.cli import main  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import edit_config, saved_model, write_word_tokenizer  # noqa: E402
from page_data import assert_page_weights  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(llama folder with tokenizer.json, mistral sliding-window folder without one)."""
    root = tmp_path_factory.mktemp("attention_lm")
    llama = shutil.copytree(saved_model("llama_gqa", root)[0], root / "llama_tok")
    write_word_tokenizer(llama)
    return llama, saved_model("mistral_window", root)[0]


def embedded(path) -> dict:
    """The JSON the page parses into ``window.attnkitData``."""
    text = path.read_text(encoding="utf-8")
    assert "window.attnkitData" in text
    match = re.search(r'<script type="application/json" id="attnkit-data">(.*?)</script>', text, flags=re.DOTALL)
    assert match, "no embedded data"
    return json.loads(match.group(1))


def api_weights(folder, ids) -> np.ndarray:
    _, weights = load_causal_lm(folder)(np.array([ids]), output_attentions=True)
    return np.stack([w[0] for w in weights])  # (N, H, L, L)


def test_prompt_page_holds_every_layer_and_head(folders, tmp_path, capsys):
    llama, _ = folders
    page = tmp_path / "llama.html"
    assert main(["attention", str(llama), "--prompt", "w3 w17 w5 w40", "--html", str(page)]) == 0
    assert "wrote" in capsys.readouterr().out
    data = embedded(page)
    assert data["tokens"] == ["w3", "w17", "w5", "w40"]
    expected = api_weights(llama, [3, 17, 5, 40])  # (2, 4, 4, 4)
    assert expected.shape == (2, 4, 4, 4)
    got = assert_page_weights(data["attention"], expected)  # 8 bits of each row's maximum
    assert got[0, 0, 0, 0] == 1.0 and (np.triu(got, 1) == 0).all()  # causal
    assert np.abs(got[:, :, 3, :] - 0.25).max() > 0.01  # not uniform


def test_ids_with_model_option_layer_and_head(folders, tmp_path, capsys):
    _, mistral = folders  # no tokenizer.json: the ids are the labels
    page = tmp_path / "mistral.html"
    ids = [2, 9, 30, 31, 4, 77, 6]
    code = main(["attention", "--model", str(mistral), "--ids", ",".join(map(str, ids)), "--layer", "1",
                 "--head", "2", "--html", str(page)])
    assert code == 0, capsys.readouterr().err
    data = embedded(page)
    assert data["tokens"] == [str(i) for i in ids]
    got = assert_page_weights(data["attention"], api_weights(mistral, ids)[1:2, 2:3])  # (1, 1, 7, 7)
    query, key = np.indices((7, 7))
    assert (got[0, 0][key <= query - 4] == 0).all()  # sliding window of 4
    assert (got[0, 0][(key <= query) & (key > query - 4)] > 0).all()


def test_control_characters_in_tokens_are_escaped(folders, tmp_path):
    llama, _ = folders
    folder = shutil.copytree(llama, tmp_path / "ctl")
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["bell\x07"] = vocab.pop("w7")
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    page = tmp_path / "ctl.html"
    assert main(["attention", str(folder), "--ids", "7,8", "--html", str(page)]) == 0
    assert embedded(page)["tokens"] == ["bell\\x07", "w8"]


def _one_line_exit_2(argv, capsys, *needles):
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and err.startswith("attnkit attention: error:"), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def test_bad_folders_and_prompts_exit_2(folders, tmp_path, capsys):
    llama, mistral = folders
    page = str(tmp_path / "x.html")
    long_ids = ",".join(["3"] * 65)  # the tiny models' context is 64
    _one_line_exit_2(["attention", str(llama), "--ids", long_ids, "--html", page], capsys,
                     "65 tokens", "context of 64")
    _one_line_exit_2(["attention", str(llama), "--prompt", " ".join(["w3"] * 70), "--html", page], capsys,
                     "70 tokens")
    broken = tmp_path / "broken"
    shutil.copytree(llama, broken)
    (broken / "model.safetensors").unlink()
    _one_line_exit_2(["attention", str(broken), "--ids", "1,2", "--html", page], capsys, "cannot load the model")
    _one_line_exit_2(["attention", str(mistral), "--prompt", "w1 w2", "--html", page], capsys, "no tokenizer.json")
    _one_line_exit_2(["attention", str(tmp_path / "nowhere"), "--ids", "1,2", "--html", page], capsys,
                     "--prompt and --ids need a Hugging Face causal-LM folder")
    bert = edit_config(llama, tmp_path / "bert", model_type="bert")
    _one_line_exit_2(["attention", str(bert), "--ids", "1,2", "--html", page], capsys, "causal-LM folder")
    _one_line_exit_2(["attention", str(llama), "--ids", "1,x", "--html", page], capsys, "--ids")
    _one_line_exit_2(["attention", str(llama), "--ids", "1,500", "--html", page], capsys, "vocabulary")
    _one_line_exit_2(["attention", str(llama), "--ids", "1,2", "--layer", "2", "--html", page], capsys,
                     "--layer 2 is out of range")
    _one_line_exit_2(["attention", str(llama), "--ids", "1,2", "--prompt", "w1", "--html", page], capsys,
                     "give the input once")
    _one_line_exit_2(["attention", str(llama), "--html", page], capsys, "--prompt TEXT or --ids")
    assert not (tmp_path / "x.html").exists()


def test_picture_of_a_deep_model_draws_one_layer_and_says_how_to_draw_others(folders, tmp_path, capsys,
                                                                             monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib import image

    from attnkit.cli import attention

    _, mistral = folders
    assert main(["attention", str(mistral), "--ids", "3,4,5", "-o", str(tmp_path / "all.png")]) == 0
    assert "note: drew layer 0" not in capsys.readouterr().out
    monkeypatch.setattr(attention, "_MAX_LAYERS_DRAWN", 1)
    assert main(["attention", str(mistral), "--ids", "3,4,5", "-o", str(tmp_path / "one.png")]) == 0
    assert "note: drew layer 0 of 2; pass --layer I to draw another" in capsys.readouterr().out
    assert image.imread(tmp_path / "one.png").shape[0] < image.imread(tmp_path / "all.png").shape[0]


def test_a_large_page_is_a_sentence_not_a_python_warning(folders, tmp_path, capsys, monkeypatch):
    from attnkit import viz

    _, mistral = folders
    monkeypatch.setattr(viz, "HTML_SIZE_WARNING_BYTES", 100)
    assert main(["attention", str(mistral), "--ids", "3,4,5", "--html", str(tmp_path / "big.html")]) == 0
    captured = capsys.readouterr()
    assert "note: the page is large and opens slowly" in captured.out and "Warning" not in captured.err


def test_a_hybrid_model_draws_its_softmax_layers_and_refuses_a_gated_deltanet_one(tmp_path, capsys):
    """Qwen3.5's Gated DeltaNet layers have no softmax pattern: the page holds the gated attention layers (1 and
    3) only, and `--layer 0` is one line and exit 2."""
    folder = saved_model("qwen3_5_text", tmp_path)[0]
    page = tmp_path / "hybrid.html"
    assert main(["attention", str(folder), "--ids", "3,17,5,40", "--html", str(page)]) == 0
    assert "layers 0, 2 are Gated DeltaNet layers" in capsys.readouterr().out
    data = embedded(page)
    assert data["layer_names"] == ["layer 1", "layer 3"]
    expected = np.stack([w[0] for w in load_causal_lm(folder).attention_weights(np.array([[3, 17, 5, 40]]),
                                                                                layers=[1, 3])])
    assert_page_weights(data["attention"], expected)
    assert main(["attention", str(folder), "--ids", "3,17", "--layer", "0", "--html", str(page)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Gated DeltaNet" in err, err


def test_short_convolution_and_mamba2_models_draw_their_attention_layers_and_refuse_the_others(tmp_path, capsys):
    """LFM2's short-convolution and Bamba's Mamba-2 layers have no attention pattern: the page holds LFM2's layers
    1 and 3, `--layer` naming another is one line and exit 2, and `attnkit explain` says what the layers are."""
    folder = saved_model("lfm2", tmp_path)[0]
    page = tmp_path / "conv.html"
    assert main(["attention", str(folder), "--ids", "3,17,5,40", "--html", str(page)]) == 0
    assert "layers 0, 2 are short-convolution layers" in capsys.readouterr().out
    assert embedded(page)["layer_names"] == ["layer 1", "layer 3"]
    assert main(["attention", str(folder), "--ids", "3,17", "--layer", "2", "--html", str(page)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--layer 2 is a short-convolution layer" in err, err
    assert main(["explain", str(folder), "--ids", "3,17,5,40", "--html", str(page), "--candidates", "2"]) == 0
    assert "note: layers 0, 2 are short-convolution layers" in capsys.readouterr().out
    bamba = saved_model("bamba", tmp_path)[0]
    assert main(["attention", str(bamba), "--ids", "3,17", "--layer", "0", "--html", str(page)]) == 2
    assert "--layer 0 is a Mamba-2 layer, which has no attention pattern; its softmax layers are 1" in \
        capsys.readouterr().err
    assert main(["explain", str(bamba), "--ids", "3,17,5,40", "--html", str(page), "--candidates", "2"]) == 0
    assert "note: layers 0, 2 are Mamba-2 layers" in capsys.readouterr().out
    falcon = saved_model("falcon_h1", tmp_path)[0]  # attention beside Mamba-2: every layer has a pattern
    assert main(["attention", str(falcon), "--ids", "3,17", "--layer", "1", "--html", str(page)]) == 0
    capsys.readouterr()
    assert main(["explain", str(falcon), "--ids", "3,17,5,40", "--html", str(page), "--candidates", "2"]) == 0
    assert "note: layers 0, 1 run attention beside a Mamba-2 mixer" in capsys.readouterr().out


def test_explain_draws_a_hybrid_models_softmax_layers_and_says_why_it_has_no_rollout(tmp_path, capsys):
    """`attnkit explain` on Qwen3.5 runs: the page draws the attention of layers 1 and 3 (equal to the model's
    weights), leaves out rollout and flow (Gated DeltaNet token weights are no shares of attention to compose), and
    its direct logit attribution gives layers 0 and 2 one share each, no heads."""
    folder = saved_model("qwen3_5_text", tmp_path)[0]
    page = tmp_path / "explain.html"
    assert main(["explain", str(folder), "--ids", "3,17,5,40", "--html", str(page), "--candidates", "2"]) == 0
    assert "note: layers 0, 2 are Gated DeltaNet layers" in capsys.readouterr().out
    data = json.loads(re.search(r'id="attnkit-data" type="application/json">(.*?)</script>',
                                page.read_text(encoding="utf-8"), flags=re.DOTALL).group(1))
    assert data["attention_layers"] == [1, 3] and data["linear_layers"] == [0, 2]
    assert data["rollout"] is None and data["flow"] is None
    lm = load_causal_lm(folder)
    expected = np.stack([w[0] for w in lm.attention_weights(np.array([[3, 17, 5, 40]]), layers=[1, 3])])
    assert_page_weights(data["attention"], expected)
    shares = data["candidates"][0]["dla"]
    assert np.all(np.array(shares["heads"])[[0, 2]] == 0) and np.all(np.array(shares["linear_attn"])[[1, 3]] == 0)
    assert np.abs(np.array(shares["linear_attn"])[[0, 2]]).min() > 0
