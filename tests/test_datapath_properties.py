"""Property tests of the RC/UC/UD data path over the simulated link.

The main property: over a link with any seeded mix of loss (up to 30 %), duplication,
reordering, delay/jitter and bit corruption, every RC message of any kind and size

- completes exactly once and in post order (send CQ wr_ids, all IBV_WC_SUCCESS, with the
  right opcode, byte_len and flags);
- moves the right bytes: every byte of both 1 MiB MRs is checked against a sequential model
  of what the operations legitimately wrote (sends scattered over the receive SGEs, writes
  at the remote offset, reads gathered back into the local SGEs, atomics' original values),
  so nothing lands anywhere else;
- receive completions carry byte_len, imm_data and IBV_WC_WITH_IMM;
- every atomic takes effect exactly once: the test models the target 64-bit words, checks
  each returned original value and the final memory;
- every corrupted packet is dropped on receive (the ICRC, or the structural parse when the
  flipped bit breaks the header), except a flip in BTH byte 4 (FECN/BECN/resv6), which the
  ICRC deliberately does not cover.

Both directions carry traffic at once, both send PSNs start just below 2^24 so the 24-bit
wrap is crossed, and the retransmit timeout is sometimes shorter than the round trip
(spurious go-back-N retries). Deterministic: ``derandomize=True`` and all randomness comes
from the drawn seeds.

The other tests here: heavy corruption (the ICRC fires, everything still arrives); long
messages (the 128-PSN window, AckReq every 66th packet, ACK coalescing and the MSN); the
initiator depth; a dead link (RETRY_EXC_ERR after exactly retry_cnt go-back-N rounds at
4.096 us x 2^timeout, then FLUSH; retry_cnt 7 never gives up; timeout 0 never retries); UC
(a hypothesis property with an exact model of what a lossy link delivers, and the four
loss positions by hand: the damaged message is dropped, later ones arrive intact); UD (GRH
area, Q_Key check, a send over the MTU).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from softrdma.enums import *  # noqa: F401,F403
from softrdma.enums import ibv_qp_state as S
from softrdma.harness.sim import SimNetwork
from softrdma.wire.frames import ip_checksum
from softrdma.wire.opcodes import Opcode as O
from softrdma.qp.psn import psn_diff

# every test twice: packet by packet, then with trains (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("link_mode")

from .datapath_helpers import U64, Wire, pair, sge_place, sge_take

SLOT = 8192
LOCAL_BASE = 0  # slot i: the local buffers of the i-th operation this endpoint initiates
TARGET_BASE = 256 * 1024  # what the peer's RDMA WRITE/READ/atomics target
TARGET_SPAN = 12 * 1024  # small, so operations overlap
N_WORDS = 6  # 64-bit atomic target words at TARGET_BASE + 8k (inside the span on purpose)
RECV_BASE = 512 * 1024  # receive buffer r at RECV_BASE + r * SLOT (up to 64)
MAX_SIZE = 5000

KINDS = ("SEND", "SEND_IMM", "WRITE", "WRITE_IMM", "READ", "FAA", "CAS")
WR = {"SEND": IBV_WR_SEND, "SEND_IMM": IBV_WR_SEND_WITH_IMM, "WRITE": IBV_WR_RDMA_WRITE,
      "WRITE_IMM": IBV_WR_RDMA_WRITE_WITH_IMM, "READ": IBV_WR_RDMA_READ,
      "FAA": IBV_WR_ATOMIC_FETCH_AND_ADD, "CAS": IBV_WR_ATOMIC_CMP_AND_SWP}
WC_OP = {"SEND": IBV_WC_SEND, "SEND_IMM": IBV_WC_SEND, "WRITE": IBV_WC_RDMA_WRITE,
         "WRITE_IMM": IBV_WC_RDMA_WRITE, "READ": IBV_WC_RDMA_READ, "FAA": IBV_WC_FETCH_ADD,
         "CAS": IBV_WC_COMP_SWAP}

sizes = st.one_of(st.sampled_from([0, 1, 7, 1023, 1024, 1025, 2048, 3072, 4096, 4097, MAX_SIZE]),
                  st.integers(0, MAX_SIZE))
op_st = st.fixed_dictionaries({
    "kind": st.sampled_from(KINDS),
    "size": sizes,
    "aux": st.integers(0, 2**64 - 1),  # everything else about the op derives from this
    "signaled": st.sampled_from([True, True, True, False]),
})
plan_st = st.fixed_dictionaries({
    "seed": st.integers(0, 2**32 - 1),
    "loss": st.sampled_from([0.0, 0.05, 0.15, 0.3]),
    "duplicate": st.sampled_from([0.0, 0.05, 0.2]),
    "reorder": st.sampled_from([0.0, 0.1, 0.3]),
    "corrupt": st.sampled_from([0.0, 0.0, 0.03, 0.1]),
    "jitter": st.sampled_from([0.0, 20e-6, 150e-6]),
    "timeout": st.sampled_from([6, 8, 12]),  # 262 us (below a reordered RTT), 1 ms, 16.8 ms
    "rd_atomic": st.sampled_from([1, 2, 4]),
    "psn_a": st.integers(0xFFFFE0, 0xFFFFFF),
    "psn_b": st.integers(0xFFFFF0, 0xFFFFFF) | st.just(0),
    "late_recv": st.sampled_from([False, False, True]),  # receives posted late: RNR NAKs
    "ops_ab": st.lists(op_st, min_size=1, max_size=16),
    "ops_ba": st.lists(op_st, max_size=8),
})


def _split(rng: random.Random, base: int, n: int, room: int) -> list[tuple[int, int]]:
    """An SGE list of total length ``n`` in ``[base, base+room)``: 1-3 pieces with gaps."""
    if n == 0:
        return rng.choice([[], [(base, 0)]])
    k = rng.randint(1, min(3, n))
    cuts = sorted(rng.sample(range(1, n), k - 1)) if k > 1 else []
    lens = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    out, off = [], base
    for ln in lens:
        out.append((off, ln))
        off += ln + rng.choice([0, 8, 64])
    assert off <= base + room
    return out


class Side:
    """One endpoint plus the model of its MR."""

    def __init__(self, ep, init: bytes) -> None:
        self.ep = ep
        self.model = bytearray(init)
        self.n_local = 0
        self.n_recv = 0
        self.recv_posts: list[tuple[int, list]] = []
        self.exp_send: list[tuple] = []  # (wr_id, wc opcode, byte_len, flags)
        self.exp_recv: list[tuple] = []  # (wr_id, wc opcode, byte_len, flags, imm)


def _plan_direction(ops, req: Side, resp: Side, tag: int) -> list:
    """Build the work requests of one direction and apply their effects to the models, in
    post order (an RC QP executes in order, so the sequential model is exact)."""
    posts = []
    read_ranges: list[tuple[int, int]] = []
    for i, op in enumerate(ops):
        rng = random.Random(op["aux"])
        kind, n = op["kind"], op["size"]
        wr_id = tag + i
        slot = LOCAL_BASE + req.n_local * SLOT
        req.n_local += 1
        flags = IBV_SEND_SIGNALED if op["signaled"] else 0
        imm = rng.getrandbits(32)
        post = dict(kind=kind, wr_id=wr_id, flags=flags, imm=imm, remote_offset=None,
                    compare_add=0, swap=0)
        if kind in ("FAA", "CAS"):
            n = 8
            word = TARGET_BASE + 8 * rng.randrange(N_WORDS)
            local = [(slot, 8)]
            (cur,) = U64.unpack_from(resp.model, word)
            if kind == "FAA":
                add = rng.choice([1, rng.getrandbits(64), 2**64 - 1])
                post["compare_add"] = add
                new = (cur + add) & (2**64 - 1)
            else:
                hit = rng.random() < 0.6
                compare = cur if hit else cur ^ (1 << rng.randrange(64))
                swap = rng.getrandbits(64)
                post["compare_add"], post["swap"] = compare, swap
                new = swap if hit else cur
            sge_place(req.model, local, U64.pack(cur))  # the original value comes back
            U64.pack_into(resp.model, word, new)
            post["remote_offset"] = word
            rrange = (word, word + 8)
        else:
            local = _split(rng, slot, n, SLOT)
            if kind in ("WRITE", "WRITE_IMM", "READ"):
                off = TARGET_BASE + rng.randrange(TARGET_SPAN - n + 1)
                post["remote_offset"] = off
                rrange = (off, off + n)
            else:
                rrange = None
            if kind == "READ":
                sge_place(req.model, local, bytes(resp.model[off:off + n]))
            elif kind in ("WRITE", "WRITE_IMM"):
                resp.model[off:off + n] = sge_take(req.model, local)
        # a write or atomic over memory an earlier read of this direction covers must be
        # fenced, or a retried read could legitimately return the newer bytes (IBTA)
        if kind != "READ" and rrange is not None and any(
                rrange[0] < e and s < rrange[1] for s, e in read_ranges if e > s):
            post["flags"] |= IBV_SEND_FENCE
        if kind == "READ":
            read_ranges.append(rrange)
        if kind in ("SEND", "SEND_IMM", "WRITE", "WRITE_IMM") and 0 < n <= 64 and \
                rng.random() < 0.5:
            post["flags"] |= IBV_SEND_INLINE  # copied at post time (max_inline_data 64)
        post["sges"] = local
        if kind in ("SEND", "SEND_IMM", "WRITE_IMM"):
            r = resp.n_recv
            resp.n_recv += 1
            rbase = RECV_BASE + r * SLOT
            if kind == "WRITE_IMM":
                rsges = _split(rng, rbase, rng.choice([0, 16]), SLOT)
            else:
                rsges = _split(rng, rbase, n + rng.choice([0, 0, 1, 100]), SLOT)
                sge_place(resp.model, rsges, sge_take(req.model, local))
            rwr = tag + 0x1000 + r
            resp.recv_posts.append((rwr, rsges))
            resp.exp_recv.append((rwr, IBV_WC_RECV_RDMA_WITH_IMM if kind == "WRITE_IMM"
                                  else IBV_WC_RECV, n,
                                  IBV_WC_WITH_IMM if kind != "SEND" else 0,
                                  imm if kind != "SEND" else None))
        if flags:
            req.exp_send.append((wr_id, WC_OP[kind], n,
                                 IBV_WC_WITH_IMM if kind in ("SEND_IMM", "WRITE_IMM") else 0))
        posts.append(post)
    return posts


def _post(req: Side, posts: list) -> None:
    ep = req.ep
    for p in posts:
        ep.post_send(WR[p["kind"]], [ep.sge(o, ln) for o, ln in p["sges"]], p["wr_id"],
                     remote_offset=p["remote_offset"], imm=p["imm"],
                     compare_add=p["compare_add"], swap=p["swap"], flags=p["flags"])


def _post_recvs(side: Side) -> None:
    for wr_id, rsges in side.recv_posts:
        side.ep.post_recv([side.ep.sge(o, ln) for o, ln in rsges], wr_id)


class CorruptionAudit:
    """Wraps both devices: every packet put on the wire is remembered; every packet that
    arrives and was not sent as is (the link flipped a bit) must be dropped by the receive
    path, unless the flip is in BTH byte 4 (FECN/BECN/resv6: not covered by the ICRC)."""

    def __init__(self, devs, net) -> None:
        self.sent: set[bytes] = set()
        self.corrupted = 0
        self.byte4 = 0
        self.icrc_drops = 0
        self.parse_drops = 0
        # what goes onto the link: with trains, IPv4 packets after a train's first carry
        # the ICRC for their IP ID, not the one the device computed
        inner_send = net._send
        net._send = (lambda src, data, *a, **k:
                     (self.sent.add(bytes(data)), inner_send(src, data, *a, **k))[1])
        for d in devs:
            inner_rx = d.receive
            d.receive = (lambda data, *a, _f=inner_rx, _d=d, **k: self._rx(_d, _f, data, *a, **k))
            inner_train = d.receive_train
            d.receive_train = (lambda parts, *a, _f=inner_train, _d=d, **k:
                               self._rx_train(_d, _f, parts, *a, **k))

    def _rx_train(self, dev, inner, parts, src, dst, *, ip_ids, **k) -> None:
        """A train with a corrupted packet is audited packet by packet (the train path
        hands every packet it does not take whole to the per-packet path anyway)."""
        if all(bytes(p) in self.sent for p in parts):
            return inner(parts, src, dst, ip_ids=ip_ids, **k)
        for p, ip_id in zip(parts, ip_ids):
            dev.receive(bytes(p), src, dst, ip_id=ip_id, **k)

    def _rx(self, dev, inner, data, *a, **k) -> None:
        if bytes(data) in self.sent:
            return inner(data, *a, **k)
        self.corrupted += 1
        if len(data) > 4 and any(bytes(data[:4]) + bytes([data[4] ^ (1 << b)]) + bytes(data[5:])
                                 in self.sent for b in range(8)):
            self.byte4 += 1
            return inner(data, *a, **k)
        c = dev.counters
        before = (c.dropped_pkts, c.icrc_err, c.malformed_pkts, c.drops.get("bad_icrc", 0))
        inner(data, *a, **k)
        after = (c.dropped_pkts, c.icrc_err, c.malformed_pkts, c.drops.get("bad_icrc", 0))
        assert after[0] == before[0] + 1, "a corrupted packet was not dropped"
        if after[1] == before[1] + 1:
            assert after[3] == before[3] + 1
            self.icrc_drops += 1
        else:
            assert after[2] == before[2] + 1, "a corrupted packet was dropped for a reason " \
                "other than the ICRC or a malformed header"
            self.parse_drops += 1


def _check_mem(side: Side, name: str) -> None:
    got = bytes(side.ep.mr.mem)
    if got != bytes(side.model):
        bad = [i for i in range(len(got)) if got[i] != side.model[i]]
        pytest.fail(f"{name}: {len(bad)} bytes differ from the model, first at offset "
                    f"0x{bad[0]:x} (region {bad[0] // SLOT * SLOT:#x}), last 0x{bad[-1]:x}")


def _split_cq(ep) -> tuple[list, list]:
    wcs = ep.cq.poll_all() if len(ep.cq) else []
    return ([w for w in wcs if not w.opcode & IBV_WC_RECV],
            [w for w in wcs if w.opcode & IBV_WC_RECV])


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plan=plan_st)
def test_rc_lossy_link_exactly_once_in_order(plan):
    net = SimNetwork(seed=plan["seed"], loss=plan["loss"], duplicate=plan["duplicate"],
                     reorder=plan["reorder"], corrupt=plan["corrupt"], jitter=plan["jitter"])
    rd = plan["rd_atomic"]
    attrs = {"timeout": plan["timeout"], "max_rd_atomic": rd, "max_dest_rd_atomic": rd}
    with pair(net, "RC", psns=(plan["psn_a"], plan["psn_b"]), a_attrs=attrs,
              b_attrs=dict(attrs)) as (a, b):
        rng = random.Random(plan["seed"])
        for ep in (a, b):
            ep.mr.mem[:] = rng.randbytes(len(ep.mr.mem))
        A, B = Side(a, bytes(a.mr.mem)), Side(b, bytes(b.mr.mem))
        posts_ab = _plan_direction(plan["ops_ab"], A, B, 0x10000)
        posts_ba = _plan_direction(plan["ops_ba"], B, A, 0x20000)
        audit = CorruptionAudit([a.device, b.device], net)
        if not plan["late_recv"]:
            _post_recvs(A)
            _post_recvs(B)
        _post(A, posts_ab)
        _post(B, posts_ba)
        if plan["late_recv"]:
            net.run(until=net.now + 3e-3)
            _post_recvs(A)
            _post_recvs(B)
        net.run(max_events=200_000)  # a passing example needs well under 1000
        assert not net._events and net._next_time() is None, "the simulation did not settle"

        for side, name in ((A, "A"), (B, "B")):
            qp = side.ep.qp
            assert qp.qp_state == S.IBV_QPS_RTS, f"{name} QP left RTS"
            assert not qp.sq, f"{name}: {len(qp.sq)} send WQEs never completed"
            assert not qp.rq, f"{name}: {len(qp.rq)} receives never consumed"
            sends, recvs = _split_cq(side.ep)
            got_s = [(w.wr_id, w.status, w.opcode, w.byte_len, w.wc_flags & IBV_WC_WITH_IMM)
                     for w in sends]
            exp_s = [(wr, IBV_WC_SUCCESS, op, n, fl) for wr, op, n, fl in side.exp_send]
            assert got_s == exp_s, f"{name} send completions"
            got_r = [(w.wr_id, w.status, w.opcode, w.byte_len, w.wc_flags & IBV_WC_WITH_IMM,
                      w.imm_data if w.wc_flags & IBV_WC_WITH_IMM else None) for w in recvs]
            exp_r = [(wr, IBV_WC_SUCCESS, op, n, fl, imm) for wr, op, n, fl, imm in side.exp_recv]
            assert got_r == exp_r, f"{name} receive completions"
            assert all(w.qp_num == qp.qp_num for w in sends + recvs)
        _check_mem(A, "A's MR")
        _check_mem(B, "B's MR")
        dropped = sum(d.counters.icrc_err for d in (a.device, b.device))
        assert dropped == audit.icrc_drops
        if plan["corrupt"] == 0:
            assert audit.corrupted == 0 and dropped == 0


def test_corruption_is_caught_by_the_icrc():
    """A fixed heavy-corruption run: the ICRC check actually fires (icrc_err > 0) and every
    corrupted packet is accounted for; the transfer still completes correctly."""
    net = SimNetwork(seed=11, corrupt=0.25)
    with pair(net, "RC", psns=(0xFFFFF8, 5), a_attrs={"timeout": 8}) as (a, b):
        audit = CorruptionAudit([a.device, b.device], net)
        data = random.Random(1).randbytes(4000)
        a.mr.write(data, len(data), 0)
        for i in range(8):
            b.post_recv(b.sge(RECV_BASE + i * SLOT, 4000), 100 + i)
        for i in range(8):
            a.post_send(IBV_WR_SEND, a.sge(0, 4000), i)
        net.run()
        sends, _ = _split_cq(a)
        _, recvs = _split_cq(b)
        assert [(w.wr_id, w.status) for w in sends] == [(i, IBV_WC_SUCCESS) for i in range(8)]
        assert [(w.wr_id, w.byte_len) for w in recvs] == [(100 + i, 4000) for i in range(8)]
        for i in range(8):
            assert b.mr.read(4000, RECV_BASE + i * SLOT) == data
        icrc = a.device.counters.icrc_err + b.device.counters.icrc_err
        assert net.stats["corrupted"] == audit.corrupted > 10
        assert icrc == audit.icrc_drops > 0
        assert audit.icrc_drops + audit.parse_drops + audit.byte4 == audit.corrupted
        assert a.device.counters.drops.get("bad_icrc", 0) + \
            b.device.counters.drops.get("bad_icrc", 0) == icrc


# ------------------------------------------------------------------------------------------
# Long messages: the 128-PSN unacknowledged window and the AckReq cadence.
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss", [0.0, 0.1])
def test_rc_long_messages_window_and_ackreq(loss):
    """200 KiB WRITE, 150 KiB SEND and a 100 KiB READ (200/150/100 PSNs) across the PSN wrap:
    the requester never runs more than 128 PSNs past the oldest unacknowledged one, sets
    AckReq on every 66th packet of a long message and on each last packet (rxe's
    ``noack_pkts++ > RXE_MAX_PKT_PER_ACK``), and the data arrives intact."""
    net = SimNetwork(seed=21, loss=loss, reorder=0.05 if loss else 0.0)
    with pair(net, "RC", psns=(0xFFFFA0, 7), a_attrs={"timeout": 8}) as (a, b):
        rng = random.Random(4)
        a.mr.mem[:] = rng.randbytes(len(a.mr.mem))
        b.mr.mem[:] = rng.randbytes(len(b.mr.mem))
        W, SN, R = 200 * 1024, 150 * 1024, 100 * 1024
        src_w, src_s = a.mr.read(W, 0), a.mr.read(SN, 300 * 1024)
        src_r = b.mr.read(R, 700 * 1024)
        seen = []

        def watch(i, p):
            if p.info.is_request:
                seen.append((p.psn, p.opcode, p.ackreq, a.qp.engine.comp.psn))
            return False

        Wire(a.device, drop=watch)
        wb = Wire(b.device)
        b.post_recv(b.sge(400 * 1024, SN), 1)
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, W), 10, remote_offset=0)
        a.post_send(IBV_WR_SEND, a.sge(300 * 1024, SN), 11)
        a.post_send(IBV_WR_RDMA_READ, a.sge(550 * 1024, R), 12, remote_offset=700 * 1024)
        net.run()
        assert [(w.wr_id, w.status) for w in a.cq.poll_all()] == \
            [(10, IBV_WC_SUCCESS), (11, IBV_WC_SUCCESS), (12, IBV_WC_SUCCESS)]
        assert [(w.wr_id, w.status, w.byte_len) for w in b.cq.poll_all()] == \
            [(1, IBV_WC_SUCCESS, SN)]
        assert b.mr.read(W, 0) == src_w
        assert b.mr.read(SN, 400 * 1024) == src_s
        assert a.mr.read(R, 550 * 1024) == src_r
        assert all(0 < psn_diff(psn, comp) + 1 <= 129 for psn, _, _, comp in seen)
        assert max(psn_diff(psn, comp) for psn, _, _, comp in seen) == 128
        if loss == 0:
            first_w, first_s = 0xFFFFA0, (0xFFFFA0 + 200) & 0xFFFFFF
            ackreqs = [psn_diff(psn, first_w) for psn, _, ack, _ in seen if ack]
            # WRITE: packets 66, 132, 198 of 200 and the last; SEND: 66, 132 and the last;
            # READ request: always
            assert ackreqs == [65, 131, 197, 199, 200 + 65, 200 + 131, 200 + 149, 350]
            assert len(seen) == 200 + 150 + 1
            assert psn_diff(seen[-1][0], first_s) == 150
            # the responder ACKs exactly the packets that asked (coalescing), with the MSN:
            # 0 inside the WRITE, 1 after it, 2 after the SEND; the READ's responses carry 3
            acks = [(psn_diff(q.psn, first_w), q.msn) for q in wb.pkts
                    if q.opcode == O.RC_ACKNOWLEDGE]
            assert acks == [(65, 0), (131, 0), (197, 0), (199, 1), (265, 1), (331, 1),
                            (349, 2)]
            rr = [q for q in wb.pkts if q.opcode != O.RC_ACKNOWLEDGE]
            assert len(rr) == 100 and {q.msn for q in rr if q.msn is not None} == {3}


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_rc_initiator_depth_limits_outstanding_reads_and_atomics(depth):
    """max_rd_atomic = depth: at most ``depth`` read/atomic requests are outstanding; the
    next goes out only when one completes."""
    net = SimNetwork(seed=8)
    with pair(net, "RC", a_attrs={"max_rd_atomic": depth},
              b_attrs={"max_dest_rd_atomic": depth}) as (a, b):
        wa = Wire(a.device)
        for i in range(8):
            if i % 2:
                a.post_send(IBV_WR_ATOMIC_FETCH_AND_ADD, a.sge(i * 64, 8), i,
                            remote_offset=TARGET_BASE, compare_add=1)
            else:
                a.post_send(IBV_WR_RDMA_READ, a.sge(i * 64, 16), i, remote_offset=TARGET_BASE)
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 8), 100, remote_offset=TARGET_BASE + 512)
        net.run()
        assert [(w.wr_id, w.status) for w in a.cq.poll_all()] == \
            [(i, IBV_WC_SUCCESS) for i in range(8)] + [(100, IBV_WC_SUCCESS)]
        # at t=0 exactly `depth` requests leave; each later one leaves when a response
        # arrives (one round trip of 20 us later per wave)
        t_req = [t for t, q in zip(wa.times, wa.pkts) if q.info.read or q.info.atomic]
        assert len(t_req) == 8
        assert [round(t / 20e-6) for t in t_req] == [i // depth for i in range(8)]
        # four FETCH_ADD 1 on a zeroed word, each exactly once
        assert U64.unpack_from(b.mr.mem, TARGET_BASE)[0] == 4
        assert [U64.unpack_from(a.mr.mem, i * 64)[0] for i in (1, 3, 5, 7)] == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------
# Dead link: RETRY_EXC_ERR after exactly retry_cnt retransmissions, then FLUSH.
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("retry_cnt", [0, 1, 3, 6])
def test_dead_link_retry_exceeded_then_flush(retry_cnt):
    net = SimNetwork(seed=5)
    with pair(net, "RC", a_attrs={"retry_cnt": retry_cnt, "timeout": 10}) as (a, b):
        a.mr.write(bytes(range(256)) * 16, 4096, 0)
        b.post_recv(b.sge(RECV_BASE, 8192), 77)
        net.profile.loss = 1.0  # the link dies after the connection was set up
        wire = Wire(a.device)
        a.post_send(IBV_WR_SEND, a.sge(0, 2500), 1)  # 3 packets
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 100), 2, remote_offset=TARGET_BASE)
        a.post_send(IBV_WR_RDMA_READ, a.sge(8192, 64), 3, remote_offset=TARGET_BASE)
        a.post_send(IBV_WR_SEND, a.sge(0, 10), 4, flags=0)  # unsignaled: flushed anyway
        before_b = bytes(b.mr.mem)
        before_a = bytes(a.mr.mem)
        t0 = net.now
        net.run()
        wcs = a.cq.poll_all()
        assert [(w.wr_id, w.status) for w in wcs] == [
            (1, IBV_WC_RETRY_EXC_ERR), (2, IBV_WC_WR_FLUSH_ERR), (3, IBV_WC_WR_FLUSH_ERR),
            (4, IBV_WC_WR_FLUSH_ERR)]
        assert a.qp.qp_state == S.IBV_QPS_ERR
        assert b.qp.qp_state == S.IBV_QPS_RTS and len(b.cq) == 0 and len(b.qp.rq) == 1
        # one first transmission of every packet plus retry_cnt go-back-N rounds
        per_round = 3 + 1 + 1 + 1
        assert len(wire.raw) == per_round * (1 + retry_cnt)
        assert a.device.counters.completer_retry_err == retry_cnt
        assert a.device.counters.retry_exceeded_err == 1
        assert net.stats["lost"] == len(wire.raw)
        # each round starts from the oldest unacknowledged PSN (go-back-N)
        psns = [p.psn for p in wire.pkts]
        assert psns == psns[:per_round] * (1 + retry_cnt)
        # the error came after (retry_cnt + 1) timeouts of 4.096 us * 2^10 each
        assert net.now - t0 == pytest.approx((retry_cnt + 1) * 4.096e-6 * 1024, rel=1e-6)
        assert bytes(a.mr.mem) == before_a and bytes(b.mr.mem) == before_b


def test_timeout_zero_means_no_retransmit_timer():
    """timeout 0: no retransmit timer at all (rxe qp_timeout_jiffies = 0): a lost request is
    never resent and never fails; the simulation goes idle with the WQE outstanding."""
    net = SimNetwork(seed=5)
    with pair(net, "RC", a_attrs={"timeout": 0, "retry_cnt": 1}) as (a, b):
        net.profile.loss = 1.0
        wire = Wire(a.device)
        a.post_send(IBV_WR_SEND, a.sge(0, 10), 1)
        net.run()
        assert net._next_time() is None and a.qp.engine.retrans_at is None
        assert len(wire.raw) == 1 and len(a.cq) == 0 and len(a.qp.sq) == 1
        assert a.qp.qp_state == S.IBV_QPS_RTS and a.device.counters.completer_retry_err == 0


def test_dead_link_retry_cnt_7_is_infinite():
    """rxe treats retry_cnt 7 like rnr_retry 7: never give up."""
    net = SimNetwork(seed=5)
    with pair(net, "RC", a_attrs={"retry_cnt": 7, "timeout": 10}) as (a, b):
        net.profile.loss = 1.0
        a.post_send(IBV_WR_SEND, a.sge(0, 10), 1)
        net.run(until=net.now + 1.0)  # ~240 timeouts
        assert len(a.cq) == 0 and a.qp.qp_state == S.IBV_QPS_RTS
        assert a.device.counters.completer_retry_err > 200
        net.profile.loss = 0.0
        b.post_recv(b.sge(RECV_BASE, 64), 9)
        net.run(until=net.now + 1.0)
        assert [(w.wr_id, w.status) for w in a.cq.poll_all()] == [(1, IBV_WC_SUCCESS)]
        assert [(w.wr_id, w.byte_len) for w in b.cq.poll_all()] == [(9, 10)]


# ------------------------------------------------------------------------------------------
# UC: a lost packet drops its message (no completion) until the next FIRST/ONLY.
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lose", ["first", "middle", "last", "only"])
def test_uc_lost_packet_drops_only_that_message(lose):
    net = SimNetwork(seed=3)
    with pair(net, "UC", psns=(0xFFFFFE, 0)) as (a, b):
        rng = random.Random(lose)
        msgs = [rng.randbytes(n) for n in (2500, 2500 if lose != "only" else 100, 3000, 500)]
        for i, m in enumerate(msgs):
            a.mr.write(m, len(m), i * SLOT)
        for i in range(4):
            b.post_recv(b.sge(RECV_BASE + i * SLOT, SLOT), 100 + i)
        before = bytes(b.mr.mem)
        # packets: msg0 = 3 (idx 0-2), msg1 = 3 (idx 3-5) or 1 (idx 3), msg2 = 3, msg3 = 1
        victim = {"first": 3, "middle": 4, "last": 5, "only": 3}[lose]
        wire = Wire(a.device, drop=lambda i, p: i == victim)
        for i, m in enumerate(msgs):
            a.post_send(IBV_WR_SEND_WITH_IMM if i == 2 else IBV_WR_SEND,
                        a.sge(i * SLOT, len(m)), i, imm=0xABCD)
        net.run()
        assert len(wire.dropped) == 1
        # UC requesters complete at transmission: all four succeed
        assert [(w.wr_id, w.status) for w in a.cq.poll_all()] == \
            [(i, IBV_WC_SUCCESS) for i in range(4)]
        wcs = b.cq.poll_all()
        # message 1 is dropped whole; messages 2 and 3 take the next receive WQEs in order
        assert [(w.wr_id, w.status, w.byte_len) for w in wcs] == [
            (100, IBV_WC_SUCCESS, 2500), (101, IBV_WC_SUCCESS, 3000), (102, IBV_WC_SUCCESS, 500)]
        assert wcs[1].wc_flags & IBV_WC_WITH_IMM and wcs[1].imm_data == 0xABCD
        assert not wcs[0].wc_flags & IBV_WC_WITH_IMM
        assert b.mr.read(2500, RECV_BASE) == msgs[0]
        assert b.mr.read(3000, RECV_BASE + SLOT) == msgs[2]
        assert b.mr.read(500, RECV_BASE + 2 * SLOT) == msgs[3]
        # nothing outside the three receive buffers changed, and inside them nothing past
        # what landed except (receive 101) leftovers of the dropped message's first packets
        after = bytes(b.mr.mem)
        assert after[:RECV_BASE] == before[:RECV_BASE]
        assert after[RECV_BASE + 2500:RECV_BASE + SLOT] == before[RECV_BASE + 2500:RECV_BASE + SLOT]
        assert after[RECV_BASE + 2 * SLOT + 500:] == before[RECV_BASE + 2 * SLOT + 500:]
        tail = after[RECV_BASE + SLOT + 3000:RECV_BASE + 2 * SLOT]
        assert tail == before[RECV_BASE + SLOT + 3000:RECV_BASE + 2 * SLOT]
        assert len(b.qp.rq) == 1 and b.qp.qp_state == S.IBV_QPS_RTS
        # the packets of the damaged message that still arrived are dropped and counted;
        # a half-received message abandoned at the next FIRST is not a packet drop
        n_drop = {"first": 2, "middle": 1, "last": 0, "only": 0}[lose]
        assert b.device.counters.drops == ({"uc_out_of_seq": n_drop} if n_drop else {})


UC_KINDS = ("SEND", "SEND_IMM", "WRITE", "WRITE_IMM")


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 2**32 - 1), loss=st.sampled_from([0.0, 0.1, 0.3]),
       psn=st.integers(0xFFFFF0, 0xFFFFFF),
       msgs=st.lists(st.tuples(st.sampled_from(UC_KINDS), sizes), min_size=1, max_size=12))
def test_uc_lossy_link_exact_model(seed, loss, psn, msgs):
    """UC over a link that loses packets (no reordering or duplication): a message is
    delivered exactly when all its packets arrive; a damaged message writes only the
    packets before its first loss (a WRITE into its target, a SEND into the receive WQE at
    the head, which the next message then reuses from its start) and completes nothing.
    The test computes the exact expected completions and every byte of B's MR."""
    net = SimNetwork(seed=seed)
    with pair(net, "UC", psns=(psn, 0)) as (a, b):
        rng = random.Random(seed)
        a.mr.mem[:] = rng.randbytes(len(a.mr.mem))
        b.mr.mem[:] = rng.randbytes(len(b.mr.mem))
        model = bytearray(b.mr.mem)
        n_recv = sum(k != "WRITE" for k, _ in msgs)
        for r in range(n_recv):
            b.post_recv(b.sge(RECV_BASE + r * SLOT, SLOT), 1000 + r)
        lost = set()
        idx = 0
        exp_recv, head = [], 0
        for i, (kind, n) in enumerate(msgs):
            npk = max(1, -(-n // 1024))
            pk = list(range(idx, idx + npk))
            idx += npk
            gone = [j for j in pk if rng.random() < loss]
            lost.update(gone)
            arrived = npk if not gone else pk.index(min(gone))  # packets before the loss
            data = bytes(a.mr.mem[i * SLOT:i * SLOT + n])
            nbytes = min(n, arrived * 1024)
            if kind in ("SEND", "SEND_IMM"):
                base = RECV_BASE + head * SLOT
                model[base:base + nbytes] = data[:nbytes]
            else:
                model[TARGET_BASE + i * SLOT:TARGET_BASE + i * SLOT + nbytes] = data[:nbytes]
            if not gone and kind != "WRITE":
                exp_recv.append((1000 + head, IBV_WC_RECV_RDMA_WITH_IMM if kind == "WRITE_IMM"
                                 else IBV_WC_RECV, n, 0x5000 + i if kind != "SEND" else None))
                head += 1
        Wire(a.device, drop=lambda j, p: j in lost)
        for i, (kind, n) in enumerate(msgs):
            a.post_send(WR[kind], a.sge(i * SLOT, n), i,
                        remote_offset=TARGET_BASE + i * SLOT, imm=0x5000 + i)
        net.run()
        sends, _ = _split_cq(a)
        assert [(w.wr_id, w.status) for w in sends] == [(i, IBV_WC_SUCCESS)
                                                        for i in range(len(msgs))]
        _, recvs = _split_cq(b)
        assert [(w.wr_id, w.opcode, w.byte_len,
                 w.imm_data if w.wc_flags & IBV_WC_WITH_IMM else None) for w in recvs] == exp_recv
        assert b.qp.qp_state == S.IBV_QPS_RTS and a.qp.qp_state == S.IBV_QPS_RTS
        got = bytes(b.mr.mem)
        if got != bytes(model):
            bad = [j for j in range(len(got)) if got[j] != model[j]]
            pytest.fail(f"{len(bad)} bytes of B's MR differ from the model, first at {bad[0]:#x}")


# ------------------------------------------------------------------------------------------
# UD: GRH area, Q_Key check, oversize sends.
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 100, 1023, 1024])
def test_ud_send_lands_after_the_grh_area(n):
    import ipaddress
    net = SimNetwork(seed=2)
    with pair(net, "UD") as (a, b):
        data = random.Random(n).randbytes(n)
        a.mr.write(data, n, 0)
        b.mr.mem[RECV_BASE:RECV_BASE + SLOT] = b"\xee" * SLOT
        before = bytes(b.mr.mem)
        b.post_recv(b.sge(RECV_BASE, 40 + 1024), 5)
        a.post_send(IBV_WR_SEND_WITH_IMM, a.sge(0, n), 6, imm=0x1234)
        net.run()
        assert [(w.wr_id, w.status, w.opcode) for w in a.cq.poll_all()] == \
            [(6, IBV_WC_SUCCESS, IBV_WC_SEND)]
        (wc,) = b.cq.poll_all()
        assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (5, IBV_WC_SUCCESS, IBV_WC_RECV,
                                                                  40 + n)
        assert wc.wc_flags & IBV_WC_GRH and wc.wc_flags & IBV_WC_WITH_IMM
        assert wc.imm_data == 0x1234 and wc.src_qp == a.qp.qp_num
        grh = b.mr.read(40, RECV_BASE)
        assert grh[:20] == bytes(20)
        ip = grh[20:40]
        assert ip[0] == 0x45 and ip[9] == 17  # IPv4, no options, UDP
        assert int.from_bytes(ip[2:4], "big") == 20 + 8 + 12 + 8 + 4 + n + (-n & 3) + 4
        assert ip_checksum(ip[:10] + b"\0\0" + ip[12:]) == int.from_bytes(ip[10:12], "big")
        assert ip[12:16] == ipaddress.ip_address(a.device.ip).packed
        assert ip[16:20] == ipaddress.ip_address(b.device.ip).packed
        assert b.mr.read(n, RECV_BASE + 40) == data
        after = bytes(b.mr.mem)
        assert after[:RECV_BASE] == before[:RECV_BASE]
        assert after[RECV_BASE + 40 + n:] == before[RECV_BASE + 40 + n:]


def test_ud_qkey_mismatch_is_dropped_and_counted():
    net = SimNetwork(seed=2)
    with pair(net, "UD") as (a, b):
        b.post_recv(b.sge(RECV_BASE, 2048), 5)
        before = bytes(b.mr.mem)
        from softrdma.verbs_api import SendWR
        wr = SendWR(7, opcode=IBV_WR_SEND, sg=[a.sge(0, 10)])
        wr.set_wr_ud(a.ah, b.qp.qp_num, 0x22222222)  # not b's Q_Key
        a.qp.post_send(wr)
        net.run()
        assert [(w.wr_id, w.status) for w in a.cq.poll_all()] == [(7, IBV_WC_SUCCESS)]
        assert len(b.cq) == 0 and len(b.qp.rq) == 1
        assert b.device.counters.drops == {"qkey_violation": 1}
        assert bytes(b.mr.mem) == before
        # the right Q_Key still works afterwards
        a.post_send(IBV_WR_SEND, a.sge(0, 10), 8)
        net.run()
        assert [(w.wr_id, w.byte_len) for w in b.cq.poll_all()] == [(5, 50)]


def test_ud_send_over_the_mtu_sends_nothing_but_succeeds():
    """C10-93.1.1 as rxe implements it: no packet, a successful send completion."""
    net = SimNetwork(seed=2)
    with pair(net, "UD") as (a, b):
        b.post_recv(b.sge(RECV_BASE, 4096), 5)
        wire = Wire(a.device)
        a.post_send(IBV_WR_SEND, a.sge(0, 1025), 1)
        a.post_send(IBV_WR_SEND, a.sge(0, 1024), 2)
        net.run()
        assert [(w.wr_id, w.status, w.byte_len) for w in a.cq.poll_all()] == \
            [(1, IBV_WC_SUCCESS, 1025), (2, IBV_WC_SUCCESS, 1024)]
        assert len(wire.raw) == 1 and wire.pkts[0].opcode == O.UD_SEND_ONLY
        assert wire.pkts[0].payload_len == 1024
        assert [(w.wr_id, w.byte_len) for w in b.cq.poll_all()] == [(5, 40 + 1024)]
