/* A file tier's warm reads, a batch per call: open, one preadv2 of [header page, block] from the page
 * cache alone (RWF_NOWAIT), close, header compared with the one the key must carry, checksum checked.
 *
 * Why: from Python each block costs three syscalls that each give the GIL up and take it back, an
 * xxh3 object and a few dozen bytecodes; on two CPUs with the event loop and the I/O threads taking
 * turns with the GIL that was ~60 us of CPU per 256 KiB block over the copy itself
 * (benchmarks/bench_file_read_cpu.py). Here a batch runs with the GIL released for the whole call.
 *
 * Only the common case is decided here: status 0 means the block is in `out` and verified. Status 1:
 * not all of it is in the page cache; the kernel was asked to read it (POSIX_FADV_WILLNEED) and the
 * caller reads it later with plain reads. Status 2: anything else (missing, short, corrupt, not a
 * regular file, lz4, RWF_NOWAIT refused): the caller reads the block again the long way, which knows
 * every case. So this code never decides a block is bad, only that it is good.
 *
 * The checksum is the block's xxh3-64 over [expected header, payload], through the XXH3 streaming
 * functions of the xxhash library the Python side already loads (their addresses are passed in).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "xxh3_fns.h"

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008
#endif


/* The file of a block: prefix, the hash's first byte in hex ("00" for an empty hash), "/", the hash
 * in hex, suffix (the file tier's _block_path, kvtier/tiers/file.py). -1 if it does not fit. */
static int block_path(char *path, size_t room, const char *prefix, size_t prefix_len, const uint8_t *hash,
                      int64_t hash_len, const char *suffix, size_t suffix_len) {
    static const char digits[] = "0123456789abcdef";
    if (prefix_len + 3 + 2 * (size_t)hash_len + suffix_len + 1 > room) return -1;
    char *p = path;
    memcpy(p, prefix, prefix_len);
    p += prefix_len;
    p[0] = hash_len ? digits[hash[0] >> 4] : '0';
    p[1] = hash_len ? digits[hash[0] & 15] : '0';
    p[2] = '/';
    p += 3;
    for (int64_t b = 0; b < hash_len; b++) {
        *p++ = digits[hash[b] >> 4];
        *p++ = digits[hash[b] & 15];
    }
    memcpy(p, suffix, suffix_len + 1);
    return 0;
}

/* fns: XXH3_createState, XXH3_freeState, XXH3_64bits_reset, XXH3_64bits_update, XXH3_64bits_digest.
 * Block i's file is block_path(prefix, hashes + i * hash_len, suffix); outs[i]: where its size bytes
 * go, read chunk bytes at a time; expected: n headers of header_size bytes, checksum field zeroed,
 * at checksum_offset; page_size: the header page's size. Every status is set (2 where not read).
 * Returns -1 if scratch memory could not be had (nothing read), else the number of status-0 blocks. */
int64_t kvt_read_warm(int64_t n, const char *prefix, const uint8_t *hashes, int64_t hash_len, const char *suffix,
                      const uint64_t *outs, int64_t size, int64_t chunk, const uint8_t *expected,
                      int64_t header_size, int64_t checksum_offset, int64_t page_size, int32_t *status,
                      void *const *fns) {
    for (int64_t i = 0; i < n; i++) status[i] = 2;
    xxh_create_fn create = (xxh_create_fn)fns[0];
    xxh_free_fn release = (xxh_free_fn)fns[1];
    xxh_reset_fn reset = (xxh_reset_fn)fns[2];
    xxh_update_fn update = (xxh_update_fn)fns[3];
    xxh_digest_fn digest = (xxh_digest_fn)fns[4];
    const size_t path_room = 4096, prefix_len = strlen(prefix), suffix_len = strlen(suffix);
    uint8_t *page = malloc((size_t)page_size + path_room);
    void *state = page == NULL ? NULL : create();
    if (state == NULL) {
        free(page);
        return -1;
    }
    char *path = (char *)page + page_size;
    int64_t good = 0;
    const size_t tail = (size_t)(header_size - checksum_offset - 8);
    for (int64_t i = 0; i < n; i++) {
        if (block_path(path, path_room, prefix, prefix_len, hashes + i * hash_len, hash_len, suffix,
                       suffix_len) < 0)
            continue;
        int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0) continue;
        uint8_t *out = (uint8_t *)(uintptr_t)outs[i];
        const uint8_t *want = expected + i * header_size;
        int64_t step = size < chunk ? size : chunk;
        struct iovec iov[2] = {{page, (size_t)page_size}, {out, (size_t)step}};
        ssize_t got = preadv2(fd, iov, 2, 0, RWF_NOWAIT);
        int ok = got == page_size + step &&
                 memcmp(page, want, (size_t)checksum_offset) == 0 &&
                 memcmp(page + checksum_offset + 8, want + checksum_offset + 8, tail) == 0 &&
                 reset(state) == 0 && update(state, want, (size_t)header_size) == 0 &&
                 update(state, out, (size_t)step) == 0;
        /* the rest a chunk at a time, each hashed while it is still in the CPU's cache */
        for (int64_t offset = step; ok && offset < size; offset += step) {
            size_t piece = (size_t)(size - offset < step ? size - offset : step);
            struct iovec rest = {out + offset, piece};
            got = preadv2(fd, &rest, 1, page_size + offset, RWF_NOWAIT);
            ok = got == (ssize_t)piece && update(state, out + offset, piece) == 0;
        }
        if (got < 0 && errno == EAGAIN) {
            posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED);
            status[i] = 1;
        }
        close(fd);
        if (!ok) continue;
        if (digest(state) == load_le64(page + checksum_offset)) {
            status[i] = 0;
            good++;
        }
    }
    release(state);
    free(page);
    return good;
}

/* A pool of reader threads that run kvt_read_warm batches without Python: a batch is queued with
 * kvt_pool_submit, and when it is done its token (8 bytes) is written to notify_fd, a pipe the event
 * loop watches. No thread of the pool ever takes the GIL, so a read that finishes never waits for
 * the event loop to give the GIL up (with Python threads it waited up to the switch interval, 5 ms,
 * whenever the loop was busy) and the loop takes each completion in its own turn.
 *
 * The caller keeps every buffer a batch names alive until the batch's token comes back. */
#include <pthread.h>
#include <signal.h>

struct kvt_job {
    struct kvt_job *next;
    int64_t n, hash_len, size, chunk, header_size, checksum_offset, page_size;
    const char *prefix, *suffix;
    const uint8_t *hashes;
    const uint64_t *outs;
    const uint8_t *expected;
    int32_t *status;
    void *const *fns;
    uint64_t token;
};

struct kvt_pool {
    pthread_mutex_t lock;
    pthread_cond_t ready;
    struct kvt_job *head, *tail;
    int stopping, notify_fd;
    int64_t started;
    pthread_t threads[];
};

static void *kvt_pool_worker(void *arg) {
    struct kvt_pool *pool = arg;
    for (;;) {
        pthread_mutex_lock(&pool->lock);
        while (pool->head == NULL && !pool->stopping) pthread_cond_wait(&pool->ready, &pool->lock);
        struct kvt_job *job = pool->head;
        if (job != NULL) {
            pool->head = job->next;
            if (pool->head == NULL) pool->tail = NULL;
        }
        pthread_mutex_unlock(&pool->lock);
        if (job == NULL) return NULL; /* stopping, and the queue is empty */
        kvt_read_warm(job->n, job->prefix, job->hashes, job->hash_len, job->suffix, job->outs, job->size,
                      job->chunk, job->expected, job->header_size, job->checksum_offset, job->page_size,
                      job->status, job->fns);
        uint64_t token = job->token;
        free(job);
        while (write(pool->notify_fd, &token, sizeof token) < 0 && errno == EINTR) {
        }
    }
}

void kvt_pool_stop(void *handle);

/* nthreads readers that report to notify_fd (a blocking pipe's write end, 8-byte writes are atomic).
 * Returns NULL if no memory or no thread could be had. Signals are blocked in the readers: the
 * process's handlers run on its own threads, and a reader's syscalls are never interrupted. */
void *kvt_pool_start(int64_t nthreads, int64_t notify_fd) {
    if (nthreads <= 0) return NULL;
    struct kvt_pool *pool = calloc(1, sizeof *pool + (size_t)nthreads * sizeof(pthread_t));
    if (pool == NULL) return NULL;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->ready, NULL);
    pool->notify_fd = (int)notify_fd;
    sigset_t all, previous;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    for (; pool->started < nthreads; pool->started++)
        if (pthread_create(&pool->threads[pool->started], NULL, kvt_pool_worker, pool) != 0) break;
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    if (pool->started == 0) {
        kvt_pool_stop(pool);
        return NULL;
    }
    return pool;
}

/* Queue one batch (kvt_read_warm's arguments) whose token is written to notify_fd when it is done.
 * Returns 0, or -1 if no memory or the pool is stopping (then nothing was queued). */
int64_t kvt_pool_submit(void *handle, int64_t n, const char *prefix, const uint8_t *hashes, int64_t hash_len,
                        const char *suffix, const uint64_t *outs, int64_t size, int64_t chunk,
                        const uint8_t *expected, int64_t header_size, int64_t checksum_offset, int64_t page_size,
                        int32_t *status, void *const *fns, uint64_t token) {
    struct kvt_pool *pool = handle;
    struct kvt_job *job = malloc(sizeof *job);
    if (job == NULL) return -1;
    *job = (struct kvt_job){.n = n, .hash_len = hash_len, .size = size, .chunk = chunk,
                            .header_size = header_size, .checksum_offset = checksum_offset,
                            .page_size = page_size, .prefix = prefix, .suffix = suffix, .hashes = hashes,
                            .outs = outs, .expected = expected, .status = status, .fns = fns, .token = token};
    pthread_mutex_lock(&pool->lock);
    if (pool->stopping) {
        pthread_mutex_unlock(&pool->lock);
        free(job);
        return -1;
    }
    if (pool->tail == NULL) pool->head = job;
    else pool->tail->next = job;
    pool->tail = job;
    pthread_cond_signal(&pool->ready);
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

/* Let the readers finish every queued batch (each reported to notify_fd), join them, free the pool. */
void kvt_pool_stop(void *handle) {
    struct kvt_pool *pool = handle;
    pthread_mutex_lock(&pool->lock);
    pool->stopping = 1;
    pthread_cond_broadcast(&pool->ready);
    pthread_mutex_unlock(&pool->lock);
    for (int64_t i = 0; i < pool->started; i++) pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->ready);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}
