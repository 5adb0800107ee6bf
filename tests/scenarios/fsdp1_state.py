"""FSDP1 state dicts built from each rank's own slices against torch's own, in one run per configuration: every rank
saves the sharded checkpoint both ways (DCP) and builds the full state both ways; rank 0 consolidates the sharded ones
and compares everything bitwise. The full state is also saved streamed (``checkpoint/streaming.py``) and read back
with ``torch.load`` against the gathered one; with ``cfg["stream_memory"]``, a wider model's streamed save is measured
(rank 0's memory, against an eager save) and made to fail midway on rank 0 (a file-size limit). Writes
``fsdp1_state.json`` (which paths applied, what differed) and ``stream_memory{rank}.json``."""

from __future__ import annotations

import json
import os
import resource
import signal
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import PeakSampler, load_config, write_json
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, 7)  # sizes that do not divide evenly: pieces straddle rows and ranks
        self.b = nn.Linear(7, width)
        self.register_buffer("scale", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale.sum()


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or sorted(map(str, a)) != sorted(map(str, b)):
            return [f"{path} keys"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            return [f"{path} length"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def streamed_full_save(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    *,
    stream: bool = True,
    crc32: bool = False,
    in_place: bool = True,
    other_host: int | None = None,
    checksums: bool = True,
) -> str:
    """Save ``model``'s full checkpoint as the front doors do, streamed (or gathered first), with CRC32s or without
    (``checkpoint_crc32``), the other ranks writing their pieces into the file themselves if ``in_place`` and they
    can (else sending them over the connections, as ranks on other hosts do); rank ``other_host`` reads another boot
    id, as a rank on another host (another running kernel) would. Returns how the pieces went: ``"in place"``,
    ``"received"`` or ``"in place + received"`` on rank 0, ``"in place"`` or ``"sent"`` elsewhere; ``""`` if the
    stream planned nothing. ``checksums``: recorded (the default), each rank writing in place hashes what it writes;
    rank 0 writes ``<file>.pieces.json``: the ``[rank, offset, bytes]`` each other rank wrote in place."""
    from lightning_gaudi_fsdp.checkpoint import formats, space, stream_in_place
    from lightning_gaudi_fsdp.checkpoint.streaming import FullStream
    from lightning_gaudi_fsdp.engine.base import of as engine_of
    from lightning_gaudi_fsdp.engine.pieces import gather_objects

    rank, world_size = dist.get_rank(), dist.get_world_size()
    plan = FullStream(rank) if stream else None
    engine = engine_of(model)  # either engine's model (the FSDP2 scenario saves with this too)
    checkpoint = {
        "state_dict": engine.model_state_dict(model, "full", "cpu", plan),
        "optimizer_states": [engine.optimizer_state_dict(model, optimizer, "full", "cpu", rank, plan)],
        "epoch": 3,
    }
    default, boot_id = stream_in_place._IN_PLACE, space._BOOT_ID
    stream_in_place._IN_PLACE = default and in_place
    if rank == other_host:  # a boot id of its own: the file rank 0 names is not this kernel's file
        space._BOOT_ID = str(path.parent / f"boot_id_of_rank{rank}")
        Path(space._BOOT_ID).write_text(f"{uuid.uuid4()}\n")
    try:
        formats.save(
            "full",
            checkpoint,
            path,
            rank=rank,
            world_size=world_size,
            gather=lambda obj: gather_objects(obj, world_size),
            stream=plan,
            crc32=crc32,
            checksums=checksums,
        )
    finally:
        stream_in_place._IN_PLACE, space._BOOT_ID = default, boot_id
    if plan is None or not plan.pending:
        return ""
    if rank == 0:
        write_json(path.parent, f"{path.name}.pieces.json", plan.placed)
    if rank != 0:
        return "in place" if plan.in_place else "sent"
    return " + ".join([*(["in place"] if plan.in_place else []), *(["received"] if plan.senders else [])])


def streamed_full_saves(model: nn.Module, optimizer: torch.optim.Optimizer, out: Path) -> list[str]:
    """The streamed saves :func:`streamed_differences` reads: without CRC32s (the other ranks write their pieces
    where torch's writer hands over each tensor, rank 0 its own), with them (each tensor assembled first on rank 0),
    and without CRC32s with the last rank as if on another host (it sends its pieces); how each went (see
    :func:`streamed_full_save`)."""
    last = dist.get_world_size() - 1
    return [
        streamed_full_save(model, optimizer, out / "streamed.ckpt"),
        streamed_full_save(model, optimizer, out / "streamed_crc32.ckpt", crc32=True),
        streamed_full_save(model, optimizer, out / "streamed_received.ckpt", other_host=last),
    ]


def streamed_differences(eager: dict, out: Path) -> dict:
    """What differs between the gathered full state ``eager`` (``model``, ``optimizer_0``) and the files of
    :func:`streamed_full_saves`: read plainly, memory-mapped and, with CRC32s or received, plainly (key order
    included); the first record of the CRC32 file whose CRC32 does not match its bytes (``zipfile``'s ``testzip``;
    None: none); whether the received file is byte for byte the one written in place (but for the checksums in its
    zip comment, whose blocks are cut where the pieces written in place start and end); whether the file written in
    place verifies (``integrity.verify``: True) and what it says of a copy with one byte changed in the middle of the
    first piece the last rank wrote in place (``flipped``: the byte's offset and the error's message)."""
    from lightning_gaudi_fsdp.checkpoint import checksum, integrity

    result: dict[str, Any] = {}
    for how, name, kwargs in (
        ("load", "streamed.ckpt", {}),
        ("mmap", "streamed.ckpt", {"mmap": True}),
        ("crc32", "streamed_crc32.ckpt", {}),
        ("received", "streamed_received.ckpt", {}),
    ):
        saved = torch.load(out / name, weights_only=True, **kwargs)
        result[how] = _differences(
            eager, {"model": saved["state_dict"], "optimizer_0": saved["optimizer_states"][0]}
        ) + ([] if list(saved["state_dict"]) == list(eager["model"]) else ["model key order"])
    with zipfile.ZipFile(out / "streamed_crc32.ckpt") as archive:
        result["crc32_mismatch"] = archive.testzip()
    received, in_place = (out / "streamed_received.ckpt").read_bytes(), (out / "streamed.ckpt").read_bytes()
    covered = [checksum.read_trailer(out / name)[1] for name in ("streamed_received.ckpt", "streamed.ckpt")]
    result["received_same_bytes"] = (
        covered[0] == covered[1] and received[: covered[0] - 2] == in_place[: covered[1] - 2]
    )
    result["verified"] = integrity.verify(out / "streamed.ckpt", earlier=False)
    pieces = json.loads((out / "streamed.ckpt.pieces.json").read_text())
    last = max(rank for rank, _, _ in pieces) if pieces else None
    flipped = None
    for rank, offset, size in pieces:
        if rank == last:
            at = offset + size // 2
            damaged = bytearray(in_place)
            damaged[at] ^= 0xFF
            (out / "flipped").mkdir(exist_ok=True)
            (out / "flipped" / "streamed.ckpt").write_bytes(bytes(damaged))
            try:
                integrity.verify(out / "flipped" / "streamed.ckpt", earlier=False)
                flipped = {"offset": at, "rank": rank, "message": None}
            except integrity.CheckpointIntegrityError as err:
                flipped = {"offset": at, "rank": rank, "message": str(err)}
            break
    result["flipped"] = flipped
    return result


def stream_memory(out: Path) -> None:
    """Rank 0's memory during a streamed and an eager full save of a wider model (about 75 MiB of state), then a
    streamed save that fails midway on rank 0 (a file-size limit): every rank records what it raised, and how long."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    rank = dist.get_rank()
    torch.manual_seed(1)
    model = FSDP(
        nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(6))),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    state_bytes = 3 * 6 * 1024 * 1024 * 4  # weights and AdamW's two moments, fp32
    record: dict = {"state_bytes": state_bytes}
    for name, stream in (("streamed", True), ("eager", False)):
        dist.barrier()
        with PeakSampler() as sampler:
            record[f"{name}_planned"] = streamed_full_save(model, optimizer, out / f"wide_{name}.ckpt", stream=stream)
        record[f"{name}_peak_growth"] = sampler.peak - sampler.base
        if rank == 0:
            (out / f"wide_{name}.ckpt").unlink()
    # A write that fails midway (the file may not grow past 8 MiB for one rank: EFBIG instead of SIGXFSZ): on rank 0,
    # the other rank's pieces written in place or received; on rank 1, writing its pieces in place.
    for suffix, in_place, failing in (("", True, 0), ("_received", False, 0), ("_writer", True, 1)):
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        if rank == failing:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, limits[1]))
        started = time.monotonic()
        try:
            streamed_full_save(model, optimizer, out / "wide_failing.ckpt", in_place=in_place)
            record[f"failure{suffix}"] = None
        except Exception as err:  # noqa: BLE001 - recorded for the test
            record[f"failure{suffix}"] = {"type": type(err).__name__, "message": str(err)}
        record[f"failure{suffix}_seconds"] = time.monotonic() - started
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        record[f"left{suffix}"] = sorted(p.name for p in out.iterdir() if "wide_failing" in p.name)
    # the process group is still in step: the next streamed save succeeds
    record["after_failure_planned"] = streamed_full_save(model, optimizer, out / "wide_after.ckpt")
    if rank == 0:
        record["after_failure_keys"] = len(torch.load(out / "wide_after.ckpt", weights_only=True)["state_dict"])
    write_json(out, f"stream_memory{rank}.json", record)


def main() -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, OptimStateKeyType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lightning_gaudi_fsdp.engine import fsdp1_io, fsdp1_state

    cfg = load_config()
    out = Path(cfg["out"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    # Lightning's FSDPPrecision gives FSDP a MixedPrecision even for 32-true; bf16 buffers are cast back for saving
    buffer_dtype = getattr(torch, cfg["buffer_dtype"])
    model = FSDP(
        nn.Sequential(Block(5), Block(5), nn.Linear(5, 3)),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=torch.device("cpu"),
        use_orig_params=cfg["use_orig_params"],
        mixed_precision=MixedPrecision(torch.float32, torch.float32, buffer_dtype),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 5)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    ours = {
        fmt: {
            "model": fsdp1_io.model_state_dict(model, fmt, "cpu"),
            "optimizer_0": fsdp1_io.optimizer_state_dict(model, optimizer, fmt, "cpu", rank),
        }
        for fmt in ("sharded", "full")
    }
    theirs = {}
    for fmt in ("sharded", "full"):
        with fsdp1_io.state_dict_context(model, fmt, "cpu"):
            optim = FSDP.optim_state_dict(model, optimizer)
            if fmt == "full" and rank == 0 and cfg["use_orig_params"]:
                optim = FSDP.rekey_optim_state_dict(optim, OptimStateKeyType.PARAM_ID, model)
            theirs[fmt] = {"model": model.state_dict(), "optimizer_0": optim}
    # The local state, read from the modules without FSDP's state-dict hooks, holds what torch's hooks build: each
    # unit's flat-parameter shard and every entry FSDP does not manage, bitwise (and is the same memory).
    local_ours = fsdp1_io.model_state_dict(model, "local", "cpu")
    with fsdp1_io.state_dict_context(model, "local", "cpu"):
        local_theirs = {
            key: (value.local_shards()[0].tensor if hasattr(value, "local_shards") else value)
            for key, value in model.state_dict().items()
        }
    local_expected = [k for k in local_theirs if k.endswith("_flat_param") or k.endswith("scale")]
    local_same = sorted(local_ours) == sorted(local_expected) and all(
        torch.equal(local_ours[k], local_theirs[k]) and local_ours[k].data_ptr() == local_theirs[k].data_ptr()
        for k in local_ours
    )
    # A module with a state-dict hook of its own: the local state then comes from torch's state_dict(), hook included.
    hook = model.module[0]._fsdp_wrapped_module._register_state_dict_hook(
        lambda module, state, prefix, local_metadata: state.__setitem__(prefix + "extra", torch.ones(1))
    )
    local_with_hook = sorted(fsdp1_io.model_state_dict(model, "local", "cpu"))
    hook.remove()
    # The same full checkpoint saved streamed: no tensor gathered before the write, the file reads back the same.
    streamed_planned = streamed_full_saves(model, optimizer, out)
    if cfg.get("stream_memory"):
        stream_memory(out)
    for name, state in (("ours", ours["sharded"]), ("theirs", theirs["sharded"])):
        dcp.save(state, checkpoint_id=out / name)
    dist.barrier()
    if rank == 0:
        consolidated = {}
        for name in ("ours", "theirs"):
            dcp_to_torch_save(out / name, out / f"{name}.pt")
            consolidated[name] = torch.load(out / f"{name}.pt", weights_only=False)
        write_json(
            out,
            "fsdp1_state.json",
            {
                "sharded_fast": fsdp1_state.supported(model),
                "full_fast": fsdp1_state.supports_full(model),
                "sharded_differences": _differences(consolidated["ours"], consolidated["theirs"]),
                "full_differences": _differences(
                    ours["full"], {**theirs["full"], "model": dict(theirs["full"]["model"])}
                ),
                "full_model_keys_in_order": list(ours["full"]["model"]) == list(theirs["full"]["model"]),
                "buffer_dtype": str(ours["full"]["model"]["0.scale"].dtype),
                "local_same_as_torchs": local_same,
                "local_keys": sorted(local_ours),
                "local_keys_with_foreign_hook": local_with_hook,
                "streamed_planned": streamed_planned,
                "streamed_differences": streamed_differences(ours["full"], out),
            },
        )
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
