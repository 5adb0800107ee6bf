"""A rank SIGKILLed at any moment, under every launcher: every other process of the job is gone within the bound.

The matrix is launcher x phase x victim. Launchers: Lightning's own (``python train.py``, rank 0 starts rank 1),
torchrun on one node, torchrun as two "nodes" on loopback (one agent each), and a SLURM-style job whose two tasks this
test starts itself with the variables ``srun`` sets. Phases: see ``train.KillAt``. Every process of a job carries a
marker in its environment, so the test finds each one by process id wherever it ended up (torchrun starts its workers
in sessions of their own; a rank whose parent died is re-parented), including any left behind.

Each run checks: the victim died where asked; every other process of the job was gone within ``ALLOWED_S`` of the
kill; every process this test started (the launchers, the srun-style tasks) exited non-zero; no process of the job
was left; where a survivor lived long enough to print, the output names the lost rank, or the rank that waited for it.
The default run has the cheapest cases that exercise each mechanism; ``pytest -m slow`` runs the whole matrix.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import SCENARIOS, _env
from helpers import BLOCK, free_port

BOUND_S = 15  # the strategy's failure_timeout in these runs
STARTUP_S = 25  # a survivor still importing torch when the victim died starts its own bounded wait that much later
ALLOWED_S = BOUND_S + STARTUP_S  # from the kill to the last process of the job gone; the default bound (60) is above
MARK = "LIGHTNING_GAUDI_FSDP_TEST_JOB"
LAUNCHERS = ("lightning", "torchrun", "torchrun_2nodes", "slurm")
PHASES = ("start", "rendezvous", "setup", "training", "validation", "save", "teardown")
DEFAULT_RUN = {("slurm", "rendezvous", 0)}  # the new bounded wait; the other launchers have default-run tests elsewhere


@dataclass
class Job:
    codes: list[int]  # of the processes the test started, in order
    output: str  # every process's stdout and stderr
    killed: dict | None  # what the victim wrote just before its SIGKILL
    gone_at: float | None  # monotonic time when the last process of the job was gone
    leftovers: list[str]  # processes of the job still running at the deadline (killed by the test afterwards)

    @property
    def gone_after_kill(self) -> float:
        assert self.killed is not None, f"the victim never reached its phase:\n{self.output[-4000:]}"
        assert self.gone_at is not None
        return self.gone_at - self.killed["at"]


def job_pids(token: str) -> dict[int, str]:
    """Running processes (zombies excluded: their environment reads empty) whose environment has ``MARK=token``."""
    needle = f"{MARK}={token}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            continue
    return found


def _commands(launcher: str, cfg_file: Path, port: int) -> list[tuple[list[str], dict[str, str]]]:
    """The processes a user (or srun) starts for ``launcher``: (command, extra environment) each."""
    script = [str(SCENARIOS / "train.py"), str(cfg_file)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    if launcher == "lightning":
        return [([sys.executable, *script], {})]
    if launcher == "torchrun":
        return [([*torchrun, "--nnodes", "1", "--nproc_per_node", "2", *script], {})]
    if launcher == "torchrun_2nodes":
        return [
            ([*torchrun, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node), *script], {})
            for node in (0, 1)
        ]
    slurm = {
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "4242",
        "SLURM_NODELIST": "127.0.0.1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    return [
        ([sys.executable, *script], {**slurm, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task)}) for task in (0, 1)
    ]


def run_job(launcher: str, cfg: dict, tmp_path: Path, timeout: float = 240, under_shell: bool = False) -> Job:
    """Start the job's processes (each in a session of its own, as a user's shell or srun would), wait until every
    process carrying this job's marker is gone, or ``timeout``; then kill whatever is left (and report it).
    ``under_shell``: start each command from ``sh -c 'cmd &'``, a parent that exits at once (the job then runs under
    whoever adopts it), and wait for the job by its marker alone."""
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"out": str(out), **cfg}
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(cfg))
    token = uuid.uuid4().hex
    logs, procs = [], []
    started = time.monotonic()
    for i, (cmd, extra) in enumerate(_commands(launcher, cfg_file, free_port())):
        env = {**_env(), MARK: token, **extra}
        log = tmp_path / f"process{i}.log"
        logs.append(log)
        with open(log, "w") as sink:
            if under_shell:
                quoted = " ".join(f"'{part}'" for part in cmd)
                cmd = ["sh", "-c", f"{quoted} >'{log}' 2>&1 </dev/null &"]
            procs.append(
                subprocess.Popen(
                    cmd, cwd=SCENARIOS, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    gone_at, leftovers = None, {}
    while True:
        running = [p for p in procs if p.poll() is None]
        marked = job_pids(token)
        if not running and not marked:
            gone_at = time.monotonic()
            break
        if time.monotonic() - started > timeout:
            leftovers = marked
            for pid in marked:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            for p in procs:
                p.kill()
                p.wait()
            break
        time.sleep(0.2)
    killed_file = out / "killed.json"
    return Job(
        codes=[p.returncode for p in procs],
        output="\n".join(f"--- {log.name}:\n{log.read_text(errors='replace')}" for log in logs),
        killed=json.loads(killed_file.read_text()) if killed_file.exists() else None,
        gone_at=gone_at,
        leftovers=[f"{pid}: {cmd}" for pid, cmd in leftovers.items()],
    )


def matrix_cfg(launcher: str, phase: str, victim: int, tmp_path: Path) -> dict:
    strategy = {"auto_wrap_policy": [BLOCK], "failure_timeout": BOUND_S, "timeout": 120}
    cfg: dict = {
        "strategy": strategy,
        "module": {"n_samples": 64},
        "max_steps": 6,
        "kill_at": {"phase": phase, "rank": victim},
    }
    if launcher == "torchrun_2nodes":
        cfg.update(devices=1, trainer={"num_nodes": 2})
    if phase == "validation":
        cfg["trainer"] = {**cfg.get("trainer", {}), "limit_val_batches": 2, "val_check_interval": 2}
    if phase == "save":
        strategy["state_dict_type"] = "sharded"
        cfg.update(save_at_step=2, save_path_in_loop=str(tmp_path / "ckpt"))
    return cfg


# What names the lost rank (or the rank left waiting for it) in a survivor's output, by who prints it.
def naming_patterns(victim: int) -> list[str]:
    survivor = 1 - victim
    return [
        rf"lightning_gaudi_fsdp: rank {victim} of 2 stopped without reporting an error",
        rf"lightning_gaudi_fsdp: rank {survivor} could not reach the rendezvous store",
        rf"lightning_gaudi_fsdp: rank {survivor} of 2 \(node [^)]*\) was in the rendezvous at [\d.]+:\d+; waited "
        rf"{BOUND_S} s \(failure_timeout\)",
        r"lightning_gaudi_fsdp: rank 0 of 2 \(node [^)]*\) was in the rendezvous at [\d.]+:\d+; rank "
        rf"{victim} \(pid \d+\), which it started, ended before joining",
        rf"lightning_gaudi_fsdp: rank {survivor} of 2 \(node [^)]*\) lost the rendezvous store",
        rf"lightning_gaudi_fsdp: the process that launched this rank \(pid \d+, global rank {victim}\) is gone",
        rf"\[rank: {victim}\] Child process with PID \d+ terminated with code -9",  # Lightning's launcher
        rf"rank\s*: {victim} \(local_rank: \d+\)\s+exitcode\s*: -9",  # torchrun's summary
    ]


def _cases() -> list:
    cases = []
    for launcher in LAUNCHERS:
        for phase in PHASES:
            for victim in (0, 1):
                marks = () if (launcher, phase, victim) in DEFAULT_RUN else (pytest.mark.slow,)
                cases.append(pytest.param(launcher, phase, victim, marks=marks, id=f"{launcher}-{phase}-rank{victim}"))
    return cases


@pytest.mark.parametrize(("launcher", "phase", "victim"), _cases())
def test_a_rank_killed_at_any_moment_takes_the_whole_job_down_within_the_bound(tmp_path, launcher, phase, victim):
    job = run_job(launcher, matrix_cfg(launcher, phase, victim, tmp_path), tmp_path)
    assert not job.leftovers, f"left behind: {job.leftovers}\n{job.output[-6000:]}"
    assert job.killed is not None, f"rank {victim} never reached {phase}:\n{job.output[-6000:]}"
    assert job.killed["rank"] == victim
    assert job.gone_after_kill < ALLOWED_S, f"the job took {job.gone_after_kill:.0f}s:\n{job.output[-6000:]}"
    assert all(code != 0 for code in job.codes), f"exit codes {job.codes}:\n{job.output[-6000:]}"
    # Under Lightning's launcher a dead rank 0 takes rank 1 with it at once (PR_SET_PDEATHSIG): nobody is left to
    # print. Everywhere else a survivor lives long enough to say which rank was lost or what it waited for; after
    # the Trainer's teardown it fails in the script's own next collective (the final gather of the weights), and
    # the exception that ends the script is reported from sys.excepthook.
    if not (launcher == "lightning" and victim == 0):
        patterns = naming_patterns(victim)
        assert any(re.search(p, job.output) for p in patterns), job.output[-6000:]


@pytest.mark.parametrize(
    "launcher",
    ["lightning", pytest.param("torchrun", marks=pytest.mark.slow), pytest.param("slurm", marks=pytest.mark.slow)],
)
def test_a_job_whose_parent_shell_exits_keeps_running_and_finishes(tmp_path, launcher):
    """No wrongful kill: the shell (or scheduler step) that started the job exits at once; no rank treats that as
    its launcher dying. Every rank trains to the end and writes its results."""
    cfg = {"strategy": {"auto_wrap_policy": [BLOCK], "failure_timeout": BOUND_S}, "module": {"n_samples": 64}}
    cfg["max_steps"] = 3
    job = run_job(launcher, cfg, tmp_path, timeout=180, under_shell=True)
    assert not job.leftovers, job.output[-6000:]
    assert job.codes == [0] * len(job.codes)  # the shells
    for rank in (0, 1):
        info = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        assert info["global_step"] == 3, job.output[-6000:]
    assert (tmp_path / "out" / "final.pt").exists(), job.output[-6000:]
    assert "lightning_gaudi_fsdp:" not in job.output, job.output[-6000:]
