"""pyverbs.utils: the string helpers."""

import struct

from ..errors import PyverbsUserError
from . import enums as e  # noqa: F401

be64toh = lambda num: struct.unpack("Q", struct.pack("!Q", num))[0]  # noqa: E731


def gid_str(subnet_prefix: int, interface_id: int) -> str:
    h = "%016x%016x" % (be64toh(subnet_prefix), be64toh(interface_id))
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def gid_str_to_array(val: str) -> list:
    parts = val.split(":")
    if len(parts) != 8 or any(len(p) != 4 for p in parts):
        raise PyverbsUserError(f"Invalid GID value ({parts})")
    return [p[i:i + 2] for p in parts for i in (0, 2)]


def qp_type_to_str(qp_type: int) -> str:
    return {2: "RC", 3: "UC", 4: "UD", 8: "Raw Packet", 9: "XRCD_SEND", 10: "XRCD_RECV",
            0xff: "Driver QP"}.get(qp_type, f"Unknown ({qp_type})")


def qp_state_to_str(qp_state: int) -> str:
    return {0: "Reset", 1: "Init", 2: "RTR", 3: "RTS", 4: "SQD", 5: "SQE", 6: "Error",
            7: "Unknown"}.get(qp_state, f"Unknown ({qp_state})")


def mtu_to_str(mtu: int) -> int:
    return {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}.get(mtu, 0)


def access_flags_to_str(flags: int) -> str:
    names = {1: "Local write", 2: "Remote write", 4: "Remote read", 8: "Remote atomic",
             16: "MW bind", 32: "Zero based", 64: "On demand"}
    return "".join(n + " " for f, n in names.items() if flags & f)


def mig_state_to_str(mig: int) -> str:
    return {0: "Migrated", 1: "Re-arm", 2: "Armed"}.get(mig, "Unknown")


def rereg_error_to_str(val: int) -> str:
    return {-1: "IBV_REREG_MR_ERR_INPUT", -2: "IBV_REREG_MR_ERR_DONT_FORK_NEW",
            -3: "IBV_REREG_MR_ERR_DO_FORK_OLD", -4: "IBV_REREG_MR_ERR_CMD",
            -5: "IBV_REREG_MR_ERR_CMD_AND_DO_FORK_NEW"}.get(val, f"Unknown error ({val})")
