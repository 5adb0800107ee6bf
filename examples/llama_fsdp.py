"""Train a LLaMA-style causal language model with FSDP from a LightningCLI config.

    python examples/llama_fsdp.py fit --config examples/configs/llama_cpu_rehearsal.yaml
    python examples/llama_fsdp.py fit --config examples/configs/llama_gaudi_8x.yaml      # 8 Gaudi cards

The model is ``transformers``' ``LlamaForCausalLM`` built from a config (no weights are downloaded). The data is
generated: each sequence follows ``token[t + 1] = (token[t] + stride) % vocab`` with a per-sequence stride, so the
loss falls visibly within a minute on CPU. ``trainer.accelerator: auto`` picks Gaudi when the Habana bridge sees a
device, and CPU processes otherwise (the run says which).

Throughput is logged by ``lightning_gaudi_fsdp.throughput.ThroughputMonitor`` (``train/items_per_sec`` = tokens/s,
``train/device/mfu`` on Gaudi 2 and Gaudi 3) from the model FLOPs the module reports per batch, and printed at the end.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader, Dataset

from lightning_gaudi_fsdp import gaudi
from lightning_gaudi_fsdp.throughput import ThroughputMonitor, summary


class StrideSequences(Dataset):
    """Deterministic sequences a small model can learn: a random start and a random stride per sample."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (num_samples, 1), generator=g)
        stride = torch.randint(1, 8, (num_samples, 1), generator=g)
        self.tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


def model_flops(tokens: torch.Tensor, matmul_params: int, layers: int, hidden: int, backward: bool = True) -> int:
    """Model FLOPs of one batch of ``tokens`` (inputs and the shifted targets: ``seq + 1`` columns), PaLM's accounting
    with activation recomputation not counted: per token ``6 * N`` (forward and backward matmuls, ``N`` every parameter
    but the input embedding) + ``12 * layers * hidden * seq`` (attention); a third of it without backward."""
    batch, seq = tokens.shape[0], tokens.shape[1] - 1
    per_token = 6 * matmul_params + 12 * layers * hidden * seq
    return batch * seq * per_token // (1 if backward else 3)


class StrideDataModule(L.LightningDataModule):
    def __init__(
        self, num_samples: int = 2048, seq_len: int = 64, vocab_size: int = 128, batch_size: int = 8, seed: int = 0
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        data = StrideSequences(h.num_samples, h.seq_len, h.vocab_size, h.seed)
        return DataLoader(data, batch_size=h.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        h = self.hparams
        data = StrideSequences(max(h.batch_size * 4, 32), h.seq_len, h.vocab_size, h.seed + 1)
        return DataLoader(data, batch_size=h.batch_size, drop_last=True)


class LlamaLM(L.LightningModule):
    """LLaMA decoder stack; ``configure_model`` builds it so that FSDP can wrap each ``LlamaDecoderLayer``."""

    def __init__(
        self,
        vocab_size: int = 128,
        hidden_size: int = 64,
        intermediate_size: int = 176,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        max_position_embeddings: int = 256,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None
        self.flops_per_batch = 0  # read by ThroughputMonitor after each batch (model FLOPs of this rank's batch)
        self._matmul_params = 0

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import LlamaConfig, LlamaForCausalLM

        h = self.hparams
        config = LlamaConfig(
            vocab_size=h.vocab_size,
            hidden_size=h.hidden_size,
            intermediate_size=h.intermediate_size,
            num_hidden_layers=h.num_hidden_layers,
            num_attention_heads=h.num_attention_heads,
            num_key_value_heads=h.num_key_value_heads,
            max_position_embeddings=h.max_position_embeddings,
            tie_word_embeddings=False,
        )
        self.model = LlamaForCausalLM(config)
        # every parameter but the input embedding (a lookup, not a matmul), counted before FSDP shards them
        self._matmul_params = sum(p.numel() for p in self.model.parameters()) - h.vocab_size * h.hidden_size

    def _loss(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.hparams
        self.flops_per_batch = model_flops(
            tokens, self._matmul_params, h.num_hidden_layers, h.hidden_size, self.training
        )
        logits = self.model(input_ids=tokens[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(tokens)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, tokens: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(tokens), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        h = self.hparams
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            (no_decay if param.ndim < 2 or "norm" in name else decay).append(param)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": h.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=h.learning_rate,
            betas=(0.9, 0.95),
        )
        total = max(self.trainer.estimated_stepping_batches, h.warmup_steps + 1)

        def schedule(step: int) -> float:
            if step < h.warmup_steps:
                return (step + 1) / h.warmup_steps
            progress = (step - h.warmup_steps) / max(1, total - h.warmup_steps)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LossSummary(Callback):
    """On rank 0 at the end of training: the first and last loss (the example's test reads this line), a loss-curve
    PNG next to the CSV log, and where the run left its checkpoints with the commands to look at them."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *_: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not self.losses:
            return
        first, last = self.losses[0], self.losses[-1]
        print(f"loss: first={first:.4f} last={last:.4f} steps={trainer.global_step}", flush=True)
        self._print_throughput(trainer)
        log_dir = getattr(trainer.logger, "log_dir", None)  # not trainer.log_dir: it broadcasts, rank 0 alone here
        if log_dir is not None:
            print(f"metrics (CSV): {log_dir}/metrics.csv", flush=True)
            self._plot(f"{log_dir}/loss.png")
        checkpoint = trainer.checkpoint_callback
        path = getattr(checkpoint, "last_model_path", "") or getattr(checkpoint, "best_model_path", "")
        if path:
            print(f"checkpoint ({trainer.strategy._state_dict_type}, committed before the run exits): {path}")
            print(f"  lightning-gaudi-fsdp inspect {path}")
            print(f"  lightning-gaudi-fsdp convert {path} model.ckpt --to full", flush=True)

    @staticmethod
    def _print_throughput(trainer: L.Trainer) -> None:
        monitor = next((c for c in trainer.callbacks if isinstance(c, ThroughputMonitor)), None)
        # what ThroughputMonitor logged last (rank 0)
        line = summary(trainer.logged_metrics, getattr(monitor, "peak", None), trainer.world_size, prefix="train/")
        if line:
            print(line, flush=True)

    def _plot(self, path: str) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("loss curve: skipped (pip install matplotlib)", flush=True)
            return
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(self.losses) + 1), self.losses)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title("LLaMA FSDP rehearsal")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        print(f"loss curve: {path}", flush=True)


class GaudiCLI(LightningCLI):
    """``trainer.accelerator: auto`` means Gaudi when present, CPU processes otherwise."""

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        if config.trainer.accelerator == "auto":
            config.trainer.accelerator = "hpu" if gaudi.is_available() else "cpu"
            where = "Intel Gaudi" if config.trainer.accelerator == "hpu" else "CPU processes (no Gaudi found)"
            if rank_zero_only.rank == 0:  # launched ranks re-run this script: say it once
                print(f"accelerator=auto: training on {where}", flush=True)


def main(args: list[str] | None = None) -> None:
    GaudiCLI(
        LlamaLM,
        StrideDataModule,
        trainer_defaults={
            "callbacks": [
                LossSummary(),
                # tokens/s and, on Gaudi, MFU: every batch holds batch_size sequences of seq_len predicted tokens
                ThroughputMonitor(batch_size_fn=len, length_fn=lambda tokens: tokens[:, 1:].numel(), window_size=10),
            ]
        },
        args=args,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
