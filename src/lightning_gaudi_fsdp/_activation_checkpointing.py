"""Activation checkpointing of the strategy's ``activation_checkpointing_policy``, and what it needs from the models
it runs inside.

Hugging Face ``transformers`` 4.x models build a KV cache in training too (``config.use_cache`` is on by default).
Recomputing a checkpointed decoder layer in backward appends to that cache a second time, and torch stops with
``CheckpointError: Recomputed values ... have different metadata``. transformers' own gradient checkpointing turns
the cache off per call while the model is in training mode; this module does the same for the layers the strategy
checkpoints, so evaluation and generation keep the user's setting.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

from torch.nn import Module

from lightning_gaudi_fsdp.adapters import torch_internals
from lightning_gaudi_fsdp.adapters.fsdp1_internals import clean_name

log = logging.getLogger("lightning_gaudi_fsdp")


def apply_activation_checkpointing(model: Module, kwargs: Mapping[str, Any]) -> list[str]:
    """Wrap the modules selected by ``kwargs`` (``check_fn`` or ``auto_wrap_policy``) in torch's checkpoint wrapper.

    Returns the names of the ``transformers`` models whose KV cache is now off in training (empty if none)."""
    if not kwargs:
        return []
    torch_internals.apply_checkpoint_wrapper(model, **kwargs)
    return apply_cache_off_in_training(model)


def apply_cache_off_in_training(model: Module) -> list[str]:
    """On every ``transformers`` model inside ``model`` that contains a checkpointed layer and has
    ``config.use_cache`` on, pass ``use_cache=False`` to its forward while it is in training mode."""
    names = []
    for name, module in model.named_modules():
        if not _uses_kv_cache(module) or not any(torch_internals.is_checkpoint_wrapper(m) for m in module.modules()):
            continue
        module.register_forward_pre_hook(_cache_off_in_training, with_kwargs=True)
        names.append(clean_name(name))
    if names:
        log.info(
            "transformers KV cache off in training for %s (activation checkpointing recomputes layers; "
            "evaluation keeps config.use_cache)",
            ", ".join(names),
        )
    return names


def _uses_kv_cache(module: Module) -> bool:
    config = getattr(module, "config", None)
    if not type(module).__module__.startswith("transformers.") or not getattr(config, "use_cache", False):
        return False
    try:
        return "use_cache" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _cache_off_in_training(
    module: Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if module.training and kwargs.get("use_cache") is not False:
        return args, {**kwargs, "use_cache": False}
    return None
