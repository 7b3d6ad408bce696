"""``HwQP``, ``HwSRQ`` and ``HwAH``: queue pairs (create, modify, query, post every
opcode), shared receive queues and address handles.

Each is the hardware implementation the verbs_api object holds (``verbs_api.QP`` holds
a ``HwQP`` on a device, a ``SoftQP`` on a soft one): the API class checks what both
backends check, this class calls libibverbs."""

from __future__ import annotations

import errno
import socket
from ctypes import addressof, byref, sizeof
from typing import Any

from ..errors import PyverbsRDMAError
from ..verbs_api import ah as v_ah, mr as v_mr
from ..verbs_api import cq as v_cq, pd as v_pd, srq as v_srq
from ..verbs_api._check import U24, U32, U64, as_int, require
from ..verbs_api.attr import QPAttr, QPCap, SrqAttr
from ..verbs_api.enums import (ibv_qp_attr_mask as M, ibv_qp_type as T, ibv_send_flags,
                               ibv_wr_opcode as W)
from ..verbs_api.posting import check_send_scalars, sge_list
from ..verbs_api.wr import MWBindInfo, RecvWR, SendWR
from . import convert, ffi
from .common import fail, hw_impl, null_error
from .completion import HwCQ
from .memory import HwMR, HwMW, HwPD
from .posting import post, posted_list, raise_at, recv_chain, sge_array

__all__ = ["HwQP", "HwSRQ", "HwAH"]

_INT_TYPES = frozenset({int, W, ibv_send_flags})  # what a WR's scalars usually are
_IMM_OPS = {int(W.IBV_WR_SEND_WITH_IMM), int(W.IBV_WR_RDMA_WRITE_WITH_IMM)}
_RDMA_OPS = {int(W.IBV_WR_RDMA_WRITE), int(W.IBV_WR_RDMA_WRITE_WITH_IMM), int(W.IBV_WR_RDMA_READ)}
_ATOMIC_OPS = {int(W.IBV_WR_ATOMIC_CMP_AND_SWP), int(W.IBV_WR_ATOMIC_FETCH_AND_ADD)}
_BIND = int(W.IBV_WR_BIND_MW)
_INLINE = 1 << 3  # IBV_SEND_INLINE
_SEND_FLAGS = 0x1F
_ALL_QP_ATTRS = (1 << 21) - 1  # what query() asks for when given no mask


# -- SRQ -------------------------------------------------------------------------------------

class HwSRQ:
    """``ibv_srq`` behind :class:`softrdma.verbs_api.SRQ`; posting through
    ``context->ops.post_srq_recv``."""

    extras: frozenset[str] = frozenset()

    @staticmethod
    def check_create(pd: Any, a: SrqAttr, what: str) -> None:
        hw_impl(pd, v_pd.PD, HwPD, what, "pd")  # the device checks the sizes

    def __init__(self, owner: Any, pd: Any, a: SrqAttr) -> None:
        what = "Failed to create SRQ"
        c = ffi.ibv_srq_init_attr()
        for n in ("max_wr", "max_sge", "srq_limit"):
            setattr(c.attr, n, getattr(a, n))
        s = ffi.lib().ibv_create_srq(pd.impl._addr, byref(c))
        if not s:
            raise null_error(what)
        self._addr = s
        self.max_wr, self.max_sge, self.srq_limit = c.attr.max_wr, c.attr.max_sge, c.attr.srq_limit
        self.context = ctx = pd.context
        ctx._objs[s] = owner  # async events name the API object
        self._post_srq_recv = ctx._ops.post_srq_recv

    def post_recv(self, wr: Any, bad_wr: Any = None) -> None:
        what = "Failed to post receive to SRQ"
        wrs = posted_list(wr, bad_wr, RecvWR, what)
        try:
            arr, keep = recv_chain(wrs, self.max_sge, what)
        except PyverbsRDMAError as e:
            raise_at(e, wrs, bad_wr, self.post_recv)
        post(self._post_srq_recv, self._addr, arr, sizeof(ffi.ibv_recv_wr), wrs, bad_wr, what)

    def modify(self, attr: SrqAttr, attr_mask: int) -> None:
        what = "Failed to modify SRQ"
        mask = as_int(attr_mask, what, "attr_mask", (1 << 31) - 1)
        c = ffi.ibv_srq_attr(as_int(attr.max_wr, what, "attr.max_wr", U32),
                             as_int(attr.max_sge, what, "attr.max_sge", U32),
                             as_int(attr.srq_limit, what, "attr.srq_limit", U32))
        rc = ffi.lib().ibv_modify_srq(self._addr, byref(c), mask)
        if rc:
            raise fail(what, rc)
        q = self.query()
        self.max_wr, self.srq_limit = q.max_wr, q.srq_limit

    def query(self) -> SrqAttr:
        c = ffi.ibv_srq_attr()
        rc = ffi.lib().ibv_query_srq(self._addr, byref(c))
        if rc:
            raise fail("Failed to query SRQ", rc)
        return SrqAttr(max_wr=c.max_wr, max_sge=c.max_sge, srq_limit=c.srq_limit)

    def destroy(self) -> None:
        rc = ffi.lib().ibv_destroy_srq(self._addr)
        if rc:
            raise fail("Failed to destroy SRQ", rc)
        self.context._objs.pop(self._addr, None)


# -- AH --------------------------------------------------------------------------------------

class HwAH:
    """``ibv_ah`` behind :class:`softrdma.verbs_api.AH`."""

    extras: frozenset[str] = frozenset()

    def __init__(self, owner: Any, pd: Any, attr: Any) -> None:
        what = "Failed to create AH"
        hw_pd = hw_impl(pd, v_pd.PD, HwPD, what, "pd")
        c = ffi.ibv_ah_attr()
        convert.ah_attr_to_c(attr, c, what, "attr")
        a = ffi.lib().ibv_create_ah(hw_pd._addr, byref(c))
        if not a:
            raise null_error(what)
        self._addr = a

    def destroy(self) -> None:
        rc = ffi.lib().ibv_destroy_ah(self._addr)
        if rc:
            raise fail("Failed to destroy AH", rc)


# -- QP --------------------------------------------------------------------------------------

_SEND_WR_SIZE = sizeof(ffi.ibv_send_wr)


class HwQP:
    """``ibv_qp`` behind :class:`softrdma.verbs_api.QP`: create, modify, query and destroy
    through the exported verbs; posting through ``context->ops.post_send``/``post_recv``.
    The API object has checked what both backends check; the device checks the rest (the
    transition, the values, its own limits) and answers with an errno."""

    extras: frozenset[str] = frozenset()  # nothing beyond the API's members

    @staticmethod
    def check_create(pd: Any, qpt: int, cap: QPCap, srq: Any, what: str) -> None:
        """Every object on a device comes from the same device (the device checks the rest)."""
        hw_impl(pd, v_pd.PD, HwPD, what, "pd")
        if srq is not None:
            hw_impl(srq, v_srq.SRQ, HwSRQ, what, "init_attr.srq")

    def __init__(self, owner: Any, pd: Any, qpt: int, cap: QPCap, scq: Any, rcq: Any,
                 srq: Any, sq_sig_all: bool) -> None:
        what = "Failed to create QP"
        hw_scq = hw_impl(scq, v_cq.CQ, HwCQ, what, "init_attr.scq")
        hw_rcq = hw_impl(rcq, v_cq.CQ, HwCQ, what, "init_attr.rcq")
        c = ffi.ibv_qp_init_attr()
        c.send_cq, c.recv_cq = hw_scq._addr, hw_rcq._addr
        if srq is not None:
            c.srq = srq.impl._addr
        convert.cap_to_c(cap, c.cap, what, "init_attr.cap")
        c.qp_type = qpt
        c.sq_sig_all = 1 if sq_sig_all else 0
        q = ffi.lib().ibv_create_qp(pd.impl._addr, byref(c))
        if not q:
            raise null_error(what)
        self._addr: int | None = q
        self.qp_num = ffi.ibv_qp.from_address(q).qp_num
        try:
            self.qp_type: Any = T(qpt)
        except ValueError:
            self.qp_type = qpt
        self.cap = convert.cap_from_c(c.cap)  # what the device granted
        self.context = ctx = pd.context
        ctx._objs[q] = owner  # async events name the API object
        ops = ctx._ops
        self._post_send, self._post_recv = ops.post_send, ops.post_recv
        self._mrs = ctx._mrs

    # -- state ------------------------------------------------------------------------------
    def _query_c(self, mask: int) -> tuple[ffi.ibv_qp_attr, ffi.ibv_qp_init_attr]:
        if self._addr is None:
            raise PyverbsRDMAError("the QP is closed", errno.EBADF)
        a, ia = ffi.ibv_qp_attr(), ffi.ibv_qp_init_attr()
        rc = ffi.lib().ibv_query_qp(self._addr, byref(a), mask, byref(ia))
        if rc:
            raise fail("Failed to query QP", rc)
        return a, ia

    @property
    def state(self) -> int:
        """The QP's state as the device reports it (``ibv_query_qp``: an error the device
        detected shows as IBV_QPS_ERR)."""
        return self._query_c(int(M.IBV_QP_STATE))[0].qp_state

    @property
    def attr(self) -> QPAttr:
        return self.query()[0]

    @property
    def sq_draining(self) -> bool:
        return bool(self._query_c(int(M.IBV_QP_STATE))[0].sq_draining)

    @property
    def duplicate_requests(self) -> None:
        return None  # a device does not count them where verbs can read it

    def modify(self, attr: QPAttr, attr_mask: int) -> None:
        """``ibv_modify_qp``; the device checks the transition and values (EINVAL...)."""
        what = "Failed to modify QP"
        mask = as_int(attr_mask, what, "attr_mask", (1 << 31) - 1, desc="not an attribute mask")
        c = convert.qp_attr_to_c(attr, mask, what)
        rc = ffi.lib().ibv_modify_qp(self._addr, byref(c), mask)
        if rc:
            raise fail(what, rc)

    def query(self, attr_mask: int = 0) -> tuple[QPAttr, QPCap, int]:
        """``ibv_query_qp``: the attributes, the capabilities and ``sq_sig_all``."""
        a, ia = self._query_c(as_int(attr_mask, "Failed to query QP", "attr_mask",
                                     (1 << 31) - 1) or _ALL_QP_ATTRS)
        return convert.qp_attr_from_c(a), convert.cap_from_c(ia.cap), ia.sq_sig_all

    def to_error(self) -> None:
        self.modify(QPAttr(qp_state=6), int(M.IBV_QP_STATE))  # IBV_QPS_ERR

    def flush(self) -> None:  # the device flushes by itself
        pass

    # -- posting ----------------------------------------------------------------------------
    def post_recv(self, wr: Any, bad_wr: Any = None) -> None:
        what = "Failed to post receive"
        wrs = posted_list(wr, bad_wr, RecvWR, what)
        try:
            arr, keep = recv_chain(wrs, max(self.cap.max_recv_sge, 1 << 16), what)
        except PyverbsRDMAError as e:
            raise_at(e, wrs, bad_wr, self.post_recv)
        post(self._post_recv, self._addr, arr, sizeof(ffi.ibv_recv_wr), wrs, bad_wr, what)

    def post_send(self, wr: Any, bad_wr: Any = None) -> None:
        """``ibv_post_send`` of a WR, a chain or a list, every opcode the device has. The
        C WRs live for the call only (providers copy them); the data must stay until the
        completion. On failure ``bad_wr``/``bad_wr_index`` name the first WR not posted."""
        what = "Failed to post send"
        wrs = posted_list(wr, bad_wr, SendWR, what)
        try:
            arr, keep = self._send_chain(wrs, what)
        except PyverbsRDMAError as e:
            raise_at(e, wrs, bad_wr, self.post_send)
        post(self._post_send, self._addr, arr, _SEND_WR_SIZE, wrs, bad_wr, what)
        for w in wrs:  # a type 2 window's new rkey, as the soft MW shows it after a bind
            if w.opcode == _BIND and getattr(w.mw, "mw_type", 1) == 2:
                w.mw.impl._c.rkey = w.bind_rkey

    def _send_chain(self, wrs: list[Any], what: str) -> tuple[Any, list[Any]]:
        arr = (ffi.ibv_send_wr * len(wrs))()
        keep: list[Any] = [arr]
        base = addressof(arr)
        ud = self.qp_type == T.IBV_QPT_UD
        for i, w in enumerate(wrs):
            try:
                self._fill_send(arr[i], w, f"wr[{i}]", what, keep, ud)
            except PyverbsRDMAError as e:
                e.index = i  # type: ignore[attr-defined]
                raise
            if i + 1 < len(wrs):
                arr[i].next = base + (i + 1) * _SEND_WR_SIZE
        return arr, keep

    def _fill_send(self, c: Any, w: Any, f: str, what: str, keep: list[Any], ud: bool) -> None:
        require(w, SendWR, what, f)
        scalars = (w.opcode, w.send_flags, w.wr_id, w.imm_data, w.remote_addr, w.rkey,
                   w.compare_add, w.swap)
        opcode, flags, wr_id, imm, raddr, rkey, cadd, swap = scalars
        if _INT_TYPES.issuperset(map(type, scalars)) and 0 <= opcode <= U32 and \
                0 <= flags <= _SEND_FLAGS and 0 <= wr_id <= U64 and 0 <= imm <= U32 and \
                0 <= raddr <= U64 and 0 <= rkey <= U32 and 0 <= cadd <= U64 and 0 <= swap <= U64:
            opcode, flags = int(opcode), int(flags)  # plain ints (enum tests cost a call)
        else:  # the named checks of the soft QP: the same messages
            opcode, flags, wr_id, imm, raddr, rkey, cadd, swap = \
                check_send_scalars(w, what, f)
        sges, _ = sge_list(w, 1 << 16, what, f)
        if sges and flags & _INLINE:
            sges = [self._host_sge(s) for s in sges]
        c.wr_id, c.opcode, c.send_flags = wr_id, opcode, flags
        if sges:
            sg = sge_array(sges)
            keep.append(sg)
            c.sg_list = addressof(sg)
        c.num_sge = len(sges)
        # immediate data: a host integer, __be32 in C; an rkey to invalidate: host order
        c.imm_data = socket.htonl(imm) if opcode in _IMM_OPS else imm
        if opcode in _RDMA_OPS:
            c.wr.rdma.remote_addr, c.wr.rdma.rkey = raddr, rkey
        elif opcode in _ATOMIC_OPS:
            a = c.wr.atomic
            a.remote_addr, a.compare_add, a.swap, a.rkey = raddr, cadd, swap, rkey
        elif opcode == _BIND:
            self._fill_bind(c, w, f, what)
        if ud:
            if w.ah is None or getattr(w.ah, "closed", True):
                raise PyverbsRDMAError(f"{what}: a UD send needs an address handle "
                                       f"({f}.ah, set by set_wr_ud)", errno.EINVAL)
            c.wr.ud.ah = hw_impl(w.ah, v_ah.AH, HwAH, what, f"{f}.ah")._addr
            c.wr.ud.remote_qpn = as_int(w.remote_qpn, what, f"{f}.remote_qpn", U24,
                                        desc="not a 24-bit QP number")
            c.wr.ud.remote_qkey = as_int(w.remote_qkey, what, f"{f}.remote_qkey", U32)

    def _fill_bind(self, c: Any, w: Any, f: str, what: str) -> None:
        if w.mw is None or w.bind_info is None:
            raise PyverbsRDMAError(f"{what}: {f}.opcode IBV_WR_BIND_MW needs "
                                   f"set_bind_wr(mw, bind_info) ({f}.mw, {f}.bind_info)",
                                   errno.EINVAL)
        mw = hw_impl(w.mw, v_mr.MW, HwMW, what, f"{f}.mw")
        info = require(w.bind_info, MWBindInfo, what, f"{f}.bind_info")
        b = c.bind_mw
        b.mw = mw._addr
        b.rkey = as_int(w.bind_rkey, what, f"{f}.bind_rkey", U32, desc="not a 32-bit key")
        self._fill_bind_info(b.bind_info, info, what, f"{f}.bind_info")

    @staticmethod
    def _fill_bind_info(b: Any, info: Any, what: str, f: str) -> None:
        if info.mr is not None:
            b.mr = hw_impl(info.mr, v_mr.MR, HwMR, what, f"{f}.mr")._addr
        b.addr = as_int(info.addr, what, f"{f}.addr", U64, desc="not a 64-bit address")
        b.length = as_int(info.length, what, f"{f}.length", U64, desc="not a 64-bit length")
        b.mw_access_flags = as_int(info.mw_access_flags, what, f"{f}.mw_access_flags", U32)

    def _host_sge(self, sge: tuple[int, int, int]) -> tuple[int, int, int]:
        """An inline SGE's iova as the real address the provider will copy from."""
        addr, length, lkey = sge
        mr = self._mrs.get(lkey)
        if mr is not None and mr._iova <= addr and addr + length <= mr._iova + len(mr._mv):
            return addr - mr._iova + mr._ptr, length, lkey
        return sge

    def bind_mw(self, mw: Any, mw_bind: Any) -> None:
        """``ibv_bind_mw`` (type 1; the API checked the arguments): the inline's checks,
        then ``context->ops.bind_mw``; ``mw.rkey`` is the new rkey (the provider updates
        it)."""
        what = "Failed to bind MW"
        hw_mw = hw_impl(mw, v_mr.MW, HwMW, what, "mw")
        info = require(mw_bind.bind_info, MWBindInfo, what, "mw_bind.bind_info")
        if info.mr is None and (info.addr or info.length):
            raise PyverbsRDMAError(f"{what}: bind_info has an address range but no MR",
                                   errno.EINVAL)
        if info.mr is not None and getattr(info.mr, "pd", None) is not mw.pd:
            raise PyverbsRDMAError(f"{what}: the MR and the MW are in different PDs", errno.EPERM)
        b = ffi.ibv_mw_bind()
        b.wr_id = as_int(mw_bind.wr_id, what, "mw_bind.wr_id", U64)
        b.send_flags = as_int(mw_bind.send_flags, what, "mw_bind.send_flags", _SEND_FLAGS)
        self._fill_bind_info(b.bind_info, info, what, "mw_bind.bind_info")
        rc = self.context._ops.bind_mw(self._addr, hw_mw._addr, addressof(b))
        if rc:
            raise fail(what, rc)

    def attach_mcast(self, gid: bytes, lid: int) -> None:
        """``ibv_attach_mcast`` on the device (the API checked the QP type and the GID)."""
        self._mcast(ffi.lib().ibv_attach_mcast, gid, lid,
                    "Failed to attach QP to multicast group")

    def detach_mcast(self, gid: bytes, lid: int) -> None:
        """``ibv_detach_mcast`` on the device."""
        self._mcast(ffi.lib().ibv_detach_mcast, gid, lid,
                    "Failed to detach QP from multicast group")

    def _mcast(self, fn: Any, gid: bytes, lid: int, what: str) -> None:
        g = ffi.ibv_gid()
        ctypes_raw = bytes(gid)
        for i, b in enumerate(ctypes_raw):
            g.raw[i] = b
        rc = fn(self._addr, byref(g), lid & 0xFFFF)
        if rc:
            raise fail(what, rc)

    def destroy(self) -> None:
        """``ibv_destroy_qp`` (an error leaves the QP as it was)."""
        rc = ffi.lib().ibv_destroy_qp(self._addr)
        if rc:
            raise fail("Failed to destroy QP", rc)
        self.context._objs.pop(self._addr, None)
        self._addr = None

    def describe(self, closed: bool) -> str:
        if closed:
            return "<QP closed>"
        name = self.qp_type.name.removeprefix("IBV_QPT_") if isinstance(self.qp_type, T) \
            else self.qp_type
        return f"<QP {name} 0x{self.qp_num:x} (libibverbs)>"
