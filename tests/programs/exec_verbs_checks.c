/* Checks of softrdma exec's core verbs from an ordinary libibverbs program (built with
 * gcc against Debian's headers and -libverbs, run under `softrdma exec`): two RC QPs of one
 * context connected to each other through the device's own GID.
 *
 * Prints "OK <name>" per check passed, "FAIL <name>: ..." and exits 1 at the first failure.
 * tests/test_exec_verbs.py runs it and reads the lines.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

#define SZ 4096
#define FAIL(name, ...) do { printf("FAIL %s: ", name); printf(__VA_ARGS__); printf("\n"); \
                             fflush(stdout); exit(1); } while (0)
#define OK(name) do { printf("OK %s\n", name); fflush(stdout); } while (0)

static struct ibv_cq *cq;

static struct ibv_wc wait_wc(const char *name)
{
	struct ibv_wc wc;
	for (long i = 0; i < 200000000L; i++) {
		int n = ibv_poll_cq(cq, 1, &wc);
		if (n < 0)
			FAIL(name, "ibv_poll_cq returned %d", n);
		if (n == 1)
			return wc;
	}
	FAIL(name, "no completion");
}

static void connect_qp(struct ibv_qp *qp, uint32_t dest, union ibv_gid *gid)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1,
		.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
			  IBV_QP_ACCESS_FLAGS))
		FAIL("modify_qp", "to INIT");
	if (qp->state != IBV_QPS_INIT)
		FAIL("qp_state", "qp->state %d after INIT", qp->state);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = dest;
	a.rq_psn = 0;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = *gid;
	a.ah_attr.grh.sgid_index = 1;
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.port_num = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
			  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		FAIL("modify_qp", "to RTR");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = 0;
	a.max_rd_atomic = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
			  IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		FAIL("modify_qp", "to RTS");
}

int main(void)
{
	int num;
	struct ibv_device **list = ibv_get_device_list(&num);
	if (!list || !num)
		FAIL("device", "no device");
	struct ibv_context *ctx = ibv_open_device(list[0]);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	char *a = calloc(1, SZ), *b = calloc(1, SZ);
	int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	struct ibv_mr *mra = ibv_reg_mr(pd, a, SZ, acc), *mrb = ibv_reg_mr(pd, b, SZ, acc);
	if (!ctx || !pd || !mra || !mrb)
		FAIL("setup", "open/alloc_pd/reg_mr failed (errno %d)", errno);
	if (mra->addr != a || mra->length != SZ || mra->pd != pd || mra->lkey == mrb->lkey)
		FAIL("reg_mr", "struct ibv_mr fields");
	OK("reg_mr");

	int r = ibv_dealloc_pd(pd);
	if (r != EBUSY)
		FAIL("dealloc_pd_busy", "ibv_dealloc_pd with MRs returned %d, not EBUSY", r);
	OK("dealloc_pd_busy");

	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	cq = ibv_create_cq(ctx, 64, (void *)0x1234, ch, 0);
	if (!ch || !cq || cq->cqe < 64 || cq->cq_context != (void *)0x1234)
		FAIL("create_cq", "channel/cq");
	if (fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK))
		FAIL("channel_fd", "fcntl on the channel fd: errno %d", errno);
	struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
	if (poll(&pfd, 1, 0) != 0)
		FAIL("channel_fd", "readable with no event");
	struct ibv_cq *ev_cq;
	void *ev_ctx;
	errno = 0;
	if (ibv_get_cq_event(ch, &ev_cq, &ev_ctx) != -1 || errno != EAGAIN)
		FAIL("channel_nonblock", "ibv_get_cq_event on an empty O_NONBLOCK channel: errno %d",
		     errno);
	OK("channel_nonblock");

	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1,
			 .max_recv_sge = 1 } };
	struct ibv_qp *qa = ibv_create_qp(pd, &ia), *qb = ibv_create_qp(pd, &ia);
	if (!qa || !qb || qa->qp_num == qb->qp_num || qa->state != IBV_QPS_RESET ||
	    qa->send_cq != cq || qa->pd != pd)
		FAIL("create_qp", "struct ibv_qp fields");
	union ibv_gid gid;
	if (ibv_query_gid(ctx, 1, 1, &gid))
		FAIL("query_gid", "index 1");
	connect_qp(qa, qb->qp_num, &gid);
	connect_qp(qb, qa->qp_num, &gid);
	struct ibv_qp_attr qattr;
	struct ibv_qp_init_attr qinit;
	if (qa->state != IBV_QPS_RTS || ibv_query_qp(qa, &qattr, IBV_QP_STATE, &qinit) ||
	    qattr.qp_state != IBV_QPS_RTS || qattr.dest_qp_num != qb->qp_num ||
	    qinit.send_cq != cq || qinit.qp_type != IBV_QPT_RC)
		FAIL("qp_state", "RTS: state %d", qa->state);
	OK("qp_state");

	/* RDMA WRITE: a's bytes land in b, the program's own memory */
	for (int i = 0; i < SZ; i++)
		a[i] = (char)(i * 7 + 3);
	struct ibv_sge sge = { .addr = (uintptr_t)a, .length = SZ, .lkey = mra->lkey };
	struct ibv_send_wr wr = { .wr_id = 11, .sg_list = &sge, .num_sge = 1,
		.opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED }, *bad = NULL;
	wr.wr.rdma.remote_addr = (uintptr_t)b;
	wr.wr.rdma.rkey = mrb->rkey;
	if ((r = ibv_post_send(qa, &wr, &bad)))
		FAIL("rdma_write", "post_send %d", r);
	struct ibv_wc wc = wait_wc("rdma_write");
	if (wc.status != IBV_WC_SUCCESS || wc.wr_id != 11 || wc.opcode != IBV_WC_RDMA_WRITE ||
	    wc.qp_num != qa->qp_num)
		FAIL("rdma_write", "wc status %d wr_id %llu", wc.status,
		     (unsigned long long)wc.wr_id);
	if (memcmp(a, b, SZ))
		FAIL("rdma_write", "the bytes did not land in the target buffer");
	OK("rdma_write");

	/* RDMA READ: b's bytes (changed by the program) come back into a */
	for (int i = 0; i < SZ; i++)
		b[i] = (char)(i * 13 + 1);
	wr.wr_id = 12;
	wr.opcode = IBV_WR_RDMA_READ;
	if ((r = ibv_post_send(qa, &wr, &bad)))
		FAIL("rdma_read", "post_send %d", r);
	wc = wait_wc("rdma_read");
	if (wc.status != IBV_WC_SUCCESS || wc.wr_id != 12 || wc.byte_len != SZ ||
	    memcmp(a, b, SZ))
		FAIL("rdma_read", "status %d, or the bytes read differ", wc.status);
	OK("rdma_read");

	/* SEND with immediate: imm_data arrives as the bytes sent (network order) */
	struct ibv_sge rsge = { .addr = (uintptr_t)b, .length = 64, .lkey = mrb->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 21, .sg_list = &rsge, .num_sge = 1 }, *rbad;
	if ((r = ibv_post_recv(qb, &rwr, &rbad)))
		FAIL("send_imm", "post_recv %d", r);
	sge.length = 64;
	wr.wr_id = 13;
	wr.opcode = IBV_WR_SEND_WITH_IMM;
	wr.imm_data = htobe32(0x01020304);
	if ((r = ibv_post_send(qa, &wr, &bad)))
		FAIL("send_imm", "post_send %d", r);
	int seen = 0;
	for (int k = 0; k < 2; k++) {
		wc = wait_wc("send_imm");
		if (wc.status != IBV_WC_SUCCESS)
			FAIL("send_imm", "status %d", wc.status);
		if (wc.opcode == IBV_WC_RECV) {
			if (wc.wr_id != 21 || wc.byte_len != 64 || !(wc.wc_flags & IBV_WC_WITH_IMM) ||
			    be32toh(wc.imm_data) != 0x01020304 || wc.qp_num != qb->qp_num)
				FAIL("send_imm", "recv wc: imm 0x%x flags 0x%x", be32toh(wc.imm_data),
				     wc.wc_flags);
			seen |= 1;
		} else {
			seen |= 2;
		}
	}
	if (seen != 3)
		FAIL("send_imm", "completions %d", seen);
	OK("send_imm");

	/* a chain whose second WR has more SGEs than the QP allows: EINVAL, bad_wr is the
	 * second, the first is posted (and completes) */
	struct ibv_sge sges[4] = { sge, sge, sge, sge };
	struct ibv_send_wr w2 = { .wr_id = 15, .sg_list = sges, .num_sge = 4,
		.opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED };
	w2.wr.rdma = wr.wr.rdma;
	wr.wr_id = 14;
	wr.opcode = IBV_WR_RDMA_WRITE;
	wr.next = &w2;
	bad = NULL;
	r = ibv_post_send(qa, &wr, &bad);
	if (r != EINVAL || bad != &w2)
		FAIL("bad_wr", "returned %d (EINVAL is %d), bad_wr %s", r, EINVAL,
		     bad == &w2 ? "the second WR" : bad == &wr ? "the first WR" : "other");
	wc = wait_wc("bad_wr");
	if (wc.wr_id != 14 || wc.status != IBV_WC_SUCCESS)
		FAIL("bad_wr", "the WR before the bad one: wr_id %llu status %d",
		     (unsigned long long)wc.wr_id, wc.status);
	wr.next = NULL;
	OK("bad_wr");

	/* a completion event: arm, post, the channel's fd becomes readable (poll), the event
	 * names the CQ and its context */
	if (ibv_req_notify_cq(cq, 0))
		FAIL("cq_event", "req_notify_cq");
	wr.wr_id = 16;
	if ((r = ibv_post_send(qa, &wr, &bad)))
		FAIL("cq_event", "post_send %d", r);
	if (poll(&pfd, 1, 20000) != 1 || !(pfd.revents & POLLIN))
		FAIL("cq_event", "the channel fd did not become readable");
	if (ibv_get_cq_event(ch, &ev_cq, &ev_ctx) || ev_cq != cq || ev_ctx != (void *)0x1234)
		FAIL("cq_event", "ibv_get_cq_event");
	if (poll(&pfd, 1, 0) != 0)
		FAIL("cq_event", "still readable after the event was read");
	ibv_ack_cq_events(cq, 1);
	wc = wait_wc("cq_event");
	if (wc.wr_id != 16)
		FAIL("cq_event", "wr_id %llu", (unsigned long long)wc.wr_id);
	OK("cq_event");

	/* a wrong lkey is found when the data moves (as rxe): an error completion */
	sge.lkey = mra->lkey ^ 0x5500;
	wr.wr_id = 17;
	if ((r = ibv_post_send(qa, &wr, &bad)))
		FAIL("bad_lkey", "post_send %d", r);
	wc = wait_wc("bad_lkey");
	if (wc.wr_id != 17 || wc.status != IBV_WC_LOC_PROT_ERR)
		FAIL("bad_lkey", "status %d (%s)", wc.status, ibv_wc_status_str(wc.status));
	OK("bad_lkey");

	/* destroy rules: a CQ a QP uses, a channel a CQ uses, are busy */
	if ((r = ibv_destroy_cq(cq)) != EBUSY)
		FAIL("destroy_busy", "destroy_cq with QPs: %d", r);
	if ((r = ibv_destroy_comp_channel(ch)) == 0)
		FAIL("destroy_busy", "destroy_comp_channel with a CQ succeeded");
	OK("destroy_busy");
	while (ibv_poll_cq(cq, 1, &wc) > 0)
		;
	if (ibv_destroy_qp(qa) || ibv_destroy_qp(qb) || ibv_destroy_cq(cq) ||
	    ibv_destroy_comp_channel(ch) || ibv_dereg_mr(mra) || ibv_dereg_mr(mrb) ||
	    ibv_dealloc_pd(pd) || ibv_close_device(ctx))
		FAIL("teardown", "errno %d", errno);
	ibv_free_device_list(list);
	OK("teardown");
	return 0;
}
