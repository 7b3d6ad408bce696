"""Field-by-field differences between what softrdma sent in a capture replay and what the
real endpoint sent: the readable form of :func:`softrdma.harness.replay.replay_side`'s
result, for test failures.

    from softrdma.harness.replay import load_capture, replay_side
    from softrdma.harness.replaydiff import diff_replay
    res = replay_side(load_capture("rc_pingpong.pcap"), "10.77.0.11", device_name="r0")
    d = diff_replay(res)
    assert d.ok, d.format()

prints, for each of the first packets that differ, its frame number, both packets as
``softrdma dissect`` lines, and every header field, those that differ marked ``!``::

    response 0, frame 6 (RC_ACKNOWLEDGE): 1 field differs
        capture : 6 10.77.0.11:49441 > 10.77.0.12  RC_ACKNOWLEDGE ... psn=13095500 ...
        softrdma: 6 10.77.0.11:49441 > 10.77.0.12  RC_ACKNOWLEDGE ... psn=13095501 ...
          opcode: RC_ACKNOWLEDGE (0x11)
        ! psn: expected 13095500, got 13095501
          dest_qp: 0x000011
          ...

Requests and responses are paired as ``replay_side`` pairs them
(:func:`softrdma.harness.replay.judge`: separately, how the two kinds interleave being
timing, not protocol; aligned by opcode, PSN and ACK kind, so that one packet only one
side sent does not shift every later pair). Only the packets judged different are shown;
those not judged (a loss makes them unknowable) are in ``not_judged`` with their reason,
and ``share()`` says how much was judged. The ICRC softrdma's packet would
carry is computed with the capture's IPv4 ID (rxe numbers its packets; softrdma's sockets
send ID 0), so an ICRC difference is a difference in the covered bytes, not the ID.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from ..wire.dissect import format_record, frame_record
from ..wire.frames import decode_frame, encode_frame
from ..wire.icrc import icrc_ipv4, icrc_ipv6
from ..wire.opcodes import lookup
from ..wire.packet import RocePacket, parse
from .replay import CapturedPacket, FrameVerdict, ReplayResult

__all__ = ["FieldDiff", "PacketDiff", "ReplayDiff", "ReplayMismatch", "diff_replay",
           "packet_fields", "opcode_name"]

#: fields shown in hex, with their digits (keys, addresses, QPNs, immediates, checksums);
#: the rest in decimal
_HEX = {"dest_qp": 6, "src_qp": 6, "syndrome": 2, "pkey": 4, "va": 8, "rkey": 8, "imm": 8,
        "ieth_rkey": 8, "qkey": 8, "icrc": 8, "swap_add": 8, "compare": 8, "orig": 8,
        "feth": 8}
#: BTH bits that are constant in practice: shown only when they differ
_QUIET = {"tver", "pkey", "fecn", "becn", "resv6", "resv7", "migreq", "pad"}


@dataclass
class FieldDiff:
    """One field of a packet pair: ``expected`` from the capture, ``got`` from softrdma
    (``None`` where that packet lacks the field)."""

    name: str
    expected: Any
    got: Any

    @property
    def differs(self) -> bool:
        return self.expected != self.got

    def show(self, v: Any) -> str:
        if v is None:
            return "-"
        if self.name == "opcode":
            return f"{opcode_name(v)} (0x{v:02x})"
        if self.name == "payload":
            return f"{len(v)} bytes"
        if isinstance(v, bool):
            return str(int(v))
        if isinstance(v, int) and self.name in _HEX:
            return f"0x{v:0{_HEX[self.name]}x}"
        return str(v)

    def line(self) -> str:
        if not self.differs:
            return f"  {self.name}: {self.show(self.expected)}"
        if self.name == "payload" and self.expected is not None and self.got is not None:
            i = next((k for k, (x, y) in enumerate(zip(self.expected, self.got)) if x != y),
                     min(len(self.expected), len(self.got)))
            return (f"! payload: first difference at byte {i} "
                    f"(expected {len(self.expected)} bytes, got {len(self.got)})")
        return f"! {self.name}: expected {self.show(self.expected)}, got {self.show(self.got)}"


def opcode_name(opcode: int) -> str:
    info = lookup(opcode)
    return info.name if info is not None else f"opcode 0x{opcode:02x}"


@dataclass
class PacketDiff:
    """The n-th request (or response) softrdma sent beside the capture's n-th; either side
    is ``None`` when one sent fewer packets than the other."""

    kind: str  # "request" or "response"
    index: int  # n among packets of its kind
    frame: int | None  # the capture's frame number of the expected packet
    name: str  # the opcode's name (the capture's packet's, if there is one)
    expected_line: str | None
    got_line: str | None
    fields: list[FieldDiff] = field(default_factory=list)

    @property
    def differing(self) -> list[FieldDiff]:
        return [f for f in self.fields if f.differs]

    def format(self) -> str:
        where = f"{self.kind} {self.index}" + (f", frame {self.frame}" if self.frame else "")
        if self.got_line is None:
            head = f"{where}: softrdma sent nothing (the capture has one more {self.kind})"
        elif self.expected_line is None:
            head = f"{where}: softrdma sent one more {self.kind} than the capture has"
        else:
            n = len(self.differing)
            head = f"{where} ({self.name}): {n} field{'s' if n != 1 else ''} " \
                   f"differ{'s' if n == 1 else ''}"
        lines = [head,
                 f"    capture : {self.expected_line or '-'}",
                 f"    softrdma: {self.got_line or '-'}"]
        if self.expected_line is not None and self.got_line is not None:
            lines += ["    " + f.line() for f in self.fields
                      if f.differs or f.name not in _QUIET]
        return "\n".join(lines)


@dataclass
class ReplayDiff:
    """Every packet pair that differs; :meth:`format` shows the first few."""

    ip: str
    source: str
    n_expected: int
    n_sent: int
    packets: list[PacketDiff]
    completions: list[Any] = field(default_factory=list)
    #: how many of the ``n_expected`` captured packets were judged, and found identical
    judged: int = 0
    identical: int = 0
    #: the captured packets not judged, each with its reason (a loss before it)
    not_judged: list[FrameVerdict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.packets

    def share(self) -> str:
        """The judged share: 'judged J of N frames (I identical, D different, U not
        judged)'."""
        return (f"judged {self.judged} of {self.n_expected} frames ({self.identical} "
                f"identical, {self.judged - self.identical} different, "
                f"{len(self.not_judged)} not judged)")

    def format(self, limit: int = 3) -> str:
        if self.ok and not self.not_judged:
            return (f"softrdma as {self.ip} in {self.source}: all {self.n_sent} packets "
                    "match the capture")
        if self.ok:
            return f"softrdma as {self.ip} in {self.source}: no difference; {self.share()}"
        lines = [f"softrdma as {self.ip} in {self.source}: {len(self.packets)} packet(s) "
                 f"differ (the capture has {self.n_expected} from {self.ip}, softrdma sent "
                 f"{self.n_sent}; {self.share()})"]
        for d in self.packets[:limit]:
            lines.append(d.format())
        if len(self.packets) > limit:
            lines.append(f"... and {len(self.packets) - limit} more")
        return "\n".join(lines)


def packet_fields(pkt: RocePacket) -> dict[str, Any]:
    """Every header field of ``pkt`` in wire order (BTH, then the extension headers), then
    ``payload_len``, ``payload`` (bytes) and ``icrc``."""
    out = pkt.fields()
    out["payload_len"] = pkt.payload_len
    out["payload"] = bytes(pkt.payload)
    out["icrc"] = pkt.icrc
    return out


def _line(roce: bytes, src: bytes, dst: bytes, sport: int, ip_id: int, index: int) -> str:
    """The ``softrdma dissect`` line of one packet, framed as it travelled."""
    frame = decode_frame(encode_frame(roce, src=src, dst=dst, sport=sport, ip_id=ip_id,
                                      ttl=64, fill_icrc=False))
    return " ".join(format_record(frame_record(index, 0.0, frame, parse(roce))).split())


def _pair(kind: str, i: int, ours: tuple[bytes, int] | None,
          theirs: CapturedPacket | None, ends: tuple[bytes, bytes]) -> PacketDiff | None:
    """The diff of one pair, or None when softrdma's packet is the captured one. ``ends``:
    the replayed endpoint's address and its peer's."""
    if theirs is None:
        assert ours is not None
        ob, sport = ours
        p = parse(ob)
        return PacketDiff(kind, i, None, p.name, None, _line(ob, *ends, sport, 0, 0),
                          [FieldDiff(k, None, v) for k, v in packet_fields(p).items()])
    exp = packet_fields(theirs.pkt)
    exp["udp_sport"] = theirs.sport
    exp_line = _line(theirs.roce, theirs.src, theirs.dst, theirs.sport, theirs.ip_id,
                     theirs.index)
    if ours is None:
        return PacketDiff(kind, i, theirs.index, theirs.pkt.name, exp_line, None,
                          [FieldDiff(k, v, None) for k, v in exp.items()])
    ob, sport = ours
    got = packet_fields(parse(ob))
    got["udp_sport"] = sport
    # the ICRC softrdma's packet would carry with the capture's IP ID (see the module doc)
    if len(theirs.src) == 4:
        got["icrc"] = icrc_ipv4(ob, theirs.src, theirs.dst, sport, ip_id=theirs.ip_id)
    else:
        got["icrc"] = icrc_ipv6(ob, theirs.src, theirs.dst, sport)
    if got == exp:
        return None
    names = list(exp) + [k for k in got if k not in exp]
    return PacketDiff(kind, i, theirs.index, theirs.pkt.name, exp_line,
                      _line(ob, theirs.src, theirs.dst, sport, 0, theirs.index),
                      [FieldDiff(k, exp.get(k), got.get(k)) for k in names])


def diff_replay(res: ReplayResult, ip: str, source: str = "the capture") -> ReplayDiff:
    """The differences of ``res`` (softrdma replayed as ``ip`` in ``source``), packet by
    packet: each captured packet judged different beside the softrdma packet paired with
    it (:func:`softrdma.harness.replay.judge` pairs them), and each packet softrdma sent
    that the capture lacks where a loss does not explain it."""
    me = ipaddress.ip_address(ip).packed
    peer = res.expected[0].dst if res.expected else bytes(len(me))
    ends = (me, peer)
    nth: dict[int, int] = {}
    count = {"request": 0, "response": 0}
    for c in res.expected:
        k = "request" if c.pkt.info.is_request else "response"
        nth[c.index] = count[k]
        count[k] += 1
    diffs: list[PacketDiff] = []
    for v in res.verdicts:
        if v.status != "different":
            continue
        if v.kind == "cm":  # a MAD, compared field by field (softrdma.harness.replaycm)
            c = v.captured
            exp_line = _line(c.roce, c.src, c.dst, c.sport, c.ip_id, c.index)
            got = v.ours
            diffs.append(PacketDiff("cm", nth.get(c.index, 0), c.index, c.pkt.name, exp_line,
                                    _line(got[0], c.src, c.dst, got[1], 0, c.index)
                                    if got else None,
                                    [FieldDiff(k, e, g) for k, e, g in (v.fields or [])]
                                    or [FieldDiff("reason", v.reason, "")]))
            continue
        d = _pair(v.kind, nth[v.captured.index], v.ours, v.captured, ends)
        if d is None:  # the same bytes, told apart by what _pair does not show
            d = PacketDiff(v.kind, nth[v.captured.index], v.frame, v.captured.pkt.name,
                           None, None)
        diffs.append(d)
    sent_nth = {"request": 0, "response": 0}
    index_of: dict[int, int] = {}
    for i, b in enumerate(res.sent):
        k = "request" if parse(b).info.is_request else "response"
        index_of[i] = sent_nth[k]
        sent_nth[k] += 1
    pos = {id(b): i for i, b in enumerate(res.sent)}
    for x in res.extra:
        if x.judged:
            p = parse(x.data)
            k = "request" if p.info.is_request else "response"
            d = _pair(k, index_of.get(pos.get(id(x.data), -1), 0), (x.data, x.sport), None,
                      ends)
            if d is not None:
                diffs.append(d)
    diffs.sort(key=lambda d: d.frame if d.frame is not None else 1 << 62)
    out = ReplayDiff(ip, source, len(res.expected), len(res.sent), diffs, res.completions)
    out.judged = res.judged
    out.identical = res.count("identical")
    out.not_judged = [v for v in res.verdicts if v.status == "not judged"]
    return out


class ReplayMismatch(AssertionError):
    """softrdma did not send what the capture shows: the message is :meth:`ReplayDiff.format`,
    ``.diff`` the :class:`ReplayDiff` itself."""

    def __init__(self, diff: ReplayDiff, limit: int = 3) -> None:
        super().__init__(diff.format(limit))
        self.diff = diff
