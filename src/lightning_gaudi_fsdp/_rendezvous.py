"""The bounded launch: ``failure_timeout``, the rendezvous that leaves when a rank never joins, and a rank that never
outlives the launcher that started it (``PR_SET_PDEATHSIG``); the process helpers the liveness modules share.

Every wait for other ranks outside a collective is bounded by ``failure_timeout`` (seconds; the strategy argument,
else ``LIGHTNING_GAUDI_FSDP_FAILURE_TIMEOUT``, else 60): the rendezvous (:func:`bounded_rendezvous`), and a rank whose
heartbeat lost the store during ``fit`` (its host is gone, ``_liveness.py``) leaves after that long.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from lightning_gaudi_fsdp import options

log = logging.getLogger(__name__)

_LAUNCHER_ENV = "LIGHTNING_GAUDI_FSDP_LAUNCHER_PID"  # set by the process that starts the other ranks
_BOUND_ENV = "LIGHTNING_GAUDI_FSDP_FAILURE_TIMEOUT"
DEFAULT_FAILURE_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1
_launcher_pid: int | None = None  # read once from _LAUNCHER_ENV


def failure_timeout(value: float | None) -> float:
    """The bound in seconds: ``value`` (the strategy's resolved ``failure_timeout``) when given, else
    ``LIGHTNING_GAUDI_FSDP_FAILURE_TIMEOUT``, else 60. Read where the strategy is built, so a bad value in the
    environment fails before any process starts. (This module reads its own variables: they are about launching and
    liveness on any device, not about Gaudi's runtime, which ``gaudi.py`` owns.)"""
    if value is not None:
        return value
    text = os.environ.get(_BOUND_ENV, "").strip()
    if not text:
        return DEFAULT_FAILURE_TIMEOUT_S
    try:
        number: Any = float(text)
    except ValueError:
        number = text
    return options.resolve_seconds(number, _BOUND_ENV) or DEFAULT_FAILURE_TIMEOUT_S


def _say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def _leave(message: str | None) -> None:
    """Print ``message`` and end this process at once with exit code 1 (from any thread: a main thread blocked in a
    C++ wait would never see an exception raised here)."""
    if message is not None:
        _say(message)
    os._exit(1)


def _where() -> str:
    return f"node {socket.gethostname()}, pid {os.getpid()}"


@contextlib.contextmanager
def bounded_rendezvous(
    bound_s: float, who: Callable[[], tuple[int, int]], children: Callable[[], dict[int, int]] | None = None
) -> Iterator[None]:
    """Around the creation of the process group (and of what needs every rank right after it): if it has not
    finished within ``bound_s`` seconds, print who waited for what and leave with exit code 1. Without it a rank whose
    peer (or the store's host) died before or during the rendezvous waits out the whole process-group timeout (30
    minutes by default), holding its device. ``who()``: this rank's (global rank, world size), read when it fires.

    ``children()``: the ranks this process started (Lightning's launcher), global rank to pid. One that is gone ends the
    wait at once; and when they are all the other ranks and all still run, the rendezvous can still complete (they
    are slow to start: a loaded machine imports torch slowly), so the bound does not cut it short. A rank that
    Lightning's launcher started (still its parent) waits on too: that launcher leaves as soon as any rank it started
    ended, and the kernel then ends this rank with it (``PR_SET_PDEATHSIG``)."""
    done = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + bound_s
        while not done.wait(0.5):
            rank, world_size = who()
            pids = children() if children is not None else {}
            dead = [f"rank {r} (pid {pid})" for r, pid in sorted(pids.items()) if not _process_alive(pid)]
            if dead:
                reason = f"{', '.join(dead)}, which it started, ended before joining"
            elif time.monotonic() < deadline or (pids and len(pids) == world_size - 1) or _follows_launcher():
                continue
            else:
                reason = (
                    f"waited {bound_s:g} s (failure_timeout) and not every rank joined: a rank, or the host of the "
                    "rendezvous store (global rank 0, or torchrun's agent on node 0), is gone or never started"
                )
            host, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
            _leave(
                f"lightning_gaudi_fsdp: rank {rank} of {world_size} ({_where()}) was in the rendezvous at "
                f"{host}:{port}; {reason}; this rank leaves instead of waiting out the process-group timeout"
            )

    thread = threading.Thread(target=watch, name="lgf-rendezvous-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _follows_launcher() -> bool:
    """Whether Lightning's launcher started this process and is still its parent (it dies with it)."""
    return _launcher_pid not in (None, 0, os.getpid()) and os.getppid() == _launcher_pid


def mark_launcher() -> None:
    """In the process about to start the other ranks with Lightning's launcher: they inherit its process id."""
    os.environ[_LAUNCHER_ENV] = str(os.getpid())


def leave_with_launcher() -> None:
    """In a rank started by Lightning's launcher: never outlive it. Under that launcher the rendezvous store lives in
    the launching process (global rank 0); a rank left behind when it dies would wait out the whole process-group
    timeout (30 minutes by default), holding its device. The kernel kills this process when its parent dies (Linux
    ``PR_SET_PDEATHSIG``), and if the launcher is already gone it leaves at once with a message.

    The launcher's pid is taken from the environment once and removed from it, so processes this rank starts do not
    inherit it; a pid that is not this process's parent and still runs is someone else's launch, left alone."""
    global _launcher_pid
    if _launcher_pid is None:
        value = os.environ.pop(_LAUNCHER_ENV, "")
        _launcher_pid = int(value) if value.isdigit() else 0
    launcher = _launcher_pid
    if not launcher or launcher == os.getpid():
        return
    import signal

    if os.getppid() == launcher:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: the check below still runs at setup
            log.debug("PR_SET_PDEATHSIG is not available here")
        return
    if _process_alive(launcher):
        return  # not our parent and still running: an outer launch whose variable leaked into this environment
    _leave(
        f"lightning_gaudi_fsdp: the process that launched this rank (pid {launcher}, global rank 0) is gone; this "
        "rank leaves instead of waiting for a rendezvous that cannot happen"
    )


def _process_alive(pid: int) -> bool:
    """True while ``pid`` runs on this machine (a zombie, killed but not yet reaped by its parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")
