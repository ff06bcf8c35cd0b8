"""The README's Python examples run, in order, in one namespace, and print what they claim."""
import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_examples():
    assert len(_blocks()) >= 4


def test_readme_examples_run_and_print_their_comments():
    namespace: dict = {}
    for block in _blocks():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
        printed = buf.getvalue().splitlines()
        # Every print(...) line annotated with "# expected" must print exactly that.
        claims = [m.group(1).strip() for line in block.splitlines()
                  if line.lstrip().startswith("print(") and (m := re.search(r"#\s*(.+)$", line))]
        # One claim per printed line, every claim checked word for word: a print added without its claim, or
        # a claim whose print was removed, fails here.
        assert len(claims) == len(printed), f"{len(claims)} claims for {len(printed)} printed lines: {printed}"
        for claim, got in zip(claims, printed, strict=True):
            assert got.strip() == claim, f"README claims {claim!r}, printed {got!r}"
