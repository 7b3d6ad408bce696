"""Memory keys: the one table of MRs and MWs that every access goes through.

Like rxe (rxe_mr.c, rxe_mw.c), a key is ``index << 8 | key_byte``, and a lookup checks, in
order: the key names a live object, the whole 32-bit key matches, the protection domain
matches, the access rights allow the operation, and ``[iova, iova + length)`` lies inside the
registered range. Only then is a memoryview of exactly that range handed out, so no access
can ever reach bytes outside a registered, permitted range.

Unlike rxe, whose indices are handed out in order (so only the key byte is secret), the
24-bit index is drawn at random among the free ones, and the key byte too: keys are opaque
to peers, so all 32 bits of an rkey are unpredictable to anyone who was not given it (see
docs/security.md). The table stays a dict from index to entry, so a lookup is O(1), and the
low byte keeps its verbs meaning (``ibv_inc_rkey`` on a memory window changes only it).

Addresses are I/O virtual addresses (iova) chosen by the device: page-aligned and unique per
device, starting at a random page-aligned base per device, so a peer cannot guess them
either. Both come from the ``rng`` the table is given: a device made with ``seed=`` draws
the same keys and addresses every time (reproducible captures and replays); without a seed
they come from the operating system's random source.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MemKind", "MemEntry", "KeyTable", "AccessError", "Access"]


class Access:
    """Access needed by an operation (the IBV_ACCESS_* bits). Plain ints, not an IntFlag:
    this is tested on every packet and IntFlag arithmetic costs a Python call per use."""

    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8
    MW_BIND = 16
    FLUSH_GLOBAL = 256
    FLUSH_PERSISTENT = 512
    NONE = 0


class MemKind(enum.Enum):
    MR = "mr"
    MW = "mw"


class AccessError(Exception):
    """A key lookup failed; ``reason`` says which check (for counters and messages)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


KEY_INDEX_MIN = 0x1  # index 0 is never handed out (key 0x000000xx stays invalid)
KEY_INDEX_MAX = 0xFFFFFF
PAGE = 4096
# the random iova base of a device: page-aligned, in [4 GiB, 64 TiB), so ~2^34 choices and
# room above it for any sane amount of registered memory below the 47-bit user-space limit
IOVA_BASE_MIN_PAGE = 1 << 20
IOVA_BASE_MAX_PAGE = 1 << 34


@dataclass(eq=False)
class MemEntry:
    kind: MemKind
    index: int
    key: int  # the low 8 bits of lkey/rkey (``index`` is the high 24)
    pd: Any
    access: int
    iova: int = 0
    length: int = 0
    buf: memoryview | None = None  # MR: the registered bytes (format 'B')
    valid: bool = True
    # MW only
    mw_type: int = 0
    mr: "MemEntry | None" = None  # MR a bound MW points into
    qp: Any = None  # type 2 MW: the QP it was bound through
    refs: int = 0  # MWs bound to this MR
    owner: Any = field(default=None, repr=False)  # the verbs object (MR / MW)
    # MR with IBV_ACCESS_FLUSH_PERSISTENT: ``persist(offset, length)`` makes that part of
    # the buffer as durable as its backing allows (a persistent FLUSH; docs/verbs.md)
    persist: Any = field(default=None, repr=False)

    @property
    def lkey(self) -> int:
        return (self.index << 8) | self.key

    rkey = lkey


class KeyTable:
    """``rng`` draws key indices, key bytes and the iova base: a ``random.Random(seed)`` for
    reproducible devices, a ``random.SystemRandom()`` otherwise."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.entries: dict[int, MemEntry] = {}  # index (key >> 8) -> entry
        self._next_iova = rng.randrange(IOVA_BASE_MIN_PAGE, IOVA_BASE_MAX_PAGE) * PAGE
        self.iova_base = self._next_iova

    def _alloc_index(self, kind: MemKind) -> int:
        """A free 24-bit index, drawn at random. The table holds at most a few hundred
        thousand of 2^24 indices, so a draw is almost always free; a scan from a random
        point settles the (pathological) case of a nearly full table."""
        rng, entries = self.rng, self.entries
        for _ in range(64):
            idx = rng.randrange(KEY_INDEX_MIN, KEY_INDEX_MAX + 1)
            if idx not in entries:
                return idx
        start = rng.randrange(KEY_INDEX_MIN, KEY_INDEX_MAX + 1)
        span = KEY_INDEX_MAX - KEY_INDEX_MIN + 1
        for k in range(span):
            idx = KEY_INDEX_MIN + (start - KEY_INDEX_MIN + k) % span
            if idx not in entries:
                return idx
        raise MemoryError(f"no free {kind.value} index")

    def alloc_iova(self, length: int) -> int:
        base = self._next_iova
        self._next_iova += (max(length, 1) + 2 * PAGE - 1) // PAGE * PAGE  # a guard page between MRs
        return base

    def register_mr(self, pd: Any, buf: memoryview, access: int, iova: int | None = None) -> MemEntry:
        idx = self._alloc_index(MemKind.MR)
        e = MemEntry(MemKind.MR, idx, self.rng.randrange(256), pd, access,
                     iova=self.alloc_iova(len(buf)) if iova is None else iova,
                     length=len(buf), buf=buf)
        self.entries[idx] = e
        return e

    def rekey(self, e: MemEntry, key: int) -> None:
        """Give ``e`` the 32-bit key ``key`` (index and key byte). For replaying captures,
        where a peer's packets name keys chosen by another implementation."""
        idx = key >> 8
        other = self.entries.get(idx)
        if other is not None and other is not e:
            raise ValueError(f"key index 0x{idx:x} is in use")
        self.entries.pop(e.index, None)
        e.index, e.key = idx, key & 0xFF
        self.entries[idx] = e

    def alloc_mw(self, pd: Any, mw_type: int) -> MemEntry:
        idx = self._alloc_index(MemKind.MW)
        e = MemEntry(MemKind.MW, idx, self.rng.randrange(256), pd, 0, mw_type=mw_type, valid=False)
        self.entries[idx] = e
        return e

    def remove(self, e: MemEntry) -> None:
        self.entries.pop(e.index, None)
        e.valid = False

    def holds(self, e: MemEntry) -> bool:
        """``e`` is registered here (not deregistered or deallocated since)."""
        return self.entries.get(e.index) is e

    def get(self, key: int) -> MemEntry | None:
        e = self.entries.get(key >> 8)
        if e is None or e.key != (key & 0xFF):
            return None
        return e

    # -- checks used by the data path -------------------------------------------------
    def resolve(self, key: int, pd: Any, iova: int, length: int, need: int, *, remote: bool,
                qp: Any = None) -> memoryview:
        """Return the bytes ``[iova, iova+length)`` of the MR or MW named by ``key``, or raise
        :class:`AccessError`. ``need`` is the Access bits the operation requires; ``remote``
        selects rkey semantics (MWs allowed; LOCAL_WRITE of the MR not implied)."""
        e = self.entries.get(key >> 8)
        if e is None:
            raise AccessError("no_key", f"key 0x{key:x} names no memory region or window")
        if e.key != (key & 0xFF):
            raise AccessError("stale_key", f"key 0x{key:x} does not match the current key "
                                           f"0x{e.lkey:x}")
        if not e.valid:
            raise AccessError("invalid", f"key 0x{key:x} has been invalidated or is unbound")
        if e.kind is MemKind.MW:
            if not remote:
                raise AccessError("mw_as_lkey", f"key 0x{key:x} is a memory window, not an lkey")
            if e.mw_type == 2 and e.qp is not None and qp is not None and e.qp is not qp:
                raise AccessError("mw_qp", f"type 2 window 0x{key:x} is bound to another QP")
            mr = e.mr
            if mr is None or not mr.valid:
                raise AccessError("invalid", f"window 0x{key:x} is not bound to a valid MR")
            pd_obj = e.pd if e.mw_type == 1 else mr.pd
        else:
            mr = e
            pd_obj = e.pd
        if pd is not None and pd_obj is not pd:
            raise AccessError("pd", f"key 0x{key:x} belongs to another protection domain")
        if need & ~e.access:
            raise AccessError("access", f"key 0x{key:x} does not allow this access "
                                        f"(needs 0x{int(need):x}, has 0x{int(e.access):x})")
        if length == 0:
            return memoryview(b"")
        if iova < e.iova or iova + length > e.iova + e.length or length < 0:
            raise AccessError("range", f"[0x{iova:x}, +{length}) is outside key 0x{key:x} "
                                       f"[0x{e.iova:x}, +{e.length})")
        off = iova - mr.iova
        assert mr.buf is not None
        return mr.buf[off:off + length]
