"""The CRC-32 behind the ICRC (softrdma.wire.crc): ISA-L's, the same function as zlib's.

The ICRC is the IEEE CRC-32; softrdma computes it with python-isal when installed (about
nine times zlib's speed on a 4 KiB packet). These tests hold the fast CRC to zlib's on
every input shape the stack feeds it, check real rxe packets' ICRCs through it, and check
that the zlib fallback is what runs when asked for (or when isal is missing)."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

from hypothesis import given, settings, strategies as st

from softrdma.wire import crc
from softrdma.wire.frames import decode_frame
from softrdma.wire.icrc import icrc_from_ip_packet
from softrdma.wire.pcap import read_pcap

from .conftest import RXE_PCAPS


def test_the_fast_crc_is_installed_and_chosen():
    """The project depends on isal on this platform: a CI without it would silently measure
    zlib's speed and call it ours."""
    import isal.isal_zlib
    assert crc.CRC_IMPL == "isal"
    assert crc.crc32 is isal.isal_zlib.crc32


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=9000), value=st.integers(0, 0xFFFFFFFF),
       start=st.integers(0, 64))
def test_same_value_as_zlib_on_every_shape(data, value, start):
    """bytes, bytearray and a memoryview slice (what the ICRC code passes), any running
    value (the ICRC continues from cached states)."""
    mv = memoryview(bytearray(data))[min(start, len(data)):]
    want = zlib.crc32(mv, value)
    assert crc.crc32(mv, value) == want
    assert crc.crc32(bytes(mv), value) == want
    assert crc.crc32(data) == zlib.crc32(data)


def test_real_rxe_icrcs_through_the_fast_crc():
    """Every RoCE frame of a real rxe capture has the ICRC softrdma computes with it."""
    n = 0
    for path in RXE_PCAPS[:6]:
        for rec in read_pcap(path):
            f = decode_frame(rec.data, rec.linktype)
            if f is None or not f.is_roce:
                continue
            assert icrc_from_ip_packet(f.ip_packet) == f.icrc(), (path, rec.index)
            n += 1
    assert n > 100


def test_zlib_fallback_when_asked():
    """``SOFTRDMA_CRC=zlib`` runs the stdlib's CRC (the benchmark's comparison, and what a
    platform without isal gets); the ICRCs stay the same."""
    code = ("from softrdma.wire import crc, icrc; import zlib; "
            "assert crc.CRC_IMPL == 'zlib' and crc.crc32 is zlib.crc32; "
            "print(icrc.icrc_ipv4(bytes(64), b'\\x7f\\0\\0\\1', b'\\x7f\\0\\0\\2', 49152))")
    env = {**os.environ, "SOFTRDMA_CRC": "zlib"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    from softrdma.wire.icrc import icrc_ipv4
    assert int(out) == icrc_ipv4(bytes(64), b"\x7f\0\0\1", b"\x7f\0\0\2", 49152)


def test_zlib_fallback_without_isal(tmp_path):
    """With isal not importable, zlib is chosen without a word."""
    (tmp_path / "isal").mkdir()
    (tmp_path / "isal" / "__init__.py").write_text("raise ImportError('no isal here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd(),
                                                         os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", "from softrdma.wire import crc; "
                          "print(crc.CRC_IMPL)"], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "zlib" and out.stderr == ""
