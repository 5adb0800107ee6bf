"""The engine object: FSDP1 (``FullyShardedDataParallel``) or FSDP2 (``fully_shard``) behind one small protocol,
chosen once from the resolved ``fsdp_version`` (:func:`select`) and held by the door (``door._engine``). The doors,
the report and the checkpoint code ask it; nothing else decides which engine a model uses."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch.nn import Module

from lightning_gaudi_fsdp.engine.fsdp1 import FSDP1
from lightning_gaudi_fsdp.engine.fsdp2 import FSDP2
from lightning_gaudi_fsdp.engine.fsdp2_state import is_fsdp2


class Engine(Protocol):
    version: int  # the fsdp_version, as checkpoints record it
    label: str  # the start table's "engine" row
    held_label: str  # what a rank holds: flat parameters (FSDP1) or parameter shards (FSDP2)

    def owns(self, model: Module) -> bool:
        """Whether ``model`` already holds units of this engine (set up before, or wrapped by hand)."""

    def held_tensors(self, model: Module) -> list[Any]:
        """Tensors holding this rank's shards beyond ``model.named_parameters()`` (FSDP1's flat parameters; none for
        FSDP2, whose parameters are the shards): what a background save watches besides the parameters."""

    def check_arguments(
        self,
        *,
        sharding_strategy: Any,
        process_group: Any,
        backward_prefetch: Any,
        limit_all_gathers: bool,
        use_orig_params: bool,
        state_dict_type: str,
        device_mesh: Any,
    ) -> None:
        """Refuse resolved arguments this engine cannot honour (with the argument, the value and what to use)."""

    def mixed_precision_config(self, mixed_precision: Any) -> Any:
        """FSDP1's ``MixedPrecision`` from the ``mixed_precision`` argument (None for FSDP2)."""

    def mixed_precision_policy(self, mixed_precision: Any) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` from the ``mixed_precision`` argument (None for FSDP1)."""

    def default_mesh(
        self, mesh: Any, sharding_strategy: Any, device_type: str, num_nodes: int, num_processes: int, world_size: int
    ) -> Any:
        """The device mesh this engine shards over, once the process group exists: ``mesh`` (``None`` or the
        ``DeviceMesh`` built from the argument) or one of its own (FSDP2 always shards over one)."""

    def shard(self, door: Any, model: Module) -> Module:
        """Shard ``model`` (no unit inside yet) with the door's resolved arguments; returns the root."""

    def adopt_wrapped(self, door: Any, model: Module, lightning_setup: Callable[[Module], Module]) -> Module:
        """Set up a model that :meth:`owns` already holds units of: units wrapped by hand below a plain root get a
        root unit holding the rest of the model; a root wrapped by hand (FSDP1) goes through Lightning's
        ``lightning_setup``; a model sharded before (FSDP2) stays as it is."""

    def wrap_context(self, door: Any) -> AbstractContextManager:
        """Around the model's construction: ``wrap(module)`` calls inside it make ``module`` a unit of this engine,
        with the door's arguments (the rest of the model becomes the root unit at setup: :meth:`adopt_wrapped`)."""

    def set_up(self, door: Any, model: Module, lightning_setup: Callable[[Module], Module]) -> Module:
        """Set ``model`` up for training (either door): the root set up before for this model as it is (the
        Trainer's validate/test/predict after fit), :meth:`adopt_wrapped` for one that holds units already, else
        :meth:`shard`. Records the root on the door (``door._fsdp_root``) and returns it."""

    def step(
        self,
        door: Any,
        name: str,
        context: Callable[[], AbstractContextManager],
        lightning_step: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The Trainer door's ``training_step``/``validation_step``/``test_step``/``predict_step`` (``name``): run
        inside the FSDP root's forward, so the root gathers its own parameters (and casts inputs). ``context``: the
        precision plugin's step context; ``lightning_step``: Lightning's own step, which calls the root."""

    def refuse_optimizers_made_before(self, optimizers: list[Any]) -> None:
        """Fabric's ``setup_module_and_optimizers``: raise when optimizers made before sharding cannot step the
        sharded parameters (FSDP2 replaces every parameter)."""

    def clip_grad_norm(self, root: Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip by the norm over every shard on every rank."""

    def no_sync(self, module: Module) -> AbstractContextManager:
        """Gradients stay local to each rank until the next synchronised backward."""

    def mixed_precision_row(self, door: Any) -> str:
        """The start table's "mixed precision" row."""

    def fingerprint(self, model: Module) -> dict[str, int]:
        """What every rank must agree on: each unit's name and size."""

    def held_elements(self, model: Module) -> int:
        """Elements of the parameters (FSDP1: flat parameters) this rank holds."""

    def unit_count(self, model: Module) -> int: ...

    # checkpoints, per format
    def model_state_dict(self, model: Module, fmt: str, device_type: str, stream: Any = None) -> dict[str, Any]:
        """The model's state in ``fmt`` (empty on ranks other than 0 for ``full``); ``stream``: plan a full state's
        gather on it instead (see :mod:`..checkpoint.streaming`)."""

    def optimizer_state_dict(
        self, model: Module, optimizer: Any, fmt: str, device_type: str, rank: int, stream: Any = None
    ) -> dict[str, Any]: ...

    def local_layout(self, model: Module) -> dict[str, Any]:
        """What a local checkpoint records of the model (beside :attr:`version`, which the checkpoint code records
        for every engine: :func:`..checkpoint.formats.local_metadata`)."""

    def check_local_layout(self, path: Any, meta: dict[str, Any], model: Module) -> None:
        """Raise ``CheckpointError`` when a local checkpoint's recorded layout does not fit ``model``."""

    def current_state(self, model: Module, fmt: str, device_type: str) -> dict[str, Any]:
        """The sharded or local state dict a checkpoint of that format is checked against."""

    def local_shard_keys(self, current: dict[str, Any]) -> list[str]:
        """The keys of :meth:`current_state` a rank's local shard must hold."""

    def expected_full_shapes(self, model: Module) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the parameters a full state dict of ``model`` must hold."""

    def apply_load(
        self, pending: Any, model: Module, optimizers: Any, *, device_type: str, strict: bool, load_optimizers: bool
    ) -> None:
        """Load a checked checkpoint (``loading.PendingLoad``) into ``model`` and ``optimizers``."""

    def load_full_optimizer(self, model: Module, optimizer: Any, state: dict[str, Any], device_type: str) -> None:
        """Load one full optimizer state into ``optimizer`` of the sharded ``model``."""

    def load_pretrained(self, model: Module, prepared: Any, device: torch.device) -> int:
        """Copy this rank's part of each planned pretrained parameter into its shards (parameters no unit manages
        get memory on ``device`` first); returns the elements written."""


def select(fsdp_version: int) -> Engine:
    """The engine for a resolved ``fsdp_version`` (1 or 2)."""
    return FSDP2() if fsdp_version == 2 else FSDP1()


def of(model: Module) -> Engine:
    """The engine that set ``model`` up, for code that holds only a model (tests, tools); the doors hold theirs."""
    return FSDP2() if is_fsdp2(model) else FSDP1()
