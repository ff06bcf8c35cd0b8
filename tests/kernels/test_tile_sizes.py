"""Tile sizes from the machine's caches: the chooser, its fallback and overrides, and exact results."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import _cpu
from attnkit.kernels import _tile_sizes
from attnkit.kernels._tile_sizes import choose_tiles, working_set
from attnkit.kernels.reference import attention_backward, attention_forward
from attnkit.kernels.tiled import default_blocks, flash_attention_backward, flash_attention_forward


def _fake_sysfs(root, l2: str, l3: str = "32768K"):
    """A sysfs cache tree like ``/sys/devices/system/cpu/cpu0/cache`` with the given L2 and L3."""
    for index, (level, kind, size, shared) in enumerate([(1, "Data", "32K", "0"), (1, "Instruction", "32K", "0"),
                                                         (2, "Unified", l2, "0"), (3, "Unified", l3, "0-15")]):
        folder = root / f"index{index}"
        folder.mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
            (folder / name).write_text(f"{value}\n")
    return root


@pytest.mark.parametrize(("l2", "heads", "head_dim", "itemsize", "expected"), [
    ("256K", 8, 64, 4, (128, 128)),
    ("512K", 8, 64, 4, (256, 256)),  # AMD Zen 2/3
    ("512K", 8, 128, 4, (128, 256)),  # wider heads: longer q/k/v rows, smaller tile
    ("512K", 8, 64, 8, (128, 128)),  # float64 doubles every byte
    ("512K", 1, 64, 4, (256, 256)),  # measured: 512 x 512 is 1.25x slower with 2 heads here
    ("1024K", 8, 64, 4, (256, 512)),  # Zen 4, Skylake-SP
    ("2048K", 8, 64, 4, (512, 512)),  # Intel Sapphire Rapids
])
def test_chooser_reads_l2_from_sysfs(tmp_path, l2, heads, head_dim, itemsize, expected):
    root = _fake_sysfs(tmp_path / "cache", l2)
    assert choose_tiles(heads, head_dim, itemsize=itemsize, sysfs_root=root) == expected


@pytest.mark.parametrize("l2_kib", [256, 512, 1024, 1280, 2048])
def test_chosen_tiles_spill_little(l2_kib):
    """With several heads per tile, one head's working set stays within a third beyond the L2."""
    tq, tk = choose_tiles(8, 64, l2=l2_kib << 10)
    assert working_set(tq, tk, 64, 64, 4) <= 1.35 * (l2_kib << 10)
    assert tq * tk >= 128 * 128  # and never so small that per-tile Python overhead dominates


def test_larger_l2_never_gives_smaller_tiles():
    areas = [np.prod(choose_tiles(8, 64, l2=kib << 10)) for kib in (128, 256, 512, 1024, 2048, 4096)]
    assert areas == sorted(areas)


def test_fallback_when_no_sysfs_and_no_sysconf(tmp_path, monkeypatch):
    def no_sysconf(key):
        raise ValueError(key)

    monkeypatch.setattr(_cpu.os, "sysconf", no_sysconf)
    missing = tmp_path / "absent"
    assert _cpu.l2_bytes(missing) == _cpu.FALLBACK_L2_BYTES == 512 << 10
    assert choose_tiles(8, 64, sysfs_root=missing) == choose_tiles(8, 64, l2=512 << 10)


def test_sysconf_used_when_sysfs_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(_cpu.os, "sysconf", lambda key: {"SC_LEVEL2_CACHE_SIZE": 2 << 20}.get(key, 0))
    assert _cpu.l2_bytes(tmp_path / "nowhere") == 2 << 20


def test_environment_overrides_the_choice(monkeypatch):
    monkeypatch.setenv("ATTNKIT_TILE_Q", "48")
    monkeypatch.setenv("ATTNKIT_TILE_K", "80")
    assert default_blocks(8, 4096, 4096, 2, "q") == (48, 80)
    assert default_blocks(8, 4096, 4096, 2, "k") == (48, 80)  # not halved for threads either
    assert default_blocks(8, 30, 4096) == (30, 80)  # still clipped to the sequence
    monkeypatch.delenv("ATTNKIT_TILE_K")
    assert default_blocks(8, 4096, 4096, 1, l2=512 << 10) == (48, 256)


@pytest.mark.parametrize("value", ["0", "-3", "big", "1.5"])
def test_bad_environment_value_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("ATTNKIT_TILE_K", value)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 9, 4))
    with pytest.raises(ValueError, match=f"ATTNKIT_TILE_K must be a positive integer.*{value!r}"):
        flash_attention_forward(q, q, q)


def test_keywords_override_the_environment(monkeypatch):
    """block_q / block_k win over ATTNKIT_TILE_*: a bad variable is then never read into the tiles."""
    monkeypatch.setenv("ATTNKIT_TILE_Q", "3")
    seen = []
    real = _tile_sizes.choose_tiles

    def spy(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr("attnkit.kernels.tiled.plan.choose_tiles", spy)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 10, 4))
    out = flash_attention_forward(q, q, q, block_q=5, block_k=5)[0]
    ref = attention_forward(q, q, q)[0]
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)
    assert seen  # the chooser was asked (head count 2, head dim 4) but the keywords were used
    assert seen[0][:2] == (2, 4)


@settings(max_examples=25, deadline=None)
@given(tile_q=st.integers(1, 70), tile_k=st.integers(1, 70), seq_q=st.integers(1, 60), seq_k=st.integers(1, 60),
       causal=st.booleans(), threads=st.sampled_from([1, 2]))
def test_any_tile_sizes_give_the_reference_results(tile_q, tile_k, seq_q, seq_k, causal, threads):
    rng = np.random.default_rng(tile_q * 1000 + tile_k)
    q = rng.standard_normal((2, 3, seq_q, 8))  # (B, H, Lq, D)
    k, v = rng.standard_normal((2, 2, 3, seq_k, 8))  # (2, B, H, Lk, D)
    grad = rng.standard_normal((2, 3, seq_q, 8))
    with pytest.MonkeyPatch.context() as mp:  # the environment path, as a user would set it
        mp.setenv("ATTNKIT_TILE_Q", str(tile_q))
        mp.setenv("ATTNKIT_TILE_K", str(tile_k))
        out, _, ctx = flash_attention_forward(q, k, v, causal=causal, num_threads=threads)
        grads = flash_attention_backward(grad, ctx)[:3]
    ref_out, _, ref_ctx = attention_forward(q, k, v, causal=causal)
    ref_grads = attention_backward(grad, ref_ctx)[:3]
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-12)
    for mine, theirs in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-11)


@pytest.mark.parametrize("l2_kib", [256, 512, 2048])
def test_machine_chosen_tiles_give_the_reference_results_in_float32(tmp_path, monkeypatch, l2_kib):
    root = _fake_sysfs(tmp_path / "cache", f"{l2_kib}K")
    monkeypatch.setattr(_tile_sizes, "SYSFS_CACHE", root)
    monkeypatch.setattr("attnkit.kernels.tiled.plan.choose_tiles",
                        lambda *a, **kw: _tile_sizes.choose_tiles(*a, **kw, sysfs_root=root))
    rng = np.random.default_rng(l2_kib)
    q, k, v, grad = (rng.standard_normal((1, 2, 600, 16)).astype(np.float32) for _ in range(4))
    out, _, ctx = flash_attention_forward(q, k, v, causal=True)
    assert out.dtype == np.float32
    ref = attention_forward(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    np.testing.assert_allclose(out, ref[0], rtol=0, atol=2e-5)
    dq = flash_attention_backward(grad, ctx)[0]
    ref_dq = attention_backward(grad.astype(np.float64), ref[2])[0]
    np.testing.assert_allclose(dq, ref_dq, rtol=0, atol=1e-4 * np.abs(ref_dq).max())
