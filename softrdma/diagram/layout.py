"""Where everything goes: one column per lane, one row per moment, time flowing down.

A real time scale would be useless: a burst of packets microseconds apart and then a
67 ms retransmission timeout. So the vertical axis is *ordered* time: every moment (a
packet leaving, a packet arriving, a note) gets a row of its own in time order, and a long
silence is shown as a gap labelled with its length. An arrow goes from its sender's row
to its receiver's row, so the arrows of a burst slope down in parallel, in flight
together, exactly as they were; a capture, which sees each packet at one instant, draws
it level. A lost packet's arrow stops half-way across.

At one instant, arrivals come first, then notes, then departures: a packet arrives, the
receiver completes or changes state, and only then answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .model import Arrow, Diagram, Note

__all__ = ["Geometry", "Layout", "layout", "format_time"]


@dataclass(frozen=True)
class Geometry:
    """The sizes, in pixels (the label font is 12 px monospace, ~7.2 px a character)."""

    col: int = 400  # lane to lane
    left: int = 110  # the time axis
    top: int = 150  # title, legend, lane headers
    send_row: int = 24  # a departing packet: room for its label above the arrow
    recv_row: int = 12  # an arrival
    note_row: int = 28
    gap_row: int = 26  # a long silence
    mark_row: int = 14  # one line of marks under an arrow (see annotate)
    bottom: int = 40
    char: float = 7.2


@dataclass
class Layout:
    """Positions, keyed by the model objects' ids: an arrow's (start y, end y or None
    while it has not arrived), a note's y, the time labels and the gaps."""

    width: int
    height: int
    lane_x: list[float]
    arrow_y: dict[int, tuple[float, float | None]] = field(default_factory=dict)  # id(arrow)
    note_y: dict[int, float] = field(default_factory=dict)  # id(note)
    ticks: list[tuple[float, str]] = field(default_factory=list)  # (y, time label)
    gaps: list[tuple[float, str]] = field(default_factory=list)  # (y, "+67.1 ms")


def format_time(dt: float) -> str:
    """Seconds since the first moment, in a readable unit."""
    if dt < 1e-3:
        return f"{dt * 1e6:.1f} µs"
    if dt < 1.0:
        return f"{dt * 1e3:.3f} ms"
    return f"{dt:.3f} s"


def layout(d: Diagram, g: Geometry = Geometry()) -> Layout:
    """Place ``d``: lanes left to right in their order, moments top to bottom."""
    lane_x = [g.left + g.col / 2 + i * g.col for i in range(len(d.lanes))]
    # moments: (time, rank, order, what, thing); rank orders one instant (see above)
    moments: list[tuple[float, int, int, str, Arrow | Note]] = []
    for i, a in enumerate(d.arrows):
        moments.append((a.send_time, 2, i, "send", a))
        if a.recv_time is not None and a.recv_time > a.send_time:
            moments.append((a.recv_time, 0, i, "recv", a))
    for i, n in enumerate(d.notes):
        moments.append((n.time, 1, i, "note", n))
    moments.sort(key=lambda m: m[:3])
    t0 = moments[0][0] if moments else 0.0
    steps = sorted(b[0] - a[0] for a, b in zip(moments, moments[1:]) if b[0] > a[0])
    # a silence is "long" when it is much longer than the typical step between moments
    typical = steps[len(steps) // 2] if steps else 0.0
    y = float(g.top)
    out = Layout(0, 0, lane_x)
    last_t: float | None = None
    last_tick = ""
    for t, _, _, what, thing in moments:
        if last_t is not None and t - last_t > max(20 * typical, 1e-3):
            y += g.gap_row
            out.gaps.append((y - g.gap_row / 2, f"+{format_time(t - last_t)}"))
        last_t = t
        if what == "send":
            y += g.send_row
            a = thing
            assert isinstance(a, Arrow)
            # level when it arrived at the instant it left (one capture point; a trace's
            # clocks that disagree): its arrival has no row of its own
            level = a.recv_time is not None and a.recv_time <= a.send_time
            out.arrow_y[id(a)] = (y, y if level else None)
        elif what == "recv":
            y += g.recv_row
            y1, _ = out.arrow_y[id(thing)]
            out.arrow_y[id(thing)] = (y1, y)
        else:
            y += g.note_row
            out.note_y[id(thing)] = y
        label = format_time(t - t0)
        if what != "recv" and label != last_tick:
            out.ticks.append((y, label))
            last_tick = label
        if what == "send":
            y += g.mark_row * len(thing.marks)  # its marks, one line each, under it
    out.width = int(g.left + g.col * max(len(d.lanes), 1) + 20)
    out.height = int(y + g.bottom)
    return out
