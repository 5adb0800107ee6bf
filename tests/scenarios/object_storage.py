"""Checkpoint locations that are URLs, through both doors in one 2-rank run; every rank records what it raised.

Usage: python object_storage.py CONFIG.json   (ranks started by the scenario pool, torchrun-style)

The ranks work in ``<out>/cwd``, where a URL taken for a local path would become a folder (``s3:``, ``memory:``).
Trainer: a fit of one step, a good checkpoint, then ``trainer.save_checkpoint(URL)``,
``trainer.validate(ckpt_path=URL)``, ``trainer.fit(ckpt_path=URL)``, a fit with
``ModelCheckpoint(dirpath="memory://...")`` (with and without ``ckpt_path="last"``), and a save to ``file://<path>``.
Fabric: a good checkpoint, then ``fabric.save(URL)`` and ``fabric.load(URL)``. Each record holds the error's type and
message (or None); then whether the good checkpoints are byte for byte as saved, and still load.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import QUIET_TRAINER, Module, load_config, write_json
from lightning.pytorch.callbacks import ModelCheckpoint
from train import leave

from lightning_gaudi_fsdp import GaudiFSDPStrategy
from lightning_gaudi_fsdp.checkpoint.convert import load_full_state
from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy as FabricStrategy


def attempt(action: Callable[[], Any]) -> dict[str, Any]:
    try:
        action()
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


def digest(path: Path) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    sha = hashlib.sha256()
    for file in files:
        sha.update(str(file.relative_to(path.parent)).encode() + file.read_bytes())
    return sha.hexdigest()


def trainer(cfg: dict[str, Any], **kwargs: Any) -> L.Trainer:
    quiet = {**QUIET_TRAINER, **kwargs.pop("quiet", {})}
    strategy = GaudiFSDPStrategy(**cfg["strategy"])
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, **quiet, **kwargs)


def trainer_door(cfg: dict[str, Any], out: Path, url: str) -> dict[str, Any]:
    records: dict[str, Any] = {}
    fitted, model = trainer(cfg), Module(**cfg["module"])
    fitted.fit(model)
    good = out / "trainer-good.ckpt"
    fitted.save_checkpoint(good)
    before = digest(good)
    records["trainer.save_checkpoint"] = attempt(lambda: fitted.save_checkpoint(url))
    records["trainer.validate"] = attempt(lambda: fitted.validate(model, ckpt_path=url, verbose=False))
    records["trainer.fit"] = attempt(lambda: trainer(cfg).fit(Module(**cfg["module"]), ckpt_path=url))
    dirpath = "memory://ckpt/run"  # an fsspec URL Lightning's ModelCheckpoint takes without s3fs installed
    saving = dict(callbacks=[ModelCheckpoint(dirpath=dirpath)], quiet={"enable_checkpointing": True})
    records["ModelCheckpoint"] = attempt(lambda: trainer(cfg, **saving).fit(Module(**cfg["module"])))
    records["ModelCheckpoint, last"] = attempt(
        lambda: trainer(cfg, **saving).fit(Module(**cfg["module"]), ckpt_path="last")
    )
    by_file_url = out / "by-file-url.ckpt"
    records["file://"] = attempt(lambda: fitted.save_checkpoint(f"file://{by_file_url}"))
    records["file:// saved"] = by_file_url.exists()
    records["good unchanged"] = digest(good) == before
    records["good step"] = load_full_state(good)[0]["global_step"] if fitted.global_rank == 0 else None
    return records


def fabric_door(cfg: dict[str, Any], out: Path, url: str) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FabricStrategy(**cfg["strategy"]))
    fabric.launch()
    fabric.seed_everything(7)
    model = fabric.setup_module(Module(**cfg["module"]))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    state = {"model": model, "optimizer": optimizer, "step": 3}
    good = out / "fabric-good.ckpt"
    fabric.save(good, state)
    before = digest(good)
    records = {
        "fabric.save": attempt(lambda: fabric.save(url, state)),
        "fabric.load": attempt(lambda: fabric.load(url, state)),
    }
    records["good unchanged"] = digest(good) == before
    records["good step"] = fabric.load(good, {"model": model, "optimizer": optimizer})["step"]
    return records


def main() -> None:
    cfg = load_config()
    out = Path(cfg["out"])
    cwd = out / "cwd"
    cwd.mkdir(parents=True, exist_ok=True)
    os.chdir(cwd)
    L.seed_everything(7)
    records = {"trainer": trainer_door(cfg, out, cfg["url"]), "fabric": fabric_door(cfg, out, cfg["url"])}
    write_json(out, f"urls{torch.distributed.get_rank()}.json", records)
    leave()


if __name__ == "__main__":
    main()
