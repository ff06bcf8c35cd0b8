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
    watch.page.wait_for_function("window.attnkitData !== undefined")
    return weights


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
def test_window_data_equals_the_weights_rounded(watched_page, tmp_path, shape):
    weights = _weights(*shape, seed=1).astype(np.float32)
    _open(watched_page, tmp_path, weights=weights)
    data = watched_page.page.evaluate("window.attnkitData")
    assert data["tokens"] == TOKENS
    got = np.array(data["attention"])  # (N, H, L, L)
    want = weights.reshape((1,) * (4 - weights.ndim) + weights.shape).astype(np.float64)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= 0.5e-4 + 1e-7
    assert np.max(np.abs(got - want)) > 0  # rounded, not the full float64 text
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
    best = int(np.argmax(np.round(weights[0, 0, 3], 4)))
    assert f"Token 3 \u201con\u201d attends most to token {best} \u201c{TOKENS[best]}\u201d" in status
    # The keys it attends to are tinted in proportion to the weight.
    tints = page.get_by_test_id("key").evaluate_all("els => els.map(e => getComputedStyle(e).backgroundColor)")
    strongest = int(np.argmax(weights[0, 0, 3]))
    assert tints[strongest] != tints[int(np.argmin(weights[0, 0, 3]))]
    page.mouse.move(5, 5)  # leaving the token clears an unpinned highlight
    assert _changed(before_heat, _pixels(heatmap)) == 0


def test_all_heads_overview_selects_the_clicked_head(watched_page, tmp_path):
    page = watched_page.page
    _open(watched_page, tmp_path)
    thumbs = page.get_by_test_id("head-thumb")
    assert thumbs.count() == 3
    assert _changed(_pixels(thumbs.nth(0).locator("canvas")), _pixels(thumbs.nth(1).locator("canvas"))) > 50
    thumbs.nth(2).click()
    assert page.get_by_test_id("head").input_value() == "2"
    assert thumbs.nth(2).get_attribute("aria-pressed") == "true"
    assert thumbs.nth(0).get_attribute("aria-pressed") == "false"


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
    assert page.get_by_role("button", name="select head 1").count() == 1


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
