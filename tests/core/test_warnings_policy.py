"""The test suite runs with warnings as errors, and every exception to that is named and explained.

A warning in normal use is a defect (a NaN computed and discarded, a deprecated call); with
``filterwarnings = ["error", ...]`` in pyproject.toml any test that triggers one fails.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_a_warning_inside_a_test_is_an_error():
    with pytest.raises(RuntimeWarning, match="invalid value"):
        np.array([0.0]) / np.array([0.0])
    with pytest.raises(DeprecationWarning):
        warnings.warn("a deprecated call", DeprecationWarning, stacklevel=1)


def test_the_configuration_starts_with_error_and_explains_each_exception(pytestconfig):
    filters = pytestconfig.getini("filterwarnings")
    assert filters[0] == "error"
    assert all(f.startswith("ignore:") and f.count(":") >= 2 for f in filters[1:]), filters  # named: message + category
    lines = PYPROJECT.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("filterwarnings = ["))
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == "]")
    entries = [i for i in range(start + 1, end) if lines[i].strip().startswith('"')]
    assert len(entries) == len(filters)
    for i in entries[1:]:
        assert "#" in lines[i] or lines[i - 1].strip().startswith("#"), f"no comment explains {lines[i].strip()}"
