"""pyverbs.mem_alloc: host memory by address (libc through ctypes), as pyverbs gives it.

An address from :func:`malloc`, :func:`posix_memalign` or :func:`mmap` can be registered
with ``MR(pd, length, access, address=addr)``: the MR then covers that memory, and its
``buf`` is that address, as with pyverbs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct

from ..errors import PyverbsError, PyverbsRDMAError

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]
_libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                 ctypes.c_size_t]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

PROT_NONE_, PROT_READ_, PROT_WRITE_, PROT_EXEC_ = 0, 1, 2, 4
MAP_SHARED_, MAP_PRIVATE_, MAP_FIXED_, MAP_ANONYMOUS_ = 1, 2, 16, 32
MAP_GROWSDOWN_, MAP_LOCKED_, MAP_NORESERVE_, MAP_POPULATE_ = 256, 8192, 16384, 32768
MAP_STACK_, MAP_HUGETLB_ = 131072, 262144
_MAP_FAILED = ctypes.c_void_p(-1).value


def malloc(size: int) -> int:
    p = _libc.malloc(size)
    if not p:
        raise PyverbsError(f"Failed to allocate memory of size {size}")
    return p


def posix_memalign(size: int, alignment: int = 8) -> int:
    p = ctypes.c_void_p()
    rc = _libc.posix_memalign(ctypes.byref(p), alignment, size)
    if rc:
        raise PyverbsRDMAError(f"Failed to allocate memory of size {size}", rc)
    return p.value or 0


def free(ptr: int) -> None:
    _libc.free(ptr)


def mmap(length: int, prot: int = PROT_READ_ | PROT_WRITE_,
         flags: int = MAP_PRIVATE_ | MAP_ANONYMOUS_, fd: int = -1, offset: int = 0,
         addr: int = 0) -> int:
    p = _libc.mmap(addr or None, length, prot, flags, fd, offset)
    if p is None or p == _MAP_FAILED:
        raise PyverbsRDMAError(f"Failed to mmap memory of length {length}",
                               ctypes.get_errno() or errno.ENOMEM)
    return p


MADV_DONTNEED = 4  # <sys/mman.h>, pyverbs' default advice


def madvise(addr: int, length: int, flags: int = MADV_DONTNEED) -> None:
    """libc's madvise (rdma-core 46 on); a failure raises as pyverbs does."""
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), flags):
        e = ctypes.get_errno()
        raise PyverbsRDMAError(f"Failed to madvise memory. Errno: {e}, {os.strerror(e)}", e)


def munmap(addr: int, length: int) -> None:
    if _libc.munmap(addr, length):
        raise PyverbsRDMAError("Failed to munmap memory", ctypes.get_errno())


def read(addr: int, length: int, offset: int = 0) -> bytes:
    return ctypes.string_at(addr + offset, length)


def write(addr: int, data: bytes | str, length: int, offset: int = 0) -> None:
    if isinstance(data, str):
        data = data.encode()
    ctypes.memmove(addr + offset, bytes(data[:length]), min(length, len(data)))


def read32(addr: int, offset: int = 0) -> int:
    return struct.unpack("=I", ctypes.string_at(addr + offset, 4))[0]


def read64(addr: int, offset: int = 0) -> int:
    return struct.unpack("=Q", ctypes.string_at(addr + offset, 8))[0]


def writebe32(addr: int, val: int, offset: int = 0) -> None:
    ctypes.memmove(addr + offset, struct.pack(">I", val), 4)


def writebe64(addr: int, val: int, offset: int = 0) -> None:
    ctypes.memmove(addr + offset, struct.pack(">Q", val), 8)


def host_buffer(addr: int, length: int) -> ctypes.Array:
    """The memory at ``addr`` as a writable buffer object (for MR registration)."""
    return (ctypes.c_char * length).from_address(addr)
