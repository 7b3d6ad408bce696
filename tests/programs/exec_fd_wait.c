/* A program that waits for a completion the way an event-driven server does: it arms its
 * CQ and sleeps in poll() on the completion channel's descriptor -- in C, calling no verb,
 * so only the soft device's progress thread can deliver what arrives -- then takes the
 * event with ibv_get_cq_event and the completion with ibv_poll_cq.
 *
 * The exchange goes through stdin/stdout (tests/test_exec_verbs.py relays it to a peer):
 * it prints "QPN PSN GID" (hex), reads the peer's "QPN PSN GID", connects an RC QP, posts
 * a receive, arms the CQ, prints "ready" and waits for the peer's SEND.
 */
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

#define FAIL(...) do { printf("FAIL "); printf(__VA_ARGS__); printf("\n"); exit(1); } while (0)

int main(void)
{
	int num;
	struct ibv_device **list = ibv_get_device_list(&num);
	if (!list || !num)
		FAIL("no device");
	struct ibv_context *ctx = ibv_open_device(list[0]);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	char *buf = calloc(1, 4096);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, ch, 0);
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1,
			 .max_recv_sge = 1 } };
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	union ibv_gid gid;
	if (!mr || !cq || !qp || ibv_query_gid(ctx, 1, 1, &gid))
		FAIL("setup");
	printf("%06x %06x ", qp->qp_num, 0x123456);
	for (int i = 0; i < 16; i++)
		printf("%02x", gid.raw[i]);
	printf("\n");
	fflush(stdout);

	unsigned rqpn, rpsn;
	char hex[33];
	union ibv_gid rgid;
	if (scanf("%x %x %32s", &rqpn, &rpsn, hex) != 3)
		FAIL("no peer address on stdin");
	for (int i = 0; i < 16; i++)
		sscanf(hex + 2 * i, "%2hhx", &rgid.raw[i]);
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
			  IBV_QP_ACCESS_FLAGS))
		FAIL("INIT");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = rqpn;
	a.rq_psn = rpsn;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = rgid;
	a.ah_attr.grh.sgid_index = 1;
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.port_num = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
			  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		FAIL("RTR");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = 0x123456;
	a.max_rd_atomic = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
			  IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		FAIL("RTS");

	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 4096, .lkey = mr->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 7, .sg_list = &sge, .num_sge = 1 }, *bad;
	if (ibv_post_recv(qp, &rwr, &bad) || ibv_req_notify_cq(cq, 0))
		FAIL("post_recv / req_notify_cq");
	printf("ready\n");
	fflush(stdout);

	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	int n = poll(&p, 1, 60000);
	if (n != 1 || !(p.revents & POLLIN))
		FAIL("poll on the channel fd returned %d", n);
	struct ibv_cq *ev_cq;
	void *ev_ctx;
	if (ibv_get_cq_event(ch, &ev_cq, &ev_ctx) || ev_cq != cq)
		FAIL("ibv_get_cq_event");
	ibv_ack_cq_events(cq, 1);
	struct ibv_wc wc;
	if (ibv_poll_cq(cq, 1, &wc) != 1 || wc.status != IBV_WC_SUCCESS || wc.wr_id != 7)
		FAIL("completion");
	printf("OK %u %.*s\n", wc.byte_len, (int)wc.byte_len, buf);
	fflush(stdout);
	ibv_destroy_qp(qp);
	ibv_destroy_cq(cq);
	ibv_destroy_comp_channel(ch);
	ibv_dereg_mr(mr);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(list);
	return 0;
}
