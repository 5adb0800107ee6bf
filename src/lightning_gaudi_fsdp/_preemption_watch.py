"""The preemption watcher (``preemption="save"``): one per rank, it learns of a SIGTERM to any rank, agrees with the
others on the step to save, and makes every rank leave within ``preemption_grace`` seconds with exit code
:data:`EXIT_CODE` and one line saying what happened (what the doors call: :mod:`._preemption`).

Kubernetes, SLURM and torchrun end a job with SIGTERM, then SIGKILL after a grace period (30 s by default). Lightning
turns SIGTERM into ``trainer.received_sigterm`` and leaves at the next batch without a checkpoint.

How the ranks agree without a collective per step. The signal is seen at once by a watcher thread per rank (Python's
C-level handler writes it to a wake-up socket, whatever the main thread is doing). That rank counts it in the
rendezvous store; the watchers of the others poll that counter every :data:`_POLL_S` seconds. A watcher that learns of
it first raises its rank's flag, then publishes how many step boundaries its main thread has passed; once every rank
has published, each computes the same save point, one boundary past the largest count. The main thread, at each
boundary, counts it and reads the flag (two attribute accesses): a rank that sees the flag waits for the save point,
and every rank reaches it together. No rank can be past it (a rank sees the flag at the latest one boundary after its
watcher published), and a rank that must still run a step finds the others doing the same step.

Whatever the main thread is doing, the watcher leaves the process once the grace period (less a margin of
:data:`_MARGIN_S`) is over: a save that has not finished by then leaves nothing visible (checkpoints are committed
atomically) and the previous checkpoint under that name stays. Before training starts (setup, the rendezvous's
aftermath, sanity checking, restoring) there is nothing to save: every rank leaves at once. In Fabric (before the
loop first reads ``strategy.preempted``, or in a loop that never does) it leaves through Python's exit path: the main
thread raises ``SystemExit`` from the handler, so ``finally`` blocks, ``atexit`` and loggers run (the deadline still
bounds it).

The user's SIGTERM handlers: one installed before this one is chained (called by it, once per signal); one installed
after it that does not chain it is respected: the watcher acts on the wake-up socket's record of a signal only while
this handler (or Lightning's, which chains it) is the one installed.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning_gaudi_fsdp import _exit as at_exit
from lightning_gaudi_fsdp import _liveness_store
from lightning_gaudi_fsdp.adapters import lightning_internals

log = logging.getLogger(__name__)

EXIT_CODE = 75  # EX_TEMPFAIL: "temporary failure, retry": requeue and resume with ckpt_path="last"
DEFAULT_GRACE_S = 25.0  # Kubernetes' default terminationGracePeriodSeconds (30) less a margin for the launcher
_MARGIN_S = 1.0  # left of the grace period for the process to end once the watcher gives up
_POLL_S = 0.1  # how often a watcher reads the store's counter of signals
_PREFIX = "lightning_gaudi_fsdp/preemption"
_SETUP = "setup"  # a rank that left before training started publishes this instead of a count
_ENDED = "ended"  # ... and one whose training ended (teardown) before it learned of a signal
_armed = 0  # watchers started in this process
_GONE = {_SETUP: "left before training started", _ENDED: "had finished training before the signal reached it"}
_BEFORE_TRAINING = (
    "before its first step boundary (training not started, or a Fabric loop that does not read strategy.preempted); "
    "nothing saved"
)
_ANSWER_S = 3.0  # a rank's watcher publishes its count within a poll of the signal: one silent this long is gone


class Preemption:
    """One rank's watcher and its state. ``who()``: (global rank, world size), read when needed."""

    def __init__(self, grace_s: float, who: Callable[[], tuple[int, int]], exit_normally: bool = False) -> None:
        self.grace_s = grace_s
        self.who = who
        self.exit_normally = exit_normally  # before the first boundary: SystemExit in the main thread, not os._exit
        self.phase = "setup"  # "training" once the first step may start
        self.boundaries = 0  # step boundaries the main thread passed (main thread only)
        self.step: int | None = None  # the training step at the last boundary, for the messages
        self.flagged = False  # this rank knows a rank was signalled (set by the watcher)
        self.stop_at: int | None = None  # the boundary every rank saves at
        self.saving: str | None = None  # the checkpoint being written for the preemption
        self._decided = threading.Event()
        self._stop = threading.Event()
        self._signal = ""  # e.g. "SIGTERM (received by rank 0)"
        self._deadline = float("inf")  # monotonic
        self._received: int | None = None  # a signal this process received (the handler's fallback record)
        self._store: Any = None
        global _armed
        _armed += 1  # every rank arms once per fit/validate/...: the same number keeps each run's keys apart
        self._run = f"{_liveness_store._run_id()}/{_armed}"
        self._previous_handler: Any = None
        self._previous_wakeup = -1
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None
        self._published = False
        self._published_at = 0.0
        self._leaving = threading.Lock()
        self._interrupting = False  # the watcher asked the main thread to run the handler (interrupt_main)
        self._exiting = False  # the main thread is leaving through Python's exit path
        self._telling = threading.RLock()  # one _notice at a time (the watcher's, or the main thread's as it leaves)

    # ---------------------------------------------------------------------------------------------- installation
    def start(self, store: Any) -> None:
        """Install the SIGTERM handler (main thread only: elsewhere Python cannot) and start the watcher. ``store``:
        the rendezvous store (None with one rank)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("lightning_gaudi_fsdp: preemption='save' needs the main thread; SIGTERM is left to Lightning")
            return
        self._store = store
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        try:
            previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # pragma: no cover - not the main thread of the main interpreter
            previous = None
        if previous not in (None, -1):  # someone else's (asyncio): theirs stays, the handler's record is used
            signal.set_wakeup_fd(previous)
            reader.close()
            writer.close()
        elif previous == -1:
            self._wake = (reader, writer)
            self._previous_wakeup = previous
        self._previous_handler = signal.signal(signal.SIGTERM, self._handle)
        self._thread = threading.Thread(target=self._watch, name="lgf-preemption", daemon=True)
        self._thread.start()
        at_exit.close_at_exit(self.stop)  # a door never torn down (Fabric): stopped before the interpreter shuts down

    def take_over(self) -> None:
        """Put this handler back in front of Lightning's (set in ``Trainer._run``, after setup, with this one chained
        inside it): Lightning's broadcasts inside the handler, a collective on one rank only, and makes every rank
        leave at the next batch. A handler installed after this one that does not chain it (a user's, a logger's)
        stays where it is: SIGTERM is then left to it."""
        if self._thread is None or threading.current_thread() is not threading.main_thread():
            return
        if lightning_internals.chained_sigterm_handlers(signal.getsignal(signal.SIGTERM)) == [self._handle]:
            signal.signal(signal.SIGTERM, self._handle)

    def _reached(self) -> bool:
        """Whether a SIGTERM reaches this handler: it is installed, or Lightning's installed handler chains it. The
        watcher acts on the wake-up descriptor's record of a signal only then: never behind a later handler's back."""
        current = signal.getsignal(signal.SIGTERM)
        return current == self._handle or self._handle in (lightning_internals.chained_sigterm_handlers(current) or [])

    def stop(self) -> None:
        """Stop watching and give SIGTERM back to the handler found at :meth:`start`. A rank that was told of a
        signal and is still here (training ended first, or teardown) leaves now."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=2 * _POLL_S + 1)
        if self._thread.is_alive():  # inside a store request: a daemon thread there when Python shuts down aborts it
            log.warning("lightning_gaudi_fsdp: the preemption watcher did not stop within its bound")
        if not self.flagged:  # a last look: a rank signalled while this one finished its last step
            with contextlib.suppress(Exception):
                self._tell()
        if self._received is not None and not self._signal:  # signalled here, the store gone: leave all the same
            rank, _ = self.who()
            self._signal = f"{signal.Signals(self._received).name} (received by rank {rank})"
            self.flagged = True
        if self.flagged and not self._exiting:  # training ended first, or failed (a rank at the deadline ends a save)
            ended = f"training ended at step {self.step} before the save point; nothing saved"
            self._leave(self._unsaved() if self.saving is not None else ended)
        self._publish(_ENDED)  # a rank signalled from now on waits for no count of this one
        self._thread = None
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._handle:
                signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)
            if self._wake is not None:
                signal.set_wakeup_fd(self._previous_wakeup)
        if self._wake is not None:
            for sock in self._wake:
                sock.close()
            self._wake = None

    def _handle(self, signum: int, frame: Any) -> None:
        previous = self._previous_handler
        if self._thread is None:  # stopped (Lightning put this handler back after teardown): as before it
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if self._interrupting:  # not a signal: the watcher asks the main thread to leave (see _progress)
            self._interrupting = False
        else:
            if self._received is None:
                self._received = signum
            if callable(previous):  # a handler installed before this one (the user's): chained, once per signal
                previous(signum, frame)
        if self.exit_normally and self.phase == "setup" and not self._exiting:
            self._exiting = True
            if self._received is not None:  # the others learn of it before this process is gone
                with contextlib.suppress(Exception):
                    self._tell()
            self._publish(_SETUP)
            self._say(_BEFORE_TRAINING)
            raise SystemExit(EXIT_CODE)  # finally blocks, atexit, loggers; the deadline still bounds it

    # ------------------------------------------------------------------------------------------------ main thread
    def boundary(self, step: int | None = None) -> bool:
        """At the end of each step, on every rank: whether this is the save point. Free unless a signal came."""
        self.boundaries += 1
        self.step = step if step is not None else self.boundaries
        if not self.flagged:
            return False
        while not self._decided.wait(1.0):
            if self._thread is None or not self._thread.is_alive():
                self._leave(f"at step {self.step}; its preemption watcher stopped")
        return self.stop_at is not None and self.boundaries >= self.stop_at

    def leave_saved(self, path: str) -> None:
        """After the save point's checkpoint committed on every rank: say so and leave (once every rank said so,
        briefly: under Lightning's launcher the others are ended with the launching rank)."""
        rank, world_size = self.who()
        self._leaving.acquire()  # the deadline, from now on, would only repeat what is said here
        self._say(f"saved step {self.step} to {path}")
        store = self._store
        if store is not None and world_size > 1:
            with contextlib.suppress(Exception):
                store.set(self._key("left", rank), "1")
                keys = [self._key("left", r) for r in range(world_size)]
                deadline = min(time.monotonic() + 5, self._deadline)
                while not store.check(keys) and time.monotonic() < deadline:
                    time.sleep(0.02)
        _exit(EXIT_CODE)

    # ---------------------------------------------------------------------------------------------------- watcher
    def _watch(self) -> None:
        try:
            while not self._stop.is_set():
                if self._wake is not None:
                    ready, _, _ = select.select([self._wake[0]], [], [], _POLL_S)
                    if ready:
                        with contextlib.suppress(BlockingIOError):
                            received = self._wake[0].recv(64)
                            if signal.SIGTERM.value in received and self._received is None and self._reached():
                                self._received = signal.SIGTERM
                else:
                    self._stop.wait(_POLL_S)
                if not self._signal:
                    try:
                        self._tell()
                    except Exception as err:  # noqa: BLE001 - the store is gone or stalled: go on without it
                        if self._store is None:
                            raise
                        log.warning(f"lightning_gaudi_fsdp: preemption watcher lost the rendezvous store ({err})")
                        self._store = None
                if self.flagged:
                    self._progress()
        except Exception as err:  # noqa: BLE001 - a watcher that fails must not leave a rank waiting at a boundary
            if self.flagged and _liveness_store.looks_like_a_lost_peer(err):  # e.g. rank 0 left first, with the store
                self._leave(
                    f"the rendezvous store stopped answering (its host left: global rank 0, or torchrun's agent); "
                    f"it stopped at step {self.step}; nothing saved"
                )
            if self.flagged:
                self._leave(f"at step {self.step}; coordinating the save failed ({type(err).__name__}: {err})")
            log.warning(f"lightning_gaudi_fsdp: the preemption watcher stopped: {type(err).__name__}: {err}")

    def _tell(self) -> None:
        with self._telling:
            if not self._signal:
                self._notice()

    def _notice(self) -> None:
        """Learn of a signal: received here (count it in the store), or counted there by another rank."""
        rank, world_size = self.who()
        store = self._store
        if self._received is not None and store is None and world_size > 1:
            self._signal = f"{signal.Signals(self._received).name} (received by rank {rank})"
            self._leave("the other ranks cannot be told (no rendezvous store); nothing saved")
        if self._received is not None:
            name = signal.Signals(self._received).name
            first, sent_at = f"{name} (received by rank {rank})", time.time()
            if store is not None and world_size > 1:
                if store.add(self._key("count"), 1) == 1:
                    store.set(self._key("first"), f"{first}\n{sent_at}")
                else:  # another rank was first: name its signal, and time the grace period from it
                    first, sent_at = self._first(store, first, sent_at)
            self._learn(first, sent_at)
        elif store is not None and world_size > 1 and store.add(self._key("count"), 0) > 0:
            self._learn(*self._first(store, "SIGTERM (received by another rank)", time.time()))

    def _first(self, store: Any, default: str, sent_at: float) -> tuple[str, float]:
        deadline = time.monotonic() + 1
        while not store.check([self._key("first")]) and time.monotonic() < deadline:
            time.sleep(0.01)
        if not store.check([self._key("first")]):
            return default, sent_at
        text, _, at = store.get(self._key("first")).decode().partition("\n")
        return text, float(at)

    def _learn(self, what: str, sent_at: float) -> None:
        elapsed = min(max(time.time() - sent_at, 0.0), self.grace_s)
        self._deadline = time.monotonic() + self.grace_s - elapsed - _MARGIN_S
        self._signal = what
        # Whatever the threads are doing then (a store that stopped answering included), the rank leaves in time.
        timer = threading.Timer(max(self._deadline - time.monotonic(), 0.0), lambda: self._leave(self._unsaved()))
        timer.daemon = True
        timer.start()
        self.flagged = True  # before the count below is read: the main thread reads them in the other order

    def _progress(self) -> None:
        """Once flagged: leave at once before training; agree on the save point during it; leave at the deadline."""
        if time.monotonic() >= self._deadline:
            self._leave(self._unsaved())
        if self.phase == "setup":
            if not self._published:
                self._publish(_SETUP)
            if not self.exit_normally or signal.getsignal(signal.SIGTERM) != self._handle:
                self._leave(_BEFORE_TRAINING)
            # Fabric: the main thread raises SystemExit in _handle, run for the signal this rank received, or asked
            # for here once (a rank that learned of it from the store)
            if self._received is None and not self._interrupting and not self._exiting:
                self._interrupting = True
                _thread.interrupt_main(signal.SIGTERM)
            return
        if self.phase != "training" or self._decided.is_set():
            return
        if not self._published:
            self._publish(str(self.boundaries))
        rank, world_size = self.who()
        store = self._store
        if store is None or world_size == 1:
            counts = [str(self.boundaries)]
        else:
            keys = [self._key("step", r) for r in range(world_size)]
            if not store.check(keys):
                for r in range(world_size):
                    marker = store.get(keys[r]).decode() if store.check([keys[r]]) else ""
                    if marker in _GONE:
                        self._leave(f"rank {r} {_GONE[marker]}; nothing saved")
                if time.monotonic() > self._published_at + _ANSWER_S:
                    # e.g. torchrun stopping the survivors of a lost worker with SIGTERM: no save can complete
                    silent = [r for r in range(world_size) if not store.check([keys[r]])]
                    self._leave(
                        f"rank(s) {', '.join(map(str, silent))} did not answer within {_ANSWER_S:g} s (gone?); a save "
                        f"needs every rank; it stopped at step {self.step}; nothing saved"
                    )
                return
            counts = [store.get(key).decode() for key in keys]
        for r, marker in enumerate(counts):
            if marker in _GONE:
                self._leave(f"rank {r} {_GONE[marker]}; nothing saved")
        self.stop_at = max(int(c) for c in counts) + 1
        self._decided.set()

    def _publish(self, value: str) -> None:
        self._published = True
        self._published_at = time.monotonic()
        rank, world_size = self.who()
        if self._store is not None and world_size > 1:
            with contextlib.suppress(Exception):
                self._store.set(self._key("step", rank), value)

    # ----------------------------------------------------------------------------------------------------- output
    def _key(self, kind: str, rank: int | None = None) -> str:
        return f"{_PREFIX}/{self._run}/{kind}" + ("" if rank is None else f"/{rank}")

    def _unsaved(self) -> str:
        if self.saving is not None:
            return (
                f"saving step {self.step} to {self.saving} did not finish within preemption_grace={self.grace_s:g} s; "
                "nothing of it is visible and the previous checkpoint there is intact"
            )
        return (
            f"training did not reach the save point (step boundary {self.stop_at}) within preemption_grace="
            f"{self.grace_s:g} s; it stopped at step {self.step}; nothing was saved"
        )

    def _say(self, what: str) -> None:
        rank, world_size = self.who()
        signalled = self._signal or "SIGTERM"
        _write(
            f"lightning_gaudi_fsdp: rank {rank} of {world_size} preempted by {signalled}: {what}; leaving with exit "
            f"code {EXIT_CODE}"
        )

    def _leave(self, what: str) -> None:
        self._leaving.acquire()  # once: a second thread leaving waits here until the first ends the process
        self._say(what)
        _exit(EXIT_CODE)


def _write(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _exit(code: int) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
