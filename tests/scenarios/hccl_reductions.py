"""Reductions on the ``hccl`` backend of the habana_frameworks double (over gloo, refusing AVG and PREMUL_SUM as
HCCL does): what each engine and the strategy send. Each rank writes rank<N>.json."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import Block, Net, load_config, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fakes"))
# The CPU build has no hpu tensors: let this fake hccl carry CPU ones, to see which reduce ops reach HCCL.
os.environ.setdefault("FAKE_HCCL_DEVICES", "cpu,hpu")
import habana_frameworks.torch.distributed.hccl  # noqa: E402,F401  (registers the fake backend)

from lightning_gaudi_fsdp import GaudiFSDPStrategy, _compat  # noqa: E402
from lightning_gaudi_fsdp.engine import fsdp2_apply  # noqa: E402


def _refused(fn: Any) -> str | None:
    try:
        fn()
    except RuntimeError as err:
        if "Unsupported ReduceOp for HCCL" in str(err):
            return str(err)
        raise
    return None


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)


def _reference_grads() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    x, y = _batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _fsdp2_grads(force_sum: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = Net()
    units = fsdp2_apply.select_units(model, ModuleWrapPolicy({Block}))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fsdp2_apply.apply_fsdp2(
        model,
        units,
        mesh=mesh,
        reshard_after_forward=True,
        mp_policy=None,
        offload_policy=None,
        ignored_params=None,
        root_casts_inputs=True,
    )
    if force_sum:
        fsdp2_apply.force_sum_reductions(model)
    x, y = _batch()
    rank, world = dist.get_rank(), dist.get_world_size()
    share = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    torch.nn.functional.mse_loss(model(x[share]), y[share]).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def main() -> None:
    cfg = load_config()
    dist.init_process_group("hccl")
    rank = dist.get_rank()
    result: dict[str, Any] = {"backend": dist.get_backend()}
    # the double refuses what HCCL refuses
    result["avg_refused"] = _refused(lambda: dist.all_reduce(torch.ones(1), op=dist.ReduceOp.AVG)) is not None
    # Lightning's own reduce sends AVG for "mean" on every backend but gloo; the strategy sums and divides
    strategy = GaudiFSDPStrategy()
    strategy._process_group_backend = "hccl"
    value = torch.tensor([float(rank + 1)])
    from lightning.pytorch.strategies import FSDPStrategy

    result["lightning_mean_refused"] = _refused(lambda: FSDPStrategy.reduce(strategy, value.clone())) is not None
    result["strategy_mean"] = strategy.reduce(value.clone(), reduce_op="mean").item()
    result["strategy_sum"] = strategy.reduce(value.clone(), reduce_op="sum").item()
    # Fabric's door: fabric.all_reduce goes to the strategy's all_reduce
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy

    from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy as FabricStrategy

    fabric = FabricStrategy()
    fabric._process_group_backend = "hccl"
    result["fabric_lightning_mean_refused"] = (
        _refused(lambda: FabricFSDPStrategy.all_reduce(fabric, value.clone(), reduce_op="mean")) is not None
    )
    result["fabric_mean"] = fabric.all_reduce(value.clone(), reduce_op="mean").item()
    result["force_sum_available"] = _compat.FSDP2_FORCE_SUM_REDUCTION
    reference = _reference_grads()
    if _compat.FSDP2_FORCE_SUM_REDUCTION:  # the FSDP2 engine needs torch >= 2.8 (refused before, tested apart)
        result["fsdp2_default_refused"] = _refused(lambda: _fsdp2_grads(force_sum=False)) is not None
        grads = _fsdp2_grads(force_sum=True)
        result["fsdp2_sum_max_grad_error"] = max((grads[n] - reference[n]).abs().max().item() for n in reference)
    write_json(Path(cfg["out"]), f"rank{rank}.json", result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
