"""The summary a fuzzing run prints: what was sent, how it was mutated, what the devices
did with it, and the checks (the format ``tests/test_fuzz_live.py`` reads)."""

from __future__ import annotations

import sys
from typing import Any

from .fuzzer import Fuzzer

__all__ = ["print_report", "print_summary", "print_checks"]


def print_report(fz: Fuzzer, total_t: float, out: Any) -> int:
    """Print the summary and the checks; return the exit status (0: every check passed;
    1: the first failure is also one line on stderr)."""
    devs = fz.devs
    st = fz.stats
    print(f"sent: {st.sent} frames in {total_t:.1f} s ({st.sent / max(total_t, 1e-9):.0f} "
          f"frames/s); {st.from_peer} from the peer's address, {st.to_live_qp} at a live QP, "
          f"{st.good_icrc} with a correct ICRC, {st.real_key} with a real rkey, "
          f"{st.byte_mutated} byte-mutated; {st.send_errors} send errors; "
          f"{st.legit_ops} legitimate operations alongside", file=out)
    print("mutations: " + ", ".join(f"{k} {v}" for k, v in sorted(st.mutations.items())), file=out)
    print("QP pairs reset and reconnected during the run: " + (", ".join(
        f"{k} {v}" for k, v in sorted(st.recoveries.items())) or "none"), file=out)
    print("error completions: " + (", ".join(f"{k} {v}" for k, v in sorted(
        st.wc_errors.items(), key=lambda kv: -kv[1])) or "none") + "; async events: " + (
        ", ".join(f"{k} {v}" for k, v in sorted(st.async_events.items(),
                                                key=lambda kv: -kv[1])) or "none"), file=out)
    for d in devs:
        c = d.counters
        drops = ", ".join(f"{k} {v}" for k, v in sorted(c.drops.items(), key=lambda kv: -kv[1]))
        extra = "".join(f", {k} {getattr(c, k)}" for k in ("icrc_unchecked", "sport_fallback")
                        if getattr(c, k, 0))
        print(f"{d.name}: received {c.rcvd_pkts}, sent {c.sent_pkts}, dropped "
              f"{c.dropped_pkts} ({c.dropped_pkts / max(total_t, 1e-9):.0f}/s){extra}; "
              f"drops by reason: {drops or 'none'}", file=out)
    return print_checks(fz, out)


def print_checks(fz: Any, out: Any) -> int:
    """The checks, one a line, and the verdict; the exit status (1: the first failure is
    also one line on stderr)."""
    print("checks:", file=out)
    for ch in fz.checks:
        print(f"  {'ok  ' if ch.ok else 'FAIL'} {ch.name}" + (f" ({ch.detail})" if ch.detail else ""),
              file=out)
    failed = [ch for ch in fz.checks if not ch.ok]
    if fz.thread_errors:
        print("first thread exception:\n" + fz.thread_errors[0], file=out)
    if failed:
        if hasattr(fz, "write_crash_pcap") and any(
                ch.name.startswith(("progress", "no exception")) for ch in failed):
            print(f"last {len(fz.ring)} frames sent: {fz.write_crash_pcap()}", file=out)
        out.flush()
        print(f"softrdma fuzz: FAILED: {failed[0].name}: {failed[0].detail}", file=sys.stderr)
        return 1
    print(f"fuzz: all {len(fz.checks)} checks passed", file=out)
    return 0


def print_summary(fz: Any, total_t: float, out: Any, unit: str = "frames") -> int:
    """The summary of the ``cm`` and ``records`` targets, in the data path's format:
    what was sent, the mutations, what the devices did, the checks."""
    st = fz.stats
    framing = (f"{st.from_peer} from the peer's address, {st.to_live_qp} aimed at live "
               f"state, {st.good_icrc} with a correct ICRC, {st.byte_mutated} byte-mutated; "
               f"{st.send_errors} send errors; ") if unit != "records" else ""
    print(f"sent: {st.sent} {unit} in {total_t:.1f} s ({st.sent / max(total_t, 1e-9):.0f} "
          f"{unit}/s); {framing}{st.legit_ops} legitimate operations alongside", file=out)
    print("mutations: " + ", ".join(f"{k} {v}" for k, v in sorted(st.mutations.items())),
          file=out)
    print("connections made and torn down alongside: " + (", ".join(
        f"{k} {v}" for k, v in sorted(st.recoveries.items())) or "none") + "; failures: " + (
        ", ".join(f"{k} {v}" for k, v in sorted(st.wc_errors.items())) or "none"), file=out)
    for d in fz.devs:
        c = d.counters
        drops = ", ".join(f"{k} {v}" for k, v in sorted(c.drops.items(), key=lambda kv: -kv[1]))
        print(f"{d.name}: received {c.rcvd_pkts}, sent {c.sent_pkts}, MADs received "
              f"{c.gsi_mads_rcvd}, sent {c.gsi_mads_sent}; drops by reason: {drops or 'none'}",
              file=out)
    return print_checks(fz, out)
