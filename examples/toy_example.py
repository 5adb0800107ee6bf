"""Intel's FSDP toy example as a LightningModule on GaudiFSDPStrategy.

    python examples/toy_example.py                 # 2 Gaudi cards, or 2 CPU processes when no Gaudi is present
    python examples/toy_example.py --ws 8 --iterations 10 -v

One bias-free 3x3 linear layer, plain SGD, and one input row per rank. Lightning launches the processes, picks the
``hccl`` backend on Gaudi (``gloo`` on CPU) and forces eager mode; there is no hand-written process-group code left.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_gaudi_fsdp import GaudiFSDPStrategy, gaudi


class RankRow(Dataset):
    """Every rank draws the same 8x3 random matrix and trains on its own row of it, as Intel's example does."""

    def __init__(self, iterations: int) -> None:
        self.rows = torch.rand(8, 3, generator=torch.Generator().manual_seed(0))
        self.iterations = iterations

    def __len__(self) -> int:
        return self.iterations

    def __getitem__(self, i: int) -> torch.Tensor:
        rank = int(os.environ.get("LOCAL_RANK", "0")) + int(os.environ.get("NODE_RANK", "0"))
        return self.rows[rank % len(self.rows)]


class ToyModel(L.LightningModule):
    def __init__(self, iterations: int = 5) -> None:
        super().__init__()
        self.lin1 = torch.nn.Linear(3, 3, bias=False)
        self.iterations = iterations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin1(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self(batch).float().sum()
        self.log("loss", loss, prog_bar=True)
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RankRow(self.iterations), batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description="FSDP toy example on Intel Gaudi (CPU processes without one)")
    parser.add_argument("--iterations", type=int, default=5, metavar="I", help="iterations (default: 5)")
    parser.add_argument("--ws", type=int, default=2, help="world size: number of processes (default: 2)")
    parser.add_argument("-v", "--verbose", action="store_true", help="verbose torch.distributed logging")
    args = parser.parse_args()
    if args.verbose:
        # Must be in the environment before the launcher starts the other ranks.
        os.environ.update(TORCH_CPP_LOG_LEVEL="INFO", TORCH_DISTRIBUTED_DEBUG="DETAIL", TORCH_SHOW_CPP_STACKTRACES="1")
    accelerator = "hpu" if gaudi.is_available() else "cpu"
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=args.ws,
        strategy=GaudiFSDPStrategy(),
        max_steps=args.iterations,
        max_epochs=1,  # one pass over RankRow is the run; without it the progress bar shows "Epoch 0/-2"
        use_distributed_sampler=False,
        logger=False,  # Intel's toy example prints its loss per rank; the LLaMA example shows Lightning's logger
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    if trainer.is_global_zero:
        where = "Intel Gaudi (hccl)" if accelerator == "hpu" else "CPU processes (gloo), no Gaudi found"
        print(f"Running on {where} with {args.ws} processes", flush=True)
    model = ToyModel(args.iterations)
    trainer.fit(model)
    print(f"rank {trainer.global_rank}: All done", flush=True)


if __name__ == "__main__":
    main()
