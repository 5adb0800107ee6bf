"""Preemption (``preemption="save"``): a real SIGTERM to one rank, every rank or the launcher, mid-epoch, with
Lightning's defaults (its logger, hence a new ``version_N`` per run, its ``ModelCheckpoint``, the progress bar). Every
process is gone within the grace period, each rank printed one line with the signal, the step and the checkpoint,
the checkpoint (``version_0/checkpoints/last.ckpt``) holds that step, and the same command with
``ckpt_path="last"`` (in ``version_1``) trains from the next step to the end, bitwise equal to the run that never
stopped (a dataloader with ``state_dict``/``load_state_dict`` resumes mid-epoch). Under SLURM the save is Lightning's
requeue checkpoint, which the requeued job restores without any ``ckpt_path``. The user's SIGTERM handlers run once,
whether installed before the strategy's (chained) or after it (respected). A disk too slow for the grace period: the
previous ``last.ckpt`` stays, nothing partial is visible, and every rank leaves in time, saying so. A Fabric loop that
never reads ``preempted`` leaves through its ``finally`` blocks.

The default run has one representative case (FSDP1, sharded, SIGTERM to Lightning's launcher), the handler installed
after the strategy's, the slow disk and both Fabric loops; ``pytest -m slow`` runs the matrix of engines, formats,
targets and launchers, SLURM's requeue and the phases outside a training step.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from distributed import test_resume
from distributed.test_failure_matrix import run_job
from helpers import BLOCK
from lightning_gaudi_fsdp.checkpoint import convert

uninterrupted = test_resume.uninterrupted  # the fixture: 8 steps without stopping, once per configuration
_assert_same_run = test_resume._assert_same_run

GRACE_S = 20  # the preemption_grace of these runs (the default is 25)
SIGNAL_STEP = 1  # the SIGTERM lands during step 2 of 4 of the first epoch: the save point is mid-epoch
EXIT_CODE = 75
LAST = Path("lightning_logs", "version_0", "checkpoints", "last.ckpt")  # the first run's, under default_root_dir


def _module() -> dict:
    return {"n_samples": 32, "batch_size": 4, "stateful_loader": True}  # 4 steps per epoch, as test_resume's


def _strategy(fmt: str, engine: int, grace: float = GRACE_S) -> dict:
    return {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt, "fsdp_version": engine, "preemption_grace": grace}


def _cfg(strategy: dict, root: Path, **extra) -> dict:
    # Lightning's defaults: its logger (version_N per run), its ModelCheckpoint (folder from the logger), progress bar
    trainer = {"logger": True, "enable_checkpointing": True, "enable_progress_bar": True, "default_root_dir": str(root)}
    return {"strategy": strategy, "module": _module(), "max_steps": 8, "trainer": trainer, **extra}


def _signalled_at(out: Path) -> float:
    return min(json.loads(p.read_text())["at"] for p in out.glob("signalled*.json"))


def _saved_lines(output: str) -> dict[int, tuple[str, int, str]]:
    """Each rank's line: rank -> (who received the signal, step, path)."""
    found = re.findall(
        r"lightning_gaudi_fsdp: rank (\d) of 2 preempted by SIGTERM \(received by rank (\d)\): saved step (\d+) to "
        rf"(\S+); leaving with exit code {EXIT_CODE}",
        output,
    )
    return {int(rank): (who, int(step), path) for rank, who, step, path in found}


def _check_preempted(output: str, ckpt: Path, gone_after_s: float, signalled: str) -> int:
    """The checks every preempted run passes; returns the step saved."""
    lines = _saved_lines(output)
    assert sorted(lines) == [0, 1], output[-6000:]
    steps = {step for _, step, _ in lines.values()}
    assert len(steps) == 1, lines  # every rank saved the same step
    (step,) = steps
    assert SIGNAL_STEP < step <= SIGNAL_STEP + 3, lines  # the step in flight completed, and little more
    assert {path for _, _, path in lines.values()} == {str(ckpt)}
    if signalled != "any":
        assert {who for who, _, _ in lines.values()} == {signalled}
    assert gone_after_s < GRACE_S, f"the last process left {gone_after_s:.1f} s after the signal"
    assert convert.describe(ckpt)["global_step"] == step  # the checkpoint holds that step
    assert not [p.name for p in ckpt.parent.iterdir() if p.name.startswith(".")]  # committed, nothing staged left
    return step


def _handled(out: Path) -> dict[int, int]:
    """How many times each rank's user SIGTERM handler ran (``train.count_sigterms``)."""
    return {
        r: json.loads((out / f"handler{r}.json").read_text()) for r in (0, 1) if (out / f"handler{r}.json").exists()
    }


def _straight(uninterrupted, strategy: dict) -> dict:
    # test_resume's uninterrupted run, shared with its module (logger=False there: logging plays no part in weights)
    return uninterrupted(strategy, {k: v for k, v in _module().items() if k != "stateful_loader"})


def _continues(resumed_output: str, first_step: int, final: dict, ckpt: Path, step: int, straight: dict) -> None:
    """The requeued run restored ``ckpt``, trained first the step after the saved one, and ended as the run that
    never stopped, bitwise (a restart from step 0 would end there too: hence the first step)."""
    assert f"Restored all states from the checkpoint at {ckpt}" in resumed_output, resumed_output[-6000:]
    assert first_step == step + 1
    _assert_same_run(final, straight)


CASES = [
    pytest.param("sharded", 1, "launcher", id="sharded-fsdp1-launcher"),
    pytest.param("local", 1, "launcher", marks=pytest.mark.slow, id="local-fsdp1-launcher"),
    pytest.param("sharded", 2, "launcher", marks=pytest.mark.slow, id="sharded-fsdp2-launcher"),
    pytest.param("local", 2, "launcher", marks=pytest.mark.slow, id="local-fsdp2-launcher"),
    pytest.param("sharded", 1, "rank1", marks=pytest.mark.slow, id="sharded-fsdp1-rank1"),
    pytest.param("local", 2, "all", marks=pytest.mark.slow, id="local-fsdp2-all"),
    pytest.param("full", 1, "rank1", marks=pytest.mark.slow, id="full-fsdp1-rank1"),
]


@pytest.mark.parametrize(("fmt", "engine", "to"), CASES)
def test_sigterm_mid_epoch_with_lightnings_defaults_saves_and_the_same_command_with_ckpt_path_last_continues(
    scenario, tmp_path, uninterrupted, fmt, engine, to
):
    """``to="launcher"``: the process a user (or Kubernetes) started, Lightning's launcher, which is rank 0; the
    others under the scenario pool (torchrun-style). The user's SIGTERM handler, installed before the strategy's,
    runs once on each signalled rank. The requeued run logs to ``version_1`` and finds ``version_0``'s save."""
    strategy = _strategy(fmt, engine)
    root = tmp_path / "root"
    launcher = "lightning" if to == "launcher" else "pool"
    signal_cfg = {"step": SIGNAL_STEP, "to": to, "delay": 0.02}
    cfg = _cfg(strategy, root, sigterm=signal_cfg, user_handler="before", out=str(tmp_path / "preempted"))
    run = scenario(cfg, expect_ok=False, launcher=launcher)
    gone = time.monotonic()
    assert run.proc.returncode == EXIT_CODE, run.proc.stderr[-6000:]
    ckpt = root / LAST
    signalled = {"launcher": "0", "rank1": "1", "all": "any"}[to]
    step = _check_preempted(run.proc.stderr, ckpt, gone - _signalled_at(run.out), signalled)
    assert _handled(run.out) == {"launcher": {0: 1}, "rank1": {1: 1}, "all": {0: 1, 1: 1}}[to]
    resumed = scenario(_cfg(strategy, root, ckpt_path="last", out=str(tmp_path / "resumed")), launcher=launcher)
    assert f'fit(ckpt_path="last") resumes from {ckpt}' in resumed.proc.stderr, resumed.proc.stderr[-6000:]
    assert (root / "lightning_logs" / "version_1").is_dir()  # the requeued run logged to a version of its own
    _continues(
        resumed.proc.stderr,
        resumed.rank(0)["first_step"],
        resumed.final(),
        ckpt,
        step,
        _straight(uninterrupted, strategy),
    )


@pytest.mark.slow
def test_under_slurm_the_requeued_job_restores_the_preemption_save_by_itself(tmp_path, uninterrupted):
    """SLURM signals every task; the save is Lightning's requeue checkpoint, ``<default_root_dir>/hpc_ckpt_1.ckpt``,
    and the requeued job (no ``ckpt_path``) restores it itself, as after Lightning's own SLURM requeue."""
    strategy = _strategy("sharded", 1)
    root = tmp_path / "root"
    cfg = _cfg(strategy, root, sigterm={"step": SIGNAL_STEP, "to": "all", "delay": 0.02})
    job = run_job("slurm", cfg, tmp_path / "job")
    assert not job.leftovers, job.output[-6000:]
    assert set(job.codes) == {EXIT_CODE}, job.output[-6000:]
    ckpt = root / "hpc_ckpt_1.ckpt"
    step = _check_preempted(job.output, ckpt, job.gone_at - _signalled_at(tmp_path / "job" / "out"), "any")
    requeued = run_job("slurm", {**cfg, "sigterm": None}, tmp_path / "requeued")
    assert set(requeued.codes) == {0}, requeued.output[-6000:]
    out = tmp_path / "requeued" / "out"
    first_step = json.loads((out / "rank0.json").read_text())["first_step"]
    final = torch.load(out / "final.pt", weights_only=False)
    _continues(requeued.output, first_step, final, ckpt, step, _straight(uninterrupted, strategy))


def test_a_sigterm_handler_installed_after_the_strategys_is_left_in_charge(scenario, tmp_path):
    """A handler installed in ``on_train_start`` (after the strategy's, not chaining it) runs once, and the strategy
    does not act behind its back: no save, no exit; training ends normally."""
    root = tmp_path / "root"
    cfg = _cfg(_strategy("sharded", 1), root, user_handler="after", sigterm={"step": SIGNAL_STEP, "to": "rank1"})
    run = scenario(cfg)
    assert "preempted by" not in run.proc.stderr, run.proc.stderr[-6000:]
    assert _handled(run.out) == {1: 1}
    assert run.rank(0)["global_step"] == 8
    assert not (root / LAST).exists()


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "engine", "to"), [("lightning", 1, "launcher"), ("torchrun", 2, "launcher")])
def test_sigterm_to_the_launcher_process_saves_and_resumes_exactly(
    scenario, tmp_path, uninterrupted, launcher, engine, to
):
    """SIGTERM to the process a user (or Kubernetes) started: Lightning's launcher is rank 0 itself; torchrun's agent
    forwards it to its workers. A ModelCheckpoint with its own ``dirpath`` that keeps no last.ckpt of its own still
    gets one, there (the logger's version plays no part)."""
    strategy = _strategy("sharded", engine)
    root = tmp_path / "root"
    dirpath = tmp_path / "ckpts"
    cfg = _cfg(strategy, root, sigterm={"step": SIGNAL_STEP, "to": to, "delay": 0.02})
    cfg["model_checkpoint"] = {"dirpath": str(dirpath), "save_last": False}
    job = run_job(launcher, cfg, tmp_path / "job")
    assert not job.leftovers, job.output[-6000:]
    assert all(code != 0 for code in job.codes), job.codes
    if launcher != "torchrun":  # Lightning's launcher (rank 0), or each srun task
        assert set(job.codes) == {EXIT_CODE}, job.output[-6000:]
    ckpt = dirpath / "last.ckpt"
    signalled = "0" if launcher == "lightning" else "any"  # torchrun's agent signals every rank
    _check_preempted(job.output, ckpt, job.gone_at - _signalled_at(tmp_path / "job" / "out"), signalled)
    straight = _straight(uninterrupted, strategy)
    resumed = scenario({**cfg, "sigterm": None, "ckpt_path": "last"})
    assert f"Restored all states from the checkpoint at {ckpt}" in resumed.proc.stderr
    _assert_same_run(resumed.final(), straight)


def test_a_disk_too_slow_for_the_grace_period_keeps_the_previous_checkpoint_and_every_rank_leaves_in_time(
    scenario, tmp_path
):
    grace = 4
    dirpath = tmp_path / "ckpts"
    ckpt = dirpath / "last.ckpt"
    cfg = _cfg(
        _strategy("sharded", 1, grace),
        tmp_path / "root",
        model_checkpoint={"dirpath": str(dirpath), "save_top_k": 0},  # saves nothing itself: last.ckpt is its "last"
        save_at_step=2,  # the previous last.ckpt, at step 2
        save_path_in_loop=str(ckpt),
        sigterm={"step": 3, "to": "rank1", "delay": 0.02, "slow_disk": 60},  # from then on each write takes 60 s
    )
    run = scenario(cfg, expect_ok=False)
    gone_after = time.monotonic() - _signalled_at(run.out)
    assert run.proc.returncode == EXIT_CODE, run.proc.stderr[-6000:]
    assert gone_after < grace, f"the last rank left {gone_after:.1f} s after the signal"
    for rank in (0, 1):
        assert re.search(
            rf"lightning_gaudi_fsdp: rank {rank} of 2 preempted by SIGTERM \(received by rank 1\): saving step \d+ to "
            rf"{re.escape(str(ckpt))} did not finish within preemption_grace={grace} s; nothing of it is visible and "
            rf"the previous checkpoint there is intact; leaving with exit code {EXIT_CODE}",
            run.proc.stderr,
        ), run.proc.stderr[-6000:]
    assert convert.describe(ckpt)["global_step"] == 2
    assert sorted(p.name for p in dirpath.iterdir() if not p.name.startswith(".")) == ["last.ckpt"]


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["setup", "validation", "save", "teardown"])
def test_sigterm_outside_a_training_step_ends_every_rank_in_time_losing_nothing(scenario, tmp_path, phase):
    """In setup there is nothing to save: every rank leaves at once. During validation, or during a save already
    running, the next training step is saved. After the last step, every rank leaves from teardown."""
    root = tmp_path / "root"
    delay = 0 if phase == "teardown" else 0.05  # after the last step, at once: fit is about to return
    cfg = _cfg(_strategy("sharded", 1), root, sigterm={"phase": phase, "to": "rank1", "delay": delay})
    if phase == "validation":
        cfg["trainer"].update(limit_val_batches=4, val_check_interval=2)
    if phase == "save":  # ModelCheckpoint saves every second step, each write taking 2 s; the signal comes during one
        cfg.update(slow_writes=2, model_checkpoint={"dirpath": str(root / "checkpoints"), "every_n_train_steps": 2})
        cfg["sigterm"] = {"step": 2, "to": "rank1", "delay": 0.5}
    run = scenario(cfg, expect_ok=False)
    gone_after = time.monotonic() - _signalled_at(run.out)
    assert run.proc.returncode in ((EXIT_CODE, 1) if phase == "teardown" else (EXIT_CODE,)), run.proc.stderr[-6000:]
    assert gone_after < GRACE_S
    ckpt = root / ("checkpoints/last.ckpt" if phase == "save" else LAST)
    if phase in ("validation", "save"):
        step = _check_preempted(run.proc.stderr, ckpt, gone_after, "1")
        # validation follows step 2 (the next step is saved); the save of step 2 runs before its boundary (saved)
        assert step >= (3 if phase == "validation" else 2)
        return
    said = {
        "setup": re.escape(
            "before its first step boundary (training not started, or a Fabric loop that does not read "
            "strategy.preempted); nothing saved"
        ),
        # rank 1 leaves from its own teardown, or learns that rank 0 had already finished fit, or that rank 0 (the
        # store's host) had left: each says so, and that nothing was saved
        "teardown": "[^\n]*nothing saved",
    }[phase]
    # after the last step, rank 0 may have finished fit before the signal came: it then fails at the script's own
    # next collective, with rank 1 gone
    for rank in (0, 1) if phase == "setup" else (1,):
        assert re.search(
            rf"lightning_gaudi_fsdp: rank {rank} of 2 preempted by SIGTERM \(received by rank 1\): {said}; "
            rf"leaving with exit code {EXIT_CODE}",
            run.proc.stderr,
        ), run.proc.stderr[-6000:]
    assert not ckpt.exists()  # setup: nothing trained; teardown: this run's own checkpointing saved no last.ckpt


def test_fabric_loop_saves_when_preempted_reads_true_on_every_rank(scenario, tmp_path):
    """Fabric: the loop reads ``fabric.strategy.preempted`` each step and saves when it is True (the same step on
    every rank); ``fabric.save`` commits and every rank leaves."""
    ckpt = tmp_path / "fabric-last.ckpt"
    cfg = {
        "strategy": _strategy("sharded", 1),
        "epochs": 4,
        "preempt": {"step": SIGNAL_STEP, "to": "rank1", "delay": 0.02, "path": str(ckpt)},
    }
    run = scenario(cfg, script="fabric_loop.py", expect_ok=False)
    gone = time.monotonic()
    assert run.proc.returncode == EXIT_CODE, run.proc.stderr[-6000:]
    _check_preempted(run.proc.stderr, ckpt, gone - _signalled_at(run.out), "1")  # its global_step: that step


def test_a_fabric_loop_that_never_reads_preempted_leaves_through_its_finally_blocks(scenario, tmp_path):
    """The loop ignores ``preempted``: the signalled rank leaves from its SIGTERM handler, the other when told, both
    through Python's exit path (the script's ``finally`` block runs) with exit code 75, in time. The user's handler,
    installed before the strategy's, runs once, on the signalled rank only."""
    cfg = {
        "strategy": _strategy("sharded", 1),
        "epochs": 20,
        "user_handler": "before",
        "preempt": {"step": SIGNAL_STEP, "to": "rank1", "delay": 0.02, "ignore": 2.0},  # each step then pauses 2 s
    }
    run = scenario(cfg, script="fabric_loop.py", expect_ok=False)
    gone_after = time.monotonic() - _signalled_at(run.out)
    assert run.proc.returncode == EXIT_CODE, run.proc.stderr[-6000:]
    assert gone_after < GRACE_S
    assert sorted(p.name for p in run.out.glob("finally*.json")) == ["finally0.json", "finally1.json"]
    assert _handled(run.out) == {1: 1}
    for rank in (0, 1):
        assert re.search(
            rf"lightning_gaudi_fsdp: rank {rank} of 2 preempted by SIGTERM \(received by rank 1\): before its first "
            rf"step boundary .*; nothing saved; leaving with exit code {EXIT_CODE}",
            run.proc.stderr,
        ), run.proc.stderr[-6000:]
