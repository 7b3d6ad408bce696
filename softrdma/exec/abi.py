"""The whole ABI an unmodified program can call: every function libibverbs.so.1 and
librdmacm.so.1 (rdma-core 44) export, with the prototype their installed headers give.

The preload library defines **all** of them. A function no part of :mod:`softrdma.exec`
implements yet is still defined, by a stub that fails the way the real library fails for
an unsupported operation (``EOPNOTSUPP``) and says so once on stderr: a call that fell
through to the real libibverbs would hand it a softrdma object it cannot read, and the
program would crash far from the cause (Debian's pyverbs calls ``ibv_get_device_index``
on every device it lists).

The prototypes are the headers' (``gcc -E`` of verbs.h, rdma_cma.h, rdma_verbs.h and
rsocket.h), with four kinds of edit: ``__attribute__((const))`` dropped, arrays as
pointers, the variadic ``rfcntl`` answered by a C forwarder (cffi cannot define a variadic
function), and the functions rdma-core exports without a public header (``ibv_copy_*_kern``,
``ibv_*fork_range``, ``ibv_get_sysfs_path``, ``ibv_read_sysfs_file``,
``ibv_register_driver``) declared here, with the one private symbol a Debian tool
imports (``ibv_query_gid_type@IBVERBS_PRIVATE_34``, by ibv_devinfo).
"""

from __future__ import annotations

import re

__all__ = ["PROTOTYPES", "TYPES", "HEADERS", "MACROS", "EXTRA_C", "CALLBACKS", "ABI_NAMES",
           "names", "declarations", "fail_value"]

HEADERS = ("infiniband/verbs.h", "infiniband/sa.h", "rdma/ib_user_sa.h", "rdma/ib_user_verbs.h",
           "rdma/rdma_cma.h", "rdma/rdma_verbs.h", "rdma/rsocket.h", "stdarg.h")

#: names verbs.h defines as macros over inline wrappers: #undef'd before the definitions
MACROS = ("ibv_get_device_list", "ibv_query_port", "ibv_reg_mr", "ibv_reg_mr_iova")

PROTOTYPES = """
    int _ibv_query_gid_ex(struct ibv_context *context, uint32_t port_num, uint32_t gid_index, struct ibv_gid_entry *entry, uint32_t flags, size_t entry_size);
    ssize_t _ibv_query_gid_table(struct ibv_context *context, struct ibv_gid_entry *entries, size_t max_entries, uint32_t flags, size_t entry_size);
    void ibv_ack_async_event(struct ibv_async_event *event);
    void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents);
    struct ibv_pd *ibv_alloc_pd(struct ibv_context *context);
    int ibv_attach_mcast(struct ibv_qp *qp, const union ibv_gid *gid, uint16_t lid);
    int ibv_close_device(struct ibv_context *context);
    void ibv_copy_ah_attr_from_kern(struct ibv_ah_attr *dst, struct ib_uverbs_ah_attr *src);
    void ibv_copy_path_rec_from_kern(struct ibv_sa_path_rec *dst, struct ib_user_path_rec *src);
    void ibv_copy_path_rec_to_kern(struct ib_user_path_rec *dst, struct ibv_sa_path_rec *src);
    void ibv_copy_qp_attr_from_kern(struct ibv_qp_attr *dst, struct ib_uverbs_qp_attr *src);
    struct ibv_ah *ibv_create_ah(struct ibv_pd *pd, struct ibv_ah_attr *attr);
    struct ibv_ah *ibv_create_ah_from_wc(struct ibv_pd *pd, struct ibv_wc *wc, struct ibv_grh *grh, uint8_t port_num);
    struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *context);
    struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context, struct ibv_comp_channel *channel, int comp_vector);
    struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr);
    struct ibv_srq *ibv_create_srq(struct ibv_pd *pd, struct ibv_srq_init_attr *srq_init_attr);
    int ibv_dealloc_pd(struct ibv_pd *pd);
    int ibv_dereg_mr(struct ibv_mr *mr);
    int ibv_destroy_ah(struct ibv_ah *ah);
    int ibv_destroy_comp_channel(struct ibv_comp_channel *channel);
    int ibv_destroy_cq(struct ibv_cq *cq);
    int ibv_destroy_qp(struct ibv_qp *qp);
    int ibv_destroy_srq(struct ibv_srq *srq);
    int ibv_detach_mcast(struct ibv_qp *qp, const union ibv_gid *gid, uint16_t lid);
    int ibv_dofork_range(void *base, size_t size);
    int ibv_dontfork_range(void *base, size_t size);
    const char *ibv_event_type_str(enum ibv_event_type event);
    int ibv_fork_init(void);
    void ibv_free_device_list(struct ibv_device **list);
    int ibv_get_async_event(struct ibv_context *context, struct ibv_async_event *event);
    int ibv_get_cq_event(struct ibv_comp_channel *channel, struct ibv_cq **cq, void **cq_context);
    __be64 ibv_get_device_guid(struct ibv_device *device);
    int ibv_get_device_index(struct ibv_device *device);
    struct ibv_device **ibv_get_device_list(int *num_devices);
    const char *ibv_get_device_name(struct ibv_device *device);
    int ibv_get_pkey_index(struct ibv_context *context, uint8_t port_num, __be16 pkey);
    const char *ibv_get_sysfs_path(void);
    struct ibv_context *ibv_import_device(int cmd_fd);
    struct ibv_dm *ibv_import_dm(struct ibv_context *context, uint32_t dm_handle);
    struct ibv_mr *ibv_import_mr(struct ibv_pd *pd, uint32_t mr_handle);
    struct ibv_pd *ibv_import_pd(struct ibv_context *context, uint32_t pd_handle);
    int ibv_init_ah_from_wc(struct ibv_context *context, uint8_t port_num, struct ibv_wc *wc, struct ibv_grh *grh, struct ibv_ah_attr *ah_attr);
    enum ibv_fork_status ibv_is_fork_initialized(void);
    int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
    int ibv_modify_srq(struct ibv_srq *srq, struct ibv_srq_attr *srq_attr, int srq_attr_mask);
    const char *ibv_node_type_str(enum ibv_node_type node_type);
    struct ibv_context *ibv_open_device(struct ibv_device *device);
    const char *ibv_port_state_str(enum ibv_port_state port_state);
    struct ibv_qp_ex *ibv_qp_to_qp_ex(struct ibv_qp *qp);
    int ibv_query_device(struct ibv_context *context, struct ibv_device_attr *device_attr);
    int ibv_query_ece(struct ibv_qp *qp, struct ibv_ece *ece);
    int ibv_query_gid(struct ibv_context *context, uint8_t port_num, int index, union ibv_gid *gid);
    int ibv_query_gid_type(struct ibv_context *context, uint8_t port_num, unsigned int index, int *type);
    int ibv_query_pkey(struct ibv_context *context, uint8_t port_num, int index, __be16 *pkey);
    int ibv_query_port(struct ibv_context *context, uint8_t port_num, struct _compat_ibv_port_attr *port_attr);
    int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask, struct ibv_qp_init_attr *init_attr);
    int ibv_query_qp_data_in_order(struct ibv_qp *qp, enum ibv_wr_opcode op, uint32_t flags);
    int ibv_query_srq(struct ibv_srq *srq, struct ibv_srq_attr *srq_attr);
    int ibv_rate_to_mbps(enum ibv_rate rate);
    int ibv_rate_to_mult(enum ibv_rate rate);
    int ibv_read_sysfs_file(const char *dir, const char *file, char *buf, size_t size);
    struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access);
    struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access);
    struct ibv_mr *ibv_reg_mr_iova(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova, int access);
    struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova, unsigned int access);
    void ibv_register_driver(const char *name, void *init_func);
int ibv_query_gid_type(struct ibv_context *context, uint8_t port_num, unsigned int index,
                       int *type);
    int ibv_rereg_mr(struct ibv_mr *mr, int flags, struct ibv_pd *pd, void *addr, size_t length, int access);
    int ibv_resize_cq(struct ibv_cq *cq, int cqe);
    int ibv_resolve_eth_l2_from_gid(struct ibv_context *context, struct ibv_ah_attr *attr, uint8_t *eth_mac, uint16_t *vid);
    int ibv_set_ece(struct ibv_qp *qp, struct ibv_ece *ece);
    void ibv_unimport_dm(struct ibv_dm *dm);
    void ibv_unimport_mr(struct ibv_mr *mr);
    void ibv_unimport_pd(struct ibv_pd *pd);
    const char *ibv_wc_status_str(enum ibv_wc_status status);
    enum ibv_rate mbps_to_ibv_rate(int mbps);
    enum ibv_rate mult_to_ibv_rate(int mult);
    int raccept(int socket, struct sockaddr *addr, socklen_t *addrlen);
    int rbind(int socket, const struct sockaddr *addr, socklen_t addrlen);
    int rclose(int socket);
    int rconnect(int socket, const struct sockaddr *addr, socklen_t addrlen);
    int rdma_accept(struct rdma_cm_id *id, struct rdma_conn_param *conn_param);
    int rdma_ack_cm_event(struct rdma_cm_event *event);
    int rdma_bind_addr(struct rdma_cm_id *id, struct sockaddr *addr);
    int rdma_connect(struct rdma_cm_id *id, struct rdma_conn_param *conn_param);
    int rdma_create_ep(struct rdma_cm_id **id, struct rdma_addrinfo *res, struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr);
    struct rdma_event_channel *rdma_create_event_channel(void);
    int rdma_create_id(struct rdma_event_channel *channel, struct rdma_cm_id **id, void *context, enum rdma_port_space ps);
    int rdma_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr);
    int rdma_create_qp_ex(struct rdma_cm_id *id, struct ibv_qp_init_attr_ex *qp_init_attr);
    int rdma_create_srq(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_srq_init_attr *attr);
    int rdma_create_srq_ex(struct rdma_cm_id *id, struct ibv_srq_init_attr_ex *attr);
    void rdma_destroy_ep(struct rdma_cm_id *id);
    void rdma_destroy_event_channel(struct rdma_event_channel *channel);
    int rdma_destroy_id(struct rdma_cm_id *id);
    void rdma_destroy_qp(struct rdma_cm_id *id);
    void rdma_destroy_srq(struct rdma_cm_id *id);
    int rdma_disconnect(struct rdma_cm_id *id);
    int rdma_establish(struct rdma_cm_id *id);
    const char *rdma_event_str(enum rdma_cm_event_type event);
    void rdma_free_devices(struct ibv_context **list);
    void rdma_freeaddrinfo(struct rdma_addrinfo *res);
    int rdma_get_cm_event(struct rdma_event_channel *channel, struct rdma_cm_event **event);
    struct ibv_context **rdma_get_devices(int *num_devices);
    __be16 rdma_get_dst_port(struct rdma_cm_id *id);
    int rdma_get_remote_ece(struct rdma_cm_id *id, struct ibv_ece *ece);
    int rdma_get_request(struct rdma_cm_id *listen, struct rdma_cm_id **id);
    __be16 rdma_get_src_port(struct rdma_cm_id *id);
    int rdma_getaddrinfo(const char *node, const char *service, const struct rdma_addrinfo *hints, struct rdma_addrinfo **res);
    int rdma_init_qp_attr(struct rdma_cm_id *id, struct ibv_qp_attr *qp_attr, int *qp_attr_mask);
    int rdma_join_multicast(struct rdma_cm_id *id, struct sockaddr *addr, void *context);
    int rdma_join_multicast_ex(struct rdma_cm_id *id, struct rdma_cm_join_mc_attr_ex *mc_join_attr, void *context);
    int rdma_leave_multicast(struct rdma_cm_id *id, struct sockaddr *addr);
    int rdma_listen(struct rdma_cm_id *id, int backlog);
    int rdma_migrate_id(struct rdma_cm_id *id, struct rdma_event_channel *channel);
    int rdma_notify(struct rdma_cm_id *id, enum ibv_event_type event);
    int rdma_reject(struct rdma_cm_id *id, const void *private_data, uint8_t private_data_len);
    int rdma_reject_ece(struct rdma_cm_id *id, const void *private_data, uint8_t private_data_len);
    int rdma_resolve_addr(struct rdma_cm_id *id, struct sockaddr *src_addr, struct sockaddr *dst_addr, int timeout_ms);
    int rdma_resolve_route(struct rdma_cm_id *id, int timeout_ms);
    int rdma_set_local_ece(struct rdma_cm_id *id, struct ibv_ece *ece);
    int rdma_set_option(struct rdma_cm_id *id, int level, int optname, void *optval, size_t optlen);
    int rgetpeername(int socket, struct sockaddr *addr, socklen_t *addrlen);
    int rgetsockname(int socket, struct sockaddr *addr, socklen_t *addrlen);
    int rgetsockopt(int socket, int level, int optname, void *optval, socklen_t *optlen);
    off_t riomap(int socket, void *buf, size_t len, int prot, int flags, off_t offset);
    int riounmap(int socket, void *buf, size_t len);
    size_t riowrite(int socket, const void *buf, size_t count, off_t offset, int flags);
    int rlisten(int socket, int backlog);
    int rpoll(struct pollfd *fds, nfds_t nfds, int timeout);
    ssize_t rread(int socket, void *buf, size_t count);
    ssize_t rreadv(int socket, const struct iovec *iov, int iovcnt);
    ssize_t rrecv(int socket, void *buf, size_t len, int flags);
    ssize_t rrecvfrom(int socket, void *buf, size_t len, int flags, struct sockaddr *src_addr, socklen_t *addrlen);
    ssize_t rrecvmsg(int socket, struct msghdr *msg, int flags);
    int rselect(int nfds, fd_set *readfds, fd_set *writefds, fd_set *exceptfds, struct timeval *timeout);
    ssize_t rsend(int socket, const void *buf, size_t len, int flags);
    ssize_t rsendmsg(int socket, const struct msghdr *msg, int flags);
    ssize_t rsendto(int socket, const void *buf, size_t len, int flags, const struct sockaddr *dest_addr, socklen_t addrlen);
    int rsetsockopt(int socket, int level, int optname, const void *optval, socklen_t optlen);
    int rshutdown(int socket, int how);
    int rsocket(int domain, int type, int protocol);
    ssize_t rwrite(int socket, const void *buf, size_t count);
    ssize_t rwritev(int socket, const struct iovec *iov, int iovcnt);
"""

#: what the prototypes name, declared for cffi: structures opaque here (their members are
#: :mod:`softrdma.ibverbs.cdecls`'s, added by :func:`softrdma.exec.build.cdefs`), integer
#: typedefs by their C type (``__be64`` and friends: cdecls's)
TYPES = """
    typedef unsigned long nfds_t;
    typedef long off_t;
    typedef ... fd_set;
    struct timeval; struct pollfd; struct iovec; struct msghdr; struct sockaddr;
    struct ibv_device; struct ibv_context; struct ibv_device_attr; struct ibv_port_attr;
    struct _compat_ibv_port_attr; struct ibv_gid_entry; struct ibv_async_event;
    struct ibv_pd; struct ibv_mr; struct ibv_mw; struct ibv_dm; struct ibv_cq;
    struct ibv_comp_channel; struct ibv_srq; struct ibv_srq_attr; struct ibv_srq_init_attr;
    struct ibv_srq_init_attr_ex; struct ibv_qp; struct ibv_qp_ex; struct ibv_qp_attr;
    struct ibv_qp_init_attr; struct ibv_qp_init_attr_ex; struct ibv_ah; struct ibv_ah_attr;
    struct ibv_wc; struct ibv_grh; struct ibv_ece; struct ibv_sa_path_rec;
    struct ib_uverbs_ah_attr; struct ib_uverbs_qp_attr; struct ib_user_path_rec;
    struct rdma_cm_id; struct rdma_cm_event; struct rdma_event_channel; struct rdma_addrinfo;
    struct rdma_conn_param; struct rdma_cm_join_mc_attr_ex;
    union ibv_gid;
    enum ibv_event_type { ... }; enum ibv_node_type { ... }; enum ibv_port_state { ... };
    enum ibv_wc_status { ... }; enum ibv_rate { ... }; enum ibv_fork_status { ... };
    enum ibv_wr_opcode { ... }; enum rdma_cm_event_type { ... }; enum rdma_port_space { ... };
"""

#: C the headers do not give: the header-less functions' prototypes and rfcntl's
#: forwarder (fcntl's third argument is an int or a pointer: passed on as a long)
EXTRA_C = """
void ibv_copy_ah_attr_from_kern(struct ibv_ah_attr *dst, struct ib_uverbs_ah_attr *src);
void ibv_copy_qp_attr_from_kern(struct ibv_qp_attr *dst, struct ib_uverbs_qp_attr *src);
void ibv_copy_path_rec_from_kern(struct ibv_sa_path_rec *dst, struct ib_user_path_rec *src);
void ibv_copy_path_rec_to_kern(struct ib_user_path_rec *dst, struct ibv_sa_path_rec *src);
int ibv_dofork_range(void *base, size_t size);
int ibv_dontfork_range(void *base, size_t size);
const char *ibv_get_sysfs_path(void);
int ibv_read_sysfs_file(const char *dir, const char *file, char *buf, size_t size);
void ibv_register_driver(const char *name, void *init_func);
int ibv_query_gid_type(struct ibv_context *context, uint8_t port_num, unsigned int index,
                       int *type);
static long softrdma_rfcntl(int socket, int cmd, long arg);
int rfcntl(int socket, int cmd, ...)
{
    va_list ap;
    long arg;
    va_start(ap, cmd);
    arg = va_arg(ap, long);
    va_end(ap);
    return (int)softrdma_rfcntl(socket, cmd, arg);
}
"""

#: declared for cffi as the Python side of rfcntl's forwarder
CALLBACKS = """
    extern "Python" long softrdma_rfcntl(int socket, int cmd, long arg);
"""

_NAME = re.compile(r"(\w+)\s*\(")


def names(prototypes: str) -> list[str]:
    """The function names a block of prototypes declares, in order."""
    return [_NAME.search(line).group(1) for line in prototypes.split(";") if _NAME.search(line)]


def declarations(prototypes: str) -> dict[str, str]:
    """name -> prototype for a block of prototypes."""
    return {_NAME.search(p).group(1): p.strip() for p in prototypes.split(";") if _NAME.search(p)}


#: every function of the ABI: the prototyped ones and rfcntl (defined in C, see EXTRA_C)
ABI_NAMES: tuple[str, ...] = tuple(names(PROTOTYPES)) + ("rfcntl",)


def fail_value(prototype: str) -> object:
    """What a stub returns: NULL for a pointer, EOPNOTSUPP for a libibverbs ``int`` (verbs
    return the errno), -1 for librdmacm and the rsocket calls (which set errno)."""
    head = prototype.split("(")[0]
    name = head.split()[-1].lstrip("*")
    if "*" in head:
        return None
    if head.startswith("void "):
        return ...
    if name.startswith(("ibv_", "_ibv_")):
        return 95
    return -1
