/* Every string of ibv_wc_status_str and ibv_event_type_str, one per line, and the
 * answers for values past the tables: tests/test_exec_verbs.py compares what the program
 * prints under softrdma exec with what Debian's libibverbs answers. */
#include <stdio.h>
#include <infiniband/verbs.h>

int main(void)
{
	for (int i = 0; i < 30; i++)
		printf("wc %d %s\n", i, ibv_wc_status_str(i));
	for (int i = 0; i < 25; i++)
		printf("event %d %s\n", i, ibv_event_type_str(i));
	return 0;
}
