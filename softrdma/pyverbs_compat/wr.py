"""pyverbs.wr: SGE, SendWR, RecvWR, with pyverbs' constructor rules.

``SendWR.rkey`` is, as in pyverbs, the new rkey of a bind WR (``bind_mw.rkey``, set by
:meth:`SendWR.set_bind_wr` to ``inc_rkey(mw.rkey)``); for other WRs it reads the RDMA/atomic
rkey given to ``set_wr_rdma``/``set_wr_atomic``.
"""

from __future__ import annotations

import sys as _sys
from typing import Any

from ..errors import PyverbsUserError
from ..verbs_api.enums import ibv_send_flags, ibv_wr_opcode
from ..verbs_api.wr import SGE as _SGE, RecvWR as _RecvWR, SendWR as _SendWR
from . import unsupported
from .base import inc_rkey

__all__ = ["SGE", "SendWR", "RecvWR", "send_flags_to_str"]

_MW_OPCODES = (ibv_wr_opcode.IBV_WR_LOCAL_INV, ibv_wr_opcode.IBV_WR_BIND_MW,
               ibv_wr_opcode.IBV_WR_SEND_WITH_INV)


class SGE(_SGE):
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        super().__init__(addr, length, lkey)

    def read(self, length: int, offset: int) -> bytes:
        raise PyverbsUserError("SGE.read needs host memory; read the MR (mr.read) instead")

    def close(self) -> None:
        pass

    def __str__(self) -> str:
        return f"{'Address':<22}: {self.addr:x}\n{'Length':<22}: {self.length}\n" \
               f"{'Key':<22}: {self.lkey:x}\n"


def _sg(sg: Any, num_sge: int) -> list:
    lst = list(sg) if isinstance(sg, (list, tuple)) else ([sg] if sg is not None else [])
    return lst[:num_sge] if num_sge >= 0 else lst


class RecvWR(_RecvWR):
    def __init__(self, wr_id: int = 0, num_sge: int = 0, sg: Any = None,
                 next_wr: Any = None) -> None:
        if num_sge < 1 or sg is None:
            raise PyverbsUserError("A WR needs at least one SGE")
        s = _sg(sg, num_sge)
        super().__init__(wr_id=wr_id, num_sge=num_sge, sg=s, next_wr=next_wr)

    def close(self) -> None:
        pass


class SendWR(_SendWR):
    def __init__(self, wr_id: int = 0, opcode: int = ibv_wr_opcode.IBV_WR_SEND,
                 num_sge: int = 0, imm_data: int = 0, sg: Any = None,
                 send_flags: int = ibv_send_flags.IBV_SEND_SIGNALED,
                 next_wr: Any = None) -> None:
        if opcode not in _MW_OPCODES and (num_sge < 1 or sg is None):
            raise PyverbsUserError("A WR needs at least one SGE")
        s = _sg(sg, num_sge)
        super().__init__(wr_id=wr_id, opcode=opcode, num_sge=len(s), imm_data=imm_data, sg=s,
                         send_flags=send_flags, next_wr=next_wr)

    @property
    def rkey(self) -> int:
        if self.opcode == ibv_wr_opcode.IBV_WR_BIND_MW:
            return self.bind_rkey
        return self._rkey

    @rkey.setter
    def rkey(self, v: int) -> None:
        self._rkey = v

    def set_bind_wr(self, mw: Any, bind_info: Any) -> None:  # type: ignore[override]
        super().set_bind_wr(mw, bind_info, inc_rkey(mw.rkey))

    def set_qp_type_xrc(self, remote_srqn: int) -> None:
        self.remote_srqn = remote_srqn

    def close(self) -> None:
        pass


def send_flags_to_str(flags: int) -> str:
    names = {1: "IBV_SEND_FENCE", 2: "IBV_SEND_SIGNALED", 4: "IBV_SEND_SOLICITED",
             8: "IBV_SEND_INLINE", 16: "IBV_SEND_IP_CSUM"}
    return " ".join(n for b, n in names.items() if flags & b) or "None"


unsupported.fill_missing(_sys.modules[__name__], "wr")
