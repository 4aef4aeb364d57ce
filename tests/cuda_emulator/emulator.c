/*
 * An emulated CUDA driver: a TEST DOUBLE for libcuda.so.1, used by aioep's own tests.
 *
 * It is not a GPU and not a product target: the real NVIDIA driver is. It exists so that
 * the CUDA backend (backends/cuda) runs its GPU tests on every CI machine, with real
 * asynchrony, and fails them for the reasons a GPU would. It is STRICT where the real
 * driver crashes, hangs or blocks (README.md, "Strict rules"; each rule is implemented where
 * its comment says "rule N"):
 *
 *   1. cuMemFree / cuMemFreeHost / cuMemHostUnregister / cuCtxSynchronize / the last
 *      cuDevicePrimaryCtxRelease wait until every stream of the context is idle and hold the
 *      context meanwhile: other threads' calls on it wait behind them (sync_begin);
 *   2. a pageable cuMemcpyAsync larger than pageable_staging_limit (4 MiB) returns only once
 *      its stream has done it; smaller ones are staged (copy_on);
 *   3. a handle (context, stream, event, device or pinned memory) used after it or its
 *      context was destroyed aborts: handle values are never reused and freed memory stays
 *      a tombstone (handle_use, check_ptr);
 *   4. a driver call from a host function aborts (hostfn_calls);
 *   5. a thread marked as an event loop (cuemu_mark_loop_thread) that would wait in the
 *      driver aborts, by the kind of call, never by timing (loop_waits, wait_behind_sync).
 *   A misuse prints one line naming the call and aborts (abort_on_misuse = 0: a violation).
 *
 * What it emulates:
 *
 *   - every stream is a native worker thread that runs its queue strictly in order;
 *   - events record a point in a stream; query / synchronize / elapsed time; a
 *     cuStreamWaitEvent blocks the waiting stream's thread (never the host);
 *   - host functions (cuLaunchHostFunc) run on one callback thread per context, as the
 *     driver's do; that thread never touches Python, so it never takes the GIL;
 *   - cuStreamWaitValue32 / cuStreamWriteValue32 on device or mapped pinned memory;
 *   - device memory lives in its own address range (0x3000'0000'0000 + device << 40),
 *     never reused and never mapped at the host address, so the host cannot read it by
 *     accident and work that touches freed memory faults (a sticky
 *     CUDA_ERROR_ILLEGAL_ADDRESS, counted as a violation);
 *   - pinned memory (cuMemHostAlloc, cuMemHostRegister, with their flags) and pageable
 *     memory: a small pageable host-to-device copy stages the source on the calling thread,
 *     a large one and a pageable device-to-host copy block the caller until the stream has
 *     done it;
 *   - error codes for bad handles, freed pointers and out-of-memory, a configurable memory
 *     limit, a bandwidth and latency model, and fault injection.
 *
 * cuda-bindings finds every driver function through cuGetProcAddress_v2, so that is what
 * this library serves; it also exports each function under the driver's own symbol name
 * (aioep_cuda calls cuLaunchHostFunc through ctypes). Functions it does not implement are
 * "not found", which cuda-bindings reports as FunctionNotFoundError.
 *
 * Test-control functions (cuemu_*) are exported for the Python helper
 * (tests/cuda_emulator/__init__.py): cuemu_set / cuemu_get for configuration and
 * statistics, cuemu_fail_call for fault injection, cuemu_last_violation for messages.
 * Configuration also comes from the environment at load time (CUEMU_DEVICES,
 * CUEMU_MEMORY_LIMIT, CUEMU_PINNED_LIMIT, CUEMU_BANDWIDTH, CUEMU_LATENCY_US).
 *
 * Build: cc -O2 -shared -fPIC -pthread -fvisibility=hidden -Wl,-soname,libcuda.so.1
 *        -o libcuda.so.1 emulator.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUmemoryPool;
typedef void (*CUhostFn)(void *);
typedef struct {
    char bytes[16];
} CUuuid;
typedef struct {
    int type;
    int id;
} CUmemLocation;
typedef struct {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
    CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705,
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

#define MAX_DEVICES 8
#define DEVICE_SPACE 0x300000000000ULL
#define DEVICE_SPAN (1ULL << 40)

/* -- configuration and statistics ------------------------------------------------------- */
static struct {
    long long devices;
    long long memory_limit;
    long long pinned_limit;
    long long bandwidth;  /* bytes per second, 0: unlimited */
    long long latency_ns; /* per copy */
    long long stream_mem_ops;
    long long driver_version;
    long long watch_tid; /* the thread whose blocking calls are counted (e.g. an event loop) */
    long long lose_after_copies; /* -1: never */
    long long unmap_pinned_on_reset;
    long long host_wait_limit_ns; /* a host wait longer than this fails (a test hangs no more) */
    long long pageable_staging_limit; /* larger pageable H2D copies wait for their stream */
    long long abort_on_misuse;        /* 1: a misuse aborts the process; 0: a violation */
    long long strict_loop_sync;       /* a synchronising call with work in flight while a loop
                                         thread is marked is a misuse */
    long long watch_is_loop;          /* the watch_tid thread counts as a marked loop thread */
} cfg;

static struct {
    long long copies, bytes_copied, violations, hostfns, pageable_copies, watched_pageable,
        watched_blocking, watched_blocking_ns, streams_created, streams_live, threads_live,
        events_created, device_allocs, pinned_allocs, abandoned_ops, sticky_errors, wait_values,
        write_values, max_queue, misuses, sync_calls, sync_waits, sync_waiting, host_waiting,
        loop_threads;
} st;

static char g_violation[512];

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_progress; /* broadcast whenever any work completes */
static int g_initialized;

static long long env_ll(const char *name, long long dflt) {
    const char *v = getenv(name);
    if (!v || !*v)
        return dflt;
    return strtoll(v, NULL, 0);
}

static void set_defaults(void) {
    cfg.devices = env_ll("CUEMU_DEVICES", 1);
    if (cfg.devices < 0)
        cfg.devices = 0;
    if (cfg.devices > MAX_DEVICES)
        cfg.devices = MAX_DEVICES;
    cfg.memory_limit = env_ll("CUEMU_MEMORY_LIMIT", 512LL << 20);
    cfg.pinned_limit = env_ll("CUEMU_PINNED_LIMIT", 1LL << 30);
    cfg.bandwidth = env_ll("CUEMU_BANDWIDTH", 0);
    cfg.latency_ns = env_ll("CUEMU_LATENCY_US", 0) * 1000;
    cfg.stream_mem_ops = 1;
    cfg.driver_version = env_ll("CUEMU_DRIVER_VERSION", 13000);
    cfg.watch_tid = 0;
    cfg.lose_after_copies = -1;
    cfg.unmap_pinned_on_reset = 1;
    cfg.host_wait_limit_ns = env_ll("CUEMU_HOST_WAIT_LIMIT_S", 60) * 1000000000LL;
    cfg.pageable_staging_limit = env_ll("CUEMU_PAGEABLE_STAGING_LIMIT", 4LL << 20);
    cfg.abort_on_misuse = env_ll("CUEMU_ABORT_ON_MISUSE", 1);
    cfg.strict_loop_sync = env_ll("CUEMU_STRICT_LOOP_SYNC", 1);
    cfg.watch_is_loop = env_ll("CUEMU_WATCH_IS_LOOP", 0);
}

__attribute__((constructor)) static void emulator_init(void) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&g_progress, &a);
    set_defaults();
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void sleep_ns(uint64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
    }
}

/* Wait on a condition variable for at most `ns` (lock held). */
static void cond_wait_ns(pthread_cond_t *cv, uint64_t ns) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t t = (uint64_t)ts.tv_nsec + ns;
    ts.tv_sec += (time_t)(t / 1000000000ULL);
    ts.tv_nsec = (long)(t % 1000000000ULL);
    pthread_cond_timedwait(cv, &g_mu, &ts);
}

static void violation(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_violation, sizeof g_violation, fmt, ap);
    va_end(ap);
    st.violations++;
}

static long my_tid(void) { return (long)syscall(SYS_gettid); }

/* -- misuse: what the real driver answers with undefined behaviour, a crash or a hang ---- */
/* A misuse (a handle used after it or its context was destroyed, a driver call from a host
 * function, a marked event-loop thread about to wait in the driver) prints one line naming
 * the call to stderr and aborts the process (the default: the real driver crashes or hangs
 * there, so a test must not go on), or, with abort_on_misuse = 0, is recorded as a violation
 * and the call fails (or, for the loop rules, goes on). */
static void say_misuse(const char *prefix, const char *msg, int fatal) {
    char line[sizeof g_violation + 64];
    int n = snprintf(line, sizeof line, "aioep CUDA emulator: %s: %s\n", prefix, msg);
    if (n > (int)sizeof line - 1)
        n = (int)sizeof line - 1;
    if (write(2, line, (size_t)n) < 0) {
    }
    /* pytest captures fd 2 during a test (and an abort loses the capture): a copy of the
     * real stderr taken before, named "pid:fd" (tests/conftest.py), gets a fatal line too */
    const char *copy = fatal ? getenv("CUEMU_STDERR_FD") : NULL;
    long pid = 0, fd = -1;
    if (copy && sscanf(copy, "%ld:%ld", &pid, &fd) == 2 && pid == (long)getpid() && fd > 2)
        if (write((int)fd, line, (size_t)n) < 0) {
        }
}

static void misuse(const char *fmt, ...) {
    char msg[sizeof g_violation];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    st.misuses++;
    if (cfg.abort_on_misuse) {
        say_misuse("MISUSE", msg, 1);
        abort();
    }
    say_misuse("MISUSE (recorded, abort_on_misuse=0)", msg, 0); /* pytest shows it if it fails */
    violation("MISUSE: %s", msg);
}

/* Threads marked as an event loop (cuemu_mark_loop_thread): they must never wait in the driver. */
#define MAX_LOOP_THREADS 16
static long g_loop_tids[MAX_LOOP_THREADS];

/* watch_is_loop (CUEMU_WATCH_IS_LOOP=1): the watch_tid thread counts as marked too, so a
 * test suite that watches its event loop (tests/backends/cuda/test_cuda.py) runs under rule 5 unchanged. */
static int is_loop_thread(long tid) {
    if (cfg.watch_is_loop && cfg.watch_tid && tid == cfg.watch_tid)
        return 1;
    for (int i = 0; i < MAX_LOOP_THREADS; i++)
        if (g_loop_tids[i] == tid)
            return 1;
    return 0;
}

static int any_loop_thread(void) {
    return st.loop_threads || (cfg.watch_is_loop && cfg.watch_tid);
}

/* Rule 5: a call from a marked event-loop thread that has to wait for the device (lock held). */
static void loop_waits(const char *call, const char *why) {
    long me = my_tid();
    if (cfg.watch_tid && me == cfg.watch_tid)
        st.watched_blocking++; /* the watched thread made a call that waits (or would) */
    if (any_loop_thread() && is_loop_thread(me))
        misuse("%s called on the marked event-loop thread (tid %ld) waits for the device: %s",
               call, me, why);
}

/* Rule 4: the thread that runs host functions must not call the driver. */
static __thread int tls_hostfn;
#define CUDA_ERROR_NOT_PERMITTED_ 800

static int hostfn_calls(const char *call) {
    if (!tls_hostfn)
        return 0;
    pthread_mutex_lock(&g_mu);
    misuse("%s called from a host function (cuLaunchHostFunc): host functions must not call "
           "the CUDA driver (the real driver deadlocks or fails)",
           call);
    pthread_mutex_unlock(&g_mu);
    return 1;
}

/* -- fault injection -------------------------------------------------------------------- */
typedef struct {
    char name[64];
    long long countdown; /* calls to let through before failing */
    long long times;     /* failures left (-1: forever) */
    CUresult code;
} fault_t;
static fault_t g_faults[16];
static int g_nfaults;

static CUresult inject(const char *name) {
    if (!g_nfaults)
        return CUDA_SUCCESS;
    CUresult out = CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < g_nfaults; i++) {
        fault_t *f = &g_faults[i];
        if (f->times == 0 || strcmp(f->name, name) != 0)
            continue;
        if (f->countdown > 0) {
            f->countdown--;
            continue;
        }
        out = f->code;
        if (f->times > 0)
            f->times--;
        break;
    }
    pthread_mutex_unlock(&g_mu);
    return out;
}

#define ENTER(name)                                                                           \
    do {                                                                                      \
        if (hostfn_calls(name))                                                               \
            return CUDA_ERROR_NOT_PERMITTED_;                                                 \
        if (!g_initialized)                                                                   \
            return CUDA_ERROR_NOT_INITIALIZED;                                                \
        CUresult inj_ = inject(name);                                                         \
        if (inj_)                                                                             \
            return inj_;                                                                      \
    } while (0)

/* -- handles ---------------------------------------------------------------------------- */
/* A handle is a non-canonical address (bit 62 set): never dereferenceable. Handle values are
 * NEVER reused (the real driver does reuse its pointers, which is exactly why a stale handle
 * there may name a new object or crash): a destroyed handle stays a tombstone that says why
 * it died, so any later use of it is caught (rule 3) however many objects were made since. */
enum { K_FREE = 0, K_CTX = 1, K_STREAM = 2, K_EVENT = 3, K_POOL = 4 };
static const char *const k_names[] = {"?", "context", "stream", "event", "memory pool"};
typedef struct {
    int kind;
    int dead;
    const char *why; /* a static string: how it died */
    void *obj;
} slot_t;
static slot_t *g_slots;
static uint32_t g_nslots, g_cap;

static uint64_t handle_new(int kind, void *obj) {
    if (g_nslots == g_cap) {
        g_cap = g_cap ? g_cap * 2 : 256;
        g_slots = realloc(g_slots, g_cap * sizeof *g_slots);
    }
    uint32_t s = g_nslots++;
    g_slots[s].kind = kind;
    g_slots[s].dead = 0;
    g_slots[s].why = NULL;
    g_slots[s].obj = obj;
    return (1ULL << 62) | ((uint64_t)kind << 48) | ((uint64_t)(s + 1) << 4);
}

static slot_t *handle_slot(uint64_t h, int kind) {
    if ((h >> 62) != 1 || ((h >> 48) & 0x3FFF) != (uint64_t)kind || (h & 0xF))
        return NULL;
    uint64_t s = ((h >> 4) & 0xFFFFFFFFULL) - 1;
    if (s >= g_nslots || g_slots[s].kind != kind)
        return NULL;
    return &g_slots[s];
}

/* The live object a handle names, or NULL: never issued (garbage), or dead. A dead one is a
 * misuse naming `call` (rule 3); `call` NULL: just look (internal). (lock held) */
static void *handle_use(const char *call, uint64_t h, int kind) {
    slot_t *sl = handle_slot(h, kind);
    if (!sl)
        return NULL;
    if (sl->dead) {
        if (call)
            misuse("%s: %s %#llx used after it was destroyed (%s)", call, k_names[kind],
                   (unsigned long long)h, sl->why);
        return NULL;
    }
    return sl->obj;
}

static void *handle_get(uint64_t h, int kind) { return handle_use(NULL, h, kind); }

static void handle_kill(uint64_t h, const char *why) {
    uint64_t s = ((h >> 4) & 0xFFFFFFFFULL) - 1;
    if (!h || s >= g_nslots || g_slots[s].dead)
        return;
    g_slots[s].dead = 1;
    g_slots[s].why = why;
}

/* -- objects ---------------------------------------------------------------------------- */
struct ctx;
struct stream;
struct event;

enum {
    OP_COPY,
    OP_STAGED,
    OP_MEMSET32,
    OP_MEMSET8,
    OP_RECORD,
    OP_WAIT_EVENT,
    OP_HOSTFN,
    OP_WAIT_VALUE,
    OP_WRITE_VALUE,
    OP_FREE,
};

typedef struct op {
    int kind;
    uint64_t seq;
    struct op *next;
    CUdeviceptr dst, src;
    size_t n;
    char *staging;
    unsigned value, flags;
    struct event *ev;
    uint64_t ev_gen;
    struct stream *wait_stream;
    uint64_t wait_seq;
    CUhostFn fn;
    void *arg;
    int done;
    struct op *cb_next;
} op_t;

typedef struct stream {
    uint64_t handle;
    struct ctx *ctx;
    unsigned gen; /* the context generation it belongs to */
    unsigned flags;
    int destroyed, abandon, legacy, running;
    op_t *head, *tail;
    uint64_t enqueued, completed;
    pthread_cond_t cv;
    struct stream *next; /* in the context's list */
} stream_t;

typedef struct event {
    uint64_t handle;
    struct ctx *ctx;
    unsigned gen;
    unsigned flags;
    int destroyed;
    stream_t *stream; /* where the last record was enqueued (NULL: never recorded) */
    uint64_t seq;
    uint64_t rec_gen; /* record generation: only the latest record stamps the time */
    uint64_t t_ns;
    int timed; /* the latest record has executed */
    struct event *next;
} event_t;

typedef struct ctx {
    uint64_t handle;
    int device;
    int active;
    unsigned gen;
    int refs;
    CUresult sticky;
    stream_t *streams;
    stream_t *null_stream;
    op_t *cb_head, *cb_tail;
    pthread_cond_t cb_cv;
    int cb_thread, cb_stop;
    unsigned peer_mask;
    long sync_owner;       /* rule 1: the thread inside a context-synchronising call (0: none) */
    const char *sync_call; /* and which call */
} ctx_t;

typedef struct {
    uint64_t handle;
    int device;
    unsigned long long release_threshold;
    int reuse[4];
} pool_t;

typedef struct device {
    ctx_t ctx;
    pool_t pool;
    long long used;
    long long pool_used;
    uint64_t next_addr;
} device_t;

static device_t g_dev[MAX_DEVICES];
static event_t *g_events;
static long long g_pinned_used;

enum { A_DEVICE = 1, A_PINNED = 2, A_REGISTERED = 3 };
typedef struct alloc {
    uint64_t addr;
    size_t size;
    char *host;
    size_t map_size;
    int kind;
    unsigned flags;
    int device;
    int from_pool;
    struct stream *alloc_stream; /* cuMemAllocAsync: usable once this stream gets here */
    uint64_t alloc_seq;
    ctx_t *ctx;
    int busy;
    int freed;
    int free_enqueued; /* cuMemFreeAsync called: a second free is a misuse */
    struct alloc *next;
} alloc_t;
static alloc_t *g_allocs;

/* Freed device and pinned memory stays a tombstone: device addresses are never reused, and
 * freed pinned memory stays reserved (PROT_NONE), so a freed pointer can never name new
 * memory and every later use of it is caught (rule 3). Sorted by address, disjoint. */
typedef struct {
    uint64_t addr, end;
    const char *why;
} tomb_t;
static tomb_t *g_tombs;
static size_t g_ntombs, g_tomb_cap;

static void tomb_add(uint64_t addr, size_t size, const char *why) {
    if (g_ntombs == g_tomb_cap) {
        g_tomb_cap = g_tomb_cap ? g_tomb_cap * 2 : 256;
        g_tombs = realloc(g_tombs, g_tomb_cap * sizeof *g_tombs);
    }
    size_t lo = 0, hi = g_ntombs;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (g_tombs[mid].addr < addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    memmove(&g_tombs[lo + 1], &g_tombs[lo], (g_ntombs - lo) * sizeof *g_tombs);
    g_tombs[lo].addr = addr;
    g_tombs[lo].end = addr + size;
    g_tombs[lo].why = why;
    g_ntombs++;
}

static const tomb_t *tomb_find(uint64_t p) {
    size_t lo = 0, hi = g_ntombs;
    while (lo < hi) { /* the first tomb that starts after p */
        size_t mid = (lo + hi) / 2;
        if (g_tombs[mid].addr <= p)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo && p < g_tombs[lo - 1].end)
        return &g_tombs[lo - 1];
    return NULL;
}

/* The thread's context stack holds context HANDLES: a context destroyed since it was made
 * current stays destroyed for this thread even after the primary context is retained again
 * (under a new handle). */
static __thread uint64_t tls_stack[64];
static __thread int tls_depth;

static uint64_t current_handle(void) { return tls_depth ? tls_stack[tls_depth - 1] : 0; }

static int wait_behind_sync(ctx_t *c, const char *call);

/* The current context, or why there is none usable (lock held). Waits while another thread is
 * in a context-synchronising call on it (rule 1). Using a current context that has been
 * destroyed is CUDA_ERROR_CONTEXT_IS_DESTROYED, as documented (not undefined). */
static CUresult need_ctx(const char *call, ctx_t **out) {
    for (;;) {
        uint64_t h = current_handle();
        if (!h)
            return CUDA_ERROR_INVALID_CONTEXT;
        slot_t *sl = handle_slot(h, K_CTX);
        if (!sl)
            return CUDA_ERROR_INVALID_CONTEXT;
        if (sl->dead)
            return CUDA_ERROR_CONTEXT_IS_DESTROYED;
        ctx_t *c = sl->obj;
        if (!c->active)
            return CUDA_ERROR_CONTEXT_IS_DESTROYED;
        if (wait_behind_sync(c, call))
            continue;
        if (c->sticky)
            return c->sticky;
        *out = c;
        return CUDA_SUCCESS;
    }
}

static int in_device_space(uint64_t p) {
    return p >= DEVICE_SPACE && p < DEVICE_SPACE + MAX_DEVICES * DEVICE_SPAN;
}

static alloc_t *find_alloc(uint64_t p, size_t n) {
    for (alloc_t *a = g_allocs; a; a = a->next) {
        if (a->freed)
            continue;
        if (p >= a->addr && p < a->addr + a->size) {
            if (n && p + n > a->addr + a->size)
                return NULL;
            return a;
        }
    }
    return NULL;
}

static void release_backing(alloc_t *a) {
    /* unlink and unmap (lock held; a->busy == 0) */
    alloc_t **pp = &g_allocs;
    while (*pp && *pp != a)
        pp = &(*pp)->next;
    if (*pp)
        *pp = a->next;
    if (a->kind == A_DEVICE)
        munmap(a->host, a->map_size);
    else if (a->kind == A_PINNED && a->host) /* keep the range reserved: never reused */
        mmap(a->host, a->map_size, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS |
             MAP_NORESERVE, -1, 0);
    free(a);
}

static void free_alloc(alloc_t *a, const char *why) {
    if (a->freed)
        return;
    a->freed = 1;
    if (a->kind != A_REGISTERED)
        tomb_add(a->addr, a->size, why);
    if (a->kind == A_DEVICE) {
        g_dev[a->device].used -= (long long)a->size;
        if (a->from_pool)
            g_dev[a->device].pool_used -= (long long)a->size;
    } else if (a->kind == A_PINNED) {
        g_pinned_used -= (long long)a->size;
    }
    if (!a->busy)
        release_backing(a);
}

enum { R_BAD = 0, R_DEVICE = 1, R_PINNED = 2, R_PAGEABLE = 3 };
typedef struct {
    int kind;
    char *p;
    alloc_t *a;
} res_t;

static res_t resolve(uint64_t ptr, size_t n) {
    res_t r = {R_BAD, NULL, NULL};
    if (!ptr)
        return r;
    alloc_t *a = find_alloc(ptr, 0);
    if (in_device_space(ptr)) {
        if (a && a->kind == A_DEVICE && ptr + n <= a->addr + a->size) {
            r.kind = R_DEVICE;
            r.p = a->host + (ptr - a->addr);
            r.a = a;
        }
        return r;
    }
    if (a) {
        if (ptr + n > a->addr + a->size)
            return r; /* runs off the end of a pinned range */
        r.kind = R_PINNED;
        r.p = (char *)(uintptr_t)ptr;
        r.a = a;
        return r;
    }
    if (tomb_find(ptr))
        return r; /* freed pinned memory (reserved, unreadable) */
    r.kind = R_PAGEABLE;
    r.p = (char *)(uintptr_t)ptr;
    return r;
}

/* Rule 3 for memory: a pointer a call names that was freed, or whose context was destroyed,
 * is a misuse (the real driver may name new memory there, or crash). Returns 0 then. */
static int check_ptr(const char *call, uint64_t p) {
    if (!p || find_alloc(p, 0))
        return 1;
    const tomb_t *t = tomb_find(p);
    if (t) {
        misuse("%s: %s pointer %#llx used after its memory was freed (%s; allocation %#llx, "
               "%llu bytes)",
               call, in_device_space(p) ? "device" : "pinned host", (unsigned long long)p,
               t->why, (unsigned long long)t->addr, (unsigned long long)(t->end - t->addr));
        return 0;
    }
    return 1;
}

/* -- streams and their worker threads --------------------------------------------------- */
static void *stream_main(void *arg);
static void *callback_main(void *arg);
static void ensure_callback_thread(ctx_t *c);

static stream_t *stream_new(ctx_t *c, unsigned flags, int legacy) {
    stream_t *s = calloc(1, sizeof *s);
    s->ctx = c;
    s->gen = c->gen;
    s->flags = flags;
    s->legacy = legacy;
    pthread_cond_init(&s->cv, NULL);
    s->handle = legacy ? 0 : handle_new(K_STREAM, s);
    s->next = c->streams;
    c->streams = s;
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&at, 256 * 1024);
    s->running = 1;
    st.threads_live++;
    if (pthread_create(&t, &at, stream_main, s) != 0) {
        s->running = 0;
        st.threads_live--;
    }
    pthread_attr_destroy(&at);
    st.streams_created++;
    st.streams_live++;
    return s;
}

/* The stream a handle names: 0 / CU_STREAM_LEGACY (1) / CU_STREAM_PER_THREAD (2) are the
 * current context's default stream (lock held). */
static CUresult get_stream(const char *call, CUstream h, stream_t **out) {
    uint64_t v = (uint64_t)(uintptr_t)h;
    if (v <= 2) {
        ctx_t *c;
        CUresult e = need_ctx(call, &c);
        if (e)
            return e;
        if (!c->null_stream)
            c->null_stream = stream_new(c, 0, 1);
        *out = c->null_stream;
        return CUDA_SUCCESS;
    }
    for (;;) {
        stream_t *s = handle_use(call, v, K_STREAM); /* destroyed: a misuse (rule 3) */
        if (!s || s->destroyed)
            return CUDA_ERROR_INVALID_HANDLE;
        if (!s->ctx->active || s->gen != s->ctx->gen)
            return CUDA_ERROR_CONTEXT_IS_DESTROYED;
        if (wait_behind_sync(s->ctx, call))
            continue; /* the world may have changed: look again */
        if (s->ctx->sticky)
            return s->ctx->sticky;
        *out = s;
        return CUDA_SUCCESS;
    }
}

static op_t *op_new(int kind) {
    op_t *o = calloc(1, sizeof *o);
    o->kind = kind;
    return o;
}

static void enqueue(stream_t *s, op_t *o) {
    o->seq = ++s->enqueued;
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    long long depth = (long long)(s->enqueued - s->completed);
    if (depth > st.max_queue)
        st.max_queue = depth;
    pthread_cond_signal(&s->cv);
}

static int stream_idle(stream_t *s, uint64_t upto) { return s->completed >= upto; }

static void host_wait_expired(const char *what) {
    violation("a host thread waited more than %lld s in %s for work that never finished (a "
              "stream held forever?); the call failed instead of hanging",
              cfg.host_wait_limit_ns / 1000000000LL, what);
}

/* Block the calling thread until `s` has completed work item `upto` (lock held); 0 if the
 * wait gave up after the host wait limit. */
static int wait_stream(stream_t *s, uint64_t upto) {
    if (stream_idle(s, upto))
        return 1;
    uint64_t t0 = now_ns();
    int watched = cfg.watch_tid && my_tid() == cfg.watch_tid, ok = 1;
    st.host_waiting++;
    while (!stream_idle(s, upto)) {
        if (cfg.host_wait_limit_ns > 0 && now_ns() - t0 > (uint64_t)cfg.host_wait_limit_ns) {
            host_wait_expired("a stream or event synchronisation");
            ok = 0;
            break;
        }
        cond_wait_ns(&g_progress, 50000000ULL);
    }
    st.host_waiting--;
    if (watched)
        st.watched_blocking_ns += (long long)(now_ns() - t0);
    return ok;
}

/* Every stream of a context reaches the work enqueued so far (lock held); returns 0 if the
 * wait gave up after `limit_ns` (0: the host wait limit). */
static int wait_ctx(ctx_t *c, uint64_t limit_ns) {
    int n = 0;
    for (stream_t *s = c->streams; s; s = s->next)
        n++;
    if (!limit_ns && cfg.host_wait_limit_ns > 0)
        limit_ns = (uint64_t)cfg.host_wait_limit_ns;
    stream_t **ss = malloc((size_t)(n ? n : 1) * sizeof *ss);
    uint64_t *upto = malloc((size_t)(n ? n : 1) * sizeof *upto);
    int i = 0;
    for (stream_t *s = c->streams; s; s = s->next, i++) {
        ss[i] = s;
        upto[i] = s->enqueued;
    }
    uint64_t start = now_ns();
    int watched = cfg.watch_tid && my_tid() == cfg.watch_tid, blocked = 0, ok = 1;
    st.host_waiting++;
    for (i = 0; i < n; i++) {
        while (!stream_idle(ss[i], upto[i])) {
            blocked = 1;
            if (limit_ns) {
                if (now_ns() - start > limit_ns) {
                    ok = 0;
                    break;
                }
                cond_wait_ns(&g_progress, 10000000ULL);
            } else {
                pthread_cond_wait(&g_progress, &g_mu);
            }
        }
        if (!ok)
            break;
    }
    st.host_waiting--;
    if (watched && blocked)
        st.watched_blocking_ns += (long long)(now_ns() - start);
    free(ss);
    free(upto);
    return ok;
}

/* -- rule 1: context-synchronising calls hold the context -------------------------------- */
/* cuMemFree, cuMemFreeHost, cuMemHostUnregister, cuCtxSynchronize and the last
 * cuDevicePrimaryCtxRelease (which destroys the context) wait until every stream of the
 * context is idle, and MEANWHILE every other driver call on that context, from any other
 * thread, waits for them to finish: the context's lock is held for the whole call. On a real
 * GPU, cuMemFreeHost waited for a stream held on the device, and cuStreamCreate from another
 * thread waited behind it; that is how a free thread froze the event loop in cuEventRecord.
 *
 * A call waits here (lock held) when another thread is inside such a call on `c`; returns 1
 * if it waited (the caller looks its handles up again). From a marked event-loop thread this
 * wait is a misuse (rule 5). */
static int wait_behind_sync(ctx_t *c, const char *call) {
    long me = my_tid();
    if (!c || !c->sync_owner || c->sync_owner == me)
        return 0;
    if (any_loop_thread() && is_loop_thread(me))
        misuse("%s called on the marked event-loop thread (tid %ld) waits behind %s on thread "
               "%ld, which synchronises device %d's context (until every stream is idle) and "
               "holds the context meanwhile",
               call, me, c->sync_call ? c->sync_call : "?", c->sync_owner, c->device);
    uint64_t t0 = now_ns();
    if (cfg.watch_tid && me == cfg.watch_tid)
        st.watched_blocking++;
    st.sync_waits++;
    st.sync_waiting++;
    while (c->sync_owner && c->sync_owner != me)
        cond_wait_ns(&g_progress, 50000000ULL);
    st.sync_waiting--;
    if (cfg.watch_tid && me == cfg.watch_tid)
        st.watched_blocking_ns += (long long)(now_ns() - t0);
    return 1;
}

static int work_in_flight(ctx_t *c) {
    for (stream_t *s = c->streams; s; s = s->next)
        if (!stream_idle(s, s->enqueued))
            return 1;
    return 0;
}

/* Enter a context-synchronising call on `c` (lock held): wait for another thread's to end,
 * then hold the context until sync_end. `check`: apply the loop rules (0 for test control). */
static void sync_begin(ctx_t *c, const char *call, int check) {
    long me = my_tid();
    if (check)
        loop_waits(call, "it synchronises the context (waits until every stream is idle)");
    while (wait_behind_sync(c, call)) {
    }
    c->sync_owner = me;
    c->sync_call = call;
    st.sync_calls++;
    if (check && cfg.strict_loop_sync && any_loop_thread() && !is_loop_thread(me) &&
        !c->sticky && work_in_flight(c))
        misuse("%s on thread %ld synchronises device %d's context while work is in flight and "
               "an event-loop thread is marked: until that work is done, every driver call on "
               "this context, the loop's included, waits behind it (a real GPU froze the event "
               "loop in cuEventRecord this way)",
               call, me, c->device);
}

static void sync_end(ctx_t *c) {
    c->sync_owner = 0;
    c->sync_call = NULL;
    pthread_cond_broadcast(&g_progress);
}

static void throttle(size_t n) {
    uint64_t ns = (uint64_t)cfg.latency_ns;
    if (cfg.bandwidth > 0)
        ns += (uint64_t)((double)n * 1e9 / (double)cfg.bandwidth);
    if (ns)
        sleep_ns(ns);
}

/* A sticky error breaks the context: as on the real driver, its queued work is dropped at
 * once (run_op skips it), so streams waiting on a value are woken now rather than at their
 * next poll, and a synchronising call finds nothing in flight. */
static void set_sticky(ctx_t *c, CUresult e) {
    if (!c->sticky) {
        c->sticky = e;
        st.sticky_errors++;
        pthread_cond_broadcast(&g_progress);
    }
}

static int value_ok(uint32_t v, uint32_t want, unsigned flags) {
    switch (flags & 0xF) {
    case 0: /* GEQ, with wrap-around */
        return (int32_t)(v - want) >= 0;
    case 1: /* EQ */
        return v == want;
    case 2: /* AND */
        return (v & want) != 0;
    case 3: /* NOR */
        return ~(v | want) != 0;
    }
    return 1;
}

/* Memory from cuMemAllocAsync on stream A is usable on another stream only once A has got
 * to the allocation (the other stream waited for it): reaching it earlier is a missing
 * dependency, which on a GPU reads or writes memory the pool may still hand elsewhere. */
static void check_alloc_order(stream_t *s, alloc_t *a, CUdeviceptr p) {
    if (!a || !a->alloc_stream || a->alloc_stream == s)
        return;
    if (!stream_idle(a->alloc_stream, a->alloc_seq))
        violation("stream %#llx used %#llx before stream %#llx got to its stream-ordered "
                  "allocation (cuMemAllocAsync): a missing wait",
                  (unsigned long long)s->handle, (unsigned long long)p,
                  (unsigned long long)a->alloc_stream->handle);
}

static void run_op(stream_t *s, op_t *o) {
    /* lock held on entry and exit; may drop it */
    ctx_t *c = s->ctx;
    if (s->abandon || c->sticky) {
        if (s->abandon)
            st.abandoned_ops++;
        if (o->staging)
            free(o->staging);
        o->staging = NULL;
        return;
    }
    switch (o->kind) {
    case OP_COPY:
    case OP_STAGED: {
        res_t d = resolve(o->dst, o->n);
        res_t r = o->kind == OP_STAGED ? (res_t){R_PAGEABLE, o->staging, NULL}
                                       : resolve(o->src, o->n);
        if (d.kind == R_BAD || r.kind == R_BAD) {
            violation("stream %#llx: a copy of %zu bytes from %#llx to %#llx touched memory "
                      "that is not allocated (freed before the stream reached the copy?)",
                      (unsigned long long)s->handle, o->n, (unsigned long long)o->src,
                      (unsigned long long)o->dst);
            set_sticky(c, CUDA_ERROR_ILLEGAL_ADDRESS);
            break;
        }
        check_alloc_order(s, d.a, o->dst);
        check_alloc_order(s, r.a, o->src);
        if (cfg.lose_after_copies >= 0 && st.copies >= cfg.lose_after_copies) {
            set_sticky(c, CUDA_ERROR_ILLEGAL_ADDRESS);
            break;
        }
        st.copies++;
        st.bytes_copied += (long long)o->n;
        if (d.a)
            d.a->busy++;
        if (r.a)
            r.a->busy++;
        pthread_mutex_unlock(&g_mu);
        throttle(o->n);
        memmove(d.p, r.p, o->n);
        pthread_mutex_lock(&g_mu);
        if (d.a && --d.a->busy == 0 && d.a->freed)
            release_backing(d.a);
        if (r.a && --r.a->busy == 0 && r.a->freed)
            release_backing(r.a);
        break;
    }
    case OP_MEMSET32:
    case OP_MEMSET8: {
        size_t bytes = o->kind == OP_MEMSET32 ? o->n * 4 : o->n;
        res_t d = resolve(o->dst, bytes);
        if (d.kind == R_BAD) {
            violation("stream %#llx: a memset of %zu bytes at %#llx touched memory that is not "
                      "allocated",
                      (unsigned long long)s->handle, bytes, (unsigned long long)o->dst);
            set_sticky(c, CUDA_ERROR_ILLEGAL_ADDRESS);
            break;
        }
        check_alloc_order(s, d.a, o->dst);
        if (o->kind == OP_MEMSET32) {
            uint32_t *w = (uint32_t *)(void *)d.p;
            for (size_t i = 0; i < o->n; i++)
                __atomic_store_n(&w[i], o->value, __ATOMIC_SEQ_CST);
        } else {
            memset(d.p, (int)(o->value & 0xFF), o->n);
        }
        break;
    }
    case OP_RECORD:
        if (o->ev->rec_gen == o->ev_gen) {
            o->ev->t_ns = now_ns();
            o->ev->timed = 1;
        }
        break;
    case OP_WAIT_EVENT:
        while (!s->abandon && !stream_idle(o->wait_stream, o->wait_seq))
            pthread_cond_wait(&g_progress, &g_mu);
        break;
    case OP_HOSTFN:
        st.hostfns++;
        ensure_callback_thread(c);
        o->done = 0;
        o->cb_next = NULL;
        if (c->cb_tail)
            c->cb_tail->cb_next = o;
        else
            c->cb_head = o;
        c->cb_tail = o;
        pthread_cond_signal(&c->cb_cv);
        while (!o->done && !s->abandon)
            pthread_cond_wait(&g_progress, &g_mu);
        if (!o->done) { /* abandoned before it ran: take it off the callback queue */
            op_t **pp = &c->cb_head, *prev = NULL;
            while (*pp && *pp != o) {
                prev = *pp;
                pp = &(*pp)->cb_next;
            }
            if (*pp) {
                *pp = o->cb_next;
                if (c->cb_tail == o)
                    c->cb_tail = prev;
            }
            break;
        }
        while (o->done == 1) /* running: the callback thread still uses `o` */
            pthread_cond_wait(&g_progress, &g_mu);
        break;
    case OP_WAIT_VALUE: {
        st.wait_values++;
        for (;;) {
            res_t d = resolve(o->dst, 4);
            if (d.kind == R_BAD || d.kind == R_PAGEABLE) {
                violation("stream %#llx: cuStreamWaitValue32 on %#llx, which is not allocated "
                          "(freed while the stream waited?)",
                          (unsigned long long)s->handle, (unsigned long long)o->dst);
                set_sticky(c, CUDA_ERROR_ILLEGAL_ADDRESS);
                break;
            }
            uint32_t v = __atomic_load_n((uint32_t *)(void *)d.p, __ATOMIC_SEQ_CST);
            if (value_ok(v, o->value, o->flags) || s->abandon || c->sticky)
                break;
            /* device writes broadcast g_progress; host writes to mapped memory are polled */
            cond_wait_ns(&g_progress, d.kind == R_PINNED ? 200000ULL : 20000000ULL);
        }
        break;
    }
    case OP_WRITE_VALUE: {
        st.write_values++;
        res_t d = resolve(o->dst, 4);
        if (d.kind == R_BAD || d.kind == R_PAGEABLE) {
            violation("stream %#llx: cuStreamWriteValue32 to %#llx, which is not allocated",
                      (unsigned long long)s->handle, (unsigned long long)o->dst);
            set_sticky(c, CUDA_ERROR_ILLEGAL_ADDRESS);
            break;
        }
        __atomic_store_n((uint32_t *)(void *)d.p, o->value, __ATOMIC_SEQ_CST);
        break;
    }
    case OP_FREE: {
        alloc_t *a = find_alloc(o->dst, 0);
        if (!a || a->kind != A_DEVICE || a->addr != o->dst) {
            violation("stream %#llx: cuMemFreeAsync(%#llx) reached a pointer that is no longer "
                      "allocated (freed twice?)",
                      (unsigned long long)s->handle, (unsigned long long)o->dst);
            set_sticky(c, CUDA_ERROR_ILLEGAL_ADDRESS);
            break;
        }
        if (a->busy)
            violation("stream %#llx: cuMemFreeAsync(%#llx) ran while another stream was copying "
                      "to or from it (a missing cross-stream dependency)",
                      (unsigned long long)s->handle, (unsigned long long)o->dst);
        free_alloc(a, "freed by cuMemFreeAsync when its stream reached the free");
        break;
    }
    }
    if (o->staging) {
        free(o->staging);
        o->staging = NULL;
    }
}

static void unlink_stream(stream_t *s) {
    ctx_t *c = s->ctx;
    stream_t **pp = &c->streams;
    while (*pp && *pp != s)
        pp = &(*pp)->next;
    if (*pp)
        *pp = s->next;
}

static void *stream_main(void *arg) {
    stream_t *s = arg;
    pthread_mutex_lock(&g_mu);
    for (;;) {
        while (!s->head && !s->destroyed)
            pthread_cond_wait(&s->cv, &g_mu);
        if (!s->head)
            break;
        op_t *o = s->head;
        run_op(s, o);
        s->head = o->next;
        if (!s->head)
            s->tail = NULL;
        s->completed = o->seq;
        free(o);
        pthread_cond_broadcast(&g_progress);
    }
    s->running = 0;
    st.threads_live--;
    st.streams_live--;
    unlink_stream(s);
    pthread_cond_broadcast(&g_progress);
    pthread_mutex_unlock(&g_mu);
    /* the stream struct is never freed: events and waits may still point at it */
    return NULL;
}

static void *callback_main(void *arg) {
    ctx_t *c = arg;
    tls_hostfn = 1; /* this thread runs host functions only: a driver call here is a misuse */
    pthread_mutex_lock(&g_mu);
    for (;;) {
        while (!c->cb_head && !c->cb_stop)
            pthread_cond_wait(&c->cb_cv, &g_mu);
        if (!c->cb_head)
            break;
        op_t *o = c->cb_head;
        c->cb_head = o->cb_next;
        if (!c->cb_head)
            c->cb_tail = NULL;
        o->done = 1;
        CUhostFn fn = o->fn;
        void *a = o->arg;
        pthread_mutex_unlock(&g_mu);
        fn(a); /* a C function on a native thread: no Python, no GIL */
        pthread_mutex_lock(&g_mu);
        o->done = 2;
        pthread_cond_broadcast(&g_progress);
    }
    c->cb_thread = 0;
    st.threads_live--;
    pthread_cond_broadcast(&g_progress);
    pthread_mutex_unlock(&g_mu);
    return NULL;
}

static void ensure_callback_thread(ctx_t *c) {
    if (c->cb_thread)
        return;
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&at, 256 * 1024);
    c->cb_stop = 0;
    if (pthread_create(&t, &at, callback_main, c) == 0) {
        c->cb_thread = 1;
        st.threads_live++;
    }
    pthread_attr_destroy(&at);
}

/* -- initialisation, devices ------------------------------------------------------------ */
EXPORT CUresult cuInit(unsigned int flags) {
    if (hostfn_calls("cuInit"))
        return CUDA_ERROR_NOT_PERMITTED_;
    CUresult inj = inject("cuInit");
    if (inj)
        return inj;
    if (flags)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    CUresult e = cfg.devices > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
    if (!e && !g_initialized) {
        for (int d = 0; d < MAX_DEVICES; d++) {
            g_dev[d].ctx.device = d;
            pthread_cond_init(&g_dev[d].ctx.cb_cv, NULL);
            g_dev[d].next_addr = DEVICE_SPACE + (uint64_t)d * DEVICE_SPAN + 0x200000;
            g_dev[d].pool.device = d;
            g_dev[d].pool.release_threshold = 0;
        }
        g_initialized = 1;
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuDriverGetVersion(int *v) {
    if (hostfn_calls("cuDriverGetVersion"))
        return CUDA_ERROR_NOT_PERMITTED_;
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    *v = (int)cfg.driver_version;
    return CUDA_SUCCESS;
}

static int valid_device(CUdevice d) { return d >= 0 && d < cfg.devices; }

EXPORT CUresult cuDeviceGetCount(int *count) {
    ENTER("cuDeviceGetCount");
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = (int)cfg.devices;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    ENTER("cuDeviceGet");
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    ENTER("cuDeviceGetName");
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "aioep CUDA driver emulator (test double) #%d", dev);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    ENTER("cuDeviceGetUuid");
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    static const char base[16] = {(char)0xe3, 0x70, 0x1a, (char)0xce, 0x00, 0x00, 0x4e, 0x30,
                                  (char)0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
    memcpy(uuid->bytes, base, 16);
    uuid->bytes[15] = (char)dev;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid(uuid, dev); }

EXPORT CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice dev) {
    ENTER("cuDeviceGetPCIBusId");
    if (!bus || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(bus, (size_t)len, "00000000:%02X:00.0", 0xE0 + dev);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    ENTER("cuDeviceTotalMem");
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)cfg.memory_limit;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    ENTER("cuDeviceGetAttribute");
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    switch (attrib) {
    case 1: *pi = 1024; break;                       /* MAX_THREADS_PER_BLOCK */
    case 10: *pi = 32; break;                        /* WARP_SIZE */
    case 13: *pi = 1000000; break;                   /* CLOCK_RATE (kHz) */
    case 16: *pi = 4; break;                         /* MULTIPROCESSOR_COUNT */
    case 18: *pi = 0; break;                         /* INTEGRATED */
    case 19: *pi = 1; break;                         /* CAN_MAP_HOST_MEMORY */
    case 33: *pi = 0xE0 + dev; break;                /* PCI_BUS_ID */
    case 34: *pi = 0; break;                         /* PCI_DEVICE_ID */
    case 40: *pi = 2; break;                         /* ASYNC_ENGINE_COUNT */
    case 41: *pi = 1; break;                         /* UNIFIED_ADDRESSING */
    case 50: *pi = 0; break;                         /* PCI_DOMAIN_ID */
    case 75: *pi = 9; break;                         /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *pi = 0; break;                         /* COMPUTE_CAPABILITY_MINOR */
    case 88: *pi = 0; break;                         /* PAGEABLE_MEMORY_ACCESS */
    case 89: *pi = 0; break;                         /* CONCURRENT_MANAGED_ACCESS */
    case 91: *pi = 1; break;                         /* CAN_USE_HOST_POINTER_FOR_REGISTERED */
    case 92: *pi = cfg.stream_mem_ops ? 1 : 0; break; /* CAN_USE_STREAM_MEM_OPS_V1 */
    case 99: *pi = 1; break;                         /* HOST_REGISTER_SUPPORTED */
    case 113: *pi = 1; break;                        /* READ_ONLY_HOST_REGISTER_SUPPORTED */
    case 115: *pi = 1; break;                        /* MEMORY_POOLS_SUPPORTED */
    default: *pi = 0; break;
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
    ENTER("cuDeviceCanAccessPeer");
    if (!can)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev) || !valid_device(peer))
        return CUDA_ERROR_INVALID_DEVICE;
    *can = dev != peer;
    return CUDA_SUCCESS;
}

/* -- contexts --------------------------------------------------------------------------- */
/* A primary context gets a NEW handle each time it is retained after being destroyed, and
 * everything made in it (streams, events, memory) dies with it: using any of it afterwards
 * is a misuse (rule 3), even after the context was retained again. On a real GPU an event
 * destroyed in a garbage collection after its context was released, while the next test had
 * retained the primary context again, crashed the process. */
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRetain");
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    ctx_t *c = &g_dev[dev].ctx;
    while (wait_behind_sync(c, "cuDevicePrimaryCtxRetain")) {
    }
    if (!c->active) {
        c->handle = handle_new(K_CTX, c);
        c->active = 1;
        c->sticky = 0;
        c->peer_mask = 0;
    }
    c->refs++;
    *pctx = (CUcontext)(uintptr_t)c->handle;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* The primary context's last reference is gone: it is destroyed with everything in it (lock
 * held, the caller holds the context: sync_begin). `why` says by what (a static string). */
static void ctx_reset(ctx_t *c, const char *why) {
    if (!wait_ctx(c, 5000000000ULL))
        violation("device %d: its primary context was released while work was still pending "
                  "after 5 s (a stream blocked forever?); the work was abandoned",
                  c->device);
    for (stream_t *s = c->streams; s; s = s->next) {
        if (!s->legacy && !s->destroyed)
            handle_kill(s->handle, why);
        s->destroyed = 1;
        s->abandon = 1;
        pthread_cond_signal(&s->cv);
    }
    c->null_stream = NULL;
    c->cb_stop = 1;
    pthread_cond_signal(&c->cb_cv);
    for (event_t *e = g_events; e; e = e->next) {
        if (e->ctx == c && e->gen == c->gen && !e->destroyed) {
            e->destroyed = 1;
            handle_kill(e->handle, why);
        }
    }
    for (alloc_t *a = g_allocs, *next; a; a = next) {
        next = a->next;
        if (a->freed || a->ctx != c)
            continue;
        if (a->kind == A_PINNED && !cfg.unmap_pinned_on_reset)
            a->host = NULL; /* leave it mapped (and leaked) */
        free_alloc(a, why);
    }
    handle_kill(c->handle, why);
    c->handle = 0;
    c->active = 0;
    c->gen++;
    c->sticky = 0;
    c->peer_mask = 0;
    pthread_cond_broadcast(&g_progress);
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRelease");
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    ctx_t *c = &g_dev[dev].ctx;
    CUresult e = CUDA_SUCCESS;
    while (wait_behind_sync(c, "cuDevicePrimaryCtxRelease")) {
    }
    if (c->refs <= 0) {
        e = CUDA_ERROR_INVALID_CONTEXT;
    } else if (c->refs > 1) {
        c->refs--;
    } else { /* the last reference: destroying the context synchronises it */
        sync_begin(c, "cuDevicePrimaryCtxRelease", 1);
        if (--c->refs == 0)
            ctx_reset(c, "its context was destroyed by the last cuDevicePrimaryCtxRelease");
        sync_end(c);
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

/* The live context a handle names (lock held); a destroyed one is a misuse naming `call`. */
static ctx_t *ctx_of(const char *call, CUcontext h) {
    return handle_use(call, (uint64_t)(uintptr_t)h, K_CTX);
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext h) {
    ENTER("cuCtxPushCurrent");
    pthread_mutex_lock(&g_mu);
    ctx_t *c = ctx_of("cuCtxPushCurrent", h);
    pthread_mutex_unlock(&g_mu);
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (tls_depth == 64)
        return CUDA_ERROR_INVALID_VALUE;
    tls_stack[tls_depth++] = (uint64_t)(uintptr_t)h;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *out) {
    ENTER("cuCtxPopCurrent");
    if (!tls_depth)
        return CUDA_ERROR_INVALID_CONTEXT;
    uint64_t h = tls_stack[--tls_depth];
    if (out)
        *out = (CUcontext)(uintptr_t)h;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext h) {
    ENTER("cuCtxSetCurrent");
    if (h) {
        pthread_mutex_lock(&g_mu);
        ctx_t *c = ctx_of("cuCtxSetCurrent", h);
        pthread_mutex_unlock(&g_mu);
        if (!c)
            return CUDA_ERROR_INVALID_CONTEXT;
    }
    uint64_t v = (uint64_t)(uintptr_t)h;
    if (!tls_depth) {
        if (v)
            tls_stack[tls_depth++] = v;
    } else {
        tls_stack[tls_depth - 1] = v;
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *out) {
    ENTER("cuCtxGetCurrent");
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    *out = (CUcontext)(uintptr_t)current_handle();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *dev) {
    ENTER("cuCtxGetDevice");
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    ctx_t *c;
    CUresult e = need_ctx("cuCtxGetDevice", &c);
    if (!e)
        *dev = c->device;
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuCtxSynchronize(void) {
    ENTER("cuCtxSynchronize");
    pthread_mutex_lock(&g_mu);
    ctx_t *c;
    CUresult e = need_ctx("cuCtxSynchronize", &c);
    if (!e) {
        sync_begin(c, "cuCtxSynchronize", 1);
        e = wait_ctx(c, 0) ? c->sticky : CUDA_ERROR_UNKNOWN;
        if (e == CUDA_ERROR_UNKNOWN)
            host_wait_expired("cuCtxSynchronize");
        sync_end(c);
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags) {
    ENTER("cuCtxEnablePeerAccess");
    if (flags)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    ctx_t *c, *p = ctx_of("cuCtxEnablePeerAccess", peer);
    CUresult e = need_ctx("cuCtxEnablePeerAccess", &c);
    if (!e && (!p || !p->active))
        e = CUDA_ERROR_INVALID_HANDLE;
    if (!e && p == c)
        e = CUDA_ERROR_INVALID_DEVICE;
    if (!e && (c->peer_mask & (1u << p->device)))
        e = CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    if (!e)
        c->peer_mask |= 1u << p->device;
    pthread_mutex_unlock(&g_mu);
    return e;
}

/* -- streams ---------------------------------------------------------------------------- */
EXPORT CUresult cuStreamCreate(CUstream *out, unsigned int flags) {
    ENTER("cuStreamCreate");
    if (!out || flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    ctx_t *c;
    CUresult e = need_ctx("cuStreamCreate", &c);
    if (!e) {
        stream_t *s = stream_new(c, flags, 0);
        *out = (CUstream)(uintptr_t)s->handle;
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream h) {
    ENTER("cuStreamDestroy");
    pthread_mutex_lock(&g_mu);
    CUresult e = CUDA_SUCCESS;
    for (;;) {
        stream_t *s = handle_use("cuStreamDestroy", (uint64_t)(uintptr_t)h, K_STREAM);
        if (!s || s->destroyed) {
            e = CUDA_ERROR_INVALID_HANDLE;
            break;
        }
        if (wait_behind_sync(s->ctx, "cuStreamDestroy"))
            continue;
        /* Like the driver: returns at once; work already enqueued still runs. */
        s->destroyed = 1;
        handle_kill(s->handle, "destroyed by cuStreamDestroy");
        pthread_cond_signal(&s->cv);
        break;
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuStreamSynchronize(CUstream h) {
    ENTER("cuStreamSynchronize");
    pthread_mutex_lock(&g_mu);
    stream_t *s;
    CUresult e = get_stream("cuStreamSynchronize", h, &s);
    if (!e) {
        loop_waits("cuStreamSynchronize", "it waits until the stream is idle");
        e = wait_stream(s, s->enqueued) ? s->ctx->sticky : CUDA_ERROR_UNKNOWN;
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuStreamQuery(CUstream h) {
    ENTER("cuStreamQuery");
    pthread_mutex_lock(&g_mu);
    stream_t *s;
    CUresult e = get_stream("cuStreamQuery", h, &s);
    if (!e && !stream_idle(s, s->enqueued))
        e = CUDA_ERROR_NOT_READY;
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuStreamGetCtx(CUstream h, CUcontext *out) {
    ENTER("cuStreamGetCtx");
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    stream_t *s;
    CUresult e = get_stream("cuStreamGetCtx", h, &s);
    if (!e)
        *out = (CUcontext)(uintptr_t)s->ctx->handle;
    pthread_mutex_unlock(&g_mu);
    return e;
}

/* The live event a handle names (lock held): destroyed, or of a destroyed context, is a
 * misuse (rule 3); waits behind a synchronising call on its context (rule 1). */
static CUresult get_event(const char *call, CUevent h, event_t **out) {
    for (;;) {
        event_t *x = handle_use(call, (uint64_t)(uintptr_t)h, K_EVENT);
        if (!x || x->destroyed)
            return CUDA_ERROR_INVALID_HANDLE;
        if (wait_behind_sync(x->ctx, call))
            continue;
        *out = x;
        return CUDA_SUCCESS;
    }
}

EXPORT CUresult cuStreamWaitEvent(CUstream h, CUevent ev, unsigned int flags) {
    ENTER("cuStreamWaitEvent");
    pthread_mutex_lock(&g_mu);
    stream_t *s;
    event_t *x = NULL;
    CUresult e = CUDA_SUCCESS;
    for (;;) { /* both looked up with no wait in between */
        e = get_stream("cuStreamWaitEvent", h, &s);
        if (!e)
            e = get_event("cuStreamWaitEvent", ev, &x);
        if (e || !s->ctx->sync_owner || s->ctx->sync_owner == my_tid())
            break;
    }
    if (!e && flags > 1)
        e = CUDA_ERROR_INVALID_VALUE;
    if (!e && x->stream) {
        /* The wait captures the event's state now; a later record does not move it. */
        op_t *o = op_new(OP_WAIT_EVENT);
        o->wait_stream = x->stream;
        o->wait_seq = x->seq;
        enqueue(s, o);
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuLaunchHostFunc(CUstream h, CUhostFn fn, void *arg) {
    ENTER("cuLaunchHostFunc");
    if (!fn)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    stream_t *s;
    CUresult e = get_stream("cuLaunchHostFunc", h, &s);
    if (!e) {
        ensure_callback_thread(s->ctx);
        op_t *o = op_new(OP_HOSTFN);
        o->fn = fn;
        o->arg = arg;
        enqueue(s, o);
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

static CUresult mem_op_target(const char *call, CUdeviceptr addr) {
    if (!check_ptr(call, addr))
        return CUDA_ERROR_INVALID_VALUE;
    res_t d = resolve(addr, 4);
    if (addr & 3)
        return CUDA_ERROR_INVALID_VALUE;
    if (d.kind == R_DEVICE)
        return CUDA_SUCCESS;
    if (d.kind == R_PINNED && (d.a->flags & 2)) /* DEVICEMAP: the device can reach it */
        return CUDA_SUCCESS;
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuStreamWaitValue32_v2(CUstream h, CUdeviceptr addr, unsigned int value,
                                       unsigned int flags) {
    ENTER("cuStreamWaitValue32");
    if (!cfg.stream_mem_ops)
        return CUDA_ERROR_NOT_SUPPORTED;
    if ((flags & 0xF) > 3)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    stream_t *s;
    CUresult e = get_stream("cuStreamWaitValue32", h, &s);
    if (!e)
        e = mem_op_target("cuStreamWaitValue32", addr);
    if (!e) {
        op_t *o = op_new(OP_WAIT_VALUE);
        o->dst = addr;
        o->value = value;
        o->flags = flags;
        enqueue(s, o);
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuStreamWriteValue32_v2(CUstream h, CUdeviceptr addr, unsigned int value,
                                        unsigned int flags) {
    ENTER("cuStreamWriteValue32");
    if (!cfg.stream_mem_ops)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    stream_t *s;
    CUresult e = get_stream("cuStreamWriteValue32", h, &s);
    if (!e)
        e = mem_op_target("cuStreamWriteValue32", addr);
    if (!e) {
        op_t *o = op_new(OP_WRITE_VALUE);
        o->dst = addr;
        o->value = value;
        enqueue(s, o);
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

/* -- events ----------------------------------------------------------------------------- */
EXPORT CUresult cuEventCreate(CUevent *out, unsigned int flags) {
    ENTER("cuEventCreate");
    if (!out || flags > 7)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    ctx_t *c;
    CUresult e = need_ctx("cuEventCreate", &c);
    if (!e) {
        event_t *x = calloc(1, sizeof *x);
        x->ctx = c;
        x->gen = c->gen;
        x->flags = flags;
        x->handle = handle_new(K_EVENT, x);
        x->next = g_events;
        g_events = x;
        st.events_created++;
        *out = (CUevent)(uintptr_t)x->handle;
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuEventDestroy_v2(CUevent h) {
    ENTER("cuEventDestroy");
    pthread_mutex_lock(&g_mu);
    event_t *x;
    CUresult e = get_event("cuEventDestroy", h, &x);
    if (!e) {
        x->destroyed = 1; /* pending records and waits keep the struct: it is never freed */
        handle_kill(x->handle, "destroyed by cuEventDestroy");
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuEventRecord(CUevent h, CUstream sh) {
    ENTER("cuEventRecord");
    pthread_mutex_lock(&g_mu);
    event_t *x = NULL;
    stream_t *s = NULL;
    CUresult e = CUDA_SUCCESS;
    for (;;) {
        e = get_event("cuEventRecord", h, &x);
        if (!e)
            e = get_stream("cuEventRecord", sh, &s);
        if (e || !x->ctx->sync_owner || x->ctx->sync_owner == my_tid())
            break;
    }
    if (!e && s->ctx != x->ctx)
        e = CUDA_ERROR_INVALID_HANDLE; /* event and stream of different contexts */
    if (!e) {
        op_t *o = op_new(OP_RECORD);
        o->ev = x;
        o->ev_gen = ++x->rec_gen;
        x->timed = 0;
        enqueue(s, o);
        x->stream = s;
        x->seq = o->seq;
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuEventQuery(CUevent h) {
    ENTER("cuEventQuery");
    pthread_mutex_lock(&g_mu);
    event_t *x;
    CUresult e = get_event("cuEventQuery", h, &x);
    if (!e && x->ctx->sticky)
        e = x->ctx->sticky;
    if (!e && x->stream && !stream_idle(x->stream, x->seq))
        e = CUDA_ERROR_NOT_READY;
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuEventSynchronize(CUevent h) {
    ENTER("cuEventSynchronize");
    pthread_mutex_lock(&g_mu);
    event_t *x;
    CUresult e = get_event("cuEventSynchronize", h, &x);
    if (!e)
        loop_waits("cuEventSynchronize", "it waits until the event's work is done");
    if (!e && x->stream && !wait_stream(x->stream, x->seq))
        e = CUDA_ERROR_UNKNOWN;
    if (!e && x->ctx->sticky)
        e = x->ctx->sticky;
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b) {
    ENTER("cuEventElapsedTime");
    if (!ms)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    event_t *x, *y;
    CUresult e = get_event("cuEventElapsedTime", a, &x);
    if (!e)
        e = get_event("cuEventElapsedTime", b, &y);
    if (!e && ((x->flags | y->flags) & 2))
        e = CUDA_ERROR_INVALID_HANDLE; /* CU_EVENT_DISABLE_TIMING */
    if (!e && (!x->stream || !y->stream))
        e = CUDA_ERROR_INVALID_HANDLE; /* never recorded */
    if (!e && (!stream_idle(x->stream, x->seq) || !stream_idle(y->stream, y->seq)))
        e = CUDA_ERROR_NOT_READY;
    if (!e && (!x->timed || !y->timed))
        e = CUDA_ERROR_NOT_READY;
    if (!e)
        *ms = (float)((double)((int64_t)(y->t_ns - x->t_ns)) / 1e6);
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) {
    return cuEventElapsedTime(ms, a, b);
}

/* -- memory ----------------------------------------------------------------------------- */
static CUresult device_alloc(ctx_t *c, size_t n, int from_pool, struct stream *s,
                             CUdeviceptr *out) {
    device_t *d = &g_dev[c->device];
    if (!n)
        return CUDA_ERROR_INVALID_VALUE;
    if ((long long)n > cfg.memory_limit - d->used)
        return CUDA_ERROR_OUT_OF_MEMORY;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t map = (n + page - 1) / page * page;
    void *host = mmap(NULL, map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    if (host == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    alloc_t *a = calloc(1, sizeof *a);
    a->addr = d->next_addr;
    a->size = n;
    a->host = host;
    a->map_size = map;
    a->kind = A_DEVICE;
    a->device = c->device;
    a->from_pool = from_pool;
    a->alloc_stream = s;
    a->alloc_seq = s ? s->enqueued : 0;
    a->ctx = c;
    /* addresses are never reused: 256-byte aligned, a 4 KiB hole after each allocation */
    d->next_addr += (n + 4096 + 255) / 256 * 256;
    d->used += (long long)n;
    if (from_pool)
        d->pool_used += (long long)n;
    a->next = g_allocs;
    g_allocs = a;
    st.device_allocs++;
    *out = a->addr;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t n) {
    ENTER("cuMemAlloc");
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    ctx_t *c;
    CUresult e = need_ctx("cuMemAlloc", &c);
    if (!e)
        e = device_alloc(c, n, 0, NULL, out);
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *out, size_t n, CUstream h) {
    ENTER("cuMemAllocAsync");
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    stream_t *s;
    CUresult e = get_stream("cuMemAllocAsync", h, &s);
    if (!e)
        e = device_alloc(s->ctx, n, 1, s, out);
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    ENTER("cuMemFree");
    pthread_mutex_lock(&g_mu);
    ctx_t *c;
    CUresult e = need_ctx("cuMemFree", &c);
    alloc_t *a = NULL;
    if (!e && !check_ptr("cuMemFree", p))
        e = CUDA_ERROR_INVALID_VALUE;
    if (!e) {
        a = find_alloc(p, 0);
        if (!a || a->kind != A_DEVICE || a->addr != p)
            e = CUDA_ERROR_INVALID_VALUE;
        else if (a->free_enqueued) {
            misuse("cuMemFree: device pointer %#llx was freed already (cuMemFreeAsync)",
                   (unsigned long long)p);
            e = CUDA_ERROR_INVALID_VALUE;
        }
    }
    if (!e) {
        /* cuMemFree synchronizes (rule 1): work already enqueued that uses the memory
         * finishes, and other threads' calls on the context wait meanwhile */
        ctx_t *owner = &g_dev[a->device].ctx;
        sync_begin(owner, "cuMemFree", 1);
        if (!wait_ctx(owner, 0))
            host_wait_expired("cuMemFree");
        a = find_alloc(p, 0);
        if (a && a->kind == A_DEVICE && a->addr == p)
            free_alloc(a, "freed by cuMemFree");
        else
            e = CUDA_ERROR_INVALID_VALUE;
        sync_end(owner);
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream h) {
    ENTER("cuMemFreeAsync");
    pthread_mutex_lock(&g_mu);
    stream_t *s;
    CUresult e = get_stream("cuMemFreeAsync", h, &s);
    if (!e && !check_ptr("cuMemFreeAsync", p))
        e = CUDA_ERROR_INVALID_VALUE;
    if (!e) {
        alloc_t *a = find_alloc(p, 0);
        if (!a || a->kind != A_DEVICE || a->addr != p) {
            e = CUDA_ERROR_INVALID_VALUE;
        } else if (a->free_enqueued) {
            misuse("cuMemFreeAsync: device pointer %#llx freed twice (a cuMemFreeAsync of it is "
                   "already enqueued)",
                   (unsigned long long)p);
            e = CUDA_ERROR_INVALID_VALUE;
        } else {
            a->free_enqueued = 1;
        }
    }
    if (!e) {
        op_t *o = op_new(OP_FREE);
        o->dst = p;
        enqueue(s, o);
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total) {
    ENTER("cuMemGetInfo");
    if (!free_b || !total)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    ctx_t *c;
    CUresult e = need_ctx("cuMemGetInfo", &c);
    if (!e) {
        *total = (size_t)cfg.memory_limit;
        long long f = cfg.memory_limit - g_dev[c->device].used;
        *free_b = (size_t)(f > 0 ? f : 0);
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

static int host_overlaps(uint64_t p, size_t n) {
    for (alloc_t *a = g_allocs; a; a = a->next)
        if (!a->freed && a->kind != A_DEVICE && p < a->addr + a->size && a->addr < p + n)
            return 1;
    return 0;
}

EXPORT CUresult cuMemHostAlloc(void **pp, size_t n, unsigned int flags) {
    ENTER("cuMemHostAlloc");
    if (!pp || !n || flags > 7)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    ctx_t *c;
    CUresult e = need_ctx("cuMemHostAlloc", &c);
    if (!e && (long long)n > cfg.pinned_limit - g_pinned_used)
        e = CUDA_ERROR_OUT_OF_MEMORY;
    if (!e) {
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        size_t map = (n + page - 1) / page * page;
        void *host = mmap(NULL, map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (host == MAP_FAILED) {
            e = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            alloc_t *a = calloc(1, sizeof *a);
            a->addr = (uint64_t)(uintptr_t)host;
            a->size = n;
            a->host = host;
            a->map_size = map;
            a->kind = A_PINNED;
            a->flags = flags;
            a->device = c->device;
            a->ctx = c;
            a->next = g_allocs;
            g_allocs = a;
            g_pinned_used += (long long)n;
            st.pinned_allocs++;
            *pp = host;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t n) { return cuMemHostAlloc(pp, n, 0); }

EXPORT CUresult cuMemFreeHost(void *p) {
    ENTER("cuMemFreeHost");
    pthread_mutex_lock(&g_mu);
    CUresult e = CUDA_SUCCESS;
    alloc_t *a = NULL;
    if (!check_ptr("cuMemFreeHost", (uint64_t)(uintptr_t)p))
        e = CUDA_ERROR_INVALID_VALUE;
    if (!e) {
        a = find_alloc((uint64_t)(uintptr_t)p, 0);
        if (!a || a->kind != A_PINNED || a->addr != (uint64_t)(uintptr_t)p)
            e = CUDA_ERROR_INVALID_VALUE;
    }
    if (!e) {
        ctx_t *c = a->ctx;
        sync_begin(c, "cuMemFreeHost", 1); /* synchronizes, like the driver (rule 1) */
        if (!wait_ctx(c, 0))
            host_wait_expired("cuMemFreeHost");
        a = find_alloc((uint64_t)(uintptr_t)p, 0);
        if (a && a->kind == A_PINNED)
            free_alloc(a, "freed by cuMemFreeHost");
        sync_end(c);
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int flags) {
    ENTER("cuMemHostRegister");
    if (!p || !n || flags > 15)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    ctx_t *c;
    CUresult e = need_ctx("cuMemHostRegister", &c);
    if (!e && host_overlaps((uint64_t)(uintptr_t)p, n))
        e = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    if (!e) {
        alloc_t *a = calloc(1, sizeof *a);
        a->addr = (uint64_t)(uintptr_t)p;
        a->size = n;
        a->kind = A_REGISTERED;
        a->flags = flags;
        a->device = c->device;
        a->ctx = c;
        a->next = g_allocs;
        g_allocs = a;
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemHostUnregister(void *p) {
    ENTER("cuMemHostUnregister");
    pthread_mutex_lock(&g_mu);
    alloc_t *a = find_alloc((uint64_t)(uintptr_t)p, 0);
    CUresult e = CUDA_SUCCESS;
    if (!a || a->kind != A_REGISTERED || a->addr != (uint64_t)(uintptr_t)p) {
        e = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    } else {
        ctx_t *c = a->ctx;
        sync_begin(c, "cuMemHostUnregister", 1); /* synchronizes (rule 1) */
        if (!wait_ctx(c, 0))
            host_wait_expired("cuMemHostUnregister");
        a = find_alloc((uint64_t)(uintptr_t)p, 0);
        if (a && a->kind == A_REGISTERED)
            free_alloc(a, "unregistered");
        sync_end(c);
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *out, void *p, unsigned int flags) {
    ENTER("cuMemHostGetDevicePointer");
    if (!out || flags)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    alloc_t *a = check_ptr("cuMemHostGetDevicePointer", (uint64_t)(uintptr_t)p)
                     ? find_alloc((uint64_t)(uintptr_t)p, 1)
                     : NULL;
    CUresult e = CUDA_SUCCESS;
    if (!a || a->kind == A_DEVICE || !(a->flags & 2))
        e = CUDA_ERROR_INVALID_VALUE;
    else
        *out = (CUdeviceptr)(uintptr_t)p; /* unified addressing: the same address */
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemHostGetFlags(unsigned int *flags, void *p) {
    ENTER("cuMemHostGetFlags");
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    alloc_t *a = check_ptr("cuMemHostGetFlags", (uint64_t)(uintptr_t)p)
                     ? find_alloc((uint64_t)(uintptr_t)p, 1)
                     : NULL;
    CUresult e = CUDA_SUCCESS;
    if (!a || a->kind != A_PINNED)
        e = CUDA_ERROR_INVALID_VALUE;
    else
        *flags = a->flags;
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    ENTER("cuPointerGetAttribute");
    if (!data)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    alloc_t *a = NULL;
    if (check_ptr("cuPointerGetAttribute", p)) {
        a = find_alloc(p, 1);
        if (a && a->ctx && wait_behind_sync(a->ctx, "cuPointerGetAttribute"))
            a = find_alloc(p, 1);
    }
    CUresult e = CUDA_SUCCESS;
    if (!a) {
        e = CUDA_ERROR_INVALID_VALUE; /* pageable host memory, or nothing at all */
    } else {
        int dev = a->kind == A_DEVICE;
        switch (attr) {
        case 1: /* CONTEXT */
            *(CUcontext *)data = (CUcontext)(uintptr_t)a->ctx->handle;
            break;
        case 2: /* MEMORY_TYPE */
            *(unsigned int *)data = dev ? 2 : 1;
            break;
        case 3: /* DEVICE_POINTER */
            if (!dev && !(a->flags & 2))
                e = CUDA_ERROR_INVALID_VALUE;
            else
                *(CUdeviceptr *)data = p;
            break;
        case 4: /* HOST_POINTER */
            if (dev)
                e = CUDA_ERROR_INVALID_VALUE;
            else
                *(void **)data = (void *)(uintptr_t)p;
            break;
        case 6: /* SYNC_MEMOPS */
        case 8: /* IS_MANAGED */
            *(char *)data = 0;
            break;
        case 9: /* DEVICE_ORDINAL */
            *(int *)data = a->device;
            break;
        case 11: /* RANGE_START_ADDR */
            *(CUdeviceptr *)data = a->addr;
            break;
        case 12: /* RANGE_SIZE */
            *(size_t *)data = a->size;
            break;
        case 13: /* MAPPED */
            *(char *)data = 1;
            break;
        case 17: /* MEMPOOL_HANDLE */
            if (!dev || !a->from_pool)
                e = CUDA_ERROR_INVALID_VALUE;
            else
                *(CUmemoryPool *)data = (CUmemoryPool)(uintptr_t)g_dev[a->device].pool.handle;
            break;
        default:
            e = CUDA_ERROR_INVALID_VALUE;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

/* -- copies and memsets ----------------------------------------------------------------- */
/* Enqueue a copy on `s` (lock held), with the host synchronisation the CUDA documentation
 * ("API synchronization behavior") gives it:
 *   - pageable -> device, cuMemcpyAsync, at most pageable_staging_limit bytes (4 MiB by
 *     default): staged on the calling thread, returns at once (the real driver returned at
 *     once for 64 KiB and 1 MiB on a stream held on the device);
 *   - pageable -> device, larger (rule 2): returns only once its stream has reached and done
 *     the copy (the real driver did not return for 64 MiB until the stream ran);
 *   - device -> pageable: returns once the copy has landed;
 *   - host -> host (pinned or pageable): fully synchronous;
 *   - synchronous cuMemcpy*: pinned <-> device and pageable -> device wait for the copy;
 *     device -> device does not wait;
 *   - everything else (pinned <-> device, device <-> device, async) returns at once.
 * A copy that waits is, from a marked event-loop thread, a misuse (rule 5). */
static CUresult copy_on(const char *call, stream_t *s, CUdeviceptr dst, CUdeviceptr src,
                        size_t n, int sync) {
    if (!n)
        return CUDA_SUCCESS;
    if (!check_ptr(call, dst) || !check_ptr(call, src))
        return CUDA_ERROR_INVALID_VALUE;
    res_t d = resolve(dst, n), r = resolve(src, n);
    if (d.kind == R_BAD || r.kind == R_BAD)
        return CUDA_ERROR_INVALID_VALUE;
    op_t *o = op_new(OP_COPY);
    o->dst = dst;
    o->src = src;
    o->n = n;
    int pageable = d.kind == R_PAGEABLE || r.kind == R_PAGEABLE;
    int watched = cfg.watch_tid && my_tid() == cfg.watch_tid;
    if (pageable) {
        st.pageable_copies++;
        if (watched)
            st.watched_pageable++;
    }
    char whybuf[200];
    const char *why = NULL;
    int stage = 0;
    if (d.kind != R_DEVICE && r.kind != R_DEVICE) {
        why = "a copy between host buffers is fully synchronous for the host";
    } else if (d.kind == R_PAGEABLE) {
        why = "a copy into pageable host memory returns once it has landed";
    } else if (r.kind == R_PAGEABLE) {
        if (sync) {
            why = "a synchronous copy from pageable memory synchronises its stream first";
        } else if ((long long)n > cfg.pageable_staging_limit) {
            snprintf(whybuf, sizeof whybuf,
                     "a pageable copy larger than the driver's staging (%zu > %lld bytes) "
                     "returns only once its stream has reached it",
                     n, cfg.pageable_staging_limit);
            why = whybuf;
        } else {
            stage = 1;
        }
    } else if (sync && !(d.kind == R_DEVICE && r.kind == R_DEVICE)) {
        why = "a synchronous copy to or from pinned memory returns once it is done";
    }
    if (why)
        loop_waits(call, why);
    if (stage) {
        o->kind = OP_STAGED;
        o->staging = malloc(n);
        if (!o->staging) {
            free(o);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        pthread_mutex_unlock(&g_mu);
        uint64_t t0 = now_ns();
        memcpy(o->staging, r.p, n);
        throttle(n); /* staging runs at the copy's speed too */
        pthread_mutex_lock(&g_mu);
        if (watched) /* host work, not a wait: counted in watched_pageable, not blocking */
            st.watched_blocking_ns += (long long)(now_ns() - t0);
        if (s->destroyed || !s->ctx->active) {
            free(o->staging);
            free(o);
            return CUDA_ERROR_INVALID_HANDLE;
        }
    }
    enqueue(s, o);
    if (why) {
        if (!wait_stream(s, o->seq))
            return CUDA_ERROR_UNKNOWN;
        if (s->ctx->sticky)
            return s->ctx->sticky;
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
    ENTER("cuMemcpyAsync");
    pthread_mutex_lock(&g_mu);
    stream_t *s;
    CUresult e = get_stream("cuMemcpyAsync", h, &s);
    if (!e)
        e = copy_on("cuMemcpyAsync", s, dst, src, n, 0);
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src,
                                  CUcontext sctx, size_t n, CUstream h) {
    ENTER("cuMemcpyPeerAsync");
    pthread_mutex_lock(&g_mu);
    stream_t *s;
    CUresult e = get_stream("cuMemcpyPeerAsync", h, &s);
    ctx_t *dc = ctx_of("cuMemcpyPeerAsync", dctx), *sc = ctx_of("cuMemcpyPeerAsync", sctx);
    if (!e && (!dc || !sc || !dc->active || !sc->active))
        e = CUDA_ERROR_INVALID_CONTEXT;
    if (!e && (!check_ptr("cuMemcpyPeerAsync", dst) || !check_ptr("cuMemcpyPeerAsync", src)))
        e = CUDA_ERROR_INVALID_VALUE;
    if (!e) {
        res_t d = resolve(dst, n), r = resolve(src, n);
        if (d.kind != R_DEVICE || r.kind != R_DEVICE || d.a->ctx != dc || r.a->ctx != sc)
            e = CUDA_ERROR_INVALID_VALUE;
    }
    if (!e)
        e = copy_on("cuMemcpyPeerAsync", s, dst, src, n, 0);
    pthread_mutex_unlock(&g_mu);
    return e;
}

static CUresult copy_sync(const char *call, CUdeviceptr dst, CUdeviceptr src, size_t n) {
    pthread_mutex_lock(&g_mu);
    stream_t *s;
    CUresult e = get_stream(call, NULL, &s);
    if (!e)
        e = copy_on(call, s, dst, src, n, 1);
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    ENTER("cuMemcpy");
    return copy_sync("cuMemcpy", dst, src, n);
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    ENTER("cuMemcpyHtoD");
    return copy_sync("cuMemcpyHtoD", dst, (CUdeviceptr)(uintptr_t)src, n);
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    ENTER("cuMemcpyDtoH");
    return copy_sync("cuMemcpyDtoH", (CUdeviceptr)(uintptr_t)dst, src, n);
}

EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    ENTER("cuMemcpyDtoD");
    return copy_sync("cuMemcpyDtoD", dst, src, n);
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream h) {
    return cuMemcpyAsync(dst, (CUdeviceptr)(uintptr_t)src, n, h);
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream h) {
    return cuMemcpyAsync((CUdeviceptr)(uintptr_t)dst, src, n, h);
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
    return cuMemcpyAsync(dst, src, n, h);
}

/* Memsets: "the synchronous memset functions are asynchronous with respect to the host
 * except when the target is pinned host memory"; the Async ones always are. */
static CUresult memset_on(const char *call, stream_t *s, CUdeviceptr dst, unsigned v,
                          size_t count, int kind, int sync) {
    size_t bytes = kind == OP_MEMSET32 ? count * 4 : count;
    if (!count)
        return CUDA_SUCCESS;
    if (!check_ptr(call, dst))
        return CUDA_ERROR_INVALID_VALUE;
    if (kind == OP_MEMSET32 && (dst & 3))
        return CUDA_ERROR_INVALID_VALUE;
    res_t d = resolve(dst, bytes);
    if (d.kind != R_DEVICE && d.kind != R_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    int waits = sync && d.kind == R_PINNED;
    if (waits)
        loop_waits(call, "a synchronous memset of pinned memory is synchronous for the host");
    op_t *o = op_new(kind);
    o->dst = dst;
    o->value = v;
    o->n = count;
    enqueue(s, o);
    if (waits) {
        if (!wait_stream(s, o->seq))
            return CUDA_ERROR_UNKNOWN;
        if (s->ctx->sticky)
            return s->ctx->sticky;
    }
    return CUDA_SUCCESS;
}

static CUresult memset_api(const char *call, CUstream h, CUdeviceptr dst, unsigned v, size_t n,
                           int kind, int sync) {
    pthread_mutex_lock(&g_mu);
    stream_t *s;
    CUresult e = get_stream(call, h, &s);
    if (!e)
        e = memset_on(call, s, dst, v, n, kind, sync);
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int v, size_t n) {
    ENTER("cuMemsetD32");
    return memset_api("cuMemsetD32", NULL, dst, v, n, OP_MEMSET32, 1);
}

EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int v, size_t n, CUstream h) {
    ENTER("cuMemsetD32Async");
    return memset_api("cuMemsetD32Async", h, dst, v, n, OP_MEMSET32, 0);
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    ENTER("cuMemsetD8");
    return memset_api("cuMemsetD8", NULL, dst, v, n, OP_MEMSET8, 1);
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream h) {
    ENTER("cuMemsetD8Async");
    return memset_api("cuMemsetD8Async", h, dst, v, n, OP_MEMSET8, 0);
}

/* -- memory pools (the device's default pool only) -------------------------------------- */
EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *out, CUdevice dev) {
    ENTER("cuDeviceGetDefaultMemPool");
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    pool_t *p = &g_dev[dev].pool;
    if (!p->handle)
        p->handle = handle_new(K_POOL, p);
    *out = (CUmemoryPool)(uintptr_t)p->handle;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool h, int attr, void *value) {
    ENTER("cuMemPoolSetAttribute");
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    pool_t *p = handle_get((uint64_t)(uintptr_t)h, K_POOL);
    CUresult e = CUDA_SUCCESS;
    if (!p)
        e = CUDA_ERROR_INVALID_HANDLE;
    else if (attr == 4) /* RELEASE_THRESHOLD */
        p->release_threshold = *(unsigned long long *)value;
    else if (attr >= 1 && attr <= 3) /* REUSE_* */
        p->reuse[attr] = *(int *)value;
    else if (attr == 6 || attr == 8) /* reset the high-water marks: only 0 is valid */
        e = *(unsigned long long *)value ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    else
        e = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool h, int attr, void *value) {
    ENTER("cuMemPoolGetAttribute");
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    pool_t *p = handle_get((uint64_t)(uintptr_t)h, K_POOL);
    CUresult e = CUDA_SUCCESS;
    if (!p)
        e = CUDA_ERROR_INVALID_HANDLE;
    else if (attr == 4)
        *(unsigned long long *)value = p->release_threshold;
    else if (attr >= 1 && attr <= 3)
        *(int *)value = p->reuse[attr];
    else if (attr >= 5 && attr <= 8)
        *(unsigned long long *)value = (unsigned long long)g_dev[p->device].pool_used;
    else
        e = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&g_mu);
    return e;
}

EXPORT CUresult cuMemPoolSetAccess(CUmemoryPool h, const CUmemAccessDesc *desc, size_t count) {
    ENTER("cuMemPoolSetAccess");
    if (!desc && count)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    pool_t *p = handle_get((uint64_t)(uintptr_t)h, K_POOL);
    CUresult e = p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
    for (size_t i = 0; !e && i < count; i++) {
        if (desc[i].location.type != 1 || !valid_device(desc[i].location.id) ||
            desc[i].flags < 0 || desc[i].flags > 3)
            e = CUDA_ERROR_INVALID_VALUE;
        else if (desc[i].location.id == p->device && desc[i].flags != 3)
            e = CUDA_ERROR_INVALID_DEVICE; /* the owner keeps read-write access */
    }
    pthread_mutex_unlock(&g_mu);
    return e;
}

/* -- errors ----------------------------------------------------------------------------- */
static const struct {
    int code;
    const char *name, *text;
} g_errors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"},
    {705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled"},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered "
                                                   "memory region"},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

EXPORT CUresult cuGetErrorName(CUresult e, const char **out) {
    if (hostfn_calls("cuGetErrorName"))
        return CUDA_ERROR_NOT_PERMITTED_;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++) {
        if (g_errors[i].code == e) {
            *out = g_errors[i].name;
            return CUDA_SUCCESS;
        }
    }
    *out = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult e, const char **out) {
    if (hostfn_calls("cuGetErrorString"))
        return CUDA_ERROR_NOT_PERMITTED_;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++) {
        if (g_errors[i].code == e) {
            *out = g_errors[i].text;
            return CUDA_SUCCESS;
        }
    }
    *out = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* -- cuGetProcAddress: how cuda-bindings finds every function ---------------------------- */
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                    unsigned long long flags, int *status);
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version,
                                 unsigned long long flags);

typedef struct {
    const char *name;
    int since; /* the CUDA version that introduced this variant */
    int until; /* the version of a newer variant with another signature (0: none) */
    void *fn;
} proc_t;

#define P(n, s, u, f) {n, s, u, (void *)(f)}
static const proc_t g_procs[] = {
    P("cuInit", 2000, 0, cuInit),
    P("cuDriverGetVersion", 2020, 0, cuDriverGetVersion),
    P("cuGetErrorName", 6000, 0, cuGetErrorName),
    P("cuGetErrorString", 6000, 0, cuGetErrorString),
    P("cuDeviceGet", 2000, 0, cuDeviceGet),
    P("cuDeviceGetCount", 2000, 0, cuDeviceGetCount),
    P("cuDeviceGetName", 2000, 0, cuDeviceGetName),
    P("cuDeviceGetUuid", 9020, 0, cuDeviceGetUuid),
    P("cuDeviceGetPCIBusId", 4010, 0, cuDeviceGetPCIBusId),
    P("cuDeviceTotalMem", 3020, 0, cuDeviceTotalMem_v2),
    P("cuDeviceGetAttribute", 2000, 0, cuDeviceGetAttribute),
    P("cuDeviceCanAccessPeer", 4000, 0, cuDeviceCanAccessPeer),
    P("cuDevicePrimaryCtxRetain", 7000, 0, cuDevicePrimaryCtxRetain),
    P("cuDevicePrimaryCtxRelease", 11000, 0, cuDevicePrimaryCtxRelease_v2),
    P("cuDeviceGetDefaultMemPool", 11020, 0, cuDeviceGetDefaultMemPool),
    P("cuCtxPushCurrent", 4000, 0, cuCtxPushCurrent_v2),
    P("cuCtxPopCurrent", 4000, 0, cuCtxPopCurrent_v2),
    P("cuCtxSetCurrent", 4000, 0, cuCtxSetCurrent),
    P("cuCtxGetCurrent", 4000, 0, cuCtxGetCurrent),
    P("cuCtxGetDevice", 2000, 13000, cuCtxGetDevice),
    P("cuCtxSynchronize", 2000, 13000, cuCtxSynchronize),
    P("cuCtxEnablePeerAccess", 4000, 0, cuCtxEnablePeerAccess),
    P("cuStreamCreate", 2000, 0, cuStreamCreate),
    P("cuStreamDestroy", 4000, 0, cuStreamDestroy_v2),
    P("cuStreamSynchronize", 2000, 0, cuStreamSynchronize),
    P("cuStreamQuery", 2000, 0, cuStreamQuery),
    P("cuStreamGetCtx", 9020, 12050, cuStreamGetCtx),
    P("cuStreamWaitEvent", 3020, 0, cuStreamWaitEvent),
    P("cuLaunchHostFunc", 10000, 13020, cuLaunchHostFunc),
    P("cuStreamWaitValue32", 8000, 0, cuStreamWaitValue32_v2),
    P("cuStreamWriteValue32", 8000, 0, cuStreamWriteValue32_v2),
    P("cuEventCreate", 2000, 0, cuEventCreate),
    P("cuEventDestroy", 4000, 0, cuEventDestroy_v2),
    P("cuEventRecord", 2000, 0, cuEventRecord),
    P("cuEventQuery", 2000, 0, cuEventQuery),
    P("cuEventSynchronize", 2000, 0, cuEventSynchronize),
    P("cuEventElapsedTime", 2000, 0, cuEventElapsedTime),
    P("cuMemAlloc", 3020, 0, cuMemAlloc_v2),
    P("cuMemAllocAsync", 11020, 0, cuMemAllocAsync),
    P("cuMemFree", 3020, 0, cuMemFree_v2),
    P("cuMemFreeAsync", 11020, 0, cuMemFreeAsync),
    P("cuMemGetInfo", 3020, 0, cuMemGetInfo_v2),
    P("cuMemHostAlloc", 2020, 0, cuMemHostAlloc),
    P("cuMemAllocHost", 3020, 0, cuMemAllocHost_v2),
    P("cuMemFreeHost", 2000, 0, cuMemFreeHost),
    P("cuMemHostRegister", 6050, 0, cuMemHostRegister_v2),
    P("cuMemHostUnregister", 4000, 0, cuMemHostUnregister),
    P("cuMemHostGetDevicePointer", 3020, 0, cuMemHostGetDevicePointer_v2),
    P("cuMemHostGetFlags", 2030, 0, cuMemHostGetFlags),
    P("cuPointerGetAttribute", 4000, 0, cuPointerGetAttribute),
    P("cuMemcpy", 4000, 0, cuMemcpy),
    P("cuMemcpyAsync", 4000, 0, cuMemcpyAsync),
    P("cuMemcpyPeerAsync", 4000, 0, cuMemcpyPeerAsync),
    P("cuMemcpyHtoD", 3020, 0, cuMemcpyHtoD_v2),
    P("cuMemcpyDtoH", 3020, 0, cuMemcpyDtoH_v2),
    P("cuMemcpyDtoD", 3020, 0, cuMemcpyDtoD_v2),
    P("cuMemcpyHtoDAsync", 3020, 0, cuMemcpyHtoDAsync_v2),
    P("cuMemcpyDtoHAsync", 3020, 0, cuMemcpyDtoHAsync_v2),
    P("cuMemcpyDtoDAsync", 3020, 0, cuMemcpyDtoDAsync_v2),
    P("cuMemsetD32", 3020, 0, cuMemsetD32_v2),
    P("cuMemsetD32Async", 3020, 0, cuMemsetD32Async),
    P("cuMemsetD8", 3020, 0, cuMemsetD8_v2),
    P("cuMemsetD8Async", 3020, 0, cuMemsetD8Async),
    P("cuMemPoolSetAttribute", 11020, 0, cuMemPoolSetAttribute),
    P("cuMemPoolGetAttribute", 11020, 0, cuMemPoolGetAttribute),
    P("cuMemPoolSetAccess", 11020, 0, cuMemPoolSetAccess),
    /* cuda-bindings 12.x looks the lookup itself up (and uses what it gets from then on) */
    P("cuGetProcAddress", 11030, 12000, cuGetProcAddress),
    P("cuGetProcAddress", 12000, 0, cuGetProcAddress_v2),
};

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                    unsigned long long flags, int *status) {
    (void)flags; /* default / legacy / per-thread stream variants are the same functions here */
    if (hostfn_calls("cuGetProcAddress"))
        return CUDA_ERROR_NOT_PERMITTED_;
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    int found_name = 0;
    for (size_t i = 0; i < sizeof g_procs / sizeof g_procs[0]; i++) {
        const proc_t *p = &g_procs[i];
        if (strcmp(p->name, symbol) != 0)
            continue;
        found_name = 1;
        if (version >= p->since && (!p->until || version < p->until)) {
            *pfn = p->fn;
            if (status)
                *status = 0; /* CU_GET_PROC_ADDRESS_SUCCESS */
            return CUDA_SUCCESS;
        }
    }
    *pfn = NULL;
    if (status)
        *status = found_name ? 2 : 1; /* VERSION_NOT_SUFFICIENT : SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version,
                                 unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

/* -- test control (not part of the CUDA API) -------------------------------------------- */
static long long *cfg_field(const char *key) {
    if (!strcmp(key, "devices")) return &cfg.devices;
    if (!strcmp(key, "memory_limit")) return &cfg.memory_limit;
    if (!strcmp(key, "pinned_limit")) return &cfg.pinned_limit;
    if (!strcmp(key, "bandwidth")) return &cfg.bandwidth;
    if (!strcmp(key, "latency_ns")) return &cfg.latency_ns;
    if (!strcmp(key, "stream_mem_ops")) return &cfg.stream_mem_ops;
    if (!strcmp(key, "driver_version")) return &cfg.driver_version;
    if (!strcmp(key, "watch_tid")) return &cfg.watch_tid;
    if (!strcmp(key, "lose_after_copies")) return &cfg.lose_after_copies;
    if (!strcmp(key, "unmap_pinned_on_reset")) return &cfg.unmap_pinned_on_reset;
    if (!strcmp(key, "host_wait_limit_ns")) return &cfg.host_wait_limit_ns;
    if (!strcmp(key, "pageable_staging_limit")) return &cfg.pageable_staging_limit;
    if (!strcmp(key, "abort_on_misuse")) return &cfg.abort_on_misuse;
    if (!strcmp(key, "strict_loop_sync")) return &cfg.strict_loop_sync;
    if (!strcmp(key, "watch_is_loop")) return &cfg.watch_is_loop;
    return NULL;
}

static long long *stat_field(const char *key) {
#define S(f) if (!strcmp(key, #f)) return &st.f
    S(copies); S(bytes_copied); S(violations); S(hostfns); S(pageable_copies);
    S(watched_pageable); S(watched_blocking); S(watched_blocking_ns); S(streams_created);
    S(streams_live); S(threads_live); S(events_created); S(device_allocs); S(pinned_allocs);
    S(abandoned_ops); S(sticky_errors); S(wait_values); S(write_values); S(max_queue);
    S(misuses); S(sync_calls); S(sync_waits); S(sync_waiting); S(host_waiting); S(loop_threads);
#undef S
    return NULL;
}

/* Set a configuration value; returns 0, or -1 for an unknown key or a bad value. */
EXPORT int cuemu_set(const char *key, long long value) {
    pthread_mutex_lock(&g_mu);
    long long *f = cfg_field(key);
    int rc = 0;
    if (!f || (!strcmp(key, "devices") && (value < 0 || value > MAX_DEVICES)))
        rc = -1;
    if (!rc && !strcmp(key, "devices"))
        for (int d = (int)value; d < MAX_DEVICES; d++)
            if (g_dev[d].ctx.refs)
                rc = -2; /* a device with a retained context cannot disappear */
    if (!rc)
        *f = value;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* A configuration value or a statistic (device_used / pinned_used / live_allocs /
 * retained_contexts are computed); -1 for an unknown key. */
EXPORT long long cuemu_get(const char *key) {
    pthread_mutex_lock(&g_mu);
    long long out = -1, *f = cfg_field(key);
    if (!f)
        f = stat_field(key);
    if (f) {
        out = *f;
    } else if (!strcmp(key, "device_used")) {
        out = 0;
        for (int d = 0; d < MAX_DEVICES; d++)
            out += g_dev[d].used;
    } else if (!strcmp(key, "pinned_used")) {
        out = g_pinned_used;
    } else if (!strcmp(key, "live_allocs")) {
        out = 0;
        for (alloc_t *a = g_allocs; a; a = a->next)
            out += !a->freed;
    } else if (!strcmp(key, "retained_contexts")) {
        out = 0;
        for (int d = 0; d < MAX_DEVICES; d++)
            out += g_dev[d].ctx.refs;
    } else if (!strcmp(key, "sticky")) {
        out = 0;
        for (int d = 0; d < MAX_DEVICES; d++)
            if (g_dev[d].ctx.sticky)
                out = g_dev[d].ctx.sticky;
    }
    pthread_mutex_unlock(&g_mu);
    return out;
}

/* The (after+1)-th call of `name` from now fails with `code`, `times` times in a row (-1:
 * forever); name "" clears every fault. Returns 0, or -1 when the table is full. */
EXPORT int cuemu_fail_call(const char *name, long long after, long long times, int code) {
    pthread_mutex_lock(&g_mu);
    int rc = 0;
    if (!name || !*name) {
        g_nfaults = 0;
    } else if (g_nfaults == (int)(sizeof g_faults / sizeof g_faults[0])) {
        rc = -1;
    } else {
        fault_t *f = &g_faults[g_nfaults++];
        snprintf(f->name, sizeof f->name, "%s", name);
        f->countdown = after;
        f->times = times;
        f->code = code;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* The message of the last violation ("" if none); clears the violation count when `clear`. */
EXPORT const char *cuemu_last_violation(int clear) {
    pthread_mutex_lock(&g_mu);
    static char copy[sizeof g_violation];
    memcpy(copy, g_violation, sizeof copy);
    if (clear) {
        st.violations = 0;
        g_violation[0] = 0;
    }
    pthread_mutex_unlock(&g_mu);
    return copy;
}

/* Destroy every primary context whatever its reference count (cuDevicePrimaryCtxReset for
 * all devices): what a test that leaked an environment left behind does not reach the next
 * test. Returns how many contexts were still retained. */
EXPORT int cuemu_reset_contexts(void) {
    pthread_mutex_lock(&g_mu);
    int n = 0;
    for (int d = 0; d < MAX_DEVICES; d++) {
        ctx_t *c = &g_dev[d].ctx;
        if (c->refs > 0 || c->active) {
            n += c->refs > 0;
            c->refs = 0;
            if (c->active) {
                sync_begin(c, "cuemu_reset_contexts", 0);
                ctx_reset(c, "its context was destroyed by cuemu_reset_contexts (the test "
                             "reset every context)");
                sync_end(c);
            }
        }
    }
    pthread_mutex_unlock(&g_mu);
    return n;
}

/* Restore the configuration (from the environment), clear faults and sticky errors. */
EXPORT void cuemu_reset(void) {
    pthread_mutex_lock(&g_mu);
    long long devices = cfg.devices;
    set_defaults();
    cfg.devices = devices; /* the device count is the caller's to change */
    g_nfaults = 0;
    memset(g_loop_tids, 0, sizeof g_loop_tids);
    st.loop_threads = 0;
    pthread_mutex_unlock(&g_mu);
}

/* Rule 5: mark thread `tid` (0: the calling thread) as an event loop. From then on any driver
 * call from it that has to wait (for the device: the synchronising calls, cuStreamSynchronize,
 * cuEventSynchronize, synchronous or large pageable copies; or behind another thread's
 * context-synchronising call) is a misuse, decided by the kind of call, never by timing.
 * Returns 0, or -1 when MAX_LOOP_THREADS are marked already. cuemu_reset unmarks all. */
EXPORT int cuemu_mark_loop_thread(long tid) {
    if (!tid)
        tid = my_tid();
    pthread_mutex_lock(&g_mu);
    int rc = -1;
    if (is_loop_thread(tid)) {
        rc = 0;
    } else {
        for (int i = 0; i < MAX_LOOP_THREADS; i++) {
            if (!g_loop_tids[i]) {
                g_loop_tids[i] = tid;
                st.loop_threads++;
                rc = 0;
                break;
            }
        }
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* Unmark thread `tid` (0: the calling thread); returns 1 if it was marked, else 0. */
EXPORT int cuemu_unmark_loop_thread(long tid) {
    if (!tid)
        tid = my_tid();
    pthread_mutex_lock(&g_mu);
    int rc = 0;
    for (int i = 0; i < MAX_LOOP_THREADS; i++) {
        if (g_loop_tids[i] == tid) {
            g_loop_tids[i] = 0;
            st.loop_threads--;
            rc = 1;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

EXPORT const char *cuemu_identity(void) {
    return "aioep CUDA driver emulator (a test double, not a GPU)";
}
