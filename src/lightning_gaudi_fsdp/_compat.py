"""What differs between the torch and Lightning versions the package supports, in one place.

Intel's Gaudi containers pin torch (Gaudi software 1.21 = torch 2.6 with Lightning 2.5.1, 1.22 = torch 2.7,
1.23 = torch 2.9, 1.24.0 = torch 2.10, 1.24.1 = torch 2.11), so the package runs on torch >= 2.6 and keeps every
version branch here, as Lightning keeps its ``_TORCH_GREATER_EQUAL_*`` flags. Other modules ask these flags and
helpers; none of them catches a ``TypeError`` to find out which torch it is on.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


def _release(version: str) -> Version:
    """The release a version string names, as Lightning compares torch (``use_base_version``): a local build
    (``2.6.0+hpu...``) or pre-release (``2.7.0a0+git...``) counts as its release."""
    return Version(Version(version).base_version)


TORCH_VERSION = _release(torch.__version__)
MIN_TORCH = Version("2.6")
# dcp.save(..., no_dist=...) appeared in torch 2.7; torch 2.6 decides it from whether a process group exists.
TORCH_GREATER_EQUAL_2_7 = Version("2.7") <= TORCH_VERSION
# FSDPModule.set_force_sum_reduction_for_comms appeared in torch 2.8; before it, FSDP2 reduce-scatters fp32/bf16
# gradients with AVG (or PREMUL_SUM), which HCCL does not offer, and its CPU streams lack record_event (2.6). The
# FSDP2 engine (fsdp_version=2) therefore needs torch >= 2.8.
FSDP2_FORCE_SUM_REDUCTION = Version("2.8") <= TORCH_VERSION

# The pairings Intel ships and the ones CI runs; `doctor` compares the installed versions with these.
# (torch minor, Lightning version Intel pairs with it or None, Gaudi software release or None, what CI tests there)
SUPPORTED_PAIRINGS: tuple[tuple[str, str | None, str | None, str], ...] = (
    ("2.6", "2.5.1", "1.21", "representative suite (torch 2.6.0 + Lightning 2.5.1 + transformers 4.57)"),
    ("2.7", None, "1.22", "not run (between the tested 2.6 and 2.9)"),
    ("2.9", "2.5.1", "1.23", "representative suite, FSDP2 included (torch 2.9.1 + Lightning 2.5.1)"),
    ("2.10", None, "1.24.0", "not run (between the tested 2.9 and 2.11)"),
    ("2.11", "2.6.6", "1.24.1", "representative suite (torch 2.11.0 + Lightning 2.6.6)"),
    ("2.13", "2.6.6", None, "full suite (torch 2.13.0 + Lightning 2.6.6 + transformers 5)"),
)
LIGHTNING_RANGE = (">=2.5.1", "<2.7")


def torch_minor(version: Version = TORCH_VERSION) -> str:
    return f"{version.major}.{version.minor}"


def check_pairing(torch_version: str, lightning_version: str) -> tuple[bool, str]:
    """Whether ``torch_version`` + ``lightning_version`` is within what the package supports, and a sentence: which
    tested pairing it is, or what is outside the range."""
    try:
        torch_v, lightning_v = _release(torch_version), Version(lightning_version)
    except InvalidVersion as err:
        return False, f"cannot read the versions (torch {torch_version!r}, Lightning {lightning_version!r}): {err}"
    if torch_v < MIN_TORCH:
        return False, f"torch {torch_version} is older than the supported {MIN_TORCH} (Gaudi software 1.21)"
    if not SpecifierSet(",".join(LIGHTNING_RANGE)).contains(lightning_v, prereleases=True):
        return False, f"Lightning {lightning_version} is outside the supported range {','.join(LIGHTNING_RANGE)}"
    minor = torch_minor(torch_v)
    for pair_minor, pair_lightning, gaudi_release, tested in SUPPORTED_PAIRINGS:
        if pair_minor == minor:
            where = f"Gaudi software {gaudi_release}'s torch; " if gaudi_release else ""
            if pair_lightning in (None, lightning_version):
                return True, f"{where}CI: {tested}"
            return True, (
                f"{where}CI tests torch {minor} only with Lightning {pair_lightning}; "
                f"Lightning {lightning_version} is within the supported range"
            )
    newest = Version(SUPPORTED_PAIRINGS[-1][0])
    if torch_v > newest:
        return True, f"newer than the newest tested torch ({newest}); expected to work"
    return True, "within the supported range, not a pairing CI tests"


def dcp_save(
    state: dict[str, Any],
    checkpoint_id: str | os.PathLike[str],
    no_dist: bool = False,
    process_group: Any = None,
    storage_writer: Any = None,
) -> None:
    """``torch.distributed.checkpoint.save``; ``no_dist=True`` writes from one process without a process group
    (offline conversion), on every supported torch. ``process_group``: the group DCP coordinates over (default: the
    default group). ``storage_writer``: torch's writer to use (a URL's), else the file-system one for the path."""
    import torch.distributed.checkpoint as dcp

    if TORCH_GREATER_EQUAL_2_7:
        dcp.save(
            state,
            checkpoint_id=checkpoint_id,
            storage_writer=storage_writer,
            no_dist=no_dist,
            process_group=process_group,
        )
        return
    if not no_dist:
        dcp.save(state, checkpoint_id=checkpoint_id, storage_writer=storage_writer, process_group=process_group)
        return
    from lightning_gaudi_fsdp.adapters import torch_internals  # torch 2.6: only its private entry point has no_dist

    torch_internals.dcp_save_no_dist(state, os.fspath(checkpoint_id), storage_writer)


def add_note(exception: BaseException, note: str) -> None:
    """``exception.add_note(note)`` (Python >= 3.11, printed under the traceback). On Python 3.10 the note is kept in
    ``__notes__`` as 3.11 does, and appended to the message of a one-argument exception so it is still printed."""
    if hasattr(exception, "add_note"):
        exception.add_note(note)
        return
    notes = getattr(exception, "__notes__", None)
    exception.__notes__ = [*(notes or []), note]  # type: ignore[attr-defined]
    if len(exception.args) == 1 and isinstance(exception.args[0], str):
        exception.args = (f"{exception.args[0]}\n{note}",)
