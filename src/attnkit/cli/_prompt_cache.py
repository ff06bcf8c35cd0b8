"""``--prompt-cache FILE`` of ``attnkit generate`` and ``attnkit chat``, as llama.cpp's flag of that name: the cache
is saved to FILE once the prompt is read, and a later run whose prompt starts with the same ids reads only the
rest (:mod:`attnkit.decoding.prompt_cache`). A FILE that is not a prompt cache, is damaged, or was written for
another model or dtype is refused with one line (exit 2) and left as it is; a missing FILE is created.
"""
from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from ._common import UsageError, printable

__all__ = ["add_prompt_cache_argument", "open_prompt_cache", "read_prompt"]


def add_prompt_cache_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """Add ``--prompt-cache FILE``; ``what`` says which prompt is saved."""
    parser.add_argument("--prompt-cache", metavar="FILE", default=None,
                        help=f"save the cache after {what} to FILE, and start from FILE's cache when it holds the "
                             f"beginning of the prompt (as llama.cpp's --prompt-cache); a FILE of another model "
                             f"is refused")


def open_prompt_cache(path: str, model: Any, prog: str, rollback: int = 0) -> Any:
    """The cache saved in ``path`` for ``model``, or an empty one when there is no file; a file that cannot be
    used is a :class:`UsageError` of ``prog``."""
    from ..decoding.prompt_cache import PromptCacheError, load_prompt_cache

    try:
        return load_prompt_cache(path, model, rollback=rollback)
    except FileNotFoundError:
        return model.new_cache(1, rollback=rollback)
    except PromptCacheError as exc:
        raise UsageError(f"--prompt-cache {printable(repr(path))}: {exc}; delete it or name another file",
                         prog) from None
    except (IsADirectoryError, PermissionError) as exc:
        raise UsageError(f"--prompt-cache {printable(repr(path))}: cannot read it: {exc.strerror}", prog) from None


def read_prompt(path: str, model: Any, cache: Any, ids: list[int], prog: str) -> int:
    """Feed ``cache`` the prompt ``ids`` but their last (only what it lacks) and save it to ``path`` when that
    changed what it holds; returns the ids read. A file that cannot be written is a :class:`UsageError`."""
    from ..decoding.prompt_cache import prefill, save_prompt_cache

    before = cache.token_ids.copy()
    read = prefill(model, cache, np.array([ids], dtype=np.int64))
    if not np.array_equal(before, cache.token_ids):
        try:
            save_prompt_cache(path, model, cache)
        except OSError as exc:
            raise UsageError(f"--prompt-cache {printable(repr(path))}: cannot write it: "
                             f"{exc.strerror or exc}", prog) from None
    return read
