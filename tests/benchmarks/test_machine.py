"""Where a benchmark ran: CPU, caches (sysfs and its fallbacks), BLAS and threads, in every benchmark."""
import json
import sys

import numpy as np
import pytest

from attnkit.benchmarks import machine
from attnkit.benchmarks.machine import cache_sizes, describe, machine_info


def _write_cache(root, index, level, kind, size, shared):
    folder = root / f"index{index}"
    folder.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (folder / name).write_text(f"{value}\n")


def test_cache_sizes_from_sysfs(tmp_path):
    _write_cache(tmp_path, 0, 1, "Data", "48K", "0")
    _write_cache(tmp_path, 1, 1, "Instruction", "32K", "0")
    _write_cache(tmp_path, 2, 2, "Unified", "2048K", "0")
    _write_cache(tmp_path, 3, 3, "Unified", "105M", "0-55")
    info = cache_sizes(tmp_path)
    assert info["source"] == "sysfs"
    assert info["L1d"]["bytes"] == 48 << 10 and info["L2"]["bytes"] == 2 << 20
    assert info["L3"] == {"bytes": 105 << 20, "shared_cpu_list": "0-55"}
    assert "L1" not in info  # the instruction cache is left out


def test_cache_sizes_fall_back_to_sysconf_then_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(machine.os, "sysconf", lambda key: {"SC_LEVEL2_CACHE_SIZE": 1 << 20}.get(key, 0))
    info = cache_sizes(tmp_path / "absent")
    assert info == {"L2": {"bytes": 1 << 20, "shared_cpu_list": None}, "source": "sysconf"}

    def no_sysconf(key):
        raise ValueError(key)

    monkeypatch.setattr(machine.os, "sysconf", no_sysconf)
    info = cache_sizes(tmp_path / "absent")
    assert info == {"source": "unknown"}
    lines = describe(dict(machine_info(), caches=info))
    assert "cache sizes unknown" in lines[1]


def test_describe_names_cpu_caches_blas_kernel_and_threads():
    info = machine_info()
    json.dumps(info)  # goes into the JSON reports as it is
    lines = describe(info, threads=[2, 1])
    assert lines[0].startswith("# machine: ") and str(info["cores"]) in lines[0]
    assert lines[1].startswith("# caches: ") and lines[2].startswith("# BLAS: ")
    assert lines[3] == f"# threads: attnkit default {info['attnkit_threads']}, this run 2, 1"
    pytest.importorskip("threadpoolctl")
    blas = info["blas"]
    assert blas and {"internal_api", "architecture", "version", "num_threads"} <= set(blas[0])
    assert f"kernel {blas[0]['architecture']}" in lines[2]


def test_without_threadpoolctl_the_blas_line_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)
    assert "threadpoolctl is not installed" in describe()[2]


def test_openblas_overrides_are_warned_about(monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    assert any(line.startswith("# WARNING") and "OPENBLAS_CORETYPE" in line for line in describe())


def test_naive_attention_matches_the_reference_kernel(rng):
    from attnkit.benchmarks.naive import naive_backward, naive_forward
    from attnkit.kernels.reference import attention_backward, attention_forward

    q, g = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 5, 4))
    k, v = rng.standard_normal((2, 3, 7, 4)), rng.standard_normal((2, 3, 7, 4))  # Lk > Lq: bottom-right causal
    for causal in (False, True):
        out, cache = naive_forward(q, k, v, causal=causal)
        ref, _, ctx = attention_forward(q, k, v, causal=causal)
        np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
        for ours, theirs in zip(naive_backward(g, cache), attention_backward(g, ctx)[:3]):
            np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-12)
