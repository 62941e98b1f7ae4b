/* stackwatch: where a governed trainer's threads are while a command waits to be seen.
 *
 * A diagnostic for bench/gpu_sharing.py (--diag). A thread polls words in memory: the governor
 * slot's CMD_T (when the daemon issued the pending command) and T_DETECT (when the trainer saw
 * it), and two words the trainer writes itself (an abort raised at, and handled at). While a
 * command has been pending and unseen for more than `thresh` ns, or an abort has been raised and
 * not yet handled for that long, it samples every other thread of the process every `period` ns
 * (at most `max_rounds` times per event): from /proc, the thread's state, its current system
 * call, wchan and kernel stack; then a real-time signal whose handler records the user stack
 * (backtrace) and when it ran (a thread inside an uninterruptible system call runs it only once
 * that call returns). sw_dump() writes one JSON line per sample, frames symbolised by dladdr.
 * Built by bench/stackwatch.py with cc; nothing here is part of the governor.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef unsigned long long u64;
#define MAXF 40

typedef struct {
    u64 trig_t, t_req, t_got;
    int kind, tid, n, round;
    char state;
    char comm[20], sysc[64], wchan[48], kstack[480];
    void *f[MAXF];
} Sample;

static Sample *S;
static int cap, n_s;
static volatile int cur = -1, done_slot = -1;
static volatile u64 *w_cmd_t, *w_det, *w_raise, *w_caught, *w_tids;   /* w_tids[0..1]: always signalled */
static u64 thresh_ns, period_ns;
static int max_rounds, sig;
static volatile int running;
static pthread_t th;
static pid_t watcher_tid;
static int deaf[64], n_deaf;   /* threads that did not answer the signal twice: not signalled again */
static int deaf_count[64], deaf_tid[64], n_dc;

static u64 now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (u64)t.tv_sec * 1000000000ull + (u64)t.tv_nsec;
}

static void handler(int s, siginfo_t *si, void *uc) {
    (void)s; (void)si; (void)uc;
    int i = cur;
    if (i >= 0 && S[i].tid == (int)syscall(SYS_gettid)) {   /* a late answer fills its own slot only */
        S[i].t_got = now_ns();
        S[i].n = backtrace(S[i].f, MAXF);
    }
    __atomic_store_n(&done_slot, i, __ATOMIC_RELEASE);
}

static void read_file(const char *path, char *buf, size_t len) {
    buf[0] = 0;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return;
    ssize_t r = read(fd, buf, len - 1);
    close(fd);
    if (r < 0) r = 0;
    buf[r] = 0;
    for (ssize_t k = 0; k < r; k++) {
        if (buf[k] == '\n') buf[k] = '|';
        else if (buf[k] == '"' || buf[k] == '\\' || (unsigned char)buf[k] < 32 || (unsigned char)buf[k] > 126) buf[k] = '_';
    }
}

static void sample_all(u64 trig, int kind, int round) {
    DIR *d = opendir("/proc/self/task");
    if (!d) return;
    struct dirent *e;
    pid_t pid = getpid();
    while ((e = readdir(d)) != NULL && n_s < cap) {
        int tid = atoi(e->d_name);
        if (tid <= 0 || tid == watcher_tid) continue;
        Sample *x = &S[n_s];
        memset(x, 0, sizeof *x);
        x->trig_t = trig; x->kind = kind; x->tid = tid; x->round = round; x->n = -1;
        char p[96], st[512];
        snprintf(p, sizeof p, "/proc/self/task/%d/stat", tid);
        read_file(p, st, sizeof st);
        char *rp = strrchr(st, ')');
        x->state = rp && rp[1] ? rp[2] : '?';
        snprintf(p, sizeof p, "/proc/self/task/%d/comm", tid);
        read_file(p, x->comm, sizeof x->comm);
        snprintf(p, sizeof p, "/proc/self/task/%d/syscall", tid);
        read_file(p, x->sysc, sizeof x->sysc);
        snprintf(p, sizeof p, "/proc/self/task/%d/wchan", tid);
        read_file(p, x->wchan, sizeof x->wchan);
        snprintf(p, sizeof p, "/proc/self/task/%d/stack", tid);
        read_file(p, x->kstack, sizeof x->kstack);
        int i = n_s++;
        /* user stacks: the trainer's own threads (main, backward), and any thread running or in
         * an uninterruptible wait; the rest (idle pools) only from /proc */
        int skip = !(tid == (int)w_tids[0] || tid == (int)w_tids[1] || x->state == 'R' || x->state == 'D');
        for (int k = 0; k < n_deaf; k++) skip |= deaf[k] == tid;
        if (skip) continue;
        __atomic_store_n(&done_slot, -1, __ATOMIC_RELEASE);
        cur = i;
        x->t_req = now_ns();
        if (syscall(SYS_tgkill, pid, tid, sig) != 0) { cur = -1; continue; }
        u64 limit = x->t_req + 5000000ull;   /* a thread in an uninterruptible call answers late */
        while (__atomic_load_n(&done_slot, __ATOMIC_ACQUIRE) != i && now_ns() < limit) {
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
        cur = -1;
        if (__atomic_load_n(&done_slot, __ATOMIC_ACQUIRE) != i) {
            int k = 0;
            while (k < n_dc && deaf_tid[k] != tid) k++;
            if (k == n_dc && n_dc < 64) { deaf_tid[n_dc] = tid; deaf_count[n_dc++] = 0; }
            if (k < 64 && ++deaf_count[k] >= 2 && n_deaf < 64) deaf[n_deaf++] = tid;
        }
    }
    closedir(d);
}

static void *watch(void *arg) {
    (void)arg;
    watcher_tid = (pid_t)syscall(SYS_gettid);
    u64 last_trig[2] = {0, 0}, next[2] = {0, 0};
    int rounds[2] = {0, 0};
    while (running) {
        u64 now = now_ns();
        u64 trig[2] = {0, 0};
        u64 c = *w_cmd_t, dt = *w_det;
        if (c && dt < c && now > c + thresh_ns) trig[0] = c;
        u64 r = *w_raise, h = *w_caught;
        if (r && h < r && now > r + thresh_ns) trig[1] = r;
        for (int k = 0; k < 2; k++) {
            if (!trig[k]) continue;
            if (trig[k] != last_trig[k]) { last_trig[k] = trig[k]; rounds[k] = 0; next[k] = 0; }
            if (rounds[k] < max_rounds && now >= next[k]) {
                sample_all(trig[k], k, rounds[k]);
                rounds[k]++;
                next[k] = now + period_ns;
            }
        }
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* words: CMD_T, T_DETECT (the governor slot), raise, caught, and two thread ids (the trainer's). */
int sw_start(u64 *cmd_t, u64 *det, u64 *raise_w, u64 *caught_w, u64 *tids, u64 thresh, u64 period,
             int rounds, int capacity) {
    void *pre[4];
    backtrace(pre, 4);   /* loads the unwinder now, not inside the first handler */
    S = calloc((size_t)capacity, sizeof *S);
    if (!S) return -1;
    cap = capacity;
    w_cmd_t = cmd_t; w_det = det; w_raise = raise_w; w_caught = caught_w; w_tids = tids;
    thresh_ns = thresh; period_ns = period; max_rounds = rounds;
    sig = SIGRTMIN + 5;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (sigaction(sig, &sa, NULL) != 0) return -2;
    running = 1;
    return pthread_create(&th, NULL, watch, NULL);
}

int sw_stop(void) {
    if (!running) return 0;
    running = 0;
    pthread_join(th, NULL);
    return n_s;
}

int sw_dump(const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    for (int i = 0; i < n_s; i++) {
        Sample *x = &S[i];
        fprintf(f, "{\"kind\":%d,\"trig_t\":%llu,\"t_req\":%llu,\"t_got\":%llu,\"round\":%d,\"tid\":%d,"
                "\"state\":\"%c\",\"comm\":\"%s\",\"syscall\":\"%s\",\"wchan\":\"%s\",\"kstack\":\"%s\",\"frames\":[",
                x->kind, x->trig_t, x->t_req, x->t_got, x->round, x->tid, x->state ? x->state : '?',
                x->comm, x->sysc, x->wchan, x->kstack);
        for (int k = 0; k < x->n; k++) {
            Dl_info di;
            if (k) fputc(',', f);
            if (dladdr(x->f[k], &di) && di.dli_fname) {
                const char *b = di.dli_fname;   /* the full path: symbolised later where it lives */
                fprintf(f, "\"%s+0x%lx", b, (unsigned long)((char *)x->f[k] - (char *)di.dli_fbase));
                if (di.dli_sname)
                    fprintf(f, " %s+0x%lx", di.dli_sname, (unsigned long)((char *)x->f[k] - (char *)di.dli_saddr));
                fputc('"', f);
            } else {
                fprintf(f, "\"%p\"", x->f[k]);
            }
        }
        fprintf(f, "]}\n");
    }
    fclose(f);
    return n_s;
}
