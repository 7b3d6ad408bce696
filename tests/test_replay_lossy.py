"""``softrdma replay`` on lossy captures (issue 28): it never crashes, judges only what the
capture shows reaching the replayed endpoint, says per frame why the rest is not judged,
and reports the judged share in text and --json.

Captures come from two places: softrdma's own engines on the simulated network with loss,
duplication, reordering or an empty receive queue, captured on the requester's and on the
responder's device; and the real rxe captures of pcaps/linux-rxe/, mutated (frames
dropped, copied, swapped or garbled with a seeded RNG)."""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json
import random
import sys
from pathlib import Path

import pytest

from softrdma.cli import main
from softrdma.harness.conversations import replay_conversations
from softrdma.harness.replay import load_capture

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pcap_mutate as pm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RXE = sorted((ROOT / "pcaps" / "linux-rxe").glob("*.pcap"))
SERVER, CLIENT = "10.77.0.11", "10.77.0.12"


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["replay", *argv])
        except SystemExit as e:  # usage errors
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def _mutate(recs: list, rng: random.Random) -> list:
    """One to four random frame faults: a frame dropped, copied in place (same IPv4 ID, as
    netem duplicates), swapped with the next, or a byte of its RoCE packet flipped (ICRC
    fixed, so the garbage is parsed)."""
    for _ in range(rng.randint(1, 4)):
        if len(recs) < 3:
            break
        i = rng.randint(1, len(recs))
        op = rng.choice(["drop", "copy", "swap", "garble"])
        if op == "drop":
            recs = pm.drop(recs, i)
        elif op == "copy":
            recs = pm.insert(recs, i, recs[i - 1])
        elif op == "swap":
            recs = pm.swap(recs, i, min(i + 1, len(recs)))
        else:
            k = rng.randrange(64)

            def flip(b: bytearray, k: int = k, bit: int = 1 << rng.randrange(8)) -> None:
                b[k % len(b)] ^= bit
            try:
                recs = pm.edit(recs, i, flip)
            except ValueError:  # not a UDP frame (a capture's TCP exchange): left alone
                pass
    return recs


@pytest.mark.parametrize("path", RXE, ids=[p.name for p in RXE])
def test_mutated_real_captures_never_crash(tmp_path, path):
    """Property: whatever frames are lost, copied, reordered or garbled, replay exits 0 or
    1 with no "unexpected error", every side is replayed or refused with a reason (none
    fails), and each replayed side accounts for every frame its endpoint sent: judged
    (identical or different) or not judged."""
    for seed in range(3):
        rng = random.Random(f"{path.name}/{seed}")
        recs = _mutate(pm.load(path), rng)
        f = tmp_path / f"m{seed}.pcap"
        f.write_bytes(pm.to_bytes(recs))
        rc, out, err = _cli(str(f), "--json")
        assert rc in (0, 1) and "unexpected error" not in err, (seed, err)
        sent_by = {}
        for c in load_capture(str(f)):
            sent_by.setdefault(str(ipaddress.ip_address(c.src)), set()).add(c.index)
        for line in out.splitlines():
            side = json.loads(line)
            assert side["status"] in ("identical", "different", "refused"), side
            if side["status"] == "refused":
                assert side["reason"], side
                continue
            assert side["judged"] + side["not_judged"] == side["frames"]
            assert side["identical"] + side["different"] == side["judged"]
            lo, hi = side["conversation"]["frames"]
            assert side["frames"] <= len([i for i in sent_by[side["as"][0]] if lo <= i <= hi])
            assert all(x["reason"] for x in side["not_judged_frames"])


def _sim_capture(tmp_path: Path, seed: int, kind: str) -> tuple[Path, Path, dict]:
    """Captures on the requester's and the responder's device while softrdma's engines
    (rxe's design) move WRITEs, READs, atomics and SENDs over the simulated network, lossy
    ("loss"), lossy with copies and reordering ("dup"), or with the responder's receive
    queue empty at first ("rnr"). Returns the two files and the network's counters."""
    from softrdma import enums as E
    from softrdma.harness.sim import SimNetwork
    from softrdma.harness.testing import connected_pair
    from softrdma.soft.capture import PacketCapture
    from softrdma.verbs_api.device import remove_device

    profile = {"loss": dict(loss=0.08), "dup": dict(loss=0.05, duplicate=0.1, reorder=0.1),
               "rnr": {}}[kind]
    net = SimNetwork(seed=seed, **profile)
    a, b = connected_pair(net, "RC")
    req, resp = tmp_path / f"{kind}{seed}.pcap", tmp_path / f"{kind}{seed}.responder.pcap"
    a.device.capture = PacketCapture(str(req), clock=lambda: net.now)
    b.device.capture = PacketCapture(str(resp), clock=lambda: net.now)
    try:
        if kind != "rnr":
            for i in range(5):
                b.post_recv(b.sge(i * 4096, 4096), 100 + i)
        n = 0
        for i in range(3):
            a.post_send(E.IBV_WR_RDMA_WRITE, a.sge(0, 8192), i, remote_offset=8192)
            a.post_send(E.IBV_WR_RDMA_READ, a.sge(65536, 8192), 10 + i, remote_offset=0)
            a.post_send(E.IBV_WR_ATOMIC_FETCH_AND_ADD, a.sge(200000 + 8 * i, 8), 20 + i,
                        remote_offset=300000, compare_add=1)
            n += 3
        for i in range(5):
            a.post_send(E.IBV_WR_SEND, a.sge(0, 3000), 30 + i)
            n += 1
        if kind == "rnr":
            net.run(until=net.now + 3e-3)
            for i in range(5):
                b.post_recv(b.sge(i * 4096, 4096), 100 + i)
        net.run_until(lambda: a.ncomp() >= n, timeout=30)
        net.run(until=net.now + 0.05)
        assert a.ncomp() == n
    finally:
        a.device.capture.close()
        b.device.capture.close()
        for e in (a, b):
            e.close()
            with contextlib.suppress(Exception):
                remove_device(e.device.name)
    return req, resp, dict(net.stats)


@pytest.mark.parametrize("kind,seed", [("loss", 1), ("loss", 3), ("dup", 2), ("dup", 5),
                                       ("rnr", 0)])
def test_an_endpoint_replayed_from_its_own_capture_is_judged_whole(tmp_path, kind, seed):
    """A capture on an endpoint's own device shows exactly what reached it: replayed as that
    endpoint, every frame it sent is judged and identical, losses or not. Replayed as the
    far endpoint (the capture point was before the lossy hop), nothing is called different,
    and what the losses hide is reported not judged, with the reason."""
    req, resp, stats = _sim_capture(tmp_path, seed, kind)
    lossy = kind != "rnr"
    if lossy:  # the network really lost packets (its own counters)
        assert stats["lost"] > 0, stats
    for path, own in ((req, 0), (resp, 1)):
        cap = load_capture(str(path))
        ends = sorted({c.src for c in cap})  # connected_pair: requester's address first
        sides = {r.side[0]: r for r in replay_conversations(cap, device_name="lossy0")}
        for k, ip in enumerate(ends):
            r = sides[str(ipaddress.ip_address(ip))]
            res = r.result
            mine = [c for c in cap if c.src == ip]
            assert len(res.verdicts) == len(mine)
            assert res.count("different") == 0 and res.mismatches == [], res.mismatches[:3]
            if k == own:
                assert res.judged == len(mine), [v.reason for v in res.verdicts
                                                 if v.status != "identical"][:3]
            elif lossy:
                # what the losses hide is said, not called different: frames not judged,
                # or packets softrdma sent that the capture lacks (lost), not judged
                nj = [v for v in res.verdicts if v.status == "not judged"]
                hidden = [x for x in res.extra if not x.judged]
                assert nj or hidden
                assert all(v.reason for v in nj) and all(x.reason for x in hidden)


def test_text_output_reports_each_unjudged_run_and_the_judged_share(tmp_path):
    """The text report names the frames not judged with the reason, and the summary line
    the judged share; --json carries the same counts per side."""
    req, _, _ = _sim_capture(tmp_path, 3, "loss")
    rc, out, _ = _cli(str(req), "--max-diffs", "50")
    assert rc == 0, out
    rc, js, _ = _cli(str(req), "--json")
    sides = [json.loads(x) for x in js.splitlines()]
    frames = sum(s["frames"] for s in sides)
    judged = sum(s["judged"] for s in sides)
    assert 0 < judged < frames
    assert out.splitlines()[-1] == (
        f"every replayed side identical where judged; 0 conversation(s) not replayed; judged "
        f"{judged} of {frames} frames of the replayed sides: {judged} identical, 0 different, "
        f"{frames - judged} not judged")
    runs = []
    for x in out.splitlines():
        if ": not judged: " in x:
            span, why = x.strip().split(": not judged: ")
            lo, _, hi = span.split()[-1].partition("-")
            runs.append((int(lo), int(hi or lo), why))
    # every frame --json lists as not judged is in a run of the text, with its reason
    for s in sides:
        for nj in s["not_judged_frames"]:
            assert any(lo <= nj["frame"] <= hi and why == nj["reason"]
                       for lo, hi, why in runs), nj


def test_a_message_whose_first_packets_were_never_captured(tmp_path):
    """The KeyError: None of issue 28: write_bw without its first frame (the client's
    RDMA WRITE FIRST). The client's frames of that message are not judged (where it began
    is not known), the rest of its frames are judged identical."""
    recs = pm.drop(pm.load(ROOT / "pcaps/linux-rxe/write_bw.pcap"), 1)
    f = tmp_path / "no-first.pcap"
    f.write_bytes(pm.to_bytes(recs))
    rc, out, err = _cli(str(f), "--json", "--ip", CLIENT)
    assert rc == 0 and not err, out + err
    (side,) = [json.loads(x) for x in out.splitlines()]
    cap = load_capture(str(f))
    first_msg = []  # the client's packets before its first LAST, as the capture shows
    for c in cap:
        if c.src == ipaddress.ip_address(CLIENT).packed:
            first_msg.append(c.index)
            if c.pkt.info.last:
                break
    assert [x["frame"] for x in side["not_judged_frames"]] == first_msg
    assert side["identical"] == side["frames"] - len(first_msg) > 0


def test_a_lost_middle_packet_is_not_a_difference(tmp_path):
    """A WRITE MIDDLE of write_bw's client removed (as if lost before the capture point):
    softrdma still sends it (it is not judged: the capture never shows it), and every
    frame the client sent is judged identical."""
    recs = pm.load(ROOT / "pcaps/linux-rxe/write_bw.pcap")
    assert pm.packet(recs[2]).opcode == 0x07  # RDMA WRITE MIDDLE, from the client
    f = tmp_path / "lost-middle.pcap"
    f.write_bytes(pm.to_bytes(pm.drop(recs, 3)))
    rc, out, _ = _cli(str(f), "--json", "--ip", CLIENT)
    (side,) = [json.loads(x) for x in out.splitlines()]
    assert rc == 0 and side["judged"] == side["identical"] == side["frames"], side
    assert side["sent"] == side["expected"] + 1  # the lost packet, which softrdma sent


def test_a_network_copy_of_the_endpoints_packet_is_not_judged(tmp_path):
    """rc_pingpong with the client's frame 1 copied in place (same IPv4 ID: rxe numbers its
    packets, so only the network repeats an ID): the copy is not judged, as a packet the
    endpoint did not send, and the rest of the client's frames are identical."""
    recs = pm.load(ROOT / "pcaps/linux-rxe/rc_pingpong.pcap")
    f = tmp_path / "copy.pcap"
    f.write_bytes(pm.to_bytes(pm.insert(recs, 1, recs[0])))
    rc, out, _ = _cli(str(f), "--json", "--ip", CLIENT)
    (side,) = [json.loads(x) for x in out.splitlines()]
    assert rc == 0, side
    assert side["not_judged_frames"] == [
        {"frame": 2, "reason": "a copy of frame 1 (same IPv4 ID) made by the network"}]
    assert side["identical"] == side["frames"] - 1


def test_a_real_difference_after_a_loss_is_still_reported(tmp_path):
    """Judging stops only where a loss makes the answer unknowable: on the responder's own
    capture of a lossy run (NAKs, go-backs), its last ACK with the MSN changed is still a
    difference, at that frame and field."""
    _, resp, stats = _sim_capture(tmp_path, 1, "loss")
    assert stats["lost"] > 0
    recs = pm.load(resp)
    cap = load_capture(str(resp))
    responder = cap[-1].src if cap[-1].pkt.info.is_response else cap[-1].dst
    frame = max(c.index for c in cap if c.src == responder and c.pkt.opcode == 0x11
                and c.pkt.syndrome >> 5 == 0)
    bad = pm.edit(recs, frame, msn=(pm.packet(recs[frame - 1]).msn + 7) & 0xFFFFFF)
    rc, out, _ = _cli(_write(tmp_path, bad), "--json", "--ip",
                      str(ipaddress.ip_address(responder)))
    (side,) = [json.loads(x) for x in out.splitlines()]
    assert rc == 1 and [d["frame"] for d in side["differences"]] == [frame], side
    assert "msn" in [f["field"] for f in side["differences"][0]["fields"]]
    assert any(e["kind"] == "nak" for e in side["losses"])  # the capture was lossy


def _write(tmp_path: Path, recs: list) -> str:
    f = tmp_path / "x.pcap"
    f.write_bytes(pm.to_bytes(recs))
    return str(f)


def test_a_file_is_replayed_one_conversation_at_a_time(tmp_path):
    """Bounded memory: replay_file indexes the capture in one pass (frame numbers only) and
    holds the packets of one conversation at a time; a conversation not chosen with
    --ip/--qpn is never read in. srq_pingpong has four RC conversations."""
    from softrdma.harness.conversations import replay_file

    path = str(ROOT / "pcaps/linux-rxe/srq_pingpong.pcap")
    index: list = []
    seen = []
    for r in replay_file(path, index=index):
        held = [cv for cv in index if cv.packets]
        assert held == [r.conversation]  # the others are frame numbers only
        assert [c.index for c in r.conversation.packets] == list(r.conversation.frame_numbers)
        seen.append(r.conversation)
    assert len(index) == 4 and all(not cv.packets for cv in index)
    assert [id(cv) for cv in index] == list(dict.fromkeys(id(cv) for cv in seen))
    index = []
    sides = list(replay_file(path, qpn=0x15, index=index))
    assert {r.side[1] for r in sides} == {0x15} and all(r.ok for r in sides)
    # the three conversations without QP 0x15 were never read in: no packets, ever
    # (frame numbers alone: 4 bytes a packet)
    assert sum(1 for cv in index if cv.endpoint(qpn=0x15) is None) == 3


def test_a_file_cut_inside_a_record_is_replayed_up_to_the_cut(tmp_path):
    """tcpdump killed mid-write: the records before the cut are replayed, the cut is named
    on stderr, and the exit status is the replay's (not 2)."""
    data = (ROOT / "pcaps/linux-rxe/rc_pingpong.pcap").read_bytes()
    whole = len(pm.load(ROOT / "pcaps/linux-rxe/rc_pingpong.pcap"))
    f = tmp_path / "cut.pcap"
    f.write_bytes(data[:len(data) * 2 // 3])
    rc, out, err = _cli(str(f))
    assert rc == 0, out + err
    assert "data truncated" in err and "record(s) before it are replayed" in err
    n = int(err.split("the ")[-1].split()[0])
    assert 0 < n < whole
    assert "as 10.77.0.11 qpn 0x11" in out


def test_a_nak_says_what_never_reached_the_endpoint(tmp_path):
    """write_bw as if the capture point were before a lossy hop: the server's PSN sequence
    NAK of 5558131 inserted after the client's 5558132 (frame 3) says frame 2 (5558131)
    never reached it. The replay does not feed frame 2 to softrdma, which then NAKs the
    same PSN with the same MSN: the inserted NAK is judged identical (fed frame 2,
    softrdma would have sent no NAK)."""
    recs = pm.load(ROOT / "pcaps/linux-rxe/write_bw.pcap")
    assert [pm.packet(recs[i]).psn for i in (1, 2)] == [5558131, 5558132]
    first_ack = pm.packet(recs[8])
    assert first_ack.opcode == 0x11 and first_ack.msn == 1  # frame 9, the server's
    nak = pm.edit(recs, 9, psn=5558131, syndrome=0x60, msn=0)[8]  # no message done yet
    f = _write(tmp_path, pm.insert(recs, 3, nak))
    (r,) = list(replay_conversations(load_capture(f), ip=SERVER, device_name="nak0"))
    res = r.result
    assert 2 in res.evidence.undelivered
    (v,) = [v for v in res.verdicts if v.frame == 4]
    assert v.status == "identical", v.reason


def _resent(rec, ip_id: int):
    """``rec`` sent again by its endpoint: the same RoCE packet under a new IPv4 ID (rxe
    numbers its packets), ICRC computed for it."""
    import dataclasses

    from softrdma.wire.frames import decode_frame, encode_frame
    f = decode_frame(rec.data, rec.linktype)
    data = encode_frame(bytes(f.payload), src=f.ip_src, dst=f.ip_dst, sport=f.sport,
                        dport=f.dport, ip_id=ip_id, ttl=f.ttl, tos=f.tos, frag=f.ip_frag,
                        fill_icrc=True, linktype=rec.linktype,
                        **({"eth_src": f.eth_src, "eth_dst": f.eth_dst} if f.eth_src else {}))
    return dataclasses.replace(rec, data=data, orig_len=len(data))


def test_a_timeout_says_which_answer_never_reached_the_endpoint(tmp_path):
    """write_bw as if the server's first ACK (frame 9) were lost after the capture point:
    the client resends its first message (frames 1-8 again, new IPv4 IDs) after it. No
    NAK explains that go-back, so the client timed out and never got the ACK: the replay
    does not feed it to softrdma, whose retransmit timer then fires where the capture
    shows the resend, and the eight resent frames are judged identical (fed the ACK,
    softrdma would have had nothing to resend)."""
    recs = pm.load(ROOT / "pcaps/linux-rxe/write_bw.pcap")
    assert pm.packet(recs[8]).opcode == 0x11 and pm.packet(recs[8]).psn == 5558137
    resend = [_resent(recs[i], 0xF000 + i) for i in range(8)]
    out = recs[:9]
    for r in resend:
        out = pm.insert(out, len(out), r)
    f = _write(tmp_path, out + recs[9:])
    (r,) = list(replay_conversations(load_capture(f), ip=CLIENT, device_name="rto0"))
    res = r.result
    assert 9 in res.evidence.undelivered
    assert [v.status for v in res.verdicts if 10 <= v.frame <= 17] == ["identical"] * 8


def test_a_re_ack_of_a_duplicate_made_after_the_capture_point_is_not_judged():
    """The lab's send.dup run (netem duplicating on each guest's way in, after the bridge):
    rxe re-ACKs a duplicate SEND the bridge never saw (frame 32 repeats frame 31's ACK).
    softrdma, fed what the bridge shows, has no duplicate to answer: that ACK is not judged,
    with the reason, and the side is identical where judged."""
    import json
    import subprocess
    import sys

    from .conftest import ROOT

    pcap = ROOT / "pcaps" / "linux-rxe" / "lossy" / "send.dup.bridge.pcap"
    r = subprocess.run([sys.executable, "-m", "softrdma", "replay", str(pcap), "--ip",
                        "10.77.0.11", "--json"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (side,) = [json.loads(x) for x in r.stdout.splitlines()]
    reasons = {f["frame"]: f["reason"] for f in side["not_judged_frames"]}
    assert reasons[32].startswith("repeats the ACK of frame 31")
