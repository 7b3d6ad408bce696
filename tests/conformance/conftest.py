"""The verbs conformance suite: one set of tests, written only against the public
``softrdma.verbs_api``, run against any device the API can open.

Which device: ``SOFTRDMA_CONFORMANCE_DEVICE`` (a device name; default: ``Context()`` with no
name, the soft default device ``softrdma0``) and ``SOFTRDMA_CONFORMANCE_GID`` (the GID index
to use; default 1: on the soft device, as on kernel rxe with an IPv4 address, index 0 is the
link-local ``fe80::`` GID and index 1 the IPv4-mapped RoCEv2 GID ``::ffff:a.b.c.d``). The
lab runs the same files on kernel rxe: ``SOFTRDMA_CONFORMANCE_DEVICE=rxe0
SOFTRDMA_CONFORMANCE_GID=1 SOFTRDMA_BACKEND=ibverbs`` (tests/interop/test_backend_conformance.py).

Connected QPs are two QPs of the one context connected to each other in loopback (the
destination GID is the device's own), as rdma-core's tests do on rxe. Path MTU is the
port's ``active_mtu``. Timers are the protocol's short ones: RC ``timeout`` 14 (4.096 us *
2^14 = 67 ms), ``min_rnr_timer`` 12 (0.64 ms).

Where softrdma and kernel rxe legitimately behave differently, the difference lives in
:data:`DIFFERENCES` below, keyed by device kind, with the rule that decides it; a test
reads its expectation from there through the ``differs`` fixture, so nothing is hidden.
"""

from __future__ import annotations

import errno
import os
import select
import time

import pytest

from softrdma.verbs_api import (
    AH, CQ, MR, PD, QP, SGE, AHAttr, CompChannel, Context, GlobalRoute, PyverbsRDMAError,
    QPAttr, QPCap, QPInitAttr, RecvWR, SendWR,
)
from softrdma.verbs_api import enums as E

# -- the device under test -------------------------------------------------------------------

DEVICE_ENV = "SOFTRDMA_CONFORMANCE_DEVICE"
GID_ENV = "SOFTRDMA_CONFORMANCE_GID"
DEFAULT_GID_INDEX = 1  # the IPv4-mapped RoCEv2 GID, on the soft device and on lab rxe

#: How long a test waits for completions before it fails (a guard against hangs on a slow
#: emulated guest, not a timing assertion: every wait ends as soon as the work is done).
WAIT = float(os.environ.get("SOFTRDMA_CONFORMANCE_WAIT", "30"))


def rxe_series(release: str | None = None) -> str:
    """The kernel series ("6.1", "6.12") of ``release`` (default: this machine's, i.e. the
    lab guest's when the suite runs on rxe0): where rxe's answer changed between kernels,
    :data:`DIFFERENCES` holds an ``"rxe <series>"`` entry beside ``"rxe"``."""
    parts = (release or os.uname().release).split(".")
    return ".".join(parts[:2])


def expectation(entry: dict[str, object], kind: str, series: str | None = None) -> object:
    """The value ``entry`` records for a device of ``kind``; for kernel rxe, the entry of
    its kernel series (``"rxe 6.12"``) if the kernels differ there, else ``"rxe"``."""
    if kind == "rxe":
        key = f"rxe {series or rxe_series()}"
        if key in entry:
            return entry[key]
    return entry[kind]


def device_kind(name: str) -> str:
    """``"rxe"`` for a device the kernel knows (it has a /sys/class/infiniband entry: in the
    lab that is kernel rxe), ``"soft"`` for a softrdma soft device (which the kernel never
    sees)."""
    return "rxe" if os.path.exists(f"/sys/class/infiniband/{name}") else "soft"


# -- legitimate per-device differences: the one place they are recorded ----------------------

#: name -> {"rule": why the devices differ, and what decides it; kind -> expected value}.
#: Expected values are what each implementation is documented (soft: docs/verbs.md) or
#: known from its source (rxe: rxe_qp.c/rxe_verbs.c, librxe) to do. "rxe" is the lab's
#: default kernel, 6.1; an "rxe 6.12" entry records where 6.12's rxe answers otherwise
#: (:func:`expectation`; the lab runs the suite on both, tests/interop/conftest.py).
DIFFERENCES: dict[str, dict[str, object]] = {
    "retry_cnt_8": {
        "rule": "retry_cnt and rnr_retry are 3-bit fields (IBTA). softrdma refuses 8 with "
                "EINVAL (docs/verbs.md, differences 19); the kernel stores the u8 unchecked "
                "(rxe_qp_from_attr), so modify succeeds. Decided by the device kind.",
        "soft": "EINVAL",
        "rxe": "accepted",
    },
    "cur_qp_state_wrong": {
        "rule": "IBV_QP_CUR_STATE naming a state the QP is not in (here SQD for an RTS QP, "
                "modified to RTS): softrdma refuses it (EINVAL, docs/verbs.md differences "
                "18); rxe_qp_chk_attr takes cur_state from the caller when the mask has "
                "IBV_QP_CUR_STATE and checks SQD->RTS, which is legal, so it succeeds. "
                "Decided by the device kind.",
        "soft": "EINVAL",
        "rxe": "accepted",
    },
    "recv_too_small": {
        "rule": "A SEND longer than the receive WQE, as (requester status, responder "
                "status). softrdma treats it as the IBTA length error (NAK invalid request: "
                "REM_INV_REQ_ERR on both sides, docs/datapath.md). rxe (6.1, the lab's "
                "kernel): copy_data returns -EINVAL for data beyond the WQE, send_data_in "
                "maps anything but -ENOSPC to RESPST_ERR_MALFORMED_WQE: NAK remote "
                "operational error, REM_OP_ERR at the requester, LOC_QP_OP_ERR at the "
                "responder (tests/test_datapath_errors.py notes the same). Decided by the "
                "device kind.",
        "soft": ("IBV_WC_REM_INV_REQ_ERR", "IBV_WC_REM_INV_REQ_ERR"),
        "rxe": ("IBV_WC_REM_OP_ERR", "IBV_WC_LOC_QP_OP_ERR"),
    },
    "non_ipv4_gid_network": {
        "rule": "Only with SOFTRDMA_CONFORMANCE_GID naming a GID that is not IPv4-mapped (index "
                "0, the link-local fe80:: GID): the network header a UD receive reports in its "
                "GRH area. rxe sends such a GID over IPv6 (its netdev has the link-local "
                "address): an IPv6 header. softrdma's devices live on an IPv4 address and "
                "carry every GID of their table over it (docs/pyverbs.md, GID index 0): "
                "20 zero bytes and an IPv4 header. Decided by the device kind.",
        "soft": "ipv4",
        "rxe": "ipv6",
    },
    "empty_sgid_index": {
        "rule": "An address vector (AH, or a QP's AV at INIT->RTR) naming an empty GID table "
                "entry. softrdma: EINVAL (docs/verbs.md: a populated sgid_index is required). "
                "rxe: the kernel resolves the sgid through ib_core's rdma_get_gid_attr, which "
                "answers -ENODATA for an entry that is not valid (EINVAL only for an index "
                "beyond the table, which a u8 sgid_index cannot reach on rxe's 1024-entry "
                "table). The rxe value is read from the kernel source, not yet observed: the "
                "first rxe0 run confirms or corrects it. Decided by the device kind.",
        "soft": errno.EINVAL,
        "rxe": errno.ENODATA,
    },
    "opcode_not_for_qp_type": {
        "rule": "A WR opcode the QP type cannot carry (RDMA READ on UC, RDMA WRITE on UD). "
                "softrdma refuses it at post_send with EINVAL (docs/verbs.md, after rxe's "
                "rxe_wr_opcode_info table). With a user QP on rxe that table is never "
                "consulted at post time: librxe's validate_send_wr (rdma-core providers/rxe/"
                "rxe.c) checks only num_sge, atomic length/alignment, inline length and "
                "BIND_MW, the doorbell carries no WR, and the kernel requester's next_opcode "
                "finds no packet opcode: the WR completes with IBV_WC_LOC_QP_OP_ERR and the "
                "QP goes to ERR, as softrdma already does for UC SEND_WITH_INV. Read from the "
                "sources, not yet observed: the first rxe0 run confirms or corrects it. "
                "Decided by the device kind.",
        "soft": "EINVAL",
        "rxe": "IBV_WC_LOC_QP_OP_ERR",
    },
    "mw_window_bounds": {
        "rule": "An RDMA READ through a type 1 window's rkey that runs past the window's end "
                "but stays inside the MR. IBTA (10.6.7.2, the window's bounds are checked on "
                "every remote access): REM_ACCESS_ERR, and softrdma does so. rxe on the lab's "
                "kernel 6.1 resolves the MW to its MR in check_rkey and checks the range "
                "against the MR only (mr_check_range), so the READ succeeds: observed on "
                "rxe0. Decided by the device kind.",
        "soft": "IBV_WC_REM_ACCESS_ERR",
        "rxe": "IBV_WC_SUCCESS",
    },
    "bad_lkey_status": {
        "rule": "A send whose SGE names an lkey that does not exist. IBTA (10.7.2.1, an invalid "
                "L_Key is a local protection error): IBV_WC_LOC_PROT_ERR, as softrdma reports. "
                "rxe: copy_data's failed key lookup returns -EINVAL, which the requester maps "
                "to IBV_WC_LOC_QP_OP_ERR (only -EFAULT, an SGE outside a valid MR, becomes "
                "LOC_PROT_ERR): observed on rxe0 for RC, UC and UD. Decided by the device "
                "kind.",
        "soft": "IBV_WC_LOC_PROT_ERR",
        "rxe": "IBV_WC_LOC_QP_OP_ERR",
    },
    "recv_posted_in_err": {
        "rule": "A receive WR posted to a QP already in ERR. IBTA (C10-42, 10.3.1): it "
                "completes with a flush error; softrdma flushes it at once. rxe (kernel 6.1, "
                "librxe): the receives outstanding at the move to ERR are flushed, but a "
                "receive posted afterwards only lands in the user-space ring that the kernel's "
                "responder task drains, and nothing schedules that task for a QP in ERR "
                "without traffic: on rxe0 it had not completed after 30 s (observed). "
                "Decided by the device kind.",
        "soft": "flushed at once",
        "rxe": "not flushed",
    },
    "requester_error_status": {
        "rule": "The status of the send WR that fails at the requester (an lkey that does not "
                "exist, an SGE outside its MR, an opcode the QP type cannot carry, UC "
                "SEND_WITH_INV, a bind to an MR without MW_BIND access) and moves the QP to "
                "ERR. IBTA (chapter 10, the error state): the WQE that caused the error "
                "completes with its own error status, and only the WQEs after it are flushed "
                "(WR_FLUSH_ERR). softrdma and rxe 6.1 do so: the 6.1 completer completes a "
                "WQE in wqe_state_error with its status before the QP's completer state is "
                "ERROR. rxe 6.12 reports IBV_WC_WR_FLUSH_ERR for that WR too (observed on "
                "rxe0, 6.12.117, for every case above): since Bob Pearson's 2023 rework that "
                "replaced qp->req.state/comp.state by the QP's own state (Linux 6.5, "
                "rxe_completer's entry test became qp_state(qp) == IB_QPS_ERR), the requester's "
                "rxe_qp_error() makes the completer flush the whole send queue, the failed "
                "WQE included, before it looks at the failed WQE. A regression on 6.12's side: "
                "softrdma keeps the IBTA answer. Decided by the kernel series.",
        "soft": "own status",
        "rxe": "own status",
        "rxe 6.12": "IBV_WC_WR_FLUSH_ERR",
    },
}


@pytest.fixture(scope="package")
def kind(ctx) -> str:
    name = os.environ.get(DEVICE_ENV) or getattr(ctx, "name", "")
    return device_kind(name.decode() if isinstance(name, bytes) else name)


@pytest.fixture
def differs(kind):
    """``differs("retry_cnt_8")``: the expectation recorded for this device's kind."""
    def get(name: str):
        entry = DIFFERENCES[name]
        assert kind in entry, f"DIFFERENCES[{name!r}] has no entry for device kind {kind!r}"
        return expectation(entry, kind)
    return get


# -- session objects -------------------------------------------------------------------------

@pytest.fixture(scope="package")
def ctx():
    name = os.environ.get(DEVICE_ENV) or None
    c = Context(name=name) if name else Context()
    yield c
    c.close()


@pytest.fixture(scope="package")
def gid_index(ctx) -> int:
    return int(os.environ.get(GID_ENV, DEFAULT_GID_INDEX))


@pytest.fixture(scope="package")
def port(ctx):
    return ctx.query_port(1)


@pytest.fixture(scope="package")
def mtu(port) -> int:
    """The path MTU for connected QPs: the port's active MTU (an IBV_MTU_* value)."""
    return int(port.active_mtu)


@pytest.fixture(scope="package")
def mtu_bytes(mtu) -> int:
    return 128 << mtu  # IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5


# -- helpers ---------------------------------------------------------------------------------

LW, RW, RR, RA = (E.IBV_ACCESS_LOCAL_WRITE, E.IBV_ACCESS_REMOTE_WRITE,
                  E.IBV_ACCESS_REMOTE_READ, E.IBV_ACCESS_REMOTE_ATOMIC)
ALL_REMOTE = LW | RW | RR | RA
QKEY = 0x11111111
GRH_LEN = 40

# IBV_QP_* masks of each transition, as the IBTA / RDMA Aware Networks Programming User
# Manual tables require them (independent of softrdma's transition table).
M = E.ibv_qp_attr_mask
REQUIRED = {
    (E.IBV_QPT_RC, "INIT"): M.IBV_QP_STATE | M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT
    | M.IBV_QP_ACCESS_FLAGS,
    (E.IBV_QPT_UC, "INIT"): M.IBV_QP_STATE | M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT
    | M.IBV_QP_ACCESS_FLAGS,
    (E.IBV_QPT_UD, "INIT"): M.IBV_QP_STATE | M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_QKEY,
    (E.IBV_QPT_RC, "RTR"): M.IBV_QP_STATE | M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN
    | M.IBV_QP_RQ_PSN | M.IBV_QP_MAX_DEST_RD_ATOMIC | M.IBV_QP_MIN_RNR_TIMER,
    (E.IBV_QPT_UC, "RTR"): M.IBV_QP_STATE | M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN
    | M.IBV_QP_RQ_PSN,
    (E.IBV_QPT_UD, "RTR"): M.IBV_QP_STATE,
    (E.IBV_QPT_RC, "RTS"): M.IBV_QP_STATE | M.IBV_QP_SQ_PSN | M.IBV_QP_TIMEOUT
    | M.IBV_QP_RETRY_CNT | M.IBV_QP_RNR_RETRY | M.IBV_QP_MAX_QP_RD_ATOMIC,
    (E.IBV_QPT_UC, "RTS"): M.IBV_QP_STATE | M.IBV_QP_SQ_PSN,
    (E.IBV_QPT_UD, "RTS"): M.IBV_QP_STATE | M.IBV_QP_SQ_PSN,
}


def raises_errno(code, fn, *args, **kw):
    with pytest.raises(PyverbsRDMAError) as ei:
        fn(*args, **kw)
    assert ei.value.error_code == code, f"expected errno {code}, got {ei.value}"
    return ei.value


def qp_state(qp) -> int:
    """The state as ibv_query_qp reports it (a QP moved to ERR by the data path too)."""
    return int(qp.query(M.IBV_QP_STATE)[0].qp_state)


def poll(cq, n: int, wait: float = WAIT) -> list:
    """Exactly the next ``n`` completions of ``cq``, in order; fails if they do not all
    arrive within ``wait`` seconds (a hang guard)."""
    got: list = []
    end = time.monotonic() + wait
    while len(got) < n:
        cnt, wcs = cq.poll(n - len(got))
        if cnt:
            got.extend(wcs[:cnt])
            continue
        if time.monotonic() > end:
            pytest.fail(f"only {len(got)} of {n} completions arrived within {wait} s: "
                        f"{[(w.wr_id, w.status) for w in got]}")
        time.sleep(0.0005)
    return got


def poll_none(cq, settle: float = 0.2) -> None:
    """Nothing more arrives on ``cq`` for ``settle`` seconds (used where the protocol
    guarantees there is nothing to complete)."""
    end = time.monotonic() + settle
    while time.monotonic() < end:
        cnt, wcs = cq.poll(1)
        assert cnt == 0, f"unexpected completion {wcs[0]!r}"
        time.sleep(0.002)


def wait_fd(fd: int, wait: float = WAIT) -> bool:
    return bool(select.select([fd], [], [], wait)[0])


class Resources:
    """What one test makes on the session's context; destroyed, newest first, afterwards."""

    def __init__(self, ctx, gid_index: int, mtu: int) -> None:
        self.ctx = ctx
        self.gid_index = gid_index
        self.mtu = mtu
        self.gid = ctx.query_gid(1, gid_index)
        self._objs: list = []
        self.pd = self.keep(PD(ctx))
        self.cq = self.cq_(64)

    def keep(self, obj):
        self._objs.append(obj)
        return obj

    def cq_(self, cqe: int = 64, channel=None) -> CQ:
        return self.keep(CQ(self.ctx, cqe, None, channel, 0))

    def channel(self) -> CompChannel:
        return self.keep(CompChannel(self.ctx))

    def mr(self, size: int = 4096, access: int = ALL_REMOTE, pd=None) -> MR:
        return self.keep(MR(pd or self.pd, size, access))

    def mr_over(self, buffer, access: int = ALL_REMOTE) -> MR:
        return self.keep(MR(self.pd, access=access, buffer=buffer))

    def qp(self, qpt: int, cap: QPCap | None = None, scq=None, rcq=None, srq=None,
           sq_sig_all: int = 0) -> QP:
        cap = cap or QPCap(max_send_wr=8, max_recv_wr=8, max_send_sge=1, max_recv_sge=1)
        ia = QPInitAttr(qp_type=qpt, scq=scq or self.cq, rcq=rcq or self.cq, srq=srq, cap=cap,
                        sq_sig_all=sq_sig_all)
        return self.keep(QP(self.pd, ia))

    def av(self) -> AHAttr:
        """The loopback address: the device's own GID, through the GID index under test."""
        return AHAttr(is_global=1, port_num=1,
                      gr=GlobalRoute(dgid=self.gid, sgid_index=self.gid_index, hop_limit=64))

    def ah(self) -> AH:
        return self.keep(AH(self.pd, attr=self.av()))

    # -- connecting --------------------------------------------------------------------
    def to_init(self, qp, access: int = ALL_REMOTE) -> None:
        a = QPAttr(qp_state=E.IBV_QPS_INIT)
        a.pkey_index, a.port_num = 0, 1
        if qp.qp_type == E.IBV_QPT_UD:
            a.qkey = QKEY
        else:
            a.qp_access_flags = access
        qp.modify(a, REQUIRED[(int(qp.qp_type), "INIT")])

    def connect(self, qp, dest_qpn: int, *, rq_psn: int, sq_psn: int, rnr_retry: int = 7,
                retry_cnt: int = 7, min_rnr_timer: int = 12, timeout: int = 14,
                rd_atomic: int = 1, access: int = ALL_REMOTE) -> None:
        """RESET -> INIT -> RTR -> RTS with exactly the required masks."""
        t = int(qp.qp_type)
        self.to_init(qp, access)
        a = QPAttr(qp_state=E.IBV_QPS_RTR)
        a.path_mtu = self.mtu
        a.dest_qp_num = dest_qpn
        a.rq_psn = rq_psn
        a.max_dest_rd_atomic = rd_atomic
        a.min_rnr_timer = min_rnr_timer
        a.ah_attr = self.av()
        qp.modify(a, REQUIRED[(t, "RTR")])
        a = QPAttr(qp_state=E.IBV_QPS_RTS)
        a.sq_psn = sq_psn
        a.timeout, a.retry_cnt, a.rnr_retry = timeout, retry_cnt, rnr_retry
        a.max_rd_atomic = rd_atomic
        qp.modify(a, REQUIRED[(t, "RTS")])

    def pair(self, qpt: int = E.IBV_QPT_RC, cap: QPCap | None = None, **kw):
        """Two QPs of this context connected to each other (loopback), in RTS."""
        a, b = self.qp(qpt, cap), self.qp(qpt, cap)
        if qpt == E.IBV_QPT_UD:
            for q in (a, b):
                self.ud_to_rts(q)
        else:
            self.connect(a, b.qp_num, rq_psn=0x1234, sq_psn=0x5678, **kw)
            self.connect(b, a.qp_num, rq_psn=0x5678, sq_psn=0x1234, **kw)
        return a, b

    def ud_to_rts(self, qp) -> None:
        self.to_init(qp)
        qp.modify(QPAttr(qp_state=E.IBV_QPS_RTR), REQUIRED[(E.IBV_QPT_UD, "RTR")])
        a = QPAttr(qp_state=E.IBV_QPS_RTS)
        a.sq_psn = 0x777
        qp.modify(a, REQUIRED[(E.IBV_QPT_UD, "RTS")])

    def close(self) -> None:
        for obj in reversed(self._objs):
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - best effort: the test already reported
                pass


@pytest.fixture
def res(ctx, gid_index, mtu):
    r = Resources(ctx, gid_index, mtu)
    yield r
    r.close()


def send_wr(mr, offset: int, length: int, wr_id: int = 1, opcode=E.IBV_WR_SEND,
            flags=E.IBV_SEND_SIGNALED, **kw) -> SendWR:
    return SendWR(wr_id=wr_id, opcode=opcode, sg=[SGE(mr.buf + offset, length, mr.lkey)],
                  send_flags=flags, **kw)


def recv_wr(mr, offset: int, length: int, wr_id: int = 1) -> RecvWR:
    return RecvWR(wr_id=wr_id, sg=[SGE(mr.buf + offset, length, mr.lkey)])


def pattern(n: int, seed: int = 1) -> bytes:
    return bytes((i * 31 + seed * 17 + (i >> 8)) & 0xFF for i in range(n))
