"""Reading checkpoint files without running code from them: the one place where checkpoints are unpickled.

A checkpoint is a pickle, and unpickling can call any function the file names. Every read here is therefore safe by
default (``weights_only=True``):

- ``torch.save`` files (a full checkpoint, ``meta.pt``, ``trainer_state.pt``, rank shards) load with torch's
  ``weights_only`` unpickler, which builds tensors, containers and plain values and refuses everything else;
- the distributed-checkpoint ``.metadata`` file, which torch reads with plain ``pickle.load``, is read here with an
  unpickler that only builds torch's own metadata records;
- the small non-tensor entries of a distributed checkpoint (optimizer hyper-parameters), which torch's planner loads
  with ``weights_only=False``, are unpickled with ``weights_only=True`` first and refused if that fails.

Beyond torch's own allowlist, exactly the types in :func:`allowed_globals` are allowed, through torch's safe-globals
mechanism. A refused checkpoint raises :class:`UnsafeCheckpointError` naming the file, the blocked types and the ways
to allow them; nothing in the file has run. ``weights_only=False`` (``Trainer.fit(..., weights_only=False)``, the
CLI's ``--trust-checkpoint``) reads the files as torch and Lightning always did, for a source the user trusts.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import io
import os
import pathlib
import pickle
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, NamedTuple

import torch
from torch.distributed.checkpoint import FileSystemReader

from lightning_gaudi_fsdp.adapters import torch_internals
from lightning_gaudi_fsdp.checkpoint import files
from lightning_gaudi_fsdp.checkpoint.files import Remote, Where
from lightning_gaudi_fsdp.checkpoint.formats import CheckpointError

TRUST_HINT = (
    "Only if you trust where it came from: allow just those types with torch.serialization.add_safe_globals([...]), "
    "or load the checkpoint unrestricted with Trainer.fit(..., weights_only=False) or "
    "`lightning-gaudi-fsdp inspect|convert --trust-checkpoint`, which runs whatever code it contains"
)
_DCP_METADATA = ".metadata"


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that needs more than safe unpickling; nothing in it was run."""

    def __init__(self, path: str | os.PathLike[str], what: str, file: str, blocked: list[str], detail: str) -> None:
        if blocked:
            problem = f"{what} ({file}) needs {', '.join(blocked)}, which safe loading (weights_only=True) refuses"
        else:
            problem = f"{what} ({file}) cannot be loaded safely (weights_only=True): {detail}"
        super().__init__(path, f"{problem}; nothing in it was run. {TRUST_HINT}")
        self.file = file
        self.blocked = blocked


# ---------------------------------------------------------------------------------------------------- allowlist
@functools.cache
def allowed_globals() -> tuple[Any, ...]:
    """What safe loading allows beyond torch's own ``weights_only`` allowlist, in ``add_safe_globals`` form.

    Lightning's own entries (loops, callbacks, schedulers, precision plugin) and this package's need nothing more.
    Hyper-parameters from ``save_hyperparameters`` do when they hold paths (``pathlib.PosixPath``,
    ``pathlib.PurePosixPath``: a path is built from its string parts) or numpy numeric scalars (``np.float64(0.1)``:
    numpy's ``scalar`` reconstructor, ``numpy.dtype`` and the dtype classes of bool, integer, float and complex
    numbers). Names written by other Python and numpy versions (``pathlib._local``, ``numpy.core``) map to the same
    objects. Enums and other classes of your own are not allowed: add them with
    ``torch.serialization.add_safe_globals``, which every read here honours."""
    return _path_globals() + _numpy_scalar_globals()


def _path_globals() -> tuple[Any, ...]:
    classes = (pathlib.PosixPath, pathlib.PurePosixPath)
    return tuple((cls, f"{module}.{cls.__name__}") for cls in classes for module in ("pathlib", "pathlib._local"))


def _numpy_scalar_globals() -> tuple[Any, ...]:
    try:
        import numpy as np
    except ImportError:
        return ()
    try:
        from numpy._core.multiarray import scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import scalar
    numeric = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
    numeric += [np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128, np.clongdouble]
    return (
        *((scalar, f"{module}.multiarray.scalar") for module in ("numpy.core", "numpy._core")),
        np.dtype,
        *dict.fromkeys(type(np.dtype(t)) for t in numeric),  # a dtype's class: only ever built, never named
    )


@contextmanager
def _allowed() -> Iterator[None]:
    # Only what the user has not allowed already: leaving the context removes what it added.
    present = torch.serialization.get_safe_globals()
    added = [g for g in allowed_globals() if g not in present]
    with torch.serialization.safe_globals(added):
        yield


# ----------------------------------------------------------------------------------------------- torch.save files
def load_file(file: Where, where: Where, what: str, *, weights_only: bool = True) -> Any:
    """``torch.load`` of one file of the checkpoint at ``where`` (memory-mapped, on the CPU; at a URL read through
    :func:`.files.open_read`, not mapped); ``what`` names the file's role in messages. Raises :class:`CheckpointError`
    when it is missing or damaged, :class:`UnsafeCheckpointError` when it needs more than safe loading."""
    if not file.is_file():
        raise CheckpointError(where, f"{what} is missing ({file.name})")
    if isinstance(file, Remote):
        with files.open_read(file) as handle:
            return _load(handle, where, what, file.name, weights_only, mmap=False)
    return _load(file, where, what, file.name, weights_only, mmap=True)


def _load(source: Any, where: Where, what: str, name: str, weights_only: bool, mmap: bool) -> Any:
    try:
        if not weights_only:
            return torch.load(source, map_location="cpu", weights_only=False, mmap=mmap)
        with _allowed():
            try:
                return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
            except pickle.UnpicklingError as err:
                if not isinstance(source, Path):
                    source.seek(0)
                raise UnsafeCheckpointError(where, what, name, _blocked(source), _detail(err)) from None
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(where, f"{what} ({name}) is damaged or truncated: {err}") from err


def _blocked(file: IO[bytes] | Path) -> list[str]:
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(file))
    except Exception:  # not a torch.save archive: the unpickler's own message says what failed
        return []


def _detail(err: BaseException) -> str:
    text = str(err)
    marker = "WeightsUnpickler error:"
    return text[text.index(marker) + len(marker) :].strip() if marker in text else text.strip()


def _check_bytes(data: io.BytesIO, where: Path, what: str, file: str) -> None:
    """Unpickle one in-memory ``torch.save`` payload with ``weights_only=True`` (and throw the result away)."""
    with _allowed():
        try:
            torch.load(data, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            data.seek(0)
            raise UnsafeCheckpointError(where, what, file, _blocked(data), _detail(err)) from None
    data.seek(0)


# ------------------------------------------------------------------------------------------ distributed checkpoint
def storage_reader(path: Where, *, weights_only: bool = True) -> FileSystemReader:
    """torch's reader of a distributed checkpoint; with ``weights_only``, one that unpickles nothing unsafe. It reads
    the metadata file once: a reader kept for many reads (a checkpoint read a tensor at a time) does not unpickle
    it again for each (several MB for a large model). Every file is read through the storage seam, at a URL through
    fsspec (:func:`.files.dcp_reader_on`)."""
    kind = _SafeFileSystemReader if weights_only else _OnceFileSystemReader
    return files.dcp_reader_on(kind(path.key if isinstance(path, Remote) else path), path)


class _OnceFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        key = (args, tuple(sorted(kwargs.items())))
        cache = self.__dict__.setdefault("_lgf_metadata", {})
        if key not in cache:
            cache[key] = self._read_metadata(*args, **kwargs)
        return cache[key]

    def _read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return super().read_metadata(*args, **kwargs)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds torch's distributed-checkpoint metadata records (dataclasses and enums of
    ``torch.distributed.checkpoint.metadata``, ``_StorageInfo``, sizes, dtypes, layouts, paths) and nothing else.
    The module of a refused name is never imported."""

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_global(module, name)
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found


class _Refused(pickle.UnpicklingError):
    pass


def _metadata_global(module: str, name: str) -> Any:
    if module == "torch.distributed.checkpoint.metadata":
        from torch.distributed.checkpoint import metadata

        found = getattr(metadata, name, None)
        is_record = isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
        return found if is_record else None
    if module == "torch":
        found = getattr(torch, name, None)
        return found if found is torch.Size or isinstance(found, torch.dtype | torch.memory_format) else None
    private = torch_internals.private_safe_global(module, name)
    if private is not None:
        return private
    full_name = f"{module}.{name}"
    for entry in (*_path_globals(), *torch.serialization.get_safe_globals()):  # the user's allowlist counts too
        found, entry_name = entry if isinstance(entry, tuple) else (entry, f"{entry.__module__}.{entry.__qualname__}")
        if entry_name == full_name:
            return found
    return None


class _SafeFileSystemReader(_OnceFileSystemReader):
    def _read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        name = _DCP_METADATA if rank is None else f"__{rank}{_DCP_METADATA}"
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except _Refused as err:
                what = "the distributed-checkpoint metadata"
                raise UnsafeCheckpointError(Path(self.path), what, name, [str(err)], "") from None
        # as torch's own reader does
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _CheckedBytes(planner, self))


class _CheckedBytes:
    """A load planner whose ``load_bytes`` first proves the entry loads with ``weights_only=True``; torch's planner then
    unpickles the same bytes (with ``weights_only=False``), which can only name the globals just allowed."""

    def __init__(self, planner: Any, reader: _SafeFileSystemReader) -> None:
        self._planner = planner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        file = self._reader.storage_data[read_item.storage_index].relative_path
        what = f"the distributed-checkpoint entry {read_item.dest_index.fqn!r}"
        _check_bytes(value, Path(self._reader.path), what, file)
        self._planner.load_bytes(read_item, value)


def read_distributed(
    path: Path, state: dict[str, Any], planner: Any, *, weights_only: bool = True, reader: Any = None
) -> None:
    """Read a distributed checkpoint into ``state`` in this process alone (no collectives), through
    :func:`storage_reader` (``reader``: one kept from an earlier read of the same checkpoint, its metadata already
    read). A refusal or damage surfaces as :class:`CheckpointError`, not wrapped by torch."""
    from torch.distributed.checkpoint.api import CheckpointException

    reader = reader if reader is not None else storage_reader(path, weights_only=weights_only)
    reader.read_metadata()  # a refusal of the metadata raised here, not folded into torch's fallbacks
    try:
        torch_internals.dcp_load_no_dist(state, reader, planner)
    except CheckpointException as err:
        for failure in err.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, CheckpointError):
                raise cause from None
        raise CheckpointError(path, f"the distributed checkpoint could not be read: {err}") from None


def check_distributed_entries(path: Path, metadata: Any, reader: Any = None) -> None:
    """Unpickle every non-tensor entry of a distributed checkpoint (optimizer hyper-parameters, a few bytes each)
    with ``weights_only=True``, so that a refusal comes before any weight changes."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    keys = {k for k, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
    if keys:
        read_distributed(path, {}, torch_internals.empty_load_planner(keys), reader=reader)


# ------------------------------------------------------------------------------------- one tensor of a DCP file
class _Rebuilt(NamedTuple):
    storage: tuple[torch.dtype, str, int]  # dtype, record key, elements
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage: Any, offset: int, size: Any, stride: Any, *_: Any) -> _Rebuilt:
    return _Rebuilt(storage, offset, tuple(size), tuple(stride))


class _TensorUnpickler(pickle.Unpickler):
    """Reads the pickle of ``torch.save(tensor)`` into a description of the tensor: the only callables it can reach
    are a function of this module that records its arguments and ``OrderedDict`` (empty backward hooks); storage
    classes become their dtype. Anything else is refused (the caller then asks ``torch.load``)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        dtype = _storage_dtypes().get(name) if module == "torch" else None
        if dtype is not None:
            return dtype
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)):
            raise _Refused(repr(pid))
        return pid[1], str(pid[2]), int(pid[4])


@functools.cache
def _storage_dtypes() -> dict[str, torch.dtype]:
    """``FloatStorage`` -> ``torch.float32`` and so on: the names ``torch.save`` gives a tensor's storage."""
    import warnings

    table = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage's deprecation, for reading a class attribute
        for name in dir(torch):
            dtype = getattr(getattr(torch, name), "dtype", None) if name.endswith("Storage") else None
            if isinstance(dtype, torch.dtype):
                table[name] = dtype
    return table


def _zip_records(data: memoryview) -> dict[str, memoryview] | None:
    """The records of an uncompressed zip archive (as ``torch.save`` writes it), by name without the archive's
    folder, found through its central directory; ``None`` for anything else (compressed, zip64, a comment)."""
    end = len(data) - _END.size
    if end < 0 or data[end : end + 4] != b"PK\x05\x06":
        return None
    count, directory_size, pos = _END.unpack_from(data, end)
    records: dict[str, memoryview] = {}
    for _ in range(count):
        if data[pos : pos + 4] != b"PK\x01\x02":
            return None
        method, size, name_len, extra_len, comment_len, local = _CENTRAL.unpack_from(data, pos)
        if method != 0 or size == 0xFFFFFFFF or local == 0xFFFFFFFF:
            return None
        name = bytes(data[pos + 46 : pos + 46 + name_len]).decode("utf-8", "replace")
        pos += 46 + name_len + extra_len + comment_len
        if data[local : local + 4] != b"PK\x03\x04":
            return None
        local_name, local_extra = _LOCAL.unpack_from(data, local)
        start = local + 30 + local_name + local_extra
        if start + size > len(data):
            return None
        records[name.partition("/")[2]] = data[start : start + size]
    return records


_END = struct.Struct("<10xHII2x")  # end of central directory: entries, directory size and offset (no comment)
_CENTRAL = struct.Struct("<10xH8xI4xHHH8xI")  # method, compressed size, name/extra/comment lengths, local offset
_LOCAL = struct.Struct("<26xHH")  # local header: name and extra lengths


def tensor_from_archive(data: bytearray) -> torch.Tensor | None:
    """The tensor one ``torch.save`` archive (a DCP file's entry) holds, as a view of ``data``, or ``None`` when it
    is not the plain form this reads (the caller then uses ``torch.load(..., weights_only=True)``). Nothing in it is
    run: see :class:`_TensorUnpickler`. About a tenth of what ``torch.load`` spends on a small tensor."""
    records = _zip_records(memoryview(data))
    if records is None or "data.pkl" not in records:
        return None
    if bytes(records.get("byteorder", b"little")) != b"little":
        return None
    try:
        rebuilt = _TensorUnpickler(io.BytesIO(records["data.pkl"])).load()
    except (pickle.UnpicklingError, TypeError, ValueError, EOFError):
        return None
    if not isinstance(rebuilt, _Rebuilt):
        return None
    dtype, key, numel = rebuilt.storage
    raw = records.get(f"data/{key}")
    if raw is None or len(raw) != numel * dtype.itemsize:
        return None
    storage = torch.frombuffer(raw, dtype=dtype) if numel else torch.empty(0, dtype=dtype)
    try:
        return storage.as_strided(rebuilt.size, rebuilt.stride, rebuilt.offset)
    except RuntimeError:
        return None
