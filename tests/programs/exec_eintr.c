/* The three blocking waits of libibverbs and librdmacm and a signal, as on Linux, where
 * each is a blocking read() of a uverbs or rdma_cm file:
 *
 *   ibv_get_cq_event, ibv_get_async_event, rdma_get_cm_event
 *
 * Usage: exec_eintr norestart|restart MY_IPV4
 *
 * norestart: SIGALRM's handler is installed without SA_RESTART; alarm(1) makes each wait
 *   fail with -1 / errno EINTR (how a program stops waiting). Then the event is made and
 *   the same call returns it: the interrupted wait left nothing broken.
 *   Prints "EINTR <wait>" and "OK <wait>" for each.
 * restart: the handler has SA_RESTART: the alarm runs the handler and the wait goes on
 *   (the kernel restarts the read) until a thread makes the event, 0.3 s after the
 *   handler ran. Prints "RESTARTED <wait>" for each.
 *
 * The events: a receive flushed by moving a QP to ERR (a completion on the armed CQ), an
 * SRQ-attached QP moved to ERR (IBV_EVENT_QP_LAST_WQE_REACHED), rdma_resolve_addr to the
 * program's own address (RDMA_CM_EVENT_ADDR_RESOLVED). Exits 0 when all went as said.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#define FAIL(...) do { printf("FAIL "); printf(__VA_ARGS__); printf("\n"); exit(1); } while (0)

static volatile sig_atomic_t fired;
static struct ibv_qp *flush_qp, *srq_qp;
static struct rdma_cm_id *cm_id;
static struct sockaddr_in dst;

static void on_alarm(int sig) { (void)sig; fired = 1; }

static void to_err(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE))
		FAIL("modify to ERR");
}

/* make the event wait number `which` waits for */
static void make_event(int which)
{
	if (which == 0)
		to_err(flush_qp);
	else if (which == 1)
		to_err(srq_qp);
	else if (rdma_resolve_addr(cm_id, NULL, (struct sockaddr *)&dst, 2000))
		FAIL("rdma_resolve_addr: %s", strerror(errno));
}

static void *maker(void *arg)
{
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGALRM);
	pthread_sigmask(SIG_BLOCK, &s, NULL); /* the alarm is the waiting thread's */
	while (!fired)
		usleep(10000);
	usleep(300000);
	make_event((int)(long)arg);
	return NULL;
}

static struct ibv_context *ctx;
static struct ibv_comp_channel *ch;
static struct rdma_event_channel *ec;
static const char *names[] = { "cq_event", "async_event", "cm_event" };

/* one wait of kind `which`: 0 if it returned an event, else errno */
static int wait_one(int which)
{
	if (which == 0) {
		struct ibv_cq *cq;
		void *cq_ctx;
		if (ibv_get_cq_event(ch, &cq, &cq_ctx))
			return errno;
		ibv_ack_cq_events(cq, 1);
	} else if (which == 1) {
		struct ibv_async_event ev;
		if (ibv_get_async_event(ctx, &ev))
			return errno;
		if (ev.event_type != IBV_EVENT_QP_LAST_WQE_REACHED)
			FAIL("async event %d", ev.event_type);
		ibv_ack_async_event(&ev);
	} else {
		struct rdma_cm_event *ev;
		if (rdma_get_cm_event(ec, &ev))
			return errno;
		if (ev->event != RDMA_CM_EVENT_ADDR_RESOLVED)
			FAIL("cm event %s", rdma_event_str(ev->event));
		rdma_ack_cm_event(ev);
	}
	return 0;
}

int main(int argc, char **argv)
{
	if (argc != 3)
		FAIL("usage: exec_eintr norestart|restart MY_IPV4");
	int restart = !strcmp(argv[1], "restart");
	dst.sin_family = AF_INET;
	if (inet_pton(AF_INET, argv[2], &dst.sin_addr) != 1)
		FAIL("address %s", argv[2]);

	struct ibv_device **list = ibv_get_device_list(NULL);
	if (!list || !list[0])
		FAIL("no device");
	ctx = ibv_open_device(list[0]);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	ch = ibv_create_comp_channel(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, ch, 0);
	struct ibv_srq_init_attr sa = { .attr = { .max_wr = 4, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &sa);
	static char buf[64];
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1,
			 .max_recv_sge = 1 } };
	flush_qp = ibv_create_qp(pd, &ia);
	ia.srq = srq;
	srq_qp = ibv_create_qp(pd, &ia);
	if (!ctx || !pd || !ch || !cq || !srq || !mr || !flush_qp || !srq_qp)
		FAIL("verbs setup");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
	if (ibv_modify_qp(flush_qp, &a, mask) || ibv_modify_qp(srq_qp, &a, mask))
		FAIL("INIT");
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = sizeof(buf), .lkey = mr->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *bad;
	if (ibv_post_recv(flush_qp, &rwr, &bad) || ibv_req_notify_cq(cq, 0))
		FAIL("post_recv / req_notify_cq");
	ec = rdma_create_event_channel();
	if (!ec || rdma_create_id(ec, &cm_id, NULL, RDMA_PS_TCP))
		FAIL("rdma_cm setup: %s", strerror(errno));

	struct sigaction act;
	memset(&act, 0, sizeof(act));
	act.sa_handler = on_alarm;
	act.sa_flags = restart ? SA_RESTART : 0;
	sigemptyset(&act.sa_mask);
	sigaction(SIGALRM, &act, NULL);

	for (int which = 0; which < 3; which++) {
		pthread_t t;
		fired = 0;
		if (restart && pthread_create(&t, NULL, maker, (void *)(long)which))
			FAIL("pthread_create");
		alarm(1);
		int err = wait_one(which);
		if (restart) {
			pthread_join(t, NULL);
			if (err || !fired)
				FAIL("%s: errno %d, handler ran %d", names[which], err, fired);
			printf("RESTARTED %s\n", names[which]);
		} else {
			if (err != EINTR || !fired)
				FAIL("%s: errno %d (%s), not EINTR", names[which], err,
				     strerror(err));
			printf("EINTR %s\n", names[which]);
			make_event(which);
			if ((err = wait_one(which)))
				FAIL("%s after EINTR: %s", names[which], strerror(err));
			printf("OK %s\n", names[which]);
		}
		fflush(stdout);
	}
	rdma_destroy_id(cm_id);
	rdma_destroy_event_channel(ec);
	ibv_destroy_qp(flush_qp);
	ibv_destroy_qp(srq_qp);
	ibv_destroy_srq(srq);
	ibv_ack_cq_events(cq, 0);
	ibv_destroy_cq(cq);
	ibv_dereg_mr(mr);
	ibv_destroy_comp_channel(ch);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(list);
	return 0;
}
