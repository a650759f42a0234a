/* FAKE libcuda.so.1 for tests: NOT the NVIDIA driver.
 *
 * A stand-in for the CUDA driver API over host memory, so that the real cuda-python
 * (cuda.bindings) can load it through LD_LIBRARY_PATH and our BindingsDriver runs on the real
 * bindings' marshalling in CPU-only CI. cuda.bindings resolves every entry point through
 * cuGetProcAddress_v2, which answers from the table at the bottom.
 *
 * It keeps the driver rules that are cheap to keep and that our code can get wrong:
 *   - cuInit first; every call that works on a context needs one current in the calling thread;
 *   - primary contexts per device (FAKE_CUDA_DEVICES, default 2), a per-thread context stack
 *     (cuCtxSetCurrent replaces its top, Push/Pop push and pop);
 *   - streams and events belong to the context current when they were made; recording an event
 *     on a stream of another context fails with CUDA_ERROR_INVALID_HANDLE (counted);
 *   - "device memory" is a shared file under FAKE_CUDA_DIR (default /dev/shm), so a legacy IPC
 *     handle names it and another process maps it; opening one's own handle fails;
 *   - VMM: cuMemAddressReserve reserves PROT_NONE address space, cuMemMap maps a cuMemCreate
 *     allocation into it (size <= the allocation's), it is usable only after cuMemSetAccess;
 *     RANGE_START/RANGE_SIZE and cuMemGetAddressRange describe the reservation,
 *     MAPPING_BASE_ADDR/MAPPING_SIZE the mapping, cuMemRetainAllocationHandle the mapping
 *     holding the address;
 *   - copies must touch known memory (device, mapped-with-access, pinned or registered host);
 *   - cuEventQuery answers NOT_READY once after each record (FAKE_CUDA_NOT_READY=N: N times;
 *     -1: the event never completes, and cuEventSynchronize on it blocks for ever, as the
 *     driver's would);
 *   - VMM access is per device: a copy touching a mapping runs in its stream's (or the current)
 *     context, whose device must have been granted access by cuMemSetAccess;
 *   - cuMemHostRegister pins whole pages: a range sharing a page with a registration already
 *     made fails with CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED; memory that is not writable
 *     (checked in /proc/self/maps) is refused without CU_MEMHOSTREGISTER_READ_ONLY, which needs
 *     the device attribute READ_ONLY_HOST_REGISTER_SUPPORTED (113); each call is counted;
 *   - ordering: the application's own GPU work (cuMemsetD8Async, cuMemcpyHtoDAsync: torch's
 *     kernels stand-ins) completes late, only when something waits for it: its stream is
 *     synchronized, an event recorded after it is queried or synchronized, another stream is
 *     made to wait on such an event (cuStreamWaitEvent), or a later call on the same stream (or
 *     a synchronous copy, for the legacy NULL stream) comes in stream order. A copy on another
 *     stream that did not wait reads or overwrites the bytes before that work lands, and is
 *     counted (stale). The engine's cuMemcpyAsync runs at once, as before.
 * Fault switches, read at each call: FAKE_CUDA_FAIL_INIT=1 (cuInit -> NO_DEVICE),
 * FAKE_CUDA_FAIL_EXPORT=1 (cuIpcGetMemHandle and cuMemExportToShareableHandle -> NOT_SUPPORTED),
 * FAKE_CUDA_CORRUPT_COPIES=1 (every async copy adds 1 to its first byte),
 * FAKE_CUDA_IGNORE_WAITS=1 (cuStreamWaitEvent orders nothing: a driver that loses the wait),
 * FAKE_CUDA_HIDE=cuA,cuB (cuGetProcAddress does not know them: an older driver), read at start,
 * FAKE_CUDA_ATTRS=103=0,124=1 (device attributes answered otherwise),
 * FAKE_CUDA_PCI_BUS_IDS=BUSID,BUSID (each device's cuDeviceGetPCIBusId),
 * FAKE_CUDA_FAIL_HOST_REGISTER=1 (cuMemHostRegister -> CUDA_ERROR_OUT_OF_MEMORY),
 * FAKE_CUDA_FAIL_IMPORT=1 (cuMemImportFromShareableHandle -> CUDA_ERROR_NOT_SUPPORTED).
 * fake_cuda_counters() reports what happened, for the tests' assertions.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum {
    OK = 0, E_INVALID_VALUE = 1, E_OUT_OF_MEMORY = 2, E_NOT_INITIALIZED = 3, E_NO_DEVICE = 100,
    E_INVALID_DEVICE = 101, E_INVALID_CONTEXT = 201, E_INVALID_HANDLE = 400, E_NOT_FOUND = 500,
    E_NOT_READY = 600, E_ALREADY_REGISTERED = 712, E_NOT_REGISTERED = 713, E_NOT_SUPPORTED = 801,
};

#define MAX_DEVICES 8
#define MAGIC_CTX 0x43545821u
#define MAGIC_STREAM 0x53545221u
#define MAGIC_EVENT 0x45564e21u
#define MAGIC_HANDLE 0x484e4421u
#define IPC_MAGIC 0xfa6ec0d3u
#define GRANULARITY (2u << 20)

struct ctx { unsigned magic; int device; int refs; };
struct stream { unsigned magic; struct ctx *ctx; };
struct event { unsigned magic; struct ctx *ctx; int pending; struct stream *on; unsigned long long upto; };
struct handle { unsigned magic; int fd; size_t size; int device; int refs; int posix_fd; };

enum kind { K_DEVICE, K_IPC, K_HOST_ALLOC, K_HOST_REG, K_RESERVE, K_MAP };
struct range {
    enum kind kind;
    uintptr_t base;
    size_t size;
    int device;
    int access;            /* K_MAP: bit d set when cuMemSetAccess granted device d access */
    struct handle *handle; /* K_MAP */
    unsigned long long seq;/* K_DEVICE: file sequence number */
    uintptr_t user;        /* K_HOST_REG: the pointer registered (base..size: its whole pages) */
    struct range *next;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct range *g_ranges;
static int g_init;
static struct ctx g_primary[MAX_DEVICES];
static unsigned long long g_seq;
static long g_counters[16]; /* see fake_cuda_counters */
enum { C_CTX_MISMATCH, C_UNKNOWN_COPY, C_NOT_READY, C_IPC_OPEN, C_IPC_CLOSE, C_COPIES, C_NO_CTX,
       C_STALE, C_WAITS, C_HOST_REGISTER, C_COUNT };

#define STACK_MAX 32
static __thread struct ctx *t_stack[STACK_MAX];
static __thread int t_depth;

static int env_on(const char *name) {
    const char *v = getenv(name);
    return v != NULL && v[0] != '\0' && strcmp(v, "0") != 0;
}

static int n_devices(void) {
    const char *v = getenv("FAKE_CUDA_DEVICES");
    int n = v ? atoi(v) : 2;
    return n < 1 ? 1 : n > MAX_DEVICES ? MAX_DEVICES : n;
}

static const char *shm_dir(void) {
    const char *v = getenv("FAKE_CUDA_DIR");
    return v && v[0] ? v : "/dev/shm";
}

static void bump(int which) { __atomic_fetch_add(&g_counters[which], 1, __ATOMIC_RELAXED); }

static struct ctx *current(void) { return t_depth > 0 ? t_stack[t_depth - 1] : NULL; }

#define NEED_INIT() do { if (!g_init) return E_NOT_INITIALIZED; } while (0)
#define NEED_CTX() do { NEED_INIT(); if (current() == NULL) { bump(C_NO_CTX); return E_INVALID_CONTEXT; } } while (0)

/* -- range table (callers hold g_lock) ---------------------------------------------------- */
static struct range *find(uintptr_t p, int kind_mask) {
    for (struct range *r = g_ranges; r; r = r->next)
        if ((kind_mask & (1 << r->kind)) && p >= r->base && p < r->base + r->size) return r;
    return NULL;
}

static struct range *add(enum kind k, uintptr_t base, size_t size, int device) {
    struct range *r = calloc(1, sizeof *r);
    r->kind = k; r->base = base; r->size = size; r->device = device;
    r->next = g_ranges; g_ranges = r;
    return r;
}

static void drop(struct range *victim) {
    for (struct range **pp = &g_ranges; *pp; pp = &(*pp)->next)
        if (*pp == victim) { *pp = victim->next; free(victim); return; }
}

#define DEVICE_KINDS ((1 << K_DEVICE) | (1 << K_IPC) | (1 << K_MAP))
#define HOST_KINDS ((1 << K_HOST_ALLOC) | (1 << K_HOST_REG))

/* Is all of [p, p+n) memory the driver may copy from a context of ``device``? (Adjacent VMM
 * mappings are one range; a mapping needs access granted to that device.) */
static int usable(uintptr_t p, size_t n, int device) {
    for (uintptr_t at = p, end = p + n; at < end;) {
        struct range *r = find(at, DEVICE_KINDS | HOST_KINDS);
        if (r == NULL || (r->kind == K_MAP && !(r->access & (1 << device)))) return 0;
        /* a copy may run on into the next VMM mapping, or the next registration of host pages
         * (regions sharing a page are pinned by two; the real driver may stage such a copy
         * through its own buffers instead, which is slower but moves the same bytes) */
        if (end > r->base + r->size && r->kind != K_MAP && r->kind != K_HOST_REG) return 0;
        at = r->base + r->size;
    }
    return 1;
}

static void dev_path(char *out, size_t cap, int pid, unsigned long long seq) {
    snprintf(out, cap, "%s/fakecuda.%d.%llu", shm_dir(), pid, seq);
}

/* -- init, devices ------------------------------------------------------------------------ */
CUresult cuInit(unsigned int flags) {
    (void)flags;
    if (env_on("FAKE_CUDA_FAIL_INIT")) return E_NO_DEVICE;
    pthread_mutex_lock(&g_lock);
    if (!g_init) {
        for (int i = 0; i < MAX_DEVICES; i++) g_primary[i] = (struct ctx){MAGIC_CTX, i, 0};
        g_init = 1;
    }
    pthread_mutex_unlock(&g_lock);
    return OK;
}

CUresult cuDriverGetVersion(int *v) {
    const char *e = getenv("FAKE_CUDA_DRIVER_VERSION");
    if (!v) return E_INVALID_VALUE;
    *v = e ? atoi(e) : 12080;
    return OK;
}

CUresult cuDeviceGetCount(int *n) { NEED_INIT(); *n = n_devices(); return OK; }

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    NEED_INIT();
    if (ordinal < 0 || ordinal >= n_devices()) return E_INVALID_DEVICE;
    *d = ordinal;
    return OK;
}

#define CHECK_DEV(d) do { NEED_INIT(); if ((d) < 0 || (d) >= n_devices()) return E_INVALID_DEVICE; } while (0)

CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    CHECK_DEV(d);
    if (len <= 0) return E_INVALID_VALUE;
    snprintf(name, (size_t)len, "FAKE CUDA device %d (not a GPU)", d);
    return OK;
}

CUresult cuDeviceGetUuid(unsigned char *uuid, CUdevice d) {
    CHECK_DEV(d);
    for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0xf0 + i); /* bytes >= 0x80 on purpose */
    uuid[0] = (unsigned char)(0xa0 + d);
    return OK;
}

/* FAKE_CUDA_PCI_BUS_IDS=0000:81:00.0,0000:01:00.0: device N's PCI address (as the real driver,
 * upper-case hex); unset or short: 0000:<N+1>:00.0. CUDA numbers devices by its own order
 * (fastest first by default, CUDA_VISIBLE_DEVICES), not by bus, so the list need not be sorted. */
CUresult cuDeviceGetPCIBusId(char *out, int len, CUdevice d) {
    CHECK_DEV(d);
    if (out == NULL || len <= 0) return E_INVALID_VALUE;
    const char *p = getenv("FAKE_CUDA_PCI_BUS_IDS");
    for (int i = 0; p && *p && i < d; i++) p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL;
    char id[32];
    if (p && *p) {
        size_t n = strcspn(p, ",");
        snprintf(id, sizeof id, "%.*s", (int)(n < 31 ? n : 31), p);
        for (char *c = id; *c; c++) *c = (char)toupper((unsigned char)*c);
    } else {
        snprintf(id, sizeof id, "0000:%02X:00.0", d + 1);
    }
    snprintf(out, (size_t)len, "%s", id);
    return OK;
}

CUresult cuDeviceTotalMem(size_t *bytes, CUdevice d) { CHECK_DEV(d); *bytes = (size_t)1 << 34; return OK; }

/* FAKE_CUDA_ATTRS=103=0,124=1: device attributes answered otherwise (all devices). */
static int attr_override(int attrib, int *value) {
    const char *p = getenv("FAKE_CUDA_ATTRS");
    while (p && *p) {
        int a, v, used = 0;
        if (sscanf(p, "%d=%d%n", &a, &v, &used) != 2) return 0;
        if (a == attrib) { *value = v; return 1; }
        p += used;
        if (*p == ',') p++;
    }
    return 0;
}

CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice d) {
    CHECK_DEV(d);
    if (attr_override(attrib, pi)) return OK;
    switch (attrib) {
    case 102: /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    case 103: /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
    case 41:  /* UNIFIED_ADDRESSING */
    case 113: /* READ_ONLY_HOST_REGISTER_SUPPORTED */
        *pi = 1; break;
    case 75: *pi = 9; break;  /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *pi = 0; break;  /* COMPUTE_CAPABILITY_MINOR */
    case 16: *pi = 132; break; /* MULTIPROCESSOR_COUNT */
    default: *pi = 0;
    }
    return OK;
}

CUresult cuDeviceCanAccessPeer(int *can, CUdevice d, CUdevice peer) {
    CHECK_DEV(d); CHECK_DEV(peer);
    *can = d != peer;
    return OK;
}

CUresult cuGetErrorName(CUresult e, const char **s) {
    static char buf[64];
    snprintf(buf, sizeof buf, "FAKE_CUDA_ERROR_%d", e);
    *s = buf;
    return OK;
}

CUresult cuGetErrorString(CUresult e, const char **s) { return cuGetErrorName(e, s); }

/* -- contexts ----------------------------------------------------------------------------- */
static int valid_ctx(struct ctx *c) {
    for (int i = 0; i < MAX_DEVICES; i++) if (c == &g_primary[i]) return 1;
    return 0;
}

CUresult cuDevicePrimaryCtxRetain(struct ctx **out, CUdevice d) {
    CHECK_DEV(d);
    __atomic_fetch_add(&g_primary[d].refs, 1, __ATOMIC_RELAXED);
    *out = &g_primary[d];
    return OK;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice d) {
    CHECK_DEV(d);
    if (__atomic_fetch_sub(&g_primary[d].refs, 1, __ATOMIC_RELAXED) <= 0) {
        __atomic_fetch_add(&g_primary[d].refs, 1, __ATOMIC_RELAXED);
        return E_INVALID_CONTEXT;
    }
    return OK;
}

CUresult cuCtxSetCurrent(struct ctx *c) {
    NEED_INIT();
    if (c == NULL) { if (t_depth > 0) t_depth--; return OK; }
    if (!valid_ctx(c)) return E_INVALID_CONTEXT;
    if (t_depth == 0) t_stack[t_depth++] = c; else t_stack[t_depth - 1] = c;
    return OK;
}

CUresult cuCtxGetCurrent(struct ctx **out) { NEED_INIT(); *out = current(); return OK; }

CUresult cuCtxPushCurrent(struct ctx *c) {
    NEED_INIT();
    if (c == NULL || !valid_ctx(c)) return E_INVALID_CONTEXT;
    if (t_depth >= STACK_MAX) return E_OUT_OF_MEMORY;
    t_stack[t_depth++] = c;
    return OK;
}

CUresult cuCtxPopCurrent(struct ctx **out) {
    NEED_INIT();
    if (t_depth == 0) return E_INVALID_CONTEXT;
    struct ctx *c = t_stack[--t_depth];
    if (out) *out = c;
    return OK;
}

CUresult cuCtxGetDevice(CUdevice *d) { NEED_CTX(); *d = current()->device; return OK; }
static void order_flush_ctx(struct ctx *c);
CUresult cuCtxSynchronize(void) { NEED_CTX(); order_flush_ctx(current()); return OK; }

/* -- pointers ----------------------------------------------------------------------------- */
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr ptr) {
    NEED_INIT();
    CUresult rc = OK;
    pthread_mutex_lock(&g_lock);
    struct range *r = find((uintptr_t)ptr, DEVICE_KINDS | HOST_KINDS);
    struct range *res = r && r->kind == K_MAP ? find((uintptr_t)ptr, 1 << K_RESERVE) : r;
    if (r == NULL) { rc = E_INVALID_VALUE; goto out; }
    int dev = r->kind <= K_IPC || r->kind == K_MAP;
    switch (attr) {
    case 2: *(unsigned *)data = dev ? 2u : 1u; break; /* MEMORY_TYPE: DEVICE or HOST */
    case 9: if (!dev) { rc = E_INVALID_VALUE; break; } *(int *)data = r->device; break;
    case 10: *(unsigned char *)data = r->kind == K_DEVICE; break; /* IS_LEGACY_CUDA_IPC_CAPABLE */
    case 11: *(CUdeviceptr *)data = res->base; break; /* RANGE_START_ADDR: the reservation */
    case 12: *(size_t *)data = res->size; break;      /* RANGE_SIZE */
    case 19: *(CUdeviceptr *)data = r->base; break;   /* MAPPING_BASE_ADDR: the mapping */
    case 18: *(size_t *)data = r->size; break;        /* MAPPING_SIZE */
    case 3: *(CUdeviceptr *)data = ptr; break;        /* DEVICE_POINTER (UVA) */
    default: rc = E_INVALID_VALUE;
    }
out:
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr ptr) {
    NEED_INIT();
    CUresult rc = OK;
    pthread_mutex_lock(&g_lock);
    struct range *r = find((uintptr_t)ptr, DEVICE_KINDS);
    if (r && r->kind == K_MAP) r = find((uintptr_t)ptr, 1 << K_RESERVE);
    if (r == NULL) rc = E_NOT_FOUND;
    else { if (base) *base = r->base; if (size) *size = r->size; }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* -- device memory (cudaMalloc-like) and legacy IPC ---------------------------------------- */
CUresult cuMemAlloc(CUdeviceptr *out, size_t n) {
    NEED_CTX();
    if (n == 0) return E_INVALID_VALUE;
    char path[512];
    pthread_mutex_lock(&g_lock);
    unsigned long long seq = ++g_seq;
    pthread_mutex_unlock(&g_lock);
    dev_path(path, sizeof path, getpid(), seq);
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return E_OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)n) != 0) { close(fd); unlink(path); return E_OUT_OF_MEMORY; }
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) { unlink(path); return E_OUT_OF_MEMORY; }
    pthread_mutex_lock(&g_lock);
    add(K_DEVICE, (uintptr_t)p, n, current()->device)->seq = seq;
    pthread_mutex_unlock(&g_lock);
    *out = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuMemFree(CUdeviceptr p) {
    NEED_INIT();
    pthread_mutex_lock(&g_lock);
    struct range *r = find((uintptr_t)p, 1 << K_DEVICE);
    if (r == NULL || r->base != (uintptr_t)p) { pthread_mutex_unlock(&g_lock); return E_INVALID_VALUE; }
    char path[512];
    dev_path(path, sizeof path, getpid(), r->seq);
    unlink(path);
    munmap((void *)r->base, r->size);
    drop(r);
    pthread_mutex_unlock(&g_lock);
    return OK;
}

struct ipc_handle { unsigned magic; int pid; unsigned long long seq; unsigned long long size;
                    unsigned long long offset; unsigned char check[32]; };

CUresult cuIpcGetMemHandle(unsigned char *out, CUdeviceptr p) {
    NEED_INIT();
    if (env_on("FAKE_CUDA_FAIL_EXPORT")) return E_NOT_SUPPORTED;
    pthread_mutex_lock(&g_lock);
    struct range *r = find((uintptr_t)p, DEVICE_KINDS);
    if (r == NULL || r->kind != K_DEVICE) { pthread_mutex_unlock(&g_lock); return E_INVALID_VALUE; }
    struct ipc_handle h = {IPC_MAGIC, getpid(), r->seq, r->size, 0, {0}};
    for (int i = 0; i < 32; i++) h.check[i] = (unsigned char)(0x80 + i); /* high bytes survive? */
    pthread_mutex_unlock(&g_lock);
    memset(out, 0, 64);
    memcpy(out, &h, sizeof h);
    return OK;
}

struct ipc_raw { unsigned char bytes[64]; }; /* CUipcMemHandle: passed by value */

CUresult cuIpcOpenMemHandle(CUdeviceptr *out, struct ipc_raw handle, unsigned int flags) {
    NEED_CTX();
    struct ipc_handle h;
    memcpy(&h, handle.bytes, sizeof h);
    if (h.magic != IPC_MAGIC || flags != 1) return E_INVALID_VALUE;
    for (int i = 0; i < 32; i++) if (h.check[i] != (unsigned char)(0x80 + i)) return E_INVALID_VALUE;
    if (h.pid == getpid()) return E_INVALID_CONTEXT; /* the real driver refuses one's own handle */
    char path[512];
    dev_path(path, sizeof path, h.pid, h.seq);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return E_INVALID_HANDLE;
    void *p = mmap(NULL, h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return E_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    add(K_IPC, (uintptr_t)p, h.size, current()->device);
    pthread_mutex_unlock(&g_lock);
    bump(C_IPC_OPEN);
    *out = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    NEED_CTX();
    pthread_mutex_lock(&g_lock);
    struct range *r = find((uintptr_t)p, 1 << K_IPC);
    if (r == NULL || r->base != (uintptr_t)p) { pthread_mutex_unlock(&g_lock); return E_INVALID_VALUE; }
    munmap((void *)r->base, r->size);
    drop(r);
    pthread_mutex_unlock(&g_lock);
    bump(C_IPC_CLOSE);
    return OK;
}

/* -- host memory -------------------------------------------------------------------------- */
CUresult cuMemHostAlloc(void **out, size_t n, unsigned int flags) {
    NEED_CTX();
    (void)flags;
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return E_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    add(K_HOST_ALLOC, (uintptr_t)p, n, -1);
    pthread_mutex_unlock(&g_lock);
    *out = p;
    return OK;
}

CUresult cuMemAllocHost(void **out, size_t n) { return cuMemHostAlloc(out, n, 0); }

CUresult cuMemFreeHost(void *p) {
    NEED_INIT();
    pthread_mutex_lock(&g_lock);
    struct range *r = find((uintptr_t)p, 1 << K_HOST_ALLOC);
    if (r == NULL || r->base != (uintptr_t)p) { pthread_mutex_unlock(&g_lock); return E_INVALID_VALUE; }
    munmap(p, r->size);
    drop(r);
    pthread_mutex_unlock(&g_lock);
    return OK;
}

/* Is all of [p, p+n) mapped, and writable? 1: writable, 0: mapped but some of it read-only,
 * -1: some of it not mapped. */
static int writable(uintptr_t p, size_t n) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (f == NULL) return -1;
    char line[512], perms[8];
    uintptr_t at = p, end = p + n;
    int all_w = 1;
    while (at < end && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3 || hi <= at) continue;
        if (lo > at) break; /* a hole */
        if (perms[1] != 'w') all_w = 0;
        at = hi;
    }
    fclose(f);
    return at < end ? -1 : all_w;
}

#define PAGE 4096u
#define PAGE_DOWN(x) ((x) & ~(uintptr_t)(PAGE - 1))
#define PAGE_UP(x) PAGE_DOWN((x) + PAGE - 1)

CUresult cuMemHostRegister(void *p, size_t n, unsigned int flags) {
    NEED_CTX();
    bump(C_HOST_REGISTER);
    if (n == 0) return E_INVALID_VALUE;
    if (env_on("FAKE_CUDA_FAIL_HOST_REGISTER")) return E_OUT_OF_MEMORY;
    int w = writable((uintptr_t)p, n), ro_ok = 0;
    if (w < 0) return E_INVALID_VALUE;
    if (flags & 0x08) { /* CU_MEMHOSTREGISTER_READ_ONLY */
        if (cuDeviceGetAttribute(&ro_ok, 113, current()->device) != OK || !ro_ok) return E_NOT_SUPPORTED;
    } else if (!w) return E_INVALID_VALUE; /* read-only pages need the READ_ONLY flag */
    CUresult rc = OK;
    uintptr_t lo = PAGE_DOWN((uintptr_t)p), hi = PAGE_UP((uintptr_t)p + n); /* whole pages */
    pthread_mutex_lock(&g_lock);
    for (struct range *r = g_ranges; r; r = r->next)
        if ((HOST_KINDS & (1 << r->kind)) && lo < PAGE_UP(r->base + r->size) && PAGE_DOWN(r->base) < hi)
            rc = E_ALREADY_REGISTERED;
    if (rc == OK) add(K_HOST_REG, lo, hi - lo, -1)->user = (uintptr_t)p;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult cuMemHostUnregister(void *p) {
    NEED_INIT();
    pthread_mutex_lock(&g_lock);
    struct range *r = g_ranges;
    while (r && !(r->kind == K_HOST_REG && r->user == (uintptr_t)p)) r = r->next;
    CUresult rc = r ? OK : E_NOT_REGISTERED;
    if (rc == OK) drop(r);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* -- VMM ---------------------------------------------------------------------------------- */
struct alloc_prop { int type; int handle_types; int loc_type; int loc_id; };

CUresult cuMemGetAllocationGranularity(size_t *g, const struct alloc_prop *prop, int option) {
    NEED_INIT(); (void)prop; (void)option;
    *g = GRANULARITY;
    return OK;
}

CUresult cuMemCreate(unsigned long long *out, size_t size, const struct alloc_prop *prop,
                     unsigned long long flags) {
    NEED_INIT(); (void)flags;
    if (size == 0 || size % GRANULARITY || prop->loc_type != 1) return E_INVALID_VALUE;
    if (prop->loc_id < 0 || prop->loc_id >= n_devices()) return E_INVALID_DEVICE;
    int fd = memfd_create("fakecuda-vmm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) { if (fd >= 0) close(fd); return E_OUT_OF_MEMORY; }
    struct handle *h = calloc(1, sizeof *h);
    *h = (struct handle){MAGIC_HANDLE, fd, size, prop->loc_id, 1, (prop->handle_types & 1) != 0};
    *out = (unsigned long long)(uintptr_t)h;
    return OK;
}

static struct handle *as_handle(unsigned long long v) {
    struct handle *h = (struct handle *)(uintptr_t)v;
    return h && h->magic == MAGIC_HANDLE ? h : NULL;
}

CUresult cuMemRelease(unsigned long long v) {
    NEED_INIT();
    struct handle *h = as_handle(v);
    if (h == NULL) return E_INVALID_HANDLE;
    if (__atomic_sub_fetch(&h->refs, 1, __ATOMIC_ACQ_REL) == 0) { close(h->fd); h->magic = 0; free(h); }
    return OK;
}

CUresult cuMemAddressReserve(CUdeviceptr *out, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
    NEED_INIT(); (void)align; (void)addr; (void)flags;
    if (size == 0 || size % GRANULARITY) return E_INVALID_VALUE;
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return E_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    add(K_RESERVE, (uintptr_t)p, size, -1);
    pthread_mutex_unlock(&g_lock);
    *out = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
    NEED_INIT();
    pthread_mutex_lock(&g_lock);
    struct range *r = find((uintptr_t)p, 1 << K_RESERVE);
    CUresult rc = r && r->base == (uintptr_t)p && r->size == size ? OK : E_INVALID_VALUE;
    if (rc == OK && find((uintptr_t)p, 1 << K_MAP) == NULL) { munmap((void *)p, size); drop(r); }
    else if (rc == OK) rc = E_INVALID_VALUE; /* still mapped */
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, unsigned long long v,
                  unsigned long long flags) {
    NEED_INIT(); (void)flags;
    struct handle *h = as_handle(v);
    if (h == NULL) return E_INVALID_HANDLE;
    if (size == 0 || offset + size > h->size) return E_INVALID_VALUE; /* larger than the handle */
    CUresult rc = OK;
    pthread_mutex_lock(&g_lock);
    struct range *res = find((uintptr_t)p, 1 << K_RESERVE);
    if (res == NULL || (uintptr_t)p + size > res->base + res->size || find((uintptr_t)p, 1 << K_MAP))
        rc = E_INVALID_VALUE;
    else if (mmap((void *)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, (off_t)offset) == MAP_FAILED)
        rc = E_OUT_OF_MEMORY;
    else {
        struct range *m = add(K_MAP, (uintptr_t)p, size, h->device);
        m->handle = h;
        __atomic_fetch_add(&h->refs, 1, __ATOMIC_ACQ_REL);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
    NEED_INIT();
    pthread_mutex_lock(&g_lock);
    struct range *m = find((uintptr_t)p, 1 << K_MAP);
    if (m == NULL || m->base != (uintptr_t)p || m->size != size) { pthread_mutex_unlock(&g_lock); return E_INVALID_VALUE; }
    struct handle *h = m->handle;
    mmap((void *)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    drop(m);
    pthread_mutex_unlock(&g_lock);
    return cuMemRelease((unsigned long long)(uintptr_t)h);
}

struct access_desc { int loc_type; int loc_id; int flags; };

CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const struct access_desc *desc, size_t count) {
    NEED_INIT();
    if (count == 0) return E_INVALID_VALUE;
    for (size_t i = 0; i < count; i++)
        if (desc[i].loc_type != 1 || desc[i].loc_id < 0 || desc[i].loc_id >= n_devices()) return E_INVALID_DEVICE;
    CUresult rc = OK;
    int prot = PROT_NONE, grant = 0, revoke = 0; /* one desc per device: the union of them */
    for (size_t i = 0; i < count; i++) {
        int f = desc[i].flags;
        prot |= f == 3 ? PROT_READ | PROT_WRITE : f == 1 ? PROT_READ : PROT_NONE;
        if (f) grant |= 1 << desc[i].loc_id; else revoke |= 1 << desc[i].loc_id;
    }
    pthread_mutex_lock(&g_lock);
    uintptr_t at = (uintptr_t)p, end = at + size;
    while (rc == OK && at < end) { /* every byte of the range must be mapped */
        struct range *m = find(at, 1 << K_MAP);
        if (m == NULL || m->base + m->size > end) { rc = E_INVALID_VALUE; break; }
        m->access = (m->access | grant) & ~revoke;
        mprotect((void *)m->base, m->size, m->access ? prot | PROT_READ : PROT_NONE);
        at = m->base + m->size;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult cuMemRetainAllocationHandle(unsigned long long *out, void *addr) {
    NEED_INIT();
    pthread_mutex_lock(&g_lock);
    struct range *m = find((uintptr_t)addr, 1 << K_MAP); /* the mapping holding addr */
    if (m) __atomic_fetch_add(&m->handle->refs, 1, __ATOMIC_ACQ_REL);
    pthread_mutex_unlock(&g_lock);
    if (m == NULL) return E_INVALID_VALUE;
    *out = (unsigned long long)(uintptr_t)m->handle;
    return OK;
}

CUresult cuMemExportToShareableHandle(void *out, unsigned long long v, int type,
                                      unsigned long long flags) {
    NEED_INIT(); (void)flags;
    if (env_on("FAKE_CUDA_FAIL_EXPORT")) return E_NOT_SUPPORTED;
    struct handle *h = as_handle(v);
    if (h == NULL) return E_INVALID_HANDLE;
    if (type != 1 || !h->posix_fd) return E_NOT_SUPPORTED; /* created without the POSIX-FD type */
    int fd = fcntl(h->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return E_OUT_OF_MEMORY;
    *(int *)out = fd;
    return OK;
}

CUresult cuMemImportFromShareableHandle(unsigned long long *out, void *os_handle, int type) {
    NEED_INIT();
    if (type != 1 || env_on("FAKE_CUDA_FAIL_IMPORT")) return E_NOT_SUPPORTED;
    int fd = fcntl((int)(intptr_t)os_handle, F_DUPFD_CLOEXEC, 0);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) { if (fd >= 0) close(fd); return E_INVALID_HANDLE; }
    struct handle *h = calloc(1, sizeof *h);
    *h = (struct handle){MAGIC_HANDLE, fd, (size_t)st.st_size, 0, 1, 1};
    *out = (unsigned long long)(uintptr_t)h;
    return OK;
}

CUresult cuMemGetHandleForAddressRange(void *out, CUdeviceptr p, size_t size, int type,
                                       unsigned long long flags) {
    NEED_INIT(); (void)out; (void)p; (void)size; (void)type; (void)flags;
    return E_NOT_SUPPORTED;
}

/* -- ordering: the application's GPU work, completing late ---------------------------------- */
/* Work queued by cuMemsetD8Async / cuMemcpyHtoDAsync waits in one global FIFO (seq increasing)
 * until something orders after it; then it lands (bytes written). */
struct op { struct stream *s; unsigned long long seq; uintptr_t dst; size_t n; unsigned char *data; struct op *next; };
static pthread_mutex_t g_order = PTHREAD_MUTEX_INITIALIZER;
static struct op *g_ops;
static unsigned long long g_op_seq;
static struct stream g_null[MAX_DEVICES]; /* each context's legacy NULL stream */
#define ALL_OPS (~0ULL)

/* The stream an argument names: its own, or the current context's NULL stream. */
static struct stream *order_stream(struct stream *s) {
    if (s == NULL || (uintptr_t)s == 1 || (uintptr_t)s == 2) {
        struct ctx *c = current();
        if (c == NULL) return NULL;
        g_null[c->device].ctx = c;
        return &g_null[c->device];
    }
    return s;
}

/* Land the work of stream ``s`` queued up to ``upto`` (g_order held by the caller). */
static void order_flush_locked(struct stream *s, unsigned long long upto) {
    for (struct op **pp = &g_ops; *pp;) {
        struct op *o = *pp;
        if (o->s == s && o->seq <= upto) {
            memcpy((void *)o->dst, o->data, o->n);
            *pp = o->next;
            free(o->data);
            free(o);
        } else {
            pp = &o->next;
        }
    }
}

static void order_flush(struct stream *s, unsigned long long upto) {
    if (s == NULL) return;
    pthread_mutex_lock(&g_order);
    order_flush_locked(s, upto);
    pthread_mutex_unlock(&g_order);
}

/* Does work of a stream other than ``s`` still have to land in [p, p+n)? */
static int order_stale(struct stream *s, uintptr_t p, size_t n) {
    int hit = 0;
    pthread_mutex_lock(&g_order);
    for (struct op *o = g_ops; o && !hit; o = o->next)
        hit = o->s != s && p < o->dst + o->n && o->dst < p + n;
    pthread_mutex_unlock(&g_order);
    return hit;
}

/* A copy on ``s`` (NULL: a synchronous copy, ordered on the legacy NULL stream): its own
 * stream's earlier work lands first; work of other streams it did not wait for is counted. */
static void order_copy(struct stream *s, uintptr_t dst, uintptr_t src, size_t n) {
    struct stream *own = order_stream(s);
    order_flush(own, ALL_OPS);
    if (n && (order_stale(own, dst, n) || order_stale(own, src, n))) bump(C_STALE);
}

static void order_record(struct event *e, struct stream *s) {
    pthread_mutex_lock(&g_order);
    e->on = order_stream(s);
    e->upto = g_op_seq;
    pthread_mutex_unlock(&g_order);
}

/* Is work before the event's last record still to land? */
static int order_pending(struct event *e) {
    int hit = 0;
    pthread_mutex_lock(&g_order);
    for (struct op *o = g_ops; o && !hit; o = o->next) hit = o->s == e->on && o->seq <= e->upto;
    pthread_mutex_unlock(&g_order);
    return hit;
}

static void order_flush_ctx(struct ctx *c) {
    pthread_mutex_lock(&g_order);
    for (struct op **pp = &g_ops; *pp;) { /* in queue order */
        struct op *o = *pp;
        if (o->s->ctx == c) {
            memcpy((void *)o->dst, o->data, o->n);
            *pp = o->next;
            free(o->data);
            free(o);
        } else {
            pp = &o->next;
        }
    }
    pthread_mutex_unlock(&g_order);
}

static CUresult order_enqueue(struct stream *s, uintptr_t dst, const void *src, int fill, size_t n) {
    pthread_mutex_lock(&g_lock);
    int ok = usable(dst, n, current()->device);
    pthread_mutex_unlock(&g_lock);
    if (!ok) { bump(C_UNKNOWN_COPY); return E_INVALID_VALUE; }
    struct stream *own = order_stream(s);
    if (own == NULL) return E_INVALID_CONTEXT;
    struct op *o = calloc(1, sizeof *o);
    o->data = malloc(n ? n : 1);
    if (src) memcpy(o->data, src, n); else memset(o->data, fill, n);
    o->s = own; o->dst = dst; o->n = n;
    pthread_mutex_lock(&g_order);
    o->seq = ++g_op_seq;
    struct op **pp = &g_ops;
    while (*pp) pp = &(*pp)->next;
    *pp = o;
    pthread_mutex_unlock(&g_order);
    return OK;
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, struct stream *s) {
    NEED_CTX();
    if (s && (uintptr_t)s > 2 && !(s->magic == MAGIC_STREAM)) return E_INVALID_HANDLE;
    return order_enqueue(s, (uintptr_t)dst, NULL, v, n);
}

/* The source bytes are taken when queued (the real driver reads pinned memory when it runs). */
CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, struct stream *s) {
    NEED_CTX();
    if (s && (uintptr_t)s > 2 && !(s->magic == MAGIC_STREAM)) return E_INVALID_HANDLE;
    return order_enqueue(s, (uintptr_t)dst, src, 0, n);
}

/* Work queued on ``s`` after this waits for the event's last record: in the fake, whose
 * engine copies run at once, that is the producer's work landing now. Events of other
 * contexts are allowed, as with the real driver. */
CUresult cuStreamWaitEvent(struct stream *s, struct event *e, unsigned int flags) {
    NEED_CTX(); (void)flags;
    if (s && (uintptr_t)s > 2 && !(s->magic == MAGIC_STREAM)) return E_INVALID_HANDLE;
    if (e == NULL || e->magic != MAGIC_EVENT) return E_INVALID_HANDLE;
    bump(C_WAITS);
    if (e->on && !env_on("FAKE_CUDA_IGNORE_WAITS")) order_flush(e->on, e->upto);
    return OK;
}

/* -- streams, events, copies ---------------------------------------------------------------- */
CUresult cuStreamCreate(struct stream **out, unsigned int flags) {
    NEED_CTX(); (void)flags;
    struct stream *s = calloc(1, sizeof *s);
    *s = (struct stream){MAGIC_STREAM, current()};
    *out = s;
    return OK;
}

static struct stream *as_stream(struct stream *s) { return s && s->magic == MAGIC_STREAM ? s : NULL; }
static struct event *as_event(struct event *e) { return e && e->magic == MAGIC_EVENT ? e : NULL; }

CUresult cuStreamDestroy(struct stream *s) {
    NEED_INIT();
    if (!as_stream(s)) return E_INVALID_HANDLE;
    order_flush(s, ALL_OPS); /* destroying a stream lets its work finish */
    s->magic = 0; free(s);
    return OK;
}

CUresult cuStreamSynchronize(struct stream *s) { NEED_CTX(); order_flush(order_stream(s), ALL_OPS); return OK; }

/* The context a stream argument runs in: its own, or the current one for the NULL stream. */
static struct ctx *stream_ctx(struct stream *s, CUresult *rc) {
    *rc = OK;
    if (s == NULL || (uintptr_t)s == 1 || (uintptr_t)s == 2) return current();
    if (!as_stream(s)) { *rc = E_INVALID_HANDLE; return NULL; }
    return s->ctx;
}

/* Async copies (the engine's) must touch known memory on both ends; a synchronous host copy
 * may name pageable host memory, as with the real driver. FAKE_CUDA_CORRUPT_COPIES=1 bumps the
 * first byte of every async copy, for tests that a checker notices wrong bytes. */
static CUresult copy(CUdeviceptr dst, CUdeviceptr src, size_t n, int async, int host_dst, int host_src,
                     int device) {
    if (n == 0) return OK;
    pthread_mutex_lock(&g_lock);
    int ok = (host_dst || usable((uintptr_t)dst, n, device)) &&
             (host_src || usable((uintptr_t)src, n, device));
    pthread_mutex_unlock(&g_lock);
    if (!ok) { bump(C_UNKNOWN_COPY); return E_INVALID_VALUE; }
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    if (async && env_on("FAKE_CUDA_CORRUPT_COPIES")) *(unsigned char *)(uintptr_t)dst += 1;
    bump(C_COPIES);
    return OK;
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, struct stream *s) {
    NEED_CTX();
    CUresult rc;
    struct ctx *c = stream_ctx(s, &rc);
    if (rc == OK) order_copy(s, (uintptr_t)dst, (uintptr_t)src, n);
    return rc != OK ? rc : copy(dst, src, n, 1, 0, 0, c->device);
}

CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    NEED_CTX();
    order_copy(NULL, (uintptr_t)dst, (uintptr_t)src, n);
    return copy(dst, src, n, 0, 0, 0, current()->device);
}
CUresult cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t n) {
    NEED_CTX();
    order_copy(NULL, (uintptr_t)dst, (uintptr_t)src, n);
    return copy(dst, (CUdeviceptr)(uintptr_t)src, n, 0, 0, 1, current()->device);
}
CUresult cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n) {
    NEED_CTX();
    order_copy(NULL, (uintptr_t)dst, (uintptr_t)src, n);
    return copy((CUdeviceptr)(uintptr_t)dst, src, n, 0, 1, 0, current()->device);
}
CUresult cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t n) { return cuMemcpy(dst, src, n); }

CUresult cuMemsetD8(CUdeviceptr dst, unsigned char v, size_t n) {
    NEED_CTX();
    order_copy(NULL, (uintptr_t)dst, (uintptr_t)dst, n);
    pthread_mutex_lock(&g_lock);
    int ok = usable((uintptr_t)dst, n, current()->device);
    pthread_mutex_unlock(&g_lock);
    if (!ok) return E_INVALID_VALUE;
    memset((void *)(uintptr_t)dst, v, n);
    return OK;
}

CUresult cuEventCreate(struct event **out, unsigned int flags) {
    NEED_CTX(); (void)flags;
    struct event *e = calloc(1, sizeof *e);
    *e = (struct event){MAGIC_EVENT, current(), 0, NULL, 0};
    *out = e;
    return OK;
}

CUresult cuEventDestroy(struct event *e) {
    NEED_INIT();
    if (!as_event(e)) return E_INVALID_HANDLE;
    e->magic = 0; free(e);
    return OK;
}

CUresult cuEventRecord(struct event *e, struct stream *s) {
    NEED_INIT();
    if (!as_event(e)) return E_INVALID_HANDLE;
    CUresult rc;
    struct ctx *sc = stream_ctx(s, &rc);
    if (rc != OK) return rc;
    if (sc != e->ctx) { bump(C_CTX_MISMATCH); return E_INVALID_HANDLE; }
    order_record(e, s);
    const char *v = getenv("FAKE_CUDA_NOT_READY");
    __atomic_store_n(&e->pending, v && v[0] ? atoi(v) : 1, __ATOMIC_RELEASE);
    return OK;
}

CUresult cuEventQuery(struct event *e) {
    NEED_INIT();
    if (!as_event(e)) return E_INVALID_HANDLE;
    if (order_pending(e)) { order_flush(e->on, e->upto); bump(C_NOT_READY); return E_NOT_READY; }
    int left = __atomic_load_n(&e->pending, __ATOMIC_ACQUIRE);
    if (left < 0) { bump(C_NOT_READY); return E_NOT_READY; } /* never completes */
    if (left > 0) { __atomic_fetch_sub(&e->pending, 1, __ATOMIC_ACQ_REL); bump(C_NOT_READY); return E_NOT_READY; }
    return OK;
}

CUresult cuEventSynchronize(struct event *e) {
    NEED_INIT();
    if (!as_event(e)) return E_INVALID_HANDLE;
    while (__atomic_load_n(&e->pending, __ATOMIC_ACQUIRE) < 0) pause(); /* never completes */
    if (e->on) order_flush(e->on, e->upto);
    e->pending = 0;
    return OK;
}

/* -- test hooks (not driver API) ------------------------------------------------------------ */
/* ctx mismatches, unknown-memory copies, NOT_READY answers, IPC opens, IPC closes, copies,
 * calls needing a context without one, copies that did not wait for the application's work on
 * their bytes (stale), cuStreamWaitEvent calls, cuMemHostRegister calls. */
int fake_cuda_counters(long *out, int n) {
    int k = n < C_COUNT ? n : C_COUNT;
    for (int i = 0; i < k; i++) out[i] = __atomic_load_n(&g_counters[i], __ATOMIC_RELAXED);
    return k;
}

/* The device of the calling thread's current context, -1 without one. */
int fake_cuda_current_device(void) { struct ctx *c = current(); return c ? c->device : -1; }

/* -- entry points by name ------------------------------------------------------------------- */
struct entry { const char *name; void *fn; };
#define E(f) {#f, (void *)f}
static const struct entry g_entries[] = {
    E(cuInit), E(cuDriverGetVersion), E(cuDeviceGetCount), E(cuDeviceGet), E(cuDeviceGetName),
    {"cuDeviceGetUuid", (void *)cuDeviceGetUuid}, {"cuDeviceGetUuid_v2", (void *)cuDeviceGetUuid},
    E(cuDeviceTotalMem), E(cuDeviceGetPCIBusId), E(cuDeviceGetAttribute), E(cuDeviceCanAccessPeer), E(cuGetErrorName),
    E(cuGetErrorString), E(cuDevicePrimaryCtxRetain), E(cuDevicePrimaryCtxRelease),
    E(cuCtxSetCurrent), E(cuCtxGetCurrent), E(cuCtxPushCurrent), E(cuCtxPopCurrent),
    E(cuCtxGetDevice), E(cuCtxSynchronize), E(cuPointerGetAttribute), E(cuMemGetAddressRange),
    E(cuMemAlloc), E(cuMemFree), E(cuIpcGetMemHandle), E(cuIpcOpenMemHandle),
    E(cuIpcCloseMemHandle), E(cuMemHostAlloc), E(cuMemAllocHost), E(cuMemFreeHost),
    E(cuMemHostRegister), E(cuMemHostUnregister), E(cuMemGetAllocationGranularity),
    E(cuMemCreate), E(cuMemRelease), E(cuMemAddressReserve), E(cuMemAddressFree), E(cuMemMap),
    E(cuMemUnmap), E(cuMemSetAccess), E(cuMemRetainAllocationHandle),
    E(cuMemExportToShareableHandle), E(cuMemImportFromShareableHandle),
    E(cuMemGetHandleForAddressRange), E(cuStreamCreate), E(cuStreamDestroy),
    E(cuStreamSynchronize), E(cuMemcpyAsync), E(cuMemcpy), E(cuMemcpyHtoD), E(cuMemcpyDtoH),
    E(cuMemcpyDtoD), E(cuMemsetD8), E(cuEventCreate), E(cuEventDestroy), E(cuEventRecord),
    E(cuEventQuery), E(cuEventSynchronize),
    E(cuStreamWaitEvent), E(cuMemsetD8Async), E(cuMemcpyHtoDAsync),
};

/* FAKE_CUDA_HIDE=name,name: entry points this "driver" does not have. */
static int hidden(const char *symbol) {
    const char *list = getenv("FAKE_CUDA_HIDE");
    size_t n = strlen(symbol);
    for (const char *p = list; p && *p;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == n && strncmp(p, symbol, n) == 0) return 1;
        p = end ? end + 1 : NULL;
    }
    return 0;
}

static const char *g_log; /* FAKE_CUDA_LOG_PROCS: append each resolved/missing name here */

/* cuda.bindings asks for each entry point by its base name (cuMemAlloc, not cuMemAlloc_v2)
 * with the version it was built against; the fake implements the newest ABI of each, which is
 * the one those versions name. */
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                             int *status) {
    (void)flags;
    if (symbol == NULL || pfn == NULL) return E_INVALID_VALUE;
    *pfn = NULL;
    if (strcmp(symbol, "cuGetProcAddress") == 0) *pfn = (void *)cuGetProcAddress_v2;
    for (size_t i = 0; *pfn == NULL && i < sizeof g_entries / sizeof g_entries[0]; i++)
        if (strcmp(symbol, g_entries[i].name) == 0) *pfn = g_entries[i].fn;
    if (*pfn && hidden(symbol)) *pfn = NULL; /* an older driver without this entry point */
    if (g_log == NULL) g_log = getenv("FAKE_CUDA_LOG_PROCS");
    if (g_log && g_log[0]) {
        FILE *f = fopen(g_log, "a");
        if (f) { fprintf(f, "%s %d %s\n", symbol, version, *pfn ? "ok" : "missing"); fclose(f); }
    }
    if (status) *status = *pfn ? 0 : 1; /* CU_GET_PROC_ADDRESS_SUCCESS / SYMBOL_NOT_FOUND */
    return *pfn ? OK : E_NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
