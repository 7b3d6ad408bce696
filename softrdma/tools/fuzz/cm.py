"""The ``cm`` target's seeds and mutators: CM MADs on QP1, aimed at live CM ids and damaged
field by field.

Seeds are every CM MAD in the captures under ``pcaps/`` (Linux rxe's REQ, REP, RTU, DREQ,
DREP, SIDR_REQ and SIDR_REP from ucmatose, rping and udaddy), plus the MRA and REJ
variants the captures lack, built with :mod:`softrdma.cm.messages`. :meth:`MadMaker.make`
decodes a seed into its MAD header, its fields (by the ``attr`` names of its
:class:`~softrdma.cm.layout.Layout`) and its private data, and rebuilds it after these
stages, each a draw from one table (named in brackets, the names the summary counts):

1. aimed [CM_AIM]: at a live CM id of the target device most of the time (its comm IDs
   swapped into the message's, its QPN in a DREQ, its local ID as a SIDR_REP's request
   ID; a REQ or SIDR_REQ at a live listener's service ID with a cma header naming the
   target), or with random IDs;
2. fields [CM_FIELD], one to three: a field of the message's layout set to a boundary
   value (0, 1, the largest, the top bit, random; a live comm ID or QPN);
3. timeouts [CM_TIMEOUTS] (REQ, REP, MRA): the CM response timeouts and the ACK timeout
   at 0 or 31, ``max_cm_retries`` 15, a service timeout of 31: what a forger chooses to
   make a retransmission timer long;
4. private data [CM_PRIVATE]: empty, random, all ones; in a REQ or SIDR_REQ the cma
   header broken (version, IP version, addresses, port) or the socket layer's hello
   behind it damaged;
5. the MAD header [CM_HEADER]: another attribute ID (another message's, LAP/APR,
   unknown), method, class and base versions, TID, attribute modifier, status;
6. the MAD's size [CM_SIZE]: truncated or extended (not 256 bytes);
7. the QP1 packet [QP1]: P_Key, Q_Key, source QP, opcode; then byte-level damage
   (:data:`~.mutators.BYTES`, [BYTES]) now and then; the ICRC as the data path does it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from ipaddress import IPv4Address
from typing import Any, Callable

from ...cm.cma import CMA_HDR_SIZE, CmaHeader, PortSpace, service_id
from ...cm.mad import AttrId, MadError, MadHeader, Method
from ...cm.messages import (
    MESSAGES, MRA, REJ, CMMessage, MessageType, MsgResponse, RejectReason, build_cm,
    parse_cm,
)
from ...cm.qp1 import GSI_QKEY, QP1_PKEY, QP1_QPN
from ...wire.frames import FrameError, decode_frame
from ...wire.headers import PSN_MASK
from ...wire.opcodes import Opcode
from ...wire.packet import DecodeError, build, parse
from ...wire.pcap import PcapError, read_pcap
from . import mutators as M
from .mutators import Mutator, Table, boundary_values
from .records import hello_bytes
from .seeds import capture_paths
from .stats import Stats

__all__ = ["LiveCm", "LiveId", "load_cm_seeds", "MadMaker", "CM_AIM", "CM_FIELD",
           "CM_TIMEOUTS", "CM_PRIVATE", "CM_HEADER", "CM_SIZE", "QP1", "CM_TABLES",
           "cm_service_ids"]

Rng = random.Random


@dataclass(frozen=True)
class LiveId:
    """What a forger aims at: one CM id of the target device (a snapshot)."""

    local_id: int
    remote_id: int
    local_qpn: int
    remote_qpn: int
    state: str


@dataclass
class LiveCm:
    """The live CM state of one target device the maker aims at: its CM ids, the service
    IDs it listens on, its address and its peer's (the forger pretends to be the peer)."""

    ids: Callable[[], list[LiveId]]
    rc_service_id: int
    ud_service_id: int
    ip: str
    peer_ip: str
    peer_guid: int


# -- seeds ------------------------------------------------------------------------------------

def _built_seeds() -> list[bytes]:
    """MRA and REJ, which the captures lack: one of each kind rdma_cm sends or answers."""
    out = []
    for mraed in MsgResponse:
        out.append(build_cm(MRA, tid=0x1_0000_0001, local_comm_id=0x11, remote_comm_id=0x22,
                            message_mraed=mraed, service_timeout=24))
    for rejected, reason in ((MsgResponse.REQ, RejectReason.INVALID_SERVICE_ID),
                             (MsgResponse.REQ, RejectReason.CONSUMER_DEFINED),
                             (MsgResponse.REP, RejectReason.STALE_CONN),
                             (MsgResponse.REQ, RejectReason.TIMEOUT)):
        out.append(build_cm(REJ, tid=0x1_0000_0002, local_comm_id=0x33, remote_comm_id=0x44,
                            message_rejected=rejected, reason=reason,
                            reject_info_length=8, ari=bytes(range(8))))
    return out


def load_cm_seeds(root: str) -> tuple[list[CMMessage], int]:
    """Every CM MAD to QP1 in the captures under ``root`` (decoded), plus the built MRA
    and REJ; and how many capture files held at least one."""
    seeds: list[CMMessage] = []
    files = 0
    for path in capture_paths(root):
        n0 = len(seeds)
        try:
            for rec in read_pcap(path):
                try:
                    fr = decode_frame(rec.data, rec.linktype)
                    if fr is None or not fr.is_roce:
                        continue
                    pkt = parse(fr.payload)
                    if pkt.dest_qp != QP1_QPN:
                        continue
                    seeds.append(parse_cm(bytes(pkt.payload)))
                except (FrameError, DecodeError, MadError, ValueError):
                    continue
        except (OSError, PcapError):
            continue
        files += len(seeds) > n0
    seeds.extend(parse_cm(m) for m in _built_seeds())
    return seeds, files


# -- [CM_AIM] where the message is aimed ------------------------------------------------------
# a mutator of the first tables takes (r, fields, live) and changes the fields in place

def aim_live(r: Rng, mt: MessageType, f: dict[str, Any], live: LiveCm) -> None:
    """(Not an attack: the message aimed at a live id or listener, so it reaches the
    matching and the state tables, not just the parser.)"""
    ids = live.ids()
    cur = r.choice(ids) if ids else LiveId(r.getrandbits(32), r.getrandbits(32), 0, 0, "")
    name = mt.name
    if name in ("REQ", "SIDR_REQ"):
        ud = name == "SIDR_REQ"
        f["service_id"] = live.ud_service_id if ud else live.rc_service_id
        if ud:
            f["request_id"] = r.choice((r.getrandbits(32), cur.remote_id))
        else:
            f["local_comm_id"] = r.choice((r.getrandbits(32), cur.remote_id))
            f["local_ca_guid"] = live.peer_guid
            # a live QPN makes the REQ look like a stale connection (REJ 10 and a DREQ)
            f["local_qpn"] = r.choice((r.getrandbits(24), cur.remote_qpn or 1))
        f["_cma"] = CmaHeader(IPv4Address(live.peer_ip), IPv4Address(live.ip),
                              r.randrange(1024, 65536)).pack()
        return
    if name == "SIDR_REP":
        f["request_id"] = cur.local_id
        return
    f["local_comm_id"] = cur.remote_id if name != "REP" or r.random() < 0.5 else \
        r.getrandbits(32)
    f["remote_comm_id"] = cur.local_id
    if name == "DREQ":
        f["remote_qpn"] = cur.local_qpn
    if name == "REP":
        f["local_ca_guid"] = live.peer_guid


def aim_random(r: Rng, mt: MessageType, f: dict[str, Any], live: LiveCm) -> None:
    """Matching by comm ID: IDs no id has (random, 0, all ones)."""
    for k in ("local_comm_id", "remote_comm_id", "request_id"):
        if k in mt.attrs:
            f[k] = r.choice((0, 0xFFFFFFFF, r.getrandbits(32)))


CM_AIM = Table("CM_AIM", Mutator("aim_live", 0.8, aim_live, attack=False),
               Mutator("aim_random", 0.2, aim_random))


# -- [CM_FIELD] one field at a boundary --------------------------------------------------------

def cm_field(r: Rng, mt: MessageType, f: dict[str, Any], live: LiveCm) -> None:
    """Every field of the message's layout: one set to a boundary value (or, for a comm
    ID or QPN field, a live id's)."""
    attr = r.choice(mt.attrs)
    bits = mt.layout.field(attr).bits
    v: int | bytes = boundary_values(r, bits)
    ids = live.ids()
    if ids and r.random() < 0.25 and ("comm_id" in attr or "qpn" in attr):
        cur = r.choice(ids)
        v = r.choice((cur.local_id, cur.remote_id)) if "comm_id" in attr else \
            r.choice((cur.local_qpn, cur.remote_qpn)) & 0xFFFFFF
    f[attr] = v


CM_FIELD = Table("CM_FIELD", Mutator("cm_field", 0.7, cm_field))
FIELD_STEPS = (1, 1, 2, 3)  # CM_FIELD is drawn this many times (one of these)


# -- [CM_TIMEOUTS] the forger's timers ------------------------------------------------------

_TIMEOUT_FIELDS = ("local_cm_response_timeout", "remote_cm_response_timeout",
                   "primary_local_ack_timeout", "alt_local_ack_timeout", "service_timeout",
                   "target_ack_delay")


def cm_timeouts(r: Rng, mt: MessageType, f: dict[str, Any], live: LiveCm) -> None:
    """The retransmission and TIMEWAIT timers a peer sets: every timeout field 0 or 31
    (4.096 us x 2^31, 2.4 h), and ``max_cm_retries`` 15, the largest."""
    for k in _TIMEOUT_FIELDS:
        if k in mt.attrs:
            f[k] = r.choice((0, 31))
    if "max_cm_retries" in mt.attrs:
        f["max_cm_retries"] = 15
    if "retry_count" in mt.attrs:
        f["retry_count"] = 7


CM_TIMEOUTS = Table("CM_TIMEOUTS", Mutator("cm_timeouts", 0.15, cm_timeouts))


# -- [CM_PRIVATE] private data ----------------------------------------------------------------
# these take (r, mt, pd, cma) and return the new private data

def pd_empty(r: Rng, mt: MessageType, pd: bytes, cma: bytes | None) -> bytes:
    """Private data readers with nothing to read: all zero (no cma header, no hello)."""
    return b""


def pd_random(r: Rng, mt: MessageType, pd: bytes, cma: bytes | None) -> bytes:
    """Private data readers: random bytes, all of it or a prefix."""
    return r.randbytes(r.randrange(mt.private_data_size + 1))


def pd_ones(r: Rng, mt: MessageType, pd: bytes, cma: bytes | None) -> bytes:
    """Length and count fields inside private data: all 0xFF."""
    return b"\xff" * mt.private_data_size


def cma_broken(r: Rng, mt: MessageType, pd: bytes, cma: bytes | None) -> bytes:
    """rdma_cm's cma header check: version, IP version (0, 6, 15), the destination not the
    target's address, the source 0.0.0.0 or multicast, port 0."""
    h = bytearray(cma or bytes(CMA_HDR_SIZE))
    what = r.randrange(5)
    if what == 0:
        h[0] = r.choice((1, 0xFF))
    elif what == 1:
        h[1] = r.choice((0x00, 0x60, 0xF0, 0x4F))
    elif what == 2:
        h[32:36] = r.choice((bytes(4), b"\xff" * 4, r.randbytes(4)))
    elif what == 3:
        h[16:20] = r.choice((bytes(4), bytes((224, 0, 0, 1))))
    else:
        h[2:4] = bytes(2)
    return bytes(h) + pd[CMA_HDR_SIZE:]


def hello_damaged(r: Rng, mt: MessageType, pd: bytes, cma: bytes | None) -> bytes:
    """The socket layer's hello behind the cma header: magic, version, features, slots
    (0, 1, 0xFFFF) and inline limit (0, 2^32-1) at their edges, or cut short."""
    return (cma or bytes(CMA_HDR_SIZE)) + hello_bytes(r)


CM_PRIVATE = Table("CM_PRIVATE",
                   Mutator("pd_empty", 0.04, pd_empty),
                   Mutator("pd_random", 0.06, pd_random),
                   Mutator("pd_ones", 0.03, pd_ones),
                   Mutator("cma_broken", 0.10, cma_broken),
                   Mutator("hello_damaged", 0.07, hello_damaged))


# -- [CM_HEADER] the MAD header ---------------------------------------------------------------
# these take (r, header dict) and change it in place

def attr_other(r: Rng, h: dict[str, int]) -> None:
    """Dispatch by attribute ID: another message's ID (its layout read over these bytes),
    LAP/APR (not supported on RoCE), ClassPortInfo, 0, unknown."""
    h["attr_id"] = r.choice([int(a) for a in MESSAGES] + [AttrId.LAP, AttrId.APR,
                                                          AttrId.CLASS_PORT_INFO, 0, 0xFFFF,
                                                          0x001B])


def mad_method(r: Rng, h: dict[str, int]) -> None:
    """The MAD layer's method check: GET, SET, GET_RESP, REPORT, the response bit."""
    h["method"] = r.choice([int(m) for m in Method] + [0, 0x83, 0x7F, 0xFF])


def mad_versions(r: Rng, h: dict[str, int]) -> None:
    """The MAD layer's version and class checks: base version, class, class version."""
    k = r.choice(("base_version", "mgmt_class", "class_version"))
    h[k] = r.choice((0, 1, 2, 3, 0x80, 0xFF, r.randrange(256)))


def mad_tid_mod(r: Rng, h: dict[str, int]) -> None:
    """What the CM echoes or ignores: TID, attribute modifier (ECE), status, class
    specific, at their edges."""
    k = r.choice(("tid", "attr_mod", "status", "class_specific"))
    bits = {"tid": 64, "attr_mod": 32, "status": 16, "class_specific": 16}[k]
    h[k] = boundary_values(r, bits)  # type: ignore[assignment]


CM_HEADER = Table("CM_HEADER",
                  Mutator("attr_other", 0.08, attr_other),
                  Mutator("mad_method", 0.03, mad_method),
                  Mutator("mad_versions", 0.03, mad_versions),
                  Mutator("mad_tid_mod", 0.06, mad_tid_mod))


# -- [CM_SIZE] the MAD's length -----------------------------------------------------------------

def mad_size(r: Rng, mad: bytes) -> bytes:
    """The 256-byte rule (QP1 and the MAD layer): the MAD cut (0, 1, 24, 255 bytes) or
    extended (257, 512, 1024)."""
    n = r.choice((0, 1, 24, 100, 255, 257, 512, 1024))
    return mad[:n] if n <= len(mad) else mad + r.randbytes(n - len(mad))


CM_SIZE = Table("CM_SIZE", Mutator("mad_size", 0.04, mad_size))


# -- [QP1] the packet around the MAD -----------------------------------------------------------
# these take (r, packet fields) and change them in place

def qp1_keys(r: Rng, p: dict[str, Any]) -> None:
    """QP1's P_Key and Q_Key checks: another P_Key (0, limited member, random), a Q_Key
    other than 0x80010000."""
    if r.random() < 0.5:
        p["pkey"] = r.choice((0, 0x7FFF, 0x8000, r.randrange(1 << 16)))
    else:
        p["qkey"] = r.choice((0, 0x80000000, 0x80010001, r.getrandbits(32)))


def qp1_src_qp(r: Rng, p: dict[str, Any]) -> None:
    """Where answers go: a source QP other than 1 (the CM answers to it)."""
    p["src_qp"] = r.choice((0, 2, 0xFFFFFF, r.randrange(1 << 24)))


def qp1_opcode(r: Rng, p: dict[str, Any]) -> None:
    """The GSI's opcode check: UD SEND with immediate, an RC or UC SEND to QP 1."""
    p["opcode"] = r.choice((Opcode.UD_SEND_ONLY_WITH_IMMEDIATE, Opcode.RC_SEND_ONLY,
                            Opcode.UC_SEND_ONLY, Opcode.RC_SEND_FIRST))


QP1 = Table("QP1",
            Mutator("qp1_keys", 0.04, qp1_keys),
            Mutator("qp1_src_qp", 0.04, qp1_src_qp),
            Mutator("qp1_opcode", 0.03, qp1_opcode))
BYTE_MUTATED = 0.08  # a CM frame gets the data path's byte-level damage this often

CM_TABLES = (CM_AIM, CM_FIELD, CM_TIMEOUTS, CM_PRIVATE, CM_HEADER, CM_SIZE, QP1)


class MadMaker:
    """Makes QP1 frames carrying mutated CM MADs, aimed at the live CM of ``targets[t]``."""

    def __init__(self, rng: Rng, stats: Stats, seeds: list[CMMessage],
                 targets: list[LiveCm]) -> None:
        self.rng = rng
        self.stats = stats
        self.by_type: dict[str, list[CMMessage]] = {}
        for s in seeds:
            self.by_type.setdefault(s.name, []).append(s)
        self.types = sorted(self.by_type)
        self.targets = targets
        self.psn = 0

    def _count(self, m: Mutator) -> None:
        if m.attack:
            self.stats.m(m.name)

    def _draw(self, table: Table, *args: Any) -> Any:
        m = table.choose(self.rng)
        if m is None or m.apply is None:
            return None
        self._count(m)
        return m.apply(self.rng, *args)

    def make(self, t: int) -> tuple[bytes, str]:
        """One RoCE packet (BTH .. ICRC, the ICRC left for the sender) for device ``t``,
        and the name of the message it started as."""
        r = self.rng
        live = self.targets[t]
        seed = r.choice(self.by_type[r.choice(self.types)])
        mt = seed.type
        f: dict[str, Any] = dict(seed.fields)
        m = CM_AIM.choose(r)
        assert m is not None and m.apply is not None  # the table covers [0, 1)
        self._count(m)
        m.apply(r, mt, f, live)
        if m.attack is False:
            self.stats.to_live_qp += 1
        cma = f.pop("_cma", None)
        for _ in range(r.choice(FIELD_STEPS)):
            self._draw(CM_FIELD, mt, f, live)
        self._draw(CM_TIMEOUTS, mt, f, live)
        pd = bytes(seed.private_data)
        if cma is not None:
            pd = cma + pd[CMA_HDR_SIZE:]
        new_pd = self._draw(CM_PRIVATE, mt, pd, cma)
        if new_pd is not None:
            pd = new_pd
        h = seed.header.as_dict()
        self._draw(CM_HEADER, h)
        mad = build_cm(mt, header=MadHeader(**h), private_data=pd[:mt.private_data_size], **f)
        new_mad = self._draw(CM_SIZE, mad)
        if new_mad is not None:
            mad = new_mad
        p: dict[str, Any] = {"opcode": Opcode.UD_SEND_ONLY, "pkey": QP1_PKEY,
                             "qkey": GSI_QKEY, "src_qp": QP1_QPN}
        self._draw(QP1, p)
        op = p.pop("opcode")
        self.psn = (self.psn + 1) & PSN_MASK
        ud = op in (Opcode.UD_SEND_ONLY, Opcode.UD_SEND_ONLY_WITH_IMMEDIATE)
        data = build(op, psn=self.psn, dest_qp=QP1_QPN, ackreq=True, pkey=p["pkey"],
                     qkey=p["qkey"] if ud else None, src_qp=p["src_qp"] if ud else None,
                     imm=r.getrandbits(32) if op == Opcode.UD_SEND_ONLY_WITH_IMMEDIATE
                     else None, payload=mad)
        if r.random() < BYTE_MUTATED:
            self.stats.byte_mutated += 1
            for _ in range(r.choice(M.BYTE_STEPS)):
                bm = M.BYTES.choose_int(r)
                if bm.fits(len(data)):
                    self._count(bm)
                    bm.apply(r, data)
        return bytes(data), mt.name


def cm_service_ids(port: int) -> tuple[int, int]:
    """The service IDs of an rdma_cm port in the TCP (RC) and UDP (UD, SIDR) spaces."""
    return service_id(PortSpace.TCP, port), service_id(PortSpace.UDP, port)

