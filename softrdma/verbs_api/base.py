"""Shared lifetime rules for verbs objects, and how an object finds its backend.

Every object knows its context and its parents; a parent cannot be destroyed while a
child uses it (EBUSY, as the kernel refuses to dealloc a PD that still has MRs, or to
destroy a CQ a QP still uses). ``close()`` is idempotent and objects are context managers.

Each verbs object is a :class:`Sibling`: one API class on both backends, holding ``impl``,
the implementation the context's :class:`Backend` names (``SoftQP`` or ``HwQP``...).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Any

from ..errors import PyverbsRDMAError
from ._check import kind

__all__ = ["Resource", "ContextBase", "Backend", "Sibling", "Delegating"]


@dataclass(frozen=True)
class Backend:
    """The implementation classes of one backend. A context's class names its backend
    (``Context.backend``); an API object made in the context takes its implementation
    from there (``QP`` holds ``context.backend.QP(...)``)."""

    name: str  #: "soft" or "ibverbs"
    PD: type  #: SoftPD or HwPD
    MR: type  #: SoftMR or HwMR
    MW: type  #: SoftMW or HwMW
    CompChannel: type  #: SoftCompChannel or HwCompChannel
    CQ: type  #: SoftCQ or HwCQ
    AH: type  #: SoftAH or HwAH
    SRQ: type  #: SoftSRQ or HwSRQ
    QP: type  #: SoftQP or HwQP


class Delegating:
    """An API object holding ``impl``: a name its class lacks is looked up among the
    implementation's ``extras`` (what only that backend has), and nowhere else."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        # reached only when the normal lookup fails: the implementation's extras
        impl = self.__dict__.get("impl")
        if impl is not None and name in impl.extras:
            return getattr(impl, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class ContextBase:
    """What every :class:`~softrdma.verbs_api.device.Context` is, declared here so the
    objects made in a context can check their argument without importing device.py
    (which imports them all)."""

    __slots__ = ()
    backend: Backend  #: the implementations of the objects made in this context


class Resource:
    _kind = "resource"
    _pool: str | None = None  # counted against the device limit max_<_pool> (rxe_pool)

    def __init__(self, context: Any) -> None:
        if not isinstance(context, ContextBase):
            raise PyverbsRDMAError(f"Failed to create {self._kind}: context is {kind(context)}, "
                                   f"not a Context", errno.EINVAL)
        context._check()
        if self._pool is not None and not context.device.pool_take(self._pool):
            raise PyverbsRDMAError(f"Failed to create {self._kind}: the device's limit of "
                                   f"{getattr(context.device.limits, 'max_' + self._pool)} "
                                   f"{self._kind}s is reached", errno.ENOMEM)
        self.context = context
        self.device = context.device
        self.closed = False
        self.users: set[Any] = set()  # objects that depend on this one
        context.children[self] = None  # an insertion-ordered set: O(1) add and remove

    def _check(self) -> None:
        if self.closed:
            raise PyverbsRDMAError(f"the {self._kind} is closed", errno.EBADF)

    def _use(self, *parents: Any) -> None:
        for p in parents:
            if p is not None:
                p.users.add(self)

    def _release(self, *parents: Any) -> None:
        for p in parents:
            if p is not None:
                p.users.discard(self)

    def close(self) -> None:
        """Destroy the object; EBUSY if another object still uses it."""
        if self.closed:
            return
        with self.device.lock:
            live = [u for u in self.users if not u.closed]
            if live:
                names = ", ".join(sorted({type(u).__name__ for u in live}))
                raise PyverbsRDMAError(f"Failed to destroy {self._kind}: still in use by "
                                       f"{len(live)} object(s) ({names})", errno.EBUSY)
            self._destroy()

    def _destroy(self) -> None:
        """Release the object unconditionally (children first is the caller's duty)."""
        if not self.closed and self._pool is not None:
            self.device.pool_give(self._pool)
        self.closed = True
        self.context.children.pop(self, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sibling(Resource, Delegating):
    """A verbs object that is one class on both backends: it checks what both backends
    check and holds ``impl``, the implementation its context's backend gives
    (``context.backend.QP``...: the soft one or the libibverbs one, siblings with the
    same methods). What only one implementation has (the soft QP's ``engine``...) is in
    its ``extras``: reachable through this object on that backend, absent on the other."""

    impl: Any  #: the backend's implementation of this object

    def _create(self, context: Any, kind: str, *args: Any) -> Any:
        """Count and register the object in ``context`` (Resource.__init__ checks it is
        one), then make ``context.backend.<kind>(self, *args)``; if that fails, the object
        is undone."""
        if not isinstance(context, ContextBase):
            Resource.__init__(self, context)  # raises EINVAL naming what it got
        with context.device.lock:
            Resource.__init__(self, context)
            try:
                self.impl = getattr(context.backend, kind)(self, *args)
            except BaseException:
                Resource._destroy(self)
                raise
        return self.impl

    def _destroy(self) -> None:
        if not self.closed:
            with self.device.lock:
                self.impl.destroy()
                self._release(*self._parents())
        super()._destroy()

    def _parents(self) -> tuple[Any, ...]:
        return ()
