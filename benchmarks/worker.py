"""One benchmark measurement in its own processes: ``python worker.py MODE CONFIG_JSON``; rank 0 writes the result.

Modes: ``lightning_steps`` / ``raw_steps`` (step time of Trainer + GaudiFSDPStrategy vs a hand-written FSDP loop),
``memory`` (bytes each rank holds), ``checkpoint`` (save/load of each format against torch.save and the disk),
``load_sharded`` (loading a sharded checkpoint at another world size).
"""

from __future__ import annotations

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
import contextlib

from models import batch, build, loss_fn  # noqa: E402


def _write(cfg: dict[str, Any], result: dict[str, Any]) -> None:
    Path(cfg["result"]).write_text(json.dumps(result))


def _status_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_rss_peak() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _fsdp_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    from models import DecoderLayer
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return {
        "auto_wrap_policy": ModuleWrapPolicy({DecoderLayer}),
        "sharding_strategy": ShardingStrategy[cfg.get("sharding", "FULL_SHARD")],
        "device_id": torch.device("cpu"),
        "use_orig_params": True,
    }


# ----------------------------------------------------------------------------------------------- hand-written FSDP
def _raw_entry(rank: int, cfg: dict[str, Any], port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cfg["world_size"])
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(build(cfg["size"]), **_fsdp_kwargs(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(cfg["steps"]):
        start = time.perf_counter()
        loss = loss_fn(model, batch(cfg["size"], step, rank))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    result: dict[str, Any] = {"step_times": times}
    if cfg.get("count_memory"):
        result.update(_held_bytes(model, optimizer))
        result["peak_rss"] = _status_bytes("VmHWM")
    gathered: list[Any] = [None] * cfg["world_size"]
    dist.all_gather_object(gathered, result)
    if rank == 0:
        _write(cfg, {"ranks": gathered})
    _leave()


def _held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the storages this rank holds for parameters, gradients and optimizer state (each counted once)."""

    def storage_bytes(tensors: list[torch.Tensor]) -> int:
        seen: dict[int, int] = {}
        for t in tensors:
            if t is not None and t.numel():
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    flat = [m._handle.flat_param for m in model.modules() if isinstance(m, FSDP) and m._handle is not None]
    grads = [getattr(p, "_saved_grad_shard", None) if p.grad is None else p.grad for p in flat]
    grads += [p.grad for p in model.parameters()]
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "param_bytes": storage_bytes(flat),
        "grad_bytes": storage_bytes(grads),
        "optim_bytes": storage_bytes(states),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_steps(cfg: dict[str, Any]) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_raw_entry, args=(cfg, _free_port()), nprocs=cfg["world_size"], start_method="spawn")


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


def _trainer(cfg: dict[str, Any], **kwargs: Any) -> Any:
    import lightning as L
    from models import DecoderLayer

    from lightning_gaudi_fsdp import GaudiFSDPStrategy

    strategy = GaudiFSDPStrategy(
        auto_wrap_policy={DecoderLayer},
        sharding_strategy=cfg.get("sharding", "FULL_SHARD"),
        state_dict_type=cfg.get("state_dict_type", "full"),
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


def lightning_steps(cfg: dict[str, Any]) -> None:
    from lightning.pytorch.callbacks import Callback

    torch.set_num_threads(1)
    times: list[float] = []

    class Timer(Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            times.append(time.perf_counter() - self.start)

    trainer = _trainer(cfg, max_steps=cfg["steps"], callbacks=[Timer()])
    trainer.fit(_module(cfg))
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, {"step_times": times})
    if trainer.global_rank == 0:
        _write(cfg, {"ranks": gathered})
    _leave()


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


def checkpoint(cfg: dict[str, Any]) -> None:
    from lightning_gaudi_fsdp.checkpoint import formats

    torch.set_num_threads(1)
    out = Path(cfg["dir"])
    trainer = _trainer(cfg, max_steps=1)
    trainer.fit(_module(cfg))  # one step, so AdamW holds its moments
    strategy = trainer.strategy
    result: dict[str, Any] = {}
    for fmt in ("full", "sharded", "local"):
        strategy._state_dict_type = fmt
        path = out / f"ckpt-{fmt}"
        _reset_rss_peak()
        before = _status_bytes("VmRSS")
        profile = os.environ.get("BENCH_PROFILE") == fmt and trainer.global_rank == 0
        if profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        save_s = _sync_time(lambda p=path: trainer.save_checkpoint(p))
        if profile:
            import pstats

            profiler.disable()
            with open(out / f"profile-{fmt}.txt", "w") as handle:
                pstats.Stats(profiler, stream=handle).sort_stats("cumulative").print_stats(30)
        peak = _status_bytes("VmHWM") - before  # what the save added on top of the trained model
        load_s = _sync_time(lambda p=path: strategy.load_checkpoint(p))
        result[fmt] = {"save_s": save_s, "load_s": load_s, "bytes": _dir_bytes(path), "rank0_peak_rss": peak}
    # baselines on rank 0: torch.save/torch.load of the same full state, and raw sequential writes with fsync
    full = formats.model_state_dict(strategy.model, "full", "cpu")
    optim = formats.optimizer_state_dict(
        strategy.model,
        trainer.optimizers[0]._optimizer if hasattr(trainer.optimizers[0], "_optimizer") else trainer.optimizers[0],
        "full",
        "cpu",
        trainer.global_rank,
    )
    if trainer.global_rank == 0:
        state = {"state_dict": full, "optimizer_states": [optim]}
        state_bytes = sum(t.numel() * t.element_size() for t in full.values())
        state_bytes += sum(
            v.numel() * v.element_size()
            for s in optim["state"].values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        target = out / "torch_save.pt"
        start = time.perf_counter()
        torch.save(state, target)
        with open(target, "rb") as f:
            os.fsync(f.fileno())
        result["torch_save"] = {"save_s": time.perf_counter() - start, "bytes": target.stat().st_size}
        start = time.perf_counter()
        torch.load(target, weights_only=False)
        result["torch_save"]["load_s"] = time.perf_counter() - start
        result["state_bytes"] = state_bytes
        block = os.urandom(min(8 << 20, result["full"]["bytes"]))
        raw = out / "raw.bin"
        start = time.perf_counter()
        with open(raw, "wb") as f:
            written = 0
            while written < result["full"]["bytes"]:
                written += f.write(block)
            f.flush()
            os.fsync(f.fileno())
        result["disk"] = {"save_s": time.perf_counter() - start, "bytes": written}
        _write(cfg, result)
    _leave()


def load_sharded(cfg: dict[str, Any]) -> None:
    """Time loading ``cfg['ckpt']`` (sharded, written at another world size) at this world size."""
    from lightning_gaudi_fsdp import GaudiFSDPStrategy

    torch.set_num_threads(1)
    original = GaudiFSDPStrategy.load_checkpoint

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        seconds = _sync_time(lambda: original(self, *args, **kwargs))
        if self.global_rank == 0:
            _write(cfg, {"load_s": seconds})
        return original(self, *args, **kwargs)  # loaded again for Lightning's return value; not timed

    GaudiFSDPStrategy.load_checkpoint = timed  # type: ignore[method-assign]
    trainer = _trainer(cfg, max_steps=1)
    trainer.fit(_module(cfg), ckpt_path=cfg["ckpt"])
    _leave()


if __name__ == "__main__":
    mode, config = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    {
        "raw_steps": raw_steps,
        "lightning_steps": lightning_steps,
        "memory": raw_steps,
        "checkpoint": checkpoint,
        "load_sharded": load_sharded,
    }[mode](config)
