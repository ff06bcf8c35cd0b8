"""MkDocs hook: the docstrings are written for Sphinx as well as for people, and mkdocstrings renders parts
of them (type descriptions, attribute lists) as literal text. On the API pages this hook turns what would
show literally into what it means:

- roles ``:func:`name``` (any of func, class, meth, mod, attr, data, exc, obj, const) lose the role;
- ``~attnkit.pkg.Name`` (Sphinx: show the last part) becomes ``Name``;
- reST double backticks left inside code and attribute text are dropped (the text is already code there).

Only pages under ``api/`` are rewritten: guides may show such text on purpose.
"""
from __future__ import annotations

import re

_ROLE_BEFORE_CODE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):(?=<code>)")
_ROLE_WITH_BACKTICKS = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`([^`<>]+)`")
_TILDE_PATH = re.compile(r"~(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)")
_DOUBLE_BACKTICKS = re.compile(r"``([^`]*?)``")


def rewrite_api_html(html: str) -> str:
    """The API page ``html`` with Sphinx roles, ``~`` paths and leftover double backticks made readable.

    Examples
    --------
    >>> rewrite_api_html("as :func:`attnkit.generate` yields, a <code>~attnkit.cache.KVCache</code>, ``d_k``")
    'as attnkit.generate yields, a <code>KVCache</code>, d_k'
    """
    html = _ROLE_BEFORE_CODE.sub("", html)
    html = _ROLE_WITH_BACKTICKS.sub(r"\1", html)
    html = _TILDE_PATH.sub(r"\1", html)
    return _DOUBLE_BACKTICKS.sub(r"\1", html)


def on_page_content(html: str, page, **kwargs) -> str:
    if not page.file.src_uri.startswith("api/"):
        return _ROLE_BEFORE_CODE.sub("", html)
    return rewrite_api_html(html)
