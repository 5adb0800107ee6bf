"""torch internals other than FSDP1's flat parameters, read in one place: ``torch.save``'s zip writer (the streaming
full save), the globals a safe unpickler must allow, distributed-checkpoint (DCP) entry points and planners used
without a process group, a host group beside a device-bound default group, ``ShardedTensor``/``DTensor``
construction, ``nn.Module``'s own state-dict parts, the activation-checkpointing wrapper, and two dispatcher/autograd
probes.

Each function names the fact it gives; ``tests/test_adapters.py`` checks every private name used here.
"""

from __future__ import annotations

import functools
import inspect
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import Module


# ------------------------------------------------------------------------------------------------- c10d's groups
def new_host_group(**kwargs: Any) -> Any:
    """``torch.distributed.new_group(backend="gloo", **kwargs)``: a group for host (CPU) tensors beside a default group
    bound to an accelerator. Lightning (>= 2.3 on torch >= 2.3) binds the default group to the process's device
    (``init_process_group(device_id=root_device)``: ``hpu:0`` on Gaudi); torch's ``new_group`` then binds every new
    group to that device too, refuses any other ``device_id``, and asks the new group's backend for the device
    (``_new_process_group_helper``: ``pg._get_backend(device_id)``), which gloo does not serve: "No backend type
    associated with device type hpu" (pytorch#162237 on XPU). The default group is unbound while the group is made
    (every rank calls this at the same point, before anything else uses the default group concurrently) and bound
    again after; the gloo group then carries CPU tensors only, as gloo does."""
    dist = torch.distributed
    default = dist.group.WORLD
    bound = getattr(default, "bound_device_id", None)
    if bound is None:
        return dist.new_group(backend="gloo", **kwargs)
    default.bound_device_id = None
    try:
        return dist.new_group(backend="gloo", **kwargs)
    finally:
        default.bound_device_id = bound


# ------------------------------------------------------------------------------------------------ c10d's threads
# The name torch gives the worker threads of a gloo process group (``ProcessGroupGloo::runLoop``) on 2.13 and 2.14;
# 2.6 and 2.9 leave them unnamed (they carry the process's name). ``_exit`` waits for them to go idle at exit.
GLOO_WORKER_THREAD = "pt_gloo_runloop"


def gloo_groups_exist() -> bool:
    """Whether any process group of this process (the default one or another) runs on gloo (``_world.pg_map``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        groups = list(dist.distributed_c10d._world.pg_map)
        return any("gloo" in str(dist.get_backend(group)) for group in groups)
    except Exception:  # noqa: BLE001 - a group being torn down: assume gloo (the wait at exit is bounded)
        return True


# ------------------------------------------------------------------------------------------- torch.save internals
# torch.serialization._save's parameters, as the streaming writer calls it (checked on torch 2.6, 2.9, 2.13, 2.14).
SAVE_PARAMETERS = ("obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record")


def streaming_writer_available() -> bool:
    """Whether ``torch.serialization._save`` and ``_open_zipfile_writer`` exist with the signature the streaming
    writer was checked with."""
    serialization = torch.serialization
    save = getattr(serialization, "_save", None)
    if save is None or not callable(getattr(serialization, "_open_zipfile_writer", None)):
        return False
    try:
        return tuple(inspect.signature(save).parameters) == SAVE_PARAMETERS
    except (TypeError, ValueError):
        return False


def save_through(obj: Any, handle: Any, wrap_writer: Callable[[Any], Any]) -> None:
    """``torch.save(obj, handle)`` with torch.save's default pickle module and protocol and its byte-order record,
    every record passing through ``wrap_writer(zip_writer)`` (which must forward ``write_record`` and the rest)."""
    with torch.serialization._open_zipfile_writer(handle) as writer:
        torch.serialization._save(obj, wrap_writer(writer), pickle, torch.serialization.DEFAULT_PROTOCOL, False)


def storage_order(obj: Any, sink: Any) -> list[int]:
    """The data address of each storage in ``obj`` in the order ``torch.save``'s pickler meets them (its record keys
    ``0, 1, ...``): a pickling pass into ``sink`` (a writable that may discard), without the data."""
    seen: dict[int, int] = {}

    class _Pickler(pickle.Pickler):
        def persistent_id(self, value: Any) -> Any:
            if isinstance(value, torch.storage.TypedStorage) or torch.is_storage(value):
                storage = value._untyped_storage if isinstance(value, torch.storage.TypedStorage) else value
                seen.setdefault(storage._cdata, storage.data_ptr())
                return len(seen)
            return None

    _Pickler(sink, protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    return list(seen.values())


def private_safe_global(module: str, name: str) -> Any:
    """The private globals a checkpoint written by torch names and a safe unpickler may allow: DCP's
    ``_StorageInfo`` (its metadata) and ``torch.serialization._get_layout`` (sparse/layout records); else None."""
    if (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        return _StorageInfo
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout
    return None


# -------------------------------------------------------------------------------------------------------- DCP
def dcp_load_no_dist(state: dict[str, Any], reader: Any, planner: Any) -> None:
    """Read a distributed checkpoint into ``state`` in this process alone (torch's private ``_load_state_dict``,
    which ``dcp.load`` calls, with ``no_dist=True`` on every supported torch)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)


def dcp_save_no_dist(state: dict[str, Any], path: str, storage_writer: Any = None) -> None:
    """torch 2.6's ``dcp.save`` has no ``no_dist``; its private entry point, which ``save`` itself calls, has."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    writer = storage_writer if storage_writer is not None else dcp.FileSystemWriter(path)
    _save_state_dict(state, storage_writer=writer, no_dist=True)


def dcp_writer_through(writer: Any, wrap: Callable[[Any, str], Any], renamed: Callable[[str, str], None]) -> Any:
    """DCP's ``writer`` (its file-system writer, or its fsspec one for a URL) with the files it opens for writing
    passed through ``wrap(stream, file)`` (a file object with an optional ``finish()``, called once the writer is
    done with it), and its renames (its ``.metadata.tmp`` put in place) told to ``renamed(old, new)``. Both writers
    keep their file system in the attribute ``fs`` (``create_stream``, ``rename``...), on torch 2.6 to 2.13."""
    import contextlib
    import os

    inner = getattr(writer, "fs", None)
    if inner is None or not callable(getattr(inner, "create_stream", None)):
        raise RuntimeError(f"torch's {type(writer).__name__} keeps no file system in .fs: its files cannot be hashed")

    class _Through:
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        @contextlib.contextmanager
        def create_stream(self, file: Any, mode: str) -> Any:
            with inner.create_stream(file, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                handle = wrap(stream, os.fspath(file))
                yield handle
                finish = getattr(handle, "finish", None)
                if finish is not None:
                    finish()

        def rename(self, file: Any, new: Any) -> None:
            inner.rename(file, new)
            renamed(os.fspath(file), os.fspath(new))

    writer.fs = _Through()
    return writer


def empty_load_planner(keys: set[str] | None = None) -> Any:
    """DCP's planner that allocates every entry (or only ``keys``) from the checkpoint's metadata: what
    ``dcp_to_torch_save`` uses to read a checkpoint with no model at hand."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    return _EmptyStateDictLoadPlanner() if keys is None else _EmptyStateDictLoadPlanner(keys=keys)


# --------------------------------------------------------------------------------------- ShardedTensor, DTensor
def sharded_tensor(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: str,
    boxes: Sequence[tuple[int, Sequence[int], Sequence[int]]],
    local: Sequence[torch.Tensor],
) -> Any:
    """A ``ShardedTensor`` of ``shape`` whose shards are ``boxes`` (``(rank, offsets, sizes)``, every rank's) and
    whose local shards are ``local`` (this rank's boxes' tensors, in the order its boxes appear), without a
    collective."""
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    rank = dist.get_rank()
    metadata = [
        (r, ShardMetadata(shard_offsets=list(offsets), shard_sizes=list(sizes), placement=f"rank:{r}/{device}"))
        for r, offsets, sizes in boxes
    ]
    own = [m for r, m in metadata if r == rank]
    shards = [Shard(tensor, m) for tensor, m in zip(local, own, strict=True)]
    properties = TensorProperties(dtype=dtype, requires_grad=False)
    global_metadata = ShardedTensorMetadata([m for _, m in metadata], torch.Size(shape), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, global_metadata)


def is_sharded_tensor(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def sharded_tensor_like(
    value: Any, tensors: Sequence[torch.Tensor], metadata: Any, shard_metadata: Sequence[Any]
) -> Any:
    """A ``ShardedTensor`` with ``value``'s process group, global ``metadata``, and local shards ``tensors`` described
    by ``shard_metadata``."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    shards = [Shard(t, m) for t, m in zip(tensors, shard_metadata, strict=True)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, metadata, process_group=value._process_group
    )


def host_placement(rank: int) -> Any:
    """A shard placement on ``rank``'s host memory."""
    from torch.distributed.remote_device import _remote_device

    return _remote_device(f"rank:{rank}/cpu")


def dtensor_local(value: Any) -> torch.Tensor:
    """A ``DTensor``'s local tensor, without autograd's view (``to_local`` would record one)."""
    return value._local_tensor


def dtensor_with_local(value: Any, local: torch.Tensor) -> Any:
    """A ``DTensor`` with ``value``'s mesh and placements over ``local``, wherever ``local`` lives (torch's own staging
    builds it so; ``from_local`` would move a host copy back onto the mesh's device)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, value._spec, requires_grad=False)


def dim0_offset(param: Any) -> int:
    """Where this rank's local part of the ``DTensor`` ``param`` starts on dimension 0."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return int(offset[0]) if offset else 0


def version_counter(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification count (autograd's version counter)."""
    return tensor._version


# --------------------------------------------------------------------------------------------- nn.Module, autograd
def state_dict_hook_modules(module: Module) -> list[str | None]:
    """The defining module of each state-dict (pre-)hook registered on ``module`` itself."""
    hooks = [*module._state_dict_pre_hooks.values(), *module._state_dict_hooks.values()]
    return [getattr(getattr(h, "func", h), "__module__", None) for h in hooks]


def own_state(module: Module, prefix: str) -> dict[str, Any]:
    """``module``'s own parameters, persistent buffers and extra state (not its children's), as ``state_dict`` has
    them, keyed with ``prefix``."""
    own: dict[str, Any] = {}
    module._save_to_state_dict(own, prefix, False)
    return own


def replace_parameter(module: Module, name: str, param: Any) -> None:
    """Put ``param`` in place of ``module``'s registered parameter ``name``, without ``register_parameter``'s hooks and
    checks (inside a patched ``register_parameter``)."""
    module._parameters[name] = param


def apply_to_own_tensors(module: Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``fn`` applied to ``module``'s own parameters and buffers (not its children's), as ``Module.to`` applies a
    conversion, keeping the parameter objects."""
    module._apply(fn, recurse=False)


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (e.g. recomputing a checkpointed layer)."""
    return torch._C._current_graph_task_id() != -1


def has_hpu_kernel(op: str) -> bool:
    """Whether FSDP2's custom op ``op`` (``fsdp::all_gather_copy_in``...) has an HPU kernel registered."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (registers the fsdp:: ops)

    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, "HPU"))


# ------------------------------------------------------------------------------------ activation checkpointing
CHECKPOINT_WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"


def apply_checkpoint_wrapper(model: Module, **kwargs: Any) -> None:
    """torch's ``apply_activation_checkpointing`` with its ``checkpoint_wrapper``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, **kwargs)


def is_checkpoint_wrapper(module: Module) -> bool:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(module, CheckpointWrapper)


def dcp_writer(path: str, url: bool, open_stream: Callable[[Any, str], Any]) -> Any:
    """torch's distributed-checkpoint writer into the folder at ``path``: ``FileSystemWriter``, or for an fsspec
    ``url`` ``FsspecWriter`` (from the private ``_fsspec_filesystem`` on every supported torch), without fsync (an
    object store has none, and torch's fallback for a stream without a file descriptor is ``os.sync()`` of the whole
    host). Every file it writes is opened by ``open_stream(path, mode)`` (see :func:`route_dcp_streams`)."""
    import torch.distributed.checkpoint as dcp

    if url:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return route_dcp_streams(FsspecWriter(path, sync_files=False), open_stream)
    return route_dcp_streams(dcp.FileSystemWriter(path), open_stream)


def read_through_fsspec(reader: Any, url: str) -> Any:
    """Point a ``FileSystemReader`` (or subclass) at the folder at an fsspec ``url``: what torch's ``FsspecReader``
    does in its constructor (its ``FileSystem`` is in the private ``_fsspec_filesystem``)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    reader.fs = FileSystem()
    reader.path = reader.fs.init_path(url)
    return reader


def route_dcp_streams(storage: Any, open_stream: Callable[[Any, str], Any]) -> Any:
    """Have torch's DCP reader or writer ``storage`` open each of its files with ``open_stream(path, mode)`` (a
    context manager giving a binary file): its file system's ``create_stream`` (torch's ``FileSystemBase`` shape,
    the same on every supported torch) is replaced; the rest of the file system (folders, renames) is torch's."""
    storage.fs.__class__ = _routed(type(storage.fs))
    storage.fs._lgf_open_stream = open_stream
    return storage


@functools.cache
def _routed(base: type) -> type:
    import contextlib

    class Routed(base):  # type: ignore[misc, valid-type]
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Any:
            with self._lgf_open_stream(path, mode) as stream:
                yield stream

    Routed.__name__ = Routed.__qualname__ = f"Routed{base.__name__}"
    return Routed
