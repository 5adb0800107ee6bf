"""The strategies' arguments, checked once: :func:`resolve` turns what a user passes to either front door (the
Trainer's ``strategy.GaudiFSDPStrategy`` or Fabric's ``fabric.GaudiFSDPStrategy``) into one frozen :class:`Resolved`,
before any process starts; :func:`adopt` keeps it on the door (``door._config``) after Lightning's ``__init__``.

Adding an argument: its parameter and docstring line in both doors' signatures (the Trainer's spells it out for
LightningCLI; ``tests/test_fabric.py`` keeps Fabric's equal), its parameter here in :func:`resolve` with its
:class:`Resolved` field and the ``options.resolve_*`` call that checks it, and the code that reads
``door._config.<field>``. Nothing else copies it."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_gaudi_fsdp import _preemption, _rendezvous, module_options, options
from lightning_gaudi_fsdp.checkpoint import pretrained
from lightning_gaudi_fsdp.engine import base as engine


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Every constructor argument, checked and in the form the strategies use."""

    parent: dict[str, Any]  # arguments of Lightning's FSDPStrategy.__init__ (Trainer's and Fabric's take the same)
    process_group: Any
    device_mesh: Any
    state_dict_type: str
    fsdp_version: int
    mp_policy: Any
    ignored_modules: Any
    ignored_states: Any
    device_id: Any
    activation_checkpointing_kwargs: dict[str, Any]
    compile_kwargs: dict[str, Any] | None
    eager_pipeline: bool | None
    keep_batch_dtypes: bool
    check_free_space: bool | None
    checkpoint_crc32: bool
    pretrained: pretrained.Weights | None
    failure_timeout: float  # seconds: argument, else LIGHTNING_GAUDI_FSDP_FAILURE_TIMEOUT, else 60
    stuck_timeout: float | None  # seconds a rank may wait in one collective before the stuck rank is named; off
    preemption: str  # "save" or "exit"
    preemption_grace: float  # seconds from a SIGTERM until every rank has left


def resolve(
    *,
    process_group_backend: str | None = None,
    timeout: timedelta | float | None = default_pg_timeout,
    sharding_strategy: Any = "FULL_SHARD",
    process_group: Any = None,
    device_mesh: Any = None,
    cpu_offload: Any = False,
    auto_wrap_policy: Any = None,
    backward_prefetch: Any = "BACKWARD_PRE",
    mixed_precision: Any = None,
    ignored_modules: Any = None,
    ignored_states: Any = None,
    param_init_fn: Any = None,
    device_id: Any = None,
    sync_module_states: Any = False,
    forward_prefetch: Any = False,
    limit_all_gathers: Any = True,
    use_orig_params: Any = True,
    state_dict_type: Any = "full",
    activation_checkpointing_policy: Any = None,
    compile: Any = False,
    eager_pipeline: Any = None,
    fsdp_version: Any = 1,
    check_free_space: Any = None,
    checkpoint_crc32: Any = False,
    pretrained_weights: Any = None,
    pretrained_prefix: Any = "",
    failure_timeout: Any = None,
    stuck_timeout: Any = None,
    preemption: Any = "save",
    preemption_grace: Any = _preemption.DEFAULT_GRACE_S,
) -> Resolved:
    """Check and convert the arguments both strategies take (same checks, same messages, before any process). The
    defaults here are those of both strategies (the Trainer's spells them out again in its signature, which
    LightningCLI reads; a test keeps the two equal)."""
    sharding = options.resolve_sharding_strategy(sharding_strategy)
    wrap_policy = module_options.resolve_auto_wrap_policy(auto_wrap_policy)
    mesh = options.resolve_device_mesh(device_mesh)
    options.check_hybrid_requirements(sharding, wrap_policy, process_group, mesh)
    state_dict_type = options.resolve_state_dict_type(state_dict_type)
    version = options.resolve_fsdp_version(fsdp_version)
    prefetch = options.resolve_backward_prefetch(backward_prefetch)
    limit = options.resolve_bool(limit_all_gathers, "limit_all_gathers")
    orig = options.resolve_bool(use_orig_params, "use_orig_params")
    chosen = engine.select(version)
    chosen.check_arguments(
        sharding_strategy=sharding,
        process_group=process_group,
        backward_prefetch=prefetch,
        limit_all_gathers=limit,
        use_orig_params=orig,
        state_dict_type=state_dict_type,
        device_mesh=mesh,
    )
    mp_policy = chosen.mixed_precision_policy(mixed_precision)
    parent = {
        "process_group_backend": options.resolve_process_group_backend(process_group_backend),
        "timeout": options.resolve_timeout(timeout),
        "cpu_offload": options.resolve_cpu_offload(cpu_offload),
        "mixed_precision": chosen.mixed_precision_config(mixed_precision),
        "auto_wrap_policy": wrap_policy,
        "sharding_strategy": sharding,
        "state_dict_type": state_dict_type,
        "device_mesh": mesh,
        "process_group": process_group,
        "backward_prefetch": prefetch,
        "param_init_fn": module_options.resolve_callable(param_init_fn, "param_init_fn"),
        "sync_module_states": options.resolve_bool(sync_module_states, "sync_module_states"),
        "forward_prefetch": options.resolve_bool(forward_prefetch, "forward_prefetch"),
        "limit_all_gathers": limit,
        "use_orig_params": orig,
    }
    weights = pretrained.resolve(pretrained_weights, pretrained_prefix)
    if weights is not None and parent["param_init_fn"] is not None:
        raise ValueError(
            "param_init_fn and pretrained_weights cannot be combined: with pretrained_weights the strategy builds "
            "the parameters on the meta device and fills them from the file (PEFT adapters as PEFT initialises them)"
        )
    if weights is not None and parent["sync_module_states"]:
        raise ValueError(
            "sync_module_states=True and pretrained_weights cannot be combined: every rank reads its own shards from "
            "the file, there is no rank 0 model to broadcast"
        )
    ignored_modules = module_options.resolve_names_list(ignored_modules, "ignored_modules")
    ignored_states = module_options.resolve_names_list(ignored_states, "ignored_states")
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("ignored_modules and ignored_states are mutually exclusive; pass only one of them")
    return Resolved(
        parent=parent,
        process_group=process_group,
        device_mesh=mesh,
        state_dict_type=state_dict_type,
        fsdp_version=version,
        mp_policy=mp_policy,
        ignored_modules=ignored_modules,
        ignored_states=ignored_states,
        device_id=options.resolve_device_id(device_id),
        activation_checkpointing_kwargs=module_options.resolve_activation_checkpointing_policy(
            activation_checkpointing_policy
        ),
        compile_kwargs=options.resolve_compile(compile),
        eager_pipeline=None if eager_pipeline is None else options.resolve_bool(eager_pipeline, "eager_pipeline"),
        keep_batch_dtypes=options.keeps_batch_dtypes(mixed_precision),
        check_free_space=None
        if check_free_space is None
        else options.resolve_bool(check_free_space, "check_free_space"),
        checkpoint_crc32=options.resolve_bool(checkpoint_crc32, "checkpoint_crc32"),
        pretrained=weights,
        failure_timeout=_rendezvous.failure_timeout(options.resolve_seconds(failure_timeout, "failure_timeout")),
        stuck_timeout=options.resolve_seconds(stuck_timeout, "stuck_timeout"),
        preemption=options.resolve_preemption(preemption),
        preemption_grace=options.resolve_preemption_grace(preemption_grace),
    )


def resolve_from(arguments: Mapping[str, Any]) -> Resolved:
    """:func:`resolve` with the arguments of a strategy's ``__init__`` (its ``locals()``)."""
    return resolve(**{name: arguments[name] for name in inspect.signature(resolve).parameters})


def resolve_keywords(door: str, arguments: Mapping[str, Any]) -> Resolved:
    """:func:`resolve` with keyword arguments a strategy passes on as given; an unknown name is a ``TypeError``
    naming ``door``."""
    known = inspect.signature(resolve).parameters
    unknown = sorted(set(arguments) - set(known))
    if unknown:
        raise TypeError(f"{door} got unexpected keyword argument(s) {unknown}; it takes {sorted(known)}")
    return resolve(**arguments)


def adopt(door: Any, resolved: Resolved, kwargs: dict[str, Any]) -> None:
    """After Lightning's ``__init__``: keep the resolved arguments on the strategy as ``door._config`` (the one place
    the package reads them from) with the engine they choose, and set the Lightning attributes Lightning's own code
    reads (``kwargs``: the FSDP keyword arguments Lightning collected)."""
    if resolved.process_group is None:
        kwargs.pop("process_group", None)
    # Kept apart from the kwargs: Lightning would build a tuple mesh on "cuda"; it is built on our device.
    kwargs.pop("device_mesh", None)
    door._config = resolved
    door._engine = engine.select(resolved.fsdp_version)  # chosen once; the door asks it for what differs
    door._device_mesh = resolved.device_mesh  # replaced by the mesh built once the process group exists
    door._state_dict_type = resolved.state_dict_type
    door._activation_checkpointing_kwargs = resolved.activation_checkpointing_kwargs  # Lightning's hand-wrapped path
    door._fsdp_root = None
    door._cache_off_in_training = []  # transformers models whose KV cache is off in training
    door._heartbeat = None
    door._preempt = None  # the SIGTERM watcher while one runs (preemption="save")
