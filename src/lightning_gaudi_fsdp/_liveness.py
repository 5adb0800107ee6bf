"""Which rank was lost: each rank's identity and heartbeat in the rendezvous store, read when a collective fails.

Every wait for other ranks outside a collective is bounded by ``failure_timeout`` (seconds; the strategy argument,
else ``LIGHTNING_GAUDI_FSDP_FAILURE_TIMEOUT``, else 60): the rendezvous (:func:`bounded_rendezvous`), and a rank whose
heartbeat lost the store during ``fit`` (its host is gone) leaves after that long if nothing else ended it first.

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
from datetime import timedelta
from typing import Any

from lightning_gaudi_fsdp import _compat, _exit, _stuck
from lightning_gaudi_fsdp._liveness_store import (
    Verdict,
    _connect,
    _key,
    _read,
    _record_error,
    _recorded_errors,
    _run_id,
    _wait_for_keys,
    _who,
    looks_like_a_lost_peer,
)
from lightning_gaudi_fsdp._rendezvous import DEFAULT_FAILURE_TIMEOUT_S, _leave, _process_alive, _say, _where

log = logging.getLogger(__name__)

_DISABLE_ENV = "LIGHTNING_GAUDI_FSDP_HEARTBEAT"
_CALL_BEATS = 3  # the heartbeat thread's store requests (and reconnections) give up after this many beats
_REPORTED = "_lightning_gaudi_fsdp_reported"  # set on an exception once reported
_uncaught: Heartbeat | None = None  # the heartbeat whose rank reports exceptions that end the script


def heartbeat_switch() -> bool:
    """``LIGHTNING_GAUDI_FSDP_HEARTBEAT``: anything but ``0`` (default on) runs the heartbeat, and with it
    ``preemption="save"``. Read once, where the strategy is built (``_config.Resolved.heartbeat``)."""
    return os.environ.get(_DISABLE_ENV, "1") != "0"


def store_address_known() -> bool:
    """Whether this rank knows the rendezvous store's address (``MASTER_ADDR``/``MASTER_PORT``, set by its
    launcher)."""
    return "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ


class Heartbeat:
    """A daemon thread that bumps this rank's counter in the rendezvous store every ``interval_s`` seconds."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        node: str,
        interval_s: float = 1.0,
        bound_s: float | None = None,
        stuck_s: float | None = None,
        enabled: bool = True,
    ) -> None:
        self.rank = rank
        self.enabled = enabled  # the strategy's resolved switch (_config.Resolved.heartbeat)
        self.world_size = world_size
        self.node = node
        self.interval_s = interval_s
        self.bound_s = DEFAULT_FAILURE_TIMEOUT_S if bound_s is None else bound_s
        self.stuck_s = stuck_s  # None: no watch of the main thread's waits
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._run = _run_id()
        self._clock: _stuck.WaitClock | None = None
        self._published_wait = ""
        self._errors_seen = 0
        self._told: set[int] = set()  # ranks whose own error this rank acknowledged
        self._own_error: int | None = None  # the order of this rank's own error among all recorded
        self._acks_lock = threading.Lock()

    def available(self) -> bool:
        return self.enabled and store_address_known()

    def start(self) -> None:
        if self._thread is not None or not self.available():
            return
        try:
            store = _connect(timeout_s=30)
            store.set(_key("who", self.rank, self._run), f"{self.node}\n{os.getpid()}")
            store.add(_key("beat", self.rank, self._run), 1)
            # every request of the thread returns within a few beats (a stall is retried in _store_lost), so that
            # stop() can wait for the thread to leave torch's C++ code before the interpreter exits
            store.set_timeout(timedelta(seconds=_CALL_BEATS * self.interval_s))
        except Exception as err:  # noqa: BLE001 - a diagnostic aid must never stop training
            log.warning(
                f"lightning_gaudi_fsdp: no heartbeat for rank {self.rank} (rendezvous store: {err}); a lost "
                "rank will not be named"
            )
            return
        if self.stuck_s is not None:
            self._clock = _stuck.WaitClock(threading.get_ident())  # the thread that runs the training loop
        self._thread = threading.Thread(target=self._beat, args=(store,), name="lgf-heartbeat", daemon=True)
        self._thread.start()
        _exit.close_at_exit(self.stop)  # a door never torn down (Fabric): stopped before the interpreter shuts down

    def _beat(self, store: Any) -> None:
        key = _key("beat", self.rank, self._run)
        while not self._stop.wait(self.interval_s):
            try:
                store.add(key, 1)
                self._answer_dump_request(store)
                self._acknowledge_errors(store)
                if self._clock is not None:
                    self._watch_wait(store, self._clock)
            except Exception as err:  # noqa: BLE001 - the store went away with its host, or stalled
                store = self._store_lost(err)
                if store is None:
                    return

    def _answer_dump_request(self, store: Any) -> None:
        """Print this rank's stacks when another rank asks: after its collective failed (the request names the
        asking rank), or, with ``stuck_timeout``, because it waited too long for this rank (the request also says
        how long and where): this rank then records why and leaves."""
        run = self._run
        dump = _key("dump", self.rank, run)
        if not store.check([dump]):
            return
        asked_by, _, waited = store.get(dump).decode().partition("\n")
        store.delete_key(dump)
        if not waited:
            _dump_stacks(
                f"lightning_gaudi_fsdp: rank {self.rank} stack, asked by rank {asked_by} (its collective failed):"
            )
            return
        why = f"stuck: rank {asked_by} waited {waited} for it"
        _dump_stacks(
            f"lightning_gaudi_fsdp: rank {self.rank} of {self.world_size} ({_where()}) is {why}. Every thread's "
            "Python stack (the main thread's shows where it is stuck):"
        )
        _record_error(store, self.rank, run, why, peer_failure=False)
        store.set(_key("dumped", self.rank, run), "1")
        # Leave after the asking rank: until then its collective stays blocked (no transport error, no second
        # report there); under a launcher that ends the job when one rank exits, this rank is ended with it.
        node, _, pid = (_read(store, _key("who", asked_by, run)) or "").partition("\n")
        if node == self.node and pid.isdigit():  # by process id: polling a store whose host left prints C++ errors
            deadline = time.monotonic() + 5 * self.interval_s
            while _process_alive(int(pid)) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            _wait_for_keys(store, [_key("left", asked_by, run)], 5 * self.interval_s)
        _leave(f"lightning_gaudi_fsdp: rank {self.rank} of {self.world_size} leaves ({why})")

    def _acknowledge_errors(self, store: Any) -> None:
        """Print the first error another rank raised itself as soon as it is recorded (unless this rank's own came
        first), and acknowledge each: the raising rank waits for that before it exits. (Under Lightning's launcher,
        rank 0's process is killed by the launcher's observer soon after a rank it started exits, before its own
        collective failure is reported.) Called by the heartbeat thread, and by a failing rank's main thread while it
        waits for its own acknowledgements."""
        with self._acks_lock:
            run = self._run
            count = store.add(_key("errors", "published", run), 0)
            if count == self._errors_seen:
                return
            self._errors_seen = count
            unseen = [r for r in range(self.world_size) if r != self.rank and r not in self._told]
            # errors of their own, not collectives failing because of another rank
            new = [(seq, r, text) for seq, r, peer, text in _recorded_errors(store, unseen, run) if not peer]
            for seq, r, text in sorted(new):
                if not self._told and (self._own_error is None or seq < self._own_error):
                    _say(f"[rank {self.rank}] lightning_gaudi_fsdp: rank {r} failed first with: {text}")
                self._told.add(r)
                store.set(_key("ack", f"{r}/{self.rank}", run), "1")

    def _watch_wait(self, store: Any, clock: _stuck.WaitClock) -> None:
        """Publish where the main thread waits; past ``stuck_timeout`` in one call, end the job naming the ranks
        that do not wait (the stuck ones), after they printed their stacks."""
        waited = clock.sample()
        site = clock.site or ""
        if site != self._published_wait:
            store.set(_key("wait", self.rank, self._run), site)
            self._published_wait = site
        if self.stuck_s is None or waited < self.stuck_s:
            return
        run = self._run
        others = [r for r in range(self.world_size) if r != self.rank]
        waits = {r: _read(store, _key("wait", r, run)) or "" for r in others}
        gone = self._gone(store)
        stuck = [r for r in others if not waits[r] and r not in gone]
        here = f"rank {self.rank} of {self.world_size} ({_where()}) waited {waited:.0f} s in {site}"
        bound = f"stuck_timeout={self.stuck_s:g} s"
        if stuck:
            names = ", ".join(f"rank {r} ({_who(store, r, run)})" for r in stuck)
            one = len(stuck) == 1
            reason = (
                f"{names}, which still run{'s' if one else ''} but never reached it (stuck); "
                f"{'its' if one else 'their'} Python stack is printed under 'lightning_gaudi_fsdp: rank N of W "
                "(node ..., pid ...) is stuck'"
            )
            _say(f"lightning_gaudi_fsdp: {here}, more than {bound}, for {reason}; every rank of the job leaves")
            for r in stuck:
                store.set(_key("dump", r, run), f"{self.rank}\n{waited:.0f} s ({bound}) in {site}")
            # They print their stacks before this rank leaves (its exit may end them: Lightning's launcher).
            _wait_for_keys(store, [_key("dumped", r, run) for r in stuck], 5 * self.interval_s)
            store.set(_key("left", self.rank, run), "1")
            _leave(None)
        elif gone:
            reason = f"rank(s) {', '.join(str(r) for r in sorted(gone))}, which stopped without reporting an error"
        else:
            elsewhere = "; ".join(f"rank {r} in {waits[r]}" for r in others)
            reason = (
                f"the other ranks, which all wait in collectives too ({elsewhere}): the ranks called different "
                "collectives, or the same ones in a different order"
            )
        _leave(f"lightning_gaudi_fsdp: {here}, more than {bound}, for {reason}; every rank of the job leaves")

    def _store_lost(self, err: BaseException) -> Any:
        """The store stopped answering. Reconnect and go on beating if it comes back within ``bound_s`` (a stall);
        stop quietly if the heartbeat is stopped meanwhile (``teardown``, also on the way out of a failure: the main
        thread usually finds out at its next collective and fails with its own error); else its host is gone and
        this rank, blocked where no peer's death reaches it, leaves."""
        deadline = time.monotonic() + self.bound_s
        while not self._stop.wait(self.interval_s):
            try:
                store = _connect(timeout_s=_CALL_BEATS * self.interval_s)
                store.add(_key("beat", self.rank, self._run), 1)
                return store
            except Exception:  # noqa: BLE001, S112 - still unreachable: the bound decides
                if time.monotonic() < deadline:
                    continue
            host, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
            _leave(
                f"lightning_gaudi_fsdp: rank {self.rank} of {self.world_size} ({_where()}) lost the rendezvous store "
                f"at {host}:{port} ({type(err).__name__}) {self.bound_s:g} s ago (failure_timeout) and is still "
                "running: the store's host (global rank 0, or torchrun's agent on node 0) is gone, so the job cannot "
                "go on; this rank leaves"
            )
        return None

    def stop(self) -> None:
        """Stop the thread and wait until it has left torch's code: a daemon thread still inside a store request when
        the interpreter shuts down aborts the process (``terminate called without an active exception``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=(_CALL_BEATS + 2) * self.interval_s)
            if self._thread.is_alive():
                log.warning(f"lightning_gaudi_fsdp: the heartbeat of rank {self.rank} did not stop")
            self._thread = None
        if self._clock is not None:
            self._clock.release()

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
            text = f"{type(exception).__name__}: {exception}".strip().splitlines()[0][:500]
            order = _record_error(store, self.rank, run, text, peer_failure)
            if not peer_failure:
                self._own_error = order
                self._await_acknowledgements(store)
                return None
            gone = self._gone(store)
            errors = _recorded_errors(store, range(self.world_size), run)
        except Exception as err:  # noqa: BLE001 - failing to talk to the store is the finding itself
            if not peer_failure:
                return None
            host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            return Verdict(store_unreachable=f"{host}:{port}: {type(err).__name__}", agent_store=agent)
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
        return Verdict(
            lost=sorted(gone - reported),
            errors=own_errors,
            stuck=stuck,
            waited_in=_stuck.traceback_wait_site(exception) if stuck else None,
        )

    def _await_acknowledgements(self, store: Any) -> None:
        """After recording an error of this rank's own: wait (a few beats at most) until every other rank printed
        it or failed with an error of its own, so that a rank killed as soon as this one exits (Lightning's launcher
        kills the rest of the job then) has said which rank failed first. Meanwhile this rank acknowledges the others'
        errors itself, so that ranks failing together do not wait for each other."""
        deadline = time.monotonic() + 3 * self.interval_s
        while time.monotonic() < deadline:
            self._acknowledge_errors(store)
            others = [r for r in range(self.world_size) if r != self.rank and r not in self._told]
            if not others or store.check([_key("ack", f"{self.rank}/{r}", self._run) for r in others]):
                return
            time.sleep(0.1)

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


def _dump_stacks(header: str) -> None:
    """Print ``header`` and every thread's Python stack to stderr (from the heartbeat thread, while the main thread
    is stuck)."""
    import faulthandler

    sys.stderr.write(header + "\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
