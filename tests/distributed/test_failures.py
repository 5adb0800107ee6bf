"""One rank fails: every process exits non-zero within a bounded time and the user sees the failing rank's error."""

from __future__ import annotations

import re
import time

import pytest

from helpers import BLOCK, assert_close_weights
from lightning_gaudi_fsdp.checkpoint.convert import describe

BOUND_S = 90  # far below the 30-minute default process-group timeout


def _failing_run(
    scenario,
    fail: dict,
    timeout_s: float = 60,
    door: str = "trainer",
    launcher: str = "lightning",
    strategy_extra: dict | None = None,
    module_extra: dict | None = None,
    **extra,
):
    """A 2-rank run of 6 steps in which ``fail`` happens, through the Trainer or a Fabric loop (``door``), its ranks
    started by Lightning's launcher or, torchrun-style, by the scenario pool (``launcher``)."""
    started = time.monotonic()
    strategy = {"auto_wrap_policy": [BLOCK], "timeout": timeout_s, **(strategy_extra or {})}
    if door == "fabric":
        cfg = {"strategy": strategy, "fail": fail, "epochs": 2, **extra}
    else:
        module = {"n_samples": 64, "fail": fail, **(module_extra or {})}
        cfg = {"strategy": strategy, "module": module, "max_steps": 6, **extra}
    run = scenario(
        cfg,
        script="fabric_loop.py" if door == "fabric" else "train.py",
        expect_ok=False,
        timeout=BOUND_S + 60,
        launcher=launcher,
    )
    elapsed = time.monotonic() - started
    assert run.proc.returncode != 0
    assert elapsed < BOUND_S, f"took {elapsed:.0f}s"
    return run


@pytest.mark.parametrize(
    ("rank", "where", "door"),
    [
        (0, "training_step", "trainer"),
        # the version jobs' failure path: test_stuck_timeout_ends_every_rank_naming_the_stuck_one_with_its_stack
        (1, "training_step", "trainer"),
        pytest.param(0, "configure_model", "trainer", marks=pytest.mark.slow),  # rank 1's case is the default run's
        (1, "configure_model", "trainer"),
        (1, "training_step", "fabric"),  # the loop's step: the survivor reports from sys.excepthook
        pytest.param(0, "training_step", "fabric", marks=pytest.mark.slow),
    ],
)
def test_a_rank_raising_stops_every_rank_with_its_error(scenario, where, rank, door):
    fail = {"where": where, "rank": rank, "step": 2 if where == "training_step" else 0}
    run = _failing_run(scenario, fail, door=door)
    assert f"RuntimeError: boom in {where} on rank {rank}" in run.proc.stderr
    if rank == 1:  # the survivor, failing in a collective, points at the rank that raised first
        assert f"lightning_gaudi_fsdp: rank 1 failed first with: RuntimeError: boom in {where} on rank 1" in (
            run.proc.stderr
        )


def test_a_rank_raising_is_named_by_a_rank_that_never_reaches_a_collective(scenario):
    """Rank 1 raises while rank 0 is busy outside any collective (here: asleep). Under Lightning's launcher rank 0's
    process is killed by the launcher's observer soon after rank 1 exits, so no collective failure of its own can
    report anything: its heartbeat prints rank 1's error while rank 1 waits for that acknowledgement."""
    fails = [
        {"where": "training_step", "rank": 1, "step": 2},
        {"where": "training_step", "rank": 0, "step": 2, "kind": "hang"},
    ]
    run = _failing_run(scenario, fails)
    assert "RuntimeError: boom in training_step on rank 1" in run.proc.stderr
    assert "[rank 0] lightning_gaudi_fsdp: rank 1 failed first with: RuntimeError: boom in training_step on rank 1" in (
        run.proc.stderr
    )


# the default run's rank killed during a save: test_damage.py::test_sigkill_during_a_save_keeps_the_previous_checkpoint
@pytest.mark.slow
def test_a_rank_raising_during_a_checkpoint_save(scenario, tmp_path):
    ckpt = tmp_path / "ckpt"
    run = scenario(
        {
            "strategy": {"auto_wrap_policy": [BLOCK], "state_dict_type": "sharded", "timeout": 60},
            "module": {"n_samples": 64},
            "max_steps": 6,
            "save_at_step": 2,
            "save_path_in_loop": str(ckpt),
            "kill_on_save": {"rank": 1, "nth": 1},
        },
        expect_ok=False,
        timeout=BOUND_S + 60,
        launcher="lightning",  # these tests are about what happens under Lightning's own launcher
    )
    assert run.proc.returncode != 0
    assert not ckpt.exists()


@pytest.mark.parametrize("door", ["trainer", "fabric"])
def test_a_rank_killed_mid_training_stops_the_others_and_the_last_checkpoint_loads(scenario, tmp_path, door):
    ckpt = tmp_path / "last.ckpt"
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": "local", "timeout": 60}
    # the Trainer saves at step 2 (mid-epoch: its loader is stateful, so a resume goes on exactly), the Fabric loop
    # after its first epoch (step 3); rank 1 dies at step 4
    stateful = {"stateful_loader": True}
    if door == "fabric":
        saving = {"save": str(ckpt), "save_after_epoch": 1}
    else:
        saving = {"save_at_step": 2, "save_path_in_loop": str(ckpt), "module_extra": stateful}
    # Both doors torchrun-style (ranks started apart, by the scenario pool): under Lightning's launcher, its own
    # watcher may kill rank 0 before the package's diagnosis, and print its own message instead (the lost rank under
    # Lightning's launcher: test_failure_matrix.py).
    run = _failing_run(
        scenario,
        {"where": "training_step", "rank": 1, "step": 4, "kind": "sigkill"},
        door=door,
        launcher="pool",
        strategy=strategy,
        **saving,
    )
    # the survivor names the lost rank (gloo's own message names only a socket address)
    assert "lightning_gaudi_fsdp: rank 1 of 2 stopped without reporting an error" in run.proc.stderr, run.proc.stderr[
        -3000:
    ]
    assert describe(ckpt)["global_step"] == (3 if door == "fabric" else 2)
    if door == "fabric":
        return  # Fabric resuming from each format: test_fabric.py
    # the run resumed from the last checkpoint goes on as if never interrupted
    cfg = {
        "strategy": {"auto_wrap_policy": [BLOCK], "state_dict_type": "local"},
        "module": {"n_samples": 64, **stateful},
    }
    resumed = scenario({**cfg, "max_steps": 3, "ckpt_path": str(ckpt)}).final()
    straight = scenario({**cfg, "max_steps": 3}).final()
    assert (resumed["step"], resumed["lr"]) == (straight["step"], straight["lr"]) == (3, straight["lr"])
    assert_close_weights(resumed["weights"], straight["weights"], atol=0)


# the same PR_SET_PDEATHSIG in the default run: test_ranks_never_outlive_the_launcher_that_started_them
@pytest.mark.slow
def test_when_rank_0_is_killed_mid_training_the_rank_it_launched_goes_with_it(scenario):
    # Under Lightning's launcher the rendezvous store lives in rank 0's process, so nothing could go on without it:
    # the kernel ends rank 1 with its launcher (PR_SET_PDEATHSIG) instead of leaving it to wait for the timeout.
    # _failing_run returns once every process of the launch is gone, within the bound.
    run = _failing_run(scenario, {"where": "training_step", "rank": 0, "step": 3, "kind": "sigkill"})
    assert run.proc.returncode == -9


@pytest.mark.parametrize(
    ("engine", "door"),
    [(1, "trainer"), (2, "trainer"), (1, "fabric"), pytest.param(2, "fabric", marks=pytest.mark.slow)],
)
def test_ranks_with_different_wrap_policies_are_reported_not_deadlocked(scenario, engine, door):
    started = time.monotonic()
    cfg = {
        "strategy": {"auto_wrap_policy": [BLOCK], "fsdp_version": engine},
        "strategy_rank1": {"auto_wrap_policy": None},
    }
    if door == "fabric":  # checked in fabric.setup_module
        cfg.update(epochs=1)
    else:
        cfg.update(module={"n_samples": 64}, max_steps=2)
    run = scenario(
        cfg, script="fabric_loop.py" if door == "fabric" else "train.py", expect_ok=False, timeout=BOUND_S + 60
    )
    assert run.proc.returncode != 0
    assert time.monotonic() - started < BOUND_S
    # Every rank raises the same ValueError, the rank that differs from rank 0 included (not a bare StopIteration).
    for rank in (0, 1):
        stderr = (run.out / f"rank{rank}.stderr").read_text()
        assert re.search(
            rf"^\[rank{rank}\]: ValueError: ranks disagree on the FSDP configuration \(rank 0 vs rank 1: 4 FSDP "
            r"units \[.*\] vs 1 units \[''\]\); every rank must build the same model with the same strategy arguments",
            stderr,
            re.MULTILINE,
        ), f"rank {rank}: {stderr[-3000:]}"  # its own traceback's last line, not the survivor's note about rank 0


def test_ranks_never_outlive_the_launcher_that_started_them(scenario):
    """Rank 0 (Lightning's launcher, home of the rendezvous store) is SIGKILLed right after starting rank 1, which is
    then still importing torch: rank 1 leaves within seconds instead of waiting out the process-group timeout."""
    started = time.monotonic()
    run = scenario(
        {"strategy": {"auto_wrap_policy": [BLOCK]}, "max_steps": 2, "kill_launcher_after_spawn": True},
        expect_ok=False,
        timeout=BOUND_S + 60,
        launcher="lightning",
    )
    elapsed = time.monotonic() - started  # the launch's pipes stay open until rank 1 is gone too
    assert run.proc.returncode == -9
    assert elapsed < 60, f"rank 1 outlived its launcher by {elapsed:.0f}s"
    assert re.search(
        r"lightning_gaudi_fsdp: the process that launched this rank \(pid \d+, global rank 0\) is gone; this rank "
        r"leaves instead of waiting for a rendezvous",
        run.proc.stderr,
    ), run.proc.stderr[-3000:]


@pytest.mark.slow  # the stuck_timeout test below is the default run's: this one waits out a collective timeout
def test_a_stuck_rank_prints_where_it_is_stuck_when_the_collective_times_out(scenario):
    """Without ``stuck_timeout``: rank 1 hangs in training_step (alive, heartbeating); rank 0's collective times out
    after the strategy's timeout and asks it for its stack, which names the line it is stuck on."""
    run = _failing_run(scenario, {"where": "training_step", "rank": 1, "step": 2, "kind": "hang"}, timeout_s=20)
    assert "lightning_gaudi_fsdp: rank 1 stack, asked by rank 0 (its collective failed):" in run.proc.stderr
    assert "in _maybe_fail" in run.proc.stderr  # the stuck frame, from rank 1's faulthandler dump
    assert "rank 1 of 2 still runs but never reached the collective (stuck); " in run.proc.stderr
    assert re.search(r"; rank 0 waited in \w+ \(called from \w+, torch/distributed/", run.proc.stderr)


STUCK_S = 4


@pytest.mark.parametrize(
    ("door", "launcher"),
    [
        pytest.param("trainer", "lightning", marks=pytest.mark.versions),  # torch's frames differ between versions
        pytest.param("fabric", "pool", marks=pytest.mark.slow),
        pytest.param("trainer", "pool", marks=pytest.mark.slow),
    ],
)
def test_stuck_timeout_ends_every_rank_naming_the_stuck_one_with_its_stack(scenario, door, launcher):
    """Rank 1 sleeps in its training step (alive, heartbeating, in no collective) with ``stuck_timeout`` set: rank 0,
    waiting in a collective, names it (node, pid) and the collective after ``stuck_timeout``; rank 1 prints its own
    stack once, showing the line it is stuck on; every process exits non-zero long before the collective timeout."""
    run = _failing_run(  # which also bounds the whole run, far below the collective timeout
        scenario,
        {"where": "training_step", "rank": 1, "step": 2, "kind": "hang"},
        timeout_s=600,  # the collective timeout is far away: only stuck_timeout can end this run in time
        door=door,
        launcher=launcher,
        strategy_extra={"stuck_timeout": STUCK_S},
    )
    err = run.proc.stderr
    # How long rank 0 waited in the collective before naming rank 1, as rank 0 measured it: stuck_timeout, not the
    # collective timeout, ended the wait. (Timed from the wait's start, not the test's: starting two processes and
    # training to step 2 took anything from 10 to 60 s on a loaded 2-core machine.)
    waited = re.search(rf"is stuck: rank 0 waited (\d+) s \(stuck_timeout={STUCK_S} s\)", err)
    assert waited, err[-4000:]
    assert STUCK_S <= int(waited.group(1)) <= STUCK_S + 10, waited.group(0)
    pid = re.search(
        r"lightning_gaudi_fsdp: rank 1 of 2 \(node [^,]+, pid (\d+)\) is stuck: rank 0 waited \d+ s "
        rf"\(stuck_timeout={STUCK_S} s\) in \w+ \(called from \w+, torch/distributed/",
        err,
    )
    assert pid, err[-4000:]
    assert err.count("is stuck: rank 0 waited") == 1  # the stack is printed once
    stuck_frame = "in _maybe_fail" if door == "trainer" else "in main"  # the sleeping line, from faulthandler
    assert stuck_frame in err[err.index("is stuck: rank 0 waited") :], err[-4000:]
    assert re.search(
        r"lightning_gaudi_fsdp: rank 0 of 2 \(node [^,]+, pid \d+\) waited \d+ s in \w+ \(called from \w+, "
        rf"torch/distributed/[^)]*\), more than stuck_timeout={STUCK_S} s, for rank 1 \(node [^,]+, pid "
        rf"{pid.group(1)}\), which still runs but never reached it \(stuck\)",
        err,
    ), err[-4000:]
