"""Devices and contexts: the device list, ``ibv_open_device`` and the queries.

A device is a ``struct ibv_device`` with the installed header's layout (Debian's pyverbs
reads ``name`` from it directly). A context is the ``struct ibv_context`` inside a
``struct verbs_context``, as every provider of rdma-core hands it out: verbs.h's inline
verbs find the extended operations there (``abi_compat`` is the marker, ``sz`` says how
many of the growing-up slots exist) and the data path in ``context->ops``. A NULL slot
makes the inline verb answer EOPNOTSUPP or take its fallback into an exported function,
exactly as with a provider that lacks the operation.

Other parts find a context's softrdma :class:`~softrdma.verbs_api.Context` with
:func:`context_of` and fill the context's operation slots with :func:`set_op`.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import PyverbsRDMAError
from . import shim
from .shim import be64, guard, handles

__all__ = ["IMPLEMENTS", "TYPES", "install", "context_of", "set_op", "verbs_context_of",
           "ON_OPEN", "ON_CLOSE", "TEARDOWN_ORDER", "destroy_children"]

#: hooks of the other parts, each called as ``fn(ctx_ptr, context)`` when
#: ibv_open_device has made a context (fill its ops slots, its async_fd) ...
ON_OPEN: list = []
#: ... and when ibv_close_device is about to close it
ON_CLOSE: list = []

IMPLEMENTS = ("ibv_get_device_list", "ibv_free_device_list", "ibv_get_device_name",
              "ibv_get_device_guid", "ibv_get_device_index", "ibv_open_device",
              "ibv_close_device", "ibv_query_device", "ibv_query_port", "ibv_query_gid",
              "ibv_query_gid_type", "ibv_read_sysfs_file")

#: enums with the constants this part uses (the structs: softrdma.ibverbs.cdecls)
TYPES = """
    enum ibv_transport_type { IBV_TRANSPORT_UNKNOWN, IBV_TRANSPORT_IB, ... };
    enum ibv_mw_type { IBV_MW_TYPE_1 = 1, IBV_MW_TYPE_2 = 2 };
"""

#: verbs.h's marker of a verbs_context: abi_compat == (void *)UINTPTR_MAX
_VERBS_CONTEXT_MARKER = (1 << 64) - 1

_devices: dict[int, Any] = {}  # address of a struct ibv_device -> its softrdma Device


def listed() -> bool:
    """Whether the program has listed the devices (libibverbs initialises itself then)."""
    return bool(_devices)


def context_of(ctx: Any) -> Any:
    """The softrdma Context behind a ``struct ibv_context *`` (Errno EINVAL if it is not
    one softrdma handed out)."""
    return handles.get("context", ctx)


def verbs_context_of(ctx: Any) -> Any:
    """The ``struct verbs_context *`` around a context softrdma handed out."""
    handles.get("context", ctx)
    return shim.ffi.cast("struct verbs_context *",
                         shim.address(ctx) - shim.ffi.offsetof("struct verbs_context",
                                                               "context"))


def set_op(ctx: Any, slot: str, fn: Any) -> None:
    """Fill an operation slot of a context: ``ops.<slot>`` for the data path
    (``post_send``, ``poll_cq``, ...), else the verbs_context's slot of that name."""
    ffi = shim.ffi
    fields = dict(ffi.typeof("struct ibv_context_ops").fields)
    if slot in fields:
        setattr(ctx.ops, slot, ffi.cast(fields[slot].type, fn))
    else:
        vctx = verbs_context_of(ctx)
        setattr(vctx, slot, ffi.cast(dict(ffi.typeof("struct verbs_context").fields)[slot].type,
                                     fn))


def install(ffi: Any, lib: Any) -> None:
    """Define this part's functions."""
    from ..verbs_api import device as vdev

    @ffi.def_extern(name="ibv_get_device_list")
    @guard(ffi.NULL)
    def get_device_list(num: Any) -> Any:
        found = vdev.get_device_list()
        structs = []
        for d in found:
            s = ffi.new("struct ibv_device *")
            s.node_type = ffi.cast("enum ibv_node_type", int(d.node_type))
            s.transport_type = ffi.cast("enum ibv_transport_type", int(d.transport_type))
            s.name = d.name
            s.dev_name = b"uverbs" + str(d.index).encode()
            handles.add("device", s, d)
            _devices[shim.address(s)] = d
            structs.append(s)
        lst = ffi.new("struct ibv_device *[]", structs + [ffi.NULL])
        handles.add("device list", lst, structs)
        if num != ffi.NULL:
            num[0] = len(structs)
        return lst

    @ffi.def_extern(name="ibv_free_device_list")
    @guard(None)
    def free_device_list(lst: Any) -> None:
        # the devices stay valid after the list goes (libibverbs keeps them too: a
        # program may use a device it picked after freeing the list)
        handles.release("device list", lst)

    @ffi.def_extern(name="ibv_get_device_name")
    @guard(ffi.NULL)
    def get_device_name(dev: Any) -> Any:
        handles.get("device", dev, 19)
        return dev.name

    @ffi.def_extern(name="ibv_get_device_guid")
    @guard(0)
    def get_device_guid(dev: Any) -> int:
        # __be64: the GUID's bytes in network order, whatever the host's
        return be64(handles.get("device", dev, 19).guid)

    @ffi.def_extern(name="ibv_get_device_index")
    @guard(-1)
    def get_device_index(dev: Any) -> int:
        # the kernel's ib_device index; a soft device has its own, stable for its life
        return int(handles.get("device", dev, 19).index)

    # ---- contexts -------------------------------------------------------------------
    @ffi.def_extern(name="ibv_open_device")
    @guard(ffi.NULL)
    def open_device(dev: Any) -> Any:
        d = handles.get("device", dev, 19)  # ENODEV
        from ..verbs_api import Context
        c = Context(name=d.name.decode())
        vctx = ffi.new("struct verbs_context *")
        vctx.sz = ffi.sizeof("struct verbs_context")
        s = vctx.context
        s.device = dev
        s.abi_compat = ffi.cast("void *", _VERBS_CONTEXT_MARKER)
        s.num_comp_vectors = 1
        r, w = os.pipe()  # cmd_fd / async_fd: real descriptors (poll on them works)
        s.cmd_fd, s.async_fd = r, w
        ptr = ffi.addressof(vctx, "context")
        handles.add("context", ptr, c)
        _contexts[shim.address(ptr)] = (vctx, (r, w))
        try:
            for fn in ON_OPEN:
                fn(ptr, c)
        except BaseException:  # no half-made context left behind
            handles.release("context", ptr)
            _contexts.pop(shim.address(ptr))
            c.close()
            os.close(r)
            os.close(w)
            raise
        return ptr

    @ffi.def_extern(name="ibv_close_device")
    @guard(-1)
    def close_device(ctx: Any) -> int:
        c = context_of(ctx)
        left = destroy_children(ctx)
        for fn in ON_CLOSE:
            fn(ctx, c)
        handles.release("context", ctx)
        vctx, fds = _contexts.pop(shim.address(ctx))
        c.close()
        for fd in fds:
            os.close(fd)
        if left:
            # the program may still hold pointers into these: their memory stays (a
            # stale ibv_post_send reads qp->context->ops and gets EINVAL, not a crash)
            _graveyard.append((vctx, left))
        return 0

    @ffi.def_extern(name="ibv_query_device")
    @guard("errno")
    def query_device(ctx: Any, attr: Any) -> int:
        a = context_of(ctx).query_device()
        for name, _ in ffi.typeof("struct ibv_device_attr").fields:
            if name == "fw_ver":
                attr.fw_ver = a.fw_ver.encode()[:63]
            elif name in ("node_guid", "sys_image_guid"):
                setattr(attr, name, be64(getattr(a, name)))
            elif name == "atomic_cap":
                attr.atomic_cap = int(a.atomic_caps)
            elif hasattr(a, name):
                setattr(attr, name, int(getattr(a, name)))
        return 0

    @ffi.def_extern(name="ibv_query_port")
    @guard("errno")
    def query_port(ctx: Any, port: int, attr: Any) -> int:
        c = context_of(ctx)
        try:
            p = c.query_port(port)
        except PyverbsRDMAError as e:  # a port the device lacks: the caller's EINVAL
            raise shim.errno_of(e) from None
        out = ffi.cast("struct ibv_port_attr *", attr)
        # the fields every release's ibv_port_attr has: a caller of the exported symbol
        # may pass the older, shorter structure (_compat_ibv_port_attr)
        for name, _ in ffi.typeof("struct ibv_port_attr").fields:
            setattr(out, name, int(getattr(p, name)))
        return 0

    @ffi.def_extern(name="ibv_query_gid")
    @guard(-1)
    def query_gid(ctx: Any, port: int, index: int, gid: Any) -> int:
        g = context_of(ctx).query_gid(port, index)
        raw = bytes.fromhex(g.gid.replace(":", ""))
        ffi.memmove(gid.raw, raw, 16)
        return 0

    @ffi.def_extern(name="ibv_query_gid_type")
    @guard(-1)
    def query_gid_type(ctx: Any, port: int, index: int, typ: Any) -> int:
        context_of(ctx)
        typ[0] = 1  # IBV_GID_TYPE_SYSFS_ROCE_V2: every softrdma GID is RoCE v2
        return 0

    @ffi.def_extern(name="ibv_read_sysfs_file")
    @guard(-1)
    def read_sysfs_file(d: Any, f: Any, buf: Any, size: int) -> int:
        return -1  # a soft device has no sysfs files: the caller's "not there"


_contexts: dict[int, Any] = {}  # context address -> (its verbs_context, its fds)

#: the order in which closing a context destroys what the program left in it: users
#: before what they use (a QP holds its CQs, SRQ and PD; a window its MR's PD; a CQ its
#: channel), as uverbs' cleanup of a closed file ends in the same place
TEARDOWN_ORDER = ("qp", "srq", "cq", "ah", "mw", "mr", "pd", "comp_channel")

#: structures of contexts closed with objects alive, kept from being freed (see
#: close_device): (verbs_context, [(structure, record)])
_graveyard: list[tuple[Any, list]] = []


def destroy_children(ctx: Any) -> list[tuple[Any, Any]]:
    """Destroy every object the program left in ``ctx`` (``ibv_close_device``: on Linux
    closing the uverbs file destroys them all, and libibverbs itself does not check),
    each through its own destroy verb, in :data:`TEARDOWN_ORDER`; a CQ's unacknowledged
    events do not hold it (uverbs does not wait for them either). Returns the
    ``(structure, record)`` pairs destroyed."""
    me = shim.address(ctx)
    gone: list[tuple[Any, Any]] = []
    for kind in TEARDOWN_ORDER:
        destroy = shim.destroyers[kind]
        for struct, obj in handles.items(kind):
            if shim.address(struct.context) == me:
                gone.append((struct, obj))
                destroy(struct)
    return gone
