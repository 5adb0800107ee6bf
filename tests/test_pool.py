"""The scenario pool itself (conftest.ScenarioPool + _pool.py): hangs, a dead server, a failed rank's partner."""

from __future__ import annotations

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
