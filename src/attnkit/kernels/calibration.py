"""Measure the kernels' machine-dependent choices on this machine (``attnkit tune``; a few seconds).

Dimension letters: B batch, H heads, L sequence length, Dh head features, M rows, K inner, N output features.

Deterministic in what it compares: a fixed candidate set per choice, fixed shapes, each candidate timed as the
best of ``repeats`` runs after one untimed run, and a candidate replaces the default only when it takes less than
:data:`MARGIN` of the default's time (so noise keeps the default, never a slower choice). The timings come from
one function, ``measure(setting, candidate) -> seconds``, which tests replace by a fake.

What is measured, in order (each with the choices found before it pinned):

* ``tile_l2_forward`` / ``tile_l2_backward``: the cache size the tile model of
  :mod:`attnkit.kernels._tile_sizes` sizes tiles for; candidates :data:`TILE_L2_CANDIDATES` (tiles 128x128,
  256x256, 256x512 and 512x512 at the shape measured) against the machine's L2. Timed: the tiled forward
  (backward) of :data:`ATTENTION_SHAPE`, causal and not.
* ``split_rows``: from how many rows a product is split over attnkit's threads. At each of
  :data:`SPLIT_ROW_CANDIDATES` a (M, 576) x (576, 1536) product (a SmolLM-135M projection) is timed split and as
  one BLAS call on BLAS's threads; from the default 256 the threshold moves up while one call wins by the
  margin, or down while the split wins by it. Needs two threads.
* ``single_blas_rows``: up to how many rows a decoding step keeps BLAS on one thread. Six (1024, 2048) weights
  (48 MiB, more than a cache holds, as a model's layers are) times M rows, on one BLAS thread and on all, for M
  in :data:`SINGLE_BLAS_ROW_CANDIDATES`: one row stays on one thread unless all threads win by the margin;
  more rows (all threads by default) go to one thread only while one thread wins by it.
* ``num_threads``: the kernels' thread count, candidates the powers of two below the usable cores and the
  cores themselves; timed: the attention forward and backward and a 1024-row product.

A choice measured while other processes used half a core or more keeps its default (or, with ``keep``, the
value cached before): a busy core makes fewer
threads look faster (OpenBLAS's threads wait for a descheduled one: one-row products took 40x as long on two
threads as on one beside other work here) and every timing noisy, and the run-time load following of
:mod:`attnkit.kernels._threads` already handles a busy machine.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._cpu import busy_seconds, l2_bytes, usable_cores
from . import _threads
from .linear import split_product
from .tiled import default_blocks, flash_attention_backward, flash_attention_forward
from .tuning import DEFAULT_CHOICES, Choices, pinned

__all__ = ["MARGIN", "TILE_L2_CANDIDATES", "SPLIT_ROW_CANDIDATES", "SINGLE_BLAS_ROW_CANDIDATES", "ATTENTION_SHAPE",
           "Calibration", "Workloads", "LoadWatch", "calibrate", "tile_candidates", "thread_candidates"]

MARGIN = 0.9  # a candidate must take less than 90% of the default's time to replace it
TILE_L2_CANDIDATES = (256 << 10, 512 << 10, 1 << 20, 2 << 20)
SPLIT_ROW_CANDIDATES = (64, 128, 256, 512, 1024, 2048)
SINGLE_BLAS_ROW_CANDIDATES = (1, 2, 4, 8)
ATTENTION_SHAPE = (1, 4, 1024, 64)  # B, H, L, Dh
PRODUCT_SHAPE = (576, 1536)  # K, N
NEVER_SPLIT = 1 << 20

Measure = Callable[[str, Any], float]


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` chose, and what it measured.

    Attributes
    ----------
    choices : Choices
    trials : dict
        Per setting, ``[candidate, seconds]`` pairs in the order measured (``candidate`` None: the default).
    busy : bool
        Other processes used half a core or more while measuring (the thread count then kept its default).
    seconds : float
        How long the calibration took.
    """

    choices: Choices
    trials: dict[str, list[list[Any]]]
    busy: bool
    seconds: float

    def record(self) -> dict[str, Any]:
        """The JSON-ready record saved beside the choices."""
        return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(self.seconds, 2),
                "busy": self.busy, "margin": MARGIN, "trials": self.trials}


def _best_time(run: Callable[[], Any], repeats: int) -> float:
    run()  # warm: first-call allocations, the thread pool, BLAS's own threads
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


class Workloads:
    """The real measurements: ``workloads(setting, candidate)`` is the best time of ``repeats`` runs.

    Parameters
    ----------
    repeats : int
        Timed runs per candidate (after one untimed run).
    base : Choices
        The choices found so far; the candidate replaces one field of them while it runs.
    """

    def __init__(self, repeats: int = 3) -> None:
        rng = np.random.default_rng(0)
        b, h, length, dh = ATTENTION_SHAPE
        self.q, self.k, self.v = (rng.standard_normal((b, h, length, dh), dtype=np.float32) for _ in range(3))
        self.grad = rng.standard_normal((b, h, length, dh), dtype=np.float32)  # (B, H, L, Dh)
        k_in, n_out = PRODUCT_SHAPE
        self.x = rng.standard_normal((max(SPLIT_ROW_CANDIDATES), k_in), dtype=np.float32)  # (M, K)
        self.w = rng.standard_normal(PRODUCT_SHAPE, dtype=np.float32)  # (K, N)
        self.decode_weights = [np.full((1024, 2048), 0.5, dtype=np.float32) for _ in range(6)]  # 48 MiB
        self.repeats = repeats
        self.base = DEFAULT_CHOICES

    def __call__(self, setting: str, candidate: Any) -> float:
        return getattr(self, f"_{setting}")(candidate)

    def _forward(self) -> list:
        return [flash_attention_forward(self.q, self.k, self.v, causal=causal)[2] for causal in (False, True)]

    def _backward(self, contexts: list) -> None:
        flash_attention_backward(self.grad, contexts[0])  # the non-causal one (a causal backward adds little)

    def _tile_l2_forward(self, l2: int | None) -> float:
        with pinned(replace(self.base, tile_l2_forward=l2)):
            return _best_time(self._forward, self.repeats)

    def _tile_l2_backward(self, l2: int | None) -> float:
        contexts = self._forward()
        with pinned(replace(self.base, tile_l2_backward=l2)):
            return _best_time(lambda: self._backward(contexts), self.repeats)

    def _product(self, candidate: tuple[int, bool]) -> float:
        rows, split = candidate
        a = self.x[:rows]  # (M, K)
        workers = _threads.default_num_threads()
        return _best_time((lambda: split_product(a, self.w, workers)) if split else (lambda: a @ self.w),
                          self.repeats)

    def _decode_blas(self, candidate: tuple[int, bool]) -> float:
        rows, single = candidate
        x = np.full((rows, 1024), 0.5, dtype=np.float32)  # (M, 1024)

        def chain() -> None:
            for weight in self.decode_weights:
                x @ weight  # (M, 2048)

        with _threads.blas_single_thread() if single else nullcontext():
            return _best_time(chain, self.repeats)

    def _num_threads(self, n: int) -> float:
        def step() -> None:
            flash_attention_backward(self.grad, flash_attention_forward(self.q, self.k, self.v)[2])
            split_product(self.x[:1024], self.w, n) if n > 1 else self.x[:1024] @ self.w  # (1024, N)

        with pinned(self.base), _threads.num_threads(n), _threads.blas_limit(n):
            return _best_time(step, self.repeats)


class LoadWatch:
    """Whether other processes used half a core or more since the last call (``/proc/stat``; never where it
    cannot be read). Calling it starts the next interval."""

    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        self.wall, self.busy, self.own = time.monotonic(), busy_seconds(), time.process_time()

    def __call__(self) -> bool:
        busy, wall, own = busy_seconds(), time.monotonic() - self.wall, time.process_time() - self.own
        before = self.busy
        self._start()
        if busy is None or before is None or wall <= 0:
            return False
        return max(0.0, (busy - before) - own) / wall >= 0.5


def tile_candidates(split: str, num_threads: int, l2: int | None = None) -> list[int | None]:
    """The default (None: the machine's L2) and those of :data:`TILE_L2_CANDIDATES` whose tiles at
    :data:`ATTENTION_SHAPE` differ from every candidate before them (the same tiles need no second timing).

    >>> tile_candidates("q", 1, l2=512 << 10)
    [None, 262144, 1048576, 2097152]
    """
    _, heads, length, dh = ATTENTION_SHAPE
    machine = l2_bytes() if l2 is None else l2
    seen, kept = set(), []
    for candidate in (None, *TILE_L2_CANDIDATES):
        tiles = default_blocks(heads, length, length, num_threads, split, head_dim=dh, l2=candidate or machine)
        if tiles not in seen:
            seen.add(tiles)
            kept.append(candidate)
    return kept


def thread_candidates(usable: int) -> list[int]:
    """The default (every usable core) first, then the powers of two below it, largest first.

    >>> thread_candidates(6)
    [6, 4, 2, 1]
    """
    return [usable] + [1 << i for i in reversed(range(usable.bit_length())) if 1 << i < usable]


def _pick(default: Any, candidates: list[Any], measure: Measure, setting: str, trials: dict) -> Any:
    """Time every candidate; the fastest replaces ``default`` if it takes less than MARGIN of its time."""
    times = {c: measure(setting, c) for c in [default, *[c for c in candidates if c != default]]}
    trials[setting] = [[c, t] for c, t in times.items()]
    best = min(times, key=lambda c: (times[c], c != default))
    return best if times[best] < MARGIN * times[default] else default


def _split_rows(measure: Measure, trials: dict) -> int:
    """The row threshold of the split products, moved from the default while one side wins by the margin."""
    rows = list(SPLIT_ROW_CANDIDATES)
    times: dict[int, tuple[float, float]] = {}

    def timed(m: int) -> tuple[float, float]:  # (split, one call)
        if m not in times:
            times[m] = (measure("product", (m, True)), measure("product", (m, False)))
        return times[m]

    def one_call_wins(m: int) -> bool:
        split, plain = timed(m)
        return plain < MARGIN * split

    def split_wins(m: int) -> bool:
        split, plain = timed(m)
        return split < MARGIN * plain

    i = rows.index(DEFAULT_CHOICES.split_rows)
    if one_call_wins(rows[i]):  # raise the threshold past every row count where one call wins
        while i < len(rows) and one_call_wins(rows[i]):
            i += 1
        chosen = rows[i] if i < len(rows) else NEVER_SPLIT
    else:  # lower it while the split wins below
        while i > 0 and split_wins(rows[i - 1]):
            i -= 1
        chosen = rows[i]
    trials["split_rows"] = [[m, {"split": s, "one_call": p}] for m, (s, p) in sorted(times.items())]
    return chosen


def _single_blas_rows(measure: Measure, trials: dict) -> int:
    """The most rows at which a decoding step keeps BLAS on one thread (see the module docstring)."""
    chosen, record = 0, []
    for rows in SINGLE_BLAS_ROW_CANDIDATES:
        single, every = measure("decode_blas", (rows, True)), measure("decode_blas", (rows, False))
        record.append([rows, {"one_thread": single, "all_threads": every}])
        keeps_single = every >= MARGIN * single if rows == 1 else single < MARGIN * every
        if not keeps_single:
            break
        chosen = rows
    trials["single_blas_rows"] = record
    return chosen


def calibrate(measure: Measure | None = None, busy: Callable[[], bool] | None = None, repeats: int = 3,
              usable: int | None = None, keep: Choices = DEFAULT_CHOICES) -> Calibration:
    """Measure every choice (see the module docstring) and return them with the timings.

    Parameters
    ----------
    measure : callable, optional
        ``measure(setting, candidate) -> seconds``; default :class:`Workloads` (the real kernels).
    busy : callable, optional
        Asked before the first choice and after each: whether other processes took a core since it was last
        asked; if so, that choice takes its value in ``keep``. Default :class:`LoadWatch` (half a core or more
        used by others, from ``/proc/stat``); ``lambda: False`` takes every measurement as it comes.
    repeats : int
        Timed runs per candidate for the default ``measure``.
    usable : int, optional
        The cores to calibrate for (default: those this process may run on).
    keep : Choices
        What a choice measured beside a busy core keeps: the defaults, or (``attnkit tune``) the choices cached
        before, so a busy re-run does not undo a quiet one.
    """
    start = time.perf_counter()
    usable = usable_cores() if usable is None else usable
    workloads = Workloads(repeats) if measure is None else None
    measure = workloads if measure is None else measure
    busy = LoadWatch() if busy is None else busy
    trials: dict[str, list] = {}
    adaptive = _threads.get_adaptive_threads()
    _threads.set_adaptive_threads(False)  # every candidate on the threads it names, whatever the load
    try:
        with pinned(DEFAULT_CHOICES):
            choices, was_busy = _measure_all(measure, busy, trials, usable, workloads, keep)
    finally:
        _threads.set_adaptive_threads(adaptive)
    return Calibration(choices, trials, was_busy, time.perf_counter() - start)


def _measure_all(measure: Measure, busy: Callable[[], bool], trials: dict, usable: int,
                 workloads: Workloads | None, keep: Choices) -> tuple[Choices, bool]:
    """Every choice in turn, each with those before it pinned; whether a thread measurement met a busy core."""
    choices = DEFAULT_CHOICES

    def found(**values: Any) -> None:
        nonlocal choices
        choices = replace(choices, **values)
        if workloads is not None:
            workloads.base = choices

    phases = [("tile_l2_forward", lambda: _pick(None, tile_candidates("q", usable)[1:], measure,
                                                "tile_l2_forward", trials)),
              ("tile_l2_backward", lambda: _pick(None, tile_candidates("k", usable)[1:], measure,
                                                 "tile_l2_backward", trials))]
    if usable > 1:
        counted = _as_count(measure, usable)
        phases += [("split_rows", lambda: _split_rows(measure, trials)),
                   ("single_blas_rows", lambda: _single_blas_rows(measure, trials)),
                   ("num_threads", lambda: _pick(None, thread_candidates(usable)[1:], counted, "num_threads",
                                                 trials))]
    was_busy = False
    busy()  # each phase's load is read from its start
    for setting, measured in phases:
        value = measured()
        if busy():  # a busy core makes fewer threads look faster, and any timing noisy: keep what was
            was_busy = True
            trials[setting + "_kept"] = [["busy", getattr(keep, setting)]]
            found(**{setting: getattr(keep, setting)})
        else:
            found(**{setting: value})
    return choices, was_busy


def _as_count(measure: Measure, usable: int) -> Measure:
    """``measure`` for the thread count, asked with ``usable`` where the candidate is the default (None)."""
    return lambda setting, n: measure(setting, usable if n is None else n)
