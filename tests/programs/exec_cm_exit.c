/* A librdmacm client that connects (no QP: rdma_connect with a qp_num, rdma_establish
 * after CONNECT_RESPONSE) and exits without destroying anything, as a program does on an
 * error path: under softrdma exec its ids must leave the CM at exit as the kernel's do
 * when the process's rdma_cm file closes (tests/test_exec_cma.py).
 *
 *     exec_cm_exit SERVER_IP PORT
 */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <rdma/rdma_cma.h>

static void want(struct rdma_event_channel *ch, enum rdma_cm_event_type type)
{
	struct rdma_cm_event *ev;

	if (rdma_get_cm_event(ch, &ev)) {
		perror("rdma_get_cm_event");
		exit(1);
	}
	printf("%s\n", rdma_event_str(ev->event));
	if (ev->event != type)
		exit(1);
	rdma_ack_cm_event(ev);
}

int main(int argc, char **argv)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_conn_param param;
	struct sockaddr_in dst;
	struct rdma_cm_id *id;

	if (argc != 3 || !ch || rdma_create_id(ch, &id, NULL, RDMA_PS_TCP))
		return 1;
	memset(&dst, 0, sizeof(dst));
	dst.sin_family = AF_INET;
	dst.sin_port = htons(atoi(argv[2]));
	inet_pton(AF_INET, argv[1], &dst.sin_addr);
	if (rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000))
		return 1;
	want(ch, RDMA_CM_EVENT_ADDR_RESOLVED);
	if (rdma_resolve_route(id, 2000))
		return 1;
	want(ch, RDMA_CM_EVENT_ROUTE_RESOLVED);
	memset(&param, 0, sizeof(param));
	param.qp_num = 0x333;
	param.retry_count = param.rnr_retry_count = 7;
	if (rdma_connect(id, &param))
		return 1;
	want(ch, RDMA_CM_EVENT_CONNECT_RESPONSE);
	if (rdma_establish(id))
		return 1;
	printf("exiting without rdma_destroy_id\n");
	fflush(stdout);
	exit(0);
}
