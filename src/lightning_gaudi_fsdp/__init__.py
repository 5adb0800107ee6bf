"""Lightning FSDP on Intel Gaudi (HPU), rehearsable on CPU processes.

Importing this package registers, once and only where the names are free, for the Trainer and for Fabric:

- the ``hpu`` accelerator in Lightning's accelerator registries (Lightning >= 2.5.6 ships none);
- the strategy names ``gaudi_fsdp`` and ``hpu_fsdp`` (lightning-habana's name) in the strategy registries: the
  Trainer's :class:`GaudiFSDPStrategy` and Fabric's :class:`lightning_gaudi_fsdp.fabric.GaudiFSDPStrategy`.

It never imports ``habana_frameworks``. If lightning-habana is installed but cannot be imported (1.6.0 on Lightning
2.6), one warning says so and everything else works.
"""

from __future__ import annotations

from lightning_gaudi_fsdp.accelerator import GaudiAccelerator
from lightning_gaudi_fsdp.checkpoint.formats import CheckpointError
from lightning_gaudi_fsdp.precision import GaudiFSDPPrecision
from lightning_gaudi_fsdp.strategy import GaudiFSDPStrategy

__all__ = ["CheckpointError", "GaudiAccelerator", "GaudiFSDPPrecision", "GaudiFSDPStrategy", "register"]
__version__ = "0.1.0"


def register() -> None:
    """Register the ``hpu`` accelerator and the strategy names with the Trainer and Fabric; safe to call more than
    once."""
    from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_gaudi_fsdp import fabric

    for registry in (AcceleratorRegistry, ACCELERATOR_REGISTRY):
        if "hpu" not in registry:
            registry.register(
                "hpu",
                GaudiAccelerator,
                description="Intel Gaudi through the Habana PyTorch bridge (lightning-gaudi-fsdp)",
            )
    GaudiFSDPStrategy.register_strategies(StrategyRegistry)
    fabric.GaudiFSDPStrategy.register_strategies(STRATEGY_REGISTRY)


def _check_lightning_habana() -> None:
    """lightning-habana is optional and archived; when it is installed but broken, say so once and carry on."""
    import importlib
    import importlib.util
    import warnings

    if importlib.util.find_spec("lightning_habana") is None:
        return
    try:
        importlib.import_module("lightning_habana")
    except Exception as err:
        warnings.warn(
            f"lightning-habana is installed but does not import with this Lightning ({type(err).__name__}: {err}). "
            "lightning-gaudi-fsdp does not need it; `pip uninstall lightning-habana` silences this warning.",
            stacklevel=2,
        )


register()
_check_lightning_habana()
