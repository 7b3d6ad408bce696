"""Devices and contexts: ``get_device_list``, ``Context`` and its queries, async events.

The embedded default is one soft device, ``softrdma0``, alive like an rxe device: the
first :class:`Context` binds it to UDP 4791 on the first free loopback address (127.0.0.1,
or 127.0.0.2 when another softrdma process has that one, and so on; its GID table says
which) and starts its progress thread, so packets move and timers fire with no call beyond
the verbs. Settings (environment):

* ``SOFTRDMA_IP=addr`` pins the default device's address (no moving on);
* ``SOFTRDMA_PROGRESS=manual`` makes it a manual device: nothing moves until the program
  calls ``get_soft_device().progress()`` (in-memory loopback, virtual time), for
  deterministic tests and step-by-step lessons.

Real devices: when libibverbs finds RDMA devices (kernel rxe's ``rxe0``, a NIC),
:func:`get_device_list` lists them after the soft ones and ``Context(name="rxe0")`` opens
one through :mod:`softrdma.ibverbs`; every object made from that context is the same
verbs_api class running on the device. ``SOFTRDMA_BACKEND=soft|ibverbs|auto`` (or
:func:`set_backend`) forces one backend: ``soft`` never loads libibverbs; ``ibverbs``
lists and opens only libibverbs devices (``Context()`` is the first of them); ``auto``
(the default) opens soft names first, then libibverbs names, and ``Context()`` is the
soft default device. A machine without libibverbs or devices sees only soft devices.

**Names.** A soft device has two spellings, accepted wherever a device is named (here, by
every tool's ``-d``, by ``softrdma devinfo -d``): ``softrdma0``, the default device, and
``softrdma-<IP>``, the device on address IP (:func:`device_name_for`). ``Context(name=
"softrdma-127.0.0.5")`` opens the device of this process on that address, or makes one
there (a live device, pinned to the address) when there is none.

More devices can be made for other addresses with :func:`add_device`::

    from softrdma.verbs_api import Context, add_device
    add_device("127.0.0.2", name="softrdma1")
    with Context(name="softrdma1") as ctx:
        print(ctx.query_port(1).active_mtu)        # 5 (IBV_MTU_4096) on loopback
"""

from __future__ import annotations

import errno
import ipaddress
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import PyverbsRDMAError
from ..soft.device import SoftDevice
from ..soft.udp import TransportError
from .ah import AH, SoftAH
from .attr import GID
from .base import Backend, ContextBase, Delegating
from .cq import CQ, CompChannel, SoftCompChannel, SoftCQ
from .events import EventQueue
from .mr import MR, MW, SoftMR, SoftMW
from .pd import PD, SoftPD
from .qp import QP
from .soft_qp import SoftQP
from .srq import SRQ, SoftSRQ
from .enums import (
    ibv_atomic_cap, ibv_device_cap_flags_ex, ibv_gid_type, ibv_link_layer, ibv_node_type,
    ibv_port_state, ibv_transport_type,
)

__all__ = ["Device", "Context", "DeviceAttr", "PortAttr", "AsyncEvent", "get_device_list",
           "add_device", "remove_device", "get_soft_device", "soft_devices", "set_backend",
           "get_backend", "SoftContext", "RXE_DEVICE_CAP_FLAGS_EX", "DEFAULT_NAME",
           "NAME_RULE", "device_name_for", "address_of_name"]

BACKENDS = ("auto", "soft", "ibverbs")
_backend: str | None = None  # set_backend's choice; None: SOFTRDMA_BACKEND, else auto


def set_backend(name: str | None) -> None:
    """Force the backend of :class:`Context` and :func:`get_device_list`: ``"soft"`` (only
    soft devices; libibverbs is never loaded), ``"ibverbs"`` (only libibverbs devices),
    ``"auto"`` (both; soft names first), or None to follow ``SOFTRDMA_BACKEND`` again.
    Objects already made keep their backend."""
    global _backend
    if name is not None and name not in BACKENDS:
        raise PyverbsRDMAError(f"set_backend: {name!r} is not one of {', '.join(BACKENDS)}",
                               errno.EINVAL)
    _backend = name


def get_backend() -> str:
    """The backend in force: :func:`set_backend`'s, else ``SOFTRDMA_BACKEND``, else auto."""
    if _backend is not None:
        return _backend
    b = os.environ.get("SOFTRDMA_BACKEND", "").strip().lower() or "auto"
    if b not in BACKENDS:
        raise PyverbsRDMAError(f"SOFTRDMA_BACKEND={b!r}: expected one of {', '.join(BACKENDS)}",
                               errno.EINVAL)
    return b


def _hw_devices() -> list[Any]:
    from ..ibverbs import devices  # only here: the soft backend never imports it
    return devices.list_devices()


def _is_soft_name(name: str) -> bool:
    if address_of_name(name) is not None:
        return True
    with _registry_lock:
        return name in _registry or name == DEFAULT_NAME

_registry: dict[str, SoftDevice] = {}
_registry_lock = threading.Lock()

#: the embedded default device (in a tool: the device the tool picks when given no -d)
DEFAULT_NAME = "softrdma0"
#: the spelling of a device named after its address
ADDRESS_PREFIX = "softrdma-"
#: the naming rule in a few words, for the messages that refuse a name
NAME_RULE = "softrdma0 (the default device) or softrdma-<IP> (the device on address IP)"


def device_name_for(ip: str) -> str:
    """``softrdma-<IP>``: the name of the soft device on address ``ip``, the address spelled
    as Python's ``ipaddress`` spells it (``softrdma-::1``, ``softrdma-127.0.0.2``)."""
    return ADDRESS_PREFIX + str(ipaddress.ip_address(ip))


def address_of_name(name: str) -> str | None:
    """The address a ``softrdma-<IP>`` name stands for (normalised), or None when ``name``
    is not spelled that way (``softrdma0``, ``rxe0``, ``softrdma-foo``)."""
    if not name.startswith(ADDRESS_PREFIX):
        return None
    try:
        return str(ipaddress.ip_address(name[len(ADDRESS_PREFIX):]))
    except ValueError:
        return None


def _progress_mode() -> str:
    mode = os.environ.get("SOFTRDMA_PROGRESS", "thread").strip().lower()
    if mode not in ("thread", "manual"):
        raise PyverbsRDMAError(f"SOFTRDMA_PROGRESS={mode!r}: expected 'thread' or 'manual'",
                               errno.EINVAL)
    return mode


def _ensure_default() -> None:
    if not _registry:
        pinned = os.environ.get("SOFTRDMA_IP")
        mode = _progress_mode()
        # a forked child's default device starts at the pinned address but moves on if
        # it is taken: the parent, still alive, holds it (softrdma exec -- a forking program)
        _registry[DEFAULT_NAME] = SoftDevice(DEFAULT_NAME, _child_start(pinned or "127.0.0.1"),
                                             live=mode == "thread",
                                             auto_address=not pinned or _forked)


def _child_start(ip: str) -> str:
    """Where a default device starts looking for a free address: past the addresses of
    its ancestors' default devices in a forked child. Those stay theirs even while no
    context of theirs is open (on Linux the address is the netdev's and every process
    shares it): rdma-core's rdma_cm tests open and close the device in the parent, then
    fork two sides that bind and connect to its address, and a side that took the freed
    address would hold that address itself and connect to itself."""
    if not _forked:
        return ip
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if not (addr.is_loopback and addr.version == 4):
        return ip
    while str(addr) in _ancestors_ips and str(addr) != "127.255.255.255":
        addr += 1
    return str(addr)


_made: dict[str, dict[str, Any]] = {}  # name -> how add_device made it (for forks)
_forked = False  # this process is a forked child (of a process that had softrdma)
_ancestors_ips: set[str] = set()  # the default devices' addresses of the parents (forks)


def _after_fork_in_child() -> None:
    """A forked child gets fresh devices, as a process gets its own verbs objects: the
    parent's device state (its QPs, its UDP socket, its progress thread, which did not
    survive the fork) stays the parent's. The child's copies of the parent's sockets are
    closed; each device is made again as it was made, and goes live (on the next free
    loopback address for the default one) when the child opens it."""
    global _registry_lock, _forked
    _registry_lock = threading.Lock()
    _forked = True
    old = dict(_registry)
    _registry.clear()
    if DEFAULT_NAME in old:
        _ancestors_ips.add(old[DEFAULT_NAME].ip)
    for name, dev in old.items():
        udp = getattr(dev, "udp", None)
        if udp is not None:
            for s in [udp.sock, getattr(udp, "raw", None), getattr(udp, "_sel", None),
                      *getattr(udp, "tx", {}).values()]:
                try:
                    if s is not None:
                        s.close()
                except OSError:
                    pass
        if name == DEFAULT_NAME:
            continue  # made again on first use, as in a new process
        how = _made.get(name)
        if how is not None:
            _registry[name] = SoftDevice(name, **how)


os.register_at_fork(after_in_child=_after_fork_in_child)


def add_device(ip: str, name: str | None = None, *, mtu: int | None = None,
               seed: int | None = None, live: bool = True) -> SoftDevice:
    """Create a soft device for ``ip`` (the GID table, port MTU and MAC come from the
    interface holding it; ``mtu`` overrides the interface MTU) and return it.

    A live device (the default) binds UDP 4791 on ``ip`` and starts its progress thread
    when the first context opens it; ``live=False`` makes a manual device, driven by the
    program (``device.progress()``, ``attach_udp(thread=False)`` and ``device.poll()``) or
    by a harness such as :class:`softrdma.sim.SimNetwork`."""
    try:  # EINVAL naming the value, as `rdma link add` refuses a bad netdev
        ipaddress.ip_address(ip)
    except ValueError:
        raise PyverbsRDMAError(f"Failed to add device: ip {ip!r:.60} is not an IP address",
                               errno.EINVAL) from None
    with _registry_lock:
        _ensure_default() if name != DEFAULT_NAME else None
        if name is None:
            i = 0
            while f"softrdma{i}" in _registry:
                i += 1
            name = f"softrdma{i}"
        if name in _registry:
            raise PyverbsRDMAError(f"device {name} already exists", errno.EEXIST)
        dev = SoftDevice(name, ip, mtu=mtu, seed=seed, live=live)
        _registry[name] = dev
        _made[name] = dict(ip=ip, mtu=mtu, seed=seed, live=live)
        return dev


def remove_device(name: str) -> None:
    with _registry_lock:
        dev = _registry.get(name)
        if dev is None:
            raise PyverbsRDMAError(f"no device named {name}", errno.ENODEV)
        if dev.contexts:
            raise PyverbsRDMAError(f"device {name} has open contexts", errno.EBUSY)
        del _registry[name]


def get_soft_device(name: str | None = None) -> SoftDevice:
    """The soft device called ``name`` (None: the default one). A ``softrdma-<IP>`` name
    that no device is registered under is the device of this process on that address,
    made there if there is none (see the module docstring); any other unknown name is
    ENODEV."""
    ip = address_of_name(name) if name is not None else None
    with _registry_lock:
        _ensure_default()
        if name is None:
            return next(iter(_registry.values()))
        dev = _registry.get(name)
        if dev is None and ip is not None:
            dev = _registry.get(device_name_for(ip)) or _settled_on(ip)
    if dev is None and ip is not None:
        try:
            dev = add_device(ip, name=device_name_for(ip), live=_progress_mode() == "thread")
            _made_by_name.add(dev.name)
            return dev
        except PyverbsRDMAError as e:
            if e.error_code != errno.EEXIST:  # (else another thread made it meanwhile)
                raise
            return get_soft_device(name)
    if dev is None:
        raise PyverbsRDMAError(f"Failed to open device {name}: no such device; soft devices "
                               f"are {NAME_RULE}", errno.ENODEV)
    return dev


_made_by_name: set[str] = set()  # devices get_soft_device made for a softrdma-<IP> name


def _forget_if_unused(dev: SoftDevice) -> None:
    """A device made for a ``softrdma-<IP>`` name that could not open (an address this
    host does not hold, UDP 4791 taken) is not left in the device list."""
    with _registry_lock:
        if dev.name in _made_by_name and not dev.contexts and _registry.get(dev.name) is dev:
            del _registry[dev.name]
            _made.pop(dev.name, None)
            _made_by_name.discard(dev.name)


def _settled_on(ip: str) -> SoftDevice | None:
    """A registered device that is on ``ip`` for good: not a default device that has yet
    to find its address (it may move on to the next loopback address when opened)."""
    want = ipaddress.ip_address(ip)
    for dev in _registry.values():
        moving = dev.live and dev.auto_address and dev.udp is None
        if ipaddress.ip_address(dev.ip) == want and not moving:
            return dev
    return None


def soft_devices() -> list[SoftDevice]:
    """Every registered soft device (the default one included), in creation order."""
    with _registry_lock:
        _ensure_default()
        return list(_registry.values())


@dataclass
class Device:
    """An entry of the device list (pyverbs ``Device``)."""

    name: bytes
    guid: int
    node_type: int = ibv_node_type.IBV_NODE_CA
    transport_type: int = ibv_transport_type.IBV_TRANSPORT_IB
    index: int = 0

    def __str__(self) -> str:
        return f"Device {self.name.decode()}, node type CA, transport IB"


def get_device_list() -> list[Device]:
    """The soft devices, then the libibverbs ones (see :func:`set_backend`)."""
    backend = get_backend()
    out: list[Device] = []
    if backend != "ibverbs":
        with _registry_lock:
            _ensure_default()
            out = [Device(name.encode(), int.from_bytes(d.node_guid, "big"), index=i)
                   for i, (name, d) in enumerate(_registry.items())]
    if backend != "soft":
        out += [Device(h.name.encode(), h.guid, h.node_type, h.transport_type, index=len(out) + i)
                for i, h in enumerate(_hw_devices())]
    return out


@dataclass
class DeviceAttr:
    fw_ver: str
    node_guid: int
    sys_image_guid: int
    max_mr_size: int
    page_size_cap: int
    vendor_id: int
    vendor_part_id: int
    hw_ver: int
    max_qp: int
    max_qp_wr: int
    device_cap_flags: int
    max_sge: int
    max_sge_rd: int
    max_cq: int
    max_cqe: int
    max_mr: int
    max_pd: int
    max_qp_rd_atom: int
    max_ee_rd_atom: int
    max_res_rd_atom: int
    max_qp_init_rd_atom: int
    max_ee_init_rd_atom: int
    atomic_caps: int
    max_ee: int
    max_rdd: int
    max_mw: int
    max_raw_ipv6_qp: int
    max_raw_ethy_qp: int
    max_mcast_grp: int
    max_mcast_qp_attach: int
    max_total_mcast_qp_attach: int
    max_ah: int
    max_fmr: int
    max_map_per_fmr: int
    max_srq: int
    max_srq_wr: int
    max_srq_sge: int
    max_pkeys: int
    local_ca_ack_delay: int
    phys_port_cnt: int
    #: the 64-bit flags of ibv_query_device_ex (0: not known, read ``device_cap_flags``)
    device_cap_flags_ex: int = 0


@dataclass
class PortAttr:
    state: int
    max_mtu: int
    active_mtu: int
    gid_tbl_len: int
    port_cap_flags: int
    max_msg_sz: int
    bad_pkey_cntr: int
    qkey_viol_cntr: int
    pkey_tbl_len: int
    lid: int
    sm_lid: int
    lmc: int
    max_vl_num: int
    sm_sl: int
    subnet_timeout: int
    init_type_reply: int
    active_width: int
    active_speed: int
    phys_state: int
    link_layer: int
    flags: int = 0
    port_cap_flags2: int = 0


from ..completion import AsyncEvent  # noqa: E402  (re-exported)


# Capability bits rxe reports (IB_DEVICE_*): bad P_Key/Q_Key counters, port active event,
# system image GUID, RC RNR NAK generation, SRQ resize, memory management extensions,
# memory windows (type 1 and 2B).
_RXE_CAP_FLAGS = (1 << 1) | (1 << 2) | (1 << 5) | (1 << 6) | (1 << 10) | (1 << 12) | (1 << 13) \
    | (1 << 17) | (1 << 21) | (1 << 24)
#: ``device_cap_flags_ex`` (64 bits, ibv_query_device_ex) as 6.12's rxe reports it: the 32
#: bits above plus IB_DEVICE_FLUSH_GLOBAL, IB_DEVICE_FLUSH_PERSISTENT (bits 38, 39) and
#: IB_DEVICE_ATOMIC_WRITE (bit 40) of RXE_DEVICE_CAP_FLAGS (rxe_param.h, since 6.2).
RXE_DEVICE_CAP_FLAGS_EX = _RXE_CAP_FLAGS | int(
    ibv_device_cap_flags_ex.IBV_DEVICE_FLUSH_GLOBAL
    | ibv_device_cap_flags_ex.IBV_DEVICE_FLUSH_PERSISTENT
    | ibv_device_cap_flags_ex.IBV_DEVICE_ATOMIC_WRITE)
_RXE_PORT_CAP_FLAGS = 1 << 26  # IB_PORT_CM_SUP; the RoCEv2 capability is a core flag


def _pick_backend(name: str | None) -> str:
    """``"soft"`` or ``"ibverbs"``: which backend opens device ``name`` (module docstring).
    ENODEV naming why when the ibverbs backend is forced and libibverbs has no device."""
    backend = get_backend()
    if backend == "soft" or (backend == "auto" and (name is None or _is_soft_name(name))):
        return "soft"
    hw = _hw_devices()
    if backend == "auto":
        # not soft, not libibverbs: the soft path says "no such device"
        return "ibverbs" if any(h.name == name for h in hw) else "soft"
    if not hw:
        from ..ibverbs import devices
        raise PyverbsRDMAError(f"Failed to open device{' ' + str(name) if name else ''}: "
                               f"the backend is ibverbs but {devices.why_none()}", errno.ENODEV)
    return "ibverbs"


class Context(ContextBase, Delegating):
    """An open device (``ibv_context``). ``Context(name="softrdma0")``; with no name, the
    first device. A context manager: leaving the ``with`` block destroys, in dependency
    order, every resource made through it that is still open.

    One class on both backends, like every verbs object: the name picks the backend
    (module docstring) and the context holds ``impl``, that backend's implementation
    (:class:`SoftContext`, or ``softrdma.ibverbs.context.HwContext`` for a libibverbs
    device), which does the queries and async events. What only one implementation has is
    in its ``extras``, reachable here on that backend only."""

    impl: Any  #: SoftContext or HwContext

    def __init__(self, name: str | bytes | None = None) -> None:
        if name is not None and not isinstance(name, (str, bytes)):
            raise PyverbsRDMAError(f"Failed to open device: name must be a str, not "
                                   f"{type(name).__name__}", errno.EINVAL)
        if isinstance(name, bytes):
            name = name.decode()
        self.closed = True  # until open: __del__ and close() must not touch anything
        if _pick_backend(name) == "soft":
            self._open(lambda api: SoftContext(api, name))
        else:
            from ..ibverbs.context import HwContext  # only here: soft never imports it
            self._open(lambda api: HwContext(api, name))

    @classmethod
    def holding(cls, make: Callable[["Context"], Any]) -> "Context":
        """A context holding ``make(context)``, an implementation opened another way
        (``HwContext.adopt`` wraps the ``ibv_context*`` librdmacm opened)."""
        self = object.__new__(cls)
        self.closed = True
        self._open(make)
        return self

    def _open(self, make: Callable[["Context"], Any]) -> None:
        # every PD, CQ, CompChannel, ... made in this context, in creation order (a dict used
        # as an ordered set, so destroying one of 10,000 QPs does not scan a list)
        self.children: dict[Any, None] = {}
        self.impl = make(self)
        self.device = self.impl.device  # SoftDevice, or what a libibverbs context reads
        self.name: str = self.impl.name
        self.backend = self.impl.backend
        self.closed = False

    # -- lifetime ------------------------------------------------------------------
    def _check(self) -> None:
        if self.closed:
            raise PyverbsRDMAError("the context is closed", errno.EBADF)

    def close(self) -> None:
        """Destroy every resource still open (QPs, then SRQs, AHs, MWs, MRs, CQs, channels,
        PDs) and close the device. A child that fails to go is reported after the others
        went (the context is going away)."""
        if self.closed:
            return
        errs = []
        for kind in (QP, SRQ, AH, MW, MR, CQ, CompChannel, PD):
            for obj in [c for c in self.children if isinstance(c, kind)]:
                try:
                    obj._destroy()
                except PyverbsRDMAError as e:
                    errs.append(e)
        try:
            self.impl.close()
        finally:
            self.closed = True
        if errs:
            raise errs[0]

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort, like pyverbs' dealloc
        try:
            if not self.closed:
                self.close()
        except Exception:
            pass

    # -- queries -------------------------------------------------------------------
    def query_device(self) -> DeviceAttr:
        return self.impl.query_device()

    def query_port(self, port_num: int = 1) -> PortAttr:
        return self.impl.query_port(port_num)

    def query_gid(self, port_num: int, index: int) -> GID:
        return self.impl.query_gid(port_num, index)

    def query_gid_type(self, port_num: int, index: int) -> int:
        return self.impl.query_gid_type(port_num, index)

    def query_gid_table(self) -> list[tuple[int, GID, int]]:
        """``(index, GID, gid type)`` for every populated entry (like ibv_query_gid_table)."""
        return self.impl.query_gid_table()

    def query_pkey(self, port_num: int, index: int) -> int:
        return self.impl.query_pkey(port_num, index)

    # -- async events ----------------------------------------------------------------
    @property
    def async_fd(self) -> int:
        """Readable when an async event is pending (select/poll/asyncio)."""
        return self.impl.async_fd

    def get_async_event(self, block: bool = True) -> AsyncEvent | None:
        """ibv_get_async_event: the next event; blocks unless ``block=False`` (then None).
        A failed device has queued IBV_EVENT_DEVICE_FATAL, so a waiter always wakes."""
        return self.impl.get_async_event(block)

    def __repr__(self) -> str:
        impl = self.__dict__.get("impl")
        return repr(impl) if impl is not None else "<Context (not open)>"


class SoftContext:
    """The soft backend's context: a :class:`~softrdma.soft.device.SoftDevice` opened for
    ``owner`` (the API :class:`Context`), its queries, and the async events routed to it."""

    backend = Backend("soft", PD=SoftPD, MR=SoftMR, MW=SoftMW, CompChannel=SoftCompChannel,
                      CQ=SoftCQ, AH=SoftAH, SRQ=SoftSRQ, QP=SoftQP)
    extras: frozenset[str] = frozenset()  # nothing beyond the API's members

    def __init__(self, owner: Context, name: str | None) -> None:
        self.owner = owner
        self.device = get_soft_device(name)
        self.name = self.device.name
        self.closed = False
        self._events = EventQueue()  # of AsyncEvents; async_fd is readable while one waits
        try:
            self.device.open()
        except TransportError as e:
            self._events.close()
            self.closed = True
            _forget_if_unused(self.device)
            hint = " (SOFTRDMA_IP pins it)" if self.device.name == DEFAULT_NAME and \
                os.environ.get("SOFTRDMA_IP") else ""
            raise PyverbsRDMAError(f"Failed to open device {self.name}: "
                                   f"{e.args[1] if len(e.args) > 1 else e}{hint}",
                                   e.errno or errno.EIO) from None
        with self.device.lock:
            self.device.async_listeners.append(self._on_async_event)
            self.device.fatal_listeners.append(self._on_fatal)

    def _check(self) -> None:
        if self.closed:
            raise PyverbsRDMAError("the context is closed", errno.EBADF)

    def close(self) -> None:
        """Stop listening to the device and release it (its children are gone)."""
        with self.device.lock:
            if self._on_async_event in self.device.async_listeners:
                self.device.async_listeners.remove(self._on_async_event)
            if self._on_fatal in self.device.fatal_listeners:
                self.device.fatal_listeners.remove(self._on_fatal)
        self.device.release()
        self._events.close()
        self.closed = True

    # -- queries -------------------------------------------------------------------
    def query_device(self) -> DeviceAttr:
        self._check()
        d = self.device
        lim = d.limits
        guid = int.from_bytes(d.node_guid, "big")
        return DeviceAttr(
            fw_ver="", node_guid=guid, sys_image_guid=guid, max_mr_size=lim.max_mr_size,
            page_size_cap=lim.page_size_cap, vendor_id=lim.vendor_id, vendor_part_id=0, hw_ver=0,
            max_qp=lim.max_qp, max_qp_wr=lim.max_qp_wr, device_cap_flags=_RXE_CAP_FLAGS,
            max_sge=lim.max_sge, max_sge_rd=lim.max_sge_rd, max_cq=lim.max_cq,
            max_cqe=lim.max_cqe, max_mr=lim.max_mr, max_pd=lim.max_pd,
            max_qp_rd_atom=lim.max_qp_rd_atom, max_ee_rd_atom=0,
            max_res_rd_atom=lim.max_res_rd_atom, max_qp_init_rd_atom=lim.max_qp_init_rd_atom,
            max_ee_init_rd_atom=0, atomic_caps=ibv_atomic_cap.IBV_ATOMIC_HCA, max_ee=0,
            max_rdd=0, max_mw=lim.max_mw, max_raw_ipv6_qp=0, max_raw_ethy_qp=0,
            max_mcast_grp=lim.max_mcast_grp, max_mcast_qp_attach=lim.max_mcast_qp_attach,
            max_total_mcast_qp_attach=lim.max_total_mcast_qp_attach,
            max_ah=lim.max_ah, max_fmr=0, max_map_per_fmr=0, max_srq=lim.max_srq,
            max_srq_wr=lim.max_srq_wr, max_srq_sge=lim.max_srq_sge, max_pkeys=lim.max_pkeys,
            local_ca_ack_delay=lim.local_ca_ack_delay, phys_port_cnt=1,
            device_cap_flags_ex=RXE_DEVICE_CAP_FLAGS_EX)

    def _check_port(self, port: int) -> None:
        if port != 1:
            raise PyverbsRDMAError(f"Failed to query port {port}: the device has one port (1)",
                                   errno.EINVAL)

    def query_port(self, port_num: int = 1) -> PortAttr:
        self._check()
        self._check_port(port_num)
        d = self.device
        return PortAttr(
            state=ibv_port_state.IBV_PORT_ACTIVE if d.port_active else ibv_port_state.IBV_PORT_DOWN,
            max_mtu=d.max_mtu, active_mtu=d.active_mtu, gid_tbl_len=d.limits.gid_tbl_len,
            port_cap_flags=_RXE_PORT_CAP_FLAGS, max_msg_sz=d.limits.max_msg_sz, bad_pkey_cntr=0,
            qkey_viol_cntr=0, pkey_tbl_len=d.limits.max_pkeys, lid=0, sm_lid=0, lmc=0,
            max_vl_num=1, sm_sl=0, subnet_timeout=0, init_type_reply=0, active_width=1,
            active_speed=1, phys_state=5 if d.port_active else 3,
            link_layer=ibv_link_layer.IBV_LINK_LAYER_ETHERNET)

    def query_gid(self, port_num: int, index: int) -> GID:
        self._check()
        self._check_port(port_num)
        tbl = self.device.gid_table
        if not 0 <= index < self.device.limits.gid_tbl_len:
            raise PyverbsRDMAError(f"Failed to query gid {index}: index out of range", errno.EINVAL)
        return GID(tbl[index]) if index < len(tbl) else GID()

    def query_gid_type(self, port_num: int, index: int) -> int:
        self.query_gid(port_num, index)
        if index >= len(self.device.gid_table):
            raise PyverbsRDMAError(f"Failed to query gid type of index {index}: empty entry",
                                   errno.ENODATA)
        return ibv_gid_type.IBV_GID_TYPE_ROCE_V2

    def query_gid_table(self) -> list[tuple[int, GID, int]]:
        return [(i, GID(g), ibv_gid_type.IBV_GID_TYPE_ROCE_V2)
                for i, g in enumerate(self.device.gid_table)]

    def query_pkey(self, port_num: int, index: int) -> int:
        self._check()
        self._check_port(port_num)
        if not 0 <= index < self.device.limits.max_pkeys:
            raise PyverbsRDMAError(f"Failed to query pkey {index}: index out of range", errno.EINVAL)
        return 0xFFFF if index == 0 else 0

    # -- async events ----------------------------------------------------------------
    def _on_fatal(self, exc: BaseException) -> None:
        # wake whoever blocks on a completion channel of ours: they find the device failed
        for c in list(self.owner.children):
            if isinstance(c, CompChannel):
                c.impl.wake()  # (async waiters get the DEVICE_FATAL event itself)

    def _on_async_event(self, ev: AsyncEvent) -> None:
        # Like uverbs: an event about a QP, CQ or SRQ goes to the context that owns it;
        # port and device events (element is a port number) go to every context.
        owner = getattr(ev.element, "context", None)
        if owner is None or owner is self.owner:
            self._events.put(ev)

    @property
    def async_fd(self) -> int:
        return self._events.fd

    def get_async_event(self, block: bool = True) -> AsyncEvent | None:
        self._check()
        while (ev := self._events.get()) is None and block:
            self._events.wait(None)
        return ev

    def __repr__(self) -> str:
        return f"<Context {self.name} {self.device.ip}>"


# -- the registry, for harnesses and tools: devices made elsewhere, looked up, forgotten ----------

__all__ += ["register_device", "unregister_device", "find_device"]


def register_device(dev: SoftDevice) -> SoftDevice:
    """Make a device built outside :func:`add_device` (a capture replay's, a test's) openable
    as ``Context(name=dev.name)``; EEXIST if the name is taken."""
    with _registry_lock:
        _ensure_default() if dev.name != DEFAULT_NAME else None
        if dev.name in _registry:
            raise PyverbsRDMAError(f"device {dev.name} already exists", errno.EEXIST)
        _registry[dev.name] = dev
        return dev


def unregister_device(name: str) -> SoftDevice | None:
    """Forget device ``name`` whatever its state (a harness or tool cleaning up after itself,
    contexts still open or not: they keep their device); the device, or None if unknown.
    :func:`remove_device` is the checked form for programs."""
    with _registry_lock:
        return _registry.pop(name, None)


def find_device(name: str) -> SoftDevice | None:
    """The registered device ``name``, or None (no default device is created)."""
    with _registry_lock:
        return _registry.get(name)
