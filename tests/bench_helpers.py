"""A stand-in for llama.cpp's ``llama-bench`` in the benchmarks' tests."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def fake_llama_bench(folder: Path, stdout: str, status: int = 0) -> Path:
    """An executable ``folder/llama-bench`` that prints ``stdout``, exits with ``status`` and appends its arguments
    to ``folder/argv.jsonl`` (one JSON list per run)."""
    script = folder / "llama-bench"
    script.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(folder / 'argv.jsonl')!r}, 'a').write("
                      f"json.dumps(sys.argv[1:]) + '\\n')\nprint({stdout!r})\nsys.exit({status})\n")
    script.chmod(0o755)
    return script


def llama_bench_runs(folder: Path) -> list[list[str]]:
    """The arguments of every run of :func:`fake_llama_bench`'s script, in order."""
    return [json.loads(line) for line in (folder / "argv.jsonl").read_text().splitlines()]
