"""The attention explorer page in a real headless Chromium: offline, error-free, faithful to the weights,
and interactive (controls, hover and keys change what is drawn; tokens are text, never markup)."""
from __future__ import annotations

import io

import numpy as np
import pytest

from attnkit.viz import attention_html

TOKENS = ["the", "cat", "sat", "on", "the", "mat", "because", "it", "was", "warm"]


def _weights(*shape, seed=0, sharpness=3.0):
    """Softmax rows of random scores: varied, peaked heads like a trained model's."""
    scores = np.random.default_rng(seed).normal(size=shape) * sharpness
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


def _open(watch, tmp_path, tokens=TOKENS, weights=None, **kwargs):
    weights = _weights(2, 3, len(tokens), len(tokens)) if weights is None else weights
    path = attention_html(tokens, weights, tmp_path / "attention.html", **kwargs)
    watch.page.goto(path.resolve().as_uri())
    watch.page.wait_for_function("() => window.attnkitData !== undefined", timeout=20_000)
    return weights


def _bound(weights: np.ndarray, bits: int = 8) -> np.ndarray:
    """The page's documented quantisation bound: each row's maximum / (2 (2**bits - 1)), plus float32 rounding."""
    top = np.asarray(weights, dtype=np.float64).max(-1, keepdims=True)
    return top / (2 * ((1 << bits) - 1)) + top * 2.0**-23


def _pixels(locator) -> np.ndarray:
    """A screenshot of one element as an (H, W, 3) uint8 array."""
    image_module = pytest.importorskip("PIL.Image", reason="screenshot comparison decodes PNGs with Pillow "
                                                          "(installed with the viz extra's matplotlib)")
    Image = image_module

    return np.asarray(Image.open(io.BytesIO(locator.screenshot())).convert("RGB"))


def _changed(a: np.ndarray, b: np.ndarray) -> int:
    """How many pixels differ between two screenshots of the same element."""
    assert a.shape == b.shape, f"the element changed size: {a.shape} -> {b.shape}"
    return int(np.any(a != b, axis=-1).sum())


def test_page_loads_nothing_from_the_network_and_logs_no_errors(watched_page, tmp_path):
    page = watched_page.page
    _open(watched_page, tmp_path)
    page.get_by_test_id("token").nth(2).hover()
    page.get_by_test_id("layer").select_option("1")
    page.get_by_test_id("head-thumb").nth(2).click()
    page.get_by_test_id("token").nth(0).click()
    for key in ("ArrowDown", "ArrowDown", "]", "[", "}", "{", "End", "Home", "Escape"):
        page.keyboard.press(key)
    page.get_by_test_id("heatmap").click(position={"x": 200, "y": 200})
    assert watched_page.blocked == []
    assert watched_page.errors == []


def test_the_network_watch_sees_and_blocks_a_request(watched_page):
    """The watch behind the no-network test does catch a page that reaches out."""
    watched_page.page.set_content('<img src="http://192.0.2.1/pixel.png" alt="">')
    # set_content returns after the load event, by which the image request has been routed (and aborted);
    # the poll only guards against a slow event delivery, it is not a timing assumption
    for _ in range(200):
        if watched_page.blocked:
            break
        watched_page.page.wait_for_timeout(50)
    assert watched_page.blocked == ["http://192.0.2.1/pixel.png"]


@pytest.mark.parametrize("shape", [(2, 3, 10, 10), (4, 10, 10), (10, 10)])
def test_window_data_equals_the_weights_to_8_bits_of_each_row(watched_page, tmp_path, shape):
    weights = _weights(*shape, seed=1).astype(np.float32)
    _open(watched_page, tmp_path, weights=weights)
    data = watched_page.page.evaluate("window.attnkitData")
    assert data["tokens"] == TOKENS and data["raw_tokens"] == TOKENS and data["bits"] == 8
    got = np.array(data["attention"])  # (N, H, L, L)
    want = weights.reshape((1,) * (4 - weights.ndim) + weights.shape).astype(np.float64)
    assert got.shape == want.shape
    assert (np.abs(got - want) <= _bound(want)).all()
    assert np.max(np.abs(got - want)) > 0  # quantised, not the full float text
    assert watched_page.page.get_by_test_id("token").count() == len(TOKENS)
    assert watched_page.page.get_by_test_id("layer").locator("option").count() == want.shape[0]
    assert watched_page.page.get_by_test_id("head").locator("option").count() == want.shape[1]


def test_layer_and_head_controls_change_the_drawing(watched_page, tmp_path):
    page = watched_page.page
    _open(watched_page, tmp_path)
    heatmap, lines = page.get_by_test_id("heatmap"), page.locator("#lines-canvas")
    first_heat, first_lines = _pixels(heatmap), _pixels(lines)
    assert _changed(first_heat, _pixels(heatmap)) == 0  # the drawing is stable, so differences mean something

    page.get_by_test_id("head").select_option("2")
    assert _changed(first_heat, _pixels(heatmap)) > 500
    assert _changed(first_lines, _pixels(lines)) > 200
    page.get_by_test_id("head").select_option("0")
    assert _changed(first_heat, _pixels(heatmap)) == 0

    page.get_by_test_id("layer").select_option("1")
    assert _changed(first_heat, _pixels(heatmap)) > 500
    assert page.evaluate("[window.attnkitExplorer.state.layer, window.attnkitExplorer.state.head]") == [1, 0]


def test_hovering_a_token_highlights_its_row_and_column(watched_page, tmp_path):
    page = watched_page.page
    weights = _open(watched_page, tmp_path)
    heatmap, lines = page.get_by_test_id("heatmap"), page.locator("#lines-canvas")
    before_heat, before_lines = _pixels(heatmap), _pixels(lines)
    token = page.get_by_test_id("token").nth(3)
    token.hover()
    assert _changed(before_heat, _pixels(heatmap)) > 100
    assert _changed(before_lines, _pixels(lines)) > 200
    status = page.get_by_role("status").inner_text()
    shown = np.array(page.evaluate("window.attnkitExplorer.weights(0, 0)"))  # (L, L) as the page decoded it
    assert (np.abs(shown - weights[0, 0]) <= _bound(weights[0, 0])).all()
    best = int(np.argmax(shown[3]))
    assert f"Token 3 \u201con\u201d attends most to token {best} \u201c{TOKENS[best]}\u201d" in status
    # The keys it attends to are tinted in proportion to the weight.
    tints = page.get_by_test_id("key").evaluate_all("els => els.map(e => getComputedStyle(e).backgroundColor)")
    strongest = int(np.argmax(weights[0, 0, 3]))
    assert tints[strongest] != tints[int(np.argmin(weights[0, 0, 3]))]
    page.mouse.move(5, 5)  # leaving the token clears an unpinned highlight
    assert _changed(before_heat, _pixels(heatmap)) == 0


def test_all_layers_by_all_heads_grid_selects_the_clicked_head(watched_page, tmp_path):
    page = watched_page.page
    _open(watched_page, tmp_path)  # 2 layers x 3 heads
    thumbs = page.get_by_test_id("head-thumb")
    assert thumbs.count() == 6
    assert _changed(_pixels(thumbs.nth(0).locator("canvas")), _pixels(thumbs.nth(1).locator("canvas"))) > 50
    thumbs.nth(3 + 2).click()  # layer 1, head 2
    assert page.get_by_test_id("layer").input_value() == "1"
    assert page.get_by_test_id("head").input_value() == "2"
    assert thumbs.nth(5).get_attribute("aria-pressed") == "true"
    assert thumbs.nth(2).get_attribute("aria-pressed") == "false"
    assert page.get_by_role("button", name="select layer 0, head 1").count() == 1


def test_keyboard_moves_the_token_focus_and_switches_heads_and_layers(watched_page, tmp_path):
    page = watched_page.page
    _open(watched_page, tmp_path)
    page.get_by_test_id("token").nth(0).click()
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")
    assert page.evaluate("document.activeElement.dataset.index") == "2"
    assert page.evaluate("window.attnkitExplorer.state.focus") == 2
    assert page.get_by_test_id("token").nth(2).get_attribute("aria-selected") == "true"
    page.keyboard.press("ArrowUp")
    assert page.evaluate("document.activeElement.dataset.index") == "1"
    page.keyboard.press("End")
    assert page.evaluate("window.attnkitExplorer.state.focus") == len(TOKENS) - 1
    page.keyboard.press("]")
    page.keyboard.press("]")
    assert page.get_by_test_id("head").input_value() == "2"
    page.keyboard.press("]")  # wraps around
    assert page.get_by_test_id("head").input_value() == "0"
    page.keyboard.press("[")
    assert page.get_by_test_id("head").input_value() == "2"
    page.keyboard.press("}")
    assert page.get_by_test_id("layer").input_value() == "1"
    page.keyboard.press("Escape")
    assert page.evaluate("window.attnkitExplorer.state.focus") is None


def test_controls_and_tokens_have_readable_labels(watched_page, tmp_path):
    page = watched_page.page
    _open(watched_page, tmp_path, layer_names=["encoder 0", "encoder 1"])
    assert page.get_by_role("combobox", name="Layer").input_value() == "0"
    assert page.get_by_role("combobox", name="Head").input_value() == "0"
    assert page.get_by_test_id("layer").locator("option").all_inner_texts() == ["encoder 0", "encoder 1"]
    assert page.get_by_test_id("token").nth(1).get_attribute("aria-label") == "token 1: cat"
    assert "encoder 0, head 0" in page.get_by_test_id("heatmap").get_attribute("aria-label")
    assert page.get_by_role("button", name="select encoder 1, head 1").count() == 1


def test_markup_in_tokens_and_title_is_shown_as_text(watched_page, tmp_path):
    page = watched_page.page
    tokens = ["<script>window.injected = 1</script>", "<img src=x onerror=\"window.injected = 2\">",
              "a & b", "</script><b>bold</b>"]
    _open(watched_page, tmp_path, tokens=tokens, weights=_weights(1, 2, 4, 4), title="<i>title</i> & co")
    assert page.evaluate("window.injected") is None
    assert page.get_by_test_id("token").all_inner_texts() == tokens
    assert page.evaluate("window.attnkitData.tokens") == tokens
    assert page.locator("h1").inner_text() == "<i>title</i> & co"
    assert page.title() == "<i>title</i> & co"
    assert page.locator("img, b, i").count() == 0
    assert page.locator("script").count() == 2  # the data and the page's own script, nothing more
    assert watched_page.errors == []


def test_colour_scale_auto_unit_and_log_with_its_legend(watched_page, tmp_path):
    page = watched_page.page
    weights = _weights(1, 2, 10, 10, sharpness=0.3)  # a diffuse head: its maximum is far below 1
    _open(watched_page, tmp_path, weights=weights)
    heatmap, legend = page.get_by_test_id("heatmap"), page.get_by_test_id("legend")
    shown_max = np.array(page.evaluate("window.attnkitExplorer.weights(0, 0)")).max()
    assert legend.get_attribute("data-scale") == "auto"
    assert float(legend.get_attribute("data-max")) == pytest.approx(shown_max, rel=1e-12)
    assert f"{shown_max:.3f}" in legend.inner_text()
    auto = _pixels(heatmap)
    page.get_by_test_id("scale").select_option("unit")
    assert legend.get_attribute("data-max") == "1" and "0..1" in legend.inner_text()
    unit = _pixels(heatmap)
    assert _changed(auto, unit) > 500
    assert unit[40:, 40:].astype(int).sum() > auto[40:, 40:].astype(int).sum()  # 0..1 draws a diffuse head paler
    page.get_by_test_id("scale").select_option("log")
    assert legend.get_attribute("data-scale") == "log" and "log" in legend.inner_text()
    assert float(legend.get_attribute("data-min")) == pytest.approx(shown_max * 1e-3, rel=1e-12)
    assert _changed(unit, _pixels(heatmap)) > 500
    assert watched_page.errors == [] and watched_page.blocked == []


def test_tokens_show_their_raw_piece_on_hover(watched_page, tmp_path):
    page = watched_page.page
    tokens, raw = [" the", " cat", "\u21b5"], ["\u0120the", "\u0120cat", "\u010a"]
    _open(watched_page, tmp_path, tokens=tokens, weights=_weights(1, 1, 3, 3), raw_tokens=raw)
    assert page.get_by_test_id("token").all_inner_texts() == tokens
    assert page.get_by_test_id("token").nth(1).get_attribute("title") == "raw: \u0120cat (position 1)"
    assert page.get_by_test_id("key").nth(2).get_attribute("title") == "raw: \u010a (position 2)"
    assert page.evaluate("window.attnkitData.raw_tokens") == raw


def test_1024_tokens_thin_the_labels_and_draw_one_tokens_lines(watched_page, tmp_path):
    page = watched_page.page
    n = 1024
    weights = _weights(1, 2, n, n, sharpness=2.0).astype(np.float32)
    tokens = [f"w{i}" for i in range(n)]
    _open(watched_page, tmp_path, tokens=tokens, weights=weights)
    every = int(page.get_by_test_id("heatmap").get_attribute("data-label-every"))
    assert every > 1 and n / every <= 200  # at most one label per 12 pixels of a 2-pixel cell
    lines = page.locator("#lines-canvas")
    assert lines.get_attribute("data-lines") == "none"
    assert "select a token" in page.get_by_test_id("lines-note").inner_text()
    page.evaluate("window.attnkitExplorer.focusToken(700)")
    assert lines.get_attribute("data-lines") == "selected"
    assert "Token 700 \u201cw700\u201d attends most to token" in page.get_by_role("status").inner_text()
    shown = np.array(page.evaluate("window.attnkitExplorer.weights(0, 1)"))
    assert (np.abs(shown - weights[0, 1]) <= _bound(weights[0, 1])).all()
    assert watched_page.errors == [] and watched_page.blocked == []


def test_cross_attention_has_query_and_key_tokens(watched_page, tmp_path):
    page = watched_page.page
    queries, keys = ["<s>", "le", "chat"], ["the", "cat", "sat", "</s>"]
    weights = _weights(2, 2, 3, 4)
    _open(watched_page, tmp_path, tokens=keys, weights=weights, query_tokens=queries)
    data = page.evaluate("window.attnkitData")
    assert data["query_tokens"] == queries and data["tokens"] == keys
    got = np.array(data["attention"])
    assert got.shape == (2, 2, 3, 4) and (np.abs(got - weights) <= _bound(weights)).all()
    assert page.get_by_test_id("token").all_inner_texts() == queries
    assert page.get_by_test_id("key").all_inner_texts() == keys
    page.get_by_test_id("key").nth(1).hover()
    best = int(np.argmax(got[0, 0, :, 1]))
    assert f"Token 1 \u201ccat\u201d is attended to most by token {best} \u201c{queries[best]}\u201d" in \
        page.get_by_role("status").inner_text()
    page.get_by_test_id("token").nth(2).click()
    assert page.evaluate("window.attnkitExplorer.state.focus") == 2
    assert watched_page.errors == [] and watched_page.blocked == []


def test_a_30_layer_9_head_256_token_page_opens_and_decodes(watched_page, tmp_path):
    page = watched_page.page
    weights = _weights(30, 9, 256, 256, seed=2).astype(np.float32)  # dense, peaked: the budget's worst case
    path = attention_html([f"t{i}" for i in range(256)], weights, tmp_path / "big.html")
    assert path.stat().st_size <= 5_000_000
    page.goto(path.resolve().as_uri())
    page.wait_for_function("() => window.attnkitData !== undefined", timeout=60_000)
    bits = page.evaluate("window.attnkitData.bits")
    for layer, head in ((0, 0), (17, 4), (29, 8)):
        shown = np.array(page.evaluate(f"window.attnkitExplorer.weights({layer}, {head})"))
        assert (np.abs(shown - weights[layer, head]) <= _bound(weights[layer, head], bits)).all()
    assert page.get_by_test_id("head-thumb").count() == 270
    page.get_by_test_id("head-thumb").nth(9 * 17 + 4).click()
    assert page.evaluate("[window.attnkitExplorer.state.layer, window.attnkitExplorer.state.head]") == [17, 4]
    assert watched_page.errors == [] and watched_page.blocked == []
