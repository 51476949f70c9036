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

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008
#endif

typedef void *(*xxh_create_fn)(void);
typedef int (*xxh_free_fn)(void *);
typedef int (*xxh_reset_fn)(void *);
typedef int (*xxh_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xxh_digest_fn)(const void *);

/* fns: XXH3_createState, XXH3_freeState, XXH3_64bits_reset, XXH3_64bits_update, XXH3_64bits_digest.
 * paths[i]: the block file; outs[i]: where its size bytes go, read chunk bytes at a time; expected:
 * n headers of header_size bytes, checksum field zeroed, at checksum_offset; page_size: the header
 * page's size.
 * Returns -1 if scratch memory could not be had (nothing read), else the number of status-0 blocks. */
int64_t kvt_read_warm(int64_t n, const char *const *paths, const uint64_t *outs, int64_t size,
                      int64_t chunk, const uint8_t *expected, int64_t header_size, int64_t checksum_offset,
                      int64_t page_size, int32_t *status, void *const *fns) {
    xxh_create_fn create = (xxh_create_fn)fns[0];
    xxh_free_fn release = (xxh_free_fn)fns[1];
    xxh_reset_fn reset = (xxh_reset_fn)fns[2];
    xxh_update_fn update = (xxh_update_fn)fns[3];
    xxh_digest_fn digest = (xxh_digest_fn)fns[4];
    uint8_t *page = malloc((size_t)page_size);
    void *state = page == NULL ? NULL : create();
    if (state == NULL) {
        free(page);
        return -1;
    }
    int64_t good = 0;
    const size_t tail = (size_t)(header_size - checksum_offset - 8);
    for (int64_t i = 0; i < n; i++) {
        status[i] = 2;
        int fd = open(paths[i], O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
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
        uint64_t stored = 0;
        for (int b = 7; b >= 0; b--) stored = (stored << 8) | page[checksum_offset + b];
        if (digest(state) == stored) {
            status[i] = 0;
            good++;
        }
    }
    release(state);
    free(page);
    return good;
}
