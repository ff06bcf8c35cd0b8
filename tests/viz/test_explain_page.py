"""``attnkit explain`` and ``explain_html``: the page in a real headless Chromium holds the library's numbers,
requests nothing, logs no errors, and its output-token picker changes the attribution shown."""
from __future__ import annotations

import base64
import json
import re
import zlib

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.cli import main  # noqa: E402
from attnkit.explain import (  # noqa: E402
    attention_flow,
    attention_rollout,
    gradient_x_input,
    logit_lens,
    saliency,
)
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import saved_model  # noqa: E402

IDS = [5, 17, 3, 60, 42, 9, 77, 21]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(folder, page) of ``attnkit explain`` on a tiny Llama, and the lines it printed."""
    root = tmp_path_factory.mktemp("explain")
    folder, _ = saved_model("llama_gqa", root)
    page = root / "explain.html"
    assert main(["explain", str(folder), "--ids", ",".join(map(str, IDS)), "--html", str(page),
                 "--candidates", "3"]) == 0
    return folder, page


def _embedded(page) -> dict:
    text = page.read_text(encoding="utf-8")
    return json.loads(re.search(r'id="attnkit-data" type="application/json">(.*?)</script>', text,
                                flags=re.DOTALL).group(1))


def test_page_data_equals_the_library(written):
    folder, page = written
    lm = load_causal_lm(folder)
    data = _embedded(page)
    ids = np.array(IDS)
    lens = logit_lens(lm, ids, top_k=5)
    np.testing.assert_array_equal(data["lens"]["ids"], lens.token_ids)
    np.testing.assert_allclose(data["lens"]["probs"], lens.probs, atol=0.5e-4 + 1e-7)
    assert [c["id"] for c in data["candidates"]] == logit_lens(lm, ids, top_k=3).token_ids[-1, -1].tolist()
    for c in data["candidates"]:
        np.testing.assert_allclose(c["gradient_x_input"], gradient_x_input(lm, ids, target_token=c["id"]), atol=1e-6)
        np.testing.assert_allclose(c["saliency"], saliency(lm, ids, target_token=c["id"]), atol=1e-6)
    _, per_layer = lm(ids[None], output_attentions=True)
    weights = np.stack([w[0] for w in per_layer])  # (N, H, L, L)
    np.testing.assert_allclose(data["rollout"], attention_rollout(weights), atol=1e-6)
    np.testing.assert_allclose(data["flow"], attention_flow(weights), atol=1e-6)  # 8 tokens: short enough
    q = np.frombuffer(zlib.decompress(base64.b64decode(data["attention"]["q"])), np.uint8).reshape(weights.shape)
    scale = np.frombuffer(base64.b64decode(data["attention"]["scale"]), "<f4").reshape(weights.shape[:-1])
    assert data["attention"]["bits"] == 8 and data["attention"]["shape"] == list(weights.shape)
    decoded = q * scale[..., None].astype(np.float64) / 255.0
    assert (np.abs(decoded - weights) <= weights.max(-1, keepdims=True) * (1 / 510 + 2.0**-23)).all()
    assert all(data["vocab"][str(t)] == str(t) for t in np.unique(lens.token_ids))  # no tokenizer: ids as text


def test_in_chromium_no_requests_no_errors_and_the_picker_changes_the_view(written, watched_page):
    folder, page_file = written
    page = watched_page.page
    page.goto(page_file.as_uri())
    page.wait_for_selector("body[data-ready='true']", timeout=10_000)
    lm = load_causal_lm(folder)
    ids = np.array(IDS)
    # The page's decoded attention equals the model's to 8 bits of each row's maximum.
    _, per_layer = lm(ids[None], output_attentions=True)
    shown = np.array(page.evaluate("window.attnkitExplain.attention(1, 2)"))
    want = per_layer[1][0, 2]
    assert np.abs(shown - want).max() <= want.max() / 510 + 1e-6

    def scores():
        cells = page.locator("[data-testid=attribution] .tok")
        return [float(cells.nth(i).get_attribute("data-score")) for i in range(cells.count())]

    first = scores()
    np.testing.assert_allclose(first, gradient_x_input(lm, ids), atol=1e-5)
    buttons = page.locator("[data-testid=candidate]")
    assert buttons.count() == 3
    buttons.nth(1).click()
    second_target = int(page.locator("[data-testid=attribution]").get_attribute("data-target"))
    assert second_target == logit_lens(lm, ids, top_k=3).token_ids[-1, -1, 1]
    second = scores()
    np.testing.assert_allclose(second, gradient_x_input(lm, ids, target_token=second_target), atol=1e-5)
    assert not np.allclose(first, second, atol=1e-4)
    assert buttons.nth(1).get_attribute("aria-pressed") == "true"
    page.select_option("[data-testid=method]", "saliency")
    np.testing.assert_allclose(scores(), saliency(lm, ids, target_token=second_target), atol=1e-5)
    # Every head of every layer has a thumbnail; clicking one selects it.
    assert page.locator("[data-testid=thumbs] canvas").count() == lm.config.num_layers * lm.config.num_heads
    page.locator("[data-testid=thumbs] canvas").nth(lm.config.num_heads + 3).click()
    assert page.input_value("[data-testid=layer]") == "1" and page.input_value("[data-testid=head]") == "3"
    # Rollout and attention flow shade the prompt by the last position's row.
    chips = page.locator("[data-testid=rollout-tokens] .tok")
    rollout_row = [float(chips.nth(i).get_attribute("data-score")) for i in range(chips.count())]
    np.testing.assert_allclose(rollout_row, attention_rollout(np.stack([w[0] for w in per_layer]))[-1], atol=1e-6)
    page.select_option("[data-testid=measure]", "flow")
    flow_row = [float(chips.nth(i).get_attribute("data-score")) for i in range(chips.count())]
    np.testing.assert_allclose(flow_row, attention_flow(np.stack([w[0] for w in per_layer]))[-1], atol=1e-6)
    page.select_option("[data-testid=scale]", "log")
    assert "(log)" in page.locator("[data-testid=legend]").inner_text()
    assert page.locator("[data-testid=lens] tr").count() == lm.config.num_layers + 1
    assert watched_page.blocked == [] and watched_page.errors == []


def test_cli_says_what_it_wrote_and_rejects_bad_input(tmp_path, capsys):
    folder, _ = saved_model("gpt2", tmp_path)
    page = tmp_path / "gpt2.html"
    assert main(["explain", str(folder), "--ids", "4,8,15,16", "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "next token:" in out and f"wrote {page}" in out and page.stat().st_size > 0
    assert main(["explain", str(tmp_path), "--ids", "1,2", "--html", str(tmp_path / "x.html")]) == 2
    assert "is not a Hugging Face causal-LM folder" in capsys.readouterr().err
    assert main(["explain", str(folder), "--html", str(tmp_path / "x.html")]) == 2
    assert "give the prompt once" in capsys.readouterr().err
    assert main(["explain", str(folder), "--ids", "1,2", "--html", str(tmp_path / "x.png")]) == 2


def test_a_30_layer_9_head_256_token_page_stays_under_5_mb(tmp_path):
    from attnkit.explain import explain_html
    from attnkit.models import CausalLM, DecoderConfig, MLPConfig

    cfg = DecoderConfig(family="llama", vocab_size=96, hidden_size=72, num_layers=30, num_heads=9, num_kv_heads=3,
                        head_dim=8, mlp=MLPConfig(64))
    lm = CausalLM(cfg, rng=0)  # randomly initialised: near-uniform causal rows, the encoding's hard case
    ids = np.random.default_rng(0).integers(0, 96, 256)
    page = tmp_path / "big.html"
    data = explain_html(lm, ids, page)
    assert data["flow"] is None  # 256 tokens: L * L maximum flows would take minutes
    assert page.stat().st_size <= 5_000_000, f"{page.stat().st_size / 1e6:.2f} MB"
    bits = data["bits"]
    enc = _embedded(page)["attention"]
    q = np.frombuffer(zlib.decompress(base64.b64decode(enc["q"])), np.uint8).reshape(enc["shape"])
    scale = np.frombuffer(base64.b64decode(enc["scale"]), "<f4").reshape(enc["shape"][:-1])
    _, per_layer = lm(ids[None], output_attentions=True)
    weights = np.stack([w[0] for w in per_layer])  # (30, 9, 256, 256)
    decoded = q * scale[..., None].astype(np.float64) / ((1 << bits) - 1)
    top = weights.max(-1, keepdims=True)
    assert (np.abs(decoded - weights) <= top / (2 * ((1 << bits) - 1)) + top * 2.0**-23).all()
    print(f"explain page 30x9x256: {page.stat().st_size / 1e6:.2f} MB at {bits} bits")


def test_the_addition_demo_is_explained_from_its_folder(tmp_path, capsys):
    from attnkit.demos import addition

    out = tmp_path / "add"
    assert main(["demo", "--task", "addition", "--steps", "3", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    page = tmp_path / "add.html"
    assert main(["explain", str(out), "--prompt", "07+35=", "--html", str(page), "--candidates", "3"]) == 0
    printed = capsys.readouterr().out
    assert "addition demo" in printed and f"wrote {page}" in printed
    lm = addition.load_model(out)
    ids = addition.parse_prompt("07+35=")
    data = _embedded(page)
    assert data["raw_tokens"] == list("07+35=")
    for c in data["candidates"]:
        np.testing.assert_allclose(c["gradient_x_input"], gradient_x_input(lm, ids, target_token=c["id"]), atol=1e-6)
        assert c["raw"] == addition.TOKENS[c["id"]]
    assert main(["explain", str(out), "--prompt", "7+x=", "--html", str(page)]) == 2
    assert "digits, '+' and '='" in capsys.readouterr().err
