"""Engine-neutral arithmetic and collectives that both engines' state-dict code and the checkpoint package share:
where ``torch.chunk`` cuts a flattened tensor among ranks, keying an optimizer state by parameter id or by parameter
name, and sending each rank's pieces of a tensor straight into one full tensor on rank 0. It imports nothing of the
package, so any module may use it without an import circle."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightning_gaudi_fsdp.checkpoint.streaming import FullStream


def chunk_spans(total: int, parts: int, unit: int = 1) -> tuple[tuple[int, int], ...]:
    """Elements ``[start, end)`` each of ``parts`` ranks holds when ``total`` rows of ``unit`` elements each are cut as
    ``torch.chunk`` cuts them (FSDP1 its flat parameter, ``unit=1``; FSDP2 a parameter's dim 0)."""
    chunk = math.ceil(total / parts)
    return tuple((min(r * chunk, total) * unit, min((r + 1) * chunk, total) * unit) for r in range(parts))


def _rekeyed(state: Mapping[str, Any], key: Callable[[Any], Any]) -> dict[str, Any]:
    return {
        **state,
        "state": {key(k): value for k, value in state["state"].items()},
        "param_groups": [{**g, "params": [key(k) for k in g["params"]]} for g in state["param_groups"]],
    }


def optimizer_state_by_name(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter id (``state`` and each group's ``params``), keyed by parameter name
    instead (``names[id]``); keys that already are names stay."""
    return _rekeyed(state, lambda k: names[k] if isinstance(k, int) else k)


def optimizer_state_by_id(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name, keyed by each name's index in ``names`` instead."""
    ids = {name: i for i, name in enumerate(names)}
    return _rekeyed(state, ids.__getitem__)


def param_groups_by_id(groups: Sequence[Mapping[str, Any]], ids: Mapping[int, int], sort: bool = False) -> list[Any]:
    """A live optimizer's ``param_groups`` as ``optimizer.state_dict()`` writes them: the hyperparameters, then
    ``params`` as ids (``ids[id(param)]``; ascending with ``sort``)."""
    out = []
    for group in groups:
        params = [ids[id(p)] for p in group["params"]]
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": sorted(params) if sort else params})
    return out


def carries_host_tensors(group: Any = None) -> bool:
    """Whether ``group`` (default: the default group) sends tensors in host memory, as the package's own gathers of
    shards in host memory need: gloo's does (the CPU rehearsal). An accelerator's backend (``hccl`` on Gaudi) carries
    device tensors, so shards offloaded to host memory (``cpu_offload``) are gathered by torch's state dicts there."""
    import torch.distributed as dist

    return "gloo" in str(dist.get_backend(group))


def gather_pieces(
    pieces: list[tuple[Any, torch.Tensor | None, Any, torch.dtype]], stream: FullStream | None = None
) -> list[Any]:
    """For each ``(param, this rank's piece, ranks sending pieces, dtype)`` (``param``: its ``shape`` and each rank's
    ``spans``, elements ``[start, end)`` of the flattened parameter), rank 0 receives every sender's piece
    straight into one host tensor of the parameter's shape (its own piece is copied in) and returns those tensors;
    other ranks get ``None`` for each. Every rank passes the same list in the same order, and message ``i`` carries
    tag ``i``, so no two are confused; all are in flight at once. With ``stream``, only planned: rank 0 gets
    placeholders, and the pieces travel when the stream writes the checkpoint."""
    import torch.distributed as dist

    if stream is not None:
        return [stream.gather(p.shape, p.spans, piece, senders, dtype) for p, piece, senders, dtype in pieces]
    rank = dist.get_rank()
    works, out, tag = [], [], 0
    for param, piece, senders, dtype in pieces:
        full = torch.empty(param.shape, dtype=dtype) if rank == 0 else None
        for r in senders:
            lo, hi = param.spans[r]
            tag += 1
            if hi <= lo:
                continue
            if rank == 0 and r == 0:
                full.view(-1)[lo:hi].copy_(piece)
            elif rank == 0:
                works.append(dist.irecv(full.view(-1)[lo:hi], src=r, tag=tag))
            elif r == rank:
                works.append(dist.isend(piece.contiguous(), dst=0, tag=tag))
        out.append(full)
    for work in works:
        work.wait()
    return out


def gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` without a process group)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, obj)
    return gathered
