"""Nothing the package started outlives the interpreter.

A thread that takes the GIL from inside torch's C++ code after Python began shutting down is ended there by the
interpreter (``pthread_exit`` unwinding through a ``noexcept`` frame), and the finished script dies with ``terminate
called without an active exception`` (SIGABRT, exit code 134). Two such threads: a gloo worker of a process group
nobody destroyed, which frees its last collective's tensors (their Python objects: the GIL) while the main thread
finalizes (seen in a core dump on torch 2.14.1: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` ->
``gil_scoped_acquire`` -> ``PyThread_exit_thread``), and a Python daemon thread returning from a store request (the
heartbeat). torch asks every distributed script to call ``destroy_process_group()`` at its end (it joins gloo's
workers); Lightning does not, and plain scripts seldom do.

So what the package starts registers its ``close`` here: the liveness heartbeat and the preemption watcher (both
stopped at each door's ``teardown`` too), the background saver's process group, and the default process group when
one of the doors created it. When the interpreter exits (``atexit``, while Python still runs) each registered
``close`` still alive runs, the latest first, and the default group, if the package created it, is destroyed last. A
script that destroyed the group itself is left as it is; ``os._exit`` skips all of it.

Destroying a group does not end its gloo workers while anything still holds the group (the FSDP model does: its
parameter groups keep their process group), and the script's last collective may still be finishing on one of them:
a worker the scheduler paused between completing the work and releasing it, which then frees the tensors' Python
objects, or a completion callback. So, last, while any gloo group existed, the main thread waits with the GIL released
until every gloo worker sleeps in its idle wait (read from ``/proc``: a futex wait without timeout, twice in a row;
waiting for the GIL is a timed wait), bounded by :data:`SETTLE_S`.

Which threads are gloo's: those torch names ``pt_gloo_runloop`` (2.13 and later), and the threads that appeared while
the package created a process group (:func:`recording_group_threads`: the default group, the hybrid mesh, the
background saver's group), which is all there is to go by where torch leaves them unnamed (2.6, 2.9). Never any other
thread: an OpenMP pool's threads (which spin while they wait with ``OMP_WAIT_POLICY=active``) or a runtime's thread
sleeping on a timer never sleep in an idle wait, and taking them for gloo's made every exit wait the whole bound and
warn.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

SETTLE_S = 5.0  # at most this long at exit for gloo's workers to go idle
_SETTLE_POLL_S = 0.01
# System call numbers: futex, and the event-loop waits (epoll_wait, epoll_pwait, epoll_pwait2, poll, ppoll, select,
# pselect6) an idle transport thread sleeps in, where torch leaves its threads unnamed.
_FUTEX, _EVENT_WAITS = {
    "x86_64": (202, {232, 281, 441, 7, 271, 23, 270}),
    "aarch64": (98, {22, 441, 73, 72}),
}.get(os.uname().machine, (None, set()))

_closers: list[weakref.WeakMethod[Callable[[], None]]] = []
_group_threads: set[int] = set()  # native threads that appeared while the package created a process group
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


@contextlib.contextmanager
def recording_group_threads() -> Iterator[None]:
    """Around the package's creation of process groups: the threads that are not Python's and appear meanwhile are
    the groups' (gloo's workers and transport, the store's), waited for at exit where torch leaves them unnamed."""
    before = _native_threads()
    try:
        yield
    finally:
        _group_threads.update(_native_threads() - before)


def _native_threads() -> set[int]:
    """The ids of this process's threads that are not Python threads (none where there is no ``/proc``)."""
    try:
        tasks = {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()
    return tasks - {thread.native_id for thread in threading.enumerate()}


def _arm() -> None:
    global _armed
    if not _armed:
        atexit.register(close_all)
        _armed = True


def close_all() -> None:
    """Run every registered ``close`` still alive (the latest first), then destroy the default process group if the
    package created it. Registered with ``atexit``; a failure is logged, never raised (the script's work is done)."""
    global _owns_default_group
    gloo = _gloo_groups_exist()
    while _closers:
        close = _closers.pop()()
        if close is not None:
            _quietly(close)
    if _owns_default_group:
        _owns_default_group = False
        _quietly(_destroy_default_group)
    _join_our_threads()
    if gloo and not settle_gloo_workers():
        log.warning(
            f"lightning_gaudi_fsdp: at exit, a gloo worker thread was still busy after {SETTLE_S:g} s; Python shuts "
            "down anyway"
        )


def _gloo_groups_exist() -> bool:
    from lightning_gaudi_fsdp.adapters import torch_internals

    return torch_internals.gloo_groups_exist()


def _destroy_default_group() -> None:
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _join_our_threads(bound_s: float = SETTLE_S) -> None:
    """Wait (bounded) for the package's threads (named ``lgf-...``) that a ``close`` stopped but could not wait for:
    one still inside a store request when Python shuts down aborts the process."""
    deadline = time.monotonic() + bound_s
    for thread in threading.enumerate():
        if thread.name.startswith("lgf-") and thread is not threading.current_thread():
            thread.join(max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                log.warning(f"lightning_gaudi_fsdp: at exit, thread {thread.name!r} was still running")


def settle_gloo_workers(bound_s: float = SETTLE_S) -> bool:
    """Wait, with the GIL released, until every gloo worker thread of this process is in its idle wait in two
    samples in a row (at most ``bound_s`` seconds). True when they are, or when this system cannot tell (no
    ``/proc``). Workers: see :func:`_gloo_workers`."""
    workers = _gloo_workers()
    deadline = time.monotonic() + bound_s
    settled_once = False
    while workers:
        time.sleep(_SETTLE_POLL_S)  # the GIL is free meanwhile: a worker waiting for it takes it now
        idle = all(_idle(task) for task in workers)
        if idle and settled_once:
            return True
        settled_once = idle
        if time.monotonic() >= deadline:
            return False
    return True


def _gloo_workers() -> list[str]:
    """The threads of gloo's process groups still alive: those torch names ``pt_gloo_runloop``, and those that
    appeared while the package created a group (:func:`recording_group_threads`)."""
    from lightning_gaudi_fsdp.adapters.torch_internals import GLOO_WORKER_THREAD

    tasks = "/proc/self/task"
    found = set()
    for tid in _native_threads():
        with contextlib.suppress(OSError):
            if tid in _group_threads or _read(f"{tasks}/{tid}/comm") == GLOO_WORKER_THREAD:
                found.add(tid)
    return [f"{tasks}/{tid}" for tid in sorted(found)]


def _idle(task: str) -> bool:
    """Whether the thread sleeps in a futex wait without a timeout (a condition variable's plain wait: gloo's idle
    worker; a thread waiting for the GIL waits with a timeout) or in an event-loop wait (gloo's transport thread). A
    thread that has ended counts as idle; a running, runnable or otherwise sleeping one does not."""
    try:
        state = _read(f"{task}/stat").rpartition(")")[2].split()[0]
        call = _read(f"{task}/syscall").split()
    except (OSError, IndexError):
        return True
    if state != "S":
        return False
    if _FUTEX is None or not call or not call[0].isdigit():  # another architecture, or not in a system call
        return True
    if int(call[0]) == _FUTEX:
        return len(call) > 4 and int(call[4], 16) == 0
    return int(call[0]) in _EVENT_WAITS


def _read(path: str) -> str:
    with open(path) as file:
        return file.read().strip()


def _quietly(close: Callable[[], Any]) -> None:
    try:
        close()
    except Exception as err:  # noqa: BLE001 - at exit: the results are written, say what could not be closed
        log.warning(f"lightning_gaudi_fsdp: at exit, {getattr(close, '__qualname__', close)} failed: {err}")
