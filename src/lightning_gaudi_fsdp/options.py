"""Turn YAML-friendly option values into the torch FSDP objects they name.

Every function here is pure: it reads no environment variable, touches no device and does not import Lightning.
Each ``resolve_*`` accepts either the torch object itself or its plain spelling (a name in any case, a dotted class
path, a dtype name) and raises ``ValueError``/``TypeError`` naming the argument, the bad value and what is accepted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

from lightning_gaudi_fsdp.adapters import fsdp1_internals

StateDictType = Literal["full", "sharded", "local"]
FSDPVersion = Literal[1, 2]
FSDP_VERSIONS: tuple[int, ...] = (1, 2)
STATE_DICT_TYPES: tuple[str, ...] = ("full", "sharded", "local")
PROCESS_GROUP_BACKENDS: tuple[str, ...] = ("hccl", "gloo", "nccl", "mpi")

# One explicit table of the dtype spellings accepted in configs (``torch.`` prefixes are stripped first).
TORCH_DTYPE_MAP: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}

MIXED_PRECISION_KEYS: tuple[str, ...] = (
    "param_dtype",
    "reduce_dtype",
    "buffer_dtype",
    "keep_low_precision_grads",
    "cast_forward_inputs",
    "cast_root_forward_inputs",
    "output_dtype",  # FSDP2 only
)
_MIXED_PRECISION_DTYPE_KEYS = MIXED_PRECISION_KEYS[:3]


def _expected(values: Iterable[str]) -> str:
    return ", ".join(repr(v) for v in values)


def _unsupported(argument: str, value: object, accepted: Iterable[str]) -> ValueError:
    return ValueError(f"{argument}={value!r} is not supported; expected one of {_expected(accepted)}")


def _resolve_enum_name(value: object, enum_cls: type, argument: str) -> Any:
    """Match ``value`` against the members of ``enum_cls`` by name, case-insensitively."""
    if isinstance(value, enum_cls):
        return value
    names = list(enum_cls.__members__)
    if isinstance(value, str):
        key = value.strip().upper()
        if key.startswith(enum_cls.__name__.upper() + "."):
            key = key[len(enum_cls.__name__) + 1 :]
        if key in enum_cls.__members__:
            return enum_cls[key]
        raise _unsupported(argument, value, names)
    raise TypeError(f"{argument} must be a string or a {enum_cls.__name__}, got {type(value).__name__} {value!r}")


def resolve_sharding_strategy(value: str | ShardingStrategy) -> ShardingStrategy:
    """``FULL_SHARD``, ``SHARD_GRAD_OP``, ``NO_SHARD``, ``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2`` in any case."""
    return _resolve_enum_name(value, ShardingStrategy, "sharding_strategy")


def resolve_backward_prefetch(value: str | BackwardPrefetch | None) -> BackwardPrefetch | None:
    """``BACKWARD_PRE``, ``BACKWARD_POST`` in any case, or ``None`` (and ``"none"``) to disable prefetching."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    return _resolve_enum_name(value, BackwardPrefetch, "backward_prefetch")


def resolve_bool(value: object, argument: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be True or False, got {type(value).__name__} {value!r}")
    return value


def resolve_cpu_offload(value: bool | CPUOffload | None) -> CPUOffload:
    if isinstance(value, CPUOffload):
        return value
    if value is None:
        return CPUOffload(offload_params=False)
    return CPUOffload(offload_params=resolve_bool(value, "cpu_offload"))


def resolve_dtype(value: str | torch.dtype, argument: str = "dtype") -> torch.dtype:
    """A ``torch.dtype`` or one of the names in ``TORCH_DTYPE_MAP``, with or without a ``torch.`` prefix."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in TORCH_DTYPE_MAP:
            return TORCH_DTYPE_MAP[key]
        raise _unsupported(argument, value, TORCH_DTYPE_MAP)
    raise TypeError(f"{argument} must be a dtype name or a torch.dtype, got {type(value).__name__} {value!r}")


def _check_mixed_precision_dict(value: object) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(f"mixed_precision must be a dict or a MixedPrecision, got {type(value).__name__} {value!r}")
    unknown = [key for key in value if key not in MIXED_PRECISION_KEYS]
    if unknown:
        raise ValueError(
            f"mixed_precision has unknown key(s) {_expected(map(str, unknown))}; "
            f"expected any of {_expected(MIXED_PRECISION_KEYS)}"
        )


def resolve_mixed_precision(value: Mapping[str, Any] | MixedPrecision | None) -> MixedPrecision | None:
    """A ``MixedPrecision`` (used as it is), or a dict with any of ``MIXED_PRECISION_KEYS`` (dtypes by name), or
    ``None``. A dict that names neither casting key gets ``cast_forward_inputs=True, cast_root_forward_inputs=False``:
    every FSDP unit below the root casts its inputs to ``param_dtype`` and the batch reaching ``training_step`` is left
    alone (see ``keeps_batch_dtypes``)."""
    if value is None or isinstance(value, MixedPrecision):
        return value
    _check_mixed_precision_dict(value)
    # The LightningModule is the FSDP root and training_step runs inside its forward, so torch's default
    # (cast_root_forward_inputs=True) would cast the whole batch, targets included, to param_dtype: a float32 target
    # silently rounded to bf16, and on older torch (2.6 to 2.9 at least) a loss such as
    # mse_loss(out.float(), target) then fails in backward ("Found dtype BFloat16 but expected Float"). Unless the
    # dict says otherwise, each FSDP unit below the root casts its own inputs instead and the batch keeps its dtypes
    # (the strategy turns the root's own casting off once it has wrapped the model).
    if value.get("output_dtype") is not None:
        raise ValueError(
            f"mixed_precision['output_dtype']={value['output_dtype']!r} needs fsdp_version=2 (FSDP1's MixedPrecision "
            "has no output dtype)"
        )
    kwargs: dict[str, Any] = (
        {"cast_forward_inputs": True, "cast_root_forward_inputs": False} if keeps_batch_dtypes(value) else {}
    )
    for key, item in value.items():
        if key == "output_dtype":
            continue
        argument = f"mixed_precision[{key!r}]"
        if key in _MIXED_PRECISION_DTYPE_KEYS:
            kwargs[key] = None if item is None else resolve_dtype(item, argument)
        else:
            kwargs[key] = resolve_bool(item, argument)
    return MixedPrecision(**kwargs)


def resolve_fsdp_version(value: object) -> FSDPVersion:
    """``1`` (torch ``FullyShardedDataParallel``) or ``2`` (``fully_shard``); ``"1"``/``"2"`` too."""
    if isinstance(value, str) and value.strip() in ("1", "2"):
        value = int(value.strip())
    if isinstance(value, bool) or value not in FSDP_VERSIONS:
        raise _unsupported("fsdp_version", value, map(str, FSDP_VERSIONS))
    return value  # type: ignore[return-value]


def resolve_mixed_precision_policy(value: Mapping[str, Any] | MixedPrecision | None) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` from the same inputs as :func:`resolve_mixed_precision` (a policy object
    passes through). FSDP2 leaves buffers alone and always reduces gradients in ``reduce_dtype``, so
    ``buffer_dtype`` and ``keep_low_precision_grads=True`` are refused with what FSDP2 does instead."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if value is None or isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, MixedPrecision):
        value = {
            "param_dtype": value.param_dtype,
            "reduce_dtype": value.reduce_dtype,
            "buffer_dtype": value.buffer_dtype,
            "keep_low_precision_grads": value.keep_low_precision_grads,
            "cast_forward_inputs": value.cast_forward_inputs or value.cast_root_forward_inputs,
        }
    _check_mixed_precision_dict(value)
    if value.get("buffer_dtype") is not None:
        raise ValueError(
            f"mixed_precision['buffer_dtype']={value['buffer_dtype']!r} is not supported with fsdp_version=2: FSDP2 "
            "does not manage buffers (they keep the dtype the module gives them); cast them in the model or use "
            "fsdp_version=1"
        )
    if value.get("keep_low_precision_grads"):
        raise ValueError(
            "mixed_precision['keep_low_precision_grads']=True is not supported with fsdp_version=2: FSDP2 reduces "
            "gradients in reduce_dtype and keeps them in the parameters' dtype; use fsdp_version=1"
        )
    kwargs: dict[str, Any] = {}
    for key in ("param_dtype", "reduce_dtype", "output_dtype"):
        item = value.get(key)
        kwargs[key] = None if item is None else resolve_dtype(item, f"mixed_precision[{key!r}]")
    casts = [value[k] for k in ("cast_forward_inputs", "cast_root_forward_inputs") if k in value]
    for key in ("cast_forward_inputs", "cast_root_forward_inputs"):
        if key in value:
            resolve_bool(value[key], f"mixed_precision[{key!r}]")
    kwargs["cast_forward_inputs"] = any(casts) if casts else True
    return MixedPrecisionPolicy(**kwargs)


def check_fsdp2_arguments(
    *,
    sharding_strategy: ShardingStrategy,
    process_group: object,
    backward_prefetch: BackwardPrefetch | None,
    limit_all_gathers: bool,
    use_orig_params: bool,
) -> None:
    """Arguments whose FSDP1 value has no FSDP2 counterpart fail here, before any process starts, naming what
    FSDP2 does instead; so does a torch too old for the FSDP2 engine."""
    from lightning_gaudi_fsdp import _compat

    if not _compat.FSDP2_FORCE_SUM_REDUCTION:
        raise ValueError(
            f"fsdp_version=2 needs torch >= 2.8 (this is torch {_compat.TORCH_VERSION}): before 2.8 FSDP2 "
            "reduce-scatters gradients with AVG or PREMUL_SUM, which HCCL does not offer (torch 2.8 added "
            "set_force_sum_reduction_for_comms), and cannot run on CPU processes. Use fsdp_version=1 with this torch "
            "(Gaudi software 1.21/1.22), or a container with torch >= 2.8"
        )
    if sharding_strategy == ShardingStrategy.NO_SHARD:
        raise ValueError(
            "sharding_strategy='NO_SHARD' is not supported with fsdp_version=2: fully_shard always shards; use "
            "fsdp_version=1 for NO_SHARD, or Lightning's DDP strategy"
        )
    if process_group is not None:
        raise ValueError(
            "process_group is not supported with fsdp_version=2: fully_shard takes a device mesh; pass device_mesh "
            "([replicas, shard_size] for hybrid sharding) or leave both unset to shard over every rank"
        )
    if backward_prefetch != BackwardPrefetch.BACKWARD_PRE:
        name = None if backward_prefetch is None else backward_prefetch.name
        raise ValueError(
            f"backward_prefetch={name!r} is not supported with fsdp_version=2: FSDP2 always prefetches the next "
            "unit's all-gather in backward (what 'BACKWARD_PRE' does); leave it at 'BACKWARD_PRE' or use "
            "fsdp_version=1"
        )
    if not limit_all_gathers:
        raise ValueError(
            "limit_all_gathers=False is not supported with fsdp_version=2: FSDP2 always bounds the all-gathers in "
            "flight; leave it True or use fsdp_version=1"
        )
    if not use_orig_params:
        raise ValueError(
            "use_orig_params=False is not supported with fsdp_version=2: FSDP2 always exposes the original "
            "parameters (one DTensor each, no flat parameters); leave it True or use fsdp_version=1"
        )


def keeps_batch_dtypes(value: object) -> bool:
    """Whether ``mixed_precision`` (as the user gave it) leaves the batch reaching ``training_step`` uncast: a dict
    that names neither ``cast_forward_inputs`` nor ``cast_root_forward_inputs``."""
    return isinstance(value, Mapping) and "cast_forward_inputs" not in value and "cast_root_forward_inputs" not in value


def resolve_state_dict_type(value: str) -> StateDictType:
    if not isinstance(value, str):
        raise TypeError(f"state_dict_type must be a string, got {type(value).__name__} {value!r}")
    key = value.strip().lower()
    if key not in STATE_DICT_TYPES:
        raise _unsupported("state_dict_type", value, STATE_DICT_TYPES)
    return key  # type: ignore[return-value]


def resolve_device_mesh(value: object) -> tuple[int, int] | Any | None:
    """``(replicas, shard_size)`` as a tuple or list of two positive ints, a ``DeviceMesh``, or ``None``."""
    if value is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(value, DeviceMesh):
        return value
    if (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        return (int(value[0]), int(value[1]))
    raise ValueError(
        f"device_mesh={value!r} is not supported; expected (replicas, shard_size) as two positive ints, "
        "for example [2, 4], or a DeviceMesh"
    )


def check_hybrid_requirements(
    sharding_strategy: ShardingStrategy, auto_wrap_policy: object, process_group: object, device_mesh: object
) -> None:
    if process_group is not None and device_mesh is not None:
        raise ValueError("process_group and device_mesh are mutually exclusive; pass only one of them")
    hybrid = sharding_strategy in (ShardingStrategy.HYBRID_SHARD, fsdp1_internals.hybrid_zero2())
    if device_mesh is not None and not hybrid:
        raise ValueError(
            f"device_mesh={device_mesh!r} only applies to hybrid sharding; set sharding_strategy to "
            f"'HYBRID_SHARD' or '_HYBRID_SHARD_ZERO2' (got {sharding_strategy.name!r})"
        )
    if hybrid and auto_wrap_policy is None and process_group is None and device_mesh is None:
        raise ValueError(
            f"sharding_strategy={sharding_strategy.name!r} needs at least one of auto_wrap_policy, process_group "
            "or device_mesh (for example device_mesh=[num_nodes, devices_per_node])"
        )


def check_state_dict_type(
    state_dict_type: StateDictType, sharding_strategy: ShardingStrategy, device_mesh: object
) -> None:
    if state_dict_type != "local":
        return
    if sharding_strategy == ShardingStrategy.NO_SHARD:
        raise ValueError(
            "state_dict_type='local' needs a sharded strategy; sharding_strategy='NO_SHARD' keeps no shards. "
            "Use state_dict_type='full' or 'sharded'"
        )
    if device_mesh is not None:
        raise ValueError(
            "state_dict_type='local' cannot be used with a device_mesh (torch's LOCAL_STATE_DICT does not "
            "support it); use state_dict_type='sharded'"
        )


def resolve_compile(value: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """``False`` -> ``None`` (no compile); ``True`` -> ``{}``; a dict -> keyword arguments for ``torch.compile``."""
    if isinstance(value, bool):
        return {} if value else None
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"compile keys must be torch.compile argument names, got {value!r}")
        return dict(value)
    raise TypeError(f"compile must be True, False or a dict of torch.compile arguments, got {value!r}")


def resolve_process_group_backend(value: str | None) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.strip().lower() not in PROCESS_GROUP_BACKENDS:
        raise ValueError(
            f"process_group_backend={value!r} is not supported; expected one of "
            f"{', '.join(repr(b) for b in PROCESS_GROUP_BACKENDS)} or None"
        )
    return value.strip().lower()


def resolve_timeout(value: timedelta | float | None) -> timedelta | None:
    if value is None or isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 86400 * 365:
        return timedelta(seconds=value)
    raise ValueError(
        f"timeout={value!r} is not supported; expected a timedelta or a positive number of seconds (under a year)"
    )


def resolve_seconds(value: timedelta | float | None, argument: str) -> float | None:
    """A bound in seconds (``failure_timeout``, ``stuck_timeout``), or ``None`` (the caller then takes the
    environment or the default)."""
    if value is None:
        return None
    return _seconds_within(
        value, argument, 0, 86400, "a positive number of seconds (at most a day), a timedelta or None"
    )


def _seconds_within(value: timedelta | float, argument: str, low: float, high: float, expected: str) -> float:
    """``value`` (seconds or a ``timedelta``) as seconds, when above ``low`` and at most ``high``; else a
    ``ValueError`` naming ``argument``, the value in seconds and what is ``expected``."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, int | float) and not isinstance(value, bool) and low < value <= high:
        return float(value)
    raise ValueError(f"{argument}={value!r} is not supported; expected {expected}")


PREEMPTION_MODES = ("save", "exit")


def resolve_preemption(value: object) -> str:
    """``preemption``: ``"save"`` (a SIGTERM saves the completed step and leaves) or ``"exit"`` (Lightning's own
    handling), any case."""
    if not isinstance(value, str) or value.strip().lower() not in PREEMPTION_MODES:
        raise _unsupported("preemption", value, PREEMPTION_MODES)
    return value.strip().lower()


def resolve_preemption_grace(value: timedelta | float) -> float:
    """``preemption_grace``: seconds from the signal until every rank has left, more than 1 (the margin kept for
    leaving) and at most an hour."""
    expected = "a number of seconds above 1 and at most 3600, or a timedelta"
    return _seconds_within(value, "preemption_grace", 1, 3600, expected)


def resolve_device_id(value: Any) -> int | str | torch.device | None:
    if value is None or isinstance(value, torch.device):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        try:
            torch.device(value)
        except RuntimeError as err:
            raise ValueError(f"device_id={value!r} is not a device; expected e.g. 'hpu:0', 'cpu' or 0") from err
        return value
    raise ValueError(
        f"device_id={value!r} is not supported; expected None, a non-negative int, a device string or a torch.device"
    )
