"""The fuzzer's mutator tables (softrdma/tools/fuzz/mutators.py) and its frame maker, without
live devices: each named mutator does what its name says, the tables are well formed, and
a seed makes the same frames as the fuzzer made before it was split into tables."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any, Callable

import pytest

from softrdma.qp.psn import psn_diff
from softrdma.tools.fuzz import FuzzConfig, Fuzzer, default_pcap_dir, load_seeds
from softrdma.tools.fuzz import mutators as M
from softrdma.wire.icrc import icrc_ipv4
from softrdma.wire.opcodes import Opcode
from softrdma.wire.packet import build, parse

N = 300  # draws per mutator
SRC, DST, SPORT = bytes([127, 0, 10, 2]), bytes([127, 0, 10, 1]), 0xC123


def _frame() -> bytearray:
    return build(Opcode.RC_RDMA_WRITE_ONLY, dest_qp=0x123, psn=77, va=0x1000, rkey=0xABCD12,
                 dma_len=40, payload=bytes(range(40)))


def _bits(a: bytes, b: bytes) -> int:
    return sum(bin(x ^ y).count("1") for x, y in zip(a, b))


def _icrc(data: bytes, sport: int) -> bytes:
    return icrc_ipv4(data, SRC, DST, sport).to_bytes(4, "little")


# one check per mutator: it is given a seeded rng and returns nothing, or fails
def _opcode_swap(r: random.Random) -> None:
    assert M.opcode_swap(r) in M.ALL_OPS


def _qpn_other(r: random.Random) -> None:
    f: dict[str, Any] = {}
    M.qpn_other(r, f, 0x500)
    assert f["dest_qp"] != 0x4FF and 0 <= f["dest_qp"] < 1 << 24 and 0 <= f["psn"] < 1 << 24


def _psn(name: str, ok: Callable[[int], bool]) -> Callable[[random.Random], None]:
    def check(r: random.Random) -> None:
        base = r.randrange(1 << 24)
        psn = M.PSN[name].apply(r, lambda: base)  # type: ignore[misc]
        assert 0 <= psn < 1 << 24 and ok(psn_diff(psn, base)), (name, base, psn)
    return check


def _reth_random(r: random.Random) -> None:
    va, rkey, n = M.reth_random(r, 40)
    assert 0 <= va < 1 << 64 and 0 <= rkey < 1 << 32 and n in M.INTERESTING32 + (40,)


def _rkey_wrong_byte(r: random.Random) -> None:
    key = r.getrandbits(32)
    bad = M.rkey_wrong_byte(r, key)
    assert bad >> 8 == key >> 8 and bad & 0xFF != key & 0xFF


def _inside(r: random.Random) -> None:
    off, n = M.inside(r, 4096, 100)
    assert n == 100 and 0 <= off and off + n <= 4096


def _va_edge(r: random.Random) -> None:
    off, n = M.va_edge(r, 4096, 100)
    assert n == 100 and off in (-1, -8, -4096, 0, 3996, 3997, 4096, 4088, 8192)


def _dma_len_odd(r: random.Random) -> None:
    off, n = M.dma_len_odd(r, 4096, 100)
    assert 0 <= off < 4096 and 0 <= n < 1 << 32
    assert n in (0, 1, 4096, 4097, 1 << 31, 0xFFFFFFFF, 101, 99) or n > 4097


def _fields(fn: Callable[..., None], ok: Callable[[dict], bool]) -> Callable[[random.Random], None]:
    """A field mutator changes only its own fields, and a packet built from them carries
    the damage (it is not lost in the rebuild)."""
    opcode, own = OWN[fn.__name__]

    def check(r: random.Random) -> None:
        f = parse(build(opcode, dest_qp=0x123, psn=77, va=0x1000, rkey=0xABCD12, dma_len=8,
                        syndrome=0x1F, msn=5)).fields()
        before = dict(f)
        fn(r, f)
        changed = {k for k in f if f[k] != before.get(k)}
        assert ok(f) and changed <= set(own), (fn.__name__, changed)
        f.pop("opcode"), f.pop("pad", None)
        for k in [k for k, v in f.items() if v is None]:
            f.pop(k)
        got = parse(build(opcode, **f))
        for k in own:
            assert int(getattr(got, k)) == int(f[k]), (fn.__name__, k)
    return check


OWN = {"atomic_operands": (Opcode.RC_COMPARE_SWAP, ("swap_add", "compare")),
       "aeth": (Opcode.RC_ACKNOWLEDGE, ("syndrome", "msn")),
       "pkey": (Opcode.RC_SEND_ONLY, ("pkey",)), "tver": (Opcode.RC_SEND_ONLY, ("tver",)),
       "bth_bits": (Opcode.RC_SEND_ONLY, ("se", "migreq", "ackreq", "fecn", "becn", "resv6",
                                          "resv7"))}


def _size(r: random.Random) -> None:
    out = M.size(r, b"abc")
    assert len(out) in (0, 1, 3, 7, 8, 1023, 1024, 1025, 4096, 4097, 2048) or len(out) < 9000
    assert out == (b"abc" * 3000)[:len(out)]


def _pad(r: random.Random) -> None:
    assert M.pad(r) in range(4)


def _bytes(name: str, ok: Callable[[bytes, bytes], bool]) -> Callable[[random.Random], None]:
    def check(r: random.Random) -> None:
        before = bytes(_frame())
        data = bytearray(before)
        M.BYTES[name].apply(r, data)  # type: ignore[misc]
        assert ok(before, bytes(data)), (name, before.hex(), data.hex())
    return check


def _diff_at(a: bytes, b: bytes) -> set[int]:
    return {i for i, (x, y) in enumerate(zip(a, b)) if x != y}


def _icrc_check(name: str, ok: Callable[[bytes, bytes], bool]) -> Callable[[random.Random], None]:
    def check(r: random.Random) -> None:
        data = _frame()
        data[-4:] = _icrc(data, SPORT) if name == "icrc_flipped" else bytes(4)
        before = bytes(data)
        M.ICRC[name].apply(r, data, SRC, DST, SPORT)  # type: ignore[misc]
        assert ok(before, bytes(data)), name
    return check


def _post_icrc_flip(r: random.Random) -> None:
    data = _frame()
    data[-4:] = _icrc(data, SPORT)
    before = bytes(data)
    M.post_icrc_flip(r, data)
    assert _bits(before, data) == 1 and len(data) == len(before)


CHECKS: dict[str, Callable[[random.Random], None]] = {
    "opcode_swap": _opcode_swap,
    "qpn_other": _qpn_other,
    "psn_exact": _psn("psn_exact", lambda d: d == 0),
    "psn_near": _psn("psn_near", lambda d: -8 <= d <= 8),
    "psn_far": _psn("psn_far", lambda d: abs(d) in (1 << 23, (1 << 23) - 1, 1 << 22, 4096)),
    "psn_random": _psn("psn_random", lambda d: True),
    "reth_random": _reth_random,
    "rkey_wrong_byte": _rkey_wrong_byte,
    "inside": _inside,
    "va_edge": _va_edge,
    "dma_len_odd": _dma_len_odd,
    "atomic_operands": _fields(M.atomic_operands, lambda f: f["swap_add"] < 1 << 64),
    "aeth": _fields(M.aeth, lambda f: 0 <= f["syndrome"] < 256 and 0 <= f["msn"] < 1 << 24),
    "pkey": _fields(M.pkey, lambda f: 0 <= f["pkey"] < 1 << 16),
    "tver": _fields(M.tver, lambda f: 1 <= f["tver"] < 16),
    "bth_bits": _fields(M.bth_bits, lambda f: f["resv6"] < 64 and f["resv7"] < 128),
    "size": _size,
    "pad": _pad,
    "bit_flip": _bytes("bit_flip", lambda a, b: len(a) == len(b) and _bits(a, b) == 1),
    "byte_set": _bytes("byte_set", lambda a, b: len(a) == len(b) and len(_diff_at(a, b)) <= 1),
    # (the random cut point may be the frame's end: a prefix, maybe the whole frame)
    "truncate": _bytes("truncate", lambda a, b: len(b) <= len(a) and a.startswith(b)),
    "extend": _bytes("extend", lambda a, b: len(b) > len(a) and b.startswith(a)),
    "header_byte": _bytes("header_byte", lambda a, b: len(a) == len(b)
                          and _diff_at(a, b) <= set(range(48))),
    "opcode_byte": _bytes("opcode_byte", lambda a, b: len(a) == len(b) and _diff_at(a, b) <= {0}),
    "delete_insert": _bytes("delete_insert", lambda a, b: 1 <= abs(len(a) - len(b)) <= 8),
    "icrc_right": _icrc_check("icrc_right", lambda a, b: b[-4:] == _icrc(b, SPORT)),
    "icrc_wrong_port": _icrc_check("icrc_wrong_port", lambda a, b: b[-4:] == _icrc(b, SPORT + 1)
                                   and b[-4:] != _icrc(b, SPORT)),
    "icrc_flipped": _icrc_check("icrc_flipped", lambda a, b: _bits(a, b) == 1
                                and _diff_at(a, b) <= set(range(len(a) - 4, len(a)))),
    "post_icrc_flip": _post_icrc_flip,
}


def _mutators() -> list[M.Mutator]:
    return [m for t in M.TABLES for m in t if m.apply is not None]


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_each_mutator_does_what_its_name_says(name):
    r = random.Random(name)
    for _ in range(N):
        CHECKS[name](r)


def test_every_mutator_is_checked_named_once_and_says_what_it_attacks():
    names = [m.name for t in M.TABLES for m in t]
    assert len(names) == len(set(names))
    assert {m.name for m in _mutators()} == set(CHECKS)
    for m in _mutators():
        assert m.attacks, m.name  # a docstring naming what it attacks (or why it is no attack)


def test_the_tables_are_distributions():
    for t in M.TABLES:
        if t is M.BYTES:  # integer weights, one drawn per damage step
            assert all(isinstance(m.weight, int) and m.weight > 0 for m in t)
            continue
        assert 0 < t.thresholds[-1] <= 1 and all(m.weight > 0 for m in t), t.name
    # a table that always picks one entry covers [0, 1)
    for t in (M.QPN, M.PSN, M.RETH, M.RANGE, M.ICRC):
        assert t.thresholds[-1] == 1.0, t.name
    assert M.PSN.thresholds == [0.45, 0.8, 0.9, 1.0]


def test_a_draw_lands_where_the_weights_say():
    r = random.Random(1)
    seen: dict[str, int] = {}
    for _ in range(20000):
        m = M.BTH.choose(r)
        k = m.name if m else "none"
        seen[k] = seen.get(k, 0) + 1
    for name, p in (("pkey", 0.05), ("tver", 0.03), ("bth_bits", 0.06), ("none", 0.86)):
        assert abs(seen[name] / 20000 - p) < 0.01, (name, seen)


# -- the frame maker, with fake targets in place of live devices -------------------------------
class _Sock:
    def __init__(self, port: int) -> None:
        self.port = port

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def _fake_fuzzer(seed: int) -> Fuzzer:
    fz = Fuzzer(FuzzConfig(seed=seed, addrs=("127.0.10.1", "127.0.10.2")))
    for k in range(2):
        mrs = {n: NS(rkey=0x1000 * (k + 1) + i, buf=0x7F0000000000 + (k << 24) + i * 0x100000,
                     length=(64 << 10) if n in ("rw", "sink") else (16 << 10))
               for i, n in enumerate(("rw", "recv", "sink", "ro", "local", "none", "otherpd"))}
        fz.sides.append(NS(mrs=mrs))
    for i, kind in enumerate(("RC", "UC", "UD", "SRQ")):
        ends = [NS(qpn=0x100 + 16 * i + k, kind=kind, side=fz.sides[k],
                   psns=(lambda a=1000 * i + k, b=2000 * i + k, c=3000 * i + k + 5: (a, b, c)))
                for k in range(2)]
        fz.pairs.append(NS(kind=kind, a=ends[0], b=ends[1], ends=tuple(ends)))
    for i in range(2):
        for j in range(2):
            fz.socks.append((_Sock(40000 + 2 * i + j), bytes([127, 0, 10, 1 + i]), True, 1 - i))
    for last in (3, 1):
        for t in (0, 1):
            fz.socks.append((_Sock(41000 + t + last), bytes([127, 0, 10 if last == 3 else 0,
                                                             last]), False, t))
    return fz


def test_a_seed_makes_the_frames_the_fuzzer_made_before_its_tables(tmp_path):
    """2,000 frames of seed 3 against fixed fake targets hash to what the fuzzer made before
    it was split into mutator tables (tools/fuzz.py of commit 6c62922): the tables draw the
    same numbers in the same order. Changing a weight or a mutator changes the hash. The
    seeds are the captures of that time (pcaps/ without the later linux-rxe/lossy/)."""
    root = Path(default_pcap_dir())
    for f in root.rglob("*.pcap"):
        rel = f.relative_to(root)
        if rel.parts[:2] == ("linux-rxe", "lossy"):
            continue
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).symlink_to(f)
    seeds, _ = load_seeds(str(tmp_path))
    by_op: dict[int, list[bytes]] = {}
    for s in seeds:
        by_op.setdefault(s[0], []).append(s)
    fz = _fake_fuzzer(3)
    h = hashlib.sha256()
    for _ in range(2000):
        data, sock_i, e = fz.frames.make(by_op, sorted(by_op))
        h.update(data + bytes([sock_i]) + str(e.qpn).encode())
    assert h.hexdigest() == GOLDEN, h.hexdigest()


GOLDEN = "3370060008038ab4291fcd73ac96fdb19fddfebc6a18627a5ce4df299435d6fc"
