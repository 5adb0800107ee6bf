"""Parameter names of Hugging Face models wrapped by PEFT, as weights files spell them.

PEFT's LoRA keeps a wrapped layer's original weight under ``<layer>.base_layer.<name>`` and adds adapter tensors
(``lora_A``, ``lora_B``, ``lora_embedding_A``/``B``, ``lora_magnitude_vector``) beside it; a plain Hugging Face file
names the original weight ``<layer>.<name>`` and has no adapters.
"""

from __future__ import annotations

BASE_LAYER = "base_layer"
ADAPTER_SEGMENTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"})


def base_key(module_key: str) -> str:
    """``module_key`` without PEFT's ``base_layer`` segments: the name the base model's file uses.

    ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.weight``."""
    return ".".join(part for part in module_key.split(".") if part != BASE_LAYER)


def is_adapter_key(module_key: str) -> bool:
    """Whether ``module_key`` names a PEFT adapter tensor (which a base model's file does not hold)."""
    return any(part in ADAPTER_SEGMENTS for part in module_key.split("."))
