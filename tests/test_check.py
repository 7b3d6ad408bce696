"""softrdma check: every real capture is clean, and every rule catches its injected fault.

The mutation tests take a real rxe capture, inject one fault with tests/pcap_mutate.py (the
ICRC is recomputed unless the fault is the ICRC) and assert the exact set of (frame, rule)
the checker reports. The expected frames come from the capture and the rule (for example:
a dropped ACK leaves unacknowledged the request whose PSN it carried), never from a run of
the checker.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from softrdma.check import RULES, check_records
from softrdma.wire.frames import LINKTYPE_RAW, decode_frame, encode_frame
from softrdma.wire.opcodes import Opcode

from . import pcap_mutate as m
from .conftest import ROOT

PCAPS = ROOT / "pcaps"
ALL = sorted(PCAPS.rglob("*.pcap"))
RXE = PCAPS / "linux-rxe"
MASK = 0xFFFFFF

#: the rules each test below breaks: every rule must appear (test_every_rule_is_broken)
BROKEN: set[str] = set()


def breaks(*rules: str):
    BROKEN.update(rules)
    return lambda f: f


@lru_cache(maxsize=None)
def _load(name: str) -> tuple:
    return tuple(m.load(RXE / name))


def load(name: str) -> list:
    return list(_load(name))


def found(records, **kw) -> set[tuple[int, str]]:
    return {(v.frame, v.rule) for v in check_records(records, **kw).violations}


def recovery(records, **kw):
    """The recovery report of the capture's flows, merged: (kind, frame, psn) -> count."""
    out = {}
    for fr in check_records(records, **kw).recovery:
        for e in fr.events:
            out[(e.kind, e.frame, e.psn)] = out.get((e.kind, e.frame, e.psn), 0) + e.count
    return out


def resend(records, after: int, src: int, ts_ns: int | None = None) -> list:
    """Frame ``src`` sent again after frame ``after``, as a requester resends: the same
    packet with a new IPv4 ID (rxe numbers every packet it sends; a copy with the old ID
    is what a network duplicates)."""
    rec = records[src - 1]
    f = decode_frame(rec.data, rec.linktype)
    top = max(decode_frame(r.data, r.linktype).ip_id for r in records)
    data = encode_frame(bytes(f.payload), src=f.ip_src, dst=f.ip_dst, sport=f.sport,
                        dport=f.dport, ip_id=(top + 1) & 0xFFFF, ttl=f.ttl, tos=f.tos,
                        frag=f.ip_frag, linktype=rec.linktype,
                        **({"eth_src": f.eth_src, "eth_dst": f.eth_dst} if f.eth_src else {}))
    return m.insert(records, after, dataclasses.replace(rec, data=data, orig_len=len(data)),
                    ts_ns=ts_ns)


def frame_of(records, pred) -> int:
    """The first frame whose RoCE packet satisfies ``pred``."""
    return next(r.index for r in records if pred(m.packet(r)))


def frames_of(records, pred) -> list[int]:
    return [r.index for r in records if pred(m.packet(r))]


def src_ip(rec) -> bytes:
    return rec.data[26:30]  # IPv4 source address in an Ethernet frame


def op(name: str):
    return lambda p: p.opcode == Opcode[name]


# ---------------------------------------------------------------- real captures are clean

def test_the_capture_set_is_all_there():
    # 13 + 9 + 8, and 45 lossy ones (15 runs at 3 points): if a capture moves, this test
    # and its clean run must follow it
    assert len(ALL) == 30 + 45


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(PCAPS)))
def test_every_real_capture_is_clean(path, cli):
    result = check_records(m.load(path))
    assert result.packets > 0
    assert result.violations == [], "\n".join(
        f"frame {v.frame}: {v.rule}: {v.message}" for v in result.violations)
    # and through the command line, as a user (or CI) runs it
    r = cli(str(path))
    assert r.returncode == 0 and r.stdout.splitlines()[-1].endswith(": clean"), r.stdout


def test_conversations_are_paired_by_evidence():
    # srq_pingpong: four RC connections between the same two hosts, each QP numbered the
    # same on both sides: eight flows, each with its requests and its ACKs
    result = check_records(load("srq_pingpong.pcap"))
    assert len(result.flows) == 8
    assert all(s.transport == "RC" and s.requests == s.responses for s in result.flows)
    # rxe-to-rxe in the lab: QP 0x15 on one side talks to 0x17 on the other
    lab = check_records(m.load(PCAPS / "lab-2026-11-22" / "read_bw.rxe-rxe.pcap"))
    assert [s.label for s in lab.flows] == ["10.77.0.12 QP 0x000015 -> 10.77.0.11 QP 0x000017"]
    assert lab.flows[0].mtu == 1024 and lab.flows[0].responses == 160


def test_rxe_go_back_bursts_run_past_an_ack():
    """rc_pingpong.pcap holds two real go-back retransmissions whose bursts continue after
    the ACK arrived (frames 40 and 63-64 resend acknowledged PSNs): rxe's behaviour, legal.
    A go-back that *starts* at an acknowledged PSN is not (test_retry_range)."""
    recs = load("rc_pingpong.pcap")
    assert parse_psn(recs, 40) == parse_psn(recs, 34)  # the resent LAST
    assert found(recs) == set()


def parse_psn(recs, frame):
    return m.packet(recs[frame - 1]).psn


# ---------------------------------------------------------------- frame rules

@breaks("ICRC")
def test_icrc():
    recs = m.edit(load("write_bw.pcap"), 5, lambda b: b.__setitem__(-1, b[-1] ^ 0x01),
                  fix_icrc=False)
    assert found(recs) == {(5, "ICRC")}


@breaks("DECODE")
def test_decode():
    # an ACK whose opcode byte becomes one no transport defines; the next ACK covers its
    # requests (coalescing), so nothing else may be reported
    recs = load("write_bw.pcap")
    ack = frame_of(recs, lambda p: p.opcode == Opcode.RC_ACKNOWLEDGE and p.psn == 5558145)
    recs = m.edit(recs, ack, lambda b: b.__setitem__(0, 0x1F))
    assert found(recs) == {(ack, "DECODE")}


@breaks("UDP-DPORT")
def test_udp_dport():
    recs = load("write_bw.pcap")
    assert found(m.edit(recs, 3, dport=4792)) == {(3, "UDP-DPORT")}


@breaks("TVER")
def test_tver():
    assert found(m.edit(load("send_bw.pcap"), 2, tver=1)) == {(2, "TVER")}


@breaks("RESERVED")
def test_reserved_bits():
    recs = load("send_bw.pcap")
    assert found(m.edit(recs, 2, resv7=0x10)) == {(2, "RESERVED")}
    ack = frame_of(recs, op("RC_ACKNOWLEDGE"))
    assert found(m.edit(recs, ack, syndrome=0x80 | 0x1F)) == {(ack, "RESERVED")}
    ud = load("ud_pingpong.pcap")  # DETH: Q_Key, then resv8, then the source QP
    assert found(m.edit(ud, 2, lambda b: b.__setitem__(12 + 4, 0x01))) == {(2, "RESERVED")}


@breaks("PAD")
def test_pad():
    recs = load("send_bw.pcap")
    last = frame_of(recs, op("RC_SEND_LAST"))
    assert m.packet(recs[last - 1]).payload_len == 952
    # 951 bytes of payload need PadCnt 1; the packet says 0
    bad = m.edit(recs, last, lambda b: m.rebuild(b, payload=bytes(m.packet(recs[last - 1])
                                                                 .payload)[:-1], pad=0))
    assert found(bad) == {(last, "PAD")}
    # the pad bytes must be zero
    odd = m.edit(recs, last, lambda b: m.rebuild(b, payload=bytes(949), pad=3))
    odd = m.edit(odd, last, lambda b: b.__setitem__(-5, 0x55))
    assert found(odd) == {(last, "PAD")}


@breaks("NO-PAYLOAD")
def test_no_payload():
    recs = load("write_bw.pcap")
    ack = frame_of(recs, op("RC_ACKNOWLEDGE"))
    recs = m.edit(recs, ack, lambda b: b[:-4] + bytes(4) + b[-4:])
    assert found(recs) == {(ack, "NO-PAYLOAD")}


# ---------------------------------------------------------------- per-QP invariants

@breaks("QP-TRANSPORT")
def test_qp_transport():
    # an RC SEND ONLY turned into UC's (same headers) on an RC connection
    recs = load("inline_send.pcap")
    assert found(m.edit(recs, 5, opcode=Opcode.UC_SEND_ONLY)) == {(5, "QP-TRANSPORT")}


@breaks("PKEY")
def test_pkey():
    recs = load("write_bw.pcap")
    assert found(m.edit(recs, 12, pkey=0x8001)) == {(12, "PKEY")}
    ud = load("ud_pingpong.pcap")
    assert found(m.edit(ud, 4, pkey=0x7FFF)) == {(4, "PKEY")}


@breaks("SPORT")
def test_sport():
    recs = load("write_bw.pcap")
    assert found(m.edit(recs, 7, sport=50000)) == {(7, "SPORT")}


@breaks("SPORT-HASH")
def test_sport_hash():
    # rxe sends both directions of a connection from one port (the hash of both QPNs):
    # a responder that answers from another port, every time, breaks that
    recs = load("inline_send.pcap")
    other = [r.index for r in recs if src_ip(r) == bytes([10, 77, 0, 11])]
    for i in other:
        recs = m.edit(recs, i, sport=0xC123)
    assert found(recs) == {(other[0], "SPORT-HASH")}
    # UD: the port is the hash of the source QPN
    ud = load("ud_pingpong.pcap")
    sender = [r.index for r in ud if src_ip(r) == src_ip(ud[0])]
    for i in sender:
        ud = m.edit(ud, i, sport=0xD000)
    assert found(ud) == {(sender[0], "SPORT-HASH")}


# ---------------------------------------------------------------- the requester's sequence

@breaks("OPSEQ")
def test_opseq_new_message_before_last():
    recs = load("rc_pingpong.pcap")
    assert m.packet(recs[1]).opcode == Opcode.RC_SEND_MIDDLE
    assert found(m.edit(recs, 2, opcode=Opcode.RC_SEND_FIRST)) == {(2, "OPSEQ")}


def test_a_lost_uc_last_is_a_loss_not_a_fault():
    """UC: FIRST, LAST, FIRST...; a LAST missing from the capture was lost before the
    capture point (UC never resends; the receiver drops the message). No rule is broken: the
    next FIRST follows a hole, and the opcode sequence is judged in PSN order, where the
    hole leaves nothing to compare. The recovery report has the loss, where it shows."""
    recs = load("uc_pingpong.pcap")
    assert m.packet(recs[1]).opcode == Opcode.UC_SEND_LAST
    lost_psn = m.packet(recs[1]).psn
    recs = m.drop(recs, 2)
    nxt = 4  # the next FIRST from that side, frame 5 before the drop
    assert m.packet(recs[nxt - 1]).opcode == Opcode.UC_SEND_FIRST
    assert found(recs) == set()
    assert recovery(recs) == {("lost-before", nxt, lost_psn): 1}


@breaks("MTU-SIZE")
def test_mtu_size():
    recs = load("send_bw.pcap")
    assert found(m.edit(recs, 2, payload=bytes(1020))) == {(2, "MTU-SIZE")}
    # --mtu: the same capture judged as if the path MTU were 2048
    assert (2, "MTU-SIZE") in found(load("send_bw.pcap"), mtu=2048)


def test_ud_datagram_larger_than_the_mtu():
    # ud_pingpong's datagrams are 512 bytes: fine at MTU 1024, too big at 256 (UD packets
    # do not reveal the MTU: --mtu only)
    recs = load("ud_pingpong.pcap")
    assert found(recs, mtu=1024) == set()
    assert found(recs, mtu=256) == {(r.index, "MTU-SIZE") for r in recs}


@breaks("WRITE-LEN")
def test_write_len():
    recs = load("write_bw.pcap")
    recs = m.edit(recs, 1, dma_len=8000)
    last = frame_of(recs, op("RC_RDMA_WRITE_LAST"))
    assert found(recs) == {(last, "WRITE-LEN")}


@breaks("PSN-SEQ")
def test_uc_going_back_is_a_fault():
    """UC never retransmits: a packet at a PSN already captured, with other bytes, breaks
    PSN-SEQ; the same bytes with the same IP ID are the network's duplicate, not a fault."""
    recs = load("uc_pingpong.pcap")
    src = src_ip(recs[0])
    later = next(r.index for r in recs[4:] if src_ip(r) == src)
    back = m.edit(recs, later, psn=m.packet(recs[0]).psn)
    assert found(back) == {(later, "PSN-SEQ")}
    dup = m.insert(recs, 1, recs[0])
    assert found(dup) == set()
    assert recovery(dup) == {("duplicate", 2, m.packet(recs[0]).psn): 1}


def test_uc_skip_is_a_loss():
    # UC: from frame 5 on, one direction's PSNs are one higher: one packet lost before the
    # capture point (or skipped: the same to every receiver), not a fault
    recs = load("uc_pingpong.pcap")
    src = src_ip(recs[0])
    skipped = m.packet(recs[4]).psn
    for r in recs[4:]:
        if src_ip(r) == src:
            recs = m.edit(recs, r.index, psn=(m.packet(r).psn + 1) & MASK)
    assert found(recs) == set()
    assert recovery(recs) == {("lost-before", 5, skipped): 1}


def test_reordered_packets_are_no_loss():
    """Two WRITE packets swapped on the way: the first shows a hole, the second fills it.
    rxe numbers its IPv4 packets, and the late one carries the lower ID: reordered, not
    resent, and no rule broken (the message is judged in PSN order)."""
    recs = load("write_bw.pcap")
    late = m.packet(recs[2]).psn
    recs = m.swap(recs, 3, 4)
    assert found(recs) == set()
    assert recovery(recs) == {("lost-before", 3, late): 1, ("reordered", 4, late): 1}
    (fr,) = check_records(recs).recovery
    assert fr.lost_before["requests"] == 0 and fr.reordered == 1


@pytest.mark.parametrize("name", ["write_bw.pcap", "read_bw.pcap", "uc_pingpong.pcap",
                                  "fetch_add.pcap"])
def test_psn_wrap_is_clean(name):
    """Shift every PSN of a capture so that the sequence wraps through 2^24 - 1 -> 0 a few
    packets in: still clean (9.7.1: PSNs are modulo 2^24)."""
    recs = load(name)
    first = m.packet(recs[0]).psn
    shift = (MASK + 1 - 3) - first
    for r in recs:
        recs = m.edit(recs, r.index, psn=(m.packet(r).psn + shift) & MASK)
    assert any(m.packet(r).psn == 0 for r in recs)
    assert found(recs) == set()
    if name == "uc_pingpong.pcap":
        # and a skip right at the wrap is still caught
        src = src_ip(recs[0])
        at = next(r.index for r in recs if m.packet(r).psn == 0 and src_ip(r) == src)
        for r in recs[at - 1:]:
            if src_ip(r) == src:
                recs = m.edit(recs, r.index, psn=(m.packet(r).psn + 1) & MASK)
        assert found(recs) == set() and recovery(recs) == {("lost-before", at, 0): 1}
        # and a UC packet going back across the wrap is still caught
        back = m.edit(recs, at, psn=MASK - 1)
        assert found(back) == {(at, "PSN-SEQ")}


def _acted_on_nak(recs):
    """write_bw with a NAK for PSN 5558146 at frame 31 that the requester acts on: it goes
    back there at once (frames 18-30 resent as frames 32-44)."""
    nak = _nak_at_31(recs, 0x60)
    good = nak
    for i, src in enumerate(range(18, 31)):
        good = resend(good, 31 + i, src)
    return good


@breaks("RETRY-RANGE")
def test_retry_range():
    """A requester that acted on a NAK for PSN p knows everything before p was
    acknowledged: resending such a PSN later is RETRY-RANGE. Without that evidence (an ACK
    the capture shows, which may have been lost after the capture point) nothing is
    judged."""
    recs = load("write_bw.pcap")
    ack = frame_of(recs, op("RC_ACKNOWLEDGE"))
    assert found(resend(recs, ack, 1)) == set()  # the ACK may never have reached it
    acted = _acted_on_nak(recs)
    assert found(acted) == set()
    end = 44  # the go-back done, resend the first WRITE's FIRST (acknowledged before p)
    assert found(resend(acted, end, 1)) == {(end + 1, "RETRY-RANGE")}


def test_retry_range_for_a_read_fully_answered():
    """The same for READs: once the requester acted on a NAK for a later PSN, a READ whose
    responses all came in order was done; asking it again is RETRY-RANGE, and asking
    again one whose responses did not all come is a re-read, legal."""
    recs = load("read_bw.pcap")
    reads = frames_of(recs, lambda p: p.info.is_request)
    firsts = frames_of(recs, op("RC_RDMA_READ_RESPONSE_FIRST"))
    # a NAK for the third READ's PSN, placed before its responses, and the requester
    # asking that READ again at once
    third = m.packet(recs[reads[2] - 1]).psn
    msn = m.packet(recs[firsts[2] - 1]).msn - 1  # the third READ not taken yet
    at = firsts[2] - 1
    nak = m.insert(recs, at, m.edit(recs, firsts[2], opcode=Opcode.RC_ACKNOWLEDGE,
                                    payload=b"", syndrome=0x60, psn=third,
                                    msn=msn)[firsts[2] - 1])
    acted = resend(nak, at + 1, reads[2])
    assert found(acted) == set()
    assert found(resend(acted, at + 2, reads[0])) == {(at + 3, "RETRY-RANGE")}


@breaks("RETRY-SAME")
def test_retry_same():
    recs = load("write_bw.pcap")
    # a resend of PSN+1 (frame 2) before any ACK: legal when identical...
    same = resend(recs, 5, 2)
    assert found(same) == set()
    # ...not when its bytes differ
    other = m.edit(same, 6, lambda b: b.__setitem__(40, b[40] ^ 0xFF))
    assert found(other) == {(6, "RETRY-SAME")}
    shorter = m.edit(same, 6, payload=bytes(m.packet(same[5]).payload)[:512])
    assert (6, "RETRY-SAME") in found(shorter)


def test_re_read_from_the_middle():
    """A READ resent from offset k must ask for VA + k*MTU and length - k*MTU (rxe_req.c
    req_retry)."""
    recs = load("read_bw.pcap")
    first = m.packet(recs[0])
    q, va, ln = first.psn, first.va, first.dma_len
    middle = frame_of(recs, lambda p: p.psn == (q + 2) & MASK and not p.info.is_request)
    good = m.edit(list(recs), 1, psn=(q + 3) & MASK, va=va + 3 * 1024, dma_len=ln - 3 * 1024)
    good = m.insert(recs, middle, good[0])
    assert found(good) == set()
    bad = m.edit(good, middle + 1, va=va + 3 * 1000)
    assert found(bad) == {(middle + 1, "RETRY-SAME")}


@breaks("ACKREQ-LAST")
def test_ackreq_last():
    recs = load("send_bw.pcap")
    last = frame_of(recs, op("RC_SEND_LAST"))
    assert found(m.edit(recs, last, ackreq=False)) == {(last, "ACKREQ-LAST")}


# ---------------------------------------------------------------- ACK / NAK / MSN

def _acks(recs):
    return frames_of(recs, op("RC_ACKNOWLEDGE"))


@breaks("AETH-SYNDROME")
def test_aeth_syndrome():
    recs = load("write_bw.pcap")
    ack = _acks(recs)[1]  # not the last: the next ACK covers its requests
    assert found(m.edit(recs, ack, syndrome=0x40 | 0x1F)) == {(ack, "AETH-SYNDROME")}
    assert found(m.edit(recs, ack, syndrome=0x65)) == {(ack, "AETH-SYNDROME")}  # NAK code 5
    reads = load("read_bw.pcap")
    resp = frames_of(reads, op("RC_RDMA_READ_RESPONSE_FIRST"))[3]
    assert found(m.edit(reads, resp, syndrome=0x62)) == {(resp, "AETH-SYNDROME")}


@breaks("ACK-PSN")
def test_ack_psn():
    recs = load("write_bw.pcap")
    ack = _acks(recs)[1]
    p = m.packet(recs[ack - 1])
    assert found(m.edit(recs, ack, psn=(p.psn + 1000) & MASK)) == {(ack, "ACK-PSN")}


@breaks("MSN")
def test_msn():
    recs = load("write_bw.pcap")
    ack = _acks(recs)[2]
    p = m.packet(recs[ack - 1])
    assert found(m.edit(recs, ack, msn=p.msn + 1)) == {(ack, "MSN")}
    # even the first ACK's: the MSN the capture starts from is the one most ACKs agree on
    first = _acks(recs)[0]
    assert found(m.edit(recs, first, msn=7)) == {(first, "MSN")}
    # READ responses: a READ counts when accepted, so its FIRST already carries the new MSN
    reads = load("read_bw.pcap")
    resp = frames_of(reads, op("RC_RDMA_READ_RESPONSE_FIRST"))[2]
    msn = m.packet(reads[resp - 1]).msn
    assert found(m.edit(reads, resp, msn=msn - 1)) == {(resp, "MSN")}


@breaks("ACK-COVER")
def test_ack_cover():
    """Drop the responder's ACK of a SEND in rc_pingpong; the responder goes on sending
    (its own SENDs) and never acknowledges that request."""
    recs = load("rc_pingpong.pcap")
    ack = 53
    p = m.packet(recs[ack - 1])
    assert p.opcode == Opcode.RC_ACKNOWLEDGE
    req = frame_of(recs, lambda q: q.info.is_request and q.psn == p.psn)
    recs = m.drop(recs, ack)
    assert found(recs) == {(req, "ACK-COVER")}
    # a capture that simply ends before the last ACK is not a fault
    tail = load("write_bw.pcap")
    assert found(m.drop(tail, len(tail))) == set()


@breaks("ACK-CREDIT")
def test_ack_credit():
    recs = load("write_bw.pcap")
    ack = _acks(recs)[0]
    assert found(m.edit(recs, ack, syndrome=0x14)) == {(ack, "ACK-CREDIT")}


def _nak_at_31(recs, syndrome):
    """write_bw frame 31 ACKs PSN 5558145 (MSN 2) after the requester sent up to 5558158;
    make it a NAK for 5558146 (or an RNR NAK)."""
    p = m.packet(recs[30])
    assert p.psn == 5558145 and p.msn == 2
    return m.edit(recs, 31, syndrome=syndrome, psn=5558146)


@breaks("NAK-RETRY")
def test_nak_retry():
    recs = load("write_bw.pcap")
    # the requester goes on with new PSNs and never goes back to 5558146, and the capture
    # ends: the NAK may have been lost after the capture point, or ignored while a retry
    # was under way (rxe), with the timer yet to fire: unresolved, not a fault
    ignored = _nak_at_31(recs, 0x60)
    for ack in reversed(_acks(ignored)):
        if ack > 31:
            ignored = m.drop(ignored, ack)
    assert found(ignored) == set()
    assert ("unresolved", 31, 5558146) in recovery(ignored)
    # resending from the NAK'd PSN (frames 18-30 again) is right ...
    good = _acted_on_nak(recs)
    assert found(good) == set()
    assert ("go-back", 32, 5558146) in recovery(good)
    # ... resending from a later one is not, once the responder acknowledges the NAK'd PSN
    # the requester never resent (the responder's later ACKs show it got there)
    late = _nak_at_31(recs, 0x60)
    for i, src in enumerate(range(19, 31)):
        late = resend(late, 31 + i, src)
    assert found(late) == {(32, "NAK-RETRY")}
    # (unless the capture itself may have missed packets: lossy)
    assert found(late, lossy=True) == set()


@breaks("NAK-ONCE")
def test_nak_once():
    """A responder NAKs a gap once (rxe's sent_psn_nak): a second NAK for the same PSN with
    no go-back captured in between breaks NAK-ONCE. After the requester went back, a second
    NAK is softrdma's (once per go-back), legal; the same NAK twice with the same IP ID is
    the network's duplicate."""
    recs = load("write_bw.pcap")
    nak = _nak_at_31(recs, 0x60)
    for ack in reversed(_acks(nak)):
        if ack > 31:  # the responder, still waiting for the NAK'd PSN, ACKs nothing more
            nak = m.drop(nak, ack)
    twice = resend(nak, 33, 31)
    assert found(twice) == {(34, "NAK-ONCE")}
    assert found(m.insert(nak, 33, nak[30])) == set()  # a network duplicate
    assert recovery(m.insert(nak, 33, nak[30]))[("duplicate", 34, 5558146)] == 1
    back = resend(nak, 33, 18)  # the requester went back: a second NAK is softrdma's
    assert found(resend(back, 34, 31)) == set()


@breaks("NAK-FATAL")
def test_nak_fatal():
    """The ACK of the first WRITE made a remote-access NAK: the WRITE failed and the QP is
    in error, so resending it is wrong."""
    recs = load("write_bw.pcap")
    nak = m.edit(recs, 9, syndrome=0x62, msn=0)  # the message did not complete
    assert found(nak) == set()
    assert found(resend(nak, 9, 8)) == {(10, "NAK-FATAL")}
    # a resend a second later is a retransmit timer's (the NAK may have been lost after
    # the capture point), not an answer to the NAK
    assert found(resend(nak, 9, 8, ts_ns=nak[8].ts_ns + 10**9)) == set()


def test_a_real_fatal_nak_is_clean(tmp_path):
    """softrdma's engines: an RDMA WRITE with a wrong rkey draws a remote-access NAK and the
    requester's QP goes to error without resending; captured at the requester, clean."""
    import contextlib

    from softrdma import enums as E
    from softrdma.harness.sim import SimNetwork
    from softrdma.harness.testing import connected_pair
    from softrdma.soft.capture import PacketCapture
    from softrdma.verbs_api.device import remove_device

    net = SimNetwork(seed=3)
    a, b = connected_pair(net, "RC")
    path = tmp_path / "fatal.pcap"
    a.device.capture = PacketCapture(str(path), clock=lambda: net.now)
    try:
        a.post_send(E.IBV_WR_RDMA_WRITE, a.sge(0, 4096), 1, remote_offset=0, rkey=0xDEAD)
        a.post_send(E.IBV_WR_RDMA_WRITE, a.sge(0, 4096), 2, remote_offset=0)
        net.run(until=net.now + 0.1)
    finally:
        a.device.capture.close()
        for e in (a, b):
            e.close()
            with contextlib.suppress(Exception):
                remove_device(e.device.name)
    recs = m.load(path)
    assert 0x62 in {m.packet(r).syndrome for r in recs}
    assert found(recs) == set()


def _a19_capture(tmp_path):
    """An ATOMIC WRITE then a global FLUSH between two soft devices on the simulated
    network, captured at the requester (frames: ATOMIC WRITE, FLUSH, their answers)."""
    from softrdma import enums as E
    from softrdma.harness.sim import SimNetwork
    from softrdma.harness.testing import connected_pair
    from softrdma.soft.capture import PacketCapture
    import contextlib

    from softrdma.verbs_api import MR, SendWR
    from softrdma.verbs_api.device import remove_device

    net = SimNetwork(seed=5)
    acc = dict(qp_access_flags=E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_FLUSH_GLOBAL)
    a, b = connected_pair(net, "RC", b_attrs=acc)
    path = tmp_path / "a19.pcap"
    a.device.capture = PacketCapture(str(path), clock=lambda: net.now)
    try:
        mr = MR(b.pd, 4096, E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE
                | E.IBV_ACCESS_FLUSH_GLOBAL)
        w = SendWR(1)
        w.set_wr_atomic_write(mr.rkey, mr.buf + 8, b"12345678")
        a.qp.post_send(w)
        w = SendWR(2)
        w.set_wr_flush(mr.rkey, mr.buf, 64, E.IBV_FLUSH_GLOBAL, E.IBV_FLUSH_RANGE)
        a.qp.post_send(w)
        net.run_until(lambda: len(a.cq) >= 2)
    finally:
        a.device.capture.close()
        for e in (a, b):
            e.close()
            with contextlib.suppress(Exception):
                remove_device(e.device.name)
    return m.load(path)


@breaks("ATOMIC-WRITE-FORM", "FLUSH-FORM", "A19-RESPONSE", "FLUSH-ICRC")
def test_atomic_write_and_flush(tmp_path):
    """ATOMIC WRITE and FLUSH (annex A19): their form, their READ RESPONSE ONLY answers,
    and rxe's ICRC of a FLUSH, which softrdma sends (tests/test_atomic_write.py and
    tests/test_flush.py try each rule on live devices)."""
    recs = _a19_capture(tmp_path)
    assert [m.packet(r).opcode for r in recs] == [0x1D, 0x1C, 0x10, 0x10]
    assert found(recs) == {(2, "FLUSH-ICRC")}
    clean = m.edit(recs, 2, lambda b: None)  # the FLUSH with IBTA's ICRC
    assert found(clean) == set()
    assert found(m.edit(clean, 1, dma_len=16)) == {(1, "ATOMIC-WRITE-FORM")}
    assert found(m.edit(clean, 2, feth=3 << 4 | 1)) == {(2, "FLUSH-FORM")}
    assert found(m.edit(clean, 3, opcode=0x11)) == {(3, "A19-RESPONSE")}  # a plain ACK


@breaks("RNR-WAIT")
def test_rnr_wait():
    """An RNR NAK (timer 12: 640 us) for the last packet of the first WRITE: the requester
    must resend that PSN no sooner than 640 us later."""
    recs = load("write_bw.pcap")
    p = m.packet(recs[8])
    assert p.opcode == Opcode.RC_ACKNOWLEDGE and p.psn == 5558137 and p.msn == 1
    rnr = m.edit(recs, 9, syndrome=0x20 | 12, msn=0)  # the message is not done yet
    t = rnr[8].ts_ns

    def again(delay_ns):
        out = resend(rnr, 9, 8, ts_ns=t + delay_ns)
        return m.insert(out, 10, recs[8], ts_ns=t + delay_ns + 50_000)  # its ACK

    assert found(again(700_000)) == set()
    assert found(again(100_000)) == {(10, "RNR-WAIT")}


# ---------------------------------------------------------------- READ responses

@breaks("READ-RESP-PSN")
def test_read_resp_psn():
    """A READ response at the PSN of a captured WRITE answers no READ: READ-RESP-PSN. So
    does one beyond every request the capture carried (nothing lost on the path reaches a
    responder), unless the capture may have dropped packets itself (lossy)."""
    recs = load("write_bw.pcap")
    ack = _acks(recs)[1]
    bad = m.edit(recs, ack, opcode=Opcode.RC_RDMA_READ_RESPONSE_ONLY, payload=bytes(64))
    assert found(bad) == {(ack, "READ-RESP-PSN")}
    reads = load("read_bw.pcap")
    mid = frames_of(reads, op("RC_RDMA_READ_RESPONSE_MIDDLE"))[5]
    p = m.packet(reads[mid - 1])
    far = m.edit(reads, mid, psn=(p.psn + 100_000) & MASK)
    assert found(far) == {(mid, "READ-RESP-PSN")}
    # unless the capture itself may have dropped packets (lossy): then an observation
    # (and the response it replaced is a hole in that READ's responses, seen at the next)
    assert found(far, lossy=True) == set()
    assert recovery(far, lossy=True) == {("not-captured", mid, (p.psn + 100_000) & MASK): 1,
                                         ("lost-before", mid + 1, p.psn): 1}


@breaks("READ-RESP-OPCODE")
def test_read_resp_opcode():
    recs = load("read_bw.pcap")
    last = frames_of(recs, op("RC_RDMA_READ_RESPONSE_LAST"))[1]
    bad = m.edit(recs, last, opcode=Opcode.RC_RDMA_READ_RESPONSE_MIDDLE)
    assert found(bad) == {(last, "READ-RESP-OPCODE")}


@breaks("READ-RESP-LEN")
def test_read_resp_len():
    recs = load("read_bw.pcap")
    last = frames_of(recs, op("RC_RDMA_READ_RESPONSE_LAST"))[1]
    bad = m.edit(recs, last, payload=bytes(1020))
    assert found(bad) == {(last, "READ-RESP-LEN")}


# ---------------------------------------------------------------- atomics

@breaks("ATOMIC-ACK")
def test_atomic_ack():
    recs = load("fetch_add.pcap")
    ack = frames_of(recs, op("RC_ATOMIC_ACKNOWLEDGE"))[2]
    bad = m.edit(recs, ack, opcode=Opcode.RC_ACKNOWLEDGE)
    assert found(bad) == {(ack, "ATOMIC-ACK")}


@breaks("ATOMIC-REPLAY")
def test_atomic_replay():
    """A duplicate FETCH_ADD (frame 2 resent before its answer) is answered twice; the
    second answer must repeat the first original value (rxe replays it, 9.7.4.1)."""
    recs = load("fetch_add.pcap")
    dup = m.insert(recs, 3, recs[1])  # the resend, frame 4
    ack = frame_of(dup, lambda p: p.opcode == Opcode.RC_ATOMIC_ACKNOWLEDGE
                   and p.psn == m.packet(recs[1]).psn)
    same = m.insert(dup, ack, dup[ack - 1])
    assert found(same) == set()
    orig = m.packet(dup[ack - 1]).orig
    other = m.edit(same, ack + 1, orig=orig + 1)
    assert found(other) == {(ack + 1, "ATOMIC-REPLAY")}


# ---------------------------------------------------------------- UD

@breaks("UD-QKEY")
def test_ud_qkey():
    recs = load("ud_pingpong.pcap")
    assert found(m.edit(recs, 3, qkey=0x12345678)) == {(3, "UD-QKEY")}
    # QP1 only ever hears the GSI Q_Key
    cm = load("udaddy.pcap")
    gsi = frame_of(cm, lambda p: p.dest_qp == 1)
    assert found(m.edit(cm, gsi, qkey=0x80010001)) == {(gsi, "UD-QKEY")}


@breaks("UD-PSN")
def test_ud_psn():
    """A UD datagram missing is lost (UD never resends): an observation. A datagram whose
    PSN goes back to one already captured, with other bytes, breaks UD-PSN."""
    recs = load("ud_pingpong.pcap")
    src = src_ip(recs[2])
    nxt = next(r.index for r in recs[3:] if src_ip(r) == src)
    lost = m.packet(recs[2]).psn
    assert found(m.drop(recs, 3)) == set()
    assert recovery(m.drop(recs, 3)) == {("lost-before", nxt - 1, lost): 1}
    back = m.edit(recs, nxt, psn=lost, payload=bytes(512))
    assert found(back) == {(nxt, "UD-PSN")}


# ---------------------------------------------------------------- the suite itself

def test_every_rule_is_broken_by_a_test():
    assert BROKEN == set(RULES), f"rules no test breaks: {sorted(set(RULES) - BROKEN)}"


def test_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="NOPE"):
        check_records([], rules=["NOPE"])


def test_rules_filter():
    recs = m.edit(load("write_bw.pcap"), 5, lambda b: b.__setitem__(-1, b[-1] ^ 1),
                  fix_icrc=False)
    assert found(recs, rules=["PSN-SEQ"]) == set()
    assert found(recs, rules=["ICRC", "PSN-SEQ"]) == {(5, "ICRC")}


# ---------------------------------------------------------------- the command line

class Run:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(capsys):
    """``softrdma check ARGS`` in this process (main() as the console script calls it)."""
    from softrdma.cli import main

    def run(*args: str) -> Run:
        try:
            rc = main(["check", *args])
        except SystemExit as e:  # argparse's usage errors
            rc = e.code
        out = capsys.readouterr()
        return Run(rc, out.out, out.err)
    return run


def test_cli_as_a_program():
    r = subprocess.run([sys.executable, "-m", "softrdma", "check", str(RXE / "rc_pingpong.pcap")],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "66 frames, 66 RoCE packets, recovery in 2 flow(s): clean"


def test_cli_clean_capture(cli):
    r = cli(str(RXE / "read_bw.pcap"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "180 frames, 180 RoCE packets: clean"
    assert "RC 10.77.0.12 QP 0x000019 -> 10.77.0.11 QP 0x000019: 20 request(s), 160 " \
           "response(s), MTU 1024: ok" in r.stdout


def test_cli_reports_violations_text_and_json(cli, tmp_path):
    recs = load("write_bw.pcap")
    recs = m.edit(recs, 7, sport=50000)
    recs = m.edit(recs, 5, lambda b: b.__setitem__(-1, b[-1] ^ 1), fix_icrc=False)
    f = tmp_path / "bad.pcap"
    f.write_bytes(m.to_bytes(recs))
    r = cli(str(f))
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0].startswith("frame 5: ICRC (IBTA 7.8.1, annex A17; rxe_icrc.c): ICRC 0x")
    assert lines[1].startswith("frame 7: SPORT (")
    assert "UDP source port 50000, this QP sends from 49728" in lines[1]
    assert "2 violation(s)" in lines[-1]
    j = cli(str(f), "--json")
    assert j.returncode == 1
    objs = [json.loads(x) for x in j.stdout.splitlines()]
    assert [(o["frame"], o["rule"]) for o in objs if "rule" in o] == [(5, "ICRC"), (7, "SPORT")]
    assert objs[-1] == {"result": {"frames": 180, "packets": 180, "violations": 2,
                                   "flows_with_recovery": 0,
                                   "clean": False}}
    only = cli("--rules", "SPORT,TVER", "--rules", "MSN", str(f))
    assert only.returncode == 1 and "ICRC" not in only.stdout and "frame 7: SPORT" in only.stdout


def test_cli_bad_input(cli, tmp_path):
    missing = cli(str(tmp_path / "nope.pcap"))
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"softrdma check: {tmp_path / 'nope.pcap'}: no such file"
    junk = tmp_path / "junk.pcap"
    junk.write_bytes(b"not a capture at all")
    r = cli(str(junk))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "not a pcap or pcapng file" in r.stderr
    assert cli(str(RXE / "read_bw.pcap"), "--rules", "NOPE").returncode == 2
    assert cli(str(RXE / "read_bw.pcap"), "--mtu", "1000").returncode == 2


def test_cli_list_rules(cli):
    r = cli("--list-rules")
    assert r.returncode == 0
    assert [line.split()[0] for line in r.stdout.splitlines()] == list(RULES)
    assert cli().returncode == 2


# ---------------------------------------------------------------- softrdma's own error paths

def _sim_capture(tmp_path, seed: int, kind: str) -> tuple[Path, Path]:
    """Captures taken on the requester's and on the responder's device while softrdma's
    engines (rxe's design) move WRITEs, READs, atomics and SENDs over the simulated network:
    lossy, duplicating and reordering, or with the receiver's RQ empty at first (RNR)."""
    import contextlib

    from softrdma import enums as E
    from softrdma.harness.sim import SimNetwork
    from softrdma.harness.testing import connected_pair
    from softrdma.soft.capture import PacketCapture
    from softrdma.verbs_api.device import remove_device

    profile = {"loss": dict(loss=0.08), "dup": dict(loss=0.05, duplicate=0.1, reorder=0.1),
               "rnr": {}}[kind]
    net = SimNetwork(seed=seed, **profile)
    a, b = connected_pair(net, "RC")
    path = tmp_path / f"{kind}{seed}.pcap"
    far = tmp_path / f"{kind}{seed}.responder.pcap"
    a.device.capture = PacketCapture(str(path), clock=lambda: net.now)
    b.device.capture = PacketCapture(str(far), clock=lambda: net.now)
    try:
        if kind != "rnr":
            for i in range(5):
                b.post_recv(b.sge(i * 4096, 4096), 100 + i)
        n = 0
        for i in range(3):
            a.post_send(E.IBV_WR_RDMA_WRITE, a.sge(0, 8192), i, remote_offset=8192)
            a.post_send(E.IBV_WR_RDMA_READ, a.sge(65536, 8192), 10 + i, remote_offset=0)
            a.post_send(E.IBV_WR_ATOMIC_FETCH_AND_ADD, a.sge(200000 + 8 * i, 8), 20 + i,
                        remote_offset=300000, compare_add=1)
            n += 3
        for i in range(5):
            a.post_send(E.IBV_WR_SEND, a.sge(0, 3000), 30 + i)
            n += 1
        if kind == "rnr":
            net.run(until=net.now + 3e-3)
            for i in range(5):
                b.post_recv(b.sge(i * 4096, 4096), 100 + i)
        net.run_until(lambda: a.ncomp() >= n, timeout=30)
        net.run(until=net.now + 0.05)
        assert a.ncomp() == n
    finally:
        a.device.capture.close()
        b.device.capture.close()
        for e in (a, b):
            e.close()
            with contextlib.suppress(Exception):
                remove_device(e.device.name)
    return path, far


@pytest.mark.parametrize("kind,seed", [("loss", 0), ("loss", 4), ("dup", 2), ("dup", 9),
                                       ("rnr", 0)])
def test_softrdma_error_paths_are_clean(tmp_path, kind, seed):
    """Go-back-N after timeouts and NAKs, re-READs from the middle, replayed atomics, RNR
    waits: softrdma's engines (built after rxe's) on a faulty network, captured at the
    requester, break no rule. The capture must really hold those paths."""
    recs = m.load(_sim_capture(tmp_path, seed, kind)[0])
    pkts = [m.packet(r) for r in recs]
    requests = [(p.psn, p.opcode) for p in pkts if p.info.is_request]
    naks = {p.syndrome & 0x60 for p in pkts if p.syndrome is not None} - {0}
    assert len(set(requests)) < len(requests)  # retransmissions happened
    assert (0x20 in naks) if kind == "rnr" else naks  # RNR NAKs, or NAKs, were sent
    result = check_records(recs)
    assert result.violations == [], "\n".join(
        f"frame {v.frame}: {v.rule}: {v.message}" for v in result.violations)


@pytest.mark.parametrize("name", ["write_bw.pcap", "read_bw.pcap", "fetch_add.pcap",
                                  "ud_pingpong.pcap", "uc_pingpong.pcap"])
def test_ipv6_and_raw_ip_captures(name):
    """The same conversations carried in IPv6 (ICRC recomputed over the IPv6 header, flow
    label 0) and written as raw IP (no Ethernet header): still clean, and a fault still
    found at its frame."""
    v6 = {bytes([10, 77, 0, 11]): "fd00::11", bytes([10, 77, 0, 12]): "fd00::12"}
    recs = []
    for r in load(name):
        f = decode_frame(r.data, r.linktype)
        data = encode_frame(bytes(f.payload), src=v6[f.ip_src], dst=v6[f.ip_dst],
                            sport=f.sport, dport=f.dport, linktype=LINKTYPE_RAW)
        recs.append(dataclasses.replace(r, data=data, linktype=LINKTYPE_RAW))
    result = check_records(recs)
    assert result.packets == len(recs) and result.violations == []
    bad = m.edit(recs, 3, tver=2)
    assert found(bad) == {(3, "TVER")}


def test_docs_table_is_the_rule_table():
    """docs/check.md lists exactly the rules of softrdma.check.rules, with their words."""
    text = (ROOT / "docs" / "check.md").read_text()
    block = text[text.index("| rule | family | statement | reference |"):]
    rows = [line for line in block[:block.index("\n\n")].splitlines()
            if line.startswith("| `")]
    table = {r.split("|")[1].strip().strip("`"): [c.strip() for c in r.split("|")[2:5]]
             for r in rows}
    assert list(table) == list(RULES)
    for rid, (family, statement, reference) in table.items():
        rule = RULES[rid]
        assert family == rule.family and reference == rule.reference, rid
        assert statement.startswith(rule.statement), rid


@pytest.mark.parametrize("kind,seed", [("loss", 1), ("dup", 0)])
def test_captures_behind_the_loss_are_clean(tmp_path, kind, seed):
    """Captured on the responder's device, behind the lossy network: the requester's
    packets show holes (lost before the capture point) that its go-backs fill. No option
    is needed to judge that clean, and the recovery report counts those losses and the
    NAKs the responder sent for them."""
    far = m.load(_sim_capture(tmp_path, seed, kind)[1])
    holes = _holes(far)
    assert holes  # the capture really shows requests lost before it
    result = check_records(far)
    assert result.violations == [], [(v.frame, v.rule, v.message) for v in result.violations]
    (fr,) = [f for f in result.recovery if f.transport == "RC" and f.events]
    assert fr.lost_before["requests"] >= 1 and fr.naks >= 1 and fr.resent_packets >= 1


def _holes(recs) -> int:
    """PSNs a requester skipped at least once in the capture (from the packets alone)."""
    src = src_ip(recs[0])
    top, holes = None, 0
    for r in recs:
        p = m.packet(r)
        if src_ip(r) != src or not p.info.is_request:
            continue
        if top is not None and (p.psn - top) & MASK < 1 << 23 and p.psn != (top + 1) & MASK:
            if (p.psn - top) & MASK > 1:
                holes += 1
        if top is None or (p.psn - top) & MASK < 1 << 23:
            top = p.psn
    return holes


def test_faults_are_found_on_lossy_captures(tmp_path):
    """Loss does not hide faults: on a capture with real losses and go-backs, a resend
    whose bytes differ is RETRY-SAME and a bad TVer is TVER, at their frames."""
    recs = m.load(_sim_capture(tmp_path, 1, "loss")[1])
    assert found(recs) == set()
    seen: dict[int, int] = {}
    resent = None
    for r in recs:
        p = m.packet(r)
        if p.info.is_request and p.info.write and p.bth.payload_len if False else (
                p.info.is_request and p.payload_len):
            if p.psn in seen:
                resent = r.index
                break
            seen[p.psn] = r.index
    assert resent is not None
    bad = m.edit(recs, resent, lambda b: b.__setitem__(40, b[40] ^ 0xFF))
    assert found(bad) == {(resent, "RETRY-SAME")}
    assert found(m.edit(recs, resent, tver=1)) >= {(resent, "TVER")}


def test_docs_example_is_what_check_prints(cli, tmp_path):
    """docs/check.md's example: rc_pingpong.pcap with frame 2 made a SEND FIRST, the MSN of
    the ACK at frame 10 raised by one and one bit of frame 20's ICRC flipped."""
    recs = load("rc_pingpong.pcap")
    recs = m.edit(recs, 2, opcode=Opcode.RC_SEND_FIRST)
    recs = m.edit(recs, 10, msn=m.packet(recs[9]).msn + 1)
    recs = m.edit(recs, 20, lambda b: b.__setitem__(-2, b[-2] ^ 0x40), fix_icrc=False)
    f = tmp_path / "rc_pingpong.mutated.pcap"
    f.write_bytes(m.to_bytes(recs))
    r = cli(str(f))
    assert r.returncode == 1
    doc = (ROOT / "docs" / "check.md").read_text()
    block = doc[doc.index("$ softrdma check rc_pingpong.mutated.pcap"):]
    block = block[:block.index("$ echo $?")]
    assert r.stdout.splitlines() == block.splitlines()[1:]


def test_garbled_captures_never_crash_the_checker():
    """Flipped bits, cut and inserted bytes (ICRC fixed or not), swapped frames, in every
    capture: the checker reports, it never raises. (9,000 such cases ran clean while it was
    written; this keeps a seeded 150.)"""
    import random

    rng = random.Random(16)
    caps = [m.load(p) for p in ALL]
    for _ in range(150):
        recs = list(rng.choice(caps))
        for _ in range(rng.randint(1, 4)):
            j = rng.randrange(len(recs))
            d = bytearray(recs[j].data)
            k = rng.randrange(14, len(d))
            what = rng.random()
            if what < 0.6:
                d[k] ^= 1 << rng.randrange(8)
            elif what < 0.8:
                del d[k:k + rng.randint(1, 8)]
            else:
                d[k:k] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            recs[j] = dataclasses.replace(recs[j], data=bytes(d))
        if rng.random() < 0.5:
            j = rng.randrange(len(recs))
            try:
                recs = m.edit(recs, j + 1, lambda b: b.__setitem__(rng.randrange(len(b) - 4),
                                                                   rng.randrange(256)))
            except ValueError:
                pass  # the garbling above left no RoCE packet there to edit
        if rng.random() < 0.3:
            a, b = rng.randrange(len(recs)), rng.randrange(len(recs))
            recs[a], recs[b] = recs[b], recs[a]
            recs = m.renumber(recs)
        result = check_records(recs, lossy=rng.random() < 0.3,
                               mtu=rng.choice([None, None, 256, 1024, 4096]))
        assert all(v.rule in RULES for v in result.violations)


def test_package_doctest(monkeypatch):
    import doctest

    import softrdma.check

    monkeypatch.chdir(ROOT)
    assert doctest.testmod(softrdma.check).failed == 0
