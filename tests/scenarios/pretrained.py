"""Pretrained Hugging Face weights into the shards: a tiny Llama from ``save_pretrained`` (several files) loaded by
every rank through ``pretrained_weights``, through the Trainer's or Fabric's door, then fine-tuned.

Usage: python pretrained.py CONFIG.json (ranks started by the scenario pool, torchrun-style). Config: ``weights``
(the directory), ``prefix``, ``engine`` (1/2), ``door`` ("trainer"/"fabric"), ``steps``, ``stage`` ("fit" or
"validate"), ``then_validate`` (Trainer: fresh validate runs after fit, without and with ``ckpt_path``, and from the
fit's checkpoint as ``pretrained_weights``), ``peft`` (LoRA on q/v), ``mmap_threshold`` (glibc's, for memory
measurements), ``gather`` (False: no full state dicts), ``strategy`` (more strategy arguments), ``reference``,
``config`` (where config.json is, when ``weights`` is a URL),
``expect_error``.

Rank 0 writes ``final.pt``: the file's tensors as loaded (gathered full state dict before training), the weights
after ``steps`` steps, and a reference trained in the same process from ``from_pretrained`` on the whole batch.
Every rank writes ``rankN.json``: held elements, the rotary ``inv_freq`` check, peak memory, losses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import transformers
from common import QUIET_TRAINER, PeakSampler, dump_replicated, load_config, write_json
from torch.utils.data import DataLoader
from train import leave

from lightning_gaudi_fsdp.engine.base import of as engine_of

LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
BATCH, SEQ = 4, 16


def tokens(cfg: dict[str, Any], vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (cfg.get("steps", 3), BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def build(cfg: dict[str, Any]) -> torch.nn.Module:
    config = transformers.LlamaConfig.from_pretrained(cfg.get("config", cfg["weights"]))
    model: torch.nn.Module = transformers.LlamaForCausalLM(config)
    if cfg.get("peft"):
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def strategy_args(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        **cfg.get("strategy", {}),
        "auto_wrap_policy": [LAYER],
        "fsdp_version": cfg.get("engine", 1),
        "pretrained_weights": cfg["weights"],
        "pretrained_prefix": cfg.get("prefix", ""),
    }


def held(strategy: Any, model: torch.nn.Module) -> int:
    return strategy._engine.held_elements(model)


def rotary_ok(model: torch.nn.Module, cfg: dict[str, Any]) -> bool:
    config = transformers.LlamaConfig.from_pretrained(cfg.get("config", cfg["weights"]))
    expected = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config).inv_freq
    found = [b for n, b in model.named_buffers() if n.endswith("rotary_emb.inv_freq")]
    return bool(found) and all(torch.equal(b, expected) for b in found)


def reference(cfg: dict[str, Any], data: torch.Tensor) -> dict[str, Any]:
    model = transformers.LlamaForCausalLM.from_pretrained(cfg["weights"], dtype=torch.float32)
    with torch.no_grad():
        val_loss = float(model(input_ids=data[0], labels=data[0]).loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in data:
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "losses": losses, "val_loss": val_loss}


class FineTune(L.LightningModule):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.model: torch.nn.Module | None = None
        self.info: dict[str, Any] = {}
        self.sampler: PeakSampler | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build(self.cfg)
            self.info["meta_after_configure_model"] = all(p.is_meta for p in self.model.parameters())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        rank, world = self.trainer.global_rank, self.trainer.world_size
        mine = batch[0][rank::world]
        loss = self.model(input_ids=mine, labels=mine, use_cache=False).loss
        self.info.setdefault("losses", []).append(float(loss))
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        rank, world = self.trainer.global_rank, self.trainer.world_size
        mine = batch[0][rank::world]
        self.info.setdefault("val_losses", []).append(float(self.model(input_ids=mine, labels=mine).loss))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(tokens(self.cfg, self._vocab()), batch_size=None, collate_fn=lambda b: [b])

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0][:1]).logits.sum()

    val_dataloader = test_dataloader = predict_dataloader = train_dataloader

    def _vocab(self) -> int:
        return transformers.LlamaConfig.from_pretrained(self.cfg.get("config", self.cfg["weights"])).vocab_size

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def loaded_state(cfg: dict[str, Any], model: torch.nn.Module, rank: int, strip: str) -> dict[str, torch.Tensor]:
    state = engine_of(model).model_state_dict(model, "full", "cpu")
    return {k.removeprefix(strip): v.clone() for k, v in state.items()} if rank == 0 else {}


def run_trainer(cfg: dict[str, Any], out: Path) -> None:
    from lightning_gaudi_fsdp import GaudiFSDPStrategy

    module = FineTune(cfg)
    strategy = GaudiFSDPStrategy(**strategy_args(cfg))
    loaded: dict[str, torch.Tensor] = {}
    quiet = {**QUIET_TRAINER, "limit_val_batches": 1 if cfg.get("stage") == "validate" else 0}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=cfg.get("steps", 3),
        callbacks=[Probe(module.info, loaded, cfg)],
        **quiet,
    )
    sampler = PeakSampler()
    with sampler:
        trainer.fit(module) if cfg.get("stage", "fit") == "fit" else trainer.validate(module)
    rank = trainer.global_rank
    dump_replicated(out, rank, trainer.strategy.model)
    final = loaded_state(cfg, trainer.strategy.model, rank, "model.")
    if cfg.get("then_validate"):
        # a fresh module and Trainer: the validate stage loads the file again; with ckpt_path the checkpoint wins
        trainer.save_checkpoint(out / "fit.ckpt")
        # and a checkpoint of this strategy as pretrained_weights (its keys are the LightningModule's: no prefix)
        from_checkpoint = {"weights": str(out / "fit.ckpt"), "prefix": ""}
        runs = (
            ("validate", None, {}),
            ("resumed", str(out / "fit.ckpt"), {}),
            ("from_checkpoint", None, from_checkpoint),
            ("test", None, {}),  # every stage wraps, and loads the file, the same way
            ("predict", None, {}),
        )
        for tag, ckpt_path, source in runs:
            fresh, state = FineTune(cfg), {}
            validator = L.Trainer(
                accelerator="cpu",
                devices=2,
                strategy=GaudiFSDPStrategy(**strategy_args({**cfg, **source})),
                callbacks=[Probe(fresh.info, {}, cfg, after_restore=state)],
                **{**QUIET_TRAINER, "limit_val_batches": 1, "limit_test_batches": 1, "limit_predict_batches": 1},
            )
            stage = {"test": validator.test, "predict": validator.predict}.get(tag, validator.validate)
            stage(fresh, ckpt_path=ckpt_path)
            module.info[f"{tag}_losses"] = fresh.info.get("val_losses")
            module.info[f"{tag}_meta_after_configure_model"] = fresh.info.get("meta_after_configure_model")
            if rank == 0:
                torch.save(state, out / f"{tag}.pt")
    finish(cfg, out, rank, module.info, sampler, loaded, final)


class Probe(L.Callback):
    """At the start of the stage (weights loaded, before any step): what the ranks hold, gathered on rank 0;
    ``after_restore``: the weights once ``ckpt_path`` was restored (at the first validation batch)."""

    def __init__(
        self, info: dict[str, Any], loaded: dict[str, Any], cfg: dict[str, Any], after_restore: dict | None = None
    ) -> None:
        self.info, self.loaded, self.cfg, self.after_restore = info, loaded, cfg, after_restore

    def _probe(self, trainer: L.Trainer) -> None:
        if "held" in self.info:
            return
        model = trainer.strategy.model
        self.info.update(held=held(trainer.strategy, model), rotary_ok=rotary_ok(model, self.cfg))
        self.loaded.update(loaded_state(self.cfg, model, trainer.global_rank, "model."))

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._probe(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._probe(trainer)

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.after_restore is not None and not self.after_restore:
            state = loaded_state(self.cfg, trainer.strategy.model, trainer.global_rank, "model.")
            self.after_restore.update(state or {"rank": trainer.global_rank})

    on_test_batch_start = on_predict_batch_start = on_validation_batch_start


def run_fabric(cfg: dict[str, Any], out: Path) -> None:
    from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=GaudiFSDPStrategy(**strategy_args(cfg)))
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    fabric.seed_everything(7)
    info: dict[str, Any] = {}
    sampler = PeakSampler()
    with sampler:
        with fabric.init_module():
            model = build(cfg)
        info["meta_after_configure_model"] = all(p.is_meta for p in model.parameters())
        model = fabric.setup_module(model)
    info.update(held=held(fabric.strategy, model), rotary_ok=rotary_ok(model, cfg))
    loaded = loaded_state(cfg, model._forward_module, rank, "") if cfg.get("gather", True) else {}
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
    for batch in tokens(cfg, transformers.LlamaConfig.from_pretrained(cfg.get("config", cfg["weights"])).vocab_size):
        mine = batch[rank::world]
        loss = model(input_ids=mine, labels=mine, use_cache=False).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        info.setdefault("losses", []).append(float(loss))
    dump_replicated(out, rank, model._forward_module)
    final = loaded_state(cfg, model._forward_module, rank, "") if cfg.get("gather", True) else {}
    finish(cfg, out, rank, info, sampler, loaded, final)


def finish(
    cfg: dict[str, Any],
    out: Path,
    rank: int,
    info: dict[str, Any],
    sampler: PeakSampler,
    loaded: dict[str, torch.Tensor],
    final: dict[str, torch.Tensor],
) -> None:
    info.update(rank=rank, peak_added=sampler.peak - sampler.base)
    if rank == 0:
        data = tokens(cfg, transformers.LlamaConfig.from_pretrained(cfg.get("config", cfg["weights"])).vocab_size)
        ref = reference(cfg, data) if cfg.get("reference", True) and not cfg.get("peft") else None
        torch.save({"loaded": loaded, "final": final, "reference": ref}, out / "final.pt")
    write_json(out, f"rank{rank}.json", info)
    leave()


def main() -> None:
    cfg = load_config()
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    if cfg.get("mmap_threshold"):
        # glibc: blocks above this size are mmap'ed and go back to the OS when freed (a fixed threshold, as
        # MALLOC_MMAP_THRESHOLD_ sets in a fresh process), so the memory peak counts live tensors, not glibc's cache
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, int(cfg["mmap_threshold"]))  # M_MMAP_THRESHOLD
    torch.manual_seed(7)
    try:
        (run_fabric if cfg.get("door") == "fabric" else run_trainer)(cfg, out)
    except Exception as err:
        if not cfg.get("expect_error"):
            raise
        write_json(
            out,
            f"error{torch.distributed.get_rank() if torch.distributed.is_initialized() else 0}.json",
            {"type": type(err).__name__, "message": str(err)},
        )
        leave()


if __name__ == "__main__":
    main()
