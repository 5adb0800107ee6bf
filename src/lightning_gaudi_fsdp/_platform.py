"""The Gaudi runtime around both front doors: root device, process-group backend, launcher checks, the process
group and mesh, the liveness heartbeat, HCCL reductions and the object all-gather.

Lightning's Trainer and Fabric ``FSDPStrategy`` classes share no base beyond ``ParallelStrategy`` of different
packages, so the functions here (and in :mod:`._sharding`) take the strategy object itself (``door``) and read the
attributes both doors have: Lightning's runtime facts (``root_device``, ``world_size``, ``num_nodes``,
``num_processes``, ``parallel_devices``, ``process_group_backend``) and the resolved options as ``door._config``
(see :func:`._config.adopt`), never Lightning's copies of the options.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed

from lightning_gaudi_fsdp import _config, _exit, _liveness, _preemption, _rendezvous, gaudi


class GaudiPlatform:
    """Mixed in before Lightning's ``FSDPStrategy`` (the Trainer's or Fabric's): the root device, the process-group
    backend, the launcher checks, the process group on Gaudi and the liveness heartbeat (each door stops it in
    ``teardown`` and reports failures through it: the Trainer in ``on_exception``, both from ``sys.excepthook``)."""

    @property
    def _on_hpu(self) -> bool:
        return on_hpu(self)

    @property
    def root_device(self) -> torch.device:
        if self._on_hpu:
            return gaudi.current_device()
        return super().root_device  # type: ignore[misc]

    def _get_process_group_backend(self) -> str:
        return process_group_backend(
            self.root_device.type,
            self._config.process_group_backend,  # type: ignore[attr-defined]
            super()._get_process_group_backend,  # type: ignore[misc]
        )

    def _configure_launcher(self) -> None:
        before_launch(self)
        super()._configure_launcher()  # type: ignore[misc]

    def setup_environment(self) -> None:
        before_process_group(self)
        existed = torch.distributed.is_available() and torch.distributed.is_initialized()
        # The rendezvous (and the mesh, the heartbeat's first contact) need every rank: bounded by failure_timeout.
        with (
            _rendezvous.bounded_rendezvous(
                self._config.failure_timeout,  # type: ignore[attr-defined]
                lambda: (self.global_rank, self.world_size),  # type: ignore[attr-defined]
                lambda: launched_pids(self),
            ),
            _exit.recording_group_threads(),
        ):  # gloo's threads, told apart at exit where torch leaves them unnamed
            super().setup_environment()  # type: ignore[misc]
            if not existed and torch.distributed.is_initialized():
                _exit.created_default_group()  # destroyed at interpreter exit unless the script does it
            after_process_group(self)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``gaudi_fsdp`` and ``hpu_fsdp`` (lightning-habana's name), where free, in the Trainer's or Fabric's
        registry."""
        description = "FSDP on Intel Gaudi (eager mode, HCCL); CPU processes over gloo for rehearsal"
        for name in ("gaudi_fsdp", "hpu_fsdp"):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description)


def launched_pids(door: Any) -> dict[int, int]:
    """The ranks this process started with Lightning's launcher, global rank to pid (none elsewhere). The launcher
    starts local ranks 1, 2, ... of its node, in that order."""
    procs = getattr(getattr(door, "launcher", None), "procs", None) or []
    first = door.node_rank * door.num_processes + 1
    return {first + i: proc.pid for i, proc in enumerate(procs)}


def on_hpu(door: Any) -> bool:
    return bool(door.parallel_devices) and door.parallel_devices[0].type == "hpu"


def process_group_backend(device_type: str, backend: str | None, default: Callable[[], str]) -> str:
    """``hccl`` on Gaudi (nothing else), ``gloo`` on CPU unless given, Lightning's ``default`` elsewhere."""
    if device_type == "hpu":
        if backend not in (None, "hccl"):
            raise ValueError(f"process_group_backend={backend!r} is not supported on Gaudi; expected 'hccl' (or None)")
        return "hccl"
    if backend is None:
        return "gloo" if device_type == "cpu" else default()
    if backend == "hccl":
        raise ValueError(f"process_group_backend='hccl' needs accelerator='hpu'; this run uses {device_type!r}")
    return backend


def check_hpu_device_id(device_id: Any) -> None:
    """On Gaudi FSDP runs on the process's own device, which the bridge addresses as ``hpu:0`` (index based device
    selection is not supported on HPU): ``device_id`` may name only that one."""
    if device_id is None or device_id == 0 and not isinstance(device_id, bool):
        return
    device = torch.device(device_id) if not isinstance(device_id, int) else None
    if device is not None and device.type == "hpu" and device.index in (None, 0):
        return
    raise ValueError(
        f"device_id={device_id!r} is not supported on Gaudi: each process addresses the device the bridge gave it as "
        "hpu:0 (index based device selection is not supported on HPU); expected None, 0, 'hpu', 'hpu:0' or "
        "torch.device('hpu', 0)"
    )


def check_mesh_size(mesh: Any, world_size: int) -> None:
    if isinstance(mesh, tuple) and world_size:
        replicas, shard = mesh
        if replicas * shard != world_size:
            raise ValueError(
                f"device_mesh={list(mesh)} has {replicas * shard} devices but the world size is "
                f"{world_size}; replicas x shard_size must equal num_nodes x devices"
            )


def before_launch(door: Any) -> None:
    """In ``_configure_launcher``: what must fail (or be set) before any process starts."""
    check_mesh_size(door._config.device_mesh, door.num_processes * door.num_nodes)
    if not door.cluster_environment.creates_processes_externally:
        _rendezvous.mark_launcher()  # this process starts the other ranks (Lightning's launcher)
    else:
        _rendezvous.leave_with_launcher()  # a rank it started (a no-op under torchrun, SLURM...)
    if on_hpu(door):
        door._get_process_group_backend()  # a wrong backend fails before any process starts
        check_hpu_device_id(door._config.device_id)
        gaudi.ensure_eager_mode()
        gaudi.apply_launch_environment(door._config.eager_pipeline)


def before_process_group(door: Any) -> None:
    """In ``setup_environment``, before Lightning creates the process group."""
    _rendezvous.leave_with_launcher()  # before the rendezvous: never wait for a launcher that is gone
    if on_hpu(door):
        gaudi.ensure_eager_mode()
        gaudi.import_hccl()


def after_process_group(door: Any) -> None:
    """In ``setup_environment``, once the process group exists: the device mesh (built once, on our device), the
    heartbeat."""
    _config.with_mesh(door, build_mesh(door))
    if door.world_size > 1 and door._heartbeat is None:
        node = f"{socket.gethostname()}/node{door.node_rank}"
        door._heartbeat = _liveness.Heartbeat(
            door.global_rank,
            door.world_size,
            node,
            bound_s=door._config.failure_timeout,
            stuck_s=door._config.stuck_timeout,
            enabled=door._config.heartbeat,
        )
        door._heartbeat.start()
        # An exception that ends the script outside the door's own hooks (Fabric has none; after the Trainer's
        # teardown, a script's own collective) still names the rank that was lost.
        _liveness.report_uncaught(door._heartbeat)
    _preemption.arm(door)


def build_mesh(door: Any) -> Any:
    """The device mesh the engine shards over: ``device_mesh=[replicas, shard_size]`` built on the root device's type
    (Lightning would build it on "cuda"), a given ``DeviceMesh`` as it is, else the engine's own choice (FSDP1: none;
    FSDP2: one over every rank, or one replica per node for hybrid sharding). A mesh built before is kept."""
    mesh = door._config.device_mesh
    if isinstance(mesh, tuple):
        from torch.distributed.device_mesh import init_device_mesh

        check_mesh_size(mesh, door.world_size)
        mesh = init_device_mesh(door.root_device.type, mesh, mesh_dim_names=("replicate", "shard"))
    return door._engine.default_mesh(
        mesh, door._config.sharding_strategy, door.root_device.type, door.num_nodes, door.num_processes, door.world_size
    )


def stop_heartbeat(door: Any) -> None:
    if door._heartbeat is not None:
        door._heartbeat.stop()
        door._heartbeat = None


def reduce_on_hccl(tensor: Any, group: Any, reduce_op: Any, backend: str | None, reduce: Callable[..., Any]) -> Any:
    """HCCL offers SUM, MIN and MAX only (Lightning sends ``ReduceOp.AVG`` for ``"mean"`` on every backend but gloo):
    on ``hccl`` a mean is a sum divided by the group's size. ``reduce(tensor, group=, reduce_op=)``: Lightning's."""
    if (
        isinstance(tensor, torch.Tensor)
        and backend == "hccl"
        and _is_mean(reduce_op)
        and torch.distributed.is_initialized()
    ):
        summed = reduce(tensor, group=group, reduce_op="sum")
        size = torch.distributed.get_world_size(group)
        return summed.div_(size) if torch.is_floating_point(summed) else summed.copy_(summed / size)
    return reduce(tensor, group=group, reduce_op=reduce_op)


def _is_mean(reduce_op: Any) -> bool:
    from torch.distributed import ReduceOp

    if isinstance(reduce_op, str):
        return reduce_op.lower() in ("mean", "avg")
    return reduce_op == ReduceOp.AVG
