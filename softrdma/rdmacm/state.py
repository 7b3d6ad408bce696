"""The rdma_cm id's state machine as data: Linux's transitions, one function to take one.

The kernel keeps an rdma_cm id's state (``enum rdma_cm_state``, :class:`RdmaCmState`) in
``rdma_id_private.state`` and moves it almost only with ``cma_comp_exch(id, from, to)``:
"if the state is ``from``, make it ``to``", which fails (the call returns ``-EINVAL``, an
event handler drops the event) in any other state. Every such call site of
drivers/infiniband/core/cma.c is a row of :data:`TRANSITIONS`, named by the step that
makes it; the few direct assignments are rows too (a new connection's id is born in
CONNECT, destroy and device removal take any state).

:func:`next_state` reads the table and refuses a step the current state does not allow
with cma.c's errno; :meth:`RdmaCmId._move <softrdma.rdmacm.cm_id.RdmaCmId._move>` is the
only place an id's state is written. softrdma resolves addresses and RoCE routes at once,
so an id passes through ADDR_QUERY and ROUTE_QUERY inside one call, as the kernel's id
does between the call and its work item. rdma_cm has no ESTABLISHED state: a connected id
stays in CONNECT until a DREQ or DREP moves it to DISCONNECT.
"""

from __future__ import annotations

import errno

from ..errors import PyverbsRDMAError
from .enums import RdmaCmState

__all__ = ["TRANSITIONS", "next_state", "RdmaCmState"]

S = RdmaCmState

#: step -> {state it is allowed in: state it leads to}, from cma.c (function, then what).
TRANSITIONS: dict[str, dict[RdmaCmState, RdmaCmState]] = {
    # rdma_bind_addr_dst: bind, and undo on error
    "bind_addr": {S.IDLE: S.ADDR_BOUND},
    "bind_addr_failed": {S.ADDR_BOUND: S.IDLE},
    # resolve_prepare_src (rdma_resolve_addr, after binding an IDLE id), undone on error
    "resolve_addr": {S.ADDR_BOUND: S.ADDR_QUERY},
    "resolve_addr_failed": {S.ADDR_QUERY: S.ADDR_BOUND},
    # addr_handler / enqueue_resolve_addr_work: the address is known; addr_handler's
    # failure path goes on back to ADDR_BOUND (RDMA_CM_EVENT_ADDR_ERROR)
    "addr_resolved": {S.ADDR_QUERY: S.ADDR_RESOLVED},
    "addr_error": {S.ADDR_RESOLVED: S.ADDR_BOUND},
    # rdma_resolve_route, undone on error; cma_init_resolve_route_work (ROUTE_RESOLVED)
    # and cma_query_handler's failure (ROUTE_ERROR)
    "resolve_route": {S.ADDR_RESOLVED: S.ROUTE_QUERY},
    "resolve_route_failed": {S.ROUTE_QUERY: S.ADDR_RESOLVED},
    "route_resolved": {S.ROUTE_QUERY: S.ROUTE_RESOLVED},
    "route_error": {S.ROUTE_QUERY: S.ADDR_RESOLVED},
    # rdma_set_ib_path, undone on error (softrdma has no rdma_set_ib_path: RoCE only)
    "set_ib_path": {S.ADDR_RESOLVED: S.ROUTE_RESOLVED},
    "set_ib_path_failed": {S.ROUTE_RESOLVED: S.ADDR_RESOLVED},
    # rdma_listen (an IDLE id is bound to the wildcard first), undone on error
    "listen": {S.ADDR_BOUND: S.LISTEN},
    "listen_failed": {S.LISTEN: S.ADDR_BOUND},
    # rdma_connect_locked, undone on error
    "connect": {S.ROUTE_RESOLVED: S.CONNECT},
    "connect_failed": {S.CONNECT: S.ROUTE_RESOLVED},
    # cma_ib_new_conn_id / cma_ib_new_udp_id: the id a REQ or SIDR_REQ makes
    "conn_request": {S.IDLE: S.CONNECT},
    # cma_ib_handler on DREQ_RECEIVED, DREP_RECEIVED, DREQ_ERROR (DISCONNECTED)
    "disconnected": {S.CONNECT: S.DISCONNECT},
    # cma_send_device_removal_put (softrdma devices are not removed under an id)
    "device_removal": {s: S.DEVICE_REMOVAL for s in S
                       if s not in (S.DESTROYING, S.DEVICE_REMOVAL)},
    # destroy_id_handler_unlock: rdma_destroy_id from any state, once
    "destroy": {s: S.DESTROYING for s in S if s != S.DESTROYING},
}


def next_state(step: str, state: RdmaCmState, what: str = "") -> RdmaCmState:
    """The state ``step`` leads to from ``state``; EINVAL (what ``cma_comp_exch``'s
    callers return) naming the call, the step and the states it needs otherwise."""
    to = TRANSITIONS[step].get(state)
    if to is None:
        need = " or ".join(s.name for s in TRANSITIONS[step])
        raise PyverbsRDMAError(f"{what or step}: the id is in state {state.name}, not "
                               f"{need} ({step})", errno.EINVAL)
    return to
