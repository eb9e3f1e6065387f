// GGUF block formats to float32, one block at a time, in parallel over blocks.
//
// Each function reads one block (llama.cpp's layout: ggml-common.h) and writes its values in the
// order gguf-py's reference dequantizers (gguf/quants.py) produce them, with the same float32
// operations in the same order (d * q, then + m or - dmin * m), so the results are bit-identical
// to the reference: this file must be built with -ffp-contract=off (no a * b + c fused into one
// rounding). float16 scales are widened exactly (at::Half), subnormals included.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include "amx_tiles.h"
#endif

#include "gguf_unpack.h"

namespace {

using gguf::f16;
using gguf::k_scale_min;
using gguf::KVALUES_IQ4NL;
using gguf::QK_K;
#if defined(__AVX2__)
using gguf::fifth_bits32;
using gguf::hsum8;
using gguf::nibbles32;
#endif

// --- blocks of 32 ---------------------------------------------------------------------------------
void q4_0(const uint8_t* b, float* y) {  // d, qs[16]
    const float d = f16(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
        y[j] = d * static_cast<float>((qs[j] & 0x0F) - 8);
        y[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
}

void q4_1(const uint8_t* b, float* y) {  // d, m, qs[16]
    const float d = f16(b), m = f16(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
        y[j] = d * static_cast<float>(qs[j] & 0x0F) + m;
        y[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
}

void q5_0(const uint8_t* b, float* y) {  // d, qh (32 bits), qs[16]
    const float d = f16(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const uint8_t* qs = b + 6;
    for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = d * static_cast<float>(lo - 16);
        y[j + 16] = d * static_cast<float>(hi - 16);
    }
}

void q5_1(const uint8_t* b, float* y) {  // d, m, qh, qs[16]
    const float d = f16(b), m = f16(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    const uint8_t* qs = b + 8;
    for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = d * static_cast<float>(lo) + m;
        y[j + 16] = d * static_cast<float>(hi) + m;
    }
}

void q8_0(const uint8_t* b, float* y) {  // d, qs int8[32]
    const float d = f16(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

void iq4_nl(const uint8_t* b, float* y) {  // d, qs[16]: indices into a non-linear table
    const float d = f16(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
        y[j] = d * static_cast<float>(KVALUES_IQ4NL[qs[j] & 0x0F]);
        y[j + 16] = d * static_cast<float>(KVALUES_IQ4NL[qs[j] >> 4]);
    }
}

// --- super-blocks of 256 --------------------------------------------------------------------------
void q2_k(const uint8_t* b, float* y) {  // scales[16] (4-bit scale | 4-bit min), qs[64], d, dmin
    const uint8_t* sc = b;
    const uint8_t* qs = b + 16;
    const float d = f16(b + 80), dmin = f16(b + 82);
    for (int e = 0; e < QK_K; ++e) {
        const int h = e / 128, s = (e % 128) / 32, l = e % 32, g = e / 16;
        const float dl = d * static_cast<float>(sc[g] & 0x0F);
        const float ml = dmin * static_cast<float>(sc[g] >> 4);
        const int q = (qs[h * 32 + l] >> (2 * s)) & 3;
        y[e] = dl * static_cast<float>(q) - ml;
    }
}

void q3_k(const uint8_t* b, float* y) {  // hmask[32], qs[64], scales[12] (16 x 6 bits), d
    const uint8_t* hmask = b;
    const uint8_t* qs = b + 32;
    const uint8_t* sc = b + 96;
    const float d = f16(b + 108);
    float dl[16];
    for (int i = 0; i < 16; ++i) {
        const int lo = (sc[i % 8] >> (4 * (i / 8))) & 0x0F;
        const int hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 0x03;
        dl[i] = d * static_cast<float>(static_cast<int8_t>(lo | (hi << 4)) - 32);
    }
    for (int e = 0; e < QK_K; ++e) {
        const int h = e / 128, s = (e % 128) / 32, l = e % 32;
        const int ql = (qs[h * 32 + l] >> (2 * s)) & 3;
        const int qh = ((hmask[l] >> (e / 32)) & 1) ^ 1;  // a set bit means no offset
        y[e] = dl[e / 16] * static_cast<float>(ql - (qh << 2));
    }
}

// qh: Q5_K's fifth bits (bit `sub` of qh[l] for value l of sub-block `sub`); null for Q4_K
void k_quant_4_5(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, float* y) {
    const float d = f16(b), dmin = f16(b + 2);
    for (int sub = 0; sub < 8; ++sub) {
        int sc, m;
        k_scale_min(b + 4, sub, &sc, &m);
        const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
        const uint8_t* q = qs + (sub / 2) * 32;
        const int shift = 4 * (sub % 2);
        for (int l = 0; l < 32; ++l) {
            const int v = ((q[l] >> shift) & 0x0F) | (qh ? ((qh[l] >> sub) & 1) << 4 : 0);
            y[sub * 32 + l] = ds * static_cast<float>(v) - dm;
        }
    }
}

void q4_k(const uint8_t* b, float* y) { k_quant_4_5(b, nullptr, b + 16, y); }  // d, dmin, scales[12], qs[128]

void q5_k(const uint8_t* b, float* y) { k_quant_4_5(b, b + 16, b + 48, y); }  // ..., qh[32], qs[128]

void q6_k(const uint8_t* b, float* y) {  // ql[128], qh[64], scales int8[16], d
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    for (int e = 0; e < QK_K; ++e) {
        const int h = e / 128, r = e % 128;
        const int lo = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
        const int hi = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
        const float ds = d * static_cast<float>(sc[e / 16]);
        y[e] = ds * static_cast<float>(static_cast<int8_t>(lo | (hi << 4)) - 32);
    }
}

void iq4_xs(const uint8_t* b, float* y) {  // d, scales_h (16 bits), scales_l[4], qs[128]
    const float d = f16(b);
    uint16_t sh;
    std::memcpy(&sh, b + 2, 2);
    const uint8_t* sl = b + 4;
    const uint8_t* qs = b + 8;
    for (int ib = 0; ib < 8; ++ib) {
        const int lo = (sl[ib / 2] >> (4 * (ib % 2))) & 0x0F;
        const int hi = (sh >> (2 * ib)) & 0x03;
        const float dl = d * static_cast<float>(static_cast<int8_t>(lo | (hi << 4)) - 32);
        for (int j = 0; j < 16; ++j) {
            y[ib * 32 + j] = dl * static_cast<float>(KVALUES_IQ4NL[qs[ib * 16 + j] & 0x0F]);
            y[ib * 32 + j + 16] = dl * static_cast<float>(KVALUES_IQ4NL[qs[ib * 16 + j] >> 4]);
        }
    }
}

#if defined(__AVX2__)
// AVX2 versions of the types decode reads most. Each expands one block into vectors of 8 values
// and hands them to a sink with their offset in the block and their part (0-3) of a group of 32:
// a store (dequantization) or the fused dot products of the linear below. Same float32 operations in the same order as the loops above
// (a multiply, then an add or subtract, never fused), so the same bits.
inline __m256 f32x8(__m128i bytes8, bool is_signed) {  // the low 8 bytes of `bytes8` as floats
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}

enum Offset { kNone, kAdd, kSub };

// A sink with a `wide(base, lo, hi)` member takes 32 values at once as two 16-lane vectors (lo:
// values base..base+15), so the expanders run in 512-bit registers for it; others take 8 at a time.
template <class S, class = void>
constexpr bool kWideSink = false;
template <class S>
constexpr bool kWideSink<S, std::void_t<decltype(&S::wide)>> = true;

// values [base, base + 32) = scale(i) * v[i], then + off or - off (or neither: adding 0 would turn
// -0 into +0); v: 32 bytes; scale(i): lo16 for i < 16, hi16 after
template <class Sink>
inline void affine32(__m256i v, bool is_signed, __m256 lo16, __m256 hi16, __m256 off, Offset op, int base, Sink& sink) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if constexpr (kWideSink<Sink>) {  // the same operations 16 lanes at a time (scales and offsets are broadcasts)
        const __m128i a = _mm256_castsi256_si128(v), b = _mm256_extracti128_si256(v, 1);
        const __m512 o = _mm512_broadcastss_ps(_mm256_castps256_ps128(off));
        __m512 lo = _mm512_mul_ps(_mm512_broadcastss_ps(_mm256_castps256_ps128(lo16)),
                                  _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(a) : _mm512_cvtepu8_epi32(a)));
        __m512 hi = _mm512_mul_ps(_mm512_broadcastss_ps(_mm256_castps256_ps128(hi16)),
                                  _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b)));
        if (op == kAdd) lo = _mm512_add_ps(lo, o), hi = _mm512_add_ps(hi, o);
        if (op == kSub) lo = _mm512_sub_ps(lo, o), hi = _mm512_sub_ps(hi, o);
        sink.wide(base, lo, hi);
        return;
    }
#endif
    const __m128i a = _mm256_castsi256_si128(v), b = _mm256_extracti128_si256(v, 1);
    const __m128i parts[4] = {a, _mm_srli_si128(a, 8), b, _mm_srli_si128(b, 8)};
    for (int p = 0; p < 4; ++p) {
        const __m256 t = _mm256_mul_ps(p < 2 ? lo16 : hi16, f32x8(parts[p], is_signed));
        sink(base + 8 * p, p, op == kAdd ? _mm256_add_ps(t, off) : op == kSub ? _mm256_sub_ps(t, off) : t);
    }
}

struct Q4_0x {
    static constexpr int kValues = 32, kBytes = 18;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        const __m256 d = _mm256_set1_ps(f16(b)), zero = _mm256_setzero_ps();
        affine32(_mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)), true, d, d, zero, kNone, 0, sink);
    }
};

struct Q4_1x {
    static constexpr int kValues = 32, kBytes = 20;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        const __m256 d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(f16(b + 2));
        affine32(nibbles32(b + 4), false, d, d, m, kAdd, 0, sink);
    }
};

struct Q5_0x {
    static constexpr int kValues = 32, kBytes = 22;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        uint32_t qh;
        std::memcpy(&qh, b + 2, 4);
        const __m256 d = _mm256_set1_ps(f16(b)), zero = _mm256_setzero_ps();
        const __m256i v = _mm256_or_si256(nibbles32(b + 6), fifth_bits32(qh));
        affine32(_mm256_sub_epi8(v, _mm256_set1_epi8(16)), true, d, d, zero, kNone, 0, sink);
    }
};

struct Q5_1x {
    static constexpr int kValues = 32, kBytes = 24;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        uint32_t qh;
        std::memcpy(&qh, b + 4, 4);
        const __m256 d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(f16(b + 2));
        affine32(_mm256_or_si256(nibbles32(b + 8), fifth_bits32(qh)), false, d, d, m, kAdd, 0, sink);
    }
};

struct IQ4_NLx {
    static constexpr int kValues = 32, kBytes = 18;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(KVALUES_IQ4NL));
        const __m256i values = _mm256_shuffle_epi8(_mm256_set_m128i(table, table), nibbles32(b + 2));
        const __m256 d = _mm256_set1_ps(f16(b)), zero = _mm256_setzero_ps();
        affine32(values, true, d, d, zero, kNone, 0, sink);
    }
};

struct Q8_0x {
    static constexpr int kValues = 32, kBytes = 34;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        const __m256 d = _mm256_set1_ps(f16(b));
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if constexpr (kWideSink<Sink>) {
            const __m512 d16 = _mm512_set1_ps(f16(b));
            sink.wide(0, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))), d16),
                      _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))), d16));
            return;
        }
#endif
        const __m128i a = _mm256_castsi256_si128(v), c = _mm256_extracti128_si256(v, 1);
        const __m128i parts[4] = {a, _mm_srli_si128(a, 8), c, _mm_srli_si128(c, 8)};
        for (int p = 0; p < 4; ++p) sink(8 * p, p, _mm256_mul_ps(f32x8(parts[p], true), d));
    }
};

// Q4_K (qh null) and Q5_K (qh: the fifth bits, bit `sub` of qh[l] for value l of sub-block `sub`)
template <bool kFifthBit, class Sink>
inline void k_quant_4_5_run(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, Sink& sink) {
    const float d = f16(b), dmin = f16(b + 2);
    const __m256i high = kFifthBit ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)) : _mm256_setzero_si256();
    // the 8 sub-blocks' d * scale and dmin * min computed together, broadcast one at a time
    uint32_t sc, sc_hi, mn, mn_hi;
    gguf::k_scales_mins(b + 4, &sc, &sc_hi, &mn, &mn_hi);
    const __m256 dsv = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                         _mm_set_epi32(0, 0, static_cast<int>(sc_hi), static_cast<int>(sc)))));
    const __m256 dmv = _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                         _mm_set_epi32(0, 0, static_cast<int>(mn_hi), static_cast<int>(mn)))));
    for (int sub = 0; sub < 8; ++sub) {
        const __m256i at = _mm256_set1_epi32(sub);
        const __m256 ds = _mm256_permutevar8x32_ps(dsv, at), dm = _mm256_permutevar8x32_ps(dmv, at);
        const __m256i v = gguf::k45_values32<kFifthBit>(qs, high, sub);
        affine32(v, false, ds, ds, dm, kSub, sub * 32, sink);
    }
}

struct Q4_Kx {
    static constexpr int kValues = 256, kBytes = 144;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) { k_quant_4_5_run<false>(b, nullptr, b + 16, sink); }
};

struct Q5_Kx {
    static constexpr int kValues = 256, kBytes = 176;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) { k_quant_4_5_run<true>(b, b + 16, b + 48, sink); }
};

struct Q6_Kx {
    static constexpr int kValues = 256, kBytes = 210;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        const float d = f16(b + 208);
        const __m256i off = _mm256_set1_epi8(32);
        const __m256 zero = _mm256_setzero_ps();
        for (int h = 0; h < 2; ++h) {
            for (int c = 0; c < 4; ++c) {  // values h * 128 + c * 32 + l, l < 32
                const __m256i v = _mm256_sub_epi8(gguf::q6_k_values32(b, h, c), off);
                const int e = h * 128 + c * 32;
                const __m256 s0 = _mm256_set1_ps(d * static_cast<float>(sc[e / 16]));
                const __m256 s1 = _mm256_set1_ps(d * static_cast<float>(sc[e / 16 + 1]));
                affine32(v, true, s0, s1, zero, kNone, e, sink);
            }
        }
    }
};

template <class T>
void dequant_simd(const uint8_t* b, float* y) {
    auto store = [y](int off, int, __m256 v) { _mm256_storeu_ps(y + off, v); };
    T::run(b, store);
}

// Calls f(T{}) with the AVX2 expander of GGML type `type`; false where there is none.
template <class F>
bool with_expander(int64_t type, F&& f) {
    switch (type) {
        case 2: f(Q4_0x{}); return true;
        case 3: f(Q4_1x{}); return true;
        case 6: f(Q5_0x{}); return true;
        case 7: f(Q5_1x{}); return true;
        case 8: f(Q8_0x{}); return true;
        case 12: f(Q4_Kx{}); return true;
        case 13: f(Q5_Kx{}); return true;
        case 14: f(Q6_Kx{}); return true;
        case 20: f(IQ4_NLx{}); return true;
        default: return false;
    }
}
#endif

void f16_to_f32(const uint8_t* b, float* y) { *y = f16(b); }

void bf16_to_f32(const uint8_t* b, float* y) {
    uint16_t bits;
    std::memcpy(&bits, b, 2);
    *y = static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
}

void f32_copy(const uint8_t* b, float* y) { std::memcpy(y, b, 4); }

struct Format {
    void (*fn)(const uint8_t*, float*);
    int64_t block_size;  // values per block
    int64_t type_size;   // bytes per block
};

// keyed by GGMLQuantizationType
bool format_of(int64_t type, Format* f) {
    switch (type) {
        case 0: *f = {f32_copy, 1, 4}; return true;
        case 1: *f = {f16_to_f32, 1, 2}; return true;
#if defined(__AVX2__)
        case 2: case 3: case 6: case 7: case 8: case 12: case 13: case 14: case 20:
            return with_expander(type, [&](auto t) {
                using T = decltype(t);
                *f = {dequant_simd<T>, T::kValues, T::kBytes};
            });
#else
        case 2: *f = {q4_0, 32, 18}; return true;
        case 3: *f = {q4_1, 32, 20}; return true;
        case 6: *f = {q5_0, 32, 22}; return true;
        case 7: *f = {q5_1, 32, 24}; return true;
        case 8: *f = {q8_0, 32, 34}; return true;
        case 12: *f = {q4_k, 256, 144}; return true;
        case 13: *f = {q5_k, 256, 176}; return true;
        case 14: *f = {q6_k, 256, 210}; return true;
        case 20: *f = {iq4_nl, 32, 18}; return true;
#endif
        case 10: *f = {q2_k, 256, 84}; return true;
        case 11: *f = {q3_k, 256, 110}; return true;
        case 23: *f = {iq4_xs, 256, 136}; return true;
        case 30: *f = {bf16_to_f32, 1, 2}; return true;
        default: return false;
    }
}

}  // namespace

bool supported(int64_t type) {
    Format f;
    return format_of(type, &f);
}

// raw: the tensor's bytes (uint8, contiguous); returns float32 [raw.numel() / type_size * block_size]
torch::Tensor dequantize(torch::Tensor raw, int64_t type) {
    Format f;
    TORCH_CHECK(format_of(type, &f), "no dequantizer for GGML type ", type);
    TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.is_contiguous(), "raw must be contiguous uint8");
    const int64_t nbytes = raw.numel();
    TORCH_CHECK(nbytes % f.type_size == 0, "byte count ", nbytes, " is not a multiple of the block size ", f.type_size);
    const int64_t nblocks = nbytes / f.type_size;
    torch::Tensor out = torch::empty({nblocks * f.block_size}, torch::kFloat32);
    const uint8_t* src = raw.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    const int64_t grain = f.block_size >= 32 ? 256 : 65536;
    at::parallel_for(0, nblocks, grain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) f.fn(src + i * f.type_size, dst + i * f.block_size);
    });
    return out;
}

// --- weights kept in their blocks -------------------------------------------------------------------
// A weight [N, K] is its N rows of K / block_size blocks each (GGUF stores rows whole: K is the
// fastest dimension). The linear below never holds more than one tile of it in float.
namespace {

inline void dequant_row(const Format& f, const uint8_t* row, int64_t nblocks, float* y) {
    for (int64_t b = 0; b < nblocks; ++b) f.fn(row + b * f.type_size, y + b * f.block_size);
}

// sum_k a[k] * b[k]; fused multiply-adds through intrinsics (this file is built without contraction)
inline float dot(const float* a, const float* b, int64_t n) {
    int64_t k = 0;
    float s = 0.0f;
#if defined(__AVX512F__)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; k + 32 <= n; k += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(b + k + 16), acc1);
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
           acc3 = _mm256_setzero_ps();
    for (; k + 32 <= n; k += 32) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16), _mm256_loadu_ps(b + k + 16), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 24), _mm256_loadu_ps(b + k + 24), acc3);
    }
    const __m256 v = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    s = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
#endif
    for (; k < n; ++k) s += a[k] * b[k];
    return s;
}

// out[i * ldo] = x[i] . w for i < R: w is loaded once for all R rows. With AVX2, one accumulator
// per row fed in order, as dot_4x2 and the fused kernel sum: a row's result does not depend on R.
template <int R>
inline void dot_rows(const float* x, int64_t ldx, const float* w, int64_t n, float* out, int64_t ldo) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (n % 8 == 0) {
        __m256 acc[R];
        for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
        for (int64_t k = 0; k < n; k += 8) {
            const __m256 wv = _mm256_loadu_ps(w + k);
            for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k), wv, acc[i]);
        }
        for (int i = 0; i < R; ++i) out[i * ldo] = hsum8(acc[i]);
        return;
    }
#endif
    for (int i = 0; i < R; ++i) out[i * ldo] = dot(x + i * ldx, w, n);
}

// Input rows [i, m) dotted with one weight row w into column `col` of y [m, ldy].
inline void dot_tail(const float* x, int64_t i, int64_t m, int64_t k, const float* w, float* y, int64_t ldy, int64_t col) {
    for (; i + 4 <= m; i += 4) dot_rows<4>(x + i * k, k, w, k, y + i * ldy + col, ldy);
    switch (m - i) {
        case 3: dot_rows<3>(x + i * k, k, w, k, y + i * ldy + col, ldy); break;
        case 2: dot_rows<2>(x + i * k, k, w, k, y + i * ldy + col, ldy); break;
        case 1: dot_rows<1>(x + i * k, k, w, k, y + i * ldy + col, ldy); break;
        default: break;
    }
}

// 4 input rows times 2 weight rows (columns col, col + 1 of y): 8 sums, each loaded vector used
// twice or four times, so the loop is bound by its multiply-adds rather than by its loads. Returns
// the first input row it did not do (all of them where it runs).
inline int64_t dot_4x2(const float* x, int64_t m, int64_t k, const float* w0, const float* w1, float* y, int64_t ldy,
                       int64_t col) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (k % 8) return 0;
    for (; i + 4 <= m; i += 4) {
        __m256 a[4][2];
        for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
        const float* xi = x + i * k;
        for (int64_t c = 0; c < k; c += 8) {
            const __m256 v0 = _mm256_loadu_ps(w0 + c), v1 = _mm256_loadu_ps(w1 + c);
            for (int r = 0; r < 4; ++r) {
                const __m256 xv = _mm256_loadu_ps(xi + r * k + c);
                a[r][0] = _mm256_fmadd_ps(xv, v0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(xv, v1, a[r][1]);
            }
        }
        for (int r = 0; r < 4; ++r) {
            y[(i + r) * ldy + col] = hsum8(a[r][0]);
            y[(i + r) * ldy + col + 1] = hsum8(a[r][1]);
        }
    }
#else
    (void)x, (void)m, (void)k, (void)w0, (void)w1, (void)y, (void)ldy, (void)col;
#endif
    return i;
}

Format checked_format(const torch::Tensor& w, int64_t type, int64_t k) {
    Format f;
    TORCH_CHECK(format_of(type, &f), "no dequantizer for GGML type ", type);
    TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "weight blocks must be contiguous uint8 [N, row bytes]");
    TORCH_CHECK(k % f.block_size == 0 && w.size(1) == k / f.block_size * f.type_size,
                "weight rows of ", w.size(1), " bytes do not hold ", k, " values of GGML type ", type);
    return f;
}

#if defined(__AVX2__) && defined(__FMA__)
// out[r * ldo] = (weight row) . x[r] for r < R, without a buffer: each block is expanded once and
// its vectors go straight into every input row's accumulator. One accumulator per row, fed in the
// order of the values, whatever R is: a row's result does not depend on how many rows came with it
// (a speculative verify step computes bit for bit what decoding the same rows one by one would).
// The expansion, not the multiply-add chain, bounds R = 1.
template <class T, int R>
void fused_row(const uint8_t* row, int64_t nb, const float* x, int64_t ldx, float* out, int64_t ldo) {
    __m256 acc[R];
    const float* xr[R];  // one pointer per row, advanced a block at a time: the loads take offsets
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), xr[r] = x + r * ldx;
    for (int64_t b = 0; b < nb; ++b) {
        auto sink = [&](int off, int, __m256 w) {
            for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr[r] + off), acc[r]);
        };
        T::run(row + b * T::kBytes, sink);
        for (int r = 0; r < R; ++r) xr[r] += T::kValues;
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = hsum8(acc[r]);
}

constexpr int64_t kFusedRows = 8;  // input rows per pass over a weight row (their accumulators stay in registers)

template <class T>
void fused_linear(const uint8_t* wp, int64_t rb, int64_t n, int64_t nb, const float* xp, int64_t m, int64_t k, float* yp) {
    const int64_t groups = (m + kFusedRows - 1) / kFusedRows;
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
        for (int64_t j = begin; j < end; ++j) {
            const uint8_t* row = wp + j * rb;
            gguf::prefetch_ahead(row, rb, wp + end * rb);
            for (int64_t i = 0, g = groups; i < m; --g) {  // m rows in `groups` passes of near-equal size
                const int64_t rows = (m - i + g - 1) / g;
                const float* xi = xp + i * k;
                float* yi = yp + i * n + j;
                i += rows;
                switch (rows) {
                    case 1: fused_row<T, 1>(row, nb, xi, k, yi, n); break;
                    case 2: fused_row<T, 2>(row, nb, xi, k, yi, n); break;
                    case 3: fused_row<T, 3>(row, nb, xi, k, yi, n); break;
                    case 4: fused_row<T, 4>(row, nb, xi, k, yi, n); break;
                    case 5: fused_row<T, 5>(row, nb, xi, k, yi, n); break;
                    case 6: fused_row<T, 6>(row, nb, xi, k, yi, n); break;
                    case 7: fused_row<T, 7>(row, nb, xi, k, yi, n); break;
                    default: fused_row<T, 8>(row, nb, xi, k, yi, n); break;
                }
            }
        }
    });
}
#endif

// The types with AVX2 expanders: the fused kernel; false where there is none.
bool fused(int64_t type, const uint8_t* wp, int64_t rb, int64_t n, int64_t nb, const float* xp, int64_t m, int64_t k,
           float* yp) {
#if defined(__AVX2__) && defined(__FMA__)
    return with_expander(type, [&](auto t) { fused_linear<decltype(t)>(wp, rb, n, nb, xp, m, k, yp); });
#else
    (void)type, (void)wp, (void)rb, (void)n, (void)nb, (void)xp, (void)m, (void)k, (void)yp;
    return false;
#endif
}

#if defined(__AVX2__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define RADIXSERVE_GGUF_BF16 1
// bfloat16 inputs of a few to a few hundred rows: each weight row is expanded once into bfloat16 (the
// rounding a bfloat16 model's float weights had) and dotted with every input row by vdpbf16ps, 32
// products per instruction accumulated in float32, four weight rows against four input rows at a
// time. The block scales are folded into the expanded row, so the inner loop is loads and dot
// products only; every output element sums in the same order whatever M is.

// The expanders' sink for one bf16 row: each vector rounded to bfloat16 (to nearest even, as
// Tensor.to) where its values go.
struct Bf16Store {
    uint16_t* y;
    void operator()(int off, int, __m256 v) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + off), reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(v)));
    }
    void wide(int base, __m512 lo, __m512 hi) {
        _mm512_storeu_si512(y + base, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
};

template <class T>
void expand_bf16(const uint8_t* row, int64_t nb, uint16_t* y) {
    for (int64_t b = 0; b < nb; ++b) {
        Bf16Store store{y + b * T::kValues};
        T::run(row + b * T::kBytes, store);
    }
}

inline __m512bh load_bh(const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

template <int R, int W>
inline void dot_bf16(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t k, at::BFloat16* out, int64_t ldo) {
    __m512 acc[R][W];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < W; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 32) {
        __m512bh wv[W];
        for (int c = 0; c < W; ++c) wv[c] = load_bh(w[c] + i);
        for (int r = 0; r < R; ++r) {
            const __m512bh xv = load_bh(x + r * ldx + i);
            for (int c = 0; c < W; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < W; ++c) out[r * ldo + c] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[r][c]));
}

template <int W>
void dot_rows_bf16(const uint16_t* x, int64_t m, int64_t k, const uint16_t* const* w, at::BFloat16* y, int64_t n, int64_t j) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) dot_bf16<4, W>(x + r * k, k, w, k, y + r * n + j, n);
    switch (m - r) {
        case 1: dot_bf16<1, W>(x + r * k, k, w, k, y + r * n + j, n); break;
        case 2: dot_bf16<2, W>(x + r * k, k, w, k, y + r * n + j, n); break;
        case 3: dot_bf16<3, W>(x + r * k, k, w, k, y + r * n + j, n); break;
        default: break;
    }
}

template <class T>
void linear_bf16_rows(const uint8_t* wp, int64_t rb, int64_t n, const uint16_t* xp, int64_t m, int64_t k, at::BFloat16* yp) {
    const int64_t nb = k / T::kValues;
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
        std::vector<uint16_t> buf(4 * k);
        const uint16_t* rows[4] = {buf.data(), buf.data() + k, buf.data() + 2 * k, buf.data() + 3 * k};
        int64_t j = begin;
        for (; j + 4 <= end; j += 4) {  // weight rows in fours
            for (int c = 0; c < 4; ++c) {
                gguf::prefetch_ahead(wp + (j + c) * rb, rb, wp + end * rb);
                expand_bf16<T>(wp + (j + c) * rb, nb, buf.data() + c * k);
            }
            dot_rows_bf16<4>(xp, m, k, rows, yp, n, j);
        }
        for (; j < end; ++j) {
            expand_bf16<T>(wp + j * rb, nb, buf.data());
            dot_rows_bf16<1>(xp, m, k, rows, yp, n, j);
        }
    });
}

bool bf16_kernel(int64_t type, const uint8_t* wp, int64_t rb, int64_t n, const uint16_t* xp, int64_t m, int64_t k, at::BFloat16* yp) {
    if (k % 32) return false;
    return with_expander(type, [&](auto t) { linear_bf16_rows<decltype(t)>(wp, rb, n, xp, m, k, yp); });
}

// Weight rows [first, first + count) into a bf16 tile, each row expanded straight to bfloat16 (the
// values dequant_row + to_bf16 give, without the float row and the call per block between them);
// false for a type without an expander.
bool bf16_tile(int64_t type, const uint8_t* wp, int64_t rb, int64_t first, int64_t count, int64_t k, at::BFloat16* out) {
    if (k % 32) return false;
    return with_expander(type, [&](auto e) {
        using T = decltype(e);
        at::parallel_for(0, count, 4, [&](int64_t begin, int64_t end) {
            for (int64_t j = begin; j < end; ++j) {
                const uint8_t* row = wp + (first + j) * rb;
                gguf::prefetch_ahead(row, rb, wp + (first + end) * rb);
                expand_bf16<T>(row, k / T::kValues, reinterpret_cast<uint16_t*>(out + j * k));
            }
        });
    });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define RADIXSERVE_GGUF_AMX 1
// bfloat16 inputs of five to a thousand rows on a CPU with AMX: the weights are expanded to bf16 32
// rows at a time into a buffer that stays in L1/L2 and multiplied there by the tile unit, so no
// weight tile is written to memory and no GEMM library re-packs it. The expanded weight rows are
// the A operand (16 rows x 32 bf16 a tile, read in place), the inputs the B operand, packed once a
// call in the tile unit's pair layout: B row r of K chunk c holds, for each of 16 input rows, its
// values 32c + 2r and 32c + 2r + 1. A C tile is 16 weight rows x 16 input rows in float32,
// transposed into the output as it is stored. Each output element sums its K chunks in order, so
// an input row's result does not depend on the other rows of the call.

// Tiles 0-3: C (16 x 16 float32); 4-5: A (16 weight rows x 32 bf16); 6-7: B (16 pairs x 16 inputs).
// Set by each thread before its tiles: the configuration is per thread, and oneDNN sets its own.
inline void amx_configure() {
    amx::TileConfig c;
    for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

// Inputs [m, k] bf16 -> pair layout, 16 inputs per block (rows past m are zeros): B row r of a
// chunk gathers pair r of the chunk from each of the block's 16 inputs.
void amx_pack_inputs(const uint16_t* xp, int64_t m, int64_t k, uint32_t* packed) {
    const int64_t chunks = k / 32, blocks = (m + 15) / 16;
    const int* x32 = reinterpret_cast<const int*>(xp);
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(k / 2)));
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
            const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, m - b * 16)) - 1);
            const int* src = x32 + b * 16 * (k / 2);
            uint32_t* dst = packed + b * chunks * 256;
            for (int64_t kc = 0; kc < chunks; ++kc)
                for (int r = 0; r < 16; ++r)
                    _mm512_store_si512(dst + kc * 256 + r * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, rows,
                                                                                           src + kc * 16 + r, 4));
        }
    });
}

// C tile (16 weight rows x 16 inputs, float32) -> y[input][first weight row ...], rounded to bf16.
inline void amx_store(const float* c, int64_t inputs, int64_t wrows, at::BFloat16* y, int64_t ldy) {
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    const __mmask16 keep = static_cast<__mmask16>((1u << wrows) - 1);
    for (int64_t i = 0; i < inputs; ++i) {
        const __m512 v = _mm512_i32gather_ps(column, c + i, 4);
        const __m256bh h = _mm512_cvtneps_pbh(v);
        _mm256_mask_storeu_epi16(y + i * ldy, keep, reinterpret_cast<const __m256i&>(h));
    }
}

// The expander's sink for the A buffer: 32 weight rows laid out chunk by chunk (chunk c of row r,
// its values 32c..32c+31, at (32c + r) * 32), so each A tile is 1 KiB of consecutive bytes.
struct ChunkStore {
    uint16_t* a;  // the buffer
    int64_t row, chunk;  // the weight row, the first chunk of the block being expanded
    void operator()(int off, int, __m256 v) {
        uint16_t* y = a + ((chunk + off / 32) * 32 + row) * 32 + off % 32;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y), reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(v)));
    }
    void wide(int base, __m512 lo, __m512 hi) {
        _mm512_store_si512(a + ((chunk + base / 32) * 32 + row) * 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
};

template <class P>
P* aligned64(P* p) {
    return reinterpret_cast<P*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

template <class T>
void linear_amx(const uint8_t* wp, int64_t rb, int64_t n, const uint16_t* xp, int64_t m, int64_t k, at::BFloat16* yp) {
    const int64_t chunks = k / 32, blocks = (m + 15) / 16, nb = k / T::kValues;
    // 64-byte aligned, left uninitialized (every value is written before it is read): the
    // expander's 512-bit stores and the tile loads never split a cache line
    std::unique_ptr<uint32_t[]> storage(new uint32_t[blocks * chunks * 256 + 16]);
    uint32_t* packed = aligned64(storage.get());
    amx_pack_inputs(xp, m, k, packed);
    // A thread's weight blocks are expanded a group at a time (as many as fit in ~256 KiB of L2) and
    // each pair of input blocks is multiplied by every block of the group in turn: the packed inputs
    // are read once per group, not once per block, which is what large inputs are bound by.
    const int64_t group = std::clamp<int64_t>((256 << 10) / (32 * k * 2), 1, 8);
    at::parallel_for(0, (n + 31) / 32, 1, [&](int64_t begin, int64_t end) {
        amx_configure();
        std::unique_ptr<uint16_t[]> abuf(new uint16_t[group * 32 * k + 32]);
        uint16_t* const abase = aligned64(abuf.get());
        alignas(64) float c[4][256];
        const uint8_t* wend = wp + std::min(n, end * 32) * rb;
        for (int64_t g0 = begin; g0 < end; g0 += group) {
            const int64_t g1 = std::min(end, g0 + group);
            for (int64_t wb = g0; wb < g1; ++wb) {
                uint16_t* a = abase + (wb - g0) * 32 * k;
                const int64_t j0 = wb * 32, wrows = std::min<int64_t>(32, n - j0);
                for (int64_t r = 0; r < wrows; ++r) {
                    const uint8_t* row = wp + (j0 + r) * rb;
                    gguf::prefetch_ahead(row, rb, wend);
                    for (int64_t b = 0; b < nb; ++b) {
                        ChunkStore store{a, r, b * (T::kValues / 32)};
                        T::run(row + b * T::kBytes, store);
                    }
                }
                for (int64_t r = wrows; r < 32; ++r)
                    for (int64_t kc = 0; kc < chunks; ++kc) std::fill_n(a + (kc * 32 + r) * 32, 32, uint16_t{0});
            }
            for (int64_t b = 0; b < blocks; b += 2) {
                const uint32_t* b0 = packed + b * chunks * 256;
                const bool two = b + 1 < blocks;
                for (int64_t wb = g0; wb < g1; ++wb) {
                    const uint16_t* a0 = abase + (wb - g0) * 32 * k;
                    const uint16_t* a1 = a0 + 512;
                    const int64_t j0 = wb * 32, wrows = std::min<int64_t>(32, n - j0);
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    if (two) {
                        for (int64_t kc = 0; kc < chunks; ++kc) {
                            _tile_loadd(4, a0 + kc * 1024, 64);
                            _tile_loadd(5, a1 + kc * 1024, 64);
                            _tile_loadd(6, b0 + kc * 256, 64);
                            _tile_loadd(7, b0 + (chunks + kc) * 256, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(1, 4, 7);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    } else {
                        for (int64_t kc = 0; kc < chunks; ++kc) {
                            _tile_loadd(4, a0 + kc * 1024, 64);
                            _tile_loadd(5, a1 + kc * 1024, 64);
                            _tile_loadd(6, b0 + kc * 256, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(2, 5, 6);
                        }
                    }
                    _tile_stored(0, c[0], 64);
                    _tile_stored(1, c[1], 64);
                    _tile_stored(2, c[2], 64);
                    _tile_stored(3, c[3], 64);
                    for (int h = 0; h < 2; ++h) {
                        const int64_t rows_h = std::min<int64_t>(16, wrows - h * 16);
                        if (rows_h <= 0) continue;
                        for (int s = 0; s < (two ? 2 : 1); ++s) {
                            const int64_t first = (b + s) * 16, inputs = std::min<int64_t>(16, m - first);
                            amx_store(c[h * 2 + s], inputs, rows_h, yp + first * n + j0 + h * 16, n);
                        }
                    }
                }
            }
        }
        _tile_release();
    });
}

// Up to this many rows: past it oneDNN's GEMM on dequantized tiles is as fast (Q4_K_M SmolLM2 q /
// down / gate projections together, 2 threads, best of 6 against the tiles: 0.85x the time at 512
// rows, 0.81x at 1024, 1.05x at 2048; every block linear: 0.39x at 8 rows, 0.45x at 32).
constexpr int64_t kAmxMaxRows = 1024;

bool amx_kernel(int64_t type, const uint8_t* wp, int64_t rb, int64_t n, const uint16_t* xp, int64_t m, int64_t k,
                at::BFloat16* yp, bool any_rows) {
    if ((m > kAmxMaxRows && !any_rows) || k % 32 || !amx::permitted()) return false;
    return with_expander(type, [&](auto t) { linear_amx<decltype(t)>(wp, rb, n, xp, m, k, yp); });
}
#endif
#endif

}  // namespace

// float32 -> bfloat16, rounded to nearest even (as Tensor.to).
inline void to_bf16(const float* x, int64_t k, at::BFloat16* o) {
    int64_t c = 0;
#ifdef __AVX512BF16__
    for (; c + 16 <= k; c += 16) {
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + c));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c), reinterpret_cast<const __m256i&>(v));
    }
#endif
    for (; c < k; ++c) o[c] = c10::BFloat16(x[c]);
}

// x [M, K] (any float dtype) times the block weight [N, K] transposed -> [M, N] in x's dtype.
// Up to `small_rows` rows (decode), bfloat16 inputs where the CPU has AVX512-BF16: the bf16 row
// kernel above. Otherwise each weight row is dequantized once, straight into the dot
// products of up to 4 input rows (the common types), or into a buffer that stays in L1 and is
// dotted with every input row, in float32; so the weights are read once, in their blocks.
// More rows: bfloat16 inputs of up to kAmxMaxRows rows (any number with small_rows -1) take the AMX
// kernel where it is built; otherwise (prefill) tiles of weight rows are dequantized to x's dtype and
// multiplied by the BLAS GEMM; a tile holds about a million values, whatever the weight's size.
torch::Tensor linear(torch::Tensor x, torch::Tensor w, int64_t type, int64_t small_rows) {
    TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features]");
    const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
    const Format f = checked_format(w, type, k);
    const int64_t nb = k / f.block_size, rb = w.size(1);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    if (m <= small_rows) {
#ifdef RADIXSERVE_GGUF_BF16
        if (x.scalar_type() == torch::kBFloat16) {
            torch::Tensor xb = x.contiguous();
            torch::Tensor y = torch::empty({m, n}, xb.options());
            const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
            if (bf16_kernel(type, wp, rb, n, xp, m, k, y.data_ptr<at::BFloat16>())) return y;
        }
#endif
        torch::Tensor xf = x.to(torch::kFloat32).contiguous();
        torch::Tensor y = torch::empty({m, n}, xf.options());
        const float* xp = xf.data_ptr<float>();
        float* yp = y.data_ptr<float>();
        if (fused(type, wp, rb, n, nb, xp, m, k, yp)) return x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type());
        at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
            std::vector<float> rows(2 * k);
            float* r0 = rows.data();
            float* r1 = r0 + k;
            int64_t j = begin;
            for (; j + 2 <= end; j += 2) {  // weight rows in pairs: dot_4x2
                dequant_row(f, wp + j * rb, nb, r0);
                dequant_row(f, wp + (j + 1) * rb, nb, r1);
                const int64_t i = dot_4x2(xp, m, k, r0, r1, yp, n, j);
                dot_tail(xp, i, m, k, r0, yp, n, j);
                dot_tail(xp, i, m, k, r1, yp, n, j + 1);
            }
            if (j < end) {
                dequant_row(f, wp + j * rb, nb, r0);
                dot_tail(xp, 0, m, k, r0, yp, n, j);
            }
        });
        return x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type());
    }
    torch::Tensor xc = x.contiguous();
    torch::Tensor y = torch::empty({m, n}, xc.options());
#ifdef RADIXSERVE_GGUF_AMX
    if (xc.scalar_type() == torch::kBFloat16 &&
        amx_kernel(type, wp, rb, n, reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), m, k,
                   y.data_ptr<at::BFloat16>(), small_rows < 0))
        return y;
#endif
    const int64_t tile = std::max<int64_t>(16, std::min<int64_t>(n, (1 << 20) / std::max<int64_t>(k, 1)));
    const bool bf16 = xc.scalar_type() == torch::kBFloat16;
    torch::Tensor buf = torch::empty({tile, k}, bf16 ? torch::kBFloat16 : torch::kFloat32);
    for (int64_t n0 = 0; n0 < n; n0 += tile) {
        const int64_t t = std::min(tile, n - n0);
        bool tiled = false;
#ifdef RADIXSERVE_GGUF_BF16
        tiled = bf16 && bf16_tile(type, wp, rb, n0, t, k, buf.data_ptr<at::BFloat16>());
#endif
        if (!tiled && bf16) {  // each row through a float row in L1, rounded to bf16 as Tensor.to would
            at::BFloat16* bp = buf.data_ptr<at::BFloat16>();
            at::parallel_for(0, t, 4, [&](int64_t begin, int64_t end) {
                std::vector<float> row(k);
                for (int64_t j = begin; j < end; ++j) {
                    gguf::prefetch_ahead(wp + (n0 + j) * rb, rb, wp + (n0 + end) * rb);
                    dequant_row(f, wp + (n0 + j) * rb, nb, row.data());
                    to_bf16(row.data(), k, bp + j * k);
                }
            });
        } else if (!tiled) {
            float* bp = buf.data_ptr<float>();
            at::parallel_for(0, t, 4, [&](int64_t begin, int64_t end) {
                for (int64_t j = begin; j < end; ++j) {
                    gguf::prefetch_ahead(wp + (n0 + j) * rb, rb, wp + (n0 + end) * rb);
                    dequant_row(f, wp + (n0 + j) * rb, nb, bp + j * k);
                }
            });
        }
        torch::Tensor wt = buf.narrow(0, 0, t);
        if (wt.scalar_type() != xc.scalar_type()) wt = wt.to(xc.scalar_type());
        if (t == n) {
            at::mm_out(y, xc, wt.t());  // one tile: straight into the output
        } else {
            y.narrow(1, n0, t).copy_(at::mm(xc, wt.t()));
        }
    }
    return y;
}

// The float32 rows `index` of the block weight [N, K] (an embedding lookup).
torch::Tensor rows(torch::Tensor w, int64_t type, int64_t k, torch::Tensor index) {
    const Format f = checked_format(w, type, k);
    TORCH_CHECK(index.dtype() == torch::kInt64 && index.dim() == 1, "index must be int64 [T]");
    torch::Tensor idx = index.contiguous();
    const int64_t t = idx.numel(), n = w.size(0), nb = k / f.block_size, rb = w.size(1);
    const int64_t* ip = idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < t; ++i) TORCH_CHECK_INDEX(ip[i] >= 0 && ip[i] < n, "row ", ip[i], " out of range [0, ", n, ")");
    torch::Tensor y = torch::empty({t, k}, torch::kFloat32);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, t, 8, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) dequant_row(f, wp + ip[i] * rb, nb, yp + i * k);
    });
    return y;
}

bool has_bf16_kernel() {
#ifdef RADIXSERVE_GGUF_BF16
    return true;
#else
    return false;
#endif
}

bool has_amx_kernel() {
#ifdef RADIXSERVE_GGUF_AMX
    return amx::permitted();
#else
    return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("dequantize", &dequantize, "GGUF blocks (uint8) of a GGML type to float32");
    m.def("supported", &supported, "whether a GGML type has a dequantizer here");
    m.def("linear", &linear, "x [M, K] @ block weight [N, K].T");
    m.def("rows", &rows, "float32 rows of a block weight");
    m.def("has_bf16_kernel", &has_bf16_kernel, "whether bfloat16 inputs have the AVX512-BF16 row kernel");
    m.def("has_amx_kernel", &has_amx_kernel, "whether bfloat16 inputs of 5 to 1024 rows take the AMX kernel");
}
