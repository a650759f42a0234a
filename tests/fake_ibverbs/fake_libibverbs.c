/*
 * FAKE libibverbs.so.1, for tests only: an emulated RDMA NIC below the real pyverbs.
 *
 * It exports the symbols (and symbol versions, fake_libibverbs.map) that Debian's python3-pyverbs
 * links against, so pyverbs and the transport's verbs.py run unchanged over it when the test
 * puts this library first on LD_LIBRARY_PATH. Functions the transport never reaches return
 * EOPNOTSUPP.
 *
 * What it checks, as a real RC fabric would:
 *  - QP state order (RESET->INIT->RTR->RTS, any->ERR/RESET) and the attribute masks each
 *    transition requires; port, pkey index, path MTU (<= the port's max), GID index (< the
 *    table, GRH required on RoCE), rd_atomic against the device caps;
 *  - MR access flags (REMOTE_WRITE needs LOCAL_WRITE), lkeys, rkeys, bounds, PD of the rkey;
 *  - reachability: the dgid must be a GID of a live device of the same type (IB / RoCE v1 /
 *    RoCE v2) as our source GID; RoCE v1 does not cross a routed fabric; on IB the dlid must be
 *    the peer's LID; the peer QP must be connected back to us;
 *  - PSNs: each WR advances both sides by its packet count; a mismatch never completes;
 *  - path MTU both ways: a WRITE larger than the responder's path MTU is NAKed as an invalid
 *    request; a READ whose responses exceed the requester's path MTU never completes;
 *  - a bounded send queue: a post beyond max_send_wr WRs not yet vouched for by a polled CQE
 *    is ENOMEM, more SGEs than max_send_sge EINVAL, a QP not in RTS (or ERR) EINVAL;
 *  - a bounded CQ: one more CQE than it holds overruns it and every poll after that fails;
 *    destroying a QP removes its CQEs, as mlx5 does; device caps (max_cqe, max_qp_wr, rd_atom)
 *    settable, what exceeds them refused.
 * A WR that cannot reach its peer completes with RETRY_EXC_ERR after the time a NIC would
 * retry (4.096 us * 2^timeout * (retry_cnt + 1)) times FAKE_IBV_RETRY_SCALE (default 1).
 *
 * Devices come from FAKE_IBV_DEVICES: "name:link:mtu[:flags]" comma-separated, link "roce", "ib",
 * "iwarp" (an RNIC: iWARP transport, Ethernet link) or "efa" (unspecified link and transport), mtu
 * in bytes (256..4096); a GID table changes at run time through a file (gid_knob); FAKE_IBV_TC / FAKE_IBV_SL: the one traffic class (RoCE) / service level
 * (IB) the fabric carries, the rest is dropped (retried out); flags "routed" (a routed fabric), "down" (port DOWN), "nogid" (an empty GID table), joined by +. FAKE_IBV_HOST (default: the pid) makes this process's GIDs and
 * LIDs; FAKE_IBV_FABRIC names the fabric (a shared file in /dev/shm) processes meet on. The
 * FAKE_IBV_INSTANT=1 checks every WR as above but moves no bytes (CPU-cost benchmarks). The
 * one-sided data moves with process_vm_readv/writev into the peer process's registered memory.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#undef ibv_query_port
#undef ibv_reg_mr
#undef ibv_get_device_list

#define MAXDEV 64
#define MAXQP 4096
#define MAXMR 8192
#define NGID 4
#define LINK_IB 1
#define LINK_ETH 2
#define LINK_NONE 0 /* IBV_LINK_LAYER_UNSPECIFIED, as EFA reports */
#define MAX_RD_ATOM 16
#define MAX_QP_WR 16384

/* Device caps, smaller where a test sets FAKE_IBV_MAX_CQE / _MAX_QP_WR / _MAX_RD_ATOM (devices
 * differ: a CQ or QP larger than the device's, or more rd_atomic, is refused as on hardware). */
static int cap(const char *name, int dflt)
{
	const char *v = getenv(name);
	return v && *v ? atoi(v) : dflt;
}
#define CAP_CQE cap("FAKE_IBV_MAX_CQE", 4194303)
#define CAP_QP_WR cap("FAKE_IBV_MAX_QP_WR", MAX_QP_WR)
#define CAP_RD_ATOM cap("FAKE_IBV_MAX_RD_ATOM", MAX_RD_ATOM)

/* ---- the fabric: a table in shared memory that every process of a test maps ---------------- */
struct rdev {
	int pid, link, mtu, lid, routed, down, nogid;
	int host;
	char name[64];
	int lossless_tc, lossless_sl; /* -1, or the only class the fabric carries (FAKE_IBV_TC/SL) */
	uint8_t gid[NGID][16];
	int gid_type[NGID]; /* enum ibv_gid_type */
	uint32_t gid_gone;  /* bit i: entry i is empty (its address was removed from the netdev) */
};
struct rqp {
	int pid, dev, state, is_global, sgid_index, path_mtu, access;
	uint32_t qpn, pd, dest_qpn, rq_psn, sq_psn;
	uint8_t dgid[16];
	uint16_t dlid;
	uint8_t timeout, retry_cnt, traffic_class, sl;
};
struct rmr {
	int pid, access;
	uint32_t rkey, pd;
	uint64_t addr, length; /* the MR's iova range: what lkeys and rkeys address */
	uint64_t base;	       /* where its bytes are in the owner's memory (a dma-buf's mapping) */
	uint64_t map_len;      /* a dma-buf MR's mapping, unmapped at dereg */
};
struct fabric {
	uint32_t magic, next_id;
	struct rdev dev[MAXDEV];
	struct rqp qp[MAXQP];
	struct rmr mr[MAXMR];
};

static struct fabric *fab;
static int fab_fd = -1;
static pthread_mutex_t big = PTHREAD_MUTEX_INITIALIZER; /* this process's objects */

/* getpid() without a system call per WR (reset in a forked child) */
static int my_pid;
static void forget_pid(void) { my_pid = 0; }
static int self_pid(void)
{
	if (!my_pid) {
		pthread_atfork(NULL, NULL, forget_pid);
		my_pid = getpid();
	}
	return my_pid;
}
static int alive(int pid) { return pid > 0 && (pid == self_pid() || kill(pid, 0) == 0 || errno != ESRCH); }

static void lock(void) { pthread_mutex_lock(&big); flock(fab_fd, LOCK_EX); }
static void unlock(void) { flock(fab_fd, LOCK_UN); pthread_mutex_unlock(&big); }

static int attach(void)
{
	if (fab)
		return 0;
	const char *name = getenv("FAKE_IBV_FABRIC");
	char path[256];
	snprintf(path, sizeof(path), "/dev/shm/fake-ibverbs-%s", name && *name ? name : "default");
	int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0 || ftruncate(fd, sizeof(struct fabric)) != 0)
		return -1;
	void *p = mmap(NULL, sizeof(struct fabric), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		return -1;
	fab = p;
	fab_fd = fd;
	flock(fd, LOCK_EX);
	if (fab->magic != 0xfabc0de) {
		fab->magic = 0xfabc0de;
		fab->next_id = 0x100;
	}
	flock(fd, LOCK_UN);
	return 0;
}

static uint32_t new_id(void) { return fab->next_id++ & 0xffffff; } /* under lock */

/* ---- this process's devices -------------------------------------------------------------- */
struct fdev {
	struct ibv_device dev;
	int slot; /* in fab->dev */
};
static struct fdev devs[MAXDEV];
static int ndevs = -1;

static int mtu_enum(int bytes)
{
	for (int m = IBV_MTU_256, b = 256; m <= IBV_MTU_4096; m++, b *= 2)
		if (b == bytes)
			return m;
	return 0;
}
static int mtu_bytes(int m) { return 128 << m; }

static void load_devices(void)
{
	if (ndevs >= 0 || attach() != 0)
		return;
	ndevs = 0;
	const char *env = getenv("FAKE_IBV_DEVICES");
	const char *h = getenv("FAKE_IBV_HOST");
	int host = (h && *h ? atoi(h) : getpid()) & 0xffff;
	char *spec = strdup(env ? env : "");
	char *save = NULL;
	lock();
	for (char *tok = strtok_r(spec, ",", &save); tok && ndevs < MAXDEV; tok = strtok_r(NULL, ",", &save)) {
		char name[64] = "", link[8] = "", routed[16] = "";
		int mtu = 4096;
		if (sscanf(tok, "%63[^:]:%7[^:]:%d:%15s", name, link, &mtu, routed) < 2 || !mtu_enum(mtu))
			continue;
		int slot = -1;
		for (int i = 0; i < MAXDEV && slot < 0; i++)
			if (!alive(fab->dev[i].pid))
				slot = i;
		if (slot < 0)
			break;
		struct rdev *r = &fab->dev[slot];
		memset(r, 0, sizeof(*r));
		r->pid = getpid();
		r->link = strcmp(link, "ib") == 0 ? LINK_IB : strcmp(link, "efa") == 0 ? LINK_NONE : LINK_ETH;
		r->mtu = mtu_enum(mtu);
		r->routed = strstr(routed, "routed") != NULL;
		r->down = strstr(routed, "down") != NULL;
		r->host = host;
		snprintf(r->name, sizeof(r->name), "%s", name);
		r->nogid = strstr(routed, "nogid") != NULL; /* no address on the netdev: no GIDs */
		const char *tc = getenv("FAKE_IBV_TC"), *sl = getenv("FAKE_IBV_SL");
		r->lossless_tc = tc && *tc ? atoi(tc) : -1;
		r->lossless_sl = sl && *sl ? atoi(sl) : -1;
		r->lid = r->link == LINK_IB ? 1 + ((host * 8 + ndevs) % 0xbffe) : 0;
		for (int g = 0; g < NGID; g++) {
			uint8_t *gid = r->gid[g];
			if (g < 2) { /* fe80::<host>:<dev>:1 */
				gid[0] = 0xfe, gid[1] = 0x80;
				gid[10] = host >> 8, gid[11] = host & 0xff, gid[13] = ndevs, gid[15] = 1;
			} else { /* ::ffff:10.<host>.<dev+1> */
				gid[10] = gid[11] = 0xff, gid[12] = 10;
				gid[13] = host >> 8, gid[14] = host & 0xff, gid[15] = ndevs + 1;
			}
			r->gid_type[g] = r->link == LINK_IB ? IBV_GID_TYPE_IB
					 : (g % 2 ? IBV_GID_TYPE_ROCE_V2 : IBV_GID_TYPE_ROCE_V1);
		}
		struct fdev *d = &devs[ndevs++];
		memset(d, 0, sizeof(*d));
		d->slot = slot;
		/* what the kernel reports for an iWARP NIC (RNIC) and for EFA (an unspecified link) */
		int iwarp = strcmp(link, "iwarp") == 0;
		d->dev.node_type = iwarp ? IBV_NODE_RNIC : r->link == LINK_NONE ? IBV_NODE_UNSPECIFIED : IBV_NODE_CA;
		d->dev.transport_type = iwarp ? IBV_TRANSPORT_IWARP
				      : r->link == LINK_NONE ? IBV_TRANSPORT_UNSPECIFIED : IBV_TRANSPORT_IB;
		snprintf(d->dev.name, sizeof(d->dev.name), "%s", name);
		snprintf(d->dev.dev_name, sizeof(d->dev.dev_name), "uverbs%d", ndevs - 1);
		snprintf(d->dev.dev_path, sizeof(d->dev.dev_path), "/fake/uverbs%d", ndevs - 1);
		snprintf(d->dev.ibdev_path, sizeof(d->dev.ibdev_path), "/fake/%s", name);
	}
	unlock();
	free(spec);
}

/* A port goes DOWN at run time while /dev/shm/fake-ibverbs-FABRIC.HOST.NAME.down exists (a
 * test pulls the cable by creating it): its WRs are not delivered, query_port says DOWN. */
static int port_down(struct rdev *r)
{
	if (r->down)
		return 1;
	const char *f = getenv("FAKE_IBV_FABRIC");
	char path[256];
	snprintf(path, sizeof(path), "/dev/shm/fake-ibverbs-%s.%d.%s.down", f && *f ? f : "default",
		 r->host, r->name);
	return access(path, F_OK) == 0;
}

/* The GID table changes at run time while /dev/shm/fake-ibverbs-FABRIC.HOST.NAME.gids exists
 * (an address added to or removed from the netdev): each line "INDEX -" empties that entry,
 * "INDEX GID v1|v2" sets it (GID as 32 hex digits, colons allowed). Applied to the shared table,
 * under the lock, by every call that reads it, so both ends of the fabric see the new table. */
static void gid_knob(struct rdev *r)
{
	const char *f = getenv("FAKE_IBV_FABRIC");
	char path[256], line[160];
	snprintf(path, sizeof(path), "/dev/shm/fake-ibverbs-%s.%d.%s.gids", f && *f ? f : "default",
		 r->host, r->name);
	FILE *fh = fopen(path, "r");
	if (!fh)
		return;
	while (fgets(line, sizeof(line), fh)) {
		int idx;
		char gid[64] = "", type[8] = "";
		if (sscanf(line, "%d %63s %7s", &idx, gid, type) < 2 || idx < 0 || idx >= NGID)
			continue;
		if (strcmp(gid, "-") == 0) {
			r->gid_gone |= 1u << idx;
			continue;
		}
		uint8_t raw[16];
		int n = 0;
		for (const char *c = gid; *c && n < 32; c++) {
			int v = *c >= '0' && *c <= '9' ? *c - '0' : *c >= 'a' && *c <= 'f' ? *c - 'a' + 10
				: *c >= 'A' && *c <= 'F' ? *c - 'A' + 10 : -1;
			if (v < 0)
				continue; /* a colon */
			raw[n / 2] = n % 2 ? (raw[n / 2] | v) : v << 4;
			n++;
		}
		if (n != 32)
			continue;
		memcpy(r->gid[idx], raw, 16);
		r->gid_type[idx] = r->link == LINK_IB ? IBV_GID_TYPE_IB
				 : strcmp(type, "v1") == 0 ? IBV_GID_TYPE_ROCE_V1 : IBV_GID_TYPE_ROCE_V2;
		r->gid_gone &= ~(1u << idx);
	}
	fclose(fh);
}
static int gid_ok(struct rdev *r, int idx); /* below: a valid entry of the table */

static struct fdev *fdev_of(struct ibv_device *dev) { return (struct fdev *)dev; }
static struct rdev *rdev_of(struct ibv_context *ctx) { return &fab->dev[fdev_of(ctx->device)->slot]; }

struct ibv_device **ibv_get_device_list(int *num)
{
	load_devices();
	if (ndevs <= 0) {
		errno = ENOSYS; /* what libibverbs says when no device exists */
		if (num)
			*num = 0;
		return NULL;
	}
	struct ibv_device **list = calloc(ndevs + 1, sizeof(*list));
	for (int i = 0; i < ndevs; i++)
		list[i] = &devs[i].dev;
	if (num)
		*num = ndevs;
	return list;
}
void ibv_free_device_list(struct ibv_device **list) { free(list); }
const char *ibv_get_device_name(struct ibv_device *d) { return d->name; }
__be64 ibv_get_device_guid(struct ibv_device *d) { return htobe64(0x0002c90300000000ull + fdev_of(d)->slot); }
int ibv_get_device_index(struct ibv_device *d) { return fdev_of(d) - devs; }

/* ---- completions ------------------------------------------------------------------------- */
struct fcqe {
	struct ibv_wc wc;
	double ready_at; /* a failed retry shows after the time the NIC spends retrying */
	struct fqp *qp;	 /* whose send queue slots this CQE frees when polled */
	uint64_t seq;	 /* the WR's place in that send queue */
};
/* A QP as this process holds it: the verbs struct first, then its send queue accounting. A
 * send queue holds max_send_wr WRs: a slot frees once a CQE of that WR or of a later one on
 * the QP is polled (RC completes in order), as on hardware; a post past it is ENOMEM. */
struct fqp {
	struct ibv_qp qp;
	uint32_t max_send_wr, max_send_sge;
	uint64_t posted, done;
};
struct fcq {
	struct ibv_cq cq;
	struct fcqe *ring;
	int head, count, overrun;
};

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void push_cqe(struct fcq *cq, struct ibv_wc *wc, double delay, struct fqp *qp, uint64_t seq) /* under lock */
{
	if (cq->count >= cq->cq.cqe) {
		cq->overrun = 1; /* a real CQ overrun: the CQ is in error from now on */
		return;
	}
	struct fcqe *e = &cq->ring[(cq->head + cq->count++) % cq->cq.cqe];
	e->wc = *wc;
	e->ready_at = delay > 0 ? now() + delay : 0;
	e->qp = qp;
	e->seq = seq;
}

static int fake_poll_cq(struct ibv_cq *ibcq, int n, struct ibv_wc *wc)
{
	struct fcq *cq = (struct fcq *)ibcq;
	int got = 0;
	pthread_mutex_lock(&big);
	if (cq->overrun) {
		pthread_mutex_unlock(&big);
		return -EOVERFLOW;
	}
	double t = cq->count ? now() : 0;
	while (got < n && cq->count && cq->ring[cq->head].ready_at <= t) {
		struct fcqe *e = &cq->ring[cq->head];
		if (e->qp->done < e->seq)
			e->qp->done = e->seq;
		wc[got++] = e->wc;
		cq->head = (cq->head + 1) % cq->cq.cqe;
		cq->count--;
	}
	pthread_mutex_unlock(&big);
	return got;
}

static int fake_req_notify(struct ibv_cq *cq, int solicited) { (void)cq, (void)solicited; return EOPNOTSUPP; }
static int fake_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
	(void)qp;
	*bad = wr;
	return EOPNOTSUPP; /* the transport is one-sided */
}
static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad);

/* ---- context, device and port queries ---------------------------------------------------- */
struct ibv_context *ibv_open_device(struct ibv_device *device)
{
	load_devices();
	if (!fab || !alive(fab->dev[fdev_of(device)->slot].pid)) {
		errno = ENODEV;
		return NULL;
	}
	struct ibv_context *ctx = calloc(1, sizeof(*ctx));
	ctx->device = device;
	ctx->cmd_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
	ctx->async_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
	ctx->num_comp_vectors = 1;
	pthread_mutex_init(&ctx->mutex, NULL);
	ctx->abi_compat = NULL; /* not extended: the inline _ex verbs say EOPNOTSUPP */
	ctx->ops.poll_cq = fake_poll_cq;
	ctx->ops.req_notify_cq = fake_req_notify;
	ctx->ops.post_send = fake_post_send;
	ctx->ops.post_recv = fake_post_recv;
	return ctx;
}

int ibv_close_device(struct ibv_context *ctx)
{
	close(ctx->cmd_fd);
	close(ctx->async_fd);
	free(ctx);
	return 0;
}

int ibv_query_device(struct ibv_context *ctx, struct ibv_device_attr *a)
{
	memset(a, 0, sizeof(*a));
	snprintf(a->fw_ver, sizeof(a->fw_ver), "fake-0.1");
	a->node_guid = ibv_get_device_guid(ctx->device);
	a->sys_image_guid = a->node_guid;
	a->max_mr_size = 1ull << 40;
	a->page_size_cap = 4096;
	a->vendor_id = 0x02c9;
	a->max_qp = MAXQP;
	a->max_qp_wr = CAP_QP_WR;
	a->max_sge = 30;
	a->max_cq = 1024;
	a->max_cqe = CAP_CQE;
	a->max_mr = MAXMR;
	a->max_pd = 1024;
	a->max_qp_rd_atom = CAP_RD_ATOM;
	a->max_qp_init_rd_atom = CAP_RD_ATOM;
	a->max_pkeys = 1;
	a->phys_port_cnt = 1;
	return 0;
}

static int ngid(struct rdev *r) { return r->nogid ? 0 : r->link == LINK_IB ? 1 : NGID; }
static int gid_ok(struct rdev *r, int idx) { return idx >= 0 && idx < ngid(r) && !(r->gid_gone >> idx & 1); }

int ibv_query_port(struct ibv_context *ctx, uint8_t port, struct _compat_ibv_port_attr *out)
{
	struct ibv_port_attr *a = (struct ibv_port_attr *)out;
	if (port != 1)
		return EINVAL;
	struct rdev *r = rdev_of(ctx);
	int down = port_down(r);
	a->state = down ? IBV_PORT_DOWN : IBV_PORT_ACTIVE;
	a->max_mtu = IBV_MTU_4096;
	a->active_mtu = r->mtu;
	a->gid_tbl_len = ngid(r);
	a->max_msg_sz = 1u << 31;
	a->pkey_tbl_len = 1;
	a->lid = r->lid;
	a->link_layer = r->link == LINK_IB ? IBV_LINK_LAYER_INFINIBAND
			: r->link == LINK_ETH ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_UNSPECIFIED;
	a->phys_state = down ? 3 : 5; /* Disabled, LinkUp */
	a->active_width = 2;
	a->active_speed = 32;
	return 0;
}


int ibv_query_gid(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid)
{
	struct rdev *r = rdev_of(ctx);
	if (port != 1 || index < 0 || index >= ngid(r))
		return -1;
	lock();
	gid_knob(r);
	if (gid_ok(r, index))
		memcpy(gid->raw, r->gid[index], 16);
	else
		memset(gid->raw, 0, 16); /* an empty entry reads as all zeros (sysfs), rc 0 */
	unlock();
	return 0;
}

/* rdma-core's private verb behind pyverbs' Context.query_gid_type: 0 = IB/RoCE v1, 1 = RoCE v2 */
int ibv_query_gid_type(struct ibv_context *ctx, uint8_t port, unsigned int index, uint32_t *type)
{
	struct rdev *r = rdev_of(ctx);
	lock();
	gid_knob(r);
	int ok = port == 1 && gid_ok(r, (int)index), v2 = ok && r->gid_type[index] == IBV_GID_TYPE_ROCE_V2;
	unlock();
	if (!ok)
		return EINVAL; /* an empty entry has no type (sysfs gid_attrs/types/N says EINVAL) */
	*type = v2;
	return 0;
}
/* the same verb under rdma-core 44's private ABI, for pyverbs built against that release */
__asm__(".symver ibv_query_gid_type_34, ibv_query_gid_type@IBVERBS_PRIVATE_34");
int ibv_query_gid_type_34(struct ibv_context *ctx, uint8_t port, unsigned int index, uint32_t *type);
int ibv_query_gid_type_34(struct ibv_context *ctx, uint8_t port, unsigned int index, uint32_t *type)
{
	return ibv_query_gid_type(ctx, port, index, type);
}

int _ibv_query_gid_ex(struct ibv_context *ctx, uint32_t port, uint32_t index,
		      struct ibv_gid_entry *e, uint32_t flags, size_t size)
{
	(void)flags;
	struct rdev *r = rdev_of(ctx);
	if (port != 1 || index >= (unsigned)ngid(r) || size < sizeof(*e))
		return EINVAL;
	lock();
	gid_knob(r);
	int ok = gid_ok(r, (int)index);
	unlock();
	if (!ok)
		return ENODATA; /* what rdma-core answers for an empty entry */
	memcpy(e->gid.raw, r->gid[index], 16);
	e->gid_index = index;
	e->port_num = port;
	e->gid_type = r->gid_type[index];
	e->ndev_ifindex = r->link == LINK_IB ? 0 : 2;
	return 0;
}

ssize_t _ibv_query_gid_table(struct ibv_context *ctx, struct ibv_gid_entry *entries,
			     size_t max, uint32_t flags, size_t size)
{
	struct rdev *r = rdev_of(ctx);
	size_t n = 0;
	for (int i = 0; i < ngid(r) && n < max; i++) {
		int rc = _ibv_query_gid_ex(ctx, 1, i, &entries[n], flags, size);
		if (rc == ENODATA)
			continue; /* the table lists valid entries only */
		if (rc)
			return -EINVAL;
		n++;
	}
	return n;
}

int ibv_query_pkey(struct ibv_context *ctx, uint8_t port, int index, __be16 *pkey)
{
	(void)ctx;
	if (port != 1 || index != 0)
		return -1;
	*pkey = htobe16(0xffff);
	return 0;
}

/* ---- PD and MR --------------------------------------------------------------------------- */
struct ibv_pd *ibv_alloc_pd(struct ibv_context *ctx)
{
	struct ibv_pd *pd = calloc(1, sizeof(*pd));
	pd->context = ctx;
	lock();
	pd->handle = new_id();
	unlock();
	return pd;
}
int ibv_dealloc_pd(struct ibv_pd *pd) { free(pd); return 0; }

struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova,
				unsigned int access)
{
	if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) && !(access & IBV_ACCESS_LOCAL_WRITE)) {
		errno = EINVAL; /* the kernel's rule: remote write needs local write */
		return NULL;
	}
	if (!addr || !length || iova != (uintptr_t)addr) {
		errno = EINVAL;
		return NULL;
	}
	lock();
	int slot = -1;
	for (int i = 0; i < MAXMR && slot < 0; i++)
		if (!alive(fab->mr[i].pid))
			slot = i;
	if (slot < 0) {
		unlock();
		errno = ENOMEM;
		return NULL;
	}
	struct ibv_mr *mr = calloc(1, sizeof(*mr));
	mr->context = pd->context;
	mr->pd = pd;
	mr->addr = addr;
	mr->length = length;
	mr->handle = slot;
	mr->lkey = mr->rkey = new_id() << 8 | 0x5a; /* lkey = rkey, as mlx5 */
	fab->mr[slot] = (struct rmr){getpid(), (int)access, mr->rkey, pd->handle, (uintptr_t)addr, length,
				     (uintptr_t)addr, 0};
	unlock();
	return mr;
}

/* A dma-buf MR, as the kernel makes one: the pages of [offset, offset + length) of the dma-buf
 * ``fd``, addressed at ``iova``. The emulation maps the fd (the fake CUDA driver's device memory
 * is a memfd) so that WRs reach those pages; pyverbs' DmaBufMR passes iova = offset. */
struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length, uint64_t iova,
				 int fd, int access)
{
	if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) && !(access & IBV_ACCESS_LOCAL_WRITE)) {
		errno = EINVAL;
		return NULL;
	}
	const char *no = getenv("FAKE_IBV_NO_DMABUF");
	if (no && *no && *no != '0') {
		errno = EOPNOTSUPP; /* a device (or kernel) that cannot import dma-bufs */
		return NULL;
	}
	size_t map_len = offset + length;
	void *map = length ? mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
	if (map == MAP_FAILED) {
		errno = EINVAL; /* not a dma-buf this device can import */
		return NULL;
	}
	struct ibv_mr *mr = ibv_reg_mr(pd, (char *)map + offset, length, access);
	if (!mr) {
		munmap(map, map_len);
		return NULL;
	}
	lock();
	fab->mr[mr->handle].addr = iova;
	fab->mr[mr->handle].map_len = map_len;
	unlock();
	mr->addr = (void *)(uintptr_t)iova;
	return mr;
}
struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access)
{
	return ibv_reg_mr_iova2(pd, addr, length, (uintptr_t)addr, access);
}
int ibv_dereg_mr(struct ibv_mr *mr)
{
	lock();
	struct rmr *r = &fab->mr[mr->handle];
	if (r->map_len) /* a dma-buf MR: its mapping starts map_len - length before its pages */
		munmap((char *)(uintptr_t)r->base - (r->map_len - r->length), r->map_len);
	memset(r, 0, sizeof(struct rmr));
	unlock();
	free(mr);
	return 0;
}

static struct rmr *find_mr(int pid, uint32_t key)
{
	for (int i = 0; i < MAXMR; i++)
		if (fab->mr[i].pid == pid && fab->mr[i].rkey == key)
			return &fab->mr[i];
	return NULL;
}

/* ---- CQ ---------------------------------------------------------------------------------- */
struct ibv_cq *ibv_create_cq(struct ibv_context *ctx, int cqe, void *cq_context,
			     struct ibv_comp_channel *channel, int comp_vector)
{
	(void)comp_vector;
	if (cqe < 1 || cqe > CAP_CQE) {
		errno = EINVAL;
		return NULL;
	}
	struct fcq *cq = calloc(1, sizeof(*cq));
	cq->cq.context = ctx;
	cq->cq.channel = channel;
	cq->cq.cq_context = cq_context;
	cq->cq.cqe = cqe;
	pthread_mutex_init(&cq->cq.mutex, NULL);
	pthread_cond_init(&cq->cq.cond, NULL);
	cq->ring = calloc(cqe, sizeof(*cq->ring));
	return &cq->cq;
}
int ibv_destroy_cq(struct ibv_cq *ibcq)
{
	struct fcq *cq = (struct fcq *)ibcq;
	free(cq->ring);
	free(cq);
	return 0;
}

/* ---- QP ---------------------------------------------------------------------------------- */
struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *init)
{
	if (init->qp_type != IBV_QPT_RC) {
		errno = EOPNOTSUPP; /* the emulation models RC only */
		return NULL;
	}
	if (!init->send_cq || !init->recv_cq || init->cap.max_send_wr > (uint32_t)CAP_QP_WR ||
	    init->cap.max_send_sge > 30 || init->cap.max_recv_sge > 30) {
		errno = EINVAL;
		return NULL;
	}
	lock();
	int slot = -1;
	for (int i = 0; i < MAXQP && slot < 0; i++)
		if (!alive(fab->qp[i].pid))
			slot = i;
	if (slot < 0) {
		unlock();
		errno = ENOMEM;
		return NULL;
	}
	struct fqp *fq = calloc(1, sizeof(*fq));
	struct ibv_qp *qp = &fq->qp;
	fq->max_send_wr = init->cap.max_send_wr;
	fq->max_send_sge = init->cap.max_send_sge ? init->cap.max_send_sge : 1;
	qp->context = pd->context;
	qp->qp_context = init->qp_context;
	qp->pd = pd;
	qp->send_cq = init->send_cq;
	qp->recv_cq = init->recv_cq;
	qp->handle = slot;
	qp->qp_num = new_id();
	qp->state = IBV_QPS_RESET;
	qp->qp_type = IBV_QPT_RC;
	pthread_mutex_init(&qp->mutex, NULL);
	pthread_cond_init(&qp->cond, NULL);
	struct rqp *r = &fab->qp[slot];
	memset(r, 0, sizeof(*r));
	r->pid = getpid();
	r->dev = fdev_of(pd->context->device)->slot;
	r->qpn = qp->qp_num;
	r->pd = pd->handle;
	r->state = IBV_QPS_RESET;
	unlock();
	return qp;
}

int ibv_destroy_qp(struct ibv_qp *qp)
{
	lock();
	/* mlx5 cleans the CQ of a destroyed QP's completions (__mlx5_cq_clean): their slots free */
	struct fcq *cq = (struct fcq *)qp->send_cq;
	int kept = 0;
	for (int i = 0; i < cq->count; i++) {
		struct fcqe e = cq->ring[(cq->head + i) % cq->cq.cqe];
		if (e.wc.qp_num != qp->qp_num)
			cq->ring[(cq->head + kept++) % cq->cq.cqe] = e;
	}
	cq->count = kept;
	memset(&fab->qp[qp->handle], 0, sizeof(struct rqp));
	unlock();
	free(qp);
	return 0;
}

/* The attributes RC requires (and allows) per transition, as the kernel's qp_state_table. */
static int check_mask(int cur, int next, int mask)
{
	int need = IBV_QP_STATE, allow = IBV_QP_STATE | IBV_QP_CUR_STATE;
	if (next == IBV_QPS_ERR || next == IBV_QPS_RESET)
		return (mask & ~allow) ? EINVAL : 0;
	if (cur == IBV_QPS_RESET && next == IBV_QPS_INIT) {
		need |= IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
	} else if (cur == IBV_QPS_INIT && next == IBV_QPS_RTR) {
		need |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
			IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
		allow |= IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX;
	} else if (cur == IBV_QPS_RTR && next == IBV_QPS_RTS) {
		need |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
			IBV_QP_MAX_QP_RD_ATOMIC;
		allow |= IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER |
			 IBV_QP_PATH_MIG_STATE;
	} else if (cur == next && (cur == IBV_QPS_INIT || cur == IBV_QPS_RTS)) {
		allow |= IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER;
	} else {
		return EINVAL;
	}
	allow |= need;
	return ((mask & need) != need || (mask & ~allow)) ? EINVAL : 0;
}

int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask)
{
	lock();
	struct rqp *r = &fab->qp[qp->handle];
	struct rdev *d = &fab->dev[r->dev];
	int next = mask & IBV_QP_STATE ? (int)a->qp_state : r->state, rc;
	if ((mask & IBV_QP_CUR_STATE) && (int)a->cur_qp_state != r->state)
		rc = EINVAL;
	else
		rc = check_mask(r->state, next, mask);
	if (!rc && (mask & IBV_QP_PORT) && a->port_num != 1)
		rc = EINVAL;
	if (!rc && (mask & IBV_QP_PKEY_INDEX) && a->pkey_index != 0)
		rc = EINVAL;
	if (!rc && (mask & IBV_QP_PATH_MTU) && (a->path_mtu < IBV_MTU_256 || a->path_mtu > IBV_MTU_4096))
		rc = EINVAL;
	if (!rc && (mask & IBV_QP_MAX_DEST_RD_ATOMIC) && a->max_dest_rd_atomic > CAP_RD_ATOM)
		rc = EINVAL;
	if (!rc && (mask & IBV_QP_MAX_QP_RD_ATOMIC) && a->max_rd_atomic > CAP_RD_ATOM)
		rc = EINVAL;
	if (!rc && (mask & IBV_QP_RETRY_CNT) && a->retry_cnt > 7)
		rc = EINVAL;
	if (!rc && (mask & IBV_QP_AV)) {
		struct ibv_ah_attr *ah = &a->ah_attr;
		if (ah->port_num != 1)
			rc = EINVAL;
		else if (d->link == LINK_ETH && !ah->is_global)
			rc = EINVAL; /* RoCE addresses by GID only */
		else if (ah->is_global && (gid_knob(d), !gid_ok(d, ah->grh.sgid_index)))
			rc = EINVAL; /* no such source GID, or its entry is empty (the kernel's
				      * rdma_get_gid_attr refuses an invalid entry) */
		else if (d->link == LINK_IB && !ah->is_global && ah->dlid == 0)
			rc = EINVAL;
	}
	if (!rc) {
		if (mask & IBV_QP_ACCESS_FLAGS)
			r->access = a->qp_access_flags;
		if (mask & IBV_QP_PATH_MTU)
			r->path_mtu = a->path_mtu;
		if (mask & IBV_QP_DEST_QPN)
			r->dest_qpn = a->dest_qp_num;
		if (mask & IBV_QP_RQ_PSN)
			r->rq_psn = a->rq_psn & 0xffffff;
		if (mask & IBV_QP_SQ_PSN)
			r->sq_psn = a->sq_psn & 0xffffff;
		if (mask & IBV_QP_TIMEOUT)
			r->timeout = a->timeout;
		if (mask & IBV_QP_RETRY_CNT)
			r->retry_cnt = a->retry_cnt;
		if (mask & IBV_QP_AV) {
			r->is_global = a->ah_attr.is_global;
			r->sgid_index = a->ah_attr.grh.sgid_index;
			r->dlid = a->ah_attr.dlid;
			r->sl = a->ah_attr.sl;
			r->traffic_class = a->ah_attr.grh.traffic_class;
			memcpy(r->dgid, a->ah_attr.grh.dgid.raw, 16);
		}
		if (next == IBV_QPS_RESET)
			memset(&r->is_global, 0, sizeof(*r) - offsetof(struct rqp, is_global));
		r->state = next;
		qp->state = next;
	}
	unlock();
	return rc;
}

int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask, struct ibv_qp_init_attr *init)
{
	(void)mask;
	lock();
	struct rqp *r = &fab->qp[qp->handle];
	memset(a, 0, sizeof(*a));
	a->qp_state = a->cur_qp_state = r->state;
	a->path_mtu = r->path_mtu;
	a->rq_psn = r->rq_psn;
	a->sq_psn = r->sq_psn;
	a->dest_qp_num = r->dest_qpn;
	a->qp_access_flags = r->access;
	a->port_num = 1;
	a->timeout = r->timeout;
	a->retry_cnt = r->retry_cnt;
	a->ah_attr.is_global = r->is_global;
	a->ah_attr.dlid = r->dlid;
	a->ah_attr.sl = r->sl;
	a->ah_attr.grh.traffic_class = r->traffic_class;
	a->ah_attr.grh.sgid_index = r->sgid_index;
	memcpy(a->ah_attr.grh.dgid.raw, r->dgid, 16);
	unlock();
	if (init) {
		memset(init, 0, sizeof(*init));
		init->send_cq = qp->send_cq;
		init->recv_cq = qp->recv_cq;
		init->qp_type = qp->qp_type;
	}
	return 0;
}

/* ---- the wire ---------------------------------------------------------------------------- */
static uint32_t packets(uint64_t len, int mtu) { return len ? (len + mtu_bytes(mtu) - 1) / mtu_bytes(mtu) : 1; }

static int instant(void);
/* The responder QP our WR reaches, or NULL when the fabric would not deliver it. */
static struct rqp *route(struct rqp *me)
{
	struct rdev *src = &fab->dev[me->dev];
	int stype = src->gid_type[me->sgid_index];
	for (int i = 0; i < MAXQP; i++) {
		struct rqp *q = &fab->qp[i];
		if (q->qpn != me->dest_qpn || !alive(q->pid))
			continue;
		struct rdev *dst = &fab->dev[q->dev];
		/* instant mode leaves out the run-time knobs (files looked up per WR) */
		if (!alive(dst->pid) || dst->link != src->link ||
		    (!instant() && (port_down(src) || port_down(dst))))
			return NULL;
		if (src->link == LINK_IB && me->dlid != dst->lid)
			return NULL;
		if (me->is_global) {
			int hit = -1;
			if (!instant())
				gid_knob(dst);
			for (int g = 0; g < ngid(dst); g++)
				if (gid_ok(dst, g) && !memcmp(dst->gid[g], me->dgid, 16))
					hit = g;
			if (hit < 0 || dst->gid_type[hit] != stype)
				return NULL;
			if (stype == IBV_GID_TYPE_ROCE_V1 && (src->routed || dst->routed))
				return NULL; /* RoCE v1 is L2 only: a routed fabric drops it */
		}
		/* A fabric whose one lossless class is set (PFC/ECN on that DSCP, or that SL on IB)
		 * drops what travels outside it, as congestion drops it on a loaded lossy queue. */
		if (src->link == LINK_ETH && src->lossless_tc >= 0 && me->traffic_class != src->lossless_tc)
			return NULL;
		if (src->link == LINK_IB && src->lossless_sl >= 0 && me->sl != src->lossless_sl)
			return NULL;
		if ((q->state != IBV_QPS_RTR && q->state != IBV_QPS_RTS) || q->dest_qpn != me->qpn)
			return NULL; /* not connected back to us: NAK'd or dropped, retried until exhausted */
		return q;
	}
	return NULL;
}

static int move(int pid, uint64_t raddr, void *laddr, size_t len, int write)
{
	if (pid == self_pid()) {
		if (write)
			memmove((void *)(uintptr_t)raddr, laddr, len);
		else
			memmove(laddr, (void *)(uintptr_t)raddr, len);
		return 0;
	}
	struct iovec l = {laddr, len}, r = {(void *)(uintptr_t)raddr, len};
	ssize_t n = write ? process_vm_writev(pid, &l, 1, &r, 1, 0) : process_vm_readv(pid, &l, 1, &r, 1, 0);
	return n == (ssize_t)len ? 0 : -1;
}

/* FAKE_IBV_INSTANT=1: a WR that passes every check completes without its bytes moving, as a NIC
 * that spends no CPU would; what is left is the CPU of the code above (benchmarks only). */
static int instant(void)
{
	static int v = -1;
	if (v < 0) {
		const char *s = getenv("FAKE_IBV_INSTANT");
		v = s && *s && *s != '0';
	}
	return v;
}
static double retry_scale(void)
{
	static double v = -1;
	if (v < 0) {
		const char *s = getenv("FAKE_IBV_RETRY_SCALE");
		v = s && *s ? atof(s) : 1.0;
	}
	return v;
}

/* One WR, under the lock: its completion status (and the delay a NIC would take to report it). */
static int execute(struct ibv_qp *qp, struct rqp *me, struct ibv_send_wr *wr, double *delay)
{
	int write = wr->opcode == IBV_WR_RDMA_WRITE;
	if (!write && wr->opcode != IBV_WR_RDMA_READ)
		return IBV_WC_LOC_QP_OP_ERR;
	if (wr->num_sge != 1)
		return IBV_WC_LOC_LEN_ERR; /* the emulation models one SGE */
	struct ibv_sge *sge = wr->sg_list;
	struct rmr *l = find_mr(self_pid(), sge->lkey);
	if (!l || l->pd != qp->pd->handle || sge->addr < l->addr || sge->addr + sge->length > l->addr + l->length ||
	    (!write && !(l->access & IBV_ACCESS_LOCAL_WRITE)))
		return IBV_WC_LOC_PROT_ERR;
	double retry = 4.096e-6 * (1 << me->timeout) * (me->retry_cnt + 1) * retry_scale();
	struct rqp *peer = route(me);
	if (!peer) {
		*delay = retry;
		return IBV_WC_RETRY_EXC_ERR;
	}
	uint32_t npkt = packets(sge->length, write ? me->path_mtu : peer->path_mtu);
	if (me->sq_psn != peer->rq_psn) {
		*delay = retry; /* out of sequence: NAK'd, retransmitted, never accepted */
		return IBV_WC_RETRY_EXC_ERR;
	}
	if (write && mtu_bytes(me->path_mtu) > mtu_bytes(peer->path_mtu) && sge->length > (uint32_t)mtu_bytes(peer->path_mtu))
		return IBV_WC_REM_INV_REQ_ERR; /* a packet longer than the responder's path MTU */
	if (!write && mtu_bytes(peer->path_mtu) > mtu_bytes(me->path_mtu) && sge->length > (uint32_t)mtu_bytes(me->path_mtu)) {
		*delay = retry; /* responses longer than our path MTU are dropped */
		return IBV_WC_RETRY_EXC_ERR;
	}
	int need = write ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_REMOTE_READ;
	struct rmr *r = find_mr(peer->pid, wr->wr.rdma.rkey);
	if (!r || r->pd != peer->pd || !(r->access & need) || !(peer->access & need) ||
	    wr->wr.rdma.remote_addr < r->addr || wr->wr.rdma.remote_addr + sge->length > r->addr + r->length)
		return IBV_WC_REM_ACCESS_ERR;
	void *local = (void *)(uintptr_t)(l->base + (sge->addr - l->addr));
	if (!instant() && move(peer->pid, r->base + (wr->wr.rdma.remote_addr - r->addr), local, sge->length, write))
		return IBV_WC_REM_ACCESS_ERR;
	me->sq_psn = (me->sq_psn + npkt) & 0xffffff;
	peer->rq_psn = (peer->rq_psn + npkt) & 0xffffff;
	return IBV_WC_SUCCESS;
}

static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
	struct fqp *fq = (struct fqp *)qp;
	lock();
	struct rqp *me = &fab->qp[qp->handle];
	if (me->state != IBV_QPS_RTS && me->state != IBV_QPS_ERR) {
		unlock();
		*bad = wr;
		return EINVAL;
	}
	struct fcq *cq = (struct fcq *)qp->send_cq;
	for (; wr; wr = wr->next) {
		/* what the provider refuses before the WR reaches the send queue: a full queue, more
		 * SGEs than the QP was made with (the WR and those after it are not posted) */
		if (fq->posted - fq->done >= fq->max_send_wr || wr->num_sge < 0 ||
		    (uint32_t)wr->num_sge > fq->max_send_sge) {
			int rc = fq->posted - fq->done >= fq->max_send_wr ? ENOMEM : EINVAL;
			unlock();
			*bad = wr;
			return rc;
		}
		uint64_t seq = ++fq->posted;
		double delay = 0;
		int st = me->state == IBV_QPS_ERR ? IBV_WC_WR_FLUSH_ERR : execute(qp, me, wr, &delay);
		if (st != IBV_WC_SUCCESS)
			me->state = qp->state = IBV_QPS_ERR;
		if (st != IBV_WC_SUCCESS || (wr->send_flags & IBV_SEND_SIGNALED)) {
			struct ibv_wc wc = {0};
			wc.wr_id = wr->wr_id;
			wc.status = st;
			wc.opcode = wr->opcode == IBV_WR_RDMA_WRITE ? IBV_WC_RDMA_WRITE : IBV_WC_RDMA_READ;
			wc.byte_len = wr->num_sge ? wr->sg_list->length : 0;
			wc.qp_num = qp->qp_num;
			push_cqe(cq, &wc, delay, fq, seq);
		}
	}
	unlock();
	return 0;
}
