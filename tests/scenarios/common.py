"""Model, data and probes shared by the multi-process scenario scripts (each run in its own subprocess)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

FEATURES = 16
# What every scenario's Trainer leaves out (no logger, bar, summary, sanity check, validation or Lightning's sampler).
QUIET_TRAINER: dict[str, Any] = dict(
    logger=False,  # a launched run checks weights, steps and files; each case that needs the logger sets it back
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    limit_val_batches=0,
    use_distributed_sampler=False,
)

# Lightning's own defaults for what QUIET_TRAINER leaves out (``"trainer": LIGHTNING_DEFAULTS`` in a scenario's config
# runs the Trainer as a plain ``Trainer(strategy=..., default_root_dir=...)``: its logger, a new ``version_N`` per run,
# its ModelCheckpoint, the progress bar, the sanity check and validation).
LIGHTNING_DEFAULTS: dict[str, Any] = {
    name: inspect.signature(L.Trainer.__init__).parameters[name].default for name in QUIET_TRAINER
}


class Block(nn.Module):
    def __init__(self, width: int = FEATURES) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.fc(x)))


class Net(nn.Module):
    def __init__(self, depth: int = 3, width: int = FEATURES, buffer: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(FEATURES, width) if width != FEATURES else nn.Identity()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)
        # buffer: a persistent buffer the forward reads (scales the input), outside any block
        self.register_buffer("scale", torch.linspace(0.5, 1.5, FEATURES) if buffer else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.proj(x if self.scale is None else x * self.scale)))


def wrap_blocks(net: Net) -> None:
    """``wrap()`` each block by hand, as Lightning's FSDP docs do with the hidden layers: ``proj`` and the output layer
    ``head`` stay outside the user's units (inside the strategy's wrapping context each block becomes a unit)."""
    from torch.distributed.fsdp.wrap import wrap

    for i, block in enumerate(net.blocks):
        net.blocks[i] = wrap(block)


class RandomRegression(Dataset):
    def __init__(self, n: int = 256, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class IndexedRegression(RandomRegression):
    """``RandomRegression`` whose items also carry their index, so that a run can say which samples each step trained
    on."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:  # type: ignore[override]
        return self.x[i], self.y[i], i


class Module(L.LightningModule):
    def __init__(
        self,
        lr: float = 0.01,
        optimizer: str = "adamw",
        scheduler: bool = True,
        batch_size: int = 4,
        depth: int = 3,
        meta_init: bool = False,
        rank_dependent_init: bool | str = False,
        buffer: bool = False,
        n_samples: int = 256,
        width: int = FEATURES,
        fail: dict | None = None,
        manual_wrap: bool = False,
        manual: bool = False,
        manual_clip_norm: float | None = None,
        manual_bypass_root: bool = False,
        stateful_loader: bool = False,
        shuffle: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = not manual
        self.net: nn.Module | None = None if meta_init else Net(depth, width, buffer)
        if rank_dependent_init and self.net is not None:
            # True: every parameter 0.01 * (rank + 1); "offset": every parameter and buffer as seeded, plus 0.01 * rank
            rank = int(os.environ.get("LOCAL_RANK", "0"))
            with torch.no_grad():
                if rank_dependent_init == "offset":
                    for t in (*self.net.parameters(), *self.net.buffers()):
                        t.add_(0.01 * rank)
                else:
                    for p in self.net.parameters():
                        p.fill_(0.01 * (rank + 1))
        self.seen_dtypes: dict[str, str] = {}
        self.configure_optimizers_calls = 0  # a hook with a side effect: Lightning must call it once per fit

    def _maybe_fail(self, where: str, step: int = 0) -> None:
        fails = self.hparams.fail if isinstance(self.hparams.fail, list) else [self.hparams.fail]
        rank = self.trainer.global_rank
        here = [f for f in fails if f and f["where"] == where and f["rank"] == rank and f.get("step", 0) == step]
        if not here:
            return
        fail = here[0]
        if fail.get("kind") == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fail.get("kind") == "hang":  # alive and stuck, as in a deadlock or a hung device call
            import time

            time.sleep(3600)
        raise RuntimeError(f"boom in {where} on rank {rank}")

    def configure_model(self) -> None:
        self._maybe_fail("configure_model")
        if self.net is None:
            with torch.device("meta"):
                self.net = Net(self.hparams.depth, self.hparams.width, self.hparams.buffer)
        if self.hparams.manual_wrap and self.net is not None:
            wrap_blocks(self.net)  # Lightning's pattern: wrap() inside configure_model (its model_sharded_context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._maybe_fail("training_step", batch_idx)
        x, y = batch[0], batch[1]  # and the samples' indices, from IndexedRegression
        out = self.net(x) if self.hparams.manual_bypass_root else self(x)
        # An fp32 op written outside the model: under "mixed" it must run in low precision.
        probe = x @ x.transpose(0, 1)
        self.seen_dtypes["training_step_matmul"] = str(probe.dtype)
        # The same op on float32 tensors made here: low precision only where autocast runs (the batch above may
        # already have been cast, which autocast or not leaves its matmul in low precision).
        fp32 = x.detach().float()
        self.seen_dtypes["training_step_fp32_matmul"] = str((fp32 @ fp32.transpose(0, 1)).dtype)
        self.seen_dtypes["target"] = str(y.dtype)
        # y.float(): under "bf16-true" Lightning converts the batch, and mse_loss's backward on torch 2.6-2.9
        # cannot mix dtypes
        loss = nn.functional.mse_loss(out.float(), y.float())
        self.log("train_loss", loss, sync_dist=True)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if self.hparams.manual_clip_norm is not None:
            self.clip_gradients(opt, gradient_clip_val=self.hparams.manual_clip_norm, gradient_clip_algorithm="norm")
        opt.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        return loss.detach()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y), sync_dist=True)

    def train_dataloader(self) -> DataLoader:
        # Lightning's own distributed sampler always shuffles training data; parity with one process on the
        # global batch needs rank r to see samples r, r + N, ... of each global batch, in order (``shuffle``: a new
        # order each epoch, as users have it, for runs compared with runs of as many ranks).
        data = IndexedRegression(self.hparams.n_samples)
        sampler = None
        if torch.distributed.is_initialized():
            sampler = DistributedSampler(data, shuffle=self.hparams.shuffle, seed=3)
        if not self.hparams.stateful_loader:
            return DataLoader(data, batch_size=self.hparams.batch_size, sampler=sampler, shuffle=False)
        # resumes mid-epoch: Lightning saves its position (state_dict) in checkpoints and gives it back on restore
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(data, batch_size=self.hparams.batch_size, sampler=sampler, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RandomRegression(64, seed=99), batch_size=self.hparams.batch_size)

    def configure_optimizers(self) -> Any:
        self.configure_optimizers_calls += 1
        params = self.trainer.model.parameters() if self.trainer.model is not None else self.parameters()
        if self.hparams.optimizer == "sgd":
            opt = torch.optim.SGD(params, lr=self.hparams.lr)
        elif self.hparams.optimizer == "sgd_momentum":
            opt = torch.optim.SGD(params, lr=self.hparams.lr, momentum=0.9)
        else:
            opt = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=0.01)
        if not self.hparams.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def load_config() -> dict[str, Any]:
    return json.loads(Path(sys.argv[1]).read_text())


def status_bytes(field: str) -> int:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``...) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def record_what_outlives(out: Path) -> None:
    """For a script that ends without ``os._exit``: at the very end of the interpreter's exit (the first ``atexit``
    hook runs last), write ``exit<rank>.json`` with whether the process group still exists and which threads of the
    package still run; anything left there can abort the process once the interpreter shuts down."""
    import atexit

    def record() -> None:
        ours = [t.name for t in threading.enumerate() if t.name.startswith(("lgf-", "checkpoint save"))]
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        group = torch.distributed.is_available() and torch.distributed.is_initialized()
        write_json(out, f"exit{rank}.json", {"process_group": group, "threads": ours})

    atexit.register(record)


def a_late_collective(seconds: float = 0.5) -> None:
    """End with a collective still finishing on gloo's worker thread: an all-reduce whose completion callback runs
    there for ``seconds`` while this thread returns as soon as the result is in (what a worker the scheduler pauses
    before it frees the work's tensors does by chance). A process that shuts Python down meanwhile aborts. Rank 0
    joins late, so on every other rank the work is still pending when the callback is attached (a callback attached
    to a finished work runs at once, on this thread)."""
    if torch.distributed.get_rank() == 0:
        time.sleep(0.3)
    tensor = torch.ones(1)
    future = torch.distributed.all_reduce(tensor, async_op=True).get_future()
    future.then(lambda _: time.sleep(seconds))
    future.wait()


def write_json(out: Path, name: str, data: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(out / name)


def dump_replicated(out: Path, rank: int, model: nn.Module) -> None:
    """Write ``replicated<rank>.pt``: every parameter and buffer of ``model`` that no rank holds a shard of (plain
    tensors: not an FSDP1 flat parameter or one of its original parameters, not a DTensor), by clean name. Such
    tensors are replicated, so they must be equal on every rank; the harness (``conftest.run_script``) compares the
    files of all ranks after every scenario that wrote them."""
    from torch.distributed.tensor import DTensor

    from lightning_gaudi_fsdp.adapters import fsdp1_internals

    sharded: set[int] = set()
    for unit in fsdp1_internals.units(model):
        sharded.add(id(unit.flat_param))
        sharded.update(id(p) for p in unit.orig_params)
    plain = {
        fsdp1_internals.clean_name(name): tensor.detach().clone()
        for name, tensor in (*model.named_parameters(), *model.named_buffers())
        if id(tensor) not in sharded and not isinstance(tensor, DTensor)
    }
    torch.save(plain, out / f"replicated{rank}.pt")


def fill_init(module: nn.Module) -> None:
    """A ``param_init_fn`` for meta-device models: materialise on CPU and fill with a recognisable constant."""
    module.to_empty(device=torch.device("cpu"), recurse=False)
    with torch.no_grad():
        for p in module.parameters(recurse=False):
            p.fill_(0.125)


class PeakSampler:
    """Peak anonymous memory (``RssAnon``) of this process while active, sampled every 2 ms; pages of
    memory-mapped files are the page cache's and are left out."""

    def __init__(self) -> None:
        self.base = status_bytes("RssAnon")
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, status_bytes("RssAnon"))
            time.sleep(0.002)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status_bytes("RssAnon"))


class StreamedSaves(logging.Handler):
    """Counts the full checkpoints this process wrote streamed (``checkpoint/streaming.py`` logs each, at debug)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0
        streaming = logging.getLogger("lightning_gaudi_fsdp.checkpoint.streaming")
        streaming.setLevel(logging.DEBUG)
        streaming.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("streamed ")


class ShardedLoads(logging.Handler):
    """Counts the sharded checkpoints this process loaded, by the way it read them (``checkpoint/loading.py`` logs
    each, at debug): ``fast`` (straight into the shards, ``checkpoint/fast_load.py``) or ``torch`` (``dcp.load``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts = {"fast": 0, "torch": 0}
        loading = logging.getLogger("lightning_gaudi_fsdp.checkpoint.loading")
        loading.setLevel(logging.DEBUG)
        loading.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.counts["fast"] += message.startswith("read straight into this rank's shards")
        self.counts["torch"] += message.startswith("torch's path loads")


def set_state_dict_type(strategy: Any, fmt: str) -> None:
    """Switch the format the next saves write (the strategy reads it from its resolved options)."""
    strategy._config = dataclasses.replace(strategy._config, state_dict_type=fmt)
