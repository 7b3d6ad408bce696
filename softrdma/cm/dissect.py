"""The dissector's CM decoding: record keys and a text summary for MADs on QP1.

A :class:`~softrdma.wire.dissect.PayloadDissector` for ``softrdma dissect``: it claims
every packet to QP1 and adds, after the frame's own keys,

* ``qp1_drop``: why rxe or the MAD layer would not take the packet (then nothing else);
* ``mad_*``: the MAD common header (``mad_tid``, ``mad_attr_id``, ...);
* ``cm_msg`` and ``cm_<field>`` for every field of the message's description
  (:mod:`softrdma.cm.messages`), ``cm_private_data_len``/``_used``/``cm_private_data``,
  the service ID as ``cm_ps``/``cm_port``, a REJ's ``cm_reason_name``; or ``cm_error``;
* ``cma_*``: the cma header of a REQ or SIDR_REQ to an rdma_cm service.

The keys are a stable interface (docs/dissect.md): add keys, never rename them.
"""

from __future__ import annotations

from ipaddress import IPv6Address
from typing import Any

from ..wire.packet import RocePacket
from .cma import (
    CmaError, PortSpace, format_service_id, ip_from_gid, split_cma_private_data,
    split_service_id,
)
from .mad import MAD_HEADER, MadError, MadHeader
from .messages import BY_NAME, RejectReason, SidrStatus, parse_cm
from .qp1 import QP1_QPN, qp1_drop_reason

__all__ = ["CMDissector", "CM_DISSECTOR", "cm_fields", "cm_text", "gid_text"]

# Short labels for the text line (the JSON keys are always cm_ + the field's name).
_LABELS = {
    "local_comm_id": "comm", "remote_comm_id": "remote", "service_id": "sid",
    "local_qpn": "qpn", "remote_qpn": "qpn", "starting_psn": "psn",
    "responder_resources": "rr", "initiator_depth": "depth", "transport_type": "type",
    "retry_count": "retry", "rnr_retry_count": "rnr", "path_mtu": "mtu",
    "message_mraed": "mraed", "message_rejected": "rejected", "service_timeout": "timeout",
    "request_id": "req_id",
}


def gid_text(gid: bytes) -> str:
    """A GID as text: ``::ffff:10.77.0.12`` for an IPv4-mapped one (the same on every
    Python version), IPv6 notation otherwise."""
    ip = ip_from_gid(gid)
    return f"::ffff:{ip}" if ip.version == 4 else str(IPv6Address(gid))


def _json_value(attr: str, v: int | bytes) -> int | str:
    if isinstance(v, int):
        return v
    return gid_text(v) if attr.endswith("_gid") else v.hex()


def _used(data: bytes) -> int:
    return len(data.rstrip(b"\0"))


def cm_fields(pkt: RocePacket) -> dict[str, Any] | None:
    """The CM keys of a packet to QP1 (None for any other packet)."""
    if pkt.dest_qp != QP1_QPN:
        return None
    drop = qp1_drop_reason(pkt)
    if drop is not None:
        return {"qp1_drop": drop}
    mad = bytes(pkt.payload)
    hdr = MadHeader.unpack(mad)
    rec: dict[str, Any] = {f"mad_{a}": getattr(hdr, a) for a in MAD_HEADER.attrs}
    try:
        m = parse_cm(mad)
    except MadError as e:
        rec["cm_error"] = e.reason
        return rec
    rec["cm_msg"] = m.name
    for attr, v in m.fields.items():
        rec[f"cm_{attr}"] = _json_value(attr, v)
    if "service_id" in m.fields:
        ps, port = split_service_id(m.service_id)
        rec["cm_ps"] = ps.name if isinstance(ps, PortSpace) else ps
        rec["cm_port"] = port
    if m.name == "REJ":
        rec["cm_reason_name"] = _name(RejectReason, m.reason)
    if m.name == "SIDR_REP":
        rec["cm_status_name"] = _name(SidrStatus, m.status)
    pd = m.private_data
    rec["cm_private_data_len"] = len(pd)
    rec["cm_private_data_used"] = _used(pd)
    rec["cm_private_data"] = pd[:_used(pd)].hex()
    if m.name in ("REQ", "SIDR_REQ") and m.service_id >> 32 == 0 and \
            isinstance(split_service_id(m.service_id)[0], PortSpace):
        try:
            cma, user = split_cma_private_data(pd)
        except CmaError as e:
            rec["cma_error"] = str(e)
        else:
            rec.update(cma_version=cma.version, cma_ip_version=cma.ip_version,
                       cma_src=str(cma.src), cma_sport=cma.sport, cma_dst=str(cma.dst),
                       cma_dport=m.service_id & 0xFFFF, cma_user_data_len=len(user),
                       cma_user_data_used=_used(user))
    return rec


def _name(enum_cls: Any, v: int) -> str | None:
    try:
        return enum_cls(v).name
    except ValueError:
        return None


def cm_text(rec: dict[str, Any]) -> str | None:
    """The summary the text line ends with, from a record :func:`cm_fields` filled."""
    if "qp1_drop" in rec:
        return f"QP1 dropped ({rec['qp1_drop']})"
    if "mad_tid" not in rec:
        return None
    if "cm_msg" not in rec:
        return (f"MAD class=0x{rec['mad_mgmt_class']:02x} attr=0x{rec['mad_attr_id']:04x} "
                f"not CM ({rec['cm_error']})")
    mt = BY_NAME[rec["cm_msg"]]
    parts = [f"CM {mt.name}", f"tid=0x{rec['mad_tid']:016x}"]
    for attr in mt.shown:
        f = mt.layout.field(attr)
        v = rec[f"cm_{attr}"]
        shown = format_service_id(v) if attr == "service_id" else f.show(v)
        parts.append(f"{_LABELS.get(attr, attr)}={shown}")
    if "cma_src" in rec:
        src = f"[{rec['cma_src']}]" if rec["cma_ip_version"] == 6 else rec["cma_src"]
        dst = f"[{rec['cma_dst']}]" if rec["cma_ip_version"] == 6 else rec["cma_dst"]
        parts.append(f"cma {src}:{rec['cma_sport']} > {dst}:{rec['cma_dport']}")
        parts.append(f"pd={rec['cma_user_data_used']}/{rec['cma_user_data_len']}")
    else:
        if "cma_error" in rec:
            parts.append("cma=BAD")
        parts.append(f"pd={rec['cm_private_data_used']}/{rec['cm_private_data_len']}")
    return " ".join(parts)


class CMDissector:
    """The CM as a :class:`~softrdma.wire.dissect.PayloadDissector`."""

    def fields(self, pkt: RocePacket) -> dict[str, Any] | None:
        return cm_fields(pkt)

    def text(self, rec: dict[str, Any]) -> str | None:
        return cm_text(rec)


CM_DISSECTOR = CMDissector()