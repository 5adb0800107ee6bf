"""The layouts a checkpoint's entries come in, and the one reader that turns each into the package's internal view.

On disk, each front door writes its own ecosystem's layout:

- the Trainer's (Lightning's ``Trainer`` checkpoint): ``state_dict``, ``optimizer_states``, ``lr_schedulers``,
  ``pytorch-lightning_version``, the loops' and callbacks' entries, and the package's bookkeeping
  (:data:`~.formats.ENGINE_KEY`, :data:`~.hf_export.HF_KEY`...) at the top level;
- Fabric's (Lightning Fabric's ``FSDPStrategy.save_checkpoint``): each entry of the ``state`` given to
  ``fabric.save`` under its own key (the model as its state dict, an optimizer as its state keyed by parameter name,
  anything else as given), and the package's bookkeeping under the one key :data:`BOOK_KEY`, which ``fabric.save``
  refuses as a name of the user's. A sharded checkpoint keeps the model and optimizers in the DCP files under their
  keys of ``state``, everything else in ``meta.pt``; a local one keeps them in its rank files.

Readers see one internal view, the Trainer's layout: :func:`internal_view` recognises the layout of a file (or of a
directory's ``meta.pt``/``trainer_state.pt``) and translates. A Fabric checkpoint's view carries :data:`FABRIC_KEYS`
(which entry of ``state`` went where) and, for a sharded one, :data:`DCP_KEYS`. Files of release 0.x, whose Fabric door
wrote the Trainer's layout with :data:`FABRIC_KEYS` at the top level, are read as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_gaudi_fsdp.checkpoint.formats import (
    BOOK_KEY,
    ENGINE_KEY,
    OPTIMIZER_GROUPS_KEY,
    PARAM_ID_NAMES_KEY,
    SHARDED_METADATA,
    WORLD_SIZE_KEY,
    CheckpointError,
)
from lightning_gaudi_fsdp.checkpoint.trust import load_file
from lightning_gaudi_fsdp.engine.pieces import optimizer_state_by_name

FABRIC_KEYS = "gaudi_fsdp_fabric_keys"  # internal view (top level of 0.x Fabric files): where Fabric's entries went
DCP_KEYS = "gaudi_fsdp_dcp_keys"  # internal view of a sharded checkpoint: the model's and optimizers' DCP keys
VERSION_KEY = "pytorch-lightning_version"  # the Trainer refuses a checkpoint without it
TRAINER_KEYS = ("state_dict", "optimizer_states", "lr_schedulers", VERSION_KEY)
_HF_KEY = "gaudi_fsdp_hf_model"  # hf_export.HF_KEY (not imported: hf_export imports transformers' names lazily)
# under BOOK_KEY in Fabric's layout, at the top in the view
_BOOKKEEPING = (ENGINE_KEY, _HF_KEY, OPTIMIZER_GROUPS_KEY, WORLD_SIZE_KEY)
INTERNAL_KEYS = (*TRAINER_KEYS, *_BOOKKEEPING, PARAM_ID_NAMES_KEY, FABRIC_KEYS, DCP_KEYS)


def reserved_keys() -> tuple[str, ...]:
    """Names a Fabric ``state`` may not use: the bookkeeping key and those of the Trainer's layout."""
    return (BOOK_KEY, *TRAINER_KEYS, FABRIC_KEYS)


def fabric_layout(view: dict[str, Any]) -> dict[str, Any]:
    """The internal view of a checkpoint the Fabric door built (with :data:`FABRIC_KEYS`) in Fabric's layout: the
    model and optimizers back under their keys of ``state`` (a full optimizer state keyed by parameter name, as
    Lightning's Fabric writes it), the other entries as they are, the bookkeeping under :data:`BOOK_KEY`."""
    view = dict(view)
    keys = view.pop(FABRIC_KEYS)
    view.pop(DCP_KEYS, None)
    names = view.pop(PARAM_ID_NAMES_KEY, None)
    out: dict[str, Any] = {}
    if "state_dict" in view:
        out[keys["model"]] = view.pop("state_dict")
    for key, state in zip(keys["optimizers"], view.pop("optimizer_states", None) or [], strict=False):
        by_id = isinstance(state, Mapping) and any(isinstance(k, int) for k in state.get("state", {}))
        out[key] = optimizer_state_by_name(dict(state), names) if by_id and names else state
    view.pop("lr_schedulers", None)
    book: dict[str, Any] = {
        "layout": "fabric",
        "model": keys["model"],
        "optimizers": list(keys["optimizers"]),
        "schedulers": list(keys.get("schedulers", [])),
        "lightning_version": view.pop(VERSION_KEY, None),
    }
    book.update((key, view.pop(key)) for key in _BOOKKEEPING if key in view)
    out.update(view)
    out[BOOK_KEY] = book
    return out


def internal_view(
    obj: Any,
    path: Path,
    *,
    raw: bool = False,
    model_key: str | None = None,
    optimizer_keys: Sequence[str] = (),
) -> dict[str, Any]:
    """A single checkpoint file's content, or a directory checkpoint's ``meta.pt``/``trainer_state.pt``, as the
    internal view (the Trainer's layout; see the module docstring). Recognised: this package's Fabric layout (by
    :data:`BOOK_KEY`), the Trainer's (by ``state_dict``), with ``raw`` a plain model state dict (names to tensors),
    and Lightning's own Fabric layout, whose model is the entry ``model_key`` (the key of ``state`` at
    ``fabric.load``), else ``"model"``, else its only state dict, and whose optimizers are ``optimizer_keys``, else
    every entry holding ``state`` and ``param_groups``. Raises :class:`~.formats.CheckpointError` for anything else."""
    if not isinstance(obj, dict):
        raise CheckpointError(path, f"it holds a {type(obj).__name__}, not a checkpoint (a dict)")
    book = obj.get(BOOK_KEY)
    if isinstance(book, Mapping) and book.get("layout") == "fabric":
        view = {k: v for k, v in obj.items() if k != BOOK_KEY}
        return _fabric_view(view, book["model"], list(book["optimizers"]), book)
    if "state_dict" in obj or VERSION_KEY in obj or FABRIC_KEYS in obj:
        return dict(obj)  # the Trainer's layout (and the Fabric door's before this layout)
    if raw and _is_plain_state_dict(obj):
        return {"state_dict": obj}
    found = _lightning_model_key(obj, model_key)
    if found is None and any(isinstance(v, torch.Tensor) for v in obj.values()):
        what = "a Lightning checkpoint nor a model state dict" if raw else "a Lightning checkpoint"
        raise CheckpointError(path, f"it has no 'state_dict' entry; it is not {what}")
    optimizers = [k for k in optimizer_keys if k in obj] or [k for k, v in obj.items() if _is_optimizer_state(v)]
    if found is None and not optimizers and not model_key:
        return dict(obj)  # a directory's metadata in Lightning's Fabric layout: the user's entries only
    if found is None:
        raise CheckpointError(
            path, "it has no model entry: neither the Trainer's 'state_dict' nor a Fabric entry such as 'model'"
        )
    return _fabric_view(dict(obj), found, optimizers, {})


def file_view(
    obj: Any, path: Path, *, raw: bool = False, model_key: str | None = None, optimizer_keys: Sequence[str] = ()
) -> dict[str, Any]:
    """:func:`internal_view` of a single-file checkpoint, which must hold a model (its ``state_dict`` in the view)."""
    view = internal_view(obj, path, raw=raw, model_key=model_key, optimizer_keys=optimizer_keys)
    if "state_dict" not in view:
        what = "a Lightning checkpoint nor a model state dict" if raw else "a Lightning checkpoint"
        raise CheckpointError(path, f"it has no 'state_dict' entry; it is not {what}")
    return view


def _fabric_view(
    view: dict[str, Any], model_key: str, optimizer_keys: list[str], book: Mapping[str, Any]
) -> dict[str, Any]:
    schedulers = list(book.get("schedulers", []))
    if model_key in view:
        view["state_dict"] = view.pop(model_key)
    states = [view.pop(k) for k in optimizer_keys if k in view]
    if states:
        view["optimizer_states"] = states
    view["lr_schedulers"] = [view[k] for k in schedulers if k in view]  # where the Trainer looks for them
    if book.get("lightning_version"):
        view[VERSION_KEY] = book["lightning_version"]
    view.update((key, book[key]) for key in _BOOKKEEPING if key in book)
    view[FABRIC_KEYS] = {"model": model_key, "optimizers": optimizer_keys, "schedulers": schedulers}
    view[DCP_KEYS] = {"model": model_key, "optimizers": optimizer_keys}
    return view


def dcp_model_key(view: Mapping[str, Any]) -> str:
    """The key of the model's entries in a sharded checkpoint's DCP files (the Trainer's: ``model``)."""
    return view.get(DCP_KEYS, {}).get("model", "model")


def dcp_optimizer_key(view: Mapping[str, Any], index: int) -> str | None:
    """The key of optimizer ``index``'s entries in a sharded checkpoint's DCP files (the Trainer's:
    ``optimizer_<index>``); None where a Fabric checkpoint holds fewer optimizers."""
    keys = view.get(DCP_KEYS)
    if keys is None:
        return f"optimizer_{index}"
    return keys["optimizers"][index] if index < len(keys["optimizers"]) else None


def with_dcp_keys(
    view: dict[str, Any], entries: Sequence[str], model_key: str | None = None, optimizer_keys: Sequence[str] = ()
) -> dict[str, Any]:
    """A sharded checkpoint's view given its DCP entries: a directory in Lightning's own Fabric layout (its
    ``meta.pt`` names neither) gets the model's key (``model_key``, else ``"model"``, else its only key that is not an
    optimizer's) and the optimizers' (``optimizer_keys`` where all are there, else the keys with a ``state`` or
    ``param_groups`` entry)."""
    if DCP_KEYS in view or "state_dict" in view or VERSION_KEY in view or FABRIC_KEYS in view:
        return view
    tops = list(dict.fromkeys(e.split(".", 1)[0] for e in entries))
    optimizers = [t for t in tops if any(e.startswith((f"{t}.state.", f"{t}.param_groups")) for e in entries)]
    if optimizer_keys and set(optimizer_keys) <= set(optimizers):
        optimizers = list(optimizer_keys)
    models = [t for t in tops if t not in optimizers]
    if model_key in models:
        model = model_key
    elif "model" in models or len(models) != 1:
        model = "model"
    else:
        model = models[0]
    view = {**view, FABRIC_KEYS: {"model": model, "optimizers": optimizers, "schedulers": []}}
    view[DCP_KEYS] = {"model": model, "optimizers": optimizers}
    return view


def is_fabric(view: Mapping[str, Any]) -> bool:
    """Whether the view is of a checkpoint in Fabric's layout (this package's Fabric door, of any release, or
    Lightning's own Fabric)."""
    return FABRIC_KEYS in view


def _lightning_model_key(obj: Mapping[str, Any], model_key: str | None) -> str | None:
    for key in (model_key, "model"):
        if key is not None and _is_plain_state_dict(obj.get(key)):
            return key
    candidates = [k for k, v in obj.items() if _is_plain_state_dict(v)]
    return candidates[0] if len(candidates) == 1 else None


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, Mapping) and {"state", "param_groups"} <= set(value)


def _is_plain_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, dict)
        and all(isinstance(k, str) for k in obj)
        and any(isinstance(v, torch.Tensor) for v in obj.values())
        and not _is_optimizer_state(obj)
    )


def sharded_view(path: Path, metadata: Any, weights_only: bool) -> dict[str, Any]:
    """The internal view of a sharded checkpoint's ``meta.pt`` (either door's layout), naming the DCP keys of its
    model and optimizers; ``metadata``: the checkpoint's DCP metadata, read once by the caller."""
    rest = load_file(path / SHARDED_METADATA, path, "the trainer state", weights_only=weights_only)
    return with_dcp_keys(internal_view(rest, path), list(metadata.state_dict_metadata))
