"""Memory regions and memory windows.

``MR(pd, length, access)`` allocates and registers ``length`` zeroed bytes, like pyverbs;
``MR(pd, access=..., buffer=obj)`` registers any object exposing a contiguous buffer
(bytearray, mmap, array, a numpy array...). Writable access needs a writable buffer.
``mr.buf`` is the address (iova) peers and SGEs use; ``mr.mem`` is a memoryview of the
registered bytes.

    >>> from softrdma.verbs_api import Context, PD, MR, IBV_ACCESS_LOCAL_WRITE
    >>> with Context() as ctx:
    ...     mr = MR(PD(ctx), 64, IBV_ACCESS_LOCAL_WRITE)
    ...     mr.write(b"hello", 5)
    ...     mr.read(5, 0)
    b'hello'

:class:`MR` and :class:`MW` are the API on both backends; each holds its backend's
implementation: :class:`SoftMR`/:class:`SoftMW` here (entries of the soft device's key
table), ``HwMR``/``HwMW`` in :mod:`softrdma.ibverbs.memory`.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Any, Callable

from ..errors import PyverbsRDMAError
from ._check import U32, U64, as_bits, as_flag, as_int, require
from ..qp.memory import MemEntry
from ..qp.mw import unbind
from .base import Sibling
from .enums import ibv_access_flags as A, ibv_mw_type
from .pd import PD

__all__ = ["MR", "MW", "MWBind", "SoftMR", "SoftMW", "check_mr_access"]

# Plain ints, not IntFlags: ``~IntFlag`` only complements the defined bits, so
# ``access & ~MR_ACCESS_BITS`` would let 1 << 40 through.
MR_ACCESS_BITS = int(A.IBV_ACCESS_LOCAL_WRITE | A.IBV_ACCESS_REMOTE_WRITE | A.IBV_ACCESS_REMOTE_READ
                 | A.IBV_ACCESS_REMOTE_ATOMIC | A.IBV_ACCESS_MW_BIND | A.IBV_ACCESS_ZERO_BASED
                 | A.IBV_ACCESS_RELAXED_ORDERING | A.IBV_ACCESS_FLUSH_GLOBAL
                 | A.IBV_ACCESS_FLUSH_PERSISTENT | A.IBV_ACCESS_HUGETLB)
_WRITES = int(A.IBV_ACCESS_LOCAL_WRITE | A.IBV_ACCESS_REMOTE_WRITE | A.IBV_ACCESS_REMOTE_ATOMIC)


def _max_alloc() -> int:
    """The most bytes ``MR(pd, length)`` will try to allocate: the machine's physical
    memory. rxe refuses to pin more than RLIMIT_MEMLOCK (ENOMEM); without pinning, the
    limit that matters here is not to make the process swap itself to death."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return 1 << 40


def check_mr_access(access: Any, what: str, field: str = "access") -> int:
    """ib_check_mr_access: an int with no unknown bit; remote write/atomic need local write.
    Returns the access flags as a plain int."""
    access = as_int(access, what, field, U64, desc="not a set of access flags")
    if access & A.IBV_ACCESS_ON_DEMAND:
        raise PyverbsRDMAError(f"{what}: IBV_ACCESS_ON_DEMAND is not supported by softrdma",
                               errno.EOPNOTSUPP)
    if access & ~MR_ACCESS_BITS:
        raise PyverbsRDMAError(f"{what}: {field} has unknown access flags "
                               f"0x{access & ~MR_ACCESS_BITS:x}", errno.EINVAL)
    if access & (A.IBV_ACCESS_REMOTE_WRITE | A.IBV_ACCESS_REMOTE_ATOMIC) and \
            not access & A.IBV_ACCESS_LOCAL_WRITE:
        raise PyverbsRDMAError(f"{what}: IBV_ACCESS_REMOTE_WRITE and IBV_ACCESS_REMOTE_ATOMIC "
                               f"require IBV_ACCESS_LOCAL_WRITE", errno.EINVAL)
    return access


def persister(buffer: Any, access: int, what: str) -> Callable[[int, int], None] | None:
    """What a persistent FLUSH does to an MR registered with ``access`` over ``buffer``:
    None without IBV_ACCESS_FLUSH_PERSISTENT; else ``persist(offset, length)``.

    rxe registers IBV_ACCESS_FLUSH_PERSISTENT only over persistent-memory (pmem) pages and
    refuses any other memory with EINVAL. A process's memory is never pmem; what can be
    made durable is a mapping, by ``msync``: so softrdma accepts the flag only for an MR
    over an ``mmap.mmap`` and answers a persistent FLUSH with ``mmap.flush`` (msync) of the
    pages it covers. A file's mapping is then as durable as the file system makes an
    msync'ed file; an anonymous mapping is memory and nothing more (docs/verbs.md)."""
    if not access & A.IBV_ACCESS_FLUSH_PERSISTENT:
        return None
    if not isinstance(buffer, mmap.mmap):
        raise PyverbsRDMAError(f"{what}: IBV_ACCESS_FLUSH_PERSISTENT needs memory that can "
                               f"be made persistent (rxe: pmem pages only); softrdma: an "
                               f"MR over an mmap.mmap, which a FLUSH msyncs", errno.EINVAL)

    def persist(offset: int, length: int) -> None:
        start = offset - offset % mmap.PAGESIZE  # msync works on whole pages
        end = min(len(buffer), offset + max(length, 0))
        if end > start:
            buffer.flush(start, end - start)
    return persist


def _as_bytes_view(buffer: Any, access: int, what: str) -> memoryview:
    try:
        mv = memoryview(buffer)
    except TypeError:
        raise PyverbsRDMAError(f"{what}: buffer of type {type(buffer).__name__} does not "
                               f"expose the buffer protocol", errno.EINVAL) from None
    if not mv.c_contiguous:
        # memoryview can only flatten C-contiguous buffers; a Fortran-ordered array is one
        # block of memory too, but must be flattened first (numpy.ravel(a, order="K")).
        raise PyverbsRDMAError(f"{what}: buffer is not C-contiguous" + (
            " (flatten it without copying first, e.g. numpy.ravel(a, order='K'))"
            if mv.contiguous else ""), errno.EINVAL)
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if access & _WRITES and mv.readonly:
        raise PyverbsRDMAError(f"{what}: buffer is read-only but the access flags allow "
                               f"writes", errno.EFAULT)
    return mv


class MR(Sibling):
    """``ibv_mr``: ``lkey``, ``rkey``, ``buf`` (the iova), ``length``, ``access``."""

    _kind = "MR"
    _pool = "mr"

    def __init__(self, pd: Any, length: int = 0, access: int = 0, address: int | None = None,
                 implicit: bool = False, *, buffer: Any = None) -> None:
        """Register ``length`` new zeroed bytes (or ``buffer``) with ``access``; ``address``
        sets the iova (a 64-bit address; by default the device picks one). A length beyond
        the machine's memory is ENOMEM, as rxe answers when it cannot pin the pages."""
        what = "Failed to register MR"
        require(pd, PD, what, "pd")
        pd._check()
        if as_flag(implicit, what, "implicit"):
            raise PyverbsRDMAError(f"{what}: implicit (ODP) MRs are not supported", errno.EOPNOTSUPP)
        # the arguments checked and the memory made before the device lock is taken
        args = pd.context.backend.MR.prepare(length, access, address, buffer, what)
        self._create(pd.context, "MR", pd, *args)
        self.pd = pd
        self._use(pd)

    # pyverbs-compatible accessors
    @property
    def lkey(self) -> int:
        return self.impl.lkey

    @property
    def rkey(self) -> int:
        return self.impl.rkey

    @property
    def buf(self) -> int:
        """The address of the first byte: what SGEs and peers use (pyverbs ``mr.buf``)."""
        return self.impl.iova

    addr = buf

    @property
    def length(self) -> int:
        return self.impl.length

    @property
    def access(self) -> int:
        return self.impl.access

    @property
    def mem(self) -> memoryview:
        """The registered bytes (a writable memoryview when the buffer is writable)."""
        return self.impl.mem

    def read(self, length: int, offset: int = 0) -> bytes:
        self._check()
        length = as_int(length, "MR read", "length", U64)
        offset = as_int(offset, "MR read", "offset", U64)
        if offset < 0 or length < 0 or offset + length > self.length:
            raise PyverbsRDMAError(f"MR read [{offset}, +{length}) is outside the MR of "
                                   f"{self.length} bytes", errno.EINVAL)
        return bytes(self.mem[offset:offset + length])

    def write(self, data: bytes | str, length: int | None = None, offset: int = 0) -> None:
        self._check()
        if isinstance(data, str):
            data = data.encode()
        try:
            data = memoryview(data).cast("B")
        except TypeError:
            raise PyverbsRDMAError(f"MR write: data is a {type(data).__name__}, not bytes or "
                                   f"str", errno.EINVAL) from None
        n = len(data) if length is None else as_int(length, "MR write", "length", U64)
        offset = as_int(offset, "MR write", "offset", U64)
        if offset < 0 or n < 0 or offset + n > self.length or n > len(data):
            raise PyverbsRDMAError(f"MR write [{offset}, +{n}) is outside the MR of "
                                   f"{self.length} bytes", errno.EINVAL)
        self.mem[offset:offset + n] = data[:n]

    def rereg(self, flags: int, pd: Any = None, addr: Any = None, length: int = 0,
              access: int = 0) -> None:
        """ibv_rereg_mr: change the PD (IBV_REREG_MR_CHANGE_PD=2), access (4) or the
        buffer (``addr`` is a buffer object here, 1 = CHANGE_TRANSLATION). The lkey and rkey
        stay (as rxe keeps them), and so does the iova unless the buffer changes."""
        self._check()
        new_pd = self.impl.rereg(flags, pd, addr, length, access)
        if new_pd is not self.pd:
            self._release(self.pd)
            self.pd = new_pd
            self._use(new_pd)

    def adopt_keys(self, lkey: int) -> None:
        """Take over the keys ``lkey`` (= rkey) of an MR of this device deregistered a
        moment ago: for an ``ibv_rereg_mr`` done as a new registration and the old one's
        deregistration (softrdma.exec), which keeps the keys as rxe does. EINVAL if
        another live MR or MW holds them."""
        self._check()
        self.impl.adopt_keys(lkey)

    def close(self) -> None:
        if not self.closed:
            self.impl.check_dereg()
        super().close()

    def _parents(self) -> tuple[Any, ...]:
        return (self.pd,)

    def __repr__(self) -> str:
        if self.closed and not self.impl.readable_closed:
            return "<MR closed>"
        return (f"<MR lkey=0x{self.lkey:x} rkey=0x{self.rkey:x} addr=0x{self.buf:x} "
                f"length={self.length} access=0x{self.access:x}>")


class SoftMR:
    """A soft MR: its entry in the device's key table (``entry``), which the engines
    resolve keys through."""

    extras = frozenset({"entry", "_entry"})
    readable_closed = True  # the entry outlives the MR: its keys still read

    @staticmethod
    def prepare(length: Any, access: Any, address: Any, buffer: Any,
                what: str) -> tuple[memoryview, Any, int, int | None]:
        """ib_check_mr_access and the sizes; the buffer made (zeroed) or viewed."""
        access = check_mr_access(access, what)
        length = as_int(length, what, "length", U64, desc="not a 64-bit length")
        if address is not None:
            address = as_int(address, what, "address", U64, desc="not a 64-bit address")
            if address + max(length, 1) - 1 > U64:
                raise PyverbsRDMAError(f"{what}: address 0x{address:x} + length {length} "
                                       f"wraps past 2^64", errno.EINVAL)
        if buffer is None:
            if length > _max_alloc():
                raise PyverbsRDMAError(f"{what}: length {length} exceeds the machine's memory",
                                       errno.ENOMEM)
            try:
                buffer = bytearray(length)
            except (MemoryError, OverflowError):
                raise PyverbsRDMAError(f"{what}: cannot allocate {length} bytes",
                                       errno.ENOMEM) from None
        mv = _as_bytes_view(buffer, access, what)
        if length and length != len(mv):
            if length > len(mv):
                raise PyverbsRDMAError(f"{what}: length {length} exceeds the buffer's "
                                       f"{len(mv)} bytes", errno.EINVAL)
            mv = mv[:length]
        return mv, buffer, access, address

    def __init__(self, owner: MR, pd: Any, mv: memoryview, buffer: Any, access: int,
                 address: int | None) -> None:
        self.owner = owner
        self.device = pd.device
        self.pd = pd
        self._buffer = buffer  # keep the object alive as long as the MR
        # (the "mr" pool bounds MRs far below the 2^24 key indices)
        persist = persister(buffer, access, "Failed to register a MR")
        self.entry: MemEntry = self.device.keys.register_mr(pd, mv, access, iova=address)
        self.entry.owner = owner
        self.entry.persist = persist

    @property
    def _entry(self) -> MemEntry:  # the name harness/replay.py reads
        return self.entry

    lkey = property(lambda self: self.entry.lkey)
    rkey = property(lambda self: self.entry.rkey)
    iova = property(lambda self: self.entry.iova)
    length = property(lambda self: self.entry.length)
    access = property(lambda self: self.entry.access)

    @property
    def mem(self) -> memoryview:
        assert self.entry.buf is not None
        return self.entry.buf

    def adopt_keys(self, lkey: int) -> None:
        with self.device.lock:
            try:
                self.device.keys.rekey(self.entry, lkey)
            except ValueError:
                raise PyverbsRDMAError(f"Failed to re-register MR: key 0x{lkey:x} is in use",
                                       errno.EINVAL) from None

    def rereg(self, flags: int, pd: Any, addr: Any, length: int, access: int) -> Any:
        what = "Failed to re-register MR"
        flags = as_bits(flags, what, "flags", 7, noun="IBV_REREG_MR_* bits")
        if flags & 1 and addr is None:
            length = as_int(length, what, "length", _max_alloc(), desc="beyond memory")
        with self.device.lock:
            if self.entry.refs:
                raise PyverbsRDMAError(f"{what}: memory windows are bound to it", errno.EBUSY)
            new_pd = pd if flags & 2 else self.pd
            if not isinstance(new_pd, PD):
                raise PyverbsRDMAError(f"{what}: IBV_REREG_MR_CHANGE_PD needs a PD", errno.EINVAL)
            new_pd._check()
            if new_pd.context is not self.owner.context:
                raise PyverbsRDMAError(f"{what}: the PD belongs to another context", errno.EINVAL)
            new_access = access if flags & 4 else self.entry.access
            new_access = check_mr_access(new_access, what)
            mv, buffer = self.entry.buf, self._buffer
            if flags & 1:
                buffer = addr if addr is not None else bytearray(length)
                mv = _as_bytes_view(buffer, new_access, what)
            elif new_access & _WRITES and mv is not None and mv.readonly:
                raise PyverbsRDMAError(f"{what}: buffer is read-only", errno.EFAULT)
            persist = persister(buffer, new_access, what)  # a refusal changes nothing
            self._buffer = buffer
            # rxe (6.2 on: rxe_rereg_user_mr) and hardware keep the keys, and the iova
            # unless the translation changes: a peer holding the rkey keeps its access
            old = self.entry
            keys = self.device.keys
            keys.remove(old)
            self.pd = new_pd
            self.entry = keys.register_mr(new_pd, mv, new_access,
                                          iova=None if flags & 1 else old.iova)
            keys.rekey(self.entry, old.lkey)
            self.entry.owner = self.owner
            self.entry.persist = persist
        return new_pd

    def check_dereg(self) -> None:
        if self.entry.refs:
            # rxe_dereg_mr refuses while windows are bound (-EINVAL in rxe)
            raise PyverbsRDMAError("Failed to dereg MR: memory windows are bound to it",
                                   errno.EINVAL)

    def destroy(self) -> None:
        self.device.keys.remove(self.entry)
        # MR -> impl -> owner -> MR is a cycle: left, it keeps the buffer until the
        # collector runs (a gigabyte READ buffer, issue 26). Nothing reads the owner
        # once the MR is deregistered; its keys stay readable through the entry.
        self.owner = self.entry.owner = None


class MWBind:
    """pyverbs ``MWBind(info, send_flags, wr_id)`` for ``QP.bind_mw`` (type 1 windows)."""

    def __init__(self, info: Any, send_flags: int = 0, wr_id: int = 0) -> None:
        # stored as given; qp.bind_mw checks them (as post_send checks any WR)
        self.bind_info = info
        self.send_flags = send_flags
        self.wr_id = wr_id


class MW(Sibling):
    """``ibv_mw``: a window onto part of an MR, with its own rkey and rights. Type 1 windows
    are bound with ``qp.bind_mw``; type 2 with an IBV_WR_BIND_MW work request; both are
    invalidated with IBV_WR_LOCAL_INV or a remote SEND_WITH_INV (type 2)."""

    _kind = "MW"
    _pool = "mw"

    def __init__(self, pd: Any, mw_type: int = ibv_mw_type.IBV_MW_TYPE_1) -> None:
        what = "Failed to allocate MW"
        require(pd, PD, what, "pd")
        pd._check()
        mw_type = as_int(mw_type, what, "mw_type", U32)
        pd.context.backend.MW.check_create(mw_type, what)
        self._create(pd.context, "MW", pd, mw_type)
        self.pd = pd
        try:
            self.mw_type: Any = ibv_mw_type(mw_type)
        except ValueError:  # (a device may know more types)
            self.mw_type = mw_type
        self._use(pd)

    @property
    def rkey(self) -> int:
        return self.impl.rkey

    @property
    def handle(self) -> int:
        return self.impl.handle

    def _parents(self) -> tuple[Any, ...]:
        return (self.pd,)

    def __repr__(self) -> str:
        return f"<MW type {int(self.mw_type)} rkey=0x{self.rkey:x}{self.impl.describe()}>"


class SoftMW:
    """A soft MW: its entry in the device's key table (``entry``)."""

    extras = frozenset({"entry", "_entry"})

    @staticmethod
    def check_create(mw_type: int, what: str) -> None:
        if mw_type not in (1, 2):
            raise PyverbsRDMAError(f"{what}: mw_type {mw_type} is not 1 or 2", errno.EINVAL)

    def __init__(self, owner: MW, pd: Any, mw_type: int) -> None:
        self.device = pd.device
        self.entry = self.device.keys.alloc_mw(pd, int(mw_type))
        self.entry.owner = owner

    @property
    def _entry(self) -> Any:  # the name harness/replay.py reads
        return self.entry

    rkey = property(lambda self: self.entry.rkey)
    handle = property(lambda self: self.entry.index)

    def destroy(self) -> None:
        unbind(self.entry)
        self.device.keys.remove(self.entry)

    def describe(self) -> str:
        return f" bound={self.entry.valid}"
