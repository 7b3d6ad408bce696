"""librdmacm's examples/rdma_client.c on softrdma.rdmacm's synchronous API, step by step:
rdma_getaddrinfo + rdma_create_ep (resolves address and route) with a 1-WR RC QP (16 bytes
inline, sq_sig_all), rdma_reg_msgs, rdma_post_recv of 16 bytes, rdma_connect (returns on
ESTABLISHED), rdma_post_send of the 16-byte send_msg (zeros, as the C program never fills
it) inline, wait for the send completion, then the receive, rdma_disconnect, destroy.

Prints "rdma_client: start" and "rdma_client: end <ret>" as the C program does. One
addition, so a test can see the data: a failed send, or a receive that is not a successful
16-byte message of zeros (what rdma_server.c sends back), makes ret -1.

Usage: rdma_client.py -s server_address [-p port_number]  (7471)
"""

from __future__ import annotations

import argparse
import sys

from softrdma.errors import PyverbsRDMAError
from softrdma.rdmacm import RDMA_PS_TCP, AddrInfo, CMID
from softrdma.verbs_api import QPCap, QPInitAttr
from softrdma.verbs_api.enums import IBV_QPT_RC, ibv_qp_attr_mask, ibv_send_flags

MSG = 16


def run(server: str, port: str) -> int:
    try:
        res = AddrInfo(dst=server, dst_service=port, port_space=RDMA_PS_TCP)
    except PyverbsRDMAError as e:
        print(f"rdma_getaddrinfo: {e}")
        return -1
    init = QPInitAttr(qp_type=IBV_QPT_RC, cap=QPCap(max_send_wr=1, max_recv_wr=1,
                                                    max_send_sge=1, max_recv_sge=1,
                                                    max_inline_data=MSG), sq_sig_all=1)
    try:
        cid = CMID(res, init)
    except PyverbsRDMAError as e:
        print(f"rdma_create_ep: {e}", file=sys.stderr)
        return -1
    ret = 0
    try:
        _, qp_init = cid.query_qp(ibv_qp_attr_mask.IBV_QP_CAP)
        send_flags = 0
        if qp_init.cap.max_inline_data >= MSG:
            send_flags = int(ibv_send_flags.IBV_SEND_INLINE)
        else:
            print("rdma_client: device doesn't support IBV_SEND_INLINE, using sge sends")
        recv_mr = cid.reg_msgs(MSG)
        send_mr = cid.reg_msgs(MSG)
        cid.post_recv(recv_mr, MSG)
        cid.connect(None)
        try:
            cid.post_send(send_mr, send_flags, MSG)
            wc = cid.get_send_comp()
            if wc.status:
                print(f"rdma_get_send_comp: status {wc.status}", file=sys.stderr)
                ret = -1
            else:
                wc = cid.get_recv_comp()
                if wc.status or wc.byte_len != MSG or recv_mr.read(MSG, 0) != bytes(MSG):
                    print(f"rdma_client: bad receive: status {wc.status} len {wc.byte_len} "
                          f"data {recv_mr.read(MSG, 0).hex()}", file=sys.stderr)
                    ret = -1
        finally:
            cid.disconnect()
    except PyverbsRDMAError as e:
        print(f"rdma_client: {e}", file=sys.stderr)
        ret = -1
    finally:
        cid.close()
    return ret


def main() -> int:
    p = argparse.ArgumentParser(prog="rdma_client", description=__doc__.split("\n\n")[0])
    p.add_argument("-s", dest="server", default="127.0.0.1")
    p.add_argument("-p", dest="port", default="7471")
    a = p.parse_args()
    print("rdma_client: start", flush=True)
    ret = run(a.server, a.port)
    print(f"rdma_client: end {ret}", flush=True)
    return ret & 0xFF


if __name__ == "__main__":
    sys.exit(main())
