"""docs/architecture.md's package map matches the tree: every path it lists exists, and every package and
top-level module of src/attnkit is listed (re-export shims of old paths aside)."""
import pathlib
import re

import attnkit

SRC = pathlib.Path(attnkit.__file__).parent
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def listed_paths():
    text = DOC.read_text(encoding="utf-8")
    table = text[text.index("## Package map"):].split("\n## ")[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    return {path for row in rows for path in re.findall(r"`([^`]+)`", row)}


def is_shim(path):
    return "import *" in path.read_text(encoding="utf-8")


def test_every_listed_path_exists():
    listed = listed_paths()
    assert len(listed) > 20
    assert sorted(p for p in listed if not (SRC / p.rstrip("/")).exists()) == []


def test_every_package_and_module_is_listed():
    listed = listed_paths()
    packages = {f"{p.name}/" for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.name for p in SRC.glob("*.py") if p.name not in ("__init__.py", "__main__.py") and not is_shim(p)}
    assert sorted((packages | modules | {"templates/"}) - listed) == []
