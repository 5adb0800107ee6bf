"""The LoRA fine-tune of ``peft_train.py`` as a plain Fabric loop under lightning_gaudi_fsdp.fabric.GaudiFSDPStrategy:
the same model, data, optimizer and steps (rank r takes rows r, r + 2, ... as the Trainer's DistributedSampler does).

Writes (rank 0) ``initial.pt``, ``at_save.pt`` (full weights when ``save`` is written, after step ``save_at``) and
``final.pt``; every rank ``rank<r>.json`` (frozen parameters that got a gradient).
Usage: python peft_fabric.py CONFIG.json
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from common import dump_replicated, load_config, write_json
from peft_train import DECODER_LAYER, SEQ, TINY_LLAMA, _gen, build_model
from train import leave

from lightning_gaudi_fsdp.adapters.fsdp1_internals import clean_name
from lightning_gaudi_fsdp.engine.base import of as engine_of
from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy


def main() -> None:
    cfg = load_config()
    out = Path(cfg["out"])
    strategy = GaudiFSDPStrategy(auto_wrap_policy=[DECODER_LAYER], **cfg.get("strategy", {}))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    fabric.seed_everything(7)
    model = fabric.setup_module(build_model(lora=True))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01))
    tokens = torch.randint(0, TINY_LLAMA["vocab_size"], (8, SEQ), generator=_gen())
    mine = tokens[rank::world]  # DistributedSampler(shuffle=False): rows r, r + world, ...

    def weights(name: str) -> None:
        state = engine_of(model._forward_module).model_state_dict(model._forward_module, "full", "cpu")
        if rank == 0:
            torch.save(state, out / name)

    weights("initial.pt")
    frozen_with_grad: set[str] = set()
    loaded = None
    for step in range(1, cfg.get("max_steps", 4) + 1):
        batch = mine[((step - 1) % 2) * 2 : ((step - 1) % 2) * 2 + 2]
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        fabric.backward(loss)
        frozen_with_grad.update(
            clean_name(n) for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None
        )
        optimizer.step()
        optimizer.zero_grad()
        if step == cfg.get("save_at"):
            state = {"model": model, "optimizer": optimizer}
            fabric.save(cfg["save"], state)
            weights("at_save.pt")
            remainder = fabric.load(cfg["save"], state)  # the same state back: nothing of the package's own
            loaded = {"remainder": sorted(remainder), "state": sorted(state)}
    write_json(out, f"rank{rank}.json", {"frozen_with_grad": sorted(frozen_with_grad), "loaded": loaded})
    dump_replicated(out, rank, model._forward_module)
    weights("final.pt")
    leave()


if __name__ == "__main__":
    main()
