/* The semantics of softrdma exec's data-path fast paths, from an ordinary libibverbs
 * program (gcc against Debian's headers, -libverbs, run under `softrdma exec`): two RC QPs
 * of one context connected to each other through the device's own GID, each with its own
 * send and receive CQ.
 *
 * Prints "OK <name>" per check passed, "FAIL <name>: ..." and exits 1 at the first failure.
 * tests/test_exec_speed_paths.py runs it (with SOFTRDMA_EXEC_FAST_POLL=1 and =0).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define SZ 4096
#define N 8
#define FAIL(name, ...) do { printf("FAIL %s: ", name); printf(__VA_ARGS__); printf("\n"); \
                             fflush(stdout); exit(1); } while (0)
#define OK(name) do { printf("OK %s\n", name); fflush(stdout); } while (0)

/* poll `cq` `want` completions at most `batch` at a time; returns the number of calls
 * that returned some */
static int collect(const char *name, struct ibv_cq *cq, struct ibv_wc *out, int want, int batch)
{
	int got = 0, calls = 0;
	struct timespec t0, t;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (long i = 0; got < want; i++) {
		clock_gettime(CLOCK_MONOTONIC, &t);
		if (t.tv_sec - t0.tv_sec > 10)
			break; /* 10 s: the completions are not coming */
		int k = want - got < batch ? want - got : batch;
		int n = ibv_poll_cq(cq, k, out + got);
		if (n < 0 || n > k)
			FAIL(name, "ibv_poll_cq(%d) returned %d", k, n);
		if (n) {
			got += n;
			calls++;
		}
	}
	if (got != want)
		FAIL(name, "%d of %d completions", got, want);
	return calls;
}

static void connect_qp(struct ibv_qp *qp, uint32_t dest, union ibv_gid *gid)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1,
		.qp_access_flags = IBV_ACCESS_REMOTE_WRITE };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
			  IBV_QP_ACCESS_FLAGS))
		FAIL("modify_qp", "to INIT");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = dest;
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
	int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
	struct ibv_mr *mra = ibv_reg_mr(pd, a, SZ, acc), *mrb = ibv_reg_mr(pd, b, SZ, acc);
	struct ibv_cq *scq_a = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	struct ibv_cq *rcq_a = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	struct ibv_cq *scq_b = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	struct ibv_cq *rcq_b = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	if (!ctx || !pd || !mra || !mrb || !scq_a || !rcq_a || !scq_b || !rcq_b)
		FAIL("setup", "open/alloc_pd/reg_mr/create_cq failed (errno %d)", errno);
	struct ibv_qp_init_attr ia = { .send_cq = scq_a, .recv_cq = rcq_a, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 32, .max_recv_wr = 32, .max_send_sge = 1,
			 .max_recv_sge = 1 } };
	struct ibv_qp *qa = ibv_create_qp(pd, &ia);
	ia.send_cq = scq_b;
	ia.recv_cq = rcq_b;
	struct ibv_qp *qb = ibv_create_qp(pd, &ia);
	union ibv_gid gid;
	if (!qa || !qb || ibv_query_gid(ctx, 1, 1, &gid))
		FAIL("setup", "create_qp/query_gid");
	connect_qp(qa, qb->qp_num, &gid);
	connect_qp(qb, qa->qp_num, &gid);

	/* an empty CQ polled many times: 0 every time, the program's array untouched */
	struct ibv_wc wc[2 * N];
	memset(wc, 0xA5, sizeof(wc));
	for (int i = 0; i < 2000; i++) {
		int n = ibv_poll_cq(rcq_b, N, wc);
		if (n != 0)
			FAIL("empty_poll", "call %d on an empty CQ returned %d", i, n);
	}
	for (size_t i = 0; i < sizeof(wc); i++)
		if (((unsigned char *)wc)[i] != 0xA5)
			FAIL("empty_poll", "byte %zu of the wc array written by an empty poll", i);
	if (ibv_poll_cq(rcq_b, 0, wc) != 0)
		FAIL("empty_poll", "num_entries 0 did not return 0");
	OK("empty_poll");

	/* a batch: N receives, then a chain of N SENDs in one post; the receive CQ is polled
	 * 3 at a time and gives every completion once, in order, with its length */
	struct ibv_sge rsge[N], ssge[N];
	struct ibv_recv_wr rwr[N], *rbad = NULL;
	struct ibv_send_wr swr[N], *sbad = NULL;
	for (int i = 0; i < N; i++) {
		rsge[i] = (struct ibv_sge){ .addr = (uintptr_t)(b + 64 * i), .length = 64,
					    .lkey = mrb->lkey };
		rwr[i] = (struct ibv_recv_wr){ .wr_id = 100 + i, .sg_list = &rsge[i], .num_sge = 1,
					       .next = i + 1 < N ? &rwr[i + 1] : NULL };
		memset(a + 64 * i, 'A' + i, 64);
		ssge[i] = (struct ibv_sge){ .addr = (uintptr_t)(a + 64 * i), .length = 10 + i,
					    .lkey = mra->lkey };
		swr[i] = (struct ibv_send_wr){ .wr_id = 200 + i, .sg_list = &ssge[i], .num_sge = 1,
					       .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED,
					       .next = i + 1 < N ? &swr[i + 1] : NULL };
	}
	if (ibv_post_recv(qb, rwr, &rbad) || ibv_post_send(qa, swr, &sbad))
		FAIL("batch", "post_recv/post_send failed");
	int calls = collect("batch", rcq_b, wc, N, 3);
	for (int i = 0; i < N; i++) {
		if (wc[i].status != IBV_WC_SUCCESS || wc[i].wr_id != (uint64_t)(100 + i) ||
		    wc[i].byte_len != (uint32_t)(10 + i) || wc[i].opcode != IBV_WC_RECV ||
		    wc[i].qp_num != qb->qp_num)
			FAIL("batch", "receive %d: status %d wr_id %lu byte_len %u", i, wc[i].status,
			     (unsigned long)wc[i].wr_id, wc[i].byte_len);
		if (b[64 * i] != 'A' + i || b[64 * i + 9 + i] != 'A' + i)
			FAIL("batch", "receive %d: payload", i);
	}
	if (calls < 3)
		FAIL("batch", "%d receive completions in %d calls of at most 3", N, calls);
	collect("batch", scq_a, wc, N, 2 * N);
	for (int i = 0; i < N; i++)
		if (wc[i].status != IBV_WC_SUCCESS || wc[i].wr_id != (uint64_t)(200 + i) ||
		    wc[i].opcode != IBV_WC_SEND)
			FAIL("batch", "send %d: status %d wr_id %lu", i, wc[i].status,
			     (unsigned long)wc[i].wr_id);
	if (ibv_poll_cq(scq_a, 2 * N, wc) != 0 || ibv_poll_cq(rcq_b, 2 * N, wc) != 0)
		FAIL("batch", "a completion twice");
	OK("batch");

	/* a send list with a bad WR in the middle: EINVAL, bad_wr at it, the WR before it
	 * posted (it completes, and is received), the one after it not */
	if (ibv_post_recv(qb, rwr, &rbad))
		FAIL("bad_send_wr", "post_recv");
	swr[0].next = &swr[1];
	swr[1].next = &swr[2];
	swr[2].next = NULL;
	swr[1].num_sge = 5; /* more than max_send_sge */
	sbad = NULL;
	int r = ibv_post_send(qa, swr, &sbad);
	if (r != EINVAL || sbad != &swr[1])
		FAIL("bad_send_wr", "returned %d, bad_wr %s", r,
		     sbad == &swr[1] ? "the bad WR" : sbad ? "another WR" : "NULL");
	collect("bad_send_wr", scq_a, wc, 1, 4);
	collect("bad_send_wr", rcq_b, wc + 1, 1, 4);
	if (wc[0].wr_id != 200 || wc[1].wr_id != 100 || wc[1].byte_len != 10)
		FAIL("bad_send_wr", "completions wr_id %lu / %lu", (unsigned long)wc[0].wr_id,
		     (unsigned long)wc[1].wr_id);
	usleep(20000); /* had the third WR gone, it would have arrived by now */
	for (int i = 0; i < 100; i++)
		if (ibv_poll_cq(scq_a, 4, wc) != 0 || ibv_poll_cq(rcq_b, 4, wc) != 0)
			FAIL("bad_send_wr", "a WR after the bad one completed");
	swr[1].num_sge = 1;
	OK("bad_send_wr");

	/* a receive list with a bad WR in the middle: the same */
	struct ibv_qp_attr qattr;
	struct ibv_qp_init_attr qinit;
	rwr[4].num_sge = 3; /* more than max_recv_sge */
	rbad = NULL;
	r = ibv_post_recv(qb, &rwr[3], &rbad);
	if (r != EINVAL || rbad != &rwr[4])
		FAIL("bad_recv_wr", "returned %d, bad_wr %s", r,
		     rbad == &rwr[4] ? "the bad WR" : rbad ? "another WR" : "NULL");
	rwr[4].num_sge = 1;
	if (ibv_query_qp(qb, &qattr, IBV_QP_STATE, &qinit) || qattr.qp_state != IBV_QPS_RTS)
		FAIL("bad_recv_wr", "the QP left RTS");
	OK("bad_recv_wr");

	/* a completion that arrives while the program does not poll (the device's progress
	 * thread takes it): the first poll after returns it */
	swr[0].next = NULL;
	if (ibv_post_send(qa, swr, &sbad))
		FAIL("idle_arrival", "post_send");
	usleep(100000);
	int n = ibv_poll_cq(scq_a, 4, wc);
	if (n != 1 || wc[0].wr_id != 200 || wc[0].status != IBV_WC_SUCCESS)
		FAIL("idle_arrival", "first poll after the pause returned %d", n);
	n = ibv_poll_cq(rcq_b, 4, wc);
	if (n != 1 || wc[0].status != IBV_WC_SUCCESS || wc[0].byte_len != 10)
		FAIL("idle_arrival", "first receive poll after the pause returned %d", n);
	OK("idle_arrival");

	ibv_destroy_qp(qa);
	ibv_destroy_qp(qb);
	ibv_destroy_cq(scq_a);
	ibv_destroy_cq(rcq_a);
	ibv_destroy_cq(scq_b);
	ibv_destroy_cq(rcq_b);
	ibv_dereg_mr(mra);
	ibv_dereg_mr(mrb);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(list);
	OK("teardown");
	return 0;
}
