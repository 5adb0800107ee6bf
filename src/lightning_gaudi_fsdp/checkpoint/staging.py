"""Staging a checkpoint into host memory, so that training can go on while the copy is written.

:class:`HostStager` copies every tensor of a checkpoint (plain tensors, the local shards of a ``ShardedTensor`` and
of a ``DTensor``) into CPU buffers it keeps from one save to the next: a checkpoint of the same model lands in the
same buffers each time, so after the first save staging allocates nothing. Containers are rebuilt around the copies
and every other value is deep-copied, so nothing in the staged checkpoint changes when training does. Nothing here
knows state-dict formats, files, process groups or devices: who allocates the buffers (page-locked memory, to stage
off an accelerator at full speed) is the caller's choice.

:meth:`HostStager.stage_later` leaves the copies of the tensors it picks for later: it returns them as
:class:`DeferredCopies`, which the caller runs in another thread while training goes on, as long as nothing writes
those tensors in between (the caller waits for the copies before the optimizer step, which is what writes
parameters and optimizer state). Each deferred tensor's version counter is read when it is staged and again after its
copy: a tensor written in place in between (by anything: a hook, a second optimizer) makes :meth:`DeferredCopies.run`
raise :class:`StagedStateChanged` instead of returning a copy that mixes two steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gaudi_fsdp.adapters import torch_internals
from lightning_gaudi_fsdp.adapters.torch_internals import version_counter

_Path = tuple[Any, ...]
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)
# allocate(shape, dtype): an empty host tensor for a staging buffer
Allocate = Callable[[torch.Size, torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class Defer:
    """Which copies wait (``picks(tensor)``), and what they wait on: ``watch`` names the tensors whose in-place
    change before the copies are made invalidates them (the parameters as the optimizer sees them, which may reach
    the picked memory through ``.data`` views that share no version counter with it)."""

    picks: Callable[[torch.Tensor], bool]
    watch: Sequence[tuple[str, torch.Tensor]] = ()
    # tensors staged as they are, neither copied nor deferred (placeholders that the writer fills itself)
    as_is: Callable[[torch.Tensor], bool] | None = None


class StagedStateChanged(RuntimeError):
    """A tensor whose copy was deferred was written in place before the copy was made."""


class DeferredCopies:
    """The copies :meth:`HostStager.stage_later` left for later: ``(path, buffer, source, source version)`` each,
    and the watched tensors with their versions at the save."""

    def __init__(self, watch: Sequence[tuple[str, torch.Tensor]] = ()) -> None:
        self.copies: list[tuple[_Path, torch.Tensor, torch.Tensor, int]] = []
        self.watched = [(name, tensor, version_counter(tensor)) for name, tensor in watch if not tensor.is_inference()]

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for _, buffer, _, _ in self.copies)

    def run(self) -> None:
        """Make the copies; raise :class:`StagedStateChanged`, naming the entries, if any source changed since it
        was staged (the copy would then hold part of a later step)."""
        if not self.copies:  # everything was copied at the save: nothing here can be stale
            return
        with torch.no_grad():
            for _, buffer, source, _ in self.copies:
                buffer.copy_(source)
        changed = [_entry(path) for path, _, source, version in self.copies if version_counter(source) != version]
        changed += [name for name, tensor, version in self.watched if version_counter(tensor) != version]
        if changed:
            changed = list(dict.fromkeys(changed))
            names = ", ".join(repr(name) for name in changed[:3])
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            raise StagedStateChanged(
                f"{names}{more} changed in place after save_checkpoint returned and before the background copy of "
                "the checkpoint was made; the copy would mix two training steps, so it is not written. Training "
                "waits for that copy only before the optimizer step: code that writes parameters or optimizer state "
                "between a save and the next optimizer step (a hook, a raw optimizer.step() call) needs "
                "async_save=False"
            )


class HostStager:
    """Copies checkpoints into reusable host buffers (one set per stager; see the module docstring).

    The buffers of a staged checkpoint are overwritten by the next :meth:`stage`: stage again only once the previous
    copy has been written. ``allocate``: makes each buffer (default: ordinary host memory); see :meth:`use`."""

    def __init__(self, allocate: Allocate | None = None) -> None:
        self._buffers: dict[_Path, torch.Tensor] = {}
        self._allocate = allocate
        self._defer: Defer | None = None
        self._later: DeferredCopies | None = None

    def use(self, allocate: Allocate | None) -> None:
        """Make later buffers with ``allocate`` (``None``: ordinary host memory); buffers made otherwise are
        dropped."""
        if allocate is not self._allocate:
            self._allocate = allocate
            self.release()

    @property
    def nbytes(self) -> int:
        """Host memory the buffers hold now."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, obj: Any) -> Any:
        """A copy of ``obj`` whose tensors live in this stager's host buffers."""
        return self.stage_later(obj, None)[0]

    def stage_later(self, obj: Any, defer: Defer | None) -> tuple[Any, DeferredCopies]:
        """As :meth:`stage`, but the tensors ``defer`` picks are not copied yet: their buffers fill when the returned
        :class:`DeferredCopies` runs."""
        used: dict[_Path, torch.Tensor] = {}
        memo: dict[int, Any] = {}  # one tensor seen twice (tied weights) stays one tensor
        later = DeferredCopies(defer.watch if defer is not None else ())
        self._defer, self._later = defer, later
        try:
            with torch.no_grad():
                staged = self._copy(obj, (), used, memo)
        finally:
            self._defer, self._later = None, None
        self._buffers = used  # buffers of entries that disappeared are dropped
        return staged, later

    def release(self) -> None:
        """Drop the buffers (a later :meth:`stage` allocates them again)."""
        self._buffers = {}

    def _copy(self, value: Any, path: _Path, used: dict[_Path, torch.Tensor], memo: dict[int, Any]) -> Any:
        if isinstance(value, _IMMUTABLE):
            return value
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, torch.Tensor):
            as_is = self._defer.as_is if self._defer is not None else None
            staged = value if as_is is not None and as_is(value) else self._tensor(value, path, used)
            memo[id(value)] = staged
            return staged
        if isinstance(value, dict):
            staged = copy.copy(value)  # the same mapping type (OrderedDict, AttributeDict...), refilled below
            for key, item in value.items():
                staged[key] = self._copy(item, (*path, key), used, memo)
            return staged
        if isinstance(value, list):
            return [self._copy(item, (*path, i), used, memo) for i, item in enumerate(value)]
        if isinstance(value, tuple):
            items = [self._copy(item, (*path, i), used, memo) for i, item in enumerate(value)]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return copy.deepcopy(value)

    def _tensor(self, value: torch.Tensor, path: _Path, used: dict[_Path, torch.Tensor]) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if torch_internals.is_sharded_tensor(value):
            # The shards are copied straight from their device; the placements then name the host. Metadata that
            # already does (a CPU run) is shared with the original rather than deep-copied: nothing changes it.
            metadata = value.metadata()
            properties = metadata.tensor_properties
            if properties.pin_memory or properties.requires_grad or not _on_host(metadata.shards_metadata):
                metadata = copy.deepcopy(metadata)
                metadata.tensor_properties.pin_memory = False
                metadata.tensor_properties.requires_grad = False
                for shard_metadata in metadata.shards_metadata:
                    _place_on_host(shard_metadata)
            tensors, shards_metadata = [], []
            for i, shard in enumerate(value.local_shards()):
                shard_metadata = shard.metadata
                if not _on_host([shard_metadata]):
                    shard_metadata = copy.deepcopy(shard_metadata)
                    _place_on_host(shard_metadata)
                tensors.append(self._buffer(shard.tensor, (*path, "shard", i), used))
                shards_metadata.append(shard_metadata)
            return torch_internals.sharded_tensor_like(value, tensors, metadata, shards_metadata)
        if isinstance(value, DTensor):
            # DTensor's private constructor, as torch's own staging (_create_cpu_state_dict) does: from_local would
            # move the host copy back onto the mesh's device.
            local = self._buffer(torch_internals.dtensor_local(value), (*path, "local"), used)
            return torch_internals.dtensor_with_local(value, local)
        return self._buffer(value, path, used)

    def _buffer(self, tensor: torch.Tensor, path: _Path, used: dict[_Path, torch.Tensor]) -> torch.Tensor:
        source = tensor.detach()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            if self._allocate is None:
                buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu")
            else:
                buffer = self._allocate(source.shape, source.dtype)
        if self._later is not None and self._defer is not None and _deferrable(source, self._defer):
            self._later.copies.append((path, buffer, source, version_counter(source)))
        else:
            buffer.copy_(source)
        used[path] = buffer
        return buffer


def _entry(path: _Path) -> str:
    """An entry's name in the checkpoint ("state_dict/layer.weight"), without the part :meth:`HostStager._tensor`
    adds for a sharded or distributed tensor's local part."""
    if path[-2:-1] == ("shard",):
        path = path[:-2]
    elif path[-1:] == ("local",):
        path = path[:-1]
    return "/".join(str(key) for key in path)


def _deferrable(tensor: torch.Tensor, defer: Defer) -> bool:
    if tensor.is_inference():  # no version counter to check the copy against
        return False
    return defer.picks(tensor)


def _on_host(shards_metadata: list[Any]) -> bool:
    return all(m.placement is None or m.placement.device().type == "cpu" for m in shards_metadata)


def _place_on_host(shard_metadata: Any) -> None:
    placement = shard_metadata.placement
    if placement is not None and placement.device().type != "cpu":
        shard_metadata.placement = torch_internals.host_placement(placement.rank())
