"""Protection domains, memory regions and address handles for unmodified programs.

Each verb turns the program's C arguments into a :mod:`softrdma.verbs_api` call and
hands back a structure with the installed header's layout, kept alive in
:data:`~softrdma.exec.shim.handles` until its destroy verb:

* ``ibv_alloc_pd`` -> ``struct ibv_pd`` for a :class:`~softrdma.verbs_api.PD`;
* ``ibv_reg_mr`` (and ``_iova``, ``_iova2``, ``ibv_rereg_mr``) -> ``struct ibv_mr`` for
  an :class:`~softrdma.verbs_api.MR` over **the program's own memory**: the MR's buffer is
  a cffi buffer at the program's address (no copy), its iova the program's pointer (or
  the iova it asked for), so SGEs carry the program's pointers and a peer's RDMA WRITE or
  READ lands in, or reads from, the program's bytes;
* ``ibv_create_ah`` (and ``_from_wc``, ``ibv_init_ah_from_wc``) -> ``struct ibv_ah`` for
  an :class:`~softrdma.verbs_api.AH`.

Public names for the other parts: :func:`pd_of` (``struct ibv_pd *`` -> verbs_api PD),
:func:`mr_of`, :func:`ah_of`, :func:`ptr_of` (a verbs_api object -> the structure handed
out for it), :func:`ah_attr_from_c` / :func:`ah_attr_to_c` (``struct ibv_ah_attr`` <->
:class:`~softrdma.verbs_api.AHAttr`).

Structures this part declares for cffi (no other part may declare them again):
``ibv_pd``, ``ibv_mr``, ``ibv_ah``, ``ibv_ah_attr``, ``ibv_global_route``, ``ibv_grh``.
"""

from __future__ import annotations

import mmap
from typing import Any

from . import devices, pages, shim
from .shim import Errno, errno_of, guard, handles

__all__ = ["IMPLEMENTS", "install", "pd_of", "mr_of", "ah_of", "ptr_of",
           "ah_attr_from_c", "ah_attr_to_c", "remember", "forget", "inline_lkey"]

IMPLEMENTS = ("ibv_alloc_pd", "ibv_dealloc_pd", "ibv_reg_mr", "ibv_reg_mr_iova",
              "ibv_reg_mr_iova2", "ibv_rereg_mr", "ibv_dereg_mr", "ibv_create_ah",
              "ibv_destroy_ah", "ibv_create_ah_from_wc", "ibv_init_ah_from_wc",
              "ibv_query_pkey")


#: the access bits libibverbs drops when the device lacks them (IBV_ACCESS_OPTIONAL_RANGE)
_OPTIONAL_ACCESS = 0x3FF00000
_REREG_ERR_INPUT = -1  # enum ibv_rereg_mr_err_code
_REREG_ERR_CMD = -4

#: id(verbs_api object) -> the C structure handed out for it (async events, WCs name them)
_ptrs: dict[int, Any] = {}


def remember(obj: Any, ptr: Any) -> None:
    """Note that ``ptr`` is the structure handed out for ``obj`` (see :func:`ptr_of`)."""
    _ptrs[id(obj)] = ptr


def forget(obj: Any) -> None:
    _ptrs.pop(id(obj), None)


def ptr_of(obj: Any) -> Any:
    """The structure handed out for a verbs_api object (NULL if none)."""
    return _ptrs.get(id(obj), shim.ffi.NULL)


#: id(PD) -> the PD's local-only MR over the whole address space (see inline_lkey)
_inline_mrs: dict[int, Any] = {}
_ADDRESS_SPACE = (1 << 63) - 1  # the most a memoryview can span


def inline_lkey(pd: Any) -> int:
    """The lkey that makes any of the program's bytes an inline source: libibverbs
    ignores the lkey of an IBV_SEND_INLINE WR's SGEs (rsocket and UCX post inline data
    from unregistered memory with lkey 0), while the soft QP gathers inline data through
    the key table. So each PD gets, on its first inline WR, one MR with no access rights
    (no remote access, no local write) spanning the process's address space, and inline
    SGEs are read through it. It reads nothing the program could not read itself."""
    mr = _inline_mrs.get(id(pd))
    if mr is None:
        from ..verbs_api import MR
        buf = shim.ffi.buffer(shim.ffi.cast("char *", 0), _ADDRESS_SPACE)
        mr = _inline_mrs[id(pd)] = MR(pd, _ADDRESS_SPACE, 0, address=0, buffer=buf)
    return mr.lkey


def pd_of(ptr: Any) -> Any:
    """The verbs_api PD behind a ``struct ibv_pd *`` (Errno EINVAL if not one of ours)."""
    return handles.get("pd", ptr)


def mr_of(ptr: Any) -> Any:
    return handles.get("mr", ptr)


def ah_of(ptr: Any) -> Any:
    return handles.get("ah", ptr)


#: A GRH's flow label is 20 bits.
FLOW_LABEL_MASK = (1 << 20) - 1


def ah_attr_from_c(a: Any) -> Any:
    """A ``struct ibv_ah_attr`` as a verbs_api AHAttr."""
    from ..verbs_api import AHAttr, GID, GlobalRoute
    g = a.grh
    # The kernel takes grh.flow_label as a u32 and a GRH carries its low 20 bits; UCX
    # sets ~0 on RoCE on purpose (ib_iface.c: "rdma-core flow label to udp sport").
    gr = GlobalRoute(dgid=GID(bytes(shim.ffi.buffer(g.dgid.raw, 16))),
                     flow_label=g.flow_label & FLOW_LABEL_MASK, sgid_index=g.sgid_index,
                     hop_limit=g.hop_limit, traffic_class=g.traffic_class) \
        if a.is_global else None
    return AHAttr(dlid=a.dlid, sl=a.sl, src_path_bits=a.src_path_bits,
                  static_rate=a.static_rate, is_global=a.is_global, port_num=a.port_num,
                  gr=gr)


def ah_attr_to_c(attr: Any, out: Any) -> None:
    """Fill a ``struct ibv_ah_attr`` from a verbs_api AHAttr."""
    ffi = shim.ffi
    if ffi.typeof(out).kind == "pointer":
        out = out[0]
    ffi.memmove(ffi.addressof(out), b"\0" * ffi.sizeof("struct ibv_ah_attr"),
                ffi.sizeof("struct ibv_ah_attr"))
    out.dlid, out.sl, out.src_path_bits = attr.dlid, attr.sl, attr.src_path_bits
    out.static_rate, out.is_global, out.port_num = attr.static_rate, attr.is_global, \
        attr.port_num
    gr = attr.gr
    if gr is not None:
        if gr.dgid is not None:
            ffi.memmove(out.grh.dgid.raw, gr.dgid.raw, 16)
        out.grh.flow_label, out.grh.sgid_index = gr.flow_label, gr.sgid_index
        out.grh.hop_limit, out.grh.traffic_class = gr.hop_limit, gr.traffic_class


def _wc_from_c(wc: Any) -> Any:
    from ..verbs_api import WC
    return WC(wr_id=wc.wr_id, status=wc.status, opcode=wc.opcode, byte_len=wc.byte_len,
              qp_num=wc.qp_num, src_qp=wc.src_qp, wc_flags=wc.wc_flags,
              pkey_index=wc.pkey_index, slid=wc.slid, sl=wc.sl,
              dlid_path_bits=wc.dlid_path_bits)


def install(ffi: Any, lib: Any) -> None:
    """Define this part's functions."""
    from ..verbs_api import AH, MR, PD
    from ..verbs_api.mr import check_mr_access

    # ---- protection domains ---------------------------------------------------------
    @ffi.def_extern(name="ibv_alloc_pd")
    @guard(ffi.NULL)
    def alloc_pd(ctx: Any) -> Any:
        c = devices.context_of(ctx)
        try:
            pd = PD(c)
        except OSError as e:
            raise errno_of(e) from None
        s = ffi.new("struct ibv_pd *")
        s.context = ctx
        s.handle = id(pd) & 0xFFFFFFFF
        remember(pd, s)
        return handles.add("pd", s, pd)

    @ffi.def_extern(name="ibv_dealloc_pd")
    @guard("errno")
    def dealloc_pd(ptr: Any) -> int:
        pd = pd_of(ptr)
        inl = _inline_mrs.get(id(pd))
        if inl is not None and all(u is inl or u.closed for u in pd.users):
            inl.close()  # the PD's own inline MR is no user of the program's
            del _inline_mrs[id(pd)]
        try:
            pd.close()  # EBUSY while an MR, QP, SRQ or AH uses it
        except OSError as e:
            raise errno_of(e) from None
        forget(pd)
        handles.release("pd", ptr)
        return 0

    # ---- memory regions ---------------------------------------------------------------
    def register(pd_ptr: Any, addr: Any, length: int, iova: int, access: int) -> Any:
        # in the order ib_uverbs_reg_mr checks: the page offsets (EINVAL), the access
        # flags (EINVAL), then the pages themselves (ib_umem_get: EFAULT)
        pd = pd_of(pd_ptr)
        access &= ~_OPTIONAL_ACCESS
        a = int(ffi.cast("uintptr_t", addr))
        if length and not a:
            raise Errno(22, "ibv_reg_mr: NULL address")
        if (a ^ iova) & (mmap.PAGESIZE - 1):
            raise Errno(22, f"ibv_reg_mr: addr 0x{a:x} and iova 0x{iova:x} must have the "
                        f"same offset in a page")
        try:
            access = check_mr_access(access, "ibv_reg_mr")
        except OSError as e:
            raise errno_of(e) from None
        pages.check_range(a, length, access)
        buf = ffi.buffer(ffi.cast("char *", addr), length)
        try:
            return MR(pd, length, access, address=iova, buffer=buf)
        except OSError as e:
            raise errno_of(e) from None

    def new_mr(pd_ptr: Any, addr: Any, length: int, iova: int, access: int) -> Any:
        mr = register(pd_ptr, addr, length, iova, access)
        s = ffi.new("struct ibv_mr *")
        _fill_mr(s, pd_ptr, addr, mr)
        remember(mr, s)
        return handles.add("mr", s, mr)

    def _fill_mr(s: Any, pd_ptr: Any, addr: Any, mr: Any) -> None:
        s.context = pd_ptr.context
        s.pd = pd_ptr
        s.addr = addr
        s.length = mr.length
        s.handle = mr.lkey >> 8
        s.lkey, s.rkey = mr.lkey, mr.rkey

    @ffi.def_extern(name="ibv_reg_mr")
    @guard(ffi.NULL)
    def reg_mr(pd: Any, addr: Any, length: int, access: int) -> Any:
        return new_mr(pd, addr, length, int(ffi.cast("uintptr_t", addr)), access)

    @ffi.def_extern(name="ibv_reg_mr_iova")
    @guard(ffi.NULL)
    def reg_mr_iova(pd: Any, addr: Any, length: int, iova: int, access: int) -> Any:
        return new_mr(pd, addr, length, iova, access)

    @ffi.def_extern(name="ibv_reg_mr_iova2")
    @guard(ffi.NULL)
    def reg_mr_iova2(pd: Any, addr: Any, length: int, iova: int, access: int) -> Any:
        return new_mr(pd, addr, length, iova, access)

    @ffi.def_extern(name="ibv_rereg_mr")
    @guard(_REREG_ERR_INPUT)
    def rereg_mr(ptr: Any, flags: int, pd_ptr: Any, addr: Any, length: int,
                 access: int) -> int:
        # libibverbs' input checks: known flags, something to change, a PD if CHANGE_PD,
        # an address and length if CHANGE_TRANSLATION
        old = mr_of(ptr)
        if not flags or flags & ~7:
            raise Errno(22, "ibv_rereg_mr: flags must be IBV_REREG_MR_CHANGE_* bits")
        new_pd = pd_ptr if flags & 2 else ptr.pd
        pd_of(new_pd)
        if flags & 1:
            if not length or addr == ffi.NULL:
                raise Errno(22, "ibv_rereg_mr: CHANGE_TRANSLATION needs addr and length")
            new_addr, new_len = addr, length
        else:
            new_addr, new_len = ptr.addr, ptr.length
        new_access = access if flags & 4 else old.access
        # the new registration first: a failure leaves the old one as it was
        try:
            mr = register(new_pd, new_addr, new_len, int(ffi.cast("uintptr_t", new_addr)),
                          new_access)
        except Errno as e:
            ffi.errno = e.error_code
            return _REREG_ERR_CMD
        try:
            old.close()
        except OSError as e:
            mr.close()
            ffi.errno = getattr(e, "error_code", None) or 22
            return _REREG_ERR_CMD
        forget(old)
        mr.adopt_keys(old.lkey)  # rxe keeps the keys (rxe_rereg_user_mr)
        # the structure stays the one allocated by ibv_reg_mr (``ptr`` is the program's
        # pointer to it, which owns nothing: released and added again, the memory would
        # be freed under the program)
        handles.replace("mr", ptr, mr)
        _fill_mr(ptr, new_pd, new_addr, mr)
        remember(mr, ptr)
        return 0

    @ffi.def_extern(name="ibv_dereg_mr")
    @guard("errno")
    def dereg_mr(ptr: Any) -> int:
        mr = mr_of(ptr)
        try:
            mr.close()  # EINVAL while memory windows are bound to it (as rxe)
        except OSError as e:
            raise errno_of(e) from None
        forget(mr)
        handles.release("mr", ptr)
        return 0

    shim.destroyers.update(pd=dealloc_pd, mr=dereg_mr)

    # ---- address handles ----------------------------------------------------------------
    def new_ah(pd_ptr: Any, attr: Any) -> Any:
        pd = pd_of(pd_ptr)
        try:
            ah = AH(pd, attr)
        except OSError as e:
            raise errno_of(e) from None
        s = ffi.new("struct ibv_ah *")
        s.context, s.pd, s.handle = pd_ptr.context, pd_ptr, id(ah) & 0xFFFFFFFF
        remember(ah, s)
        return handles.add("ah", s, ah)

    @ffi.def_extern(name="ibv_create_ah")
    @guard(ffi.NULL)
    def create_ah(pd: Any, attr: Any) -> Any:
        if attr == ffi.NULL:
            raise Errno(22, "ibv_create_ah: attr is NULL")
        return new_ah(pd, ah_attr_from_c(attr))

    @ffi.def_extern(name="ibv_destroy_ah")
    @guard("errno")
    def destroy_ah(ptr: Any) -> int:
        ah = ah_of(ptr)
        try:
            ah.close()
        except OSError as e:
            raise errno_of(e) from None
        forget(ah)
        handles.release("ah", ptr)
        return 0

    shim.destroyers["ah"] = destroy_ah

    def attr_from_wc(ctx: Any, port: int, wc: Any, grh: Any) -> Any:
        from ..verbs_api.ah import ah_attr_from_wc
        c = devices.context_of(ctx)
        if wc == ffi.NULL or grh == ffi.NULL:
            raise Errno(22, "ibv_init_ah_from_wc: wc and grh are required")
        if not wc.wc_flags & 1:  # IBV_WC_GRH: RoCE always has one
            raise Errno(22, "ibv_init_ah_from_wc: the completion has no GRH")
        table = [g.raw for _, g, _ in c.query_gid_table()]
        try:
            return ah_attr_from_wc(_wc_from_c(wc), bytes(ffi.buffer(grh, 40)), table, port)
        except OSError as e:
            raise errno_of(e) from None

    @ffi.def_extern(name="ibv_init_ah_from_wc")
    @guard("errno")
    def init_ah_from_wc(ctx: Any, port: int, wc: Any, grh: Any, out: Any) -> int:
        ah_attr_to_c(attr_from_wc(ctx, port, wc, grh), out)
        return 0

    @ffi.def_extern(name="ibv_create_ah_from_wc")
    @guard(ffi.NULL)
    def create_ah_from_wc(pd: Any, wc: Any, grh: Any, port: int) -> Any:
        pd_of(pd)
        return new_ah(pd, attr_from_wc(pd.context, port, wc, grh))

    @ffi.def_extern(name="ibv_query_pkey")
    @guard(-1)
    def query_pkey(ctx: Any, port: int, index: int, pkey: Any) -> int:
        try:
            v = devices.context_of(ctx).query_pkey(port, index)
        except OSError as e:
            raise errno_of(e) from None
        pkey[0] = ((v & 0xFF) << 8) | (v >> 8)  # __be16
        return 0
