"""Pretrain a LLaMA-style model with Lightning Fabric and FSDP on Intel Gaudi (or CPU processes), with sharded
checkpoints and resume.

    python examples/fabric_pretrain.py --steps 30                       # 2 CPU processes when no Gaudi is found
    python examples/fabric_pretrain.py --steps 60 --resume              # continue from the newest checkpoint
    python examples/fabric_pretrain.py --devices 8 --steps 1000         # 8 Gaudi cards (bf16-mixed autocast)

The model is ``transformers``' ``LlamaForCausalLM`` built from a config (no weights are downloaded); the data is
the generated stride sequences of ``llama_fsdp.py``. Each ``--save-every`` steps every rank writes its shard of a
sharded checkpoint (``checkpoints/step-NNNNN``); ``--resume`` restores model, optimizer, learning-rate scheduler
and step from the newest one, in place. ``--async-save`` writes each checkpoint in the background while training goes
on; ``fabric.strategy.teardown()`` at the end waits for the last one. A SIGTERM (a preempted pod or job, ``kill`` on
one rank) saves the step just completed the same way and ends every rank with exit code 75; ``--resume`` continues
from it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L
import torch
from llama_fsdp import StrideSequences, model_flops
from torch.utils.data import DataLoader

from lightning_gaudi_fsdp import gaudi
from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy
from lightning_gaudi_fsdp.throughput import FabricMonitor, summary


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="train until this optimizer step")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--fsdp-version", type=int, default=1, choices=(1, 2))
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"))
    parser.add_argument("--resume", action="store_true", help="load the newest checkpoint in --checkpoints first")
    parser.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    return parser.parse_args()


def llama(vocab_size: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def main() -> None:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    args = parse_args()
    on_gaudi = gaudi.is_available()
    strategy = GaudiFSDPStrategy(
        auto_wrap_policy={LlamaDecoderLayer},  # one FSDP unit per decoder layer
        state_dict_type="sharded",
        fsdp_version=args.fsdp_version,
        async_save=args.async_save,
    )
    fabric = L.Fabric(
        accelerator="hpu" if on_gaudi else "cpu",
        devices=args.devices,
        strategy=strategy,
        precision="bf16-mixed" if on_gaudi else "32-true",
    )
    fabric.launch()
    fabric.print(f"training on {'Intel Gaudi' if on_gaudi else 'CPU processes (no Gaudi found)'}")
    fabric.seed_everything(0)
    vocab_size = 128
    # The model is built in full on each rank and sharded by setup_module. init_module(empty_init=True) would build
    # it on the meta device instead; that needs every module to re-initialise itself with reset_parameters(), which
    # transformers' rotary-embedding buffers do not.
    with fabric.init_module():
        model = llama(vocab_size)
    config = model.config
    matmul_params = sum(p.numel() for p in model.parameters()) - vocab_size * config.hidden_size  # before sharding
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))  # warmup
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}

    if args.resume:
        saved = sorted(args.checkpoints.glob("step-*"))
        if saved:
            fabric.load(saved[-1], state)  # every entry restored in place; "step" comes back in `state`
            fabric.print(f"resumed from {saved[-1]} at step {state['step']}")

    data = StrideSequences(4096, args.seq_len, vocab_size, seed=0)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True))
    losses: list[float] = []
    monitor = FabricMonitor(fabric, window_size=5)  # tokens/s, and MFU on Gaudi 2 and Gaudi 3
    batches, start = 0, time.perf_counter()
    epoch = 0
    while state["step"] < args.steps:
        loader.sampler.set_epoch(epoch)
        for tokens in loader:
            logits = model(input_ids=tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the norm over every rank's shards
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            state["step"] += 1
            losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
            gaudi.synchronize()  # the device's queued work done before the clock is read
            batches += 1
            flops = model_flops(tokens, matmul_params, config.num_hidden_layers, config.hidden_size)
            monitor.update(
                time=time.perf_counter() - start,
                batches=batches,
                samples=batches * tokens.shape[0],
                lengths=batches * tokens[:, 1:].numel(),
                flops=flops,
            )
            if fabric.strategy.preempted:  # a SIGTERM on any rank: True on every rank at the same step
                fabric.save(args.checkpoints / f"step-{state['step']:05d}", state)  # commits; every rank exits (75)
            if state["step"] % args.save_every == 0 or state["step"] == args.steps:
                fabric.save(args.checkpoints / f"step-{state['step']:05d}", state)
            if state["step"] >= args.steps:
                break
        epoch += 1
    fabric.strategy.teardown()  # waits for a checkpoint still being written in the background (--async-save)
    # torch's advice for the end of every distributed script: without it, gloo's worker threads can still hold work
    # while the interpreter shuts down, and the process aborts ("terminate called without an active exception")
    torch.distributed.destroy_process_group()
    if losses:
        fabric.print(f"loss: first={losses[0]:.4f} last={losses[-1]:.4f} steps={state['step']}")
    line = summary(monitor.compute(), monitor.peak, fabric.world_size) if fabric.is_global_zero else None
    if line:
        fabric.print(line)


if __name__ == "__main__":
    main()
