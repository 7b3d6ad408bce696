/* A QP's async event still pending when the QP is destroyed: uverbs discards it with the
 * QP, so the program never reads an event whose element.qp is gone (UCX's async thread
 * reads event.element.qp->qp_num of every QP event).
 *
 * An RC QP on an SRQ moved to the error state raises IBV_EVENT_QP_LAST_WQE_REACHED; the
 * program waits (poll() on context->async_fd) until it is pending, destroys the QP without
 * reading it, and then, with async_fd O_NONBLOCK, expects ibv_get_async_event to fail with
 * EAGAIN. Prints "OK pending", "OK dropped" and exits 0.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
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
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_srq_init_attr sa = { .attr = { .max_wr = 4, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &sa);
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .srq = srq,
		.qp_type = IBV_QPT_RC, .cap = { .max_send_wr = 4, .max_send_sge = 1 } };
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	if (!ctx || !pd || !cq || !srq || !qp)
		FAIL("setup");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
			  IBV_QP_ACCESS_FLAGS))
		FAIL("INIT");
	a.qp_state = IBV_QPS_ERR;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE))
		FAIL("ERR");
	struct pollfd p = { .fd = ctx->async_fd, .events = POLLIN };
	if (poll(&p, 1, 10000) != 1)
		FAIL("pending: no async event within 10 s");
	printf("OK pending\n");
	if (ibv_destroy_qp(qp))
		FAIL("destroy_qp");
	fcntl(ctx->async_fd, F_SETFL, fcntl(ctx->async_fd, F_GETFL) | O_NONBLOCK);
	struct ibv_async_event ev;
	if (ibv_get_async_event(ctx, &ev) == 0)
		FAIL("dropped: got event %d, element.qp %p, of a destroyed QP", ev.event_type,
		     (void *)ev.element.qp);
	if (errno != EAGAIN)
		FAIL("dropped: errno %d, not EAGAIN", errno);
	printf("OK dropped\n");
	ibv_destroy_srq(srq);
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(list);
	return 0;
}
