"""``attnkit tune``: measure the kernels' machine-dependent choices here and cache them (:mod:`attnkit.kernels.tuning`).

A few seconds: the tile sizes of the tiled attention (forward and backward), from how many rows products are
split over attnkit's threads, up to how many tokens a decoding step keeps BLAS on one thread, and the thread
count (:mod:`attnkit.kernels.calibration`). Prints what it timed and chose, and writes the choices to this
machine's file in the cache folder, which every later process on this machine (same CPU, cores and library
versions) uses unless ``ATTNKIT_TUNE=0``. ``--show`` prints the choices in use and where they come from.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

from ..kernels import tuning
from ._common import UsageError, bounded_int, printable

__all__ = ["NAME", "add_parser", "run"]

NAME = "tune"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``attnkit tune`` and its arguments."""
    p = subparsers.add_parser(
        NAME, help="measure tile sizes, product splits and threads on this machine (a few seconds) and cache them",
        description="Measure the kernels' machine-dependent choices on this machine (the tiled attention's tile "
                    "sizes, forward and backward; from how many rows products are split over threads; up to how "
                    "many tokens a decoding step keeps BLAS on one thread; the thread count), each a fixed set "
                    "of candidates timed best of --repeats, a candidate replacing the default only if it takes "
                    "less than 90% of its time; choices measured while other processes used a core keep their "
                    "previous value (the last tune's, else the default). Writes them to $XDG_CACHE_HOME/attnkit "
                    "(else ~/.cache/attnkit), one file per CPU "
                    "model, core count and library versions; attnkit then uses them in every process on this "
                    "machine (ATTNKIT_TUNE=0: the defaults).")
    p.add_argument("--show", action="store_true", help="print the choices in use and where they come from; "
                                                       "measure nothing")
    p.add_argument("--repeats", type=bounded_int(1, 100), default=3,
                   help="timed runs per candidate, best kept (default 3)")
    p.add_argument("--ignore-load", action="store_true",
                   help="keep what was measured even while other processes used a core")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Show, or measure and write, the tuned choices."""
    enabled = tuning.tuning_enabled()  # a bad value was refused by the command line's entry
    path = tuning.cache_path()
    if args.show:
        print(f"choices: {tuning.describe_choices()}")
        print(f"this machine's file: {printable(str(path))}")
        return 0
    _check_writable(path)
    from ..kernels.calibration import calibrate

    try:  # a choice measured beside a busy core keeps the last quiet tune's value
        keep = tuning.load_choices(path)
    except (OSError, ValueError):
        keep = tuning.DEFAULT_CHOICES
    result = calibrate(busy=(lambda: False) if args.ignore_load else None, repeats=args.repeats, keep=keep)
    for line in _trial_lines(result.trials):
        print(line)
    try:
        tuning.save_choices(path, result.choices, result.record())
    except OSError as exc:
        raise UsageError(f"cannot write the tuning file {printable(str(path))}: {exc.strerror or exc}") from None
    tuning.forget_cached()
    print(f"measured in {result.seconds:.1f} s"
          + ("; other processes used a core meanwhile: the choices measured then kept their previous values (run "
             "again on a quieter machine, or with --ignore-load)" if result.busy else ""))
    print(f"chosen: {tuning.describe_choices(result.choices, 'written to ' + printable(str(path)))}")
    if not enabled:
        print(f"note: {tuning.ENV_TUNE}=0 is set here: attnkit uses the defaults until it is unset")
    return 0


def _check_writable(path) -> None:
    """Fail before measuring when the cache folder cannot be made or written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise UsageError(f"cannot write the tuning file in {printable(str(path.parent))}: "
                         f"{exc.strerror or exc}") from None


def _value(candidate: Any) -> str:
    if candidate is None:
        return "default"
    if isinstance(candidate, int) and candidate >= 1 << 16:
        return f"{candidate >> 10} KiB"
    return str(candidate)


def _trial_lines(trials: dict[str, list]) -> list[str]:
    """One line per choice: each candidate's best time (ms)."""
    lines = []
    for setting, rows in trials.items():
        if setting.endswith("_kept"):
            kept = rows[0][1]
            lines.append(f"{setting[:-len('_kept')]}: measured beside a busy core: kept "
                         f"{'the default' if kept is None else _value(kept)}")
            continue
        parts = []
        for candidate, seconds in rows:
            if isinstance(seconds, dict):
                parts.append(f"{candidate}: " + " / ".join(f"{k} {v * 1e3:.2f} ms" for k, v in seconds.items()))
            else:
                parts.append(f"{_value(candidate)} {seconds * 1e3:.2f} ms")
        lines.append(f"{setting}: " + "; ".join(parts))
    return lines
