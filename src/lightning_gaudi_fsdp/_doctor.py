"""The checks behind ``lightning-gaudi-fsdp doctor``: what a user needs to know when something does not work."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from lightning_gaudi_fsdp import _compat, _report, gaudi


@dataclass
class Check:
    name: str
    value: str
    ok: bool = True
    blocking: bool = False
    fix: str = ""


def _lightning_habana() -> Check:
    if importlib.util.find_spec("lightning_habana") is None:
        return Check("lightning-habana", "not installed (not needed)")
    version = _report._dist_version("lightning-habana") or "unknown"
    try:
        importlib.import_module("lightning_habana")
    except Exception as err:
        return Check(
            "lightning-habana",
            f"{version}, does not import: {type(err).__name__}: {err}",
            ok=False,
            fix="lightning-habana is archived and breaks on current Lightning; this package does not need it "
            "(`pip uninstall lightning-habana`)",
        )
    return Check("lightning-habana", f"{version} (imports; its HPUAccelerator is accepted)")


def fsdp2_hpu_kernels() -> bool:
    """Whether this torch registers FSDP2's copy-in kernels for HPU (what ``fully_shard`` runs on Gaudi)."""
    from lightning_gaudi_fsdp.adapters import torch_internals

    return torch_internals.has_hpu_kernel("fsdp::all_gather_copy_in")


def _fsdp2_engine(on_hpu: bool) -> Check:
    """Whether ``fsdp_version=2`` can run on this torch and, for an HPU target (``on_hpu``), whether FSDP2's own
    kernels are registered for HPU (a CPU rehearsal never runs them)."""
    if not _compat.FSDP2_FORCE_SUM_REDUCTION:
        return Check(
            "FSDP2 engine (fsdp_version=2)",
            f"not on torch {_compat.TORCH_VERSION} (needs >= 2.8); fsdp_version=1 only",
            ok=False,
            fix="the default engine (fsdp_version=1) works on this torch; FSDP2 needs a container with torch >= 2.8",
        )
    if not on_hpu:
        return Check(
            "FSDP2 engine (fsdp_version=2)", "available: fully_shard (HPU kernels not checked for a cpu target)"
        )
    hpu = fsdp2_hpu_kernels()
    return Check(
        "FSDP2 engine (fsdp_version=2)",
        f"available: fully_shard, SUM reductions on hccl, HPU kernels {'registered' if hpu else 'missing'}",
        ok=hpu,
        fix="this torch registers no HPU kernels for FSDP2's copy-in ops; use fsdp_version=1 on Gaudi",
    )


def _pairing(torch_version: str, lightning_version: str) -> Check:
    """Not blocking: a pairing outside the tested ones may still work, and on Gaudi torch comes from the container."""
    ok, sentence = _compat.check_pairing(torch_version, lightning_version)
    oldest = _compat.SUPPORTED_PAIRINGS[0]
    lightning = ",".join(_compat.LIGHTNING_RANGE)
    return Check(
        "torch + Lightning",
        sentence,
        ok=ok,
        fix=f"use torch >= {_compat.MIN_TORCH} (Gaudi software {oldest[2]} or newer; on Gaudi keep the container's "
        f"torch) with `pip install 'lightning{lightning}'`; the README's support table lists what CI tests",
    )


def run_checks(accelerator: str = "auto") -> list[Check]:
    import torch
    import torch.distributed

    bridge = gaudi.bridge_installed()
    target = ("hpu" if bridge else "cpu") if accelerator == "auto" else accelerator
    on_hpu = target == "hpu"
    versions = _report.versions()
    checks = [
        Check("target accelerator", target),
        Check("torch", versions["torch"]),
        Check("lightning", versions["lightning"]),
        _pairing(versions["torch"], versions["lightning"]),
        _fsdp2_engine(on_hpu),
        Check("lightning-gaudi-fsdp", versions["lightning-gaudi-fsdp"]),
        _lightning_habana(),
        Check(
            "torch.distributed",
            "available" if torch.distributed.is_available() else "missing",
            ok=torch.distributed.is_available(),
            blocking=True,
            fix="install a torch build with distributed support",
        ),
    ]
    if not on_hpu:
        gloo = torch.distributed.is_available() and torch.distributed.is_gloo_available()
        checks.append(
            Check(
                "gloo backend",
                "available" if gloo else "missing",
                ok=gloo,
                blocking=True,
                fix="install a torch build with gloo (the CPU rehearsal needs it)",
            )
        )
    bridge_version = gaudi.bridge_version()
    checks.append(
        Check(
            "Habana bridge",
            bridge_version or "not installed",
            ok=bridge or not on_hpu,
            blocking=on_hpu,
            fix="run inside Intel's Gaudi PyTorch container (habana_frameworks is not on PyPI)",
        )
    )
    if bridge:
        lazy = gaudi.is_lazy_mode()
        checks.append(
            Check(
                "execution mode",
                "lazy" if lazy else "eager",
                ok=not lazy,
                blocking=on_hpu,
                fix="set PT_HPU_LAZY_MODE=0 before starting Python; FSDP cannot run in lazy mode",
            )
        )
        hccl = gaudi.hccl_importable()
        checks.append(
            Check(
                "hccl module",
                "importable" if hccl else "fails to import",
                ok=hccl,
                blocking=on_hpu,
                fix=f"{gaudi.HCCL_MODULE} must import; check the container's habana-torch-plugin",
            )
        )
        count = gaudi.device_count()
        checks.append(
            Check(
                "Gaudi devices",
                str(count),
                ok=count > 0,
                blocking=on_hpu,
                fix="no device visible: check HABANA_VISIBLE_DEVICES and `hl-smi`",
            )
        )
    from lightning.pytorch.accelerators import AcceleratorRegistry

    registered = AcceleratorRegistry["hpu"]["accelerator"] if "hpu" in AcceleratorRegistry else None
    checks.append(
        Check(
            "'hpu' accelerator",
            f"{registered.__module__}.{registered.__qualname__}" if registered else "not registered",
            ok=registered is not None,
            blocking=on_hpu,
            fix="import lightning_gaudi_fsdp before building the Trainer",
        )
    )
    for name, value in gaudi.relevant_environment().items():
        checks.append(Check(f"${name}", "unset" if value is None else value))
    return checks


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        status = "ok " if c.ok else ("ERR" if c.blocking else "warn")
        lines.append(f"[{status:4}] {c.name.ljust(width)}  {c.value}")
    problems = [c for c in checks if not c.ok]
    if problems:
        lines.append("")
        lines += [f"fix: {c.name}: {c.fix}" for c in problems]
    verdict = "can run" if all(c.ok or not c.blocking for c in checks) else "cannot run"
    target = checks[0].value
    lines.append("")
    lines.append(f"This machine {verdict} GaudiFSDPStrategy with accelerator={target!r}.")
    return "\n".join(lines)
