"""Turn YAML-friendly values that name modules into what FSDP takes: module classes from dotted paths, the auto-wrap
and activation-checkpointing policies built from them, and submodules or parameters chosen by name
(``ignored_modules``, ``ignored_states``). Pure, like :mod:`.options`: no environment, no device, no Lightning."""

from __future__ import annotations

import difflib
import functools
import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy
from torch.nn import Module

from lightning_gaudi_fsdp.adapters import fsdp1_internals
from lightning_gaudi_fsdp.options import _expected


def import_object(path: str, argument: str) -> Any:
    """Import ``package.module.Name`` (the last dot separates the attribute)."""
    module_name, _, attr = path.strip().rpartition(".")
    if not module_name or not attr or module_name.startswith(".") or not attr.isidentifier():
        raise ValueError(f"{argument}: {path!r} is not a dotted class path such as 'torch.nn.Linear'")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, TypeError, ValueError) as err:
        raise ValueError(f"{argument}: cannot import module {module_name!r} for {path!r} ({err})") from err
    try:
        return getattr(module, attr)
    except AttributeError:
        close = difflib.get_close_matches(attr, [n for n in dir(module) if not n.startswith("_")], n=3)
        hint = f"; did you mean {_expected(f'{module_name}.{c}' for c in close)}?" if close else ""
        raise ValueError(f"{argument}: module {module_name!r} has no attribute {attr!r}{hint}") from None


def resolve_module_classes(value: object, argument: str) -> tuple[type[Module], ...]:
    """A module class, a dotted class path, or a set/list/tuple of either, as a tuple of ``nn.Module`` subclasses."""
    items = [value] if isinstance(value, str | type) else value
    if not isinstance(items, Iterable) or isinstance(items, Mapping):
        raise TypeError(
            f"{argument} must be a module class, a dotted class path or a list of them, "
            f"got {type(value).__name__} {value!r}"
        )
    classes: list[type[Module]] = []
    for item in items:
        cls = import_object(item, argument) if isinstance(item, str) else item
        if not (isinstance(cls, type) and issubclass(cls, Module)):
            raise TypeError(f"{argument}: {item!r} is not a torch.nn.Module subclass")
        if cls not in classes:
            classes.append(cls)
    if not classes:
        raise ValueError(f"{argument} is empty; give at least one module class or leave it as None")
    return tuple(classes)


def _is_class_spec(value: object) -> bool:
    return isinstance(value, str | type | set | frozenset | list | tuple)


def resolve_auto_wrap_policy(value: object) -> Callable[..., bool] | ModuleWrapPolicy | None:
    """Module classes (or their dotted paths) -> ``ModuleWrapPolicy``; an int -> size-based policy with that
    ``min_num_params``; a callable or a torch policy object is used as it is; ``None`` wraps only the root."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"auto_wrap_policy must not be a bool, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"auto_wrap_policy={value!r} must be a positive min_num_params for the size-based policy")
        return functools.partial(size_based_auto_wrap_policy, min_num_params=value)
    if _is_class_spec(value):
        return ModuleWrapPolicy(set(resolve_module_classes(value, "auto_wrap_policy")))
    if callable(value):
        return value
    raise TypeError(
        "auto_wrap_policy must be module classes, dotted class paths, an int (min_num_params), a callable "
        f"or a ModuleWrapPolicy, got {type(value).__name__} {value!r}"
    )


def resolve_activation_checkpointing_policy(value: object) -> dict[str, Any]:
    """Keyword arguments for torch's ``apply_activation_checkpointing``: ``{}`` when disabled, ``check_fn`` for
    module classes or a ``(module) -> bool`` callable, ``auto_wrap_policy`` for a torch policy object."""
    if value is None:
        return {}
    if fsdp1_internals.is_policy(value):
        return {"auto_wrap_policy": value}
    if _is_class_spec(value):
        classes = resolve_module_classes(value, "activation_checkpointing_policy")
        return {"check_fn": _InstanceOf(classes)}
    if callable(value):
        return {"check_fn": value}
    raise TypeError(
        "activation_checkpointing_policy must be module classes, dotted class paths or a callable, "
        f"got {type(value).__name__} {value!r}"
    )


class _InstanceOf:
    """A picklable ``check_fn`` that selects modules of the given classes."""

    def __init__(self, classes: tuple[type[Module], ...]) -> None:
        self.classes = classes

    def __call__(self, module: Module) -> bool:
        return isinstance(module, self.classes)

    def __repr__(self) -> str:
        return f"InstanceOf({', '.join(c.__qualname__ for c in self.classes)})"


def resolve_submodules(
    root: Module, items: Iterable[object], argument: str, allow_parameters: bool = False
) -> list[Module | torch.nn.Parameter]:
    """Turn names relative to ``root`` (``"encoder.layers.0"``) into the modules (or parameters) they name.

    Objects pass through unchanged. An unknown name raises ``ValueError`` listing the closest names.
    """
    modules = dict(root.named_modules())
    params = dict(root.named_parameters()) if allow_parameters else {}
    resolved: list[Module | torch.nn.Parameter] = []
    for item in items:
        if not isinstance(item, str):
            resolved.append(item)  # type: ignore[arg-type]
            continue
        if item in modules and item:
            resolved.append(modules[item])
        elif item in params:
            resolved.append(params[item])
        else:
            names = [n for n in modules if n] + list(params)
            close = difflib.get_close_matches(item, names, n=3, cutoff=0.5)
            hint = f"; closest: {_expected(close)}" if close else ""
            kinds = "module or parameter" if allow_parameters else "module"
            raise ValueError(f"{argument}: {item!r} is not a {kinds} of {type(root).__name__}{hint}")
    return resolved


def resolve_names_list(value: object, argument: str) -> list[Any] | None:
    """``None`` or a list/tuple/set of names or objects (resolved against the model at setup)."""
    if value is None:
        return None
    if isinstance(value, str | Module):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, Mapping):
        return list(value)
    raise TypeError(f"{argument} must be a list of module names or objects, got {type(value).__name__} {value!r}")


def resolve_callable(value: Any, argument: str) -> Any:
    if isinstance(value, str):
        value = import_object(value, argument)
    if value is not None and not callable(value):
        raise TypeError(f"{argument} must be a callable or None, got {type(value).__name__} {value!r}")
    return value
