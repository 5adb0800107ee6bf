"""Saves that fail on a small tmpfs: many causes and formats in one 2-rank run; every rank records what it raised.

Usage: python save_failures.py CONFIG.json   (the test mounts the tmpfs at ``cfg["root"]``)

After the first optimizer step, each case of ``cfg["cases"]`` saves a good checkpoint into its own directory, breaks
the target (fills the disk to half the size of that checkpoint, remounts it read-only, or removes the directory while a
rank writes), saves again, catches the error and records it per rank, together with
the seconds the failed save took, the files left beside the good checkpoint and whether the good one still loads.
The run then goes on training with ``ModelCheckpoint``; before its second save the disk is filled again, and that
failure, uncaught, ends the run as it would end a user's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
from common import QUIET_TRAINER, Module, load_config, set_state_dict_type, write_json
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from train import leave

from lightning_gaudi_fsdp import GaudiFSDPStrategy
from lightning_gaudi_fsdp.checkpoint import formats
from lightning_gaudi_fsdp.checkpoint.convert import load_full_state
from lightning_gaudi_fsdp.checkpoint.space import CHECK_FREE_SPACE_ENV


def _bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fill(root: Path, leave_free: int) -> Path:
    """Write a ballast file so that only ``leave_free`` bytes stay free on ``root``'s file system."""
    ballast = root / "ballast"
    vfs = os.statvfs(root)
    with open(ballast, "ab") as handle:
        handle.write(b"\0" * max(vfs.f_bavail * vfs.f_frsize - leave_free, 0))
    return ballast


def arm_vanish(directory: Path) -> Callable[[], None]:
    """This rank's next staged write first removes ``directory`` (as a clean-up job would, mid-save)."""
    real = formats.save_file

    def vanishing(obj: Any, file: Path, **kwargs: Any) -> None:
        if ".partial" in str(file) and directory.exists():
            shutil.rmtree(directory)
        real(obj, file, **kwargs)

    formats.save_file = vanishing

    def disarm() -> None:
        formats.save_file = real

    return disarm


def break_target(case: dict[str, Any], root: Path, home: Path, good: Path, rank: int) -> Callable[[], None]:
    """Break what the next save writes to; returns how to repair it."""
    cause = case["cause"]
    if cause == "vanish":
        return arm_vanish(home / "sub") if rank == case.get("rank", 1) else lambda: None
    if rank != 0:
        return lambda: None
    if cause == "full_disk":
        ballast = fill(root, _bytes(good) // 2)
        return ballast.unlink
    if cause == "read_only":
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        return lambda: subprocess.run(["mount", "-o", "remount,rw", str(root)], check=True)
    raise ValueError(f"unknown cause {cause!r}")


class FailingSaves(Callback):
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.root = Path(cfg["root"])

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            results = {case["name"]: self.run_case(trainer, case) for case in self.cfg["cases"]}
            write_json(Path(self.cfg["out"]), f"cases{trainer.global_rank}.json", results)
            final = self.cfg["final"]
            set_state_dict_type(trainer.strategy, final["fmt"])
            os.environ[CHECK_FREE_SPACE_ENV] = "1" if final["check"] else "0"
        elif trainer.global_step == 2:  # ModelCheckpoint saves after this hook: leave half its last checkpoint free
            if trainer.global_rank == 0:
                saved = [p for p in (self.root / "mc").iterdir() if not p.name.startswith(".")]
                fill(self.root, _bytes(saved[0]) // 2)
            trainer.strategy.barrier()
            write_json(Path(self.cfg["out"]), f"final_started{trainer.global_rank}.json", time.time())

    def run_case(self, trainer: L.Trainer, case: dict[str, Any]) -> dict[str, Any]:
        strategy, rank = trainer.strategy, trainer.global_rank
        home = self.root / case["name"]
        good, bad = home / "good.ckpt", home / "sub" / "next.ckpt"
        set_state_dict_type(strategy, case["fmt"])
        os.environ[CHECK_FREE_SPACE_ENV] = "1" if case["check"] else "0"
        trainer.save_checkpoint(good)
        repair = break_target(case, self.root, home, good, rank)
        strategy.barrier()
        record: dict[str, Any] = {"error": None}
        started = time.monotonic()
        try:
            trainer.save_checkpoint(bad)
        except Exception as err:
            cause = err.__cause__
            record = {
                "error": type(err).__name__,
                "message": str(err),
                "chained": type(cause).__name__ if cause else None,
            }
        record["seconds"] = time.monotonic() - started
        strategy.barrier()
        repair()
        if rank == 0:
            record["left"] = sorted(str(p.relative_to(home)) for p in home.rglob("*") if good not in (p, *p.parents))
            record["good_step"] = load_full_state(good)[0]["global_step"]  # reads every byte of it
            shutil.rmtree(home)
        strategy.barrier()
        return record


def main() -> None:
    cfg = load_config()
    L.seed_everything(7, workers=True)
    mc = ModelCheckpoint(dirpath=Path(cfg["root"]) / "mc", every_n_train_steps=1, save_top_k=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=GaudiFSDPStrategy(**cfg["strategy"]),
        max_steps=4,
        **{**QUIET_TRAINER, "enable_checkpointing": True},
        callbacks=[FailingSaves(cfg), mc],
    )
    trainer.fit(Module(**cfg["module"]))
    leave()  # not reached when the last save fails as intended


if __name__ == "__main__":
    main()
