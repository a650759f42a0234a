/*
 * FAKE libibverbs.so.1 (tests only), part two: the verbs pyverbs (44 or 59) links against that the
 * rdma transport never calls. They exist so the real pyverbs loads (Python opens extension
 * modules with RTLD_NOW); each says EOPNOTSUPP. Kept apart from verbs.h, whose prototypes these
 * loose ones would clash with.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

/* ---- what pyverbs links against but the transport never calls ----------------------------- */
#define NOSYS_PTR(name, ...) void *name(__VA_ARGS__) { errno = EOPNOTSUPP; return NULL; }
#define NOSYS_INT(name, ...) int name(__VA_ARGS__) { return EOPNOTSUPP; }
NOSYS_PTR(ibv_create_ah, void *a, void *b)
NOSYS_PTR(ibv_create_ah_from_wc, void *a, void *b, void *c, int d)
NOSYS_INT(ibv_destroy_ah, void *a)
NOSYS_PTR(ibv_create_comp_channel, void *a)
NOSYS_INT(ibv_destroy_comp_channel, void *a)
NOSYS_PTR(ibv_create_srq, void *a, void *b)
NOSYS_INT(ibv_destroy_srq, void *a)
NOSYS_INT(ibv_modify_srq, void *a, void *b, int c)
NOSYS_INT(ibv_query_srq, void *a, void *b)
NOSYS_INT(ibv_get_async_event, void *a, void *b)
void ibv_ack_async_event(void *e) { (void)e; }
NOSYS_INT(ibv_get_cq_event, void *a, void *b, void *c)
void ibv_ack_cq_events(void *cq, unsigned int n) { (void)cq, (void)n; }
NOSYS_INT(ibv_resize_cq, void *a, int b)
int ibv_fork_init(void) { return 0; }
int ibv_is_fork_initialized(void) { return 0; /* IBV_FORK_DISABLED */ }
NOSYS_PTR(ibv_import_device, int a)
NOSYS_PTR(ibv_import_dm, void *a, uint32_t b)
NOSYS_PTR(ibv_import_mr, void *a, uint32_t b)
NOSYS_PTR(ibv_import_pd, void *a, uint32_t b)
void ibv_unimport_dm(void *a) { (void)a; }
void ibv_unimport_mr(void *a) { (void)a; }
void ibv_unimport_pd(void *a) { (void)a; }
NOSYS_PTR(ibv_qp_to_qp_ex, void *a)
NOSYS_INT(ibv_query_ece, void *a, void *b)
NOSYS_INT(ibv_set_ece, void *a, void *b)
int ibv_query_qp_data_in_order(void *qp, int op, uint32_t flags) { (void)qp, (void)op, (void)flags; return 0; }
NOSYS_INT(ibv_rereg_mr, void *a, int b, void *c, void *d, size_t e, int f)
/* what the real librdmacm.so.1 (loaded by pyverbs' cmid module) binds against */
NOSYS_INT(ibv_attach_mcast, void *a, void *b, uint16_t c)
NOSYS_INT(ibv_detach_mcast, void *a, void *b, uint16_t c)
void ibv_copy_ah_attr_from_kern(void *a, void *b) { (void)a, (void)b; }
void ibv_copy_path_rec_from_kern(void *a, void *b) { (void)a, (void)b; }
void ibv_copy_qp_attr_from_kern(void *a, void *b) { (void)a, (void)b; }
int ibv_get_pkey_index(void *a, uint8_t b, uint16_t c) { (void)a, (void)b, (void)c; return -1; }
int ibv_get_sysfs_path(char *a, size_t b) { (void)a, (void)b; return -1; }
int ibv_read_sysfs_file(const char *a, const char *b, char *c, size_t d) { (void)a, (void)b, (void)c, (void)d; return -1; }
