"""One benchmark measurement in its own processes: ``python worker.py MODE CONFIG_JSON``; rank 0 writes the result.

This process imports torch (and Lightning and the package, for the Trainer modes) once, then forks one process per
rank, which finds its rank in the environment as under torchrun, so Lightning starts no processes of its own. That
saves an import of Lightning per rank (seconds each on a shared 2-core machine) and changes nothing that is timed:
the steps, saves and loads run after setup, in the same processes either way.

``cfg["engine"]`` (``"fsdp1"`` or ``"fsdp2"``) picks ``GaudiFSDPStrategy(fsdp_version=...)`` and the hand-written
loop to compare it with. Modes: ``lightning_steps`` / ``raw_steps`` (step time of Trainer + GaudiFSDPStrategy vs a
hand-written loop), ``memory`` (bytes each rank holds), ``checkpoint`` (save/load of each format against torch.save
and the disk), ``load_sharded`` (loading sharded checkpoints written at another world size), ``pretrained_load``
(peak host memory per rank while a Hugging Face Llama's weights go into the shards, with ``pretrained_weights`` or
with ``from_pretrained`` on every rank).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import raw  # noqa: E402
import resume  # noqa: E402
from models import batch, build, loss_fn  # noqa: E402
from peaks import Peaks, reset_rss_peak, status_bytes  # noqa: E402

FSDP_VERSION = {"fsdp1": 1, "fsdp2": 2}
FORMATS = ("full", "sharded", "local")


def _write(cfg: dict[str, Any], result: dict[str, Any]) -> None:
    package = sys.modules.get("lightning_gaudi_fsdp")  # which tree was measured (compare.py checks it)
    result = {**result, "package": getattr(package, "__file__", None)}
    Path(cfg["result"]).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------------ Lightning
def _module(cfg: dict[str, Any]) -> Any:
    import lightning as L
    from torch.utils.data import DataLoader, Dataset

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 10**6

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.zeros(0)  # the step builds the same batch as the raw loop

    class BenchModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = build(cfg["size"])

        def training_step(self, _: Any, batch_idx: int) -> torch.Tensor:
            return loss_fn(self.model, batch(cfg["size"], batch_idx, self.global_rank))

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Tokens(), batch_size=None)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return BenchModule()


def _trainer(cfg: dict[str, Any], engine: str | None = None, **kwargs: Any) -> Any:
    import lightning as L
    from models import DecoderLayer

    from lightning_gaudi_fsdp import GaudiFSDPStrategy

    strategy = GaudiFSDPStrategy(
        auto_wrap_policy={DecoderLayer},
        sharding_strategy=cfg.get("sharding", "FULL_SHARD"),
        state_dict_type=cfg.get("state_dict_type", "full"),
        fsdp_version=FSDP_VERSION[engine or cfg["engine"]],
    )
    return L.Trainer(
        accelerator="cpu",
        devices=cfg["world_size"],
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        **kwargs,
    )


def lightning_steps(rank: int, cfg: dict[str, Any]) -> None:
    from lightning.pytorch.callbacks import Callback

    times: list[float] = []
    cpu: list[float] = []

    class Timer(Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            self.start, self.start_cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, *args: Any) -> None:
            times.append(time.perf_counter() - self.start)
            cpu.append(time.process_time() - self.start_cpu)

    trainer = _trainer(cfg, max_steps=cfg["steps"], callbacks=[Timer()])
    trainer.fit(_module(cfg))
    # what the strategy holds at rest, to compare with the hand-written loop's count
    held = raw.held_bytes(trainer.strategy.model, _unwrap(trainer.optimizers[0]))
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, {"step_times": times, "step_cpu": cpu, **held})
    if trainer.global_rank == 0:
        _write(cfg, {"ranks": gathered})
    _leave()


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer._optimizer if hasattr(optimizer, "_optimizer") else optimizer


def _leave() -> None:
    """All results are written: leave without tearing gloo down (that sometimes ends in std::terminate)."""
    if dist.is_initialized():
        dist.barrier()
    os._exit(0)


def _sync_time(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _dir_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def checkpoint(rank: int, cfg: dict[str, Any]) -> None:
    """Save and load each format, then the baselines on rank 0 (torch.save/torch.load of the same full state, and
    plain sequential writes of as many bytes with fsync), ``cfg["rounds"]`` times in turn, so that the contenders
    share the machine's moods, after ``cfg["warmup"]`` rounds that are not counted; each round starts from no
    checkpoint on disk."""
    out = Path(cfg["dir"])
    trainer = _trainer(cfg, max_steps=1)
    trainer.fit(_module(cfg))  # one step, so AdamW holds its moments
    from lightning_gaudi_fsdp.checkpoint.background import BackgroundSaver

    result: dict[str, Any] = {name: [] for name in (*FORMATS, *TORCH_SAVES, "disk")}
    result["async"] = {fmt: [] for fmt in FORMATS}
    # the same saves and loads with verify_checkpoints=False, in the same rounds (alternating which goes first)
    result["unverified"] = {fmt: [] for fmt in FORMATS}
    result["async_unverified"] = {fmt: [] for fmt in FORMATS}
    savers = {fmt: BackgroundSaver() for fmt in FORMATS}  # one per format: its host buffers are reused across rounds
    state: dict[str, Any] | None = None
    rounds, warmup = cfg.get("rounds", 1), cfg.get("warmup", 0)
    for round_ in range(warmup + rounds):
        for fmt in FORMATS:  # BENCH_PROFILE profiles the last round's save: warm, as the later rounds are
            for verify in (True, False) if round_ % 2 == 0 else (False, True):
                _set_verify(trainer.strategy, verify)
                saved, background = ("unverified", "async_unverified") if not verify else (fmt, "async")
                last = round_ == warmup + rounds - 1 and verify
                row = _save_and_load(trainer, fmt, out / f"ckpt-{fmt}", cfg, profile=last)
                (result[saved] if verify else result[saved][fmt]).append(row)
                result[background][fmt].append(_async_save(trainer, fmt, out / f"ckpt-{fmt}-async", savers[fmt]))
            _set_verify(trainer.strategy, True)
        if state is None:
            state = _full_state(trainer)  # collective; rank 0 gets the state, the others an empty one
        if rank == 0:
            for name, crc32 in TORCH_SAVES.items():
                result[name].append(_torch_save_and_load(state, out / f"{name}.pt", crc32=crc32))
            result["disk"].append(_plain_writes(result["full"][-1]["bytes"], out / "plain.bin"))
    if rank == 0:
        # the warm-up rounds wrote into memory the machine had not used yet (every contender's first write is
        # several times slower; docs/benchmarks.md): run, not counted
        result = {
            k: {f: v[warmup:] for f, v in r.items()} if isinstance(r, dict) else r[warmup:] for k, r in result.items()
        }
        _write(cfg, {**result, "state_bytes": _state_bytes(state)})
    _leave()


def checkpoint_in_fit(rank: int, cfg: dict[str, Any]) -> None:
    """A synchronous full ``trainer.save_checkpoint`` made inside ``fit`` (at the end of a training step, as a
    checkpoint callback makes it) against ``torch.save`` without CRC32s + fsync of the same full state on rank 0, both
    into new files, in turn at the end of each of ``cfg["rounds"]`` steps (after ``cfg["warmup"]`` steps not counted),
    each step starting with the other one. No file is deleted until the end: a write right after a large file was
    deleted took up to three times as long on this machine's disk, whichever contender it was."""
    import lightning as L

    out = Path(cfg["dir"])
    warmup, seconds = cfg.get("warmup", 0), {"full": [], "torch_save_plain": []}

    def contender(trainer: Any, name: str, target: Path) -> float:
        if name == "full":
            return _sync_time(lambda: trainer.save_checkpoint(target))
        state = _full_state(trainer)  # gathered before the clock starts: torch.save's input
        taken = _torch_save_and_load(state, target, crc32=False, load=False)["save_s"] if rank == 0 else 0.0
        del state
        dist.barrier()
        return taken

    class InFit(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            step = trainer.global_step  # 1, 2, ... after this step's optimizer step
            order = ["full", "torch_save_plain"] if step % 2 else ["torch_save_plain", "full"]
            for name in order:
                taken = contender(trainer, name, out / f"{name}-{step}.ckpt")
                if step > warmup:
                    seconds[name].append(taken)

    trainer = _trainer(cfg, max_steps=warmup + cfg["rounds"], callbacks=[InFit()])
    trainer.fit(_module(cfg))
    if rank == 0:
        for path in out.glob("*.ckpt"):
            _remove(path)
        _write(cfg, seconds)
    _leave()


def save_resume(rank: int, cfg: dict[str, Any]) -> None:
    """What a user waits for at a checkpoint, per format of ``cfg["formats"]``: ``trainer.save_checkpoint`` into a new
    path, the same save again over that checkpoint (as ``ModelCheckpoint`` rewrites ``last.ckpt``: the replaced one is
    deleted inside the call), and loading it (``strategy.load_checkpoint``, what ``fit(ckpt_path=...)`` runs before
    the first step); against ``torch.save`` without CRC32s + fsync of the same full state into a new file (rank 0),
    ``torch.load`` of this rank's share (its file of the local checkpoint) and ``torch.load`` of the whole file (rank
    0). ``cfg["rounds"]`` rounds in one process, each starting with the next contender; the first round is kept and
    reported apart (a fresh process's first save is the first checkpoint of a run). No file is deleted before the
    end, but by the overwriting saves. ``BENCH_PROFILE=<format>`` / ``BENCH_PROFILE_LOAD=<format>`` write a cProfile
    of rank 0's last save / load of that format to ``BENCH_PROFILE_DIR``."""
    out = Path(cfg["dir"])
    trainer = _trainer(cfg, max_steps=1)
    trainer.fit(_module(cfg))  # one step, so AdamW holds its moments
    strategy = trainer.strategy
    state = _full_state(trainer)  # collective; rank 0 gets the state, the others an empty one
    rounds, formats = cfg.get("rounds", 1), cfg.get("formats", list(FORMATS))
    rows: list[dict[str, float]] = []

    def profiled(kind: str, fmt: str, last: bool, fn: Any) -> float:
        if not (last and rank == 0 and os.environ.get(f"BENCH_PROFILE{kind}") == fmt):
            return _sync_time(fn)
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        taken = _sync_time(lambda: profiler.runcall(fn))
        name = f"profile-{cfg['engine']}-{fmt}{kind.lower().replace('_', '-')}.txt"
        with open(Path(os.environ.get("BENCH_PROFILE_DIR", out)) / name, "w") as handle:
            stats = pstats.Stats(profiler, stream=handle)
            stats.sort_stats("cumulative").print_stats(50)
            stats.sort_stats("tottime").print_stats(30)
        return taken

    def fmt_contender(fmt: str, round_: int, row: dict[str, float]) -> None:
        resume.set_format(strategy, fmt)
        path, last = out / f"{fmt}-{round_}", round_ == rounds - 1
        row[f"{fmt}_save_s"] = profiled("", fmt, last, lambda: trainer.save_checkpoint(path))
        row[f"{fmt}_overwrite_s"] = _sync_time(lambda: trainer.save_checkpoint(path))
        row[f"{fmt}_load_s"] = profiled("_LOAD", fmt, last, lambda: strategy.load_checkpoint(path))
        row[f"{fmt}_bytes"] = _dir_bytes(path)

    def torch_save(round_: int, row: dict[str, float]) -> None:
        saved = _torch_save_and_load(state, out / f"torch-{round_}.pt", crc32=False, load=False) if rank == 0 else {}
        row["torch_save_plain_s"] = resume._slowest(saved.get("save_s", 0.0))

    def torch_loads(round_: int, row: dict[str, float]) -> None:
        share = out / f"local-{round_}" / f"rank_{rank:05d}.pt"
        row["torch_load_share_s"] = resume._torch_load(share) if share.is_file() else float("nan")
        loaded = 0.0
        if rank == 0:
            start = time.perf_counter()
            torch.load(out / f"torch-{round_}.pt", weights_only=False)
            loaded = time.perf_counter() - start
        row["torch_load_full_s"] = resume._slowest(loaded)

    contenders: list[Any] = [functools.partial(fmt_contender, fmt) for fmt in formats] + [torch_save]
    for round_ in range(rounds):
        row: dict[str, float] = {}
        k = round_ % len(contenders)
        for contender in contenders[k:] + contenders[:k]:
            contender(round_, row)
        torch_loads(round_, row)  # reads this round's files
        rows.append(row)
        dist.barrier()
        if rank == 0:  # the disk holds one round; the next round's first contender pays this deletion
            for path in [*out.glob(f"*-{round_}"), out / f"torch-{round_}.pt"]:
                _remove(path)
            os.sync()
        dist.barrier()
    if rank == 0:
        for path in sorted(out.iterdir()):
            _remove(path)
        _write(cfg, {"rows": rows, "state_bytes": _state_bytes(state)})
    _leave()


def _save_and_load(trainer: Any, fmt: str, path: Path, cfg: dict[str, Any], profile: bool) -> dict[str, Any]:
    strategy = trainer.strategy
    resume.set_format(strategy, fmt)
    if trainer.global_rank == 0:
        _remove(path)
    profile = profile and os.environ.get("BENCH_PROFILE") == fmt and trainer.global_rank == 0
    reset_rss_peak()
    before = status_bytes("VmRSS")
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    save_s = _sync_time(lambda: trainer.save_checkpoint(path))
    if profile:
        import pstats

        profiler.disable()
        profile_dir = Path(os.environ.get("BENCH_PROFILE_DIR", path.parent))
        with open(profile_dir / f"profile-{cfg['engine']}-{fmt}.txt", "w") as handle:
            pstats.Stats(profiler, stream=handle).sort_stats("cumulative").print_stats(40)
    peak = status_bytes("VmHWM") - before  # what the save added on top of the trained model
    load_s = _sync_time(lambda: strategy.load_checkpoint(path))
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    # the layout written: which format the save really used (the files of a folder; [] for one file)
    return {"save_s": save_s, "load_s": load_s, "bytes": _dir_bytes(path), "rank0_peak_rss": peak, "files": files}


def _set_verify(strategy: Any, on: bool) -> None:
    """Make ``strategy`` record checksums on its saves and verify them on its loads (``verify_checkpoints``), or
    not, from now on (a tree without the option: nothing changes)."""
    import dataclasses

    config = getattr(strategy, "_config", None)
    if dataclasses.is_dataclass(config) and hasattr(config, "verify_checkpoints"):
        strategy._config = dataclasses.replace(config, verify_checkpoints=on)


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _async_save(trainer: Any, fmt: str, path: Path, saver: Any) -> dict[str, Any]:
    """The same save with ``async_save=True``: how long the training loop is blocked by it, and how long until it
    committed. Blocked: ``save_checkpoint`` (building the state dicts and staging what is not copied later, every
    rank, ending with Lightning's barrier) plus the wait before the next optimizer step for the background copies,
    which overlap that step's forward and backward (run here as the Trainer runs them, without the optimizer
    step); the slowest rank's wait counts."""
    from lightning_gaudi_fsdp.engine.pieces import gather_objects

    strategy = trainer.strategy
    resume.set_format(strategy, fmt)
    if trainer.global_rank == 0:
        _remove(path)
    strategy._background, saver.active = saver, True
    try:
        dist.barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(path)  # ends with Lightning's barrier: the slowest rank's blocked time
        blocked = time.perf_counter() - start
        step_start = time.perf_counter()
        strategy.training_step(None, 1).backward()  # the next step's forward and backward
        step_s = time.perf_counter() - step_start
        waited = torch.tensor([saver.wait_staged(rank=trainer.global_rank)])
        dist.all_reduce(waited, op=dist.ReduceOp.MAX)
        _unwrap(trainer.optimizers[0]).zero_grad(set_to_none=True)
        saver.wait(rank=trainer.global_rank, gather=functools.partial(gather_objects, world_size=trainer.world_size))
        dist.barrier()
        total = time.perf_counter() - start
    finally:
        strategy._background, saver.active = None, False
    return {
        "blocked_s": blocked + float(waited),
        "save_call_s": blocked,
        "copy_wait_s": float(waited),
        "step_s": step_s,
        "save_s": total,  # the forward and backward included
        "bytes": _dir_bytes(path),
        "staging_bytes": saver._stager.nbytes,
        "deferred_bytes": saver.deferred_bytes,
    }


def _full_state(trainer: Any) -> dict[str, Any]:
    model = trainer.strategy.model
    engine = trainer.strategy._engine
    full = engine.model_state_dict(model, "full", "cpu")
    optim = engine.optimizer_state_dict(model, _unwrap(trainer.optimizers[0]), "full", "cpu", trainer.global_rank)
    return {"state_dict": full, "optimizer_states": [optim]}


def _state_bytes(state: dict[str, Any]) -> int:
    tensors = list(state["state_dict"].values())
    tensors += [v for s in state["optimizer_states"][0]["state"].values() for v in s.values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# The torch.save baselines: with a CRC32 of each zip record (torch's default), and without, as the package's saves
# write them unless `checkpoint_crc32=True` (issue 31's target compares with this one).
TORCH_SAVES = {"torch_save": True, "torch_save_plain": False}


def _torch_save_and_load(state: dict[str, Any], target: Path, *, crc32: bool, load: bool = True) -> dict[str, Any]:
    from lightning_gaudi_fsdp.checkpoint.storage import zip_checksums

    target.unlink(missing_ok=True)
    start = time.perf_counter()
    with zip_checksums(crc32):
        torch.save(state, target)
    with open(target, "rb") as f:
        os.fsync(f.fileno())
    save_s = time.perf_counter() - start
    if not load:
        return {"save_s": save_s, "bytes": target.stat().st_size}
    start = time.perf_counter()
    torch.load(target, weights_only=False)
    return {"save_s": save_s, "load_s": time.perf_counter() - start, "bytes": target.stat().st_size}


def _plain_writes(nbytes: int, target: Path) -> dict[str, Any]:
    target.unlink(missing_ok=True)
    block = os.urandom(min(8 << 20, nbytes))
    start = time.perf_counter()
    with open(target, "wb") as f:
        written = 0
        while written < nbytes:
            written += f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return {"save_s": time.perf_counter() - start, "bytes": written}


def load_sharded(rank: int, cfg: dict[str, Any]) -> None:
    """Time loading each ``cfg["ckpts"][engine]`` (sharded, written at another world size) at this world size, with
    that engine; one Trainer after the other in the same processes, which saves a Lightning start per engine."""
    from lightning_gaudi_fsdp import GaudiFSDPStrategy

    original = GaudiFSDPStrategy.load_checkpoint
    seconds: dict[str, float] = {}

    for engine, path in cfg["ckpts"].items():

        def timed(self: Any, *args: Any, engine: str = engine, **kwargs: Any) -> Any:
            seconds[engine] = _sync_time(lambda: original(self, *args, **kwargs))
            return original(self, *args, **kwargs)  # loaded again for Lightning's return value; not timed

        GaudiFSDPStrategy.load_checkpoint = timed  # type: ignore[method-assign]
        trainer = _trainer(cfg, engine, max_steps=1)
        trainer.fit(_module(cfg), ckpt_path=path)
        del trainer
    if rank == 0:
        _write(cfg, {"load_s": seconds})
    _leave()


def pretrained_load(rank: int, cfg: dict[str, Any]) -> None:
    """Fabric door: ``contender="strategy"`` builds the Llama under ``init_module()`` with ``pretrained_weights``
    (meta parameters, each rank reads its slices); ``"from_pretrained"`` has every rank load the whole model with
    ``transformers`` and then shard it (no help from the strategy)."""
    import lightning as L
    import transformers

    from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy

    layer = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    args: dict[str, Any] = {"auto_wrap_policy": [layer], "fsdp_version": FSDP_VERSION[cfg["engine"]]}
    if cfg["contender"] == "strategy":
        args["pretrained_weights"] = cfg["weights"]
    fabric = L.Fabric(accelerator="cpu", devices=cfg["world_size"], strategy=GaudiFSDPStrategy(**args))
    fabric.launch()
    started = time.perf_counter()
    with Peaks() as peak:
        if cfg["contender"] == "strategy":
            with fabric.init_module():
                model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(cfg["weights"]))
        else:
            model = transformers.LlamaForCausalLM.from_pretrained(cfg["weights"], dtype=torch.float32)
        model = fabric.setup_module(model)
    seconds = time.perf_counter() - started
    row = {
        "peak_added": peak.anon,
        "peak_resident_added": peak.resident,
        "shard_bytes": fabric.strategy._engine.held_elements(model._forward_module) * 4,
        "load_s": seconds,
    }
    rows: list[Any] = [None] * cfg["world_size"]
    dist.all_gather_object(rows, row)
    if rank == 0:
        _write(cfg, {"ranks": rows})
    _leave()


MODES = {
    "raw_steps": raw.steps,
    "memory": raw.memory,
    "lightning_steps": lightning_steps,
    "checkpoint": checkpoint,
    "checkpoint_in_fit": checkpoint_in_fit,
    "load_sharded": load_sharded,
    "save_resume": save_resume,
    "pretrained_load": pretrained_load,
    "resume": lambda rank, cfg: (resume.resume(rank, cfg), _leave()),
}


def _rank(rank: int, mode: str, cfg: dict[str, Any], port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(cfg["world_size"]),
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
        RANK=str(rank),
    )
    torch.set_num_threads(1)
    MODES[mode](rank, cfg)


TRAINER_MODES = ("lightning_steps", "checkpoint", "checkpoint_in_fit", "save_resume", "load_sharded", "pretrained_load")
TRAINER_MODES += ("resume",)


def launch(mode: str, cfg: dict[str, Any]) -> None:
    import torch.multiprocessing as mp

    if mode in TRAINER_MODES:
        import lightning.pytorch  # noqa: F401  (imported once, before forking)

        import lightning_gaudi_fsdp  # noqa: F401
    if mode in ("pretrained_load", "resume"):
        import transformers.models.llama.modeling_llama  # noqa: F401
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: nothing has run an operator or started a thread in this process yet
    mp.start_processes(_rank, args=(mode, cfg, port), nprocs=cfg["world_size"], start_method="fork")


if __name__ == "__main__":
    launch(sys.argv[1], json.loads(Path(sys.argv[2]).read_text()))
