"""``softrdma replay PCAP``: stand softrdma in for an endpoint of a captured conversation
and report, packet by packet, where softrdma and the captured endpoint part ways.

Each conversation (a pair of QPs: :mod:`softrdma.harness.conversations`) is replayed with
softrdma in place of each end in turn, or only of the end chosen with ``--ip`` and/or
``--qpn``. softrdma gets what the captured endpoint got (the peer's packets, in capture
order) and posts the work requests the endpoint's own requests show; everything it sends
is compared with what the endpoint sent, byte for byte, UDP source port and ICRC
included. Exit status 0 when every replayed side is identical, 1 when one differs (each
difference reported with its frame number and fields), 2 when the file cannot be read,
an option is wrong or nothing matched ``--ip``/``--qpn``. Conversations that cannot be
replayed (QP1's MADs, one-sided flows) are listed with the reason and do not fail the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .argtypes import CAPTURE_HELP, capture_file, int_range, ip_address, qp_number
from .common import UsageError, capture_file_errors

__all__ = ["add_parser", "run"]




def add_parser(sub: Any) -> None:
    d = sub.add_parser("replay", help="replay a capture with softrdma in place of an endpoint",
                       description="Replay each conversation of a RoCEv2 capture with softrdma "
                                   "standing in for an endpoint (both ends in turn, or the one "
                                   "chosen by --ip/--qpn) and report where what softrdma sends "
                                   "differs from what the captured endpoint sent. Exit status 0 "
                                   "identical, 1 different, 2 unreadable file or bad option.")
    d.add_argument("pcap", type=capture_file, help=CAPTURE_HELP)
    d.add_argument("--ip", type=ip_address, help="stand in for the endpoint with this address")
    d.add_argument("--qpn", type=qp_number, help="stand in for the endpoint with this QP number")
    d.add_argument("--inline", action="store_true",
                   help="the endpoint posted its sends inline (as ibv_rc_pingpong -I does)")
    d.add_argument("--json", action="store_true",
                   help="JSON lines: one object per replayed side, with its differences")
    d.add_argument("--max-diffs", type=int_range(0, None), default=5, metavar="N",
                   help="differences shown per side in text output (default 5)")
    d.set_defaults(func=run)


def _not_judged(verdicts: list[Any]) -> list[tuple[int, int, str]]:
    """Runs of consecutive not-judged frames with one reason: (first, last, reason)."""
    runs: list[tuple[int, int, str]] = []
    for v in verdicts:
        if runs and runs[-1][2] == v.reason:
            runs[-1] = (runs[-1][0], v.frame, v.reason)
        else:
            runs.append((v.frame, v.frame, v.reason))
    return runs


def _side_json(r: Any) -> dict[str, Any]:
    cv = r.conversation
    out: dict[str, Any] = {
        "conversation": {"transport": cv.transport, "a": list(cv.a), "b": list(cv.b),
                         "frames": list(cv.frames), "packets": cv.count},
        "as": list(r.side),
    }
    if r.error is not None:
        out.update(status="failed", reason=r.error)
        return out
    if r.result is None:
        out.update(status="refused", reason=r.refused)
        return out
    res = r.result
    diff = r.diff()
    ev = res.evidence
    out.update(status="identical" if r.ok else "different", sent=len(res.sent),
               expected=len(res.expected), after_capture=len(res.after_capture),
               frames=len(res.verdicts), judged=res.judged, identical=res.count("identical"),
               different=res.count("different"), not_judged=res.count("not judged"),
               differences=[{"kind": d.kind, "index": d.index, "frame": d.frame,
                             "opcode": d.name,
                             "sent_by": ("both" if d.expected_line and d.got_line else
                                         "capture" if d.expected_line else "softrdma"),
                             "fields": [{"field": f.name, "expected": f.show(f.expected),
                                         "got": f.show(f.got)} for f in d.differing]}
                            for d in diff.packets],
               not_judged_frames=[{"frame": v.frame, "reason": v.reason}
                                  for v in res.verdicts if v.status == "not judged"],
               extra_not_judged=sum(1 for x in res.extra if not x.judged),
               losses=[{"frame": e.frame, "kind": e.kind, "psn": e.psn, "count": e.count,
                        "text": e.text} for e in (ev.events if ev is not None else [])],
               notes=res.notes, failures=res.failures)
    return out


def _share(res: Any) -> str:
    return (f"judged {res.judged} of {len(res.verdicts)} frames: {res.count('identical')} "
            f"identical, {res.count('different')} different, {res.count('not judged')} "
            "not judged")


def _side_text(r: Any, max_diffs: int) -> list[str]:
    """The lines for one side (the conversation's own line is written once, before)."""
    who = f"as {r.side[0]} qpn {'?' if r.side[1] is None else hex(r.side[1])}"
    if r.error is not None:
        return [f"  {who}: FAILED: {r.error}"]
    res = r.result
    nj = [v for v in res.verdicts if v.status == "not judged"]
    unjudged_extra = sum(1 for x in res.extra if not x.judged)
    tail = (f"; {len(res.after_capture)} answer(s) after the capture's end not compared"
            if res.after_capture else "")
    if unjudged_extra:
        tail += (f"; {unjudged_extra} packet(s) softrdma sent that the capture does not show "
                 "not judged (after a loss)")
    lines = []
    if r.ok and not nj:
        lines.append(f"  {who}: identical ({len(res.sent)} packets){tail}")
    elif r.ok:
        lines.append(f"  {who}: identical where judged ({_share(res)}){tail}")
    else:
        diff = r.diff()
        lines.append(f"  {who}: DIFFERENT ({len(diff.packets)} packet(s) differ; softrdma sent "
                     f"{len(res.sent)} packets, the captured endpoint {len(res.expected)}; "
                     f"{_share(res)}){tail}")
        for d in diff.packets[:max_diffs]:
            where = f"{d.kind} {d.index}" + (f", frame {d.frame}" if d.frame else "")
            if d.got_line is None:
                lines.append(f"  {where} ({d.name}): softrdma sent nothing in its place")
            elif d.expected_line is None:
                lines.append(f"  {where}: softrdma sent one more {d.kind} than the endpoint")
            else:
                lines.append(f"  {where} ({d.name}):")
            lines.append(f"    capture : {d.expected_line or '-'}")
            lines.append(f"    softrdma: {d.got_line or '-'}")
            if d.expected_line and d.got_line:
                lines.extend("    " + f.line() for f in d.differing)
        if len(diff.packets) > max_diffs:
            lines.append(f"  ... {len(diff.packets) - max_diffs} more (--max-diffs)")
        lines.extend(f"  {f}" for f in res.failures)
    runs = _not_judged(nj)
    for first, last, why in runs[:max_diffs]:
        frames = f"frame {first}" if first == last else f"frames {first}-{last}"
        lines.append(f"  {frames}: not judged: {why}")
    if len(runs) > max_diffs:
        lines.append(f"  ... {len(runs) - max_diffs} more runs of frames not judged "
                     "(--max-diffs; --json lists every frame)")
    return lines


def run(args: argparse.Namespace) -> int:
    with capture_file_errors(args.pcap):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from ..harness.conversations import replay_file
    warnings: list[str] = []
    out = sys.stdout
    sides = different = refused = failed = refused_sides = 0
    frames = judged = identical = ndiff = 0
    last = None
    convs: list[Any] = []
    for r in replay_file(args.pcap, ip=args.ip, qpn=args.qpn, inline=args.inline,
                         warnings=warnings, index=convs):
        sides += 1
        cv = r.conversation
        if args.json:
            out.write(json.dumps(_side_json(r)) + "\n")
        new = cv is not last
        last = cv
        if r.result is None and r.error is None:
            if r.side_refused is not None:  # this side only
                refused_sides += 1
                if not args.json:
                    if new:
                        out.write(cv.describe() + "\n")
                    out.write(f"  as {r.side[0]}: not replayed: {r.side_refused}\n")
            elif new:
                refused += 1
                if not args.json:
                    out.write(f"{cv.describe()}\n  not replayed: {cv.refused}\n")
            continue
        if r.error is not None:
            failed += 1
        else:
            res = r.result
            frames += len(res.verdicts)
            judged += res.judged
            identical += res.count("identical")
            ndiff += res.count("different")
            if not r.ok:
                different += 1
        if not args.json:
            if new:
                out.write(cv.describe() + "\n")
            for line in _side_text(r, args.max_diffs):
                out.write(line + "\n")
    for w in warnings:
        sys.stderr.write(f"softrdma replay: {args.pcap}: {w}\n")
    if not convs:
        raise UsageError(f"{args.pcap}: no RoCEv2 packets in the capture")
    if sides == 0:
        want = " ".join(x for x in (args.ip and f"--ip {args.ip}",
                                    args.qpn is not None and f"--qpn {args.qpn:#x}") if x)
        raise UsageError(f"{args.pcap}: no conversation has an endpoint matching {want}")
    summary = (f"judged {judged} of {frames} frames of the replayed sides: {identical} "
               f"identical, {ndiff} different, {frames - judged} not judged")
    if not args.json:  # (--json: each side's object has its counts)
        verdict = (f"{different} of the replayed sides different" if different else
                   "every replayed side identical where judged" if frames > judged else
                   "every replayed side identical")
        if failed:
            verdict += f"; {failed} side(s) could not be replayed"
        sides_note = f" ({refused_sides} side(s) not replayed)" if refused_sides else ""
        out.write(f"{verdict}; {refused} conversation(s) not replayed{sides_note}; "
                  f"{summary}\n")
    return 1 if different or failed else 0
