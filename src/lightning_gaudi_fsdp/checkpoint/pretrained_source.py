"""Where ``pretrained_weights`` points, and reading its tensors a slice at a time.

A Hugging Face model directory (``model.safetensors``, or several files with ``model.safetensors.index.json``), one
``.safetensors`` file (memory-mapped; ``safe_open(...).get_slice(key)[a:b]`` reads rows of one tensor), or a
checkpoint of this strategy (full, sharded or local; read a tensor, or one local FSDP unit, at a time through
:mod:`.tensor_source`). Any of them may be at a URL (:mod:`.files`); safetensors files there are read a byte range
of rows at a time (:mod:`.remote_safetensors`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_gaudi_fsdp.checkpoint import files, hf_names
from lightning_gaudi_fsdp.checkpoint.remote_safetensors import DTYPES as _DTYPES
from lightning_gaudi_fsdp.checkpoint.remote_safetensors import RemoteSafetensors
from lightning_gaudi_fsdp.checkpoint.tensor_source import TensorSource, open_source

INDEX = hf_names.MODEL_INDEX
SINGLE = hf_names.MODEL_FILE
_ACCEPTED = (
    "a Hugging Face model directory (model.safetensors or model.safetensors.index.json), a .safetensors file or a "
    "checkpoint of this strategy (full file, sharded or local directory)"
)


class PretrainedWeightsError(ValueError):
    """``pretrained_weights`` cannot be loaded into the model; the message names the path, the file and the key."""


@dataclasses.dataclass(frozen=True)
class Weights:
    """A resolved ``pretrained_weights``: where the tensors are and how file keys become module keys."""

    path: Path
    kind: Literal["safetensors", "checkpoint"]
    files: tuple[Path, ...]  # the safetensors files (empty for a checkpoint)
    prefix: str = ""

    def describe(self) -> str:
        return f"pretrained_weights={str(self.path)!r}"


def resolve(pretrained_weights: str | os.PathLike[str] | None, pretrained_prefix: str = "") -> Weights | None:
    """Check ``pretrained_weights`` (it must exist and be one of the accepted kinds) and ``pretrained_prefix``."""
    if not isinstance(pretrained_prefix, str):
        raise TypeError(f"pretrained_prefix={pretrained_prefix!r} must be a string (e.g. 'model.' or '')")
    if pretrained_weights is None:
        if pretrained_prefix:
            raise ValueError(f"pretrained_prefix={pretrained_prefix!r} needs pretrained_weights")
        return None
    if not isinstance(pretrained_weights, str | os.PathLike):
        raise TypeError(f"pretrained_weights={pretrained_weights!r} must be a path; expected {_ACCEPTED}")
    path = files.locate(pretrained_weights, "pretrained_weights", "GaudiFSDPStrategy").expanduser()
    shown = f"pretrained_weights={str(pretrained_weights)!r}"
    if not path.exists():
        raise PretrainedWeightsError(f"{shown} does not exist; expected {_ACCEPTED}")
    if path.is_file():
        if path.suffix == ".safetensors":
            return Weights(path, "safetensors", (path,), pretrained_prefix)
        return Weights(path, "checkpoint", (), pretrained_prefix)
    if (path / INDEX).is_file():
        return Weights(path, "safetensors", _indexed_files(path, shown), pretrained_prefix)
    if (path / SINGLE).is_file():
        return Weights(path, "safetensors", (path / SINGLE,), pretrained_prefix)
    from lightning_gaudi_fsdp.checkpoint.formats import detect_format_or_none

    if detect_format_or_none(path) is not None:
        return Weights(path, "checkpoint", (), pretrained_prefix)
    raise PretrainedWeightsError(
        f"{shown} is a directory without {SINGLE}, {INDEX} or a checkpoint's metadata; expected {_ACCEPTED}"
    )


def _indexed_files(path: Path, shown: str) -> tuple[Path, ...]:
    try:
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise PretrainedWeightsError(f"{shown}: {INDEX} is not a safetensors index ({err})") from None
    files = tuple(dict.fromkeys(path / name for name in weight_map.values()))
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise PretrainedWeightsError(f"{shown}: {INDEX} names {missing[0]}, which is missing")
    return files


# ------------------------------------------------------------------------------------------------------- reading
class Source:
    """The tensors of a ``Weights``: shapes and dtypes of every key, and rows of dimension 0 of one key."""

    def __init__(self, weights: Weights, *, weights_only: bool = True) -> None:
        self.weights = weights
        self._handles: dict[Path, Any] = {}
        self._checkpoint: TensorSource | None = None
        self._read: dict[str, torch.Tensor] = {}  # the checkpoint tensors read last (one group)
        self.where: dict[str, str] = {}  # key -> file name, for messages
        self._file_of: dict[str, Path] = {}
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype | str]] = {}
        if weights.kind == "checkpoint":
            # names, shapes and dtypes only; tensors are read a few at a time (memory-mapped, or the byte ranges of
            # a sharded checkpoint), so no rank holds the whole model
            self._checkpoint = open_source(weights.path, weights_only=weights_only)
            for key, (shape, dtype) in self._checkpoint.entries.items():
                self.meta[key] = (tuple(shape), dtype)
                self.where[key] = weights.path.name
            return
        for file in weights.files:
            handle = self._open(file)
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                piece = handle.get_slice(key)
                self.meta[key] = (tuple(piece.get_shape()), _DTYPES.get(piece.get_dtype(), piece.get_dtype()))
                self.where[key] = file.name
                self._file_of[key] = file

    def _open(self, file: Path) -> Any:
        from safetensors import safe_open

        handle = self._handles.get(file)
        if handle is None:
            try:
                if files.is_remote(file):
                    handle = self._handles[file] = RemoteSafetensors(file)
                else:
                    handle = self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except Exception as err:
                raise PretrainedWeightsError(
                    f"{self.weights.describe()}: {file.name} is not a readable safetensors file ({err})"
                ) from None
        return handle

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of dimension 0 of ``key`` (the whole tensor for a 0-d one)."""
        if self._checkpoint is not None:
            if key not in self._read:
                self._read = self._checkpoint.read(self._checkpoint.group(key))
            tensor = self._read[key]
            return tensor if tensor.dim() == 0 else tensor[start:stop]
        handle = self._open(self._file_of[key])
        if not self.meta[key][0]:
            return handle.get_tensor(key)
        return handle.get_slice(key)[start:stop]
