"""FLUSH (IBTA 1.5 annex A19; rxe since Linux 6.2) between two live soft devices over real
UDP on 127.0.2.x: the bytes on the wire (BTH, FETH, RETH, no payload; rxe's ICRC), the
placement types and selectivity levels with rxe's access checks, what "persistent" does on
a soft device, ordering behind earlier WRITEs, a duplicate answered without flushing again,
the device capabilities, the send-ops flag, and the checker's rules.

Expectations from IBTA and rxe's code: the FETH word is 26 reserved bits, the selectivity
level (bits 5-4) and the placement type (bits 3-0, 1 global, 2 persistent); the answer is
an RDMA READ RESPONSE ONLY without data (rxe send_read_response_ack); the completion is
IBV_WC_FLUSH with byte_len the FLUSH's length (rxe_comp.c: wqe->dma.length); the QP's and
the MR's FLUSH access bits must cover the placement type (rxe_resp.c check_qp_attr_access:
else NAK invalid request; check_rkey: else NAK remote access); at level MR no range is
checked, at level range the range must lie in the MR. Linux 6.12's rxe computes a FLUSH's
ICRC over its headers twice and drops one with IBTA's (seen in the lab,
tests/interop/test_atomic_write_interop.py): the value is derived here from the IBTA ICRC
of the captured packet by that rule.
"""

from __future__ import annotations

import errno
import mmap
import struct
import zlib

import pytest

from softrdma.check import check_records
from softrdma.enums import (
    IBV_ACCESS_FLUSH_GLOBAL, IBV_ACCESS_FLUSH_PERSISTENT, IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_ATOMIC, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE, IBV_FLUSH_GLOBAL,
    IBV_FLUSH_MR, IBV_FLUSH_PERSISTENT, IBV_FLUSH_RANGE, IBV_WC_FLUSH, IBV_WC_REM_ACCESS_ERR,
    IBV_WC_REM_INV_REQ_ERR, IBV_WC_SUCCESS, IBV_WR_RDMA_WRITE,
)
from softrdma.errors import PyverbsRDMAError
from softrdma.harness.testing import Endpoint, connect
from softrdma.verbs_api import MR, Context, QPCap, SendWR
from softrdma.wire.frames import decode_frame
from softrdma.wire.icrc import icrc_from_ip_packet
from softrdma.wire.pcap import read_pcap

from . import pcap_mutate as m
from .conftest import wait_until

CAP = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
PSN = 0x200
QP_ACCESS = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC | \
    IBV_ACCESS_FLUSH_GLOBAL | IBV_ACCESS_FLUSH_PERSISTENT
MR_GLOBAL = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_FLUSH_GLOBAL


class SpyMap(mmap.mmap):
    """An mmap that records its msyncs (what a persistent FLUSH does) and what the memory
    held at each."""

    def __init__(self, *a, **k) -> None:
        self.calls: list[tuple[int, int, bytes]] = []

    def flush(self, offset: int = 0, size: int = 0) -> None:
        self.calls.append((offset, size, self[:]))
        super().flush(offset, size)


def _pair(udp_devices, n: int, capture=None, timeout: int = 18, b_access=QP_ACCESS):
    da = udp_devices(f"127.0.2.{2 * n + 101}", f"fl-a{n}", **({"capture": str(capture)}
                                                              if capture else {}))
    db = udp_devices(f"127.0.2.{2 * n + 102}", f"fl-b{n}")
    a = Endpoint(Context(name=da.name), "RC", 1 << 16, CAP, 64)
    b = Endpoint(Context(name=db.name), "RC", 1 << 16, CAP, 64)
    connect(a, b, PSN, PSN, timeout=timeout, qp_access_flags=QP_ACCESS)
    connect(b, a, PSN, PSN, timeout=timeout, qp_access_flags=b_access)
    return da, db, a, b


def _flush(a, mr, offset: int, length: int, ptype: int, level: int, wr_id: int = 1) -> None:
    wr = SendWR(wr_id)
    wr.set_wr_flush(mr.rkey, mr.buf + offset, length, ptype, level)
    a.qp.post_send(wr)


def _wcs(ep, n: int = 1):
    assert wait_until(lambda: len(ep.cq) >= n)
    return ep.cq.poll_all()


def test_flush_packets_and_completion(udp_devices, tmp_path):
    """A global FLUSH of a range: BTH + FETH (level 0, type 1) + RETH, no payload, with
    rxe's ICRC; answered by a READ RESPONSE ONLY without data; IBV_WC_FLUSH, 100 bytes."""
    pcap = tmp_path / "f.pcap"
    da, db, a, b = _pair(udp_devices, 0, pcap)
    mr = MR(b.pd, 4096, MR_GLOBAL)
    _flush(a, mr, 64, 100, IBV_FLUSH_GLOBAL, IBV_FLUSH_RANGE)
    (wc,) = _wcs(a)
    assert (wc.status, wc.opcode, wc.byte_len) == (IBV_WC_SUCCESS, IBV_WC_FLUSH, 100)
    da.detach()
    (req_rec, resp_rec) = list(read_pcap(pcap))
    req = bytes(decode_frame(req_rec.data).payload)
    resp = bytes(decode_frame(resp_rec.data).payload)
    assert req[:-4] == struct.pack("!BBHII", 0x1C, 0, 0xFFFF, b.qp.qp_num, 0x80000000 | PSN) \
        + struct.pack("!I", 0 << 4 | 1) + struct.pack("!QII", mr.buf + 64, mr.rkey, 100)
    ibta = icrc_from_ip_packet(decode_frame(req_rec.data).ip_packet)
    assert int.from_bytes(req[-4:], "little") == zlib.crc32(req[:-4], ibta)  # rxe's
    assert resp[:-4] == struct.pack("!BBHII", 0x10, 0, 0xFFFF, a.qp.qp_num, PSN) \
        + struct.pack("!I", 0x1F << 24 | 1)
    assert int.from_bytes(resp[-4:], "little") == \
        icrc_from_ip_packet(decode_frame(resp_rec.data).ip_packet)  # IBTA's


@pytest.mark.parametrize("case, ptype, level, offset, length, want", [
    ("mr-level-any-length", IBV_FLUSH_GLOBAL, IBV_FLUSH_MR, 0, 12345678, IBV_WC_SUCCESS),
    ("range-past-the-mr", IBV_FLUSH_GLOBAL, IBV_FLUSH_RANGE, 4000, 200, IBV_WC_REM_ACCESS_ERR),
    ("persistent-into-global-mr", IBV_FLUSH_PERSISTENT, IBV_FLUSH_RANGE, 0, 64,
     IBV_WC_REM_ACCESS_ERR),
], ids=lambda v: v if isinstance(v, str) else None)
def test_levels_types_and_mr_access(udp_devices, case, ptype, level, offset, length, want):
    """rxe's checks of the MR: level MR flushes the whole region whatever the length, a
    range must lie in the MR, the MR's access must cover the placement type."""
    n = {"mr-level-any-length": 1, "range-past-the-mr": 2, "persistent-into-global-mr": 3}[case]
    _, _, a, b = _pair(udp_devices, n)
    mr = MR(b.pd, 4096, MR_GLOBAL)
    _flush(a, mr, offset, length, ptype, level)
    (wc,) = _wcs(a)
    assert wc.status == want
    if want == IBV_WC_SUCCESS:
        assert (wc.opcode, wc.byte_len) == (IBV_WC_FLUSH, length)


def test_qp_without_flush_access_refuses_it(udp_devices):
    """A responder QP without IBV_ACCESS_FLUSH_GLOBAL: NAK invalid request (rxe
    check_qp_attr_access), whatever the MR allows."""
    _, _, a, b = _pair(udp_devices, 4, b_access=IBV_ACCESS_REMOTE_WRITE)
    mr = MR(b.pd, 4096, MR_GLOBAL)
    _flush(a, mr, 0, 64, IBV_FLUSH_GLOBAL, IBV_FLUSH_RANGE)
    assert [w.status for w in _wcs(a)] == [IBV_WC_REM_INV_REQ_ERR]


def test_persistent_needs_a_mapping_and_msyncs_it(udp_devices, tmp_path):
    """IBV_ACCESS_FLUSH_PERSISTENT over ordinary memory is refused (EINVAL, as rxe refuses
    it over pages that are not pmem); over a file mapping it is granted, and a persistent
    FLUSH msyncs the pages of its range (level range) or the whole MR (level MR), after
    the WRITE before it has placed its data; the file holds the data."""
    _, _, a, b = _pair(udp_devices, 5)
    with pytest.raises(PyverbsRDMAError) as e:
        MR(b.pd, 4096, MR_GLOBAL | IBV_ACCESS_FLUSH_PERSISTENT)
    assert e.value.error_code == errno.EINVAL
    path = tmp_path / "pmem"
    path.write_bytes(bytes(3 * 4096))
    with open(path, "r+b") as f:
        spy = SpyMap(f.fileno(), 3 * 4096)
    mr = MR(b.pd, 3 * 4096, MR_GLOBAL | IBV_ACCESS_FLUSH_PERSISTENT, buffer=spy)
    data = bytes((i * 5) & 0xFF for i in range(3000))  # three packets at MTU 1024
    w = SendWR(1, opcode=IBV_WR_RDMA_WRITE, sg=[a.sge(0, 3000)], send_flags=0)
    a.mr.write(data, 3000, 0)
    w.set_wr_rdma(mr.rkey, mr.buf + 5000)
    a.qp.post_send(w)
    _flush(a, mr, 5000, 3000, IBV_FLUSH_PERSISTENT, IBV_FLUSH_RANGE, wr_id=2)
    _flush(a, mr, 0, 0, IBV_FLUSH_PERSISTENT | IBV_FLUSH_GLOBAL, IBV_FLUSH_MR, wr_id=3)
    assert [w.status for w in _wcs(a, 2)] == [IBV_WC_SUCCESS] * 2
    (o1, n1, seen), (o2, n2, _) = spy.calls
    assert (o1, n1) == (4096, 8000 - 4096)  # the pages of [5000, 8000)
    assert (o2, n2) == (0, 3 * 4096)  # the whole MR
    assert seen[5000:8000] == data  # the WRITE was placed before the FLUSH ran
    assert path.read_bytes()[5000:8000] == data


def test_flush_behind_a_write_with_a_lost_packet(udp_devices):
    """A WRITE's middle packet lost: the FLUSH behind it is not executed before the WRITE
    is whole (the responder takes requests in PSN order; go-back-N resends both)."""
    da, db, a, b = _pair(udp_devices, 6)
    path_map = SpyMap(-1, 8192)
    mr = MR(b.pd, 8192, MR_GLOBAL | IBV_ACCESS_FLUSH_PERSISTENT, buffer=path_map)
    rule = da.faults.tx.drop("RC_RDMA_WRITE_MIDDLE")
    data = bytes((i * 3) & 0xFF for i in range(3000))
    a.mr.write(data, 3000, 0)
    w = SendWR(1, opcode=IBV_WR_RDMA_WRITE, sg=[a.sge(0, 3000)], send_flags=0)
    w.set_wr_rdma(mr.rkey, mr.buf)
    a.qp.post_send(w)
    _flush(a, mr, 0, 3000, IBV_FLUSH_PERSISTENT, IBV_FLUSH_RANGE, wr_id=2)
    assert [w.status for w in _wcs(a)] == [IBV_WC_SUCCESS]
    assert len(rule.hits) == 1 and len(path_map.calls) == 1
    assert path_map.calls[0][2][:3000] == data


def test_duplicate_is_answered_not_flushed_again(udp_devices):
    """The answer lost: the FLUSH comes again; the responder answers from its resource
    (oA19-15) without flushing a second time (rxe 6.12 would drop the duplicate: it does
    not record a FLUSH resource's PSN, docs/verbs.md)."""
    da, db, a, b = _pair(udp_devices, 7, timeout=14)
    spy = SpyMap(-1, 4096)
    mr = MR(b.pd, 4096, MR_GLOBAL | IBV_ACCESS_FLUSH_PERSISTENT, buffer=spy)
    rule = da.faults.rx.drop("RC_RDMA_READ_RESPONSE_ONLY")
    _flush(a, mr, 0, 64, IBV_FLUSH_PERSISTENT, IBV_FLUSH_RANGE)
    assert [w.status for w in _wcs(a)] == [IBV_WC_SUCCESS]
    assert len(rule.hits) == 1 and db.counters.duplicate_request == 1
    assert len(spy.calls) == 1


def test_capabilities_and_send_ops_flag(udp_devices):
    """device_cap_flags_ex has FLUSH global, persistent and ATOMIC WRITE (bits 38-40, as
    6.12's rxe); the extended QP posts a FLUSH only with IBV_QP_EX_WITH_FLUSH."""
    from softrdma.pyverbs_compat.cq import CQ as CCQ
    from softrdma.pyverbs_compat.device import Context as CContext
    from softrdma.pyverbs_compat.pd import PD as CPD
    from softrdma.pyverbs_compat.qp import QPEx, QPInitAttrEx
    from softrdma.enums import IBV_QPT_RC
    d = udp_devices("127.0.2.130", "fl-x")
    ctx = CContext(name=d.name)
    flags = ctx.query_device_ex().device_cap_flags_ex
    assert flags & (7 << 38) == 7 << 38
    assert ctx.query_device().device_cap_flags < 1 << 32  # the old field stays 32 bits
    pd, cq = CPD(ctx), CCQ(ctx, 8)
    qp = QPEx(ctx, QPInitAttrEx(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, pd=pd, comp_mask=1 | 64,
                                send_ops_flags=1 << 12))
    qp.wr_start()
    qp.wr_flush(0, 0, 64, IBV_FLUSH_GLOBAL, IBV_FLUSH_RANGE)
    with pytest.raises(PyverbsRDMAError) as e:
        qp.wr_complete()
    assert e.value.error_code == errno.EINVAL
    ctx.close()


def test_check_rules_fire_on_crafted_packets(udp_devices, tmp_path):
    """softrdma's own FLUSH breaks only FLUSH-ICRC (IBTA's ICRC expected, rxe's sent); with
    IBTA's ICRC it is clean; a FETH with a reserved bit, level 2 or type 0 breaks
    FLUSH-FORM; an answer carrying data breaks A19-RESPONSE."""
    pcap = tmp_path / "k.pcap"
    da, db, a, b = _pair(udp_devices, 8, pcap)
    mr = MR(b.pd, 4096, MR_GLOBAL)
    _flush(a, mr, 0, 64, IBV_FLUSH_GLOBAL, IBV_FLUSH_RANGE)
    assert [w.status for w in _wcs(a)] == [IBV_WC_SUCCESS]
    da.detach()
    recs = m.load(pcap)

    def rules(records):
        return sorted({v.rule for v in check_records(records).violations})
    assert rules(recs) == ["FLUSH-ICRC"]
    assert rules(m.edit(recs, 1, lambda b: None)) == []  # ICRC recomputed: IBTA's
    for feth in (1 | 1 << 6, 2 << 4 | 1, 0):
        assert rules(m.edit(recs, 1, feth=feth)) == ["FLUSH-FORM"], hex(feth)
    assert "A19-RESPONSE" in rules(m.edit(recs, 2, payload=b"\0" * 4))
