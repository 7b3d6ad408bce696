"""The frame maker: a seed frame, aimed at a live QP and damaged by drawing from the tables.

:meth:`FrameMaker.make` takes a seed (a RoCE packet from a capture), decodes it into its
fields and rebuilds it after these stages, each a draw from one table of
:mod:`.mutators` (named in brackets):

1. the opcode, maybe swapped [OPCODE];
2. the target: a device, and a live QP of the seed's transport (85 %) or any pair's;
   its QPN [QPN] and a PSN near the one the QP expects [PSN];
3. RETH / AtomicETH aimed at a real MR of the target [RETH, RKEY, RANGE], atomic operands
   [ATOMIC]; AETH [AETH]; DETH, IETH and immediate data filled in;
4. the BTH [BTH], the payload size [SIZE] and the pad count [PAD];
5. the packet built, then byte-level damage (30 % of frames) [BYTES];
6. a sending socket (the target's peer address 75 % of the time), and the ICRC computed
   for it or not [ICRC, POST_ICRC].

Every mutator applied is counted by name in ``stats.mutations``.
"""

from __future__ import annotations

import random
import socket
from typing import Any

from ...wire.opcodes import OPCODE_LIST, Hdr, Transport
from ...wire.packet import build, parse
from . import mutators as M
from .live import KINDS, UD_QKEY, End, Pair, Side
from .stats import Stats

__all__ = ["FrameMaker", "SendSocket"]

SAME_TRANSPORT = 0.85  # a frame is aimed at a pair of its seed's transport this often
QKEY_RIGHT = 0.8  # a DETH carries the right Q_Key this often
FROM_PEER = 0.75  # a frame is sent from the target's peer address this often
READ_LENGTHS = (1, 64, 1024, 4096, 16384)  # a READ request asks for one of these
_TRANSPORT_KIND = {Transport.RC: ("RC", "SRQ"), Transport.UC: ("UC",), Transport.UD: ("UD",)}
_OPTIONAL = ("va", "rkey", "dma_len", "syndrome", "msn", "swap_add", "compare", "orig", "imm",
             "ieth_rkey", "qkey", "src_qp", "feth")

# a sending socket: (socket, its source address, bound to the target's peer?, target device)
SendSocket = tuple[socket.socket, bytes, bool, int]


class FrameMaker:
    """Makes frames aimed at the fuzzer's live QPs. ``sides``, ``pairs`` and ``socks`` are
    the fuzzer's own lists (pairs it re-creates are seen at once)."""

    def __init__(self, rng: random.Random, stats: Stats, sides: list[Side], pairs: list[Pair],
                 socks: list[SendSocket], addrs: tuple[str, str]) -> None:
        self.rng = rng
        self.stats = stats
        self.sides = sides
        self.pairs = pairs
        self.socks = socks
        self.addrs = addrs

    def _count(self, m: M.Mutator) -> None:
        if m.attack:
            self.stats.m(m.name)

    def make(self, seeds_by_op: dict[int, list[bytes]], ops: list[int]) \
            -> tuple[bytes, int, End | None]:
        """One frame: (its bytes, the index of the socket to send it from, the QP aimed at)."""
        r = self.rng
        st = self.stats
        seed = r.choice(seeds_by_op[r.choice(ops)])
        pkt = parse(seed)
        f = pkt.fields()
        opcode = f.pop("opcode")
        payload = bytes(pkt.payload)
        m = M.OPCODE.choose(r)
        if m is not None:
            self._count(m)
            opcode = m.apply(r)
        info = OPCODE_LIST[opcode]
        t, e, _ = self._pick_target(info)
        side = self.sides[t]
        q = M.QPN.choose(r) if e is not None else M.QPN["qpn_other"]
        if e is not None and q is not None and q.apply is None:  # live_qp: aimed at it
            f["dest_qp"] = e.qpn
            st.to_live_qp += 1
            f["psn"] = self._psn_for(e, info.is_request)
        else:
            q = M.QPN["qpn_other"]
            self._count(q)
            q.apply(r, f, self.pairs[0].a.qpn)  # type: ignore[misc]
        hdrs = {h for h, _ in info.headers}
        if Hdr.RETH in hdrs or Hdr.ATMETH in hdrs:
            n = len(payload) if Hdr.RETH in hdrs else 8
            if info.name.endswith("READ_REQUEST"):
                n = r.choice(READ_LENGTHS)
            f["va"], f["rkey"], f["dma_len"] = self._mr_target(side, n, Hdr.ATMETH in hdrs)
            if Hdr.ATMETH in hdrs:
                self._maybe(M.ATOMIC, f)
        if Hdr.AETH in hdrs:
            self._maybe(M.AETH, f)
        if Hdr.DETH in hdrs:
            f["qkey"] = UD_QKEY if r.random() < QKEY_RIGHT else \
                r.choice((0, 0x80000000, r.getrandbits(32)))
            f["src_qp"] = r.randrange(1 << 24)
        if Hdr.IETH in hdrs:
            f["ieth_rkey"] = r.choice([mr.rkey for mr in side.mrs.values()] + [r.getrandbits(32)])
        if Hdr.IMMDT in hdrs:
            f["imm"] = r.getrandbits(32)
        for k in _OPTIONAL:
            if f.get(k) is None:
                f.pop(k, None)
        self._maybe(M.BTH, f)
        m = M.SIZE.choose(r)
        if m is not None:
            self._count(m)
            payload = m.apply(r, payload)
        pad = None
        m = M.PAD.choose(r)
        if m is not None:
            self._count(m)
            pad = m.apply(r)
        f.pop("pad", None)
        data = build(opcode, payload=payload, pad=pad, **f)
        # byte-level damage, before the ICRC is (maybe) made right again
        if r.random() < M.BYTE_MUTATED:
            st.byte_mutated += 1
            self._damage_bytes(data)
        sock_i = self._pick_sock(t)
        sock, src, _, _ = self.socks[sock_i]
        self._icrc(data, src, socket.inet_aton(self.addrs[t]), sock.getsockname()[1])
        return bytes(data), sock_i, e

    def _maybe(self, table: M.Table, f: dict[str, Any]) -> None:
        """One draw from a table of field mutators: apply what it picks to the fields."""
        m = table.choose(self.rng)
        if m is not None:
            self._count(m)
            m.apply(self.rng, f)

    def _pick_target(self, info: Any) -> tuple[int, End | None, Pair | None]:
        """Target device index and the live QP the frame is aimed at (None: no QP)."""
        r = self.rng
        t = r.randrange(2)
        kinds = _TRANSPORT_KIND.get(info.transport, KINDS)
        if r.random() < SAME_TRANSPORT:
            cands = [p for p in self.pairs if p.kind in kinds]
        else:
            cands = self.pairs
        if not cands:
            return t, None, None
        p = r.choice(cands)
        return t, p.ends[t], p

    def _psn_for(self, e: End, is_request: bool) -> int:
        """A PSN for a frame to ``e``, near the one its responder expects (a request) or its
        completer's or requester's (a response) [PSN]."""
        r = self.rng
        m = M.PSN.choose(r)
        psns = e.psns()
        if psns is None or m is None:  # no engine to aim at (or the draw fell off the end)
            m = M.PSN["psn_random"]
        expected, unacked, nxt = psns or (0, 0, 0)

        def base() -> int:
            if is_request:
                return expected
            return unacked if r.random() < 0.5 else nxt

        self._count(m)
        return m.apply(r, base)

    def _mr_target(self, side: Side, length: int, atomic: bool) -> tuple[int, int, int]:
        """(va, rkey, dma_len) aimed at a real MR most of the time [RETH, RKEY, RANGE]."""
        r = self.rng
        m = M.RETH.choose(r)
        if m is not None and m.apply is not None:
            self._count(m)
            return m.apply(r, length)
        name = r.choices(M.MR_CHOICES, M.MR_WEIGHTS)[0]
        mr = side.mrs[name]
        self.stats.real_key += 1
        key = mr.rkey
        k = M.RKEY.choose(r)
        if k is not None:
            self._count(k)
            key = k.apply(r, key)
        rng_m = M.RANGE.choose(r)
        assert rng_m is not None  # the RANGE table covers [0, 1)
        self._count(rng_m)
        off, n = rng_m.apply(r, mr.length, length)
        if atomic and r.random() < M.ATOMIC_ALIGNED:
            off &= ~7
        return (mr.buf + off) & 0xFFFFFFFFFFFFFFFF, key, n & 0xFFFFFFFF

    def _damage_bytes(self, data: bytearray) -> None:
        """A few steps of byte-level damage [BYTES], each a mutator drawn by weight."""
        r = self.rng
        for _ in range(r.choice(M.BYTE_STEPS)):
            m = M.BYTES.choose_int(r)
            if m.fits(len(data)):
                self._count(m)
                m.apply(r, data)

    def _pick_sock(self, t: int) -> int:
        """A sending socket towards device ``t``: bound to its peer's address 75 % of the
        time (the source-address check passes), else to a stranger's."""
        peer = [i for i, s in enumerate(self.socks) if s[3] == t and s[2]]
        other = [i for i, s in enumerate(self.socks) if s[3] == t and not s[2]]
        return self.rng.choice(peer if self.rng.random() < FROM_PEER else other)

    def _icrc(self, data: bytearray, src: bytes, dst: bytes, sport: int) -> None:
        """The ICRC for the socket the frame leaves from, or not [ICRC, POST_ICRC]."""
        r = self.rng
        m = M.ICRC.choose(r)
        if len(data) < M.ICRC_MIN or m is None or m.apply is None:
            return
        if m.attack:
            self._count(m)
        else:
            self.stats.good_icrc += 1
        m.apply(r, data, src, dst, sport)
        if m.name in ("icrc_right", "icrc_wrong_port"):  # a right ICRC, then damage under it
            p = M.POST_ICRC.choose(r)
            if p is not None:
                self._count(p)
                p.apply(r, data)
