"""Thread pool and BLAS-thread management for the tiled kernel.

NumPy releases the GIL inside BLAS calls and inside ufunc loops (``exp``, ``multiply``, reductions), so
a handful of Python threads each working on its own tiles keeps all cores busy. BLAS must then run one
thread per caller: ``t`` tile threads times ``b`` BLAS threads above the core count only adds contention.

``threadpoolctl`` (the ``fast`` extra) sets the BLAS thread count; it is imported lazily, and without it
the kernel still runs, merely risking oversubscription if BLAS is itself multi-threaded.

Other processes: a machine's cores may be taken by other processes (a shared machine, a build running beside).
Threads that wait for each other then wait for a descheduled thread: a 2-beam search of a SmolLM-135M shape
took 1.8-2.4x as long on two threads as on one while a busy loop held one of two cores, and OpenBLAS, which
splits every product over its threads and spins waiting for the slowest, did most of the damage. So, unless
:func:`set_adaptive_threads` turns it off, the work is run on the cores other processes left free
(:func:`free_cores`, read from ``/proc/stat`` at most every :data:`LOAD_INTERVAL` seconds): :func:`run_tasks`
starts no more workers than there are free cores, and :func:`blas_on_free_cores` (entered by the models'
forward and decoding steps) holds BLAS to them. What is computed does not change: the tasks (tile plans, the
backward's lanes, a product's row blocks) are cut by the thread count alone, and any worker may run any
task, so the bits are those of an idle machine; only who runs the tasks, and how many BLAS threads run
the products outside them, follow the load.

Processes and interrupts: a child made by ``fork()`` inherits the pool's bookkeeping but none of its
threads, so the pool is forgotten in the child (``os.register_at_fork``) and rebuilt on first use.
When the calling thread stops (``KeyboardInterrupt``, an error in any task), the other workers are told
to stop and give up at their next :func:`check_stop` (the kernels call it between tiles).
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any

from .._arguments import bounded_int
from .._cpu import busy_seconds, usable_cpu_ids
from .._validation import check_positive_int
from .tuning import current_choices

__all__ = ["MAX_NUM_THREADS", "LOAD_INTERVAL", "check_num_threads", "thread_count_argument", "set_num_threads",
           "get_num_threads", "num_threads", "default_num_threads", "set_adaptive_threads", "get_adaptive_threads",
           "free_cores", "cores_left", "in_worker", "blas_limit", "blas_single_thread", "blas_on_free_cores",
           "one_row_blas", "decode_blas", "run_tasks", "check_stop", "TasksStopped"]

_pool: ThreadPoolExecutor | None = None  # the process's helper threads, sized by the largest call so far
_pool_size = 0
_pool_lock = threading.Lock()
_in_worker = threading.local()  # .active: inside a worker loop; .stop: the running call's stop event
_blas_libraries: Any = None  # threadpoolctl's controllers of the BLAS libraries, False if unavailable, None before use
_num_threads: int | None = None  # set by set_num_threads; None: every core this process may run on
_adaptive = True  # set by set_adaptive_threads: run on the cores other processes left free

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
    2-CPU laptop gives the bits of the same run on a 64-core server). The work is cut for ``n`` threads but
    run by at most as many as there are free cores (:func:`set_adaptive_threads`; with that off, the extra
    threads time-share the CPUs). A call never starts more threads, nor makes more scratch buffers, than it has
    tasks: a tiny call costs the same at 1024 as at 1.

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
    """The number of tile threads used when the caller does not say: :func:`set_num_threads`'s value, else the
    count ``attnkit tune`` measured best on this machine (:mod:`attnkit.kernels.tuning`; never above the cores
    this process may run on), else those cores, at most :data:`MAX_NUM_THREADS`.

    ``os.sched_getaffinity`` where the platform has it (containers and ``taskset`` restrict it), else
    ``os.cpu_count()``.
    """
    if _num_threads is not None:
        return _num_threads
    tuned = current_choices().num_threads
    return _usable_count() if tuned is None else min(tuned, _usable_count())


def set_adaptive_threads(enabled: bool) -> None:
    """Whether the kernels run on the cores other processes left free (default True) or on all of their threads.

    Parameters
    ----------
    enabled : bool
        True: :func:`run_tasks` starts at most :func:`free_cores` workers, and the models' forward and decoding
        steps hold BLAS to that many threads (:func:`blas_on_free_cores`). False: every thread of
        :func:`get_num_threads` runs whatever the load (a benchmark of thread scaling wants that).

    Notes
    -----
    The setting changes who runs the work, never the work: tile plans, the backward's lanes and a product's
    row blocks depend on :func:`get_num_threads` alone, so the kernels' results are the same bits either way.
    OpenBLAS's own result for a product can depend on how many threads it splits it over (a (300, 3000) x
    (3000, 300) float32 product differed in its last bits, 2e-7 relative, between 1 and 2 threads; the
    products of the model shapes measured did not): with the setting on, such a product outside the kernels'
    tasks may differ in its last bits between a busy and an idle machine. Turn it off, or pin BLAS with
    ``--threads`` / ``threadpoolctl``, when runs on a busy machine must match idle ones bit for bit.

    Examples
    --------
    >>> import attnkit
    >>> attnkit.set_adaptive_threads(False); attnkit.get_adaptive_threads()
    False
    >>> attnkit.set_adaptive_threads(True)
    """
    global _adaptive
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    _adaptive = enabled


def get_adaptive_threads() -> bool:
    """Whether the kernels run on the cores other processes left free (see :func:`set_adaptive_threads`)."""
    return _adaptive


# Seconds between two readings of the load: /proc/stat counts in ticks of 10 ms, so half a second gives every
# CPU 50 ticks (a reading to about 0.05 cores), and a load that comes or goes is followed within a second.
LOAD_INTERVAL = 0.5


class _LoadReading:
    """The last reading of the load: when, the CPUs' busy time then, this process's CPU time then, and the
    cores found free since the reading before."""

    __slots__ = ("wall", "busy", "own", "cpus", "free")

    def __init__(self) -> None:
        self.wall = self.busy = self.own = None
        self.cpus: frozenset[int] | None = None
        self.free: int | None = None

    def take(self) -> None:
        """Read the counters now (the start of the next interval)."""
        self.cpus = usable_cpu_ids()
        self.wall, self.busy, self.own = time.monotonic(), busy_seconds(self.cpus), time.process_time()


_reading = _LoadReading()
_reading_lock = threading.Lock()
_reading.take()  # the first interval runs from import to the first call


def cores_left(busy: float, own: float, wall: float, usable: int) -> int:
    """How many of ``usable`` cores other processes left free over an interval of ``wall`` seconds in which the
    CPUs were busy for ``busy`` CPU-seconds, ``own`` of them this process's.

    The others used ``(busy - own) / wall`` cores; half a core or more counts as a core taken (a busy loop
    beside two threads of ours gets two thirds of a core, and must count as one). At least 1.

    Examples
    --------
    >>> cores_left(busy=1.0, own=0.98, wall=0.5, usable=2)  # idle but for this process
    2
    >>> cores_left(busy=1.0, own=0.62, wall=0.5, usable=2)  # a busy loop got 0.76 of a core
    1
    >>> cores_left(busy=4.0, own=0.0, wall=0.5, usable=2)  # eight busy cores' worth: still one
    1
    """
    others = max(0.0, busy - own) / wall
    return max(1, min(usable, usable - int(others + 0.5)))


def free_cores() -> int:
    """The cores this process may run on that other processes left free, as last read (at most
    :data:`LOAD_INTERVAL` seconds ago): the CPUs' busy time in ``/proc/stat`` minus this process's own CPU time
    over the interval (:func:`cores_left`). All of the process's cores where the load cannot be read (not Linux),
    before the first interval ends and when :func:`set_adaptive_threads` turned this off.

    Examples
    --------
    >>> 1 <= free_cores() <= (os.cpu_count() or 1)
    True
    """
    usable = _usable_count()
    if not _adaptive:
        return usable
    now = time.monotonic()
    if _reading.wall is not None and now - _reading.wall < LOAD_INTERVAL:
        return min(usable, _reading.free or usable)
    with _reading_lock:
        if _reading.wall is not None and now - _reading.wall < LOAD_INTERVAL:  # another thread just read it
            return min(usable, _reading.free or usable)
        before = (_reading.wall, _reading.busy, _reading.own, _reading.cpus)
        _reading.take()
        wall, busy, own, cpus = before
        if busy is None or _reading.busy is None or cpus != _reading.cpus or _reading.wall - wall <= 0:
            _reading.free = None  # no reading (no /proc/stat, or the affinity changed): every core
        else:
            _reading.free = cores_left(_reading.busy - busy, _reading.own - own, _reading.wall - wall, usable)
        return min(usable, _reading.free or usable)


def _usable_count() -> int:
    """The CPUs this process may run on (affinity), at least 1, at most :data:`MAX_NUM_THREADS`."""
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
_limits: list[int] = []  # the BLAS thread limits held now, by every caller; the lowest applies
_original: list[tuple[Any, int]] | None = None  # (BLAS library, its own thread count) while a limit is held


def _forget_pool_after_fork() -> None:
    """In a forked child: drop the parent's pool (its threads do not exist here), reset the locks, and start a
    new load reading (the child's CPU time starts at zero)."""
    global _pool, _pool_size, _pool_lock, _limit_lock, _limits, _original, _reading_lock
    _pool, _pool_size = None, 0
    _pool_lock = threading.Lock()
    _limit_lock = threading.Lock()
    _limits, _original = [], None
    _reading_lock = threading.Lock()
    _reading.take()
    _reading.free = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _blas() -> list[Any]:
    """threadpoolctl's controllers of the loaded BLAS libraries (empty without threadpoolctl), found once.

    Finding them (what ``threadpool_limits`` does on every call) inspects every loaded library and costs
    ~0.4 ms; setting a found library's thread count costs ~2 us.
    """
    global _blas_libraries
    if _blas_libraries is None:
        try:
            from threadpoolctl import ThreadpoolController
            _blas_libraries = list(ThreadpoolController().select(user_api="blas").lib_controllers)
        except Exception:  # threadpoolctl missing or unable to inspect the libraries
            _blas_libraries = False
    return _blas_libraries or []


def _apply_limits() -> None:
    """Set every BLAS library to the lowest limit held (never above its own count), or give it back its own
    count when no limit is held. Called with ``_limit_lock`` held."""
    global _original
    if not _limits:
        for library, count in _original or ():
            library.set_num_threads(count)
        _original = None
        return
    if _original is None:
        _original = [(library, library.num_threads) for library in _blas()]
    lowest = min(_limits)
    for library, count in _original:
        library.set_num_threads(min(lowest, count))


@contextmanager
def blas_limit(n: int):
    """Context manager holding BLAS to at most ``n`` threads (a no-op without threadpoolctl).

    The limit is process-wide while it is held, as every BLAS thread setting is; concurrent and nested
    holders share it: the lowest limit held applies, never more threads than BLAS had, and when the last
    holder leaves, BLAS gets its own count back.
    """
    n = check_num_threads(n)
    with _limit_lock:
        held = bool(_blas())
        if held:
            _limits.append(n)
            _apply_limits()
    try:
        yield
    finally:
        if held:
            with _limit_lock:
                _limits.remove(n)
                _apply_limits()


def blas_single_thread():
    """Context manager limiting BLAS to one thread (a no-op without threadpoolctl); see :func:`blas_limit`."""
    return blas_limit(1)


def blas_on_free_cores():
    """Context manager holding BLAS to the cores other processes left free (:func:`free_cores`), for a chain of
    products outside :func:`run_tasks` (a model's forward, a decoding step); nothing when every core is free.

    OpenBLAS splits each product over its threads and spins until the slowest is done: beside a busy core
    every product waits for a descheduled thread (a 2-beam search of a SmolLM-135M shape: 4.8 s with two BLAS
    threads, 2.2 s with one, while a busy loop held one of two cores).
    """
    free = free_cores()
    return blas_limit(free) if free < _usable_count() else nullcontext()


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
    ``single`` or ``all``) decides instead. "All" means all of the free cores (:func:`blas_on_free_cores`).
    """
    return blas_single_thread() if _one_row_prefers_single() else blas_on_free_cores()


def decode_blas(tokens: int):
    """Context manager for a model forward over ``tokens`` tokens (B * L): BLAS on one thread for a decoding
    step small enough, else on the free cores (:func:`blas_on_free_cores`).

    "Small enough" is the tuned ``single_blas_rows`` (:mod:`attnkit.kernels.tuning`: the most rows at which one
    BLAS thread was not slower than all of them, measured by ``attnkit tune``); without a tuning, one token,
    as :func:`one_row_blas` decides. ``ATTNKIT_ONE_ROW_BLAS`` still decides one token when set.
    """
    limit = current_choices().single_blas_rows
    if tokens <= 1 and (limit is None or os.environ.get("ATTNKIT_ONE_ROW_BLAS", "auto").strip().lower()
                        not in ("", "auto")):
        return one_row_blas()
    if limit is not None and tokens <= limit:
        return blas_single_thread()
    return blas_on_free_cores()


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

    Tasks are handed out dynamically in the given order (put the largest first for load balance): a worker
    that the operating system holds back runs fewer of them, the others take the rest. Each worker has a
    stable ``worker_id`` in ``range(workers)``, so it may own scratch buffers and private accumulators without
    locks; what a task computes must not depend on it (then the result is the same whoever runs what). The
    calling thread is worker 0. At most :func:`free_cores` workers start (all of ``num_threads`` with
    :func:`set_adaptive_threads` off): the tasks stay those cut for ``num_threads``, fewer threads run them.
    With one thread, or one task, or when called from inside a worker (no nested pools: that could deadlock),
    everything runs in the calling thread. BLAS runs one thread per worker in every case, the single-worker
    one included: tile-sized products are too small to split, and a multi-threaded BLAS spinning next to a
    busy core made one tile thread 18x slower (measured, ``docs/benchmarks.md``). Nested calls leave the
    limit to their caller.

    If any worker fails or the calling thread is interrupted (``KeyboardInterrupt``), the others stop at
    their next :func:`check_stop`, and the first error is raised once all of them have returned.

    Returns
    -------
    int
        The number of workers used (``worker_id`` ranged over ``range(workers)``).
    """
    workers = min(int(num_threads), len(tasks))
    if _adaptive:
        workers = min(workers, free_cores())
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
