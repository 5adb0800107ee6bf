"""A scenario pool: one long-lived process that imported torch and Lightning once and forks the ranks of each
multi-process scenario on request, as torchrun would start them (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``...).

Every rank is still its own process with its own real process group; only the ~5 s import of torch and Lightning per
process is paid once per test session. The pytest side (``conftest.py``) talks to it over stdin/stdout, one JSON
line per message:

- request: ``{"name", "script", "args", "cwd", "nprocs", "distributed", "env", "logs"}``, optionally ``"grace_s"``
  and ``"deadline_s"``
- reply 1: ``{"pgid": ...}`` as soon as the ranks are started (the pytest side kills that group on a timeout)
- reply 2: ``{"codes": [...]}`` once every rank has exited. When one rank fails, the others get ``grace_s`` seconds
  (``GRACE_S`` by default) to report their own errors, then are killed, as torchrun stops a job whose worker failed.
  Ranks still running ``deadline_s`` seconds after they started are killed (the server's own bound, behind the pytest
  side's timeout: it holds even when that side is stopped or stuck).

No process outlives the one that started it: the server gets SIGKILL when its pytest worker dies, however hard (the
parent-death signal of Linux's ``prctl``), and each rank when the server dies.

The server itself never touches a tensor or a process group, so forking it is safe.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import runpy
import signal
import sys
import time
from typing import Any

GRACE_S = float(os.environ.get("SCENARIO_POOL_GRACE_S", "30"))
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` (the process that started it) dies: a worker killed hard leaves neither
    the server nor ranks behind. Linux only; elsewhere the server still ends when its stdin closes."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)


def _preload() -> None:
    import lightning  # noqa: F401
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: F401

    import lightning_gaudi_fsdp  # noqa: F401
    from lightning_gaudi_fsdp.checkpoint import convert, loading  # noqa: F401


def _rank_main(request: dict[str, Any], rank: int) -> int:
    logs = request["logs"]
    for fd, name in ((1, f"rank{rank}.stdout"), (2, f"rank{rank}.stderr")):
        target = os.open(os.path.join(logs, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # A scenario that hangs is sent SIGUSR1 before it is killed: every thread's stack goes to the rank's stderr log.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    env = dict(request["env"])
    if request["distributed"]:
        env.update(
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            RANK=str(rank),
            WORLD_SIZE=str(request["nprocs"]),
            LOCAL_WORLD_SIZE=str(request["nprocs"]),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(request["port"]),
        )
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter does: a hook (Fabric's failure report) runs first
        return 1
    return 0


def _start(request: dict[str, Any]) -> list[int]:
    pids: list[int] = []
    pgid = 0
    server = os.getpid()
    for rank in range(request["nprocs"]):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _die_with_parent(server)
                os.setpgid(0, pgid)
                code = _rank_main(request, rank)
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        if not pgid:
            pgid = pid
        with contextlib.suppress(PermissionError, ProcessLookupError):  # the child did it already, or is gone
            os.setpgid(pid, pgid)
        pids.append(pid)
    return pids


def _wait(pids: list[int], pgid: int, grace_s: float, deadline_s: float) -> list[int]:
    codes: dict[int, int] = {}
    failed_at: float | None = None
    deadline = time.monotonic() + deadline_s
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and failed_at is None:
                    failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s and len(codes) < len(pids):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            failed_at = float("inf")  # killed once; now only reap
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.02)
    return [codes[pid] for pid in pids]


def _reply(message: dict[str, Any]) -> None:
    sys.__stdout__.write(json.dumps(message) + "\n")
    sys.__stdout__.flush()


def main() -> None:
    _die_with_parent(os.getppid())
    if os.environ.get("SCENARIO_POOL_PRELOAD", "1") != "0":  # 0: the pool's own tests, which run no training
        _preload()
    _reply({"ready": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        pids = _start(request)
        _reply({"pgid": pids[0], "pids": pids})
        grace_s = float(request.get("grace_s", GRACE_S))
        _reply({"codes": _wait(pids, pids[0], grace_s, float(request.get("deadline_s", "inf")))})


if __name__ == "__main__":
    main()
