"""A ``.safetensors`` file at a URL read a few rows at a time, through the storage seam (:mod:`.files`).

``safetensors.safe_open`` memory-maps a local file; an object has nothing to map. This reads the file's header once
(8 bytes of length, then JSON: each tensor's dtype, shape and byte range) and then only the byte range of the rows
asked for, so a rank loading ``pretrained_weights`` from object storage reads about its own shards, as from a local
file, never the whole model. It offers the part of ``safe_open``'s handle that :mod:`.pretrained_source` uses:
``keys()``, ``get_slice(key)`` (``get_shape()``, ``get_dtype()``, ``[start:stop]`` over dimension 0) and
``get_tensor(key)``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from lightning_gaudi_fsdp.checkpoint import files
from lightning_gaudi_fsdp.checkpoint.files import Remote

DTYPES = {  # safetensors' dtype names
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


class RemoteSafetensors:
    """The tensors of the safetensors file at ``where`` (see the module docstring)."""

    def __init__(self, where: Remote) -> None:
        self.where = where
        with files.open_read(where) as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 0 < length <= _MAX_HEADER:
                raise ValueError(f"header length {length} is not that of a safetensors file")
            header = json.loads(handle.read(length))
        header.pop("__metadata__", None)
        self._base = 8 + length
        self._entries: dict[str, dict[str, Any]] = header

    def keys(self) -> list[str]:
        return list(self._entries)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self, key, self._entries[key])

    def get_tensor(self, key: str) -> torch.Tensor:
        entry = self._entries[key]
        return self.get_slice(key)[0 : entry["shape"][0]] if entry["shape"] else self._read(entry, 0, 1, 1)

    def _read(self, entry: dict[str, Any], start: int, stop: int, row_elements: int) -> torch.Tensor:
        dtype = DTYPES[entry["dtype"]]
        row_bytes = row_elements * dtype.itemsize
        begin = self._base + entry["data_offsets"][0] + start * row_bytes
        with files.open_read(self.where) as handle:
            handle.seek(begin)
            data = bytearray(handle.read((stop - start) * row_bytes))
        if len(data) != (stop - start) * row_bytes:
            raise EOFError(f"{self.where}: ends before the rows {start}:{stop} of a tensor")
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        shape = entry["shape"]
        return flat.reshape(stop - start, *shape[1:]) if shape else flat.reshape(())


class _Slice:
    def __init__(self, owner: RemoteSafetensors, key: str, entry: dict[str, Any]) -> None:
        self._owner, self._key, self._entry = owner, key, entry

    def get_shape(self) -> list[int]:
        return list(self._entry["shape"])

    def get_dtype(self) -> str:
        return str(self._entry["dtype"])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        shape = self._entry["shape"]
        start, stop, _ = rows.indices(shape[0])
        return self._owner._read(self._entry, start, max(stop, start), math.prod(shape[1:]))
