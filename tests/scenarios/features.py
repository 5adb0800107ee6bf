"""Lightning features under GaudiFSDPStrategy; ``case`` in the config picks one. Rank 0 writes rank0.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torchmetrics
from common import Module, Net, dump_replicated, load_config, write_json
from lightning.pytorch.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from train import leave

from lightning_gaudi_fsdp import GaudiFSDPStrategy
from lightning_gaudi_fsdp.engine.base import of as engine_of


class SyncModule(Module):
    """Logs rank-dependent values with every reduction, and keeps a torchmetrics metric."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.metric = torchmetrics.MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        value = torch.tensor(float(self.global_rank + 1))
        for fx in ("mean", "sum", "max", "min"):
            self.log(f"rank_{fx}", value, sync_dist=True, reduce_fx=fx, on_step=True, on_epoch=False)
        self.metric.update(value)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x).float(), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class GroupsModule(Module):
    """No weight decay on norms and biases: two parameter groups (needs use_orig_params=True)."""

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2 and "norm" not in n]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2 or "norm" in n]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=0.01
        )


class Collectives(Callback):
    def __init__(self) -> None:
        self.result: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy

        def rank_value() -> torch.Tensor:  # Lightning reduces in place: a fresh tensor each time
            return torch.tensor(float(trainer.global_rank + 1))

        self.result["reduce_sum"] = float(s.reduce(rank_value(), reduce_op="sum"))
        self.result["reduce_mean"] = float(s.reduce(rank_value(), reduce_op="mean"))
        self.result["all_gather"] = s.all_gather(rank_value()).tolist()
        self.result["broadcast"] = s.broadcast({"from": trainer.global_rank, "list": [1, 2]}, src=0)
        s.barrier("after-collectives")
        self.result["metric"] = float(pl_module.metric.compute())
        self.result["metric_device"] = str(pl_module.metric.device)
        self.result["logged"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rank_")}


def _trainer(cfg: dict[str, Any], **kwargs: Any) -> L.Trainer:
    reference = cfg.get("strategy") == "reference"  # one process with Lightning's default strategy
    base: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1 if reference else 2,
        strategy="auto" if reference else GaudiFSDPStrategy(**cfg.get("strategy", {})),
        # quiet on purpose: each feature case compares weights with a one-process reference; the logger, checkpointing
        # and progress bar are covered on Lightning's defaults by the resume, async-save and preemption families
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    base.update(kwargs)
    return L.Trainer(**base)


def main() -> None:
    cfg = load_config()
    out = Path(cfg["out"])
    L.seed_everything(7)
    case = cfg["case"]
    result: dict[str, Any] = {}
    if case == "sync":
        module = SyncModule(n_samples=64)
        collectives = Collectives()
        trainer = _trainer(cfg, max_steps=3, callbacks=[collectives], limit_val_batches=0)
        trainer.fit(module)
        result.update(collectives.result)
    elif case == "eval_loops":
        module = SyncModule(n_samples=64)
        trainer = _trainer(cfg, max_steps=3, limit_val_batches=2)
        trainer.fit(module)
        ckpts = {"full": Path(cfg["ckpt"]), "weights_only": Path(cfg["ckpt"] + ".weights")}
        for source, ckpt in ckpts.items():
            trainer.save_checkpoint(ckpt, weights_only=source == "weights_only")
        result["val_current"] = trainer.validate(module, verbose=False)[0]["val_loss"]
        full = engine_of(trainer.strategy.model).model_state_dict(trainer.strategy.model, "full", "cpu")
        trainer2 = _trainer(cfg, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2)
        for source, ckpt in ckpts.items():
            fresh = SyncModule(n_samples=64)
            result[f"{source}_val"] = trainer2.validate(fresh, ckpt_path=str(ckpt), verbose=False)[0]["val_loss"]
            result[f"{source}_test"] = trainer2.test(fresh, ckpt_path=str(ckpt), verbose=False)[0]["test_loss"]
            preds = trainer2.predict(fresh, ckpt_path=str(ckpt))
            if trainer.global_rank == 0:
                net = Net()
                net.load_state_dict({k.removeprefix("net."): v for k, v in full.items()})
                x = next(iter(fresh.val_dataloader()))[0]
                result[f"{source}_predict_matches_plain_model"] = bool(torch.allclose(preds[0], net(x), atol=1e-6))
    elif case == "groups":
        module = GroupsModule(n_samples=64, **cfg.get("module", {}))
        losses: list[float] = []

        class Record(Callback):
            def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
                losses.append(float(args[1]["loss"] if isinstance(args[1], dict) else args[1]))

        trainer = _trainer(cfg, max_epochs=4, callbacks=[Record()], limit_val_batches=0)
        trainer.fit(module)
        groups = trainer.optimizers[0].param_groups
        result.update(losses=losses, steps=trainer.global_step, groups=[len(g["params"]) for g in groups])
        model = trainer.strategy.model
        if cfg.get("strategy") == "reference":
            weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
        else:
            weights = engine_of(model).model_state_dict(model, "full", "cpu")
        if trainer.global_rank == 0:
            torch.save({k.removeprefix("net."): v for k, v in weights.items()}, out / "weights.pt")
    elif case == "callbacks":
        module = SyncModule(n_samples=64)
        ckpt_dir = out / "ckpts"
        callbacks = [
            ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=1, mode="min"),
            EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0),  # any epoch "fails to improve"
            LearningRateMonitor(logging_interval="step"),
        ]
        trainer = _trainer(
            cfg,
            max_epochs=10,
            callbacks=callbacks,
            limit_val_batches=2,
            enable_checkpointing=True,
            logger=CSVLogger(out / "logs", name="run", version=0),
            log_every_n_steps=1,
        )
        trainer.fit(module)
        best = callbacks[0].best_model_path
        result.update(
            epochs_run=trainer.current_epoch,
            stopped=bool(callbacks[1].stopped_epoch),
            best=str(best),
            best_score=float(callbacks[0].best_model_score),
            lr_logged="lr-AdamW" in (out / "logs" / "run" / "version_0" / "metrics.csv").read_text(),
        )
        # the best checkpoint loads: validating from it gives the score it was kept for
        result["best_val_loss"] = trainer.validate(module, ckpt_path=best, verbose=False)[0]["val_loss"]
        write_json(out, f"rank{trainer.global_rank}_best.json", {"best": str(best)})
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    dump_replicated(out, rank, trainer.strategy.model)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    if rank == 0:
        write_json(out, "rank0.json", result)
    leave()


if __name__ == "__main__":
    main()
