"""Tracing: watch everything a soft device does, as structured log records.

A real NIC is a black box. softrdma can show every work request, every packet with its PSN
and ACK, every timer, retransmission, state change and completion. This module turns that
on and off. The records go through the standard :mod:`logging` module, under one logger
per kind of event:

==========================  ==================================================================
``softrdma.verbs``          verbs calls and what they returned (or raised)
``softrdma.wqe``            work requests posted (send and receive queues)
``softrdma.packet``         every packet sent (``tx``) or received (``rx``), one dissector line
``softrdma.ack``            the responder's ACK/NAK decisions (ACK, NAK, RNR NAK, re-ACK)
``softrdma.timer``          the retransmit and RNR timers: armed, fired
``softrdma.retry``          retransmissions and why (timeout, PSN-sequence NAK, RNR NAK)
``softrdma.qp``             QP state transitions
``softrdma.cq``             completions
``softrdma.event``          asynchronous events
``softrdma.drop``           packets dropped, with the reason (the device's drop counters)
==========================  ==================================================================

Turn it on in any of three ways:

* the environment: ``SOFTRDMA_TRACE=all`` (or a comma list of kinds:
  ``packet,retry,qp``), with ``SOFTRDMA_TRACE_FORMAT=json`` for JSON lines,
  ``SOFTRDMA_TRACE_FILE=run.log`` to write to a file instead of stderr, and
  ``SOFTRDMA_TRACE_QPN=0x11,0x12`` to keep only those QPs;
* the command line: ``softrdma --trace[=KINDS] [--trace-format json]
  [--trace-file F] TOOL ...``, which works with every tool;
* Python: :func:`enable` and :func:`disable`, or your own :mod:`logging` handlers on the
  ``softrdma.*`` loggers after :func:`enable` with ``handler=None``.

Each record carries the structured fields as ``record.softrdma``, a dict:

* ``t``: the device clock in seconds: virtual on a simulated network (it starts at 0),
  since :func:`enable` on a live device;
* ``dev``: the device name; ``ip``: its address;
* ``kind``: the event kind;
* ``qpn``: the QP number, when the event belongs to a QP;
* fields of the event, such as ``psn``, ``opcode``, ``why``, ``old`` and ``new``.

:class:`JsonFormatter` writes each record as one JSON object per line, with those fields
and ``msg``.

The cost when tracing is off is one attribute test where an event could happen: devices
hold ``trace = None``, and the verbs wrappers are installed only while ``verbs`` is
traced.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import weakref
from typing import IO, Any, Callable, Iterable

__all__ = ["KINDS", "Tracer", "JsonFormatter", "TextFormatter", "enable", "disable",
           "current", "parse_kinds", "attach", "on_change"]

KINDS = ("verbs", "wqe", "packet", "ack", "timer", "retry", "qp", "cq", "event", "drop")

#: the tracer devices use (None: off); set by enable()/disable() and the environment
_current: "Tracer | None" = None
_env_read = False
_devices: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every soft device made (attach)
#: called with the new tracer (or None) on enable/disable: the verbs layer's wrappers
_listeners: list[Callable[["Tracer | None"], None]] = []


def parse_kinds(text: str | Iterable[str] | None) -> frozenset[str]:
    """``"all"``, ``"1"``, ``""``/None (= all) or a comma list of :data:`KINDS`;
    ValueError naming an unknown kind."""
    if text is None:
        return frozenset(KINDS)
    items = [x.strip() for x in (text.split(",") if isinstance(text, str) else text)]
    items = [x for x in items if x]
    if not items or any(x in ("all", "1", "yes", "true") for x in items):
        return frozenset(KINDS)
    bad = [x for x in items if x not in KINDS]
    if bad:
        raise ValueError(f"unknown trace kind(s) {', '.join(bad)} (choose from "
                         f"{', '.join(KINDS)}, or all)")
    return frozenset(items)


class Tracer:
    """What a device calls to trace: :meth:`emit` makes one log record on
    ``softrdma.<kind>``, if the kind (and the QP) is traced."""

    def __init__(self, kinds: Iterable[str] = KINDS, qpns: Iterable[int] | None = None) -> None:
        self.kinds = frozenset(kinds)
        self.qpns = frozenset(qpns) if qpns is not None else None
        self._loggers = {k: logging.getLogger(f"softrdma.{k}") for k in KINDS}
        import time
        self.t0 = time.monotonic()  # live devices' clock is monotonic: show it from here

    def wants(self, kind: str, qpn: int | None = None) -> bool:
        return kind in self.kinds and (self.qpns is None or qpn is None or qpn in self.qpns)

    def emit(self, dev: Any, kind: str, qpn: int | None, msg: str, **fields: Any) -> None:
        """One event of ``dev`` (a device, for its name and clock)."""
        if kind not in self.kinds or (self.qpns is not None and qpn is not None
                                      and qpn not in self.qpns):
            return
        t = float(getattr(dev, "now", 0.0))
        if getattr(dev, "clock", None) is not None:
            t -= self.t0
        rec = {"t": round(t, 9),
               "dev": getattr(dev, "name", "?"), "ip": getattr(dev, "ip", None), "kind": kind}
        if qpn is not None:
            rec["qpn"] = qpn
        rec.update(fields)
        self._loggers[kind].info(msg, extra={"softrdma": rec})


class TextFormatter(logging.Formatter):
    """``   0.012345 dev0 retry  qp 0x11 retransmit from PSN 105: timeout``."""

    def format(self, record: logging.LogRecord) -> str:
        r = getattr(record, "softrdma", None)
        if r is None:
            return super().format(record)
        qp = f"qp 0x{r['qpn']:x} " if "qpn" in r else ""
        return f"{r['t']:12.6f} {r['dev']} {r['kind']:<6} {qp}{record.getMessage()}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: the structured fields and ``msg``."""

    def format(self, record: logging.LogRecord) -> str:
        r = dict(getattr(record, "softrdma", None) or {"kind": record.name})
        r["msg"] = record.getMessage()
        return json.dumps(r, default=str)


_handler: logging.Handler | None = None


def enable(kinds: str | Iterable[str] | None = "all", *, fmt: str = "text",
           stream: IO[str] | None = None, path: str | None = None,
           qpns: Iterable[int] | None = None,
           handler: logging.Handler | None | bool = True) -> Tracer:
    """Start tracing ``kinds`` on every device, existing and future. By default a handler
    writes ``fmt`` (``"text"`` or ``"json"``) lines to ``stream`` (stderr) or the file
    ``path``; ``handler=None`` installs none (attach your own to ``softrdma.*``), and a
    :class:`logging.Handler` is used as given. ``qpns`` keeps only those QPs' events."""
    global _current, _handler
    if fmt not in ("text", "json"):
        raise ValueError(f"trace format must be text or json, not {fmt!r}")
    tracer = Tracer(parse_kinds(kinds), qpns)
    root = logging.getLogger("softrdma")
    if _handler is not None:
        root.removeHandler(_handler)
        _handler = None
    if handler is True:
        h: logging.Handler = (logging.FileHandler(path, mode="a") if path
                              else logging.StreamHandler(stream or sys.stderr))
        h.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
        _handler = h
    elif isinstance(handler, logging.Handler):
        _handler = handler
    if _handler is not None:
        root.addHandler(_handler)
    for k in KINDS:
        logging.getLogger(f"softrdma.{k}").setLevel(logging.INFO)
    if root.level == logging.NOTSET or root.level > logging.INFO:
        root.setLevel(logging.INFO)
    _install(tracer)
    return tracer


def disable() -> None:
    """Stop tracing: devices go back to ``trace = None`` and the verbs wrappers come off."""
    global _handler
    if _handler is not None:
        logging.getLogger("softrdma").removeHandler(_handler)
        try:
            _handler.close()
        except Exception:
            pass
        _handler = None
    _install(None)


def current() -> Tracer | None:
    """The tracer a new device starts with: the one :func:`enable` made, else one from
    SOFTRDMA_TRACE (read once), else None."""
    global _env_read
    if not _env_read:
        _env_read = True
        spec = os.environ.get("SOFTRDMA_TRACE")
        if spec and spec not in ("0", "no", "false") and _current is None:
            qpns = os.environ.get("SOFTRDMA_TRACE_QPN")
            enable(spec, fmt=os.environ.get("SOFTRDMA_TRACE_FORMAT", "text"),
                   path=os.environ.get("SOFTRDMA_TRACE_FILE") or None,
                   qpns=[int(x, 0) for x in qpns.split(",") if x.strip()] if qpns else None)
    return _current


def _install(tracer: Tracer | None) -> None:
    """Point every device (and its counters) at ``tracer``; tell the listeners."""
    global _current
    _current = tracer
    for dev in list(_devices):
        set_device_tracer(dev, tracer)
    for fn in list(_listeners):
        fn(tracer)


def attach(dev: Any) -> None:
    """A new device: it follows enable()/disable() from now on, starting with current()."""
    _devices.add(dev)
    set_device_tracer(dev, current())


def on_change(fn: Callable[["Tracer | None"], None]) -> None:
    """Call ``fn(tracer)`` now and whenever tracing is enabled or disabled."""
    _listeners.append(fn)
    fn(_current)


def set_device_tracer(dev: Any, tracer: Tracer | None) -> None:
    dev.trace = tracer
    counters = getattr(dev, "counters", None)
    if counters is not None:
        counters.trace = (tracer, dev) if tracer is not None and "drop" in tracer.kinds \
            else None
