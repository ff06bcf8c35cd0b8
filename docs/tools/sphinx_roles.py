"""MkDocs hook: docstrings cross-reference with Sphinx roles (``:func:`name```), which the API pages would
show literally as ``:func:name``; drop the role and keep the code-formatted name."""
from __future__ import annotations

import re

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):(?=<code>)")


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub("", html)
