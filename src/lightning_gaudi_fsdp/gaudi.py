"""Everything that touches the Intel Gaudi software stack (``habana_frameworks``) lives here.

``habana_frameworks`` ships with Intel's Gaudi containers, not with PyPI. It is imported lazily, inside the functions
below, so this module imports cleanly on any machine. Environment variables are read and written only here:

- ``PT_HPU_LAZY_MODE``: ``1`` selects the legacy lazy mode, in which FSDP cannot run. The bridge reads it when it
  loads (at ``import torch`` in current releases), so the strategy can only detect it in the running process and set
  ``0`` for the processes it launches.
- ``PT_HPU_EAGER_PIPELINE_ENABLE``: Intel's stability switch for FSDP. The strategy's ``eager_pipeline`` argument,
  when not ``None``, takes precedence over the environment and is passed on to launched processes.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

LAZY_MODE_ENV = "PT_HPU_LAZY_MODE"
EAGER_PIPELINE_ENV = "PT_HPU_EAGER_PIPELINE_ENABLE"
HCCL_MODULE = "habana_frameworks.torch.distributed.hccl"
COMPILE_BACKEND = "hpu_backend"
RELEVANT_ENV = (
    LAZY_MODE_ENV,
    EAGER_PIPELINE_ENV,
    "HABANA_VISIBLE_DEVICES",
    "HABANA_VISIBLE_MODULES",
    "PT_HPU_LOG_MOD_MASK",
)

LAZY_MODE_MESSAGE = (
    "FSDP cannot run on Gaudi in lazy mode, and the Habana bridge in this process was loaded with "
    "PT_HPU_LAZY_MODE=1. Set PT_HPU_LAZY_MODE=0 in the environment before Python starts (it is read when "
    "torch is imported), for example `PT_HPU_LAZY_MODE=0 python train.py`."
)


def bridge_installed() -> bool:
    """Whether the ``habana_frameworks.torch`` package can be found (without importing it)."""
    try:
        return importlib.util.find_spec("habana_frameworks.torch") is not None
    except (ImportError, ValueError):
        return False


def _hpu_module() -> Any:
    """``torch.hpu`` once the bridge is loaded, else ``None``."""
    if not bridge_installed():
        return None
    try:
        importlib.import_module("habana_frameworks.torch")
    except Exception:  # a broken bridge must never break an import of this package
        return None
    return getattr(torch, "hpu", None)


def is_available() -> bool:
    hpu = _hpu_module()
    try:
        return bool(hpu is not None and hpu.is_available())
    except Exception:
        return False


def device_count() -> int:
    hpu = _hpu_module()
    if hpu is None:
        return 0
    try:
        return int(hpu.device_count())
    except Exception:
        return 0


def device_generation() -> str | None:
    """The Gaudi generation of this process's device as the bridge names it, lower-cased: ``"gaudi2"``, ``"gaudi3"``
    (``torch.hpu.get_device_name()`` answers ``"GAUDI2"``, ``"GAUDI3"``); ``None`` without a visible device."""
    hpu = _hpu_module()
    try:
        if hpu is None or not hpu.is_available():
            return None
        name = str(hpu.get_device_name())
    except Exception:  # an old bridge without get_device_name, or a device that does not answer
        return None
    return name.strip().lower().replace(" ", "") or None


def bridge_version() -> str | None:
    if not bridge_installed():
        return None
    try:
        module = importlib.import_module("habana_frameworks.torch")
    except Exception:
        return None
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("habana-torch-plugin")
        except Exception:
            return "unknown"
    return str(version)


def is_lazy_mode(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the running bridge is in lazy mode: asked of the bridge when it can tell, else the environment."""
    if bridge_installed():
        try:
            internal = importlib.import_module("habana_frameworks.torch.utils.internal")
            if hasattr(internal, "is_lazy"):
                return bool(internal.is_lazy())
        except ImportError:
            pass
    env = os.environ if environ is None else environ
    return env.get(LAZY_MODE_ENV, "0").strip() == "1"


def ensure_eager_mode() -> None:
    if is_lazy_mode():
        raise RuntimeError(LAZY_MODE_MESSAGE)


def import_hccl() -> None:
    """Register the ``hccl`` process-group backend; must happen before ``init_process_group('hccl')``."""
    try:
        importlib.import_module(HCCL_MODULE)
    except ImportError as err:
        raise RuntimeError(
            f"process_group_backend='hccl' needs {HCCL_MODULE!r}, which failed to import ({err}). "
            "Run inside Intel's Gaudi PyTorch container or install the matching habana-torch-plugin."
        ) from err


def hccl_importable() -> bool:
    try:
        importlib.import_module(HCCL_MODULE)
    except Exception:
        return False
    return True


def current_device() -> torch.device:
    """The device this process addresses: ``hpu:<torch.hpu.current_device()>``."""
    hpu = _hpu_module()
    index = int(hpu.current_device()) if hpu is not None else 0
    return torch.device("hpu", index)


def synchronize() -> None:
    """Wait for the work queued on this process's Gaudi device (a timer read after it measures finished work); a no-op
    without the bridge."""
    hpu = _hpu_module()
    if hpu is not None:
        hpu.synchronize()


def host_staging_allocator(device_type: str) -> Callable[[torch.Size, torch.dtype], torch.Tensor] | None:
    """How to allocate host buffers that checkpoints are staged into from ``device_type``: page-locked memory on Gaudi
    once the bridge is loaded (device-to-host copies into it run at DMA speed), ``None`` (ordinary memory) elsewhere;
    on a CPU run nothing is pinned."""
    if device_type != "hpu" or not is_available():
        return None
    return _pinned_empty


def _pinned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    # pin_memory=True pins for the current accelerator, which the loaded bridge makes the HPU.
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)


def launch_environment(eager_pipeline: bool | None) -> dict[str, str]:
    """Variables that processes launched for Gaudi must start with."""
    env = {LAZY_MODE_ENV: "0"}
    if eager_pipeline is not None:
        env[EAGER_PIPELINE_ENV] = "true" if eager_pipeline else "false"
    return env


def apply_launch_environment(eager_pipeline: bool | None) -> dict[str, str]:
    """Write :func:`launch_environment` into ``os.environ`` so that launched processes inherit it."""
    env = launch_environment(eager_pipeline)
    os.environ.update(env)
    return env


def relevant_environment() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in RELEVANT_ENV}


def default_compile_backend(device_type: str) -> str:
    """``hpu_backend`` on Gaudi (inductor is not supported there); ``aot_eager`` on CPU, which traces and
    runs the graph without a C++ build; ``inductor`` elsewhere."""
    if device_type == "hpu":
        return COMPILE_BACKEND
    if device_type == "cpu":
        return "aot_eager"
    return "inductor"


def prepare_compile_backend(backend: str) -> None:
    """Importing the bridge's dynamo module registers ``hpu_backend`` with ``torch.compile``."""
    if backend == COMPILE_BACKEND:
        importlib.import_module("habana_frameworks.torch.dynamo.compile_backend")
