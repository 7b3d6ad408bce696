"""Negative tests of the data path: every error completion and NAK.

Each test checks both sides' completions (status and wr_id), both QPs' states, what went on
the wire where it matters, and that no byte of any MR changed outside the range the
operation was allowed to write (MRs are filled with random bytes and snapshotted before).

Crafted packets are built with :func:`softrdma.wire.packet.build` and handed to a device
with ``device.receive`` (through ``datapath_helpers.inject``, which fills the ICRC); what a
responder answers is captured by replacing its device's ``transmit``.

IBV_WC_LOC_LEN_ERR is never produced (rxe has no path to it either).
"""

from __future__ import annotations

import random

import pytest

from softrdma.enums import *  # noqa: F401,F403
from softrdma.enums import ibv_qp_state as S
from softrdma.qp.params import rnr_nak_seconds
from softrdma.harness.sim import SimNetwork
from softrdma.verbs_api import MR, PD
from softrdma.wire.headers import NakCode
from softrdma.wire.opcodes import Opcode as O
from softrdma.wire.packet import build

# every test twice: packet by packet, then with trains (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("link_mode")

from .datapath_helpers import U64, Wire, inject, pair

RTS, ERR = S.IBV_QPS_RTS, S.IBV_QPS_ERR
MTU = 1024
RECV = 512 * 1024  # receive buffers live here in every test
TGT = 256 * 1024  # RDMA targets


# -- helpers --------------------------------------------------------------------------------
def rc(seed: int = 1, **kw):
    net = SimNetwork(seed=seed)
    return net, pair(net, "RC", **kw)


def fill(*mrs) -> None:
    rng = random.Random(len(mrs))
    for m in mrs:
        m.mem[:] = rng.randbytes(len(m.mem))


def snap(*mrs) -> list[bytes]:
    return [bytes(m.mem) for m in mrs]


def only_changed(before: bytes, mr, allowed: list[tuple[int, int]] = ()) -> None:
    """Every byte of ``mr`` outside the ``[start, end)`` offsets in ``allowed`` is as in
    ``before``."""
    after = bytes(mr.mem)
    assert len(after) == len(before)
    pos = 0
    for s, e in sorted(allowed) + [(len(after), len(after))]:
        if after[pos:s] != before[pos:s]:
            bad = next(i for i in range(pos, s) if after[i] != before[i])
            pytest.fail(f"MR byte at offset {bad:#x} changed outside the permitted ranges "
                        f"{allowed}")
        pos = max(pos, e)


def wcs(ep) -> list[tuple[int, int]]:
    return [(w.wr_id, w.status) for w in ep.cq.poll_all()] if len(ep.cq) else []


def naks(wire: Wire) -> list[tuple[int, int]]:
    """(syndrome, psn) of every ACKNOWLEDGE the device sent."""
    return [(p.syndrome, p.psn) for p in wire.pkts if p.opcode == O.RC_ACKNOWLEDGE]


def resp_state(ep) -> tuple:
    r = ep.qp.engine.resp
    return (ep.qp.qp_state, r.psn, r.ack_psn, r.msn, r.opcode, r.sent_psn_nak, r.drop_msg,
            len(ep.qp.rq), len(ep.cq), ep.qp.engine.req.psn, ep.qp.engine.comp.psn)


# ------------------------------------------------------------------------------------------
# RNR
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["SEND", "WRITE_IMM"])
def test_rnr_nak_then_success_once_a_receive_is_posted(op):
    net, p = rc(b_attrs={"min_rnr_timer": 12})
    with p as (a, b):
        fill(a.mr, b.mr)
        before_a, before_b = snap(a.mr, b.mr)
        wa, wb = Wire(a.device), Wire(b.device)
        if op == "SEND":
            a.post_send(IBV_WR_SEND, a.sge(0, 3000), 1)
        else:
            a.post_send(IBV_WR_RDMA_WRITE_WITH_IMM, a.sge(0, 3000), 1, remote_offset=TGT,
                        imm=0x77)
        net.run(until=net.now + 5e-3)
        # no completion anywhere, both QPs fine
        assert wcs(a) == [] and wcs(b) == []
        assert a.qp.qp_state == RTS and b.qp.qp_state == RTS
        first = wa.pkts[0].psn
        # a SEND needs the receive WQE at its FIRST packet; a WRITE_WITH_IMM only at its
        # LAST (the FIRST and MIDDLE are executed and their bytes land)
        rnr_psn = first if op == "SEND" else (first + 2) & 0xFFFFFF
        if op == "SEND":
            only_changed(before_b, b.mr)
        else:
            only_changed(before_b, b.mr, [(TGT, TGT + 2 * MTU)])
            assert b.mr.read(2 * MTU, TGT) == a.mr.read(2 * MTU, 0)
        # RNR NAK: syndrome 0x20 | min_rnr_timer, carrying the PSN of the request that found
        # no receive WQE; the packets behind it are out of sequence (one PSN NAK each time)
        rnrs = [x for x in naks(wb) if x[0] & 0x60 == 0x20]
        n = len(rnrs)
        assert rnrs == [(0x20 | 12, rnr_psn)] * n
        assert 5 <= n <= 5e-3 / rnr_nak_seconds(12) + 1
        assert set(naks(wb)) - set(rnrs) <= {(NakCode.PSN_SEQ_ERROR, rnr_psn), (0x1F, first),
                                             (0x1F, (first + 1) & 0xFFFFFF)}
        assert b.device.counters.send_rnr_err == n and a.device.counters.rcvd_rnr_err == n
        b.post_recv(b.sge(RECV, 4096), 9)
        net.run()
        assert wcs(a) == [(1, IBV_WC_SUCCESS)]
        (wc,) = b.cq.poll_all()
        assert (wc.wr_id, wc.status, wc.byte_len) == (9, IBV_WC_SUCCESS, 3000)
        assert a.qp.qp_state == RTS and b.qp.qp_state == RTS
        assert a.device.counters.retry_rnr_exceeded_err == 0
        if op == "SEND":
            assert b.mr.read(3000, RECV) == a.mr.read(3000, 0)
            only_changed(before_b, b.mr, [(RECV, RECV + 3000)])
        else:
            assert wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM and wc.imm_data == 0x77
            assert b.mr.read(3000, TGT) == a.mr.read(3000, 0)
            only_changed(before_b, b.mr, [(TGT, TGT + 3000)])
        only_changed(before_a, a.mr)


@pytest.mark.parametrize("timer", [1, 12, 31])
def test_rnr_retry_exceeded_after_exactly_rnr_retry_plus_one_tries(timer):
    net, p = rc(a_attrs={"rnr_retry": 2}, b_attrs={"min_rnr_timer": timer})
    with p as (a, b):
        fill(a.mr, b.mr)
        before_a, before_b = snap(a.mr, b.mr)
        wa, wb = Wire(a.device), Wire(b.device)
        a.post_send(IBV_WR_SEND, a.sge(0, 100), 1)
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 100), 2, remote_offset=TGT)
        t0 = net.now
        net.run()
        assert wcs(a) == [(1, IBV_WC_RNR_RETRY_EXC_ERR), (2, IBV_WC_WR_FLUSH_ERR)]
        assert a.qp.qp_state == ERR
        # the responder saw nothing wrong: RNR is not an error there
        assert b.qp.qp_state == RTS and wcs(b) == []
        sends = [p for p in wa.pkts if p.opcode == O.RC_SEND_ONLY]
        assert len(sends) == 3 and len({p.psn for p in sends}) == 1
        # the WRITE behind the SEND arrives out of sequence each time: never executed
        assert [x for x in naks(wb) if x[0] & 0x60 == 0x20] == [(0x20 | timer, sends[0].psn)] * 3
        assert set(naks(wb)) <= {(0x20 | timer, sends[0].psn),
                                 (NakCode.PSN_SEQ_ERROR, sends[0].psn)}
        assert b.device.counters.send_rnr_err == 3
        assert a.device.counters.rcvd_rnr_err == 3
        assert a.device.counters.retry_rnr_exceeded_err == 1
        # each retry follows the RNR NAK (one round trip of 2 x 10 us) by exactly rxe's
        # rnrnak_usec[timer]
        times = [t for t, p_ in zip(wa.times, wa.pkts) if p_.opcode == O.RC_SEND_ONLY]
        for t1, t2 in zip(times, times[1:]):
            assert t2 - t1 == pytest.approx(20e-6 + rnr_nak_seconds(timer), rel=1e-9)
        assert times[0] == t0
        only_changed(before_a, a.mr)
        only_changed(before_b, b.mr)


# ------------------------------------------------------------------------------------------
# REM_ACCESS_ERR: rkey, range, MR access rights, PD
# ------------------------------------------------------------------------------------------
ACCESS_CASES = {
    # name: (opcode, how the remote key/offset is chosen, MR2 access or None)
    "write_bad_key_byte": (IBV_WR_RDMA_WRITE, "stale", None),
    "read_unknown_rkey": (IBV_WR_RDMA_READ, "unknown", None),
    "atomic_bad_key_byte": (IBV_WR_ATOMIC_FETCH_AND_ADD, "stale", None),
    "write_imm_bad_rkey": (IBV_WR_RDMA_WRITE_WITH_IMM, "stale", None),
    "write_out_of_range": (IBV_WR_RDMA_WRITE, "end", None),
    "read_out_of_range": (IBV_WR_RDMA_READ, "end", None),
    "atomic_out_of_range": (IBV_WR_ATOMIC_CMP_AND_SWP, "end", None),
    "write_before_mr": (IBV_WR_RDMA_WRITE, "before", None),
    "write_mr_without_remote_write": (IBV_WR_RDMA_WRITE, "mr2",
                                      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ
                                      | IBV_ACCESS_REMOTE_ATOMIC),
    "read_mr_without_remote_read": (IBV_WR_RDMA_READ, "mr2",
                                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE
                                    | IBV_ACCESS_REMOTE_ATOMIC),
    "atomic_mr_without_remote_atomic": (IBV_WR_ATOMIC_FETCH_AND_ADD, "mr2",
                                        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE
                                        | IBV_ACCESS_REMOTE_READ),
    "write_rkey_of_another_pd": (IBV_WR_RDMA_WRITE, "pd2", None),
    "read_rkey_of_another_pd": (IBV_WR_RDMA_READ, "pd2", None),
}


@pytest.mark.parametrize("case", list(ACCESS_CASES))
def test_remote_access_error(case):
    op, how, mr2_access = ACCESS_CASES[case]
    net, p = rc()
    with p as (a, b):
        mr2 = None
        if how == "mr2":
            mr2 = MR(b.pd, 64 * 1024, mr2_access)
        elif how == "pd2":
            mr2 = MR(PD(b.ctx), 64 * 1024, ALL_ACCESS)
        fill(a.mr, b.mr, *([mr2] if mr2 else []))
        before = snap(a.mr, b.mr, *([mr2] if mr2 else []))
        b.post_recv(b.sge(RECV, 4096), 50)
        b.post_recv(b.sge(RECV + 4096, 4096), 51)
        wb = Wire(b.device)
        atomic = op in (IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_ATOMIC_CMP_AND_SWP)
        # (a WRITE_ONLY_WITH_IMM takes its receive WQE before the rkey check; a multi-packet
        # one would fail at its FIRST packet, which takes none)
        n = 8 if atomic else 100 if op == IBV_WR_RDMA_WRITE_WITH_IMM else 2048
        if how == "end":
            off = b.mr.length - (n // 2 if not atomic else 0)  # straddles / past the end
        elif how == "before":
            off = -64
        else:
            off = TGT
        rkey = {"stale": b.mr.rkey ^ 0x5A, "unknown": 0x00FFFF00 | (b.mr.rkey & 0xFF)}.get(how)
        if mr2 is not None:
            rkey = mr2.rkey
            off = mr2.buf - b.mr.buf + 1024
        a.post_send(op, a.sge(0, n), 1, remote_offset=off, rkey=rkey, compare_add=1, swap=2,
                    imm=5)
        a.post_send(IBV_WR_SEND, a.sge(0, 10), 2)
        net.run()
        assert wcs(a) == [(1, IBV_WC_REM_ACCESS_ERR), (2, IBV_WC_WR_FLUSH_ERR)]
        assert a.qp.qp_state == ERR
        # the responder NAKs the first packet with "remote access error" and goes to ERR;
        # a WRITE_WITH_IMM had taken a receive WQE: it completes with the error
        req_psn = a.qp.attr.sq_psn
        assert naks(wb) == [(NakCode.REMOTE_ACCESS_ERROR, req_psn)]
        assert len(wb.raw) == 1
        assert b.qp.qp_state == ERR
        exp_b = [(50, IBV_WC_REM_ACCESS_ERR), (51, IBV_WC_WR_FLUSH_ERR)] \
            if op == IBV_WR_RDMA_WRITE_WITH_IMM else \
            [(50, IBV_WC_WR_FLUSH_ERR), (51, IBV_WC_WR_FLUSH_ERR)]
        assert wcs(b) == exp_b
        for bf, m in zip(before, [a.mr, b.mr] + ([mr2] if mr2 else [])):
            only_changed(bf, m)


ALL_ACCESS = (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
              | IBV_ACCESS_REMOTE_ATOMIC)


# ------------------------------------------------------------------------------------------
# REM_INV_REQ_ERR
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op,qp_access,dest_rd", [
    (IBV_WR_RDMA_READ, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC, 4),
    (IBV_WR_RDMA_WRITE, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC, 4),
    (IBV_WR_RDMA_WRITE_WITH_IMM, IBV_ACCESS_REMOTE_READ, 4),
    (IBV_WR_ATOMIC_CMP_AND_SWP, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE, 4),
    (IBV_WR_RDMA_READ, ALL_ACCESS & ~IBV_ACCESS_LOCAL_WRITE, 0),  # max_dest_rd_atomic 0
    (IBV_WR_ATOMIC_FETCH_AND_ADD, ALL_ACCESS & ~IBV_ACCESS_LOCAL_WRITE, 0),
], ids=["read_no_qp_remote_read", "write_no_qp_remote_write", "write_imm_no_qp_remote_write",
        "cas_no_qp_remote_atomic", "read_no_responder_resources",
        "faa_no_responder_resources"])
def test_invalid_request_opcode_not_allowed(op, qp_access, dest_rd):
    net, p = rc(b_attrs={"qp_access_flags": qp_access, "max_dest_rd_atomic": dest_rd})
    with p as (a, b):
        fill(a.mr, b.mr)
        before_a, before_b = snap(a.mr, b.mr)
        b.post_recv(b.sge(RECV, 4096), 50)
        wb = Wire(b.device)
        n = 8 if op in (IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD) else 100
        a.post_send(op, a.sge(0, n), 1, remote_offset=TGT)
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 10), 2, remote_offset=TGT)
        net.run()
        assert wcs(a) == [(1, IBV_WC_REM_INV_REQ_ERR), (2, IBV_WC_WR_FLUSH_ERR)]
        assert naks(wb) == [(NakCode.INVALID_REQUEST, a.qp.attr.sq_psn)]
        assert a.qp.qp_state == ERR and b.qp.qp_state == ERR
        # the opcode check comes before the receive WQE is taken: it is only flushed
        assert wcs(b) == [(50, IBV_WC_WR_FLUSH_ERR)]
        only_changed(before_a, a.mr)
        only_changed(before_b, b.mr)


def test_invalid_request_misaligned_atomic_injected():
    """post_send refuses a misaligned atomic (EINVAL), so craft the request: the responder
    answers one NAK "invalid request" with the request's PSN, executes nothing and goes to
    ERR (rxe RESPST_ERR_MISALIGNED_ATOMIC, class C)."""
    from softrdma.errors import PyverbsRDMAError
    net, p = rc()
    with p as (a, b):
        fill(a.mr, b.mr)
        with pytest.raises(PyverbsRDMAError):
            a.post_send(IBV_WR_ATOMIC_FETCH_AND_ADD, a.sge(0, 8), 1, remote_offset=TGT + 4)
        before_a, before_b = snap(a.mr, b.mr)
        b.post_recv(b.sge(RECV, 64), 50)
        wb = Wire(b.device, deliver=False)
        psn = b.qp.engine.resp.psn
        raw = build(O.RC_FETCH_ADD, psn=psn, dest_qp=b.qp.qp_num, ackreq=True,
                    va=b.mr.buf + TGT + 4, rkey=b.mr.rkey, swap_add=1)
        inject(b.device, raw, a.device.ip_packed)
        assert naks(wb) == [(NakCode.INVALID_REQUEST, psn)]
        assert len(wb.raw) == 1
        assert b.qp.qp_state == ERR and wcs(b) == [(50, IBV_WC_WR_FLUSH_ERR)]
        assert a.qp.qp_state == RTS and wcs(a) == []
        only_changed(before_a, a.mr)
        only_changed(before_b, b.mr)


def test_invalid_request_receive_buffer_too_small():
    """A SEND larger than the receive WQE: the responder completes that receive with
    REM_INV_REQ_ERR, NAKs "invalid request", the requester completes REM_INV_REQ_ERR.
    (rxe itself reaches RESPST_ERR_MALFORMED_WQE here, see the report of this test.)"""
    net, p = rc()
    with p as (a, b):
        fill(a.mr, b.mr)
        before_a, before_b = snap(a.mr, b.mr)
        b.post_recv(b.sge(RECV, 100), 50)
        b.post_recv(b.sge(RECV + 4096, 4096), 51)
        wb = Wire(b.device)
        a.post_send(IBV_WR_SEND, a.sge(0, 200), 1)
        a.post_send(IBV_WR_SEND, a.sge(0, 10), 2)
        net.run()
        assert wcs(a) == [(1, IBV_WC_REM_INV_REQ_ERR), (2, IBV_WC_WR_FLUSH_ERR)]
        assert naks(wb) == [(NakCode.INVALID_REQUEST, a.qp.attr.sq_psn)]
        assert wcs(b) == [(50, IBV_WC_REM_INV_REQ_ERR), (51, IBV_WC_WR_FLUSH_ERR)]
        assert a.qp.qp_state == ERR and b.qp.qp_state == ERR
        only_changed(before_a, a.mr)
        # at most the 100 bytes of the receive buffer may have been written
        only_changed(before_b, b.mr, [(RECV, RECV + 100)])


@pytest.mark.parametrize("kind", ["missing_first", "first_not_mtu", "only_over_mtu",
                                  "write_len_mismatch"])
def test_invalid_request_opcode_sequence_and_length_injected(kind):
    """Class C errors found by check_op_seq / check_length / check_rkey's length rules:
    NAK "invalid request" with the packet's PSN, responder QP to ERR, receive WQE (if one was
    taken) completed REM_INV_REQ_ERR."""
    net, p = rc()
    with p as (a, b):
        fill(a.mr, b.mr)
        before_a, before_b = snap(a.mr, b.mr)
        b.post_recv(b.sge(RECV, 8192), 50)
        wb = Wire(b.device, deliver=False)
        psn = b.qp.engine.resp.psn
        kw = dict(psn=psn, dest_qp=b.qp.qp_num, ackreq=True)
        took_wqe = True
        if kind == "missing_first":
            raw = build(O.RC_SEND_MIDDLE, payload=bytes(MTU), **kw)
            took_wqe = False
        elif kind == "first_not_mtu":
            raw = build(O.RC_SEND_FIRST, payload=bytes(100), **kw)
        elif kind == "only_over_mtu":
            raw = build(O.RC_SEND_ONLY, payload=bytes(MTU + 4), **kw)
        else:
            raw = build(O.RC_RDMA_WRITE_ONLY, va=b.mr.buf + TGT, rkey=b.mr.rkey, dma_len=64,
                        payload=bytes(60), **kw)
            took_wqe = False
        inject(b.device, raw, a.device.ip_packed)
        assert naks(wb) == [(NakCode.INVALID_REQUEST, psn)]
        assert b.qp.qp_state == ERR
        assert wcs(b) == [(50, IBV_WC_REM_INV_REQ_ERR if took_wqe else IBV_WC_WR_FLUSH_ERR)]
        assert a.qp.qp_state == RTS and wcs(a) == []
        only_changed(before_a, a.mr)
        only_changed(before_b, b.mr)


# ------------------------------------------------------------------------------------------
# REM_OP_ERR
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["lkey", "range"])
def test_remote_operational_error_bad_receive_wqe(bad):
    """The receive WQE names memory it may not write: responder LOC_QP_OP_ERR
    (RESPST_ERR_MALFORMED_WQE), NAK "remote operational error", requester REM_OP_ERR."""
    net, p = rc()
    with p as (a, b):
        fill(a.mr, b.mr)
        before_a, before_b = snap(a.mr, b.mr)
        from softrdma.verbs_api import SGE
        if bad == "lkey":
            sge = SGE(b.mr.buf + RECV, 4096, b.mr.lkey ^ 0x33)
        else:
            sge = SGE(b.mr.buf + b.mr.length - 50, 4096, b.mr.lkey)
        b.post_recv(sge, 50)
        b.post_recv(b.sge(RECV + 8192, 4096), 51)
        wb = Wire(b.device)
        a.post_send(IBV_WR_SEND_WITH_IMM, a.sge(0, 100), 1, imm=3)
        a.post_send(IBV_WR_RDMA_READ, a.sge(4096, 100), 2, remote_offset=TGT)
        net.run()
        assert wcs(a) == [(1, IBV_WC_REM_OP_ERR), (2, IBV_WC_WR_FLUSH_ERR)]
        assert naks(wb) == [(NakCode.REMOTE_OPERATIONAL_ERROR, a.qp.attr.sq_psn)]
        assert wcs(b) == [(50, IBV_WC_LOC_QP_OP_ERR), (51, IBV_WC_WR_FLUSH_ERR)]
        assert a.qp.qp_state == ERR and b.qp.qp_state == ERR
        only_changed(before_a, a.mr)
        only_changed(before_b, b.mr)


@pytest.mark.parametrize("syndrome,status", [
    (NakCode.INVALID_REQUEST, IBV_WC_REM_INV_REQ_ERR),
    (NakCode.REMOTE_ACCESS_ERROR, IBV_WC_REM_ACCESS_ERR),
    (NakCode.REMOTE_OPERATIONAL_ERROR, IBV_WC_REM_OP_ERR),
    (NakCode.INVALID_RD_REQUEST, IBV_WC_REM_OP_ERR),  # rxe: "unexpected nak" -> REM_OP_ERR
])
def test_completer_nak_codes_injected(syndrome, status):
    """The requester's side of each NAK code, fed directly: the responder's real ACK is
    swallowed and a NAK for the outstanding PSN is injected instead."""
    net, p = rc()
    with p as (a, b):
        fill(a.mr, b.mr)
        before_b = bytes(b.mr.mem)
        b.post_recv(b.sge(RECV, 4096), 50)
        b.post_recv(b.sge(RECV + 4096, 4096), 51)
        wb = Wire(b.device, deliver=False)
        a.post_send(IBV_WR_SEND, a.sge(0, 100), 1)
        a.post_send(IBV_WR_SEND, a.sge(0, 100), 2)
        net.run(until=net.now + 1e-3)  # well before the 67 ms retransmit timeout
        assert len(wb.raw) == 2 and wcs(b) == [(50, IBV_WC_SUCCESS), (51, IBV_WC_SUCCESS)]
        before_a = bytes(a.mr.mem)
        psn = a.qp.attr.sq_psn
        nak = build(O.RC_ACKNOWLEDGE, psn=psn, dest_qp=a.qp.qp_num, syndrome=syndrome, msn=0)
        inject(a.device, nak, b.device.ip_packed)
        assert wcs(a) == [(1, status), (2, IBV_WC_WR_FLUSH_ERR)]
        assert a.qp.qp_state == ERR and b.qp.qp_state == RTS and wcs(b) == []
        only_changed(before_a, a.mr)
        only_changed(before_b, b.mr, [(RECV, RECV + 100), (RECV + 4096, RECV + 4196)])


# ------------------------------------------------------------------------------------------
# LOC_PROT_ERR
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["bad_lkey", "out_of_range", "second_sge_bad"])
def test_local_protection_error_on_gather(case):
    from softrdma.verbs_api import SGE
    net, p = rc()
    with p as (a, b):
        fill(a.mr, b.mr)
        before_a, before_b = snap(a.mr, b.mr)
        b.post_recv(b.sge(RECV, 8192), 50)
        b.post_recv(b.sge(RECV + 8192, 8192), 51)
        wa = Wire(a.device)
        allowed_b = []
        if case == "bad_lkey":
            a.post_send(IBV_WR_SEND, SGE(a.mr.buf, 100, a.mr.lkey ^ 0x01), 1)
        elif case == "out_of_range":
            a.post_send(IBV_WR_RDMA_WRITE, SGE(a.mr.buf + a.mr.length - 50, 100, a.mr.lkey), 1,
                        remote_offset=TGT)
        elif case == "second_sge_bad":
            # 3 packets; the second needs the bad SGE: the FIRST goes out and lands
            a.post_send(IBV_WR_SEND, [a.sge(0, 1500), SGE(a.mr.buf, 1500, 0xDEAD00)], 1)
            allowed_b = [(RECV, RECV + MTU)]
        a.post_send(IBV_WR_SEND, a.sge(0, 10), 2)
        net.run()
        assert wcs(a) == [(1, IBV_WC_LOC_PROT_ERR), (2, IBV_WC_WR_FLUSH_ERR)]
        assert a.qp.qp_state == ERR
        # nothing of the failed message was sent (except the packets before the bad SGE)
        assert len(wa.raw) == (1 if case == "second_sge_bad" else 0)
        assert b.qp.qp_state == RTS and wcs(b) == []
        only_changed(before_a, a.mr)
        only_changed(before_b, b.mr, allowed_b)
        if allowed_b:
            assert b.mr.read(MTU, RECV) == a.mr.read(MTU, 0)


@pytest.mark.parametrize("op", [IBV_WR_RDMA_READ, IBV_WR_ATOMIC_FETCH_AND_ADD])
def test_local_protection_error_result_into_mr_without_local_write(op):
    """A read or atomic whose local buffer lies in an MR without LOCAL_WRITE: the remote
    side executes it (an atomic takes effect there), the response cannot be placed:
    LOC_PROT_ERR and the rest flushed."""
    net, p = rc()
    with p as (a, b):
        ro = MR(a.pd, 8192, IBV_ACCESS_REMOTE_READ)  # no LOCAL_WRITE
        fill(a.mr, b.mr)
        ro.mem[:] = random.Random(9).randbytes(8192)
        before_a, before_b, before_ro = snap(a.mr, b.mr, ro)
        from softrdma.verbs_api import SGE
        n = 8 if op == IBV_WR_ATOMIC_FETCH_AND_ADD else 3000
        a.post_send(op, SGE(ro.buf + 64, n, ro.lkey), 1, remote_offset=TGT, compare_add=5)
        a.post_send(IBV_WR_SEND, a.sge(0, 10), 2)
        net.run()
        assert wcs(a) == [(1, IBV_WC_LOC_PROT_ERR), (2, IBV_WC_WR_FLUSH_ERR)]
        assert a.qp.qp_state == ERR and b.qp.qp_state == RTS and wcs(b) == []
        only_changed(before_a, a.mr)
        only_changed(before_ro, ro)
        if op == IBV_WR_ATOMIC_FETCH_AND_ADD:
            (orig,) = U64.unpack_from(before_b, TGT)
            assert U64.unpack_from(bytes(b.mr.mem), TGT)[0] == (orig + 5) % 2**64
            only_changed(before_b, b.mr, [(TGT, TGT + 8)])
        else:
            only_changed(before_b, b.mr)


# ------------------------------------------------------------------------------------------
# RETRY_EXC_ERR and WR_FLUSH_ERR
# ------------------------------------------------------------------------------------------
def test_retry_exceeded_link_dies_mid_message():
    """The link dies after the first two packets of a 5-packet WRITE arrived: RETRY_EXC_ERR
    after retry_cnt=3 retries (each resending from the first unacknowledged PSN), the rest
    flushed; the responder keeps the two packets' bytes and stays in RTS."""
    net, p = rc(a_attrs={"retry_cnt": 3, "timeout": 10})
    with p as (a, b):
        fill(a.mr, b.mr)
        before_a, before_b = snap(a.mr, b.mr)
        wa = Wire(a.device, drop=lambda i, pkt: i >= 2)
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 5 * MTU), 1, remote_offset=TGT)
        a.post_send(IBV_WR_RDMA_READ, a.sge(8 * MTU, 64), 2, remote_offset=TGT)
        a.post_send(IBV_WR_SEND, a.sge(0, 1), 3, flags=0)
        net.run()
        assert wcs(a) == [(1, IBV_WC_RETRY_EXC_ERR), (2, IBV_WC_WR_FLUSH_ERR),
                          (3, IBV_WC_WR_FLUSH_ERR)]
        assert a.qp.qp_state == ERR and b.qp.qp_state == RTS and wcs(b) == []
        first = a.qp.attr.sq_psn
        # 7 packets in the first round, then 3 retries of everything but nothing is acked
        # (the FIRST/MIDDLE carried no AckReq): go-back-N from the first PSN each time
        psns = [pkt.psn for pkt in wa.pkts]
        assert len(psns) == 7 * 4 and psns == psns[:7] * 4 and psns[0] == first
        assert a.device.counters.completer_retry_err == 3
        # posting after the error: flushed at once, nothing sent
        a.post_send(IBV_WR_SEND, a.sge(0, 1), 4)
        assert wcs(a) == [(4, IBV_WC_WR_FLUSH_ERR)] and len(wa.raw) == 28
        only_changed(before_a, a.mr)
        assert b.mr.read(2 * MTU, TGT) == a.mr.read(2 * MTU, 0)
        only_changed(before_b, b.mr, [(TGT, TGT + 2 * MTU)])


def test_flush_on_both_queues_after_an_error():
    """After an error completion: every outstanding send WR and, on a QP that went to ERR,
    every posted receive is completed with WR_FLUSH_ERR, in order, exactly once."""
    net, p = rc()
    with p as (a, b):
        fill(a.mr, b.mr)
        for i in range(3):
            b.post_recv(b.sge(RECV + i * 4096, 4096), 50 + i)
            a.post_recv(a.sge(RECV + i * 4096, 4096), 60 + i)
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 10), 1, remote_offset=TGT, rkey=0)
        for i in range(2, 6):
            a.post_send(IBV_WR_SEND, a.sge(0, 10), i, flags=0 if i % 2 else IBV_SEND_SIGNALED)
        net.run()
        assert wcs(a) == [(1, IBV_WC_REM_ACCESS_ERR)] + \
            [(i, IBV_WC_WR_FLUSH_ERR) for i in range(2, 6)] + \
            [(60 + i, IBV_WC_WR_FLUSH_ERR) for i in range(3)]
        assert wcs(b) == [(50 + i, IBV_WC_WR_FLUSH_ERR) for i in range(3)]
        assert a.qp.qp_state == ERR and b.qp.qp_state == ERR
        b.post_recv(b.sge(RECV, 64), 99)
        assert wcs(b) == [(99, IBV_WC_WR_FLUSH_ERR)]
        net.run()
        assert wcs(a) == [] and wcs(b) == []


# ------------------------------------------------------------------------------------------
# PSN sequence errors (responder side)
# ------------------------------------------------------------------------------------------
def test_psn_sequence_error_one_nak_then_silence_until_the_expected_psn():
    net, p = rc()
    with p as (a, b):
        fill(a.mr, b.mr)
        before_b = bytes(b.mr.mem)
        for i in range(4):
            b.post_recv(b.sge(RECV + i * 4096, 4096), 50 + i)
        wb = Wire(b.device, deliver=False)
        exp = b.qp.engine.resp.psn
        src = a.device.ip_packed

        def send(psn, data, ackreq=True):
            inject(b.device, build(O.RC_SEND_ONLY, psn=psn, dest_qp=b.qp.qp_num,
                                   ackreq=ackreq, payload=data), src)

        send((exp + 2) & 0xFFFFFF, b"x" * 10)
        assert naks(wb) == [(NakCode.PSN_SEQ_ERROR, exp)]
        send((exp + 3) & 0xFFFFFF, b"y" * 10)
        send((exp + 2) & 0xFFFFFF, b"x" * 10)
        send((exp + 1000) & 0xFFFFFF, b"z" * 10)
        assert len(wb.raw) == 1  # silence
        # rxe counts RXE_CNT_OUT_OF_SEQ_REQ once per NAK; the silent drops are counted apart
        assert b.device.counters.out_of_seq_request == 1
        assert b.device.counters.drops == {"psn_out_of_seq": 3}
        assert wcs(b) == [] and b.qp.qp_state == RTS
        only_changed(before_b, b.mr)
        # the expected PSN arrives: executed and acknowledged; a new gap gets a new NAK
        send(exp, b"A" * 10)
        assert naks(wb)[1:] == [(0x1F, exp)]
        send((exp + 5) & 0xFFFFFF, b"q" * 10)
        assert naks(wb)[2:] == [(NakCode.PSN_SEQ_ERROR, (exp + 1) & 0xFFFFFF)]
        send((exp + 1) & 0xFFFFFF, b"B" * 10)
        assert [(w.wr_id, w.status, w.byte_len) for w in b.cq.poll_all()] == \
            [(50, IBV_WC_SUCCESS, 10), (51, IBV_WC_SUCCESS, 10)]
        assert b.mr.read(10, RECV) == b"A" * 10 and b.mr.read(10, RECV + 4096) == b"B" * 10
        only_changed(before_b, b.mr, [(RECV, RECV + 10), (RECV + 4096, RECV + 4096 + 10)])
        assert b.device.counters.out_of_seq_request == 2
        assert b.device.counters.drops == {"psn_out_of_seq": 3}
        assert b.qp.qp_state == RTS and a.qp.qp_state == RTS and wcs(a) == []


def test_psn_sequence_nak_across_the_wrap():
    """Expected PSN 0xFFFFFF, a request with PSN 1 is ahead (not a duplicate): NAK 0xFFFFFF."""
    net, p = rc(psns=(0xFFFFFF, 0))
    with p as (a, b):
        b.post_recv(b.sge(RECV, 64), 50)
        wb = Wire(b.device, deliver=False)
        assert b.qp.engine.resp.psn == 0xFFFFFF
        inject(b.device, build(O.RC_SEND_ONLY, psn=1, dest_qp=b.qp.qp_num, ackreq=True,
                               payload=b"zz"), a.device.ip_packed)
        assert naks(wb) == [(NakCode.PSN_SEQ_ERROR, 0xFFFFFF)]
        assert b.device.counters.out_of_seq_request == 1
        assert b.device.counters.duplicate_request == 0


# ------------------------------------------------------------------------------------------
# Duplicates
# ------------------------------------------------------------------------------------------
def _exchange(op, n=3000, **kw):
    """Run one operation A -> B to completion with both wires tapped; return the pieces."""
    net, p = rc()
    ctx = p.__enter__()
    a, b = ctx
    fill(a.mr, b.mr)
    wa, wb = Wire(a.device), Wire(b.device)
    b.post_recv(b.sge(RECV, 8192), 50)
    b.post_recv(b.sge(RECV + 8192, 8192), 51)
    a.post_send(op, a.sge(0, n), 1, remote_offset=TGT, **kw)
    net.run()
    return net, p, a, b, wa, wb


@pytest.mark.parametrize("op", [IBV_WR_SEND, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM])
def test_duplicate_send_or_write_is_acked_not_executed(op):
    net, p, a, b, wa, wb = _exchange(op, imm=7)
    try:
        assert wcs(a) == [(1, IBV_WC_SUCCESS)]
        assert [w for w, _ in wcs(b)] == ([50] if op != IBV_WR_RDMA_WRITE else [])
        requests = list(wa.raw)
        assert len(requests) == 3
        # the application reuses the memory: a re-execution would show
        region = (RECV, RECV + 3000) if op == IBV_WR_SEND else (TGT, TGT + 3000)
        b.mr.mem[region[0]:region[1]] = bytes(3000)
        before_b = bytes(b.mr.mem)
        state = resp_state(b)
        wb.clear()
        wb.deliver = False
        for raw in requests:  # replay the whole message, as a go-back-N retry would
            b.device.receive(raw, a.device.ip_packed, b.device.ip_packed,
                             sport=a.qp.engine.src_port)
        # every duplicate is re-ACKed with the PSN of the last executed request (C9-105)
        last = requests[-1]
        from softrdma.wire.packet import parse
        lpsn = parse(last).psn
        assert naks(wb) == [(0x1F, lpsn)] * 3
        assert b.device.counters.duplicate_request == 3
        assert resp_state(b) == state and wcs(b) == []
        assert bytes(b.mr.mem) == before_b
        assert b.qp.qp_state == RTS and a.qp.qp_state == RTS
    finally:
        p.__exit__(None, None, None)


def test_duplicate_read_is_replayed_with_the_same_bytes():
    net, p, a, b, wa, wb = _exchange(IBV_WR_RDMA_READ, n=3000)
    try:
        assert wcs(a) == [(1, IBV_WC_SUCCESS)]
        assert a.mr.read(3000, 0) == b.mr.read(3000, TGT)
        (req,) = wa.raw
        responses = list(wb.raw)
        assert [p_.opcode for p_ in wb.pkts] == [O.RC_RDMA_READ_RESPONSE_FIRST,
                                                 O.RC_RDMA_READ_RESPONSE_MIDDLE,
                                                 O.RC_RDMA_READ_RESPONSE_LAST]
        before_a, before_b = snap(a.mr, b.mr)
        state = resp_state(b)
        wb.clear()
        wb.deliver = False
        sport = a.qp.engine.src_port
        b.device.receive(req, a.device.ip_packed, b.device.ip_packed, sport=sport)
        assert wb.raw == responses  # byte for byte
        # a retry of the tail (what the requester sends after the FIRST arrived)
        from softrdma.wire.packet import parse
        r = parse(req)
        tail = build(O.RC_RDMA_READ_REQUEST, psn=(r.psn + 1) & 0xFFFFFF, dest_qp=r.dest_qp,
                     ackreq=True, va=r.va + MTU, rkey=r.rkey, dma_len=r.dma_len - MTU)
        wb.clear()
        inject(b.device, tail, a.device.ip_packed, sport=sport)
        assert wb.raw == responses[1:]
        # a "duplicate" asking for more than was read is dropped (class D)
        wb.clear()
        bigger = build(O.RC_RDMA_READ_REQUEST, psn=r.psn, dest_qp=r.dest_qp, ackreq=True,
                       va=r.va, rkey=r.rkey, dma_len=r.dma_len + 8)
        inject(b.device, bigger, a.device.ip_packed, sport=sport)
        assert wb.raw == []
        assert b.device.counters.drops.get("duplicate_read_mismatch") == 1
        assert resp_state(b) == state and wcs(b) == []
        assert snap(a.mr, b.mr) == [before_a, before_b]
    finally:
        p.__exit__(None, None, None)


@pytest.mark.parametrize("op", [IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_ATOMIC_CMP_AND_SWP])
def test_duplicate_atomic_replays_the_saved_value_and_never_executes_twice(op):
    net, p = rc()
    with p as (a, b):
        fill(a.mr, b.mr)
        (orig,) = U64.unpack_from(b.mr.mem, TGT)
        wa, wb = Wire(a.device), Wire(b.device)
        a.post_send(op, a.sge(0, 8), 1, remote_offset=TGT, compare_add=orig if
                    op == IBV_WR_ATOMIC_CMP_AND_SWP else 3, swap=0x1234)
        net.run()
        assert wcs(a) == [(1, IBV_WC_SUCCESS)]
        assert U64.unpack_from(a.mr.mem, 0)[0] == orig
        new = 0x1234 if op == IBV_WR_ATOMIC_CMP_AND_SWP else (orig + 3) % 2**64
        assert U64.unpack_from(b.mr.mem, TGT)[0] == new
        (req,) = wa.raw
        (ack,) = wb.pkts
        assert ack.opcode == O.RC_ATOMIC_ACKNOWLEDGE and ack.orig == orig
        # the application changes the word: a re-execution would both change it and
        # report the new value as "original"
        U64.pack_into(b.mr.mem, TGT, 0xAAAA)
        before_b = bytes(b.mr.mem)
        state = resp_state(b)
        wb.clear()
        wb.deliver = False
        for _ in range(2):
            b.device.receive(req, a.device.ip_packed, b.device.ip_packed,
                             sport=a.qp.engine.src_port)
        assert [(x.opcode, x.psn, x.orig) for x in wb.pkts] == \
            [(O.RC_ATOMIC_ACKNOWLEDGE, ack.psn, orig)] * 2
        assert bytes(b.mr.mem) == before_b
        assert resp_state(b) == state and wcs(b) == []
        assert b.device.counters.duplicate_request == 2
        assert a.qp.qp_state == RTS and b.qp.qp_state == RTS and wcs(a) == []
        assert U64.unpack_from(a.mr.mem, 0)[0] == orig  # the replies were not delivered


def test_duplicate_atomic_whose_resource_was_recycled_is_dropped():
    """With max_dest_rd_atomic 1, a later read reuses the only responder resource: a stale
    duplicate of the atomic is then dropped (class D), never executed."""
    net, p = rc(a_attrs={"max_rd_atomic": 1}, b_attrs={"max_dest_rd_atomic": 1})
    with p as (a, b):
        fill(a.mr, b.mr)
        wa = Wire(a.device)
        a.post_send(IBV_WR_ATOMIC_FETCH_AND_ADD, a.sge(0, 8), 1, remote_offset=TGT,
                    compare_add=1)
        a.post_send(IBV_WR_RDMA_READ, a.sge(64, 16), 2, remote_offset=TGT + 64)
        net.run()
        assert wcs(a) == [(1, IBV_WC_SUCCESS), (2, IBV_WC_SUCCESS)]
        before_b = bytes(b.mr.mem)
        wb = Wire(b.device, deliver=False)
        b.device.receive(wa.raw[0], a.device.ip_packed, b.device.ip_packed,
                         sport=a.qp.engine.src_port)
        assert wb.raw == [] and bytes(b.mr.mem) == before_b
        assert b.device.counters.drops == {"duplicate_without_resource": 1}


# ------------------------------------------------------------------------------------------
# Malformed and hostile packets
# ------------------------------------------------------------------------------------------
HOSTILE = ["truncated_bth", "truncated_reth", "unknown_opcode", "bad_pad", "bad_icrc",
           "wrong_qpn", "qpn_zero", "wrong_pkey", "tver", "wrong_source", "wrong_destination",
           "wrong_transport", "ud_opcode_to_rc", "cnp"]


@pytest.mark.parametrize("case", HOSTILE)
def test_malformed_or_hostile_packet_is_counted_and_dropped(case):
    net, p = rc()
    with p as (a, b):
        fill(a.mr, b.mr)
        b.post_recv(b.sge(RECV, 4096), 50)
        before_a, before_b = snap(a.mr, b.mr)
        wb = Wire(b.device, deliver=False)
        psn = b.qp.engine.resp.psn
        src, qpn = a.device.ip_packed, b.qp.qp_num
        good = dict(psn=psn, dest_qp=qpn, ackreq=True)
        icrc, dst = True, None
        write = build(O.RC_RDMA_WRITE_ONLY, va=b.mr.buf + TGT, rkey=b.mr.rkey, dma_len=16,
                      payload=bytes(16), **good)
        expect_reason = {"truncated_bth": "malformed_truncated",
                         "truncated_reth": "malformed_truncated",
                         "unknown_opcode": "malformed_unknown_opcode",
                         "bad_pad": "malformed_bad_pad", "bad_icrc": "bad_icrc",
                         "wrong_qpn": "no_qp", "qpn_zero": "qp0", "wrong_pkey": "bad_pkey",
                         "tver": "bad_tver", "wrong_source": "wrong_source",
                         "wrong_destination": "not_our_address",
                         "wrong_transport": "wrong_transport",
                         "ud_opcode_to_rc": "wrong_transport", "cnp": "cnp_ignored"}[case]
        if case == "truncated_bth":
            raw = bytes(write[:10])
            icrc = False
        elif case == "truncated_reth":
            raw = build(O.RC_RDMA_WRITE_ONLY, **good)[:12 + 8] + bytes(4)  # RETH cut short
            icrc = False
        elif case == "unknown_opcode":
            raw = bytearray(write)
            raw[0] = 0x1E
        elif case == "bad_pad":
            raw = build(O.RC_SEND_ONLY, payload=b"", **good)
            raw[1] |= 3 << 4  # pad count 3, but no byte between the BTH and the ICRC
        elif case == "bad_icrc":
            raw = bytearray(write)
            icrc = False  # keep the zero ICRC build() left
        elif case == "wrong_qpn":
            raw = build(O.RC_SEND_ONLY, payload=b"hi", **dict(good, dest_qp=0xABCDE))
        elif case == "qpn_zero":
            raw = build(O.RC_SEND_ONLY, payload=b"hi", **dict(good, dest_qp=0))
        elif case == "wrong_pkey":
            raw = build(O.RC_SEND_ONLY, payload=b"hi", pkey=0x8001, **good)
        elif case == "tver":
            raw = build(O.RC_SEND_ONLY, payload=b"hi", tver=1, **good)
        elif case == "wrong_source":
            raw = build(O.RC_SEND_ONLY, payload=b"hi", **good)
            src = bytes([10, 99, 99, 99])
        elif case == "wrong_destination":
            raw = build(O.RC_SEND_ONLY, payload=b"hi", **good)
            dst = bytes([10, 99, 99, 98])
        elif case == "wrong_transport":
            raw = build(O.UC_SEND_ONLY, payload=b"hi", **good)
        elif case == "ud_opcode_to_rc":
            raw = build(O.UD_SEND_ONLY, payload=b"hi", qkey=0x11111111, src_qp=7, **good)
        else:
            raw = build(O.CNP, dest_qp=qpn)
        state_b, state_a = resp_state(b), resp_state(a)
        c = b.device.counters
        before_counts = (c.rcvd_pkts, c.dropped_pkts, c.icrc_err, c.malformed_pkts)
        inject(b.device, raw, src, icrc=icrc, dst_ip=dst)  # must not raise
        assert c.rcvd_pkts == before_counts[0] + 1
        assert c.dropped_pkts == before_counts[1] + 1
        assert c.drops == {expect_reason: 1}
        assert c.icrc_err == before_counts[2] + (case == "bad_icrc")
        assert c.malformed_pkts == before_counts[3] + expect_reason.startswith("malformed")
        assert wb.raw == []  # no answer
        assert resp_state(b) == state_b and resp_state(a) == state_a
        assert b.qp.qp_state == RTS and a.qp.qp_state == RTS
        only_changed(before_a, a.mr)
        only_changed(before_b, b.mr)
        # the QP is unharmed: the real packet is still accepted
        inject(b.device, write, a.device.ip_packed)
        assert naks(wb) == [(0x1F, psn)]
        assert b.mr.read(16, TGT) == bytes(16)


def test_corrupted_bit_anywhere_is_caught():
    """Flip every bit of a valid request in turn: the packet is dropped every time (ICRC, or
    the header parse when the flip breaks it), except the BTH byte-4 bits (FECN, BECN,
    resv6), which the ICRC masks on purpose; those leave the packet valid."""
    net, p = rc()
    with p as (a, b):
        fill(a.mr, b.mr)
        wb = Wire(b.device, deliver=False)
        psn = b.qp.engine.resp.psn
        raw = build(O.RC_RDMA_WRITE_ONLY, psn=psn, dest_qp=b.qp.qp_num, ackreq=True,
                    va=b.mr.buf + TGT, rkey=b.mr.rkey, dma_len=8, payload=b"ABCDEFGH")
        from softrdma.wire.icrc import set_icrc_ipv4
        sport = 0xC0DE
        set_icrc_ipv4(raw, a.device.ip_packed, b.device.ip_packed, sport)
        before_b = bytes(b.mr.mem)
        c = b.device.counters
        accepted = 0
        for i in range(len(raw) * 8):
            bad = bytearray(raw)
            bad[i // 8] ^= 1 << (i % 8)
            d0 = c.dropped_pkts
            b.device.receive(bytes(bad), a.device.ip_packed, b.device.ip_packed, sport=sport)
            if i // 8 == 4:
                accepted += c.dropped_pkts == d0
            else:
                assert c.dropped_pkts == d0 + 1, f"bit {i} flipped went through"
        # the 8 byte-4 variants were accepted: the first executed, 7 were duplicates
        assert accepted == 8 and c.duplicate_request == 7
        assert b.mr.read(8, TGT) == b"ABCDEFGH"
        only_changed(before_b, b.mr, [(TGT, TGT + 8)])
        assert c.icrc_err + c.malformed_pkts == c.dropped_pkts == len(raw) * 8 - 8
        assert b.qp.qp_state == RTS and len(wb.raw) == 8


def test_send_with_invalidate_kills_the_remote_type2_window():
    """SEND_WITH_INV names a type 2 window bound at the responder: the responder invalidates
    it before completing the receive (IBV_WC_WITH_INV, invalidated_rkey), and the window's
    rkey no longer grants access. An rkey that names no window is rxe's class J error: the
    responder completes the receive with REM_INV_REQ_ERR and moves to ERR, but still ACKs
    the packet (rxe_resp.c RESPST_ERR_INVALIDATE_RKEY keeps the ACK syndrome), so the
    requester's send succeeds."""
    from softrdma.enums import (
        IBV_ACCESS_REMOTE_READ, IBV_MW_TYPE_2, IBV_QPS_ERR, IBV_SEND_SIGNALED, IBV_WC_BIND_MW,
        IBV_WC_REM_ACCESS_ERR, IBV_WC_REM_INV_REQ_ERR, IBV_WC_SUCCESS, IBV_WC_WITH_INV,
        IBV_WR_BIND_MW, IBV_WR_RDMA_READ, IBV_WR_SEND_WITH_INV,
    )
    from softrdma.harness.sim import SimNetwork
    from softrdma.harness.testing import connected_pair
    from softrdma.verbs_api import MW, MWBindInfo, SendWR

    net = SimNetwork(seed=5)
    a, b = connected_pair(net, "RC")
    mw = MW(b.pd, IBV_MW_TYPE_2)
    bind = SendWR(wr_id=1, opcode=IBV_WR_BIND_MW, send_flags=IBV_SEND_SIGNALED)
    bind.set_bind_wr(mw, MWBindInfo(b.mr, b.mr.buf, 4096, IBV_ACCESS_REMOTE_READ))
    b.qp.post_send(bind)
    net.run()
    assert [(w.status, w.opcode) for w in b.cq.poll_all()] == [(IBV_WC_SUCCESS, IBV_WC_BIND_MW)]
    rkey = mw.rkey
    # the window works before the invalidation
    a.post_send(IBV_WR_RDMA_READ, a.sge(0, 64), 2, remote_offset=0, rkey=rkey)
    net.run()
    assert [w.status for w in a.cq.poll_all()] == [IBV_WC_SUCCESS]
    b.post_recv(b.sge(8192, 256), 3)
    inv = SendWR(wr_id=4, opcode=IBV_WR_SEND_WITH_INV, sg=[a.sge(0, 16)],
                 send_flags=IBV_SEND_SIGNALED)
    inv.invalidate_rkey = rkey
    a.qp.post_send(inv)
    net.run()
    assert [w.status for w in a.cq.poll_all()] == [IBV_WC_SUCCESS]
    (wc,) = b.cq.poll_all()
    assert wc.status == IBV_WC_SUCCESS and wc.wc_flags & IBV_WC_WITH_INV
    assert wc.invalidated_rkey == rkey
    # the window's rkey is dead now: a READ through it is a remote access error
    a.post_send(IBV_WR_RDMA_READ, a.sge(0, 64), 5, remote_offset=0, rkey=rkey)
    net.run()
    assert [w.status for w in a.cq.poll_all()] == [IBV_WC_REM_ACCESS_ERR]

    # an rkey that names no window: only the responder sees the error (rxe's class J)
    a2, b2 = connected_pair(net, "RC")
    b2.post_recv(b2.sge(0, 256), 6)
    bad = SendWR(wr_id=7, opcode=IBV_WR_SEND_WITH_INV, sg=[a2.sge(0, 16)],
                 send_flags=IBV_SEND_SIGNALED)
    bad.invalidate_rkey = b2.mr.rkey  # an MR, not a type 2 window
    a2.qp.post_send(bad)
    net.run()
    assert [w.status for w in a2.cq.poll_all()] == [IBV_WC_SUCCESS]
    (rwc,) = b2.cq.poll_all()
    assert rwc.status == IBV_WC_REM_INV_REQ_ERR and rwc.wr_id == 6
    assert b2.qp.qp_state == IBV_QPS_ERR
    assert b2.device.counters.qp_fatal == 0 and b.device.counters.qp_fatal == 0
