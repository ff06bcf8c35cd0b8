"""Shared helpers of the command-line tests (``from cli_helpers import ...``): PNG checks and running
``python -m attnkit`` in a real process with this source tree first on the path."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
DPI = 100  # the CLI writes its pictures at 100 dpi: figsize * 100 pixels


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    head = Path(path).read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def assert_image(path: Path, size_inches: tuple[float, float]) -> None:
    """``path`` is a complete, non-blank PNG of ``size_inches`` at the CLI's resolution."""
    import matplotlib.image

    assert path.is_file(), f"{path} was not written"
    expected = (round(size_inches[0] * DPI), round(size_inches[1] * DPI))
    assert png_size(path) == expected
    pixels = matplotlib.image.imread(path)  # decodes the whole file: a truncated PNG fails here
    assert pixels.shape[:2] == (expected[1], expected[0])
    assert pixels.std() > 0.05, f"{path} is blank"


def run_attnkit(args: list, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m attnkit *args`` in a fresh process; ``args`` may hold bytes (passed to the OS as they are)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    env.pop("ATTNKIT_TRACEBACK", None)
    argv = [sys.executable, "-m", "attnkit", *args]
    proc = subprocess.run(argv, capture_output=True, timeout=timeout, cwd=cwd, env=env)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode("utf-8", "replace"),
                                       proc.stderr.decode("utf-8", "replace"))


def assert_one_line_error(stderr: str, *fragments: str) -> None:
    """``stderr`` is exactly one ``attnkit...: error: ...`` line with every fragment, no traceback, no raw
    control characters."""
    assert "Traceback" not in stderr, stderr
    assert stderr.endswith("\n") and stderr.count("\n") == 1, f"not one line: {stderr!r}"
    assert stderr.startswith("attnkit") and ": error: " in stderr, stderr
    assert not any(ord(c) < 32 or 0x7f <= ord(c) <= 0x9f for c in stderr[:-1]), f"raw control characters: {stderr!r}"
    for fragment in fragments:
        assert fragment in stderr, f"{fragment!r} not in {stderr!r}"
