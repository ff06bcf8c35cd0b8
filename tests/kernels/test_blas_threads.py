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
