"""Finding and opening libibverbs devices.

``ibv_get_device_list`` is called for each listing or open and its list freed at once
(an opened context does not need it). No library, or a machine without RDMA devices
(``ibv_get_device_list`` returns NULL with ENOSYS, or an empty list), simply gives no
devices: :func:`why_none` says which, for an error message when the ibverbs backend was
asked for explicitly.
"""

from __future__ import annotations

import ctypes
import errno
from dataclasses import dataclass

from ..errors import PyverbsRDMAError
from . import ffi

__all__ = ["HwDeviceInfo", "list_devices", "open_device", "why_none", "byteswap64"]


def byteswap64(v: int) -> int:
    """A ``__be64`` read as a host integer, turned into the number it stands for."""
    return int.from_bytes(v.to_bytes(8, "little"), "big")


@dataclass(frozen=True)
class HwDeviceInfo:
    name: str
    guid: int  # the node GUID as a number (5054:00ff:fe00:0011 -> 0x505400fffe000011)
    node_type: int
    transport_type: int


def _with_list(fn):  # noqa: ANN001, ANN202
    """Call ``fn([ibv_device*...])`` on a fresh device list, freeing it afterwards."""
    lib = ffi.lib()
    if lib is None:
        return fn([])
    n = ctypes.c_int(0)
    lst = lib.ibv_get_device_list(ctypes.byref(n))
    if not lst:
        return fn([])
    try:
        return fn(list((ctypes.c_void_p * n.value).from_address(lst)))
    finally:
        lib.ibv_free_device_list(lst)


def list_devices() -> list[HwDeviceInfo]:
    """The devices libibverbs finds (none without the library or without devices)."""
    def info(devs: list[int]) -> list[HwDeviceInfo]:
        lib = ffi.lib()
        out = []
        for d in devs:
            s = ffi.ibv_device.from_address(d)
            out.append(HwDeviceInfo(lib.ibv_get_device_name(d).decode(),
                                    byteswap64(lib.ibv_get_device_guid(d)),
                                    s.node_type, s.transport_type))
        return out
    return _with_list(info)


def why_none() -> str:
    """Why there is no device: the library is missing, or it finds none."""
    if ffi.lib() is None:
        return ffi.load_error() or "libibverbs cannot be loaded"
    n = ctypes.c_int(0)
    lst = ffi.lib().ibv_get_device_list(ctypes.byref(n))
    err = ctypes.get_errno()
    if lst:
        ffi.lib().ibv_free_device_list(lst)
        return f"libibverbs lists {n.value} device(s)"
    return f"libibverbs finds no RDMA device ({errno.errorcode.get(err, err)})"


def open_device(name: str | None) -> tuple[int, str]:
    """``ibv_open_device`` of the device called ``name`` (None: the first one): the
    ``ibv_context*`` as an int, and the device's name. ENODEV naming the reason when there
    is no such device; the errno of ibv_open_device if it fails."""
    what = f"Failed to open device {name}" if name else "Failed to open device"

    def open_(devs: list[int]) -> tuple[int, str]:
        lib = ffi.lib()
        if not devs:
            raise PyverbsRDMAError(f"{what}: {why_none()}", errno.ENODEV)
        for d in devs:
            dname = lib.ibv_get_device_name(d).decode()
            if name is None or dname == name:
                ctx = lib.ibv_open_device(d)
                if not ctx:
                    raise PyverbsRDMAError(what, ctypes.get_errno() or errno.ENODEV)
                return ctx, dname
        names = ", ".join(lib.ibv_get_device_name(d).decode() for d in devs)
        raise PyverbsRDMAError(f"{what}: no such libibverbs device (there are: {names})",
                               errno.ENODEV)
    return _with_list(open_)
