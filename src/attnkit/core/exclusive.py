"""Which thread may run a module while its hooks or ``input_gradients_only`` are in effect.

Hooks, the record of which values a forward replaced, the ``input_gradients_only`` switch and the state a forward
saves for backward all belong to the model, not to a thread. So while one thread has any of them in effect (inside
:func:`attnkit.explain.hooks`, any explanation built on it, or :meth:`Module.input_gradients_only`), the model is
held by that thread: another thread that runs it (a forward, ``generate``, a backward) gets a ``RuntimeError``
naming the holder, instead of hooked values or a backward of someone else's forward. The holding thread may nest
blocks freely; a second thread's block is refused the same way.

A :class:`Holder` is set on every module of the claimed tree (an instance attribute that shadows the class default
None), so the check in the paths that every forward and backward take (``save_for_backward``, ``saved_tensors``, a
hook point) is one attribute read when nothing is held.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any

__all__ = ["Holder", "claim", "lock", "release"]

# Claims, and the check-then-write of a module's saved forward state, happen one at a time: a forward of another
# thread that passed its check before a claim has written its state before the claim, so the holder's own forward
# overwrites it (a lock costs ~0.1 us per save, a forward saves once per module).
lock = threading.Lock()


def _new_lock() -> None:
    """A child made by ``fork()`` starts with a free lock (another thread of the parent may have held it)."""
    global lock
    lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock)


def _no_holder() -> None:
    return None


class Holder:
    """The thread holding a tree of modules, and what for (``"attnkit.explain.hooks"``, ...).

    A copy of a held module (``copy.deepcopy``, pickling) is not held: the holder copies as None.
    """

    __slots__ = ("thread", "thread_name", "what", "owner")

    def __init__(self, what: str, owner: str) -> None:
        self.thread = threading.get_ident()
        self.thread_name = threading.current_thread().name
        self.what = what
        self.owner = owner  # the class of the module claimed (the model), which the refusal names

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self):
        return _no_holder, ()

    def refusal(self) -> RuntimeError:
        """The error another thread gets when it runs a held module."""
        return RuntimeError(
            f"{self.owner} is held by thread {self.thread_name!r} for {self.what}: while hooks, "
            f"patching or input_gradients_only are in effect, only that thread may run the model (its hooks, "
            f"gradient switches and saved forward state are the model's, not the thread's); wait for that block "
            f"to end, or give this thread its own copy (copy.deepcopy(model))")

    def check(self) -> None:
        """Raise :meth:`refusal` unless the calling thread is the holder."""
        if threading.get_ident() != self.thread:
            raise self.refusal()


def claim(modules: Iterable[Any], what: str) -> list[Any]:
    """Hold ``modules`` (a model first, then its submodules) for the calling thread; returns the ones this claim took
    (to :func:`release` later).

    Modules the calling thread already holds stay with their earlier claim; if another thread holds any of them,
    nothing is taken and its :meth:`Holder.refusal` is raised here.
    """
    modules = list(modules)
    me = threading.get_ident()
    holder = Holder(what, type(modules[0]).__name__ if modules else "")
    with lock:
        for module in modules:
            held = module.__dict__.get("_holder")
            if held is not None and held.thread != me:
                raise held.refusal()
        taken = [module for module in modules if module.__dict__.get("_holder") is None]
        for module in taken:
            object.__setattr__(module, "_holder", holder)
    return taken


def release(taken: Iterable[Any]) -> None:
    """Undo one :func:`claim`: its modules are no longer held."""
    with lock:
        for module in taken:
            module.__dict__.pop("_holder", None)
