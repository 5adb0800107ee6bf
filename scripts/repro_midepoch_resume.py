"""Minimal reproduction, for Lightning upstream: resuming from a checkpoint with torchdata's ``StatefulDataLoader``
over a shuffled ``DistributedSampler`` is exact only in the first epoch.

Plain Lightning (no lightning-gaudi-fsdp), one CPU process, a few seconds: ``python scripts/repro_midepoch_resume.py``
(needs ``torchdata``). A run of 3 epochs of 8 steps saves a checkpoint at steps 3, 11 and 8 (ModelCheckpoint,
``every_n_train_steps``); a new Trainer resumes from each and prints which samples it trains next, against what the
uninterrupted run trained there. Exits 1 if any resume differs. On Lightning 2.6.6 + torchdata 0.11:

- step 3 (first epoch, mid-epoch): exact;
- step 11 (second epoch, mid-epoch): the rest of the epoch is taken from the FIRST epoch's order;
- step 8 (after the first epoch's last batch): the second epoch is skipped (the run trains the third epoch's order
  next, and with ``max_epochs`` it trains one epoch fewer).

Cause: ``FitLoop.setup_data`` applies the saved loader state (``_load_combined_loader_states``) and calls
``iter()`` on the data fetcher before ``FitLoop.on_advance_start`` calls ``_set_sampler_epoch`` and before
``FitLoop.reset`` decides the resumed epoch. ``StatefulDataLoader``'s ``BatchSampler`` iterator calls
``iter(sampler)`` at once, so the ``DistributedSampler`` draws its permutation with the epoch it has at that moment
(0, a new sampler's); ``set_epoch`` comes too late, and ``TrainingEpochLoop.on_run_start`` does not call ``iter()``
again while resuming. A position saved after an epoch's last batch (``_num_yielded == len``,
``_iterator_finished=False``, since the sized loader's fetcher never asked for one more batch) is applied to the epoch
that ``FitLoop.reset`` has already moved on to: that epoch yields nothing and ends at once.
"""

from __future__ import annotations

import sys
import tempfile

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

SAMPLES, BATCH = 16, 2  # 8 steps an epoch


class Numbers(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.trained: dict[int, list[int]] = {}  # global step -> sample indices

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.trained[self.global_step] = batch.flatten().int().tolist()
        return self.layer(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> StatefulDataLoader:
        sampler = DistributedSampler(Numbers(), num_replicas=1, rank=0, shuffle=True)  # as with N ranks
        return StatefulDataLoader(Numbers(), batch_size=BATCH, sampler=sampler)


def trainer(**kwargs: object) -> L.Trainer:
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(accelerator="cpu", devices=1, max_epochs=3, **quiet, **kwargs)  # type: ignore[arg-type]


def resumes(saves: tuple[int, ...] = (3, 11, 8), callbacks: tuple[L.Callback, ...] = ()) -> dict[int, bool]:
    """For each step of ``saves``: whether resuming from its checkpoint (with ``callbacks``) trains what the
    uninterrupted run trained from there."""
    exact = {}
    with tempfile.TemporaryDirectory() as tmp:
        straight = Model()
        savers = [  # one ModelCheckpoint per step, each keeping every checkpoint it writes
            ModelCheckpoint(dirpath=tmp, filename=f"at-{s}-{{step}}", every_n_train_steps=s, save_top_k=-1)
            for s in saves
        ]
        trainer(callbacks=savers).fit(straight)
        for step in saves:
            resumed = Model()
            fit = trainer(enable_checkpointing=False, callbacks=list(callbacks))
            fit.fit(resumed, ckpt_path=f"{tmp}/at-{step}-step={step}.ckpt")
            steps = sorted(resumed.trained)
            exact[step] = resumed.trained == {s: v for s, v in straight.trained.items() if s >= step}
            print(
                f"resumed from the checkpoint of step {step}: {'exact' if exact[step] else 'DIFFERS'}; "
                f"next batch {resumed.trained[steps[0]]} (uninterrupted: {straight.trained[step]}); "
                f"{len(steps)} steps trained (uninterrupted: {len(straight.trained) - step})",
                file=sys.stderr,
            )
    return exact


def main() -> int:
    return 0 if all(resumes().values()) else 1


if __name__ == "__main__":
    sys.exit(main())
