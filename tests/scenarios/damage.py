"""Damaged checkpoints refused by their checksums, in one 2-rank launch of the Trainer.

At step ``K`` a callback saves the model in every format of ``formats`` (and once with checksums off), rank 0 makes
damaged copies of them (a byte flipped in a tensor's data or in metadata, a file cut short by one byte, a file
deleted, two ranks' files swapped), then every rank resumes from each copy through the strategy's
``load_checkpoint`` (what ``Trainer.fit(ckpt_path=...)`` calls) and records the error it raised, how long it took
and whether the weights and the optimizer state in memory were left as they were; then it loads the undamaged ones.
Rank ``r`` writes ``rank<r>.json``: ``{"damaged": {name: file}, "loads": {name: {...}}}``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import QUIET_TRAINER, Module, load_config, set_state_dict_type, write_json
from lightning.pytorch.callbacks import Callback
from train import leave

from lightning_gaudi_fsdp import GaudiFSDPStrategy

K = 2


def _flip(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0xFF
    file.write_bytes(bytes(data))


def _record_data(file: Path, largest: bool) -> int:
    """The offset of the middle of a ``torch.save`` archive's largest tensor record (``largest``) or of its pickle."""
    with zipfile.ZipFile(file) as archive:
        records = archive.infolist()
        if largest:
            record = max((r for r in records if "/data/" in r.filename), key=lambda r: r.file_size)
        else:
            record = next(r for r in records if r.filename.endswith("data.pkl"))
    with open(file, "rb") as handle:
        handle.seek(record.header_offset + 26)
        name, extra = int.from_bytes(handle.read(2), "little"), int.from_bytes(handle.read(2), "little")
    return record.header_offset + 30 + name + extra + record.file_size // 2


def _dcp_entry_middle(ckpt: Path, shard: str) -> int:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(ckpt)).read_metadata()
    info = max(
        (i for k, i in metadata.storage_data.items() if i.relative_path == shard and k.fqn.startswith("model.")),
        key=lambda i: i.length,
    )
    return info.offset + info.length // 2


def damage(work: Path, formats: list[str]) -> dict[str, str]:
    """Rank 0: damaged copies of the checkpoints in ``work``; returns each copy's name -> the file damaged."""

    def copy(fmt: str, name: str) -> Path:
        dst = work / f"damaged_{name}"
        (shutil.copytree if (work / fmt).is_dir() else shutil.copy2)(work / fmt, dst)
        return dst

    made: dict[str, str] = {}
    if "full" in formats:
        ckpt = copy("full", "full_tensor")
        _flip(ckpt, _record_data(ckpt, largest=True))
        ckpt = copy("full", "full_metadata")
        _flip(ckpt, _record_data(ckpt, largest=False))
        ckpt = copy("full", "full_truncated")
        ckpt.write_bytes(ckpt.read_bytes()[:-1])
        made.update({f"full_{kind}": f"damaged_full_{kind}" for kind in ("tensor", "metadata", "truncated")})
    if "sharded" in formats:
        ckpt = copy("sharded", "sharded_tensor")
        _flip(ckpt / "__1_0.distcp", _dcp_entry_middle(ckpt, "__1_0.distcp"))
        ckpt = copy("sharded", "sharded_metadata")
        _flip(ckpt / ".metadata", (ckpt / ".metadata").stat().st_size // 2)
        ckpt = copy("sharded", "sharded_truncated")
        (ckpt / "__0_0.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes()[:-1])
        ckpt = copy("sharded", "sharded_missing")
        (ckpt / "__1_0.distcp").unlink()
        ckpt = copy("sharded", "sharded_marker_missing")  # the file that says which format it is
        (ckpt / "meta.pt").unlink()
        made.update(
            sharded_tensor="__1_0.distcp",
            sharded_metadata=".metadata",
            sharded_truncated="__0_0.distcp",
            sharded_missing="__1_0.distcp",
            sharded_marker_missing="meta.pt",
        )
    if "local" in formats:
        ckpt = copy("local", "local_tensor")
        _flip(ckpt / "rank_00001.pt", _record_data(ckpt / "rank_00001.pt", largest=True))
        ckpt = copy("local", "local_metadata")
        _flip(ckpt / "local_metadata.json", (ckpt / "local_metadata.json").stat().st_size // 2)
        ckpt = copy("local", "local_truncated")
        (ckpt / "rank_00000.pt").write_bytes((ckpt / "rank_00000.pt").read_bytes()[:-1])
        ckpt = copy("local", "local_missing")
        (ckpt / "rank_00001.pt").unlink()
        ckpt = copy("local", "local_marker_missing")
        (ckpt / "local_metadata.json").unlink()
        ckpt = copy("local", "local_swapped")
        first, second = (ckpt / "rank_00000.pt").read_bytes(), (ckpt / "rank_00001.pt").read_bytes()
        (ckpt / "rank_00000.pt").write_bytes(second)
        (ckpt / "rank_00001.pt").write_bytes(first)
        made.update(
            local_tensor="rank_00001.pt",
            local_metadata="local_metadata.json",
            local_truncated="rank_00000.pt",
            local_missing="rank_00001.pt",
            local_marker_missing="local_metadata.json",
            local_swapped="rank_00000.pt",
        )
    return made


def _snapshot(trainer: L.Trainer) -> list[torch.Tensor]:
    """This rank's parameters (local shards) and optimizer state, copied."""
    tensors = [getattr(p, "to_local", lambda p=p: p)().detach().clone() for p in trainer.strategy.model.parameters()]
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            tensors += [
                getattr(v, "to_local", lambda v=v: v)().detach().clone() for v in state.values() if torch.is_tensor(v)
            ]
    return tensors


class SaveDamageLoad(Callback):
    def __init__(self, work: Path, formats: list[str], result: dict[str, Any]) -> None:
        self.work, self.formats, self.result = work, formats, result

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != K:
            return
        strategy = trainer.strategy
        config = strategy._config
        original = config.state_dict_type
        for fmt in self.formats:
            set_state_dict_type(strategy, fmt)
            trainer.save_checkpoint(self.work / fmt)
        strategy._config = dataclasses.replace(config, verify_checkpoints=False)  # as an earlier release wrote it
        trainer.save_checkpoint(self.work / "unverified")
        strategy._config = config
        made = damage(self.work, self.formats) if trainer.global_rank == 0 else {}
        made = trainer.strategy.broadcast(made)
        self.result["damaged"] = made
        loads: dict[str, Any] = {}
        for name in [*(f"damaged_{n}" for n in made), *self.formats, "unverified"]:
            fmt = name.split("_")[1] if name.startswith("damaged_") else (original if name == "unverified" else name)
            set_state_dict_type(strategy, fmt)
            before = _snapshot(trainer)
            started = time.monotonic()
            error = None
            try:
                strategy.load_checkpoint(self.work / name)
            except Exception as err:  # noqa: BLE001 - recorded for the test
                error = {"type": type(err).__name__, "message": str(err)}
            after = _snapshot(trainer)
            loads[name] = {
                "error": error,
                "seconds": time.monotonic() - started,
                "unchanged": len(before) == len(after)
                and all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
            }
        strategy._config = config
        self.result["loads"] = loads


def main() -> None:
    cfg = load_config()
    out = Path(cfg["out"])
    work = out / "ckpts"
    work.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    result: dict[str, Any] = {}
    L.seed_everything(7)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=GaudiFSDPStrategy(
            auto_wrap_policy=["common.Block"], timeout=60, fsdp_version=cfg.get("fsdp_version", 1)
        ),
        max_steps=K,
        callbacks=[SaveDamageLoad(work, cfg.get("formats", ["full", "sharded", "local"]), result)],
        **QUIET_TRAINER,
    )
    trainer.fit(Module(n_samples=32, batch_size=4))
    write_json(out, f"rank{rank}.json", result)
    leave()


if __name__ == "__main__":
    main()
