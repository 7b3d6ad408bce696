"""The two receive paths give every packet the same verdict (softrdma.soft.rx).

A train received whole goes through ``receive_train``, which takes runs of MIDDLE packets
as a run (one ``drop_reason`` for the first packet, ``next_middle`` for the rest, the
responder's ``expects_middle`` and ``take_middles``); everything else goes through
``receive_packet`` one packet at a time. The property: a train of one message (a FIRST,
MIDDLEs, a LAST) with bits flipped in the BTH (opcode, flags with the pad and TVer,
P_Key, FECN/BECN, QPN, AckReq and resv7, PSN), in the RETH, in the ICRC, packets cut
short, lengthened, repeated, lost or swapped, fed to one receiver as a train and to an
identical one packet by packet, leaves both with

- the same verdict for each packet, in order: every drop with its reason and every packet
  the receiver sent (ACK, NAK) with the index of the packet that caused it;
- the same counters, the same responder state (PSN, MSN, opcode, UC drop) and QP state,
  the same receive completions and the same bytes in the receiver's memory.

Receivers differ in what they expect: RC or UC, a WRITE or a SEND, remote write allowed or
not (or revoked after the FIRST, which then arrives on its own), receive buffers big
enough or not, an RDMA length that ends inside the MIDDLEs, a message begun by an ONLY (so
the MIDDLEs are out of sequence), a receive PSN just below the 24-bit wrap. Deterministic
(``derandomize``). Deleting a check from the train path alone makes it fail.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from softrdma.enums import (
    IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE, IBV_MTU_256, IBV_QP_ACCESS_FLAGS,
    IBV_QPS_RTS, IBV_WC_RECV, IBV_WC_SUCCESS,
)
from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import connected_pair
from softrdma.qp.responder import Responder
from softrdma.verbs_api import QPAttr
from softrdma.wire.headers import (
    BTH_ACK, BTH_ACK_OFFSET, BTH_FLAGS_OFFSET, BTH_OPCODE_OFFSET, BTH_PAD_MASK, BTH_PAD_SHIFT,
    BTH_PKEY_OFFSET, BTH_PSN_OFFSET, BTH_QPN_OFFSET, BTH_TVER_MASK,
)
from softrdma.wire.icrc import icrc_ipv4
from softrdma.wire.opcodes import Opcode as O
from softrdma.wire.packet import build, parse

MTU = 256
RQ_PSN = 0xFFFFFE  # the receiver's expected PSN: the train crosses the 24-bit wrap
TARGET = 4096  # where the WRITE lands in the receiver's MR
RECV_AT = 16384  # the receive buffer of the SEND
_SEQ = {("RC", "WRITE"): (O.RC_RDMA_WRITE_FIRST, O.RC_RDMA_WRITE_MIDDLE, O.RC_RDMA_WRITE_LAST),
        ("RC", "SEND"): (O.RC_SEND_FIRST, O.RC_SEND_MIDDLE, O.RC_SEND_LAST),
        ("UC", "WRITE"): (O.UC_RDMA_WRITE_FIRST, O.UC_RDMA_WRITE_MIDDLE, O.UC_RDMA_WRITE_LAST),
        ("UC", "SEND"): (O.UC_SEND_FIRST, O.UC_SEND_MIDDLE, O.UC_SEND_LAST)}
# the same message begun by an ONLY instead: the MIDDLEs that follow are out of sequence
_ONLY = {O.RC_RDMA_WRITE_FIRST: O.RC_RDMA_WRITE_ONLY, O.RC_SEND_FIRST: O.RC_SEND_ONLY,
         O.UC_RDMA_WRITE_FIRST: O.UC_RDMA_WRITE_ONLY, O.UC_SEND_FIRST: O.UC_SEND_ONLY}
_WRITE_STARTS = (O.RC_RDMA_WRITE_FIRST, O.UC_RDMA_WRITE_FIRST, O.RC_RDMA_WRITE_ONLY,
                 O.UC_RDMA_WRITE_ONLY)
# BTH byte ranges by field (wire/headers.py's picture); a flip picks a bit in one of them
_FIELDS = {"opcode": (0, 1), "flags": (1, 2), "pkey": (2, 4), "fecn_resv6": (4, 5),
           "qpn": (5, 8), "ackreq_resv7": (8, 9), "psn": (9, 12), "reth": (12, 28)}


def _answer(data: bytes) -> tuple:
    """What a receiver sent, without what differs between receivers (QPN, ICRC)."""
    p = parse(data)
    return p.name, p.psn, p.syndrome, p.msn, bytes(p.payload)


class Receiver:
    """One receiving QP on its own simulated device, every verdict it gives logged with
    the number of packets received so far: ``("drop", n, reason)``, and ``("sent", n,
    answer)`` for what it transmits (ACKs, NAKs)."""

    def __init__(self, world: dict) -> None:
        self.net = SimNetwork(seed=1, delay=0.0)
        access = IBV_ACCESS_REMOTE_READ | (IBV_ACCESS_REMOTE_WRITE if world["write_ok"] else 0)
        self.a, self.b = connected_pair(
            self.net, world["qp"], mr_size=1 << 15, psns=(RQ_PSN, 5),
            a_attrs=dict(path_mtu=IBV_MTU_256),
            b_attrs=dict(path_mtu=IBV_MTU_256, qp_access_flags=access))
        self.dev = self.b.device
        self.eng = self.dev.qps[self.b.qp.qp_num]
        self.log: list[tuple] = []
        c = self.dev.counters
        drop = c.drop
        self.dev.counters.drop = lambda reason, count=1: (
            self.log.append(("drop", c.rcvd_pkts, reason.value)), drop(reason, count))
        self.dev.transmit = lambda data, dst, sport: self.log.append(
            ("sent", c.rcvd_pkts, _answer(data)))
        if world["op"] == "SEND":
            self.b.post_recv(self.b.sge(RECV_AT, world["recv_len"]), wr_id=7)
        self.src = self.a.device.ip_packed
        self.sport = self.eng.src_port

    def close(self) -> None:
        """Unregister the receiver's simulated devices (and so close their descriptors)."""
        self.net.close()

    def packet(self, op: int, k: int, payload: bytes, world: dict) -> bytearray:
        """Packet ``k`` of the message (PSN RQ_PSN + k), its ICRC right."""
        extra = {}
        if op in _WRITE_STARTS:
            extra = dict(va=self.b.mr.buf + TARGET, rkey=self.b.mr.rkey,
                         dma_len=world["dma_len"])
        p = build(op, psn=(RQ_PSN + k) & 0xFFFFFF, dest_qp=self.b.qp.qp_num, payload=payload,
                  **extra)
        return self.fix(p)

    def fix(self, p: bytearray) -> bytearray:
        if len(p) >= 16:
            p[-4:] = icrc_ipv4(p, self.src, self.dev.ip_packed, self.sport).to_bytes(4, "little")
        return p

    def state(self) -> dict:
        c = self.dev.counters
        del c.drop  # the logging wrapper: not a counter
        resp = self.eng.resp
        wcs = [(w.wr_id, w.status, w.opcode, w.byte_len) for w in self.b.cq.poll_all()]
        return {"counters": c.as_dict(), "log": self.log, "wcs": wcs,
                "resp": (resp.psn, resp.ack_psn, resp.msn, resp.opcode, resp.drop_msg,
                         resp.va - self.b.mr.buf, resp.resid, resp.wqe_offset),
                "qp_state": self.eng.state, "memory": self.b.mr.read(1 << 15, 0)}


def _train(r: Receiver, world: dict, mutations: list) -> list[bytes]:
    first, middle, last = _SEQ[(world["qp"], world["op"])]
    if world["only"]:
        first = _ONLY[first]
    n = world["middles"]
    ops = [first] + [middle] * n + [last]
    lens = [MTU] * (n + 1) + [world["last_len"]]
    pkts = [r.packet(op, k, bytes((k * 7 + i) & 0xFF for i in range(ln)), world)
            for k, (op, ln) in enumerate(zip(ops, lens))]
    for kind, at, where, bit, fix in mutations:
        i = at % len(pkts)
        p = pkts[i]
        if kind in _FIELDS:
            lo, hi = _FIELDS[kind]
            if len(p) >= hi:
                p[lo + where % (hi - lo)] ^= 1 << bit
        elif kind == "payload":
            if len(p) > 16:
                p[12 + where % (len(p) - 16)] ^= 1 << bit
        elif kind == "icrc":
            p[len(p) - 1 - where % 4] ^= 1 << bit
            continue  # the ICRC stays wrong
        elif kind == "truncate":
            del p[where % (len(p) + 1):]
        elif kind == "lengthen":
            p[len(p) - 4:len(p) - 4] = bytes(1 + where % 8)
        elif kind == "repeat":
            pkts.insert(i, bytearray(p))
        elif kind == "lose":
            if len(pkts) > 1:
                del pkts[i]
            continue
        elif kind == "swap":
            j = where % len(pkts)
            pkts[i], pkts[j] = pkts[j], pkts[i]
            continue
        if fix:
            r.fix(p)
    return [bytes(p) for p in pkts]


def _both(world: dict, mutations: list) -> tuple[dict, dict]:
    """The same mutated train through the train path at one receiver and packet by packet
    at another."""
    whole, single = Receiver(world), Receiver(world)
    try:
        return _run_both(whole, single, world, mutations)
    finally:  # each receiver's devices hold descriptors: hypothesis makes hundreds
        whole.close()
        single.close()


def _run_both(whole: "Receiver", single: "Receiver", world: dict,
              mutations: list) -> tuple[dict, dict]:
    # the same changes to each receiver's packets (their QPNs, rkeys and addresses differ)
    train = _train(whole, world, mutations)
    packets = _train(single, world, mutations)
    if world["split"]:  # the first packet in a datagram of its own, as coalesce sends it
        for r, p in ((whole, train.pop(0)), (single, packets.pop(0))):
            r.dev.receive(p, r.src, r.dev.ip_packed, sport=r.sport, verify_icrc=True)
            # the access flags change in the middle of a message (a QP in ERR keeps them)
            if world["revoke_write"] and r.eng.state == IBV_QPS_RTS:
                r.b.qp.modify(QPAttr(qp_access_flags=IBV_ACCESS_REMOTE_READ),
                              IBV_QP_ACCESS_FLAGS)
    whole.dev.receive_train([memoryview(p) for p in train], whole.src, whole.dev.ip_packed,
                            sport=whole.sport, verify_icrc=True)
    for p in packets:
        single.dev.receive(p, single.src, single.dev.ip_packed, sport=single.sport,
                           verify_icrc=True)
    return whole.state(), single.state()


worlds = st.fixed_dictionaries({
    "qp": st.sampled_from(["RC", "UC"]),
    "op": st.sampled_from(["WRITE", "SEND"]),
    "only": st.sampled_from([False] * 5 + [True]),
    "split": st.booleans(),
    "revoke_write": st.sampled_from([False] * 5 + [True]),
    "middles": st.integers(1, 5),
    "last_len": st.sampled_from([1, 3, 100, MTU]),
    "write_ok": st.sampled_from([True] * 5 + [False]),
    # the SEND's receive buffer: all of it, or ending inside the MIDDLEs
    "recv_len": st.sampled_from([8192] * 4 + [3 * MTU, 3 * MTU + 5]),
    # the WRITE's RDMA length: the message's, or ending inside the MIDDLEs
    "dma_len": st.sampled_from([None] * 4 + [2 * MTU, 3 * MTU, 3 * MTU + 1]),
})
mutation = st.tuples(
    st.sampled_from(list(_FIELDS) + ["payload", "icrc", "truncate", "lengthen", "repeat",
                                      "lose", "swap"]),
    st.one_of(st.just(1), st.integers(0, 7)),  # which packet (often the first MIDDLE)
    st.integers(0, 63),  # where in the field (byte), or how much
    # which bit; often the pad (bits 4, 5 of the flags byte) or the top one (SE, FECN, AckReq)
    st.one_of(st.sampled_from([4, 5, 7]), st.integers(0, 7)),
    st.sampled_from([True, True, True, False]))  # the ICRC fixed after the change


def _world(world: dict) -> dict:
    world = dict(world)
    if world["dma_len"] is None:
        world["dma_len"] = (world["middles"] + 1) * MTU + world["last_len"]
    return world


@settings(max_examples=500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds, mutations=st.lists(mutation, max_size=3))
def test_a_mutated_train_gets_the_verdicts_of_its_packets(world, mutations):
    whole, single = _both(_world(world), mutations)
    assert whole["log"] == single["log"]  # each packet's drop reason or answer, in order
    assert whole == single


# A receiver that takes the MIDDLEs whole unless the change says otherwise, and one change
# to the first MIDDLE's BTH: where a check that only one path makes shows at once.
friendly = st.fixed_dictionaries({
    "qp": st.sampled_from(["RC", "UC"]), "op": st.sampled_from(["WRITE", "SEND"]),
    "only": st.just(False), "split": st.booleans(), "revoke_write": st.just(False),
    "middles": st.integers(1, 4), "last_len": st.just(100), "write_ok": st.just(True),
    "recv_len": st.just(8192), "dma_len": st.just(None)})
first_middle = st.tuples(st.sampled_from(list(_FIELDS)[:-1]), st.just(1), st.integers(0, 3),
                         st.integers(0, 7), st.sampled_from([True, True, False]))


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(world=friendly, change=first_middle)
def test_one_bit_of_the_first_middle_gets_the_verdict_of_its_packet(world, change):
    whole, single = _both(_world(world), [change])
    assert whole["log"] == single["log"]
    assert whole == single


def test_a_clean_train_takes_the_shortcut_and_lands_as_its_packets(monkeypatch):
    """Unmutated, the MIDDLEs of the train are taken as one run (so the property above
    compares the shortcut, not receive_packet with itself), and land as packet by packet."""
    taken = []
    take = Responder.take_middles

    def spy(self, packets, mtu):
        n = take(self, packets, mtu)
        taken.append((len(packets), n))
        return n

    monkeypatch.setattr(Responder, "take_middles", spy)
    for qp in ("RC", "UC"):
        for op in ("WRITE", "SEND"):
            world = _world({"qp": qp, "op": op, "only": False, "split": False,
                            "revoke_write": False, "middles": 4, "last_len": 100,
                            "write_ok": True, "recv_len": 8192, "dma_len": None})
            taken.clear()
            whole, single = _both(world, [])
            assert taken == [(4, 4)]
            assert whole == single
            assert whole["counters"]["dropped_pkts"] == 0 and whole["wcs"] == (
                [(7, IBV_WC_SUCCESS, IBV_WC_RECV, 5 * MTU + 100)] if op == "SEND" else [])
            at = RECV_AT if op == "SEND" else TARGET
            sent = b"".join(bytes((k * 7 + i) & 0xFF for i in range(MTU if k < 5 else 100))
                            for k in range(6))
            assert whole["memory"][at:at + len(sent)] == sent


def test_the_bth_offsets_the_receive_path_reads_are_the_fields_parse_decodes():
    """softrdma.soft.rx reads the BTH from bytes at wire.headers' offsets: each offset
    holds the field parse decodes (the QPN runs up to the AckReq byte)."""
    p = bytes(build(O.UC_SEND_MIDDLE, psn=0xABCDEF, dest_qp=0x123456, pkey=0x7ACE, tver=5,
                    ackreq=True, fecn=True, resv7=0x11, payload=b"xy"))
    d = parse(p)
    assert p[BTH_OPCODE_OFFSET] == d.opcode == O.UC_SEND_MIDDLE
    assert (p[BTH_FLAGS_OFFSET] & BTH_PAD_MASK) >> BTH_PAD_SHIFT == d.pad == 2
    assert p[BTH_FLAGS_OFFSET] & BTH_TVER_MASK == d.tver == 5
    assert int.from_bytes(p[BTH_PKEY_OFFSET:BTH_PKEY_OFFSET + 2], "big") == d.pkey == 0x7ACE
    assert int.from_bytes(p[BTH_QPN_OFFSET:BTH_ACK_OFFSET], "big") == d.dest_qp == 0x123456
    assert bool(p[BTH_ACK_OFFSET] << 24 & BTH_ACK) == d.ackreq is True
    assert int.from_bytes(p[BTH_PSN_OFFSET:BTH_PSN_OFFSET + 3], "big") == d.psn == 0xABCDEF
