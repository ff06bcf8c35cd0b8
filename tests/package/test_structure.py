"""Structure the codebase keeps: functions read on a screen or two (at most 60 lines of body), and the
families' model_type strings only in their modules (tests/pretrained/test_family_registry.py)."""
from __future__ import annotations

import ast
import pathlib

import attnkit

SRC = pathlib.Path(attnkit.__file__).parent
MAX_LINES = 60
# Longer on purpose, each with its reason.
LONGER = {
    # transformers' beam search step by step, kept in one piece so it can be read against transformers' own
    ("decoding/beam_search.py", "transformers_beam_search"),
}


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    start = first.end_lineno + 1 if docstring and len(node.body) > 1 else first.lineno
    return node.end_lineno - start + 1


def test_no_function_is_longer_than_sixty_lines():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        name = str(path.relative_to(SRC))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (name, node.name) not in LONGER:
                if _body_lines(node) > MAX_LINES:
                    long.append((name, node.name, _body_lines(node)))
    assert long == []
