/* Row copies into a memory tier's slab with non-temporal (streaming) stores.
 *
 * Why: a block stored in a CPU tier is not read again soon, yet memcpy writes it through the CPU
 * caches: every destination line is first read from memory (read-for-ownership), then written back
 * later, evicting the engine's own data on the way. Streaming stores write whole lines straight to
 * memory. glibc only switches to them for copies larger than its non-temporal threshold (3/4 of the
 * shared cache, 192 MiB on the CI VMs), so a tier's 256 KiB-8 MiB copies never get them from memcpy.
 * Measured on a 2-CPU AMD EPYC VM: 256 KiB rows 6.6-7.3 GB/s with memcpy, 8.5-10.9 with this.
 *
 * Built at run time by kvtier/kernels/host.py with the system C compiler (as Triton builds its
 * launchers) and called through ctypes, which releases the GIL for the call. Plain C plus SSE2
 * intrinsics, which every x86-64 CPU has; elsewhere every copy is memmove. Overlapping rows are
 * copied with memmove too. Ends with a store fence: the rows are visible to every thread once a call
 * returns.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KVT_STREAMING 1
#else
#define KVT_STREAMING 0
#endif

int kvt_streaming(void) { return KVT_STREAMING; }

static void stream_row(char *dst, const char *src, size_t n) {
    if ((uintptr_t)dst < (uintptr_t)src + n && (uintptr_t)src < (uintptr_t)dst + n) {
        memmove(dst, src, n);
        return;
    }
#if KVT_STREAMING
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t lines = n / 64;
    for (size_t i = 0; i < lines; i++, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n - lines * 64);
#else
    memcpy(dst, src, n);
#endif
}

static void fence(void) {
#if KVT_STREAMING
    _mm_sfence();
#endif
}

/* rows of row_bytes from src + i * src_stride to dst + i * dst_stride (strides in bytes, any sign) */
void kvt_stream_strided(uintptr_t dst, int64_t dst_stride, uintptr_t src, int64_t src_stride,
                        int64_t rows, int64_t row_bytes) {
    for (int64_t i = 0; i < rows; i++)
        stream_row((char *)(dst + (uintptr_t)(i * dst_stride)),
                   (const char *)(src + (uintptr_t)(i * src_stride)), (size_t)row_bytes);
    fence();
}

/* rows of row_bytes from src + i * src_stride to the addresses dst[i] */
void kvt_stream_scatter(const uint64_t *dst, uintptr_t src, int64_t src_stride, int64_t rows,
                        int64_t row_bytes) {
    for (int64_t i = 0; i < rows; i++)
        stream_row((char *)(uintptr_t)dst[i], (const char *)(src + (uintptr_t)(i * src_stride)),
                   (size_t)row_bytes);
    fence();
}
