"""The kernels run on the cores other processes left free, and compute the same bits as on an idle machine.

The load is simulated: a fake ``/proc/stat`` for the reader, scripted counters for :func:`free_cores`, and
``free_cores`` itself replaced for the pool and BLAS. Nothing here depends on timing or on the machine's load.
"""
from __future__ import annotations

import numpy as np
import pytest

import attnkit
from attnkit import _cpu
from attnkit.kernels import _threads, tiled
from attnkit.kernels.linear import product
from attnkit.models import CausalLM, DecoderConfig, MLPConfig

pytestmark = pytest.mark.concurrency


@pytest.fixture
def adaptive():
    """Adaptive threads on (the test session runs with them off), off again afterwards."""
    attnkit.set_adaptive_threads(True)
    try:
        yield
    finally:
        attnkit.set_adaptive_threads(False)


@pytest.fixture
def one_core_taken(adaptive, monkeypatch):
    """Two usable cores, one of them busy with another process (both free once adaptive threads are off)."""
    monkeypatch.setattr(_threads, "_usable_count", lambda: 2)
    monkeypatch.setattr(_threads, "free_cores", lambda: 1 if attnkit.get_adaptive_threads() else 2)


# -- the reading ------------------------------------------------------------------------------------------
def test_busy_seconds_sums_the_non_idle_ticks_of_the_cpus_asked_for(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    #                user nice system idle iowait irq softirq steal
    stat.write_text("cpu  300 0 30 900 50 0 5 10 0 0\n"
                    "cpu0 100 0 10 500 40 0 2 0 0 0\n"
                    "cpu1 200 0 20 400 10 0 3 10 0 0\n"
                    "intr 12345 0 0\n")
    monkeypatch.setattr(_cpu.os, "sysconf", lambda key: 100 if key == "SC_CLK_TCK" else 0)
    assert _cpu.busy_seconds(None, stat) == pytest.approx((112 + 233) / 100)
    assert _cpu.busy_seconds(frozenset({1}), stat) == pytest.approx(233 / 100)  # steal counts, iowait does not
    assert _cpu.busy_seconds(frozenset({7}), stat) is None  # no line for the CPUs asked for
    assert _cpu.busy_seconds(None, tmp_path / "absent") is None


@pytest.mark.parametrize("busy, own, expected", [
    (2.0, 2.0, 2),   # only this process ran: both cores are free
    (1.2, 1.0, 2),   # others used 0.2 of a core: not a core taken
    (1.9, 1.3, 1),   # a busy loop got 0.6 of a core beside two threads of ours: taken
    (2.0, 1.0, 1),   # a busy loop held a core
    (9.0, 0.0, 1),   # heavy load: still one core
    (1.0, 1.5, 2),   # the counters' ticks lag the process's own clock: never negative
])
def test_cores_left_counts_a_core_from_half_a_core_of_other_load(busy, own, expected):
    assert _threads.cores_left(busy, own, wall=1.0, usable=2) == expected


def test_free_cores_reads_the_load_at_most_every_interval(adaptive, monkeypatch):
    """Scripted counters: the reading follows the load over each interval and is kept between readings."""
    clock = {"wall": 100.0, "busy": 50.0, "own": 10.0}
    monkeypatch.setattr(_threads, "_usable_count", lambda: 2)
    monkeypatch.setattr(_threads, "usable_cpu_ids", lambda: frozenset({0, 1}))
    monkeypatch.setattr(_threads, "busy_seconds", lambda cpus: clock["busy"])
    monkeypatch.setattr(_threads.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(_threads.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(_threads, "_reading", _threads._LoadReading())
    _threads._reading.take()

    def advance(seconds, busy, own):
        clock["wall"] += seconds
        clock["busy"] += busy
        clock["own"] += own

    advance(1.0, busy=2.0, own=1.0)  # another process held a core for the whole second
    assert _threads.free_cores() == 1
    advance(0.1, busy=0.2, own=0.2)  # within the interval: the reading is kept
    assert _threads.free_cores() == 1
    advance(_threads.LOAD_INTERVAL, busy=1.0, own=1.0)  # the other process left
    assert _threads.free_cores() == 2
    attnkit.set_adaptive_threads(False)
    advance(1.0, busy=2.0, own=0.0)
    assert _threads.free_cores() == 2  # off: every core, whatever the load


def test_without_a_reading_every_core_is_free(adaptive, monkeypatch):
    monkeypatch.setattr(_threads, "_usable_count", lambda: 4)
    monkeypatch.setattr(_threads, "busy_seconds", lambda cpus: None)  # not Linux
    monkeypatch.setattr(_threads, "_reading", _threads._LoadReading())
    _threads._reading.take()
    monkeypatch.setattr(_threads.time, "monotonic", lambda: 1e9)
    assert _threads.free_cores() == 4


def test_the_setting_is_a_bool():
    with pytest.raises(TypeError, match="enabled must be True or False, got 1"):
        attnkit.set_adaptive_threads(1)
    assert attnkit.get_adaptive_threads() is False  # unchanged (the session's setting)


# -- the pool ---------------------------------------------------------------------------------------------
def test_the_pool_starts_no_more_workers_than_free_cores(one_core_taken):
    seen = []
    used = _threads.run_tasks(list(range(8)), lambda task, worker: seen.append(worker), 2)
    assert used == 1 and sorted(seen) == [0] * 8
    attnkit.set_adaptive_threads(False)
    seen.clear()
    assert _threads.run_tasks(list(range(8)), lambda task, worker: seen.append(worker), 2) == 2


def _tiled_grads(threads):
    rng = np.random.default_rng(5)
    q, k, v, grad = (rng.standard_normal((2, 3, 300, 16)).astype(np.float32) for _ in range(4))
    bias = rng.standard_normal((2, 1, 300, 1)).astype(np.float32)  # shared by key blocks: summed over lanes
    out, _, ctx = tiled.flash_attention_forward(q, k, v, causal=True, bias=bias, num_threads=threads,
                                                block_q=32, block_k=32)
    return (out, *tiled.flash_attention_backward(grad, ctx))


@pytest.mark.parametrize("threads", [2, 3])
def test_one_free_core_gives_the_bits_of_every_core(one_core_taken, threads):
    """The backward's lanes are cut for the thread count, not for the workers that run them."""
    busy = _tiled_grads(threads)
    attnkit.set_adaptive_threads(False)
    idle = _tiled_grads(threads)
    for a, b in zip(busy, idle, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_split_product_gives_the_same_bits_on_one_free_core(one_core_taken):
    rng = np.random.default_rng(6)
    a = rng.standard_normal((600, 256)).astype(np.float32)  # (M, K): split in row blocks at 2 threads
    b = rng.standard_normal((256, 384)).astype(np.float32)  # (K, N)
    with attnkit.num_threads(2):
        busy = product(a, b)  # (M, N)
        attnkit.set_adaptive_threads(False)
        idle = product(a, b)
    np.testing.assert_array_equal(busy, idle)


# -- BLAS -------------------------------------------------------------------------------------------------
threadpoolctl = pytest.importorskip("threadpoolctl")


def _blas_threads():
    return [lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]


@pytest.fixture
def two_blas_threads():
    if not _blas_threads():
        pytest.skip("no BLAS found by threadpoolctl")
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        yield _blas_threads()


def test_blas_runs_on_the_free_cores_and_gets_its_count_back(two_blas_threads, one_core_taken):
    with _threads.blas_on_free_cores():
        assert _blas_threads() == [1] * len(two_blas_threads)
    assert _blas_threads() == two_blas_threads


def test_blas_keeps_its_count_when_every_core_is_free(two_blas_threads, adaptive, monkeypatch):
    monkeypatch.setattr(_threads, "_usable_count", lambda: 2)
    monkeypatch.setattr(_threads, "free_cores", lambda: 2)
    with _threads.blas_on_free_cores():
        assert _blas_threads() == two_blas_threads


def test_a_limit_never_raises_blas_above_its_own_count(two_blas_threads):
    with threadpoolctl.threadpool_limits(1, user_api="blas"), _threads.blas_limit(3):
        assert _blas_threads() == [1] * len(two_blas_threads)


def test_nested_limits_apply_the_lowest_and_unwind(two_blas_threads):
    with _threads.blas_limit(2):
        with _threads.blas_single_thread():
            assert _blas_threads() == [1] * len(two_blas_threads)
        assert _blas_threads() == two_blas_threads
    assert _blas_threads() == two_blas_threads


def test_a_model_generates_the_same_tokens_on_one_free_core(two_blas_threads, one_core_taken, monkeypatch):
    """The forward and the decoding steps enter the BLAS limit (seen here) and give the idle tokens."""
    cfg = DecoderConfig(family="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, mlp=MLPConfig(48))
    lm = CausalLM(cfg, rng=0)
    prompt = np.array([[1, 2, 3, 4]])
    entered = []
    real = _threads.blas_limit

    def watched(n):
        entered.append(n)
        return real(n)

    monkeypatch.setattr(_threads, "blas_limit", watched)
    busy = lm.generate(prompt, max_new_tokens=6, do_sample=False, num_beams=2)
    assert entered and set(entered) == {1}
    attnkit.set_adaptive_threads(False)
    idle = lm.generate(prompt, max_new_tokens=6, do_sample=False, num_beams=2)
    np.testing.assert_array_equal(busy, idle)
