"""Saving safely onto real storage: free space before a save, and the cause of a failed write on every rank.

:func:`write_atomically` runs a save in steps: prepare the staging location, write (one or more steps), commit. After
each step the ranks tell each other whether, and why, their part failed; then every rank raises the same
:class:`CheckpointSaveError`, naming the checkpoint, the failed ranks and the cause in plain words ("no space left on
/scratch: needed about 4.2 MiB, 1.1 MiB free", a read-only file system, a permission, a directory that vanished), with
the rank's own exception chained. Rank 0 removes the staging location only after that exchange, when no rank writes
into it any more, so clean-up never causes a second error that hides the first.

Before anything is written, every rank reports the bytes it is about to write and the free space of its target file
system (both measured by :mod:`.space`); a file system that cannot hold what its ranks write refuses the save
(:func:`shortfalls`). :func:`zip_checksums` switches off ``torch.save``'s CRC32 of each record while a checkpoint
is written (``checkpoint_crc32=False``, the default): ``torch.load`` never checks them, and computing them took about
as long as writing the bytes. Nothing here knows state-dict formats.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_gaudi_fsdp.checkpoint import checksum, commit, files, space
from lightning_gaudi_fsdp.checkpoint.files import Remote, Where
from lightning_gaudi_fsdp.checkpoint.space import Plan, Target, human_bytes, needed_together, same_file_system

log = logging.getLogger(__name__)

_FULL_BELOW_BYTES = 64 * 1024  # after a write failed without an errno, a file system with less free is taken as full

Gather = Callable[[Any], list[Any]]


def _no_space(mount: str, needed: int | None, free: int | None) -> str:
    if needed is None or free is None:
        return f"no space left on {mount}"
    return f"no space left on {mount}: needed about {human_bytes(needed)}, {human_bytes(free)} free"


def shortfalls(plans: Sequence[Plan]) -> list[Failure]:
    """Refusals, one per writing rank, for each file system whose free space is less than its ranks will write."""
    failures: list[Failure] = []
    done: set[tuple[int | str, int]] = set()
    for plan in plans:
        key = plan.target.file_system
        if key in done:
            continue
        done.add(key)
        group = same_file_system(plans, plan.target)
        needed, free = needed_together(group), min(p.target.free for p in group)
        if needed is None or needed <= free:  # an estimate that failed was reported when it failed
            continue
        mount = plan.target.mount
        advice = (
            f"free space on {mount} or save elsewhere; if this file system reports its free space wrongly, pass "
            f"check_free_space=False (strategy or convert) or set {space.CHECK_FREE_SPACE_ENV}=0"
        )
        cause = _no_space(mount, needed, free)
        failures += [Failure(p.rank, "refused before writing", cause, "", advice) for p in group if p.needed]
    return failures


# ---------------------------------------------------------------------------------------------------- failures
@dataclass(frozen=True)
class Failure:
    """Why one rank's part of a save failed: ``cause`` in plain words ("" when unknown), ``error`` the exception's
    first line, ``advice`` what to do."""

    rank: int
    stage: str
    cause: str
    error: str
    advice: str


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def save_error_message(path: Where, failures: Sequence[Failure], world_size: int | None = None) -> str:
    """One message for every rank: each cause once, with the ranks it hit (none named when one process saved)."""
    groups: dict[tuple[str, str], list[Failure]] = {}
    for failure in sorted(failures, key=lambda f: f.rank):
        groups.setdefault((failure.stage, failure.cause), []).append(failure)
    parts = []
    for (stage, cause), members in groups.items():
        errors = list(dict.fromkeys(f.error for f in members if f.error))
        text = "; ".join(errors) or "unknown error"
        if cause:
            text = cause + (f" ({text})" if errors else "")
        who = "" if world_size == 1 else _ranks([f.rank for f in members]) + " "
        parts.append(f"{who}{stage}: {text}")
    advice = "; ".join(dict.fromkeys(f.advice for f in failures if f.advice))
    return (
        f"Cannot save checkpoint {str(path)!r}: {'; '.join(parts)}. Nothing was committed: a checkpoint already under "
        f"this name is unchanged. To do: {advice}."
    )


class CheckpointSaveError(OSError):
    """A save that failed: raised on every rank with the same message (path, failed ranks, causes, what to do); on a
    rank whose own write failed, that exception is chained."""

    def __init__(
        self, path: str | os.PathLike[str] | Remote, failures: Sequence[Failure], world_size: int | None = None
    ) -> None:
        where = path if isinstance(path, Remote) else Path(path)
        super().__init__(save_error_message(where, failures, world_size))
        self.path = where
        self.failures = list(failures)
        self.world_size = world_size

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.failures, self.world_size)


def _os_error_in(error: BaseException) -> OSError | None:
    """The first ``OSError`` with an errno in ``error``'s chain (torch's writers wrap it in a ``RuntimeError``)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        todo += [current.__cause__, current.__context__]
    return None


def _raised_by(error: BaseException, rank: int) -> list[tuple[int, BaseException]]:
    """The ranks that raised ``error``: torch's distributed checkpoint raises one exception on every rank that
    carries each failed rank's own (``CheckpointException.failures``: rank -> (exception, traceback))."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        found = [(r, e[0] if isinstance(e, tuple) else e) for r, e in failures.items()]
        return [(int(r), e) for r, e in found if isinstance(e, BaseException)] or [(rank, error)]
    return [(rank, error)]


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def failures_of(error: BaseException, rank: int, stage: str) -> list[Failure]:
    """What ``error``, raised on ``rank`` by a save, says failed: a :class:`CheckpointSaveError`'s own failures (already
    agreed by every rank), else one failure of ``rank`` in ``stage`` with the error's first line."""
    if isinstance(error, CheckpointSaveError):
        return list(error.failures)
    shown = _os_error_in(error) or error
    return [Failure(rank, stage, "", first_line(shown), "see the error chained on the failed rank")]


def merge_reports(reports: Sequence[Sequence[Failure]]) -> list[Failure]:
    """One failure per failed rank from every rank's report (``reports[r]``: what rank ``r`` reported); a rank's
    account of its own failure wins over another rank's."""
    failures: dict[int, Failure] = {}
    for reporter, reported in enumerate(reports):
        for failure in reported:
            if failure.rank not in failures or failure.rank == reporter:
                failures[failure.rank] = failure
    return list(failures.values())


# ------------------------------------------------------------------------------------------------ the protocol
_NO_TARGET = Target("", 0, 0, "", 0)  # a URL's: no free space to compare with


class _Attempt:
    def __init__(self, path: Where, *, directory: bool, rank: int, gather: Gather, staging: Where | None) -> None:
        self.path = path
        self.staging = staging if staging is not None else commit.staging_path(path)
        self.directory = directory
        self.rank = rank
        self.gather = gather
        self.plans: list[Plan] = []
        self.world_size: int | None = None

    def prepare(self, before: Callable[[], None] | None, needed: Callable[[], int], check: bool) -> None:
        def plan() -> Plan:
            if self.rank == 0:
                if before is not None:
                    before()
                commit.prepare_staging(self.path, self.directory, self.staging)
            if isinstance(self.path, Remote):
                return Plan(self.rank, _NO_TARGET, None, False)
            return Plan(self.rank, space.probe(self.path.parent), self.estimate(needed, check), check)

        self.plans = self.step("failed while preparing", plan)
        if self.plans[0].check:  # rank 0 decides, so every rank takes the same branch
            refused = shortfalls(self.plans)
            if refused:
                self.fail(refused, None)

    def estimate(self, needed: Callable[[], int], check: bool) -> int | None:
        """``needed()``, or None with a warning (when ``check``) that the free-space check does not run: a partial
        count would let a save that does not fit pass it."""
        try:
            return needed()
        except Exception as err:  # noqa: BLE001 - the save itself reports what it cannot write
            if check:
                log.warning(
                    f"[rank {self.rank}] the free-space check before saving {str(self.path)!r} did not run: the size "
                    f"of this rank's part could not be estimated ({first_line(err)}); saving without it"
                )
            return None

    def step(self, stage: str, action: Callable[[], Any]) -> list[Any]:
        """Run ``action``, then learn every rank's outcome; if any failed, every rank raises the same error."""
        result: Any = None
        error: BaseException | None = None
        try:
            result = action()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # torch's distributed checkpoint raises a BaseException (CheckpointException)
            error = err
        reports = [self.describe(r, e, stage) for r, e in _raised_by(error, self.rank)] if error is not None else []
        try:
            gathered = self.gather((result, reports))
        except BaseException:
            if error is not None:  # a lost peer; keep this rank's own failure in the output
                log.error(f"[rank {self.rank}] saving {str(self.path)!r} {stage}: {first_line(error)}")
            raise
        self.world_size = len(gathered)
        failures = merge_reports([reported for _, reported in gathered])
        if failures:
            self.fail(failures, error)
        return [res for res, _ in gathered]

    def fail(self, failures: list[Failure], error: BaseException | None) -> None:
        if self.rank == 0:
            try:
                commit.discard(self.path)
            except Exception as err:  # noqa: BLE001 - a read-only file system, a store gone: the first error matters
                log.warning(f"could not remove the staging location {str(self.staging)!r}: {err}")
        raise CheckpointSaveError(self.path, failures, self.world_size) from error

    def describe(self, rank: int, error: BaseException, stage: str) -> Failure:
        try:
            cause, advice = self._cause(error, staging_made=stage != "failed while preparing")
        except Exception:  # noqa: BLE001 - looking at a broken target must not keep this rank from reporting
            cause, advice = "", ""
        shown = _os_error_in(error) or error  # "[Errno 28] No space left on device", not torch's "unexpected pos"
        return Failure(rank, stage, cause, first_line(shown), advice or "see the error chained on the failed rank")

    def _cause(self, error: BaseException, staging_made: bool) -> tuple[str, str]:
        if isinstance(self.path, Remote):  # the store's own message (bucket, credentials, network) is the cause
            return "", f"check that {self.path.url!r} is reachable and writable with these credentials"
        own = next((p for p in self.plans if p.rank == self.rank), None)
        where = self.staging if self.directory else self.path.parent
        mount = own.target.mount if own else str(space.mount_point(where))
        needed = needed_together(same_file_system(self.plans, own.target)) if own else None
        full = (_no_space(mount, needed, own.target.free if own else None), f"free space on {mount} or save elsewhere")
        read_only = (f"{mount} is a read-only file system", f"remount {mount} read-write or save elsewhere")
        gone = self._vanished(staging_made)
        os_error = _os_error_in(error)
        code = os_error.errno if os_error is not None else None
        if code in (errno.ENOSPC, errno.EDQUOT):
            return full
        if code == errno.EROFS:
            return read_only
        if code in (errno.EACCES, errno.EPERM):
            target = os_error.filename if os_error is not None and os_error.filename else where
            return (
                f"permission denied for {str(target)!r}",
                f"make {str(self.path.parent)!r} writable for this user (and not immutable: lsattr/chattr -i) or "
                "save elsewhere",
            )
        if code not in (None, errno.ENOENT):
            return "", ""
        if gone is not None:
            return gone
        if code is None:  # torch's file writer reports no errno ("unexpected pos ..."): look at the target itself
            if space.read_only(where):
                return read_only
            if not os.access(space.nearest_existing(where), os.W_OK):
                return f"permission denied for {str(where)!r}", f"make {str(where)!r} writable or save elsewhere"
            if space.free_bytes(where) < max(own.needed or 0 if own else 0, _FULL_BELOW_BYTES):
                return full
        return "", ""

    def _vanished(self, staging_made: bool) -> tuple[str, str] | None:
        advice = (
            "keep the checkpoint directory in place while training runs (a clean-up job, or another run sharing the "
            "directory, may have removed it)"
        )
        if not self.path.parent.exists():
            return f"directory {str(self.path.parent)!r} no longer exists", advice
        if staging_made and self.directory and not self.staging.exists():
            return f"the staging directory {str(self.staging)!r} was removed during the save", advice
        return None


def _alone(obj: Any) -> list[Any]:
    return [obj]


@contextlib.contextmanager
def zip_checksums(enabled: bool) -> Iterator[None]:
    """Write ``torch.save`` archives with (``enabled``) or without a CRC32 of each record while the block runs in
    this thread (where the checkpoint's writers run: the training loop's, or a background save's).

    ``torch.load`` (and the distributed checkpoint reader) never verify them; only zip tools (``unzip -t``) do. The
    switch is torch's ``set_crc32_options``, restored on the way out: per thread on torch 2.13, process-wide on
    2.6 to 2.9, where a ``torch.save`` of your own during a background save also writes none (it loads all the
    same). The doors never run two saves at once."""
    serialization = torch.serialization
    found = serialization.get_crc32_options()
    serialization.set_crc32_options(enabled)
    try:
        yield
    finally:
        serialization.set_crc32_options(found)


def write_atomically(
    path: str | os.PathLike[str],
    writes: Sequence[Callable[[], None]],
    *,
    directory: bool,
    needed: Callable[[], int],
    check_free_space: bool | None = None,
    rank: int = 0,
    gather: Gather = _alone,
    before: Callable[[], None] | None = None,
    staging: Where | None = None,
    recorder: checksum.Recorder | None = None,
) -> Where:
    """Save to ``path`` through its staging location; every rank calls this with its own ``writes`` (run in order,
    the ranks agreeing after each) and ``needed``, which estimates the bytes those writes take. ``gather`` is an
    all-gather of Python objects (one process: the default). ``before`` runs on rank 0 before the staging location
    is prepared.

    Raises :class:`CheckpointSaveError` on every rank if any rank's step failed, or before any write if free space
    is short (unless the check is off, see :func:`check_free_space_enabled`). Where ``needed`` raises, that rank logs
    the warning "the free-space check before saving PATH did not run: ..." and the file system it writes to is not
    checked; the save goes on (and reports what it cannot write, if anything). ``staging``: where the writes go
    (:func:`.commit.staging_path`; required for a URL, whose generation every rank must agree on). At a URL there is
    no free-space check; the commit writes the commit record (see :mod:`.commit`). ``recorder``: the checksums of
    what this rank wrote into the staging directory; rank 0 writes every rank's into its manifest before the
    commit."""
    path = files.locate(path, "path")  # every writer saves through here: never a URL taken for a local path
    attempt = _Attempt(path, directory=directory, rank=rank, gather=gather, staging=staging)
    attempt.prepare(before, needed, space.check_free_space_enabled(check_free_space))
    for write in writes:
        attempt.step("failed while writing", write)
    digests: dict[str, checksum.Digest] = {}
    if recorder is not None:
        for recorded in attempt.step("failed while writing", lambda: dict(recorder.files)):
            digests.update(recorded)

    def finish() -> None:
        if rank == 0:
            if recorder is not None:
                checksum.write_manifest(attempt.staging, digests)
            commit.commit(attempt.staging, path)

    attempt.step("failed while committing", finish)
    return path
