"""Dissect captures: one record per RoCE frame, as a text line or a JSON object.

This is the engine behind ``softrdma dissect``. The field names of :func:`frame_record`
are a stable interface documented in docs/dissect.md; add fields, never rename them.

Payloads are decoded by :class:`PayloadDissector` plug-ins the caller passes in (the CM's,
:data:`softrdma.cm.dissect.CM_DISSECTOR`, for MADs on QP1): protocols above the wire layer
stay above it, and a frame no plug-in claims keeps exactly the record and line it had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Protocol, Sequence

from .frames import Frame, FrameError, decode_frame
from .headers import HEADERS
from .opcodes import lookup
from .packet import DecodeError, RocePacket, parse
from .pcap import PcapRecord
from .wireshark import wireshark_name

__all__ = ["DissectStats", "PayloadDissector", "frame_record", "format_record", "packet_line",
           "dissect_records"]


class PayloadDissector(Protocol):
    """Decodes the payload of the packets it recognises into more record keys."""

    def fields(self, pkt: RocePacket) -> dict[str, Any] | None:
        """Keys to add to the packet's record (None: not this dissector's packet)."""

    def text(self, rec: dict[str, Any]) -> str | None:
        """The text appended to the record's line (None: nothing to add)."""


@dataclass
class DissectStats:
    frames: int = 0
    roce: int = 0
    skipped: int = 0  # not IP/UDP to port 4791
    undecodable: int = 0  # claimed RoCE (or IP) but malformed
    bad_icrc: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        return (f"{self.frames} frames: {self.roce} RoCE, {self.skipped} not RoCE (skipped), "
                f"{self.undecodable} undecodable, {self.bad_icrc} bad ICRC")


def frame_record(index: int, ts: float, frame: Frame, pkt: RocePacket,
                 payload: Sequence[PayloadDissector] = ()) -> dict[str, Any]:
    """The documented JSON record of one decoded RoCE frame; the keys of the first
    ``payload`` dissector that claims the packet come last."""
    info = pkt.info
    expected = frame.icrc()
    rec: dict[str, Any] = {
        "index": index,
        "time": ts,
        "ip_version": frame.ip_version,
        "src": frame.src,
        "dst": frame.dst,
        "sport": frame.sport,
        "dport": frame.dport,
        "opcode": pkt.opcode,
        "opcode_name": info.name,
        "transport": info.transport.name,
        "qpn": pkt.dest_qp,
        "psn": pkt.psn,
        "ackreq": pkt.ackreq,
        "se": pkt.se,
        "migreq": pkt.migreq,
        "pad": pkt.pad,
        "tver": pkt.tver,
        "pkey": pkt.pkey,
        "fecn": pkt.fecn,
        "becn": pkt.becn,
    }
    for hdr, _ in info.headers:  # extension headers: keys from their descriptions
        h = HEADERS[hdr]
        for f in h.fields:
            if f.attr is not None:
                value = getattr(pkt, f.attr)
                rec[h.record_key(f)] = value
                for key, fn in f.derived:
                    rec[key] = fn(value)
    rec["payload_len"] = pkt.payload_len
    rec["icrc"] = f"0x{pkt.icrc:08x}"
    rec["icrc_expected"] = f"0x{expected:08x}"
    rec["icrc_ok"] = pkt.icrc == expected
    for d in payload:
        extra = d.fields(pkt)
        if extra is not None:
            rec.update(extra)
            break
    return rec


def _ext_headers(opcode: int, value: Any) -> list[str]:
    """The extension headers' text, as the dissector shows them (``value(h, f)`` reads a
    field)."""
    parts = []
    for hdr, _ in lookup(opcode).headers:
        h = HEADERS[hdr]
        shown = [h.label] if h.label else []
        for f in h.fields:
            if f.attr is not None:
                v = value(h, f)
                text = f.describe(v) if f.describe else f.show(v)
                label = f.name if f.text is None else f.text
                shown.append(f"{label}={text}" if label else text)
        if shown:  # the CNP's reserved bytes show nothing
            parts.append(" ".join(shown))
    return parts


def packet_line(pkt: RocePacket) -> str:
    """The dissector's line for a packet without its frame (no index, addresses or ICRC
    verdict): what the trace prints for each packet sent or received."""
    flags = ("A" if pkt.ackreq else "-") + ("S" if pkt.se else "-")
    parts = [f"{pkt.info.name:<34}", f"qpn=0x{pkt.dest_qp:06x}", f"psn={pkt.psn:<8d}", flags]
    parts += _ext_headers(pkt.opcode, lambda h, f: getattr(pkt, f.attr))
    parts.append(f"len={pkt.payload_len}")
    return " ".join(parts)


def format_record(rec: dict[str, Any], payload: Sequence[PayloadDissector] = (), *,
                  time: str | None = None, wireshark_names: bool = False) -> str:
    """One human line for a record made by :func:`frame_record`; a payload dissector's
    text follows after `` | ``. ``time``: a time column after the frame number (as
    tshark's); ``wireshark_names``: the opcode as Wireshark names it (``RC Send First``)."""
    ends = f"{rec['src']}:{rec['sport']} > {rec['dst']}"
    flags = ("A" if rec["ackreq"] else "-") + ("S" if rec["se"] else "-")
    name = wireshark_name(rec["opcode"]) if wireshark_names else rec["opcode_name"]
    parts = [f"{rec['index']:5d}"] + ([time] if time is not None else [])
    parts += [f"{ends:<32}", f"{name:<34}",
              f"qpn=0x{rec['qpn']:06x}", f"psn={rec['psn']:<8d}", flags]
    parts += _ext_headers(rec["opcode"], lambda h, f: rec[h.record_key(f)])
    parts.append(f"len={rec['payload_len']}")
    parts.append("icrc=ok" if rec["icrc_ok"] else f"icrc=BAD({rec['icrc']}!={rec['icrc_expected']})")
    for d in payload:
        text = d.text(rec)
        if text is not None:
            parts.append("| " + text)
            break
    return " ".join(parts)


def dissect_records(records: Iterable[PcapRecord], stats: DissectStats,
                    payload: Sequence[PayloadDissector] = ()) -> Iterator[dict[str, Any]]:
    """Decode pcap records, yielding a record dict per RoCE frame, or an error dict
    ``{"index", "error", "reason"}`` for a frame that should be RoCE but does not decode.
    ``payload``: the dissectors that decode payloads (see :func:`frame_record`)."""
    for r in records:
        stats.frames += 1
        try:
            frame = decode_frame(r.data, r.linktype)
        except FrameError:
            # IP/UDP headers that do not hold together: we cannot tell it was meant for
            # port 4791, so it is skipped like any other non-RoCE frame, but counted.
            stats.skipped += 1
            stats.by_reason["bad_frame"] = stats.by_reason.get("bad_frame", 0) + 1
            continue
        if frame is None or not frame.is_roce:
            stats.skipped += 1
            continue
        try:
            pkt = parse(frame.payload)
        except DecodeError as e:
            stats.undecodable += 1
            stats.by_reason[e.reason] = stats.by_reason.get(e.reason, 0) + 1
            yield {"index": r.index, "time": r.timestamp, "src": frame.src, "dst": frame.dst,
                   "error": str(e), "reason": e.reason}
            continue
        stats.roce += 1
        rec = frame_record(r.index, r.timestamp, frame, pkt, payload)
        if not rec["icrc_ok"]:
            stats.bad_icrc += 1
        yield rec
