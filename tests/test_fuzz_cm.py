"""``softrdma fuzz --target cm`` and ``--target records``: mutated CM MADs on QP1 and
forged socket-layer hellos and records against live devices on loopback, with the data
path's survival checks and their own. A short run of each must pass the checks that
guard what they fuzz; a planted bug (a CM handler that raises, a record parser that
raises something other than ProtocolError) must make the run fail and say which check,
so the checks are known to be able to fail.

Every check is required: the leaks the fuzzers found (a REQ rdma_cm refused left
its CM id, a hello the socket layer refused left its QP and slots; issue 26) are fixed."""

from __future__ import annotations

import io
import os
import random
import re
import subprocess
import sys

from softrdma.cm.mad import MAD_SIZE, AttrId, MadHeader
from softrdma.cm.messages import MESSAGES, REQ, build_cm, parse_cm
from softrdma.cm.state import CmAgent
from softrdma.socket import record as socket_record
from softrdma.tools.fuzz import cm as C
from softrdma.tools.fuzz import default_pcap_dir
from softrdma.tools.fuzz import records as R
from softrdma.tools.fuzz.cmtarget import run_cm
from softrdma.tools.fuzz.fuzzer import FuzzConfig
from softrdma.tools.fuzz.rectarget import run_records
from softrdma.tools.fuzz.stats import Stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fuzz(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "softrdma", "fuzz", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _checks(out: str) -> dict[str, bool]:
    return {m.group(2): m.group(1) == "ok  " for m in
            re.finditer(r"^  (ok  |FAIL) (.+?)(?: \(.*)?$", out, re.M)}


# -- the mutators -------------------------------------------------------------------------

def test_cm_seeds_cover_every_message():
    """The seeds hold every CM message rdma_cm exchanges (Linux's from the captures, MRA
    and REJ built), so every handler of the CM is reached."""
    seeds, files = C.load_cm_seeds(default_pcap_dir())
    assert files >= 2
    assert {s.name for s in seeds} == {m.name for m in MESSAGES.values()}


def _live() -> C.LiveCm:
    ids = [C.LiveId(0x1111, 0x2222, 0x33, 0x44, "ESTABLISHED")]
    rc, ud = C.cm_service_ids(7471)
    return C.LiveCm(lambda: ids, rc, ud, "127.0.0.1", "127.0.0.2", 0xABC)


def test_cm_mutators_do_what_they_say():
    """Each CM mutator changes what its name says: aimed at the live id's comm IDs, the
    forger's timeouts at 0/31 with 15 retries, another attribute ID, a MAD that is not
    256 bytes."""
    r = random.Random(5)
    f: dict = {}
    C.aim_live(r, MESSAGES[AttrId.DREQ], f, _live())
    assert (f["local_comm_id"], f["remote_comm_id"], f["remote_qpn"]) == (0x2222, 0x1111, 0x33)
    f = {}
    C.cm_timeouts(r, REQ, f, _live())
    assert f["max_cm_retries"] == 15
    assert {f["local_cm_response_timeout"], f["remote_cm_response_timeout"]} <= {0, 31}
    seen = set()
    for _ in range(200):
        h = MadHeader(1, 7, 2, 3, 0, 0, 1, AttrId.RTU, 0).as_dict()
        C.attr_other(r, h)
        seen.add(h["attr_id"])
    assert {AttrId.LAP, AttrId.APR, 0, AttrId.REQ} <= seen
    mad = build_cm(REQ)
    assert all(len(C.mad_size(r, mad)) != MAD_SIZE for _ in range(50))


def test_mad_maker_is_deterministic_and_reaches_every_stage():
    """A seed fixes the frames (against fixed live state), and a few thousand frames use
    every table's mutators."""
    seeds, _ = C.load_cm_seeds(default_pcap_dir())

    def frames(seed: int) -> tuple[list[bytes], Stats]:
        st = Stats()
        mk = C.MadMaker(random.Random(seed), st, seeds, [_live(), _live()])
        return [mk.make(i % 2)[0] for i in range(3000)], st

    a, st = frames(11)
    assert a == frames(11)[0] and a != frames(12)[0]
    for t in C.CM_TABLES:
        for m in t:
            if m.attack:
                assert st.mutations.get(m.name, 0) > 0, m.name
    # most frames still are CM MADs a device parses: the deep paths are reached
    ok = 0
    for fr in a:
        try:
            parse_cm(fr[20:20 + MAD_SIZE])  # BTH 12 + DETH 8, then the MAD
            ok += 1
        except ValueError:
            pass
    assert ok > len(a) // 2


def test_record_mutators_do_what_they_say():
    """The hello mutators give hellos the socket layer refuses (or a correct one), and the
    record maker's correct records parse as what it says."""
    r = random.Random(3)
    for fn in (R.hello_magic, R.hello_short):
        for _ in range(20):
            try:
                socket_record.Hello.unpack(fn(r))
                raise AssertionError(f"{fn.__name__} made an acceptable hello")
            except socket_record.ProtocolError:
                pass
    mk = R.RecordMaker(r, Stats())
    due = R.Due(seq=5, inline_max=1024, max_message=1 << 20, rkey=0x77, addr=0x1000,
                mr_len=4096, out=[1])
    correct = 0
    for _ in range(300):
        data, t, ok = mk.make(due, 1056)
        if ok:
            correct += 1
            rec = socket_record.Record.unpack(data)
            assert rec.type == t
            if t in (socket_record.RecordType.NORMAL, socket_record.RecordType.INLINE):
                assert rec.seq == 5
    assert 100 < correct < 300


# -- live runs ----------------------------------------------------------------------------

def test_fuzz_cm_short_run_survives():
    """Mutated REQ/REP/RTU/DREQ/... at devices with a listener and an established
    connection: the devices catch no exception, the progress threads live, no rdma_cm
    event is left unread, the established connection (or its replacement) moves data and
    a fresh connection is made in bounded time."""
    r = _fuzz("--target", "cm", "--seconds", "4", "--seed", "7", "--addrs", "127.0.41.1",
              "127.0.41.2")
    out = r.stdout
    checks = _checks(out)
    m = re.search(r"sent: (\d+) CM MADs", out)
    # (about 1,500 a second on 2 shared cores; the bounds allow for a loaded machine)
    assert m and int(m.group(1)) > 400, out + r.stderr
    for dev in ("127.0.41.1", "127.0.41.2"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"softrdma-fuzz-{dev}:"))
        # the MADs reached the CM, and QP1's and the MAD layer's checks
        assert int(re.search(r"MADs received (\d+)", line).group(1)) > 100, line
        assert "gsi_" in line, line
    assert "gsi_mad_size" in out and "gsi_qkey" in out and "gsi_mad_method" in out, out
    for name in ("progress threads alive", "no exception in any thread", "threads flat",
                 "descriptors bounded", "RSS flat", "no exception caught by a device",
                 "no rdma_cm event left unread", "established connection moves data",
                 "a fresh connection works"):
        assert checks.get(name) is True, (name, out)
    assert "CM ids bounded" in checks, out
    assert all(checks.values()), out


def test_fuzz_records_short_run_survives():
    """Forged hellos and records at a Receiver: it keeps serving the legitimate sender
    (every message, in order), every forged connection it drops ends with a clear error,
    it serves none of them after, recv raises nothing unexpected, and a fresh sender is
    heard; a client given a damaged hello in the REP connects or is refused cleanly."""
    r = _fuzz("--target", "records", "--seconds", "4", "--seed", "7", "--addrs",
              "127.0.41.5", "127.0.41.6")
    out = r.stdout
    checks = _checks(out)
    m = re.search(r"sent: (\d+) records", out)
    assert m and int(m.group(1)) > 60, out + r.stderr
    assert re.search(r"ended: .*ProtocolError \d+", out), out
    for name in ("progress threads alive", "no exception in any thread", "threads flat",
                 "descriptors bounded", "RSS flat", "no exception caught by a device",
                 "Receiver.recv raised only TimeoutError",
                 "broken connections end with a clear error",
                 "a client refuses a bad REP hello clearly",
                 "the legitimate sender is heard", "a fresh sender is heard"):
        assert checks.get(name) is True, (name, out)
    assert re.search(r"Receiver connections bounded \(1 served and \d+ held", out), out
    assert all(checks.values()), out


def test_fuzz_cm_catches_a_planted_bug(monkeypatch):
    """A CM handler that raises (the MAD layer catches it and counts it) makes the run
    fail with the check that names the counter."""
    def broken(self, msg, src, now):
        raise RuntimeError("planted")
    monkeypatch.setattr(CmAgent, "_on_dreq", broken)
    out = io.StringIO()
    rc = run_cm(FuzzConfig(seed=2, count=1500, addrs=("127.0.41.9", "127.0.41.10"),
                           target="cm"), out)
    assert rc == 1
    checks = _checks(out.getvalue())
    assert checks["no exception caught by a device"] is False, out.getvalue()
    assert re.search(r"FAIL no exception caught by a device \(.*gsi_handler_errors \+\d+",
                     out.getvalue()), out.getvalue()


def test_fuzz_records_catches_a_planted_bug(monkeypatch):
    """A record parser that raises KeyError (not ProtocolError) for an unknown type
    escapes the Receiver's recv: the run fails and says so."""
    orig = socket_record.Record.unpack.__func__

    def unpack(cls, buf, offset=0):
        if len(buf) > offset and buf[offset] not in set(socket_record.RecordType):
            raise KeyError(buf[offset])
        return orig(cls, buf, offset)
    monkeypatch.setattr(socket_record.Record, "unpack", classmethod(unpack))
    out = io.StringIO()
    rc = run_records(FuzzConfig(seed=2, count=600, addrs=("127.0.41.13", "127.0.41.14"),
                                target="records"), out)
    assert rc == 1
    checks = _checks(out.getvalue())
    assert checks["Receiver.recv raised only TimeoutError"] is False, out.getvalue()
    assert "KeyError" in out.getvalue()


def test_fuzz_target_options_one_line():
    """A data-path-only option with another target is refused in one line."""
    r = _fuzz("--target", "cm", "--self-test", "sentinel", "--seconds", "1")
    assert r.returncode == 1
    assert r.stderr.strip().startswith("softrdma fuzz: --target cm has only --self-test leak")
