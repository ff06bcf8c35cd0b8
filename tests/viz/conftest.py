"""A real headless Chromium for the explorer page's tests, driven by playwright; a visible skip without one.

The browser is the system's (Debian package ``chromium``, or the path in ``ATTNKIT_CHROMIUM``): playwright's
own browser download is never used, so the tests need no network. ``make test`` installs the package where
it runs as root.
"""
from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The Chromium executable: ``$ATTNKIT_CHROMIUM``, else the first of the usual names on ``PATH``."""
    configured = os.environ.get("ATTNKIT_CHROMIUM")
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    for name in _CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def _unavailable(reason: str):
    """Skip, saying why; fail instead where ``ATTNKIT_REQUIRE_BROWSER=1`` (make test sets it when Chromium is
    installed, so a browser that is there but does not start is an error, not a silent skip)."""
    if os.environ.get("ATTNKIT_REQUIRE_BROWSER") == "1":
        pytest.fail(f"ATTNKIT_REQUIRE_BROWSER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the session (launching one takes seconds)."""
    try:
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("browser tests need the playwright package (pip install -e '.[test]')")
    executable = find_chromium()
    if executable is None:
        _unavailable("browser tests need Chromium: apt-get install chromium, or set ATTNKIT_CHROMIUM to its path")
    manager = sync_playwright().start()
    try:
        instance = manager.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
    except PlaywrightError as exc:
        manager.stop()
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _unavailable(f"Chromium at {executable} did not start: {first_line}")
    yield instance
    instance.close()
    manager.stop()


class PageWatch:
    """A page whose non-``file://`` requests are aborted and counted, and whose console errors are kept."""

    def __init__(self, page):
        self.page = page
        self.blocked: list[str] = []
        self.errors: list[str] = []
        page.route("**/*", self._route)
        page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        page.on("pageerror", lambda error: self.errors.append(f"uncaught: {error}"))

    def _route(self, route):
        url = route.request.url
        if url.startswith(("file://", "data:", "about:")):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()


@pytest.fixture
def watched_page(browser):
    """A fresh 1280 x 900 page in its own context, watched by :class:`PageWatch`."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, device_scale_factor=1)
    watch = PageWatch(context.new_page())
    yield watch
    context.close()
