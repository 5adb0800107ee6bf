"""Which rank was lost: each rank's identity and heartbeat in the rendezvous store, read when a collective fails.

When one process dies (SIGKILL, the out-of-memory killer, a segfault in a kernel), the survivors' next collective
fails with a transport message such as gloo's "Connection closed by peer [addr]:port", which names a socket, not a
rank. Each rank therefore writes its node and process id to the rendezvous store and bumps a counter there every
``interval_s`` from a daemon thread; a rank handling an exception records it there too. A survivor checks ranks on
its own node by process id (at once) and ranks on other nodes by whether their counter still moves over a short
window: a rank that is gone without a recorded error is the one that was lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from lightning_gaudi_fsdp import _compat

log = logging.getLogger(__name__)

_PREFIX = "lightning_gaudi_fsdp/liveness"
_DISABLE_ENV = "LIGHTNING_GAUDI_FSDP_HEARTBEAT"
_LAUNCHER_ENV = "LIGHTNING_GAUDI_FSDP_LAUNCHER_PID"  # set by the process that starts the other ranks
_PR_SET_PDEATHSIG = 1
_REPORTED = "_lightning_gaudi_fsdp_reported"  # set on an exception once reported
_launcher_pid: int | None = None  # read once from _LAUNCHER_ENV
_uncaught: Heartbeat | None = None  # the heartbeat whose rank reports exceptions that end the script


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
    sys.stderr.write(
        f"lightning_gaudi_fsdp: the process that launched this rank (pid {launcher}, global rank 0) is gone; this "
        "rank leaves instead of waiting for a rendezvous that cannot happen\n"
    )
    sys.stderr.flush()
    os._exit(1)


@dataclass
class Verdict:
    """What a survivor learned: ranks that stopped without a word, and the errors ranks raised themselves, in order
    (collective failures caused by another rank are left out)."""

    lost: list[int] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)
    store_unreachable: str | None = None
    stuck: list[int] = field(default_factory=list)  # alive, no error of their own: asked to print their stacks

    def message(self, rank: int, world_size: int) -> str | None:
        if self.store_unreachable is not None:
            return (
                f"lightning_gaudi_fsdp: rank {rank} could not reach the rendezvous store ({self.store_unreachable}); "
                "under Lightning's launcher the store lives in global rank 0's process, so rank 0 was most likely "
                "lost: its own output shows an error if it raised one, nothing if it was killed, ran out of memory "
                "or crashed"
            )
        parts = []
        if self.lost:
            names = ", ".join(str(r) for r in self.lost)
            plural = "s" if len(self.lost) > 1 else ""
            parts.append(
                f"rank{plural} {names} of {world_size} stopped without reporting an error (killed, out of memory, "
                "or crashed); the collective failure on the surviving ranks follows from that"
            )
        if self.stuck:
            names = ", ".join(str(r) for r in self.stuck)
            plural = "s" if len(self.stuck) > 1 else ""
            parts.append(
                f"rank{plural} {names} of {world_size} still run{'' if plural else 's'} but never reached the "
                f"collective (stuck); each printed its Python stack to its own stderr, under the line "
                f"'lightning_gaudi_fsdp: rank N stack, asked by rank {rank}'"
            )
        others = [(r, text) for r, text in self.errors if r != rank]
        if others:  # errors a rank raised itself (not a collective failing because of another rank)
            first_rank, first_text = others[0]
            parts.append(f"rank {first_rank} failed first with: {first_text}")
        if not parts:
            return None
        return "lightning_gaudi_fsdp: " + "; ".join(parts)


def _key(kind: str, rank: int | str, run: str) -> str:
    return f"{_PREFIX}/{run}/{kind}/{rank}"


def _run_id() -> str:
    # torchrun keeps its store across restarts of the workers: keep each attempt's keys apart.
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


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


def _connect(timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    host = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class Heartbeat:
    """A daemon thread that bumps this rank's counter in the rendezvous store every ``interval_s`` seconds."""

    def __init__(self, rank: int, world_size: int, node: str, interval_s: float = 1.0) -> None:
        self.rank = rank
        self.world_size = world_size
        self.node = node
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._run = _run_id()

    @staticmethod
    def available() -> bool:
        return os.environ.get(_DISABLE_ENV, "1") != "0" and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ

    def start(self) -> None:
        if self._thread is not None or not self.available():
            return
        try:
            store = _connect(timeout_s=30)
            store.set(_key("who", self.rank, self._run), f"{self.node}\n{os.getpid()}")
            store.add(_key("beat", self.rank, self._run), 1)
        except Exception as err:  # noqa: BLE001 - a diagnostic aid must never stop training
            log.warning(
                f"lightning_gaudi_fsdp: no heartbeat for rank {self.rank} (rendezvous store: {err}); a lost "
                "rank will not be named"
            )
            return
        self._thread = threading.Thread(target=self._beat, args=(store,), name="lgf-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, store: Any) -> None:
        key = _key("beat", self.rank, self._run)
        dump = _key("dump", self.rank, self._run)
        while not self._stop.wait(self.interval_s):
            try:
                store.add(key, 1)
                if store.check([dump]):
                    asked_by = store.get(dump).decode()
                    store.delete_key(dump)
                    _dump_stacks(self.rank, asked_by)
            except Exception:  # the store went away with its host; the main thread will find out on its own
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)
            self._thread = None

    def report(self, exception: BaseException) -> str | None:
        """Handle an exception that ends this rank's run, once: record it in the store and, when it looks like a lost
        peer, attach the verdict naming the rank(s) at fault to the exception (a note, printed with its traceback)
        and log it. Returns the message, if any."""
        if isinstance(exception, KeyboardInterrupt | SystemExit) or getattr(exception, _REPORTED, False):
            return None
        with contextlib.suppress(AttributeError):  # a type with __slots__ may be reported twice: harmless
            setattr(exception, _REPORTED, True)
        verdict = self.on_failure(exception)
        message = verdict.message(self.rank, self.world_size) if verdict is not None else None
        if message:
            _compat.add_note(exception, message)
            log.error(f"[rank {self.rank}] {message}")
        return message

    def on_failure(self, exception: BaseException) -> Verdict | None:
        """Record this rank's error in the store (numbered, so survivors can tell which came first); when the error
        looks like a lost peer, also find out which ranks are gone and which recorded errors of their own."""
        if not self.available():
            return None
        peer_failure = looks_like_a_lost_peer(exception)
        run = self._run
        try:
            store = _connect(timeout_s=3)
            order = store.add(_key("errors", "count", run), 1)
            text = f"{type(exception).__name__}: {exception}".strip().splitlines()[0][:500]
            store.set(_key("error", self.rank, run), f"{order}\n{int(peer_failure)}\n{text}")
            if not peer_failure:
                return None
            gone = self._gone(store)
            errors = []
            for r in range(self.world_size):
                recorded = _read(store, _key("error", r, run))
                if recorded is not None:
                    seq, peer, text = recorded.split("\n", 2)
                    errors.append((int(seq), r, peer == "1", text))
        except Exception as err:  # noqa: BLE001 - failing to talk to the store is the finding itself
            if not peer_failure:
                return None
            host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            return Verdict(store_unreachable=f"{host}:{port}: {type(err).__name__}")
        reported = {r for _, r, _, _ in errors}
        own_errors = [(r, text) for _, r, peer, text in sorted(errors) if not peer]
        stuck = sorted(set(range(self.world_size)) - gone - reported - {self.rank})
        if stuck:
            try:
                for r in stuck:  # their heartbeat threads print where their main threads are
                    store.set(_key("dump", r, run), str(self.rank))
                time.sleep(2 * self.interval_s)
            except Exception:  # noqa: BLE001, S110 - the verdict stands without the stacks
                pass
        return Verdict(lost=sorted(gone - reported), errors=own_errors, stuck=stuck)

    def _gone(self, store: Any) -> set[int]:
        """Ranks no longer running: by process id on this node (at once), by a stalled heartbeat elsewhere."""
        run = self._run
        gone: set[int] = set()
        remote: list[int] = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            node, _, pid = (_read(store, _key("who", r, run)) or "").partition("\n")
            if node == self.node and pid:
                if not _process_alive(int(pid)):
                    gone.add(r)
            else:
                remote.append(r)
        if remote:
            before = {r: store.add(_key("beat", r, run), 0) for r in remote}
            time.sleep(3 * self.interval_s)
            gone.update(r for r in remote if store.add(_key("beat", r, run), 0) == before[r])
        return gone


def report_uncaught(heartbeat: Heartbeat) -> None:
    """Report, through ``heartbeat``, an exception that ends the script (``sys.excepthook``, before the traceback is
    printed): for a front door without an exception hook of its own (Fabric). Installed once per process; a later
    call only changes the heartbeat. An exception a launcher catches before it reaches the interpreter is not seen."""
    global _uncaught
    _uncaught = heartbeat
    if getattr(sys.excepthook, _REPORTED, False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        current = _uncaught
        if current is not None:
            try:
                current.report(value)
            except Exception as err:  # noqa: BLE001 - the original traceback must be printed whatever happens
                log.debug(f"lightning_gaudi_fsdp: could not report the failure: {err}")
        previous(kind, value, traceback)

    setattr(hook, _REPORTED, True)
    sys.excepthook = hook


def _dump_stacks(rank: int, asked_by: str) -> None:
    """Print every thread's Python stack to stderr (from the heartbeat thread, while the main thread is stuck)."""
    import faulthandler

    sys.stderr.write(f"lightning_gaudi_fsdp: rank {rank} stack, asked by rank {asked_by} (its collective failed):\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def _read(store: Any, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def looks_like_a_lost_peer(exception: BaseException) -> bool:
    """A failure inside a collective or the store (as opposed to this rank's own bug), worth a diagnosis."""
    import torch.distributed

    if isinstance(exception, torch.distributed.DistError):
        return True
    text = str(exception)
    return isinstance(exception, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "[/", "gloo", "hccl")
    )
