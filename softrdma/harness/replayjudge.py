"""Judging a replay: softrdma's packets paired with the endpoint's captured ones, each
captured packet identical, different or not judged (a loss at or before it makes what
reached the endpoint unknowable), with the evidence of :mod:`.replayloss`."""

from __future__ import annotations

from difflib import SequenceMatcher
from typing import Any

from ..wire.icrc import RC_FLUSH_OPCODE, icrc_ipv4, icrc_ipv6, rxe_flush_icrc
from ..wire.opcodes import Opcode
from ..wire.packet import RocePacket, parse
from .replayloss import Evidence
from .replayresult import CapturedPacket, ExtraPacket, FrameVerdict, ReplayResult

__all__ = ["judge"]


_ACK = int(Opcode.RC_ACKNOWLEDGE)


def _why_not(ev: Evidence, frame: int) -> str | None:
    """Why a packet at ``frame`` cannot be judged (a loss at or before it), or None."""
    e = ev.before(frame)
    return None if e is None else f"after frame {e.frame} ({e.kind}: {e.text})"


def _repeated_ack(res: ReplayResult, c: Any) -> str | None:
    """A plain ACK the endpoint sent again (the same PSN, MSN and syndrome as an earlier
    one): its answer to a duplicate request. When the network made that duplicate after
    the capture point, the capture does not show it, and what softrdma was fed lacks it."""
    p = c.pkt
    if p.opcode != _ACK or p.syndrome is None:
        return None
    for e in res.expected:
        if e.index >= c.index:
            break
        q = e.pkt
        if q.opcode == _ACK and (q.psn, q.msn, q.syndrome) == (p.psn, p.msn, p.syndrome):
            return (f"repeats the ACK of frame {e.index}: the endpoint's answer to a duplicate "
                    "request the capture does not show (made after the capture point)")
    return None


def _why_extra(ev: Evidence, frame: int) -> str | None:
    """Why a packet softrdma sent (replaying ``frame``) that the capture lacks is not
    judged, or None. In a capture with losses it may have been lost before the capture
    point, and the evidence of that (the peer acting as if it never came) may be anywhere
    after it, or nowhere (a later cumulative ACK covers a lost one): not judged. A go-back
    alone is no loss (rxe's timer also fires spuriously), but after one the capture is
    not known to be whole either."""
    e = ev.first_loss() or ev.before(frame)
    return None if e is None else (f"the capture shows losses (first at frame {e.frame}: "
                                   f"{e.text}): it may have been lost before the capture point")


def judge(res: ReplayResult, ev: Evidence, foreign: set[int] | frozenset[int] = frozenset(),
          skipped: dict[int, str] | None = None) -> None:
    """Pair softrdma's packets with the endpoint's captured ones and judge each captured one
    (``res.verdicts``, ``res.extra``, ``res.mismatches``).

    Requests and responses are paired separately (their interleaving is timing), each by
    aligning the two sequences of (opcode, PSN, AETH kind): a packet lost before the capture point,
    or one softrdma did not send, leaves the rest paired. Where the two sequences differ
    over a stretch, its packets are paired in order when the capture shows no loss up to
    there (a difference), and left unpaired after a loss (not judged: what reached the
    endpoint is not known). A captured packet with no partner is a difference, unless a
    loss before it explains it; so is a packet softrdma sent that the capture lacks.
    :func:`softrdma.harness.replaydiff.diff_replay` shows the same field by field."""
    verdicts: dict[int, FrameVerdict] = {}
    res.extra, res.mismatches = [], []
    ours = [(b, sport, at, parse(b)) for b, sport, at in zip(res.sent, res.sports, res.sent_at)]
    for c in res.expected:
        if c.index in ev.copies:
            verdicts[c.index] = FrameVerdict(c.index, _kind(c.pkt), "not judged", c,
                                             reason=f"a copy of frame {ev.copies[c.index]} "
                                                    f"({ev.copy_how.get(c.index, 'same bytes')})"
                                                    " made by the network")
        elif c.index in foreign:
            verdicts[c.index] = FrameVerdict(c.index, _kind(c.pkt), "not judged", c,
                                             reason="not of this conversation's transport")
        elif skipped and c.index in skipped:
            verdicts[c.index] = FrameVerdict(c.index, _kind(c.pkt), "not judged", c,
                                             reason=skipped[c.index])
    shown = {c.pkt.psn for c in res.expected if c.pkt.info.is_request}
    for kind, is_req in (("request", True), ("response", False)):
        o = [x for x in ours if x[3].info.is_request == is_req]
        t = [c for c in res.expected if c.index not in verdicts
             and c.pkt.info.is_request == is_req]
        sm = SequenceMatcher(None, _keys([c.pkt for c in t]), _keys([x[3] for x in o]),
                             autojunk=False)
        ops = sm.get_opcodes()
        # softrdma's packets after the last one paired with the capture's: the capture
        # may end before it would have shown them (cut inside a retransmission burst)
        tail = ops[-1][3] if ops and ops[-1][0] == "insert" else len(o)
        pairs: list[tuple[str, Any, int]] = []  # (how, captured, index into o)
        lone_t: list[Any] = []
        lone_o: list[int] = []
        for tag, i1, i2, j1, j2 in ops:
            n = min(i2 - i1, j2 - j1) if tag in ("equal", "replace") else 0
            for k in range(n):
                c = t[i1 + k]
                if tag == "replace" and _why_not(ev, c.index):
                    # the PSNs part ways after a loss: nothing to pair it with
                    lone_t.append(c)
                    lone_o.append(j1 + k)
                else:
                    pairs.append((tag, c, j1 + k))
            lone_t.extend(t[i1 + n:i2])
            lone_o.extend(range(j1 + n, j2))
        _repair(pairs, lone_o, o)
        lone_t = _pair_lone(pairs, lone_t, lone_o, o)
        for tag, c, j in pairs:
            x = o[j]
            v = verdicts[c.index] = _pair(kind, c, x[0], x[1])
            why = None
            if v.status == "different":
                why = ev.uncertain_at(c.index) or ev.input_before(c.index) or \
                    _atomic_after_uncertainty(ev, c, x[3])
            if why:
                v.status, v.reason = "not judged", why
        for c in lone_t:
            why = _why_not(ev, c.index) or _repeated_ack(res, c)
            verdicts[c.index] = FrameVerdict(
                c.index, kind, "not judged" if why else "different", c,
                reason=why or "softrdma sent nothing in its place")
        for j in sorted(lone_o):
            x = o[j]
            why = _why_extra(ev, x[2]) or (
                f"sent after the last {kind} of the endpoint's the capture shows: the "
                "capture may end before it" if j >= tail else None) or (
                None if is_req else ev.answer_lost(x[3].psn, x[2]))
            if why is None and is_req and x[3].psn not in shown:
                why = (f"the capture never shows PSN {x[3].psn} from the endpoint (lost "
                       "before the capture point, or sent before the capture began)")
            res.extra.append(ExtraPacket(x[0], x[1], x[2], why is None, why or ""))
    res.verdicts = [verdicts[c.index] for c in res.expected]
    for v in res.verdicts:
        if v.status == "different":
            res.mismatches.append(f"{v.kind} (frame {v.frame}): {v.reason}")
    for x in res.extra:
        if x.judged:
            res.mismatches.append(f"softrdma sent {parse(x.data)!r} (replaying frame "
                                  f"{x.after_frame}), the capture has no such packet")


def _keys(pkts: list[RocePacket]) -> list[tuple[int, int, int, int]]:
    """The alignment keys of a sequence: :func:`_key` and how many times it came before,
    so that a first transmission pairs with a first transmission, not with a resend of it
    in a later go-back burst (the longest run would otherwise win)."""
    seen: dict[tuple[int, int, int], int] = {}
    out = []
    for p in pkts:
        k = _key(p)
        n = seen[k] = seen.get(k, -1) + 1
        out.append(k + (n,))
    return out


def _pair_lone(pairs: list[tuple[str, Any, int]], lone_t: list[Any], lone_o: list[int],
               o: list[Any]) -> list[Any]:
    """Pair a captured packet left alone with one of softrdma's left alone that has its
    bytes (a transmission lost before the capture point shifts which resend is which).
    Returns the captured packets still alone."""
    if not lone_t or not lone_o:
        return lone_t
    by_bytes: dict[bytes, list[int]] = {}
    for j in sorted(lone_o):
        by_bytes.setdefault(bytes(o[j][0][:-4]), []).append(j)
    rest = []
    for c in lone_t:
        alt = by_bytes.get(c.roce[:-4])
        if alt:
            j = alt.pop(0)
            lone_o.remove(j)
            pairs.append(("equal", c, j))
        else:
            rest.append(c)
    return rest


def _repair(pairs: list[tuple[str, Any, int]], lone_o: list[int], o: list[Any]) -> None:
    """Where a captured packet is paired with a softrdma packet that differs, but one of
    softrdma's left unpaired has the same key and the captured bytes, pair it with that
    one instead: the alignment cannot tell apart packets with one key (answers to the same
    duplicate READ at different times carry different MSNs)."""
    if not lone_o:
        return
    by_bytes: dict[bytes, list[int]] = {}
    for j in lone_o:
        by_bytes.setdefault(bytes(o[j][0][:-4]), []).append(j)
    for k, (tag, c, j) in enumerate(pairs):
        if bytes(o[j][0][:-4]) == c.roce[:-4]:
            continue
        alt = by_bytes.get(c.roce[:-4])
        if alt:
            j2 = alt.pop(0)
            pairs[k] = (tag, c, j2)
            lone_o.remove(j2)
            lone_o.append(j)
            by_bytes.setdefault(bytes(o[j][0][:-4]), []).append(j)


def _atomic_after_uncertainty(ev: Evidence, c: CapturedPacket, ours: RocePacket) -> str | None:
    """An atomic ACK that differs only in the original value, after a stretch where which
    of the peer's atomics reached the endpoint is not known: the memory it read may hold
    one add or swap more or less (not judged), or None."""
    if not c.pkt.info.atomic or not ours.info.atomic:
        return None
    a, b = c.pkt.fields(), ours.fields()
    if {k for k in a if a[k] != b.get(k)} - {"orig"}:
        return None
    lo = next((w for w in ev.uncertain if w[0] <= c.index), None)
    return None if lo is None else (f"the original value of an atomic after frames {lo[0]}-"
                                    f"{lo[1]}, where which of the peer's atomics reached the "
                                    "endpoint is not known")


def _key(p: RocePacket) -> tuple[int, int, int]:
    """What pairs two packets: opcode, PSN and, for an ACK, whether it is an ACK, an RNR
    NAK or a NAK (a NAK of PSN p and the later ACK of p are different answers)."""
    return p.opcode, p.psn, -1 if p.syndrome is None else p.syndrome >> 5


def _kind(p: RocePacket) -> str:
    return "request" if p.info.is_request else "response"


def _pair(kind: str, c: CapturedPacket, ob: bytes, sport: int) -> FrameVerdict:
    """The verdict on captured ``c`` against softrdma's packet ``ob`` sent from ``sport``."""
    if ob[:-4] != c.roce[:-4]:
        why = f"{parse(ob)!r} != {c.pkt!r}"
    elif sport != c.sport:
        why = f"UDP source port {sport} != {c.sport}"
    else:
        if len(c.src) == 4:
            icrc = icrc_ipv4(ob, c.src, c.dst, sport, ip_id=c.ip_id)
        else:
            icrc = icrc_ipv6(ob, c.src, c.dst, sport)
        if ob[0] == RC_FLUSH_OPCODE:  # softrdma sends rxe's ICRC of a FLUSH
            icrc = rxe_flush_icrc(icrc, ob)
        if icrc == c.pkt.icrc:
            return FrameVerdict(c.index, kind, "identical", c, (ob, sport))
        why = f"ICRC with the captured IP ID 0x{icrc:08x} != 0x{c.pkt.icrc:08x}"
    return FrameVerdict(c.index, kind, "different", c, (ob, sport), why)
