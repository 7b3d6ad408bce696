"""softrdma check on real lossy captures of kernel rxe, against what netem and rxe counted.

pcaps/linux-rxe/lossy/ holds runs of perftest, ibv_rc_pingpong and rping between two
kernel rxe guests with netem losing packets on each guest's way out (before every capture
point) and on its way in (after the bridge, and, as the captures show, before the guest's
own tcpdump), each captured at three points: the bridge and each guest's NIC.
counters.json has, for each run, netem's drop counters and each guest's rxe counters read
in the guests around the run (scripts/record_lossy_captures.py). Every capture must be clean
with no option, and its recovery report must agree with those counters where the capture
point lets it see:

* every PSN-sequence NAK the responder counted (``out_of_seq_request``) is in a capture,
  unless netem dropped it on the responder's way out;
* the requester's retries (``completer_retry_err``) are its go-backs, unless a whole burst
  was dropped on its way out;
* a request lost before the bridge was dropped on the requester's way out, one lost after
  the bridge on the responder's way in;
* nothing its own NIC captured was lost after that point on the way in.
"""

from __future__ import annotations

import json
from functools import lru_cache

import pytest

from softrdma.check import check_pcap

from .conftest import ROOT

LOSSY = ROOT / "pcaps" / "linux-rxe" / "lossy"
POINTS = ("bridge", "g0", "g1")
PERFTEST = ("send", "write", "read", "atomic")  # client (guest 1) = requester


def _runs() -> list[dict]:
    return json.loads((LOSSY / "counters.json").read_text())["runs"]


def _drops(run: dict, guest: int, way: str) -> int:
    q = run["qdisc"][f"g{guest}"].get(way)
    return q["after"]["drops"] - q["before"]["drops"] if q else 0


@lru_cache(maxsize=None)
def _check(name: str):
    return check_pcap(LOSSY / name)


def _captures() -> list[tuple[str, str]]:
    return [(r["run"], p) for r in _runs() for p in POINTS]


def test_the_lossy_set_is_there():
    """The runs the README lists, each at its three points (a missing file fails here,
    it is never skipped)."""
    runs = _runs()
    assert len(runs) >= 6
    for r in runs:
        for p in POINTS:
            assert (LOSSY / f"{r['run']}.{p}.pcap").is_file(), (r["run"], p)


@pytest.mark.parametrize("run,point", _captures())
def test_every_lossy_capture_is_clean_with_no_option(run, point):
    result = _check(f"{run}.{point}.pcap")
    assert result.packets > 0
    assert result.violations == [], [(v.frame, v.rule, v.message) for v in result.violations]


def _requester_flow(result, client_ip: str):
    flows = [f for f in result.recovery if f.transport == "RC"
             and f.label.startswith(client_ip + " ")]
    assert len(flows) == 1, [f.label for f in result.recovery]
    return flows[0]


@pytest.mark.parametrize("run", [r["run"] for r in _runs() if r["op"] in PERFTEST])
def test_recovery_agrees_with_netem_and_rxe(run):
    r = next(x for x in _runs() if x["run"] == run)
    req_ip, rxe = r["client"]["ip"], r["rxe"]
    naks = rxe["g0"].get("out_of_seq_request", 0)
    retries = rxe["g1"].get("completer_retry_err", 0)
    req_out, resp_out = _drops(r, 1, "egress"), _drops(r, 0, "egress")
    resp_in = _drops(r, 0, "ingress")
    dups = rxe["g0"].get("duplicate_request", 0)
    assert naks or retries or req_out or resp_in or dups  # the run lost, reordered or
    # duplicated packets
    fr = {p: _requester_flow(_check(f"{run}.{p}.pcap"), req_ip) for p in POINTS}
    for p in POINTS:
        assert naks - resp_out <= fr[p].naks <= naks, p
    # the go-backs, seen where the requester sends them
    go_backs = sum(fr["g1"].go_backs.values())
    assert retries - req_out <= go_backs <= retries
    # where the losses were placed
    assert fr["bridge"].lost_before["requests"] <= req_out + resp_in
    assert fr["bridge"].lost_after["requests"] <= resp_in
    assert fr["g0"].lost_after["requests"] == 0  # the responder's NIC: nothing later lost
    assert fr["g1"].lost_after["responses"] == 0  # the requester's NIC likewise
    if req_out == 0:
        assert fr["g1"].lost_before["requests"] == 0


@pytest.mark.parametrize("run", [r["run"] for r in _runs() if r["op"] in PERFTEST])
def test_two_nics_locate_every_loss_between_them(run):
    """The requester's NIC (A) and the responder's (B), merged by time: every request A
    saw and B did not was dropped on the responder's way in, every response B saw and A
    did not on the requester's way in: as many as netem dropped there, exactly."""
    from softrdma.check import check_captures

    r = next(x for x in _runs() if x["run"] == run)
    result = check_captures([LOSSY / f"{run}.g1.pcap", LOSSY / f"{run}.g0.pcap"])
    assert result.violations == []
    fr = _requester_flow(result, r["client"]["ip"])
    assert fr.located["request(s) seen at A, not at B"] == _drops(r, 0, "ingress")
    assert fr.located["response(s) seen at B, not at A"] == _drops(r, 1, "ingress")
    assert result.merge.offsets[1].matched > 0


def test_cli_with_two_captures_and_a_stretch(tmp_path):
    """`softrdma check A B` prints the located losses and the merge's report; a second
    capture that cannot be read is named; --recovery --frames lists only that stretch's
    events; a bad stretch is a usage error."""
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "softrdma", "check", *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)

    a, b = LOSSY / "write.loss-both.g1.pcap", LOSSY / "write.loss-both.g0.pcap"
    r = cli(str(a), str(b))
    assert r.returncode == 0, r.stderr
    assert "request(s) seen at A, not at B" in r.stdout
    assert any(line.startswith("merge: [B] ") for line in r.stdout.splitlines())
    bad = tmp_path / "nope.pcap"
    bad.write_bytes(b"not a capture")
    r = cli(str(a), str(bad))
    assert r.returncode == 2 and "nope.pcap" in r.stderr
    r = cli(str(a), "--recovery", "--frames", "1-40")
    frames = [int(line.split()[1].rstrip(":")) for line in r.stdout.splitlines()
              if line.startswith("    frame ")]
    assert frames and all(1 <= f <= 40 for f in frames)
    assert cli(str(a), "--frames", "9-3").returncode == 2


@pytest.mark.parametrize("run", [r["run"] for r in _runs()
                                 if r["op"] in PERFTEST and r["fault"] == "dup"])
def test_network_duplicates_are_the_responders_duplicate_requests(run):
    """netem duplicating packets and nothing lost: a duplicate request rxe's responder
    counted (duplicate_request) is a packet the network delivered twice, or a resend of
    one it had; its own NIC captured every copy. The recovery report counts the network's
    duplicates as such (exactly rxe's count when nothing was resent), the resends as
    resends, and no more go-backs than rxe's retries."""
    r = next(x for x in _runs() if x["run"] == run)
    retries = r["rxe"]["g1"].get("completer_retry_err", 0)
    fr = _requester_flow(_check(f"{run}.g0.pcap"), r["client"]["ip"])
    dups = sum(e.count for e in fr.events if e.kind == "duplicate" and e.direction == "requests")
    # the responder also counts resends of what it had as duplicates: rxe's timer fires on
    # a clean run under qemu's emulation too (pcaps/linux-rxe/lossy/README.md)
    assert 0 < dups <= r["rxe"]["g0"]["duplicate_request"]
    assert dups + fr.resent_packets >= r["rxe"]["g0"]["duplicate_request"]
    if retries == 0:
        assert dups == r["rxe"]["g0"]["duplicate_request"] and fr.resent_packets == 0
    assert sum(fr.go_backs.values()) <= retries
