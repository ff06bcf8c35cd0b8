"""attention_html without a browser: the file is self-contained, small, escaped, atomically written, and
bad input is refused with a message naming the argument."""
from __future__ import annotations

import json
import os
import re
import warnings

import numpy as np
import pytest

from attnkit import viz
from attnkit.viz import HTML_SIZE_WARNING_BYTES, attention_html


def _weights(*shape, seed=0):
    w = np.random.default_rng(seed).random(shape)
    return w / w.sum(-1, keepdims=True)


def _embedded(path) -> dict:
    """The JSON the page embeds (what the page's script parses into window.attnkitData)."""
    text = path.read_text(encoding="utf-8")
    match = re.search(r'<script type="application/json" id="attnkit-data">(.*?)</script>', text, flags=re.DOTALL)
    assert match, "no embedded data"
    return json.loads(match.group(1))


def test_writes_one_self_contained_file(tmp_path):
    path = attention_html(list("abcde"), _weights(2, 3, 5, 5), tmp_path / "a.html")
    assert path == tmp_path / "a.html"
    assert os.listdir(tmp_path) == ["a.html"]  # no temporary file left behind
    text = path.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text and "//cdn" not in text
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", text)  # nothing loaded from elsewhere
    for testid in ("layer", "head", "heatmap"):
        assert f'data-testid="{testid}"' in text
    assert "window.attnkitData" in text
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)


@pytest.mark.parametrize("shape, expected", [((5, 5), (1, 1, 5, 5)), ((3, 5, 5), (1, 3, 5, 5)),
                                             ((2, 3, 5, 5), (2, 3, 5, 5))])
def test_accepts_one_head_one_layer_or_all_layers(tmp_path, shape, expected):
    w = _weights(*shape).astype(np.float32)
    data = _embedded(attention_html(list("abcde"), w, tmp_path / "a.html"))
    got = np.array(data["attention"])
    assert got.shape == expected
    np.testing.assert_allclose(got, w.reshape(expected), atol=0.5e-4 + 1e-7, rtol=0)
    assert data["layer_names"] == [f"layer {i}" for i in range(expected[0])]
    assert data["head_names"] == [f"head {j}" for j in range(expected[1])]


def test_weights_are_rounded_to_the_given_decimals(tmp_path):
    w = _weights(2, 4, 6, 6)
    for decimals in (2, 4, 5):
        data = _embedded(attention_html(list("abcdef"), w, tmp_path / "a.html", decimals=decimals))
        got = np.array(data["attention"])
        assert np.array_equal(got, np.round(w, decimals))
    text = (tmp_path / "a.html").read_text(encoding="utf-8")
    assert not re.search(r"\d\.\d{6,}", text.split('id="attnkit-data">')[1])  # no long float tails


def test_does_not_modify_the_callers_weights(tmp_path):
    w = _weights(2, 2, 3, 3).astype(np.float32)
    before = w.copy()
    attention_html(["a", "b", "c"], w, tmp_path / "a.html")
    assert np.array_equal(w, before)


def test_tokens_and_title_cannot_break_out_as_markup(tmp_path):
    tokens = ["</script><script>alert(1)</script>", "<!--", "a&b", "\u00e9\u6f22"]
    path = attention_html(tokens, _weights(1, 1, 4, 4), tmp_path / "a.html", title="</title><script>x</script>")
    text = path.read_text(encoding="utf-8")
    assert text.count("<script") == 2 and text.count("</script>") == 2  # the page's own two
    assert "<title>&lt;/title&gt;&lt;script&gt;x&lt;/script&gt;</title>" in text
    assert _embedded(path)["tokens"] == tokens  # the escapes decode back to the exact tokens


def test_warns_when_the_page_would_be_large(tmp_path):
    w = np.full((1, 12, 270, 270), 1 / 270)  # ~875k weights, about 6 bytes each
    with pytest.warns(UserWarning, match=r"MB .*1 layers x 12 heads x 270 x 270"):
        path = attention_html([str(i) for i in range(270)], w, tmp_path / "big.html")
    assert path.stat().st_size > HTML_SIZE_WARNING_BYTES
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention_html([str(i) for i in range(40)], np.full((2, 4, 40, 40), 1 / 40), tmp_path / "small.html")


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    path = attention_html(list("ab"), _weights(1, 1, 2, 2), tmp_path / "a.html")
    before = path.read_bytes()

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(viz.os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        attention_html(list("ab"), _weights(1, 1, 2, 2, seed=5), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["a.html"]


@pytest.mark.parametrize("weights, error, message", [
    (np.ones((2, 2, 2, 2, 2)) / 2, ValueError,
     r"weights must be \(L, L\), \(heads, L, L\) or \(layers, heads, L, L\), got shape \(2, 2, 2, 2, 2\)"),
    (np.ones(2) / 2, ValueError, r"got shape \(2,\)"),
    (np.ones((2, 3)) / 3, ValueError, r"as many keys as queries .*\(2, 3\)"),
    (np.ones((0, 0)), ValueError, "must not be empty"),
    (np.full((2, 2), np.nan), ValueError, "must be finite, got 4 NaN"),
    (np.full((2, 2), 2.0), ValueError, r"in \[0, 1\], got values from 2 to 2"),
    (np.full((2, 2), -0.5), ValueError, r"in \[0, 1\]"),
    (np.array([["a", "b"], ["c", "d"]]), TypeError, "real numeric array, got dtype <U1"),
])
def test_bad_weights_are_refused_with_what_was_wrong(tmp_path, weights, error, message):
    with pytest.raises(error, match=message):
        attention_html(["x", "y"], weights, tmp_path / "a.html")
    assert os.listdir(tmp_path) == []


def test_bad_tokens_names_path_and_decimals_are_refused(tmp_path):
    w = _weights(2, 3, 2, 2)
    with pytest.raises(ValueError, match="tokens has 3 tokens, but the weights have 2 positions"):
        attention_html(["a", "b", "c"], w, tmp_path / "a.html")
    with pytest.raises(TypeError, match="not a string"):
        attention_html("ab", w, tmp_path / "a.html")
    with pytest.raises(ValueError, match="layer_names has 1 names, but the weights have 2"):
        attention_html(["a", "b"], w, tmp_path / "a.html", layer_names=["only"])
    with pytest.raises(ValueError, match="head_names has 2 names, but the weights have 3"):
        attention_html(["a", "b"], w, tmp_path / "a.html", head_names=["x", "y"])
    with pytest.raises(ValueError, match="decimals must be an integer from 1 to 6, got 0"):
        attention_html(["a", "b"], w, tmp_path / "a.html", decimals=0)
    with pytest.raises(ValueError, match="folder .* does not exist"):
        attention_html(["a", "b"], w, tmp_path / "missing" / "a.html")
    with pytest.raises(ValueError, match="must be a file name, got the folder"):
        attention_html(["a", "b"], w, tmp_path)
