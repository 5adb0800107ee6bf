"""Saving in the background: the training loop waits only while a checkpoint is copied into host memory.

:meth:`BackgroundSaver.save` waits for the previous save of this rank (at most one is in flight), stages the
checkpoint into reused host buffers (:mod:`.staging`) and hands the copy to a thread that runs the ordinary save
protocol on it (:func:`.storage.write_atomically`: prepare, write, agree, commit). That thread talks to the other
ranks' threads over a process group of its own (gloo, created on the first save), never over the default group,
whose collectives the training loop issues at the same time: one group used from two threads at once mixes up the
messages of both.

With ``defer`` (see :meth:`.staging.HostStager.stage_later`) the tensors only the optimizer step writes (parameters
and optimizer state in host memory) are copied by that thread too, first, while training goes on; the doors call
:meth:`BackgroundSaver.wait_staged` before the next optimizer step. A tensor written in place before its copy was made
fails that save on every rank (the copy would mix two steps); the ranks agree on the copies before anything is written.

So a background checkpoint is crash-safe exactly as a synchronous one: it becomes visible under its final name only
after every rank's thread wrote its part and they all agreed, and a kill in between leaves the previous checkpoint.
Removals of older checkpoints asked for while a save is in flight (``ModelCheckpoint``'s top-k rotation asks right
after ``save_checkpoint`` returns) are deferred until that save has committed, and dropped if it fails.

A failed background save is not lost: at the next save, or at :meth:`BackgroundSaver.finish` (end of fit), every
rank learns every rank's outcome over the main thread's group and raises the same
:class:`~.storage.CheckpointSaveError` (path, failed ranks, cause). Nothing here knows state-dict formats.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed

from lightning_gaudi_fsdp import _compat, _exit
from lightning_gaudi_fsdp.adapters import torch_internals
from lightning_gaudi_fsdp.checkpoint import space, storage
from lightning_gaudi_fsdp.checkpoint.staging import Defer, DeferredCopies, HostStager

log = logging.getLogger(__name__)

LONG_WAIT_S = 10.0  # a save waiting longer than this for the previous one says so
STAGE = "failed while writing in the background"
COPY_STAGE = "failed while copying the checkpoint in the background"

# write(staged_checkpoint, gather, process_group): the save protocol, run in the background thread with the
# background group's all-gather (``process_group`` is None without a process group).
Write = Callable[[Any, storage.Gather, Any], None]


@dataclass
class _Job:
    path: Path
    started: float
    done: threading.Event = field(default_factory=threading.Event)
    staged: threading.Event = field(default_factory=threading.Event)  # every tensor copied (or the copy failed)
    error: BaseException | None = None
    committed: bool = False
    removals: list[Callable[[], None]] = field(default_factory=list)
    thread: threading.Thread | None = None


class BackgroundSaver:
    """One rank's background saves (see the module docstring). ``timeout``: of the background process group, and how
    long :meth:`finish` waits for a save after the run failed.

    Every rank calls :meth:`save` and :meth:`finish` at the same points (they run collectives on the group of the
    ``gather`` passed in); :meth:`defer_removal` runs none."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        self._timeout = timeout
        self._stager = HostStager()
        self.use_host_buffers = self._stager.use  # who allocates the staging buffers (see HostStager.use)
        self._lock = threading.Lock()
        self._job: _Job | None = None
        self._group: Any = None
        self._group_made = False
        self.active = False  # whether saves go to the background now (the strategy arms it while fit runs)
        self.deferred_bytes = 0  # of the last save: bytes its thread copied after save() returned

    @property
    def in_flight(self) -> bool:
        job = self._job
        return job is not None and not job.done.is_set()

    def save(
        self,
        checkpoint: Any,
        path: Path,
        write: Write,
        *,
        rank: int,
        gather: storage.Gather,
        defer: Defer | None = None,
    ) -> float:
        """Wait for the previous save (raising its failure on every rank), stage ``checkpoint`` and start writing it
        in the background; the tensors ``defer`` picks are copied in the background first (every rank passes a
        ``defer`` or none). Returns the seconds this call blocked."""
        started = time.monotonic()
        self.wait(rank=rank, gather=gather, waiting=f"the save of {str(path)!r}")
        waited = time.monotonic() - started
        staged, later = self._stager.stage_later(checkpoint, defer)
        self.deferred_bytes = later.nbytes
        group = self._process_group()
        job = _Job(path, time.monotonic())  # a Path or a URL (.files.Remote)
        if not later.copies:
            job.staged.set()
        thread = threading.Thread(
            target=self._run,
            args=(job, staged, later if defer is not None else None, write, group, rank),
            name=f"checkpoint save {path}",
            daemon=True,
        )
        job.thread = thread
        self._job = job
        thread.start()
        blocked = time.monotonic() - started
        log.debug(
            f"[rank {rank}] {str(path)!r}: waited {waited:.3f}s for the previous save, staged "
            f"{space.human_bytes(self._stager.nbytes - later.nbytes)} in {blocked - waited:.3f}s, "
            f"{space.human_bytes(later.nbytes)} left to copy in the background"
        )
        return blocked

    def wait_staged(self, *, rank: int) -> float:
        """Wait until the save in flight has copied every tensor (before anything writes parameters or optimizer
        state again). Returns the seconds it waited."""
        job = self._job
        if job is None or job.staged.is_set():
            return 0.0
        started = time.monotonic()
        if not job.staged.wait(LONG_WAIT_S):
            log.warning(f"[rank {rank}] the optimizer step waits for the background copy of {str(job.path)!r}")
            job.staged.wait()
        return time.monotonic() - started

    def defer_removal(self, remove: Callable[[], None]) -> None:
        """Run ``remove`` once the save in flight has committed (now, if none is in flight); never if it failed."""
        with self._lock:
            job = self._job
            if job is not None and job.error is None and not job.committed:
                job.removals.append(remove)
                return
        if job is not None and job.error is not None:
            log.info(f"kept an older checkpoint: the save of {str(job.path)!r} that was to replace it failed")
            return
        _remove(remove)

    def wait(
        self,
        *,
        rank: int,
        gather: storage.Gather,
        agree: bool = True,
        timeout: float | None = None,
        waiting: str = "the end of fit",
    ) -> None:
        """Wait for the save in flight. ``agree``: exchange outcomes over ``gather`` and raise
        :class:`~.storage.CheckpointSaveError` on every rank if any rank's save failed; without it (after the run
        failed, when peers may not be there) a failure is logged, and the wait ends after ``timeout`` seconds.
        ``waiting``: what waits, for the warning logged when the wait is long."""
        job = self._job
        if job is None:
            return
        if not job.done.wait(LONG_WAIT_S):
            log.warning(
                f"[rank {rank}] {waiting} waits for the background save of {str(job.path)!r}, started "
                f"{time.monotonic() - job.started:.0f}s ago"
            )
            if not job.done.wait(timeout):
                log.error(f"[rank {rank}] gave up waiting for the background save of {str(job.path)!r}")
                self._job = None
                return
        # The thread has set ``done``; let it end too. Its last act drops its references to the staged copy and to
        # the background group: were that the group's last reference, gloo's destructor would run in that thread
        # while this one destroys the group (torch 2.6 deadlocks there).
        if job.thread is not None:
            job.thread.join()
        self._job = None
        error = job.error
        if not agree:
            if error is not None:
                log.error(f"[rank {rank}] the background save of {str(job.path)!r} failed: {error}")
            return
        reports = gather(storage.failures_of(error, rank, STAGE) if error is not None else [])
        failures = storage.merge_reports(reports)
        if failures:
            failed = storage.CheckpointSaveError(job.path, failures, len(reports))
            _compat.add_note(
                failed,
                "This checkpoint was being written in the background (async_save=True): its failure is raised at the "
                "next save or at the end of fit.",
            )
            raise failed from error

    def finish(self, *, rank: int, gather: storage.Gather, interrupted: bool = False) -> None:
        """End of fit: wait for the last save (raising its failure on every rank unless ``interrupted``), then free
        the host buffers and the background group."""
        timeout = self._timeout.total_seconds() if self._timeout is not None and interrupted else None
        try:
            self.wait(rank=rank, gather=gather, agree=not interrupted, timeout=timeout)
        finally:
            self.active = False
            self._stager.release()
            # After the agreement no rank's thread uses the group any more; after a failure a peer's thread might.
            if not interrupted:
                self._close_group()

    def _process_group(self) -> Any:
        if not self._group_made:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                kwargs = {"timeout": self._timeout} if self._timeout is not None else {}
                with _exit.recording_group_threads():
                    self._group = torch_internals.new_host_group(**kwargs)  # also beside a group bound to hpu:0
                _exit.close_at_exit(self.close)
            self._group_made = True
        return self._group

    def close(self) -> None:
        """When the interpreter exits: destroy the background group, which ``finish`` keeps after an interrupted run
        (a peer's thread might still use it). The save in flight was waited for already (``finish`` at the end of fit,
        Fabric's wait at exit); a thread still running is given a few seconds more."""
        job = self._job
        if job is not None and job.thread is not None:
            job.thread.join(LONG_WAIT_S)
        self._close_group()

    def _close_group(self) -> None:
        group, self._group, self._group_made = self._group, None, False
        if group is not None and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group(group)

    def _run(self, job: _Job, staged: Any, later: DeferredCopies | None, write: Write, group: Any, rank: int) -> None:
        try:
            gather = _gather_over(group)
            if later is not None:
                _copy_agreed(job.path, later, job.staged, gather, rank)
            write(staged, gather, group)
        except BaseException as err:  # noqa: BLE001 - reported to every rank at the next save or at the end of fit
            with self._lock:
                job.error = err
            job.staged.set()
            job.done.set()
            return
        with self._lock:
            job.committed = True
            removals, job.removals = job.removals, []
        for remove in removals:
            _remove(remove)
        job.done.set()


def _copy_agreed(path: Path, later: DeferredCopies, staged: threading.Event, gather: storage.Gather, rank: int) -> None:
    """Make the deferred copies, then learn every rank's outcome: if any rank's copy failed, every rank raises the
    same :class:`~.storage.CheckpointSaveError` before anything is written."""
    error: BaseException | None = None
    try:
        later.run()
    except Exception as err:  # noqa: BLE001 - agreed below
        error = err
    finally:
        staged.set()
    reports = gather(storage.failures_of(error, rank, COPY_STAGE) if error is not None else [])
    failures = storage.merge_reports(reports)
    if failures:
        raise storage.CheckpointSaveError(path, failures, len(reports)) from error


def _gather_over(group: Any) -> storage.Gather:
    def gather(obj: Any) -> list[Any]:
        if group is None:
            return [obj]
        gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(gathered, obj, group=group)
        return gathered

    return gather


def _remove(remove: Callable[[], None]) -> None:
    try:
        remove()
    except Exception as err:  # noqa: BLE001 - an older checkpoint left behind must not fail the run
        log.warning(f"could not remove an older checkpoint after a background save committed: {err}")
