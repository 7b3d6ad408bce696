/* ibv_reg_mr's answers about the program's own memory under softrdma exec, as the kernel
 * gives them (ib_uverbs_reg_mr, ib_umem_get): addr and iova must share their offset in a
 * page (EINVAL); nothing mapped, or a read-only mapping registered for writing, is EFAULT;
 * a read-only mapping registered for reading only is fine.
 *
 * Prints "OK <name>" per check passed, "FAIL <name>: ..." and exits 1 at the first failure.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define FAIL(name, ...) do { printf("FAIL %s: ", name); printf(__VA_ARGS__); printf("\n"); \
                             fflush(stdout); exit(1); } while (0)
#define OK(name) do { printf("OK %s\n", name); fflush(stdout); } while (0)

static struct ibv_pd *pd;

static void refused(const char *name, struct ibv_mr *mr, int want)
{
	if (mr)
		FAIL(name, "registered (lkey 0x%x), expected errno %d", mr->lkey, want);
	if (errno != want)
		FAIL(name, "errno %d (%s), expected %d", errno, strerror(errno), want);
	OK(name);
}

int main(void)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (!list || n < 1)
		FAIL("devices", "no device");
	struct ibv_context *ctx = ibv_open_device(list[0]);
	pd = ctx ? ibv_alloc_pd(ctx) : NULL;
	if (!pd)
		FAIL("pd", "no PD");
	long page = sysconf(_SC_PAGESIZE);
	int rw = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

	/* nothing is mapped at page 0 */
	errno = 0;
	refused("unmapped", ibv_reg_mr(pd, (void *)0x10, 4096, IBV_ACCESS_LOCAL_WRITE), EFAULT);

	/* two pages, the second unmapped: the range runs off the mapping */
	char *two = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	munmap(two + page, page);
	errno = 0;
	refused("past_the_mapping", ibv_reg_mr(pd, two, 2 * page, rw), EFAULT);
	struct ibv_mr *mr = ibv_reg_mr(pd, two, page, rw);
	if (!mr || mr->addr != two || mr->length != (size_t)page)
		FAIL("within_the_mapping", "errno %d", errno);
	ibv_dereg_mr(mr);
	OK("within_the_mapping");

	/* a read-only page: readable by the device, never writable */
	char *ro = mmap(NULL, page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	errno = 0;
	refused("read_only_for_writing", ibv_reg_mr(pd, ro, page, IBV_ACCESS_LOCAL_WRITE), EFAULT);
	mr = ibv_reg_mr(pd, ro, page, IBV_ACCESS_REMOTE_READ);
	if (!mr)
		FAIL("read_only_for_reading", "errno %d (%s)", errno, strerror(errno));
	ibv_dereg_mr(mr);
	OK("read_only_for_reading");

	/* the iova must keep the address's offset in its page */
	errno = 0;
	refused("iova_offset", ibv_reg_mr_iova2(pd, two + 16, 64, 0x70000000, rw), EINVAL);
	mr = ibv_reg_mr_iova2(pd, two + 16, 64, 0x70000010, rw);
	if (!mr || mr->addr != two + 16)
		FAIL("iova_same_offset", "errno %d (%s)", errno, strerror(errno));
	ibv_dereg_mr(mr);
	OK("iova_same_offset");

	/* the access flags are checked before the pages: EINVAL, not EFAULT */
	errno = 0;
	refused("access_before_pages",
		ibv_reg_mr(pd, (void *)0x10, 4096, IBV_ACCESS_REMOTE_WRITE), EINVAL);

	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(list);
	return 0;
}
