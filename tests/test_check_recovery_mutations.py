"""softrdma check on captures that hold real loss recovery, each mutated to break one rule.

The sources are captures where loss was repaired for real: softrdma's engines (rxe's
requester, completer and responder) on the simulated network with 6 % loss, captured on the
requester's device and, for the same run, on the responder's (behind the request losses);
rxe's own rc_pingpong.pcap (timeouts, go-backs, duplicates re-ACKed); and the lab's 45
lossy kernel-rxe captures in pcaps/linux-rxe/lossy/ (netem loss, duplication, reordering;
bridge and both guests). Each test first finds, from the packets alone, the recovery it
needs (a PSN-sequence NAK and the go-back that answers it, a re-READ from the middle, a
duplicate WRITE or atomic answered again) and asserts it is there; then it breaks exactly
one recovery rule and asserts the checker reports exactly that (frame, rule). Every
expected frame is the frame the mutation touched, named from the mutation; none is read
from the checker's output. Each source is also asserted clean as it was captured.

A READ response that restarts *later* than the re-READ's offset is not among them: from
the capture it is the same as the response at that offset lost on the way, which is no
fault; nor one that restarts *earlier* (the same bytes as a late network copy). A restart
at the right PSN with the opcode or the length of another offset is, by IBTA 9.4.3 (the
responses of a READ are FIRST/MIDDLE.../LAST by position, each min(MTU, what is left)).

Each verdict is exact: the injected fault at its frame, and nothing else (the captures'
own losses are observations, never violations).
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from pathlib import Path

import pytest

from softrdma.check import check_records
from softrdma.wire.frames import decode_frame
from softrdma.wire.opcodes import Opcode

from . import pcap_mutate as m
from .conftest import ROOT

RXE = ROOT / "pcaps" / "linux-rxe"
MTU = 1024  # connected_pair's path MTU
READ_LEN = 7000  # not a multiple of the MTU: a READ's LAST response is shorter (856)
SEED = 30  # a seed whose capture holds a NAK, a re-READ from offset 3 and duplicates


def found(records, **kw) -> set[tuple[int, str]]:
    return {(v.frame, v.rule) for v in check_records(records, **kw).violations}


def explain(records) -> str:
    return "\n".join(f"frame {v.frame}: {v.rule}: {v.message}"
                     for v in check_records(records).violations)


# ---------------------------------------------------------------- the sources

def sim_capture(path: Path, seed: int, loss: float = 0.06, write_len: int = 3000,
                read_len: int = READ_LEN) -> tuple[Path, Path]:
    """Three rounds of WRITE (``write_len`` bytes), READ (``read_len``) and FETCH_ADD (+1)
    between two softrdma engines on the simulated network with ``loss``, captured on the
    requester's device (``path``) and on the responder's (``path`` with ``.responder``)."""
    from softrdma import enums as E
    from softrdma.harness.sim import SimNetwork
    from softrdma.harness.testing import connected_pair
    from softrdma.soft.capture import PacketCapture
    from softrdma.verbs_api.device import remove_device

    far = path.with_suffix(".responder.pcap")
    net = SimNetwork(seed=seed, loss=loss)
    a, b = connected_pair(net, "RC")
    a.device.capture = PacketCapture(str(path), clock=lambda: net.now)
    b.device.capture = PacketCapture(str(far), clock=lambda: net.now)
    try:
        for i in range(3):
            a.post_send(E.IBV_WR_RDMA_WRITE, a.sge(0, write_len), i, remote_offset=8192)
            a.post_send(E.IBV_WR_RDMA_READ, a.sge(65536, read_len), 10 + i, remote_offset=0)
            a.post_send(E.IBV_WR_ATOMIC_FETCH_AND_ADD, a.sge(200000 + 8 * i, 8), 20 + i,
                        remote_offset=300000, compare_add=1)
        net.run_until(lambda: a.ncomp() >= 9, timeout=30)
        net.run(until=net.now + 0.05)
        assert a.ncomp() == 9
    finally:
        a.device.capture.close()
        b.device.capture.close()
        for e in (a, b):
            e.close()
            with contextlib.suppress(Exception):
                remove_device(e.device.name)
    return path, far


@pytest.fixture(scope="module")
def sim_pair(tmp_path_factory) -> tuple[list, list]:
    near, far = sim_capture(tmp_path_factory.mktemp("recovery") / "sim.pcap", SEED)
    return m.load(near), m.load(far)


@pytest.fixture
def sim(sim_pair) -> list:
    """The capture on the requester's device: it sees every request the requester sent
    and the responses that reached it."""
    return list(sim_pair[0])


@pytest.fixture
def far(sim_pair) -> list:
    """The same run captured on the responder's device: behind the losses of the
    requests, before those of the responses (the other side of the loss)."""
    return list(sim_pair[1])


@lru_cache(maxsize=None)
def _rxe(name: str) -> tuple:
    return tuple(m.load(RXE / name))


# ---------------------------------------------------------------- finding the recovery

def pk(recs, frame: int):
    return m.packet(recs[frame - 1])


def name(p) -> str:
    return Opcode(p.opcode).name


def is_request(p) -> bool:
    return p.info.is_request


def psn_nak(p) -> bool:
    """An ACKNOWLEDGE whose AETH says NAK, PSN sequence error (IBTA 9.3.5: 011 00000)."""
    return p.opcode == Opcode.RC_ACKNOWLEDGE and p.syndrome == 0x60


def ends(rec) -> tuple:
    """(source, destination) address of a record."""
    f = decode_frame(rec.data, rec.linktype)
    return f.ip_src, f.ip_dst


def roce(recs, sender=None):
    """(record, packet) of every RC packet (from ``sender``, an (source, destination)
    pair, when given); other frames (ARP, the CM's UD MADs) are passed over."""
    for r in recs:
        f = decode_frame(r.data, r.linktype)
        if f is None or not f.is_roce or f.payload[0] >= 0x20:  # RC opcodes are 0x00-0x1F
            continue
        if sender is None or (f.ip_src, f.ip_dst) == sender:
            yield r, m.packet(r)


def read_packets(p) -> int:
    """How many PSNs a request takes: a READ's response count, 1 for the rest."""
    return -(-p.dma_len // MTU) if p.opcode == Opcode.RC_RDMA_READ_REQUEST else 1


def first_nak_and_go_back(recs) -> tuple[int, int]:
    """The first PSN-sequence NAK and the first request after it, from the end it was sent
    to, that resends a PSN that end had sent before it (the go-back)."""
    nak = next(r for r, p in roce(recs) if psn_nak(p))
    requester = tuple(reversed(ends(nak)))
    sent = {p.psn + i for r, p in roce(recs[:nak.index], requester) if is_request(p)
            for i in range(read_packets(p))}  # a READ request takes a PSN per response
    back = next(r.index for r, p in roce(recs[nak.index:], requester)
                if is_request(p) and p.psn in sent)
    return nak.index, back


def re_read(recs) -> tuple[int, int, int, int]:
    """A READ request resent from the middle of an earlier READ of its sender: (its frame,
    the earlier READ's first PSN, the offset k in packets, the frame of the first response
    at its PSN after it)."""
    reads: dict[tuple, dict[int, int]] = {}  # sender -> first PSN -> DMA length
    for r, p in roce(recs):
        if p.opcode != Opcode.RC_RDMA_READ_REQUEST:
            continue
        mine = reads.setdefault(ends(r), {})
        base = next((b for b, n in mine.items() if b < p.psn < b + -(-n // MTU)), None)
        if base is None:
            mine.setdefault(p.psn, p.dma_len)
            continue
        answer = next(s.index for s, q in roce(recs[r.index:], tuple(reversed(ends(r))))
                      if name(q).startswith("RC_RDMA_READ_RESPONSE") and q.psn == p.psn)
        return r.index, base, p.psn - base, answer
    raise AssertionError("no re-READ from the middle in this capture")


# ---------------------------------------------------------------- the sources are clean

def test_the_simulated_source_holds_recovery_and_is_clean(sim):
    """The source of the mutations below: a NAK answered by a go-back to the NAK'd PSN, a
    re-READ from offset k (VA + k*MTU, length - k*MTU: IBTA 9.4.3, rxe_req.c req_retry),
    replayed answers, and no rule broken."""
    nak, back = first_nak_and_go_back(sim)
    assert pk(sim, back).psn == pk(sim, nak).psn
    frame, base, k, _ = re_read(sim)
    first = next(r for r in sim if m.packet(r).psn == base
                 and m.packet(r).opcode == Opcode.RC_RDMA_READ_REQUEST)
    assert 1 <= k <= -(-READ_LEN // MTU) - 3  # a re-READ with a MIDDLE, not just the LAST
    assert pk(sim, frame).va == m.packet(first).va + k * MTU
    assert pk(sim, frame).dma_len == READ_LEN - k * MTU
    assert found(sim) == set(), explain(sim)


def test_rc_pingpong_holds_go_backs_and_is_clean():
    """rc_pingpong.pcap: real rxe timeouts; SEND PSNs resent (frames 35-40, 58-64)."""
    recs = list(_rxe("rc_pingpong.pcap"))
    reqs = [(p.psn, src) for p, src in ((m.packet(r), r.data[26:30]) for r in recs)
            if is_request(p)]
    assert len(set(reqs)) < len(reqs)
    assert found(recs) == set(), explain(recs)


def test_a_duplicate_write_re_acked_after_an_atomic_is_clean(tmp_path):
    """A duplicate WRITE is acknowledged again at the responder's last PSN (rxe_resp.c
    ``duplicate_request``: ``send_ack(qp, AETH_ACK_UNLIMITED, prev_psn)``; softrdma's
    responder the same), which may be an atomic's PSN: a plain ACK there is not the
    atomic's answer. Seed 0 with 8 KiB WRITEs and READs holds one: the FETCH_ADD's
    ATOMIC ACKNOWLEDGE is lost, a duplicate WRITE is re-ACKed at the FETCH_ADD's PSN, the
    requester resends the FETCH_ADD and gets its (replayed) ATOMIC ACKNOWLEDGE."""
    recs = m.load(sim_capture(tmp_path / "s0.pcap", 0, write_len=8192, read_len=8192)[0])
    atomics = {p.psn for _, p in roce(recs) if p.opcode == Opcode.RC_FETCH_ADD}
    answered = {p.psn for _, p in roce(recs) if p.opcode == Opcode.RC_ATOMIC_ACKNOWLEDGE}
    re_acks = [r.index for r, p in roce(recs) if p.opcode == Opcode.RC_ACKNOWLEDGE
               and p.syndrome == 0x1F and p.psn in atomics & answered]
    assert re_acks  # a plain ACK at an atomic's PSN, the atomic answered as it should be
    assert found(recs) == set(), explain(recs)


# ---------------------------------------------------------------- recovery rules broken

def test_a_second_nak_for_one_gap(sim):
    """The responder NAKs a PSN-sequence gap once (rxe_resp.c: ``sent_psn_nak``) and again
    only after the requester went back. A copy of the NAK, sent again by the responder (a
    new IPv4 ID: not the network's copy) right after the first and before any go-back
    resend, is NAK-ONCE at the copy's frame."""
    nak, back = first_nak_and_go_back(sim)
    assert back == nak + 1  # nothing between the NAK and the go-back: the copy comes first
    recs, want = second_nak(sim)
    assert psn_nak(pk(recs, nak + 1)) and pk(recs, nak + 1).psn == pk(recs, nak).psn
    assert found(recs) == want == {(nak + 1, "NAK-ONCE")}


def test_a_go_back_to_a_later_psn(sim):
    """After a PSN-sequence NAK the requester resends from the NAK'd PSN (IBTA 9.7.5.2).
    Without the resend of the NAK'd request, the go-back starts at the next PSN the
    requester had sent: NAK-RETRY at the frame of that (now first) resend."""
    nak, back = first_nak_and_go_back(sim)
    recs = m.drop(sim, back)
    shifted = pk(recs, back)
    assert is_request(shifted) and shifted.psn != pk(sim, nak).psn
    assert shifted.psn in {p.psn for p in map(m.packet, sim[:nak]) if is_request(p)}
    assert found(recs) == {(back, "NAK-RETRY")}


def test_a_re_read_answered_with_the_opcode_of_another_offset(sim):
    """A re-READ from offset k is answered from offset k: the first response carries the
    re-READ's PSN, FIRST or MIDDLE (not the READ's last packet: IBTA 9.4.3, rxe's
    ``rdatm_res_state_replay`` goes on with MIDDLE), MTU bytes. Given the opcode of the
    last offset (LAST, with the same MTU bytes and the AETH its real LAST carries), it is
    READ-RESP-OPCODE at that frame."""
    _, _, _, answer = re_read(sim)
    assert pk(sim, answer).opcode == Opcode.RC_RDMA_READ_RESPONSE_MIDDLE
    assert pk(sim, answer).payload_len == MTU
    last = next(r for r in sim[answer:]
                if m.packet(r).opcode == Opcode.RC_RDMA_READ_RESPONSE_LAST)
    recs = m.edit(sim, answer, opcode=Opcode.RC_RDMA_READ_RESPONSE_LAST,
                  syndrome=m.packet(last).syndrome, msn=m.packet(last).msn)
    assert found(recs) == {(answer, "READ-RESP-OPCODE")}


def test_a_re_read_answered_with_the_length_of_another_offset(sim):
    """The same response given the length of the READ's last offset (READ_LEN mod MTU =
    856 bytes) where min(MTU, what is left from offset k) is MTU: READ-RESP-LEN there."""
    _, _, _, answer = re_read(sim)
    short = READ_LEN % MTU
    recs = m.edit(sim, answer, payload=bytes(pk(sim, answer).payload)[:short])
    assert pk(recs, answer).payload_len == short
    assert found(recs) == {(answer, "READ-RESP-LEN")}


def duplicate_answers(recs) -> list[int]:
    """The plain ACKs that acknowledge nothing new: every request up to their PSN had been
    answered (ACK, READ response or atomic ACK) by the same responder before them, so they
    answer a duplicate SEND or WRITE (C9-105: a duplicate is acknowledged again, rxe_resp.c
    ``duplicate_request``). (No PSN wrap in these captures.)"""
    out, answered = [], {}
    for r, p in roce(recs):
        if is_request(p) or p.syndrome is None or p.syndrome & 0x60:
            continue  # requests; NAKs and RNR NAKs answer nothing
        if p.opcode == Opcode.RC_ACKNOWLEDGE and p.psn <= answered.get(ends(r), -1):
            out.append(r.index)
        answered[ends(r)] = max(answered.get(ends(r), -1), p.psn)
    return out


def counted_again(recs, ack: int) -> list:
    """``recs`` as if the responder had executed the duplicate that ``ack`` answers: MSN
    + 1 on that ACK and on every response it sent after it (the MSN of the moment)."""
    for r, p in list(roce(recs[ack - 1:], ends(recs[ack - 1]))):
        if p.msn is not None:
            recs = m.edit(recs, r.index, msn=p.msn + 1)
    return recs


def atomic_replay(recs) -> tuple[int, int]:
    """The first ATOMIC ACKNOWLEDGE that repeats an earlier one's PSN (from the same
    responder): (its frame, the frame of the first)."""
    first: dict[tuple, int] = {}
    for r, p in roce(recs):
        if p.opcode == Opcode.RC_ATOMIC_ACKNOWLEDGE:
            key = (ends(r), p.psn)
            if key in first:
                return r.index, first[key]
            first[key] = r.index
    raise AssertionError("no replayed ATOMIC ACKNOWLEDGE")


def executed_again(recs, replay: int, first: int) -> list:
    """The replayed ATOMIC ACK at ``replay`` as if the atomic had been executed again:
    a FETCH_ADD's original value is then the first answer's plus the add (a CMP_SWAP's,
    the swap value when it had matched, else unchanged: not used here)."""
    p0 = pk(recs, first)
    atomic = next(p for r, p in roce(recs[:replay], tuple(reversed(ends(recs[first - 1]))))
                  if p.psn == p0.psn and p.opcode == Opcode.RC_FETCH_ADD)
    return m.edit(recs, replay, orig=(p0.orig + atomic.swap_add) & (2 ** 64 - 1))


def test_a_duplicate_write_executed_again(sim):
    """A duplicate WRITE is acknowledged again, not executed again (IBTA 9.7.4.1, C9-105;
    rxe_resp.c ``duplicate_request``): its ACK repeats the MSN. The capture's last plain
    ACK answers a duplicate WRITE (the requester resent the WRITE; nothing new was left to
    acknowledge). Executed again, it would carry MSN + 1, and so would every later
    response. Only that ACK is a new MSN to judge: the responses after it are replays of
    READ responses and atomic ACKs, which carry the MSN of the moment and agree with it
    (docs/check.md, MSN). So exactly one MSN violation, at that ACK, whether the checker
    judges each MSN against the previous response or against the capture's majority."""
    dups = duplicate_answers(sim)
    acks = [r.index for r in sim if m.packet(r).opcode == Opcode.RC_ACKNOWLEDGE]
    assert dups and dups[-1] == acks[-1]
    last = dups[-1]
    resent_writes = [r.index for r in sim[:last] if name(m.packet(r)).startswith("RC_RDMA_WRITE")
                     and m.packet(r).psn in {m.packet(q).psn for q in sim[:r.index - 1]}]
    assert resent_writes  # the duplicate WRITE the requester resent
    later = [r.index for r in sim[last:] if m.packet(r).msn is not None]
    assert later and all(name(pk(sim, f)) != "RC_ACKNOWLEDGE" for f in later)
    assert found(counted_again(sim, last)) == {(last, "MSN")}


def test_a_duplicate_write_executed_again_mid_capture(sim):
    """The same fault at the first ACK that answers a duplicate WRITE, with more plain ACKs
    after it: the MSN went wrong once, at that ACK; the later responses only carry the
    responder's (wrong) count on, so a checker that judges each MSN by its step from the
    previous response reports that ACK alone."""
    dups = duplicate_answers(sim)
    assert len(dups) >= 2
    assert found(counted_again(sim, dups[0])) == {(dups[0], "MSN")}


def test_a_duplicate_send_executed_again_in_rxe_capture():
    """rc_pingpong.pcap ends with rxe answering the duplicates of a resent SEND (frames
    58-64 resend PSNs 5209626-5209629, which frame 60 acknowledges): frames 61, 62, 65
    and 66 repeat that ACK. Had the responder executed the SEND again (consumed another
    receive), its last ACK (frame 66, the capture's last) would count it: MSN + 1 there,
    one violation."""
    recs = list(_rxe("rc_pingpong.pcap"))
    dups = duplicate_answers(recs)
    assert dups[-4:] == [61, 62, 65, 66] and len(recs) == 66
    assert found(counted_again(recs, 66)) == {(66, "MSN")}


def test_a_duplicate_send_executed_again_in_rxe_capture_mid_capture():
    """rc_pingpong.pcap frames 41-44 answer the duplicates of the SEND rxe resent after a
    timeout (frames 35-37, 40; frame 38 had acknowledged it). Executed again, the first
    of them (41) counts it: MSN + 1 on it and on every later response of that responder.
    The MSN went wrong at frame 41 and only there."""
    recs = list(_rxe("rc_pingpong.pcap"))
    dups = duplicate_answers(recs)
    assert dups[:4] == [41, 42, 43, 44]
    assert found(counted_again(recs, 41)) == {(41, "MSN")}


def test_a_duplicate_atomic_executed_again(sim):
    """A duplicate atomic is answered with the original value of its first execution
    (IBTA 9.7.4.1.5; rxe replays the saved ATOMIC ACK). Executed again, a FETCH_ADD's
    replayed answer would carry that value plus the add: ATOMIC-REPLAY at that frame."""
    replay, first = atomic_replay(sim)
    assert pk(sim, replay).orig == pk(sim, first).orig
    assert found(executed_again(sim, replay, first)) == {(replay, "ATOMIC-REPLAY")}


def test_a_psn_skipped_at_the_end_of_a_lossy_capture(sim):
    """The requester's last new PSN made one higher wherever it appears (the request, its
    resends, the answers): a PSN skipped and never sent, which no loss explains (the
    responder answered the PSN after it without NAKing): PSN-SEQ at its first frame."""
    psns = [p.psn for _, p in roce(sim) if is_request(p)]
    last = max(psns)
    at = next(r.index for r, p in roce(sim) if p.psn == last)
    recs = sim
    for r, p in roce(sim):
        if p.psn == last:
            recs = m.edit(recs, r.index, psn=last + 1)
    assert found(recs) == {(at, "PSN-SEQ")}


# ---------------------------------------------------------------- behind the losses



def skipped_psns(recs) -> list[int]:
    """Frames where a request arrives ahead of the next PSN its sender had not yet shown:
    a gap in what this capture point saw (a loss before it, or reordering)."""
    out, nxt = [], None
    for r, p in roce(recs):
        if not is_request(p):
            continue
        if nxt is not None and p.psn > nxt:
            out.append(r.index)
        nxt = max(nxt or 0, p.psn + read_packets(p))
    return out


def test_the_responder_side_capture_is_clean(far):
    """Captured on the responder's device, behind the request losses: requests arrive
    after a PSN gap, the responder NAKs, the requester repairs. All legal."""
    assert skipped_psns(far) and any(psn_nak(p) for _, p in roce(far))
    assert found(far) == set(), explain(far)


def test_responder_side_a_second_nak_for_one_gap(far):
    """The responder's own capture: its NAK sent twice for one gap, the copy right after
    the first (the go-back arrives later): NAK-ONCE at the copy."""
    nak, back = first_nak_and_go_back(far)
    assert back > nak + 1
    recs = m.copy(far, nak, nak, ts_ns=far[nak - 1].ts_ns, ip_id=0x4242)
    assert found(recs) == {(nak + 1, "NAK-ONCE")}


def test_responder_side_a_duplicate_write_executed_again(far):
    """The responder's own capture shows the duplicate WRITE arrive after it had
    acknowledged the WRITE, and its answer: the last plain ACK. Counted again (MSN + 1 on
    it and on the responses after it, all replays): MSN there only."""
    last = duplicate_answers(far)[-1]
    responder = ends(far[last - 1])
    later = [p for _, p in roce(far[last:], responder)]
    assert later and all(p.opcode != Opcode.RC_ACKNOWLEDGE for p in later)
    assert found(counted_again(far, last)) == {(last, "MSN")}


def test_responder_side_a_duplicate_atomic_executed_again(far):
    """The responder's own capture: the duplicate FETCH_ADD and its replayed answer;
    executed again, the answer carries the first value plus the add: ATOMIC-REPLAY."""
    replay, first = atomic_replay(far)
    psn = pk(far, replay).psn
    assert any(p.opcode == Opcode.RC_FETCH_ADD and p.psn == psn
               for _, p in roce(far[first:replay - 1]))  # the duplicate, between them
    assert found(executed_again(far, replay, first)) == {(replay, "ATOMIC-REPLAY")}


# ---------------------------------------------------------------- old faults, lossy source

def _families(recs, frame: int) -> list[tuple[str, list]]:
    """One-frame faults at ``frame`` (the existing mutation families of test_check.py)."""
    return [
        ("ICRC", m.edit(recs, frame, lambda b: b.__setitem__(-1, b[-1] ^ 0x01),
                        fix_icrc=False)),
        ("TVER", m.edit(recs, frame, tver=1)),
        ("RESERVED", m.edit(recs, frame, resv7=0x10)),
        ("PKEY", m.edit(recs, frame, pkey=0x8001)),
        ("UDP-DPORT", m.edit(recs, frame, dport=4792)),
    ]


#: faults in the BTH, which a resend repeats from the first copy (RETRY-SAME compares the
#: headers); the ICRC and the UDP port are not the request
IN_THE_REQUEST = {"TVER", "RESERVED", "PKEY"}


def expected(recs, frame: int, rule: str) -> set[tuple[int, str]]:
    """The fault at its frame and, when the frame resends a request and the fault is in
    its headers, RETRY-SAME there too: the resend is no longer the same request."""
    p = pk(recs, frame)
    resend = is_request(p) and any(
        q.psn == p.psn and is_request(q) for _, q in roce(recs[:frame - 1], ends(recs[frame - 1])))
    return {(frame, rule)} | ({(frame, "RETRY-SAME")}
                              if resend and rule in IN_THE_REQUEST else set())


def _in_recovery(sim) -> dict[str, int]:
    nak, back = first_nak_and_go_back(sim)
    _, _, _, answer = re_read(sim)
    return {"nak": nak, "go-back": back, "re-read answer": answer}


@pytest.mark.parametrize("where", ["nak", "go-back", "re-read answer"])
def test_frame_faults_inside_recovery_are_found(sim, where):
    """A fault in a packet of the recovery itself (the NAK, the first resend, a replayed
    READ response) is reported at that frame, and nothing else is (but RETRY-SAME when
    the fault is in a resend's headers)."""
    frame = _in_recovery(sim)[where]
    for rule, recs in _families(sim, frame):
        assert found(recs) == expected(sim, frame, rule), (rule, explain(recs))


def test_a_resend_with_other_bytes_inside_recovery(sim):
    """The go-back's first resend with one byte changed is not a resend: RETRY-SAME."""
    _, back = first_nak_and_go_back(sim)
    recs = m.edit(sim, back, lambda b: b.__setitem__(4, b[4] ^ 0x01))  # the QPN's low bits
    assert found(recs) >= {(back, "RETRY-SAME")}


@pytest.mark.parametrize("frame", [35, 40, 58, 64])
def test_frame_faults_in_rxe_go_backs(frame):
    """rc_pingpong.pcap: faults in packets of rxe's go-back bursts (frames 35 and 58
    start one, 40 and 64 resend a LAST) are found there, and nothing else."""
    recs = list(_rxe("rc_pingpong.pcap"))
    assert m.packet(recs[frame - 1]).psn in {m.packet(r).psn for r in recs[:frame - 1]}
    for rule, bad in _families(recs, frame):
        assert found(bad) == expected(recs, frame, rule), (rule, explain(bad))


def first_resend(recs) -> int:
    """The first RC request whose PSN its sender had already sent to that QP."""
    seen: set[tuple] = set()
    for r, p in roce(recs):
        if is_request(p):
            key = (ends(r), p.dest_qp, p.psn)
            if key in seen:
                return r.index
            seen.add(key)
    raise AssertionError("a lossy capture with no resend")


def recovery_cases(recs) -> dict[str, tuple[list, set]]:
    """The recovery mutations above that ``recs`` holds the path for: name -> (mutated
    records, the expected (frame, rule) set), each derived from the mutation as in the
    tests on the simulated capture."""
    cases: dict[str, tuple[list, set]] = {}
    with contextlib.suppress(StopIteration, AssertionError):
        nak, back = first_nak_and_go_back(recs)
        psn = pk(recs, nak).psn
        # a response covering the NAK'd PSN before the go-back overtakes the NAK (the
        # packet was late, not lost: reordering), and a later start is then no fault; a
        # NAK at a later PSN covers it too (a NAK acknowledges every PSN before its own)
        overtaken = any(p.psn > psn or (p.psn == psn and not psn_nak(p))
                        for _, p in roce(recs[nak:back], ends(recs[nak - 1]))
                        if not is_request(p))
        if pk(recs, back).psn == psn and not overtaken:
            bad = m.drop(recs, back)
            later = pk(bad, back)
            if is_request(later) and later.psn != psn:
                cases["go-back to a later PSN"] = (bad, {(back, "NAK-RETRY")})
    with contextlib.suppress(StopIteration, AssertionError):
        _, _, _, answer = re_read(recs)
        p = pk(recs, answer)
        if p.opcode == Opcode.RC_RDMA_READ_RESPONSE_MIDDLE and p.payload_len == MTU:
            last = next(q for _, q in roce(recs[answer:], ends(recs[answer - 1]))
                        if q.opcode == Opcode.RC_RDMA_READ_RESPONSE_LAST)
            cases["re-READ answered with LAST"] = (
                m.edit(recs, answer, opcode=Opcode.RC_RDMA_READ_RESPONSE_LAST,
                       syndrome=last.syndrome, msn=last.msn), {(answer, "READ-RESP-OPCODE")})
            cases["re-READ answered short"] = (
                m.edit(recs, answer, payload=bytes(p.payload)[:MTU // 2]),
                {(answer, "READ-RESP-LEN")})
    with contextlib.suppress(AssertionError, StopIteration):
        replay, first = atomic_replay(recs)
        if pk(recs, replay).opcode == Opcode.RC_ATOMIC_ACKNOWLEDGE:
            cases["atomic executed again"] = (executed_again(recs, replay, first),
                                              {(replay, "ATOMIC-REPLAY")})
    dups = duplicate_answers(recs)
    if dups:
        last = dups[-1]
        later = [p for _, p in roce(recs[last:], ends(recs[last - 1]))]
        if all(p.opcode != Opcode.RC_ACKNOWLEDGE for p in later):
            cases["duplicate executed again"] = (counted_again(recs, last), {(last, "MSN")})
    return cases


def test_recovery_cases_are_those_of_the_tests_above(sim):
    """recovery_cases (used on the lab's captures) finds on the simulated capture the
    mutations the tests above make, with the same verdicts."""
    cases = recovery_cases(sim)
    assert set(cases) == {"go-back to a later PSN", "re-READ answered with LAST",
                          "re-READ answered short", "atomic executed again",
                          "duplicate executed again"}
    for name_, (bad, want) in cases.items():
        assert found(bad) == want, name_


def second_nak(recs) -> tuple[list, set]:
    """The first PSN-sequence NAK sent again right after itself, before the go-back, as a
    new packet (its own IPv4 ID): NAK-ONCE at the copy."""
    nak, back = first_nak_and_go_back(recs)
    assert back > nak
    bad = m.copy(recs, nak, nak, ts_ns=recs[nak - 1].ts_ns, ip_id=0x4242)
    return bad, {(nak + 1, "NAK-ONCE")}


# ---------------------------------------------------------------- the lab's lossy captures

LAB = RXE / "lossy"

#: the lab's captures (pcaps/linux-rxe/lossy/README.md: kernel rxe to kernel rxe, netem on
#: the sender's side, the receiver's or both; each run at the bridge and in each guest) and
#: the recovery mutations each holds the path for, as recovery_cases finds them in the
#: packets (a go-back answering a NAK with nothing overtaking it, a re-READ from the middle
#: answered by a MIDDLE, a replayed ATOMIC ACK, the last ACK of a duplicate)
LAB_CASES: dict[str, set[str]] = {
    f"{run}.{point}.pcap": set(cases)
    for run, cases in {
        "atomic.loss-both": {"atomic executed again"},
        "atomic.loss-receiver": {"atomic executed again"},
        "rc_pingpong.loss-both": set(),
        "read.loss-both": {"re-READ answered with LAST", "re-READ answered short"},
        "read.loss-receiver": {"re-READ answered with LAST", "re-READ answered short"},
        "read.loss-sender": {"re-READ answered with LAST", "re-READ answered short"},
        "rping.loss-both": {"duplicate executed again"},
        "send.dup": {"duplicate executed again"},
        "send.loss-both": {"duplicate executed again"},
        "send.reorder": set(),
        "write.dup": set(),
        "write.loss-both": {"duplicate executed again"},
        "write.loss-receiver": set(),
        "write.loss-sender": set(),
        "write.reorder": {"duplicate executed again"},
    }.items()
    for point in ("bridge", "g0", "g1")
}
# where a capture point saw the go-back answer its NAK, it depends on the point
for _name in ("atomic.loss-receiver.bridge", "atomic.loss-receiver.g1",
              "send.loss-both.bridge", "send.loss-both.g1", "write.loss-both.bridge",
              "write.loss-both.g1", "write.loss-receiver.bridge", "write.loss-receiver.g1"):
    LAB_CASES[f"{_name}.pcap"].add("go-back to a later PSN")

def nak_once_provable(recs) -> bool:
    """A capture where a second copy of its first PSN-sequence NAK could only be a fault:
    it has one, with a go-back after it, and no go-back of that requester started within
    a round trip (its shortest request-to-ACK time in the capture, plus 1 ms) before it. A
    go-back the responder got after sending the NAK justifies a second (softrdma's
    responder NAKs once per go-back), and from the capture point one sent up to a round
    trip before the NAK may have."""
    nak = next((r for r, p in roce(recs) if psn_nak(p)), None)
    if nak is None:
        return False
    requester = tuple(reversed(ends(nak)))
    sent, top, starts, rtt = {}, None, [], None
    for r, p in roce(recs[:nak.index]):
        if ends(r) == requester and is_request(p):
            if top is not None and p.psn < top and p.psn in sent and (
                    not starts or starts[-1][1] != p.psn):
                starts.append((r.ts_ns, p.psn + read_packets(p)))
            elif starts and starts[-1][1] == p.psn:
                starts[-1] = (starts[-1][0], p.psn + read_packets(p))
            sent.setdefault(p.psn, r.ts_ns)
            top = p.psn if top is None else max(top, p.psn)
        elif ends(r) != requester and p.opcode == Opcode.RC_ACKNOWLEDGE and p.psn in sent:
            d = r.ts_ns - sent[p.psn]
            rtt = d if rtt is None else min(rtt, d)
    window = (rtt or 0) + 1_000_000
    if any(nak.ts_ns - t <= window for t, _ in starts):
        return False
    try:
        first_nak_and_go_back(recs)
    except StopIteration:
        return False
    return True


#: captures with a PSN-sequence NAK and a go-back after it (for the second-NAK mutation)
LAB_NAKS = sorted(n for n in LAB_CASES if nak_once_provable(m.load(LAB / n)))

class LossesTakenForFaults(AssertionError):
    """The injected fault was found at its frame, but so were the capture's own losses."""


def lab_params(names):
    """``names`` as parameters (a capture missing from pcaps/linux-rxe/lossy/ fails)."""
    return [pytest.param(n, id=n) for n in names]


def assert_exactly(bad, want: set) -> None:
    """The fault is found where it was put, and nothing else is reported."""
    got = found(bad)
    assert want <= got, f"{sorted(want - got)} not found:\n{explain(bad)}"
    if got != want:
        raise LossesTakenForFaults(f"also {sorted(got - want)}:\n{explain(bad)}")


@pytest.mark.parametrize("name", lab_params(sorted(LAB_CASES)))
def test_lab_lossy_capture_is_clean(name):
    """Every lab capture, as recorded, breaks no rule: its losses are the network's."""
    recs = m.load(LAB / name)
    assert_exactly(recs, set())


@pytest.mark.parametrize("name", lab_params(sorted(LAB_CASES)))
def test_lab_lossy_capture_frame_faults(name):
    """The old one-frame faults in each lab capture's first resent request (a repair of a
    loss) are found there, and nothing else (RETRY-SAME too for a header fault)."""
    recs = m.load(LAB / name)
    frame = first_resend(recs)
    for rule, bad in _families(recs, frame):
        assert_exactly(bad, expected(recs, frame, rule))


@pytest.mark.parametrize("name", lab_params(sorted(n for n, c in LAB_CASES.items() if c)))
def test_lab_lossy_capture_recovery_mutations(name):
    """Each recovery mutation a lab capture holds the path for is flagged at its frame,
    and nothing else is."""
    recs = m.load(LAB / name)
    cases = recovery_cases(recs)
    assert set(cases) == LAB_CASES[name]
    for _, (bad, want) in sorted(cases.items()):
        assert_exactly(bad, want)


@pytest.mark.parametrize("name", lab_params(LAB_NAKS))
def test_lab_lossy_capture_second_nak(name):
    """A lab capture's first PSN-sequence NAK sent twice: NAK-ONCE at the copy."""
    bad, want = second_nak(m.load(LAB / name))
    assert found(bad) == want


def test_the_second_nak_mutation_has_captures_to_run_on():
    """The selection above (from the packets) leaves most lab captures with a NAK in: the
    second-NAK mutation is tried on real rxe recovery, not on none."""
    assert len(LAB_NAKS) >= 20
