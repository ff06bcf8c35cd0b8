"""``attnkit explain --generate``: the page holds each candidate's direct logit attribution and the generation's
per-token attribution matrix equal to the library's, and in a real headless Chromium its heat maps show them."""
from __future__ import annotations

import contextlib
import io
import json
import re

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.cli import main  # noqa: E402
from attnkit.explain import direct_logit_attribution, generation_attribution  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import saved_model  # noqa: E402

IDS = [5, 17, 3, 60, 42, 9, 77, 21]
CORRUPT = [5, 17, 8, 60, 42, 30, 77, 21]
NEW = 4


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(folder, page, printed) of ``attnkit explain --generate --corrupt-ids`` on a tiny Llama."""
    root = tmp_path_factory.mktemp("explain_shares")
    folder, _ = saved_model("llama_gqa", root)
    page = root / "shares.html"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["explain", str(folder), "--ids", ",".join(map(str, IDS)), "--corrupt-ids",
                     ",".join(map(str, CORRUPT)), "--generate", str(NEW), "--html", str(page),
                     "--candidates", "3"]) == 0
    return folder, page, buffer.getvalue()


def _embedded(page) -> dict:
    text = page.read_text(encoding="utf-8")
    return json.loads(re.search(r'id="attnkit-data" type="application/json">(.*?)</script>', text,
                                flags=re.DOTALL).group(1))


def test_page_data_equals_the_library(written):
    folder, page, printed = written
    lm = load_causal_lm(folder)
    data = _embedded(page)
    for candidate in data["candidates"]:
        parts = direct_logit_attribution(lm, IDS, candidate["id"])
        shares = candidate["dla"]
        np.testing.assert_allclose(shares["heads"], parts["heads"], atol=1e-6)
        np.testing.assert_allclose(shares["mlp"], parts["mlp"], atol=1e-6)
        np.testing.assert_allclose(shares["embed"], parts["embed"] + parts["pos_embed"], atol=1e-6)
        total = np.sum(shares["heads"]) + np.sum(shares["mlp"]) + shares["embed"] + shares["bias"]
        np.testing.assert_allclose(total, shares["logit"], atol=1e-4)  # six decimals on 2 x 4 + 2 + 2 numbers
        np.testing.assert_allclose(shares["logit"], lm(np.array([IDS]))[0, -1, candidate["id"]], atol=1e-6)
    found = generation_attribution(lm, IDS, max_new_tokens=NEW)
    generation = data["generation"]
    assert generation["prompt_length"] == len(IDS) and len(generation["tokens"]) == len(IDS) + NEW
    assert generation["tokens"][len(IDS):] == [str(t) for t in found.targets]
    np.testing.assert_allclose(generation["attributions"], found.attributions, atol=1e-6)
    assert f"generated: '{''.join(str(t) for t in found.targets)}'; attributed each of its {NEW} tokens" in printed


def _cells(page, testid):
    rows = page.locator(f"[data-testid={testid}] tr")
    return [[float(cell.get_attribute("data-score")) for cell in rows.nth(r).locator("td").all()]
            for r in range(1, rows.count())]


def test_in_chromium_the_heat_maps_show_the_shares_and_the_matrix(written, watched_page):
    _, page_file, _ = written
    data = _embedded(page_file)
    page = watched_page.page
    page.goto(page_file.as_uri())
    page.wait_for_selector("body[data-ready='true']", timeout=10_000)
    for panel in ("#dla-panel", "#gen-panel", "#patch-panel"):
        assert page.locator(panel).is_visible(), panel
    for k in (0, 2):  # the picked output token's shares: heads then the MLP, the last layer first
        page.locator("[data-testid=candidate]").nth(k).click()
        shares = data["candidates"][k]["dla"]
        assert page.locator("[data-testid=dla]").get_attribute("data-target") == str(data["candidates"][k]["id"])
        want = np.concatenate([np.array(shares["heads"]), np.array(shares["mlp"])[:, None]], axis=1)[::-1]
        np.testing.assert_allclose(_cells(page, "dla"), want, atol=1e-9)
        rest = page.locator("[data-testid=dla-rest]")
        assert float(rest.get_attribute("data-logit")) == shares["logit"]
        assert float(page.locator("[data-testid=dla-legend]").get_attribute("data-max")) == \
            pytest.approx(np.abs(want).max())
    np.testing.assert_allclose(_cells(page, "generation"), data["generation"]["attributions"], atol=1e-9)
    # a generated token's row is blank (grey) from its own position on
    first = page.locator("[data-testid=generation] tr").nth(1).locator("td")
    assert first.nth(len(IDS) - 1).text_content() != "" and first.nth(len(IDS)).text_content() == ""
    assert first.nth(len(IDS)).get_attribute("class") == "after"
    assert float(page.locator("[data-testid=patch-legend]").get_attribute("data-max")) == 1.0
    assert watched_page.blocked == [] and watched_page.errors == []


def test_cli_refuses_a_generation_past_the_positions(tmp_path, capsys):
    folder, _ = saved_model("gpt2", tmp_path)  # 64 learned positions
    capsys.readouterr()  # transformers' progress bar while saving
    ids = ",".join(["4"] * 60)
    assert main(["explain", str(folder), "--ids", ids, "--generate", "5", "--html", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err
    assert "the prompt's 60 tokens and --generate 5 are more than the model's 64 positions" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert main(["explain", str(folder), "--ids", "4,8", "--generate", "0", "--html", str(tmp_path / "x.html")]) == 2
    assert "argument --generate: must be a positive integer, got 0" in capsys.readouterr().err
