"""Fine-tune a tiny Hugging Face Llama (optionally with PEFT LoRA adapters over its frozen base) with the Trainer,
save the result in each requested format, and record what a user would check.

Writes (rank 0): ``initial.pt`` (full weights before the first step), ``final.pt`` (full weights and optimizer state
after training), and every rank ``rank<r>.json`` (frozen parameters that got a gradient, losses).
Usage: python peft_train.py CONFIG.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import QUIET_TRAINER, dump_replicated, load_config, set_state_dict_type, write_json
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, DistributedSampler

from lightning_gaudi_fsdp import GaudiFSDPStrategy
from lightning_gaudi_fsdp.adapters.fsdp1_internals import clean_name
from lightning_gaudi_fsdp.engine.base import of as engine_of

TINY_LLAMA = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
SEQ = 12
DECODER_LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"


def build_model(lora: bool) -> torch.nn.Module:
    """The same initial model in every process (seeded here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**LORA))
    return model


class FineTune(L.LightningModule):
    def __init__(self, lora: bool = True, batch_size: int = 2, n_samples: int = 8, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_model(self.hparams.lora)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch, use_cache=False).loss

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, TINY_LLAMA["vocab_size"], (self.hparams.n_samples, SEQ), generator=_gen())
        sampler = DistributedSampler(tokens, shuffle=False) if torch.distributed.is_initialized() else None
        return DataLoader(tokens, batch_size=self.hparams.batch_size, sampler=sampler, shuffle=False)

    def configure_optimizers(self) -> Any:
        model = self.trainer.model if self.trainer.model is not None else self
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=self.hparams.lr)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


class Probe(Callback):
    """``save``: ``{format: path}`` written after the optimizer step of ``save_at`` (where ModelCheckpoint saves),
    with the full weights of that moment in ``at_save.pt``."""

    def __init__(self, out: Path, save: dict[str, str], save_at: int) -> None:
        self.out, self.frozen_with_grad, self.losses = out, set(), []
        self.save, self.save_at = save, save_at

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = _full_weights(trainer, pl_module)
        if trainer.global_rank == 0:
            torch.save(state, self.out / "initial.pt")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        for name, p in trainer.strategy.model.named_parameters():
            if not p.requires_grad and p.grad is not None:
                self.frozen_with_grad.add(clean_name(name))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *a: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        if trainer.global_step != self.save_at or not self.save:
            return
        configured = trainer.strategy._config.state_dict_type
        for fmt, path in self.save.items():  # one run, each format
            set_state_dict_type(trainer.strategy, fmt)
            trainer.save_checkpoint(path)
        set_state_dict_type(trainer.strategy, configured)
        state = _full_weights(trainer, pl_module)
        if trainer.global_rank == 0:
            torch.save(state, self.out / "at_save.pt")


def _full_weights(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, torch.Tensor]:
    if trainer.world_size == 1 and not isinstance(trainer.strategy, GaudiFSDPStrategy):
        return {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
    return engine_of(trainer.strategy.model).model_state_dict(
        trainer.strategy.model, "full", trainer.strategy.root_device.type
    )


def main() -> None:
    cfg = load_config()
    out = Path(cfg["out"])
    L.seed_everything(7)
    module = FineTune(**cfg.get("module", {}))
    trainer_kwargs: dict[str, Any] = dict(QUIET_TRAINER, accelerator="cpu", max_steps=cfg.get("max_steps", 2))
    if cfg.get("strategy") == "reference":
        trainer_kwargs.update(devices=1, strategy="auto")
    else:
        strategy = {"auto_wrap_policy": [DECODER_LAYER], **cfg.get("strategy", {})}
        trainer_kwargs.update(devices=cfg.get("devices", 2), strategy=GaudiFSDPStrategy(**strategy))
    probe = Probe(out, cfg.get("save", {}), cfg.get("save_at", 0))
    trainer = L.Trainer(callbacks=[probe], **trainer_kwargs)
    trainer.fit(module, ckpt_path=cfg.get("ckpt_path"))
    rank = trainer.global_rank
    write_json(out, f"rank{rank}.json", {"frozen_with_grad": sorted(probe.frozen_with_grad), "losses": probe.losses})
    dump_replicated(out, rank, trainer.strategy.model)
    weights = _full_weights(trainer, module)
    if cfg.get("strategy") == "reference":
        optim = trainer.optimizers[0].state_dict()
    else:
        model, device = trainer.strategy.model, trainer.strategy.root_device.type
        optim = engine_of(model).optimizer_state_dict(model, trainer.optimizers[0], "full", device, rank)
    if rank == 0:
        torch.save({"weights": weights, "optimizer": optim, "step": trainer.global_step}, out / "final.pt")
    from train import leave

    leave()


if __name__ == "__main__":
    main()
