# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The tcp transport's two per-request loops, compiled (optional: ``fast.py`` loads this module
and the transport runs its pure-Python loops when it is absent).

Both speak exactly the frames of ``wire.py`` on a plain, blocking socket whose kernel timeouts
(SO_RCVTIMEO/SO_SNDTIMEO) the caller has set, and run without the interpreter lock:

* ``exchange``: an initiator's one request on a direct connection: send the request (and a
  WRITE's payload), read the response (and a READ's data) into memory the caller checked.
* ``serve``: a target's loop over requests that fall inside one region the caller checked, for
  as long as the local registrations keep their generation (``epoch``). Anything else (another
  region, another op, a malformed frame, a changed generation) is handed back to Python with the
  request's header, which the Python loop then handles as if it had read the header itself.

Neither ever touches memory outside the ranges it is given. Outcomes are small ints or tuples,
turned into the transport's errors by the Python side.
"""

from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset


cdef extern from "<sys/socket.h>" nogil:
    ssize_t c_send "send"(int, const void*, size_t, int)
    ssize_t c_recv "recv"(int, void*, size_t, int)
    int MSG_WAITALL
    int MSG_NOSIGNAL
    int MSG_DONTWAIT


cdef extern from "<errno.h>" nogil:
    int EWOULDBLOCK


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len


cdef extern from "<sys/socket.h>" nogil:
    struct msghdr:
        void* msg_name
        unsigned int msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t c_sendmsg "sendmsg"(int, const msghdr*, int)
    ssize_t c_recvmsg "recvmsg"(int, msghdr*, int)


cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd*, unsigned long, int)
    short POLLIN
    short POLLOUT


cdef extern from "<time.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int, timespec*)
    int CLOCK_MONOTONIC


cdef packed struct Req:
    uint32_t magic
    uint8_t op
    uint8_t pad1
    uint16_t pad2
    uint64_t rid
    uint64_t addr
    uint64_t length


cdef packed struct Resp:
    uint32_t magic
    uint8_t status
    uint8_t pad1
    uint16_t pad2
    uint64_t rid
    uint64_t length


cdef enum:
    REQ_MAGIC = 0x4D435251
    RESP_MAGIC = 0x4D435250
    OP_READ = 0
    OP_WRITE = 1
    RIGHT_READ = 1
    RIGHT_WRITE = 2
    MAX_MESSAGE = 4096  # wire.MAX_ERROR_MESSAGE

cdef enum:  # outcomes; ``exchange`` returns 0 for done, a tuple for a peer's error status
    C_IDLE = 0  # ``serve``: no request arrived within one kernel timeout
    C_HANDBACK = 1  # ``serve``: a request for Python to handle; its header is in ``hdr``
    C_TIMEOUT = -1  # the deadline passed
    C_CLOSED = -2  # the peer closed the connection
    C_BROKEN = -3  # a socket error; ``last_errno()`` tells which
    C_PROTOCOL = -4  # the peer's frame was not an answer to this request

IDLE = C_IDLE
HANDBACK = C_HANDBACK
TIMEOUT = C_TIMEOUT
CLOSED = C_CLOSED
BROKEN = C_BROKEN
PROTOCOL = C_PROTOCOL

cdef int _errno = 0


cdef inline void _set_errno(int e) noexcept nogil:
    global _errno
    _errno = e


def last_errno():
    """The errno behind the last BROKEN outcome of this thread's calls (approximate across
    threads; for messages only)."""
    return _errno


# How long a wait for a peer spins (polls without sleeping) before it sleeps in the kernel, in
# seconds; 0: never. Each wait spins afresh, so a stream that keeps arriving is never slept on.
cdef double _spin = 0.0


def set_spin(double seconds):
    """Spin for up to ``seconds`` before each sleep on a socket (0 turns spinning off)."""
    global _spin
    if not seconds >= 0.0:
        raise ValueError(f"spin must be >= 0 seconds, not {seconds}")
    _spin = seconds


def spin():
    """The spin budget of each wait, in seconds."""
    return _spin


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef int _spin_ready(int fd, short events, double until) noexcept nogil:
    """1 once ``fd`` is ready for ``events`` (or has an error), 0 when ``until`` came first,
    polling without sleeping (yielding the core to anything else runnable on it)."""
    cdef pollfd p
    cdef int r
    while True:
        p.fd = fd
        p.events = events
        p.revents = 0
        r = poll(&p, 1, 0)
        if r > 0 or (r < 0 and errno != EINTR):
            return 1
        if _now() >= until:
            return 0
        sched_yield()


cdef int _wait(int fd, short events, double deadline) noexcept nogil:
    """0 once ``fd`` is ready for ``events`` (or has an error the next call reports), else
    TIMEOUT at the deadline: the waits after a short or empty first call, bounded by what is
    left of the deadline rather than by the kernel timeout. It spins first (``set_spin``): a
    sleeping waiter costs a wake-up on the peer's answer, tens of microseconds on a VM."""
    cdef pollfd p
    cdef double left
    cdef int r
    if _spin > 0.0 and _spin_ready(fd, events, min(_now() + _spin, deadline)):
        return 0
    while True:
        left = deadline - _now()
        if left <= 0:
            return C_TIMEOUT
        p.fd = fd
        p.events = events
        p.revents = 0
        r = poll(&p, 1, <int>(left * 1000) + 1)
        if r > 0:
            return 0
        if r < 0 and errno != EINTR:
            _set_errno(errno)
            return C_BROKEN


def wait_readable(int fd, double seconds):
    """Spin for up to ``seconds`` until ``fd`` is readable, without the interpreter lock (for a
    Python caller about to block on a reply). True: readable (or in error) now."""
    cdef int r
    with nogil:
        r = _spin_ready(fd, POLLIN, _now() + seconds)
    return r == 1


cdef int _recv_all(int fd, char* p, size_t n, double deadline) noexcept nogil:
    """0, or TIMEOUT/CLOSED/BROKEN. The first call blocks (bounded by the kernel timeout the
    caller set) unless waits spin; what is still missing after it is waited for until the
    deadline."""
    cdef ssize_t k
    cdef int flags = MSG_DONTWAIT if _spin > 0.0 else MSG_WAITALL
    cdef int rc
    while n:
        k = c_recv(fd, p, n, flags)
        if k > 0:
            p += k
            n -= <size_t>k
            if not n:
                break
        elif k == 0:
            return C_CLOSED
        elif errno == EINTR:
            continue
        elif errno != EAGAIN and errno != EWOULDBLOCK:
            _set_errno(errno)
            return C_BROKEN
        rc = _wait(fd, POLLIN, deadline)
        if rc:
            return rc
        flags = MSG_DONTWAIT
    return 0


cdef int _send_all(int fd, const char* p, size_t n, double deadline, int waited) noexcept nogil:
    """As ``_recv_all``; ``waited``: an earlier call already blocked once, so wait by poll."""
    cdef ssize_t k
    cdef int rc
    while n:
        if waited:
            rc = _wait(fd, POLLOUT, deadline)
            if rc:
                return rc
        k = c_send(fd, p, n, MSG_NOSIGNAL | (MSG_DONTWAIT if waited or _spin > 0.0 else 0))
        waited = 1
        if k > 0:
            p += k
            n -= <size_t>k
        elif k < 0 and errno == EINTR:
            continue
        elif k < 0 and (errno == EAGAIN or errno == EWOULDBLOCK):
            continue
        else:
            _set_errno(errno if k < 0 else 0)
            return C_BROKEN
    return 0


cdef int _send_two(int fd, const char* a, size_t na, const char* b, size_t nb,
                   double deadline) noexcept nogil:
    """``a`` then ``b``, in one writev when the socket takes them."""
    cdef iovec v[2]
    cdef msghdr m
    cdef ssize_t k
    cdef int rc
    v[0].iov_base = <void*>a
    v[0].iov_len = na
    v[1].iov_base = <void*>b
    v[1].iov_len = nb
    memset(&m, 0, sizeof(m))
    m.msg_iov = v
    m.msg_iovlen = 2
    while True:
        k = c_sendmsg(fd, &m, MSG_NOSIGNAL | (MSG_DONTWAIT if _spin > 0.0 else 0))
        if k >= 0:
            break
        if errno == EINTR:
            continue
        if errno == EAGAIN or errno == EWOULDBLOCK:
            k = 0
            break
        _set_errno(errno)
        return C_BROKEN
    if <size_t>k < na:
        rc = _send_all(fd, a + k, na - <size_t>k, deadline, 1)
        if rc:
            return rc
        return _send_all(fd, b, nb, deadline, 1)
    if <size_t>k < na + nb:
        return _send_all(fd, b + (<size_t>k - na), nb - (<size_t>k - na), deadline, 1)
    return 0


cdef int _recv_answer(int fd, Resp* r, char* data, size_t n, double deadline,
                      size_t* have) noexcept nogil:
    """An answer's header, and as much of the ``n`` bytes that may follow it into ``data`` as
    has arrived with it (``have``): one call where two would read header and data apart."""
    cdef iovec v[2]
    cdef msghdr m
    cdef ssize_t k
    cdef int rc
    v[0].iov_base = <void*>r
    v[0].iov_len = sizeof(Resp)
    v[1].iov_base = <void*>data
    v[1].iov_len = n
    memset(&m, 0, sizeof(m))
    m.msg_iov = v
    m.msg_iovlen = 2 if n else 1
    have[0] = 0
    while True:
        k = c_recvmsg(fd, &m, MSG_DONTWAIT if _spin > 0.0 else 0)
        if k > 0:
            break
        if k == 0:
            return C_CLOSED
        if errno == EINTR:
            continue
        if errno != EAGAIN and errno != EWOULDBLOCK:
            _set_errno(errno)
            return C_BROKEN
        rc = _wait(fd, POLLIN, deadline)
        if rc:
            return rc
    if <size_t>k < sizeof(Resp):
        return _recv_all(fd, (<char*>r) + k, sizeof(Resp) - <size_t>k, deadline)
    have[0] = <size_t>k - sizeof(Resp)
    return 0


def exchange(int fd, int op, uint64_t rid, uint64_t remote, uint64_t local, uint64_t n,
             double deadline):
    """One READ (``op`` 0: ``n`` bytes from the peer's ``remote`` into ``local``) or WRITE
    (1: from ``local`` to ``remote``) on the connection ``fd``, by ``deadline`` (monotonic).
    ``local`` must be host memory the caller keeps valid for the call. Returns 0 when done, an
    outcome below zero, or ``(status, message)``: the peer refused it (a refused READ may have
    written part of its message into ``local``)."""
    cdef Req q
    cdef Resp r
    cdef int rc = 0
    cdef size_t have = 0
    cdef char msg[MAX_MESSAGE]
    q.magic = REQ_MAGIC
    q.op = <uint8_t>op
    q.pad1 = 0
    q.pad2 = 0
    q.rid = rid
    q.addr = remote
    q.length = n
    with nogil:
        if op == OP_WRITE:
            rc = _send_two(fd, <char*>&q, sizeof(Req), <char*>local, n, deadline)
            if rc == 0:
                rc = _recv_all(fd, <char*>&r, sizeof(Resp), deadline)
        else:
            rc = _send_all(fd, <char*>&q, sizeof(Req), deadline, 0)
            if rc == 0:
                rc = _recv_answer(fd, &r, <char*>local, n, deadline, &have)
        if rc == 0:
            if r.magic != RESP_MAGIC or r.rid != rid:
                rc = C_PROTOCOL
            elif r.status != 0:
                if r.length > MAX_MESSAGE or have > r.length:
                    rc = C_PROTOCOL
                else:
                    memcpy(msg, <char*>local, have)
                    rc = _recv_all(fd, msg + have, r.length - have, deadline)
                    if rc == 0:
                        rc = 1
            elif op == OP_READ:
                if r.length != n:
                    rc = C_PROTOCOL
                elif n > have:
                    rc = _recv_all(fd, (<char*>local) + have, n - have, deadline)
    if rc == 1:
        return (r.status, msg[:r.length])
    return rc


def serve(int fd, uint64_t lo, uint64_t hi, int rights, uint64_t epoch_at, uint64_t epoch,
          double frame_timeout, double min_rate, uint64_t max_payload, unsigned char[::1] hdr):
    """Serve READ/WRITE requests on ``fd`` that lie inside [``lo``, ``hi``) of this process's
    memory with ``rights`` (1 read, 2 write), while the 8-byte generation at ``epoch_at`` still
    reads ``epoch``. Returns IDLE (nothing arrived within one kernel timeout), HANDBACK (the next
    request's header, unserved, is in ``hdr``), or TIMEOUT/CLOSED/BROKEN (the connection is
    done). Each request has ``frame_timeout`` plus its length at ``min_rate`` to arrive whole."""
    cdef Req q
    cdef Resp r
    cdef int rc = 0
    cdef ssize_t k
    cdef double deadline = 0.0
    cdef char* mem
    cdef volatile uint64_t* gen = <volatile uint64_t*>epoch_at
    if hdr.shape[0] < <Py_ssize_t>sizeof(Req):
        raise ValueError("header buffer too small")
    r.magic = RESP_MAGIC
    r.pad1 = 0
    r.pad2 = 0
    with nogil:
        while True:
            k = c_recv(fd, <char*>&q, sizeof(Req), MSG_WAITALL)
            if k > 0:
                deadline = _now() + frame_timeout
                if <size_t>k < sizeof(Req):  # the rest of a header: within the frame timeout
                    rc = _recv_all(fd, (<char*>&q) + k, sizeof(Req) - <size_t>k, deadline)
                    if rc:
                        break
            elif k == 0:
                rc = C_CLOSED
                break
            elif errno == EINTR:
                continue
            elif errno == EAGAIN or errno == EWOULDBLOCK:
                rc = C_IDLE  # nothing of a request within one kernel timeout
                break
            else:
                _set_errno(errno)
                rc = C_BROKEN
                break
            if (
                q.magic != REQ_MAGIC
                or (q.op != OP_READ and q.op != OP_WRITE)
                or q.length == 0
                or q.length > max_payload
                or q.addr < lo
                or q.addr > hi
                or q.length > hi - q.addr
                or (q.op == OP_READ and not (rights & RIGHT_READ))
                or (q.op == OP_WRITE and not (rights & RIGHT_WRITE))
                or gen[0] != epoch
            ):
                memcpy(&hdr[0], &q, sizeof(Req))
                rc = C_HANDBACK
                break
            deadline += q.length / min_rate
            mem = <char*>q.addr
            r.rid = q.rid
            r.status = 0
            if q.op == OP_READ:
                r.length = q.length
                rc = _send_two(fd, <char*>&r, sizeof(Resp), mem, q.length, deadline)
            else:
                r.length = 0
                rc = _recv_all(fd, mem, q.length, deadline)
                if rc == 0:
                    rc = _send_all(fd, <char*>&r, sizeof(Resp), deadline, 0)
            if rc:
                break
    return rc

