// Quantized weights to float32 rows, in one pass: the CPU path of a quantized linear layer
// dequantizes a tile of rows that fits in cache with this and multiplies by it (BLAS, through
// torch), so the weights stay as shipped in memory and no row is ever widened twice. Formats
// (engine/worker/quant/weights.py): integer codes of 4 bits (two to a byte, the low nibble the
// even column) or 8, with a scale and zero point per (row, group) and optionally act-order's
// g_idx; FP8 (e4m3, e5m2) with a float32 scale per (bo, bi) block; MXFP4 (E2M1 codes, a power of
// two per 32 values). Each value is computed as the PyTorch reference computes it, in float32:
// (code - zero) * scale, fp8 * scale, fp4 * 2^(e - 127).
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

// One weight (at one leading index: an expert); cpu_dequant.QuantRows mirrors it field for field.
struct QuantRows {
    int32_t format;  // 0 integer codes, 1 fp8 e4m3fn, 2 fp8 e5m2, 3 mxfp4
    int32_t bits;    // integer codes: 4 or 8
    const uint8_t* data;  // row r's bytes at data + r * row_bytes
    int64_t row_bytes;
    int64_t in_features;
    const void* scales;  // integer: [out, groups] of scale_dtype; fp8: float32 grid; mxfp4: uint8 [out, in / 32]
    int32_t scale_dtype;  // 0 float32, 1 bfloat16, 2 float16
    int64_t scale_row_stride;  // elements between rows of scales (and of zeros)
    const int16_t* zeros;  // integer: [out, groups], or nullptr: `zero` everywhere
    int32_t zero;
    const int32_t* g_idx;  // integer: each input column's group, or nullptr: column / group_size
    int32_t group_size;
    int32_t block_rows;  // fp8: the rows and columns one scale covers
    int32_t block_cols;
};

namespace {

float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

float half_to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0) {  // zero or subnormal: man * 2^-24
        return bits_to_float(sign) + (sign ? -1.0f : 1.0f) * std::ldexp(float(man), -24);
    }
    if (exp == 31) return bits_to_float(sign | 0x7F800000u | (man << 13));
    return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

float scale_at(const QuantRows& w, int64_t i) {
    switch (w.scale_dtype) {
        case 1: return bits_to_float(uint32_t(static_cast<const uint16_t*>(w.scales)[i]) << 16);
        case 2: return half_to_float(static_cast<const uint16_t*>(w.scales)[i]);
        default: return static_cast<const float*>(w.scales)[i];
    }
}

// Every byte's value as float8 e4m3fn and e5m2, and each E2M1 code's.
struct Tables {
    float e4m3[256], e5m2[256];
    Tables() {
        for (int b = 0; b < 256; ++b) {
            float sign = (b & 0x80) ? -1.0f : 1.0f;
            int e = (b >> 3) & 0xF, m = b & 0x7;
            e4m3[b] = (e == 15 && m == 7) ? NAN : sign * (e ? std::ldexp(1.0f + m / 8.0f, e - 7)
                                                             : std::ldexp(m / 8.0f, -6));
            int e5 = (b >> 2) & 0x1F, m5 = b & 0x3;
            e5m2[b] = e5 == 31 ? (m5 ? NAN : sign * INFINITY)
                               : sign * (e5 ? std::ldexp(1.0f + m5 / 4.0f, e5 - 15) : std::ldexp(m5 / 4.0f, -14));
        }
    }
};
const Tables tables;
const float FP4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                       -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

void integer_row(const QuantRows& w, int64_t r, float* __restrict out) {
    const uint8_t* codes = w.data + r * w.row_bytes;
    const int64_t n = w.in_features, base = r * w.scale_row_stride;
    if (w.g_idx) {  // act-order: any column in any group
        for (int64_t i = 0; i < n; ++i) {
            int code = w.bits == 4 ? (codes[i >> 1] >> ((i & 1) * 4)) & 0xF : codes[i];
            int64_t g = base + w.g_idx[i];
            out[i] = (float(code) - float(w.zeros ? w.zeros[g] : w.zero)) * scale_at(w, g);
        }
        return;
    }
    for (int64_t start = 0, g = 0; start < n; start += w.group_size, ++g) {
        const float s = scale_at(w, base + g), z = float(w.zeros ? w.zeros[base + g] : w.zero);
        const int64_t end = start + w.group_size < n ? start + w.group_size : n;
        if (w.bits == 4 && (start & 1) == 0) {
            int64_t i = start;
            for (; i + 1 < end; i += 2) {
                const uint8_t b = codes[i >> 1];
                out[i] = (float(b & 0xF) - z) * s;
                out[i + 1] = (float(b >> 4) - z) * s;
            }
            if (i < end) out[i] = (float(codes[i >> 1] & 0xF) - z) * s;
        } else if (w.bits == 4) {
            for (int64_t i = start; i < end; ++i) out[i] = (float((codes[i >> 1] >> ((i & 1) * 4)) & 0xF) - z) * s;
        } else {
            for (int64_t i = start; i < end; ++i) out[i] = (float(codes[i]) - z) * s;
        }
    }
}

void fp8_row(const QuantRows& w, int64_t r, float* __restrict out) {
    const uint8_t* v = w.data + r * w.row_bytes;
    const float* lut = w.format == 1 ? tables.e4m3 : tables.e5m2;
    const float* grid = static_cast<const float*>(w.scales) + (r / w.block_rows) * w.scale_row_stride;
    const int64_t n = w.in_features;
    for (int64_t start = 0, b = 0; start < n; start += w.block_cols, ++b) {
        const float s = grid[b];
        const int64_t end = start + w.block_cols < n ? start + w.block_cols : n;
        for (int64_t i = start; i < end; ++i) out[i] = lut[v[i]] * s;
    }
}

void mxfp4_row(const QuantRows& w, int64_t r, float* out) {
    const uint8_t* blocks = w.data + r * w.row_bytes;
    const uint8_t* exps = static_cast<const uint8_t*>(w.scales) + r * w.scale_row_stride;
    for (int64_t g = 0; g < w.in_features / 32; ++g) {
        const float s = std::ldexp(1.0f, int(exps[g]) - 127);
        for (int j = 0; j < 16; ++j) {
            const uint8_t b = blocks[g * 16 + j];
            out[g * 32 + 2 * j] = FP4[b & 0xF] * s;
            out[g * 32 + 2 * j + 1] = FP4[b >> 4] * s;
        }
    }
}

}  // namespace

extern "C" {

// Rows [row_start, row_end) of `w` as float32 into out ([rows, in_features], contiguous).
// Returns 0; -1 for an unknown format or bit width.
int baton_dequant_rows(const QuantRows* weight, int64_t row_start, int64_t row_end, float* out) {
    const QuantRows& w = *weight;
    if (w.format < 0 || w.format > 3 || (w.format == 0 && w.bits != 4 && w.bits != 8)) return -1;
    #pragma omp parallel for schedule(static)
    for (int64_t r = row_start; r < row_end; ++r) {
        float* dst = out + (r - row_start) * w.in_features;
        if (w.format == 0) integer_row(w, r, dst);
        else if (w.format == 3) mxfp4_row(w, r, dst);
        else fp8_row(w, r, dst);
    }
    return 0;
}

}  // extern "C"
