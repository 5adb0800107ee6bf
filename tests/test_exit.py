"""What the package does at interpreter exit: gloo's worker threads found on this torch, and the wait until they are
idle. Each check runs in a fresh process (real torch threads over gloo)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = [
    pytest.mark.versions,  # which threads torch starts, and how it names them, moves with torch
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads are read from /proc"),
]

_PROBE = """
import json, sys, threading, time, torch, torch.distributed as dist
from lightning_gaudi_fsdp import _exit
from lightning_gaudi_fsdp.adapters.torch_internals import gloo_groups_exist

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
with _exit.recording_group_threads():  # as the doors create their groups
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
dist.all_reduce(torch.ones(1))
if rank == 0:  # joins the next all-reduce only once rank 1 attached its callback: it runs on a gloo worker
    store.wait(["attached"])
    dist.all_reduce(torch.ones(1))
    dist.barrier()
    sys.exit(0)
found = {"workers": _exit._gloo_workers(), "idle_settles": _exit.settle_gloo_workers(2.0)}
python = {thread.native_id for thread in threading.enumerate()}
found["python_threads_taken"] = [w for w in found["workers"] if int(w.rsplit("/", 1)[1]) in python]
events, started, sampled = {}, threading.Event(), threading.Event()

def busy(_):  # a completion callback still running: sleeps on a timer (not gloo's idle wait) until sampled
    events["callback_thread"] = f"/proc/self/task/{threading.get_native_id()}"
    events["callback_started"] = time.monotonic()
    started.set()
    deadline = time.monotonic() + 60
    while not sampled.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    events["callback_ended"] = time.monotonic()

future = dist.all_reduce(torch.ones(1), async_op=True).get_future()
future.then(busy)
store.set("attached", "1")
future.wait()
found["callback_ran"] = started.wait(60)
events["busy_sampling"] = time.monotonic()
found["busy_settles"] = _exit.settle_gloo_workers(0.3)  # the callback still runs: not idle within 0.3 s
events["busy_sampled"] = time.monotonic()
sampled.set()
found["then_settles"] = _exit.settle_gloo_workers(30.0)  # once it returns, the worker goes back to its idle wait
events["settled"] = time.monotonic()
dist.barrier()
found["gloo"] = gloo_groups_exist()
dist.destroy_process_group()
found["gloo_after"] = gloo_groups_exist()
print(json.dumps({**found, **events}))
"""


def test_gloo_workers_are_found_and_waited_for_until_idle():
    """The worker that runs a collective's completion callback is among the threads waited for, whether torch names
    it (2.13 and later) or not (2.6, 2.9: the threads that appeared while the group was created); the wait sees it
    busy while the callback runs and idle once it returned. The callback is attached before the other rank joins, so
    that it runs on the worker that completes the work (attached to a completed future, torch runs it in place, on
    the caller's thread)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = textwrap.dedent(_PROBE)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    try:
        outputs = [rank.communicate(timeout=180) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    found = json.loads(outputs[1][0].strip().splitlines()[-1])
    assert len(found["workers"]) >= 2, found  # gloo starts two workers per group by default
    assert found["python_threads_taken"] == []
    assert found["callback_thread"] in found["workers"], found  # a torch that hides its workers fails here
    assert (found["gloo"], found["gloo_after"]) == (True, False)
    assert found["idle_settles"] is True
    assert found["callback_ran"] is True
    # the order of events, not their durations: busy while the callback ran, settled only once it had returned
    assert found["callback_started"] <= found["busy_sampling"] < found["busy_sampled"] < found["callback_ended"]
    assert found["busy_settles"] is False
    assert found["busy_sampled"] - found["busy_sampling"] >= 0.3  # it waited its whole bound for the busy worker
    assert found["then_settles"] is True
    assert found["callback_ended"] <= found["settled"]


_OTHER_THREADS = """
import ctypes, json, os, threading, time, torch
import lightning as L
from lightning_gaudi_fsdp import _exit
from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy

def native():
    return {int(tid) for tid in os.listdir("/proc/self/task")} - {t.native_id for t in threading.enumerate()}

fabric = L.Fabric(accelerator="cpu", devices=1, strategy=GaudiFSDPStrategy())
fabric.launch()  # the door creates its gloo group
before = native()
torch.ones(256, 256) @ torch.ones(256, 256)  # OpenMP's pool: its threads spin while they wait (active policy)
libc = ctypes.CDLL(None)  # a runtime's thread that sleeps on a timer (libc's sleep as the thread's function)
handle = ctypes.c_ulong()
sleep = ctypes.cast(libc.sleep, ctypes.c_void_p)
assert libc.pthread_create(ctypes.byref(handle), None, sleep, ctypes.c_void_p(600)) == 0
time.sleep(0.2)
others = native() - before
workers = {int(w.rsplit("/", 1)[1]) for w in _exit._gloo_workers()}
print(json.dumps({"others": len(others), "taken_for_gloo": len(others & workers)}))
"""


def test_threads_that_are_not_gloos_are_not_waited_for_at_exit():
    """A process whose OpenMP threads spin while they wait (``OMP_WAIT_POLICY=active``) and with a runtime's thread
    sleeping on a timer: neither is taken for a gloo worker, so the exit does not wait the whole bound for them to go
    idle, nor warn that a gloo worker was still busy (before, any thread torch left unnamed was taken for one, and
    on every torch once the group was destroyed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "active"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_OTHER_THREADS)], capture_output=True, text=True, env=env, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["others"] >= 2, found  # the timer's thread and at least one of OpenMP's
    assert found["taken_for_gloo"] == 0, found
    assert "still busy" not in proc.stderr, proc.stderr[-3000:]  # the exit did not wait the whole bound for them
