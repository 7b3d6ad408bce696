"""softrdma's pytest plugin (softrdma/pytest_plugin.py), used as a user uses it: test files
written into a fresh directory and run by pytest (pytest's own ``pytester``; in a subprocess
but for the lab checks, which fake the prerequisite check in this process),
with the plugin loaded through the installed ``pytest11`` entry point and nothing else."""

from __future__ import annotations

from softrdma.harness import lab as labmod
from softrdma.wire.frames import decode_frame
from softrdma.wire.packet import parse
from softrdma.wire.pcap import read_pcap

from . import pcap_mutate as m
from .conftest import PCAPS

pytest_plugins = ["pytester"]

SERVER = "10.77.0.11"  # rc_pingpong.pcap's server (the client is 10.77.0.12)


def roce_frames(path) -> list:
    frames = [decode_frame(r.data, r.linktype) for r in read_pcap(path)]
    return [f for f in frames if f is not None and f.is_roce]


def test_loading_the_plugin_imports_nothing_of_the_stack(pytester):
    pytester.makepyfile("""
        import sys

        def test_loaded_and_light(pytestconfig):
            assert pytestconfig.pluginmanager.has_plugin("softrdma")
            assert "softrdma.pytest_plugin" in sys.modules
            heavy = [m for m in sys.modules if m.startswith(("softrdma.soft", "softrdma.verbs_api",
                                                           "softrdma.harness", "softrdma.qp"))]
            assert heavy == []
    """)
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["softrdma: seed 0 (--softrdma-seed N to change)"])


USER_TESTS = """
    import pytest
    from softrdma.enums import IBV_WC_SUCCESS, IBV_WR_RDMA_WRITE, IBV_WR_SEND
    from softrdma.verbs_api import Context

    @pytest.mark.parametrize("transport", ["sim", "udp"])
    @pytest.mark.parametrize("qp_type", ["RC", "UC", "UD"])
    def test_send(qp_pair, qp_type, transport):
        pair = qp_pair(qp_type, transport=transport)
        a, b = pair
        assert pair.transport == transport and (pair.net is not None) == (transport == "sim")
        a.mr.write(b"hello", 5)
        b.post_recv(b.buf_sge(0, 4096), wr_id=1)
        a.post_send(IBV_WR_SEND, a.buf_sge(0, 5), wr_id=2)
        assert pair.run_until(lambda: a.ncomp() == 1 and b.ncomp() == 1, timeout=5)
        (wc,) = b.cq.poll_all()
        assert (wc.status, wc.wr_id, wc.byte_len) == (IBV_WC_SUCCESS, 1, 5 + 40 * (qp_type == "UD"))
        assert b.mr.read(5, 40 * (qp_type == "UD")) == b"hello"

    def test_run_until_times_out_on_both_transports(qp_pair):
        for transport in ("sim", "udp"):
            pair = qp_pair("RC", transport=transport)
            assert pair.run_until(lambda: pair.a.ncomp(), timeout=0.05) is False

    def test_lossy_network(sim_network, qp_pair):
        net = sim_network(loss=0.1, reorder=0.1, duplicate=0.05)
        pair = qp_pair("RC", net=net)
        a, b = pair
        for i in range(10):
            a.post_send(IBV_WR_RDMA_WRITE, a.buf_sge(0, 4096), wr_id=i, remote_offset=0)
        assert pair.run_until(lambda: a.ncomp() == 10, timeout=30)
        assert all(w.status == IBV_WC_SUCCESS for w in a.cq.poll_all())
        assert net.stats["lost"] > 0 and net.stats["reordered"] > 0

    def test_link_settings_straight_to_the_pair(qp_pair):
        pair = qp_pair("RC", corrupt=0.2)
        a, b = pair
        a.post_send(IBV_WR_RDMA_WRITE, a.buf_sge(0, 8192), wr_id=1, remote_offset=0)
        assert pair.run_until(lambda: a.ncomp() == 1, timeout=30)
        assert pair.net.stats["corrupted"] > 0

    def test_soft_device(soft_device):
        assert soft_device.ip.startswith("127.") and soft_device.udp is not None
        with Context(name=soft_device.name) as ctx:
            assert ctx.device is soft_device

    def test_replay_of_a_real_capture(softrdma_replay):
        diff = softrdma_replay.assert_matches("rc_pingpong.pcap", "10.77.0.11")
        assert diff.ok and diff.n_sent == 33

    def test_zz_every_device_is_gone():
        from softrdma.verbs_api.device import soft_devices
        assert [d.name for d in soft_devices()] == ["softrdma0"]
"""


def test_every_fixture_works_in_a_users_test_file(pytester):
    (pytester.path / "rc_pingpong.pcap").symlink_to(PCAPS / "rc_pingpong.pcap")
    pytester.makepyfile(test_user=USER_TESTS)
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    r.assert_outcomes(passed=12)


def test_a_replay_that_differs_fails_with_a_field_by_field_diff(pytester, tmp_path):
    recs = m.edit(m.load(PCAPS / "rc_pingpong.pcap"), 6, psn=13095500)  # the server's 1st ACK
    (pytester.path / "mutated.pcap").write_bytes(m.to_bytes(recs))
    pytester.makepyfile(f"""
        def test_server(softrdma_replay):
            softrdma_replay.assert_matches("mutated.pcap", "{SERVER}")
    """)
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([
        "E * softrdma as 10.77.0.11 in mutated.pcap: 1 packet(s) differ*",
        "E * response 0, frame 6 (RC_ACKNOWLEDGE): 2 fields differ",
        "E * capture : 6 10.77.0.11:49441 > 10.77.0.12 RC_ACKNOWLEDGE * psn=13095500 *",
        "E * softrdma: 6 10.77.0.11:49441 > 10.77.0.12 RC_ACKNOWLEDGE * psn=13095501 *",
        "E *   opcode: RC_ACKNOWLEDGE (0x11)",
        "E *   dest_qp: 0x000011",
        "E * ! psn: expected 13095500, got 13095501",
        "E *   syndrome: 0x1f",
        "E *   msn: 1",
        "E * ! icrc: expected 0x*, got 0x*",
    ])
    assert "! msn" not in r.stdout.str() and "! dest_qp" not in r.stdout.str()


SEEDED = """
    import pytest
    from softrdma.enums import IBV_WR_RDMA_WRITE

    def test_lossy(sim_network, qp_pair, softrdma_seed):
        net = sim_network(loss=0.2)
        pair = qp_pair("RC", net=net)
        for i in range(8):
            pair.a.post_send(IBV_WR_RDMA_WRITE, pair.a.buf_sge(0, 4096), wr_id=i, remote_offset=0)
        assert pair.run_until(lambda: pair.a.ncomp() == 8, timeout=60)
        print(f"RUN seed={softrdma_seed} stats={sorted(net.stats.items())} "
              f"rkey={pair.b.mr.rkey:#x} now={net.now!r}")

    @pytest.mark.softrdma_seed(42)
    def test_marker(softrdma_seed):
        assert softrdma_seed == 42

    @pytest.mark.softrdma_seed(43)
    def test_marker_fails(softrdma_seed):
        assert softrdma_seed == -1

    def test_fails(qp_pair):
        qp_pair("RC")
        assert False, "deliberately"
"""


def test_the_seed_option_changes_the_run_and_the_same_seed_repeats_it(pytester):
    pytester.makepyfile(SEEDED)

    def run(seed: int) -> str:
        r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", f"--softrdma-seed={seed}")
        r.assert_outcomes(passed=2, failed=2)
        r.stdout.fnmatch_lines([f"softrdma: seed {seed} (--softrdma-seed N to change)"])
        r.stdout.fnmatch_lines(["*- softrdma -*", "seed 43, pinned by @pytest.mark.softrdma_seed",
                                "*- softrdma -*", f"seed {seed}: rerun with --softrdma-seed {seed}"])
        (line,) = [x[x.index("RUN "):] for x in r.outlines if "RUN seed=" in x]
        return line

    one, again, other = run(1), run(1), run(2)
    assert one == again
    assert one != other
    assert "('lost', 0)" not in one and "seed=1" in one


KEEP = """
    from softrdma.enums import IBV_WR_SEND

    def exchange(pair):
        a, b = pair
        b.post_recv(b.buf_sge(0, 4096), wr_id=1)
        a.post_send(IBV_WR_SEND, a.buf_sge(0, 3000), wr_id=2)
        assert pair.run_until(lambda: a.ncomp() and b.ncomp(), timeout=5)

    def test_sim_passes(qp_pair):
        exchange(qp_pair("RC"))

    def test_sim_fails(qp_pair):
        exchange(qp_pair("RC"))
        assert False

    def test_udp_fails(qp_pair):
        exchange(qp_pair("RC", transport="udp"))
        assert False

    def test_no_softrdma_fixture_fails():
        assert False
"""


def test_keep_captures_writes_a_pcap_for_each_failed_test_only(pytester, tmp_path):
    pytester.makepyfile(test_keep=KEEP)
    out = tmp_path / "caps"
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--softrdma-keep-captures={out}")
    r.assert_outcomes(passed=1, failed=3)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["test_keep.py_test_sim_fails.pcap", "test_keep.py_test_udp_fails.pcap"]
    r.stdout.fnmatch_lines([f"capture of the test's packets: {out}/test_keep.py_test_sim_fails.pcap"])
    # a 3000-byte SEND at MTU 1024: FIRST, MIDDLE, LAST from a and b's ACK, each once
    sent = ["RC_SEND_FIRST", "RC_SEND_MIDDLE", "RC_SEND_LAST", "RC_ACKNOWLEDGE"]
    sim = roce_frames(out / "test_keep.py_test_sim_fails.pcap")
    assert [parse(bytes(f.payload)).name for f in sim] == sent
    assert len({f.src for f in sim[:3]} | {f.dst for f in sim[3:]}) == 1
    assert all(f.src.startswith("10.200.") and parse(bytes(f.payload)).icrc == f.icrc()
               for f in sim)  # as sent: ICRC good
    udp = roce_frames(out / "test_keep.py_test_udp_fails.pcap")
    names = [parse(bytes(f.payload)).name for f in udp]  # real time: a retry may be there too
    assert names[:3] == sent[:3] and "RC_ACKNOWLEDGE" in names, names
    assert all(f.src.startswith("127.") for f in udp)


def test_rxe_lab_skips_with_one_line_naming_what_is_missing(pytester, monkeypatch):
    monkeypatch.setattr(labmod, "missing_prerequisites",
                        lambda: ["qemu-system-x86_64 (qemu-system-x86)", "vng (virtme-ng (pip))"])
    pytester.makepyfile("""
        def test_one(rxe_lab):
            raise AssertionError("never runs")

        def test_two(rxe_lab):
            raise AssertionError("never runs")
    """)
    monkeypatch.delenv("CI", raising=False)
    r = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    r.assert_outcomes(skipped=2)
    r.stdout.fnmatch_lines([
        "SKIPPED [[]1[]] *: rxe_lab needs qemu-system-x86_64 (qemu-system-x86), vng (virtme-ng "
        "(pip)): install them with scripts/setup (root; see docs/lab.md, 'Prerequisites')"])

    monkeypatch.setenv("CI", "true")  # softrdma's rule: under CI a missing prerequisite fails
    r = pytester.runpytest("-p", "no:cacheprovider")
    r.assert_outcomes(errors=2)
    r.stdout.fnmatch_lines(["*CI=true and rxe_lab needs qemu-system-x86_64*"])


def test_rxe_lab_that_cannot_start_skips_with_the_labs_reason(pytester, monkeypatch):
    monkeypatch.setattr(labmod, "missing_prerequisites", lambda: [])

    def no_lab(*a, **kw):
        raise labmod.LabUnavailable("guest 0 did not boot in 240 s")

    monkeypatch.setattr(labmod, "Lab", no_lab)
    monkeypatch.delenv("CI", raising=False)
    pytester.makepyfile("def test_one(rxe_lab): pass")
    r = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    r.assert_outcomes(skipped=1)
    r.stdout.fnmatch_lines(["*rxe_lab did not start: guest 0 did not boot in 240 s"])


def test_a_replay_diff_names_missing_and_extra_packets_and_stops_at_the_limit(tmp_path):
    """Without pytester: the Replay helper behind the fixture, on a capture that lacks the
    server's first two ACKs (frames 6 and 15): softrdma's ACKs are aligned with the
    capture's by PSN, so the rest pair with their own and the two softrdma sent that the
    capture lacks are the only differences."""
    from softrdma.harness.fixtures import Replay
    from softrdma.harness.replaydiff import ReplayMismatch

    path = tmp_path / "no-first-acks.pcap"
    path.write_bytes(m.to_bytes(m.drop(m.drop(m.load(PCAPS / "rc_pingpong.pcap"), 15), 6)))
    d = Replay().run(path, SERVER)
    assert (d.ok, d.n_expected, d.n_sent) == (False, 31, 33)
    assert [(p.kind, p.frame, p.expected_line) for p in d.packets] == [
        ("response", None, None)] * 2
    assert (d.judged, d.identical) == (31, 31)  # every captured packet has its partner
    text = d.format(limit=1)
    assert "response 0: softrdma sent one more response than the capture has" in text
    assert "psn=13095501" in text and "msn=1" in text  # softrdma's first ACK, dissected
    assert text.endswith("... and 1 more")
    try:
        Replay().assert_matches(path, SERVER, limit=1)
    except ReplayMismatch as e:
        assert e.diff.packets == d.packets and str(e) == d.format(limit=1)
    else:
        raise AssertionError("no ReplayMismatch")
    assert Replay().assert_matches(PCAPS / "rc_pingpong.pcap", "10.77.0.12").ok
