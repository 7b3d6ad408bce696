"""Moving bytes between SGE lists and packets, through the key table's checks.

rxe's ``copy_data``: every SGE is resolved through its lkey with the access the operation
needs, so a bad lkey, a range outside the MR or a missing permission raises
:class:`~softrdma.qp.memory.AccessError` and nothing is copied past that point.
"""

from __future__ import annotations

from typing import Any

from .memory import AccessError

__all__ = ["gather", "gather_view", "scatter", "NoSpace", "AccessError"]


class NoSpace(Exception):
    """The receive buffers are too small for the incoming data (rxe -ENOSPC)."""


def gather(keys: Any, pd: Any, sges: list[tuple[int, int, int]], offset: int, n: int) -> bytes:
    """``n`` bytes of the SGE list starting ``offset`` bytes into it."""
    if len(sges) == 1:  # the common case, one slice
        addr, length, lkey = sges[0]
        if offset + n > length:
            raise AccessError("range", "read past the end of the SGE list")
        return bytes(keys.resolve(lkey, pd, addr + offset, n, 0, remote=False))
    out = bytearray()
    for addr, length, lkey in sges:
        if offset >= length:
            offset -= length
            continue
        take = min(length - offset, n - len(out))
        out += keys.resolve(lkey, pd, addr + offset, take, 0, remote=False)
        offset = 0
        if len(out) == n:
            break
    if len(out) != n:
        raise AccessError("range", "read past the end of the SGE list")
    return bytes(out)


def gather_view(keys: Any, pd: Any, sges: list[tuple[int, int, int]], offset: int,
                n: int) -> memoryview:
    """What :func:`gather` returns for a one-SGE list, as a view of the MR (no copy): the
    zero-copy send path's payload (softrdma.wire.iov), read when the packet leaves."""
    addr, length, lkey = sges[0]
    if offset + n > length:
        raise AccessError("range", "read past the end of the SGE list")
    return keys.resolve(lkey, pd, addr + offset, n, 0, remote=False)


def scatter(keys: Any, pd: Any, sges: list[tuple[int, int, int]], offset: int,
            data: bytes | memoryview, need: int = 1) -> None:
    """Write ``data`` into the SGE list starting ``offset`` bytes into it (LOCAL_WRITE)."""
    n = len(data)
    if not n:
        return
    pos = 0
    for addr, length, lkey in sges:
        if offset >= length:
            offset -= length
            continue
        take = min(length - offset, n - pos)
        keys.resolve(lkey, pd, addr + offset, take, need, remote=False)[:] = data[pos:pos + take]
        pos += take
        offset = 0
        if pos == n:
            return
    raise NoSpace(f"{n - pos} bytes do not fit the receive buffers")
