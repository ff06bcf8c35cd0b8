"""The tiled kernel's tiles run with single-threaded BLAS, with one tile thread as with many."""
from __future__ import annotations

import pytest

threadpoolctl = pytest.importorskip("threadpoolctl")

from attnkit.kernels import _threads  # noqa: E402

pytestmark = pytest.mark.concurrency


def _blas_threads() -> list[int]:
    return [lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]


@pytest.mark.parametrize("num_threads", [1, 2])
def test_tasks_see_one_blas_thread_and_the_setting_comes_back(num_threads):
    if not _blas_threads():
        pytest.skip("no BLAS found by threadpoolctl")
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        before = _blas_threads()
        seen = []
        _threads.run_tasks([0, 1, 2], lambda task, worker: seen.append(_blas_threads()), num_threads)
        assert seen and all(threads == [1] * len(before) for threads in seen)
        assert _blas_threads() == before  # restored after the call


@pytest.fixture
def undecided(monkeypatch):
    """The one-row decision forgotten, so that the test makes it again."""
    monkeypatch.setattr(_threads, "_one_row_single", None)
    return monkeypatch


@pytest.mark.parametrize("choice, expected", [("single", [1]), ("all", [2]), (" Single ", [1])])
def test_the_environment_decides_the_one_row_blas_threads(undecided, choice, expected):
    if not _blas_threads():
        pytest.skip("no BLAS found by threadpoolctl")
    undecided.setenv("ATTNKIT_ONE_ROW_BLAS", choice)
    undecided.setattr(_threads, "_single_thread_is_not_slower", lambda: pytest.fail("measured although set"))
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        before = _blas_threads()
        with _threads.one_row_blas():
            assert _blas_threads() == expected * len(before)
        assert _blas_threads() == before


def test_a_bad_environment_value_names_the_variable(undecided):
    undecided.setenv("ATTNKIT_ONE_ROW_BLAS", "four")
    with pytest.raises(ValueError, match=r"ATTNKIT_ONE_ROW_BLAS must be one of auto, single, all, got 'four'"):
        _threads.one_row_blas()


def test_the_measurement_runs_once_per_process(undecided):
    undecided.delenv("ATTNKIT_ONE_ROW_BLAS", raising=False)
    calls = []
    undecided.setattr(_threads, "_single_thread_is_not_slower", lambda: calls.append(1) or False)
    for _ in range(3):
        with _threads.one_row_blas():
            pass
    assert calls == [1] and _threads._one_row_single is False


def test_the_measurement_answers_and_leaves_the_blas_setting_as_it_was(undecided):
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        before = _blas_threads()
        assert _threads._single_thread_is_not_slower() in (True, False)
        assert _blas_threads() == before
