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
		.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
				   IBV_ACCESS_REMOTE_ATOMIC };
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
	int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
		  IBV_ACCESS_REMOTE_ATOMIC;
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

	/* inline data from memory no MR covers, with lkey 0: libibverbs ignores the lkey of
	 * an IBV_SEND_INLINE WR */
	char stackbuf[16];
	for (int i = 0; i < 16; i++)
		stackbuf[i] = (char)(0x40 + i);
	rsge.addr = (uintptr_t)b;
	rwr.wr_id = 22;
	if ((r = ibv_post_recv(qb, &rwr, &rbad)))
		FAIL("inline", "post_recv %d", r);
	struct ibv_sge isge = { .addr = (uintptr_t)stackbuf, .length = 16, .lkey = 0 };
	struct ibv_send_wr iwr = { .wr_id = 23, .sg_list = &isge, .num_sge = 1,
		.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE };
	if ((r = ibv_post_send(qa, &iwr, &bad)))
		FAIL("inline", "post_send %d", r);
	for (int k = 0; k < 2; k++)
		if ((wc = wait_wc("inline")).status != IBV_WC_SUCCESS)
			FAIL("inline", "status %d", wc.status);
	if (memcmp(b, stackbuf, 16))
		FAIL("inline", "the inline bytes did not arrive");
	OK("inline");

	/* FETCH_AND_ADD and CMP_AND_SWP on a 64-bit word of b: the old value lands in a */
	uint64_t *word = (uint64_t *)(b + 256), *old = (uint64_t *)(a + 512);
	*word = 5;
	struct ibv_sge asge = { .addr = (uintptr_t)old, .length = 8, .lkey = mra->lkey };
	struct ibv_send_wr awr = { .wr_id = 19, .sg_list = &asge, .num_sge = 1,
		.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD, .send_flags = IBV_SEND_SIGNALED };
	awr.wr.atomic.remote_addr = (uintptr_t)word;
	awr.wr.atomic.rkey = mrb->rkey;
	awr.wr.atomic.compare_add = 3;
	if ((r = ibv_post_send(qa, &awr, &bad)))
		FAIL("atomics", "post_send %d", r);
	wc = wait_wc("atomics");
	if (wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_FETCH_ADD || *old != 5 ||
	    *word != 8)
		FAIL("atomics", "fetch_add: status %d old %llu word %llu", wc.status,
		     (unsigned long long)*old, (unsigned long long)*word);
	awr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
	awr.wr.atomic.compare_add = 8;
	awr.wr.atomic.swap = 0x1122334455667788ULL;
	if ((r = ibv_post_send(qa, &awr, &bad)))
		FAIL("atomics", "post_send %d", r);
	wc = wait_wc("atomics");
	if (wc.status != IBV_WC_SUCCESS || *old != 8 || *word != 0x1122334455667788ULL)
		FAIL("atomics", "cmp_swp: status %d old %llu", wc.status, (unsigned long long)*old);
	OK("atomics");

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
	/* a chain that loops back on itself ends at the queue's depth: ENOMEM, no hang */
	struct ibv_send_wr loop = wr;
	loop.send_flags = 0;  /* unsignaled: what was posted completes silently */
	loop.next = &loop;
	bad = NULL;
	r = ibv_post_send(qa, &loop, &bad);
	if (r != ENOMEM || bad != &loop)
		FAIL("bad_wr", "a cyclic chain returned %d (ENOMEM is %d)", r, ENOMEM);
	/* the queue drains as the device moves (poll_cq drives it) */
	wr.wr_id = 24;
	for (long i = 0; (r = ibv_post_send(qa, &wr, &bad)) == ENOMEM; i++) {
		ibv_poll_cq(cq, 1, &wc);
		if (i > 100000000L)
			FAIL("bad_wr", "the send queue never drained");
	}
	if (r || (wc = wait_wc("bad_wr")).wr_id != 24 || wc.status != IBV_WC_SUCCESS)
		FAIL("bad_wr", "after the cyclic chain: %d", r);
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

	/* ibv_resize_cq: the new size in cq->cqe */
	if ((r = ibv_resize_cq(cq, 200)) || cq->cqe < 200)
		FAIL("resize_cq", "returned %d, cqe %d", r, cq->cqe);
	OK("resize_cq");

	/* ibv_rereg_mr to another buffer: the same struct, the new address, new keys; a
	 * WRITE with the new rkey lands in the new buffer */
	char *c = calloc(1, SZ);
	struct ibv_mr *before = mrb;
	if ((r = ibv_rereg_mr(mrb, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, c, SZ, acc)) ||
	    mrb != before || mrb->addr != c)
		FAIL("rereg_mr", "returned %d", r);
	wr.wr.rdma.remote_addr = (uintptr_t)c;
	wr.wr.rdma.rkey = mrb->rkey;
	wr.wr_id = 18;
	sge.length = SZ;
	if ((r = ibv_post_send(qa, &wr, &bad)))
		FAIL("rereg_mr", "post_send %d", r);
	wc = wait_wc("rereg_mr");
	if (wc.status != IBV_WC_SUCCESS || memcmp(a, c, SZ))
		FAIL("rereg_mr", "status %d, or the bytes did not land in the new buffer",
		     wc.status);
	OK("rereg_mr");

	/* an SRQ whose limit is armed: the async event comes on context->async_fd (a real
	 * descriptor poll() sees) and names the SRQ */
	struct ibv_srq_init_attr sia = { .attr = { .max_wr = 8, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &sia);
	if (!srq || sia.attr.max_wr < 8)
		FAIL("srq_limit", "create_srq");
	struct ibv_qp_init_attr sa = ia;
	sa.srq = srq;
	struct ibv_qp *qc = ibv_create_qp(pd, &sa), *qd = ibv_create_qp(pd, &ia);
	if (!qc || !qd)
		FAIL("srq_limit", "create_qp");
	connect_qp(qc, qd->qp_num, &gid);
	connect_qp(qd, qc->qp_num, &gid);
	rsge.addr = (uintptr_t)c;
	rsge.lkey = mrb->lkey;
	for (int i = 0; i < 4; i++) {
		rwr.wr_id = 30 + i;
		if ((r = ibv_post_srq_recv(srq, &rwr, &rbad)))
			FAIL("srq_limit", "post_srq_recv %d", r);
	}
	struct ibv_srq_attr sattr = { .srq_limit = 2 };
	if ((r = ibv_modify_srq(srq, &sattr, IBV_SRQ_LIMIT)))
		FAIL("srq_limit", "modify_srq %d", r);
	struct pollfd afd = { .fd = ctx->async_fd, .events = POLLIN };
	if (poll(&afd, 1, 0) != 0)
		FAIL("srq_limit", "async_fd readable before any event");
	sge.lkey = mra->lkey;
	sge.length = 64;
	wr.opcode = IBV_WR_SEND;
	for (int i = 0; i < 3; i++) {
		wr.wr_id = 40 + i;
		if ((r = ibv_post_send(qd, &wr, &bad)))
			FAIL("srq_limit", "post_send %d", r);
		for (int k = 0; k < 2; k++)
			if ((wc = wait_wc("srq_limit")).status != IBV_WC_SUCCESS)
				FAIL("srq_limit", "status %d", wc.status);
	}
	if (poll(&afd, 1, 20000) != 1)
		FAIL("srq_limit", "async_fd did not become readable");
	struct ibv_async_event ev;
	if (ibv_get_async_event(ctx, &ev) || ev.event_type != IBV_EVENT_SRQ_LIMIT_REACHED ||
	    ev.element.srq != srq)
		FAIL("srq_limit", "event %d", ev.event_type);
	ibv_ack_async_event(&ev);
	if (ibv_query_srq(srq, &sattr) || sattr.srq_limit != 0 || sattr.max_wr < 8)
		FAIL("srq_limit", "query_srq: limit %u", sattr.srq_limit);
	if ((r = ibv_destroy_srq(srq)) != EBUSY)
		FAIL("srq_limit", "destroy_srq with a QP: %d", r);
	if (ibv_destroy_qp(qc) || ibv_destroy_qp(qd) || ibv_destroy_srq(srq))
		FAIL("srq_limit", "teardown");
	OK("srq_limit");
	wr.opcode = IBV_WR_RDMA_WRITE;

	/* UD: a send through an AH, and the answer through ibv_create_ah_from_wc (the GRH the
	 * receive buffer starts with names the sender) */
	struct ibv_qp_init_attr ua_attr = ia;
	ua_attr.qp_type = IBV_QPT_UD;
	struct ibv_qp *ua = ibv_create_qp(pd, &ua_attr), *ub = ibv_create_qp(pd, &ua_attr);
	if (!ua || !ub)
		FAIL("ud_ah_from_wc", "create_qp UD");
	for (int k = 0; k < 2; k++) {
		struct ibv_qp *q = k ? ub : ua;
		struct ibv_qp_attr u = { .qp_state = IBV_QPS_INIT, .port_num = 1,
					 .qkey = 0x11111111 };
		if (ibv_modify_qp(q, &u, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
				  IBV_QP_QKEY))
			FAIL("ud_ah_from_wc", "INIT");
		u.qp_state = IBV_QPS_RTR;
		if (ibv_modify_qp(q, &u, IBV_QP_STATE))
			FAIL("ud_ah_from_wc", "RTR");
		u.qp_state = IBV_QPS_RTS;
		u.sq_psn = 0;
		if (ibv_modify_qp(q, &u, IBV_QP_STATE | IBV_QP_SQ_PSN))
			FAIL("ud_ah_from_wc", "RTS");
	}
	struct ibv_ah_attr aa = { .is_global = 1, .port_num = 1 };
	aa.grh.dgid = gid;
	aa.grh.sgid_index = 1;
	aa.grh.hop_limit = 1;
	struct ibv_ah *ah = ibv_create_ah(pd, &aa);
	if (!ah)
		FAIL("ud_ah_from_wc", "create_ah errno %d", errno);
	rsge.addr = (uintptr_t)c;
	rsge.length = 64 + 40;
	rwr.wr_id = 50;
	if ((r = ibv_post_recv(ub, &rwr, &rbad)))
		FAIL("ud_ah_from_wc", "post_recv %d", r);
	struct ibv_send_wr uw = { .wr_id = 51, .sg_list = &sge, .num_sge = 1,
		.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
	sge.addr = (uintptr_t)a;
	sge.length = 64;
	uw.wr.ud.ah = ah;
	uw.wr.ud.remote_qpn = ub->qp_num;
	uw.wr.ud.remote_qkey = 0x11111111;
	if ((r = ibv_post_send(ua, &uw, &bad)))
		FAIL("ud_ah_from_wc", "post_send %d", r);
	struct ibv_wc rwc = { 0 };
	for (int k = 0; k < 2; k++) {
		wc = wait_wc("ud_ah_from_wc");
		if (wc.status != IBV_WC_SUCCESS)
			FAIL("ud_ah_from_wc", "status %d", wc.status);
		if (wc.opcode == IBV_WC_RECV)
			rwc = wc;
	}
	if (rwc.wr_id != 50 || rwc.byte_len != 64 + 40 || !(rwc.wc_flags & IBV_WC_GRH) ||
	    rwc.src_qp != ua->qp_num || memcmp(c + 40, a, 64))
		FAIL("ud_ah_from_wc", "recv wc: len %u flags 0x%x src_qp 0x%x", rwc.byte_len,
		     rwc.wc_flags, rwc.src_qp);
	struct ibv_ah_attr back;
	if (ibv_init_ah_from_wc(ctx, 1, &rwc, (struct ibv_grh *)c, &back) || !back.is_global ||
	    memcmp(&back.grh.dgid, &gid, 16))
		FAIL("ud_ah_from_wc", "init_ah_from_wc");
	struct ibv_ah *ah2 = ibv_create_ah_from_wc(pd, &rwc, (struct ibv_grh *)c, 1);
	if (!ah2)
		FAIL("ud_ah_from_wc", "create_ah_from_wc errno %d", errno);
	rsge.addr = (uintptr_t)(a + 1024);
	rsge.lkey = mra->lkey;
	rwr.wr_id = 52;
	if ((r = ibv_post_recv(ua, &rwr, &rbad)))
		FAIL("ud_ah_from_wc", "post_recv %d", r);
	uw.wr_id = 53;
	uw.wr.ud.ah = ah2;
	uw.wr.ud.remote_qpn = rwc.src_qp;
	if ((r = ibv_post_send(ub, &uw, &bad)))
		FAIL("ud_ah_from_wc", "reply post_send %d", r);
	int got = 0;
	for (int k = 0; k < 2; k++) {
		wc = wait_wc("ud_ah_from_wc");
		if (wc.status == IBV_WC_SUCCESS && wc.wr_id == 52 && wc.src_qp == ub->qp_num)
			got = 1;
	}
	if (!got)
		FAIL("ud_ah_from_wc", "the reply did not arrive");
	if (ibv_destroy_ah(ah) || ibv_destroy_ah(ah2) || ibv_destroy_qp(ua) || ibv_destroy_qp(ub))
		FAIL("ud_ah_from_wc", "teardown");
	OK("ud_ah_from_wc");
	sge.addr = (uintptr_t)a;
	sge.length = SZ;

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
