"""Trainer resume under safe loading, in one 2-rank launch: our checkpoints (with hyper-parameters of common types)
resume exactly in every format; crafted ones are refused before their payload runs; ``weights_only=False`` loads them.

Steps: an uninterrupted run of 2k steps; a run of k steps that saves at step k in all three formats; a resume from
each for k more steps; copies of those checkpoints whose files carry a payload that would create a marker file, each
resumed with the default and some with ``weights_only=False``. Rank 0 writes ``rank0.json``, rank 1 ``rank1.json``.
"""

from __future__ import annotations

import inspect
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from common import QUIET_TRAINER, Module, load_config, set_state_dict_type, write_json
from lightning.pytorch.callbacks import Callback
from train import leave

from lightning_gaudi_fsdp import GaudiFSDPStrategy
from lightning_gaudi_fsdp.checkpoint import formats
from lightning_gaudi_fsdp.engine.base import of as engine_of

SMOOTHING, SEED_OFFSET = np.float64(0.1), np.int64(3)
K = 4  # steps per epoch: 32 samples, 4 per rank, 2 ranks; checkpoints at an epoch boundary resume exactly
FORMATS = ("full", "sharded", "local")


class HparamsModule(Module):
    """Common hyper-parameter types next to the base module's: a path, numpy scalars, a tuple, a list, a dict."""

    def __init__(
        self,
        data_dir: Path = Path("/data/train"),
        label_smoothing: Any = SMOOTHING,
        seed_offset: Any = SEED_OFFSET,
        betas: tuple[float, float] = (0.9, 0.99),
        tags: list[str] | None = None,
        schedule: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.loaded_hparams: dict[str, Any] | None = None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_hparams = checkpoint.get("hyper_parameters")


class SaveAllFormats(Callback):
    def __init__(self, step: int, directory: Path) -> None:
        self.step, self.directory = step, directory

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            strategy = trainer.strategy
            original = strategy._config.state_dict_type
            for fmt in FORMATS:
                set_state_dict_type(strategy, fmt)
                trainer.save_checkpoint(self.directory / fmt)
            set_state_dict_type(strategy, original)


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def fit(max_steps: int, ckpt: Path | None = None, weights_only: bool | None = None, **kwargs: Any) -> Any:
    """A fresh module and Trainer; returns (trainer, module, error message or None)."""
    L.seed_everything(7)
    module = HparamsModule(tags=["a", "b"], schedule={"warmup": 2, "decay": [0.5, 0.25]}, n_samples=32, batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=GaudiFSDPStrategy(auto_wrap_policy=["common.Block"], timeout=60),
        max_steps=max_steps,
        **{**QUIET_TRAINER, **kwargs},
    )
    extra = {} if weights_only is None else {"weights_only": weights_only}
    try:
        trainer.fit(module, ckpt_path=None if ckpt is None else str(ckpt), **extra)
    except formats.CheckpointError as err:
        return trainer, module, str(err)
    return trainer, module, None


def full_weights(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    return engine_of(trainer.strategy.model).model_state_dict(trainer.strategy.model, "full", "cpu")


def craft(good: Path, bad: Path, target: str, marker: Path) -> None:
    """Copy ``good`` to ``bad`` with a payload in ``target`` (a file of the checkpoint, or ``""`` for a full one)."""
    (shutil.copytree if good.is_dir() else shutil.copy)(good, bad)
    file = bad / target if target else bad
    checkpoint = torch.load(file, weights_only=False)  # written by this run
    checkpoint["payload"] = Payload(marker)
    torch.save(checkpoint, file)
    if bad.is_dir():  # crafted without checksums: verification is not what stops it
        (bad / "checksums.json").unlink()


def main() -> None:
    cfg = load_config()
    out = Path(cfg["out"])
    work = out / "ckpts"
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    result: dict[str, Any] = {}

    straight, _, _ = fit(2 * K)
    reference = full_weights(straight)
    fit(K, callbacks=[SaveAllFormats(K, work)])
    for fmt in FORMATS:
        trainer, module, error = fit(2 * K, work / fmt)
        weights = full_weights(trainer)
        result[fmt] = {
            "error": error,
            "step": trainer.global_step,
            "bitwise": rank != 0
            or (weights.keys() == reference.keys() and all(torch.equal(weights[k], v) for k, v in reference.items())),
            "hparams_equal": module.loaded_hparams == dict(module.hparams),
            "hparam_types": {k: type(v).__name__ for k, v in (module.loaded_hparams or {}).items()},
        }

    bad = {  # name: (source format, file with the payload)
        "full": ("full", ""),
        "sharded_meta": ("sharded", formats.SHARDED_METADATA),
        "local_trainer_state": ("local", formats.LOCAL_TRAINER_STATE),
        "local_rank1_shard": ("local", formats.local_shard_name(1)),
    }
    if rank == 0:
        for name, (fmt, target) in bad.items():
            craft(work / fmt, work / f"bad_{name}", target, out / f"ran_{name}")
    torch.distributed.barrier()
    for name in bad:
        _, _, error = fit(K, work / f"bad_{name}")
        result[f"refused_{name}"] = {"error": error, "marker": (out / f"ran_{name}").exists()}
    trusted = ("full", "local_rank1_shard") if "weights_only" in inspect.signature(L.Trainer.fit).parameters else ()
    for name in trusted:  # Lightning 2.5 has no weights_only argument
        trainer, _, error = fit(K, work / f"bad_{name}", weights_only=False)
        torch.distributed.barrier()  # rank 1's payload has run before rank 0 looks
        result[f"trusted_{name}"] = {
            "error": error,
            "step": trainer.global_step,
            "marker": (out / f"ran_{name}").exists(),
        }
    write_json(out, f"rank{rank}.json", result)
    leave()


if __name__ == "__main__":
    main()
