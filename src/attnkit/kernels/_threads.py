"""Thread pool and BLAS-thread management for the tiled kernel.

NumPy releases the GIL inside BLAS calls and inside ufunc loops (``exp``, ``multiply``, reductions), so
a handful of Python threads each working on its own tiles keeps all cores busy. BLAS must then run one
thread per caller: ``t`` tile threads times ``b`` BLAS threads above the core count only adds contention.

``threadpoolctl`` (the ``fast`` extra) sets the BLAS thread count; it is imported lazily, and without it
the kernel still runs, merely risking oversubscription if BLAS is itself multi-threaded.

Processes and interrupts: a child made by ``fork()`` inherits the pool's bookkeeping but none of its
threads, so the pool is forgotten in the child (``os.register_at_fork``) and rebuilt on first use.
When the calling thread stops (``KeyboardInterrupt``, an error in any task), the other workers are told
to stop and give up at their next :func:`check_stop` (the kernels call it between tiles).
"""
from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any

from .._arguments import bounded_int
from .._validation import check_positive_int

__all__ = ["MAX_NUM_THREADS", "check_num_threads", "thread_count_argument", "set_num_threads", "get_num_threads",
           "num_threads", "default_num_threads", "in_worker", "blas_single_thread", "one_row_blas", "run_tasks",
           "check_stop", "TasksStopped"]

_pool: ThreadPoolExecutor | None = None  # the process's helper threads, sized by the largest call so far
_pool_size = 0
_pool_lock = threading.Lock()
_in_worker = threading.local()  # .active: inside a worker loop; .stop: the running call's stop event
_controller: Any = None  # threadpoolctl.ThreadpoolController, False if unavailable, None before first use
_num_threads: int | None = None  # set by set_num_threads; None: every core this process may run on

# The most tile threads a call may use. Every worker is an operating-system thread (with its stack) and a
# per-call scratch; past the CPUs a process may run on, more of them only time-share those CPUs. 1024 is above
# the hardware threads of today's largest common servers (2 x 192 cores with SMT: 768) and far below where a
# count became the cost of every call (10**6 made a tiny forward take 3.3 s).
MAX_NUM_THREADS = 1024


class TasksStopped(Exception):
    """Raised inside a worker whose call was stopped (the caller sees the original error instead)."""


def check_num_threads(n: Any, name: str = "n") -> int:
    """``n`` as a thread count: an integer in [1, :data:`MAX_NUM_THREADS`] (``TypeError`` / ``ValueError``
    naming ``name`` otherwise). The one check of every thread count the kernels take."""
    return check_positive_int(n, name, maximum=MAX_NUM_THREADS)


# The argparse type of every --threads flag (attnkit's commands, the benchmarks): the bound check_num_threads
# applies, so a count the command line accepts is one the kernels run.
thread_count_argument = bounded_int(1, MAX_NUM_THREADS)


def set_num_threads(n: int | None) -> None:
    """Set how many threads the kernels use when a call does not say (``None``: every available core).

    Parameters
    ----------
    n : int or None
        A thread count in [1, :data:`MAX_NUM_THREADS`] (1024), or ``None`` to go back to the cores this
        process may run on.

    Raises
    ------
    TypeError, ValueError
        ``n`` is not an integer, or is outside [1, 1024]; the setting is then unchanged.

    Notes
    -----
    A count above the CPUs this process may run on (``os.sched_getaffinity``) is taken as given, not
    clamped: the tile plan and the backward's lanes, and so the last bits of a gradient, depend on the
    thread count alone, so one count means one computation on every machine (a run with ``n=8`` on a
    2-CPU laptop gives the bits of the same run on a 64-core server). The extra threads only time-share the
    CPUs. A call never starts more threads, nor makes more scratch buffers, than it has tasks: a tiny call
    costs the same at 1024 as at 1.

    Examples
    --------
    >>> import attnkit
    >>> attnkit.set_num_threads(1); attnkit.get_num_threads()
    1
    >>> attnkit.set_num_threads(None)
    """
    global _num_threads
    _num_threads = None if n is None else check_num_threads(n, "n")


def get_num_threads() -> int:
    """The number of threads the kernels use when a call does not say (see :func:`set_num_threads`)."""
    return default_num_threads()


@contextmanager
def num_threads(n: int | None):
    """Use ``n`` kernel threads inside a ``with`` block, then restore the previous setting.

    ``n`` is checked as by :func:`set_num_threads` (at most :data:`MAX_NUM_THREADS`) before anything changes.

    Examples
    --------
    >>> import attnkit
    >>> with attnkit.num_threads(2):
    ...     attnkit.get_num_threads()
    2
    """
    previous = _num_threads
    set_num_threads(n)
    try:
        yield
    finally:
        set_num_threads(previous)


def default_num_threads() -> int:
    """The number of tile threads used when the caller does not say: :func:`set_num_threads`'s value, or
    else the cores this process may run on, at most :data:`MAX_NUM_THREADS`.

    ``os.sched_getaffinity`` where the platform has it (containers and ``taskset`` restrict it), else
    ``os.cpu_count()``.
    """
    if _num_threads is not None:
        return _num_threads
    if hasattr(os, "sched_getaffinity"):
        try:
            return min(max(1, len(os.sched_getaffinity(0))), MAX_NUM_THREADS)
        except OSError:
            pass
    return min(os.cpu_count() or 1, MAX_NUM_THREADS)


def in_worker() -> bool:
    """Whether the calling thread is one of :func:`run_tasks`'s workers (a nested call runs inline there)."""
    return getattr(_in_worker, "active", False)


def check_stop() -> None:
    """Raise :class:`TasksStopped` if the call this worker is running for has been stopped."""
    event = getattr(_in_worker, "stop", None)
    if event is not None and event.is_set():
        raise TasksStopped


def _start_helpers(loop: Callable[[int], None], workers: int) -> list[Future]:
    """Run ``loop(1)`` .. ``loop(workers - 1)`` on the process's pool of helper threads.

    One long-lived pool (spawning threads per call costs), replaced by a larger one when a call needs more
    helpers than it has: the replaced pool's threads finish what they run and leave. Its threads start as
    tasks arrive, so the threads alive are those of the largest call so far, whatever the sizes of the others
    (a pool per worker count kept 1 + 2 + ... threads). Getting the pool and submitting happen under one lock,
    so a concurrent call cannot shut the pool down in between.
    """
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers - 1:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_size = ThreadPoolExecutor(max_workers=workers - 1, thread_name_prefix="attnkit"), workers - 1
        return [_pool.submit(loop, w) for w in range(1, workers)]


_limit_lock = threading.Lock()
_limit_users = 0
_limit_handle: Any = None


def _forget_pool_after_fork() -> None:
    """In a forked child: drop the parent's pool (its threads do not exist here) and reset the locks."""
    global _pool, _pool_size, _pool_lock, _limit_lock, _limit_users, _limit_handle
    _pool, _pool_size = None, 0
    _pool_lock = threading.Lock()
    _limit_lock = threading.Lock()
    _limit_users = 0
    _limit_handle = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


@contextmanager
def blas_single_thread():
    """Context manager limiting BLAS to one thread (a no-op without threadpoolctl).

    Uses one cached ``ThreadpoolController``: building a fresh one (what ``threadpool_limits`` does)
    inspects every loaded library and costs ~0.4 ms a call, entering a cached one costs ~3 us.
    The limit is process-wide while it is held, as every BLAS thread setting is; concurrent callers
    share it (reference-counted), and the last one out restores the original setting.
    """
    global _controller, _limit_users, _limit_handle
    with _limit_lock:
        if _controller is None:
            try:
                from threadpoolctl import ThreadpoolController
                _controller = ThreadpoolController()
            except Exception:  # threadpoolctl missing or unable to inspect the libraries
                _controller = False
        if _controller is not False:
            if _limit_users == 0:
                _limit_handle = _controller.limit(limits=1, user_api="blas")
            _limit_users += 1
    try:
        yield
    finally:
        with _limit_lock:
            if _controller is not False:
                _limit_users -= 1
                if _limit_users == 0:
                    _limit_handle.restore_original_limits()
                    _limit_handle = None


_ONE_ROW_CHOICES = ("auto", "single", "all")
_one_row_single: bool | None = None  # one-row products on one BLAS thread; None before the first decision
_one_row_lock = threading.Lock()


def one_row_blas():
    """Context manager for a chain of one-row products (a decoding step at batch 1): BLAS on one thread,
    unless this machine's one-row products run faster on all of BLAS's threads.

    A one-row product reads the whole weight for little arithmetic, so its speed is memory bandwidth. Whether
    a second BLAS thread adds bandwidth or only wake-up cost depends on the machine: a batch-1 decoding
    step of a SmolLM-135M shape ran 17% faster on two OpenBLAS threads on a 2-core AMD EPYC, while a GPT-2
    MLP weight at one row took 0.23 ms on one thread and 0.60 ms on two on an Intel server. So it is
    measured once per process, on the first call: six (1024, 2048) float32 weights (48 MiB, more than a
    cache holds, as a model's layers are) multiplied by one row, alternately on one thread and on all,
    best of four; all threads must win by 10%. The environment variable ``ATTNKIT_ONE_ROW_BLAS`` (``auto``,
    ``single`` or ``all``) decides instead.
    """
    return blas_single_thread() if _one_row_prefers_single() else nullcontext()


def _one_row_prefers_single() -> bool:
    global _one_row_single
    if _one_row_single is None:
        with _one_row_lock:
            if _one_row_single is None:
                choice = os.environ.get("ATTNKIT_ONE_ROW_BLAS", "auto").strip().lower() or "auto"
                if choice not in _ONE_ROW_CHOICES:
                    raise ValueError(f"ATTNKIT_ONE_ROW_BLAS must be one of {', '.join(_ONE_ROW_CHOICES)}, "
                                     f"got {choice!r}")
                _one_row_single = _single_thread_is_not_slower() if choice == "auto" else choice == "single"
    return _one_row_single


def _single_thread_is_not_slower() -> bool:
    """Time one-row products on one BLAS thread and on all (see :func:`one_row_blas`)."""
    import time

    import numpy as np

    if default_num_threads() < 2:
        return True
    weights = [np.full((1024, 2048), 0.5, dtype=np.float32) for _ in range(6)]  # 48 MiB
    row = np.full((1, 1024), 0.5, dtype=np.float32)

    def product_time() -> float:
        start = time.perf_counter()
        for weight in weights:
            row @ weight  # (1, 2048)
        return time.perf_counter() - start

    single, every = [], []
    for _ in range(4):
        with blas_single_thread():
            single.append(product_time())
        every.append(product_time())
    return min(every) > 0.9 * min(single)


def run_tasks(tasks: Sequence[Any], work: Callable[[Any, int], None], num_threads: int) -> int:
    """Run ``work(task, worker_id)`` for every task, spread over ``num_threads`` threads.

    Tasks are handed out dynamically in the given order (put the largest first for load balance). Each
    worker has a stable ``worker_id`` in ``range(workers)``, so it may own scratch buffers and private
    accumulators without locks. The calling thread is worker 0. With one thread, or one task, or when
    called from inside a worker (no nested pools: that could deadlock), everything runs in the calling
    thread. BLAS runs one thread per worker in every case, the single-worker one included: tile-sized
    products are too small to split, and a multi-threaded BLAS spinning next to a busy core made one
    tile thread 18x slower (measured, ``docs/benchmarks.md``). Nested calls leave the limit to their caller.

    If any worker fails or the calling thread is interrupted (``KeyboardInterrupt``), the others stop at
    their next :func:`check_stop`, and the first error is raised once all of them have returned.

    Returns
    -------
    int
        The number of workers used (``worker_id`` ranged over ``range(workers)``).
    """
    workers = min(int(num_threads), len(tasks))
    if getattr(_in_worker, "active", False):
        for task in tasks:
            work(task, 0)
        return 1
    if workers <= 1:
        with blas_single_thread():
            for task in tasks:
                work(task, 0)
        return 1
    counter = itertools.count()  # next() on a count is atomic under the GIL
    stop = threading.Event()

    def loop(worker_id: int) -> None:
        _in_worker.active, _in_worker.stop = True, stop
        try:
            while not stop.is_set():
                i = next(counter)
                if i >= len(tasks):
                    return
                work(tasks[i], worker_id)
        except BaseException:
            stop.set()  # the others leave at their next tile
            raise
        finally:
            _in_worker.active, _in_worker.stop = False, None

    with blas_single_thread():
        futures = _start_helpers(loop, workers)
        try:
            _join(loop, futures)
        except BaseException:  # KeyboardInterrupt while waiting, or the first task error
            stop.set()
            _wait_all(futures)  # no task may outlive the call (they write into the caller's arrays)
            raise
    return workers


def _join(loop: Callable[[int], None], futures) -> None:
    """Run worker 0 in the calling thread, then wait for the others; raise the first task error."""
    try:
        loop(0)
    except TasksStopped:  # another worker failed: its error is raised below
        pass
    error = None
    for f in futures:
        try:
            f.result()
        except TasksStopped:
            pass
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


def _wait_all(futures) -> None:
    """Wait until every future is done, ignoring their results (the caller raises its own error)."""
    for f in futures:
        try:
            f.result()
        except BaseException:  # TasksStopped, or a second error: the first one is reported
            pass
