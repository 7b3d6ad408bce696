/* A program that waits by spinning on ibv_poll_cq, as librdmacm's mckey waits for its
 * messages: one RC QP's receive CQ, nothing ever arriving, polled in a tight loop for
 * SECONDS of wall-clock time (argv[1], default 1). Prints "CPU <process CPU seconds>
 * WALL <seconds> POLLS <calls>" and exits 0; any poll returning other than 0 fails.
 * tests/test_exec_poll_yield.py runs it under `softrdma exec`.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>
#include <infiniband/verbs.h>

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static double cpu(void)
{
	struct rusage u;
	getrusage(RUSAGE_SELF, &u);
	return u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec +
	       u.ru_stime.tv_usec / 1e6;
}

int main(int argc, char **argv)
{
	double seconds = argc > 1 ? atof(argv[1]) : 1.0;
	int num;
	struct ibv_device **list = ibv_get_device_list(&num);
	if (!list || !num) {
		printf("FAIL no device\n");
		return 1;
	}
	struct ibv_context *ctx = ibv_open_device(list[0]);
	struct ibv_cq *cq = ctx ? ibv_create_cq(ctx, 16, NULL, NULL, 0) : NULL;
	if (!cq) {
		printf("FAIL open/create_cq\n");
		return 1;
	}
	struct ibv_wc wc[8];
	long polls = 0;
	double t0 = now(), c0 = cpu();
	while (now() - t0 < seconds) {
		int n = ibv_poll_cq(cq, 8, wc);
		if (n != 0) {
			printf("FAIL poll returned %d\n", n);
			return 1;
		}
		polls++;
	}
	printf("CPU %.3f WALL %.3f POLLS %ld\n", cpu() - c0, now() - t0, polls);
	ibv_destroy_cq(cq);
	ibv_close_device(ctx);
	ibv_free_device_list(list);
	return 0;
}
