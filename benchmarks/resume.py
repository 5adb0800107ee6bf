"""Resume time against reading the bytes: the worker side of ``run.py --only resume`` (``worker.py resume CFG``). One
Trainer trains a transformers Llama (``cfg["layers"]`` decoder layers of width ``cfg["width"]``, AdamW) for one step and
saves it in every format of ``cfg["formats"]``. Then, in the same processes, for each format and round: a fresh ``fit``
and a ``fit(ckpt_path=...)`` of one step each, timed from ``on_fit_start`` (Lightning restores after it) to the first
``on_train_batch_start``: the resume's difference is the time it adds before training starts. The baseline is
``torch.load`` of this rank's share of the same state from one plain file (the rank's file of the local checkpoint: its
shard of the weights and of the AdamW state); for the full format, ``torch.load`` of the whole file on rank 0 plus a
scatter of its tensors to the ranks (:func:`_torch_load_and_scatter`). A checkpoint written elsewhere (``cfg["ckpts"]``,
a reshard) is resumed the same way at this world size. With ``cfg["memory"]``, one more resume per format measures the
memory restoring needs beyond what training then holds. ``BENCH_PROFILE_RESUME=<format>`` writes a cProfile of rank 0's
resume of that format to ``BENCH_PROFILE_DIR``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

FSDP_VERSION = {"fsdp1": 1, "fsdp2": 2}
LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"


def _module(cfg: dict[str, Any]) -> Any:
    import lightning as L
    import transformers
    from torch.utils.data import DataLoader, Dataset

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 10**6

        def __getitem__(self, i: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(i)
            return torch.randint(0, 1024, (33,), generator=g)

    class Llama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.LlamaConfig(
                vocab_size=1024,
                hidden_size=cfg["width"],
                intermediate_size=2 * cfg["width"],
                num_hidden_layers=cfg["layers"],
                num_attention_heads=4,
                num_key_value_heads=4,
            )
            torch.manual_seed(0)
            self.model = transformers.LlamaForCausalLM(config)

        def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Tokens(), batch_size=2)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Llama()


class _Window:
    """Seconds from ``on_fit_start`` (Lightning restores a checkpoint after it) to the first training batch; with
    ``profile``, a cProfile of that window; with ``memory``, the peak anonymous memory (sampled) the process added in
    that window above what it holds at the first batch (``restore_extra``: what restoring needed only while it ran)."""

    def __new__(cls, profile: Path | None = None, memory: bool = False) -> Any:
        from lightning.pytorch.callbacks import Callback
        from peaks import Peaks

        class Window(Callback):
            seconds = 0.0
            restore_extra = 0

            def on_fit_start(self, *args: Any) -> None:
                if memory:
                    self.peaks = Peaks().__enter__()
                if profile is not None:
                    import cProfile

                    self.profiler = cProfile.Profile()
                    self.profiler.enable()
                self.start = time.perf_counter()

            def on_train_batch_start(self, *args: Any) -> None:
                if self.seconds == 0.0:
                    self.seconds = time.perf_counter() - self.start
                    if memory:
                        held = self.peaks.held()
                        self.peaks.__exit__()
                        self.restore_extra = max(self.peaks.anon - held, 0)
                    if profile is not None:
                        import pstats

                        self.profiler.disable()
                        with open(profile, "w") as handle:
                            stats = pstats.Stats(self.profiler, stream=handle)
                            stats.sort_stats("cumulative").print_stats(60)
                            stats.sort_stats("tottime").print_stats(30)

        return Window()


def _trainer(cfg: dict[str, Any], engine: str, callback: Any, max_steps: int) -> Any:
    import lightning as L

    from lightning_gaudi_fsdp import GaudiFSDPStrategy

    strategy = GaudiFSDPStrategy(auto_wrap_policy=[LAYER], fsdp_version=FSDP_VERSION[engine])
    return L.Trainer(
        accelerator="cpu",
        devices=cfg["world_size"],
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[callback],
    )


def set_format(strategy: Any, fmt: str) -> None:
    """Make ``strategy`` save in ``fmt`` from now on: the package reads its resolved options (``strategy._config``, a
    frozen record) since they moved there; older trees read ``strategy._state_dict_type``. Setting only the latter
    left every save of the benchmark a full one."""
    import dataclasses

    strategy._state_dict_type = fmt
    if dataclasses.is_dataclass(getattr(strategy, "_config", None)):
        strategy._config = dataclasses.replace(strategy._config, state_dict_type=fmt)


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _window(cfg: dict[str, Any], engine: str, ckpt: str | None, profile: Path | None = None) -> float:
    callback = _Window(profile)
    trainer = _trainer(cfg, engine, callback, max_steps=2 if ckpt else 1)
    trainer.fit(_module(cfg), ckpt_path=ckpt)
    return _slowest(callback.seconds)


def _restore_extra(cfg: dict[str, Any], engine: str, ckpt: str) -> float:
    """The largest ``restore_extra`` (bytes) of any rank over one resume of ``ckpt``, in a fit of its own (the
    sampling thread stays out of the timed windows)."""
    callback = _Window(memory=True)
    _trainer(cfg, engine, callback, max_steps=2).fit(_module(cfg), ckpt_path=ckpt)
    return _slowest(float(callback.restore_extra))


def _torch_load(file: Path) -> float:
    dist.barrier()
    start = time.perf_counter()
    torch.load(file, map_location="cpu", weights_only=True)
    return _slowest(time.perf_counter() - start)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _torch_load_and_scatter(file: Path) -> float:
    """The full format's baseline: ``torch.load`` of the whole checkpoint file on rank 0, then the least a scatter of
    it costs: every tensor of the model and optimizer state, per dtype, joined into one buffer, padded to a multiple
    of the world size and sent to the ranks in equal pieces by one ``dist.scatter`` (with the sizes broadcast
    first). Timed on the slowest rank, from a barrier."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    start = time.perf_counter()
    buffers: dict[str, torch.Tensor] = {}
    if rank == 0:
        state = torch.load(file, map_location="cpu", weights_only=True)
        found = _tensors({"model": state["state_dict"], "optimizers": state.get("optimizer_states", [])})
        for dtype in sorted({str(t.dtype) for t in found}):
            buffers[dtype] = torch.cat([t.reshape(-1) for t in found if str(t.dtype) == dtype])
    sizes = [{k: (v.numel(), v.dtype) for k, v in buffers.items()}]
    dist.broadcast_object_list(sizes, src=0)
    for dtype, (numel, torch_dtype) in sizes[0].items():
        piece = -(-numel // world)
        received = torch.empty(piece, dtype=torch_dtype)
        pieces = None
        if rank == 0:
            padded = torch.zeros(piece * world, dtype=torch_dtype)
            padded[:numel] = buffers[dtype]
            pieces = list(padded.chunk(world))
        dist.scatter(received, pieces, src=0)
    return _slowest(time.perf_counter() - start)


def resume(rank: int, cfg: dict[str, Any]) -> None:
    """Save (unless ``cfg["ckpts"]`` names checkpoints written elsewhere), then time fresh and resumed fits."""
    out = Path(cfg["dir"])
    engine = cfg["engine"]
    ckpts = cfg.get("ckpts")
    if ckpts is None:
        writer = _trainer(cfg, engine, _Window(), max_steps=1)
        writer.fit(_module(cfg))
        ckpts = {}
        for fmt in cfg["formats"]:
            set_format(writer.strategy, fmt)
            ckpts[fmt] = str(out / f"{engine}-{fmt}")
            writer.save_checkpoint(ckpts[fmt])
        del writer
    share = Path(cfg.get("share") or out / f"{engine}-local") / f"rank_{rank:05d}.pt"
    profile_fmt = os.environ.get("BENCH_PROFILE_RESUME")
    profile_dir = Path(os.environ.get("BENCH_PROFILE_DIR", out))
    rows: dict[str, list[dict[str, float]]] = {fmt: [] for fmt in ckpts}
    for round_ in range(cfg.get("rounds", 1)):
        for fmt, ckpt in ckpts.items():
            profile = None
            if round_ == 0 and rank == 0 and profile_fmt == fmt:
                profile = profile_dir / f"profile-resume-{engine}-{fmt}-{cfg['layers']}.txt"
            fresh = _window(cfg, engine, None)
            resumed = _window(cfg, engine, ckpt, profile)
            if fmt == "full":
                load = _torch_load_and_scatter(Path(ckpt))
            else:
                load = _torch_load(share) if share.is_file() else float("nan")
            rows[fmt].append({"fresh_s": fresh, "resume_s": resumed, "added_s": resumed - fresh, "torch_load_s": load})
    memory = {fmt: _restore_extra(cfg, engine, ckpt) for fmt, ckpt in ckpts.items()} if cfg.get("memory") else {}
    if rank == 0:
        share_bytes = share.stat().st_size if share.is_file() else 0
        result = {"rows": rows, "share_bytes": share_bytes, "restore_extra": memory}
        Path(cfg["result"]).write_text(__import__("json").dumps(result))
