"""A plain Lightning Fabric loop under lightning_gaudi_fsdp.fabric.GaudiFSDPStrategy; every rank writes what it saw.

Usage: python fabric_loop.py CONFIG.json (ranks started by the scenario pool, torchrun-style).

Each optimizer step takes one global batch of ``GLOBAL_BATCH`` samples in ``MICRO`` micro-batches (gradient
accumulation under ``fabric.no_backward_sync``); rank r takes rows r, r + N, ... of each micro-batch. Gradients are
clipped by value, then by norm. Rank 0 also trains a plain copy of the initial model on the whole global batch in
the same process (``reference``) for comparison.

Other keys: ``fail`` ({rank, step, kind}: that rank raises, SIGKILLs itself with ``kind="sigkill"`` or sleeps an hour
with ``kind="hang"``, at that global step), ``strategy_rank1`` (arguments rank 1 alone takes), ``slow_writes`` (each
checkpoint write first sleeps that many seconds), ``slow_copies`` (an async save's background copies start that many
seconds late), ``exit_normally`` (end after training without teardown or
``os._exit``), ``preempt`` ({step, to, delay, path}: a SIGTERM as ``train.SignalAt`` sends it; the loop saves to
``path`` when ``fabric.strategy.preempted``), ``raw_checks`` (after training: ``fabric.load_raw`` and, in full
format, ``fabric.save(filter=...)`` round trips; results under ``raw`` in the rank's JSON), ``lightning_layout``
(beside ``save``, the same state is also saved there in the layout Lightning's own Fabric writes, without this
package's save: see ``save_lightning_layout``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import (
    Module,
    RandomRegression,
    StreamedSaves,
    a_late_collective,
    dump_replicated,
    load_config,
    record_what_outlives,
    wrap_blocks,
    write_json,
)
from torch import nn
from train import arm_slow_copies, arm_write_probes, count_sigterms, leave, sigterm_later

from lightning_gaudi_fsdp.checkpoint import formats
from lightning_gaudi_fsdp.engine import pieces
from lightning_gaudi_fsdp.engine.base import of as engine_of
from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy

GLOBAL_BATCH = 8
MICRO = 2
STEPS_PER_EPOCH = 3


def batches(epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = RandomRegression(GLOBAL_BATCH * STEPS_PER_EPOCH * 4, seed=1234)
    start = (epoch % 4) * GLOBAL_BATCH * STEPS_PER_EPOCH
    spans = [slice(start + i * GLOBAL_BATCH, start + (i + 1) * GLOBAL_BATCH) for i in range(STEPS_PER_EPOCH)]
    return [(data.x[span], data.y[span]) for span in spans]


def make_optimizer(params: Any) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def clip(cfg: dict[str, Any], fabric: L.Fabric | None, model: Any, optimizer: Any) -> float | None:
    """Clip by value, then by norm; returns the norm before clipping."""
    value, norm = cfg.get("clip_value"), cfg.get("clip_norm")
    if fabric is None:
        if value:
            nn.utils.clip_grad_value_(model.parameters(), value)
        return float(nn.utils.clip_grad_norm_(model.parameters(), norm)) if norm else None
    if value:
        fabric.clip_gradients(model, optimizer, clip_val=value)
    return float(fabric.clip_gradients(model, optimizer, max_norm=norm)) if norm else None


def device_type(model: Any) -> str:
    return next(model.parameters()).device.type


def full_weights(model: Any, rank: int) -> dict[str, torch.Tensor]:
    state = engine_of(model._forward_module).model_state_dict(model._forward_module, "full", device_type(model))
    return {k.removeprefix("net."): v.clone() for k, v in state.items()} if rank == 0 else {}


def raw_checks(
    fabric: L.Fabric, model: Any, optimizer: Any, out: Path, ckpt: str, at_load: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """After training: ``fabric.load_raw`` from ``ckpt`` (any format; ``at_load``: the weights it holds, on rank 0)
    and from a plain ``torch.save`` file, and, with a full-format strategy, ``fabric.save(filter=...)``. What every
    rank saw."""
    rank, fmt = fabric.global_rank, fabric.strategy._config.state_dict_type
    seen: dict[str, Any] = {}
    trained = full_weights(model, rank)
    fabric.seed_everything(11)
    other = fabric.setup_module(Module(depth=3))  # a second model set up by Fabric
    other_optimizer = fabric.setup_optimizers(make_optimizer(other.parameters())[0])

    if fmt == "full":  # first, while the second model still holds its own initial weights
        filtered = str(out / "filtered.ckpt")
        fabric.save(filtered, {"model": model, "optimizer": optimizer}, filter={"model": lambda k, v: "head" in k})
        seen["filtered_keys"] = sorted(torch.load(filtered, weights_only=True)["model"])
        before = full_weights(other, rank)
        try:
            fabric.load(filtered, {"model": other})
        except Exception as err:
            seen["strict_error"] = f"{type(err).__name__}: {err}"
        fabric.load(filtered, {"model": other}, strict=False)
        after = full_weights(other, rank)
        if rank == 0:
            seen["partial"] = {
                k: "trained" if torch.equal(v, trained[k]) else "kept" if torch.equal(v, before[k]) else "other"
                for k, v in after.items()
            }

    # a checkpoint of this run into the set-up model and into a plain one that was never set up
    fabric.load_raw(ckpt, other)
    seen["checkpoint_into_set_up"] = _equal(full_weights(other, rank), at_load)
    plain = Module(depth=3)
    fabric.load_raw(ckpt, plain)
    seen["checkpoint_into_plain"] = rank != 0 or _equal(_weights(plain), at_load)

    # a plain torch.save of the model's state dict, into both
    plain_file = out / "plain.pt"
    full = engine_of(model._forward_module).model_state_dict(model._forward_module, "full", device_type(model))
    if rank == 0:
        torch.save(full, plain_file)
    fabric.barrier()
    fabric.load_raw(plain_file, other)
    seen["raw_into_set_up"] = _equal(full_weights(other, rank), trained)
    plain = Module(depth=3)
    fabric.load_raw(plain_file, plain)
    seen["raw_into_plain"] = rank != 0 or _equal(_weights(plain), trained)

    # an optimizer alone: from a full checkpoint, refused for the others with what to do instead
    try:
        fabric.load_raw(ckpt, other_optimizer)
        loaded = engine_of(other._forward_module).optimizer_state_dict(
            other._forward_module, other_optimizer.optimizer, "full", device_type(other), rank
        )
        if rank == 0:
            saved = torch.load(ckpt, weights_only=True)["optimizer"]  # Fabric's layout: keyed by parameter name
            names = formats.param_id_names(other._forward_module)
            loaded = pieces.optimizer_state_by_name(loaded, names)
            torch.save({"saved": saved, "loaded": loaded}, out / "raw_optimizer.pt")
    except Exception as err:
        seen["optimizer_error"] = f"{type(err).__name__}: {err}"
    try:
        fabric.load_raw(ckpt + ".missing", other_optimizer)
    except Exception as err:
        seen["missing_error"] = f"{type(err).__name__}: {err}"
    return seen


def save_lightning_layout(path: str, model: Any, optimizer: Any, state: dict[str, Any], fabric: L.Fabric) -> None:
    """``state`` saved to ``path`` in the layout Lightning's own Fabric writes, for this strategy's
    ``state_dict_type``. Sharded: by Lightning's own code, run on this strategy's model (FSDP1:
    ``lightning.fabric.strategies.FSDPStrategy.save_checkpoint``; FSDP2: ``ModelParallelStrategy``'s
    ``_save_checkpoint``): the model and optimizer in DCP under their keys, the other entries in ``meta.pt``. Full: as
    ``FSDPStrategy.save_checkpoint`` builds it (its own call would offload a full state dict on CPU, which crashes
    torch 2.13): ``full_state[key]`` for each entry (a module as its full state dict, an optimizer as
    ``FSDP.optim_state_dict`` under a full context, i.e. keyed by parameter name, anything else as given or its
    ``state_dict()``), ``torch.save`` on rank 0."""
    from lightning.fabric.strategies import FSDPStrategy
    from lightning.fabric.strategies.model_parallel import _save_checkpoint
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    strategy, rank = fabric.strategy, fabric.global_rank
    unwrapped = {k: v._forward_module if v is model else v.optimizer if v is optimizer else v for k, v in state.items()}
    if strategy._config.state_dict_type == "sharded" and strategy._engine.version == 1:
        FSDPStrategy.save_checkpoint(strategy, path, unwrapped)
        return
    if strategy._config.state_dict_type == "sharded":
        _save_checkpoint(Path(path), unwrapped, full_state_dict=False, rank=rank)
        return
    engine = engine_of(model._forward_module)
    weights = engine.model_state_dict(model._forward_module, "full", device_type(model))
    by_id = engine.optimizer_state_dict(model._forward_module, optimizer.optimizer, "full", device_type(model), rank)
    if rank != 0:
        return
    plain = Module(depth=3)  # the unwrapped model: the names FSDP.optim_state_dict keys the state by
    plain.load_state_dict(weights)
    full_state = {}
    for key, obj in state.items():
        if obj is model:
            full_state[key] = weights
        elif obj is optimizer:
            full_state[key] = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, plain)
        else:
            full_state[key] = obj.state_dict() if hasattr(obj, "state_dict") else obj
    torch.save(full_state, path)


def _weights(plain: Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in plain.net.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equal, same keys (both empty off rank 0)."""
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())


def main() -> None:
    cfg = load_config()
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    if cfg.get("exit_normally"):
        record_what_outlives(out)
    if cfg.get("slow_writes"):
        arm_write_probes(out, cfg["slow_writes"], 0, False)
    if cfg.get("slow_copies"):
        arm_slow_copies(cfg["slow_copies"])
    strategy_cfg = cfg.get("strategy", {})
    if cfg.get("strategy_rank1") and int(os.environ.get("LOCAL_RANK", "0")) == 1:
        strategy_cfg = {**strategy_cfg, **cfg["strategy_rank1"]}  # a misconfigured rank
    strategy: Any = cfg.get("strategy_name") or GaudiFSDPStrategy(**strategy_cfg)
    fabric = L.Fabric(
        accelerator=cfg.get("accelerator", "cpu"),
        devices=cfg.get("devices", 2),
        strategy=strategy,
        precision=cfg.get("precision", "32-true"),
    )
    if cfg.get("user_handler") == "before":  # the user's, installed before the strategy's: chained by it
        count_sigterms(out, int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))))
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    _FINALLY.update(out=out, rank=rank)
    fail = cfg.get("fail")
    preempt = cfg.get("preempt")  # {"step", "to", "delay", "path"}: see train.SignalAt
    fabric.seed_everything(7)
    with fabric.init_module(empty_init=True):
        module = Module(depth=3)
        if cfg.get("manual_wrap"):  # the blocks by hand, the head left outside the units
            wrap_blocks(module.net)
    info: dict[str, Any] = {
        "rank": rank,
        "strategy": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__,
    }
    info["meta_before_setup"] = all(p.is_meta for p in module.parameters())
    saved_streamed: StreamedSaves | None = None  # counts the full checkpoints the save below wrote streamed
    model = fabric.setup_module(module)
    optimizer, scheduler = make_optimizer(model.parameters())
    optimizer = fabric.setup_optimizers(optimizer)
    info["precision"] = type(fabric.strategy.precision).__name__
    info["engine"] = fabric.strategy._engine.version
    info["units"] = list(engine_of(model._forward_module).fingerprint(model._forward_module))  # by name
    initial = full_weights(model, rank)

    state: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "epoch": 0,
        "global_step": 0,
    }
    for key in cfg.get("drop_keys", []):
        del state[key]
    if cfg.get("load"):
        try:  # every rank fails alike, before any weight changes
            fabric.load(cfg["load"] + ".missing", state)
        except Exception as err:
            info["missing_error"] = f"{type(err).__name__}: {err}"
        if cfg.get("load_damaged"):  # a copy with one byte changed: refused by its checksums, nothing loaded

            def local() -> list[torch.Tensor]:
                return [getattr(p, "to_local", lambda p=p: p)().detach().clone() for p in model.parameters()]

            before = local()
            try:
                fabric.load(cfg["load_damaged"], state)
            except Exception as err:
                info["damaged_error"] = f"{type(err).__name__}: {err}"
            info["damaged_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, local(), strict=True))
        remainder = fabric.load(cfg["load"], state, strict=cfg.get("strict", True))
        info["scheduler_same_object"] = state["scheduler"] is scheduler
        info["scheduler_last_epoch"] = scheduler.last_epoch
        info["remainder_keys"] = sorted(remainder)
        info["loaded"] = {k: state[k] for k in ("epoch", "global_step") if k in state}
        info["lr_after_load"] = optimizer.param_groups[0]["lr"]
        at_load = full_weights(model, rank)
        loaded = {  # collectives: every rank
            "weights": at_load,
            "optimizer": engine_of(model._forward_module).optimizer_state_dict(
                model._forward_module, optimizer.optimizer, "full", device_type(model), rank
            ),
            "scheduler": scheduler.state_dict(),
        }
        if rank == 0:
            torch.save(loaded, out / "loaded.pt")

    reference = reference_optimizer = reference_scheduler = None
    if rank == 0 and cfg.get("reference"):
        reference = Module(depth=3)
        reference.net.load_state_dict(initial)
        reference_optimizer, reference_scheduler = make_optimizer(reference.parameters())

    losses, reference_losses, norms, reference_norms = [], [], [], []
    for epoch in range(state.get("epoch", 0), cfg.get("epochs", 2)):
        for x, y in batches(epoch):
            if fail and fail["rank"] == rank and fail["step"] == state.get("global_step", 0):
                if fail.get("kind") == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fail.get("kind") == "hang":  # alive and stuck, as in a deadlock or a hung device call
                    time.sleep(3600)
                raise RuntimeError(f"boom in training_step on rank {rank}")
            total = torch.zeros((), device=fabric.device)
            micro = GLOBAL_BATCH // MICRO
            for m in range(MICRO):
                xm, ym = x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro]
                with fabric.no_backward_sync(model, enabled=m < MICRO - 1):
                    xr, yr = fabric.to_device((xm[rank::world], ym[rank::world]))
                    loss = nn.functional.mse_loss(model(xr), yr) / MICRO
                    fabric.backward(loss)
                total += loss.detach()
            norms.append(clip(cfg, fabric, model, optimizer))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            losses.append(float(fabric.all_reduce(total, reduce_op="mean")))
            state["global_step"] = state.get("global_step", 0) + 1
            if preempt and state["global_step"] == preempt["step"]:
                sigterm_later(preempt["to"], rank, out, preempt.get("delay", 0.0))
            if preempt and preempt.get("ignore"):  # a loop that never reads preempted (and a step that takes a while)
                time.sleep(preempt["ignore"])
            elif fabric.strategy.preempted:  # the same answer on every rank, at the same step
                fabric.save(preempt["path"], state)  # commits, then every rank leaves (exit code 75)
            if reference is not None:
                loss = nn.functional.mse_loss(reference(x), y)
                loss.backward()
                reference_norms.append(clip(cfg, None, reference, reference_optimizer))
                reference_optimizer.step()
                reference_optimizer.zero_grad()
                reference_scheduler.step()
                reference_losses.append(float(loss))
        state["epoch"] = epoch + 1
        if cfg.get("save") and state["epoch"] == cfg.get("save_after_epoch", 1):
            streamed = saved_streamed = StreamedSaves()
            started = time.monotonic()
            fabric.save(cfg["save"], state)
            if cfg.get("lightning_layout"):
                save_lightning_layout(cfg["lightning_layout"], model, optimizer, state, fabric)
            background = fabric.strategy._background
            info["save"] = {
                "seconds": time.monotonic() - started,
                "in_flight": background is not None and background.in_flight,
                "committed_on_return": Path(cfg["save"]).exists(),
                "streamed": streamed.count > 0,  # rank 0 wrote it as its tensors arrived
            }

    if cfg.get("exit_normally"):  # no teardown, no os._exit: only the interpreter's exit waits for a background save
        write_json(out, f"rank{rank}.json", info)
        if cfg.get("late_collective"):
            a_late_collective()
        return
    if cfg.get("raw_checks"):
        info["raw"] = raw_checks(fabric, model, optimizer, out, cfg["load"], at_load)
    fabric.strategy.teardown()  # waits for a background save (fabric.save with async_save=True)
    info["committed_after_teardown"] = bool(cfg.get("save")) and Path(cfg["save"]).exists()
    if saved_streamed is not None:  # a background full save is streamed too, after fabric.save returned
        info["save"]["streamed_by_teardown"] = saved_streamed.count > 0

    # collectives
    def mine() -> torch.Tensor:
        return torch.tensor(float(rank + 1), device=fabric.device)

    info["all_reduce_sum"] = float(fabric.all_reduce(mine(), reduce_op="sum"))
    info["all_reduce_mean"] = float(fabric.all_reduce(mine(), reduce_op="mean"))
    info["all_gather"] = fabric.all_gather(torch.tensor([rank], device=fabric.device)).reshape(-1).tolist()
    info["backend"] = fabric.strategy.process_group_backend
    info["device"] = str(fabric.device)
    info["broadcast"] = fabric.broadcast({"from": rank}, src=0)
    fabric.barrier()
    info.update(
        losses=losses,
        norms=norms,
        lr=optimizer.param_groups[0]["lr"],
        final_state={k: state[k] for k in ("epoch", "global_step") if k in state},
    )
    dump_replicated(out, rank, model._forward_module)
    final = full_weights(model, rank)
    optim = engine_of(model._forward_module).optimizer_state_dict(
        model._forward_module, optimizer.optimizer, "full", device_type(model), rank
    )
    if rank == 0:
        torch.save(
            {
                "weights": final,
                "initial": initial,
                "optimizer": optim,
                "scheduler": scheduler.state_dict(),
                "lr": optimizer.param_groups[0]["lr"],
                "reference": None
                if reference is None
                else {
                    "weights": {k: v.detach().clone() for k, v in reference.net.state_dict().items()},
                    "losses": reference_losses,
                    "norms": reference_norms,
                    "lr": reference_optimizer.param_groups[0]["lr"],
                },
            },
            out / "final.pt",
        )
    write_json(out, f"rank{rank}.json", info)
    leave()


_FINALLY: dict[str, Any] = {}  # where the script's finally block records that it ran


if __name__ == "__main__":
    try:
        main()
    finally:  # a preemption in a loop that never reads strategy.preempted leaves through here (SystemExit)
        if _FINALLY:
            write_json(_FINALLY["out"], f"finally{_FINALLY['rank']}.json", {"at": time.monotonic()})
