"""Raw memory and file calls through ``ctypes``, in one place: where a buffer's bytes start (CPython's buffer
protocol), a tensor's bytes as a buffer a file writes without copying them, and Linux's ``sync_file_range``. The
streamed full save (:mod:`..checkpoint.streaming`) uses them to write each piece of a gathered tensor straight from the
shard that holds it.

``Py_buffer``'s layout is part of CPython's stable ABI; ``tests/test_adapters.py`` checks each call against what
Python and torch say of the same bytes.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (its layout is part of the stable ABI)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)(
    ("PyObject_GetBuffer", ctypes.pythonapi)
)
_release_buffer = ctypes.PYFUNCTYPE(None, ctypes.POINTER(_PyBuffer))(("PyBuffer_Release", ctypes.pythonapi))


def address(data: Any) -> int:
    """Where the bytes of a buffer start (a read-only one too, as torch's writer hands over: ``torch.frombuffer``
    would warn about it, and silencing that is not thread-safe while a background save writes)."""
    view = _PyBuffer()
    if _get_buffer(data, ctypes.byref(view), 0) != 0:  # PyBUF_SIMPLE
        raise TypeError(f"a {type(data).__name__} has no buffer to write")
    try:
        return int(view.buf or 0)
    finally:
        _release_buffer(ctypes.byref(view))


def raw(chunk: torch.Tensor) -> Any:
    """The bytes of a contiguous uint8 tensor as a buffer a file writes without copying them first."""
    return (ctypes.c_ubyte * chunk.numel()).from_address(chunk.data_ptr())


def start_writeback(fd: int, offset: int, size: int) -> None:
    """Ask the kernel to start writing bytes ``[offset, offset + size)`` of ``fd`` to disk without waiting for them
    (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; elsewhere nothing). Durability still comes from the fsync of
    the save protocol."""
    call = _sync_file_range()
    if call is not None:
        call(fd, offset, size, 2)  # SYNC_FILE_RANGE_WRITE; advisory: an error only means no head start


@functools.cache
def _sync_file_range() -> Any:
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call
