"""The hardware backend's conversions, without hardware: work requests to C structs (the
immediate-data byte order, every opcode's union member, chains), completions from C
(ntohl of immediate data only with IBV_WC_WITH_IMM, rxe's invalidate flag), and how a
post verb's ``bad_wr`` becomes softrdma's ``bad_wr_index``."""

from __future__ import annotations

import ctypes
import errno
import struct
from collections import deque

import pytest

from softrdma.ibverbs import ffi, posting
from softrdma.ibverbs.completion import HwCQ
from softrdma.ibverbs.queues import HwQP
from softrdma.verbs_api import SGE, PyverbsRDMAError, RecvWR, SendWR
from softrdma.verbs_api import enums as E


def _qp(qp_type=E.IBV_QPT_RC):
    q = object.__new__(HwQP)  # only what building WRs reads
    q.qp_type, q._mrs = qp_type, {}
    return q


def test_imm_data_is_sent_big_endian_and_invalidate_rkey_host_order():
    wrs = [SendWR(opcode=E.IBV_WR_SEND_WITH_IMM, imm_data=0x11223344),
           SendWR(opcode=E.IBV_WR_RDMA_WRITE_WITH_IMM, imm_data=0xA1B2C3D4),
           SendWR(opcode=E.IBV_WR_SEND_WITH_INV, imm_data=0x11223344)]
    arr, _ = _qp()._send_chain(wrs, "x")
    raw = [bytes(memoryview(arr[i]).cast("B"))[36:40] for i in range(3)]
    assert raw[0] == b"\x11\x22\x33\x44"  # __be32: the wire's bytes, in order
    assert raw[1] == b"\xa1\xb2\xc3\xd4"
    assert raw[2] == struct.pack("=I", 0x11223344)  # uint32_t invalidate_rkey: host order


def test_each_opcode_fills_its_union_member_and_chains_link():
    w1 = SendWR(wr_id=1, opcode=E.IBV_WR_RDMA_READ, sg=[SGE(0x1000, 8, 5)])
    w1.set_wr_rdma(rkey=0x77, addr=0x9000)
    w2 = SendWR(wr_id=2, opcode=E.IBV_WR_ATOMIC_CMP_AND_SWP, sg=[SGE(0x2000, 8, 5)])
    w2.set_wr_atomic(rkey=0x88, addr=0xA000, compare_add=3, swap=4)
    arr, keep = _qp()._send_chain([w1, w2], "x")
    assert arr[0].wr.rdma.remote_addr == 0x9000 and arr[0].wr.rdma.rkey == 0x77
    a = arr[1].wr.atomic
    assert (a.remote_addr, a.compare_add, a.swap, a.rkey) == (0xA000, 3, 4, 0x88)
    assert arr[0].next == ctypes.addressof(arr[1]) and not arr[1].next
    sg = ffi.ibv_sge.from_address(arr[0].sg_list)
    assert (sg.addr, sg.length, sg.lkey) == (0x1000, 8, 5) and arr[0].num_sge == 1


def test_a_field_refused_before_posting_names_its_wr():
    bad = SendWR(opcode=E.IBV_WR_SEND)
    bad.rkey = 1 << 32
    with pytest.raises(PyverbsRDMAError) as e:
        _qp()._send_chain([SendWR(), bad], "Failed to post send")
    assert e.value.index == 1 and "wr[1].rkey" in str(e.value)


def test_bad_wr_pointer_becomes_the_index():
    arr, _ = posting.recv_chain([RecvWR(wr_id=i) for i in range(3)], 4, "x")
    size = ctypes.sizeof(ffi.ibv_recv_wr)

    def fake_post(obj, wr, bad_pp):  # refuses the third WR, as a provider does
        ctypes.c_void_p.from_address(bad_pp).value = wr + 2 * size
        return errno.ENOMEM

    wrs = [RecvWR(wr_id=i) for i in range(3)]
    out = RecvWR()
    with pytest.raises(PyverbsRDMAError) as e:
        posting.post(fake_post, 0, arr, size, wrs, out, "Failed to post receive")
    assert e.value.error_code == errno.ENOMEM and e.value.bad_wr_index == 2 and out.wr_id == 2


def _cq(inv_bit=1 << 3):
    cq = object.__new__(HwCQ)
    cq._arr = (ffi.ibv_wc * 16)()
    cq._arr_addr = ctypes.addressof(cq._arr)
    cq._wcs, cq._inv_bit, cq._addr = deque(), inv_bit, 0
    return cq


def _poller(*wcs):
    def poll(cq, n, arr):
        k = min(n, len(wcs))
        for i in range(k):
            ctypes.memmove(arr + i * ctypes.sizeof(ffi.ibv_wc), ctypes.byref(wcs[i]),
                           ctypes.sizeof(ffi.ibv_wc))
        return k
    return poll


def test_completions_turn_imm_back_to_a_host_integer():
    w = ffi.ibv_wc(wr_id=5, opcode=E.IBV_WC_RECV, byte_len=9, wc_flags=E.IBV_WC_WITH_IMM)
    w.imm_data = struct.unpack("=I", b"\x11\x22\x33\x44")[0]  # as the wire's bytes land
    plain = ffi.ibv_wc(wr_id=6, opcode=E.IBV_WC_RECV)
    plain.imm_data = 0xDEAD  # union garbage without a flag: not reported
    cq = _cq()
    cq._poll_cq = _poller(w, plain)
    cq._fill(2)
    a, b = cq._wcs
    assert a.imm_data == 0x11223344 and a.wr_id == 5 and a.byte_len == 9
    assert b.imm_data == 0 and b.invalidated_rkey == 0


def test_rxe_invalidate_flag_is_reported_as_ibv_wc_with_inv():
    w = ffi.ibv_wc(wr_id=1, opcode=E.IBV_WC_RECV, wc_flags=1 | (1 << 2))  # GRH | kernel INV
    w.imm_data = 0x1234
    cq = _cq(inv_bit=1 << 2)
    cq._poll_cq = _poller(w)
    cq._fill(1)
    (wc,) = cq._wcs
    assert wc.wc_flags == E.IBV_WC_GRH | E.IBV_WC_WITH_INV
    assert wc.invalidated_rkey == 0x1234 == wc.imm_data
