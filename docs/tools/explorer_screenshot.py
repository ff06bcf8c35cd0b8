"""Draw docs/explorer.png: the attention explorer on all-MiniLM-L6-v2, one token selected.

Run with ``make docs-screenshot`` (needs the pretrained extra, playwright and a Chromium; set
ATTNKIT_CHROMIUM to its path if it is not /usr/bin/chromium).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from attnkit.pretrained import load_minilm
from attnkit.viz import attention_html

SENTENCE = "The quick brown fox jumps over the lazy dog because it was bored."
LAYER, HEAD, TOKEN = 5, 11, "it"  # a head in which "it" looks back at "fox" and "dog"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def main(out: str = "docs/explorer.png") -> int:
    from playwright.sync_api import sync_playwright

    encoder = load_minilm()
    layers = [encoder.attention(SENTENCE, layer) for layer in range(encoder.num_layers)]
    tokens, weights = layers[0][0], np.stack([w for _, w in layers])  # (N, H, L, L)
    with tempfile.TemporaryDirectory() as folder:
        page_path = attention_html(tokens, weights, Path(folder) / "minilm.html",
                                   title=f"all-MiniLM-L6-v2: {SENTENCE}")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=os.environ.get("ATTNKIT_CHROMIUM", "/usr/bin/chromium"),
                                        args=ARGS)
            page = browser.new_page(viewport={"width": 1240, "height": 860}, device_scale_factor=1)
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                       else route.abort())
            page.goto(page_path.resolve().as_uri())
            page.get_by_test_id("layer").select_option(str(LAYER))
            page.get_by_test_id("head").select_option(str(HEAD))
            page.get_by_test_id("token").nth(tokens.index(TOKEN)).click()
            page.screenshot(path=out, full_page=True)
            browser.close()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
