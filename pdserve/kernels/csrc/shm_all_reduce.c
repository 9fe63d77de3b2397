/* All-reduce (sum) of the tensor-parallel ranks of one host through a shared segment
 * (pdserve/parallel/shm_all_reduce.py maps it). Layout: `world` flags of 64 bytes (each rank's sequence
 * number, alone on its cache line), then two banks of `world` slots of `slot_bytes`.
 *
 * Call `seq` (1, 2, ... the same on every rank, since every rank makes the same calls in the same
 * order) uses bank seq & 1: a rank copies its part into its slot, publishes seq, waits until every
 * rank has published seq, then sums the slots in rank order, so every rank gets the same bits. Two
 * banks make one wait per call enough: a rank that writes bank b at call seq + 2 has seen every rank
 * publish seq + 1, which each did only after reading bank b at call seq.
 *
 * The wait spins briefly, then yields the core (ranks may outnumber cores), then sleeps in short
 * naps. It gives up when a peer's process is gone or after timeout_s, so a dead rank is an error,
 * not a hang. Returns 0, or SHM_AR_TIMEOUT, or SHM_AR_PEER_GONE + the peer's rank. */

#include <errno.h>
#include <signal.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "bf16.h"

#define SHM_AR_TIMEOUT 1
#define SHM_AR_BAD_ARGS 2
#define SHM_AR_PEER_GONE 16
#define FLAG_BYTES 64

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Whether process `pid` has exited: gone, or a zombie its parent has not reaped yet (rank 0 is the
 * parent of the other ranks, so a rank that died stays a zombie while rank 0 waits on it). */
static int exited(int32_t pid) {
    if (kill(pid, 0) != 0) return errno == ESRCH;
    char path[64], stat[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0; /* cannot tell: keep waiting, the timeout still bounds it */
    size_t got = fread(stat, 1, sizeof stat - 1, f);
    fclose(f);
    stat[got] = 0;
    const char *state = strrchr(stat, ')'); /* "pid (comm) S ...": comm may hold spaces and parentheses */
    return state && (state[2] == 'Z' || state[2] == 'X');
}

/* Waits until `flag` reaches `seq` (pid 0: the peer's process cannot be watched, only the timeout). */
static int await_flag(const int64_t *flag, int64_t seq, int32_t pid, double timeout_s) {
    for (int i = 0; i < 4096; i++) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) >= seq) return 0;
        cpu_relax();
    }
    double start = now_s(), checked = start;
    struct timespec nap = {0, 50000}; /* 50 us */
    for (long i = 0;; i++) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) >= seq) return 0;
        if (i < 2000) {
            sched_yield();
            continue;
        }
        nanosleep(&nap, NULL);
        double t = now_s();
        if (t - checked > 0.1) {
            checked = t;
            if (pid > 0 && exited(pid)) return -1;
            if (t - start > timeout_s) return -2;
        }
    }
}

int shm_all_reduce(char *segment, int64_t slot_bytes, int rank, int world, int64_t seq, void *data,
                   int64_t n, int dtype, const int32_t *pids, double timeout_s) {
    int64_t elem = dtype == 0 ? 4 : 2;
    if (rank < 0 || rank >= world || n * elem > slot_bytes || (dtype != 0 && dtype != 1)) return SHM_AR_BAD_ARGS;
    char *bank = segment + (int64_t)world * FLAG_BYTES + (seq & 1) * (int64_t)world * slot_bytes;
    memcpy(bank + rank * slot_bytes, data, (size_t)(n * elem));
    __atomic_store_n((int64_t *)(segment + rank * FLAG_BYTES), seq, __ATOMIC_RELEASE);
    for (int r = 0; r < world; r++) {
        if (r == rank) continue;
        int got = await_flag((const int64_t *)(segment + r * FLAG_BYTES), seq, pids[r], timeout_s);
        if (got == -1) return SHM_AR_PEER_GONE + r;
        if (got == -2) return SHM_AR_TIMEOUT;
    }
    if (dtype == 0) {
        float *out = (float *)data;
        const float *first = (const float *)bank;
        for (int64_t i = 0; i < n; i++) out[i] = first[i];
        for (int r = 1; r < world; r++) {
            const float *part = (const float *)(bank + r * slot_bytes);
            for (int64_t i = 0; i < n; i++) out[i] += part[i];
        }
    } else {
        uint16_t *out = (uint16_t *)data;
        for (int64_t i = 0; i < n; i++) {
            float sum = 0.0f;
            for (int r = 0; r < world; r++) sum += bf16_in(((const uint16_t *)(bank + r * slot_bytes))[i]);
            out[i] = bf16_out(sum);
        }
    }
    return 0;
}
