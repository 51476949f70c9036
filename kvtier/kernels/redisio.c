/* A Redis tier's raw-block GETs and SETs, a run of them per call on one connected socket, in RESP2.
 *
 * Why: from Python each block costs a few socket calls that each give the GIL up and take it back,
 * an xxh3 object and some hundred bytecodes; with the event loop and up to 16 I/O threads taking turns
 * with the GIL on two CPUs, that was most of the client's CPU per 256 KiB block (docs/redis.md). Here
 * a run of blocks goes with the GIL released for the whole call (ctypes releases it).
 *
 * Only the common case is decided here, as in fileread.c. A GET's status 0: the value was this key's
 * raw block (length, header byte for byte, checksum) and is in `out`; 1: the key is absent; 2: the
 * header matched and the checksum did not (the value is corrupt). Anything else (another length or
 * header, an lz4 value) is consumed and given status 3: the caller sends that request again the long
 * way, which knows every case. A SET's status 0: +OK. The first error reply (MOVED, OOM, NOAUTH, …)
 * gets status 5, its line is copied to `refusal` (NUL-terminated), no further request is sent and the
 * call returns 1 once the replies in flight are read (a later error reply gets 3): the caller decides
 * what the error means for the node. A negative return is a failed connection (the caller closes it):
 * -1 a timeout, -2 closed or reset, -3 a reply that is not RESP we expect, -4 no memory. Requests whose
 * reply was not read (not sent, or the connection failed) keep status 4: not done.
 *
 * `stop` is the caller's flag: once it is non-zero no further request is sent (the replies in flight
 * are still read), so a cancelled or failed batch ends after the requests already on the wire.
 *
 * The socket is the caller's: blocking, with kernel send/receive timeouts (SO_SNDTIMEO/SO_RCVTIMEO),
 * nothing buffered on the caller's side. Every reply to what a call sent is read before it returns, so
 * no byte of a later reply is ever taken from the caller.
 *
 * The checksum is xxh3-64 over [header with its checksum field zeroed, payload] (kvtier/codec.py),
 * through the XXH3 streaming functions of the xxhash library the Python side already loads.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "xxh3_fns.h"


enum { ST_OK = 0, ST_ABSENT = 1, ST_CORRUPT = 2, ST_AGAIN = 3, ST_NOT_DONE = 4, ST_REFUSED = 5 };
enum { E_TIMEOUT = -1, E_CLOSED = -2, E_PROTOCOL = -3, E_MEMORY = -4 };

#define BUF_SIZE (64 * 1024 + 4096)
#define MAX_LINE (64 * 1024)
#define FILL_STEP 4096

/* What was received and not yet consumed: reply lines and the first bytes of a value. */
struct conn {
    int fd;
    size_t start, end;
    uint8_t buf[BUF_SIZE];
};

static int recv_error(ssize_t got) {
    if (got == 0) return E_CLOSED;
    return errno == EAGAIN || errno == EWOULDBLOCK ? E_TIMEOUT : E_CLOSED;
}

/* Receive at least one more byte into the buffer (at most FILL_STEP). */
static int fill(struct conn *c) {
    if (c->start == c->end) c->start = c->end = 0;
    if (c->end + FILL_STEP > BUF_SIZE) {
        memmove(c->buf, c->buf + c->start, c->end - c->start);
        c->end -= c->start;
        c->start = 0;
    }
    for (;;) {
        ssize_t got = recv(c->fd, c->buf + c->end, FILL_STEP, 0);
        if (got > 0) {
            c->end += (size_t)got;
            return 0;
        }
        if (got < 0 && errno == EINTR) continue;
        return recv_error(got);
    }
}

/* The next reply line, without its CRLF: *line points into the buffer until the next receive. */
static int read_line(struct conn *c, const uint8_t **line, size_t *len) {
    size_t scanned = c->start;
    for (;;) {
        for (size_t i = scanned; i + 1 < c->end; i++) {
            if (c->buf[i] == '\r' && c->buf[i + 1] == '\n') {
                *line = c->buf + c->start;
                *len = i - c->start;
                c->start = i + 2;
                return 0;
            }
        }
        if (c->end - c->start > MAX_LINE) return E_PROTOCOL;
        size_t offset = c->end > c->start ? c->end - 1 - c->start : 0;
        int rc = fill(c);
        if (rc) return rc;
        scanned = c->start + offset;
    }
}

/* Fill dst exactly: what is buffered first, the rest straight from the socket. */
static int read_exact(struct conn *c, uint8_t *dst, size_t want) {
    size_t have = c->end - c->start;
    if (have > want) have = want;
    memcpy(dst, c->buf + c->start, have);
    c->start += have;
    while (have < want) {
        ssize_t got = recv(c->fd, dst + have, want - have, MSG_WAITALL);
        if (got > 0) have += (size_t)got;
        else if (!(got < 0 && errno == EINTR)) return recv_error(got);
    }
    return 0;
}

static int skip(struct conn *c, size_t n) {
    while (n) {
        if (c->start == c->end) {
            int rc = fill(c);
            if (rc) return rc;
        }
        size_t step = c->end - c->start < n ? c->end - c->start : n;
        c->start += step;
        n -= step;
    }
    return 0;
}

static int expect_crlf(struct conn *c) {
    while (c->end - c->start < 2) {
        int rc = fill(c);
        if (rc) return rc;
    }
    if (c->buf[c->start] != '\r' || c->buf[c->start + 1] != '\n') return E_PROTOCOL;
    c->start += 2;
    return 0;
}

static int send_all(int fd, struct iovec *iov, int count) {
    while (count > 0) {
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)count};
        ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) continue;
            return errno == EAGAIN || errno == EWOULDBLOCK ? E_TIMEOUT : E_CLOSED;
        }
        while (count > 0 && (size_t)sent >= iov->iov_len) {
            sent -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + sent;
            iov->iov_len -= (size_t)sent;
        }
    }
    return 0;
}

/* "$<digits>" → its value; -2 if the line is not that. */
static int64_t bulk_length(const uint8_t *line, size_t len) {
    if (len < 2 || line[0] != '$') return -2;
    if (len == 3 && line[1] == '-' && line[2] == '1') return -1;
    int64_t value = 0;
    for (size_t i = 1; i < len; i++) {
        if (line[i] < '0' || line[i] > '9' || value > (INT64_MAX - 9) / 10) return -2;
        value = value * 10 + (line[i] - '0');
    }
    return value;
}

/* The first error reply of a call, kept for the caller. */
struct refusal {
    char *text;
    size_t room;
    int seen;
};

/* An error reply: the first one is kept (status 5), any later one is sent again (3). */
static void refused(struct refusal *r, const uint8_t *line, size_t len, int32_t *status) {
    if (r->seen) {
        *status = ST_AGAIN;
        return;
    }
    size_t keep = len - 1 < r->room - 1 ? len - 1 : r->room - 1;
    memcpy(r->text, line + 1, keep);
    r->text[keep] = 0;
    r->seen = 1;
    *status = ST_REFUSED;
}

/* The reply to a request whose outcome is not decided here: an error line, or a bulk value skipped. */
static int other_reply(struct conn *c, const uint8_t *line, size_t len, struct refusal *r, int32_t *status) {
    if (len >= 1 && line[0] == '-') {
        refused(r, line, len, status);
        return 0;
    }
    int64_t size = bulk_length(line, len);
    if (size < -1) return E_PROTOCOL;
    *status = size < 0 ? ST_ABSENT : ST_AGAIN;
    return size < 0 ? 0 : skip(c, (size_t)size + 2);
}

struct hasher {
    void *state;
    xxh_reset_fn reset;
    xxh_update_fn update;
    xxh_digest_fn digest;
};

/* Read one GET's reply: into out (size bytes), its header compared with want. */
static int read_get_reply(struct conn *c, uint8_t *out, int64_t size, int64_t chunk, const uint8_t *want,
                          int64_t header_size, int64_t checksum_offset, struct hasher *h, struct refusal *r,
                          int32_t *status) {
    const uint8_t *line;
    size_t len;
    int rc = read_line(c, &line, &len);
    if (rc) return rc;
    int64_t length = bulk_length(line, len);
    if (length != header_size + size) return other_reply(c, line, len, r, status);
    uint8_t header[512]; /* header_size ≤ 512, checked by the caller */
    if ((rc = read_exact(c, header, (size_t)header_size))) return rc;
    const size_t tail = (size_t)(header_size - checksum_offset - 8);
    if (memcmp(header, want, (size_t)checksum_offset) != 0 ||
        memcmp(header + checksum_offset + 8, want + checksum_offset + 8, tail) != 0) {
        *status = ST_AGAIN;
        return skip(c, (size_t)size + 2);
    }
    if (h->reset(h->state) != 0 || h->update(h->state, want, (size_t)header_size) != 0) return E_MEMORY;
    /* the payload a chunk at a time, each hashed while it is still in the CPU's cache */
    for (int64_t offset = 0; offset < size; offset += chunk) {
        size_t piece = (size_t)(size - offset < chunk ? size - offset : chunk);
        if ((rc = read_exact(c, out + offset, piece))) return rc;
        if (h->update(h->state, out + offset, piece) != 0) return E_MEMORY;
    }
    if ((rc = expect_crlf(c))) return rc;
    *status = h->digest(h->state) == load_le64(header + checksum_offset) ? ST_OK : ST_CORRUPT;
    return 0;
}

static int stopped(const int32_t *stop) { return __atomic_load_n(stop, __ATOMIC_RELAXED) != 0; }

static int send_get(int fd, const uint8_t *key, size_t key_len) {
    char head[64];
    int n = snprintf(head, sizeof head, "*2\r\n$3\r\nGET\r\n$%zu\r\n", key_len);
    struct iovec iov[3] = {{head, (size_t)n}, {(void *)key, key_len}, {"\r\n", 2}};
    return send_all(fd, iov, 3);
}

/* A call's receive buffer over fd and its hash state; NULL if no memory. */
static struct conn *start_run(int64_t fd, struct hasher *h, void *const *fns) {
    struct conn *c = malloc(sizeof *c);
    if (c == NULL) return NULL;
    h->state = ((xxh_create_fn)fns[0])();
    if (h->state == NULL) {
        free(c);
        return NULL;
    }
    h->reset = (xxh_reset_fn)fns[2];
    h->update = (xxh_update_fn)fns[3];
    h->digest = (xxh_digest_fn)fns[4];
    c->fd = (int)fd;
    c->start = c->end = 0;
    return c;
}

static void end_run(struct conn *c, struct hasher *h, void *const *fns) {
    ((xxh_free_fn)fns[1])(h->state);
    free(c);
}

/* GET n keys (key i: keys[offsets[i]:offsets[i + 1]]) into outs[i] (sizes[i] bytes each), `depth`
 * requests in flight; expected: n headers of header_size bytes, checksum fields zeroed. Every status is
 * set. Returns 0, 1 after an error reply, or a negative failure (see the top of this file). */
int64_t kvt_redis_get(int64_t fd, int64_t n, const uint8_t *keys, const int64_t *offsets, const uint64_t *outs,
                      const int64_t *sizes, int64_t chunk, const uint8_t *expected, int64_t header_size,
                      int64_t checksum_offset, int64_t depth, int32_t *status, char *refusal,
                      int64_t refusal_room, const int32_t *stop, void *const *fns) {
    for (int64_t i = 0; i < n; i++) status[i] = ST_NOT_DONE;
    if (chunk <= 0 || depth <= 0 || checksum_offset + 8 > header_size || header_size > 512 || refusal_room < 1)
        return E_PROTOCOL;
    struct refusal r = {refusal, (size_t)refusal_room, 0};
    struct hasher h;
    struct conn *c = start_run(fd, &h, fns);
    if (c == NULL) return E_MEMORY;
    int rc = 0;
    int64_t sent = 0;
    for (int64_t done = 0; rc == 0 && done < n; done++) {
        while (rc == 0 && !r.seen && sent < n && sent - done < depth && !stopped(stop)) {
            rc = send_get(c->fd, keys + offsets[sent], (size_t)(offsets[sent + 1] - offsets[sent]));
            sent++;
        }
        if (rc != 0 || done == sent) break;
        rc = read_get_reply(c, (uint8_t *)(uintptr_t)outs[done], sizes[done], chunk, expected + done * header_size,
                            header_size, checksum_offset, &h, &r, &status[done]);
    }
    end_run(c, &h, fns);
    return rc != 0 ? rc : r.seen;
}

/* SET n keys to [header ‖ payload]: srcs[i] holds sizes[i] payload bytes, expected[i] the header with
 * its checksum field zeroed (the checksum is computed here and written into a copy). `tail` goes after
 * each value's CRLF (e.g. "$2\r\nPX\r\n$4\r\n1000\r\n", with nargs 5). Returns as kvt_redis_get. */
int64_t kvt_redis_set(int64_t fd, int64_t n, const uint8_t *keys, const int64_t *offsets, const uint64_t *srcs,
                      const int64_t *sizes, const uint8_t *expected, int64_t header_size, int64_t checksum_offset,
                      const uint8_t *tail, int64_t tail_len, int64_t nargs, int64_t depth, int32_t *status,
                      char *refusal, int64_t refusal_room, const int32_t *stop, void *const *fns) {
    for (int64_t i = 0; i < n; i++) status[i] = ST_NOT_DONE;
    if (depth <= 0 || checksum_offset + 8 > header_size || header_size > 512 || tail_len + 2 > 256 ||
        refusal_room < 1)
        return E_PROTOCOL;
    struct refusal r = {refusal, (size_t)refusal_room, 0};
    struct hasher h;
    struct conn *c = start_run(fd, &h, fns);
    if (c == NULL) return E_MEMORY;
    uint8_t header[512], end[256];
    end[0] = '\r';
    end[1] = '\n';
    memcpy(end + 2, tail, (size_t)tail_len);
    int rc = 0;
    int64_t sent = 0;
    for (int64_t done = 0; rc == 0 && done < n; done++) {
        while (rc == 0 && !r.seen && sent < n && sent - done < depth && !stopped(stop)) {
            const uint8_t *src = (const uint8_t *)(uintptr_t)srcs[sent];
            const uint8_t *want = expected + sent * header_size;
            size_t size = (size_t)sizes[sent], key_len = (size_t)(offsets[sent + 1] - offsets[sent]);
            if (h.reset(h.state) != 0 || h.update(h.state, want, (size_t)header_size) != 0 ||
                h.update(h.state, src, size) != 0) {
                rc = E_MEMORY;
                break;
            }
            uint64_t sum = h.digest(h.state);
            memcpy(header, want, (size_t)header_size);
            for (int b = 0; b < 8; b++) header[checksum_offset + b] = (uint8_t)(sum >> (8 * b));
            char head[96], mid[32];
            int head_len = snprintf(head, sizeof head, "*%d\r\n$3\r\nSET\r\n$%zu\r\n", (int)nargs, key_len);
            int mid_len = snprintf(mid, sizeof mid, "\r\n$%zu\r\n", (size_t)header_size + size);
            struct iovec iov[6] = {{head, (size_t)head_len}, {(void *)(keys + offsets[sent]), key_len},
                                   {mid, (size_t)mid_len}, {header, (size_t)header_size}, {(void *)src, size},
                                   {end, (size_t)tail_len + 2}};
            rc = send_all(c->fd, iov, 6);
            sent++;
        }
        if (rc != 0 || done == sent) break;
        const uint8_t *line;
        size_t len;
        if ((rc = read_line(c, &line, &len))) break;
        if (len == 3 && memcmp(line, "+OK", 3) == 0) status[done] = ST_OK;
        else if (len >= 1 && line[0] == '-') refused(&r, line, len, &status[done]);
        else rc = E_PROTOCOL;
    }
    end_run(c, &h, fns);
    return rc != 0 ? rc : r.seen;
}
