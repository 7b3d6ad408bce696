"""``-R`` (rdma_cm): perftest's rdma_cm mode, in either role.

Read from linux-rdma/perftest v4.5-0.17 (Debian 12's 4.5+0.17): perftest_parameters.c
(``-R`` sets ``work_rdma_cm``, which turns ``use_rdma_cm`` on too), perftest_communication.c
(``create_comm_struct``, ``rdma_client_connect``/``rdma_server_connect``,
``ctx_xchg_data_rdma``, ``rdma_write_keys``/``rdma_read_keys``, ``ctx_close_connection``,
``create_rdma_cm_connection`` and the ``rdma_cm_*`` event handlers) and
perftest_resources.c (``create_rdma_resources``, ``destroy_ctx``, ``rdma_cm_*``).

With ``-R`` there is **no TCP at all**; two kinds of rdma_cm connections, both in the TCP
port space on the ``-p`` port:

1. **The control connection** (``create_comm_struct``): an RC QP of its own (send and
   receive depth 1) connected with ``responder_resources = initiator_depth = 0`` (the
   control context's verb is SEND), ``retry_count`` 7, ``rnr_retry_count`` 7, no private
   data. Each side posts one 56-byte receive before connecting/accepting and another after
   each message it reads. Every record of the TCP exchange (version, page size, cache line,
   MTU, BW reports) travels as one SEND of the record's size, in the same order and with the
   same who-writes-first rule (client writes then reads; server reads then writes); the key
   records are ``struct pingpong_dest`` in binary, 56 bytes big-endian
   (``rdma_write_keys``): lid, out_reads, qpn, psn, rkey (4 bytes each), 4 bytes of
   padding, vaddr (8), the GID (16), srqn and gid_index (4 each; the reader ignores these
   two). The server's listening id is destroyed once it has accepted.
2. **The test's QPs** (``create_rdma_cm_connection``): after a handshake (a record of
   zeros), the client makes one rdma_cm connection per QP (``-q``) to the same port:
   ``responder_resources = initiator_depth = out_reads`` for READ/ATOMIC, else 0,
   ``retry_count`` = ``rnr_retry_count`` = 7; the server accepts each with the same values
   (then ``min_rnr_timer`` 12) and destroys its listener; one more handshake of zeros. The
   key handshakes that follow are the usual ones, but nobody calls ``ctx_connect`` (rdma_cm
   moved the QPs to RTS) and the GID types are not compared.

``ctx_close_connection`` is only its handshake: no "done". At the end the client
disconnects every test QP's id and waits for DISCONNECTED; the server destroys its ids
(which says goodbye on the wire); the control connection goes when the process ends.

softrdma's server listens for the test's connections as soon as the control connection is
accepted (perftest listens only after the first zero handshake, which a quick client can
beat: its REQ then meets a REJ); and the client retries a connection refused, or not
established within 1.5 s, for 5 s, as the TCP client retries its connection.
"""

from __future__ import annotations

import errno
import struct
import time
from typing import Any

from ...errors import PyverbsRDMAError
from ...enums import IBV_QPT_RC
from ...rdmacm import RAI_PASSIVE, RDMA_PS_TCP, AddrInfo, CMEventChannel, CMID, ConnParam
from ...rdmacm import enums as ce
from ...verbs_api import CQ, MR, PD, SGE, QPAttr, QPCap, QPInitAttr, RecvWR, SendWR
from ...verbs_api.enums import (
    ibv_access_flags as A, ibv_qp_attr_mask as M, ibv_send_flags as F, ibv_wr_opcode as O,
)
from ..common import ToolError
from .communication import Dest, PerftestComm
from .parameters import MIN_RNR_TIMER

__all__ = ["CmComm", "DEST_FMT", "DEST_SIZE", "encode_dest", "decode_dest", "CmLink"]

E = ce.rdma_cm_event_type
#: ``struct pingpong_dest`` as rdma_write_keys sends it (HAVE_ENDIAN: big-endian)
DEST_FMT = ">iiiiI4xQ16sIi"
DEST_SIZE = struct.calcsize(DEST_FMT)  # 56
SYNC_SPEC_ID = 5  # perftest's wr_id of the control messages
RETRY_COUNT = 7  # DEF_RETRY_COUNT
CONNECT_TRIES_S = 5.0
ANSWER_S = 1.5  # what a connection attempt waits for ESTABLISHED before the next one

_ERRORS = {E.RDMA_CM_EVENT_ADDR_ERROR, E.RDMA_CM_EVENT_ROUTE_ERROR,
           E.RDMA_CM_EVENT_CONNECT_ERROR, E.RDMA_CM_EVENT_UNREACHABLE,
           E.RDMA_CM_EVENT_REJECTED}


def encode_dest(d: Dest, gid_index: int = 0) -> bytes:
    return struct.pack(DEST_FMT, d.lid, d.out_reads, d.qpn, d.psn, d.rkey & 0xFFFFFFFF,
                       d.vaddr, bytes(d.gid), d.srqn & 0xFFFFFFFF, gid_index)


def decode_dest(msg: bytes) -> Dest:
    """``rdma_read_keys``: lid, out_reads, qpn, psn, rkey, vaddr and the GID (not srqn)."""
    if len(msg) < DEST_SIZE:
        raise ToolError(f"the peer's key record is {len(msg)} bytes, not perftest's "
                        f"{DEST_SIZE}-byte struct pingpong_dest (is it perftest -R or "
                        f"softrdma perf -R, running the same test?)")
    lid, outs, qpn, psn, rkey, vaddr, gid, _srqn, _gidx = struct.unpack(DEST_FMT,
                                                                        msg[:DEST_SIZE])
    return Dest(lid=lid, out_reads=outs, qpn=qpn & 0xFFFFFF, psn=psn & 0xFFFFFF, rkey=rkey,
                vaddr=vaddr, gid=gid, srqn=0)


def _cm_error(what: str, ev: Any) -> ToolError:
    status = ev.status
    hint = ""
    if ev.event_type == E.RDMA_CM_EVENT_REJECTED:
        hint = " (is the server running, with -R, on this port?)"
    elif ev.event_type in (E.RDMA_CM_EVENT_ADDR_ERROR, E.RDMA_CM_EVENT_ROUTE_ERROR):
        hint = " (use the server's RoCE interface IP)"
    return ToolError(f"{what}: {ev.event_str()} (status {status}){hint}")


class CmLink:
    """The rdma_cm side of one test: the control connection and the test's connections,
    on the tool's (manual-mode) soft device."""

    def __init__(self, perf: Any, server: bool, peer: str | None, port: int) -> None:
        self.perf = perf
        self.dev = perf.dev
        self.server = server
        self.peer = peer
        self.port = port
        self.ctl_ch = CMEventChannel()
        self.data_ch = CMEventChannel()
        self.ctl: CMID | None = None
        self.ctl_listener: CMID | None = None
        self.data_listener: CMID | None = None
        self.data_ids: list[CMID] = []
        self.pending_reqs: list[Any] = []
        self.closed = False

    # -- events ---------------------------------------------------------------------------
    def _get(self, ch: CMEventChannel, timeout: float) -> Any | None:
        try:
            return ch.get_cm_event(timeout)
        except PyverbsRDMAError as e:
            if e.error_code == errno.ETIMEDOUT:
                return None
            raise

    def _expect(self, ch: CMEventChannel, cid: CMID, want: int, what: str,
                timeout: float = 10.0, hint: str = "") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ev = self._get(ch, max(left, 0.0)) if left > 0 else None
            if ev is None:
                raise ToolError(f"{what}: no {ce.event_str(want)} in {timeout:.0f} s{hint}")
            if ev.id is not cid.id:
                self._stray(ev)
                continue
            if ev.event_type == want and not ev.status:
                return ev
            raise _cm_error(what, ev)

    def _stray(self, ev: Any) -> None:
        if ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST:
            self.pending_reqs.append(ev)

    # -- the control connection (create_comm_struct + establish_connection) ---------------
    def control_connect(self) -> "CmComm":
        ctl = self._client_connect(self.ctl_ch, ConnParam(resources=0, depth=0,
                                                          retry=RETRY_COUNT, rnr_retry=7),
                                   control=True)
        self.ctl = ctl
        return CmComm(self, client=True)

    def control_accept(self) -> "CmComm":
        lst = CMID(self.ctl_ch, port_space=RDMA_PS_TCP)
        self.ctl_listener = lst
        try:
            lst.bind_addr(AddrInfo(src=self.dev.ip, src_service=str(self.port),
                                   flags=RAI_PASSIVE))
            lst.listen(1)
        except PyverbsRDMAError as e:
            raise ToolError(f"rdma_cm: couldn't listen on {self.dev.ip} port {self.port}: "
                            f"{e}") from None
        while True:
            ev = self._get(self.ctl_ch, 3600.0)
            if ev is not None and ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST:
                break
        ctl = CMID(ev, listen_id=lst)
        self.ctl = ctl
        self._control_qp(ctl)
        ctl.accept(ConnParam(resources=0, depth=0, retry=RETRY_COUNT, rnr_retry=7))
        lst.close()  # rdma_destroy_id(ctx->cm_id_control)
        self.ctl_listener = None
        self.listen_data()
        return CmComm(self, client=False)

    def _control_qp(self, cid: CMID) -> None:
        """The control context: its own PD, a 56-byte receive buffer and a send buffer,
        an RC QP with one send and one receive, a receive posted (post_one_recv_wqe)."""
        ctx = cid.context
        self.cpd = PD(ctx)
        cid.pd = self.cpd
        self.cmr = MR(self.cpd, 2 * 4096, int(A.IBV_ACCESS_LOCAL_WRITE))
        self.cscq = CQ(ctx, 4, None, None, 0)
        self.crcq = CQ(ctx, 4, None, None, 0)
        cid.create_qp(QPInitAttr(qp_type=IBV_QPT_RC, scq=self.cscq, rcq=self.crcq,
                                 cap=QPCap(max_send_wr=1, max_recv_wr=1, max_send_sge=1,
                                           max_recv_sge=1), sq_sig_all=0))
        self.cqp = cid.qp
        self.post_ctl_recv()

    def post_ctl_recv(self) -> None:
        self.cqp.post_recv(RecvWR(SYNC_SPEC_ID, sg=[SGE(self.cmr.buf, DEST_SIZE,
                                                        self.cmr.lkey)]))

    # -- the client's connections -----------------------------------------------------------
    def _client_connect(self, ch: CMEventChannel, param: ConnParam, control: bool,
                        make_qp: Any = None) -> CMID:
        """rdma_resolve_addr, rdma_resolve_route, the QP, rdma_connect, ESTABLISHED;
        a refused or unanswered connection is tried again for 5 s."""
        deadline = time.monotonic() + CONNECT_TRIES_S
        while True:
            cid = CMID(ch, port_space=RDMA_PS_TCP)
            try:
                cid.resolve_addr(AddrInfo(src=self.dev.ip, dst=self.peer,
                                          dst_service=str(self.port)), 2000)
                self._expect(ch, cid, E.RDMA_CM_EVENT_ADDR_RESOLVED, "rdma_resolve_addr")
                cid.resolve_route(2000)
                self._expect(ch, cid, E.RDMA_CM_EVENT_ROUTE_RESOLVED, "rdma_resolve_route")
                if control:
                    self._control_qp(cid)
                else:
                    make_qp(cid)
                cid.connect(param)
                # a REQ that meets no CM at all (the server not started yet) gets no
                # answer, and the CM would send it again only after 6 s: a new one sooner
                left = deadline - time.monotonic()
                self._expect(ch, cid, E.RDMA_CM_EVENT_ESTABLISHED,
                             f"rdma_connect to {self.peer} port {self.port}",
                             timeout=ANSWER_S if left > ANSWER_S else max(left, 0.5) + 2,
                             hint=" (is the server running, with -R, on this port?)")
                return cid
            except ToolError:
                self._close_id(cid)
                if control:
                    for name in ("cpd", "cmr", "cscq", "crcq"):
                        obj = self.__dict__.pop(name, None)
                        if obj is not None and name != "cpd":
                            try:
                                obj.close()
                            except Exception:
                                pass
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    @staticmethod
    def _close_id(cid: CMID) -> None:
        try:
            cid.close()
        except Exception:
            pass

    # -- the test's connections (create_rdma_cm_connection) ------------------------------
    def _conn_param(self) -> ConnParam:
        perf = self.perf
        outs = perf.out_reads if perf.verb in ("read", "atomic") else 0
        return ConnParam(resources=outs, depth=outs, retry=RETRY_COUNT,
                         rnr_retry=RETRY_COUNT)

    def _make_qp(self, cid: CMID) -> None:
        perf = self.perf
        cid.pd = perf.pd
        cid.create_qp(perf.qp_init_attr())

    def listen_data(self) -> None:
        lst = CMID(self.data_ch, port_space=RDMA_PS_TCP)
        lst.pd = self.perf.pd
        lst.bind_addr(AddrInfo(src=self.dev.ip, src_service=str(self.port),
                               flags=RAI_PASSIVE))
        lst.listen(self.perf.a.qp)
        self.data_listener = lst

    def connect_data(self, comm: "CmComm") -> None:
        """create_rdma_cm_connection: a handshake, one connection per QP, a handshake."""
        perf = self.perf
        zero = Dest(out_reads=0)
        comm.hand_shake(zero)
        nq = perf.a.qp
        if self.server:
            lst = self.data_listener
            while len(self.data_ids) < nq:
                if self.pending_reqs:
                    ev = self.pending_reqs.pop(0)
                else:
                    ev = self._get(self.data_ch, 60.0)
                    if ev is None:
                        raise ToolError("rdma_cm: the client's test QPs did not connect "
                                        "in 60 s")
                if ev.event_type != E.RDMA_CM_EVENT_CONNECT_REQUEST:
                    continue
                cid = CMID(ev, listen_id=lst)
                self._make_qp(cid)
                perf.qps.append(cid.qp)
                cid.accept(self._conn_param())
                try:  # perftest sets min_rnr_timer after rdma_accept
                    cid.qp.modify(QPAttr(min_rnr_timer=MIN_RNR_TIMER),
                                  int(M.IBV_QP_MIN_RNR_TIMER))
                except Exception:
                    pass
                self.data_ids.append(cid)
            lst.close()
            self.data_listener = None
        else:
            for _ in range(nq):
                cid = self._client_connect(self.data_ch, self._conn_param(), control=False,
                                           make_qp=self._make_qp)
                perf.qps.append(cid.qp)
                self.data_ids.append(cid)
        comm.hand_shake(zero)

    # -- the end --------------------------------------------------------------------------
    def peer_disconnected(self) -> bool:
        """Whether the control connection got DISCONNECTED (the peer went away)."""
        while self.ctl_ch.pending():
            ev = self._get(self.ctl_ch, 0.0)
            if ev is None:
                break
            if ev.event_type in (E.RDMA_CM_EVENT_DISCONNECTED,
                                 E.RDMA_CM_EVENT_DEVICE_REMOVAL):
                self.ctl_gone = True
        return getattr(self, "ctl_gone", False)

    def close(self) -> None:
        """destroy_ctx: the client disconnects each test QP's id and waits for the
        DISCONNECTED events; the server just destroys its ids."""
        if self.closed:
            return
        self.closed = True
        if not self.server and self.data_ids:
            want = 0
            for cid in self.data_ids:
                try:
                    cid.disconnect()
                    want += 1
                except Exception:
                    pass
            deadline = time.monotonic() + 5.0
            while want and time.monotonic() < deadline:
                ev = self._get(self.data_ch, 0.2)
                if ev is not None and ev.event_type == E.RDMA_CM_EVENT_DISCONNECTED:
                    want -= 1
        for cid in self.data_ids:
            self._close_id(cid)  # with its QP (rdma_destroy_qp + rdma_destroy_id)
        self.data_ids.clear()
        for lst in (self.data_listener, self.ctl_listener):
            if lst is not None:
                self._close_id(lst)
        if self.ctl is not None:
            try:
                self.ctl.disconnect()
            except Exception:
                pass
            self._close_id(self.ctl)
        for name in ("cmr", "cscq", "crcq", "cpd"):
            obj = self.__dict__.get(name)
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    pass
        for ch in (self.ctl_ch, self.data_ch):
            try:
                ch.close()
            except Exception:
                pass


class CmComm(PerftestComm):
    """The exchange over the control connection (``ctx_xchg_data_rdma``): the same
    records as on TCP, each one SEND; the keys as 56-byte binary records."""

    def __init__(self, link: CmLink, client: bool) -> None:
        self.link = link
        self.client = client
        self.pump = link.perf.pump
        self.rem_version = b""
        self.rem_vers = 0.0
        self.sock = None

    def _wait(self, cq: Any, what: str, timeout: float | None) -> Any:
        waited = 0.0
        while True:
            n, wcs = cq.poll(1)
            if n:
                wc = wcs[0]
                if wc.status:
                    raise ToolError(f"rdma_cm control QP: the {what} completed with status "
                                    f"{wc.status} (did the peer exit?)")
                return wc
            if self.link.peer_disconnected():
                raise ToolError(f"the peer disconnected while we waited for its {what} (is "
                                f"it perftest 4.x -R or softrdma perf -R, running the same "
                                f"test?)")
            self.pump(0.01)
            waited += 0.01
            if timeout is not None and waited > timeout:
                raise ToolError(f"no {what} from the peer in {timeout:.0f} s")

    def _send(self, data: bytes) -> None:
        """rdma_write_data: one signaled SEND, waited for."""
        link = self.link
        off = 4096
        link.cmr.mem[off:off + len(data)] = data
        wr = SendWR(SYNC_SPEC_ID, O.IBV_WR_SEND, 1,
                    sg=[SGE(link.cmr.buf + off, len(data), link.cmr.lkey)],
                    send_flags=F.IBV_SEND_SIGNALED)
        link.cqp.post_send(wr)
        self._wait(link.cscq, "send completion", None)

    def _recv(self, n: int, what: str, timeout: float | None = None) -> bytes:
        """rdma_read_data: the next message (copied), then a new receive posted."""
        link = self.link
        wc = self._wait(link.crcq, what, timeout)
        data = bytes(link.cmr.mem[:min(wc.byte_len, DEST_SIZE)])
        link.post_ctl_recv()
        return data[:n].ljust(n, b"\0")

    def hand_shake(self, my: Dest, timeout: float | None = None) -> Dest:
        return decode_dest(self.xchg(encode_dest(my), "key record", timeout))

    def close_connection(self, my: Dest) -> None:
        """ctx_close_connection with rdma_cm: the handshake only."""
        self.hand_shake(my)

    def close(self) -> None:
        pass
