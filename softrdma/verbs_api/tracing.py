"""Trace kind ``verbs``: every verbs call and its result, for learners.

While ``softrdma.trace`` traces ``verbs``, the public methods below are wrapped (and only
then: when off, the classes hold their own functions and pay nothing). A call shows as
``QP.modify(QPAttr(...), 0x1) -> None`` or ``... raised PyverbsRDMAError: ...``.
``CQ.poll`` is shown only when it returned completions: an application polling an empty
CQ in a loop would bury everything else.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from .. import trace as _trace

__all__ = ["install"]

#: class name -> methods traced (constructors as "__init__")
METHODS: dict[str, tuple[str, ...]] = {
    "Context": ("__init__", "close", "query_device", "query_port", "query_gid"),
    "PD": ("__init__", "close"),
    "MR": ("__init__", "close", "rereg"),
    "MW": ("__init__", "close"),
    "CQ": ("__init__", "close", "poll", "req_notify", "resize"),
    "CompChannel": ("__init__", "close", "get_cq_event"),
    "SRQ": ("__init__", "close", "modify", "post_recv"),
    "AH": ("__init__", "close"),
    "QP": ("__init__", "close", "modify", "query", "post_send", "post_recv", "to_init",
           "to_rtr", "to_rts", "bind_mw"),
}

_originals: dict[tuple[type, str], Callable[..., Any]] = {}


def _short(v: Any, width: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= width else r[:width - 3] + "..."


class _NoDevice:
    name = "verbs"
    now = 0.0


def _wrap(cls: type, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    label = f"{cls.__name__}.{'__init__' if name == '__init__' else name}"
    if name == "__init__":
        label = cls.__name__

    @functools.wraps(fn)
    def traced(self: Any, *args: Any, **kw: Any) -> Any:
        tracer = _trace.current()
        try:
            result = fn(self, *args, **kw)
        except Exception as e:
            if tracer is not None:
                dev = getattr(self, "device", None) or _NoDevice
                tracer.emit(dev, "verbs", getattr(self, "qp_num", None),
                            f"{label}({_args(args, kw)}) raised {type(e).__name__}: {e}",
                            call=label, error=str(e))
            raise
        if tracer is not None and not (name == "poll" and _empty_poll(result)):
            dev = getattr(self, "device", None) or _NoDevice
            shown = self if name == "__init__" else result
            tracer.emit(dev, "verbs", getattr(self, "qp_num", None),
                        f"{label}({_args(args, kw)}) -> {_short(shown)}", call=label)
        return result
    traced.__softrdma_traced__ = True  # type: ignore[attr-defined]
    return traced


def _empty_poll(result: Any) -> bool:
    if isinstance(result, tuple) and result and result[0] == 0:
        return True
    return isinstance(result, list) and not result


def _args(args: tuple, kw: dict) -> str:
    parts = [_short(a, 40) for a in args] + [f"{k}={_short(v, 40)}" for k, v in kw.items()]
    return ", ".join(parts)


def install(tracer: Any) -> None:
    """Wrap the methods while ``tracer`` traces ``verbs``; restore them otherwise."""
    from . import ah, cq, device, mr, pd, qp, srq
    classes = {"Context": device.Context, "PD": pd.PD, "MR": mr.MR, "MW": mr.MW,
               "CQ": cq.CQ, "CompChannel": cq.CompChannel, "SRQ": srq.SRQ, "AH": ah.AH,
               "QP": qp.QP}
    on = tracer is not None and "verbs" in tracer.kinds
    for cname, names in METHODS.items():
        cls = classes.get(cname)
        if cls is None:
            continue
        for name in names:
            key = (cls, name)
            if on and key not in _originals and name in cls.__dict__:
                _originals[key] = cls.__dict__[name]
                setattr(cls, name, _wrap(cls, name, cls.__dict__[name]))
            elif not on and key in _originals:
                setattr(cls, name, _originals.pop(key))
