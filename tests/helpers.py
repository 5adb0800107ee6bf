"""Helpers the test modules share: the unit class the scenarios wrap, weight comparisons, a free port."""

from __future__ import annotations

import socket
from typing import Any

BLOCK = "common.Block"  # the transformer-like block of tests/scenarios/common.py: one FSDP unit each


def assert_close_weights(a: dict[str, Any], b: dict[str, Any], atol: float = 1e-5) -> None:
    """Same keys, and every tensor within ``atol`` (``atol=0``: bitwise)."""
    import torch

    assert sorted(a) == sorted(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=lambda m, k=key: f"{k}: {m}")


def changed(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether any tensor of ``a`` differs from ``b``'s (a parity test on untouched weights proves nothing)."""
    import torch

    return any(not torch.allclose(a[k], b[k]) for k in a)


def slurm_environment(monkeypatch: Any, *, tasks: int, tasks_per_node: int, rank: int, nodelist: str) -> None:
    """The variables a SLURM task sees (``SLURMEnvironment.detect()`` is true), set for one test; the
    ``MASTER_ADDR``/``MASTER_PORT`` that Lightning's ``SLURMEnvironment`` writes into ``os.environ`` are undone after it
    too (left behind, they sent a later test's rendezvous to the SLURM node's name)."""
    env = {
        "SLURM_NTASKS": str(tasks),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % tasks_per_node),
        "SLURM_NODEID": str(rank // tasks_per_node),
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "42",
        "SLURM_NODELIST": nodelist,
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # records the state before, so the test's end restores it
        monkeypatch.delenv(key)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
