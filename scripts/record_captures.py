#!/usr/bin/env python3
"""Record fresh test vectors with real Linux rxe: rxe-to-rxe and rxe-to-softrdma runs of the
pingpong and perftest tools, captured on the lab bridge, into pcaps/lab-<date>/.

    sudo .venv/bin/python scripts/record_captures.py [--out DIR] [--only NAME ...]

Needs what the interop tests need (docs/lab.md). Two guests: 10.77.0.11 (server) and
10.77.0.12 (client) for rxe-to-rxe; softrdma at 10.77.0.1 for the mixed runs.

Open question: the rxe-to-rxe pingpong runs succeed but tcpdump (on br0 or on guest 0's
tap) records none of their RoCE frames, while the perftest runs between the same guests
are recorded; so pingpongs are recorded rxe-to-softrdma only (pcaps/linux-rxe has rxe-to-rxe
pingpongs).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from softrdma.harness.lab import HOST_IP, Lab, guest_ip  # noqa: E402

RUNS = {  # name: (server command, client command without the server address)
    "rc_pingpong": ("ibv_rc_pingpong -g 1 -n 5 -s 4096", "ibv_rc_pingpong -g 1 -n 5 -s 4096"),
    "ud_pingpong": ("ibv_ud_pingpong -g 1 -n 5 -s 512", "ibv_ud_pingpong -g 1 -n 5 -s 512"),
    "write_bw": ("ib_write_bw -x 1 -n 20 -s 8192 -F", "ib_write_bw -x 1 -n 20 -s 8192 -F"),
    "read_bw": ("ib_read_bw -x 1 -n 20 -s 8192 -F", "ib_read_bw -x 1 -n 20 -s 8192 -F"),
    "fetch_add": ("ib_atomic_bw -x 1 -n 20 -A FETCH_AND_ADD -F",
                  "ib_atomic_bw -x 1 -n 20 -A FETCH_AND_ADD -F"),
}
SOFT = {"rc_pingpong": "softrdma pingpong rc -n 5 -s 4096", "ud_pingpong": "softrdma pingpong ud -n 5 -s 512",
        "write_bw": "softrdma perf write -n 20 -s 8192", "read_bw": "softrdma perf read -n 20 -s 8192",
        "fetch_add": "softrdma perf atomic -n 20 -A FETCH_AND_ADD"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "pcaps" / f"lab-{datetime.date.today()}"))
    ap.add_argument("--only", nargs="*", choices=sorted(RUNS))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    readme = ["# Captures recorded by scripts/record_captures.py", "",
              "| file | server | client |", "|---|---|---|"]
    with Lab(guests=2) as lab:
        for name in a.only or sorted(RUNS):
            srv, cli = RUNS[name]
            pairs = [] if "pingpong" in name else [
                ("rxe-rxe", ("guest", 0, srv), ("guest", 1, f"{cli} {guest_ip(0)}"))]
            for tag, server, client in pairs + [
                    ("rxe-softrdma", ("guest", 0, srv), ("host", None, f"{SOFT[name]} --addr {HOST_IP} {guest_ip(0)}"
                                                            if "perf" in SOFT[name] else
                                                            f"{SOFT[name]} -a {HOST_IP} {guest_ip(0)}"))]:
                pcap = out / f"{name}.{tag}.pcap"
                from softrdma.wire.pcap import read_pcap
                for attempt in range(3):
                    # The first capture after boot has been seen to come out empty although
                    # the run succeeded: an empty capture is retried, and reported.
                    cap = lab.capture(pcap, iface="tap0")  # guest 0 is in every run
                    job = lab.guest_start(server[1], f"timeout 60 {server[2]}")
                    time.sleep(1.5)
                    r = lab.guest(client[1], f"timeout 60 {client[2]}") if client[0] == "guest" else \
                        lab.host(client[2], timeout=90)
                    g = job.wait(90)
                    time.sleep(0.5)
                    cap.terminate()
                    cap.wait(10)
                    frames = sum(1 for _ in read_pcap(pcap))
                    ok = r.rc == 0 and g.rc == 0 and frames > 0
                    print(f"{pcap.name}: {'ok' if ok else 'FAILED'} (client {r.rc}, server {g.rc}, "
                          f"{frames} frames, attempt {attempt + 1})")
                    if ok or r.rc or g.rc:
                        break
                readme.append(f"| {pcap.name} | `{server[2]}` ({'rxe' if server[0] == 'guest' else 'softrdma'}) "
                              f"| `{client[2]}` ({'rxe' if client[0] == 'guest' else 'softrdma'}) |")
    (out / "README.md").write_text("\n".join(readme) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
