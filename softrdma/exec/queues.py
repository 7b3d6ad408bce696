"""Completion queues, completion channels, async events, QPs and SRQs for unmodified
programs, and the data path their ``ops`` slots call.

The data path. verbs.h's ``ibv_post_send``, ``ibv_post_recv``, ``ibv_post_srq_recv``,
``ibv_poll_cq`` and ``ibv_req_notify_cq`` are static inlines calling through
``context->ops``: at ``ibv_open_device`` (hook :data:`softrdma.exec.devices.ON_OPEN`) those
slots get the ``extern "Python"`` callbacks below. ``post_send`` walks the program's WR
chain and SGEs (the SGE addresses are the program's pointers: its MRs' iovas), posts them
to the softrdma QP and on a failure points ``*bad_wr`` at the first WR not posted and
returns the errno; ``poll_cq`` writes ``struct ibv_wc`` entries into the program's array.

Progress. The soft device moves packets on its own (a progress thread per device,
:mod:`softrdma.soft.progress`); the program's thread runs Python only inside a verb, and
gives the GIL back when the verb returns. So a program that busy-polls ``ibv_poll_cq``
makes progress itself (an empty CQ reads the socket on the caller's thread) and lets the
thread run between its calls, and a program blocked in ``read()``/``poll()`` on a channel
fd, or inside ``ibv_get_cq_event``, holds no GIL while the thread delivers.

Channels and async events have **real descriptors** (:class:`EventFd`, an eventfd):
readable exactly while an event is pending, blocking unless the program sets O_NONBLOCK,
in which case ``ibv_get_cq_event``/``ibv_get_async_event`` fail with EAGAIN as
libibverbs' ``read()`` would. They wait in that very ``read()`` (libc's, not Python's,
which retries after EINTR): a signal handled without SA_RESTART ends the wait with EINTR.

Public names for the other parts (the ``ext`` and ``cma`` helpers build on them):

* :func:`create_cq` ``(ctx_ptr, cqe, cq_context, channel_ptr, comp_vector, ctype)`` ->
  the structure (``ctype`` may be ``"struct ibv_cq_ex"``: a structure starting with
  ``struct ibv_cq``), registered as a "cq"; :func:`cq_of` (``struct ibv_cq *`` -> its
  :class:`CqRec`, ``.cq`` the verbs_api CQ);
* :func:`create_qp` ``(pd_ptr, init_attr_ptr)`` -> ``struct ibv_qp *``, and
  :func:`make_qp` with the attributes as Python values and ``ctype`` (``"struct
  ibv_qp_ex"``: starts with ``struct ibv_qp``); :func:`qp_of` -> :class:`QpRec`
  (``.qp`` the verbs_api QP); :func:`modify_qp` / :func:`query_qp` (the C verbs' bodies);
* :func:`srq_of`, :func:`channel_of`; :func:`fill_wcs` / :func:`fill_wc` (``struct
  ibv_wc`` entries from softrdma WCs).
* the records: ``CqRec.poll(n) -> (count, [WC])`` (the soft CQ's poll, progress
  included), ``CqRec.struct``/``.channel``/``.unacked``; ``QpRec.post_send([SendWR])`` and
  ``QpRec.post_recv([RecvWR])`` (raise PyverbsRDMAError with ``bad_wr_index``),
  ``QpRec.struct`` (its ``state`` kept as libibverbs keeps it); ``SrqRec.srq``;
  :class:`EventFd` for any other queue of events a program waits on through a descriptor.

Structures this part declares for cffi (no other part may declare them again):
``ibv_cq``, ``ibv_comp_channel``, ``ibv_wc``, ``ibv_sge``, ``ibv_send_wr``,
``ibv_recv_wr``, ``ibv_qp``, ``ibv_qp_cap``, ``ibv_qp_init_attr``, ``ibv_qp_attr``,
``ibv_srq``, ``ibv_srq_attr``, ``ibv_srq_init_attr``, ``ibv_async_event``, the enums
``ibv_wc_opcode``, ``ibv_qp_state``, ``ibv_qp_type``, ``ibv_mtu``, ``ibv_mig_state`` (cffi
refuses an enum's ``{...}`` twice) and the opaque ``struct ibv_wq``. The data path slots
of ``struct ibv_context_ops`` are declared in devices.py (their callbacks here).
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import threading
import time
from collections import deque
from typing import Any

from ..readiness import BusyPoll, readable
from . import devices, shim
from .shim import Errno, errno_of, guard, handles, read_like_libc
from .verbs import ah_attr_from_c, ah_attr_to_c, ah_of, forget, inline_lkey, \
    pd_of, ptr_of, remember

# the verbs_api record classes the data path builds (bound by install: the launcher imports
# this module for its names only, and should not load the whole stack)
SendWR: Any = None
RecvWR: Any = None
SGE: Any = None

__all__ = ["IMPLEMENTS", "TYPES", "CALLBACKS", "install", "EventFd", "CqRec", "QpRec",
           "create_cq", "cq_of", "create_qp", "make_qp", "qp_of", "modify_qp", "query_qp",
           "srq_of", "channel_of", "fill_wc", "fill_wcs"]

IMPLEMENTS = ("ibv_create_cq", "ibv_destroy_cq", "ibv_resize_cq", "ibv_create_comp_channel",
              "ibv_destroy_comp_channel", "ibv_get_cq_event", "ibv_ack_cq_events",
              "ibv_get_async_event", "ibv_ack_async_event", "ibv_create_qp", "ibv_modify_qp",
              "ibv_query_qp", "ibv_destroy_qp", "ibv_create_srq", "ibv_modify_srq",
              "ibv_query_srq", "ibv_destroy_srq")

#: enums with the constants this part uses (the structs: softrdma.ibverbs.cdecls)
TYPES = """
    enum ibv_wc_opcode { IBV_WC_SEND, ... };
    enum ibv_qp_state { IBV_QPS_RESET, ... };
    enum ibv_qp_type { IBV_QPT_RC = 2, ... };
    enum ibv_mtu { IBV_MTU_256 = 1, ... };
    enum ibv_mig_state { IBV_MIG_MIGRATED, ... };
"""

CALLBACKS = """
    extern "Python" int softrdma_poll_cq(struct ibv_cq *, int, struct ibv_wc *);
    extern "Python" int softrdma_req_notify_cq(struct ibv_cq *, int);
    extern "Python" int softrdma_post_send(struct ibv_qp *, struct ibv_send_wr *,
                                           struct ibv_send_wr **);
    extern "Python" int softrdma_post_recv(struct ibv_qp *, struct ibv_recv_wr *,
                                           struct ibv_recv_wr **);
    extern "Python" int softrdma_post_srq_recv(struct ibv_srq *, struct ibv_recv_wr *,
                                               struct ibv_recv_wr **);
"""

EAGAIN, EBUSY, EINVAL, EOPNOTSUPP = errno.EAGAIN, errno.EBUSY, errno.EINVAL, errno.EOPNOTSUPP

# ibv_qp_attr_mask bits and the other constants of verbs.h used here
_QP_STATE, _QP_AV, _QP_ALT_PATH, _QP_CAP = 1, 1 << 7, 1 << 14, 1 << 19
_WC_WITH_IMM = 2
_WR_SEND_WITH_INV, _WR_BIND_MW = 9, 8
_IMM_OPS = frozenset({1, 3})  # IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND_WITH_IMM
_INLINE_OPS = frozenset({0, 1, 2, 3, 9})  # WRITE, WRITE_WITH_IMM, SEND, SEND_WITH_IMM, _INV
_SEND_INLINE = 8


def _bswap32(v: int) -> int:
    return int.from_bytes(v.to_bytes(4, "little"), "big")


class EventFd:
    """A queue of events with a real descriptor, as libibverbs' channels and async_fd:
    the fd (an eventfd) is readable exactly while an event is pending. It is blocking
    unless the program sets O_NONBLOCK on it, and only this object ever reads it (and only
    after writing it), so no verb blocks where the program did not ask to wait."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_CLOEXEC)
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()
        self._up = False  # the counter is 1 (the fd readable)
        self.closed = False

    def put(self, item: Any) -> None:
        with self._lock:
            if self.closed:
                return
            self._items.append(item)
            # every event writes (an edge for EPOLLET waiters, as each event of a uverbs
            # file is new data); one read clears the counter however high
            os.eventfd_write(self.fd, 1)
            self._up = True

    def get(self) -> Any | None:
        """The oldest event, or None (never blocks)."""
        with self._lock:
            if not self._items:
                return None
            item = self._items.popleft()
            if not self._items:
                self._lower()
            return item

    def _lower(self) -> None:
        """Make the fd unreadable (the queue is empty). Only a readable fd is read: the
        program may have read it itself, or made it non-blocking, and this must never
        block."""
        if self._up:
            self._up = False
            try:
                if select.select([self.fd], [], [], 0)[0]:
                    os.eventfd_read(self.fd)
            except OSError:
                pass

    def drop_where(self, pred: Any) -> int:
        """Forget the events ``pred`` accepts (their object is gone); how many."""
        with self._lock:
            keep = deque(i for i in self._items if not pred(i))
            n = len(self._items) - len(keep)
            self._items = keep
            if not keep:
                self._lower()
            return n

    def nonblocking(self) -> bool:
        return bool(fcntl.fcntl(self.fd, fcntl.F_GETFL) & os.O_NONBLOCK)

    def wake(self) -> None:
        """Make the fd readable with no event (the device stopped): a waiter in
        :meth:`take` wakes and looks at the world again."""
        with self._lock:
            if not self.closed:
                os.eventfd_write(self.fd, 1)
                self._up = True

    def _block(self, what: str) -> None:
        """Wait as libibverbs waits, in a ``read()`` of the fd (libc's, without the GIL,
        not retried by Python): a signal handled without SA_RESTART ends the wait with
        EINTR, with SA_RESTART the kernel restarts it. The read takes the counter: it is
        raised again for the events still queued."""
        n = read_like_libc(self.fd, 8)
        if n == -errno.EINTR:
            raise Errno(errno.EINTR, f"{what}: interrupted by a signal")
        if n < 0:
            return  # made non-blocking or closed meanwhile: the caller's loop says which
        with self._lock:
            self._up = False
            if self._items and not self.closed:
                os.eventfd_write(self.fd, 1)
                self._up = True

    def take(self, what: str, fatal: Any) -> Any:
        """The next event, waiting for it unless the fd is non-blocking (EAGAIN); a
        device that stopped (``fatal()`` true, its waiters woken by :meth:`wake`) fails
        the wait with EIO; a signal handled without SA_RESTART with EINTR."""
        while (item := self.get()) is None:
            if self.closed:
                raise Errno(errno.EBADF, f"{what}: closed")
            if self.nonblocking():
                raise Errno(EAGAIN, f"{what}: no event")
            if fatal():
                raise Errno(errno.EIO, f"{what}: the device stopped")
            self._block(what)
        return item

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                os.close(self.fd)


# ---- the records behind the structures --------------------------------------------------

class ChannelRec:
    """A completion channel: its structure, its events (of :class:`CqRec`), its CQs."""

    __slots__ = ("struct", "events", "cqs", "context")

    def __init__(self, struct: Any, context: Any) -> None:
        self.struct = struct
        self.context = context
        self.events = EventFd()
        self.cqs = 0


class _Notify:
    """What a soft CQ tells of an armed completion (``SoftCQ.channel``): the CQ's
    record goes into its channel's EventFd."""

    __slots__ = ("rec", "channel")

    def __init__(self, rec: "CqRec", channel: ChannelRec) -> None:
        self.rec, self.channel = rec, channel

    @property
    def closed(self) -> bool:
        return self.channel.events.closed

    def notify(self, _cq: Any) -> None:
        self.channel.events.put(self.rec)

    def wake(self) -> None:
        pass


#: SOFTRDMA_EXEC_FAST_POLL=0: every ibv_poll_cq goes through the soft CQ's poll (which takes
#: the device lock to look at the queue even when it is empty)
FAST_POLL = os.environ.get("SOFTRDMA_EXEC_FAST_POLL", "1") != "0"
#: SOFTRDMA_EXEC_POLL_YIELD=0: an empty ibv_poll_cq always answers at once, however long the
#: program has been spinning (a whole CPU for a program that waits by polling)
POLL_YIELD = os.environ.get("SOFTRDMA_EXEC_POLL_YIELD", "1") != "0"
#: the longest an empty ibv_poll_cq past its busy-poll window waits for the device's socket
#: (poll(2) counts in milliseconds): an arrival ends the wait at once, so this only bounds
#: what is not an arrival (a completion of the in-device loopback, a post by another thread
#: of the program); against the about 10 us of CPU an empty call costs, a waiting program
#: uses a few per cent of a CPU
POLL_YIELD_SLICE = 0.001
_NO_WCS: tuple = ()


def empty_first_poll(impl: Any) -> Any:
    """``impl.poll`` (a soft CQ's) for a program that spins on ``ibv_poll_cq``: most of its
    calls find the CQ empty, so one that does makes progress on the caller's thread
    (``device.poll_nowait``: read the socket, which takes the device lock only if nobody
    holds it) and, still empty, answers 0 without the lock -- a completion queued
    meanwhile by the progress thread is there for the next call. Only a CQ with
    completions takes the lock, to pop them (``impl.poll``).

    A program that waits by spinning (librdmacm's mckey spins until its messages come,
    perftest between its iterations) would hold a CPU for as long as it waits: on a real
    NIC that costs nothing else, here it takes the CPU from the device's peers on the same
    machine (another softrdma process, or a VM running kernel rxe). So once the CQ has been
    empty for longer than its busy-poll window (:class:`softrdma.readiness.BusyPoll`,
    derived from how long its recent waits took, as ``softrdma perf`` does), each empty
    call first waits for the device's socket, at most :data:`POLL_YIELD_SLICE` or until the
    device's next timer. A short wait (ib_send_lat's round trip) stays within the window
    and never sleeps."""
    dev = impl.device
    full = impl.poll
    busy = BusyPoll()
    clock = time.perf_counter
    # the current wait: its first empty poll, and the program's post count then (a post
    # since means the program did something else in between: a new wait starts)
    wait: list = [None, -1]

    def poll(n: int) -> tuple[int, Any]:
        if not len(impl) and dev.udp is not None:
            dev.poll_nowait()  # a failed device raises (DeviceFailed: an OSError)
            if not len(impl):
                if POLL_YIELD:
                    now = clock()
                    if wait[0] is None or wait[1] != _posts[0]:
                        busy.settle()
                        wait[0], wait[1] = now, _posts[0]
                    elif now - wait[0] > busy.window():
                        _yield(dev)
                        dev.poll_nowait()
                        if len(impl):
                            return _taken(n)
                    busy.last = now - wait[0]
                return 0, _NO_WCS
        return _taken(n)

    def _taken(n: int) -> tuple[int, Any]:
        wait[0] = None
        return full(n)
    return poll


#: how many times the program posted (any QP, SRQ or extended WR list): a spinning poll's
#: wait ends where the program does something else
_posts = [0]


def note_post() -> None:
    """The program posted work (the extended verbs' ``wr_complete`` calls this too)."""
    _posts[0] += 1


def _yield(dev: Any) -> None:
    """Wait for the device's socket, at most POLL_YIELD_SLICE or until its next timer."""
    timeout = POLL_YIELD_SLICE
    dl = dev.next_deadline()
    if dl is not None:
        timeout = max(0.0, min(timeout, dl - time.monotonic()))
    if timeout:
        readable([dev.udp.fileno()], timeout)


class CqRec:
    """A CQ: ``cq`` (the verbs_api CQ), ``struct`` (what the program holds: a ``struct
    ibv_cq *``), its channel record, the events got and not yet acknowledged."""

    __slots__ = ("cq", "struct", "mem", "channel", "unacked", "poll", "__weakref__")

    def __init__(self, cq: Any, struct: Any, mem: Any, channel: ChannelRec | None) -> None:
        self.cq, self.struct, self.mem, self.channel = cq, struct, mem, channel
        self.unacked = 0
        # the soft CQ's poll: one call per ibv_poll_cq
        self.poll = empty_first_poll(cq.impl) if FAST_POLL else cq.impl.poll


class QpRec:
    """A QP: ``qp`` (the verbs_api QP), ``struct`` (``struct ibv_qp *``), the granted
    SGE limits (checked before the program's SGE arrays are read)."""

    __slots__ = ("qp", "struct", "mem", "max_send_sge", "max_recv_sge", "ud", "post_send",
                 "post_recv", "inline_lkey", "send_depth", "recv_depth")

    def __init__(self, qp: Any, struct: Any, mem: Any) -> None:
        self.qp, self.struct, self.mem = qp, struct, mem
        self.max_send_sge = qp.cap.max_send_sge
        self.max_recv_sge = qp.cap.max_recv_sge
        self.send_depth, self.recv_depth = qp.cap.max_send_wr, qp.cap.max_recv_wr
        self.ud = int(qp.qp_type) == 4
        self.post_send = qp.impl.post_send
        self.post_recv = qp.impl.post_recv
        self.inline_lkey: int | None = None  # (verbs.inline_lkey, on the first inline WR)


class SrqRec:
    __slots__ = ("srq", "struct", "max_sge")

    def __init__(self, srq: Any, struct: Any) -> None:
        self.srq, self.struct = srq, struct
        self.max_sge = srq.max_sge


# by address: the data path's lookups (one dict get per call)
_cqs: dict[int, CqRec] = {}
_qps: dict[int, QpRec] = {}
_srqs: dict[int, SrqRec] = {}


def _addr(ptr: Any) -> int:
    return int(shim.ffi.cast("uintptr_t", ptr))


def cq_of(ptr: Any) -> CqRec:
    """The record of a ``struct ibv_cq *`` softrdma handed out (Errno EINVAL if not)."""
    rec = _cqs.get(_addr(ptr))
    if rec is None:
        raise Errno(EINVAL, "not a CQ of softrdma exec")
    return rec


def live_cq(addr: int) -> CqRec | None:
    """The record of the CQ at ``addr`` if it is still alive (None once destroyed)."""
    return _cqs.get(addr)


def live_qp(addr: int) -> QpRec | None:
    """The record of the QP at ``addr`` if it is still alive (None once destroyed)."""
    return _qps.get(addr)


def qp_of(ptr: Any) -> QpRec:
    rec = _qps.get(_addr(ptr))
    if rec is None:
        raise Errno(EINVAL, "not a QP of softrdma exec")
    return rec


def srq_of(ptr: Any) -> SrqRec:
    rec = _srqs.get(_addr(ptr))
    if rec is None:
        raise Errno(EINVAL, "not an SRQ of softrdma exec")
    return rec


def channel_of(ptr: Any) -> ChannelRec:
    return handles.get("comp_channel", ptr)


# ---- CQs ------------------------------------------------------------------------------------

def create_cq(ctx: Any, cqe: int, cq_context: Any, channel: Any, comp_vector: int,
              ctype: str = "struct ibv_cq") -> Any:
    """ibv_create_cq's body: a CQ in the context, its structure of type ``ctype`` (a
    structure starting with ``struct ibv_cq``) returned, registered as a "cq"."""
    from ..verbs_api import CQ
    ffi = shim.ffi
    c = devices.context_of(ctx)
    ch = channel_of(channel) if channel != ffi.NULL else None
    try:
        cq = CQ(c, cqe, None, None, comp_vector)
    except OSError as e:
        raise errno_of(e) from None
    mem = ffi.new(ctype + " *")
    s = ffi.cast("struct ibv_cq *", mem)
    s.context, s.channel, s.cq_context = ctx, channel, cq_context
    s.handle, s.cqe = id(cq) & 0xFFFFFFFF, cq.cqe
    rec = CqRec(cq, s, mem, ch)
    if ch is not None:
        # the soft CQ tells its channel of an armed completion: ours, with a real fd
        cq.impl.channel = _Notify(rec, ch)
        ch.cqs += 1
        ch.struct.refcnt += 1
    _cqs[_addr(s)] = rec
    remember(cq, s)
    handles.add("cq", s, rec)
    return mem


def destroy_cq(ptr: Any) -> int:
    rec = cq_of(ptr)
    if rec.unacked:
        # libibverbs would wait for the acks for ever; say why instead
        raise Errno(EBUSY, f"ibv_destroy_cq: {rec.unacked} CQ events not acknowledged")
    try:
        rec.cq.close()  # EBUSY while a QP uses it
    except OSError as e:
        raise errno_of(e) from None
    if rec.channel is not None:
        rec.channel.cqs -= 1
        rec.channel.struct.refcnt -= 1
        rec.channel.events.drop_where(lambda r: r is rec)
    del _cqs[_addr(ptr)]
    drop_async_events(rec.cq)
    forget(rec.cq)
    handles.release("cq", ptr)
    return 0


#: struct ibv_wc's fields in the order :func:`fill_wcs` packs them, with their widths
_WC_FIELDS = (("wr_id", "Q"), ("status", "I"), ("opcode", "I"), ("vendor_err", "I"),
              ("byte_len", "I"), ("imm_data", "I"), ("qp_num", "I"), ("src_qp", "I"),
              ("wc_flags", "I"), ("pkey_index", "H"), ("slid", "H"), ("sl", "B"),
              ("dlid_path_bits", "B"))
_wc_struct: Any = None  # a struct.Struct with the header's offsets (made by install)
_WC_SIZE = 0


def _wc_layout(ffi: Any) -> Any:
    """A struct.Struct that writes a whole ``struct ibv_wc`` at once, its padding taken
    from the installed header's offsets (one pack_into per completion, not 13 cffi
    attribute stores)."""
    import struct
    fmt, at = "<", 0
    for name, code in _WC_FIELDS:
        off = ffi.offsetof("struct ibv_wc", name)
        if off < at:
            raise ValueError(f"struct ibv_wc.{name} at {off}: not in header order")
        fmt += "x" * (off - at) + code
        at = off + struct.calcsize("<" + code)
    fmt += "x" * (ffi.sizeof("struct ibv_wc") - at)
    return struct.Struct(fmt)


def fill_wcs(wc: Any, wcs: list) -> None:
    """Write softrdma WCs into the program's ``struct ibv_wc`` array (imm_data in network
    order, as the program reads a __be32)."""
    buf = shim.ffi.buffer(wc, _WC_SIZE * len(wcs))
    pack = _wc_struct.pack_into
    at = 0
    for w in wcs:
        flags = w.wc_flags
        imm = w.imm_data
        if flags & _WC_WITH_IMM:
            imm = _bswap32(imm)
        pack(buf, at, w.wr_id, w.status, w.opcode, w.vendor_err, w.byte_len, imm, w.qp_num,
             w.src_qp, flags, w.pkey_index, w.slid, w.sl, w.dlid_path_bits)
        at += _WC_SIZE


def fill_wc(out: Any, w: Any) -> None:
    """One ``struct ibv_wc`` (a pointer, or an element of an array) from a softrdma WC."""
    ffi = shim.ffi
    fill_wcs(out if ffi.typeof(out).kind == "pointer" else ffi.addressof(out), [w])


# ---- QPs ------------------------------------------------------------------------------------

def make_qp(pd_ptr: Any, qp_type: int, send_cq: Any, recv_cq: Any, srq: Any,
            cap: Any, sq_sig_all: int, qp_context: Any,
            ctype: str = "struct ibv_qp") -> Any:
    """A QP from Python values: the C pointers of its PD, CQs and SRQ (NULL for none),
    ``cap`` a ``struct ibv_qp_cap *`` (updated to what the device granted), the structure
    of type ``ctype`` (starting with ``struct ibv_qp``) returned, registered as a "qp"."""
    from ..verbs_api import QP, QPCap, QPInitAttr
    ffi = shim.ffi
    pd = pd_of(pd_ptr)
    if qp_type not in (2, 3, 4):
        # XRC, raw packet, driver QPs: rxe has none
        raise Errno(EOPNOTSUPP if qp_type in (8, 9, 10, 0xFF) else EINVAL,
                    f"ibv_create_qp: qp_type {qp_type} is not supported (RC, UC, UD)")
    if send_cq == ffi.NULL or recv_cq == ffi.NULL:
        raise Errno(EINVAL, "ibv_create_qp: a send CQ and a receive CQ are required")
    scq, rcq = cq_of(send_cq).cq, cq_of(recv_cq).cq
    s_rec = srq_of(srq) if srq != ffi.NULL else None
    qcap = QPCap(max_send_wr=cap.max_send_wr, max_recv_wr=cap.max_recv_wr,
                 max_send_sge=cap.max_send_sge, max_recv_sge=cap.max_recv_sge,
                 max_inline_data=cap.max_inline_data)
    try:
        qp = QP(pd, QPInitAttr(qp_type=qp_type, scq=scq, rcq=rcq,
                               srq=None if s_rec is None else s_rec.srq, cap=qcap,
                               sq_sig_all=1 if sq_sig_all else 0))
    except OSError as e:
        raise errno_of(e) from None
    g = qp.cap
    cap.max_send_wr, cap.max_recv_wr = g.max_send_wr, g.max_recv_wr
    cap.max_send_sge, cap.max_recv_sge = g.max_send_sge, g.max_recv_sge
    cap.max_inline_data = g.max_inline_data
    mem = ffi.new(ctype + " *")
    s = ffi.cast("struct ibv_qp *", mem)
    s.context, s.qp_context, s.pd = pd_ptr.context, qp_context, pd_ptr
    s.send_cq, s.recv_cq, s.srq = send_cq, recv_cq, srq
    s.handle = s.qp_num = qp.qp_num
    s.state, s.qp_type = 0, qp_type  # IBV_QPS_RESET
    _qps[_addr(s)] = QpRec(qp, s, mem)
    remember(qp, s)
    handles.add("qp", s, _qps[_addr(s)])
    return mem


def create_qp(pd_ptr: Any, attr: Any) -> Any:
    """ibv_create_qp's body: ``struct ibv_qp *`` (``attr->cap`` updated)."""
    if attr == shim.ffi.NULL:
        raise Errno(EINVAL, "ibv_create_qp: init_attr is NULL")
    return shim.ffi.cast("struct ibv_qp *", make_qp(
        pd_ptr, attr.qp_type, attr.send_cq, attr.recv_cq, attr.srq,
        shim.ffi.addressof(attr, "cap"), attr.sq_sig_all, attr.qp_context))


# ibv_qp_attr fields copied as they are, by the mask bit that names them
_PLAIN = ((1, "qp_state"), (2, "cur_qp_state"), (4, "en_sqd_async_notify"),
          (8, "qp_access_flags"), (16, "pkey_index"), (32, "port_num"), (64, "qkey"),
          (256, "path_mtu"), (512, "timeout"), (1024, "retry_cnt"), (2048, "rnr_retry"),
          (4096, "rq_psn"), (8192, "max_rd_atomic"), (32768, "min_rnr_timer"),
          (65536, "sq_psn"), (131072, "max_dest_rd_atomic"), (262144, "path_mig_state"),
          (1048576, "dest_qp_num"), (1 << 25, "rate_limit"))


def modify_qp(ptr: Any, attr: Any, mask: int) -> int:
    """ibv_modify_qp's body (the errno, 0 on success); ``qp->state`` follows, as
    libibverbs keeps it."""
    from ..verbs_api import QPAttr, QPCap
    rec = qp_of(ptr)
    if attr == shim.ffi.NULL:
        raise Errno(EINVAL, "ibv_modify_qp: attr is NULL")
    a = QPAttr()
    for bit, name in _PLAIN:
        if mask & bit:
            setattr(a, name, int(getattr(attr, name)))
    if mask & _QP_AV:
        a.ah_attr = ah_attr_from_c(attr.ah_attr)
    if mask & _QP_ALT_PATH:
        a.alt_ah_attr = ah_attr_from_c(attr.alt_ah_attr)
        a.alt_pkey_index, a.alt_port_num = attr.alt_pkey_index, attr.alt_port_num
        a.alt_timeout = attr.alt_timeout
    if mask & _QP_CAP:
        c = attr.cap
        a.cap = QPCap(c.max_send_wr, c.max_recv_wr, c.max_send_sge, c.max_recv_sge,
                      c.max_inline_data)
    try:
        rec.qp.modify(a, mask)
    except OSError as e:
        raise errno_of(e) from None
    if mask & _QP_STATE:
        rec.struct.state = attr.qp_state
    return 0


def query_qp(ptr: Any, attr: Any, mask: int, init_attr: Any) -> int:
    """ibv_query_qp's body: every attribute (rxe answers them all), the creation
    attributes with the program's own pointers."""
    ffi = shim.ffi
    rec = qp_of(ptr)
    try:
        a, ia = rec.qp.query(mask)
    except OSError as e:
        raise errno_of(e) from None
    if attr != ffi.NULL:
        ffi.memmove(attr, b"\0" * ffi.sizeof("struct ibv_qp_attr"),
                    ffi.sizeof("struct ibv_qp_attr"))
        for _, name in _PLAIN:
            setattr(attr, name, int(getattr(a, name)))
        attr.sq_draining = int(a.sq_draining)
        attr.alt_pkey_index, attr.alt_port_num = a.alt_pkey_index, a.alt_port_num
        attr.alt_timeout = a.alt_timeout
        _cap_to_c(a.cap, attr.cap)
        if a.ah_attr is not None and a.ah_attr.gr is not None:
            ah_attr_to_c(a.ah_attr, attr.ah_attr)
        if a.alt_ah_attr is not None and a.alt_ah_attr.gr is not None:
            ah_attr_to_c(a.alt_ah_attr, attr.alt_ah_attr)
    s = rec.struct
    if init_attr != ffi.NULL:
        init_attr.qp_context, init_attr.send_cq, init_attr.recv_cq = \
            s.qp_context, s.send_cq, s.recv_cq
        init_attr.srq, init_attr.qp_type = s.srq, s.qp_type
        init_attr.sq_sig_all = int(ia.sq_sig_all)
        _cap_to_c(ia.cap, init_attr.cap)
    s.state = int(a.qp_state)
    return 0


def _cap_to_c(cap: Any, out: Any) -> None:
    out.max_send_wr, out.max_recv_wr = cap.max_send_wr, cap.max_recv_wr
    out.max_send_sge, out.max_recv_sge = cap.max_send_sge, cap.max_recv_sge
    out.max_inline_data = cap.max_inline_data


def destroy_qp(ptr: Any) -> int:
    rec = qp_of(ptr)
    try:
        rec.qp.close()
    except OSError as e:
        raise errno_of(e) from None
    del _qps[_addr(ptr)]
    drop_async_events(rec.qp)
    forget(rec.qp)
    handles.release("qp", ptr)
    return 0


# ---- work requests ------------------------------------------------------------------------

def _sges(sg: Any, n: int) -> list:
    if n == 1:  # the common case, without a loop
        e = sg[0]
        return [SGE(e.addr, e.length, e.lkey)]
    out = []
    for j in range(n):
        e = sg[j]
        out.append(SGE(e.addr, e.length, e.lkey))
    return out


def _inline_sges(sg: Any, n: int, rec: "QpRec") -> list:
    """An inline WR's SGEs, read through the PD's inline lkey (their own lkeys are
    ignored, as libibverbs does)."""
    key = rec.inline_lkey
    if key is None:
        key = rec.inline_lkey = inline_lkey(rec.qp.pd)
    return [SGE(e.addr, e.length, key) for e in (sg[j] for j in range(n))]


def _send_wr(w: Any, rec: QpRec) -> Any:
    """One ``struct ibv_send_wr`` as a verbs_api SendWR (the SGE count checked before the
    program's array is read: a count past the QP's limit is EINVAL, as rxe says)."""
    n = w.num_sge
    if n < 0 or n > rec.max_send_sge:
        raise Errno(EINVAL, f"ibv_post_send: num_sge {n} exceeds max_send_sge "
                            f"{rec.max_send_sge}")
    op = w.opcode
    imm = w.imm_data
    if op in _IMM_OPS:
        imm = _bswap32(imm)  # __be32 in the program's memory
    elif op == _WR_BIND_MW:  # a type 2 window's bind (softrdma.exec.extended)
        from .extended import send_wr_of_bind
        b = w.bind_mw
        return send_wr_of_bind(b.mw, b.rkey, b.bind_info, w.wr_id, w.send_flags)
    flags = w.send_flags
    if not n:
        sges: Any = ()
    elif flags & _SEND_INLINE and op in _INLINE_OPS:
        sges = _inline_sges(w.sg_list, n, rec)
    else:
        sges = _sges(w.sg_list, n)
    wr = SendWR(w.wr_id, op, n, imm, sges, flags)
    u = w.wr
    if rec.ud:
        wr.ah = ah_of(u.ud.ah)
        wr.remote_qpn, wr.remote_qkey = u.ud.remote_qpn, u.ud.remote_qkey
    elif op >= 5 and op <= 6:  # atomics: their own member of the union
        a = u.atomic
        wr.remote_addr, wr.rkey, wr.compare_add, wr.swap = a.remote_addr, a.rkey, \
            a.compare_add, a.swap
    else:
        wr.remote_addr, wr.rkey = u.rdma.remote_addr, u.rdma.rkey
    return wr


def _recv_wr(w: Any, max_sge: int) -> Any:
    n = w.num_sge
    if n < 0 or n > max_sge:
        raise Errno(EINVAL, f"post_recv: num_sge {n} exceeds the queue's max_sge {max_sge}")
    return RecvWR(w.wr_id, n, _sges(w.sg_list, n) if n else ())


def _post(wr: Any, bad_wr: Any, convert: Any, arg: Any, post: Any, depth: int) -> int:
    """Convert the chain until a WR fails, post what came before it; on a failure
    ``*bad_wr`` is the first WR not posted and the errno is returned. A chain longer
    than the queue (``depth``; a cycle, say) stops there: that WR is ENOMEM, the queue
    being full, as it would be once the earlier ones are in."""
    _posts[0] += 1
    if wr and not wr.next:  # one WR, the common case: no lists to walk
        try:
            post([convert(wr, arg)])
        except OSError as e:
            if bad_wr:
                bad_wr[0] = wr
            return getattr(e, "error_code", None) or e.errno or EINVAL
        return 0
    wrs, ptrs = [], []
    failed = None
    w = wr
    while w:
        if len(wrs) > depth:
            failed = (errno.ENOMEM, w)
            break
        try:
            wrs.append(convert(w, arg))
        except Errno as e:
            failed = (e.error_code, w)
            break
        ptrs.append(w)
        w = w.next
    if wrs:
        try:
            post(wrs)
        except OSError as e:
            if bad_wr:
                bad_wr[0] = ptrs[getattr(e, "bad_wr_index", 0)]
            return getattr(e, "error_code", None) or e.errno or EINVAL
    if failed is not None:
        if bad_wr:
            bad_wr[0] = failed[1]
        return failed[0]
    return 0


# ---- SRQs ------------------------------------------------------------------------------------

def _srq_attr_to_c(a: Any, out: Any) -> None:
    out.max_wr, out.max_sge, out.srq_limit = a.max_wr, a.max_sge, a.srq_limit


# ---- async events ------------------------------------------------------------------------------

_async: dict[int, tuple[EventFd, Any]] = {}  # context address -> (its events, listeners)


def _on_open(ctx: Any, c: Any) -> None:
    """ibv_open_device made ``ctx``: its data path slots, its async_fd."""
    lib = _lib
    for slot, fn in (("poll_cq", lib.softrdma_poll_cq),
                     ("req_notify_cq", lib.softrdma_req_notify_cq),
                     ("post_send", lib.softrdma_post_send),
                     ("post_recv", lib.softrdma_post_recv),
                     ("post_srq_recv", lib.softrdma_post_srq_recv)):
        devices.set_op(ctx, slot, fn)
    events = EventFd()

    def listener(ev: Any) -> None:
        # as uverbs: a QP's, CQ's or SRQ's event to the context owning it; port and
        # device events to every context
        owner = getattr(ev.element, "context", None)
        if owner is None or owner is c:
            events.put(ev)

    def stopped(_exc: BaseException) -> None:
        # the device failed: every waiter of this context wakes (EIO), as uverbs wakes
        # the readers of its event files when a device goes
        events.wake()
        for ch in handles.of_kind("comp_channel"):
            if ch.context is c:
                ch.events.wake()

    dev = c.device
    with dev.lock:
        dev.async_listeners.append(listener)
        dev.fatal_listeners.append(stopped)
    _async[_addr(ctx)] = (events, (listener, stopped))
    ctx.async_fd = events.fd


def drop_async_events(obj: Any) -> None:
    """``obj`` (a QP, CQ or SRQ) is destroyed: its pending async events go with it, as
    uverbs discards an object's events when it is destroyed -- a program reads
    ``event.element.qp->qp_num`` (UCX does), never a NULL or freed structure."""
    for events, _ in list(_async.values()):
        events.drop_where(lambda ev: ev.element is obj)


def _on_close(ctx: Any, c: Any) -> None:
    entry = _async.pop(_addr(ctx), None)
    if entry is None:
        return
    events, (listener, stopped) = entry
    dev = c.device
    with dev.lock:
        if listener in dev.async_listeners:
            dev.async_listeners.remove(listener)
        if stopped in dev.fatal_listeners:
            dev.fatal_listeners.remove(stopped)
    events.close()


_lib: Any = None


def install(ffi: Any, lib: Any) -> None:
    """Define this part's functions and hook the context's creation."""
    global _lib, SendWR, RecvWR, SGE, _wc_struct, _WC_SIZE
    _lib = lib
    _wc_struct = _wc_layout(ffi)
    _WC_SIZE = ffi.sizeof("struct ibv_wc")
    from ..verbs_api import SRQ, SGE, RecvWR, SendWR, SrqAttr, SrqInitAttr
    devices.ON_OPEN.append(_on_open)
    devices.ON_CLOSE.append(_on_close)
    NULL = ffi.NULL

    # ---- CQs and channels ----------------------------------------------------------------
    @ffi.def_extern(name="ibv_create_cq")
    @guard(NULL)
    def ibv_create_cq(ctx: Any, cqe: int, cq_context: Any, channel: Any, vec: int) -> Any:
        return ffi.cast("struct ibv_cq *", create_cq(ctx, cqe, cq_context, channel, vec))

    @ffi.def_extern(name="ibv_destroy_cq")
    @guard("errno")
    def ibv_destroy_cq(cq: Any) -> int:
        return destroy_cq(cq)

    @ffi.def_extern(name="ibv_resize_cq")
    @guard("errno")
    def ibv_resize_cq(cq: Any, cqe: int) -> int:
        rec = cq_of(cq)
        try:
            rec.cq.resize(cqe)
        except OSError as e:
            raise errno_of(e) from None
        rec.struct.cqe = rec.cq.cqe
        return 0

    @ffi.def_extern(name="ibv_create_comp_channel")
    @guard(NULL)
    def ibv_create_comp_channel(ctx: Any) -> Any:
        c = devices.context_of(ctx)
        s = ffi.new("struct ibv_comp_channel *")
        rec = ChannelRec(s, c)
        s.context, s.fd, s.refcnt = ctx, rec.events.fd, 0
        return handles.add("comp_channel", s, rec)

    @ffi.def_extern(name="ibv_destroy_comp_channel")
    @guard("errno")
    def ibv_destroy_comp_channel(ch: Any) -> int:
        rec = channel_of(ch)
        if rec.cqs:
            raise Errno(EBUSY, "ibv_destroy_comp_channel: CQs still use it")
        handles.release("comp_channel", ch)
        rec.events.close()
        return 0

    @ffi.def_extern(name="ibv_get_cq_event")
    @guard(-1)
    def ibv_get_cq_event(ch: Any, cq_out: Any, ctx_out: Any) -> int:
        rec = channel_of(ch)
        dev = rec.context.device
        cq = rec.events.take("ibv_get_cq_event", lambda: dev.fatal is not None)
        cq.unacked += 1
        cq_out[0] = cq.struct
        ctx_out[0] = cq.struct.cq_context
        return 0

    @ffi.def_extern(name="ibv_ack_cq_events")
    @guard(None)
    def ibv_ack_cq_events(cq: Any, n: int) -> None:
        rec = cq_of(cq)
        n = min(n, rec.unacked)
        rec.unacked -= n
        rec.struct.comp_events_completed += n

    @ffi.def_extern(name="softrdma_req_notify_cq")
    @guard("errno")
    def req_notify_cq(cq: Any, solicited_only: int) -> int:
        rec = cq_of(cq)
        try:
            rec.cq.req_notify(bool(solicited_only))
        except OSError as e:
            raise errno_of(e) from None
        return 0

    @ffi.def_extern(name="softrdma_poll_cq")
    @guard(-1)
    def poll_cq(cq: Any, n: int, wc: Any) -> int:
        rec = _cqs.get(int(ffi.cast("uintptr_t", cq)))
        if rec is None:
            raise Errno(EINVAL, "ibv_poll_cq: not a CQ of softrdma exec")
        if n <= 0:
            return 0
        try:
            got, wcs = rec.poll(n)
        except OSError as e:
            raise errno_of(e) from None
        if got:
            fill_wcs(wc, wcs)
        return got

    # ---- async events ----------------------------------------------------------------------
    @ffi.def_extern(name="ibv_get_async_event")
    @guard(-1)
    def ibv_get_async_event(ctx: Any, out: Any) -> int:
        c = devices.context_of(ctx)
        events, _ = _async[_addr(ctx)]
        while True:
            ev = events.take("ibv_get_async_event", lambda: False)
            el = ev.element
            if isinstance(el, int):
                out.element.port_num = el
                break
            kind = type(el).__name__
            if kind not in ("QP", "CQ", "SRQ"):
                out.element.port_num = 0
                break
            p = ptr_of(el)
            if p == NULL:  # raised as its object was being destroyed: gone with it
                continue
            setattr(out.element, kind.lower(), p)
            break
        out.event_type = int(ev.event_type)
        del c
        return 0

    @ffi.def_extern(name="ibv_ack_async_event")
    @guard(None)
    def ibv_ack_async_event(event: Any) -> None:
        pass  # nothing waits for the acks: destroying an object never blocks here

    # ibv_wc_status_str / ibv_event_type_str: softrdma.exec.misc (enum_strs.c's tables)

    # ---- QPs ----------------------------------------------------------------------------------
    @ffi.def_extern(name="ibv_create_qp")
    @guard(NULL)
    def ibv_create_qp(pd: Any, attr: Any) -> Any:
        return create_qp(pd, attr)

    @ffi.def_extern(name="ibv_modify_qp")
    @guard("errno")
    def ibv_modify_qp(qp: Any, attr: Any, mask: int) -> int:
        return modify_qp(qp, attr, mask)

    @ffi.def_extern(name="ibv_query_qp")
    @guard("errno")
    def ibv_query_qp(qp: Any, attr: Any, mask: int, init_attr: Any) -> int:
        return query_qp(qp, attr, mask, init_attr)

    @ffi.def_extern(name="ibv_destroy_qp")
    @guard("errno")
    def ibv_destroy_qp(qp: Any) -> int:
        return destroy_qp(qp)

    @ffi.def_extern(name="softrdma_post_send")
    @guard("errno")
    def post_send(qp: Any, wr: Any, bad_wr: Any) -> int:
        rec = _qps.get(int(ffi.cast("uintptr_t", qp)))
        if rec is None:
            raise Errno(EINVAL, "ibv_post_send: not a QP of softrdma exec")
        return _post(wr, bad_wr, _send_wr, rec, rec.post_send, rec.send_depth)

    @ffi.def_extern(name="softrdma_post_recv")
    @guard("errno")
    def post_recv(qp: Any, wr: Any, bad_wr: Any) -> int:
        rec = _qps.get(int(ffi.cast("uintptr_t", qp)))
        if rec is None:
            raise Errno(EINVAL, "ibv_post_recv: not a QP of softrdma exec")
        # (a QP with an SRQ has max_recv_sge 0: its receives go to the SRQ)
        return _post(wr, bad_wr, _recv_wr, rec.max_recv_sge, rec.post_recv, rec.recv_depth)

    # ---- SRQs ----------------------------------------------------------------------------------
    @ffi.def_extern(name="ibv_create_srq")
    @guard(NULL)
    def ibv_create_srq(pd_ptr: Any, init: Any) -> Any:
        pd = pd_of(pd_ptr)
        if init == NULL:
            raise Errno(EINVAL, "ibv_create_srq: init_attr is NULL")
        a = init.attr
        try:
            srq = SRQ(pd, SrqInitAttr(SrqAttr(a.max_wr, a.max_sge, a.srq_limit)))
        except OSError as e:
            raise errno_of(e) from None
        q = srq.query()
        a.max_wr, a.max_sge = q.max_wr, q.max_sge  # what the device granted
        s = ffi.new("struct ibv_srq *")
        s.context, s.srq_context, s.pd = pd_ptr.context, init.srq_context, pd_ptr
        s.handle = id(srq) & 0xFFFFFFFF
        rec = SrqRec(srq, s)
        _srqs[_addr(s)] = rec
        remember(srq, s)
        return handles.add("srq", s, rec)

    @ffi.def_extern(name="ibv_modify_srq")
    @guard("errno")
    def ibv_modify_srq(srq: Any, attr: Any, mask: int) -> int:
        rec = srq_of(srq)
        try:
            rec.srq.modify(SrqAttr(attr.max_wr, attr.max_sge, attr.srq_limit), mask)
        except OSError as e:
            raise errno_of(e) from None
        return 0

    @ffi.def_extern(name="ibv_query_srq")
    @guard("errno")
    def ibv_query_srq(srq: Any, attr: Any) -> int:
        rec = srq_of(srq)
        try:
            _srq_attr_to_c(rec.srq.query(), attr)
        except OSError as e:
            raise errno_of(e) from None
        return 0

    @ffi.def_extern(name="ibv_destroy_srq")
    @guard("errno")
    def ibv_destroy_srq(srq: Any) -> int:
        rec = srq_of(srq)
        try:
            rec.srq.close()  # EBUSY while a QP uses it
        except OSError as e:
            raise errno_of(e) from None
        del _srqs[_addr(srq)]
        drop_async_events(rec.srq)
        forget(rec.srq)
        handles.release("srq", srq)
        return 0

    @guard("errno")
    def cq_at_close(cq: Any) -> int:
        cq_of(cq).unacked = 0  # closing the context does not wait for the acks
        return destroy_cq(cq)

    shim.destroyers.update(qp=ibv_destroy_qp, srq=ibv_destroy_srq, cq=cq_at_close,
                           comp_channel=ibv_destroy_comp_channel)

    @ffi.def_extern(name="softrdma_post_srq_recv")
    @guard("errno")
    def post_srq_recv(srq: Any, wr: Any, bad_wr: Any) -> int:
        rec = _srqs.get(int(ffi.cast("uintptr_t", srq)))
        if rec is None:
            raise Errno(EINVAL, "ibv_post_srq_recv: not an SRQ of softrdma exec")
        return _post(wr, bad_wr, _recv_wr, rec.max_sge, rec.srq.post_recv, rec.srq.max_wr)
