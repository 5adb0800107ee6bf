"""Train, save sharded and resume with the INSTALLED package (run by scripts/check_wheel.sh from outside the tree).

``python wheel_smoke.py train DIR``: 2 CPU processes train one epoch and save a sharded ``DIR/last.ckpt``; rank 0
writes the model's output on a fixed input after training to ``DIR/trained.json``.
``python wheel_smoke.py resume DIR``: 2 CPU processes resume from ``DIR/last.ckpt`` for a second epoch; at the start
of training the output on the same input must equal the saved one bitwise, and the run must end at step 2 x epoch.
Exits non-zero on any difference. Lightning's launcher re-runs this file (``sys.argv``) for rank 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gaudi_fsdp
from lightning_gaudi_fsdp import GaudiFSDPStrategy

FEATURES = 16
PROBE = torch.linspace(-1.0, 1.0, 4 * FEATURES).reshape(4, FEATURES)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(FEATURES, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Regression(L.LightningModule):
    def __init__(self, directory: str, phase: str) -> None:
        super().__init__()
        self.directory, self.phase = Path(directory), phase
        self.net = nn.Sequential(Block(), Block(), nn.Linear(FEATURES, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _probe(self) -> list[float]:
        with torch.no_grad():  # through the sharded root, which gathers the parameters (every rank calls it)
            return self.trainer.strategy.model(PROBE.to(self.device)).flatten().tolist()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_start(self) -> None:
        if self.phase == "resume":
            trained = json.loads((self.directory / "trained.json").read_text())
            resumed = self._probe()
            if resumed != trained:
                raise SystemExit(f"resume: the weights differ from the saved ones: {resumed} != {trained}")

    def on_train_end(self) -> None:
        probe = self._probe()
        if self.phase == "train" and self.global_rank == 0:
            (self.directory / "trained.json").write_text(json.dumps(probe))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, FEATURES, generator=g), torch.randn(64, 1, generator=g))
        return DataLoader(data, batch_size=8)


def main(phase: str, directory: str) -> None:
    if "site-packages" not in lightning_gaudi_fsdp.__file__:
        raise SystemExit(f"lightning_gaudi_fsdp was imported from {lightning_gaudi_fsdp.__file__}, not the wheel")
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=GaudiFSDPStrategy(state_dict_type="sharded", auto_wrap_policy={Block}),
        max_epochs=1 if phase == "train" else 2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0)],
    )
    trainer.fit(Regression(directory, phase), ckpt_path=None if phase == "train" else str(Path(directory, "last.ckpt")))
    expected = 4 if phase == "train" else 8  # 64 samples / 2 ranks / batch 8 per epoch
    if trainer.global_step != expected:
        raise SystemExit(f"{phase}: ended at step {trainer.global_step}, expected {expected}")
    if trainer.global_rank == 0:
        print(f"wheel smoke {phase}: step {trainer.global_step}, package {lightning_gaudi_fsdp.__file__}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
