"""Fabric's door on Gaudi as the habana_frameworks double presents it: 2 ranks (started as torchrun would), the
default group on the double's ``hccl`` (``hpu`` tensors only) and bound to ``hpu:0`` the way Lightning binds it
(``init_process_group(..., device_id=root_device)``). What real Gaudi would refuse: a CPU tensor over ``hccl``; the
background saver's gloo group beside the bound default group; ``sync_module_states``' broadcast of a model still on
the host. Each rank writes rank<N>.json; nothing here can put a tensor on ``hpu`` (the CPU build has none)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fakes"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import Net, load_config, write_json  # noqa: E402

from lightning_gaudi_fsdp import _sharding  # noqa: E402
from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy  # noqa: E402


def _error(fn: Any) -> str | None:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def main() -> None:
    cfg = load_config()
    fabric = L.Fabric(accelerator="hpu", devices=2, strategy=GaudiFSDPStrategy(async_save=True))
    fabric.launch()
    rank = fabric.global_rank
    info: dict[str, Any] = {"backend": dist.get_backend(), "bound": str(dist.group.WORLD.bound_device_id)}
    info["cpu_over_hccl"] = _error(lambda: dist.all_reduce(torch.ones(1)))  # the double is as strict as the bridge

    def background_gather() -> None:  # the group every asynchronous save writes and agrees over
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, rank, group=fabric.strategy._background._process_group())
        info["background_gather"] = gathered

    info["background_error"] = _error(background_gather)
    torch.manual_seed(rank)  # each rank starts from different weights; sync_module_states makes them rank 0's
    model = Net()
    info["before_sync"] = {name: value.tolist() for name, value in model.state_dict().items()}
    info["broadcast_error"] = _error(lambda: _sharding.broadcast_module_states(model))
    info["after_sync"] = {name: value.tolist() for name, value in model.state_dict().items()}
    write_json(Path(cfg["out"]), f"rank{rank}.json", info)


if __name__ == "__main__":
    main()
