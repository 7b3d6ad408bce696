"""The ctypes layouts of softrdma.ibverbs.cma_ffi agree with the installed rdma/rdma_cma.h
(offsetof/sizeof/alignof of every member of rdma_cm_id, rdma_cm_event, rdma_conn_param,
rdma_ud_param, rdma_route, rdma_addr and the sockaddrs), and the check does report a wrong
layout. Needs gcc and librdmacm-dev: skipped without them on a developer machine, a
failure under CI=true."""

from __future__ import annotations

import ctypes

import pytest

from softrdma.ibverbs import cma_ffi

from .conftest import IN_CI


@pytest.fixture(scope="module")
def toolchain():
    why = cma_ffi.header_missing()
    if why:
        if IN_CI:
            pytest.fail(f"CI must run the librdmacm layout check: {why}")
        pytest.skip(why)


def test_every_ctypes_layout_matches_rdma_cma_h(toolchain):
    n, bad = cma_ffi.check_layouts()
    assert n > 250
    assert bad == []


def test_the_structs_the_backend_reads_are_all_checked():
    names = set(cma_ffi.STRUCTS)
    assert {"struct rdma_cm_id", "struct rdma_cm_event", "struct rdma_conn_param",
            "struct rdma_ud_param", "struct rdma_route", "struct rdma_addr",
            "struct sockaddr_in", "struct sockaddr_in6"} <= names


def test_a_wrong_layout_is_reported(toolchain):
    class bad_conn_param(ctypes.Structure):  # private_data_len as 16 bits: the rest moves
        _fields_ = [("private_data", ctypes.c_void_p), ("private_data_len", ctypes.c_uint16)] \
            + [f for f in cma_ffi.rdma_conn_param._fields_[2:]]

    n, bad = cma_ffi.check_layouts({"struct rdma_conn_param": bad_conn_param})
    assert any(m.startswith("struct rdma_conn_param.private_data_len:") and "size 2" in m
               for m in bad)
    assert any(m.startswith("struct rdma_conn_param.responder_resources: ctypes offset 10")
               for m in bad)
    assert not any(m.startswith("struct rdma_conn_param.private_data:") for m in bad)
