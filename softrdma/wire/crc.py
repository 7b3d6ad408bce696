"""CRC-32 for the ICRC: ISA-L's when it is installed, else zlib's.

The ICRC is the IEEE CRC-32 that ``zlib.crc32`` computes (softrdma.wire.icrc). zlib 1.2's
table-driven code runs at about 3.5 GB/s here, so a 4 KiB packet costs 1.1 us of CRC on
each side: the largest single cost of a packet in the send and receive paths. Intel's
ISA-L computes the same function with carry-less multiply (PCLMULQDQ) at 30 GB/s and
more; python-isal (``isal.isal_zlib``, the pycompression project's well-kept binding,
wheels for Linux, macOS and Windows on x86-64 and ARM) exposes it with zlib's signature,
``crc32(data, value=0)``. Measured on the development machine, per call on a memoryview:

=========  ===========  ===========
bytes      zlib.crc32   isal crc32
=========  ===========  ===========
80         0.13 us      0.07 us
1,024      0.42 us      0.08 us
4,112      1.14 us      0.13 us
65,536     23 us        1.6 us
=========  ===========  ===========

The two give the same value for every input (tests/test_crc.py holds them to it), so which
one runs is invisible on the wire. ``SOFTRDMA_CRC=zlib`` forces zlib (for comparisons, and
to test the fallback); without isal, zlib is used silently.
"""

from __future__ import annotations

import os
import zlib
from typing import Callable

__all__ = ["crc32", "CRC_IMPL", "zlib_crc32"]

#: the stdlib's CRC-32, the reference and the fallback
zlib_crc32: Callable[..., int] = zlib.crc32


def _choose() -> tuple[Callable[..., int], str]:
    if os.environ.get("SOFTRDMA_CRC", "").lower() == "zlib":
        return zlib.crc32, "zlib"
    try:
        from isal import isal_zlib
    except ImportError:
        return zlib.crc32, "zlib"
    return isal_zlib.crc32, "isal"


#: ``crc32(data, value=0) -> int``, zlib's signature and result
crc32, CRC_IMPL = _choose()
