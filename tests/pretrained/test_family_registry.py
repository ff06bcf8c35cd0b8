"""The families' registry is the only list of families: one module per model_type, and every place that names
the families (loading, the command line's help, the README's table, the trainer, the decode benchmark, the
tests' tiny models) agrees with it."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

from attnkit.pretrained import supported_model_types
from attnkit.pretrained.families import REGISTRY, family

ROOT = pathlib.Path(__file__).resolve().parents[2]
FAMILY_DIR = ROOT / "src" / "attnkit" / "pretrained" / "families"


def test_one_module_per_family_and_nothing_else():
    modules = sorted(p.stem for p in FAMILY_DIR.glob("*.py") if not p.stem.startswith("_"))
    assert modules == sorted(REGISTRY) == sorted(supported_model_types())
    assert len(REGISTRY) >= 12


@pytest.mark.parametrize("model_type", sorted(REGISTRY))
def test_each_family_states_what_it_is(model_type):
    entry = REGISTRY[model_type]
    assert entry.model_type == model_type
    assert entry.summary and len(entry.summary) > 40, entry.summary
    if model_type not in ("llama", "gpt2", "gpt_neox"):  # the others are stated as a difference from another
        assert "except" in entry.summary, entry.summary
    assert entry.architecture.endswith(("ForCausalLM", "LMHeadModel"))
    assert entry.hf_config_class.endswith("Config") and entry.benchmark


def _code_strings(path: pathlib.Path) -> set[str]:
    """The string constants of a module's code (docstrings, with their examples, left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}


def test_the_model_type_is_written_in_one_source_file():
    """A family's model_type is spelled in the code of its own module only (every other place reads the
    registry), docstring examples aside."""
    src = ROOT / "src" / "attnkit"
    strings = {str(p.relative_to(src)): _code_strings(p) for p in src.rglob("*.py")}
    for model_type in REGISTRY:
        files = sorted(name for name, found in strings.items() if model_type in found)
        expected = [f"pretrained/families/{model_type}.py"]
        if model_type == "llama":  # the demos' and the distributed and patching benchmarks' own models are Llamas
            files = [f for f in files if not f.startswith(("demos/", "benchmarks/ddp", "benchmarks/patching"))]
        # llama.cpp's tokenizer and pre-tokenizer names are a namespace of their own, which often spells the same
        # words; its architecture names are the families' (see the next test)
        files = [f for f in files if not f.startswith(("pretrained/gguf_tokenizer", "pretrained/gguf_metadata",
                                                       "benchmarks/gguf_"))]
        # and so are the names of the common chat templates (--chat-template qwen3), which users know by the model
        files = [f for f in files if f != "pretrained/named_chat_templates.py"]
        assert files == expected, (model_type, files)


def test_each_gguf_architecture_is_named_in_its_familys_module_only():
    """llama.cpp's ``general.architecture`` of a family is stated by the family (``Family.gguf``): the GGUF loader
    spells none, and no two families claim one."""
    src = ROOT / "src" / "attnkit"
    strings = {str(p.relative_to(src)): _code_strings(p) for p in src.rglob("*.py")}
    entries = {model_type: entry.gguf.name for model_type, entry in REGISTRY.items() if entry.gguf is not None}
    assert len(set(entries.values())) == len(entries) >= 8
    for model_type, name in entries.items():
        files = sorted(f for f, found in strings.items() if name in found and f.startswith("pretrained/")
                       and not f.startswith(("pretrained/gguf_tokenizer", "pretrained/gguf_metadata",
                                             "pretrained/named_chat_templates")))
        assert files == [f"pretrained/families/{model_type}.py"], (name, files)


def test_an_unknown_family_is_refused_naming_those_there_are():
    with pytest.raises(ValueError, match=r"model_type 'bert' is not supported; attnkit loads (\w+, )*deepseek_v3, "
                                         r"(\w+, )*gemma2, gemma3_text"):
        family("bert")


def test_the_readme_table_lists_every_family():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Model families", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|", section, flags=re.M)
    assert sorted(row for row in rows if row != "model_type") == sorted(REGISTRY)


def test_the_help_names_every_family():
    from attnkit.cli._common import model_types_text

    text = model_types_text()
    assert all(name in text for name in REGISTRY)


def test_the_trainer_and_the_benchmark_read_the_registry():
    pytest.importorskip("torch")
    from attnkit.benchmarks.decode import FAMILIES
    from attnkit.torch.train import ARCHITECTURES

    assert ARCHITECTURES == {name: entry.architecture for name, entry in REGISTRY.items()}
    assert set(FAMILIES) == set(REGISTRY)


def test_the_tests_have_a_tiny_model_of_every_family():
    pytest.importorskip("torch")
    from hf_models import SPECS

    classes = {spec[0] for spec in SPECS.values()}
    assert {entry.hf_config_class for entry in REGISTRY.values()} <= classes
