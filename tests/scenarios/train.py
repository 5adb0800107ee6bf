"""Train (and optionally resume/save) one configuration; every rank writes what it observed as JSON.

Usage: python train.py CONFIG.json   (Lightning's launcher re-runs this same command for the other ranks)
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import (
    QUIET_TRAINER,
    Block,
    Module,
    ShardedLoads,
    StreamedSaves,
    a_late_collective,
    dump_replicated,
    load_config,
    record_what_outlives,
    status_bytes,
    write_json,
)
from lightning.pytorch.callbacks import Callback

from lightning_gaudi_fsdp import GaudiFSDPStrategy
from lightning_gaudi_fsdp.checkpoint import formats, loading
from lightning_gaudi_fsdp.engine import fsdp1_io, fsdp2
from lightning_gaudi_fsdp.engine.base import of as engine_of


def fsdp_units(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [(n, m) for n, m in model.named_modules() if isinstance(m, FSDP)]


class Probe(Callback):
    def __init__(self, out: Path, cfg: dict[str, Any]) -> None:
        self.out, self.cfg, self.info, self.losses = out, cfg, {}, []
        self.trained: list[tuple[int, list[int]]] = []  # each step this rank trained: (global step, sample indices)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # runs before configure_model and FSDP wrapping: reset the peak-RSS counter to measure what setup adds
        Path("/proc/self/clear_refs").write_text("5")
        self.rss_before_setup = status_bytes("VmRSS")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.info["setup_peak_added_bytes"] = status_bytes("VmHWM") - self.rss_before_setup
        model = trainer.strategy.model
        if fsdp2.is_fsdp2(model):
            self.info["model_bytes"] = 4 * sum(p.numel() for p in model.parameters())
        else:
            self.info["model_bytes"] = 4 * sum(
                u._handle.flat_param._unpadded_unsharded_size.numel()
                for u in [m for _, m in fsdp_units(model)]
                if u._handle is not None
            )
        if not fsdp_units(model) and not fsdp2.is_fsdp2(model):
            return
        full = engine_of(model).model_state_dict(model, "full", trainer.strategy.root_device.type)
        if trainer.global_rank == 0:
            values = torch.cat([v.reshape(-1) for k, v in full.items() if "weight" in k or "bias" in k])
            self.info["initial_unique_values"] = [round(v, 6) for v in values.round(decimals=6).unique()[:10].tolist()]
        fc = pl_module.net.blocks[0].fc

        def hook(mod: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
            self.info["fc_forward"] = {
                "input": str(args[0].dtype),
                "weight": str(mod.weight.dtype),
                "output": str(output.dtype),
            }

        fc.register_forward_hook(hook)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.cfg.get("start_state"):
            return
        # what a resume restored: weights, optimizer and schedulers before the first step
        model, device_type, rank = trainer.strategy.model, trainer.strategy.root_device.type, trainer.global_rank
        state = engine_of(model).model_state_dict(model, "full", device_type)
        optim = engine_of(model).optimizer_state_dict(model, trainer.optimizers[0], "full", device_type, rank)
        if rank == 0:
            torch.save(
                {
                    "weights": {k.removeprefix("net."): v for k, v in state.items()},
                    "optimizer": optim,
                    "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
                },
                self.out / "start.pt",
            )

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.info.setdefault("first_step", trainer.global_step + 1)  # the first step this run trains

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *a: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        self.trained.append((trainer.global_step, a[0][2].tolist()))
        _NOW["step"] = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        _NOW["ended"] = True  # no later step comes: a write waiting for one goes on

        model = trainer.strategy.model
        units = fsdp_units(model)
        info = self.info
        info["rank"] = trainer.global_rank
        info["world_size"] = trainer.world_size
        info["losses"] = self.losses
        info["trained"] = self.trained
        info["global_step"] = trainer.global_step
        info["seen_dtypes"] = pl_module.seen_dtypes
        info["configure_optimizers_calls"] = getattr(pl_module, "configure_optimizers_calls", None)
        info["gc_enabled"] = gc.isenabled()  # a restore pauses the automatic collector only while it runs
        info["checkpoint_wrappers"] = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
        info["compiled_modules"] = sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
        info["precision_plugin"] = type(trainer.strategy.precision_plugin).__name__
        info["backend"] = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        info["units"] = []
        if fsdp2.is_fsdp2(model):
            info["engine"] = 2
            info["units"] = _fsdp2_units(model)
            info["ignored_params"] = sorted(
                n for n, p in pl_module.named_parameters() if not isinstance(p, torch.distributed.tensor.DTensor)
            )
        for name, unit in units:
            entry = {
                "name": name,
                "sharding_strategy": unit.sharding_strategy.name,
                "forward_prefetch": unit.forward_prefetch,
                "limit_all_gathers": unit.limit_all_gathers,
                "backward_prefetch": None if unit.backward_prefetch is None else unit.backward_prefetch.name,
                "use_orig_params": unit._use_orig_params,
                "compute_device": str(unit.compute_device),
                "cpu_offload": unit.cpu_offload.offload_params,
                "mixed_precision": str(unit.mixed_precision),
            }
            if unit._handle is not None:
                flat = unit._handle.flat_param
                entry["local_numel"] = flat.numel()
                entry["unsharded_numel"] = flat._unpadded_unsharded_size.numel()
                entry["fqns"] = list(flat._fqns)
            info["units"].append(entry)
        if units:
            root = units[0][1]
            info["ignored_params"] = sorted(
                n for n, p in pl_module.named_parameters() if p in getattr(root, "_ignored_params", set())
            )
        dump_replicated(self.out, trainer.global_rank, model)
        if "dynamo" in self.cfg.get("probes", []):
            from torch._dynamo.utils import counters

            info["dynamo_frames_ok"] = int(counters["frames"]["ok"])
        write_json(self.out, f"rank{trainer.global_rank}.json", info)


def _fsdp2_units(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Each fully_shard unit: its name, the parameter elements it owns and this rank's share of them."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    def local(p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if isinstance(p, DTensor) else p  # ignored parameters stay plain tensors

    owned: set[int] = set()
    units = []
    for name, module in reversed([(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]):
        params = [p for p in module.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        state = module._get_fsdp_state()
        group = state._fsdp_param_group
        units.append(
            {
                "name": name,
                "unsharded_numel": sum(p.numel() for p in params),
                "local_numel": sum(local(p).numel() for p in params),
                "shard_dim0": {
                    n: list(local(p).shape) for n, p in module.named_parameters() if id(p) in {id(q) for q in params}
                },
                "reshard_after_forward": None if group is None else bool(group.post_forward_mesh_info),
                "mesh": list(group.mesh_info.mesh.shape) if group is not None else None,
            }
        )
    return list(reversed(units))


class SeesCheckpoint(Callback):
    """An ``on_save_checkpoint`` hook: the checkpoint it sees (rank 0: the sum of every weight) goes to
    ``hook_saw.json``; with it, full checkpoints are gathered before the hook, not streamed."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if trainer.global_rank == 0:
            total = sum(float(v.double().sum()) for v in checkpoint["state_dict"].values())
            write_json(self.out, "hook_saw.json", {"weights_sum": total})


class FailedBuildThenDirectSave(Callback):
    """At ``step``: a ``trainer.save_checkpoint`` whose build fails after the model's state was built (this
    callback's ``state_dict`` raises), then ``strategy.save_checkpoint`` of a checkpoint made by hand, to ``path``.
    What the failed save raised goes to ``direct<rank>.json``."""

    def __init__(self, step: int, path: str, out: Path) -> None:
        self.step, self.path, self.out = step, path, out
        self.failing = False

    def state_dict(self) -> dict[str, Any]:
        if self.failing:
            raise RuntimeError("this callback's state_dict failed on purpose")
        return {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        self.failing, error = True, None
        try:
            trainer.save_checkpoint(self.path + ".failed")
        except RuntimeError as err:
            error = str(err)
        finally:
            self.failing = False
        trainer.strategy.save_checkpoint({"note": "made by hand", "step": self.step}, self.path)
        write_json(self.out, f"direct{trainer.global_rank}.json", {"error": error})


class SaveAtStep(Callback):
    """Save where ModelCheckpoint would: inside the loop, after the optimizer step of ``step``. ``paths``: a path per
    step (``{"2": ...}``) instead of ``path``; ``catch``: steps whose save records a ``CheckpointSaveError`` instead of
    raising it. Each save's blocked seconds (and error, and whether rank 0 wrote it streamed) go to
    ``saves<rank>.json``. ``write_after``: right after each save returns, write the first parameter in place
    (unchanged values), as a hook running before the optimizer step might."""

    def __init__(
        self,
        step: int | list[int],
        path: str,
        out: Path,
        paths: dict[str, str] | None = None,
        catch: list[int] = (),
        write_after: bool = False,
    ) -> None:
        self.steps, self.path = [step] if isinstance(step, int) else step, path
        self.out, self.paths, self.catch, self.write_after = out, paths or {}, catch, write_after
        self.records: list[dict[str, Any]] = []
        self.streamed = StreamedSaves()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        from lightning_gaudi_fsdp.checkpoint.storage import CheckpointSaveError

        step = trainer.global_step
        if step not in self.steps:
            return
        record: dict[str, Any] = {"step": step, "error": None}
        streamed_before = self.streamed.count
        started = time.perf_counter()
        try:
            trainer.save_checkpoint(self.paths.get(str(step), self.path))
        except CheckpointSaveError as err:
            if step not in self.catch:
                raise
            record["error"] = str(err)
        record["seconds"] = time.perf_counter() - started
        record["streamed"] = self.streamed.count > streamed_before
        if self.write_after:
            with torch.no_grad():
                next(trainer.lightning_module.parameters()).mul_(1)
        background = getattr(trainer.strategy, "_background", None)
        if background is not None and background.active:  # bytes staged, and of them copied after the save returned
            record["staged_bytes"], record["deferred_bytes"] = background._stager.nbytes, background.deferred_bytes
        self.records.append(record)
        write_json(self.out, f"saves{trainer.global_rank}.json", self.records)


class Soak(Callback):
    """Rotate the checkpoint format before each ModelCheckpoint save and sample RSS, open fds and files on disk."""

    def __init__(self, every: int, dirpath: str, formats_: list[str]) -> None:
        self.every, self.dirpath, self.formats = every, Path(dirpath), formats_
        self.samples: list[dict[str, int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step % self.every == 0:  # ModelCheckpoint saves right after this hook
            trainer.strategy._state_dict_type = self.formats[(step // self.every) % len(self.formats)]

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step and step % self.every == 0:
            entries = [p for p in self.dirpath.iterdir() if not p.name.startswith(".")] if self.dirpath.exists() else []
            self.samples.append(
                {
                    "step": step,
                    "rss": status_bytes("VmRSS"),
                    "fds": len(os.listdir("/proc/self/fd")),
                    "checkpoints": len(entries),
                }
            )


def env_rank() -> int:
    """This process's global rank as its launcher gave it (torchrun and the pool: ``RANK``; srun: ``SLURM_PROCID``;
    Lightning's launcher: ``LOCAL_RANK`` on one node, none in the launching rank 0)."""
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def die(out: Path) -> None:
    """SIGKILL this process, first writing when (``killed.json``: the monotonic clock, shared by every process of the
    machine, from which a test measures how long the others took to leave)."""
    import signal

    write_json(out, "killed.json", {"at": time.monotonic(), "pid": os.getpid(), "rank": env_rank()})
    os.kill(os.getpid(), signal.SIGKILL)


def arm_kill_on_save(rank: int, nth: int, out: Path) -> None:
    """On ``rank``, the ``nth`` checkpoint write writes half its bytes, then the process SIGKILLs itself."""
    import torch.distributed.checkpoint as dcp

    if env_rank() != rank:
        return
    calls = {"n": 0}
    real_save, real_dcp_save = torch.save, dcp.save

    def die_midway(target: Any) -> None:
        path = Path(target) if not isinstance(target, Path) else target
        if path.suffix or not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"\x80" * 1000)  # a real, partial write
        die(out)

    def counting_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        target = getattr(f, "name", f)  # checkpoint files are written through an open file
        if isinstance(target, str | Path) and ".partial" in str(target):
            calls["n"] += 1
            if calls["n"] == nth:
                die_midway(target)
        return real_save(obj, f, *args, **kwargs)

    def counting_dcp_save(state: Any, *args: Any, checkpoint_id: Any = None, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == nth:
            die_midway(Path(checkpoint_id) / "__partial_0.distcp")
        return real_dcp_save(state, *args, checkpoint_id=checkpoint_id, **kwargs)

    def counting_stream_write(stream: Any, obj: Any, file: Any) -> Any:  # a streamed full checkpoint
        if ".partial" in str(file):
            calls["n"] += 1
            if calls["n"] == nth:
                die_midway(file)
        return real_stream_write(stream, obj, file)

    from lightning_gaudi_fsdp.checkpoint.streaming import FullStream

    real_stream_write = FullStream.write
    torch.save = counting_save
    dcp.save = counting_dcp_save
    FullStream.write = counting_stream_write  # type: ignore[method-assign]


def arm_kill_mid_upload(rank: int, nth: int, out: Path) -> None:
    """On ``rank``, the ``nth`` object a save uploads (to a URL, through the storage seam) gets half its bytes sent
    (a multipart upload under way), then the process SIGKILLs itself."""
    from lightning_gaudi_fsdp.checkpoint import files

    if env_rank() != rank:
        return
    calls = {"n": 0}
    real_open_write = files.open_write

    class HalfThenDie:
        def __init__(self, handle: Any) -> None:
            self.handle = handle

        def write(self, data: Any) -> int:
            view = memoryview(data).cast("B")
            self.handle.write(view[: max(len(view) // 2, 1)])
            self.handle.flush()
            die(out)
            return 0

        def __getattr__(self, name: str) -> Any:
            return getattr(self.handle, name)

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.handle.close()

    def counting_open_write(where: Any) -> Any:
        handle = real_open_write(where)
        if files.is_remote(where):
            calls["n"] += 1
            if calls["n"] == nth:
                return HalfThenDie(handle)
        return handle

    files.open_write = counting_open_write


# the last finished training step, and whether training ended, for probes that run in the background
_NOW: dict[str, Any] = {"step": 0, "ended": False}


def arm_slow_copies(seconds: float) -> None:
    """An asynchronous save's background copies (of what only the optimizer step writes) start ``seconds`` late."""
    from lightning_gaudi_fsdp.checkpoint import staging

    run = staging.DeferredCopies.run

    def slowed(self: Any) -> None:
        time.sleep(seconds)
        run(self)

    staging.DeferredCopies.run = slowed  # type: ignore[method-assign]


def arm_write_probes(out: Path, slow_writes: float, later_step_s: float, record_events: bool) -> None:
    """``slow_writes``: each checkpoint write first sleeps that many seconds; ``later_step_s``: it first waits until
    training finished a step after the one reached when the write began, or ended (at most that many seconds).
    Either way it records the step reached (``writes<rank>.json``). ``record_events``:
    every checkpoint commit and removal, in order (``events<rank>.json``)."""
    import lightning.fabric.plugins.io.torch_io as torch_io

    from lightning_gaudi_fsdp import _compat
    from lightning_gaudi_fsdp.checkpoint import commit

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    writes: list[int] = []
    events: list[list[Any]] = []

    def slowed(real: Any) -> Any:
        def write(*args: Any, **kwargs: Any) -> Any:
            time.sleep(slow_writes)
            step, deadline = _NOW["step"], time.monotonic() + later_step_s
            while _NOW["step"] <= step and not _NOW["ended"] and time.monotonic() < deadline:
                time.sleep(0.01)
            writes.append(_NOW["step"])
            write_json(out, f"writes{rank}.json", writes)
            return real(*args, **kwargs)

        return write

    def recorded(kind: str, real: Any, arg: int) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            events.append([kind, Path(args[arg]).name, _NOW["step"]])
            write_json(out, f"events{rank}.json", events)
            return result

        return call

    if slow_writes or later_step_s:
        from lightning_gaudi_fsdp.checkpoint.streaming import FullStream

        formats.save_file = slowed(formats.save_file)
        _compat.dcp_save = slowed(_compat.dcp_save)
        FullStream.write = slowed(FullStream.write)  # type: ignore[method-assign]
    if record_events:
        commit.commit = recorded("commit", commit.commit, 1)
        io = torch_io.TorchCheckpointIO
        io.remove_checkpoint = recorded("remove", io.remove_checkpoint, 1)  # type: ignore[method-assign]


def lightning_stock_strategy(strategy_cfg: dict[str, Any]) -> Any:
    """Lightning's own ``FSDPStrategy``, changed only where it cannot run on CPU with torch 2.13: FSDP is handed a
    CPU device where Lightning passes ``root_device.index`` (None on CPU), full state dicts skip the
    ``offload_to_cpu`` copy that segfaults on torch 2.13 (the shards already live on CPU), and a trivial subclass
    gets past the Trainer's "FSDP needs CUDA" check (an exact-type test). Its checkpoint formats and save/load code
    are Lightning's, untouched."""
    import lightning.pytorch.strategies.fsdp as lightning_fsdp
    import torch.distributed.fsdp as torch_fsdp
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUDeviceFSDP(torch_fsdp.FullyShardedDataParallel):
        def __init__(self, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, device_id=torch.device("cpu") if device_id is None else device_id, **kwargs)

    torch_fsdp.FullyShardedDataParallel = CPUDeviceFSDP  # Lightning imports it inside _setup_model

    def no_offload_full_context(module: Any, world_size: int, rank0_only: bool = True) -> Any:
        return fsdp1_io.state_dict_context(module, "full", "cpu", rank0_only=rank0_only)  # offload_to_cpu=False

    lightning_fsdp._get_full_state_dict_context = no_offload_full_context
    kwargs = dict(strategy_cfg)
    kwargs["auto_wrap_policy"] = {Block}

    class StockFSDPStrategy(FSDPStrategy):
        pass

    return StockFSDPStrategy(**kwargs)


def kill_launcher_after_spawn(out: Path) -> None:
    """Rank 0 (Lightning's launcher) SIGKILLs itself right after starting the other ranks: they are still importing
    torch or entering the rendezvous, whose store would have lived in rank 0."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    real = _SubprocessScriptLauncher._call_children_scripts

    def spawn_then_die(self: Any) -> None:
        real(self)
        die(out)

    _SubprocessScriptLauncher._call_children_scripts = spawn_then_die


PHASES = ("start", "rendezvous", "setup", "training", "validation", "save", "teardown")


class KillAt(Callback):
    """``kill_at: {"phase", "rank"}``: global rank ``rank`` SIGKILLs itself in ``phase`` (one of ``PHASES``):
    ``start`` (before the Trainer exists; in Lightning's launching rank 0, right after it started the others),
    ``rendezvous`` (inside ``init_process_group``, one second in; the other ranks enter it only once the victim is
    dead, so the victim dies waiting for them), ``setup`` (the ``setup`` hook: after the rendezvous, before the
    model is built and wrapped), ``training`` (before step 2), ``validation`` (before the first validation batch;
    the config must enable validation), ``save`` (midway through its first checkpoint write: ``save_at_step``,
    ``sharded``) and ``teardown`` (as the strategy's ``teardown`` begins, after the last training step)."""

    def __init__(self, phase: str, rank: int, out: Path) -> None:
        if phase not in PHASES:
            raise ValueError(f"kill_at phase={phase!r}; expected one of {PHASES}")
        self.phase, self.rank, self.out = phase, rank, out
        victim = env_rank() == rank
        if phase == "start" and victim:
            launching = not any(name in os.environ for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"))
            if launching:  # Lightning's launcher: die once the others exist
                kill_launcher_after_spawn(out)
            else:
                die(out)
        elif phase == "rendezvous":
            self._arm_rendezvous(victim)
        elif phase == "save":
            arm_kill_on_save(rank, 1, out)
        elif phase == "teardown" and victim:
            real = GaudiFSDPStrategy.teardown

            def teardown(strategy: Any) -> None:
                die(out)
                real(strategy)

            GaudiFSDPStrategy.teardown = teardown  # type: ignore[method-assign]

    def _arm_rendezvous(self, victim: bool) -> None:
        import threading

        import torch.distributed

        real = torch.distributed.init_process_group
        out = self.out

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            if victim:
                threading.Timer(1.0, die, (out,)).start()
            else:
                deadline = time.monotonic() + 60
                while not (out / "killed.json").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            return real(*args, **kwargs)

        torch.distributed.init_process_group = init_process_group

    def _here(self, trainer: L.Trainer, phase: str) -> None:
        if self.phase == phase and trainer.global_rank == self.rank:
            die(self.out)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._here(trainer, "setup")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if i == 2:
            self._here(trainer, "training")

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._here(trainer, "validation")


class SignalAt(Callback):
    """``sigterm: {"step", "to", "delay", "slow_disk"}``: ``delay`` seconds after training step ``step`` ended (so
    during a later step), a real SIGTERM from a timer thread: ``to="rank1"`` (that rank to itself), ``"all"`` (each rank
    to itself), ``"launcher"`` (rank 0 to the process that launched the job: itself under Lightning's launcher,
    torchrun's agent under torchrun). The monotonic time of each signal goes to ``signalled<rank>.json``.
    ``slow_disk``: from then on every checkpoint write first sleeps that many seconds. ``phase``: instead of after a
    step, in the ``setup`` hook, at the first validation batch (``validation``) or at ``on_train_end``
    (``teardown``)."""

    def __init__(
        self, out: Path, step: int = 0, to: str = "rank1", delay: float = 0.0, slow_disk: float = 0.0, phase: str = ""
    ) -> None:
        self.step, self.to, self.out, self.delay, self.slow_disk, self.phase = step, to, out, delay, slow_disk, phase

    def _send(self, trainer: L.Trainer, phase: str) -> None:
        if phase == self.phase:
            self.phase = "sent"
            sigterm_later(self.to, trainer.global_rank, self.out, self.delay, self.slow_disk)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self._send(trainer, "")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._send(trainer, "setup")

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._send(trainer, "validation")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._send(trainer, "teardown")


def sigterm_later(to: str, rank: int, out: Path, delay: float, slow_disk: float = 0.0) -> None:
    """See :class:`SignalAt`; called on every rank."""
    import signal
    import threading

    if to == "all" or (to == "rank1" and rank == 1):
        target = os.getpid()
    elif to == "launcher" and rank == 0:
        target = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
    else:
        return
    if slow_disk:
        arm_slow_disk(slow_disk)

    def send() -> None:
        write_json(out, f"signalled{rank}.json", {"at": time.monotonic(), "pid": target})
        os.kill(target, signal.SIGTERM)

    if delay:
        threading.Timer(delay, send).start()
    else:
        send()


def arm_slow_disk(seconds: float) -> None:
    """Every checkpoint write from now on first sleeps ``seconds`` (a disk too slow for the grace period)."""
    from lightning_gaudi_fsdp import _compat
    from lightning_gaudi_fsdp.checkpoint.streaming import FullStream

    def slowed(real: Any) -> Any:
        def write(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return real(*args, **kwargs)

        return write

    formats.save_file = slowed(formats.save_file)
    _compat.dcp_save = slowed(_compat.dcp_save)
    FullStream.write = slowed(FullStream.write)  # type: ignore[method-assign]


def count_sigterms(out: Path, rank: int, chain: bool = False) -> None:
    """Install a user's SIGTERM handler that counts its calls in ``handler<rank>.json`` (``chain``: and then calls the
    handler it replaced, as a well-behaved one does)."""
    import signal

    calls, previous = [], signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        calls.append(time.monotonic())
        write_json(out, f"handler{rank}.json", len(calls))
        if chain and callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, handler)


class UserHandlerAtTrainStart(Callback):
    """``user_handler: "after"``: the user's handler, installed in ``on_train_start`` (after the strategy's), that
    does not chain the strategy's."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        count_sigterms(self.out, trainer.global_rank)


def main() -> None:
    cfg = load_config()
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    if cfg.get("user_handler") == "before":  # installed before the strategy's: chained by it
        count_sigterms(out, env_rank())
    if cfg.get("exit_normally"):
        record_what_outlives(out)
    if cfg.get("kill_launcher_after_spawn"):
        kill_launcher_after_spawn(out)
    if cfg.get("kill_on_save"):
        arm_kill_on_save(**cfg["kill_on_save"], out=out)
    if cfg.get("kill_mid_upload"):
        arm_kill_mid_upload(**cfg["kill_mid_upload"], out=out)
    kill_at = KillAt(**cfg["kill_at"], out=out) if cfg.get("kill_at") else None
    if cfg.get("slow_copies"):
        arm_slow_copies(cfg["slow_copies"])
    if cfg.get("slow_writes") or cfg.get("writes_after_a_later_step") or cfg.get("record_events"):
        arm_write_probes(
            out, cfg.get("slow_writes", 0), cfg.get("writes_after_a_later_step", 0), bool(cfg.get("record_events"))
        )
    if "restore_note_after_s" in cfg:  # the restore line, shown here for a restore of any length
        loading.RESTORE_NOTE_AFTER_S = cfg["restore_note_after_s"]
    L.seed_everything(cfg.get("seed", 7), workers=True)
    module = Module(**cfg.get("module", {}))
    strategy_cfg = cfg.get("strategy", {})
    trainer_kwargs: dict[str, Any] = dict(
        QUIET_TRAINER, accelerator=cfg.get("accelerator", "cpu"), max_steps=cfg.get("max_steps", 4)
    )
    trainer_kwargs.update(cfg.get("trainer", {}))
    if strategy_cfg == "reference":
        trainer_kwargs.update(devices=1, strategy="auto")
    elif cfg.get("lightning_stock"):
        trainer_kwargs.update(devices=cfg.get("devices", 2), strategy=lightning_stock_strategy(strategy_cfg))
    else:
        if cfg.get("strategy_rank1") and int(os.environ.get("LOCAL_RANK", "0")) == 1:
            strategy_cfg = {**strategy_cfg, **cfg["strategy_rank1"]}  # a misconfigured rank
        trainer_kwargs.update(devices=cfg.get("devices", 2), strategy=GaudiFSDPStrategy(**strategy_cfg))
    callbacks: list[Callback] = [Probe(out, cfg)]
    if kill_at is not None:
        callbacks.append(kill_at)
    if cfg.get("user_handler") == "after":
        callbacks.append(UserHandlerAtTrainStart(out))
    if cfg.get("sigterm"):
        callbacks.append(SignalAt(**cfg["sigterm"], out=out))
    if cfg.get("hook_reads_checkpoint"):
        callbacks.append(SeesCheckpoint(out))
    if cfg.get("failed_build_then_direct_save"):
        step, path = cfg["failed_build_then_direct_save"]
        callbacks.append(FailedBuildThenDirectSave(step, path, out))
    if cfg.get("save_at_step"):
        callbacks.append(
            SaveAtStep(
                cfg["save_at_step"],
                cfg.get("save_path_in_loop", ""),
                out,
                cfg.get("save_paths_in_loop"),
                cfg.get("catch_save_errors_at", ()),
                bool(cfg.get("write_params_after_save")),
            )
        )
    soak = None
    if cfg.get("soak"):
        soak = Soak(cfg["soak"]["every"], cfg["soak"]["dirpath"], cfg["soak"]["formats"])
        callbacks.append(soak)
    if cfg.get("model_checkpoint"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(**cfg["model_checkpoint"]))
        trainer_kwargs["enable_checkpointing"] = True
    trainer = L.Trainer(callbacks=callbacks, **trainer_kwargs)
    loads = ShardedLoads()
    with trainer.init_module(empty_init=cfg.get("empty_init", False)) if cfg.get("init_module") else _null():
        pass
    trainer.fit(module, ckpt_path=cfg.get("ckpt_path"))  # returns once the last background save committed
    write_json(out, f"sharded_loads{trainer.global_rank}.json", loads.counts)
    saver = next((c for c in callbacks if isinstance(c, SaveAtStep)), None)
    if saver is not None:  # full checkpoints rank 0 wrote streamed, in all (background saves included)
        write_json(out, f"streamed{trainer.global_rank}.json", saver.streamed.count)
    if soak is not None:
        write_json(out, f"soak{trainer.global_rank}.json", soak.samples)
    if cfg.get("save_path"):
        trainer.save_checkpoint(cfg["save_path"])
    if cfg.get("exit_normally"):  # a plain script: no destroy_process_group, no os._exit
        if cfg.get("late_collective"):
            a_late_collective()
        return
    model = trainer.strategy.model
    opt = trainer.optimizers[0]
    if strategy_cfg == "reference":
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        optim = opt.state_dict()
    else:
        state = engine_of(model).model_state_dict(model, "full", trainer.strategy.root_device.type)
        optim = engine_of(model).optimizer_state_dict(
            model, opt, "full", trainer.strategy.root_device.type, trainer.global_rank
        )
    if trainer.global_rank == 0:
        state = {k.removeprefix("net."): v for k, v in state.items()}
        schedulers = [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]
        torch.save(
            {
                "weights": state,
                "lr": opt.param_groups[0]["lr"],
                "step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "optimizer": optim,
                "schedulers": schedulers,
            },
            out / "final.pt",
        )
    leave()


def leave() -> None:
    """Every result is written: leave without tearing gloo down, which on torch 2.13 CPU sometimes ends in
    ``terminate called without an active exception`` (SIGABRT) at interpreter exit, even after
    destroy_process_group."""
    import sys

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


if __name__ == "__main__":
    main()
