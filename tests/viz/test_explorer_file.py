"""attention_html without a browser: the file is self-contained, small, escaped, atomically written, and
bad input is refused with a message naming the argument."""
from __future__ import annotations

import base64
import json
import os
import re
import warnings
import zlib

import numpy as np
import pytest

from attnkit import viz
from attnkit.models import CausalLM, DecoderConfig, MLPConfig
from attnkit.viz import HTML_SIZE_WARNING_BYTES, attention_html, encode_attention


def _weights(*shape, seed=0):
    w = np.random.default_rng(seed).random(shape)
    return w / w.sum(-1, keepdims=True)


def _embedded(path) -> dict:
    """The JSON the page embeds (what the page's script parses into window.attnkitData)."""
    text = path.read_text(encoding="utf-8")
    match = re.search(r'<script type="application/json" id="attnkit-data">(.*?)</script>', text, flags=re.DOTALL)
    assert match, "no embedded data"
    return json.loads(match.group(1))


def decoded(encoding: dict) -> np.ndarray:
    """The weights a page decodes from its ``attention`` entry: codes x row maximum / (2**bits - 1)."""
    shape = tuple(encoding["shape"])
    q = np.frombuffer(zlib.decompress(base64.b64decode(encoding["q"])), np.uint8).reshape(shape)
    scale = np.frombuffer(base64.b64decode(encoding["scale"]), "<f4").reshape(shape[:-1])
    return q * scale[..., None].astype(np.float64) / ((1 << encoding["bits"]) - 1)


def bound(weights: np.ndarray, bits: int) -> np.ndarray:
    """The documented quantisation bound of every weight: its row's maximum / (2 (2**bits - 1)), plus float32
    rounding of that maximum."""
    top = np.asarray(weights, dtype=np.float64).max(-1, keepdims=True)
    return top / (2 * ((1 << bits) - 1)) + top * 2.0**-23


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
    got = decoded(data["attention"])
    assert got.shape == expected and data["attention"]["bits"] == 8
    assert (np.abs(got - w.reshape(expected)) <= bound(w.reshape(expected), 8)).all()
    assert data["layer_names"] == [f"layer {i}" for i in range(expected[0])]
    assert data["head_names"] == [f"head {j}" for j in range(expected[1])]


def test_weights_keep_8_bits_per_row_unless_the_budget_asks_for_fewer(tmp_path):
    w = _weights(2, 4, 30, 30)
    data = _embedded(attention_html([str(i) for i in range(30)], w, tmp_path / "a.html"))
    err = np.abs(decoded(data["attention"]) - w)
    assert data["attention"]["bits"] == 8 and (err <= bound(w, 8)).all() and err.max() > 0
    assert (decoded(data["attention"]).max(-1) == np.float32(w.max(-1))).all()  # each row's maximum is kept
    w = _weights(4, 8, 100, 100)  # noise: about a byte per weight at 8 bits
    path = attention_html([str(i) for i in range(100)], w, tmp_path / "b.html", max_bytes=250_000)
    data = _embedded(path)
    bits = data["attention"]["bits"]
    assert 3 <= bits < 8 and path.stat().st_size <= 250_000
    assert (np.abs(decoded(data["attention"]) - w) <= bound(w, bits)).all()


def test_encode_attention_rounds_each_row_to_its_maximum():
    w = np.array([[0.5, 0.25, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    for bits in (3, 8):
        enc = encode_attention(w, bits)
        got = decoded(enc)
        assert got.shape == w.shape and (np.abs(got - w) <= bound(w, bits)).all()
        assert (got[1] == 0).all()  # an all-zero row stays zero
    with pytest.raises(ValueError, match="bits must be an int from 3 to 8, got 9"):
        encode_attention(w, 9)


def _decoder_weights(layers, heads, length, seed=0):
    """The attention of a randomly initialised decoder (what a fresh model, or one whose weights are noise to
    the eye, gives): causal, near-uniform rows that deflate poorly."""
    cfg = DecoderConfig(family="llama", vocab_size=64, hidden_size=heads * 8, num_layers=layers, num_heads=heads,
                        num_kv_heads=heads // 3, head_dim=8, mlp=MLPConfig(32))
    lm = CausalLM(cfg, rng=seed)
    _, per_layer = lm(np.random.default_rng(seed).integers(0, 64, (1, length)), output_attentions=True)
    return np.stack([w[0] for w in per_layer])  # (N, H, L, L)


@pytest.mark.parametrize("kind", ["random decoder", "dense peaked"])
def test_30_layers_9_heads_256_tokens_fit_in_5_mb(tmp_path, kind):
    if kind == "random decoder":
        w = _decoder_weights(30, 9, 256)
    else:  # no mask, softmax of random scores: the worst case for the deflation
        scores = np.random.default_rng(1).normal(size=(30, 9, 256, 256)).astype(np.float32) * 3
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = attention_html([f"t{i}" for i in range(256)], w, tmp_path / "big.html")
    size = path.stat().st_size
    assert size <= HTML_SIZE_WARNING_BYTES, f"{size / 1e6:.2f} MB"
    data = _embedded(path)
    bits = data["attention"]["bits"]
    assert bits >= 3
    err = np.abs(decoded(data["attention"]) - w)
    assert (err <= bound(w, bits)).all()
    print(f"{kind}: {size / 1e6:.2f} MB at {bits} bits per weight")


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


def test_warns_when_even_3_bits_exceed_the_budget(tmp_path):
    w = _weights(1, 12, 100, 100)
    with pytest.warns(UserWarning, match=r"MB .*1 layers x 12 heads x 100 x 100 weights at 3 bits"):
        path = attention_html([str(i) for i in range(100)], w, tmp_path / "big.html", max_bytes=50_000)
    assert path.stat().st_size > 50_000
    assert _embedded(path)["attention"]["bits"] == 3
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
    with pytest.raises(ValueError, match="max_bytes must be positive, got 0"):
        attention_html(["a", "b"], w, tmp_path / "a.html", max_bytes=0)
    with pytest.raises(ValueError, match="raw_tokens has 1 tokens, but the weights have 2 keys"):
        attention_html(["a", "b"], w, tmp_path / "a.html", raw_tokens=["x"])
    with pytest.raises(ValueError, match="folder .* does not exist"):
        attention_html(["a", "b"], w, tmp_path / "missing" / "a.html")
    with pytest.raises(ValueError, match="must be a file name, got the folder"):
        attention_html(["a", "b"], w, tmp_path)
