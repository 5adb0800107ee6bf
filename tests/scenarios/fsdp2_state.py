"""FSDP2 full state dicts gathered by sending each rank's dim-0 chunk straight to rank 0, against torch's
``get_model_state_dict``/``get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)``, in one run: rank 0
compares both bitwise, key order included. Writes ``fsdp2_state.json``."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from common import load_config, write_json
from fsdp1_state import Block, _differences, streamed_differences, streamed_full_saves
from torch import nn


def main() -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from lightning_gaudi_fsdp.engine import fsdp2_state, pieces

    cfg = load_config()
    out = Path(cfg["out"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    # dim-0 sizes that do not divide evenly; the last layer's single row leaves some ranks an empty chunk
    model = nn.Sequential(Block(5), Block(5), nn.Linear(5, 1))
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 5)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    ours = {
        "model": fsdp2_state.model_state_dict(model, "full"),
        "optimizer": fsdp2_state.optimizer_state_dict(model, optimizer, "full", rank),
    }
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    theirs = {
        "model": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
    }
    # The same full checkpoint saved streamed (checkpoint/streaming.py): read back, it equals the gathered state.
    streamed_planned = streamed_full_saves(model, optimizer, out)
    if rank == 0:
        theirs["optimizer"] = pieces.optimizer_state_by_id(theirs["optimizer"], fsdp2_state.parameter_names(model))
        write_json(
            out,
            "fsdp2_state.json",
            {
                "gathers_to_rank0": fsdp2_state._gathers_to_rank0(model),
                "differences": _differences(ours, theirs),
                "model_keys_in_order": list(ours["model"]) == list(theirs["model"]),
                "optimizer_keys_in_order": list(ours["optimizer"]["state"]) == list(theirs["optimizer"]["state"]),
                "streamed_planned": streamed_planned,
                "streamed_differences": streamed_differences(
                    {"model": ours["model"], "optimizer_0": ours["optimizer"]}, out
                ),
            },
        )
    else:
        write_json(
            out, f"fsdp2_state_rank{rank}.json", {"model": len(ours["model"]), "optimizer": len(ours["optimizer"])}
        )
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
