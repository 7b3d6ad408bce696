"""A stretch of a long capture: frames A-B, or seconds T0-T1 from its first packet.

A capture of a slow transfer can hold a million packets; the question is about forty of
them. A :class:`Stretch` picks them out of a stream of pcap records without holding the
rest: :meth:`Stretch.select` yields the records inside and stops pulling from the source as
soon as one lies past the end, so a stretch near the start of a huge file reads only
that far. :meth:`Stretch.prefix` yields everything up to the end, for a reader that needs
the history before the stretch (the checker, whose recovery report marks the stretch).

    >>> Stretch.parse_frames("100-140").describe()
    'frames 100-140'
    >>> Stretch.parse_time("0.5-0.75").describe()
    'seconds 0.5-0.75 from the first packet'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from ..wire.pcap import PcapRecord

__all__ = ["Stretch"]


def _pair(text: str, kind: type, what: str) -> tuple:
    a, sep, b = text.partition("-")
    try:
        if not sep:
            raise ValueError
        lo, hi = kind(a), kind(b)
    except ValueError:
        raise ValueError(f"{text!r}: expected {what}") from None
    if lo < 0 or hi < lo:
        raise ValueError(f"{text!r}: expected {what}, the first no larger than the second")
    return lo, hi


@dataclass(frozen=True)
class Stretch:
    """Frames ``first``-``last`` (1-based, both included, as tshark numbers them) and/or
    capture times ``t0``-``t1`` in seconds since the capture's first record (both
    included). A bound left None is open."""

    first: int | None = None
    last: int | None = None
    t0: float | None = None
    t1: float | None = None

    @classmethod
    def parse_frames(cls, text: str) -> "Stretch":
        """``"A-B"``: frames A to B."""
        a, b = _pair(text, int, "frames as A-B, e.g. 100-140")
        if a < 1:
            raise ValueError(f"{text!r}: frames are numbered from 1")
        return cls(first=a, last=b)

    @classmethod
    def parse_time(cls, text: str) -> "Stretch":
        """``"T0-T1"``: seconds from the capture's first packet."""
        t0, t1 = _pair(text, float, "seconds as T0-T1, e.g. 0.5-0.75")
        return cls(t0=t0, t1=t1)

    def also(self, other: "Stretch") -> "Stretch":
        """Both stretches' bounds (frames from one, times from the other)."""
        return Stretch(self.first if other.first is None else other.first,
                       self.last if other.last is None else other.last,
                       self.t0 if other.t0 is None else other.t0,
                       self.t1 if other.t1 is None else other.t1)

    def describe(self) -> str:
        parts = []
        if self.first is not None or self.last is not None:
            parts.append(f"frames {self.first or 1}-{'' if self.last is None else self.last}")
        if self.t0 is not None or self.t1 is not None:
            parts.append(f"seconds {self.t0 or 0:g}-{'' if self.t1 is None else f'{self.t1:g}'}"
                         f" from the first packet")
        return ", ".join(parts) or "the whole capture"

    def _past_end(self, r: PcapRecord, start: float) -> bool:
        return ((self.last is not None and r.index > self.last)
                or (self.t1 is not None and r.timestamp - start > self.t1))

    def _inside(self, r: PcapRecord, start: float) -> bool:
        return ((self.first is None or r.index >= self.first)
                and (self.t0 is None or r.timestamp - start >= self.t0))

    def prefix(self, records: Iterable[PcapRecord]) -> Iterator[PcapRecord]:
        """Every record up to the stretch's end; stops reading at the first one past it.
        (Times count from the first record: a capture's clock may start anywhere.)"""
        start: float | None = None
        for r in records:
            if start is None:
                start = r.timestamp
            if self._past_end(r, start):
                return
            yield r

    def select(self, records: Iterable[PcapRecord]) -> Iterator[PcapRecord]:
        """The records inside the stretch; stops reading at the first one past its end."""
        start: float | None = None
        for r in self.prefix(records):
            if start is None:
                start = r.timestamp
            if self._inside(r, start):
                yield r
