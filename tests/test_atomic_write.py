"""ATOMIC WRITE (IBTA 1.5 annex A19; rxe since Linux 6.2) between two live soft devices over
real UDP on 127.0.2.x: the verbs, the bytes on the wire against the IBTA layout written out
here, the errors rxe gives, a duplicate answered without executing it again, loss, the
initiator depth it takes, and the checker's rules on crafted bad packets.

The expectations come from IBTA and rxe's code: the request is BTH (opcode 0x1D) + RETH
(VA, rkey, DMA length 8) + the 8 bytes; the answer an RDMA READ RESPONSE ONLY without data
at the same PSN (rxe_resp.c send_read_response_ack); the completion IBV_WC_ATOMIC_WRITE with
byte_len 8 (rxe_comp.c); a misaligned address is NAK'd "invalid request" (rxe_mr.c
rxe_mr_do_atomic_write: RESPST_ERR_MISALIGNED_ATOMIC), an rkey without REMOTE_WRITE
"remote access"; a QP without REMOTE_WRITE refuses the opcode (check_qp_attr_access) and
one with max_dest_rd_atomic 0 too (check_resource); librxe refuses the operation on a QP
created without IBV_QP_EX_WITH_ATOMIC_WRITE, and UC/UD QPs cannot have it.

No assertion is about time: waits poll a condition with a generous bound. Neither
Debian's tshark nor scapy decodes opcode 0x1D (both show it as unknown), so the layout is
checked against bytes assembled from the IBTA description in this file.
"""

from __future__ import annotations

import errno
import struct

import pytest

from softrdma.check import check_records
from softrdma.enums import (
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ, IBV_WC_ATOMIC_WRITE,
    IBV_WC_REM_ACCESS_ERR, IBV_WC_REM_INV_REQ_ERR, IBV_WC_SUCCESS, IBV_WR_ATOMIC_WRITE,
    IBV_WR_RDMA_WRITE,
)
from softrdma.harness.testing import Endpoint, connect
from softrdma.verbs_api import MR, Context, QPCap, SendWR
from softrdma.wire.frames import decode_frame
from softrdma.wire.pcap import read_pcap

from . import pcap_mutate as m
from .conftest import wait_until

CAP = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
PSN = 0x100
VALUE = bytes.fromhex("0123456789abcdef")


def _pair(udp_devices, n: int, capture=None, timeout: int = 18, **b_attrs):
    da = udp_devices(f"127.0.2.{2 * n + 1}", f"aw-a{n}", **({"capture": str(capture)}
                                                            if capture else {}))
    db = udp_devices(f"127.0.2.{2 * n + 2}", f"aw-b{n}")
    a = Endpoint(Context(name=da.name), "RC", 1 << 16, CAP, 64)
    b = Endpoint(Context(name=db.name), "RC", 1 << 16, CAP, 64)
    connect(a, b, PSN, PSN, timeout=timeout)
    connect(b, a, PSN, PSN, timeout=timeout, **b_attrs)
    return da, db, a, b


def _atomic_write(a, b, offset: int, value: bytes = VALUE, wr_id: int = 1, rkey=None) -> None:
    wr = SendWR(wr_id)
    wr.set_wr_atomic_write(b.mr.rkey if rkey is None else rkey, b.mr.buf + offset, value)
    a.qp.post_send(wr)


def _wcs(ep, n: int = 1):
    assert wait_until(lambda: len(ep.cq) >= n)
    return ep.cq.poll_all()


def _roce(pcap) -> list[bytes]:
    return [bytes(decode_frame(r.data).payload) for r in read_pcap(pcap)]


def test_atomic_write_lands_and_its_packets_are_ibtas(udp_devices, tmp_path):
    """The 8 bytes land at the address named; request and answer are byte for byte the
    IBTA layouts (ICRC aside); the completion is IBV_WC_ATOMIC_WRITE with 8 bytes."""
    pcap = tmp_path / "a.pcap"
    da, db, a, b = _pair(udp_devices, 0, pcap)
    _atomic_write(a, b, 64)
    (wc,) = _wcs(a)
    assert (wc.status, wc.opcode, wc.byte_len, wc.wr_id) == (IBV_WC_SUCCESS,
                                                             IBV_WC_ATOMIC_WRITE, 8, 1)
    assert b.mr.read(8, 64) == VALUE and b.mr.read(8, 56) == bytes(8)
    da.detach()
    req, resp = _roce(pcap)
    # BTH: opcode, SE/M/Pad/TVer 0, P_Key, resv8 + dest QP, AckReq + PSN; RETH; 8 bytes
    assert req[:-4] == struct.pack("!BBHII", 0x1D, 0, 0xFFFF, b.qp.qp_num, 0x80000000 | PSN) \
        + struct.pack("!QII", b.mr.buf + 64, b.mr.rkey, 8) + VALUE
    # READ RESPONSE ONLY (0x10), AETH ACK with credit 31 and MSN 1, no data
    assert resp[:-4] == struct.pack("!BBHII", 0x10, 0, 0xFFFF, a.qp.qp_num, PSN) \
        + struct.pack("!I", 0x1F << 24 | 1)
    a.close(), b.close()


def test_errors_as_rxe_gives_them(udp_devices):
    """Misaligned: NAK invalid request, nothing written; an MR without REMOTE_WRITE: NAK
    remote access (each moves the QP to ERR, so each gets a pair of its own)."""
    _, _, a, b = _pair(udp_devices, 1)
    _atomic_write(a, b, 12)
    assert [w.status for w in _wcs(a)] == [IBV_WC_REM_INV_REQ_ERR]
    assert b.mr.read(16, 8) == bytes(16)
    _, _, a, b = _pair(udp_devices, 2)
    ro = MR(b.pd, 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ)
    _atomic_write(a, b, 0, rkey=ro.rkey)
    assert [w.status for w in _wcs(a)] == [IBV_WC_REM_ACCESS_ERR]


@pytest.mark.parametrize("attrs", [{"qp_access_flags": IBV_ACCESS_REMOTE_READ},
                                   {"max_dest_rd_atomic": 0}], ids=["no-remote-write",
                                                                    "no-responder-resources"])
def test_responder_qp_refuses_it(udp_devices, attrs):
    """A responder QP without REMOTE_WRITE, or without responder resources, answers an
    ATOMIC WRITE with NAK invalid request (rxe check_op_valid / check_resource)."""
    _, _, a, b = _pair(udp_devices, 3 if "qp_access_flags" in attrs else 4, **attrs)
    _atomic_write(a, b, 0)
    assert [w.status for w in _wcs(a)] == [IBV_WC_REM_INV_REQ_ERR]
    assert b.mr.read(8, 0) == bytes(8)


def test_duplicate_is_answered_not_executed_again(udp_devices, tmp_path):
    """The answer lost: the requester sends the ATOMIC WRITE again; the responder finds it
    among its resources and answers again without writing (oA19-15): a value written
    locally meanwhile survives."""
    pcap = tmp_path / "d.pcap"
    da, db, a, b = _pair(udp_devices, 5, pcap, timeout=20)  # 4.3 s: the write below first
    rule = da.faults.rx.drop("RC_RDMA_READ_RESPONSE_ONLY")
    _atomic_write(a, b, 8)
    assert wait_until(lambda: b.mr.read(8, 8) == VALUE)  # executed once
    b.mr.write(b"LOCAL!!!", 8, 8)  # the responder's own store, after the ATOMIC WRITE
    (wc,) = _wcs(a, 1)
    assert wc.status == IBV_WC_SUCCESS and len(rule.hits) == 1
    assert b.mr.read(8, 8) == b"LOCAL!!!"  # the duplicate did not write again
    assert db.counters.duplicate_request == 1
    da.detach()
    ops = [(p[0], int.from_bytes(p[9:12], "big")) for p in _roce(pcap)]
    # a's capture: the request, its resend and the second answer (the first answer was
    # dropped on a's receive side, before the capture point)
    assert ops == [(0x1D, PSN), (0x1D, PSN), (0x10, PSN)]
    assert db.counters.sent_pkts == 2  # the answer, then the replayed answer


def test_lost_request_is_sent_again(udp_devices):
    """The request itself lost: the retransmit timer sends it again, it executes once."""
    da, db, a, b = _pair(udp_devices, 6)
    rule = da.faults.tx.drop("RC_ATOMIC_WRITE")
    _atomic_write(a, b, 16)
    (wc,) = _wcs(a)
    assert wc.status == IBV_WC_SUCCESS and len(rule.hits) == 1
    assert b.mr.read(8, 16) == VALUE and db.counters.duplicate_request == 0


def test_it_takes_an_initiator_depth_credit(udp_devices, tmp_path):
    """max_rd_atomic 1: the second ATOMIC WRITE waits for the first's answer (rxe counts it
    like a READ or an atomic), while a WRITE behind it would not wait for anything."""
    pcap = tmp_path / "c.pcap"
    da = udp_devices("127.0.2.15", "aw-a7", capture=str(pcap))
    db = udp_devices("127.0.2.16", "aw-b7")
    a = Endpoint(Context(name=da.name), "RC", 1 << 16, CAP, 64)
    b = Endpoint(Context(name=db.name), "RC", 1 << 16, CAP, 64)
    connect(a, b, PSN, PSN, max_rd_atomic=1)
    connect(b, a, PSN, PSN)
    with da.lock:  # both posted before the first can leave
        _atomic_write(a, b, 0, wr_id=1)
        _atomic_write(a, b, 8, bytes(range(8)), wr_id=2)
    assert [w.status for w in _wcs(a, 2)] == [IBV_WC_SUCCESS] * 2
    da.detach()
    ops = [(p[0], int.from_bytes(p[9:12], "big")) for p in _roce(pcap)]
    assert ops == [(0x1D, PSN), (0x10, PSN), (0x1D, PSN + 1), (0x10, PSN + 1)]


def test_send_ops_flags_and_qp_types(udp_devices):
    """pyverbs' extended QP: the operation needs IBV_QP_EX_WITH_ATOMIC_WRITE (else the
    batch fails, EINVAL); a UD QP cannot ask for it (EOPNOTSUPP), nor post it (EINVAL)."""
    from softrdma.errors import PyverbsRDMAError
    from softrdma.pyverbs_compat.qp import QPEx, QPInitAttrEx
    from softrdma.pyverbs_compat.pd import PD as CPD
    from softrdma.pyverbs_compat.device import Context as CContext
    from softrdma.pyverbs_compat.cq import CQ as CCQ
    from softrdma.enums import IBV_QPT_RC, IBV_QPT_UD
    db = udp_devices("127.0.2.17", "aw-x")
    ctx = CContext(name=db.name)
    pd, cq = CPD(ctx), CCQ(ctx, 8)
    init = dict(scq=cq, rcq=cq, pd=pd, comp_mask=1 | 64)
    with pytest.raises(PyverbsRDMAError) as e:
        QPEx(ctx, QPInitAttrEx(qp_type=IBV_QPT_UD, send_ops_flags=1 << 12, **init))
    assert e.value.error_code == errno.EOPNOTSUPP
    qp = QPEx(ctx, QPInitAttrEx(qp_type=IBV_QPT_RC, send_ops_flags=1 << 0, **init))
    qp.wr_start()
    qp.wr_atomic_write(0, 0, VALUE)
    with pytest.raises(PyverbsRDMAError) as e:
        qp.wr_complete()
    assert e.value.error_code == errno.EINVAL
    _, _, a, b = _pair(udp_devices, 9)
    wr = SendWR(1, opcode=IBV_WR_ATOMIC_WRITE, sg=[a.sge(0, 4)])  # 4 bytes, not 8
    with pytest.raises(PyverbsRDMAError) as e:
        a.qp.post_send(wr)
    assert e.value.error_code == errno.EINVAL
    ctx.close()


def test_check_rules_fire_on_crafted_packets(udp_devices, tmp_path):
    """A clean exchange has no violation; the same with the ATOMIC WRITE shortened,
    misaligned, answered with data or with an ATOMIC ACKNOWLEDGE breaks the rule that
    says so."""
    pcap = tmp_path / "k.pcap"
    da, db, a, b = _pair(udp_devices, 10, pcap)
    w = SendWR(1, opcode=IBV_WR_RDMA_WRITE, sg=[a.sge(0, 32)])
    w.set_wr_rdma(b.mr.rkey, b.mr.buf)
    a.qp.post_send(w)
    assert [x.status for x in _wcs(a)] == [IBV_WC_SUCCESS]  # answered before the next
    _atomic_write(a, b, 32, wr_id=2)
    assert [x.status for x in _wcs(a)] == [IBV_WC_SUCCESS]
    da.detach()
    recs = m.load(pcap)
    assert [p[0] for p in _roce(pcap)] == [0x0A, 0x11, 0x1D, 0x10]

    def rules(records):
        return sorted({v.rule for v in check_records(records).violations})
    assert rules(recs) == []
    assert rules(m.edit(recs, 3, payload=VALUE[:4])) == ["ATOMIC-WRITE-FORM"]
    assert rules(m.edit(recs, 3, va=b.mr.buf + 36)) == ["ATOMIC-WRITE-FORM"]
    assert rules(m.edit(recs, 4, payload=b"\0" * 8)) == ["A19-RESPONSE"]
    assert "A19-RESPONSE" in rules(m.edit(recs, 4, opcode=0x12, orig=0))


def test_a_short_atomic_write_payload_is_nakd_not_a_fault(udp_devices, tmp_path):
    """An ATOMIC WRITE whose payload is not the 8 bytes it stores (the fuzzer sent one of
    4 with a RETH length of 4: the 8-byte store raised, the QP was faulted with a traceback) is a
    length error: NAK invalid request (AETH 0x61), as for a WRITE of the wrong length."""
    import socket
    import time
    pcap = tmp_path / "s.pcap"
    da, db, a, b = _pair(udp_devices, 11, pcap)
    _atomic_write(a, b, 0)
    assert [x.status for x in _wcs(a)] == [IBV_WC_SUCCESS]
    recs = m.load(pcap)
    i = next(k for k, r in enumerate(_roce(pcap), 1) if r[0] == 0x1D)
    short = m.edit(recs, i, payload=VALUE[:4], dma_len=4, psn=PSN + 1)  # a consistent RETH
    frame = decode_frame(short[i - 1].data)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((da.ip, 0))
        s.sendto(bytes(frame.payload), (db.ip, 4791))
    deadline = time.monotonic() + 10
    naks: list = []
    while not naks and time.monotonic() < deadline:
        time.sleep(0.05)
        naks = [r for r in _roce(pcap) if r[0] == 0x11 and r[12] == 0x61]
    assert naks, [r[0] for r in _roce(pcap)]
    assert db.counters.qp_fatal == 0
