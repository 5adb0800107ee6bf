"""Names of a PEFT-wrapped model's weights and their Hugging Face counterparts, and of a Hugging Face model
directory's weight files (what ``save_pretrained`` writes; read for ``pretrained_weights``, written by ``convert --to
hf``).

PEFT (LoRA) keeps a wrapped layer's original weight as ``<layer>.base_layer.weight`` and adds its adapters as
``<layer>.lora_A.<adapter>.weight`` (``lora_B``, ``lora_embedding_A/B``, ``lora_magnitude_vector`` for DoRA).
"""

from __future__ import annotations

MODEL_FILE = "model.safetensors"  # a model saved in one file
MODEL_INDEX = "model.safetensors.index.json"  # which of several files holds each key
BASE_LAYER = "base_layer"
ADAPTER_SEGMENTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"})


def base_key(module_key: str) -> str:
    """The key of the same weight in the model without adapters: every ``.base_layer`` segment dropped
    (``q_proj.base_layer.weight`` -> ``q_proj.weight``); other keys are returned unchanged."""
    return ".".join(part for part in module_key.split(".") if part != BASE_LAYER)


def is_adapter_key(module_key: str) -> bool:
    """Whether ``module_key`` names a LoRA adapter tensor (``lora_A``, ``lora_B``, ``lora_embedding_A/B``,
    ``lora_magnitude_vector``), not a base weight."""
    return any(part in ADAPTER_SEGMENTS for part in module_key.split("."))
