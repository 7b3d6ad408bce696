"""pyverbs' close(): an object closes the objects that depend on it first.

softrdma.verbs_api refuses to destroy a resource in use (EBUSY, as the kernel answers the
C verbs); pyverbs' ``close()`` instead closes the dependents first (a PD its QPs, SRQs,
AHs, MWs and MRs; a CQ the QPs using it; a channel its CQs; an SRQ its QPs). The shim's
classes do the same through :func:`close_tree`.
"""

from __future__ import annotations

from typing import Any


def close_tree(obj: Any) -> None:
    if getattr(obj, "closed", True):
        return
    for u in sorted(list(getattr(obj, "users", ())), key=_order):
        close_tree(u)
    cls = type(obj)
    # the nearest verbs_api (or libibverbs backend) close(); the shim's own close() calls
    # back here
    for k in cls.__mro__:
        if k.__module__.startswith(("softrdma.verbs_api", "softrdma.ibverbs")) and \
                "close" in k.__dict__:
            k.__dict__["close"](obj)
            return
    obj.close()


def _order(o: Any) -> int:
    # QPs before SRQs, AHs, MWs, MRs, CQs (pyverbs' order)
    for i, name in enumerate(("QP", "SRQ", "AH", "MW", "MR", "CQ")):
        if any(k.__name__ == name for k in type(o).__mro__):
            return i
    return 9


class CascadeClose:
    def close(self) -> None:
        close_tree(self)
