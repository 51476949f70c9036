/* The XXH3 streaming functions of the xxhash library the Python side already loads, whose addresses
 * host.py hands in as fns[0..4] (XXH3_createState, XXH3_freeState, XXH3_64bits_reset, the
 * CPU-dispatching XXH3_64bits_update, XXH3_64bits_digest), and the byte order of a stored checksum
 * (kvtier/codec.py packs it little-endian). Shared by fileread.c and redisio.c. */
#ifndef KVTIER_XXH3_FNS_H
#define KVTIER_XXH3_FNS_H

#include <stddef.h>
#include <stdint.h>

typedef void *(*xxh_create_fn)(void);
typedef int (*xxh_free_fn)(void *);
typedef int (*xxh_reset_fn)(void *);
typedef int (*xxh_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xxh_digest_fn)(const void *);

static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t value = 0;
    for (int b = 7; b >= 0; b--) value = (value << 8) | p[b];
    return value;
}

#endif
