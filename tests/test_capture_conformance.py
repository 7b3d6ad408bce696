"""softrdma against real Linux rxe: replay each capture with softrdma standing in for one
endpoint, and require the packets it sends to equal, byte for byte, the packets the real
rxe endpoint sent (ICRC recomputed with the captured IPv4 ID, which rxe increments and our
sockets do not). See softrdma/harness/replay.py for what is taken from the capture and what is
computed."""

from __future__ import annotations

import pytest

from softrdma.harness.replay import load_capture, replay_side
from softrdma.wire.packet import parse

from .conftest import PCAPS

SINGLE_QP = ["rc_pingpong", "uc_pingpong", "ud_pingpong", "send_bw", "inline_send",
             "write_bw", "read_bw", "fetch_add", "cmp_swap"] + [
    f"with-oob/{n}" for n in ("rc_pingpong", "ud_pingpong", "send_bw", "send_lat", "write_bw",
                              "write_lat", "read_bw", "atomic_bw")]
SERVER, CLIENT = "10.77.0.11", "10.77.0.12"


@pytest.mark.parametrize("ip", [SERVER, CLIENT], ids=["as-server", "as-client"])
@pytest.mark.parametrize("name", SINGLE_QP)
def test_replay_is_byte_identical(name, ip):
    cap = load_capture(str(PCAPS / f"{name}.pcap"))
    res = replay_side(cap, ip, device_name="conformance0", inline="inline" in name)
    assert res.mismatches == []
    assert len(res.sent) == len(res.expected) > 0
    assert res.drops == {}


def test_rc_pingpong_retransmissions_and_duplicate_acks():
    """The real run had a spurious retransmit timeout on each side: the requester re-sent
    from the oldest unacknowledged PSN (go-back-N), and the responder re-ACKed every
    duplicate with the last acknowledged PSN without delivering anything twice."""
    cap = load_capture(str(PCAPS / "rc_pingpong.pcap"))
    for ip in (SERVER, CLIENT):
        res = replay_side(cap, ip, device_name="conformance0")
        assert res.mismatches == []
        reqs = [parse(b) for b in res.sent if parse(b).info.is_request]
        psns = [p.psn for p in reqs]
        assert len(psns) > len(set(psns)), "the replay must include the retransmission"
        # ibv_rc_pingpong -n 5 -s 4096: every receive completed exactly once despite the
        # duplicates
        recvs = [wc for wc in res.completions if wc.opcode == 0x80]
        assert [wc.byte_len for wc in recvs] == [4096] * 5
        assert all(wc.status == 0 for wc in res.completions)


def test_atomics_replay_computes_the_captured_results():
    """The ATOMIC ACKNOWLEDGE values come from executing the atomics on memory seeded only
    with the first original value per address."""
    cap = load_capture(str(PCAPS / "fetch_add.pcap"))
    res = replay_side(cap, SERVER, device_name="conformance0")
    origs = [parse(b).orig for b in res.sent]
    assert origs == [c.pkt.orig for c in res.expected]
    assert res.mismatches == []
