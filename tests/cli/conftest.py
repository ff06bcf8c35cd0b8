"""Fixtures of the command-line tests: one small demo model, trained once per session, and the chat model
folder (the session's ``chat_folder``) under the name the chat tests use."""
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
def folder(chat_folder):
    """The chat tests' model folder: the session's ``chat_folder``."""
    return chat_folder
