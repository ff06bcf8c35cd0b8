"""Draw docs/explain-minilm.png: the explain page on the pretrained all-MiniLM-L6-v2, explaining why two
sentences are similar (attribution of both sentences, rollout, one head with its colour scale, the grid).

Run with ``make docs-screenshot`` (needs the pretrained extra, playwright and a Chromium; set
ATTNKIT_CHROMIUM to its path if it is not /usr/bin/chromium).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from attnkit.explain import explain_similarity_html
from attnkit.pretrained import load_minilm

SENTENCE, OTHER = "A man is playing a guitar on the stage.", "Someone performs music in a concert."
LAYER, HEAD = 2, 5
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def main(out: str = "docs/explain-minilm.png") -> int:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as folder:
        page_path = Path(folder) / "explain.html"
        explain_similarity_html(load_minilm(), SENTENCE, OTHER, page_path,
                                title=f"all-MiniLM-L6-v2: {SENTENCE} ~ {OTHER}")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=os.environ.get("ATTNKIT_CHROMIUM", "/usr/bin/chromium"),
                                        args=ARGS)
            page = browser.new_page(viewport={"width": 1100, "height": 900}, device_scale_factor=1)
            requests: list[str] = []
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                       else (requests.append(route.request.url), route.abort()))
            page.goto(page_path.resolve().as_uri())
            page.wait_for_selector("body[data-ready='true']")
            page.select_option("[data-testid=layer]", str(LAYER))
            page.select_option("[data-testid=head]", str(HEAD))
            page.screenshot(path=out, full_page=True)
            browser.close()
        if requests:
            raise SystemExit(f"the page requested {requests}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
