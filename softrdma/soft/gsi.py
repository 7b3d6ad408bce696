"""QP1, the general services interface (GSI), of a soft device: 256-byte MADs in and out.

rxe implements QP1 as an ``IB_QPT_GSI`` QP handled like a UD QP, owned by the kernel's MAD
layer (drivers/infiniband/core/mad.c), which hands each MAD to the agent registered for its
class: on RoCE that is ib_cm (class 0x07, version 2, method SEND). :class:`GsiEndpoint` is
both for a soft device: the receive path (``softrdma.soft.rx``) gives it every packet whose
destination QP is 1 once the device-wide checks passed (decode, ICRC, destination address,
TVer, P_Key), and it applies what rxe and the MAD layer check next, dropping and counting
what they drop:

========================  =============================================================
drop reason               what
========================  =============================================================
``gsi_opcode``            not UD SEND_ONLY (rxe: GSI takes UD opcodes; the MAD layer
                          one-packet SENDs)
``gsi_qkey``              DETH Q_Key is not 0x80010000 (rxe ``check_keys``: GSI_QKEY)
``gsi_mad_size``          the payload is not one 256-byte MAD
``gsi_mad_base_version``  MAD base version not 1 (``validate_mad``)
``gsi_mad_class``         management class not the CM's 0x07: no agent for it
``gsi_mad_class_version`` class version not 2: the CM registered for version 2 only
``gsi_mad_method``        method not SEND: the CM takes nothing else (``validate_mad``)
``gsi_no_handler``        a CM MAD, but no handler is registered: the MAD layer with no
                          agent for it drops it (``find_mad_agent`` finds none; only
                          GET/SET would get a "method unsupported" GetResp, and the CM
                          class uses SEND, which gets nothing)
========================  =============================================================

A MAD that passes is counted in ``counters.gsi_mads_rcvd`` and handed to the handler,
``handler(mad, source)``: the 256 bytes and a :class:`MadSource` (where it came from, so an
answer can go back: responses go to the request's IP source and source QP). The handler
runs on whichever thread delivers packets (the progress thread, a polling caller, or the
caller of :meth:`SoftDevice.progress`) with the device lock held: it must not block. It may
call :meth:`GsiEndpoint.send`; a packet it sends to its own device is delivered after it
returns, never from inside it. An exception from the handler is logged and counted in
``counters.gsi_handler_errors``; the receive path goes on.

Sending (:meth:`GsiEndpoint.send`) frames the MAD as rxe does (``softrdma.cm.qp1.build_qp1``:
UD SEND_ONLY to QP 1, P_Key 0xFFFF, Q_Key 0x80010000, source QP 1, PSN from QP1's own
counter starting at 0) and sends it through the device's normal send path (ICRC, capture,
counters, fault injection) from UDP source port 55410 (``QP1_UDP_SPORT``), the port rxe's
QP1 uses; a MAD to the device's own address is looped back like any packet.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Any, Callable

from ..cm.mad import MadHeader, cm_mad_drop_reason
from ..cm.qp1 import GSI_QKEY, QP1_PKEY, QP1_QPN, QP1_UDP_SPORT, build_qp1, qp1_drop_reason
from ..cm.state import reply_without_consumer
from ..counters import Drop
from ..wire.headers import PSN_MASK
from ..wire.packet import RocePacket

__all__ = ["GsiEndpoint", "MadSource", "MadHandler"]

log = logging.getLogger("softrdma")

#: qp1_drop_reason / cm_mad_drop_reason tokens -> the device's drop reasons
_DROP = {
    "opcode": Drop.GSI_OPCODE, "pkey": Drop.BAD_PKEY, "qkey": Drop.GSI_QKEY,
    "mad_size": Drop.GSI_MAD_SIZE, "base_version": Drop.GSI_MAD_BASE_VERSION,
    "mgmt_class": Drop.GSI_MAD_CLASS, "class_version": Drop.GSI_MAD_CLASS_VERSION,
    "method": Drop.GSI_MAD_METHOD,
}


@dataclass(frozen=True, slots=True)
class MadSource:
    """Where a received MAD came from (what a MAD layer's work completion and GRH say).

    ``src_ip``/``dst_ip`` are text addresses; ``src_qp`` is the DETH source QP (1 for the
    CM) and ``sport`` the UDP source port; ``pkey`` and ``psn`` as in the BTH."""

    src_ip: str
    src_qp: int
    dst_ip: str
    sport: int
    pkey: int
    psn: int


MadHandler = Callable[[bytes, MadSource], Any]


class GsiEndpoint:
    """QP1 of one :class:`~softrdma.soft.device.SoftDevice` (``device.gsi``)."""

    qpn = QP1_QPN
    #: rxe's UDP source port for QP1 (the device's send path reads ``src_port``)
    src_port = QP1_UDP_SPORT

    def __init__(self, device: Any) -> None:
        self.device = device
        self.handler: MadHandler | None = None
        self.psn = 0  # rxe's QP1 send PSN starts at 0 (IB_MAD_SEND_Q_PSN)
        self._dispatching = False

    def set_handler(self, handler: MadHandler | None) -> None:
        """Register the MAD handler (the CM), or ``None`` to remove it."""
        with self.device.lock:
            self.handler = handler

    # -- receive ------------------------------------------------------------------------
    def on_packet(self, pkt: RocePacket, src_ip: bytes, dst_ip: bytes, sport: int) -> None:
        """A packet for QP 1 that passed the device-wide checks (called with the lock held)."""
        c = self.device.counters
        why = qp1_drop_reason(pkt)
        if why is not None:
            c.drop(_DROP[why])
            return
        mad = bytes(pkt.payload)
        why = cm_mad_drop_reason(MadHeader.unpack(mad))
        if why is not None:
            c.drop(_DROP[why])
            return
        handler = self.handler
        if handler is None:
            # nobody uses the CM here, but Linux's CM runs on every port: a REQ still
            # gets REJ 8, a SIDR_REQ status 1, a DREQ its DREP (so a peer learns at once)
            c.drop(Drop.GSI_NO_HANDLER)
            reply = reply_without_consumer(mad)
            if reply is not None:
                self._dispatching = True  # no loopback delivery from inside the receive
                try:
                    self.send(reply, dst_ip=src_ip, dst_qpn=pkt.src_qp)
                finally:
                    self._dispatching = False
            return
        c.gsi_mads_rcvd += 1
        source = MadSource(str(ipaddress.ip_address(src_ip)), pkt.src_qp,
                           str(ipaddress.ip_address(dst_ip)), sport, pkt.pkey, pkt.psn)
        self._dispatching = True
        try:
            handler(mad, source)
        except Exception:  # the handler's bug must not stop the device's receive path
            c.gsi_handler_errors += 1
            log.exception("MAD handler of %s failed", self.device.name)
        finally:
            self._dispatching = False

    # -- send ---------------------------------------------------------------------------
    def send(self, mad: bytes | bytearray, dst_ip: str | bytes, dst_qpn: int = QP1_QPN, *,
             pkey: int = QP1_PKEY, qkey: int = GSI_QKEY) -> None:
        """Send one 256-byte MAD to ``dst_ip`` (text or packed), QP ``dst_qpn``, as rxe's
        QP1 sends it. ``pkey`` and ``qkey`` exist for crafting. Raises ValueError for a
        MAD that is not 256 bytes or an address of the other IP version."""
        dev = self.device
        dst = dst_ip if isinstance(dst_ip, (bytes, bytearray)) else \
            ipaddress.ip_address(dst_ip).packed
        dst = bytes(dst)
        if len(dst) != len(dev.ip_packed):
            raise ValueError(f"cannot send from {dev.ip} to an IPv{4 if len(dst) == 4 else 6} "
                             f"address")
        if not 0 <= dst_qpn <= 0xFFFFFF:
            raise ValueError(f"QPN {dst_qpn} is not a 24-bit value")
        with dev.lock:
            pkt = build_qp1(mad, psn=self.psn, pkey=pkey, qkey=qkey)
            if dst_qpn != QP1_QPN:
                pkt[5:8] = dst_qpn.to_bytes(3, "big")  # BTH DestQP
            self.psn = (self.psn + 1) & PSN_MASK
            dev.counters.gsi_mads_sent += 1
            dev.send_packet(self, pkt, dst)
            if not self._dispatching:  # loopback: delivered now on a live device
                dev.after_post()
