"""Nothing the package started outlives the interpreter.

A thread that takes the GIL from inside torch's C++ code after Python began shutting down is ended there by the
interpreter (``pthread_exit`` unwinding through a ``noexcept`` frame), and the finished script dies with ``terminate
called without an active exception`` (SIGABRT, exit code 134). Two such threads: a gloo worker of a process group
nobody destroyed, which frees its last collective's tensors (their Python objects: the GIL) while the main thread
finalizes (seen in a core dump on torch 2.14.1: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` ->
``gil_scoped_acquire`` -> ``PyThread_exit_thread``), and a Python daemon thread returning from a store request (the
heartbeat). torch asks every distributed script to call ``destroy_process_group()`` at its end (it joins gloo's
workers); Lightning does not, and plain scripts seldom do.

So what the package starts registers its ``close`` here: the liveness heartbeat (stopped at each door's
``teardown`` too), the background saver's process group, and the default process group when one of the doors created
it. When the interpreter exits (``atexit``, while Python still runs) each registered ``close`` still alive runs, the
latest first, and the default group, if the package created it, is destroyed last. A script that destroyed the group
itself is left as it is; ``os._exit`` skips all of it.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_closers: list[weakref.WeakMethod[Callable[[], None]]] = []
_owns_default_group = False
_armed = False


def close_at_exit(close: Callable[[], None]) -> None:
    """Call ``close`` (a bound method, held weakly: an object already gone has nothing left to close) when the
    interpreter exits. It must be safe to call twice (the object may have been closed already)."""
    _arm()
    _closers.append(weakref.WeakMethod(close))  # type: ignore[arg-type]


def created_default_group() -> None:
    """A door's setup created the default process group: destroy it at interpreter exit unless the script did."""
    global _owns_default_group
    _arm()
    _owns_default_group = True


def _arm() -> None:
    global _armed
    if not _armed:
        atexit.register(close_all)
        _armed = True


def close_all() -> None:
    """Run every registered ``close`` still alive (the latest first), then destroy the default process group if the
    package created it. Registered with ``atexit``; a failure is logged, never raised (the script's work is done)."""
    global _owns_default_group
    while _closers:
        close = _closers.pop()()
        if close is not None:
            _quietly(close)
    if _owns_default_group:
        _owns_default_group = False
        _quietly(_destroy_default_group)


def _destroy_default_group() -> None:
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _quietly(close: Callable[[], Any]) -> None:
    try:
        close()
    except Exception as err:  # noqa: BLE001 - at exit: the results are written, say what could not be closed
        log.warning(f"lightning_gaudi_fsdp: at exit, {getattr(close, '__qualname__', close)} failed: {err}")
