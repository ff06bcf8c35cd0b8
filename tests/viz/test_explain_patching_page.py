"""``attnkit explain --corrupt-ids``: the page holds activation patching equal to the library's, and in a real
headless Chromium its table shows it, per position and per head."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.cli import main  # noqa: E402
from attnkit.explain import activation_patching  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import saved_model  # noqa: E402

IDS = [5, 17, 3, 60, 42, 9, 77, 21]
CORRUPT = [5, 17, 8, 60, 42, 30, 77, 21]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(folder, page, printed lines) of ``attnkit explain --corrupt-ids`` on a tiny Llama."""
    root = tmp_path_factory.mktemp("explain_patching")
    folder, _ = saved_model("llama_gqa", root)
    page = root / "patching.html"
    capture = root / "out.txt"
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["explain", str(folder), "--ids", ",".join(map(str, IDS)), "--corrupt-ids",
                     ",".join(map(str, CORRUPT)), "--html", str(page), "--candidates", "2"]) == 0
    capture.write_text(buffer.getvalue())
    return folder, page, buffer.getvalue()


def _embedded(page) -> dict:
    text = page.read_text(encoding="utf-8")
    return json.loads(re.search(r'id="attnkit-data" type="application/json">(.*?)</script>', text,
                                flags=re.DOTALL).group(1))


def test_page_patching_equals_the_library(written):
    folder, page, printed = written
    lm = load_causal_lm(folder)
    patching = _embedded(page)["patching"]
    clean_logits, corrupt_logits = lm(np.array([IDS]))[0, -1], lm(np.array([CORRUPT]))[0, -1]
    assert patching["correct"] == int(clean_logits.argmax())
    assert patching["incorrect"] in (int(corrupt_logits.argmax()), int(np.argsort(-clean_logits)[1]))
    assert patching["incorrect"] != patching["correct"]
    answers = (patching["correct"], patching["incorrect"])
    np.testing.assert_allclose(patching["resid_pre"], activation_patching(lm, IDS, CORRUPT, answers), atol=1e-6)
    np.testing.assert_allclose(patching["z"], activation_patching(lm, IDS, CORRUPT, answers, hook="z"), atol=1e-6)
    np.testing.assert_allclose(patching["corrupt_metric"], corrupt_logits[answers[0]] - corrupt_logits[answers[1]],
                               atol=1e-6)
    # block 0's residual at every position where the prompts agree is the corrupted run unchanged
    same = [i for i in range(len(IDS)) if IDS[i] == CORRUPT[i]]
    np.testing.assert_allclose(np.array(patching["resid_pre"])[0, same], patching["corrupt_metric"], atol=1e-5)
    assert "patching: logit[" in printed and "on the prompt" in printed


def test_in_chromium_the_table_shows_positions_then_heads(written, watched_page):
    folder, page_file, _ = written
    patching = _embedded(page_file)["patching"]
    page = watched_page.page
    page.goto(page_file.as_uri())
    page.wait_for_selector("body[data-ready='true']", timeout=10_000)
    assert page.locator("#patch-panel").is_visible()

    def table():
        rows = page.locator("[data-testid=patching] tr")
        return [[float(cell.get_attribute("data-score")) for cell in rows.nth(r).locator("td").all()]
                for r in range(1, rows.count())]

    shown = table()  # the last layer first, as the logit lens
    np.testing.assert_allclose(shown[::-1], patching["resid_pre"], atol=1e-9)
    page.select_option("[data-testid=patch-what]", "z")
    np.testing.assert_allclose(table()[::-1], patching["z"], atol=1e-9)
    assert watched_page.blocked == [] and watched_page.errors == []


def test_cli_refuses_a_corrupted_prompt_of_another_length(tmp_path, capsys):
    folder, _ = saved_model("gpt2", tmp_path)
    assert main(["explain", str(folder), "--ids", "4,8,15", "--corrupt-ids", "4,8", "--html",
                 str(tmp_path / "x.html")]) == 2
    assert "the corrupted prompt has 2 tokens but the prompt has 3" in capsys.readouterr().err
    assert main(["explain", str(folder), "--ids", "4,8,15", "--corrupt-ids", "4,8,9", "--corrupt", "a b c",
                 "--html", str(tmp_path / "x.html")]) == 2
    assert "give the corrupted prompt once" in capsys.readouterr().err
