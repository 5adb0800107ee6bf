"""The liveness protocol in the rendezvous store: the keys, each rank's error records and their order, the verdict a
survivor prints, and what counts as a lost peer (``_liveness.py`` runs it from the heartbeat thread)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

_PREFIX = "lightning_gaudi_fsdp/liveness"


@dataclass
class Verdict:
    """What a survivor learned: ranks that stopped without a word, and the errors ranks raised themselves, in order
    (collective failures caused by another rank are left out)."""

    lost: list[int] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)
    store_unreachable: str | None = None
    stuck: list[int] = field(default_factory=list)  # alive, no error of their own: asked to print their stacks
    agent_store: bool = False  # torchrun's agent holds the store (not global rank 0)
    waited_in: str | None = None  # the collective this rank failed in

    def message(self, rank: int, world_size: int) -> str | None:
        if self.store_unreachable is not None:
            if self.agent_store:
                where = (
                    "under torchrun the store lives in the agent of node 0, which ends the job (and the store) as "
                    "soon as one of its workers exits: a rank was lost or failed, and torchrun's failure summary "
                    "names it"
                )
            else:
                where = (
                    "under Lightning's launcher and SLURM the store lives in global rank 0's process, so rank 0 was "
                    "most likely lost: its own output shows an error if it raised one, nothing if it was killed, ran "
                    "out of memory or crashed"
                )
            return (
                f"lightning_gaudi_fsdp: rank {rank} could not reach the rendezvous store ({self.store_unreachable}); "
                + where
            )
        parts = []
        if self.lost:
            names = ", ".join(str(r) for r in self.lost)
            plural = "s" if len(self.lost) > 1 else ""
            parts.append(
                f"rank{plural} {names} of {world_size} stopped without reporting an error (killed, out of memory, "
                "or crashed); the collective failure on the surviving ranks follows from that"
            )
        if self.stuck:
            names = ", ".join(str(r) for r in self.stuck)
            plural = "s" if len(self.stuck) > 1 else ""
            parts.append(
                f"rank{plural} {names} of {world_size} still run{'' if plural else 's'} but never reached the "
                f"collective (stuck); each printed its Python stack to its own stderr, under the line "
                f"'lightning_gaudi_fsdp: rank N stack, asked by rank {rank}'"
                + (f"; rank {rank} waited in {self.waited_in}" if self.waited_in else "")
            )
        others = [(r, text) for r, text in self.errors if r != rank]
        if others:  # errors a rank raised itself (not a collective failing because of another rank)
            first_rank, first_text = others[0]
            parts.append(f"rank {first_rank} failed first with: {first_text}")
        if not parts:
            return None
        return "lightning_gaudi_fsdp: " + "; ".join(parts)


def _key(kind: str, rank: int | str, run: str) -> str:
    return f"{_PREFIX}/{run}/{kind}/{rank}"


def _run_id() -> str:
    # torchrun keeps its store across restarts of the workers: keep each attempt's keys apart.
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _connect(timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    host = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def _record_error(store: Any, rank: int, run: str, text: str, peer_failure: bool) -> int:
    """Record ``rank``'s error, numbered in the order errors reach the store; ``peer_failure``: a collective failing
    because of another rank, not an error of its own. Returns its number. Readers watch the ``published`` count, bumped
    once the record is readable: a reader that saw the number taken before the record was written would otherwise
    count it as seen and never read it."""
    order = store.add(_key("errors", "count", run), 1)
    store.set(_key("error", rank, run), f"{order}\n{int(peer_failure)}\n{text}")
    store.add(_key("errors", "published", run), 1)
    return order


def _recorded_errors(store: Any, ranks: Iterable[int], run: str) -> list[tuple[int, int, bool, str]]:
    """(number, rank, peer_failure, text) of each error :func:`_record_error` recorded for ``ranks``."""
    errors = []
    for r in ranks:
        recorded = _read(store, _key("error", r, run))
        if recorded is not None:
            seq, peer, text = recorded.split("\n", 2)
            errors.append((int(seq), r, peer == "1", text))
    return errors


def _wait_for_keys(store: Any, keys: list[str], bound_s: float) -> None:
    """Until every key is set, the store is gone (the rank that would set them left with it) or ``bound_s``."""
    deadline = time.monotonic() + bound_s
    with contextlib.suppress(Exception):
        while time.monotonic() < deadline and not store.check(keys):
            time.sleep(0.1)


def _who(store: Any, rank: int, run: str) -> str:
    node, _, pid = (_read(store, _key("who", rank, run)) or "?\n?").partition("\n")
    return f"node {node}, pid {pid}"


def _read(store: Any, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def looks_like_a_lost_peer(exception: BaseException) -> bool:
    """A failure inside a collective or the store (as opposed to this rank's own bug), worth a diagnosis."""
    import torch.distributed

    if isinstance(exception, torch.distributed.DistError):
        return True
    text = str(exception)
    return isinstance(exception, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "[/", "gloo", "hccl")
    )
