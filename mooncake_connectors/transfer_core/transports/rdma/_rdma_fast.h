/* The rdma transport's compiled data path, the C half (``_rdma_fast.pyx`` wraps it).
 *
 * libibverbs directly: the QP, CQ, PD and MRs these functions touch are made by this module on
 * its own device context, so no handle crosses from pyverbs (which ships no .pxd to reach its
 * C objects by). ibv_post_send and ibv_poll_cq are verbs.h inlines into the provider's ops. */
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* One run of the plan: ``length`` bytes from ``laddr`` to ``raddr`` (or back), cut into WRs of
 * at most ``part`` bytes chained in order; the last one asks for a completion if ``signaled``.
 * Every WR of a run carries the run's wr_id: an error or flush completion names the run. */
typedef struct {
	uint64_t wr_id, laddr, raddr, length;
	uint32_t lkey, rkey, part;
	int signaled;
} mc_run;

static inline uint32_t mc_parts(const mc_run *r)
{
	return r->length ? (uint32_t)((r->length + r->part - 1) / r->part) : 1;
}

/* Chain every WR of runs[0..n) into wrs/sges (room for the sum of their parts) and ring the
 * doorbell once. 0, or the provider's errno with *bad_run the first run not posted whole. */
static int mc_post_runs(struct ibv_qp *qp, int write, const mc_run *runs, int n,
			struct ibv_send_wr *wrs, struct ibv_sge *sges, int *bad_run)
{
	int k = 0;
	for (int i = 0; i < n; i++) {
		const mc_run *r = &runs[i];
		uint32_t parts = mc_parts(r);
		for (uint32_t p = 0; p < parts; p++, k++) {
			uint64_t off = (uint64_t)p * r->part;
			uint64_t len = r->length - off < r->part ? r->length - off : r->part;
			struct ibv_sge *s = &sges[k];
			struct ibv_send_wr *w = &wrs[k];
			s->addr = r->laddr + off;
			s->length = (uint32_t)len;
			s->lkey = r->lkey;
			w->wr_id = r->wr_id;
			w->next = &wrs[k + 1];
			w->sg_list = s;
			w->num_sge = 1;
			w->opcode = write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
			w->send_flags = (r->signaled && p + 1 == parts) ? IBV_SEND_SIGNALED : 0;
			w->wr.rdma.remote_addr = r->raddr + off;
			w->wr.rdma.rkey = r->rkey;
		}
	}
	if (!k)
		return 0;
	wrs[k - 1].next = NULL;
	struct ibv_send_wr *bad = NULL;
	int rc = ibv_post_send(qp, wrs, &bad);
	if (rc) {
		/* which run the refused WR belongs to: runs before it went out whole */
		int idx = bad ? (int)(bad - wrs) : 0, seen = 0;
		*bad_run = n;
		for (int i = 0; i < n; i++) {
			seen += (int)mc_parts(&runs[i]);
			if (idx < seen) {
				*bad_run = i;
				break;
			}
		}
	}
	return rc;
}

static inline double mc_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Poll ``cq`` for up to ``n`` completions, spinning up to ``spin`` seconds while it is empty
 * (a completion is often microseconds away; a caller that spins releases the interpreter lock). */
static int mc_poll(struct ibv_cq *cq, int n, struct ibv_wc *wc, double spin)
{
	int got = ibv_poll_cq(cq, n, wc);
	if (got != 0 || spin <= 0)
		return got;
	double end = mc_now() + spin;
	for (;;) {
		got = ibv_poll_cq(cq, n, wc);
		if (got != 0 || mc_now() >= end)
			return got;
	}
}

/* Wait for the one completion each chain posted on cqs[i] (a QP with a CQ of its own, whose
 * chain asks for a completion on its last WR only: RC completes in order, so it vouches for the
 * chain) for every i with done[i] == 0. ``once``: one pass over the CQs, then return (*pending:
 * chains not yet complete). Else until all are complete or ``deadline`` (CLOCK_MONOTONIC
 * seconds), spinning ``spin`` seconds and then polling every 20 us. 0 when all completed; a
 * completion's status (> 0) or -errno (poll failure, -ETIMEDOUT), with *which the chain. */
static int mc_wait(struct ibv_cq **cqs, uint8_t *done, int n, double deadline, double spin, int once,
		   int *pending, int *which)
{
	struct ibv_wc wc[4];
	double spin_end = -1;
	for (;;) {
		int left = 0;
		for (int i = 0; i < n; i++) {
			if (done[i])
				continue;
			int got = ibv_poll_cq(cqs[i], 4, wc);
			if (got < 0) {
				*which = i;
				return got;
			}
			for (int k = 0; k < got; k++)
				if (wc[k].status != IBV_WC_SUCCESS) {
					*which = i;
					return (int)wc[k].status;
				}
			if (got > 0)
				done[i] = 1;
			else
				left++;
		}
		*pending = left;
		if (!left || once)
			return 0;
		double now = mc_now();
		if (now >= deadline) {
			for (int i = 0; i < n; i++)
				if (!done[i]) {
					*which = i;
					break;
				}
			return -ETIMEDOUT;
		}
		if (spin_end < 0)
			spin_end = now + spin;
		if (now >= spin_end) {
			struct timespec ts = {0, 20000};
			nanosleep(&ts, NULL);
		}
	}
}

/* One WR of a batch: ``len`` bytes between ``laddr`` and ``raddr`` (offsets added per lane). */
typedef struct {
	uint64_t laddr, raddr;
	uint32_t len;
} mc_blk;

/* A direct QP a batch runs on: its keys, the shift of each side's addresses for its NIC pair
 * (dma-buf iovas), its room to chain ``max_wr`` WRs, and its share [first, end) of the WRs. */
typedef struct {
	struct ibv_qp *qp;
	struct ibv_cq *cq;
	struct ibv_send_wr *wrs;
	struct ibv_sge *sges;
	int max_wr;
	uint32_t lkey, rkey;
	uint64_t loff, roff;
	int64_t first, next, end;
} mc_lane;

/* Run ``total`` WRs over lanes[0..nl) (nl <= 64): each lane takes a contiguous share and posts
 * it in waves of at most max_wr WRs, one chain per wave whose last WR asks for a completion;
 * every lane's wave completes before the next wave is posted. 0, or as mc_wait (and -errno of a
 * refused post) with *which the lane. */
static int mc_run_blocks(int write, const mc_blk *w, int64_t total, mc_lane *lanes, int nl,
			 double deadline, double spin, int *which)
{
	uint8_t done[64];
	struct ibv_cq *cqs[64];
	int64_t per = (total + nl - 1) / nl;
	for (int i = 0; i < nl; i++) {
		int64_t a = (int64_t)i * per, b = a + per;
		lanes[i].first = lanes[i].next = a < total ? a : total;
		lanes[i].end = b < total ? b : total;
		cqs[i] = lanes[i].cq;
	}
	for (;;) {
		int posted = 0, pending = 0;
		for (int i = 0; i < nl; i++) {
			mc_lane *L = &lanes[i];
			int64_t m = L->end - L->next;
			if (m > L->max_wr)
				m = L->max_wr;
			done[i] = 1;
			if (m <= 0)
				continue;
			for (int64_t j = 0; j < m; j++) {
				const mc_blk *b = &w[L->next + j];
				struct ibv_sge *s = &L->sges[j];
				struct ibv_send_wr *wr = &L->wrs[j];
				s->addr = b->laddr + L->loff;
				s->length = b->len;
				s->lkey = L->lkey;
				wr->wr_id = (uint64_t)i;
				wr->next = j + 1 < m ? &L->wrs[j + 1] : NULL;
				wr->sg_list = s;
				wr->num_sge = 1;
				wr->opcode = write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
				wr->send_flags = j + 1 == m ? IBV_SEND_SIGNALED : 0;
				wr->wr.rdma.remote_addr = b->raddr + L->roff;
				wr->wr.rdma.rkey = L->rkey;
			}
			struct ibv_send_wr *bad = NULL;
			int rc = ibv_post_send(L->qp, L->wrs, &bad);
			if (rc) {
				*which = i;
				return -rc;
			}
			L->next += m;
			done[i] = 0;
			posted++;
		}
		if (!posted)
			return 0;
		int rc = mc_wait(cqs, done, nl, deadline, spin, 0, &pending, which);
		if (rc)
			return rc;
	}
}

static int mc_to_init(struct ibv_qp *qp, int port, int access)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.pkey_index = 0;
	a.port_num = (uint8_t)port;
	a.qp_access_flags = (unsigned)access;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

static int mc_to_rtr(struct ibv_qp *qp, int mtu, uint32_t dest_qpn, uint32_t rq_psn, int max_dest_rd,
		     int min_rnr, int dlid, int sl, int port, const unsigned char *dgid, int sgid_index,
		     int traffic_class)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = (enum ibv_mtu)mtu;
	a.dest_qp_num = dest_qpn;
	a.rq_psn = rq_psn;
	a.max_dest_rd_atomic = (uint8_t)max_dest_rd;
	a.min_rnr_timer = (uint8_t)min_rnr;
	a.ah_attr.dlid = (uint16_t)dlid;
	a.ah_attr.sl = (uint8_t)sl;
	a.ah_attr.port_num = (uint8_t)port;
	a.ah_attr.is_global = 1;
	memcpy(a.ah_attr.grh.dgid.raw, dgid, 16);
	a.ah_attr.grh.sgid_index = (uint8_t)sgid_index;
	a.ah_attr.grh.traffic_class = (uint8_t)traffic_class;
	a.ah_attr.grh.hop_limit = 64;
	return ibv_modify_qp(qp, &a,
			     IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
				     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

static int mc_to_rts(struct ibv_qp *qp, uint32_t psn, int timeout, int retry, int rnr, int max_rd)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = psn;
	a.timeout = (uint8_t)timeout;
	a.retry_cnt = (uint8_t)retry;
	a.rnr_retry = (uint8_t)rnr;
	a.max_rd_atomic = (uint8_t)max_rd;
	return ibv_modify_qp(qp, &a,
			     IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				     IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

static int mc_to_err(struct ibv_qp *qp)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_ERR;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

static struct ibv_qp *mc_create_qp(struct ibv_pd *pd, struct ibv_cq *cq, int max_wr, int max_sge)
{
	struct ibv_qp_init_attr init;
	memset(&init, 0, sizeof(init));
	init.send_cq = cq;
	init.recv_cq = cq;
	init.qp_type = IBV_QPT_RC;
	init.sq_sig_all = 0;
	init.cap.max_send_wr = (uint32_t)max_wr;
	init.cap.max_recv_wr = 1;
	init.cap.max_send_sge = (uint32_t)max_sge;
	init.cap.max_recv_sge = 1;
	return ibv_create_qp(pd, &init);
}

static struct ibv_context *mc_open(const char *name)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	struct ibv_context *ctx = NULL;
	if (!list)
		return NULL;
	errno = ENODEV;
	for (int i = 0; i < n; i++)
		if (strcmp(ibv_get_device_name(list[i]), name) == 0) {
			ctx = ibv_open_device(list[i]);
			break;
		}
	ibv_free_device_list(list);
	return ctx;
}

static struct ibv_mr *mc_reg_mr(struct ibv_pd *pd, uint64_t addr, size_t length, int access)
{
	return ibv_reg_mr_iova2(pd, (void *)(uintptr_t)addr, length, addr, (unsigned)access);
}
