"""librdmacm's ``rdma_*`` calls: event channels, ids, addresses, connections, events.

This module plays librdmacm (rdma-core 44's ``librdmacm/cma.c``); the kernel it would talk
to through ``/dev/infiniband/rdma_cm`` is softrdma's rdma_cm
(:class:`softrdma.rdmacm.cm_id.RdmaCmId`, :class:`softrdma.rdmacm.channel.EventChannel`).
What librdmacm keeps in user space is kept here, in the program's structures:

* **struct rdma_event_channel** (:class:`Channel`): its ``fd`` is a real descriptor,
  readable exactly while an event waits (a file description of its own onto the channel's
  pipe, so the program's ``fcntl(fd, F_SETFL, O_NONBLOCK)`` is the program's alone:
  ``rdma_get_cm_event`` then fails with EAGAIN instead of blocking, as on Linux).
* **struct rdma_cm_id** (:class:`Id`, librdmacm's ``cma_id_private``): ``verbs``, ``pd``
  and ``port_num`` once the id has a device (``ucma_get_device``: one context per device
  for the process, opened with ``ibv_open_device``, and one PD per device, the ones
  ``rdma_get_devices`` lists too), ``route.addr`` (both addresses, GIDs, P_Key) and
  ``route.path_rec`` refreshed when librdmacm refreshes them (``ucma_query_route`` after
  bind, listen, ADDR_RESOLVED, ROUTE_RESOLVED and for a new connection request).
* **struct rdma_cm_event** (:class:`Event`): allocated by ``rdma_get_cm_event``, freed by
  ``rdma_ack_cm_event``; a CONNECT_REQUEST brings a new id (the listener's context, its
  channel -- or a channel of its own for a synchronous listener).
* **synchronous ids** (created without a channel, ``rdma_create_ep``): every call waits
  for its event on the id's own channel and fails with the event's errno
  (``ucma_complete``), the event kept in ``id->event``.
* **a waiting thread** (rping's CM thread in ``rdma_get_cm_event``) holds no GIL; if
  another thread destroys the channel, it waits on, as a ``read()`` of the closed rdma_cm
  file does on Linux.

The connection calls are :mod:`.cma_conn`'s, the QP ones :mod:`.cma_qp`'s, addresses and
``rdma_getaddrinfo`` :mod:`.cma_addr`'s. The QP of an id is the verbs part's QP the
program posts to, and the very QP softrdma's CM moves through INIT, RTR, RTS and ERR, as
librdmacm does with ``ibv_modify_qp``.

Errors are the errno librdmacm gives (EINVAL for a call the id's state does not allow,
ENODEV for an address no device holds, ...); a pointer that is not one of ours is EINVAL
where librdmacm would crash. ``SOFTRDMA_EXEC_CM_TRACE=1`` prints one line per call and its
outcome on stderr (a tool's own output to a pipe is block-buffered: the trace says when a
server listens).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import sys
import threading
import time
from typing import Any, Callable

from ..cm.cma import gid_from_ip
from ..errors import PyverbsRDMAError
from ..rdmacm.channel import EventChannel
from ..rdmacm.cm_id import RdmaCmId
from ..rdmacm.enums import rdma_cm_event_type as E
from ..rdmacm.events import ConnParams, RdmaCmEvent
from .cma_addr import read_sockaddr, sockaddr_bytes, sockaddr_len, write_sockaddr, \
    SOCKADDR_STORAGE
from .shim import Errno, guard, handles, read_like_libc
from .verbs import ah_attr_to_c

__all__ = ["IMPLEMENTS", "install", "Id", "Channel", "Event", "CmaDev", "id_of",
           "cm_call", "cma_dev", "create_id", "destroy_id", "bind_addr", "resolve_addr",
           "resolve_route", "query_route", "complete", "get_event", "migrate", "conn_param",
           "sync_qp_state", "route_addr", "TRACE"]

IMPLEMENTS = (
    "rdma_create_event_channel", "rdma_destroy_event_channel", "rdma_create_id",
    "rdma_destroy_id", "rdma_bind_addr", "rdma_resolve_addr", "rdma_resolve_route",
    "rdma_get_cm_event", "rdma_ack_cm_event", "rdma_event_str", "rdma_migrate_id",
)


RDMA_PS_IPOIB, RDMA_PS_TCP, RDMA_PS_UDP = 0x0002, 0x0106, 0x0111
IBV_QPT_RC, IBV_QPT_UD = 2, 4
ffi: Any = None
lib: Any = None
#: ``SOFTRDMA_EXEC_CM_TRACE=1``: one line on stderr per rdma_* call and its outcome (what
#: a program did, in order, even when its own output is buffered)
TRACE = bool(os.environ.get("SOFTRDMA_EXEC_CM_TRACE"))


def _trace(name: str, outcome: Any) -> None:
    print(f"softrdma exec: {time.monotonic():.3f} {name} -> {outcome}", file=sys.stderr,
          flush=True)


def cm_call(fail: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """:func:`shim.guard`, with softrdma rdma_cm's errors (the caller's mistakes: a state
    that does not allow the call, an address no device holds) as plain errnos."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            try:
                r = fn(*args)
            except PyverbsRDMAError as e:
                if TRACE:
                    _trace(fn.__name__, f"{errno.errorcode.get(e.error_code)} ({e.msg})")
                raise Errno(e.error_code, e.msg) from None
            except Errno as e:
                if TRACE:
                    _trace(fn.__name__, f"{errno.errorcode.get(e.error_code)} ({e})")
                raise
            if TRACE:
                _trace(fn.__name__, r if isinstance(r, int) else "ok")
            return r
        return guard(fail)(call)
    return wrap


# ---- event channels ----------------------------------------------------------------------

def _own_fd(fd: int) -> int:
    """A new file description of the pipe behind ``fd`` (through /proc): readable when
    ``fd`` is, with file status flags (O_NONBLOCK) of its own."""
    new = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    os.set_blocking(new, True)
    return new


class Channel:
    """``struct rdma_event_channel`` and the softrdma channel behind it."""

    def __init__(self) -> None:
        self.ec = EventChannel()
        self.struct = ffi.new("struct rdma_event_channel *")
        self.fd = _own_fd(self.ec.fd)
        self.struct.fd = self.fd
        self.closed = False
        handles.add("cm_channel", self.struct, self)

    def blocking(self) -> bool:
        """Whether the program left its descriptor blocking (no O_NONBLOCK)."""
        return not fcntl.fcntl(self.fd, fcntl.F_GETFL) & os.O_NONBLOCK

    def close(self) -> None:
        """rdma_destroy_event_channel: the ids still on it go (the kernel's ucma_close)."""
        handles.release("cm_channel", self.struct)
        self.closed = True
        self.ec.close()
        os.close(self.fd)


# ---- devices -----------------------------------------------------------------------------

class CmaDev:
    """librdmacm's ``struct cma_device``: the process's one context on a device (opened
    once, never closed, as librdmacm keeps it) and the PD ids on it share."""

    def __init__(self, name: str, verbs: Any) -> None:
        self.name = name
        self.verbs = verbs
        self.pd = ffi.NULL
        self.refcnt = 0


_devs: dict[str, CmaDev] = {}
_ibv_devices: dict[str, Any] = {}


def _ibv_device(name: str) -> Any:
    """The ``struct ibv_device *`` named ``name`` (the list is kept, as librdmacm keeps
    its ``dev_list``; asked again when a device appeared since)."""
    dev = _ibv_devices.get(name)
    if dev is None:
        lst = lib.ibv_get_device_list(ffi.NULL)
        i = 0
        while lst != ffi.NULL and lst[i] != ffi.NULL:
            _ibv_devices[ffi.string(lst[i].name).decode()] = lst[i]
            i += 1
        dev = _ibv_devices.get(name)
        if dev is None:
            raise Errno(errno.ENODEV, f"no device {name}")
    return dev


#: librdmacm's ``mut``: one context and one PD per device even when two threads find the
#: device at once (rping's CM thread and its main thread)
_devs_lock = threading.Lock()


def cma_dev(name: str) -> CmaDev:
    """``ucma_init_device``: the device's context, opened on first use."""
    with _devs_lock:
        d = _devs.get(name)
        if d is None:
            ctx = lib.ibv_open_device(_ibv_device(name))
            if ctx == ffi.NULL:
                raise Errno(ffi.errno or errno.ENODEV, f"cannot open {name}")
            d = _devs[name] = CmaDev(name, ctx)
        return d


def _get_device(rec: "Id") -> None:
    """``ucma_get_device``: the id's device is known: its context, the device's PD (made
    with the first id) and port in the id."""
    d = cma_dev(rec.cid.device.name)
    with _devs_lock:
        if d.pd == ffi.NULL:
            d.pd = lib.ibv_alloc_pd(d.verbs)
            if d.pd == ffi.NULL:
                raise Errno(ffi.errno or errno.ENOMEM, "cannot allocate the device's PD")
        d.refcnt += 1
    rec.dev = d
    s = rec.struct
    s.verbs, s.pd, s.port_num = d.verbs, d.pd, 1


def _put_device(d: CmaDev) -> None:
    """``ucma_put_device``: the device's PD goes with its last id (if the program freed
    what it made on it: otherwise it stays, as librdmacm ignores the failure)."""
    with _devs_lock:
        d.refcnt -= 1
        if d.refcnt == 0 and d.pd != ffi.NULL:
            if lib.ibv_dealloc_pd(d.pd) == 0:
                d.pd = ffi.NULL


# ---- ids ---------------------------------------------------------------------------------

class Id:
    """``struct rdma_cm_id`` with librdmacm's ``cma_id_private`` and softrdma's rdma_cm id
    (:attr:`cid`, whose ``context`` is this object)."""

    def __init__(self, cid: RdmaCmId, channel: Channel, sync: bool, context: Any, ps: int,
                 qp_type: int) -> None:
        self.cid = cid
        cid.context = self
        self.channel = channel
        self.sync = sync
        self.dev: CmaDev | None = None
        self.event: Event | None = None  # id->event, a synchronous id's last event
        self.family: int | None = None  # of the address the program bound or resolved
        self.dst_family: int | None = None
        self.qp_init_attr: Any = None  # a passive endpoint's, for rdma_get_request
        self.connect = b""  # rdma_addrinfo's ai_connect, sent with the REQ
        self.local_ece = (0, 0)
        self.remote_ece = (0, 0)
        self.qp: Any = None  # the QpRec of the QP the CM moves (rdma_create_qp)
        self.qp_struct: Any = None  # its struct ibv_qp *
        # the route's path record, when the structure is declared (by the misc part)
        self.path = ffi.new("struct ibv_sa_path_rec *") if PATH_REC else None
        s = self.struct = ffi.new("struct rdma_cm_id *")
        s.channel, s.context, s.ps, s.qp_type = channel.struct, context, ps, qp_type
        handles.add("cm_id", s, self)

    def set_event(self, ev: "Event | None") -> None:
        if self.event is not None:
            handles.release("cm_event", self.event.struct)
        self.event = ev
        self.struct.event = ev.struct if ev is not None else ffi.NULL


def id_of(ptr: Any) -> Id:
    """The :class:`Id` of a ``struct rdma_cm_id *`` (EINVAL if it is not one of ours)."""
    return handles.get("cm_id", ptr)


def create_id(channel: Any, context: Any, ps: int, qp_type: int) -> Id:
    """``rdma_create_id2``: a channel of the id's own (synchronous) when ``channel`` is
    NULL."""
    sync = channel == ffi.NULL
    ch = Channel() if sync else handles.get("cm_channel", channel)
    try:
        cid = RdmaCmId(ch.ec, ps, qp_type=qp_type)
    except BaseException:
        if sync:
            ch.close()
        raise
    return Id(cid, ch, sync, context, ps, qp_type)


def destroy_id(rec: Id) -> None:
    """``rdma_destroy_id``: leave the CM as the kernel does, then free what librdmacm
    holds (the id's last event, its device's reference, a synchronous id's channel)."""
    rec.cid.destroy()
    rec.set_event(None)
    if rec.dev is not None:
        _put_device(rec.dev)
        rec.dev = None
    handles.release("cm_id", rec.struct)
    if rec.sync:
        rec.channel.close()


def route_addr(s: Any) -> Any:
    """``id->route.addr`` as a ``char *``: the source address, then the destination at
    :data:`SOCKADDR_STORAGE`."""
    return ffi.cast("char *", ffi.addressof(s.route, "addr"))


def query_route(rec: Id) -> None:
    """``ucma_query_route``: the id's addresses, GIDs and path as the CM knows them now,
    and its device once it has one."""
    cid, s = rec.cid, rec.struct
    if cid.destroyed:
        return
    if rec.dev is None and cid.cdev is not None:
        _get_device(rec)
    base = route_addr(s)
    local = cid.local_ip
    write_sockaddr(base, sockaddr_bytes(local, cid.src_port, rec.family))
    if cid.dst_ip is not None:
        write_sockaddr(base + SOCKADDR_STORAGE,
                       sockaddr_bytes(cid.dst_ip, cid.dst_port, rec.dst_family))
    ib = s.route.addr.addr.ibaddr
    ib.pkey = 0xFFFF
    r = cid.route
    sgid = r.sgid if r is not None else (gid_from_ip(local) if local is not None else None)
    dgid = r.dgid if r is not None else (gid_from_ip(cid.dst_ip) if cid.dst_ip is not None
                                         else None)
    if sgid is not None:
        ffi.memmove(ib.sgid.raw, sgid, 16)
    if dgid is not None:
        ffi.memmove(ib.dgid.raw, dgid, 16)
    if r is not None and rec.path is not None:
        p = rec.path
        ffi.memmove(p.sgid.raw, r.sgid, 16)
        ffi.memmove(p.dgid.raw, r.dgid, 16)
        p.flow_label = int.from_bytes(r.flow_label.to_bytes(4, "big"), "little")
        p.hop_limit, p.traffic_class, p.reversible, p.numb_path = r.hop_limit, \
            r.traffic_class, 1, 1
        p.pkey, p.mtu_selector, p.mtu, p.rate_selector = 0xFFFF, 2, int(r.path_mtu), 2
        p.rate, p.packet_life_time_selector = int(r.rate), 2
        p.packet_life_time = r.packet_life_time
        s.route.path_rec, s.route.num_paths = p, 1


# ---- events ------------------------------------------------------------------------------

class Event:
    """``struct rdma_cm_event`` (librdmacm's ``cma_event``: the event and its private
    data), alive until ``rdma_ack_cm_event``."""

    def __init__(self, ev: RdmaCmEvent, rec: Id, listen: Id | None) -> None:
        self.struct = s = ffi.new("struct rdma_cm_event *")
        self.rec, self.listen = rec, listen  # the ids' records (librdmacm's cma_id_private)
        s.id = rec.struct
        s.listen_id = listen.struct if listen is not None else ffi.NULL
        s.event, s.status = int(ev.event), int(ev.status)
        self.data: Any = None
        if ev.ud is not None or (ev.conn is None and rec.cid.is_ud):
            self._ud(ev)
        else:
            self._conn(ev.conn)

    def _param(self, kind: str) -> Any:
        """``event->param.conn`` or ``.ud`` (the union cffi cannot declare partially: it
        follows ``status``, at its members' pointer alignment)."""
        return ffi.cast(f"struct rdma_{kind}_param *",
                        ffi.cast("char *", self.struct) + PARAM_OFFSET)

    def _private(self, p: Any, data: bytes) -> None:
        data = data[:255]
        if data:
            self.data = ffi.new("uint8_t[]", data)
            p.private_data = self.data
        p.private_data_len = len(data)

    def _conn(self, c: ConnParams | None) -> None:
        if c is None:
            return
        p = self._param("conn")
        self._private(p, c.private_data)
        p.responder_resources, p.initiator_depth = c.responder_resources, c.initiator_depth
        p.flow_control, p.retry_count = c.flow_control, c.retry_count
        p.rnr_retry_count, p.srq, p.qp_num = c.rnr_retry_count, c.srq, c.qp_num

    def _ud(self, ev: RdmaCmEvent) -> None:
        u, d = self._param("ud"), ev.ud
        if d is None:
            return
        self._private(u, d.private_data)
        if d.context is not None and d.context != ffi.NULL:
            u.private_data = d.context  # a multicast join's: the join's context pointer
        u.qp_num, u.qkey = d.qp_num, d.qkey
        if d.ah_attr is not None:
            ah_attr_to_c(d.ah_attr, u.ah_attr)


#: whether ``struct ibv_sa_path_rec`` has its fields (declared by another part)
PATH_REC = False

#: where ``param`` lies in ``struct rdma_cm_event`` (set by :func:`install`)
PARAM_OFFSET = 0


def _process(ev: RdmaCmEvent) -> Event | None:
    """What librdmacm's ``rdma_get_cm_event`` does with the kernel's event: None for an
    event the program never sees (its id is gone; a REJECTED or DISCONNECTED after the
    id's connection failed locally)."""
    cid = ev.id
    if cid.destroyed:
        return None
    t = ev.event
    if t == E.RDMA_CM_EVENT_CONNECT_REQUEST:
        lrec: Id = ev.listen_id.context
        ls = lrec.struct
        rec = Id(cid, lrec.channel, False, ls.context, ls.ps, ls.qp_type)
        if lrec.sync:  # ucma_process_conn_req: rdma_migrate_id(child, NULL)
            migrate(rec, None)
        query_route(rec)
        return Event(ev, rec, lrec)
    rec = cid.context
    if not isinstance(rec, Id):
        return None
    if t in (E.RDMA_CM_EVENT_REJECTED, E.RDMA_CM_EVENT_DISCONNECTED) and cid.connect_error:
        return None
    sync_qp_state(rec)
    if t in (E.RDMA_CM_EVENT_ADDR_RESOLVED, E.RDMA_CM_EVENT_ROUTE_RESOLVED):
        try:
            query_route(rec)
        except Errno as e:
            out = Event(ev, rec, None)
            out.struct.event = int(E.RDMA_CM_EVENT_ADDR_ERROR if t == E.RDMA_CM_EVENT_ADDR_RESOLVED
                                   else E.RDMA_CM_EVENT_ROUTE_ERROR)
            out.struct.status = -e.error_code
            return out
    return Event(ev, rec, None)


def get_event(ch: Channel, block: bool) -> Event:
    """The next event the program sees on ``ch`` (EAGAIN if none waits and it must not
    block), registered for ``rdma_ack_cm_event``."""
    while True:
        try:
            # a channel whose devices have no progress thread is moved by its waiter
            wait = None if block and ch.ec.manual_devices() else 0
            ev = ch.ec.get(wait)
        except OSError as e:
            if ch.closed:
                _wait_for_ever()
            if block and e.errno == errno.ETIMEDOUT:
                _block(ch)
                continue
            code = errno.EAGAIN if e.errno == errno.ETIMEDOUT else e.errno
            raise Errno(code, "rdma_get_cm_event: no event") from None
        out = _process(ev)
        if out is not None:
            handles.add("cm_event", out.struct, out)
            return out


def _block(ch: Channel) -> None:
    """Wait as librdmacm waits, in a ``read()`` of the channel's fd (libc's, without the
    GIL, not retried by Python: a signal handled without SA_RESTART fails
    ``rdma_get_cm_event`` with EINTR, as on Linux; with SA_RESTART the kernel restarts
    it). The byte read is one event's flag: the event it stands for is the next
    ``get`` (which drains the pipe when it takes the last)."""
    n = read_like_libc(ch.fd, 1)
    if n == -errno.EINTR:
        raise Errno(errno.EINTR, "rdma_get_cm_event: interrupted by a signal")
    if n == -errno.EAGAIN:  # the program made it non-blocking meanwhile
        raise Errno(errno.EAGAIN, "rdma_get_cm_event: no event")


def _wait_for_ever() -> None:
    """Another thread destroyed the channel this one waits on: on Linux the waiting read
    holds the file and waits on, for events that never come (rping's CM thread, blocked
    when its main thread ends, must not wake with an error and exit the program with it)."""
    while True:
        time.sleep(3600)


def complete(rec: Id) -> None:
    """``ucma_complete``: a synchronous id waits for the outcome of what it asked, and
    fails with the errno of a failed one (ECONNREFUSED for REJECTED)."""
    if not rec.sync:
        return
    rec.set_event(None)
    ev = get_event(rec.channel, True)
    rec.set_event(ev)
    st = ev.struct.status
    if st:
        code = errno.ECONNREFUSED if ev.struct.event == E.RDMA_CM_EVENT_REJECTED else abs(st)
        raise Errno(code, f"{E(ev.struct.event).name}, status {st}")


def migrate(rec: Id, channel: Any) -> None:
    """``rdma_migrate_id``: the id's events (those waiting too) go to ``channel``; NULL
    makes it synchronous, on a channel of its own."""
    if rec.sync and channel is None:
        raise Errno(errno.EINVAL, "rdma_migrate_id: a synchronous id needs a channel")
    ch = Channel() if channel is None else channel
    old = rec.channel
    ch.ec.adopt(rec.cid)
    if rec.sync:
        rec.set_event(None)
        old.close()
    rec.sync = channel is None
    rec.channel = ch
    rec.struct.channel = ch.struct


def bind_addr(rec: Id, addr: Any) -> None:
    """``rdma_bind_addr``."""
    fam, ip, port = read_sockaddr(addr)
    rec.cid.bind_addr(ip, port)
    rec.family = fam
    query_route(rec)


def resolve_addr(rec: Id, src: Any, dst: Any, timeout_ms: int) -> None:
    """``rdma_resolve_addr`` (a synchronous id waits for ADDR_RESOLVED)."""
    dfam, dip, dport = read_sockaddr(dst)
    sip = None
    if src != ffi.NULL:
        if not sockaddr_len(src):
            raise Errno(errno.EINVAL, "rdma_resolve_addr: src_addr of an unknown family")
        rec.family, sip, _ = read_sockaddr(src)
    rec.dst_family = dfam
    rec.cid.resolve_addr(sip, dip, dport, timeout_ms)
    data = bytes(ffi.buffer(ffi.cast("char *", dst), sockaddr_len(dst)))
    write_sockaddr(route_addr(rec.struct) + SOCKADDR_STORAGE, data)
    complete(rec)


def resolve_route(rec: Id, timeout_ms: int) -> None:
    """``rdma_resolve_route`` (a synchronous id waits for ROUTE_RESOLVED)."""
    rec.cid.resolve_route(timeout_ms)
    complete(rec)


def sync_qp_state(rec: Id) -> None:
    """``qp->state`` as libibverbs keeps it: the CM moved the QP itself (INIT, RTR, RTS
    with the connection, ERR when it ends)."""
    if rec.qp is not None and rec.qp_struct is not None:
        rec.qp_struct.state = int(rec.qp.qp.state)


def conn_param(p: Any) -> ConnParams | None:
    """A ``struct rdma_conn_param *`` (NULL: None)."""
    if p == ffi.NULL:
        return None
    data = b""
    if p.private_data != ffi.NULL and p.private_data_len:
        data = bytes(ffi.buffer(ffi.cast("char *", p.private_data), p.private_data_len))
    return ConnParams(private_data=data, responder_resources=p.responder_resources,
                      initiator_depth=p.initiator_depth, flow_control=p.flow_control,
                      retry_count=p.retry_count, rnr_retry_count=p.rnr_retry_count,
                      srq=p.srq, qp_num=p.qp_num)


# ---- the end of the program ----------------------------------------------------------------

#: how long leaving the CM may hold up the program's exit
EXIT_LEAVE_TIMEOUT = 1.0
_exit_keep: list[Any] = []  # the C exit handler's ctypes thunk, alive until exit
_exit_pid = [0]  # the process whose ids the handler destroys


def _leave_all() -> None:
    """The program ends with ids it never destroyed: leave the CM as the kernel does when
    the rdma_cm file closes with the process (ucma_close: each id destroyed, so an
    established peer gets a DREQ and sees DISCONNECTED now, a pending request a REJ),
    within :data:`EXIT_LEAVE_TIMEOUT` (a device lock held elsewhere never hangs the
    exit). A program killed by a signal leaves nothing, as no code of it runs."""
    if os.getpid() != _exit_pid[0]:
        return  # a forked child's copies are the parent's ids: its file stays open there
    ids = [rec for rec in handles.of_kind("cm_id") if not rec.cid.destroyed]
    if not ids:
        return

    def leave() -> None:
        for rec in ids:
            try:
                rec.cid.destroy()
            except Exception:
                pass
    t = threading.Thread(target=leave, name="softrdma-cm-exit", daemon=True)
    t.start()
    t.join(EXIT_LEAVE_TIMEOUT)


def _at_exit() -> None:
    """Run :func:`_leave_all` when the program exits: Python's atexit in a Python program
    (it finalizes its interpreter), a C exit handler in a C one (nothing finalizes the
    interpreter the library started)."""
    _exit_pid[0] = os.getpid()
    if getattr(sys, "orig_argv", None):
        import atexit
        atexit.register(_leave_all)
        return
    import ctypes

    def handler(_arg: Any) -> None:
        try:
            _leave_all()
        except BaseException:
            pass
    thunk = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(handler)
    _exit_keep.append(thunk)
    ctypes.CDLL(None).__cxa_atexit(thunk, None, None)


def _event_names() -> dict[int, Any]:
    return {int(e): ffi.new("char[]", e.name.encode()) for e in E}


def install(lib_ffi: Any, the_lib: Any) -> None:
    """Define this part's functions."""
    global ffi, lib, PARAM_OFFSET, PATH_REC
    ffi, lib = lib_ffi, the_lib
    try:  # an opaque structure has no size (and asking it for fields would abort)
        PATH_REC = ffi.sizeof("struct ibv_sa_path_rec") > 0
    except ffi.error:
        PATH_REC = False
    PARAM_OFFSET = (ffi.offsetof("struct rdma_cm_event", "status") + 4 + 7) & ~7
    assert PARAM_OFFSET + ffi.sizeof("struct rdma_ud_param") == \
        ffi.sizeof("struct rdma_cm_event"), "struct rdma_cm_event is not as expected"
    names = _event_names()
    unknown = ffi.new("char[]", b"UNKNOWN EVENT")
    _at_exit()
    from . import reaper
    reaper.install()  # the kernel's DREQs for a program that dies connected

    @ffi.def_extern(name="rdma_create_event_channel")
    @cm_call(ffi.NULL)
    def rdma_create_event_channel() -> Any:
        return Channel().struct

    @ffi.def_extern(name="rdma_destroy_event_channel")
    @cm_call(None)
    def rdma_destroy_event_channel(channel: Any) -> None:
        handles.get("cm_channel", channel).close()

    @ffi.def_extern(name="rdma_create_id")
    @cm_call(-1)
    def rdma_create_id(channel: Any, id_out: Any, context: Any, ps: int) -> int:
        if id_out == ffi.NULL:
            raise Errno(errno.EINVAL, "rdma_create_id: id is NULL")
        qp_type = IBV_QPT_UD if ps in (RDMA_PS_IPOIB, RDMA_PS_UDP) else IBV_QPT_RC
        id_out[0] = create_id(channel, context, ps, qp_type).struct
        return 0

    @ffi.def_extern(name="rdma_destroy_id")
    @cm_call(-1)
    def rdma_destroy_id(id: Any) -> int:
        destroy_id(id_of(id))
        return 0

    @ffi.def_extern(name="rdma_bind_addr")
    @cm_call(-1)
    def rdma_bind_addr(id: Any, addr: Any) -> int:
        bind_addr(id_of(id), addr)
        return 0

    @ffi.def_extern(name="rdma_resolve_addr")
    @cm_call(-1)
    def rdma_resolve_addr(id: Any, src: Any, dst: Any, timeout_ms: int) -> int:
        resolve_addr(id_of(id), src, dst, timeout_ms)
        return 0

    @ffi.def_extern(name="rdma_resolve_route")
    @cm_call(-1)
    def rdma_resolve_route(id: Any, timeout_ms: int) -> int:
        resolve_route(id_of(id), timeout_ms)
        return 0

    @ffi.def_extern(name="rdma_get_cm_event")
    @cm_call(-1)
    def rdma_get_cm_event(channel: Any, event: Any) -> int:
        ch = handles.get("cm_channel", channel)
        if event == ffi.NULL:
            raise Errno(errno.EINVAL, "rdma_get_cm_event: event is NULL")
        event[0] = get_event(ch, ch.blocking()).struct
        return 0

    @ffi.def_extern(name="rdma_ack_cm_event")
    @cm_call(-1)
    def rdma_ack_cm_event(event: Any) -> int:
        ev: Event = handles.release("cm_event", event)
        if ev.rec.event is ev:  # a synchronous id's event the program acked itself
            ev.rec.event = None
            ev.rec.struct.event = ffi.NULL
        return 0

    @ffi.def_extern(name="rdma_event_str")
    def rdma_event_str(event: int) -> Any:
        return names.get(event, unknown)

    @ffi.def_extern(name="rdma_migrate_id")
    @cm_call(-1)
    def rdma_migrate_id(id: Any, channel: Any) -> int:
        rec = id_of(id)
        migrate(rec, None if channel == ffi.NULL else handles.get("cm_channel", channel))
        return 0
