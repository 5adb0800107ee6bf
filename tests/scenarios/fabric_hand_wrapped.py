"""A Hugging Face Llama whose decoder layers the user wraps by hand under ``fabric.init_module()`` (FSDP1), with the
strategy's activation checkpointing, trained by a plain Fabric loop without passing ``use_cache``.

Every rank writes ``rank<r>.json``: whether each training forward built a KV cache (``config.use_cache`` is on: it
must be off in training where layers are checkpointed), whether an evaluation forward still does, the checkpoint
wrappers, and the losses. The embeddings, the final norm and ``lm_head`` stay outside the user's units. Rank 0 also
trains a plain copy of the model on each whole global batch (``final.pt``: both models' weights and losses).
Usage: python fabric_hand_wrapped.py CONFIG.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import dump_replicated, load_config, write_json
from peft_train import DECODER_LAYER, SEQ, TINY_LLAMA, _gen, build_model
from torch.distributed.fsdp.wrap import wrap
from train import leave

from lightning_gaudi_fsdp.engine.base import of as engine_of
from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy


def main() -> None:
    cfg = load_config()
    strategy = GaudiFSDPStrategy(activation_checkpointing_policy=[DECODER_LAYER], **cfg.get("strategy", {}))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    with fabric.init_module():
        model = build_model(lora=False)
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = wrap(layer)  # by hand: the strategy's enable_wrap arguments
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    tokens = torch.randint(0, TINY_LLAMA["vocab_size"], (8, SEQ), generator=_gen())
    mine = tokens[rank::world]
    info: dict[str, Any] = {"use_cache": model.config.use_cache, "cache_in_training": [], "losses": []}
    reference = build_model(lora=False) if rank == 0 else None  # the same initial weights (seeded)
    reference_optimizer = None if reference is None else torch.optim.AdamW(reference.parameters(), lr=0.01)
    reference_losses = []
    model.train()
    for step in range(2):
        out = model(input_ids=mine[step * 2 : step * 2 + 2], labels=mine[step * 2 : step * 2 + 2])  # no use_cache
        info["cache_in_training"].append(out.past_key_values is not None)
        fabric.backward(out.loss)  # transformers 4.x with a cache: CheckpointError (recomputed metadata differs)
        optimizer.step()
        optimizer.zero_grad()
        info["losses"].append(float(fabric.all_reduce(out.loss.detach(), reduce_op="mean")))
        if reference is not None:  # the global batch: every rank's rows of this step
            batch = torch.cat([tokens[r::world][step * 2 : step * 2 + 2] for r in range(world)])
            loss = reference(input_ids=batch, labels=batch, use_cache=False).loss
            loss.backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            reference_losses.append(float(loss))
    dump_replicated(Path(cfg["out"]), rank, model._forward_module)
    weights = engine_of(model._forward_module).model_state_dict(model._forward_module, "full", "cpu")
    if reference is not None:
        torch.save(
            {"weights": weights, "reference": {"weights": reference.state_dict(), "losses": reference_losses}},
            Path(cfg["out"]) / "final.pt",
        )
    model.eval()
    with torch.no_grad():
        info["cache_in_evaluation"] = model(input_ids=mine[:1]).past_key_values is not None
    info["checkpoint_wrappers"] = sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules())
    write_json(Path(cfg["out"]), f"rank{rank}.json", info)
    leave()


if __name__ == "__main__":
    main()
