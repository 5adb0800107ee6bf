"""The scenario pool itself (conftest.ScenarioPool + _pool.py): hangs, a dead server, a failed rank's partner."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import pytest

HANG = "hang.py"
# run_script sends every scenario through Lightning's launcher then, so there is no session pool to test.
needs_session_pool = pytest.mark.skipif(
    os.environ.get("SCENARIO_POOL", "1") == "0", reason="SCENARIO_POOL=0: run_script does not use the pool"
)


def _pids(out: Path, nprocs: int) -> list[int]:
    return [int((out / f"rank{r}.pid").read_text()) for r in range(nprocs)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@needs_session_pool
def test_a_hanging_scenario_fails_naming_the_test_and_leaves_no_rank(tmp_path):
    from conftest import _scenario_pool, run_script

    cfg = {"out": str(tmp_path / "out"), "devices": 2}
    with pytest.raises(pytest.fail.Exception) as failure:
        run_script(HANG, cfg, tmp_path, timeout=2)

    message = str(failure.value)
    assert message.startswith(
        "scenario tests/test_pool.py::test_a_hanging_scenario_fails_naming_the_test_and_leaves_no_rank "
        "hung for more than 2s"
    )
    # where each rank hung: every thread's stack, dumped into the rank's log before the kill
    for rank in range(2):
        log = message.split(f"--- rank {rank} stderr:")[1].split("--- rank")[0]
        assert "most recent call first" in log, log
        assert 'hang.py", line' in log, log
    pids = _pids(tmp_path / "out", 2)
    assert not [pid for pid in pids if _alive(pid)]  # killed and reaped by the pool before the test failed
    assert _scenario_pool().proc.poll() is None  # the pool itself survives a hung scenario


@needs_session_pool
def test_a_pool_server_killed_between_scenarios_is_replaced(tmp_path):
    from conftest import _scenario_pool, run_script

    exit_ok = {"exit_codes": {"0": 0, "1": 0}, "devices": 2}
    run_script(HANG, {**exit_ok, "out": str(tmp_path / "first")}, tmp_path)
    pool = _scenario_pool()
    killed = pool.proc
    killed.kill()
    killed.wait()

    result = run_script(HANG, {**exit_ok, "out": str(tmp_path / "second")}, tmp_path)
    assert result.proc.returncode == 0
    assert pool.proc is not killed
    assert pool.proc.poll() is None
    assert len(set(_pids(tmp_path / "second", 2))) == 2


@needs_session_pool
def test_a_failed_rank_s_partner_is_killed_after_the_grace_period(tmp_path):
    """Rank 0 exits with 3 while rank 1 sleeps: the pool kills rank 1 after the grace period (30 s by default, 0.5 s
    for this scenario), as torchrun would, and the scenario reports rank 0's code long before its timeout."""
    from conftest import SCENARIOS, _scenario_pool

    grace = 0.5
    pool = _scenario_pool()
    out = tmp_path / "out"
    out.mkdir()
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps({"out": str(out), "exit_codes": {"0": 3}}))
    pool._ensure()  # started before the clock: the server's imports are not part of what is measured
    started = time.monotonic()
    result = pool.run(
        SCENARIOS / HANG, [str(cfg_file)], nprocs=2, distributed=True, logs=out, timeout=60, grace_s=grace
    )
    elapsed = time.monotonic() - started

    assert result.returncode == 3
    assert grace <= elapsed < 30, elapsed
    assert not [pid for pid in _pids(out, 2) if _alive(pid)]


# A pytest worker of its own, reduced to what matters: it starts a pool server (without the torch imports, which these
# checks do not need), has it run a scenario that never ends under a 1 s deadline, then one with no deadline, and
# prints what the server replied.
WORKER = """
import json, subprocess, sys, time
server = subprocess.Popen([sys.executable, sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          env={**json.loads(sys.argv[2]), "SCENARIO_POOL_PRELOAD": "0"}, start_new_session=True)
print(json.dumps({"server": server.pid, **json.loads(server.stdout.readline())}), flush=True)
for request in json.loads(sys.argv[3]):
    server.stdin.write(json.dumps(request) + "\\n")
    server.stdin.flush()
    print(server.stdout.readline().strip(), flush=True)
    if "deadline_s" in request:
        print(server.stdout.readline().strip(), flush=True)
time.sleep(600)  # until the test kills this worker
"""


def test_the_pool_bounds_each_scenario_and_dies_with_a_worker_killed_hard(tmp_path):
    """The server kills a scenario's ranks at its own deadline even when the pytest side never does; a pytest worker
    killed hard (SIGKILL, as an out-of-memory kill or a CI runner cancelling does) takes the server and the ranks of
    the scenario it was running with it, although they sit in process groups of their own."""
    import signal
    import subprocess
    import sys

    from conftest import SCENARIOS, _env

    server, ranks = 0, []
    requests = []
    for name, deadline in (("bounded", {"deadline_s": 1}), ("orphaned", {})):
        out = tmp_path / name
        out.mkdir()
        cfg = out / "config.json"
        cfg.write_text(json.dumps({"out": str(out)}))
        request = {"script": str(SCENARIOS / HANG), "args": [str(cfg)], "cwd": str(SCENARIOS), "nprocs": 2}
        requests.append({**request, "distributed": True, "port": 0, "env": _env(), "logs": str(out), **deadline})
    pool_py = Path(__file__).parent / "_pool.py"
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(pool_py), json.dumps(_env()), json.dumps(requests)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        server = json.loads(worker.stdout.readline())["server"]
        json.loads(worker.stdout.readline())  # the bounded scenario started
        assert json.loads(worker.stdout.readline()) == {"codes": [-9, -9]}  # killed at its 1 s deadline
        assert not [pid for pid in _pids(tmp_path / "bounded", 2) if _alive(pid)]
        json.loads(worker.stdout.readline())  # the orphaned scenario started
        for _ in range(500):  # its ranks write their pids first thing
            if all((tmp_path / "orphaned" / f"rank{r}.pid").exists() for r in range(2)):
                break
            time.sleep(0.02)
        ranks = _pids(tmp_path / "orphaned", 2)
        assert all(_alive(pid) for pid in [server, *ranks])
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        for _ in range(250):
            if not [pid for pid in [server, *ranks] if _alive(pid)]:
                break
            time.sleep(0.02)
        assert [pid for pid in [server, *ranks] if _alive(pid)] == []
    finally:
        worker.kill()
        worker.wait()
        for pid in [server, *ranks]:  # whatever a failed check left behind (they are this test's own processes)
            if pid > 0:  # 0 until read: os.kill(0, ...) would signal this process group
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@needs_session_pool
def test_an_interrupted_scenario_leaves_no_rank(tmp_path):
    """Whatever stops the wait (pytest-timeout's signal, Ctrl-C): the scenario's ranks, in their own process group,
    are killed before the exception goes on, and the next scenario gets a fresh pool."""
    import signal

    from conftest import SCENARIOS, _scenario_pool

    class Interrupted(BaseException):  # as KeyboardInterrupt: not an Exception
        pass

    def interrupt(*_: object) -> None:
        raise Interrupted

    pool = _scenario_pool()
    out = tmp_path / "out"
    out.mkdir()
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps({"out": str(out)}))
    pool._ensure()
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 5.0)
        with pytest.raises(Interrupted):
            pool.run(SCENARIOS / HANG, [str(cfg_file)], nprocs=2, distributed=True, logs=out, timeout=120)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    pids = _pids(out, 2)
    for _ in range(250):
        if not [pid for pid in pids if _alive(pid)]:
            break
        time.sleep(0.02)
    assert [pid for pid in pids if _alive(pid)] == []
    assert pool.proc is None  # replaced at the next scenario
