# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The rdma transport's compiled data path (built at install where a C compiler and
libibverbs-dev are present; fastverbs.py uses it, else the pyverbs path runs).

A Device is this module's own context on one RDMA device, with its PD and CQ; the MRs and QPs
the compiled path uses are made on it, so every handle ibv_post_send and ibv_poll_cq see was
made here. post_runs chains the WRs of a batch of runs in C and posts them with one doorbell;
poll polls the CQ in C without the interpreter lock, spinning a bounded time while it is empty.
run_wait is a whole request of a caller that waits for it: a chain on each of a few QPs that
have CQs of their own, posted and waited for in one call.
"""

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport malloc
from libc.stdlib cimport calloc, free
from libc.string cimport strerror
from libc.errno cimport errno


cdef extern from "_rdma_fast.h" nogil:
    struct ibv_context:
        pass
    struct ibv_pd:
        pass
    struct ibv_cq:
        pass
    struct ibv_qp:
        uint32_t qp_num
    struct ibv_mr:
        uint32_t lkey
        uint32_t rkey
    struct ibv_sge:
        pass
    struct ibv_send_wr:
        pass
    struct ibv_wc:
        uint64_t wr_id
        int status
        uint32_t qp_num
    ctypedef struct mc_run:
        uint64_t wr_id, laddr, raddr, length
        uint32_t lkey, rkey, part
        int signaled

    ibv_context *mc_open(const char *name)
    int ibv_close_device(ibv_context *ctx)
    ibv_pd *ibv_alloc_pd(ibv_context *ctx)
    int ibv_dealloc_pd(ibv_pd *pd)
    ibv_cq *ibv_create_cq(ibv_context *ctx, int cqe, void *cq_context, void *channel, int vec)
    int ibv_destroy_cq(ibv_cq *cq)
    ibv_mr *mc_reg_mr(ibv_pd *pd, uint64_t addr, size_t length, int access)
    ibv_mr *ibv_reg_dmabuf_mr(ibv_pd *pd, uint64_t offset, size_t length, uint64_t iova,
                              int fd, int access)
    int ibv_dereg_mr(ibv_mr *mr)
    ibv_qp *mc_create_qp(ibv_pd *pd, ibv_cq *cq, int max_wr, int max_sge)
    int ibv_destroy_qp(ibv_qp *qp)
    int mc_to_init(ibv_qp *qp, int port, int access)
    int mc_to_rtr(ibv_qp *qp, int mtu, uint32_t dest_qpn, uint32_t rq_psn, int max_dest_rd,
                  int min_rnr, int dlid, int sl, int port, const unsigned char *dgid,
                  int sgid_index, int traffic_class)
    int mc_to_rts(ibv_qp *qp, uint32_t psn, int timeout, int retry, int rnr, int max_rd)
    int mc_to_err(ibv_qp *qp)
    uint32_t mc_parts(const mc_run *r)
    int mc_post_runs(ibv_qp *qp, int write, const mc_run *runs, int n, ibv_send_wr *wrs,
                     ibv_sge *sges, int *bad_run)
    int mc_poll(ibv_cq *cq, int n, ibv_wc *wc, double spin)
    int mc_wait(ibv_cq **cqs, uint8_t *done, int n, double deadline, double spin, int once,
                int *pending, int *which)
    ctypedef struct mc_blk:
        uint64_t laddr, raddr
        uint32_t len
    ctypedef struct mc_lane:
        ibv_qp *qp
        ibv_cq *cq
        ibv_send_wr *wrs
        ibv_sge *sges
        int max_wr
        uint32_t lkey, rkey
        uint64_t loff, roff
        int64_t first, next, end
    int mc_run_blocks(int write, const mc_blk *w, int64_t total, mc_lane *lanes, int nl,
                      double deadline, double spin, int *which)


class VerbsError(OSError):
    """A verb refused (``errno`` is its code)."""


cdef _fail(int code, str what):
    raise VerbsError(code, f"{what}: {strerror(code).decode()} (errno {code})")


cdef class Device:
    """An RDMA device opened by this module, its PD and one CQ of ``cq_size`` entries."""

    cdef ibv_context *ctx
    cdef ibv_pd *pd
    cdef ibv_cq *cq
    cdef ibv_wc *wcs
    cdef int nwc
    cdef readonly str name
    cdef public double spin

    def __cinit__(self, str name, int cq_size, int max_poll=64):
        self.name = name
        self.ctx = mc_open(name.encode())
        if self.ctx == NULL:
            _fail(errno or 19, f"opening {name}")
        self.pd = ibv_alloc_pd(self.ctx)
        if self.pd == NULL:
            code = errno or 12
            self.close()
            _fail(code, f"allocating a PD on {name}")
        self.cq = ibv_create_cq(self.ctx, cq_size, NULL, NULL, 0)
        if self.cq == NULL:
            code = errno or 22
            self.close()
            _fail(code, f"creating a CQ of {cq_size} on {name}")
        self.nwc = max(1, max_poll)
        self.wcs = <ibv_wc *>calloc(self.nwc, sizeof(ibv_wc))
        self.spin = 0.0

    def reg_mr(self, uint64_t addr, size_t length, int access):
        cdef ibv_mr *mr = mc_reg_mr(self.pd, addr, length, access)
        if mr == NULL:
            _fail(errno or 22, f"registering {length} bytes at {addr:#x} on {self.name}")
        return Mr.wrap(self, mr)

    def reg_dmabuf_mr(self, int fd, uint64_t offset, size_t length, uint64_t iova, int access):
        cdef ibv_mr *mr = ibv_reg_dmabuf_mr(self.pd, offset, length, iova, fd, access)
        if mr == NULL:
            _fail(errno or 22, f"registering a dma-buf of {length} bytes on {self.name}")
        return Mr.wrap(self, mr)

    def create_qp(self, int max_wr, bint own_cq=False):
        """An RC QP on this device's CQ, or (``own_cq``) on a CQ of its own for run_wait."""
        cdef ibv_cq *own = NULL
        cdef ibv_qp *qp
        if self.ctx == NULL:
            raise VerbsError(9, f"{self.name} is closed")
        if own_cq:
            # an error flushes every WR posted: room for a CQE each
            own = ibv_create_cq(self.ctx, max_wr + 1, NULL, NULL, 0)
            if own == NULL:
                _fail(errno or 22, f"creating a CQ of {max_wr + 1} on {self.name}")
        qp = mc_create_qp(self.pd, own if own != NULL else self.cq, max_wr, 1)
        if qp == NULL:
            code = errno or 22
            if own != NULL:
                ibv_destroy_cq(own)
            _fail(code, f"creating a QP of {max_wr} WRs on {self.name}")
        q = Qp.wrap(self, qp, max_wr)
        q.own = own
        return q

    def poll(self, int n=64, double spin=-1.0):
        """Up to ``n`` completions as (wr_id, status, qp_num) tuples; while the CQ is empty,
        spins up to ``spin`` seconds (-1: this device's ``spin``) without the GIL."""
        cdef int got, i
        cdef double s = self.spin if spin < 0 else spin
        if self.cq == NULL:
            raise VerbsError(9, f"the CQ of {self.name} is closed")
        if n > self.nwc:
            n = self.nwc
        # One poll is a few loads and stores: it keeps the GIL. Releasing it there would hand
        # the GIL to another thread (the poller) at every empty poll of a caller that waits
        # inline, and back. Only a spin, which may last microseconds, runs without it.
        got = mc_poll(self.cq, n, self.wcs, 0.0)
        if got == 0 and s > 0:
            with nogil:
                got = mc_poll(self.cq, n, self.wcs, s)
        if got < 0:
            _fail(-got, f"polling the CQ of {self.name}")
        return [(self.wcs[i].wr_id, self.wcs[i].status, self.wcs[i].qp_num) for i in range(got)]

    def close(self):
        if self.cq != NULL:
            ibv_destroy_cq(self.cq)
            self.cq = NULL
        if self.pd != NULL:
            ibv_dealloc_pd(self.pd)
            self.pd = NULL
        if self.ctx != NULL:
            ibv_close_device(self.ctx)
            self.ctx = NULL
        if self.wcs != NULL:
            free(self.wcs)
            self.wcs = NULL


cdef class Mr:
    """A memory region of a Device (``close`` deregisters it)."""

    cdef ibv_mr *mr
    cdef object dev
    cdef readonly uint32_t lkey, rkey

    @staticmethod
    cdef Mr wrap(Device dev, ibv_mr *mr):
        cdef Mr m = Mr.__new__(Mr)
        m.mr, m.dev, m.lkey, m.rkey = mr, dev, mr.lkey, mr.rkey
        return m

    def close(self):
        if self.mr != NULL:
            ibv_dereg_mr(self.mr)
            self.mr = NULL


cdef class Qp:
    """An RC QP of a Device, and room to chain ``max_wr`` WRs for one post."""

    cdef ibv_qp *qp
    cdef ibv_cq *own  # a CQ of its own (create_qp(own_cq=True)), else NULL
    cdef object dev
    cdef ibv_send_wr *wrs
    cdef ibv_sge *sges
    cdef mc_run *runs
    cdef readonly int max_wr
    cdef readonly uint32_t qp_num

    @staticmethod
    cdef Qp wrap(Device dev, ibv_qp *qp, int max_wr):
        cdef Qp q = Qp.__new__(Qp)
        q.qp, q.dev, q.max_wr, q.qp_num = qp, dev, max_wr, qp.qp_num
        q.wrs = <ibv_send_wr *>calloc(max_wr, sizeof(ibv_send_wr))
        q.sges = <ibv_sge *>calloc(max_wr, sizeof(ibv_sge))
        q.runs = <mc_run *>calloc(max_wr, sizeof(mc_run))
        return q

    cdef ibv_qp *_live(self) except NULL:
        if self.qp == NULL:
            raise VerbsError(9, "the QP is closed")
        return self.qp

    def to_init(self, uint8_t port, int access):
        rc = mc_to_init(self._live(), port, access)
        if rc:
            _fail(rc, "RESET->INIT")

    def to_rtr(self, uint8_t mtu, uint32_t dest_qpn, uint32_t rq_psn, uint8_t max_dest_rd,
               uint8_t min_rnr, uint16_t dlid, uint8_t sl, uint8_t port, bytes dgid,
               uint8_t sgid_index, uint8_t traffic_class):
        # sized C types: a value out of the verbs' range is OverflowError, as in pyverbs
        if len(dgid) != 16:
            raise ValueError(f"a GID is 16 bytes, not {len(dgid)}")
        rc = mc_to_rtr(self._live(), mtu, dest_qpn, rq_psn, max_dest_rd, min_rnr, dlid, sl,
                       port, <const unsigned char *>dgid, sgid_index, traffic_class)
        if rc:
            _fail(rc, "INIT->RTR")

    def to_rts(self, uint32_t psn, uint8_t timeout, uint8_t retry, uint8_t rnr, uint8_t max_rd):
        rc = mc_to_rts(self._live(), psn, timeout, retry, rnr, max_rd)
        if rc:
            _fail(rc, "RTR->RTS")

    def to_error(self):
        if self.qp != NULL:
            mc_to_err(self.qp)

    def post_runs(self, bint write, list runs):
        """Post ``runs``, (wr_id, laddr, lkey, raddr, rkey, length, part, signaled) tuples,
        as one chain of WRs (one doorbell). Returns how many runs went out whole: all of them,
        else the provider refused the WR of the next one (VerbsError when it is the first)."""
        cdef int n = len(runs), total = 0, bad = 0, i, rc
        cdef mc_run *r
        cdef ibv_qp *qp = self._live()
        if n > self.max_wr:
            raise ValueError(f"{n} runs exceed the QP's {self.max_wr} WRs")
        for i in range(n):
            t = <tuple>runs[i]
            r = &self.runs[i]
            r.wr_id, r.laddr, r.lkey, r.raddr, r.rkey, r.length, r.part, r.signaled = t
            if r.part == 0:
                raise ValueError("a run's part size must be > 0")
            total += mc_parts(r)
        if total > self.max_wr:
            raise ValueError(f"{total} WRs exceed the QP's {self.max_wr}")
        rc = mc_post_runs(qp, write, self.runs, n, self.wrs, self.sges, &bad)
        if rc == 0:
            return n
        if bad == 0:
            _fail(rc, "post_send")
        return bad

    def close(self):
        if self.qp != NULL:
            ibv_destroy_qp(self.qp)
            self.qp = NULL
        if self.own != NULL:
            ibv_destroy_cq(self.own)
            self.own = NULL
        free(self.wrs)
        free(self.sges)
        free(self.runs)
        self.wrs = NULL
        self.sges = NULL
        self.runs = NULL


cdef enum:
    MAX_CHAINS = 64


def run_wait(bint write, list plan, double deadline, double spin):
    """One request of a caller that waits for it: ``plan`` is a list of (qp, laddr, lkey,
    raddr, rkey, length, part) with qp a Qp made with ``own_cq``, idle (nothing posted on it
    not yet completed) and used by this caller only; each entry is posted on its QP as one
    chain of WRs of ``part`` bytes whose last asks for a completion. Then one pass over the
    CQs with the GIL (a completion may be there already); while chains are left, they are
    waited for without the GIL until ``deadline`` (time.monotonic()), spinning ``spin``
    seconds, then polling every 20 us.

    Returns (0, -1) when every chain completed; (status, i) when plan[i] completed with that
    ibv_wc_status; (-errno, i) when posting plan[i] failed (the chains before it were posted and
    are not waited for), its CQ could not be polled, or (-ETIMEDOUT) it was not complete at the
    deadline. After a failure the QPs of the plan are in an unknown state: take them down."""
    cdef int n = len(plan), i, rc, bad = 0, pending = 0, which = -1
    cdef ibv_cq *cqs[MAX_CHAINS]
    cdef uint8_t done[MAX_CHAINS]
    cdef Qp q
    cdef mc_run *r
    if n > MAX_CHAINS:
        raise ValueError(f"{n} chains exceed {MAX_CHAINS}")
    for i in range(n):
        t = <tuple>plan[i]
        q = <Qp?>t[0]
        if q.qp == NULL or q.own == NULL:
            raise VerbsError(9, "run_wait needs open QPs with CQs of their own")
        r = &q.runs[0]
        r.wr_id, r.laddr, r.lkey, r.raddr, r.rkey, r.length, r.part = (
            i, t[1], t[2], t[3], t[4], t[5], t[6])
        r.signaled = 1
        if r.part == 0:
            raise ValueError("a chain's part size must be > 0")
        if mc_parts(r) > <uint32_t>q.max_wr:
            raise ValueError(f"{mc_parts(r)} WRs exceed the QP's {q.max_wr}")
        rc = mc_post_runs(q.qp, write, q.runs, 1, q.wrs, q.sges, &bad)
        if rc:
            return (-rc, i)
        cqs[i] = q.own
        done[i] = 0
    rc = mc_wait(cqs, done, n, deadline, spin, 1, &pending, &which)
    if rc == 0 and pending:
        with nogil:
            rc = mc_wait(cqs, done, n, deadline, spin, 0, &pending, &which)
    return (rc, which)


def run_blocks(bint write, list slices, object op, list lanes, uint64_t llo, uint64_t lhi,
               uint64_t rlo, uint64_t rhi, uint32_t part, double deadline, double spin):
    """A batch of a caller that waits for it: ``slices`` (engine Slices, all of ``op``, each in
    the local range [llo, lhi) and the remote range [rlo, rhi)), adjacent ones coalesced, cut
    into WRs of at most ``part`` bytes and spread over ``lanes``, (qp, lkey, loff, rkey, roff)
    with qp a Qp made with ``own_cq``, idle and used by this caller only; each lane posts its
    share in chains of at most its max_wr WRs and waits for each (without the GIL) until
    ``deadline``. Returns (rc, which, WRs per lane): rc 0 when every WR completed; -EINVAL with
    which the slice when a slice is not of ``op``, empty or out of range (nothing posted);
    else as run_wait, which the lane."""
    cdef Py_ssize_t n = len(slices), i, k = 0, runs = 0
    cdef int nl = len(lanes), rc = 0, which = -1, j
    cdef uint64_t la, ra, ln, o, total = 0
    cdef mc_lane cl[MAX_CHAINS]
    cdef mc_blk *blk = NULL
    cdef mc_blk *w = NULL
    cdef Qp q
    if nl < 1 or nl > MAX_CHAINS or part == 0:
        raise ValueError(f"{nl} lanes (1..{MAX_CHAINS}), part {part}")
    blk = <mc_blk *>malloc(max(1, n) * sizeof(mc_blk))
    if blk == NULL:
        raise MemoryError()
    try:
        # coalesce: a slice continuing the previous one on both sides joins its run
        for i in range(n):
            s = slices[i]
            if s.op is not op:
                return (-22, i, [])
            la, ra, ln = s.local_addr, s.remote_addr, s.length
            if ln == 0 or la < llo or la + ln > lhi or ra < rlo or ra + ln > rhi:
                return (-22, i, [])
            if runs and blk[runs - 1].laddr + blk[runs - 1].len == la \
                    and blk[runs - 1].raddr + blk[runs - 1].len == ra \
                    and <uint64_t>blk[runs - 1].len + ln <= 0xffffffff:
                blk[runs - 1].len += <uint32_t>ln
            elif ln > 0xffffffff:
                return (-22, i, [])
            else:
                blk[runs].laddr, blk[runs].raddr, blk[runs].len = la, ra, <uint32_t>ln
                runs += 1
            total += (ln + part - 1) // part + 1  # an upper bound on the WRs
        w = <mc_blk *>malloc(max(1, total) * sizeof(mc_blk))
        if w == NULL:
            raise MemoryError()
        for i in range(runs):
            o = 0
            while o < blk[i].len:
                ln = min(<uint64_t>part, blk[i].len - o)
                w[k].laddr, w[k].raddr, w[k].len = blk[i].laddr + o, blk[i].raddr + o, <uint32_t>ln
                k += 1
                o += ln
        for j in range(nl):
            t = <tuple>lanes[j]
            q = <Qp?>t[0]
            if q.qp == NULL or q.own == NULL:
                raise VerbsError(9, "run_blocks needs open QPs with CQs of their own")
            cl[j].qp, cl[j].cq, cl[j].wrs, cl[j].sges, cl[j].max_wr = (
                q.qp, q.own, q.wrs, q.sges, q.max_wr)
            cl[j].lkey, cl[j].loff, cl[j].rkey, cl[j].roff = t[1], t[2], t[3], t[4]
        with nogil:
            rc = mc_run_blocks(write, w, k, cl, nl, deadline, spin, &which)
        return (rc, which, [cl[j].next - cl[j].first for j in range(nl)])
    finally:
        free(blk)
        free(w)
