"""One description of rdma-core's C structures serves both directions of the ABI.

softrdma.ibverbs.cdecls holds the declarations; the ctypes backend's classes are made from
them (their layouts are compared with the installed headers by test_ibverbs_layout.py and
test_rdmacm_hw_layout.py), and softrdma exec's preload library is built from the same text
by cffi, which checks each member's type against the header at compile time. These tests
guard that nothing grows a second description, and that a wrong member is caught on the
cffi side as it is on the ctypes side.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from softrdma.ibverbs import cdecls, cma_ffi, ffi, layout

from .conftest import IN_CI, ROOT


@pytest.fixture(scope="module")
def toolchain():
    why = layout.toolchain_missing()
    if why:
        if IN_CI:
            pytest.fail(f"CI must check the C declarations: {why}")
        pytest.skip(why)


def test_the_ctypes_backend_uses_the_description():
    t = cdecls.ctypes_types()
    assert ffi.ibv_wc is t["struct ibv_wc"] and ffi.ibv_send_wr is t["struct ibv_send_wr"]
    assert cma_ffi.rdma_cm_id is t["struct rdma_cm_id"]
    # every struct of the description is checked against a header, by one of the two
    assert set(ffi.STRUCTS) | set(cma_ffi.STRUCTS) == set(t)
    # C's anonymous members read as C reads them
    wc = ffi.ibv_wc(imm_data=0x01020304)
    assert wc.invalidated_rkey == 0x01020304
    assert ctypes.sizeof(ffi.ibv_wc) == 48 and ffi.ibv_wc.qp_num.offset == 28


def test_no_part_of_softrdma_exec_describes_a_struct_again():
    """The preload library's parts may declare enums (with the constants they use) and
    glibc's types, never the members of an rdma-core struct: those are cdecls's."""
    described = {d.cname for d in cdecls.parse()}
    again = []
    for path in sorted((ROOT / "softrdma" / "exec").glob("*.py")):
        for kind, name in re.findall(r"\b(struct|union)\s+(\w+)\s*\{", path.read_text()):
            if f"{kind} {name}" in described:
                again.append(f"{path.name}: {kind} {name}")
    assert again == []


def test_the_cffi_rendering_leaves_structs_open_but_closes_what_anonymous_members_hold():
    cdef = cdecls.cffi_cdef()
    # open: the compiler places the members, so a header that grew still works
    assert re.search(r"struct verbs_context \{.*?\.\.\.;\s*\};", cdef, re.S)
    # closed: cffi cannot ask the compiler about an anonymous union's members
    sge = re.search(r"struct ibv_mw_bind_info \{(.*?)\};", cdef, re.S).group(1)
    assert "..." not in sge
    assert "int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);" in cdef
    assert "enum ibv_wc_status { ... };" in cdef
    assert "enum ibv_wc_status { ... };" not in cdecls.cffi_cdef(
        declared_enums={"ibv_wc_status"})


def _cffi_view(tmp_path: Path, text: str, name: str):
    """Build ``text`` as cffi does for the preload library (against verbs.h, with
    cdecls's compile flags) and return the built module's ffi, its types not yet used."""
    cffi = pytest.importorskip("cffi")
    import importlib.util
    f = cffi.FFI()
    f.cdef(cdecls.cffi_cdef(text))
    f.set_source(name, "#include <infiniband/verbs.h>\n",
                 extra_compile_args=cdecls.CFFI_COMPILE_ARGS)
    so = f.compile(tmpdir=str(tmp_path))
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ffi


def test_cffi_rejects_a_member_whose_type_is_not_the_headers(toolchain, tmp_path):
    """The mistake the layout check finds on the ctypes side (a member of the wrong type)
    is found on the cffi side too: a pointer member of another type does not compile (gcc,
    with CFFI_COMPILE_ARGS), an integer of another size is refused at the struct's first
    use, before any byte is read or written."""
    good = "struct ibv_sge { uint64_t addr; uint32_t length; uint32_t lkey; };"
    assert _cffi_view(tmp_path, good, "_cdecls_good").sizeof("struct ibv_sge") == 16
    narrow = _cffi_view(tmp_path, good.replace("uint32_t lkey", "uint16_t lkey"),
                        "_cdecls_narrow")
    with pytest.raises(Exception, match="lkey"):
        narrow.new("struct ibv_sge *")
    with pytest.raises(Exception, match="CompileError|incompatible"):
        _cffi_view(tmp_path, "struct ibv_recv_wr { uint64_t wr_id; struct ibv_sge *next; "
                   "struct ibv_sge *sg_list; int num_sge; };", "_cdecls_ptr")
    # and the ctypes side of the same wrong text disagrees with the header as well
    bad = cdecls.ctypes_types(good.replace("uint32_t lkey", "uint16_t lkey"))
    n, mismatches = layout.check({"struct ibv_sge": bad["struct ibv_sge"]})
    assert any(m.startswith("struct ibv_sge.lkey:") for m in mismatches)


def test_the_parser_reads_what_the_headers_write():
    (d,) = cdecls.parse("""
        struct x {
            struct ibv_mr *(*reg)(struct ibv_pd *pd, void *addr, size_t length, int access);
            char name[IBV_SYSFS_NAME_MAX];
            union { uint32_t imm_data; uint32_t invalidate_rkey; };
            struct { uint64_t remote_addr; uint32_t rkey; } rdma;
        };""")
    assert [m.name for m in d.members] == ["reg", "name", None, "rdma"]
    assert d.members[0].pointer and d.members[1].count == 64
    assert [m.name for m in d.members[2].nested.members] == ["imm_data", "invalidate_rkey"]
    with pytest.raises(ValueError, match="not described"):
        cdecls.ctypes_types("struct y { struct nowhere n; };")
