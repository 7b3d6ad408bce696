"""Whether the program's memory can back a memory region: what ``ib_umem_get`` pins.

On Linux, ``ibv_reg_mr`` asks the kernel to pin the pages of ``[addr, addr + length)``
(``ib_umem_get``, ``pin_user_pages_fast``): an address nothing is mapped at, or a
read-only mapping registered with an access that lets the device write
(``ib_access_writable``: local write, remote write, remote atomic, MW bind), fails with
EFAULT before any MR exists. softrdma does not pin (the soft device reads the program's
bytes in place), so without this check a bad address would only show up later, as a
SIGSEGV of the whole program inside the device's own code, on the first packet that
touches it. :func:`check_range` asks ``/proc/self/maps`` instead.
"""

from __future__ import annotations

import errno
from bisect import bisect_right

from .shim import Errno

__all__ = ["check_range", "WRITABLE_ACCESS", "mappings"]

#: ib_access_writable: the access bits that make the kernel pin for writing (FOLL_WRITE)
WRITABLE_ACCESS = 0x1 | 0x2 | 0x8 | 0x10  # LOCAL_WRITE, REMOTE_WRITE, REMOTE_ATOMIC, MW_BIND

MAPS = "/proc/self/maps"


def mappings(path: str = MAPS) -> list[tuple[int, int, str]]:
    """The process's mappings, ``(start, end, permissions)`` in address order."""
    out = []
    with open(path) as f:
        for line in f:
            span, perms = line.split(None, 2)[:2]
            start, end = span.split("-")
            out.append((int(start, 16), int(end, 16), perms))
    return out


def check_range(addr: int, length: int, access: int, what: str = "ibv_reg_mr") -> None:
    """EFAULT unless every byte of ``[addr, addr + length)`` is mapped readable, and
    writable too when ``access`` has a bit of :data:`WRITABLE_ACCESS`."""
    if length <= 0:
        return
    write = bool(access & WRITABLE_ACCESS)
    maps = mappings()
    starts = [m[0] for m in maps]
    at, end = addr, addr + length
    while at < end:
        i = bisect_right(starts, at) - 1
        if i < 0 or maps[i][1] <= at:
            raise Errno(errno.EFAULT, f"{what}: nothing is mapped at 0x{at:x}")
        perms = maps[i][2]
        if perms[0] != "r" or (write and perms[1] != "w"):
            need = "readable and writable" if write else "readable"
            raise Errno(errno.EFAULT, f"{what}: the memory at 0x{at:x} is not {need} "
                        f"({perms[:3]})")
        at = maps[i][1]
