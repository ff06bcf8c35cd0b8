"""Fixtures of the command-line tests: one small demo model, trained once per session, and one tiny chat
model folder (a random Llama with a byte-level BPE tokenizer and a ChatML template)."""
import pytest


@pytest.fixture(scope="session")
def small_demo(tmp_path_factory):
    """A 30-step demo run through main() (not accurate, but every file is written)."""
    pytest.importorskip("matplotlib", reason="the demo draws with the viz extra: pip install 'attnkit[viz]'")
    from attnkit.cli import main

    out = tmp_path_factory.mktemp("demo") / "nested" / "out"
    code = main(["demo", "--steps", "30", "--seed", "1", "--out", str(out), "--no-progress"])
    assert code == 0
    return out


@pytest.fixture(scope="session")
def folder(tmp_path_factory):
    """The chat tests' model folder: :func:`text_models.write_chat_model`, written once per session."""
    pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    from text_models import write_chat_model

    path = tmp_path_factory.mktemp("chat")
    write_chat_model(path)
    return path
