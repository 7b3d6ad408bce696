"""Everything of libibverbs' ABI around the objects: the enum strings, the rate tables,
the fork bookkeeping, the GID/P_Key queries, the kernel-structure conversions, and the
operations rxe does not have (import, ECE, multicast on softrdma).

The rule is rdma-core 44 with the rxe provider: each function answers what Debian's
libibverbs answers for an rxe device, except where a soft device has nothing to do
(``madvise`` for fork safety: softrdma reads registered memory in the process itself,
never by DMA, so there is no page to keep from a child).

It also fills two slots of every context (:data:`devices.ON_OPEN`): ``query_port``
(verbs.h's inline ``ibv_query_port`` calls it with its own structure size) and
``query_device_ex`` (``ibv_query_device_ex``, which ibv_devinfo and perftest call).
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import socket
import struct
from typing import Any, Callable

from . import devices
from ..errors import PyverbsRDMAError
from .shim import Errno, guard, handles

#: what the verbs answer a caller with (its mistake: EINVAL and the like), not logged
_ANSWERS = (Errno, PyverbsRDMAError)

__all__ = ["IMPLEMENTS", "CALLBACKS", "install", "note_fork_range", "ifindex_of"]

IMPLEMENTS = (
    "ibv_wc_status_str", "ibv_event_type_str", "ibv_node_type_str", "ibv_port_state_str",
    "ibv_rate_to_mbps", "ibv_rate_to_mult", "mbps_to_ibv_rate", "mult_to_ibv_rate",
    "ibv_fork_init", "ibv_is_fork_initialized", "ibv_dofork_range", "ibv_dontfork_range",
    "_ibv_query_gid_ex", "_ibv_query_gid_table", "ibv_get_pkey_index",
    "ibv_get_sysfs_path", "ibv_register_driver",
    "ibv_copy_path_rec_from_kern", "ibv_copy_path_rec_to_kern", "ibv_copy_ah_attr_from_kern",
    "ibv_copy_qp_attr_from_kern", "ibv_resolve_eth_l2_from_gid",
    "ibv_import_device", "ibv_import_pd", "ibv_import_mr", "ibv_import_dm",
    "ibv_unimport_pd", "ibv_unimport_mr", "ibv_unimport_dm",
    "ibv_query_ece", "ibv_set_ece", "ibv_query_qp_data_in_order",
    "ibv_attach_mcast", "ibv_detach_mcast",
)


CALLBACKS = """
    extern "Python" int softrdma_query_port(struct ibv_context *, uint8_t,
                                            struct ibv_port_attr *, size_t);
    extern "Python" int softrdma_query_device_ex(struct ibv_context *,
        const struct ibv_query_device_ex_input *, struct ibv_device_attr_ex *, size_t);
"""

# ---- the strings of libibverbs' enum_strs.c (rdma-core 44), by enum value -------------
NODE_TYPE_STR = {1: "InfiniBand channel adapter", 2: "InfiniBand switch",
                 3: "InfiniBand router", 4: "iWARP NIC", 5: "usNIC", 6: "usNIC UDP",
                 7: "unspecified"}
PORT_STATE_STR = {0: "no state change (NOP)", 1: "down", 2: "init", 3: "armed", 4: "active",
                  5: "active defer"}
EVENT_TYPE_STR = dict(enumerate((
    "CQ error", "local work queue catastrophic error", "invalid request local work queue error",
    "local access violation work queue error", "communication established",
    "send queue drained", "path migrated", "path migration request error",
    "local catastrophic error", "port active", "port error", "LID change", "P_Key change",
    "SM change", "SRQ catastrophic error", "SRQ limit reached", "last WQE reached",
    "client reregistration", "GID table change", "WQ fatal")))
WC_STATUS_STR = dict(enumerate((
    "success", "local length error", "local QP operation error",
    "local EE context operation error", "local protection error",
    "Work Request Flushed Error", "memory management operation error", "bad response error",
    "local access error", "remote invalid request error", "remote access error",
    "remote operation error", "transport retry counter exceeded",
    "RNR retry counter exceeded", "local RDD violation error", "remote invalid RD request",
    "aborted error", "invalid EE context number", "invalid EE context state", "fatal error",
    "response timeout error", "general error", "TM error", "TM software rendezvous")))
UNKNOWN = "unknown"

# ---- verbs.c's rate tables -------------------------------------------------------------
#: enum ibv_rate (verbs.h; the values are ABI): IBV_RATE_<name>_GBPS
IBV_RATE = {"2_5": 2, "5": 5, "10": 3, "20": 6, "30": 4, "40": 7, "60": 8, "80": 9, "120": 10,
            "14": 11, "56": 12, "112": 13, "168": 14, "25": 15, "100": 16, "200": 17,
            "300": 18, "28": 19, "50": 20, "400": 21, "600": 22, "800": 23, "1200": 24}
IBV_RATE_MAX = 0
RATE_MULT = {"2_5": 1, "5": 2, "10": 4, "20": 8, "30": 12, "40": 16, "60": 24, "80": 32,
             "120": 48, "28": 11, "50": 20, "400": 160, "600": 240, "800": 320, "1200": 480}
RATE_MBPS = {"2_5": 2500, "5": 5000, "10": 10000, "20": 20000, "30": 30000, "40": 40000,
             "60": 60000, "80": 80000, "120": 120000, "14": 14062, "56": 56250,
             "112": 112500, "168": 168750, "25": 25781, "100": 103125, "200": 206250,
             "300": 309375, "28": 28125, "50": 53125, "400": 425000, "600": 637500,
             "800": 850000, "1200": 1275000}
IBV_FORK_DISABLED, IBV_FORK_ENABLED = 0, 1  # enum ibv_fork_status
IBV_GID_TYPE_ROCE_V2 = 2  # enum ibv_gid_type

# ---- fork: rdma-core's state without the madvise calls ---------------------------------
# libibverbs keeps a range tree once ibv_fork_init ran (IBV_FORK_ENABLED); a range call
# before that makes a later ibv_fork_init fail with EINVAL ("too late"). A soft device
# needs no MADV_DONTFORK, so the ranges are not kept, only the state.
_fork = {"enabled": False, "too_late": False}


def note_fork_range() -> int:
    """What ibv_dontfork_range/ibv_dofork_range do, for a part that registers memory
    (ibv_reg_mr calls it in libibverbs): 0, and a later ibv_fork_init is too late unless
    it already ran."""
    if not _fork["enabled"]:
        _fork["too_late"] = True
    return 0


def ifindex_of(ip: str) -> int:
    """The index of the network interface an IPv4 address of this host belongs to (the
    netdev of a RoCE GID: its ``ndev_ifindex``); 127/8 is ``lo``'s; 0 if none."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return 0
    if addr.version == 4 and addr.is_loopback:
        return socket.if_nametoindex("lo")
    if addr.version != 4:
        return 0
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for idx, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                a = fcntl.ioctl(s, 0x8915, req)[20:24]      # SIOCGIFADDR
                m = fcntl.ioctl(s, 0x891b, req)[20:24]      # SIOCGIFNETMASK
            except OSError:
                continue
            net = ipaddress.ip_network(f"{socket.inet_ntoa(a)}/{socket.inet_ntoa(m)}",
                                       strict=False)
            if addr in net:
                return idx
    finally:
        s.close()
    return 0


def install(ffi: Any, lib: Any) -> None:
    """Define this part's functions and hook the context slots."""

    def strings(table: dict[int, str]) -> dict[int, Any]:
        return {k: ffi.new("char[]", v.encode()) for k, v in table.items()}

    def string_fn(name: str, table: dict[int, str]) -> None:
        kept = strings(table)  # static storage: the program keeps the pointers
        unknown = ffi.new("char[]", UNKNOWN.encode())
        kept[-1] = unknown

        def fn(value: int) -> Any:
            return kept.get(value, unknown)
        ffi.def_extern(name=name)(guard(unknown)(fn))

    string_fn("ibv_node_type_str", NODE_TYPE_STR)
    string_fn("ibv_port_state_str", PORT_STATE_STR)
    string_fn("ibv_event_type_str", EVENT_TYPE_STR)
    string_fn("ibv_wc_status_str", WC_STATUS_STR)

    rate = IBV_RATE
    rate_max = IBV_RATE_MAX
    to_mult = {rate[k]: v for k, v in RATE_MULT.items()}
    to_mbps = {rate[k]: v for k, v in RATE_MBPS.items()}
    from_mult = {v: rate[k] for k, v in RATE_MULT.items()}
    from_mbps = {v: rate[k] for k, v in RATE_MBPS.items()}

    ffi.def_extern(name="ibv_rate_to_mult")(guard(-1)(lambda r: to_mult.get(r, -1)))
    ffi.def_extern(name="ibv_rate_to_mbps")(guard(-1)(lambda r: to_mbps.get(r, -1)))
    ffi.def_extern(name="mult_to_ibv_rate")(
        guard(rate_max)(lambda m: from_mult.get(m, rate_max)))
    ffi.def_extern(name="mbps_to_ibv_rate")(
        guard(rate_max)(lambda m: from_mbps.get(m, rate_max)))

    # ---- fork ----------------------------------------------------------------------
    def fork_safe_env() -> None:
        # libibverbs' initialisation (the first ibv_get_device_list) calls ibv_fork_init
        # when RDMAV_FORK_SAFE or IBV_FORK_SAFE is set
        if not _fork["enabled"] and devices.listed() and (
                os.environ.get("RDMAV_FORK_SAFE") or os.environ.get("IBV_FORK_SAFE")):
            _fork["enabled"] = True

    @ffi.def_extern(name="ibv_fork_init")
    @guard("errno")
    def fork_init() -> int:
        fork_safe_env()
        if _fork["enabled"]:
            return 0
        if _fork["too_late"] or handles.of_kind("mr"):
            return errno.EINVAL  # memory was registered before: libibverbs says too late
        _fork["enabled"] = True
        return 0

    @ffi.def_extern(name="ibv_is_fork_initialized")
    @guard(0)
    def is_fork_initialized() -> int:
        fork_safe_env()
        # the kernel's copy-on-fork flag (IBV_FORK_UNNEEDED) comes from RDMA netlink,
        # which a machine without an RDMA device answers "no" to
        return IBV_FORK_ENABLED if _fork["enabled"] else IBV_FORK_DISABLED

    ffi.def_extern(name="ibv_dontfork_range")(guard(-1)(lambda base, size: note_fork_range()))
    ffi.def_extern(name="ibv_dofork_range")(guard(-1)(lambda base, size: note_fork_range()))

    # ---- GIDs and P_Keys -------------------------------------------------------------
    entry_size_min = ffi.sizeof("struct ibv_gid_entry")
    roce_v2 = IBV_GID_TYPE_ROCE_V2

    def netdev_of(c: Any) -> int:
        """The ifindex of the interface a device sits on: every GID of it has this
        netdev (rxe's link-local GID too), found by the device's IPv4 address."""
        for _, g, _ in c.query_gid_table():
            if g.raw[:12] == bytes(10) + b"\xff\xff":
                return ifindex_of(g.ip)
        return 0

    def fill_entry(c: Any, port: int, index: int, out: Any, ndev: int) -> None:
        """The kernel's QUERY_GID_ENTRY: EINVAL for a port or index out of range,
        ENODATA for an empty entry."""
        try:
            g = c.query_gid(port, index)
        except Exception as e:
            raise Errno(errno.EINVAL, f"no GID {index} on port {port}") from e
        raw = bytes(g.raw)
        if raw == bytes(16):
            raise Errno(errno.ENODATA, f"GID {index} is empty")
        ffi.memmove(out.gid.raw, raw, 16)
        out.gid_index = index
        out.port_num = port
        out.gid_type = roce_v2
        out.ndev_ifindex = ndev

    def put_entry(at: Any, entry: Any, size: int) -> None:
        # the kernel's copy to a longer structure of a newer caller: the rest is zero
        ffi.memmove(at, entry, entry_size_min)
        if size > entry_size_min:
            ffi.memmove(at + entry_size_min, bytes(size - entry_size_min),
                        size - entry_size_min)

    @ffi.def_extern(name="_ibv_query_gid_ex")
    @guard("errno")
    def query_gid_ex(ctx: Any, port: int, index: int, entry: Any, flags: int,
                     entry_size: int) -> int:
        c = devices.context_of(ctx)
        if flags or entry_size < entry_size_min or entry == ffi.NULL:
            return errno.EINVAL
        tmp = ffi.new("struct ibv_gid_entry *")
        fill_entry(c, port, index, tmp, netdev_of(c))
        put_entry(ffi.cast("char *", entry), tmp, entry_size)
        return 0

    @ffi.def_extern(name="_ibv_query_gid_table")
    @guard(-errno.EIO)
    def query_gid_table(ctx: Any, entries: Any, max_entries: int, flags: int,
                        entry_size: int) -> int:
        try:
            c = devices.context_of(ctx)
        except Errno as e:
            return -e.error_code
        if flags or entry_size < entry_size_min:
            return -errno.EINVAL
        found = []
        ndev = netdev_of(c)
        for port in range(1, c.query_device().phys_port_cnt + 1):
            for index in range(c.query_port(port).gid_tbl_len):
                tmp = ffi.new("struct ibv_gid_entry *")
                try:
                    fill_entry(c, port, index, tmp, ndev)
                except Errno:
                    continue  # the empty entries are not in the table
                found.append(tmp)
        if len(found) > max_entries:
            return -errno.EINVAL
        base = ffi.cast("char *", entries)
        for i, tmp in enumerate(found):
            put_entry(base + i * entry_size, tmp, entry_size)
        return len(found)

    def pkey_at(ctx: Any, port: int, index: int) -> int:
        """libibverbs reads ports/<port>/pkeys/<index> in sysfs: a missing file (port or
        index out of range) is -1 with errno ENOENT."""
        c = devices.context_of(ctx)
        try:
            return int(c.query_pkey(port, index))
        except Exception as e:
            raise Errno(errno.ENOENT, f"no P_Key {index} on port {port}") from e

    # ibv_query_pkey itself: softrdma.exec.verbs
    @ffi.def_extern(name="ibv_get_pkey_index")
    @guard(-1)
    def get_pkey_index(ctx: Any, port: int, pkey: int) -> int:
        want = shim_be16(pkey)  # __be16 both ways: swapping is its own inverse
        index = 0
        while True:  # as libibverbs: up the table until the value or the table's end
            if pkey_at(ctx, port, index) == want:
                return index
            index += 1

    # ---- sysfs and drivers ----------------------------------------------------------
    sysfs: list[Any] = []

    @ffi.def_extern(name="ibv_get_sysfs_path")
    @guard(ffi.NULL)
    def get_sysfs_path() -> Any:
        if not sysfs:
            env = os.environ.get("SYSFS_PATH") if os.getuid() == os.geteuid() else None
            path = env.encode()[:256].rstrip(b"/") if env is not None else b"/sys"
            sysfs.append(ffi.new("char[]", path))
        return sysfs[0]

    @ffi.def_extern(name="ibv_register_driver")
    @guard(None)
    def register_driver(name: Any, init: Any) -> None:
        return None  # the old provider entry point: libibverbs ignores it too

    # ---- the kernel's path record <-> libibverbs' ------------------------------------
    path_fields = ("dlid", "slid", "raw_traffic", "flow_label", "hop_limit", "traffic_class",
                   "reversible", "numb_path", "pkey", "sl", "mtu_selector", "mtu",
                   "rate_selector", "rate", "packet_life_time", "preference",
                   "packet_life_time_selector")
    to_sa = _converters(ffi, "struct ibv_sa_path_rec", path_fields)
    to_user = _converters(ffi, "struct ib_user_path_rec", path_fields)

    @ffi.def_extern(name="ibv_copy_path_rec_from_kern")
    @guard(None)
    def copy_path_rec_from_kern(dst: Any, src: Any) -> None:
        ffi.memmove(dst.dgid.raw, src.dgid, 16)
        ffi.memmove(dst.sgid.raw, src.sgid, 16)
        for name, conv in to_sa:
            setattr(dst, name, conv(getattr(src, name)))

    @ffi.def_extern(name="ibv_copy_path_rec_to_kern")
    @guard(None)
    def copy_path_rec_to_kern(dst: Any, src: Any) -> None:
        ffi.memmove(dst.dgid, src.dgid.raw, 16)
        ffi.memmove(dst.sgid, src.sgid.raw, 16)
        for name, conv in to_user:
            setattr(dst, name, conv(getattr(src, name)))

    # ---- the kernel's AH and QP attributes -> libibverbs' (marshall.c) -----------------
    grh_fields = ("flow_label", "sgid_index", "hop_limit", "traffic_class")
    ah_fields = ("dlid", "sl", "src_path_bits", "static_rate", "is_global", "port_num")
    qp_fields = ("cur_qp_state", "path_mtu", "path_mig_state", "qkey", "rq_psn", "sq_psn",
                 "dest_qp_num", "qp_access_flags", "pkey_index", "alt_pkey_index",
                 "en_sqd_async_notify", "sq_draining", "max_rd_atomic", "max_dest_rd_atomic",
                 "min_rnr_timer", "port_num", "timeout", "retry_cnt", "rnr_retry",
                 "alt_port_num", "alt_timeout")
    cap_fields = ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge",
                  "max_inline_data")
    to_grh = _converters(ffi, "struct ibv_global_route", grh_fields)
    to_ah = _converters(ffi, "struct ibv_ah_attr", ah_fields)
    to_qp = _converters(ffi, "struct ibv_qp_attr", qp_fields)
    to_cap = _converters(ffi, "struct ibv_qp_cap", cap_fields)

    def copy_ah(dst: Any, src: Any) -> None:
        ffi.memmove(dst.grh.dgid.raw, src.grh.dgid, 16)
        for name, conv in to_grh:
            setattr(dst.grh, name, conv(getattr(src.grh, name)))
        for name, conv in to_ah:
            setattr(dst, name, conv(getattr(src, name)))

    @ffi.def_extern(name="ibv_copy_ah_attr_from_kern")
    @guard(None)
    def copy_ah_attr_from_kern(dst: Any, src: Any) -> None:
        copy_ah(dst, src)

    @ffi.def_extern(name="ibv_copy_qp_attr_from_kern")
    @guard(None)
    def copy_qp_attr_from_kern(dst: Any, src: Any) -> None:
        # qp_state and the rate limit are not the kernel structure's to give
        for name, conv in to_qp:
            setattr(dst, name, conv(getattr(src, name)))
        for name, conv in to_cap:
            setattr(dst.cap, name, conv(getattr(src, name)))
        copy_ah(dst.ah_attr, src.ah_attr)
        copy_ah(dst.alt_ah_attr, src.alt_ah_attr)

    # ---- the Ethernet address of a RoCE destination ------------------------------------
    @ffi.def_extern(name="ibv_resolve_eth_l2_from_gid")
    @guard(-errno.EINVAL)
    def resolve_eth_l2_from_gid(ctx: Any, attr: Any, mac: Any, vid: Any) -> int:
        # libibverbs: the source GID must exist (else ibv_query_gid's -1), then the
        # kernel's neighbour of the destination on the source's netdev, no VLAN: 0xffff
        if attr == ffi.NULL or mac == ffi.NULL:
            return -errno.EINVAL
        c = devices.context_of(ctx)
        try:
            sgid = c.query_gid(attr.port_num, attr.grh.sgid_index)
        except Exception:
            return -1
        if bytes(sgid.raw) == bytes(16):
            return -errno.EINVAL  # an empty entry: no netdev to find a neighbour on
        found = neighbour_mac(bytes(ffi.buffer(attr.grh.dgid.raw, 16)))
        if found is None:
            return -errno.EHOSTUNREACH
        ffi.memmove(mac, found, 6)
        if vid != ffi.NULL:
            vid[0] = 0xFFFF
        return 0

    # ---- what rxe does not do --------------------------------------------------------
    def unsupported_ptr(*args: Any) -> Any:
        ffi.errno = errno.EOPNOTSUPP  # libibverbs' dummy import_* operations
        return ffi.NULL

    for name in ("ibv_import_pd", "ibv_import_mr", "ibv_import_dm"):
        ffi.def_extern(name=name)(guard(ffi.NULL)(unsupported_ptr))
    for name in ("ibv_unimport_pd", "ibv_unimport_mr", "ibv_unimport_dm"):
        ffi.def_extern(name=name)(guard(None)(lambda obj: None))

    @ffi.def_extern(name="ibv_import_device")
    @guard(ffi.NULL)
    def import_device(cmd_fd: int) -> Any:
        # libibverbs looks the descriptor up as a uverbs character device: a softrdma
        # context's is a pipe, no device of the kernel's
        raise Errno(errno.EOPNOTSUPP, "softrdma contexts cannot be imported")

    @ffi.def_extern(name="ibv_query_ece")
    @guard("errno")
    def query_ece(qp: Any, ece: Any) -> int:
        handles.get("qp", qp)
        return errno.EOPNOTSUPP  # rxe has no ECE (libibverbs' dummy operation)

    @ffi.def_extern(name="ibv_set_ece")
    @guard("errno")
    def set_ece(qp: Any, ece: Any) -> int:
        handles.get("qp", qp)
        if ece != ffi.NULL and ffi.cast("uint32_t *", ece)[0] == 0:  # vendor_id
            ffi.errno = errno.EOPNOTSUPP  # libibverbs' own check sets errno as well
        return errno.EOPNOTSUPP

    @ffi.def_extern(name="ibv_query_qp_data_in_order")
    @guard(0)
    def query_qp_data_in_order(qp: Any, op: int, flags: int) -> int:
        handles.get("qp", qp)
        return 0  # rxe has no query_qp_data_in_order: the dummy's "not in order"

    # ---- multicast groups (softrdma.soft.mcast: rxe_mcast.c) ---------------------------
    def mcast(verb: str) -> Callable[[Any, Any, int], int]:
        def call(qp: Any, gid: Any, lid: int) -> int:
            rec = handles.get("qp", qp)
            if gid == ffi.NULL:
                return errno.EINVAL
            getattr(rec.qp, verb)(bytes(ffi.buffer(gid, 16)), lid)
            return 0
        call.__name__ = f"ibv_{verb}"
        return call

    ffi.def_extern(name="ibv_attach_mcast")(guard("errno", _ANSWERS)(mcast("attach_mcast")))
    ffi.def_extern(name="ibv_detach_mcast")(guard("errno", _ANSWERS)(mcast("detach_mcast")))

    # ---- context slots -------------------------------------------------------------
    port_attr_size = ffi.sizeof("struct ibv_port_attr")

    @ffi.def_extern(name="softrdma_query_port")
    @guard("errno")
    def query_port(ctx: Any, port: int, attr: Any, size: int) -> int:
        # as __lib_query_port: the provider fills a whole structure, the caller gets
        # the first `size` bytes of it
        tmp = ffi.new("struct ibv_port_attr *")
        rc = lib.ibv_query_port(ctx, port, ffi.cast("struct _compat_ibv_port_attr *", tmp))
        if rc:
            return rc
        ffi.memmove(attr, tmp, min(size, port_attr_size))
        return 0

    attr_ex_size = ffi.sizeof("struct ibv_device_attr_ex")
    orig_size = ffi.sizeof("struct ibv_device_attr")

    @ffi.def_extern(name="softrdma_query_device_ex")
    @guard("errno")
    def query_device_ex(ctx: Any, inp: Any, attr: Any, size: int) -> int:
        # ibv_cmd_query_device_any: no input flags known, at least the old structure
        if inp != ffi.NULL and inp.comp_mask:
            return errno.EINVAL
        if size < orig_size:
            return errno.EINVAL
        c = devices.context_of(ctx)
        tmp = ffi.new("struct ibv_device_attr_ex *")
        rc = lib.ibv_query_device(ctx, ffi.addressof(tmp, "orig_attr"))
        if rc:
            return rc
        dev_attr = c.query_device()
        tmp.device_cap_flags_ex = int(dev_attr.device_cap_flags_ex or dev_attr.device_cap_flags)
        tmp.phys_port_cnt_ex = int(tmp.orig_attr.phys_port_cnt)
        n = min(size, attr_ex_size)
        ffi.memmove(attr, tmp, n)
        if size > n:  # a newer caller's longer structure: the rest is zero
            ffi.memmove(ffi.cast("char *", attr) + n, bytes(size - n), size - n)
        return 0

    def on_open(ctx: Any, c: Any) -> None:
        devices.set_op(ctx, "query_port", lib.softrdma_query_port)
        devices.set_op(ctx, "query_device_ex", lib.softrdma_query_device_ex)

    devices.ON_OPEN.append(on_open)


def neighbour_mac(dgid: bytes) -> bytes | None:
    """The link-layer address rxe would send to for a destination GID: none (zeros, the
    loopback device's) for an address of this host, as softrdma's devices are; else
    the kernel's ARP entry for an IPv4 destination; None when there is none (the
    caller's EHOSTUNREACH)."""
    mapped = dgid[:12] == bytes(10) + b"\xff\xff"
    ip = ipaddress.ip_address(dgid[12:] if mapped else dgid)
    if ip.is_loopback or _is_local(ip):
        return bytes(6)
    if ip.version == 4:
        hop = _next_hop(ip)
        try:
            with open("/proc/net/arp") as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[0] == str(hop) and int(fields[2], 16) & 0x2:  # ATF_COM
                        return bytes.fromhex(fields[3].replace(":", ""))
        except OSError:
            pass
    return None


def _next_hop(ip: Any) -> Any:
    """The gateway the kernel routes an IPv4 destination through (its longest matching
    route in /proc/net/route), or the destination itself when it is on a link."""
    best: tuple[int, Any] = (-1, ip)
    try:
        with open("/proc/net/route") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                dest, gw, mask = (int.from_bytes(bytes.fromhex(fields[i]), "little")
                                  for i in (1, 2, 7))
                if int(ip) & mask == dest and bin(mask).count("1") > best[0]:
                    best = (bin(mask).count("1"), ipaddress.IPv4Address(gw) if gw else ip)
    except (OSError, ValueError, IndexError):
        pass
    return best[1]


def _is_local(ip: Any) -> bool:
    """Whether ``ip`` is an address of this host (binding to it works)."""
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))
        return True
    except OSError:
        return False


def shim_be16(v: int) -> int:
    """A __be16's value from a host one (and back): its two bytes swapped."""
    return ((v & 0xFF) << 8) | ((v >> 8) & 0xFF)


def _converters(ffi: Any, struct_name: str,
                fields: tuple[str, ...]) -> list[tuple[str, Callable[[int], int]]]:
    """(field, conversion) pairs: C's assignment to the destination field's integer type
    (wrapping to its width, signed if it is), precomputed once."""
    out = []
    types = dict(ffi.typeof(struct_name).fields)
    for name in fields:
        t = types[name].type
        bits = ffi.sizeof(t) * 8
        signed = t.cname in ("int", "short", "signed char", "long", "int8_t", "int16_t",
                             "int32_t", "int64_t")

        def conv(v: int, bits: int = bits, signed: bool = signed) -> int:
            v &= (1 << bits) - 1
            if signed and v >> (bits - 1):
                v -= 1 << bits
            return v
        out.append((name, conv))
    return out
