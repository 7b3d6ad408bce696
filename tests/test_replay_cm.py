"""``softrdma replay`` of QP1 (issue 28): softrdma's rdma_cm answers the captured REQ (or
SIDR_REQ) as the passive side, and its REP, SIDR_REP, DREQ and DREP are compared with the
captured ones field by field, the random IDs and PSNs by their relations (the fields and
relations of tests/test_cm_capture_conformance.py)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

from softrdma.cli import main
from softrdma.cm.messages import build_cm, parse_cm
from softrdma.harness.replay import load_capture

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pcap_mutate as pm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PCAPS = ROOT / "pcaps" / "linux-rxe"
SERVER, CLIENT = "10.77.0.11", "10.77.0.12"


def _cli(*argv: str) -> tuple[int, list[dict]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["replay", *argv, "--json"])
    return rc, [json.loads(x) for x in out.getvalue().splitlines()]


def _qp1(sides: list[dict]) -> dict[str, dict]:
    return {s["as"][0]: s for s in sides if s["conversation"]["a"][1] == 1}


def _mads(path: Path) -> list[tuple[int, str, str]]:
    """(frame, sender, message name) of each CM MAD in the capture."""
    return [(c.index, ".".join(map(str, c.src)), parse_cm(bytes(c.pkt.payload)).name)
            for c in load_capture(str(path)) if c.pkt.dest_qp == 1]


@pytest.mark.parametrize("name", ["rping", "ucmatose", "udaddy"])
def test_the_passive_side_answers_as_captured(name):
    """Every MAD the captured server sent (REP, DREQ/DREP, SIDR_REP) is judged identical to
    what softrdma's CM sends when fed the client's; the client (which sent the REQ) is
    refused with the reason."""
    rc, sides = _cli(str(PCAPS / f"{name}.pcap"))
    assert rc == 0
    qp1 = _qp1(sides)
    server = qp1[SERVER]
    mine = [f for f, ip, _ in _mads(PCAPS / f"{name}.pcap") if ip == SERVER]
    assert mine and server["status"] == "identical"
    assert (server["frames"], server["judged"], server["identical"]) == (len(mine),) * 3
    assert qp1[CLIENT]["status"] == "refused" and "passive" in qp1[CLIENT]["reason"]


def _mad_edit(path: Path, frame: int, tid: int | None = None, **fields) -> list:
    """The capture with the CM MAD of ``frame`` rebuilt with ``fields`` changed."""
    recs = pm.load(path)
    m = parse_cm(bytes(pm.packet(recs[frame - 1]).payload))
    vals = {a: getattr(m, a) for a in m.type.attrs}
    vals.update(fields)
    mad = build_cm(m.type, tid=m.tid if tid is None else tid,
                   private_data=bytes(m.private_data), **vals)
    return pm.edit(recs, frame, payload=bytes(mad))


@pytest.mark.parametrize("name,frame,fields,tid,field", [
    # the REP's target ACK delay: softrdma's CM sends the device's own
    ("rping", 2, {"target_ack_delay": 7}, None, "target_ack_delay"),
    # the REP names another REQ: the relation to the REQ's comm ID breaks
    ("ucmatose", 3, {"remote_comm_id": 0x1234}, None,
     "remote_comm_id is the REQ's local_comm_id"),
    # the DREP answers another transaction than the client's DREQ
    ("rping", 41, {}, 0x99, "tid is the DREQ's"),
    # the SIDR_REP's Q_Key is not rdma_cm's
    ("udaddy", 2, {"qkey": 0x1234}, None, "qkey"),
])
def test_a_changed_field_of_the_passive_side_is_reported(tmp_path, name, frame, fields, tid,
                                                         field):
    path = tmp_path / f"{name}.pcap"
    path.write_bytes(pm.to_bytes(_mad_edit(PCAPS / f"{name}.pcap", frame, tid, **fields)))
    assert (frame, SERVER) == next((f, ip) for f, ip, _ in _mads(path) if f == frame)
    rc, sides = _cli(str(path))
    server = _qp1(sides)[SERVER]
    assert rc == 1 and server["status"] == "different"
    (d,) = server["differences"]
    assert d["frame"] == frame and field in [f["field"] for f in d["fields"]], d
    assert server["judged"] == server["frames"]


def test_a_capture_without_the_req_is_refused_not_failed(tmp_path):
    """rping without its REQ (frame 1): nothing for the CM to answer, both QP1 sides are
    refused with the reason, and the RC connection still replays identically (its UDP
    source port, which the REQ's flow label chose, is taken from the capture)."""
    path = tmp_path / "no-req.pcap"
    path.write_bytes(pm.to_bytes(pm.drop(pm.load(PCAPS / "rping.pcap"), 1)))
    rc, sides = _cli(str(path))
    assert rc == 0
    for s in _qp1(sides).values():
        assert s["status"] == "refused" and "no REQ" in s["reason"]
    rc_sides = [s for s in sides if s["conversation"]["transport"] == "RC"]
    assert len(rc_sides) == 2 and all(s["status"] == "identical" for s in rc_sides)
