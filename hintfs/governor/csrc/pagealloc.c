/* hintfs page allocator: torch's CUDA allocator on top of 32 MiB physical pages (CUDA VMM).
 *
 * Why: torch's caching allocator gives memory back only with empty_cache(), which frees every
 * cached segment (cudaFree, ~1.2 ms/GB, and it synchronises the device). The governor needs to
 * give back exactly the bytes asked for, in milliseconds, and to hand physical pages to another
 * process. Here the training process's whole address space is one reserved virtual range; 32 MiB
 * physical pages are mapped into it on demand, and any page that holds no live block can be
 * unmapped and released (or lent to another process as a file descriptor) at once.
 *
 * Loaded by torch through CUDAPluggableAllocator (pa_malloc/pa_free have its ABI), and by
 * ctypes for control (pa_release, pa_lend, pa_stats). Two backends: the CUDA driver (libcuda,
 * dlopen'd, no headers needed) and host memory (memfd pages mapped with mmap), which has the same
 * page semantics and lets the allocator be tested on machines without a GPU.
 *
 * Layout: blocks come from two pools, small (<= 1 MiB) and large, as in torch's allocator, so
 * that long-lived small blocks do not pin pages in the middle of large ones. Each pool keeps its
 * free ranges sorted by address (best fit, coalescing on free). A page belongs to one pool while
 * mapped; `live` counts the bytes of allocated blocks on it, so a page with live == 0 is wholly
 * free and can go. Free ranges carry the stream that freed them and are reused only on that
 * stream (fresh or released memory has no stream), which is the caching allocator's rule.
 * One mutex: torch calls malloc/free from the main thread and from autograd's thread.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

typedef unsigned long long u64;

enum { BACKEND_CUDA = 0, BACKEND_HOST = 1 };
enum { POOL_NONE = -1, POOL_SMALL = 0, POOL_LARGE = 1 };
#define SMALL_MAX (1u << 20)
#define ROUND 512u

/* ------------------------------------------------------------------ CUDA driver, by dlsym */
typedef struct { int type; int id; } CuLocation;
typedef struct {
    int type, handle_types;
    CuLocation location;
    void *win32;
    unsigned char alloc_flags[8];
} CuAllocProp;
typedef struct { CuLocation location; int flags; } CuAccessDesc;

static struct {
    int (*init)(unsigned);
    int (*device_get)(int *, int);
    int (*primary_retain)(void **, int);
    int (*ctx_get)(void **);
    int (*ctx_set)(void *);
    int (*ctx_sync)(void);
    int (*reserve)(u64 *, size_t, size_t, u64, u64);
    int (*address_free)(u64, size_t);
    int (*create)(u64 *, size_t, const CuAllocProp *, u64);
    int (*map)(u64, size_t, size_t, u64, u64);
    int (*set_access)(u64, size_t, const CuAccessDesc *, size_t);
    int (*unmap)(u64, size_t);
    int (*release)(u64);
    int (*export_fd)(void *, u64, int, u64);
    int (*granularity)(size_t *, const CuAllocProp *, int);
} cu;

/* ------------------------------------------------------------------ state */
typedef struct { u64 start, len; void *stream; } Range;
typedef struct { Range *r; int n, cap; } RangeSet;

typedef struct {
    u64 handle;      /* CUDA: generic allocation handle; host: memfd */
    int fd;          /* exported at creation (pa_export_at_create), or -1 */
    int mapped;
    int unmap_pending;   /* lent with pa_lend_deferred: out of the books, still mapped here */
    int async_unmap;     /* released early: out of the books, being unmapped by a worker */
    int pool;
    u64 free_ep;     /* epoch of the last free of a block on this page (EP_DIRTY: unknown) */
    u64 live;        /* bytes of allocated blocks on this page */
} Page;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int backend = -1, device = 0;
static int export_at_create = 0;   /* export each page's fd when it is created, not when lent */
/* With HINTFS_PAGEALLOC_BATCH_UNMAP=1 a release unmaps each run of adjacent pages with one
 * cuMemUnmap (their handles released first) instead of one call per page (per page anyway if
 * the driver refuses the range). Off by default: on the H200 it made no difference (the cost
 * is per byte, about 1.4 ms/GiB to unmap), see bench/README.md. */
static int batch_unmap = 0;
/* Epochs, for releasing empty pages without synchronising the device (pa_release_idle): a free
 * stamps its pages with the current epoch; pa_mark() closes an epoch and the caller records a
 * CUDA event right after it, on `mark_stream`. Once that event has completed, every kernel
 * enqueued before a free of epoch <= the mark has finished (a block's kernels are enqueued
 * before its free, on the stream that frees it), so an empty page whose last free is that old
 * holds nothing any queued kernel still uses. A free on another stream makes its page
 * EP_DIRTY until the next full release (which synchronises). */
#define EP_DIRTY (~0ull)
static u64 cur_epoch = 1;
static void *mark_stream;
static int mark_stream_set = 0;
static void *cu_ctx;
static u64 page_bytes, va_base, va_bytes;
static int n_pages;
static Page *pages;
static RangeSet pools[2];
static CuAllocProp prop;
static CuAccessDesc access_desc;
static char last_error[256];

/* statistics, read by pa_stats */
static u64 st_allocated, st_peak, st_mapped, st_peak_mapped, st_allocs, st_frees, st_maps, st_unmaps,
    st_map_ns, st_unmap_ns, st_lent, st_oom, st_bytes_lent, st_unmap_calls, st_idle_bytes,
    st_handle_release_ns;

static u64 now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (u64)t.tv_sec * 1000000000ull + (u64)t.tv_nsec;
}

static void set_error(const char *what, int code) {
    snprintf(last_error, sizeof last_error, "%s failed (%d)", what, code);
}

/* ------------------------------------------------------------------ backend operations */
static int bk_create(u64 *h) {
    if (backend == BACKEND_CUDA) {
        int e = cu.create(h, page_bytes, &prop, 0);
        if (e) set_error("cuMemCreate", e);
        return e;
    }
    int fd = memfd_create("hintfs-page", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)page_bytes) != 0) {
        if (fd >= 0) close(fd);
        set_error("memfd_create", errno);
        return -1;
    }
    *h = (u64)fd;
    return 0;
}

static int bk_map(u64 va, u64 h) {
    if (backend == BACKEND_CUDA) {
        int e = cu.map(va, page_bytes, 0, h, 0);
        if (!e) e = cu.set_access(va, page_bytes, &access_desc, 1);
        if (e) set_error("cuMemMap", e);
        return e;
    }
    void *p = mmap((void *)va, page_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, (int)h, 0);
    if (p == MAP_FAILED) { set_error("mmap", errno); return -1; }
    return 0;
}

static int bk_unmap(u64 va, u64 len) {
    __atomic_fetch_add(&st_unmap_calls, 1, __ATOMIC_RELAXED);   /* workers unmap too */
    if (backend == BACKEND_CUDA) return cu.unmap(va, len);
    /* give the range back to the reservation: inaccessible, nothing behind it */
    void *p = mmap((void *)va, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? -1 : 0;
}

/* Unmap [va, va + len), a run of whole pages whose handles may already be released (their
 * memory goes once unmapped): one call, or one per page if the range is refused. */
static void unmap_run(u64 va, u64 len) {
    if (len == 0) return;
    if (batch_unmap && len > page_bytes && bk_unmap(va, len) == 0) return;
    for (u64 a = va; a < va + len; a += page_bytes) bk_unmap(a, page_bytes);
}

static int bk_release(u64 h) {
    if (backend == BACKEND_CUDA) return cu.release(h);
    return close((int)h);
}

static int bk_export(u64 h, int *fd) {
    if (backend == BACKEND_CUDA) return cu.export_fd(fd, h, 1 /* POSIX fd */, 0);
    *fd = dup((int)h);
    return *fd < 0 ? -1 : 0;
}

static void bk_sync(void) {
    if (backend == BACKEND_CUDA) cu.ctx_sync();
}

static void bk_make_current(void) {
    void *c = NULL;
    if (backend == BACKEND_CUDA && cu.ctx_get(&c) == 0 && c == NULL) cu.ctx_set(cu_ctx);
}

/* ------------------------------------------------------------------ unmap workers */
/* Pages released early (pa_release_idle) are taken out of the books under `mu`, then closed,
 * released and unmapped by worker threads that never take `mu`: torch's frees and mallocs go on
 * meanwhile (grow() skips pages with async_unmap set). pa_release waits for them before it
 * returns, so an ack never precedes the memory's return. With unmap_threads > 1 a full release
 * unmaps through the workers too, in parallel. */
static pthread_mutex_t qmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t q_work = PTHREAD_COND_INITIALIZER, q_done = PTHREAD_COND_INITIALIZER;
static int *q_pages;
static int q_len, q_outstanding, n_workers, unmap_threads = 1;
#define MAX_WORKERS 16

static void *unmap_worker(void *arg) {
    (void)arg;
    bk_make_current();
    pthread_mutex_lock(&qmu);
    for (;;) {
        while (q_len == 0) pthread_cond_wait(&q_work, &qmu);
        int p = q_pages[--q_len];
        pthread_mutex_unlock(&qmu);
        Page *pg = &pages[p];
        u64 t = now_ns();
        if (pg->fd >= 0) close(pg->fd);
        bk_release(pg->handle);
        u64 t1 = now_ns();
        unmap_run(va_base + (u64)p * page_bytes, page_bytes);
        __atomic_fetch_add(&st_handle_release_ns, t1 - t, __ATOMIC_RELAXED);
        __atomic_fetch_add(&st_unmap_ns, now_ns() - t1, __ATOMIC_RELAXED);
        pthread_mutex_lock(&qmu);
        if (--q_outstanding == 0) pthread_cond_broadcast(&q_done);
    }
    return NULL;
}

/* Hand page p (already out of the pools and the books) to the workers. */
static void enqueue_unmap(int p) {
    pthread_mutex_lock(&qmu);
    int want = unmap_threads < 1 ? 1 : unmap_threads > MAX_WORKERS ? MAX_WORKERS : unmap_threads;
    while (n_workers < want) {
        pthread_t th;
        if (pthread_create(&th, NULL, unmap_worker, NULL) != 0) break;
        pthread_detach(th);
        n_workers++;
    }
    if (n_workers == 0) {   /* no thread could start: unmap here */
        pthread_mutex_unlock(&qmu);
        Page *pg = &pages[p];
        if (pg->fd >= 0) close(pg->fd);
        bk_release(pg->handle);
        unmap_run(va_base + (u64)p * page_bytes, page_bytes);
        return;
    }
    q_pages[q_len++] = p;
    q_outstanding++;
    pthread_cond_signal(&q_work);
    pthread_mutex_unlock(&qmu);
}

/* Wait until the workers have unmapped every page handed to them; the caller holds `mu`. */
static void wait_unmaps_locked(void) {
    pthread_mutex_lock(&qmu);
    while (q_outstanding > 0) pthread_cond_wait(&q_done, &qmu);
    pthread_mutex_unlock(&qmu);
    for (int p = 0; p < n_pages; p++) {
        if (!pages[p].async_unmap) continue;
        pages[p].async_unmap = 0;
        pages[p].fd = -1;
        pages[p].handle = 0;
    }
}

/* ------------------------------------------------------------------ range sets */
static int rs_find(const RangeSet *s, u64 addr) { /* first index with start >= addr */
    int lo = 0, hi = s->n;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (s->r[mid].start < addr) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int rs_insert_at(RangeSet *s, int i, Range x) {
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 64;
        Range *r = realloc(s->r, (size_t)cap * sizeof(Range));
        if (!r) return -1;
        s->r = r;
        s->cap = cap;
    }
    memmove(&s->r[i + 1], &s->r[i], (size_t)(s->n - i) * sizeof(Range));
    s->r[i] = x;
    s->n++;
    return 0;
}

static void rs_remove_at(RangeSet *s, int i) {
    memmove(&s->r[i], &s->r[i + 1], (size_t)(s->n - i - 1) * sizeof(Range));
    s->n--;
}

/* Add a free range, merging with neighbours that touch it and carry the same stream. */
static int rs_add(RangeSet *s, u64 start, u64 len, void *stream) {
    int i = rs_find(s, start);
    if (i > 0 && s->r[i - 1].start + s->r[i - 1].len == start && s->r[i - 1].stream == stream) {
        s->r[i - 1].len += len;
        if (i < s->n && s->r[i].start == start + len && s->r[i].stream == stream) {
            s->r[i - 1].len += s->r[i].len;
            rs_remove_at(s, i);
        }
        return 0;
    }
    if (i < s->n && s->r[i].start == start + len && s->r[i].stream == stream) {
        s->r[i].start = start;
        s->r[i].len += len;
        return 0;
    }
    Range x = {start, len, stream};
    return rs_insert_at(s, i, x);
}

/* Remove [start, start+len) from the set; it must lie inside free ranges (possibly several). */
static int rs_cut(RangeSet *s, u64 start, u64 len) {
    u64 end = start + len;
    int i = rs_find(s, start);
    if (i > 0 && s->r[i - 1].start + s->r[i - 1].len > start) i--;
    while (i < s->n && s->r[i].start < end) {
        Range r = s->r[i];
        u64 rend = r.start + r.len;
        if (r.start < start && rend > end) { /* split in two */
            s->r[i].len = start - r.start;
            Range tail = {end, rend - end, r.stream};
            return rs_insert_at(s, i + 1, tail);
        }
        if (r.start < start) { s->r[i].len = start - r.start; i++; continue; }
        if (rend > end) { s->r[i].start = end; s->r[i].len = rend - end; return 0; }
        rs_remove_at(s, i);
    }
    return 0;
}

/* ------------------------------------------------------------------ pages */
static void live_add(u64 start, u64 len, int sign) {
    u64 end = start + len;
    for (u64 a = start; a < end;) {
        int p = (int)((a - va_base) / page_bytes);
        u64 pend = va_base + (u64)(p + 1) * page_bytes;
        u64 n = (end < pend ? end : pend) - a;
        if (sign > 0) pages[p].live += n; else pages[p].live -= n;
        a += n;
    }
}

static int map_page(int p, int pool) {
    u64 t = now_ns();
    bk_make_current();
    if (bk_create(&pages[p].handle)) return -1;
    if (bk_map(va_base + (u64)p * page_bytes, pages[p].handle)) {
        bk_release(pages[p].handle);
        return -1;
    }
    pages[p].mapped = 1;
    pages[p].pool = pool;
    pages[p].live = 0;
    pages[p].free_ep = 0;
    pages[p].fd = -1;
    if (export_at_create && bk_export(pages[p].handle, &pages[p].fd)) pages[p].fd = -1;
    st_mapped += page_bytes;
    if (st_mapped > st_peak_mapped) st_peak_mapped = st_mapped;
    st_maps++;
    st_map_ns += now_ns() - t;
    return 0;
}

/* Take an empty page out of its pool and release its handle (or lend it as `*lend_fd`, an fd
 * that keeps the memory alive for whoever imports it); the caller unmaps it, which is when
 * its physical memory goes back to the driver. */
static int detach_page(int p, int *lend_fd) {
    Page *pg = &pages[p];
    if (lend_fd) {   /* first, so that a failed export leaves the page as it was */
        if (pg->fd >= 0) { *lend_fd = pg->fd; pg->fd = -1; }   /* exported already: no driver call */
        else if (bk_export(pg->handle, lend_fd)) { set_error("export", -1); return -1; }
    } else if (pg->fd >= 0) {
        close(pg->fd);
        pg->fd = -1;
    }
    rs_cut(&pools[pg->pool], va_base + (u64)p * page_bytes, page_bytes);
    bk_release(pg->handle);
    pg->mapped = 0;
    pg->pool = POOL_NONE;
    pg->handle = 0;
    st_mapped -= page_bytes;
    st_unmaps++;
    return 0;
}

/* Unmap one empty page; its physical memory goes back to the driver, or to `*lend_fd`. */
static int unmap_page(int p, int *lend_fd) {
    u64 t = now_ns();
    if (detach_page(p, lend_fd)) return -1;
    unmap_run(va_base + (u64)p * page_bytes, page_bytes);
    __atomic_fetch_add(&st_unmap_ns, now_ns() - t, __ATOMIC_RELAXED);
    return 0;
}

/* Take empty page p out of its pool and the books; a worker closes its fd, releases its handle
 * and unmaps it (wait_unmaps_locked waits for that). */
static void detach_async(int p) {
    Page *pg = &pages[p];
    rs_cut(&pools[pg->pool], va_base + (u64)p * page_bytes, page_bytes);
    pg->mapped = 0;
    pg->pool = POOL_NONE;
    pg->async_unmap = 1;
    st_mapped -= page_bytes;
    st_unmaps++;
    enqueue_unmap(p);
}

/* Map `need` fresh pages contiguously for `pool`, as one free range (first fit over unmapped
 * pages; the reserved range is several times the device's memory, so runs are easy to find). */
static int grow(int pool, u64 need_bytes) {
    int need = (int)((need_bytes + page_bytes - 1) / page_bytes);
    int run = 0;
    for (int p = 0; p < n_pages; p++) {
        run = (pages[p].mapped || pages[p].unmap_pending || pages[p].async_unmap) ? 0 : run + 1;
        if (run == need) {
            int first = p - need + 1;
            for (int q = first; q <= p; q++) {
                if (map_page(q, pool)) { /* roll back the pages of this run */
                    for (int k = first; k < q; k++) {
                        rs_add(&pools[pool], va_base + (u64)k * page_bytes, page_bytes, NULL);
                        unmap_page(k, NULL);
                    }
                    return -1;
                }
            }
            return rs_add(&pools[pool], va_base + (u64)first * page_bytes, (u64)need * page_bytes, NULL);
        }
    }
    set_error("address space exhausted", need);
    return -1;
}

/* Unmap every empty page until at most `keep` bytes stay mapped; returns bytes unmapped.
 * Syncs the device first: a freed block's last kernels may still run (stream-ordered free). */
static u64 release_locked_d(u64 keep, int *lend_fds, int max_lend, int *n_lent, int defer);
static u64 release_locked(u64 keep, int *lend_fds, int max_lend, int *n_lent) {
    return release_locked_d(keep, lend_fds, max_lend, n_lent, 0);
}

/* `defer`: the pages leave the books and their fds are handed out, but this process's own
 * mappings stay until pa_finish_lend (after the ack): nothing here uses them any more (the
 * device was synchronised, their ranges are cut from the pools), and the physical memory
 * belongs to whoever holds the fds, so unmapping is bookkeeping of ours, not the handover. */
static u64 release_locked_d(u64 keep, int *lend_fds, int max_lend, int *n_lent, int defer) {
    u64 freed = 0;
    int lent = 0;
    bk_make_current();
    u64 ep = cur_epoch++;   /* frees up to `ep` came before the sync below: it covers them */
    bk_sync();
    u64 t = now_ns();
    int async = !lend_fds && !defer && unmap_threads > 1;   /* unmap through the workers */
    u64 run_lo = 0, run_hi = 0;   /* detached pages [run_lo, run_hi) not unmapped yet */
    for (int p = n_pages - 1; p >= 0 && st_mapped > keep; p--) {
        if (!pages[p].mapped || pages[p].live) continue;
        if (lend_fds && lent >= max_lend) break;
        if (async) {
            detach_async(p);
            freed += page_bytes;
            continue;
        }
        if (detach_page(p, lend_fds ? &lend_fds[lent] : NULL)) break;
        if (defer) {
            pages[p].unmap_pending = 1;
            if (lend_fds) lent++;
            freed += page_bytes;
            continue;
        }
        u64 va = va_base + (u64)p * page_bytes;
        if (run_hi && va + page_bytes == run_lo) run_lo = va;   /* extends the run downwards */
        else {
            unmap_run(run_lo, run_hi - run_lo);
            run_lo = va;
            run_hi = va + page_bytes;
        }
        if (lend_fds) lent++;
        freed += page_bytes;
    }
    unmap_run(run_lo, run_hi - run_lo);
    if (!async) __atomic_fetch_add(&st_unmap_ns, now_ns() - t, __ATOMIC_RELAXED);
    wait_unmaps_locked();   /* early releases (pa_release_idle) and this one's, if async */
    /* after a device sync nothing queued uses free memory: forget which stream freed it */
    for (int k = 0; k < 2; k++) {
        RangeSet *s = &pools[k];
        for (int i = 0; i < s->n; i++) s->r[i].stream = NULL;
        for (int i = 0; i + 1 < s->n;) {
            if (s->r[i].start + s->r[i].len == s->r[i + 1].start) {
                s->r[i].len += s->r[i + 1].len;
                rs_remove_at(s, i + 1);
            } else i++;
        }
    }
    for (int p = 0; p < n_pages; p++)   /* and every empty page is idle now */
        if (pages[p].free_ep <= ep || pages[p].free_ep == EP_DIRTY) pages[p].free_ep = 0;
    if (n_lent) *n_lent = lent;
    return freed;
}

/* Empty pages whose last free is covered by a completed event of mark `done` go, highest first,
 * until at most `keep` bytes stay mapped: out of the books now, unmapped by the workers while
 * the caller goes on (no device sync). Returns the bytes taken out. */
static u64 release_idle_locked(u64 keep, u64 done) {
    u64 freed = 0;
    for (int p = n_pages - 1; p >= 0 && st_mapped > keep; p--) {
        Page *pg = &pages[p];
        if (!pg->mapped || pg->live || pg->free_ep > done || pg->free_ep == EP_DIRTY) continue;
        detach_async(p);
        freed += page_bytes;
    }
    st_idle_bytes += freed;
    return freed;
}

/* Best fit among the pool's free ranges usable on `stream`; -1 if none. */
static int best_fit(const RangeSet *s, u64 size, void *stream) {
    int best = -1;
    for (int i = 0; i < s->n; i++) {
        const Range *r = &s->r[i];
        if (r->len < size || (r->stream && r->stream != stream)) continue;
        if (best < 0 || r->len < s->r[best].len) {
            best = i;
            if (r->len == size) break;
        }
    }
    return best;
}

static u64 round_size(u64 size) { return (size + ROUND - 1) / ROUND * ROUND; }

/* ------------------------------------------------------------------ the API */

/* backend: 0 CUDA, 1 host. va_bytes: the address range to reserve (0: 4x the device's memory,
 * or 64 GiB on the host backend). Returns 0, or -1 with pa_last_error(). */
int pa_init(int backend_kind, int dev, u64 page, u64 va) {
    pthread_mutex_lock(&mu);
    int rc = -1;
    if (backend >= 0) { snprintf(last_error, sizeof last_error, "already initialised"); goto out; }
    if (page == 0 || page % (2u << 20)) { snprintf(last_error, sizeof last_error, "page size must be a multiple of 2 MiB"); goto out; }
    device = dev;
    page_bytes = page;
    const char *bu = getenv("HINTFS_PAGEALLOC_BATCH_UNMAP");
    batch_unmap = bu && bu[0] == '1';
    const char *ut = getenv("HINTFS_PAGEALLOC_UNMAP_THREADS");
    if (ut && atoi(ut) > 0) unmap_threads = atoi(ut);
    if (backend_kind == BACKEND_CUDA) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (!lib) { snprintf(last_error, sizeof last_error, "cannot load libcuda.so.1"); goto out; }
#define SYM(field, name) if (!(*(void **)&cu.field = dlsym(lib, name))) { snprintf(last_error, sizeof last_error, "libcuda lacks %s", name); goto out; }
        SYM(init, "cuInit") SYM(device_get, "cuDeviceGet") SYM(primary_retain, "cuDevicePrimaryCtxRetain")
        SYM(ctx_get, "cuCtxGetCurrent") SYM(ctx_set, "cuCtxSetCurrent") SYM(ctx_sync, "cuCtxSynchronize")
        SYM(reserve, "cuMemAddressReserve") SYM(address_free, "cuMemAddressFree") SYM(create, "cuMemCreate")
        SYM(map, "cuMemMap") SYM(set_access, "cuMemSetAccess") SYM(unmap, "cuMemUnmap")
        SYM(release, "cuMemRelease") SYM(export_fd, "cuMemExportToShareableHandle")
        SYM(granularity, "cuMemGetAllocationGranularity")
#undef SYM
        int cdev, e;
        if ((e = cu.init(0)) || (e = cu.device_get(&cdev, dev)) || (e = cu.primary_retain(&cu_ctx, cdev))) {
            set_error("CUDA initialisation", e);
            goto out;
        }
        backend = BACKEND_CUDA;
        bk_make_current();
        memset(&prop, 0, sizeof prop);
        prop.type = 1;             /* CU_MEM_ALLOCATION_TYPE_PINNED */
        prop.handle_types = 1;     /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: pages can be lent */
        prop.location.type = 1;    /* CU_MEM_LOCATION_TYPE_DEVICE */
        prop.location.id = cdev;
        access_desc.location = prop.location;
        access_desc.flags = 3;     /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
        size_t gran = 0;
        if ((e = cu.granularity(&gran, &prop, 0)) || page % gran) {
            backend = -1;
            snprintf(last_error, sizeof last_error, "page size is not a multiple of the granularity (%zu)", gran);
            goto out;
        }
        if (va == 0) va = 512ull << 30;
        if ((e = cu.reserve(&va_base, va, page, 0, 0))) { backend = -1; set_error("cuMemAddressReserve", e); goto out; }
    } else {
        if (va == 0) va = 64ull << 30;
        void *p = mmap(NULL, va + page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) { set_error("mmap reserve", errno); goto out; }
        va_base = ((u64)p + page - 1) / page * page;
        backend = BACKEND_HOST;
    }
    va_bytes = va / page * page;
    n_pages = (int)(va_bytes / page);
    pages = calloc((size_t)n_pages, sizeof(Page));
    q_pages = calloc((size_t)n_pages, sizeof(int));
    for (int p = 0; p < n_pages; p++) { pages[p].pool = POOL_NONE; pages[p].fd = -1; }
    rc = 0;
out:
    pthread_mutex_unlock(&mu);
    return rc;
}

const char *pa_last_error(void) { return last_error; }

/* Export every page as an fd when it is created (one fd held per mapped page), so that lending
 * a page later costs no driver call on the shrink's critical path. Call before allocating. */
void pa_export_at_create(int on) {
    pthread_mutex_lock(&mu);
    export_at_create = on;
    pthread_mutex_unlock(&mu);
}

/* torch.cuda.memory.CUDAPluggableAllocator: void* alloc(ssize_t size, int device, cudaStream_t) */
void *pa_malloc(ssize_t size, int dev, void *stream) {
    (void)dev;
    if (size <= 0) return NULL;
    u64 n = round_size((u64)size);
    int pool = n <= SMALL_MAX ? POOL_SMALL : POOL_LARGE;
    pthread_mutex_lock(&mu);
    int i = best_fit(&pools[pool], n, stream);
    if (i < 0) {
        /* small blocks come from one page at a time; large ones from a run of fresh pages */
        if (grow(pool, pool == POOL_SMALL ? page_bytes : n)) {
            release_locked(0, NULL, 0, NULL); /* out of memory: give back every empty page, retry */
            if (grow(pool, pool == POOL_SMALL ? page_bytes : n)) {
                st_oom++;
                fprintf(stderr, "hintfs pagealloc: out of device memory for %lld bytes (%llu mapped): %s\n",
                        (long long)size, st_mapped, last_error);
                pthread_mutex_unlock(&mu);
                return NULL;
            }
        }
        i = best_fit(&pools[pool], n, stream);
    }
    Range *r = &pools[pool].r[i];
    u64 addr = r->start;
    if (r->len == n) rs_remove_at(&pools[pool], i);
    else { r->start += n; r->len -= n; }
    live_add(addr, n, +1);
    st_allocated += n;
    if (st_allocated > st_peak) st_peak = st_allocated;
    st_allocs++;
    pthread_mutex_unlock(&mu);
    return (void *)addr;
}

/* void free(void* ptr, ssize_t size, int device, cudaStream_t stream): stream-ordered, like
 * the caching allocator: the block is reused only by later work on the same stream. */
void pa_free(void *ptr, ssize_t size, int dev, void *stream) {
    (void)dev;
    if (!ptr || size <= 0) return;
    u64 n = round_size((u64)size);
    int pool = n <= SMALL_MAX ? POOL_SMALL : POOL_LARGE;
    pthread_mutex_lock(&mu);
    live_add((u64)ptr, n, -1);
    u64 ep = mark_stream_set && stream != mark_stream ? EP_DIRTY : cur_epoch;
    for (u64 a = (u64)ptr; a < (u64)ptr + n; a = (a - va_base) / page_bytes * page_bytes + va_base + page_bytes)
        pages[(a - va_base) / page_bytes].free_ep = ep;
    rs_add(&pools[pool], (u64)ptr, n, stream);
    st_allocated -= n;
    st_frees++;
    pthread_mutex_unlock(&mu);
}

/* Unmap empty pages until at most `keep_bytes` stay mapped. Returns the bytes released. */
u64 pa_release(u64 keep_bytes) {
    pthread_mutex_lock(&mu);
    u64 freed = backend < 0 ? 0 : release_locked(keep_bytes, NULL, 0, NULL);
    pthread_mutex_unlock(&mu);
    return freed;
}

/* Close an epoch (see cur_epoch): record an event on the mark stream right after this call,
 * and once it has completed pass the returned mark to pa_release_idle. */
u64 pa_mark(void) {
    pthread_mutex_lock(&mu);
    u64 m = cur_epoch++;
    pthread_mutex_unlock(&mu);
    return m;
}

/* The stream the caller records its mark events on; frees on other streams are never idle. */
void pa_set_mark_stream(void *stream) {
    pthread_mutex_lock(&mu);
    mark_stream = stream;
    mark_stream_set = 1;
    pthread_mutex_unlock(&mu);
}

/* Release empty pages that no queued kernel can use (their last free is covered by a
 * completed event of mark `done`) down to `keep_bytes`, without synchronising the device: the
 * pages leave the books now and are unmapped by worker threads while the caller goes on.
 * pa_release (which the ack must follow) waits for them. Returns the bytes taken out. */
u64 pa_release_idle(u64 keep_bytes, u64 done) {
    pthread_mutex_lock(&mu);
    u64 freed = backend < 0 ? 0 : release_idle_locked(keep_bytes, done);
    pthread_mutex_unlock(&mu);
    return freed;
}

/* Worker threads for unmapping (early releases always use them; with n > 1 full releases unmap
 * in parallel through them). Also HINTFS_PAGEALLOC_UNMAP_THREADS. */
void pa_set_unmap_threads(int n) {
    pthread_mutex_lock(&mu);
    if (n > 0) unmap_threads = n;
    pthread_mutex_unlock(&mu);
}

/* Like pa_release, but each released page becomes an fd in `fds` (at most `max_fds`) that
 * another process imports (cuMemImportFromShareableHandle, or mmap on the host backend).
 * The memory stays alive through the fd; this process no longer holds it. Returns the count. */
int pa_lend(u64 keep_bytes, int *fds, int max_fds) {
    int n = 0;
    pthread_mutex_lock(&mu);
    if (backend >= 0) {
        release_locked(keep_bytes, fds, max_fds, &n);
        st_lent += (u64)n;
        st_bytes_lent += (u64)n * page_bytes;
    }
    pthread_mutex_unlock(&mu);
    return n;
}

/* Lend like pa_lend, but leave the pages mapped here until pa_finish_lend (the caller acks
 * in between, so the unmap is off the shrink's critical path). */
int pa_lend_deferred(u64 keep_bytes, int *fds, int max_fds) {
    int n = 0;
    pthread_mutex_lock(&mu);
    if (backend >= 0) {
        release_locked_d(keep_bytes, fds, max_fds, &n, 1);
        st_lent += (u64)n;
        st_bytes_lent += (u64)n * page_bytes;
    }
    pthread_mutex_unlock(&mu);
    return n;
}

/* Unmap the pages pa_lend_deferred left mapped; returns how many. */
int pa_finish_lend(void) {
    int n = 0;
    pthread_mutex_lock(&mu);
    u64 t = now_ns();
    bk_make_current();
    for (int p = n_pages - 1; p >= 0; p--) {
        if (!pages[p].unmap_pending) continue;
        unmap_run(va_base + (u64)p * page_bytes, page_bytes);
        pages[p].unmap_pending = 0;
        n++;
    }
    __atomic_fetch_add(&st_unmap_ns, now_ns() - t, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&mu);
    return n;
}

/* out[0..18]: allocated, peak allocated, mapped, peak mapped, page bytes, allocs, frees, maps,
 * unmaps, map ns, unmap ns, pages lent, ooms, free ranges, va bytes, empty mapped pages,
 * unmap calls (fewer than unmaps when runs of pages were unmapped at once), bytes released
 * early (pa_release_idle), ns in handle releases on the workers. */
void pa_stats(u64 *out) {
    pthread_mutex_lock(&mu);
    u64 empty = 0;
    for (int p = 0; p < n_pages; p++) empty += pages[p].mapped && !pages[p].live;
    u64 v[19] = {st_allocated, st_peak, st_mapped, st_peak_mapped, page_bytes, st_allocs, st_frees,
                 st_maps, st_unmaps, st_map_ns, st_unmap_ns, st_lent,
                 st_oom, (u64)(pools[0].n + pools[1].n), va_bytes, empty, st_unmap_calls,
                 st_idle_bytes, st_handle_release_ns};
    memcpy(out, v, sizeof v);
    pthread_mutex_unlock(&mu);
}

/* Lock-free reads for the training client's safe points (aligned 8-byte loads are atomic). */
u64 pa_mapped(void) { return __atomic_load_n(&st_mapped, __ATOMIC_RELAXED); }
u64 pa_peak_allocated(void) { return __atomic_load_n(&st_peak, __ATOMIC_RELAXED); }

void pa_reset_peak(void) {
    pthread_mutex_lock(&mu);
    st_peak = st_allocated;
    st_peak_mapped = st_mapped;
    pthread_mutex_unlock(&mu);
}
