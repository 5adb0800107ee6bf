"""How a survivor tells a lost rank from a live one on its own node: by process id, zombies counting as gone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest

from lightning_gaudi_fsdp import _liveness, _liveness_store
from lightning_gaudi_fsdp._liveness_store import Verdict
from lightning_gaudi_fsdp._rendezvous import _process_alive


def test_a_running_process_is_alive_and_a_killed_unreaped_one_is_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _process_alive(child.pid)
        child.kill()
        # not reaped (no wait()): a zombie, as a SIGKILLed rank is until Lightning's launcher polls it
        deadline = time.monotonic() + 10
        while _process_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _process_alive(child.pid)
        assert child.poll() is not None  # ... and it really was killed, not gone some other way
    finally:
        child.wait()
    assert not _process_alive(child.pid)


def test_the_verdict_names_lost_ranks_and_the_first_error_another_rank_raised():
    verdict = Verdict(lost=[2, 3], errors=[(0, "OSError: disk full"), (1, "ValueError: x")])
    assert verdict.message(rank=0, world_size=4) == (
        "lightning_gaudi_fsdp: ranks 2, 3 of 4 stopped without reporting an error (killed, out of memory, or "
        "crashed); the collective failure on the surviving ranks follows from that; rank 1 failed first with: "
        "ValueError: x"
    )
    assert Verdict().message(rank=0, world_size=4) is None


def _leave_with_launcher_in_a_child(launcher_pid: str) -> subprocess.CompletedProcess[str]:
    code = "from lightning_gaudi_fsdp import _rendezvous; _rendezvous.leave_with_launcher(); print('stayed')"
    env = {**os.environ, "LIGHTNING_GAUDI_FSDP_LAUNCHER_PID": launcher_pid}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_rank_whose_launcher_is_gone_leaves_at_once_and_an_unrelated_live_pid_is_left_alone():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid is free, nobody runs under it
    gone = _leave_with_launcher_in_a_child(str(dead.pid))
    assert gone.returncode == 1
    assert f"the process that launched this rank (pid {dead.pid}, global rank 0) is gone" in gone.stderr
    # pid 1 runs and is not the child's parent: a variable leaked from an outer launch, not our launcher
    alive = _leave_with_launcher_in_a_child("1")
    assert alive.returncode == 0
    assert alive.stdout.strip() == "stayed"


def test_an_exception_that_ends_the_script_is_reported_once_before_the_previous_hook_prints_it():
    """Fabric's door reports through sys.excepthook: the heartbeat's report runs first (its note is printed with the
    traceback), the hook that was there before still runs, and installing twice chains only once."""
    # _liveness loaded on its own in a fresh interpreter: the hook it installs is the only one
    code = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_liveness", {_liveness.__file__!r})
_liveness = sys.modules["_liveness"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_liveness)

class Recording(_liveness.Heartbeat):
    def report(self, exception):
        exception.add_note(f"reported by rank {{self.rank}}")
        return None

def previous(kind, value, tb):
    sys.stderr.write("previous hook: " + " | ".join([str(value), *value.__notes__]) + "\\n")

sys.excepthook = previous
_liveness.report_uncaught(Recording(0, 2, "node"))
_liveness.report_uncaught(Recording(1, 2, "node"))  # the same hook, now for rank 1
raise RuntimeError("boom")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "previous hook: boom | reported by rank 1"


def test_failure_timeout_takes_the_argument_then_the_environment_then_60_seconds(monkeypatch):
    from lightning_gaudi_fsdp import GaudiFSDPStrategy, _rendezvous

    monkeypatch.delenv("LIGHTNING_GAUDI_FSDP_FAILURE_TIMEOUT", raising=False)
    assert GaudiFSDPStrategy()._config.failure_timeout == 60.0
    assert GaudiFSDPStrategy(failure_timeout=12)._config.failure_timeout == 12.0
    monkeypatch.setenv("LIGHTNING_GAUDI_FSDP_FAILURE_TIMEOUT", "25")
    assert GaudiFSDPStrategy()._config.failure_timeout == 25.0
    assert GaudiFSDPStrategy(failure_timeout=12)._config.failure_timeout == 12.0
    monkeypatch.setenv("LIGHTNING_GAUDI_FSDP_FAILURE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"LIGHTNING_GAUDI_FSDP_FAILURE_TIMEOUT='soon' is not supported; expected a"):
        GaudiFSDPStrategy()
    with pytest.raises(ValueError, match=r"failure_timeout=-1 is not supported; expected a positive number of seconds"):
        GaudiFSDPStrategy(failure_timeout=-1)
    assert _rendezvous.DEFAULT_FAILURE_TIMEOUT_S == 60.0
    from jsonargparse import ArgumentParser  # LightningCLI's parser: the bound is a YAML value like any other

    parser = ArgumentParser()
    parser.add_class_arguments(GaudiFSDPStrategy, "strategy")
    config = parser.parse_string("strategy:\n  failure_timeout: 20\n")
    assert GaudiFSDPStrategy(**config.strategy.as_dict())._config.failure_timeout == 20.0


def test_stuck_timeout_is_off_unless_given_in_seconds_as_an_argument_or_in_yaml():
    from jsonargparse import ArgumentParser

    from lightning_gaudi_fsdp import GaudiFSDPStrategy, fabric

    assert GaudiFSDPStrategy()._config.stuck_timeout is None
    assert GaudiFSDPStrategy(stuck_timeout=300)._config.stuck_timeout == 300.0
    assert fabric.GaudiFSDPStrategy(stuck_timeout=timedelta(minutes=2))._config.stuck_timeout == 120.0
    with pytest.raises(
        ValueError, match=r"^stuck_timeout='5m' is not supported; expected a positive number of seconds"
    ):
        GaudiFSDPStrategy(stuck_timeout="5m")
    parser = ArgumentParser()
    parser.add_class_arguments(GaudiFSDPStrategy, "strategy")
    config = parser.parse_string("strategy:\n  stuck_timeout: 90\n")
    assert GaudiFSDPStrategy(**config.strategy.as_dict())._config.stuck_timeout == 90.0


def test_a_wait_in_torch_distributed_is_timed_per_call_so_short_waits_never_add_up():
    """The heartbeat's clock of the main thread's wait, on a real thread blocked in real ``torch.distributed`` calls
    (a store read another thread answers later): eight waits of 0.25 s in a row never read as one long wait; one
    wait of 2.5 s does, and names the call; time spent outside ``torch.distributed`` is no wait."""
    import threading

    import torch.distributed as dist
    from torch.distributed.elastic.utils.store import get_all

    from lightning_gaudi_fsdp._stuck import WaitClock

    store = dist.HashStore()
    phase = {"name": "idle"}

    def waits() -> None:
        time.sleep(0.5)  # outside torch.distributed
        for i, seconds in enumerate([0.25] * 8 + [2.5]):
            phase["name"] = "short" if seconds < 1 else "long"
            threading.Timer(seconds, store.set, args=(f"w{i}/0", b"x")).start()
            get_all(store, 0, f"w{i}/", 1)
        phase["name"] = "done"

    thread = threading.Thread(target=waits, daemon=True)
    thread.start()
    clock = WaitClock(thread.ident)
    seen: dict[str, float] = {}
    sites = set()
    while thread.is_alive():
        waited, name = clock.sample(), phase["name"]
        seen[name] = max(seen.get(name, 0.0), waited)
        if clock.site:
            sites.add(clock.site)
        time.sleep(0.05)
    assert seen["idle"] == 0.0
    # each short wait read alone (on a loaded machine a 0.25 s wait may end late), never the 2 s they add up to
    assert seen["short"] < 1.5, seen
    assert seen["long"] > 1.8, seen
    assert sites
    assert all(re.fullmatch(r"get_all \(torch/distributed/elastic/utils/store\.py:\d+\)", s) for s in sites), sites


_RENDEZVOUS_CHILD = """
import os, subprocess, sys, time
from lightning_gaudi_fsdp import _rendezvous
dead = subprocess.Popen([sys.executable, "-c", "pass"])
dead.wait()
with _rendezvous.bounded_rendezvous(1.0, lambda: (0, 2)):
    time.sleep(0.1)  # a rendezvous that finishes in time
time.sleep(1.5)  # past the bound: nothing fires once it finished
print("stayed", flush=True)
# Lightning's launcher whose started ranks are all the others and all still run: slow, not lost; it waits on
with _rendezvous.bounded_rendezvous(1.0, lambda: (0, 2), lambda: {1: os.getpid()}):
    time.sleep(2)
print("waited on", flush=True)
# a rank Lightning's launcher started (its parent) waits on as well: the launcher does the watching
_rendezvous._launcher_pid = os.getppid()
with _rendezvous.bounded_rendezvous(1.0, lambda: (1, 2)):
    time.sleep(2)
_rendezvous._launcher_pid = 0
print("followed", flush=True)
# one of them ended: no need to wait for the bound
with _rendezvous.bounded_rendezvous(60.0, lambda: (0, 2), lambda: {1: dead.pid}):
    time.sleep(60)
print("still here", flush=True)
"""


def test_a_rendezvous_is_bounded_and_a_launcher_leaves_at_once_when_a_rank_it_started_ended():
    """The plain bound firing (a peer on another launcher) is in the default run of test_failure_matrix.py."""
    env = {**os.environ, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _RENDEZVOUS_CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == ["stayed", "waited on", "followed"]
    assert re.search(
        r"lightning_gaudi_fsdp: rank 0 of 2 \(node .+, pid \d+\) was in the rendezvous at 10\.1\.2\.3:29500; "
        r"rank 1 \(pid \d+\), which it started, ended before joining",
        proc.stderr,
    ), proc.stderr
    assert time.monotonic() - started < 50  # not the 60 s bound of the last wait


_HEARTBEAT_CHILD = """
import time
from lightning_gaudi_fsdp import _liveness
_liveness.Heartbeat(1, 2, "elsewhere", interval_s=0.2, bound_s=1.0).start()
print("beating", flush=True)
time.sleep(60)  # a main thread blocked where the loss of the store never reaches it
"""


def _readline(stream: Any, timeout: float) -> str:
    """The next line of a child's output, failing the test if none comes within ``timeout`` seconds."""
    import select

    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        pytest.fail(f"no line from the child within {timeout} s")
    return stream.readline().strip()


def test_a_rank_that_lost_the_store_during_fit_leaves_after_the_bound():
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    env.pop("LIGHTNING_GAUDI_FSDP_HEARTBEAT", None)
    child = subprocess.Popen(
        [sys.executable, "-c", _HEARTBEAT_CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert _readline(child.stdout, timeout=60) == "beating"
        assert store.add("lightning_gaudi_fsdp/liveness/0/beat/1", 0) >= 1  # it reached the store
        del store  # its host is gone
        lost = time.monotonic()
        _, stderr = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 1
    assert time.monotonic() - lost < 30
    assert re.search(
        r"lightning_gaudi_fsdp: rank 1 of 2 \(node .+, pid \d+\) lost the rendezvous store at 127\.0\.0\.1:\d+ "
        r"\(\w+\) 1 s ago \(failure_timeout\) and is still running",
        stderr,
    ), stderr


def test_a_heartbeat_that_looks_while_another_rank_records_its_error_still_acknowledges_it(capfd):
    """Rank 1 records its error in several store operations; rank 0's heartbeat may look between any two of them (a
    loaded machine descheduled rank 1 there). Its next beat must still print and acknowledge the error: without the
    acknowledgement rank 1 exits after its bounded wait, and Lightning's launcher kills rank 0 before it said which rank
    failed (the CI flake of test_a_rank_raising_stops_every_rank_with_its_error)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    survivor = _liveness.Heartbeat(0, 2, "node")

    class Interleaved:  # rank 1's view of the store: rank 0's heartbeat beats before each of its operations
        def __getattr__(self, name: str):
            operation = getattr(store, name)

            def call(*args):
                survivor._acknowledge_errors(store)
                return operation(*args)

            return call

    _liveness_store._record_error(Interleaved(), 1, survivor._run, "RuntimeError: boom", peer_failure=False)
    survivor._acknowledge_errors(store)  # its next beat
    assert "[rank 0] lightning_gaudi_fsdp: rank 1 failed first with: RuntimeError: boom" in capfd.readouterr().err
    assert store.check([_liveness_store._key("ack", "1/0", survivor._run)])
