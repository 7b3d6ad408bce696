"""pyverbs.mr: MR, MW, MWBindInfo, MWBind.

``MR(pd, length, access, address=None, implicit=False)`` as pyverbs: without ``address``
the MR gets ``length`` new zeroed bytes; with ``address`` (a host address from
``pyverbs.mem_alloc``) it covers that memory and ``mr.buf`` is that address. ``rereg``
takes the new address as an integer, as pyverbs does. ``write(data, length, offset=0)`` and
``read(length, offset)`` copy to and from the registered bytes.
"""

from __future__ import annotations

import errno
import sys as _sys
from typing import Any

from ..errors import PyverbsRDMAError, PyverbsUserError
from ..verbs_api.enums import ibv_access_flags as A
from ..verbs_api.mr import MR as _MR, MW as _MW, MWBind as _MWBind
from ..verbs_api.wr import MWBindInfo as _MWBindInfo
from . import unsupported
from ._close import CascadeClose, close_tree
from .mem_alloc import host_buffer

__all__ = ["MR", "MW", "MWBindInfo", "MWBind"]


def _rewrap(e: PyverbsRDMAError, msg: str) -> PyverbsRDMAError:
    return PyverbsRDMAError(msg, e.error_code)


class MR(CascadeClose, _MR):
    def __init__(self, creator: Any, length: int = 0, access: int = 0, address: Any = None,
                 implicit: bool = False, **kwargs: Any) -> None:
        from ..rdmacm.cmid import CMID
        if isinstance(creator, CMID):
            # pyverbs: rdma_reg_msgs / rdma_reg_write / rdma_reg_read on the id's PD, as
            # the access flag says (anything else: EINVAL, no MR)
            acc = {A.IBV_ACCESS_LOCAL_WRITE: A.IBV_ACCESS_LOCAL_WRITE,
                      A.IBV_ACCESS_REMOTE_WRITE: A.IBV_ACCESS_LOCAL_WRITE |
                      A.IBV_ACCESS_REMOTE_WRITE,
                      A.IBV_ACCESS_REMOTE_READ: A.IBV_ACCESS_LOCAL_WRITE |
                      A.IBV_ACCESS_REMOTE_READ}.get(access, -1)
            if acc < 0 or creator.pd is None or address is not None:
                raise PyverbsRDMAError(f"Failed to register a MR. length: {length}, access "
                                       f"flags: {access}", errno.EINVAL)
            creator, access = creator.pd, acc
        try:
            if address is not None and not implicit:
                super().__init__(creator, length, access, address=address,
                                 buffer=host_buffer(address, length))
                self._user_addr = True
            else:
                super().__init__(creator, length, access, implicit=implicit)
                self._user_addr = False
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError(f"Failed to register a MR. length: {length}, access flags: "
                                   f"{access}", e.error_code) from None

    @property
    def handle(self) -> int:
        return self.lkey >> 8

    def write(self, data: Any, length: int, offset: int = 0) -> None:  # type: ignore[override]
        if self.closed or length < 0:
            raise PyverbsUserError(f"The MR buffer isn't allocated or length {length} is "
                                   f"invalid")
        if isinstance(data, str):
            data = data.encode()
        data = bytes(data)[:length]
        self.mem[offset:offset + len(data)] = data

    def read(self, length: int, offset: int) -> bytes:  # type: ignore[override]
        if offset < 0:
            raise PyverbsUserError(f"Invalid offset {offset}")
        if self.closed or length < 0:
            raise PyverbsUserError(f"The MR buffer isn't allocated or length {length} is "
                                   f"invalid")
        return bytes(self.mem[offset:offset + length])

    def rereg(self, flags: int, pd: Any = None, addr: int = 0, length: int = 0,
              access: int = 0) -> None:
        buf = None
        if flags & 1:  # IBV_REREG_MR_CHANGE_TRANSLATION: addr is host memory
            buf = host_buffer(addr, length) if addr else bytearray(length)
        try:
            super().rereg(flags, pd=pd, addr=buf, length=length, access=access)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to rereg MR: IBV_REREG_MR_ERR_INPUT",
                                   e.error_code) from None

    def close(self) -> None:
        try:
            close_tree(self)
        except PyverbsRDMAError as e:
            raise _rewrap(e, "Failed to dereg MR") from None


class MW(CascadeClose, _MW):
    def __init__(self, pd: Any, mw_type: int) -> None:
        try:
            super().__init__(pd, mw_type)
        except PyverbsRDMAError as e:
            raise _rewrap(e, "Failed to allocate MW") from None

    def close(self) -> None:
        try:
            close_tree(self)
        except PyverbsRDMAError as e:
            raise _rewrap(e, "Failed to dealloc MW") from None


class MWBindInfo(_MWBindInfo):
    def __init__(self, mr: Any, addr: int, length: int, mw_access_flags: int) -> None:
        super().__init__(mr=mr, addr=addr, length=length, mw_access_flags=mw_access_flags)


class MWBind(_MWBind):
    def __init__(self, mw_bind_info: Any, send_flags: int, wr_id: int = 0) -> None:
        super().__init__(mw_bind_info, send_flags, wr_id)


class MREx(MR):
    """pyverbs' ``MREx`` (``ibv_reg_mr_ex``, rdma-core 60 on). For a provider without a
    ``reg_mr_ex`` op (rxe) libibverbs turns it into the legacy registration
    (``dummy_ops.c``), so host memory registers as with ``MR``; a dma-buf ``fd``, a DMA
    handle, a ``Buf`` or an IOVA of its own fail EOPNOTSUPP here (rxe has no dma-buf MRs
    nor DMA handles)."""

    def __init__(self, pd: Any, length: int = 0, access: int = 0, address: Any = None,
                 iova: Any = None, fd: Any = None, fd_offset: int = 0, dmah: Any = None,
                 implicit: bool = False, buf: Any = None, **kwargs: Any) -> None:
        what = "Failed to register MR using extended API"
        if fd is not None or dmah is not None or buf is not None or \
                (iova is not None and iova != address):
            raise PyverbsRDMAError(what, errno.EOPNOTSUPP)
        try:
            super().__init__(pd, length, access, address=address, implicit=implicit)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError(f"{what}. Errno: {e.error_code}", e.error_code) from None


unsupported.fill_missing(_sys.modules[__name__], "mr")  # DMMR, DmaBufMR: EOPNOTSUPP, as rxe
