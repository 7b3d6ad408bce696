"""The lossy rxe captures (pcaps/linux-rxe/lossy, made by scripts/record_lossy_captures.py):
every file the README names is there and every RoCE frame in it carries a correct ICRC;
counters.json describes exactly these files; the counters netem and rxe kept during each run
agree with the packets captured; and the three captures of one run (the bridge, each
guest) agree in the way the netem placement requires. Everything is derived from the
packets and from netem's and rxe's counters, never from softrdma's checker. No lab needed.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path

import pytest

from softrdma.wire.frames import decode_frame
from softrdma.wire.packet import parse
from softrdma.wire.pcap import read_pcap

DIR = Path(__file__).resolve().parent.parent / "pcaps" / "linux-rxe" / "lossy"
README = (DIR / "README.md").read_text()
DOC = json.loads((DIR / "counters.json").read_text())
RUNS = {r["run"]: r for r in DOC["runs"]}
IP = {"g0": "10.77.0.11", "g1": "10.77.0.12"}
PERFTEST = ("send", "write", "read", "atomic")  # the client is the only requester


@lru_cache(maxsize=None)
def roce(name: str) -> tuple[tuple[str, str, bytes], ...]:
    """(source IP, destination IP, IP packet bytes) of every RoCE frame of one capture, in
    capture order. The IP packet identifies one transmission: rxe gives every packet a new
    IP ID (so a retransmission differs), netem's duplicate is a byte-for-byte copy."""
    out = []
    for rec in read_pcap(DIR / name):
        f = decode_frame(rec.data, rec.linktype)
        if f is not None and f.is_roce:
            out.append((f.src, f.dst, bytes(f.ip_packet)))
    return tuple(out)


def direction(name: str, src: str, dst: str) -> list[bytes]:
    return [p for s, d, p in roce(name) if (s, d) == (IP[src], IP[dst])]


def faults(run: dict, guest: str, dir_: str) -> list[str]:
    """The netem specs that were on ``guest``'s ``dir_`` ("egress"/"ingress") in ``run``."""
    return [n["spec"] for n in run["netem"] if f"g{n['guest']}" == guest and n["direction"] == dir_]


def qdisc(run: dict, guest: str, dir_: str, key: str) -> int:
    """A netem/FIFO counter of one run: after minus before (each run starts a new qdisc)."""
    q = run["qdisc"][guest][dir_]
    return (q["after"].get(key) or 0) - (q["before"].get(key) or 0)


def is_subsequence(small: list, big: list) -> bool:
    it = iter(big)
    return all(any(x == y for y in it) for x in small)


CAPTURES = [c["file"] for r in DOC["runs"] for c in r["captures"].values()]


def test_readme_lists_exactly_the_captures_in_counters_and_on_disk():
    """The README's table, counters.json and the directory name the same capture files."""
    listed = set(re.findall(r"[\w-]+\.[\w-]+\.(?:bridge|g0|g1)\.pcap", README))
    on_disk = {p.name for p in DIR.glob("*.pcap")}
    assert listed == set(CAPTURES) == on_disk
    assert len(RUNS) >= 12 and len(CAPTURES) == 3 * len(RUNS)


def test_set_stays_small():
    """The whole set is committed: each capture well under 1 MB, all under ~8 MB."""
    sizes = [(DIR / f).stat().st_size for f in CAPTURES]
    assert max(sizes) < 1_000_000 and sum(sizes) < 9_000_000


@pytest.mark.parametrize("name", CAPTURES)
def test_every_roce_frame_carries_a_correct_icrc(name):
    """Each file is a readable capture whose RoCE frames decode and whose ICRC is the one
    computed from the captured headers (a frame damaged by a capture or a merge fails)."""
    n = 0
    for rec in read_pcap(DIR / name):
        f = decode_frame(rec.data, rec.linktype)
        assert f is not None and f.is_roce, rec.index
        assert parse(f.payload).icrc == f.icrc(), rec.index
        n += 1
    assert n > 0


@pytest.mark.parametrize("run", RUNS)
def test_counters_json_describes_its_files(run):
    """Frame counts, the guests' sent/received split, commands and exit statuses recorded;
    tcpdump dropped nothing (a precondition of every comparison below)."""
    r = RUNS[run]
    assert r["server"]["cmd"] and r["client"]["cmd"] and r["netem"]
    assert r["client"]["rc"] == 0 and r["server"]["rc"] == 0, "the tools completed"
    for point, c in r["captures"].items():
        assert len(roce(c["file"])) == c["frames"], point
        dropped = c["tcpdump_dropped"]
        assert (dropped if isinstance(dropped, list) else [dropped]) == [0] * (
            2 if point != "bridge" else 1), point
    for g in ("g0", "g1"):
        f = r["captures"][g]["file"]
        peer = "g1" if g == "g0" else "g0"
        assert len(direction(f, g, peer)) == r["captures"][g]["frames_sent"]
        assert len(direction(f, peer, g)) == r["captures"][g]["frames_received"]


@pytest.mark.parametrize("run", RUNS)
def test_guest_captures_hold_what_their_qdiscs_passed(run):
    """netem's own counters: the guest's egress qdisc passed exactly the frames its capture
    shows leaving (tcpdump -Q out taps after the qdisc), its ifb0 qdisc exactly the frames
    its capture shows arriving (tcpdump on ifb0 taps after that qdisc; ifb0 sends nothing
    of its own, its IPv6 being off). And rxe counts a
    packet netem dropped as sent: without duplication, sent_pkts = passed + dropped (with
    it, netem's copies come on top). rxe counts what reached it (rcvd_pkts) among the
    frames the ifb0 capture shows."""
    r = RUNS[run]
    for g in ("g0", "g1"):
        c, rxe = r["captures"][g], r["rxe"][g]
        assert qdisc(r, g, "egress", "packets") == c["frames_sent"]
        assert qdisc(r, g, "ingress", "packets") == c["frames_received"]
        handed = c["frames_sent"] + qdisc(r, g, "egress", "drops")
        if any("duplicate" in s for s in faults(r, g, "egress")):
            assert rxe.get("sent_pkts", 0) <= handed
        else:
            assert rxe.get("sent_pkts", 0) == handed
        assert 0 < rxe.get("rcvd_pkts", 0) <= c["frames_received"]


@pytest.mark.parametrize("run", [r for r in RUNS if RUNS[r]["op"] in PERFTEST])
def test_lost_requests_made_rxe_retry(run):
    """rxe resends only by a retry (its completer counts each in completer_retry_err) or
    after an RNR NAK. A request lost on the way (client egress or server ingress; for READ
    and atomics also a response, which only a retry brings back) therefore shows in the
    client's retries, unless an RNR NAK went back over it. A lost READ/atomic response
    means the responder sees that request again: duplicate_request."""
    r = RUNS[run]
    lost_requests = qdisc(r, "g1", "egress", "drops") + qdisc(r, "g0", "ingress", "drops")
    lost_responses = qdisc(r, "g0", "egress", "drops") + qdisc(r, "g1", "ingress", "drops")
    client, server = r["rxe"]["g1"], r["rxe"]["g0"]
    if r["op"] in ("read", "atomic"):
        lost_requests += lost_responses
        if lost_responses:
            assert server.get("duplicate_request", 0) > 0
    if lost_requests and not client.get("rcvd_rnr_err"):
        assert client.get("completer_retry_err", 0) > 0


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("src,dst", [("g1", "g0"), ("g0", "g1")])
def test_capture_points_agree_as_the_fault_placement_requires(run, src, dst):
    """Packets from ``src`` to ``dst``, at the three points. Nothing sits between the
    sender's egress tap and the bridge: the bridge holds exactly the sender's capture, in
    order (a loss on the sender's side is missing from both). Between the bridge and the
    receiver's capture sits the receiver's ifb netem: with none, both hold the same
    sequence; with loss, the receiver holds an ordered part of the bridge, missing exactly
    as many as netem dropped there; with duplication, the same packets, some more than
    once; with reordering, the same packets in another order."""
    r = RUNS[run]
    sent = direction(r["captures"][src]["file"], src, dst)
    bridge = direction(r["captures"]["bridge"]["file"], src, dst)
    got = direction(r["captures"][dst]["file"], src, dst)
    assert bridge == sent
    specs = " ".join(faults(r, dst, "ingress"))
    drops = qdisc(r, dst, "ingress", "drops")
    if not specs:
        assert got == bridge
    elif "duplicate" in specs:
        assert set(got) == set(bridge) and not (Counter(bridge) - Counter(got))
    elif "reorder" in specs:
        assert Counter(got) == Counter(bridge)
    else:
        assert set(got) <= set(bridge) and is_subsequence(got, bridge)
        assert len(bridge) - len(got) == drops
