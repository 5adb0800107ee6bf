"""Fixtures: run a multi-process scenario script in a subprocess with a hard timeout, and read what it wrote."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCENARIOS = Path(__file__).parent / "scenarios"
DEFAULT_TIMEOUT = 180


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # Each scenario gets its own port range from Lightning's launcher; keep stray variables of an outer run out.
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        env.pop(name, None)
    return env


class ScenarioResult:
    def __init__(self, out: Path, proc: subprocess.CompletedProcess[str]) -> None:
        self.out = out
        self.proc = proc

    def rank(self, r: int) -> dict[str, Any]:
        return json.loads((self.out / f"rank{r}.json").read_text())

    def final(self) -> dict[str, Any]:
        import torch

        return torch.load(self.out / "final.pt", weights_only=False)


def run_command(
    cmd: list[str], cwd: Path, timeout: float = DEFAULT_TIMEOUT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own process group; on timeout kill the whole group (every rank) and fail the test."""
    return run_commands([cmd], cwd, timeout, env)[0]


def run_commands(
    cmds: list[list[str]], cwd: Path, timeout: float = DEFAULT_TIMEOUT, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``cmds`` concurrently (e.g. one launcher per simulated node), each in its own process group. If any is
    still running after ``timeout`` seconds, every group is killed and the test fails."""
    from concurrent.futures import ThreadPoolExecutor

    procs = [
        subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env or _env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # the ranks a launcher starts share its process group: one kill takes all
        )
        for cmd in cmds
    ]
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            futures = [pool.submit(proc.communicate, timeout=timeout) for proc in procs]
            outputs = []
            for cmd, proc, future in zip(cmds, procs, futures, strict=True):
                try:
                    outputs.append(future.result())
                except subprocess.TimeoutExpired:
                    for other in procs:
                        _kill_leftovers(other.pid)
                    stdout, stderr = proc.communicate()
                    pytest.fail(f"{cmd} hung for more than {timeout}s:\n{_tail(stdout)}\n{_tail(stderr)}")
    finally:
        for proc in procs:
            _kill_leftovers(proc.pid)
    return [
        subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        for cmd, proc, (stdout, stderr) in zip(cmds, procs, outputs, strict=True)
    ]


def run_script(
    script: str, cfg: dict[str, Any], tmp_path: Path, timeout: float = DEFAULT_TIMEOUT, expect_ok: bool = True
) -> ScenarioResult:
    out = Path(cfg.setdefault("out", str(tmp_path / "out")))
    out.mkdir(parents=True, exist_ok=True)
    cfg_file = out / "config.json"
    cfg_file.write_text(json.dumps(cfg))
    result = run_command([sys.executable, str(SCENARIOS / script), str(cfg_file)], SCENARIOS, timeout)
    if expect_ok and result.returncode != 0:
        pytest.fail(
            f"scenario {script} failed with exit code {result.returncode}:\n{_tail(result.stdout)}\n"
            f"{_tail(result.stderr)}"
        )
    return ScenarioResult(out, result)


def _tail(text: str | None, n: int = 4000) -> str:
    return (text or "")[-n:]


def _kill_leftovers(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@pytest.fixture
def scenario(tmp_path: Path):
    """``scenario(cfg)`` runs ``scenarios/train.py`` (or ``script=``) with ``cfg`` and returns its results."""

    def run(cfg: dict[str, Any], script: str = "train.py", **kwargs: Any) -> ScenarioResult:
        sub = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        sub.mkdir()
        cfg = dict(cfg)
        cfg.setdefault("out", str(sub / "out"))
        return run_script(script, cfg, sub, **kwargs)

    return run


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """``small_tmpfs("8m")`` mounts a tmpfs of that size under ``tmp_path`` (unmounted afterwards): a disk that fills
    up for real. Skips where mounting is not permitted (it needs root or CAP_SYS_ADMIN)."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        try:
            proc = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
            )
        except FileNotFoundError:
            pytest.skip("no mount command here to make a small tmpfs")
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "--lazy", str(where)], capture_output=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``hpu`` need a real Gaudi; elsewhere they skip with one line saying so."""
    from lightning_gaudi_fsdp import gaudi

    if gaudi.is_available():
        return
    skip = pytest.mark.skip(reason="no Intel Gaudi device here (habana_frameworks not importable or no HPU visible)")
    for item in items:
        if "hpu" in item.keywords:
            item.add_marker(skip)
