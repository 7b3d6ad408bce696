/* ibv_attach_mcast / ibv_detach_mcast as the verbs core and rxe answer them (softrdma's
 * tests/test_exec_mcast.py): prints one line per call, "name rc". */
#include <stdio.h>
#include <string.h>
#include <infiniband/verbs.h>

static void gid_v4(union ibv_gid *g, unsigned a, unsigned b, unsigned c, unsigned d)
{
	memset(g, 0, sizeof(*g));
	g->raw[10] = 0xff;
	g->raw[11] = 0xff;
	g->raw[12] = a; g->raw[13] = b; g->raw[14] = c; g->raw[15] = d;
}

static struct ibv_qp *make_qp(struct ibv_pd *pd, struct ibv_cq *cq, enum ibv_qp_type t)
{
	struct ibv_qp_init_attr ia = {
		.send_cq = cq, .recv_cq = cq, .qp_type = t,
		.cap = { .max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	return ibv_create_qp(pd, &ia);
}

int main(void)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (!list || !n)
		return 2;
	struct ibv_context *ctx = ibv_open_device(list[0]);
	struct ibv_device_attr attr;
	ibv_query_device(ctx, &attr);
	printf("limits %d %d %d\n", attr.max_mcast_grp, attr.max_mcast_qp_attach,
	       attr.max_total_mcast_qp_attach);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 4, NULL, NULL, 0);
	struct ibv_qp *ud = make_qp(pd, cq, IBV_QPT_UD), *rc = make_qp(pd, cq, IBV_QPT_RC);
	union ibv_gid group, unicast;
	gid_v4(&group, 239, 3, 2, 1);
	gid_v4(&unicast, 10, 3, 2, 1);
	printf("rc_attach %d\n", ibv_attach_mcast(rc, &group, 0));
	printf("unicast_attach %d\n", ibv_attach_mcast(ud, &unicast, 0));
	printf("detach_unattached %d\n", ibv_detach_mcast(ud, &group, 0));
	printf("attach %d\n", ibv_attach_mcast(ud, &group, 0));
	printf("attach_again %d\n", ibv_attach_mcast(ud, &group, 0));
	printf("detach %d\n", ibv_detach_mcast(ud, &group, 0));
	printf("detach_again %d\n", ibv_detach_mcast(ud, &group, 0));
	ibv_destroy_qp(ud);
	ibv_destroy_qp(rc);
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(list);
	return 0;
}
