"""The built documentation site: the strict build passes with no warning (and no build command hides warnings
from it), API pages show no raw reST (roles, ``~`` paths, double backticks), and no page or stylesheet requests
anything from the network (the site works offline)."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RAW_REST = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):|``|~attnkit\.")
# What a browser fetches by itself: scripts, images, frames, stylesheets, icons, preconnects, CSS url()s.
REQUESTED = re.compile(r"""(?:<(?:script|img|iframe|source|audio|video)\b[^>]*\bsrc|<link\b[^>]*\bhref)\s*=\s*["']?"""
                       r"""(?:https?:)?//|url\(\s*["']?(?:https?:)?//|@import\s+["']?(?:https?:)?//""", re.IGNORECASE)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """The strict build (as ``make docs`` runs it: without ``--quiet``, which would drop the warnings before
    ``--strict`` counts them): its folder and its log."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return out, done


@pytest.fixture(scope="module")
def site(build):
    out, done = build
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_the_strict_build_passes_without_a_warning(build):
    _, done = build
    warnings = [line for line in (done.stdout + done.stderr).splitlines() if "WARNING" in line]
    assert warnings == [] and done.returncode == 0, done.stderr[-2000:]


def test_no_build_command_hides_warnings_from_strict():
    """mkdocs 1.6 with ``--quiet`` drops warnings before ``--strict`` counts them: a build that passed with it had
    six (a broken image, a docstring read as two bogus parameters, a code line read as a link)."""
    commands = [line for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines()
                if "mkdocs build" in line]
    assert commands, "the Makefile has no mkdocs build"
    for line in commands:
        words = line.split()
        assert "--strict" in words and not {"--quiet", "-q"} & set(words), line


def _text(path: pathlib.Path) -> str:
    """A page's visible text and attributes: code blocks of examples are excluded (they may show anything)."""
    html = path.read_text(encoding="utf-8")
    return re.sub(r"<pre\b.*?</pre>", "", html, flags=re.DOTALL)


def test_api_pages_show_no_raw_rest(site):
    pages = sorted((site / "api").rglob("*.html"))
    assert len(pages) >= 15
    raw = {str(p.relative_to(site)): sorted(set(RAW_REST.findall(_text(p)))) for p in pages}
    assert {page: found for page, found in raw.items() if found} == {}
    explain = (site / "api" / "explain" / "index.html").read_text(encoding="utf-8")
    assert "gradient_x_input" in explain and "attention_rollout" in explain and "logit_lens" in explain


def test_no_page_or_stylesheet_requests_the_network(site):
    files = [p for p in site.rglob("*") if p.suffix in (".html", ".css", ".js")]
    assert len(files) > 20
    requested = {str(p.relative_to(site)): REQUESTED.findall(p.read_text(encoding="utf-8", errors="replace"))
                 for p in files}
    assert {f: hits for f, hits in requested.items() if hits} == {}


def test_the_checks_catch_what_they_look_for():
    assert RAW_REST.findall("see :meth:`x` and ``y`` and ~attnkit.cache.KVCache")
    assert REQUESTED.search('<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">')
    assert REQUESTED.search("@font-face{src:url(https://fonts.gstatic.com/a.woff2)}")
    assert not REQUESTED.search('<a href="https://example.org">a link the reader may follow</a>')
