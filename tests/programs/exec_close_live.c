/* ibv_close_device with every kind of object still alive, as a program that forgets its
 * teardown (or exits) leaves them. On Linux closing the uverbs file destroys all the
 * context's objects (libibverbs' ibv_close_device does not check), so:
 *
 *   - the QP's peer, connected to it, sees its next SEND fail (IBV_WC_RETRY_EXC_ERR);
 *   - no descriptor of the closed context stays open (channel, async_fd);
 *   - the program's stale pointers give EINVAL (where Linux would use freed memory, the
 *     exec library answers: none of these calls may crash);
 *   - the device lives on: a context opened after works.
 *
 * Two contexts on the one device: A has a PD, an MR, a memory window, an AH, a CQ on a
 * completion channel with an event got and not acknowledged, an SRQ, and an RC QP
 * connected to B's QP, with a receive posted. A is closed with all that alive.
 * Prints "OK <step>" lines and exits 0.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <infiniband/verbs.h>

#define FAIL(...) do { printf("FAIL "); printf(__VA_ARGS__); printf("\n"); exit(1); } while (0)
#define EXPECT(cond, ...) do { if (!(cond)) FAIL(__VA_ARGS__); } while (0)

static int count_fds(void)
{
	int n = 0;
	DIR *d = opendir("/proc/self/fd");
	while (readdir(d))
		n++;
	closedir(d);
	return n;
}

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

struct side {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_comp_channel *ch;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	char buf[256];
};

static void open_side(struct side *s, struct ibv_device *dev)
{
	s->ctx = ibv_open_device(dev);
	EXPECT(s->ctx, "open_device");
	s->pd = ibv_alloc_pd(s->ctx);
	s->ch = ibv_create_comp_channel(s->ctx);
	s->cq = ibv_create_cq(s->ctx, 16, NULL, s->ch, 0);
	s->mr = ibv_reg_mr(s->pd, s->buf, sizeof(s->buf), IBV_ACCESS_LOCAL_WRITE |
			   IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_MW_BIND);
	struct ibv_qp_init_attr ia = { .send_cq = s->cq, .recv_cq = s->cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1,
			 .max_recv_sge = 1 } };
	s->qp = ibv_create_qp(s->pd, &ia);
	EXPECT(s->pd && s->ch && s->cq && s->mr && s->qp, "setup");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
		.qp_access_flags = IBV_ACCESS_REMOTE_WRITE };
	EXPECT(!ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
			      IBV_QP_ACCESS_FLAGS), "INIT");
}

static void connect_to(struct side *s, struct ibv_qp *peer, union ibv_gid *gid)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024,
		.dest_qp_num = peer->qp_num, .rq_psn = 0, .max_dest_rd_atomic = 1,
		.min_rnr_timer = 12,
		.ah_attr = { .is_global = 1, .port_num = 1,
			     .grh = { .dgid = *gid, .sgid_index = 1, .hop_limit = 1 } } };
	EXPECT(!ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
			      IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
			      IBV_QP_MIN_RNR_TIMER), "RTR");
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;  /* 67 ms */
	a.retry_cnt = 3;
	a.rnr_retry = 3;
	a.sq_psn = 0;
	a.max_rd_atomic = 1;
	EXPECT(!ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
			      IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC),
	       "RTS");
}

static int post(struct side *s, int recv)
{
	struct ibv_sge sge = { .addr = (uintptr_t)s->buf, .length = 16, .lkey = s->mr->lkey };
	if (recv) {
		struct ibv_recv_wr wr = { .wr_id = 2, .sg_list = &sge, .num_sge = 1 }, *bad;
		return ibv_post_recv(s->qp, &wr, &bad);
	}
	struct ibv_send_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1,
		.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;
	return ibv_post_send(s->qp, &wr, &bad);
}

/* the next completion of s's CQ (busy-polling up to `secs`); its status */
static int next_wc(struct side *s, double secs, double *took)
{
	struct ibv_wc wc;
	double t0 = now();
	while (now() - t0 < secs) {
		int n = ibv_poll_cq(s->cq, 1, &wc);
		EXPECT(n >= 0, "poll_cq %d", n);
		if (n) {
			if (took)
				*took = now() - t0;
			return wc.status;
		}
	}
	FAIL("no completion within %.0f s", secs);
}

int main(void)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	EXPECT(list && list[0], "no device");
	struct side a, b;
	union ibv_gid gid;
	open_side(&b, list[0]);
	int fds = count_fds();
	open_side(&a, list[0]);
	EXPECT(!ibv_query_gid(a.ctx, 1, 1, &gid), "query_gid");
	connect_to(&a, b.qp, &gid);
	connect_to(&b, a.qp, &gid);

	/* the pair works: a's SEND lands in b's receive */
	EXPECT(!post(&b, 1) && !ibv_req_notify_cq(a.cq, 0) && !post(&a, 0), "post");
	EXPECT(next_wc(&b, 30, NULL) == IBV_WC_SUCCESS, "b's receive");
	struct ibv_cq *ev_cq;
	void *ev_ctx;
	EXPECT(!ibv_get_cq_event(a.ch, &ev_cq, &ev_ctx) && ev_cq == a.cq, "cq event");
	EXPECT(next_wc(&a, 30, NULL) == IBV_WC_SUCCESS, "a's send");
	printf("OK connected\n");

	/* everything else a context can hold, left alive */
	struct ibv_srq_init_attr sa = { .attr = { .max_wr = 4, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(a.pd, &sa);
	struct ibv_mw *mw = ibv_alloc_mw(a.pd, IBV_MW_TYPE_1);
	struct ibv_ah_attr aa = { .is_global = 1, .port_num = 1,
		.grh = { .dgid = gid, .sgid_index = 1, .hop_limit = 1 } };
	struct ibv_ah *ah = ibv_create_ah(a.pd, &aa);
	EXPECT(srq && mw && ah, "srq, mw, ah");
	EXPECT(!post(&a, 1), "a's receive");

	/* the CQ event is not acknowledged: ibv_destroy_cq would be EBUSY, closing is not */
	EXPECT(ibv_close_device(a.ctx) == 0, "close_device: %s", strerror(errno));
	printf("OK closed\n");
	EXPECT(count_fds() == fds, "descriptors: %d after, %d before", count_fds(), fds);
	printf("OK descriptors\n");

	/* every stale pointer is EINVAL, none crashes */
	struct ibv_wc wc;
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qia;
	struct ibv_device_attr da;
	EXPECT(post(&a, 0) == EINVAL, "post_send");
	EXPECT(post(&a, 1) == EINVAL, "post_recv");
	EXPECT(ibv_poll_cq(a.cq, 1, &wc) < 0, "poll_cq");
	EXPECT(ibv_req_notify_cq(a.cq, 0) == EINVAL, "req_notify_cq");
	EXPECT(ibv_query_qp(a.qp, &qa, IBV_QP_STATE, &qia) == EINVAL, "query_qp");
	EXPECT(ibv_get_cq_event(a.ch, &ev_cq, &ev_ctx) == -1 && errno == EINVAL, "get_cq_event");
	ibv_ack_cq_events(a.cq, 1);
	EXPECT(ibv_destroy_qp(a.qp) == EINVAL, "destroy_qp");
	EXPECT(ibv_destroy_srq(srq) == EINVAL, "destroy_srq");
	EXPECT(ibv_destroy_cq(a.cq) == EINVAL, "destroy_cq");
	EXPECT(ibv_destroy_ah(ah) == EINVAL, "destroy_ah");
	EXPECT(ibv_dealloc_mw(mw) == EINVAL, "dealloc_mw");
	EXPECT(ibv_dereg_mr(a.mr) == EINVAL, "dereg_mr");
	EXPECT(ibv_dealloc_pd(a.pd) == EINVAL, "dealloc_pd");
	EXPECT(ibv_destroy_comp_channel(a.ch) == EINVAL, "destroy_comp_channel");
	EXPECT(!ibv_alloc_pd(a.ctx) && errno == EINVAL, "alloc_pd");
	EXPECT(ibv_query_device(a.ctx, &da) == EINVAL, "query_device");
	EXPECT(ibv_close_device(a.ctx) == -1 && errno == EINVAL, "close_device again");
	printf("OK stale\n");

	/* the peer's next SEND is never acknowledged: retries spent, an error completion
	 * (timeout 14 = 67 ms, retry_cnt 3: about 0.27 s) */
	double took;
	EXPECT(!post(&b, 0), "b's send");
	int st = next_wc(&b, 60, &took);
	EXPECT(st == IBV_WC_RETRY_EXC_ERR, "peer: status %d (%s)", st, ibv_wc_status_str(st));
	printf("OK peer %s after %.2f s\n", ibv_wc_status_str(st), took);

	/* the device lives on */
	struct side c;
	open_side(&c, list[0]);
	EXPECT(!post(&c, 1), "a new context's QP");
	EXPECT(!ibv_destroy_qp(c.qp) && !ibv_destroy_cq(c.cq) && !ibv_dereg_mr(c.mr) &&
	       !ibv_destroy_comp_channel(c.ch) && !ibv_dealloc_pd(c.pd) &&
	       !ibv_close_device(c.ctx), "a new context's teardown");
	printf("OK device\n");
	ibv_free_device_list(list);
	return 0;
}
