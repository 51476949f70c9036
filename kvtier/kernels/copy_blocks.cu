// kvtier block kernels: batched block copy and per-layer <-> cross-layer pack/unpack
// (docs/architecture.md#kernels).
//
// Compiled at run time by CuPy's NVRTC (kvtier/kernels/cuda.py) and by nvcc in CI
// (.ci/compile_kernels), so this file uses no host headers and only `extern "C" __global__` entry
// points. Host memory is reached through mapped (UVA) pointers of page-locked slots, so one launch
// moves many blocks in either direction: GPU <-> GPU, GPU -> pinned host, pinned host -> GPU.
//
// Every move is cut into *pieces* (one chunk of a block for copy_blocks; one (block, layer, K|V) slab of
// block_size x heads x head_dim for pack/unpack). A piece is `rows` rows of `row_bytes`; row r sits
// at (r / inner) * outer_stride + (r % inner) * inner_stride on each side, which covers both the
// contiguous case (rows = 1) and an NHD <-> HND transpose (rows of head_dim elements). Rows move in
// units of UNIT bytes (16: uint4, the normal case; smaller when an address or stride is not 16-byte
// aligned), and the row_bytes % UNIT tail moves byte by byte. One CUDA block handles one piece at a
// time (grid-stride over pieces); its threads walk the piece's units, so neighbouring threads touch
// neighbouring 16-byte words (coalesced). The host side (cuda.py) mirrors this address math in
// `piece_geometry` and `piece_byte_addresses`, which the CPU tests check against the torch reference.

// Launch shape, mirrored by THREADS and BLOCKS_PER_SM in cuda.py: at 4 resident blocks of 256
// threads per SM the kernels fit in 64 registers without spilling (checked by .ci/compile_kernels).
#define KVTIER_THREADS 256
#define KVTIER_BLOCKS_PER_SM 4
#define KVTIER_KERNEL extern "C" __global__ void __launch_bounds__(KVTIER_THREADS, KVTIER_BLOCKS_PER_SM)

typedef unsigned char u8;
typedef long long i64;

struct RowGeometry {
    i64 rows;          // rows per piece
    i64 row_bytes;     // bytes per row
    i64 inner;         // rows per outer step
    i64 src_outer;     // byte stride of the outer row index, source side
    i64 src_inner;     // byte stride of the inner row index, source side
    i64 dst_outer;     // byte stride of the outer row index, destination side
    i64 dst_inner;     // byte stride of the inner row index, destination side
};

template <typename T>
__device__ __forceinline__ void copy_piece(u8* __restrict__ dst, const u8* __restrict__ src, const RowGeometry& g) {
    const i64 units_per_row = g.row_bytes / (i64)sizeof(T);
    const i64 units = g.rows * units_per_row;
    if (g.rows == 1) {  // one contiguous span (the common case): no index division per access
        const T* s = reinterpret_cast<const T*>(src);
        T* d = reinterpret_cast<T*>(dst);
        for (i64 u = threadIdx.x; u < units; u += blockDim.x) d[u] = s[u];
    }
    for (i64 u = g.rows == 1 ? units : (i64)threadIdx.x; u < units; u += blockDim.x) {
        const i64 row = u / units_per_row;
        const i64 col = (u - row * units_per_row) * (i64)sizeof(T);
        const i64 outer = row / g.inner;
        const i64 inner = row - outer * g.inner;
        const T* s = reinterpret_cast<const T*>(src + outer * g.src_outer + inner * g.src_inner + col);
        T* d = reinterpret_cast<T*>(dst + outer * g.dst_outer + inner * g.dst_inner + col);
        *d = *s;
    }
    const i64 tail = g.row_bytes - units_per_row * (i64)sizeof(T);
    if (tail == 0) return;
    const i64 head = units_per_row * (i64)sizeof(T);
    for (i64 t = threadIdx.x; t < g.rows * tail; t += blockDim.x) {
        const i64 row = t / tail;
        const i64 col = head + (t - row * tail);
        const i64 outer = row / g.inner;
        const i64 inner = row - outer * g.inner;
        dst[outer * g.dst_outer + inner * g.dst_inner + col] = src[outer * g.src_outer + inner * g.src_inner + col];
    }
}

__device__ __forceinline__ void copy_piece_unit(u8* dst, const u8* src, const RowGeometry& g, int unit) {
    switch (unit) {
        case 16: copy_piece<uint4>(dst, src, g); break;
        case 8: copy_piece<unsigned long long>(dst, src, g); break;
        case 4: copy_piece<unsigned int>(dst, src, g); break;
        case 2: copy_piece<unsigned short>(dst, src, g); break;
        default: copy_piece<u8>(dst, src, g); break;
    }
}

// dst_base + dst_ids[i] * dst_stride  <-  src_base + src_ids[i] * src_stride, block_bytes each.
// Either base may be a mapped pinned-host pointer; base 0 with stride 1 makes the ids plain addresses.
// A piece is one chunk_bytes slice of a block (the last one shorter): cutting blocks into chunks keeps
// every SM busy when a call moves fewer blocks than the grid has CUDA blocks (64 blocks of 2 MiB left
// half of an H200's SMs idle with one piece per block). chunk_bytes is a multiple of 16, so a chunk
// starts as aligned as its block.
KVTIER_KERNEL kvtier_copy_blocks(const u8* __restrict__ src_base, const i64* __restrict__ src_ids,
                                 i64 src_stride, u8* __restrict__ dst_base,
                                 const i64* __restrict__ dst_ids, i64 dst_stride, i64 num_blocks,
                                 i64 block_bytes, i64 chunk_bytes, int unit) {
    RowGeometry g;
    g.rows = 1; g.inner = 1;
    g.src_outer = 0; g.src_inner = 0; g.dst_outer = 0; g.dst_inner = 0;
    const i64 chunks = (block_bytes + chunk_bytes - 1) / chunk_bytes;
    for (i64 p = blockIdx.x; p < num_blocks * chunks; p += gridDim.x) {
        const i64 i = p / chunks;
        const i64 offset = (p - i * chunks) * chunk_bytes;
        g.row_bytes = block_bytes - offset < chunk_bytes ? block_bytes - offset : chunk_bytes;
        copy_piece_unit(dst_base + dst_ids[i] * dst_stride + offset, src_base + src_ids[i] * src_stride + offset,
                        g, unit);
    }
}

// Pieces of pack/unpack: piece p = (i, layer, kv) with p = (i * num_layers + layer) * kv_factor + kv.
// Engine side: layer_ptrs[layer] + block_ids[i] * engine_block_stride + kv * engine_kv_stride.
// Cross-layer side: blocks + cross_ids[i] * blocks_stride + (layer * kv_factor + kv) * piece_bytes
// (blocks = 0, cross_ids = addresses, blocks_stride = 1 addresses scattered slots, e.g. CPU tier views).
struct PieceAddress {
    i64 engine;
    i64 cross;
};

__device__ __forceinline__ PieceAddress piece_address(i64 p, const unsigned long long* layer_ptrs, const i64* block_ids,
                                                      const i64* cross_ids, int num_layers, int kv_factor, i64 engine_block_stride,
                                                      i64 engine_kv_stride, i64 blocks_stride, i64 piece_bytes) {
    const i64 slab = p % ((i64)num_layers * kv_factor);  // layer * kv_factor + kv
    const i64 i = p / ((i64)num_layers * kv_factor);
    const i64 layer = slab / kv_factor;
    const i64 kv = slab - layer * kv_factor;
    PieceAddress a;
    a.engine = (i64)layer_ptrs[layer] + block_ids[i] * engine_block_stride + kv * engine_kv_stride;
    a.cross = cross_ids[i] * blocks_stride + slab * piece_bytes;
    return a;
}

// Rows of a piece: strided on the engine side, dense (row r at r * row_bytes) on the cross-layer side.
__device__ __forceinline__ RowGeometry engine_to_cross(i64 rows, i64 row_bytes, i64 inner, i64 engine_outer,
                                                       i64 engine_inner) {
    RowGeometry g;
    g.rows = rows; g.row_bytes = row_bytes; g.inner = inner;
    g.src_outer = engine_outer; g.src_inner = engine_inner;
    g.dst_outer = inner * row_bytes; g.dst_inner = row_bytes;
    return g;
}

__device__ __forceinline__ RowGeometry cross_to_engine(i64 rows, i64 row_bytes, i64 inner, i64 engine_outer,
                                                       i64 engine_inner) {
    RowGeometry g = engine_to_cross(rows, row_bytes, inner, engine_outer, engine_inner);
    g.src_outer = inner * row_bytes; g.src_inner = row_bytes;
    g.dst_outer = engine_outer; g.dst_inner = engine_inner;
    return g;
}

// Gather engine blocks `block_ids` of every layer into cross-layer blocks (device or mapped host).
KVTIER_KERNEL kvtier_pack_blocks(const unsigned long long* __restrict__ layer_ptrs,
                                 const i64* __restrict__ block_ids, i64 num_blocks, int num_layers,
                                 int kv_factor, i64 engine_block_stride, i64 engine_kv_stride,
                                 u8* __restrict__ blocks, const i64* __restrict__ cross_ids,
                                 i64 blocks_stride, i64 piece_bytes,
                                 i64 rows, i64 row_bytes, i64 inner, i64 engine_outer,
                                 i64 engine_inner, int unit) {
    const RowGeometry g = engine_to_cross(rows, row_bytes, inner, engine_outer, engine_inner);
    const i64 pieces = num_blocks * num_layers * kv_factor;
    for (i64 p = blockIdx.x; p < pieces; p += gridDim.x) {
        const PieceAddress a = piece_address(p, layer_ptrs, block_ids, cross_ids, num_layers, kv_factor,
                                             engine_block_stride, engine_kv_stride, blocks_stride, piece_bytes);
        copy_piece_unit(blocks + a.cross, reinterpret_cast<const u8*>(a.engine), g, unit);
    }
}

// Scatter cross-layer blocks back into engine blocks `block_ids` (ids must not repeat).
KVTIER_KERNEL kvtier_unpack_blocks(const unsigned long long* __restrict__ layer_ptrs,
                                   const i64* __restrict__ block_ids, i64 num_blocks, int num_layers,
                                   int kv_factor, i64 engine_block_stride, i64 engine_kv_stride,
                                   const u8* __restrict__ blocks, const i64* __restrict__ cross_ids,
                                   i64 blocks_stride, i64 piece_bytes,
                                   i64 rows, i64 row_bytes, i64 inner, i64 engine_outer,
                                   i64 engine_inner, int unit) {
    const RowGeometry g = cross_to_engine(rows, row_bytes, inner, engine_outer, engine_inner);
    const i64 pieces = num_blocks * num_layers * kv_factor;
    for (i64 p = blockIdx.x; p < pieces; p += gridDim.x) {
        const PieceAddress a = piece_address(p, layer_ptrs, block_ids, cross_ids, num_layers, kv_factor,
                                             engine_block_stride, engine_kv_stride, blocks_stride, piece_bytes);
        copy_piece_unit(reinterpret_cast<u8*>(a.engine), blocks + a.cross, g, unit);
    }
}
