"""Shared helpers of the command-line tests (``from cli_helpers import ...``): PNG checks, running
``python -m attnkit`` in a real process with this source tree first on the path (its stderr on a pseudo-terminal
with :func:`run_on_terminal`), and ``attnkit chat`` on a pseudo-terminal."""
from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
DPI = 100  # the CLI writes its pictures at 100 dpi: figsize * 100 pixels


def greedy_reply(folder: Path, messages: list[dict], max_new_tokens: int) -> str:
    """The library's greedy reply to ``messages`` with the folder's chat template and eos ids: what ``attnkit
    chat --temperature 0`` must print."""
    import numpy as np

    from attnkit.pretrained import load

    model, tok = load(folder)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    out = model.generate(np.array([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=list(tok.eos_token_ids))
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


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


def run_attnkit(args: list, cwd: Path, timeout: float = 300, stdin: str | None = None) -> subprocess.CompletedProcess:
    """``python -m attnkit *args`` in a fresh process; ``args`` may hold bytes (passed to the OS as they are);
    ``stdin``: text piped to it (else it inherits the test's)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    env.pop("ATTNKIT_TRACEBACK", None)
    argv = [sys.executable, "-m", "attnkit", *args]
    proc = subprocess.run(argv, capture_output=True, timeout=timeout, cwd=cwd, env=env,
                          input=None if stdin is None else stdin.encode())
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode("utf-8", "replace"),
                                       proc.stderr.decode("utf-8", "replace"))


def run_on_terminal(args: list, cwd: Path, stdin: bytes = b"", timeout: float = 300) -> tuple[int, str, str]:
    """``python -m attnkit *args`` with its stderr on a pseudo-terminal of 100 columns (stdin and stdout pipes):
    ``(exit code, stdout, what the terminal showed)``, the terminal's carriage returns kept."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    env.pop("ATTNKIT_TRACEBACK", None)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "attnkit", *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=follower, cwd=cwd, env=env, close_fds=True)
    os.close(follower)
    shown = bytearray()

    def read_terminal() -> None:
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the process closed its end
                return
            if not chunk:
                return
            shown.extend(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        stdout, _ = proc.communicate(stdin, timeout=timeout)
    finally:
        proc.kill()
        reader.join(timeout=10)
        os.close(leader)
    return proc.returncode, stdout.decode("utf-8", "replace"), bytes(shown).decode("utf-8", "replace")


def assert_one_line_error(stderr: str, *fragments: str) -> None:
    """``stderr`` is exactly one ``attnkit...: error: ...`` line with every fragment, no traceback, no raw
    control characters."""
    assert "Traceback" not in stderr, stderr
    assert stderr.endswith("\n") and stderr.count("\n") == 1, f"not one line: {stderr!r}"
    assert stderr.startswith("attnkit") and ": error: " in stderr, stderr
    assert not any(ord(c) < 32 or 0x7f <= ord(c) <= 0x9f for c in stderr[:-1]), f"raw control characters: {stderr!r}"
    for fragment in fragments:
        assert fragment in stderr, f"{fragment!r} not in {stderr!r}"


class Chat:
    """``attnkit chat`` on a pseudo-terminal, driven line by line."""

    def __init__(self, args, env=None):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
                   **(env or {}))
        env.pop("ATTNKIT_TRACEBACK", None)
        self.leader, follower = pty.openpty()
        # A shell that starts a job in the background may hand SIGINT down as ignored: restore the default so
        # that Python installs its KeyboardInterrupt handler in the child.
        self.proc = subprocess.Popen([sys.executable, "-m", "attnkit", "chat", *map(str, args)], stdin=follower,
                                     stdout=follower, stderr=subprocess.PIPE, env=env, close_fds=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        os.close(follower)
        self.shown = b""

    def read_until(self, predicate, timeout=120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not predicate(self.shown):
            ready, _, _ = select.select([self.leader], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(self.leader, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                self.shown += chunk
            elif self.proc.poll() is not None:
                break
        return predicate(self.shown)

    def prompts(self) -> int:
        return self.shown.count(b"> ")

    def type(self, line: bytes) -> None:
        """Type ``line`` and Enter, reading what the terminal shows meanwhile: a long paste echoed back by the
        line editor would otherwise fill the terminal's buffer while this process still writes, and neither
        side could go on."""
        data = line + b"\n"
        os.set_blocking(self.leader, False)
        try:
            while data:
                readable, writable, _ = select.select([self.leader], [self.leader], [], 1.0)
                if readable:
                    try:
                        self.shown += os.read(self.leader, 65536)
                    except BlockingIOError:
                        pass
                if writable:
                    try:
                        data = data[os.write(self.leader, data[:4096]):]
                    except BlockingIOError:
                        pass
                if not (readable or writable) and self.proc.poll() is not None:
                    break
        finally:
            os.set_blocking(self.leader, True)

    def finish(self, timeout=60):
        code = self.proc.wait(timeout=timeout)
        self.read_until(lambda _: False, timeout=0.2)
        stderr = self.proc.stderr.read().decode("utf-8", "replace")
        self.proc.stderr.close()
        os.close(self.leader)
        return self.shown.decode("utf-8", "replace").replace("\r\n", "\n"), stderr, code

    def say(self, line: bytes) -> None:
        """Type ``line`` at the next prompt and wait for the prompt after it."""
        count = self.prompts()
        self.type(line)
        assert self.read_until(lambda _: self.prompts() > count), self.shown
