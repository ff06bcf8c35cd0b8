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


# Attributes a forward may test that are its inputs' or its run's state, not the module's architecture.
RUNTIME_STATE = {"_hook_table", "saved_tensors", "training", "_parameters", "grads", "_shape"}


def _setting_tests(path: pathlib.Path) -> list[str]:
    """The ifs in forward, backward and their private helpers whose test reads only ``self``'s settings."""
    found = []
    for cls in (n for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            private = fn.name.startswith("_") and not fn.name.startswith(("__", "_refuse", "_check"))
            if fn.name not in ("forward", "backward") and not private:
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.If, ast.IfExp)):
                    names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
                    attrs = {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
                    if names == {"self"} and not attrs & RUNTIME_STATE:
                        found.append(f"{path.name}:{node.lineno} {cls.name}.{fn.name}: {ast.unparse(node.test)}")
    return found


def test_the_language_models_parts_are_chosen_when_built_not_switched_when_run():
    """The decoder block, its attention and the LM read no setting in forward/backward: the block is composed
    from its parts when built (identity norms, the residual's class, the q/k norm's placement), and the whole
    of layers, attention and models keeps to at most 15 such tests."""
    composed = [SRC / "layers/lm_block.py", SRC / "layers/identity.py", SRC / "attention/grouped_query.py"]
    assert [t for path in composed for t in _setting_tests(path) if "_attend" not in t] == []
    everywhere = [t for folder in ("layers", "attention", "models") for path in sorted((SRC / folder).glob("*.py"))
                  if path.name != "config.py" for t in _setting_tests(path)]
    assert len(everywhere) <= 15, everywhere
