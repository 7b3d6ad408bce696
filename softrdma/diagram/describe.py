"""One packet to one arrow (the label fields and the dissector's one-line text), and the
texts of the notes every source writes the same way (completions, QP states).

Both adapters that see bytes (a capture, the simulated network) go through
:func:`softrdma.wire.dissect.frame_record`, so an arrow's tooltip is exactly the line
``softrdma dissect`` prints for that packet, ICRC verdict included.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from ..cm.dissect import CM_DISSECTOR
from ..enums import ibv_qp_state, ibv_wc_opcode, ibv_wc_status
from ..wire.dissect import format_record, frame_record
from ..wire.frames import LINKTYPE_RAW, decode_frame, encode_frame
from ..wire.headers import aeth_syndrome_name
from ..wire.packet import parse
from .model import Arrow, Kind, Lane

__all__ = ["arrow_of", "record_of_roce", "completion_text", "state_text"]


#: payload dissectors whose keys the arrows use (the CM's, for QP1)
PAYLOAD = (CM_DISSECTOR,)


def arrow_of(rec: dict[str, Any], src: Lane, dst: Lane, send_time: float,
             recv_time: float | None) -> Arrow:
    """The arrow for one dissector record; a bad ICRC makes it ``bad-icrc``."""
    syn = rec.get("aeth_syndrome")
    # a MAD on QP1 is drawn as the CM message it carries (REQ, REP, RTU, DREQ...)
    name = f"CM {rec['cm_msg']}" if "cm_msg" in rec else rec["opcode_name"]
    return Arrow(src, dst, send_time, recv_time, name, rec["psn"],
                 ackreq=bool(rec["ackreq"]),
                 aeth=None if syn is None else aeth_syndrome_name(syn),
                 msn=rec.get("aeth_msn"), length=rec["payload_len"],
                 kind=Kind.NORMAL if rec["icrc_ok"] else Kind.BAD_ICRC,
                 frame=rec.get("index"), detail=format_record(rec, PAYLOAD).strip())


def record_of_roce(roce: bytes, src_ip: bytes, dst_ip: bytes, sport: int, index: int,
                   t: float) -> dict[str, Any]:
    """The dissector record of a RoCE packet (BTH .. ICRC) that travelled between two
    addresses, as if captured: the packet is framed in IP/UDP the way a device sends it
    (IP ID 0, the ICRC left as it is) so the ICRC is judged as a receiver would."""
    raw = encode_frame(roce, src=str(ipaddress.ip_address(src_ip)),
                       dst=str(ipaddress.ip_address(dst_ip)), sport=sport,
                       linktype=LINKTYPE_RAW, fill_icrc=False)
    frame = decode_frame(raw, LINKTYPE_RAW)
    assert frame is not None  # we framed it ourselves
    return frame_record(index, t, frame, parse(frame.payload), PAYLOAD)


def completion_text(wc: Any) -> str:
    """A work completion as a note: ``WC RDMA_WRITE SUCCESS wr_id 1``."""
    try:
        op = ibv_wc_opcode(wc.opcode).name.removeprefix("IBV_WC_")
    except ValueError:
        op = str(wc.opcode)
    st = ibv_wc_status(wc.status).name.removeprefix("IBV_WC_")
    return f"WC {op} {st} wr_id {wc.wr_id}"


def state_text(state: int) -> str:
    """A QP state as a note: ``RTS``, ``ERR``."""
    return ibv_qp_state(state).name.removeprefix("IBV_QPS_")
