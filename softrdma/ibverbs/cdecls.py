"""The C structures of libibverbs and librdmacm, described once for both directions.

softrdma crosses the C ABI of rdma-core both ways:

- **Python calling C** (:mod:`softrdma.ibverbs`, the libibverbs backend): ctypes reads and
  writes the structs a real provider hands out (``ibv_qp_attr``, ``ibv_wc``, ...).
- **C calling Python** (:mod:`softrdma.exec`, unmodified programs on soft devices): the
  preload library, built by cffi, reads the program's work requests and writes its
  completions in the same structs.

Both take their structures from :data:`DECLARATIONS` below, the declarations of rdma-core
44's headers (x86_64) as C, one definition per struct:

- :func:`ctypes_types` turns them into ``ctypes`` classes (every pointer an integer
  ``c_void_p``: the data path stores plain addresses, about ten times cheaper than
  ``ctypes.cast``; every enum a ``c_int``). :mod:`softrdma.ibverbs.layout` compares each
  member's offset, size and alignment with what gcc computes from the installed headers.
- :func:`cffi_cdef` renders them for cffi, each named struct left open with ``...;`` so
  that the compiler, not this text, places every member: the preload library stays right
  for headers that grew (``verbs_context`` grows at its front, ``ibv_qp_ex`` at its end),
  and cffi's generated C still checks every member named here, by type, against the
  header.

Only what both sides need is described; a struct added here is checked by both. Function
pointers keep their C signature: cffi assigns the preload library's callbacks to them and
gcc checks the types; ctypes sees an address.
"""

from __future__ import annotations

import re
from ctypes import (Structure, Union, c_char, c_int, c_long, c_size_t, c_ubyte, c_uint,
                    c_uint8, c_uint16, c_uint32, c_uint64, c_ulong, c_void_p)
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Union as TUnion

__all__ = ["DECLARATIONS", "CONSTANTS", "CFFI_TYPEDEFS", "CFFI_COMPILE_ARGS", "ctypes_types",
           "cffi_cdef", "parse", "Decl", "Member"]

#: the enum constants the declarations size arrays with (verbs.h's ``enum { ... }``)
CONSTANTS = {"IBV_SYSFS_NAME_MAX": 64, "IBV_SYSFS_PATH_MAX": 256}

DECLARATIONS = """
/* glibc (<sys/socket.h>, <netinet/in.h>): what librdmacm's structs hold by value */
struct sockaddr {
    uint16_t sa_family;
    char sa_data[14];
};
struct in_addr {
    uint32_t s_addr;
};
struct sockaddr_in {
    uint16_t sin_family;
    uint16_t sin_port;
    struct in_addr sin_addr;
    unsigned char sin_zero[8];
};
struct in6_addr {
    union {
        uint8_t __u6_addr8[16];
        uint16_t __u6_addr16[8];
        uint32_t __u6_addr32[4];
    } __in6_u;
};
struct sockaddr_in6 {
    uint16_t sin6_family;
    uint16_t sin6_port;
    uint32_t sin6_flowinfo;
    struct in6_addr sin6_addr;
    uint32_t sin6_scope_id;
};
struct sockaddr_storage {
    uint16_t ss_family;
    char __ss_padding[118];
    unsigned long __ss_align;
};
/* rdma-core 44: <infiniband/verbs.h>, <infiniband/sa.h>, <rdma/ib_user_sa.h>,
   <rdma/ib_user_verbs.h>, <rdma/rdma_cma.h> */
struct _ibv_device_ops {
    struct ibv_context *(*_dummy1)(struct ibv_device *device, int cmd_fd);
    void (*_dummy2)(struct ibv_context *context);
};
struct ibv_device {
    struct _ibv_device_ops _ops;
    enum ibv_node_type node_type;
    enum ibv_transport_type transport_type;
    char name[IBV_SYSFS_NAME_MAX];
    char dev_name[IBV_SYSFS_NAME_MAX];
    char dev_path[IBV_SYSFS_PATH_MAX];
    char ibdev_path[IBV_SYSFS_PATH_MAX];
};
struct ibv_context_ops {
    int (*_compat_query_device)(struct ibv_context *context,
            struct ibv_device_attr *device_attr);
    int (*_compat_query_port)(struct ibv_context *context, uint8_t port_num,
            struct _compat_ibv_port_attr *port_attr);
    void *(*_compat_alloc_pd)(void);
    void *(*_compat_dealloc_pd)(void);
    void *(*_compat_reg_mr)(void);
    void *(*_compat_rereg_mr)(void);
    void *(*_compat_dereg_mr)(void);
    struct ibv_mw *(*alloc_mw)(struct ibv_pd *pd, enum ibv_mw_type type);
    int (*bind_mw)(struct ibv_qp *qp, struct ibv_mw *mw, struct ibv_mw_bind *mw_bind);
    int (*dealloc_mw)(struct ibv_mw *mw);
    void *(*_compat_create_cq)(void);
    int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
    int (*req_notify_cq)(struct ibv_cq *cq, int solicited_only);
    void *(*_compat_cq_event)(void);
    void *(*_compat_resize_cq)(void);
    void *(*_compat_destroy_cq)(void);
    void *(*_compat_create_srq)(void);
    void *(*_compat_modify_srq)(void);
    void *(*_compat_query_srq)(void);
    void *(*_compat_destroy_srq)(void);
    int (*post_srq_recv)(struct ibv_srq *srq, struct ibv_recv_wr *recv_wr,
            struct ibv_recv_wr **bad_recv_wr);
    void *(*_compat_create_qp)(void);
    void *(*_compat_query_qp)(void);
    void *(*_compat_modify_qp)(void);
    void *(*_compat_destroy_qp)(void);
    int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr,
            struct ibv_send_wr **bad_wr);
    int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr,
            struct ibv_recv_wr **bad_wr);
    void *(*_compat_create_ah)(void);
    void *(*_compat_destroy_ah)(void);
    void *(*_compat_attach_mcast)(void);
    void *(*_compat_detach_mcast)(void);
    void *(*_compat_async_event)(void);
};
struct ibv_context {
    struct ibv_device *device;
    struct ibv_context_ops ops;
    int cmd_fd;
    int async_fd;
    int num_comp_vectors;
    pthread_mutex_t mutex;
    void *abi_compat;
};
struct verbs_context {
    int (*query_port)(struct ibv_context *context, uint8_t port_num,
            struct ibv_port_attr *port_attr, size_t port_attr_len);
    int (*advise_mr)(struct ibv_pd *pd, enum ib_uverbs_advise_mr_advice advice,
            uint32_t flags, struct ibv_sge *sg_list, uint32_t num_sges);
    struct ibv_mr *(*alloc_null_mr)(struct ibv_pd *pd);
    int (*read_counters)(struct ibv_counters *counters, uint64_t *counters_value,
            uint32_t ncounters, uint32_t flags);
    int (*attach_counters_point_flow)(struct ibv_counters *counters,
            struct ibv_counter_attach_attr *attr, struct ibv_flow *flow);
    struct ibv_counters *(*create_counters)(struct ibv_context *context,
            struct ibv_counters_init_attr *init_attr);
    int (*destroy_counters)(struct ibv_counters *counters);
    struct ibv_mr *(*reg_dm_mr)(struct ibv_pd *pd, struct ibv_dm *dm, uint64_t dm_offset,
            size_t length, unsigned int access);
    struct ibv_dm *(*alloc_dm)(struct ibv_context *context, struct ibv_alloc_dm_attr *attr);
    int (*free_dm)(struct ibv_dm *dm);
    int (*modify_flow_action_esp)(struct ibv_flow_action *action,
            struct ibv_flow_action_esp_attr *attr);
    int (*destroy_flow_action)(struct ibv_flow_action *action);
    struct ibv_flow_action *(*create_flow_action_esp)(struct ibv_context *context,
            struct ibv_flow_action_esp_attr *attr);
    int (*modify_qp_rate_limit)(struct ibv_qp *qp, struct ibv_qp_rate_limit_attr *attr);
    struct ibv_pd *(*alloc_parent_domain)(struct ibv_context *context,
            struct ibv_parent_domain_init_attr *attr);
    int (*dealloc_td)(struct ibv_td *td);
    struct ibv_td *(*alloc_td)(struct ibv_context *context,
            struct ibv_td_init_attr *init_attr);
    int (*modify_cq)(struct ibv_cq *cq, struct ibv_modify_cq_attr *attr);
    int (*post_srq_ops)(struct ibv_srq *srq, struct ibv_ops_wr *op,
            struct ibv_ops_wr **bad_op);
    int (*destroy_rwq_ind_table)(struct ibv_rwq_ind_table *rwq_ind_table);
    struct ibv_rwq_ind_table *(*create_rwq_ind_table)(struct ibv_context *context,
            struct ibv_rwq_ind_table_init_attr *init_attr);
    int (*destroy_wq)(struct ibv_wq *wq);
    int (*modify_wq)(struct ibv_wq *wq, struct ibv_wq_attr *wq_attr);
    struct ibv_wq *(*create_wq)(struct ibv_context *context,
            struct ibv_wq_init_attr *wq_init_attr);
    int (*query_rt_values)(struct ibv_context *context, struct ibv_values_ex *values);
    struct ibv_cq_ex *(*create_cq_ex)(struct ibv_context *context,
            struct ibv_cq_init_attr_ex *init_attr);
    struct verbs_ex_private *priv;
    int (*query_device_ex)(struct ibv_context *context,
            const struct ibv_query_device_ex_input *input, struct ibv_device_attr_ex *attr,
            size_t attr_size);
    int (*ibv_destroy_flow)(struct ibv_flow *flow);
    void (*ABI_placeholder2)(void);
    struct ibv_flow *(*ibv_create_flow)(struct ibv_qp *qp, struct ibv_flow_attr *flow_attr);
    void (*ABI_placeholder1)(void);
    struct ibv_qp *(*open_qp)(struct ibv_context *context, struct ibv_qp_open_attr *attr);
    struct ibv_qp *(*create_qp_ex)(struct ibv_context *context,
            struct ibv_qp_init_attr_ex *qp_init_attr_ex);
    int (*get_srq_num)(struct ibv_srq *srq, uint32_t *srq_num);
    struct ibv_srq *(*create_srq_ex)(struct ibv_context *context,
            struct ibv_srq_init_attr_ex *srq_init_attr_ex);
    struct ibv_xrcd *(*open_xrcd)(struct ibv_context *context,
            struct ibv_xrcd_init_attr *xrcd_init_attr);
    int (*close_xrcd)(struct ibv_xrcd *xrcd);
    uint64_t _ABI_placeholder3;
    size_t sz;
    struct ibv_context context;
};
struct ibv_device_attr {
    char fw_ver[64];
    __be64 node_guid;
    __be64 sys_image_guid;
    uint64_t max_mr_size;
    uint64_t page_size_cap;
    uint32_t vendor_id;
    uint32_t vendor_part_id;
    uint32_t hw_ver;
    int max_qp;
    int max_qp_wr;
    unsigned int device_cap_flags;
    int max_sge;
    int max_sge_rd;
    int max_cq;
    int max_cqe;
    int max_mr;
    int max_pd;
    int max_qp_rd_atom;
    int max_ee_rd_atom;
    int max_res_rd_atom;
    int max_qp_init_rd_atom;
    int max_ee_init_rd_atom;
    enum ibv_atomic_cap atomic_cap;
    int max_ee;
    int max_rdd;
    int max_mw;
    int max_raw_ipv6_qp;
    int max_raw_ethy_qp;
    int max_mcast_grp;
    int max_mcast_qp_attach;
    int max_total_mcast_qp_attach;
    int max_ah;
    int max_fmr;
    int max_map_per_fmr;
    int max_srq;
    int max_srq_wr;
    int max_srq_sge;
    uint16_t max_pkeys;
    uint8_t local_ca_ack_delay;
    uint8_t phys_port_cnt;
};
struct ibv_odp_caps {
    uint64_t general_caps;
    struct {
        uint32_t rc_odp_caps;
        uint32_t uc_odp_caps;
        uint32_t ud_odp_caps;
    } per_transport_caps;
};
struct ibv_tso_caps {
    uint32_t max_tso;
    uint32_t supported_qpts;
};
struct ibv_rss_caps {
    uint32_t supported_qpts;
    uint32_t max_rwq_indirection_tables;
    uint32_t max_rwq_indirection_table_size;
    uint64_t rx_hash_fields_mask;
    uint8_t rx_hash_function;
};
struct ibv_packet_pacing_caps {
    uint32_t qp_rate_limit_min;
    uint32_t qp_rate_limit_max;
    uint32_t supported_qpts;
};
struct ibv_tm_caps {
    uint32_t max_rndv_hdr_size;
    uint32_t max_num_tags;
    uint32_t flags;
    uint32_t max_ops;
    uint32_t max_sge;
};
struct ibv_cq_moderation_caps {
    uint16_t max_cq_count;
    uint16_t max_cq_period;
};
struct ibv_pci_atomic_caps {
    uint16_t fetch_add;
    uint16_t swap;
    uint16_t compare_swap;
};
struct ibv_device_attr_ex {
    struct ibv_device_attr orig_attr;
    uint32_t comp_mask;
    struct ibv_odp_caps odp_caps;
    uint64_t completion_timestamp_mask;
    uint64_t hca_core_clock;
    uint64_t device_cap_flags_ex;
    struct ibv_tso_caps tso_caps;
    struct ibv_rss_caps rss_caps;
    uint32_t max_wq_type_rq;
    struct ibv_packet_pacing_caps packet_pacing_caps;
    uint32_t raw_packet_caps;
    struct ibv_tm_caps tm_caps;
    struct ibv_cq_moderation_caps cq_mod_caps;
    uint64_t max_dm_size;
    struct ibv_pci_atomic_caps pci_atomic_caps;
    uint32_t xrc_odp_caps;
    uint32_t phys_port_cnt_ex;
};
struct ibv_query_device_ex_input {
    uint32_t comp_mask;
};
union ibv_gid {
    uint8_t raw[16];
    struct {
        __be64 subnet_prefix;
        __be64 interface_id;
    } global;
};
struct ibv_port_attr {
    enum ibv_port_state state;
    enum ibv_mtu max_mtu;
    enum ibv_mtu active_mtu;
    int gid_tbl_len;
    uint32_t port_cap_flags;
    uint32_t max_msg_sz;
    uint32_t bad_pkey_cntr;
    uint32_t qkey_viol_cntr;
    uint16_t pkey_tbl_len;
    uint16_t lid;
    uint16_t sm_lid;
    uint8_t lmc;
    uint8_t max_vl_num;
    uint8_t sm_sl;
    uint8_t subnet_timeout;
    uint8_t init_type_reply;
    uint8_t active_width;
    uint8_t active_speed;
    uint8_t phys_state;
    uint8_t link_layer;
    uint8_t flags;
    uint16_t port_cap_flags2;
};
struct ibv_gid_entry {
    union ibv_gid gid;
    uint32_t gid_index;
    uint32_t port_num;
    uint32_t gid_type;
    uint32_t ndev_ifindex;
};
struct ibv_pd {
    struct ibv_context *context;
    uint32_t handle;
};
struct ibv_mr {
    struct ibv_context *context;
    struct ibv_pd *pd;
    void *addr;
    size_t length;
    uint32_t handle;
    uint32_t lkey;
    uint32_t rkey;
};
struct ibv_mw {
    struct ibv_context *context;
    struct ibv_pd *pd;
    uint32_t rkey;
    uint32_t handle;
    enum ibv_mw_type type;
};
struct ibv_mw_bind_info {
    struct ibv_mr *mr;
    uint64_t addr;
    uint64_t length;
    unsigned int mw_access_flags;
};
struct ibv_mw_bind {
    uint64_t wr_id;
    unsigned int send_flags;
    struct ibv_mw_bind_info bind_info;
};
struct ibv_comp_channel {
    struct ibv_context *context;
    int fd;
    int refcnt;
};
struct ibv_cq {
    struct ibv_context *context;
    struct ibv_comp_channel *channel;
    void *cq_context;
    uint32_t handle;
    int cqe;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t comp_events_completed;
    uint32_t async_events_completed;
};
struct ibv_poll_cq_attr {
    uint32_t comp_mask;
};
struct ibv_cq_ex {
    struct ibv_context *context;
    struct ibv_comp_channel *channel;
    void *cq_context;
    uint32_t handle;
    int cqe;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t comp_events_completed;
    uint32_t async_events_completed;
    uint32_t comp_mask;
    enum ibv_wc_status status;
    uint64_t wr_id;
    int (*start_poll)(struct ibv_cq_ex *current, struct ibv_poll_cq_attr *attr);
    int (*next_poll)(struct ibv_cq_ex *current);
    void (*end_poll)(struct ibv_cq_ex *current);
    enum ibv_wc_opcode (*read_opcode)(struct ibv_cq_ex *current);
    uint32_t (*read_vendor_err)(struct ibv_cq_ex *current);
    uint32_t (*read_byte_len)(struct ibv_cq_ex *current);
    __be32 (*read_imm_data)(struct ibv_cq_ex *current);
    uint32_t (*read_qp_num)(struct ibv_cq_ex *current);
    uint32_t (*read_src_qp)(struct ibv_cq_ex *current);
    unsigned int (*read_wc_flags)(struct ibv_cq_ex *current);
    uint32_t (*read_slid)(struct ibv_cq_ex *current);
    uint8_t (*read_sl)(struct ibv_cq_ex *current);
    uint8_t (*read_dlid_path_bits)(struct ibv_cq_ex *current);
    uint64_t (*read_completion_ts)(struct ibv_cq_ex *current);
    uint16_t (*read_cvlan)(struct ibv_cq_ex *current);
    uint32_t (*read_flow_tag)(struct ibv_cq_ex *current);
    void (*read_tm_info)(struct ibv_cq_ex *current, struct ibv_wc_tm_info *tm_info);
    uint64_t (*read_completion_wallclock_ns)(struct ibv_cq_ex *current);
};
struct ibv_cq_init_attr_ex {
    uint32_t cqe;
    void *cq_context;
    struct ibv_comp_channel *channel;
    uint32_t comp_vector;
    uint64_t wc_flags;
    uint32_t comp_mask;
    uint32_t flags;
    struct ibv_pd *parent_domain;
};
struct ibv_srq {
    struct ibv_context *context;
    void *srq_context;
    struct ibv_pd *pd;
    uint32_t handle;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t events_completed;
};
struct ibv_srq_attr {
    uint32_t max_wr;
    uint32_t max_sge;
    uint32_t srq_limit;
};
struct ibv_srq_init_attr {
    void *srq_context;
    struct ibv_srq_attr attr;
};
struct ibv_qp {
    struct ibv_context *context;
    void *qp_context;
    struct ibv_pd *pd;
    struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    uint32_t handle;
    uint32_t qp_num;
    enum ibv_qp_state state;
    enum ibv_qp_type qp_type;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t events_completed;
};
struct ibv_ah {
    struct ibv_context *context;
    struct ibv_pd *pd;
    uint32_t handle;
};
struct ibv_global_route {
    union ibv_gid dgid;
    uint32_t flow_label;
    uint8_t sgid_index;
    uint8_t hop_limit;
    uint8_t traffic_class;
};
struct ibv_ah_attr {
    struct ibv_global_route grh;
    uint16_t dlid;
    uint8_t sl;
    uint8_t src_path_bits;
    uint8_t static_rate;
    uint8_t is_global;
    uint8_t port_num;
};
struct ibv_qp_cap {
    uint32_t max_send_wr;
    uint32_t max_recv_wr;
    uint32_t max_send_sge;
    uint32_t max_recv_sge;
    uint32_t max_inline_data;
};
struct ibv_qp_init_attr {
    void *qp_context;
    struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    struct ibv_qp_cap cap;
    enum ibv_qp_type qp_type;
    int sq_sig_all;
};
struct ibv_rx_hash_conf {
    uint8_t rx_hash_function;
    uint8_t rx_hash_key_len;
    uint8_t *rx_hash_key;
    uint64_t rx_hash_fields_mask;
};
struct ibv_qp_init_attr_ex {
    void *qp_context;
    struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    struct ibv_qp_cap cap;
    enum ibv_qp_type qp_type;
    int sq_sig_all;
    uint32_t comp_mask;
    struct ibv_pd *pd;
    struct ibv_xrcd *xrcd;
    uint32_t create_flags;
    uint16_t max_tso_header;
    struct ibv_rwq_ind_table *rwq_ind_tbl;
    struct ibv_rx_hash_conf rx_hash_conf;
    uint32_t source_qpn;
    uint64_t send_ops_flags;
};
struct ibv_qp_attr {
    enum ibv_qp_state qp_state;
    enum ibv_qp_state cur_qp_state;
    enum ibv_mtu path_mtu;
    enum ibv_mig_state path_mig_state;
    uint32_t qkey;
    uint32_t rq_psn;
    uint32_t sq_psn;
    uint32_t dest_qp_num;
    unsigned int qp_access_flags;
    struct ibv_qp_cap cap;
    struct ibv_ah_attr ah_attr;
    struct ibv_ah_attr alt_ah_attr;
    uint16_t pkey_index;
    uint16_t alt_pkey_index;
    uint8_t en_sqd_async_notify;
    uint8_t sq_draining;
    uint8_t max_rd_atomic;
    uint8_t max_dest_rd_atomic;
    uint8_t min_rnr_timer;
    uint8_t port_num;
    uint8_t timeout;
    uint8_t retry_cnt;
    uint8_t rnr_retry;
    uint8_t alt_port_num;
    uint8_t alt_timeout;
    uint32_t rate_limit;
};
struct ibv_sge {
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
};
struct ibv_send_wr {
    uint64_t wr_id;
    struct ibv_send_wr *next;
    struct ibv_sge *sg_list;
    int num_sge;
    enum ibv_wr_opcode opcode;
    unsigned int send_flags;
    union {
        __be32 imm_data;
        uint32_t invalidate_rkey;
    };
    union {
        struct {
            uint64_t remote_addr;
            uint32_t rkey;
        } rdma;
        struct {
            uint64_t remote_addr;
            uint64_t compare_add;
            uint64_t swap;
            uint32_t rkey;
        } atomic;
        struct {
            struct ibv_ah *ah;
            uint32_t remote_qpn;
            uint32_t remote_qkey;
        } ud;
    } wr;
    union {
        struct {
            uint32_t remote_srqn;
        } xrc;
    } qp_type;
    union {
        struct {
            struct ibv_mw *mw;
            uint32_t rkey;
            struct ibv_mw_bind_info bind_info;
        } bind_mw;
        struct {
            void *hdr;
            uint16_t hdr_sz;
            uint16_t mss;
        } tso;
    };
};
struct ibv_recv_wr {
    uint64_t wr_id;
    struct ibv_recv_wr *next;
    struct ibv_sge *sg_list;
    int num_sge;
};
struct ibv_data_buf {
    void *addr;
    size_t length;
};
struct ibv_qp_ex {
    struct ibv_qp qp_base;
    uint64_t comp_mask;
    uint64_t wr_id;
    unsigned int wr_flags;
    void (*wr_atomic_cmp_swp)(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr,
            uint64_t compare, uint64_t swap);
    void (*wr_atomic_fetch_add)(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr,
            uint64_t add);
    void (*wr_bind_mw)(struct ibv_qp_ex *qp, struct ibv_mw *mw, uint32_t rkey,
            const struct ibv_mw_bind_info *bind_info);
    void (*wr_local_inv)(struct ibv_qp_ex *qp, uint32_t invalidate_rkey);
    void (*wr_rdma_read)(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr);
    void (*wr_rdma_write)(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr);
    void (*wr_rdma_write_imm)(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr,
            __be32 imm_data);
    void (*wr_send)(struct ibv_qp_ex *qp);
    void (*wr_send_imm)(struct ibv_qp_ex *qp, __be32 imm_data);
    void (*wr_send_inv)(struct ibv_qp_ex *qp, uint32_t invalidate_rkey);
    void (*wr_send_tso)(struct ibv_qp_ex *qp, void *hdr, uint16_t hdr_sz, uint16_t mss);
    void (*wr_set_ud_addr)(struct ibv_qp_ex *qp, struct ibv_ah *ah, uint32_t remote_qpn,
            uint32_t remote_qkey);
    void (*wr_set_xrc_srqn)(struct ibv_qp_ex *qp, uint32_t remote_srqn);
    void (*wr_set_inline_data)(struct ibv_qp_ex *qp, void *addr, size_t length);
    void (*wr_set_inline_data_list)(struct ibv_qp_ex *qp, size_t num_buf,
            const struct ibv_data_buf *buf_list);
    void (*wr_set_sge)(struct ibv_qp_ex *qp, uint32_t lkey, uint64_t addr, uint32_t length);
    void (*wr_set_sge_list)(struct ibv_qp_ex *qp, size_t num_sge,
            const struct ibv_sge *sg_list);
    void (*wr_start)(struct ibv_qp_ex *qp);
    int (*wr_complete)(struct ibv_qp_ex *qp);
    void (*wr_abort)(struct ibv_qp_ex *qp);
    void (*wr_atomic_write)(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr,
            const void *atomic_wr);
};
struct ibv_wc {
    uint64_t wr_id;
    enum ibv_wc_status status;
    enum ibv_wc_opcode opcode;
    uint32_t vendor_err;
    uint32_t byte_len;
    union {
        __be32 imm_data;
        uint32_t invalidated_rkey;
    };
    uint32_t qp_num;
    uint32_t src_qp;
    unsigned int wc_flags;
    uint16_t pkey_index;
    uint16_t slid;
    uint8_t sl;
    uint8_t dlid_path_bits;
};
struct ibv_async_event {
    union {
        struct ibv_cq *cq;
        struct ibv_qp *qp;
        struct ibv_srq *srq;
        struct ibv_wq *wq;
        int port_num;
    } element;
    enum ibv_event_type event_type;
};
struct ibv_grh {
    __be32 version_tclass_flow;
    __be16 paylen;
    uint8_t next_hdr;
    uint8_t hop_limit;
    union ibv_gid sgid;
    union ibv_gid dgid;
};
struct ibv_sa_path_rec {
    union ibv_gid dgid;
    union ibv_gid sgid;
    __be16 dlid;
    __be16 slid;
    int raw_traffic;
    __be32 flow_label;
    uint8_t hop_limit;
    uint8_t traffic_class;
    int reversible;
    uint8_t numb_path;
    __be16 pkey;
    uint8_t sl;
    uint8_t mtu_selector;
    uint8_t mtu;
    uint8_t rate_selector;
    uint8_t rate;
    uint8_t packet_life_time_selector;
    uint8_t packet_life_time;
    uint8_t preference;
};
struct ib_user_path_rec {
    __u8 dgid[16];
    __u8 sgid[16];
    __be16 dlid;
    __be16 slid;
    __u32 raw_traffic;
    __be32 flow_label;
    __u32 reversible;
    __u32 mtu;
    __be16 pkey;
    __u8 hop_limit;
    __u8 traffic_class;
    __u8 numb_path;
    __u8 sl;
    __u8 mtu_selector;
    __u8 rate_selector;
    __u8 rate;
    __u8 packet_life_time_selector;
    __u8 packet_life_time;
    __u8 preference;
};
struct ib_uverbs_global_route {
    __u8 dgid[16];
    __u32 flow_label;
    __u8 sgid_index;
    __u8 hop_limit;
    __u8 traffic_class;
    __u8 reserved;
};
struct ib_uverbs_ah_attr {
    struct ib_uverbs_global_route grh;
    __u16 dlid;
    __u8 sl;
    __u8 src_path_bits;
    __u8 static_rate;
    __u8 is_global;
    __u8 port_num;
    __u8 reserved;
};
struct ib_uverbs_qp_attr {
    __u32 qp_attr_mask;
    __u32 qp_state;
    __u32 cur_qp_state;
    __u32 path_mtu;
    __u32 path_mig_state;
    __u32 qkey;
    __u32 rq_psn;
    __u32 sq_psn;
    __u32 dest_qp_num;
    __u32 qp_access_flags;
    struct ib_uverbs_ah_attr ah_attr;
    struct ib_uverbs_ah_attr alt_ah_attr;
    __u32 max_send_wr;
    __u32 max_recv_wr;
    __u32 max_send_sge;
    __u32 max_recv_sge;
    __u32 max_inline_data;
    __u16 pkey_index;
    __u16 alt_pkey_index;
    __u8 en_sqd_async_notify;
    __u8 sq_draining;
    __u8 max_rd_atomic;
    __u8 max_dest_rd_atomic;
    __u8 min_rnr_timer;
    __u8 port_num;
    __u8 timeout;
    __u8 retry_cnt;
    __u8 rnr_retry;
    __u8 alt_port_num;
    __u8 alt_timeout;
    __u8 reserved[5];
};
struct rdma_ib_addr {
    union ibv_gid sgid;
    union ibv_gid dgid;
    __be16 pkey;
};
struct rdma_addr {
    union {
        struct sockaddr src_addr;
        struct sockaddr_in src_sin;
        struct sockaddr_in6 src_sin6;
        struct sockaddr_storage src_storage;
    };
    union {
        struct sockaddr dst_addr;
        struct sockaddr_in dst_sin;
        struct sockaddr_in6 dst_sin6;
        struct sockaddr_storage dst_storage;
    };
    union {
        struct rdma_ib_addr ibaddr;
    } addr;
};
struct rdma_route {
    struct rdma_addr addr;
    struct ibv_sa_path_rec *path_rec;
    int num_paths;
};
struct rdma_event_channel {
    int fd;
};
struct rdma_cm_id {
    struct ibv_context *verbs;
    struct rdma_event_channel *channel;
    void *context;
    struct ibv_qp *qp;
    struct rdma_route route;
    enum rdma_port_space ps;
    uint8_t port_num;
    struct rdma_cm_event *event;
    struct ibv_comp_channel *send_cq_channel;
    struct ibv_cq *send_cq;
    struct ibv_comp_channel *recv_cq_channel;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    struct ibv_pd *pd;
    enum ibv_qp_type qp_type;
};
struct rdma_conn_param {
    const void *private_data;
    uint8_t private_data_len;
    uint8_t responder_resources;
    uint8_t initiator_depth;
    uint8_t flow_control;
    uint8_t retry_count;
    uint8_t rnr_retry_count;
    uint8_t srq;
    uint32_t qp_num;
};
struct rdma_ud_param {
    const void *private_data;
    uint8_t private_data_len;
    struct ibv_ah_attr ah_attr;
    uint32_t qp_num;
    uint32_t qkey;
};
struct rdma_cm_event {
    struct rdma_cm_id *id;
    struct rdma_cm_id *listen_id;
    enum rdma_cm_event_type event;
    int status;
    union {
        struct rdma_conn_param conn;
        struct rdma_ud_param ud;
    } param;
};
struct rdma_cm_join_mc_attr_ex {
    uint32_t comp_mask;
    uint32_t join_flags;
    struct sockaddr *addr;
};
struct rdma_addrinfo {
    int ai_flags;
    int ai_family;
    int ai_qp_type;
    int ai_port_space;
    socklen_t ai_src_len;
    socklen_t ai_dst_len;
    struct sockaddr *ai_src_addr;
    struct sockaddr *ai_dst_addr;
    char *ai_src_canonname;
    char *ai_dst_canonname;
    size_t ai_route_len;
    void *ai_route;
    size_t ai_connect_len;
    void *ai_connect;
    struct rdma_addrinfo *ai_next;
};
"""

# glibc's pthread types are opaque: only their size and alignment matter (x86_64)
_SCALARS: dict[str, type] = {
    "char": c_char, "unsigned char": c_ubyte, "int": c_int, "unsigned int": c_uint,
    "unsigned": c_uint, "long": c_long, "unsigned long": c_ulong, "size_t": c_size_t,
    "uint8_t": c_uint8, "uint16_t": c_uint16, "uint32_t": c_uint32, "uint64_t": c_uint64,
    "__u8": c_uint8, "__u16": c_uint16, "__u32": c_uint32, "__u64": c_uint64,
    "__be16": c_uint16, "__be32": c_uint32, "__be64": c_uint64, "socklen_t": c_uint32,
    "pthread_mutex_t": c_uint64 * 5, "pthread_cond_t": c_uint64 * 6,
}

#: what cffi is told of the non-standard scalar types (the headers' own typedefs). cffi
#: tells ``uint32_t`` from ``unsigned int``: the callbacks are declared with ``uintN_t``, so
#: are these; the 64-bit ones are ``unsigned long long`` as in <asm-generic/int-ll64.h>
#: (``uint64_t`` is ``unsigned long``: ``ibv_get_device_guid``'s definition would clash)
CFFI_TYPEDEFS = """
    typedef uint8_t __u8; typedef uint16_t __u16; typedef uint32_t __u32;
    typedef unsigned long long __u64; typedef uint16_t __be16; typedef uint32_t __be32;
    typedef unsigned long long __be64; typedef unsigned int socklen_t;
    typedef struct { ...; } pthread_mutex_t; typedef struct { ...; } pthread_cond_t;
"""


#: for gcc compiling cffi's C from :func:`cffi_cdef`: a member whose type here is not the
#: header's is an error, not a warning (cffi's generated code assigns ``&p->member`` to a
#: pointer of the type written here; an integer of another size cffi refuses at first use)
CFFI_COMPILE_ARGS = ["-Werror=incompatible-pointer-types", "-Werror=pointer-sign"]


@dataclass
class Member:
    """One member of a struct or union: ``ctype`` is the C type as written (for a nested
    anonymous struct or union, ``nested`` holds it instead), ``count`` an array length."""

    name: str | None  # None: an anonymous struct/union whose members belong to the parent
    ctype: str = ""
    count: int | None = None
    nested: "Decl | None" = None

    @property
    def pointer(self) -> bool:
        """A data or function pointer: an address, whatever it points to."""
        return "*" in self.ctype


@dataclass
class Decl:
    """A struct or union: ``kind`` is "struct" or "union", ``name`` None when anonymous."""

    kind: str
    name: str | None
    members: list[Member] = field(default_factory=list)

    @property
    def cname(self) -> str:
        return f"{self.kind} {self.name}"


_HEAD = re.compile(r"^(struct|union)(?:\s+(\w+))?\s*\{", re.S)
_FNPTR = re.compile(r"\(\s*\*\s*(\w+)\s*\)\s*\(")
_PLAIN = re.compile(r"^(.*?)(\w+)\s*(?:\[\s*(\w+)\s*\])?$", re.S)


def _split(body: str) -> list[str]:
    """The top-level ``;``-terminated declarations of a struct body or of the text."""
    out, depth, cur = [], 0, []
    for ch in body:
        cur.append(ch)
        if ch in "{(":
            depth += 1
        elif ch in "})":
            depth -= 1
        elif ch == ";" and depth == 0:
            out.append("".join(cur)[:-1].strip())
            cur = []
    return [d for d in out if d]


def _decl(src: str) -> tuple[Decl, str]:
    """A struct/union definition and what follows its closing brace (a member name)."""
    m = _HEAD.match(src)
    if m is None:
        raise ValueError(f"not a struct or union: {src[:60]!r}")
    close = src.rindex("}")
    d = Decl(m.group(1), m.group(2))
    for item in _split(src[m.end():close]):
        d.members.append(_member(item))
    return d, src[close + 1:].strip()


def _member(item: str) -> Member:
    item = " ".join(item.split())
    if _HEAD.match(item):
        nested, name = _decl(item)
        return Member(name or None, nested=nested)
    fn = _FNPTR.search(item)
    if fn:
        return Member(fn.group(1), ctype=item[:fn.start()].strip() + " (*)" +
                      item[fn.end() - 1:])
    m = _PLAIN.match(item)
    if m is None:
        raise ValueError(f"cannot read the member {item!r}")
    count = m.group(3)
    n = None if count is None else int(CONSTANTS.get(count, count))
    return Member(m.group(2), ctype=m.group(1).strip(), count=n)


def parse(text: str = DECLARATIONS) -> list[Decl]:
    """The named structs and unions of ``text``, in order."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return [_decl(item)[0] for item in _split(text)]


# -- ctypes ------------------------------------------------------------------------------


def _ctype(m: Member, known: dict[str, type]) -> type:
    if m.pointer:
        t: type = c_void_p
    else:
        base = m.ctype.replace("const ", "").strip()
        if base.startswith("enum "):
            t = c_int
        elif base in _SCALARS:
            t = _SCALARS[base]
        elif base in known:
            t = known[base]
        else:
            raise ValueError(f"{m.name}: {base!r} is not described before its use")
    return t * m.count if m.count is not None else t


def _ctypes_class(d: Decl, name: str, known: dict[str, type]) -> type:
    fields, anonymous, n = [], [], 0
    for m in d.members:
        if m.nested is not None:
            mname = m.name
            if mname is None:
                mname, n = f"_anon{n}", n + 1
                anonymous.append(mname)
            fields.append((mname, _ctypes_class(m.nested, f"{name}_{mname}", known)))
        else:
            fields.append((m.name, _ctype(m, known)))
    base = Structure if d.kind == "struct" else Union
    ns: dict[str, object] = {"_fields_": fields}
    if anonymous:
        ns["_anonymous_"] = tuple(anonymous)
    return type(name, (base,), ns)


@lru_cache(maxsize=None)
def ctypes_types(text: str = DECLARATIONS) -> dict[str, type]:
    """C name (``"struct ibv_wc"``) -> ctypes class, for every struct and union of
    ``text``; nested anonymous members are named as C names them, an anonymous struct or
    union inside another is an ``_anonymous_`` member (``wc.imm_data`` as in C)."""
    known: dict[str, type] = {}
    for d in parse(text):
        known[d.cname] = _ctypes_class(d, str(d.name), known)
    return known


# -- cffi --------------------------------------------------------------------------------


def _render(d: Decl, indent: str, open_end: bool) -> list[str]:
    head = f"{d.kind} {d.name} {{" if d.name else f"{d.kind} {{"
    out = [indent + head]
    for m in d.members:
        if m.nested is not None:
            inner = _render(m.nested, indent + "    ", False)
            inner[-1] = inner[-1][:-1] + (f" {m.name};" if m.name else ";")
            out += inner
        elif "(*)" in m.ctype:
            out.append(f"{indent}    {m.ctype.replace('(*)', f'(*{m.name})', 1)};")
        else:
            arr = f"[{m.count}]" if m.count is not None else ""
            out.append(f"{indent}    {m.ctype} {m.name}{arr};")
    if open_end:
        out.append(indent + "    ...;")
    out.append(indent + "};")
    return out


def cffi_cdef(text: str = DECLARATIONS, *, declared_enums: TUnion[set[str], frozenset[str]] =
              frozenset(), typedefs: bool = True) -> str:
    """``text`` as a cffi ``cdef``: the scalar typedefs, a forward declaration of every
    struct it only points to, ``enum X { ... };`` for every enum it names (except those
    in ``declared_enums``, declared elsewhere with their constants), and each named struct
    or union open at its end (``...;``), so the compiler places the members (all but those
    an anonymous member holds: see :func:`_held_by_anonymous`). ``typedefs=False`` leaves
    out :data:`CFFI_TYPEDEFS`, for a caller that declares them before its own types."""
    decls = parse(text)
    flat = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    defined = {d.cname for d in decls}
    forward = sorted({f"{k} {n}" for k, n in re.findall(r"\b(struct|union)\s+(\w+)", flat)}
                     - defined)
    enums = sorted(set(re.findall(r"\benum\s+(\w+)", flat)) - set(declared_enums))
    out = [CFFI_TYPEDEFS] if typedefs else []  # else the caller declares them first
    out += [f"    {f};" for f in forward]
    out += [f"    enum {e} {{ ... }};" for e in enums]
    closed = _held_by_anonymous(decls)
    for d in decls:
        out += _render(d, "    ", d.cname not in closed)
    return "\n".join(out) + "\n"


def _held_by_anonymous(decls: list[Decl]) -> set[str]:
    """The structs some anonymous struct or union holds by value: cffi cannot leave those
    open (an open member makes its holder open, and an anonymous holder has no name to
    ask the compiler about), so their members must be exactly the header's (the layout
    check holds them to it)."""
    by_name = {d.cname: d for d in decls}
    held: set[str] = set()

    def walk(d: Decl, anonymous: bool) -> None:
        for m in d.members:
            if m.nested is not None:
                walk(m.nested, True)
            elif anonymous and not m.pointer and m.ctype in by_name and m.ctype not in held:
                held.add(m.ctype)
                walk(by_name[m.ctype], True)  # what a closed struct holds is closed too

    for d in decls:
        walk(d, False)
    return held
