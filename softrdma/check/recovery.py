"""The recovery report: what each flow lost, where, and what it cost to recover.

A capture shows a flow from one point of its path. Packets lost *before* that point never
appear (a hole in a sender's PSNs); packets lost *after* it appear, but their receiver acts
as if they had not (the responder NAKs a PSN the capture already carried, the requester
re-reads a READ response the capture shows). The rule modules infer both while they walk a
flow and record them here, with the NAKs, go-backs, timeouts and duplicates they saw, so
that the question a person with a slow transfer asks ("what did the losses cost, and why")
has its answer: bytes sent twice, the goodput, and the time lost to recovery.

"Time lost" is the union, over the flow's losses, of the time from the first sign of the
loss (the packet's capture, or the hole) to the acknowledgement that covers it.

Every count is kept for any length of capture; the events themselves, which the text and
JSON outputs list and ``softrdma diagram`` draws, are kept up to :data:`MAX_EVENTS` per flow.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KINDS", "RecoveryEvent", "FlowRecovery", "MAX_EVENTS"]

#: event kinds, as the report names them
KINDS = {
    "lost-before": "packets the capture never saw (lost between the sender and the capture "
                   "point)",
    "lost-after": "packets the capture saw that their receiver never got (lost after the "
                  "capture point)",
    "reordered": "a packet that filled a hole late, without being resent",
    "nak": "a PSN sequence error NAK",
    "rnr-nak": "a receiver-not-ready NAK",
    "go-back": "the requester resent from a PSN (after a NAK, a timeout, an implied NAK or "
               "a missing READ response)",
    "timeout": "a go-back that no NAK the requester could act on explains: its retransmit "
               "timer fired",
    "duplicate": "a packet the network delivered twice (the same bytes, not a resend)",
    "not-captured": "an answer to a request the capture never showed: the capture itself "
                    "missed packets",
    "unresolved": "a loss whose repair the capture ends before",
}
MAX_EVENTS = 20000


@dataclass(slots=True)
class RecoveryEvent:
    """One observation: the frame where it shows, its time, what (:data:`KINDS`), the PSN
    it concerns, how many packets, and a sentence for people."""

    frame: int
    ts: float
    kind: str
    psn: int
    count: int
    text: str
    direction: str = "requests"  # "requests" (requester -> responder) or "responses"

    def to_dict(self) -> dict[str, Any]:
        return {"frame": self.frame, "ts": round(self.ts, 6), "kind": self.kind,
                "psn": self.psn, "count": self.count, "direction": self.direction,
                "text": self.text}


@dataclass
class FlowRecovery:
    """What one flow (or UD sender) lost and how it recovered."""

    label: str
    transport: str
    events: list[RecoveryEvent] = field(default_factory=list)
    events_dropped: int = 0  # events beyond MAX_EVENTS (counted, not kept)
    lost_before: Counter = field(default_factory=Counter)  # direction -> packets
    lost_after: Counter = field(default_factory=Counter)  # direction -> packets
    reordered: int = 0
    naks: int = 0
    rnr_naks: int = 0
    go_backs: Counter = field(default_factory=Counter)  # cause -> go-backs
    resent_packets: int = 0
    resent_bytes: int = 0
    duplicates: int = 0
    duplicate_bytes: int = 0
    not_captured: int = 0
    unresolved: int = 0
    timeout_wait: float = 0.0  # silences before go-backs caused by timeouts
    good_bytes: int = 0  # payload bytes moved once (first transmission of each PSN)
    messages: int = 0  # messages sent (each counted once, however often resent)
    first_ts: float | None = None
    last_ts: float | None = None
    time_lost: float = 0.0
    located: Counter = field(default_factory=Counter)  # several capture points: packets
    # some saw and others did not, by which saw them
    _open: dict[int, float] = field(default_factory=dict)  # lost PSN (unwrapped) -> start
    _lost_until: float = float("-inf")

    # -- recording
    def add(self, kind: str, frame: int, ts: float, psn: int, count: int, text: str,
            direction: str = "requests") -> None:
        assert kind in KINDS, kind
        if kind == "lost-before":
            self.lost_before[direction] += count
        elif kind == "lost-after":
            self.lost_after[direction] += count
        elif kind == "reordered":
            self.reordered += count
        elif kind == "nak":
            self.naks += 1
        elif kind == "rnr-nak":
            self.rnr_naks += 1
        elif kind == "duplicate":
            self.duplicates += count
        elif kind == "not-captured":
            self.not_captured += count
        elif kind == "unresolved":
            self.unresolved += count
        if len(self.events) < MAX_EVENTS:
            self.events.append(RecoveryEvent(frame, ts, kind, psn, count, text, direction))
        else:
            self.events_dropped += 1

    def go_back(self, cause: str, frame: int, ts: float, psn: int, text: str,
                silence: float | None = None) -> None:
        """A go-back starting at ``psn``; ``cause`` is "nak", "rnr-nak", "timeout",
        "implied-nak", "re-read" or "unknown"."""
        self.go_backs[cause] += 1
        if cause == "timeout":
            self.timeout_wait += silence or 0.0
            self.add("timeout", frame, ts, psn, 1, text)
        else:
            self.add("go-back", frame, ts, psn, 1, text)

    def reclassify_reordered(self, frame: int, ts: float, psn: int,
                             direction: str = "requests") -> None:
        """A hole counted as lost before the capture point was filled by the packet itself,
        late: reordering, not loss."""
        if self.lost_before[direction] > 0:
            self.lost_before[direction] -= 1
        self.add("reordered", frame, ts, psn, 1, f"PSN {psn} arrived late (reordered, "
                                                  "not resent)", direction)

    def span(self, ts: float) -> None:
        if self.first_ts is None:
            self.first_ts = ts
        self.last_ts = ts

    def good(self, nbytes: int) -> None:
        self.good_bytes += nbytes

    def resent(self, nbytes: int) -> None:
        self.resent_packets += 1
        self.resent_bytes += nbytes

    def duplicated(self, nbytes: int) -> None:
        self.duplicate_bytes += nbytes

    # -- time lost to recovery
    def open(self, apsn: int, ts: float) -> None:
        """A loss of (unwrapped) PSN ``apsn`` first showed at ``ts``."""
        if apsn not in self._open:
            self._open[apsn] = ts

    def close_upto(self, apsn: int, ts: float) -> None:
        """Everything up to ``apsn`` is acknowledged at ``ts``: the losses it covers are
        repaired."""
        if not self._open:
            return
        done = [k for k in self._open if k <= apsn]
        if not done:
            return
        t0 = min(self._open.pop(k) for k in done)
        if t0 >= self._lost_until:
            self.time_lost += ts - t0
            self._lost_until = ts
        elif ts > self._lost_until:
            self.time_lost += ts - self._lost_until
            self._lost_until = ts

    def pending(self) -> list[int]:
        """Unwrapped PSNs of losses not repaired yet."""
        return sorted(self._open)

    # -- reading
    @property
    def duration(self) -> float:
        if self.first_ts is None or self.last_ts is None:
            return 0.0
        return self.last_ts - self.first_ts

    @property
    def goodput(self) -> float | None:
        """Bytes per second moved once, over the flow's span in the capture."""
        d = self.duration
        return self.good_bytes / d if d > 0 else None

    @property
    def eventful(self) -> bool:
        return bool(self.events or self.events_dropped or self.resent_packets
                    or self.located)

    def summary(self) -> dict[str, Any]:
        return {
            "flow": self.label, "transport": self.transport,
            "lost_before_capture": dict(self.lost_before),
            "lost_after_capture": dict(self.lost_after),
            "reordered": self.reordered, "naks": self.naks, "rnr_naks": self.rnr_naks,
            "go_backs": dict(self.go_backs), "resent_packets": self.resent_packets,
            "resent_bytes": self.resent_bytes, "duplicates": self.duplicates,
            "duplicate_bytes": self.duplicate_bytes, "not_captured": self.not_captured,
            "unresolved": self.unresolved, "timeout_wait_s": round(self.timeout_wait, 6),
            "good_bytes": self.good_bytes, "messages": self.messages,
            "duration_s": round(self.duration, 6),
            "goodput_Bps": None if self.goodput is None else round(self.goodput, 1),
            "time_lost_s": round(self.time_lost, 6), "events_dropped": self.events_dropped,
            "located": dict(self.located),
        }

    def text(self) -> str:
        """One paragraph for people."""
        parts = []
        lb, la = self.lost_before, self.lost_after
        for d in ("requests", "responses"):
            if lb[d] or la[d]:
                parts.append(f"{d}: {lb[d]} lost before the capture point, {la[d]} after")
        if self.reordered:
            parts.append(f"{self.reordered} reordered")
        if self.naks or self.rnr_naks:
            parts.append(f"{self.naks} NAK(s), {self.rnr_naks} RNR NAK(s)")
        if self.go_backs:
            causes = ", ".join(f"{n} {c}" for c, n in sorted(self.go_backs.items()))
            parts.append(f"{sum(self.go_backs.values())} go-back(s) ({causes})")
        if self.go_backs.get("timeout"):
            parts.append(f"{self.timeout_wait * 1e3:.1f} ms waited for retransmit timers")
        if self.resent_packets:
            parts.append(f"{self.resent_packets} packet(s) resent ({_size(self.resent_bytes)} "
                         "sent twice)")
        if self.duplicates:
            parts.append(f"{self.duplicates} network duplicate(s)")
        if self.not_captured:
            parts.append(f"{self.not_captured} answer(s) to requests the capture missed")
        if self.unresolved:
            parts.append(f"{self.unresolved} unresolved at the end of the capture")
        for what, k in sorted(self.located.items()):
            parts.append(f"{k} {what}")
        if self.goodput is not None:
            rate = f", {self.messages / self.duration:.0f} messages/s" if self.messages else ""
            parts.append(f"goodput {_size(self.goodput)}/s{rate} over {self.duration:.3f} s")
        if self.time_lost:
            share = f" ({100 * self.time_lost / self.duration:.0f} %)" if self.duration else ""
            parts.append(f"{self.time_lost:.3f} s lost to recovery{share}")
        if not self.eventful:
            parts.insert(0, "no loss")
        return "; ".join(parts)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
