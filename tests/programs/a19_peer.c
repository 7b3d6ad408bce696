/* ATOMIC WRITE (IBTA 1.5 annex A19) between two RC QPs, and a responder for FLUSH, for
 * the interop tests against Linux 6.12's rxe (tests/interop/test_atomic_write_interop.py).
 *
 *   a19_peer [-p port] [-g gid_index] [-a mr_access] [-q qp_access] [-C]
 *       the responder: one 4096-byte MR (LOCAL_WRITE | REMOTE_WRITE | mr_access), an RC
 *       QP with qp_access; it serves one client on TCP port, then prints the MR's first
 *       64 bytes ("mem <hex>") and exits
 *   a19_peer [-p port] [-g gid_index] -o aw:OFFSET:HEX16 [-o ...] SERVER
 *       the requester: each -o is one ibv_wr_atomic_write of the 8 bytes HEX16 (in memory
 *       order) at the server MR's address + OFFSET; prints "wc <status> <opcode>
 *       <byte_len>" per completion and stops at the first error
 *   a19_peer -R -a mr_access      ibv_reg_mr with those access bits: "reg_mr <errno>"
 *   -C                            print "caps_ex 0x<device_cap_flags_ex>" first
 *
 * Debian 12's rdma-core 44 headers have ibv_wr_atomic_write but neither ibv_wr_flush nor
 * the IBV_ACCESS_FLUSH_* names: access bits are given as numbers (FLUSH_GLOBAL 0x100,
 * FLUSH_PERSISTENT 0x200). The exchange over TCP is one line each way:
 * "QPN PSN GID RKEY ADDR" in hex, then the client's "done" line.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define FAIL(...) do { printf("FAIL "); printf(__VA_ARGS__); printf("\n"); exit(1); } while (0)
#define MR_SIZE 4096
#define MAX_OPS 16

struct peer { unsigned qpn, psn; union ibv_gid gid; unsigned rkey; unsigned long long addr; };

static int tcp_server(int port)
{
	int one = 1, s = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(s, (void *)&a, sizeof(a)) || listen(s, 1))
		FAIL("listen on %d: %s", port, strerror(errno));
	int c = accept(s, NULL, NULL);
	close(s);
	return c;
}

static int tcp_client(const char *host, int port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	if (inet_pton(AF_INET, host, &a.sin_addr) != 1)
		FAIL("bad address %s", host);
	for (int i = 0; i < 100; i++) {
		int s = socket(AF_INET, SOCK_STREAM, 0);
		if (!connect(s, (void *)&a, sizeof(a)))
			return s;
		close(s);
		usleep(100000);
	}
	FAIL("connect to %s:%d", host, port);
}

static void send_line(int s, const struct peer *p)
{
	char line[160];
	int n = snprintf(line, sizeof(line), "%06x %06x ", p->qpn, p->psn);
	for (int i = 0; i < 16; i++)
		n += snprintf(line + n, sizeof(line) - n, "%02x", p->gid.raw[i]);
	n += snprintf(line + n, sizeof(line) - n, " %08x %016llx\n", p->rkey, p->addr);
	if (write(s, line, n) != n)
		FAIL("send");
}

static void recv_line(int s, char *buf, size_t size)
{
	size_t n = 0;
	while (n + 1 < size && read(s, buf + n, 1) == 1 && buf[n] != '\n')
		n++;
	buf[n] = 0;
}

static void recv_peer(int s, struct peer *p)
{
	char line[160], hex[33];
	recv_line(s, line, sizeof(line));
	if (sscanf(line, "%x %x %32s %x %llx", &p->qpn, &p->psn, hex, &p->rkey, &p->addr) != 5)
		FAIL("bad peer line '%s'", line);
	for (int i = 0; i < 16; i++)
		sscanf(hex + 2 * i, "%2hhx", &p->gid.raw[i]);
}

static void connect_qp(struct ibv_qp *qp, const struct peer *me, const struct peer *rem,
		       int gid_index, int access)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = access };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
			  IBV_QP_ACCESS_FLAGS))
		FAIL("INIT: %s", strerror(errno));
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = rem->qpn;
	a.rq_psn = rem->psn;
	a.max_dest_rd_atomic = 4;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = rem->gid;
	a.ah_attr.grh.sgid_index = gid_index;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.port_num = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
			  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		FAIL("RTR: %s", strerror(errno));
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = me->psn;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 4;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
			  IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC))
		FAIL("RTS: %s", strerror(errno));
}

int main(int argc, char **argv)
{
	int port = 18515, gid_index = 1, mr_access = 0, reg_only = 0, caps = 0, nops = 0;
	int qp_access = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
			IBV_ACCESS_REMOTE_ATOMIC | 0x100 | 0x200;
	unsigned offs[MAX_OPS];
	unsigned char vals[MAX_OPS][8];
	int c;
	while ((c = getopt(argc, argv, "p:g:a:q:o:RC")) != -1) {
		switch (c) {
		case 'p': port = atoi(optarg); break;
		case 'g': gid_index = atoi(optarg); break;
		case 'a': mr_access = strtol(optarg, NULL, 0); break;
		case 'q': qp_access = strtol(optarg, NULL, 0); break;
		case 'R': reg_only = 1; break;
		case 'C': caps = 1; break;
		case 'o': {
			char hex[17];
			if (nops == MAX_OPS || sscanf(optarg, "aw:%u:%16s", &offs[nops], hex) != 2 ||
			    strlen(hex) != 16)
				FAIL("bad -o %s (aw:OFFSET:HEX16)", optarg);
			for (int i = 0; i < 8; i++)
				sscanf(hex + 2 * i, "%2hhx", &vals[nops][i]);
			nops++;
			break;
		}
		default: FAIL("usage: see the comment at the top of a19_peer.c");
		}
	}
	const char *server = optind < argc ? argv[optind] : NULL;

	int num;
	struct ibv_device **list = ibv_get_device_list(&num);
	if (!list || !num)
		FAIL("no device");
	struct ibv_context *ctx = ibv_open_device(list[0]);
	if (!ctx)
		FAIL("open device");
	if (caps) {
		struct ibv_device_attr_ex ax;
		if (ibv_query_device_ex(ctx, NULL, &ax))
			FAIL("ibv_query_device_ex");
		printf("caps_ex 0x%llx\n", (unsigned long long)ax.device_cap_flags_ex);
	}
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	void *buf;
	if (!pd || posix_memalign(&buf, 4096, MR_SIZE))
		FAIL("pd/buffer");
	memset(buf, 0, MR_SIZE);
	int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | mr_access;
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, MR_SIZE, access);
	if (reg_only) {
		printf("reg_mr %d\n", mr ? 0 : errno);
		return 0;
	}
	if (!mr)
		FAIL("ibv_reg_mr 0x%x: %s", access, strerror(errno));
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_qp_init_attr_ex ia = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .pd = pd,
		.cap = { .max_send_wr = 16, .max_recv_wr = 4, .max_send_sge = 1,
			 .max_recv_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.send_ops_flags = IBV_QP_EX_WITH_ATOMIC_WRITE | IBV_QP_EX_WITH_RDMA_WRITE };
	struct ibv_qp *qp = cq ? ibv_create_qp_ex(ctx, &ia) : NULL;
	if (!qp)
		FAIL("create_qp_ex: %s", strerror(errno));
	struct peer me = { .qpn = qp->qp_num, .psn = 0x2a2a2a & 0xffffff, .rkey = mr->rkey,
			   .addr = (uintptr_t)buf }, rem;
	if (ibv_query_gid(ctx, 1, gid_index, &me.gid))
		FAIL("query_gid %d", gid_index);

	int s = server ? tcp_client(server, port) : tcp_server(port);
	if (server) {
		send_line(s, &me);
		recv_peer(s, &rem);
		connect_qp(qp, &me, &rem, gid_index, qp_access);
	} else {  /* ready before the client learns where to send: no request is early */
		recv_peer(s, &rem);
		connect_qp(qp, &me, &rem, gid_index, qp_access);
		send_line(s, &me);
	}
	if (!server) {  /* the responder: wait until the client is done, show the memory */
		char line[32];
		recv_line(s, line, sizeof(line));
		printf("mem ");
		for (int i = 0; i < 64; i++)
			printf("%02x", ((unsigned char *)buf)[i]);
		printf("\n");
		return 0;
	}
	struct ibv_qp_ex *qpx = ibv_qp_to_qp_ex(qp);
	for (int k = 0; k < nops; k++) {
		ibv_wr_start(qpx);
		qpx->wr_id = k;
		qpx->wr_flags = IBV_SEND_SIGNALED;
		ibv_wr_atomic_write(qpx, rem.rkey, rem.addr + offs[k], vals[k]);
		if (ibv_wr_complete(qpx))
			FAIL("wr_complete: %s", strerror(errno));
		struct ibv_wc wc;
		int n;
		while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
			;
		if (n < 0)
			FAIL("poll_cq");
		printf("wc %d %d %u\n", wc.status, wc.opcode, wc.byte_len);
		if (wc.status != IBV_WC_SUCCESS)
			break;
	}
	fflush(stdout);
	if (write(s, "done\n", 5) != 5)
		FAIL("send done");
	return 0;
}
