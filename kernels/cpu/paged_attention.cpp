// Paged attention for CPU over a step's flat batch of query rows. It first writes the step's
// new keys and values into their cache slots, then attends: keys and values are read in
// place from the block pool (no gather), and scores, softmax and the weighted sum are fused
// per (tile of rows, KV head). A row at position p attends to its sequence's first p + 1
// tokens: a decode to its whole context, a prefill row causally; with a sliding window W, only
// the last W of them (p - W + 1 onwards), and blocks wholly before a tile's window are never
// read (a hybrid KV cache lets them go). A soft-cap turns scores into cap * tanh(s / cap)
// before the softmax (Gemma 2). A head's sink (gpt-oss) is one more score in its softmax, with no
// value: the weights of the real keys sum to less than 1. Built and loaded by
// baton/kernels/cpu_kernels.py (plain C ABI, no torch headers, so it compiles in seconds);
// OpenMP threads come from the libgomp torch already loaded.
//
// The cache may hold another dtype than the queries (float32 or bf16): FP8 (e4m3 or e5m2), or
// bf16 under float32 queries. The step's keys and values then arrive in the cache's dtype
// already (kernels/kv_quant.py, the one writer), elements are widened as they are read, and an
// FP8 cache's per-KV-head scales are folded in: K's into the query's scale, V's into the
// softmax's 1 / sum.
//
// Layout (strides in elements): see struct Batch. A row's heads are contiguous, head_dim
// apart, in q, k, v, out and in a cache token; rows are *_row_stride apart.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include <omp.h>

// One call's arguments; cpu_kernels.Batch mirrors it field for field.
struct Batch {
    const void* q;  // [rows, kv_heads * group, head_dim]
    int64_t q_row_stride;
    const void* k;  // this step's keys [rows, kv_heads, head_dim]
    int64_t k_row_stride;
    const void* v;
    int64_t v_row_stride;
    void* k_cache;  // block b, token j, head h at b * block_stride + j * token_stride + h * head_dim
    void* v_cache;
    int64_t block_stride;
    int64_t token_stride;
    const int64_t* block_ids;        // the step's sequences' blocks, concatenated
    const int64_t* row_block_start;  // [rows] where the row's sequence's blocks start in block_ids
    const int64_t* positions;        // [rows]
    int64_t num_rows;
    int64_t num_block_ids;  // length of block_ids
    int64_t num_blocks;     // blocks in the cache
    int32_t num_kv_heads;
    int32_t group;
    int32_t head_dim;
    int32_t block_size;
    float scale;
    void* out;  // [rows, kv_heads * group, head_dim], contiguous
    int32_t window;  // a row sees the last `window` positions up to its own (0: all)
    float softcap;   // scores become softcap * tanh(score / softcap) (0: not capped)
    const float* sinks;  // [kv_heads * group] each query head's sink score (nullptr: none)
    int32_t cache_dtype;  // 0 float32, 1 bf16 (unscaled, whatever the queries'), 2 fp8 e4m3, 3 fp8 e5m2
    const float* k_scales;  // [kv_heads] an FP8 cache's K scale per head (nullptr: 1)
    const float* v_scales;
};

namespace {

struct bf16 { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
    uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
struct fp8_e4m3 { uint8_t bits; };
struct fp8_e5m2 { uint8_t bits; };

// FP8 to float by bit arithmetic the compiler vectorizes (a table lookup would not): a normal
// value's exponent and mantissa move into float's fields, rebiased; a subnormal one (exponent 0)
// is its mantissa times its smallest step. No NaN or infinity is ever stored (writers clamp).
template <int kExpBits>
inline float fp8_to_float(uint8_t byte) {
    constexpr int kManBits = 7 - kExpBits, kBias = (1 << (kExpBits - 1)) - 1;
    const uint32_t mag = byte & 0x7F;
    const uint32_t normal_bits = (mag << (23 - kManBits)) + (uint32_t(127 - kBias) << 23);
    float normal;
    std::memcpy(&normal, &normal_bits, 4);
    const float step = 1.0f / float(1u << (kBias - 1 + kManBits));  // 2^(1 - bias - mantissa bits)
    const float subnormal = float(int(mag & ((1u << kManBits) - 1))) * step;
    float value = (mag >> kManBits) ? normal : subnormal;
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    bits |= uint32_t(byte & 0x80) << 24;
    std::memcpy(&value, &bits, 4);
    return value;
}
inline float to_float(fp8_e4m3 x) { return fp8_to_float<4>(x.bits); }
inline float to_float(fp8_e5m2 x) { return fp8_to_float<5>(x.bits); }

inline void store(float* p, float x) { *p = x; }
inline void store(bf16* p, float x) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffff) > 0x7f800000) { p->bits = 0x7fc0; return; }  // NaN
    u += 0x7fff + ((u >> 16) & 1);
    p->bits = uint16_t(u >> 16);
}

// exp(x) for x <= 0 (scores minus their maximum), within 1 ulp of exp (checked over every
// float in [-87, 0]): Cephes' polynomial on a range-reduced argument. Written out so the
// compiler vectorizes the softmax loop; libm's vector expf would need -ffast-math, whose
// start-up code flushes denormals process-wide.
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;  // exp(-87) ~ 1.6e-38, still a normal float
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * r * r + r + 1.0f;
    const int32_t bits = (int32_t(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return e * scale;
}

constexpr int kMaxTileRows = 8;  // query rows of one sequence that share each K/V block read
constexpr int kMaxGroup = 16, kMaxHeadDim = 256, kMaxBlockSize = 256;
constexpr int kMaxQueries = kMaxTileRows * kMaxGroup;

// Eight floats; GCC and Clang lower it to AVX, SSE or NEON, or scalars, whatever -march allows.
typedef float v8 __attribute__((vector_size(32)));
inline v8 load8(const float* p) {
    v8 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

// Asks for the next block's rows of this head while the current one is computed: blocks are
// scattered, so the hardware prefetcher cannot guess where the next one is.
template <typename T>
inline void prefetch_block(const T* blk, int n, int64_t token_stride, int dl) {
    for (int j = 0; j < n; ++j)
        for (int d = 0; d < dl; d += 64 / int(sizeof(T))) __builtin_prefetch(blk + j * token_stride + d);
}

struct Tile {
    int64_t row;  // first row
    int rows;
};

// Per-thread buffers: queries, the transposed key block, and every query's scores (then
// weights) over the tile's context.
struct Scratch {
    float* qf;  // [queries rounded up to 4][D], scaled
    float* kt;  // [D][block_size]
    float* sc;  // [queries][ctx]
};

// Scores of one query row's `group` queries, key by key: dot products over D. For a decode
// the queries are too few to pay for transposing the block.
template <typename T, int D>
void score_row(const float* qf, int group, int dl, const T* k_blk, int n, int64_t token_stride, float* sc,
               int64_t ctx) {
    for (int j = 0; j < n; ++j) {
        const T* k = k_blk + j * token_stride;
        float kf[D > 0 ? D : kMaxHeadDim];
        for (int d = 0; d < dl; ++d) kf[d] = to_float(k[d]);
        for (int g = 0; g < group; ++g) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < dl; ++d) s += qf[g * dl + d] * kf[d];
            sc[g * ctx + j] = s;
        }
    }
}

// Scores of a tile's queries against one 16-key block: the block is transposed to [D][16]
// once, then each group of 4 queries accumulates 4 x 16 scores in registers, one D at a time.
template <typename T>
void score_tile16(const float* qf, int nq, int dl, const T* k_blk, int n, int64_t token_stride, float* kt,
                  float* sc, int64_t ctx) {
    for (int j = 0; j < 16; ++j)
        for (int d = 0; d < dl; ++d) kt[d * 16 + j] = j < n ? to_float(k_blk[j * token_stride + d]) : 0.f;
    for (int i = 0; i < nq; i += 4) {  // qf has zero rows up to a multiple of 4
        v8 s[4][2] = {};
        for (int d = 0; d < dl; ++d) {
            const v8 k0 = load8(kt + d * 16), k1 = load8(kt + d * 16 + 8);
            for (int u = 0; u < 4; ++u) {
                const float qd = qf[(i + u) * dl + d];
                s[u][0] += qd * k0;
                s[u][1] += qd * k1;
            }
        }
        for (int u = 0; u < 4 && i + u < nq; ++u) {
            float tmp[16];
            store8(tmp, s[u][0]);
            store8(tmp + 8, s[u][1]);
            std::memcpy(sc + (i + u) * ctx, tmp, sizeof(float) * n);
        }
    }
}

// Softmax of one query's scores over keys [lo, len), in place (soft-capped first when cap > 0),
// the `sink` score counted in the sum where there is one; weights outside are 0. Returns 1 / the
// sum of exponentials, applied to the output instead.
inline float softmax(float* s, int64_t lo, int64_t len, int64_t ctx, float cap, const float* sink) {
    if (cap > 0.f)
        for (int64_t t = lo; t < len; ++t) s[t] = cap * std::tanh(s[t] / cap);
    float m = s[lo];
#pragma omp simd reduction(max : m)
    for (int64_t t = lo + 1; t < len; ++t) m = s[t] > m ? s[t] : m;
    if (sink != nullptr && *sink > m) m = *sink;
    float sum = sink != nullptr ? exp_nonpositive(*sink - m) : 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = lo; t < len; ++t) {
        s[t] = exp_nonpositive(s[t] - m);
        sum += s[t];
    }
    for (int64_t t = 0; t < lo; ++t) s[t] = 0.f;
    for (int64_t t = len; t < ctx; ++t) s[t] = 0.f;
    return 1.f / sum;
}

// The first key a query at `pos` sees.
inline int64_t first_key(int64_t pos, int window) { return window > 0 && pos >= window ? pos - window + 1 : 0; }

// out[u] = inv_sum[u] * sum_t p[u][t] * V[t] for m <= kQueries queries at once, so each V row
// is read once for all of them; D in slices that keep the accumulators in registers.
template <typename T, typename C, int D>
void weighted_sums(const float* p, int64_t ctx, int m, int64_t lo, int64_t len, const C* v_cache,
                   const int64_t* table, int64_t block_stride, int64_t token_stride, int bs, int dl,
                   const float* inv_sum, T* const* outs) {
    constexpr int kSlice = D > 0 && D < 64 ? D : 64;
    constexpr int kQueries = 64 / kSlice;
    for (int c0 = 0; c0 < dl; c0 += kSlice) {
        const int cw = dl - c0 < kSlice ? dl - c0 : kSlice;
        float acc[kQueries][kSlice] = {};
        for (int64_t blk = lo / bs, t0 = blk * bs; t0 < len; t0 += bs, ++blk) {  // from the first block in use
            const C* v_blk = v_cache + table[blk] * block_stride + c0;
            const int n = len - t0 < bs ? int(len - t0) : bs;
            if (t0 + bs < len) prefetch_block(v_cache + table[blk + 1] * block_stride + c0, bs, token_stride, cw);
            for (int j = 0; j < n; ++j) {
                const C* v = v_blk + j * token_stride;
                if constexpr (kQueries == 1) {
                    const float w = p[t0 + j];
#pragma omp simd
                    for (int c = 0; c < (D > 0 ? kSlice : cw); ++c) acc[0][c] += w * to_float(v[c]);
                } else {
                    float vf[kSlice];
                    for (int c = 0; c < kSlice; ++c) vf[c] = to_float(v[c]);
                    for (int u = 0; u < kQueries; ++u) {
                        const float w = u < m ? p[u * ctx + t0 + j] : 0.f;
#pragma omp simd
                        for (int c = 0; c < kSlice; ++c) acc[u][c] += w * vf[c];
                    }
                }
            }
        }
        for (int u = 0; u < m; ++u)
            for (int c = 0; c < cw; ++c) store(outs[u] + c0 + c, acc[u][c] * inv_sum[u]);
    }
}

// Attention for `rows` consecutive query rows of one sequence and one KV head. A row's keys
// past its own context get zero weight. D or BS of 0: runtime sizes (a generic instance).
template <typename T, typename C, int D, int BS>
void attend_tile(const T* q, int64_t q_row_stride, int rows, const int64_t* positions, const C* k_cache,
                 const C* v_cache, const int64_t* table, int64_t block_stride, int64_t token_stride, int block_size,
                 int group, int head_dim, float scale, float v_scale, int window, float softcap, const float* sinks,
                 T* out, int64_t out_row_stride, const Scratch& buf) {
    const int dl = D > 0 ? D : head_dim;
    const int bs = BS > 0 ? BS : block_size;
    const int nq = rows * group;  // query i = row * group + g
    int64_t ctx = 0, lo = INT64_MAX;  // the longest context in the tile, the first key any row sees
    for (int r = 0; r < rows; ++r) {
        ctx = positions[r] + 1 > ctx ? positions[r] + 1 : ctx;
        lo = first_key(positions[r], window) < lo ? first_key(positions[r], window) : lo;
    }
    for (int i = 0; i < (nq + 3) / 4 * 4; ++i)
        for (int d = 0; d < dl; ++d)
            buf.qf[i * dl + d] = i < nq ? to_float(q[(i / group) * q_row_stride + (i % group) * dl + d]) * scale : 0.f;

    for (int64_t blk = lo / bs, t0 = blk * bs; t0 < ctx; t0 += bs, ++blk) {
        const C* k_blk = k_cache + table[blk] * block_stride;
        const int n = ctx - t0 < bs ? int(ctx - t0) : bs;
        if (t0 + bs < ctx) prefetch_block(k_cache + table[blk + 1] * block_stride, bs, token_stride, dl);
        if (BS == 16 && rows > 1)
            score_tile16(buf.qf, nq, dl, k_blk, n, token_stride, buf.kt, buf.sc + t0, ctx);
        else
            for (int r = 0; r < rows; ++r)
                score_row<C, D>(buf.qf + r * group * dl, group, dl, k_blk, n, token_stride,
                                buf.sc + r * group * ctx + t0, ctx);
    }
    float inv_sum[kMaxQueries];
    T* outs[kMaxQueries];
    for (int i = 0; i < nq; ++i) {
        const int64_t pos = positions[i / group];
        inv_sum[i] = v_scale * softmax(buf.sc + i * ctx, first_key(pos, window), pos + 1, ctx, softcap,
                                       sinks != nullptr ? sinks + i % group : nullptr);
        outs[i] = out + (i / group) * out_row_stride + (i % group) * dl;
    }
    constexpr int kQueries = D > 0 && D < 64 ? 64 / D : 1;
    for (int i = 0; i < nq; i += kQueries) {
        const int m = nq - i < kQueries ? nq - i : kQueries;
        int64_t len = 0, first = INT64_MAX;  // the longest context among these queries, the first key they see
        for (int u = i; u < i + m; ++u) {
            const int64_t pos = positions[u / group];
            len = pos + 1 > len ? pos + 1 : len;
            first = first_key(pos, window) < first ? first_key(pos, window) : first;
        }
        weighted_sums<T, C, D>(buf.sc + i * ctx, ctx, m, first, len, v_cache, table,
                            block_stride, token_stride, bs, dl, inv_sum + i, outs + i);
    }
}

// Returns 0, -2 for a row whose blocks are not all in block_ids or the cache, -3 when out of memory.
template <typename T, typename C, int D, int BS>
int attend_all(const Batch& b) {
    const T* q = static_cast<const T*>(b.q);
    C* k_cache = static_cast<C*>(b.k_cache);
    C* v_cache = static_cast<C*>(b.v_cache);
    T* out = static_cast<T*>(b.out);
    const int64_t num_rows = b.num_rows, kv_elems = int64_t(b.num_kv_heads) * b.head_dim;
    // Tiles: runs of up to kMaxTileRows rows of the same sequence (a decode is a tile of one).
    Tile* tiles = static_cast<Tile*>(std::malloc(sizeof(Tile) * (num_rows + 1)));
    if (tiles == nullptr) return -3;
    bool in_range = true;
    for (int64_t i = 0; i < b.num_block_ids; ++i) in_range &= b.block_ids[i] >= 0 && b.block_ids[i] < b.num_blocks;
    int64_t num_tiles = 0, max_ctx = 0;
    for (int64_t r = 0; r < num_rows && in_range; ++r) {
        // A row reads (and writes) block_ids[start .. start + pos / block_size], nothing else.
        const int64_t start = b.row_block_start[r];
        in_range = b.positions[r] >= 0 && start >= 0 && start + b.positions[r] / b.block_size < b.num_block_ids;
        max_ctx = b.positions[r] + 1 > max_ctx ? b.positions[r] + 1 : max_ctx;
        Tile* last = num_tiles ? &tiles[num_tiles - 1] : nullptr;
        if (last && b.row_block_start[r] == b.row_block_start[last->row] && last->rows < kMaxTileRows)
            ++last->rows;
        else
            tiles[num_tiles++] = Tile{r, 1};
    }
    if (!in_range) {
        std::free(tiles);
        return -2;
    }
    const size_t qf_floats = size_t(kMaxQueries + 4) * b.head_dim, kt_floats = size_t(b.head_dim) * b.block_size;
    const size_t sc_floats = size_t(kMaxTileRows) * b.group * (max_ctx + b.block_size);
    const int64_t out_row_stride = kv_elems * b.group;
    const size_t scratch_floats = qf_floats + kt_floats + sc_floats;
    float* scratch_all = static_cast<float*>(std::malloc(sizeof(float) * scratch_floats * omp_get_max_threads()));
    if (scratch_all == nullptr) {
        std::free(tiles);
        return -3;
    }
#pragma omp parallel
    {
        // The step's keys and values into their slots first: prefill rows attend to each other.
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_rows; ++r) {
            const int64_t pos = b.positions[r];
            const int64_t slot = b.block_ids[b.row_block_start[r] + pos / b.block_size] * b.block_stride +
                                 pos % b.block_size * b.token_stride;
            std::memcpy(k_cache + slot, static_cast<const C*>(b.k) + r * b.k_row_stride, sizeof(C) * kv_elems);
            std::memcpy(v_cache + slot, static_cast<const C*>(b.v) + r * b.v_row_stride, sizeof(C) * kv_elems);
        }
        float* scratch = scratch_all + scratch_floats * omp_get_thread_num();
        const Scratch buf{scratch, scratch + qf_floats, scratch + qf_floats + kt_floats};
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tiles; ++t)
            for (int h = 0; h < b.num_kv_heads; ++h) {
                const int64_t r = tiles[t].row, head = int64_t(h) * b.group * b.head_dim;
                const float k_scale = b.k_scales != nullptr ? b.k_scales[h] : 1.f;
                const float v_scale = b.v_scales != nullptr ? b.v_scales[h] : 1.f;
                attend_tile<T, C, D, BS>(q + r * b.q_row_stride + head, b.q_row_stride, tiles[t].rows, b.positions + r,
                                      k_cache + h * b.head_dim, v_cache + h * b.head_dim,
                                      b.block_ids + b.row_block_start[r], b.block_stride, b.token_stride,
                                      b.block_size, b.group, b.head_dim, b.scale * k_scale, v_scale, b.window,
                                      b.softcap,
                                      b.sinks != nullptr ? b.sinks + h * b.group : nullptr,
                                      out + r * out_row_stride + head, out_row_stride, buf);
            }
    }
    std::free(scratch_all);
    std::free(tiles);
    return 0;
}

template <typename T, typename C>
int dispatch(const Batch& b) {
#define BATON_ATTEND_D(D) return b.block_size == 16 ? attend_all<T, C, D, 16>(b) : attend_all<T, C, D, 0>(b)
    // Fixed sizes unroll and vectorize the inner loops: every common one where the cache holds the
    // queries' dtype; where it holds another, the real models' 64 and 128 only (each instance
    // costs the build seconds).
    constexpr bool kSame = std::is_same<T, C>::value;
    switch (b.head_dim) {
        case 16: if constexpr (kSame) { BATON_ATTEND_D(16); } break;
        case 32: if constexpr (kSame) { BATON_ATTEND_D(32); } break;
        case 64: BATON_ATTEND_D(64);
        case 128: BATON_ATTEND_D(128);
        default: break;
    }
    BATON_ATTEND_D(0);
#undef BATON_ATTEND_D
}

}  // namespace

extern "C" {

// dtype: the queries', 0 float32, 1 bfloat16; the cache's in the batch. Returns 0; -1 for an unsupported shape or dtype; -2 for a row
// whose blocks lie outside block_ids or the cache (nothing written); -3 when out of memory.
int baton_paged_attention(int dtype, const Batch* batch) {
    const Batch& b = *batch;
    if (b.group < 1 || b.group > kMaxGroup || b.head_dim < 1 || b.head_dim > kMaxHeadDim || b.block_size < 1 ||
        b.block_size > kMaxBlockSize)
        return -1;
    if (dtype != 0 && dtype != 1) return -1;
    switch (b.cache_dtype) {
        case 0: return dtype == 0 ? dispatch<float, float>(b) : -1;  // (a cache wider than bf16 queries: none)
        case 1: return dtype == 0 ? dispatch<float, bf16>(b) : dispatch<bf16, bf16>(b);
        case 2: return dtype == 0 ? dispatch<float, fp8_e4m3>(b) : dispatch<bf16, fp8_e4m3>(b);
        case 3: return dtype == 0 ? dispatch<float, fp8_e5m2>(b) : dispatch<bf16, fp8_e5m2>(b);
        default: return -1;
    }
}

}
