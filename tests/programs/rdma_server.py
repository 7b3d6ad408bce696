"""librdmacm's examples/rdma_server.c on softrdma.rdmacm's synchronous API, step by step:
rdma_getaddrinfo(RAI_PASSIVE) + rdma_create_ep with a 1-WR RC QP (16 bytes inline,
sq_sig_all), rdma_listen, rdma_get_request, rdma_reg_msgs, rdma_post_recv of 16 bytes,
rdma_accept, wait for the receive, rdma_post_send of the 16-byte send_msg (zeros, as the C
program never fills it) inline, wait for its completion, rdma_disconnect, destroy.

Prints "rdma_server: start" and "rdma_server: end <ret>" as the C program does. One
addition, so a test can see the data: a receive that is not a successful 16-byte message of
zeros (what rdma_client.c sends) or a failed send makes ret -1 (the C program does not look
at its completions' status).

Usage: rdma_server.py [-s server_address] [-p port_number]  (7471; the softrdma device is
the one SOFTRDMA_IP names, as for every softrdma program)
"""

from __future__ import annotations

import argparse
import sys

from softrdma.errors import PyverbsRDMAError
from softrdma.rdmacm import RAI_PASSIVE, RDMA_PS_TCP, AddrInfo, CMID
from softrdma.verbs_api import QPCap, QPInitAttr
from softrdma.verbs_api.enums import IBV_QPT_RC, ibv_qp_attr_mask, ibv_send_flags

MSG = 16


def run(server: str | None, port: str) -> int:
    try:
        res = AddrInfo(src=server, src_service=port, port_space=RDMA_PS_TCP,
                       flags=RAI_PASSIVE)
    except PyverbsRDMAError as e:
        print(f"rdma_getaddrinfo: {e}")
        return -1
    init = QPInitAttr(qp_type=IBV_QPT_RC, cap=QPCap(max_send_wr=1, max_recv_wr=1,
                                                    max_send_sge=1, max_recv_sge=1,
                                                    max_inline_data=MSG), sq_sig_all=1)
    try:
        listen_id = CMID(res, init)
    except PyverbsRDMAError as e:
        print(f"rdma_create_ep: {e}", file=sys.stderr)
        return -1
    try:
        listen_id.listen(0)
        conn = listen_id.get_request()
        try:
            _, qp_init = conn.query_qp(ibv_qp_attr_mask.IBV_QP_CAP)
            send_flags = 0
            if qp_init.cap.max_inline_data >= MSG:
                send_flags = int(ibv_send_flags.IBV_SEND_INLINE)
            else:
                print("rdma_server: device doesn't support IBV_SEND_INLINE, using sge sends")
            recv_mr = conn.reg_msgs(MSG)
            send_mr = conn.reg_msgs(MSG)  # send_msg: zeros; with inline, its bytes are copied
            conn.post_recv(recv_mr, MSG)
            conn.accept(None)
            ret = 0
            try:
                wc = conn.get_recv_comp()
                if wc.status or wc.byte_len != MSG or recv_mr.read(MSG, 0) != bytes(MSG):
                    print(f"rdma_server: bad receive: status {wc.status} len {wc.byte_len} "
                          f"data {recv_mr.read(MSG, 0).hex()}", file=sys.stderr)
                    ret = -1
                conn.post_send(send_mr, send_flags, MSG)  # sq_sig_all: signaled anyway
                wc = conn.get_send_comp()
                if wc.status:
                    print(f"rdma_get_send_comp: status {wc.status}", file=sys.stderr)
                    ret = -1
            finally:
                conn.disconnect()
        finally:
            conn.close()
    except PyverbsRDMAError as e:
        print(f"rdma_server: {e}", file=sys.stderr)
        ret = -1
    finally:
        listen_id.close()
    return ret


def main() -> int:
    p = argparse.ArgumentParser(prog="rdma_server", description=__doc__.split("\n\n")[0])
    p.add_argument("-s", dest="server", default=None)
    p.add_argument("-p", dest="port", default="7471")
    a = p.parse_args()
    print("rdma_server: start", flush=True)
    ret = run(a.server, a.port)
    print(f"rdma_server: end {ret}", flush=True)
    return ret & 0xFF


if __name__ == "__main__":
    sys.exit(main())
