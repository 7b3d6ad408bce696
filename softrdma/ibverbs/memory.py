"""``HwPD``, ``HwMR`` and ``HwMW``: protection domains and registered memory (see
:mod:`.objects` for the iova and lifetime rules), the implementations a
:class:`softrdma.verbs_api.PD` / ``MR`` / ``MW`` holds on a device."""

from __future__ import annotations

import ctypes
import errno
import mmap
from ctypes import addressof
from typing import Any

from ..errors import PyverbsRDMAError
from ..verbs_api import pd as v_pd
from ..verbs_api import device as v_device
from ..verbs_api._check import U64, as_int
from . import ffi
from .common import fail, hw_impl, null_error
from .context import HwContext

__all__ = ["HwPD", "HwMR", "HwMW"]


# -- PD --------------------------------------------------------------------------------------

class HwPD:
    """``ibv_pd`` behind :class:`softrdma.verbs_api.PD`."""

    extras: frozenset[str] = frozenset()

    def __init__(self, owner: Any) -> None:
        context = owner.context
        hw_impl(context, v_device.Context, HwContext, "Failed to alloc PD", "context")
        addr = ffi.lib().ibv_alloc_pd(context._addr)
        if not addr:
            raise null_error("Failed to alloc PD")
        self._addr = addr
        self.context = context

    def destroy(self) -> None:
        rc = ffi.lib().ibv_dealloc_pd(self._addr)
        if rc:
            raise fail("Failed to dealloc PD", rc)


# -- MR and MW -------------------------------------------------------------------------------

def _writable_view(buffer: Any, what: str) -> memoryview:
    """A flat, writable byte view of ``buffer`` (EINVAL if it has no buffer or is not
    contiguous; EFAULT if read-only: libibverbs needs memory the device may write)."""
    try:
        mv = memoryview(buffer)
    except TypeError:
        raise PyverbsRDMAError(f"{what}: buffer of type {type(buffer).__name__} does not "
                               f"expose the buffer protocol", errno.EINVAL) from None
    if not mv.c_contiguous:
        raise PyverbsRDMAError(f"{what}: buffer is not C-contiguous", errno.EINVAL)
    if mv.readonly:
        raise PyverbsRDMAError(f"{what}: buffer is read-only ({type(buffer).__name__}); the "
                               f"ibverbs backend registers writable memory only", errno.EFAULT)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class HwMR:
    """``ibv_mr`` over a Python buffer, behind :class:`softrdma.verbs_api.MR`. ``iova`` is
    what SGEs and peers use (see :mod:`.objects`); ``host_addr`` is the real address."""

    extras = frozenset({"host_addr"})
    readable_closed = False  # the ibv_mr is gone with the MR

    @staticmethod
    def prepare(length: Any, access: Any, address: Any, buffer: Any,
                what: str) -> tuple[int, int, int | None, Any]:
        """The C widths (the device checks the access flags and the sizes)."""
        access = as_int(access, what, "access", U64, desc="not a set of access flags")
        length = as_int(length, what, "length", U64, desc="not a 64-bit length")
        if address is not None:
            address = as_int(address, what, "address", U64, desc="not a 64-bit address")
        return length, access, address, buffer

    def __init__(self, owner: Any, pd: Any, length: int, access: int, address: int | None,
                 buffer: Any) -> None:
        what = "Failed to register MR"
        hw_pd = hw_impl(pd, v_pd.PD, HwPD, what, "pd")
        if buffer is None:
            try:  # page-aligned, page-granular memory: safe with MADV_DONTFORK
                buffer = mmap.mmap(-1, max(length, 1))
            except (OSError, OverflowError, ValueError) as e:
                raise PyverbsRDMAError(f"{what}: cannot allocate {length} bytes ({e})",
                                       errno.ENOMEM) from None
            mv = memoryview(buffer)[:length]
        else:
            mv = _writable_view(buffer, what)
            if length and length != len(mv):
                if length > len(mv):
                    raise PyverbsRDMAError(f"{what}: length {length} exceeds the buffer's "
                                           f"{len(mv)} bytes", errno.EINVAL)
                mv = mv[:length]
        n = len(mv)
        # from_buffer exports the buffer (pinning the object) for as long as the array lives
        arr = (ctypes.c_char * max(n, 1)).from_buffer(mv if n else bytearray(1))
        ptr = addressof(arr)
        iova = ptr if address is None else address
        c = ffi.lib().ibv_reg_mr_iova2(hw_pd._addr, ptr, n, iova, access)
        if not c:
            err = ctypes.get_errno()
            del arr  # drop the exports now: the traceback keeps this frame alive
            mv.release()
            if err == errno.EINVAL and (iova ^ ptr) & (mmap.PAGESIZE - 1):
                # uverbs requires start and iova to share their offset within a page
                raise PyverbsRDMAError(f"{what}: address (iova) 0x{iova:x} and the buffer "
                                       f"at 0x{ptr:x} are at different offsets in a page "
                                       f"(the kernel requires the same)", err)
            raise fail(what, err)
        self._addr = c
        self._c = ffi.ibv_mr.from_address(c)
        self._buffer, self._arr, self._mv = buffer, arr, mv
        self._ptr, self._iova, self._access = ptr, iova, access
        self.pd = pd
        self.context = pd.context
        self.context._mrs[self._c.lkey] = self

    lkey = property(lambda self: self._c.lkey)
    rkey = property(lambda self: self._c.rkey)
    iova = property(lambda self: self._iova)
    length = property(lambda self: self._c.length)
    access = property(lambda self: self._access)

    @property
    def mem(self) -> memoryview:
        """The registered bytes (the caller's buffer itself)."""
        return self._mv

    @property
    def host_addr(self) -> int:
        """The registered memory's real address in this process."""
        return self._ptr

    def adopt_keys(self, lkey: int) -> None:
        raise PyverbsRDMAError("Failed to re-register MR: a real device chooses its keys "
                               "(ibv_rereg_mr keeps them)", errno.EOPNOTSUPP)

    def rereg(self, flags: int, pd: Any, addr: Any, length: int, access: int) -> Any:
        """``ibv_rereg_mr``: IBV_REREG_MR_CHANGE_PD (2), _ACCESS (4), _TRANSLATION (1, with
        ``addr`` a buffer object, registered at its real address). Returns the PD."""
        what = "Failed to re-register MR"
        flags = as_int(flags, what, "flags", 7)
        new_pd = pd if flags & 2 else self.pd
        if flags & 2:
            hw_impl(pd, v_pd.PD, HwPD, what, "pd")
        access = as_int(access, what, "access", U64) if flags & 4 else self._access
        arr, ptr, mv, buffer, n = self._arr, self._ptr, self._mv, self._buffer, 0
        if flags & 1:
            buffer = addr if addr is not None else mmap.mmap(-1, max(1, length))
            mv = _writable_view(buffer, what)
            if length:
                mv = mv[:length]
            n = len(mv)
            arr = (ctypes.c_char * max(n, 1)).from_buffer(mv)
            ptr = addressof(arr)
        old_lkey = self._c.lkey
        rc = ffi.lib().ibv_rereg_mr(self._addr, flags, new_pd.impl._addr if flags & 2 else None,
                                    ptr if flags & 1 else None, n, access)
        if rc:  # an IBV_REREG_MR_ERR_* code (negative); errno says why (EOPNOTSUPP on rxe)
            raise fail(what, ctypes.get_errno() or errno.EINVAL)
        self.context._mrs.pop(old_lkey, None)
        self.context._mrs[self._c.lkey] = self
        if flags & 1:
            self._arr, self._ptr, self._mv, self._buffer, self._iova = arr, ptr, mv, buffer, ptr
        self.pd = new_pd
        self._access = access
        return new_pd

    def check_dereg(self) -> None:
        pass  # the device decides (EBUSY while windows are bound)

    def destroy(self) -> None:
        lkey = self._c.lkey
        rc = ffi.lib().ibv_dereg_mr(self._addr)
        if rc:
            raise fail("Failed to dereg MR", rc)
        self.context._mrs.pop(lkey, None)
        # only now may the buffer move or go away
        self._arr = None
        try:
            self._mv.release()
        except BufferError:  # the program still exports it (a memoryview slice of its own)
            pass


class HwMW:
    """``ibv_mw`` through ``context->ops.alloc_mw`` (a static inline in verbs.h)."""

    extras: frozenset[str] = frozenset()

    @staticmethod
    def check_create(mw_type: int, what: str) -> None:
        pass  # the device knows its window types

    def __init__(self, owner: Any, pd: Any, mw_type: int) -> None:
        what = "Failed to allocate MW"
        hw_pd = hw_impl(pd, v_pd.PD, HwPD, what, "pd")
        op = pd.context._ops.alloc_mw
        if op is None:
            raise PyverbsRDMAError(f"{what}: the device has no memory windows", errno.EOPNOTSUPP)
        c = op(hw_pd._addr, mw_type)
        if not c:
            raise null_error(what)
        self._addr = c
        self._c = ffi.ibv_mw.from_address(c)
        self.context = pd.context

    @property
    def rkey(self) -> int:
        return self._c.rkey

    @property
    def handle(self) -> int:
        return self._c.handle

    def destroy(self) -> None:
        rc = self.context._ops.dealloc_mw(self._addr)
        if rc:
            raise fail("Failed to dealloc MW", rc)

    def describe(self) -> str:
        return ""
