"""How ``attnkit bench`` reaches the attention benchmark, which lives in ``benchmarks/bench_attention.py``.

The benchmark is a script of the source tree, not a module of the package, so it is found next to the
package (``<checkout>/benchmarks/``, i.e. an editable install or a run from a checkout) and loaded by its
path. An installed wheel has no ``benchmarks/`` folder: the command then says so in one line.
(Should the benchmark's core move into the package, :func:`load` becomes a plain import.)
"""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["benchmark_path", "load", "run"]

_MODULE_NAME = "_attnkit_bench_attention"


def benchmark_path() -> Path:
    """Where ``benchmarks/bench_attention.py`` is when attnkit runs from a source checkout."""
    return Path(__file__).resolve().parents[2] / "benchmarks" / "bench_attention.py"


def load() -> ModuleType:
    """Import the benchmark script (once) and return it.

    Raises
    ------
    ImportError
        If attnkit is not running from a source checkout (the message says how to get one).
    """
    if _MODULE_NAME in sys.modules:
        return sys.modules[_MODULE_NAME]
    path = benchmark_path()
    if not path.is_file():
        raise ImportError(f"attnkit bench runs benchmarks/bench_attention.py of a source checkout, and there is none "
                          f"at {path}: clone the repository and pip install -e . there")
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_MODULE_NAME]
        raise
    return module


def run(argv: Sequence[str]) -> Any:
    """Run the benchmark's ``main`` with command-line arguments ``argv``; returns its report."""
    return load().main(list(argv))
