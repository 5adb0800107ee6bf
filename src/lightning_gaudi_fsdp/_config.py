"""The strategies' arguments, defined and checked once: :func:`resolve`'s signature is the one definition of every
argument both front doors take (the Trainer's ``strategy.GaudiFSDPStrategy`` and Fabric's
``fabric.GaudiFSDPStrategy``): its names, types and defaults. :func:`takes_arguments` gives each door's ``__init__``
that signature (after the door's own Lightning plugins), so ``help()``, IDEs, the API reference and LightningCLI see
each argument; a door may change a default (Fabric's ``state_dict_type``, as Lightning's own two doors differ).
:func:`resolve` turns the values into one frozen :class:`Resolved` before any process starts; :func:`adopt` keeps it
on the door (``door._config``) after Lightning's ``__init__``.

Adding an argument: its parameter here in :func:`resolve` (typed, with its default), its docstring line under the
Trainer door's ``Arguments:``, its :class:`Resolved` field and the ``options.resolve_*`` call that checks it, and the
code that reads ``door._config.<field>``. Nothing else copies it (docs/architecture.md walks one through;
tests/test_strategy.py checks every argument is documented and lands in :class:`Resolved`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn import Module, Parameter

from lightning_gaudi_fsdp import _liveness, _preemption, _rendezvous, module_options, options
from lightning_gaudi_fsdp.checkpoint import pretrained
from lightning_gaudi_fsdp.engine import base as engine

# The spellings each argument accepts (evaluated at run time: LightningCLI reads them from the doors' signatures).
WrapPolicyInput = int | str | list[str] | set[type[Module]] | list[type[Module]] | ModuleWrapPolicy | Callable | None
CheckpointPolicyInput = str | list[str] | set[type[Module]] | list[type[Module]] | Callable | None
_Init = TypeVar("_Init", bound=Callable[..., None])


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Every option the package acts on, checked and in the form the code that acts on it uses. Engines and helpers
    read ``door._config`` and nothing else (not Lightning's ``kwargs`` or its private copies of the options)."""

    parent: dict[str, Any]  # arguments of Lightning's FSDPStrategy.__init__ (Trainer's and Fabric's take the same)
    process_group_backend: str | None  # None: hccl on Gaudi, gloo on CPU (see _platform.process_group_backend)
    timeout: timedelta
    sharding_strategy: ShardingStrategy
    process_group: Any
    # The argument (None, [replicas, shard] or a DeviceMesh) until the process group exists; then the one DeviceMesh
    # the engine uses (built once: _platform.build_mesh, with the engine's default_mesh); FSDP1 may take none.
    device_mesh: Any
    cpu_offload: CPUOffload
    auto_wrap_policy: Any  # an FSDP1 wrap policy or callable; FSDP2 picks its units with it too
    backward_prefetch: BackwardPrefetch | None
    # FSDP1's (None under FSDP2); without it FSDP1 takes the precision plugin's (Lightning's mixed_precision_config)
    mixed_precision: MixedPrecision | None
    mp_policy: Any  # FSDP2's MixedPrecisionPolicy (None under FSDP1)
    param_init_fn: Callable[[Module], None] | None
    sync_module_states: bool
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool
    state_dict_type: str
    engine: engine.Engine  # chosen once, from fsdp_version: the one record of it (engine.version)
    ignored_modules: Any
    ignored_states: Any
    device_id: Any
    activation_checkpointing_kwargs: dict[str, Any]
    compile_kwargs: dict[str, Any] | None
    eager_pipeline: bool | None
    keep_batch_dtypes: bool
    check_free_space: bool | None
    checkpoint_crc32: bool
    verify_checkpoints: bool  # checksums recorded on every save, verified on every load
    pretrained: pretrained.Weights | None
    failure_timeout: float  # seconds: argument, else LIGHTNING_GAUDI_FSDP_FAILURE_TIMEOUT, else 60
    stuck_timeout: float | None  # seconds a rank may wait in one collective before the stuck rank is named; off
    heartbeat: bool  # LIGHTNING_GAUDI_FSDP_HEARTBEAT not "0": the liveness heartbeat, and preemption="save" with it
    preemption: str  # "save" or "exit"
    preemption_grace: float  # seconds from a SIGTERM until every rank has left
    async_save: bool

    @property
    def has_mixed_precision(self) -> bool:
        """Whether ``mixed_precision`` sets FSDP's dtypes, on either engine."""
        return self.mixed_precision is not None or self.mp_policy is not None


def resolve(
    *,
    process_group_backend: str | None = None,
    timeout: timedelta | float | None = default_pg_timeout,
    sharding_strategy: str | ShardingStrategy = "FULL_SHARD",
    process_group: Any = None,
    device_mesh: tuple[int, int] | list[int] | DeviceMesh | None = None,
    cpu_offload: bool | CPUOffload = False,
    auto_wrap_policy: WrapPolicyInput = None,
    backward_prefetch: str | BackwardPrefetch | None = "BACKWARD_PRE",
    mixed_precision: dict[str, Any] | MixedPrecision | None = None,
    ignored_modules: list[str] | list[Module] | None = None,
    ignored_states: list[str] | list[Module] | list[Parameter] | None = None,
    param_init_fn: str | Callable[[Module], None] | None = None,
    device_id: int | str | torch.device | None = None,
    sync_module_states: bool = False,
    forward_prefetch: bool = False,
    limit_all_gathers: bool = True,
    use_orig_params: bool = True,
    state_dict_type: str = "full",
    activation_checkpointing_policy: CheckpointPolicyInput = None,
    compile: bool | dict[str, Any] = False,
    eager_pipeline: bool | None = None,
    fsdp_version: int = 1,
    check_free_space: bool | None = None,
    checkpoint_crc32: bool = False,
    verify_checkpoints: bool = True,
    pretrained_weights: str | None = None,
    pretrained_prefix: str = "",
    failure_timeout: float | None = None,
    stuck_timeout: float | None = None,
    preemption: str = "save",
    preemption_grace: float = _preemption.DEFAULT_GRACE_S,
    async_save: bool = False,
) -> Resolved:
    """Check and convert the arguments both strategies take (same checks, same messages, before any process). This
    signature is theirs (see :func:`takes_arguments`); the types say what a user may pass, each value is checked
    here whatever its type."""
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
        process_group_backend=parent["process_group_backend"],
        timeout=parent["timeout"],
        sharding_strategy=sharding,
        process_group=process_group,
        device_mesh=mesh,
        cpu_offload=parent["cpu_offload"],
        auto_wrap_policy=wrap_policy,
        backward_prefetch=prefetch,
        mixed_precision=parent["mixed_precision"],
        mp_policy=mp_policy,
        param_init_fn=parent["param_init_fn"],
        sync_module_states=parent["sync_module_states"],
        forward_prefetch=parent["forward_prefetch"],
        limit_all_gathers=limit,
        use_orig_params=orig,
        state_dict_type=state_dict_type,
        engine=chosen,
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
        checkpoint_crc32=_resolve_crc32(checkpoint_crc32),
        verify_checkpoints=options.resolve_bool(verify_checkpoints, "verify_checkpoints"),
        pretrained=weights,
        failure_timeout=_rendezvous.failure_timeout(options.resolve_seconds(failure_timeout, "failure_timeout")),
        stuck_timeout=options.resolve_seconds(stuck_timeout, "stuck_timeout"),
        heartbeat=_liveness.heartbeat_switch(),
        preemption=options.resolve_preemption(preemption),
        preemption_grace=options.resolve_preemption_grace(preemption_grace),
        async_save=options.resolve_bool(async_save, "async_save"),
    )


CRC32_DEPRECATED = (
    "checkpoint_crc32 is deprecated: the checksums verify_checkpoints=True records (XXH3-64 of every byte, verified "
    "before every load) supersede torch's zip CRC32s, which no load reads. checkpoint_crc32=True still writes them for "
    "zip tools (unzip -t) in this release, and makes a streamed full save send every piece through rank 0; leave it "
    "out (verify_checkpoints=False turns checksums off)."
)


def _resolve_crc32(value: Any) -> bool:
    """``checkpoint_crc32``, deprecated: ``True`` says so once, on rank 0 (:data:`CRC32_DEPRECATED`)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_deprecation

    crc32 = options.resolve_bool(value, "checkpoint_crc32")
    if crc32:
        rank_zero_deprecation(CRC32_DEPRECATED)
    return crc32


def takes_arguments(**door_defaults: Any) -> Callable[[_Init], _Init]:
    """Give a door's ``__init__(self, <its Lightning plugins>, **arguments)`` the signature ``help()``, IDEs, the API
    reference and LightningCLI read: its own parameters, then every parameter of :func:`resolve`, keyword-only, typed,
    with the door's defaults (``door_defaults`` replaces some). The ``__init__`` receives every argument in
    ``arguments``, with those defaults filled in; an unknown name is a ``TypeError`` naming the door."""
    unknown_defaults = set(door_defaults) - set(_SIGNATURE.parameters)
    if unknown_defaults:
        raise TypeError(f"takes_arguments: {sorted(unknown_defaults)} are not arguments of resolve()")

    def decorate(init: _Init) -> _Init:
        own = [p for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD]
        own_hints = typing.get_type_hints(init)
        own = [p.replace(annotation=own_hints.get(p.name, p.annotation)) for p in own]
        shared = [
            p.replace(kind=p.KEYWORD_ONLY, default=door_defaults.get(p.name, p.default), annotation=_HINTS[p.name])
            for p in _SIGNATURE.parameters.values()
        ]
        signature = inspect.Signature([*own, *shared], return_annotation=None)

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            unknown = sorted(name for name in kwargs if name not in signature.parameters)
            if unknown:
                takes = sorted(name for name in signature.parameters if name != "self")
                raise TypeError(f"{type(self).__name__} got unexpected keyword argument(s) {unknown}; it takes {takes}")
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            init(**bound.arguments)  # the door's own parameters by name, the shared ones into its **arguments

        __init__.__signature__ = signature  # type: ignore[attr-defined]
        __init__.__annotations__ = {p.name: p.annotation for p in signature.parameters.values() if p.name != "self"}
        __init__.__annotations__["return"] = None
        del __init__.__wrapped__  # type: ignore[attr-defined]  # inspect and jsonargparse read __signature__
        return __init__  # type: ignore[return-value]

    return decorate


def adopt(door: Any, resolved: Resolved, kwargs: dict[str, Any]) -> None:
    """After Lightning's ``__init__``: keep the resolved options on the strategy as ``door._config`` (the one place
    the package reads them from) with the engine they choose, and set, here only, what Lightning's own code reads
    (``kwargs``: the FSDP keyword arguments Lightning collected, ``door.kwargs`` / ``door._fsdp_kwargs``)."""
    door._config = resolved
    door._engine = resolved.engine  # the door asks it for what differs
    # Lightning's own code that still runs under these doors, and what it reads (set once, here):
    # - ``kwargs``: FSDPStrategy.setup_optimizers (Trainer) and setup_module_and_optimizers/setup_optimizer (Fabric)
    #   read ``use_orig_params``; _setup_model (Trainer) and setup_module (Fabric) drop ``auto_wrap_policy`` from it
    #   for a root wrapped by hand; their setup_environment would build a tuple ``device_mesh`` on "cuda", so the
    #   mesh is kept out of it (built on our device: _platform.after_process_group), and so is an unset
    #   ``process_group``.
    # - ``_activation_checkpointing_kwargs``: _setup_model (Trainer) and setup_module (Fabric) apply it to a root
    #   wrapped by hand (engine.fsdp1.FSDP1.adopt_wrapped hands such a root to them).
    # - ``_state_dict_type``: Lightning's __init__ already set it from ``resolved.parent``; its readers (the
    #   doors' save/load and state-dict hooks) are all overridden, and the package reads ``_config.state_dict_type``.
    if resolved.process_group is None:
        kwargs.pop("process_group", None)
    kwargs.pop("device_mesh", None)
    door._activation_checkpointing_kwargs = resolved.activation_checkpointing_kwargs
    door._fsdp_root = None
    door._cache_off_in_training = []  # transformers models whose KV cache is off in training
    door._heartbeat = None
    door._preempt = None  # the SIGTERM watcher while one runs (preemption="save")


def with_mesh(door: Any, mesh: Any) -> None:
    """Once the process group exists: the device mesh built from ``device_mesh`` replaces the argument in
    ``door._config`` (the only change a :class:`Resolved` sees after construction)."""
    if mesh is not door._config.device_mesh:
        door._config = dataclasses.replace(door._config, device_mesh=mesh)


_SIGNATURE = inspect.signature(resolve)
_HINTS = typing.get_type_hints(resolve)
