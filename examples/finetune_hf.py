"""Fine-tune a Hugging Face causal language model with LoRA under FSDP, then export it as a Hugging Face model.

    python examples/finetune_hf.py                                   # CPU rehearsal: makes a tiny local Llama first
    python examples/finetune_hf.py --base /models/Llama-3.1-8B --devices 8 --steps 200 --seq-len 512   # on Gaudi

The round trip a fine-tuning user needs, in four steps:

1. **Weights in.** ``GaudiFSDPStrategy(pretrained_weights=BASE, pretrained_prefix=...)``: the model built in
   ``configure_model`` is created on the meta device and each rank reads only its own slices of the safetensors
   files after sharding, so no rank ever holds a full copy of the base model.
2. **LoRA.** ``peft.get_peft_model`` in ``configure_model``: the base is frozen (no gradients, no optimizer state),
   only the adapters train.
3. **A checkpoint.** A sharded checkpoint of the fine-tuned model (``trainer.save_checkpoint``).
4. **Weights out.** ``export_hf`` (the ``lightning-gaudi-fsdp convert ... --to hf`` command) writes the adapters as
   PEFT saves them and the base with the adapters merged in, as a directory ``from_pretrained`` loads; the example
   reloads it with ``transformers`` and prints a sample.

Nothing is downloaded: without ``--base`` the example writes a small randomly initialised Llama with
``save_pretrained`` and fine-tunes it on generated sequences (``token[t + 1] = token[t] + stride``), so the sample
shows whether the model learned to continue a stride.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the LLaMA example's generated data
from llama_fsdp import LlamaLM, StrideDataModule, StrideSequences  # noqa: E402

from lightning_gaudi_fsdp import GaudiFSDPStrategy, gaudi  # noqa: E402
from lightning_gaudi_fsdp.checkpoint.hf_export import export_hf  # noqa: E402

# Adapters on every projection of the decoder layers (the usual choice for instruction tuning).
LORA = {
    "r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
PREFIX = "model.base_model.model."  # LightningModule attribute ``model`` -> PeftModel -> the transformers model


class LoRAFineTune(L.LightningModule):
    def __init__(self, base: str, learning_rate: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        # No weights here: the strategy builds this on the meta device and fills each rank's shards from the files.
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.hparams.base))
        self.model = get_peft_model(model, LoraConfig(**LORA))

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        if self.global_step == 0:
            self.first_loss = loss.item()
        self.last_loss = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]  # the adapters; the base stays frozen
        return torch.optim.AdamW(trainable, lr=self.hparams.learning_rate)


def make_base(path: Path, vocab_size: int, steps: int = 40) -> None:
    """The LLaMA example's model (``examples/llama_fsdp.py``, its default sizes), briefly pretrained in this process
    on the generated sequences (so fine-tuning starts from a model that knows something), written as a Hugging Face
    directory split into several safetensors files."""
    torch.manual_seed(0)
    lm = LlamaLM(vocab_size=vocab_size)
    lm.configure_model()
    model = lm.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = StrideSequences(steps * 16, 64, vocab_size, seed=1234).tokens.split(16)
    for tokens in data:
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"base model: {path} (pretrained {steps} steps here, loss {loss.item():.3f})", flush=True)
    model.save_pretrained(path, max_shard_size="200KB")


def sample(model_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="a Hugging Face model directory (default: make a small one under --out)")
    parser.add_argument("--out", default="runs/finetune", help="where the run, checkpoint and exports go")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    out = Path(args.out)
    accelerator = "hpu" if gaudi.is_available() else "cpu"
    vocab_size = 128
    base = Path(args.base) if args.base else out / "base"
    if args.base is None and not (base / "config.json").is_file():
        make_base(base, vocab_size)  # every rank re-runs this script: the first one writes it, the others find it
    if args.base is not None:
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(base).vocab_size

    strategy = GaudiFSDPStrategy(
        auto_wrap_policy={"transformers.models.llama.modeling_llama.LlamaDecoderLayer"},
        use_orig_params=True,
        state_dict_type="sharded",
        pretrained_weights=str(base),
        pretrained_prefix=PREFIX,
    )
    num_samples = 64 * args.batch_size
    # The progress bar counts epochs up to max_epochs: give the number of passes over the data that args.steps takes
    # (each rank sees its share of the samples, in whole batches); Lightning's default, -1, shows "Epoch 0/-2".
    steps_per_epoch = math.ceil(num_samples / args.devices) // args.batch_size
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=math.ceil(args.steps / steps_per_epoch),
        precision="bf16-mixed",
        logger=False,  # the example saves once, by hand, at the end (then exports it); nothing to log per step
        enable_checkpointing=False,
        default_root_dir=str(out),
    )
    module = LoRAFineTune(str(base))
    data = StrideDataModule(
        num_samples=num_samples, seq_len=args.seq_len, vocab_size=vocab_size, batch_size=args.batch_size
    )
    trainer.fit(module, data)
    checkpoint = out / "checkpoints" / "finetuned.ckpt"
    trainer.save_checkpoint(checkpoint, weights_only=False)  # adapters and their optimizer state
    torch.distributed.destroy_process_group()  # the last collective: see examples/fabric_pretrain.py
    if not trainer.is_global_zero:
        return
    print(
        f"training on {'Intel Gaudi' if accelerator == 'hpu' else 'CPU processes (no Gaudi found)'}: "
        f"loss: first={module.first_loss:.4f} last={module.last_loss:.4f} steps={args.steps}",
        flush=True,
    )

    for kind in ("adapter", "merged"):
        target = out / f"hf-{kind}"
        if target.exists():
            import shutil

            shutil.rmtree(target)  # this example's own earlier output
        export_hf(checkpoint, target, hf_config=base, peft=kind)
        print(f"{kind} export: {target} ({', '.join(sorted(p.name for p in target.iterdir()))})", flush=True)
    prompt = [5, 8, 11, 14]  # stride 3
    print(f"sample from {out / 'hf-merged'}: {sample(out / 'hf-merged', prompt, 8)}", flush=True)


if __name__ == "__main__":
    main()
