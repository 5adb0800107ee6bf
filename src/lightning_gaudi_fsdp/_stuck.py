"""Where a rank's main thread waits: the collective it is blocked in, and for how long (``stuck_timeout``).

A rank stuck outside any collective (a deadlock in user code, a hung device call) leaves the other ranks blocked in
their next collective until the process group's ``timeout`` (30 minutes by default), and then only their own stacks
are printed. The heartbeat thread of each rank samples its main thread's innermost Python frame every beat: a frame
inside ``torch.distributed`` (a c10d collective, or FSDP waiting for one) is a wait, and the same frame object seen
again is the same call still waiting. Each rank publishes where it waits (or that it does not); a rank that waited
``stuck_timeout`` in one call names the ranks that are not waiting as stuck and has them print their stacks.
"""

from __future__ import annotations

import os
import sys
import time
from types import FrameType

_DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"
_PLUMBING = ("distributed_c10d.py", "c10d_logger.py")  # torch's collective wrappers: the caller says more


def wait_site(frame: FrameType | None) -> str | None:
    """``"all_reduce (called from _reduce_grad, torch/distributed/fsdp/_runtime_utils.py:858)"`` when ``frame``
    (a thread's innermost Python frame) is a call into ``torch.distributed`` blocked in C++; ``None`` otherwise.
    Checkpoint file writes (``torch.distributed.checkpoint``) are work, not a wait."""
    if frame is None or _DISTRIBUTED not in frame.f_code.co_filename or _is_checkpoint_io(frame):
        return None
    caller = frame
    while caller.f_back is not None and caller.f_code.co_filename.endswith(_PLUMBING):
        caller = caller.f_back
    if caller is frame:
        return f"{frame.f_code.co_name} ({_short(frame)})"
    return f"{frame.f_code.co_name} (called from {caller.f_code.co_name}, {_short(caller)})"


def traceback_wait_site(exception: BaseException) -> str | None:
    """:func:`wait_site` of the innermost frame of ``exception``'s traceback: the collective a rank failed in."""
    tb = exception.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return wait_site(tb.tb_frame)


def _is_checkpoint_io(frame: FrameType) -> bool:
    return f"distributed{os.sep}checkpoint{os.sep}" in frame.f_code.co_filename and frame.f_code.co_name != "wait"


def _short(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    index = path.rfind(f"{os.sep}torch{os.sep}")
    return f"{path[index + 1 :] if index >= 0 else path}:{frame.f_lineno}"


class WaitClock:
    """How long the thread ``ident`` has been in its current wait, sampled from another thread.

    The frame object is held between two samples: the same object means the same call is still running (a new call
    at the same place gets a new frame object), so a thread that waits briefly in many collectives is never taken for
    one that waits long in one."""

    def __init__(self, ident: int) -> None:
        self.ident = ident
        self._frame: FrameType | None = None
        self._since = 0.0
        self.site: str | None = None

    def sample(self) -> float:
        """Sample the thread: seconds it has waited in the current call (0 when it is not waiting)."""
        frame = sys._current_frames().get(self.ident)  # noqa: SLF001 - the documented way to read another thread
        site = wait_site(frame)
        if site is None:
            self._frame, self.site = None, None
            return 0.0
        if frame is not self._frame:
            self._frame, self._since, self.site = frame, time.monotonic(), site
        return time.monotonic() - self._since

    def release(self) -> None:
        self._frame = None
