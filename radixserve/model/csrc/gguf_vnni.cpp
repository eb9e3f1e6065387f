// x @ W^T for a weight kept in its GGUF blocks, by integer dot products (AVX512-VNNI): the decode
// batches of a bfloat16 model, where a step is bound by reading the weights and, past a few rows,
// by the arithmetic. float32 models keep gguf_dequant.cpp's float kernel (their reference is exact).
//
//   linear(x [M, K] f32|bf16, w u8 [N, row bytes], type) -> y [M, N] (x's dtype)
//
// Activations keep ~15 bits (one int8 pass, llama.cpp's, moves a model's predictions several times
// more than its 4-bit weights do). Two schemes, by how a type scales its values.
//
// Types with a float scale per 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) are read as groups
// of 32 unsigned bytes u with a scale s and an offset m, w = s * u + m:
//
//   Q4_0   u = q          s = d        m = -8 d           Q4_1   u = q       s = d      m = min
//   Q5_0   u = q          s = d        m = -16 d          Q5_1   u = q       s = d      m = min
//   Q8_0   u = q + 128    s = d        m = -128 d         IQ4_NL u = t[q]+128 s = d     m = -128 d
//
// and each row of x is quantized per span of 8 groups (256 values; a row's last may be shorter):
// qa = round(x / step), step = max|x| / 32639, so qa = 256 hi + lo with hi and lo both int8. Then
// a span's
//
//   sum_i w_i x_i = step * sum_groups s * sum_lanes (256 * sum4(u hi) + sum4(u lo))
//                   + sum_groups m * step * sum(qa of the group)
//
// where each sum4 over a lane's 4 values is exact integer arithmetic (vpdpbusd, u8 x s8); the
// offset term's step * sum(qa) is computed once per call with the quantization, and the offsets
// are one 8-lane product per span (its 8 groups' m against the row's 8 sums). Groups go in pairs,
// side by side in 512-bit vectors (bytes, products, scales); on an Intel Xeon with AVX-512 that
// took 0.88-0.99x the time of one group per 256-bit vector at one row, 0.8x at 4 rows, 0.64x at 32
// (an AMD EPYC, which splits 512-bit operations in two, had shown no gain). Up to 24 rows, each
// pair is unpacked into the dot products of up to 8 rows at once (a weight row once per 8 rows,
// from L1 after the first); past that, a weight row is unpacked once into a buffer (bytes, lane
// scales and offsets, in L1) that groups of 4 rows then read.
//
// Types with integer sub-scales in blocks of 256 (Q4_K, Q5_K, Q6_K, IQ4_XS) fold the sub-scales
// into the weights: each block is unpacked once into 256 int16 values w, value = d * w + m_g for
// its group g of 32,
//
//   Q4_K / Q5_K  w = q * scale, m = -dmin * min     Q6_K  w = (q - 32) * scale (per 16)
//   IQ4_XS  w = t[q] * (scale - 32)
//
// Each row of x is quantized per block of 256 as int16 (step = max|x| / 32767); a block's products
// are summed exactly in int32 by vpdpwssd (|w| <= 4096 and |qa| <= 32767: a lane's 16 products
// stay in range), then one float multiply-add by d * step; the offsets are one 8-lane product per
// block, its 8 m_g against the row's 8 step * sum(qa_g). Every row of x reads the unpacked block,
// so an extra row costs two loads and a vpdpwssd per 32 values (1.3-1.9x faster than the first
// scheme at 2-9 rows, the same at one).
//
// In both, everything after the integer sums is float32, in one order for every row, so a row's
// result does not depend on how many rows come with it (a request's tokens do not depend on its
// batch). Output rows (weight rows) are split over threads.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "gguf_unpack.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__) && !defined(RADIXSERVE_NO_SIMD)
#define RADIXSERVE_GGUF_VNNI 1
#endif

namespace {

#ifdef RADIXSERVE_GGUF_VNNI
using gguf::f16;

constexpr int64_t kGroup = 32;
// Up to kDirectRows * kDirectChunks rows, weight groups are unpacked straight into the products of
// up to kDirectRows rows at a time; past that, a weight row is unpacked once into a buffer
constexpr int64_t kDirectRows = 8, kDirectChunks = 3;
constexpr float kQMax = 127.f * 256.f + 127.f;

// x quantized: per row, hi and lo bytes in the values' order, per span of 8 groups (256 values;
// the row's last may be shorter) the step, and per group step * (sum of the group's qa), a row's
// sums padded with zeros to whole spans (`gstride`)
struct Act {
    int64_t k = 0, groups = 0, spans = 0, gstride = 0;
    std::vector<int8_t> hi, lo;
    std::vector<float> step, gsum;
    Act(int64_t m, int64_t k_)
        // hi / lo padded: a pair's load from the last row's odd last group reads 32 bytes on (against zero weights)
        : k(k_), groups(k_ / kGroup), spans((groups + 7) / 8), gstride(spans * 8), hi(m * k_ + kGroup, 0),
          lo(m * k_ + kGroup, 0), step(m * spans), gsum(m * gstride, 0.f) {}
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The step of n values of x (a multiple of 16) quantized to at most qmax: max|x| / qmax, and in
// `inv` what x is multiplied by. A NaN or infinite value makes the step NaN (inv 0) and so every
// product of the row NaN, as in float.
template <class S>
float quant_step(const S* x, int64_t n, float qmax, float* inv) {
    __m512 amax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t j = 0; j < n; j += 16) {
        const __m512 v = load16(x + j);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
        bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);  // max drops NaNs: they are looked for on their own
    }
    const float mx = _mm512_reduce_max_ps(amax);
    const bool nonfinite = bad || !std::isfinite(mx);
    *inv = !nonfinite && mx > 0.f ? qmax / mx : 0.f;
    return nonfinite ? std::numeric_limits<float>::quiet_NaN() : mx / qmax;
}

// span `i` (row i / spans) of x: n groups of 32 from x
template <class S>
void quantize_span(const S* x, int64_t n, Act& a, int64_t i) {
    float inv;
    const float step = a.step[i] = quant_step(x, n * kGroup, kQMax, &inv);
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512i c128 = _mm512_set1_epi32(128);
    const int64_t r = i / a.spans, g0 = i % a.spans * 8;
    for (int64_t g = 0; g < n; ++g) {
        const S* xg = x + g * kGroup;
        const int64_t at = r * a.k + (g0 + g) * kGroup;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xg), vi)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xg + 16), vi));
        const __m512i ha = _mm512_srai_epi32(_mm512_add_epi32(qa, c128), 8), hb = _mm512_srai_epi32(_mm512_add_epi32(qb, c128), 8);
        const __m512i la = _mm512_sub_epi32(qa, _mm512_slli_epi32(ha, 8)), lb = _mm512_sub_epi32(qb, _mm512_slli_epi32(hb, 8));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.hi[at]), _mm512_cvtepi32_epi8(ha));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.hi[at + 16]), _mm512_cvtepi32_epi8(hb));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.lo[at]), _mm512_cvtepi32_epi8(la));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.lo[at + 16]), _mm512_cvtepi32_epi8(lb));
        a.gsum[r * a.gstride + g0 + g] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb))) * step;
    }
}

template <class S>
void quantize(const S* x, int64_t m, Act& a) {
    at::parallel_for(0, m * a.spans, 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t g0 = i % a.spans * 8;
            quantize_span(x + i / a.spans * a.k + g0 * kGroup, std::min<int64_t>(8, a.groups - g0), a, i);
        }
    });
}

// --- the weight side: each type's groups of 32 as (u, s, m) ----------------------------------------
//
// A type gives `bytes(b)`, the group at b as 32 unsigned bytes, and `pair(b)`, the groups at b and
// b + kBytes side by side in a 512-bit vector; its scale d is the float16 at the group's start, its
// offset m either kOffset * d or (kMin) the float16 after d. A whole span's 8 scales (and mins) are
// converted by one vcvtph2ps, and a pair of 4-bit groups is unpacked in 512-bit operations (Q5's
// fifth bits added under a byte mask). On an Intel Xeon with AVX-512, against unpacking each group in
// 256 bits with its scale converted on its own: at one row, 0.73-0.79x the time with the weight in
// cache, 0.85-0.93x streaming it from memory on two threads; 0.85-0.94x at 4 rows.

inline __m128i iq4_table() {  // the IQ4 values + 128, as unsigned bytes
    return _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gguf::KVALUES_IQ4NL)), _mm_set1_epi8(char(0x80)));
}

inline uint32_t load32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

inline int load16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

// the 16 bytes at p and at p + stride as 64 values: p's low nibbles, p's high nibbles, then the
// same of p + stride (nibbles32's order, twice)
inline __m512i nibbles64(const uint8_t* p, int64_t stride) {
    const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride)), 1);
    const __m512i x = _mm512_shuffle_i64x2(_mm512_castsi256_si512(q), _mm512_castsi256_si512(q), _MM_SHUFFLE(1, 1, 0, 0));
    // 128-bit lanes 1 and 3 (16-bit elements 8-15 and 24-31) take the high nibbles
    return _mm512_and_si512(_mm512_mask_srli_epi16(x, 0xFF00FF00u, x, 4), _mm512_set1_epi8(0x0F));
}

// Q5_0 / Q5_1: 16 added to byte i where bit i of the fifth bits is set (qh: the pair's 64 bits)
inline __m256i with_fifth(__m256i v, uint32_t qh) { return _mm256_mask_add_epi8(v, qh, v, _mm256_set1_epi8(0x10)); }
inline __m512i with_fifth(__m512i v, uint64_t qh) { return _mm512_mask_add_epi8(v, qh, v, _mm512_set1_epi8(0x10)); }

inline __m512i pair_bytes(__m256i u0, __m256i u1) { return _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1); }

// a 4-bit type of kSize bytes a group: kQs, where its 16 bytes of values start; kHigh, where Q5's 32
// fifth bits start (0: none); kMinAfterD, or else its offset is kTimesD * d
template <int64_t kSize, int64_t kQs, int64_t kHigh, bool kMinAfterD, int kTimesD>
struct Nibbles {
    static constexpr int64_t kValues = 32, kBytes = kSize;
    static constexpr bool kMin = kMinAfterD;
    static constexpr float kOffset = static_cast<float>(kTimesD);
    static __m256i bytes(const uint8_t* b) {
        const __m256i v = gguf::nibbles32(b + kQs);
        if constexpr (kHigh > 0) return with_fifth(v, load32(b + kHigh));
        return v;
    }
    static __m512i pair(const uint8_t* b) {
        const __m512i v = nibbles64(b + kQs, kBytes);
        if constexpr (kHigh > 0) return with_fifth(v, load32(b + kHigh) | static_cast<uint64_t>(load32(b + kBytes + kHigh)) << 32);
        return v;
    }
};

using Q4_0v = Nibbles<18, 2, 0, false, -8>;
using Q4_1v = Nibbles<20, 4, 0, true, 0>;
using Q5_0v = Nibbles<22, 6, 2, false, -16>;
using Q5_1v = Nibbles<24, 8, 4, true, 0>;

struct Q8_0v {
    static constexpr int64_t kValues = 32, kBytes = 34;
    static constexpr bool kMin = false;
    static constexpr float kOffset = -128.f;
    static __m256i bytes(const uint8_t* b) {
        return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), _mm256_set1_epi8(char(0x80)));
    }
    static __m512i pair(const uint8_t* b) {
        const __m512i q = pair_bytes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)),
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kBytes + 2)));
        return _mm512_xor_si512(q, _mm512_set1_epi8(char(0x80)));
    }
};

struct IQ4_NLv {
    static constexpr int64_t kValues = 32, kBytes = 18;
    static constexpr bool kMin = false;
    static constexpr float kOffset = -128.f;
    static __m256i bytes(const uint8_t* b) {
        const __m128i t = iq4_table();
        return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), gguf::nibbles32(b + 2));
    }
    static __m512i pair(const uint8_t* b) {
        return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(iq4_table()), nibbles64(b + 2, kBytes));
    }
};

// group b's (u, s, m) into sink
template <class T, class Sink>
inline void unpack(const uint8_t* b, Sink& sink) {
    const float d = f16(b);
    sink(T::bytes(b), d, T::kMin ? f16(b + 2) : T::kOffset * d);
}

// the float16 at byte `at` of each of the 8 groups from b, as floats
template <class T, size_t... I>
inline __m256 halves8(const uint8_t* b, int64_t at, std::index_sequence<I...>) {
    __m128i v = _mm_setzero_si128();
    ((v = _mm_insert_epi16(v, load16(b + I * T::kBytes + at), I)), ...);
    return _mm256_cvtph_ps(v);
}

// a whole span's scales s and offsets m, 8 lanes each
template <class T>
inline void span_scales(const uint8_t* b, __m256* s, __m256* m) {
    *s = halves8<T>(b, 0, std::make_index_sequence<8>{});
    *m = T::kMin ? halves8<T>(b, 2, std::make_index_sequence<8>{}) : _mm256_mul_ps(*s, _mm256_set1_ps(T::kOffset));
}

// --- the dot products -------------------------------------------------------------------------------
using gguf::hsum8;

// rows r0 .. r0 + R of x against weight groups g and g + 1 (bytes u: g's in the low half, scales
// s: 8 lanes each): into the span's sums `part`
template <int R>
inline void accumulate(const Act& a, int64_t r0, int64_t g, __m512i u, __m512 s, __m512* part) {
    for (int r = 0; r < R; ++r) {
        const int64_t at = ((r0 + r) * a.groups + g) * kGroup;
        const __m512i h = _mm512_loadu_si512(&a.hi[at]);
        const __m512i l = _mm512_loadu_si512(&a.lo[at]);
        const __m512i t = _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, h), 8), u, l);
        part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, part[r]);
    }
}

inline __m512 pair_scales(float s0, float s1) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(s0)), _mm256_castps_pd(_mm256_set1_ps(s1)), 1));
}

// the end of the span of 8 groups from g0: its sums times the row's step into acc, and its offsets
// (`m`, zero past the row's last group): one 8-lane product per row
template <int R>
inline void end_span(const Act& a, int64_t r0, int64_t g0, __m256 m, __m512* part, __m512* acc, __m256* macc) {
    for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(a.step[(r0 + r) * a.spans + g0 / 8]), acc[r]);
        part[r] = _mm512_setzero_ps();
        macc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(&a.gsum[(r0 + r) * a.gstride + g0]), macc[r]);
    }
}

// O: float, or c10::BFloat16 (a bfloat16 model's output written as it is, no conversion pass)
template <int R, class O>
inline void finish(const __m512* acc, const __m256* macc, O* out, int64_t ldo) {
    for (int r = 0; r < R; ++r) {
        const __m256 lanes = _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
        out[r * ldo] = static_cast<O>(hsum8(_mm256_add_ps(lanes, macc[r])));
    }
}

// the lanes of a span's 8-lane scales that pair p (groups 2p, 2p + 1) takes: 8 of each
inline __m512i pair_lanes(int p) {
    return _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
}

// one weight row against R <= kDirectRows rows of x, unpacking each pair of groups straight into the products
template <class T, int R, class O>
void row_direct(const uint8_t* row, int64_t groups, const Act& a, int64_t r0, O* out, int64_t ldo) {
    __m512 acc[R], part[R];
    __m256 macc[R];
    for (int r = 0; r < R; ++r) acc[r] = part[r] = _mm512_setzero_ps(), macc[r] = _mm256_setzero_ps();
    const __m512i lanes[4] = {pair_lanes(0), pair_lanes(1), pair_lanes(2), pair_lanes(3)};
    int64_t g0 = 0;
    for (; g0 + 8 <= groups; g0 += 8) {  // whole spans
        const uint8_t* span = row + g0 * T::kBytes;
        __m256 s8, m8;
        span_scales<T>(span, &s8, &m8);
        const __m512 s16 = _mm512_castps256_ps512(s8);
#pragma GCC unroll 4
        for (int i = 0; i < 8; i += 2)
            accumulate<R>(a, r0, g0 + i, T::pair(span + i * T::kBytes), _mm512_permutexvar_ps(lanes[i / 2], s16), part);
        end_span<R>(a, r0, g0, m8, part, acc, macc);
    }
    if (g0 < groups) {  // the row's last span, shorter: group by group, the rest zeros
        const int64_t n = groups - g0;
        __m256 mg = _mm256_setzero_ps();  // the groups' offsets, built in a register
        for (int i = 0; i < n; i += 2) {
            __m256i u0, u1 = _mm256_setzero_si256();
            float s0, s1 = 0.f, m0, m1 = 0.f;
            auto first = [&](__m256i u, float s, float m) { u0 = u, s0 = s, m0 = m; };
            auto next = [&](__m256i u, float s, float m) { u1 = u, s1 = s, m1 = m; };
            unpack<T>(row + (g0 + i) * T::kBytes, first);
            if (i + 1 < n) unpack<T>(row + (g0 + i + 1) * T::kBytes, next);
            accumulate<R>(a, r0, g0 + i, pair_bytes(u0, u1), pair_scales(s0, s1), part);
            mg = _mm256_mask_mov_ps(mg, static_cast<__mmask8>(1u << i), _mm256_set1_ps(m0));
            mg = _mm256_mask_mov_ps(mg, static_cast<__mmask8>(2u << i), _mm256_set1_ps(m1));
        }
        end_span<R>(a, r0, g0, mg, part, acc, macc);
    }
    finish<R, O>(acc, macc, out, ldo);
}

// one weight row, unpacked into `u` (its bytes), `s` and `m` (per group; zero-padded: to a pair, and
// m to gstride)
struct RowBuffer {
    std::vector<uint8_t> u;
    std::vector<float> s, m;
    RowBuffer(int64_t k, int64_t gstride) : u(k + kGroup, 0), s(k / kGroup + 1, 0.f), m(gstride, 0.f) {}
};

template <int R, class O>
void row_buffered(const RowBuffer& w, int64_t groups, const Act& a, int64_t r0, O* out, int64_t ldo) {
    __m512 acc[R], part[R];
    __m256 macc[R];
    for (int r = 0; r < R; ++r) acc[r] = part[r] = _mm512_setzero_ps(), macc[r] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
        const int64_t n = std::min<int64_t>(8, groups - g0);
        for (int64_t g = g0; g < g0 + n; g += 2) {
            const __m512i u = _mm512_loadu_si512(&w.u[g * kGroup]);
            accumulate<R>(a, r0, g, u, pair_scales(w.s[g], w.s[g + 1]), part);  // past the row: zeros
        }
        end_span<R>(a, r0, g0, _mm256_loadu_ps(&w.m[g0]), part, acc, macc);
    }
    finish<R, O>(acc, macc, out, ldo);
}

// one weight row against rows r0 .. r0 + rows (at most kDirectRows) of x
template <class T, class O>
void row_chunk(const uint8_t* row, int64_t groups, const Act& a, int64_t r0, int64_t rows, O* out, int64_t ldo) {
    switch (rows) {
        case 1: row_direct<T, 1, O>(row, groups, a, r0, out, ldo); break;
        case 2: row_direct<T, 2, O>(row, groups, a, r0, out, ldo); break;
        case 3: row_direct<T, 3, O>(row, groups, a, r0, out, ldo); break;
        case 4: row_direct<T, 4, O>(row, groups, a, r0, out, ldo); break;
        case 5: row_direct<T, 5, O>(row, groups, a, r0, out, ldo); break;
        case 6: row_direct<T, 6, O>(row, groups, a, r0, out, ldo); break;
        case 7: row_direct<T, 7, O>(row, groups, a, r0, out, ldo); break;
        default: row_direct<T, 8, O>(row, groups, a, r0, out, ldo); break;
    }
}

template <class T, class O>
void run_linear(const uint8_t* wp, int64_t rb, int64_t n, const Act& a, int64_t m, O* yp) {
    const int64_t groups = a.groups;
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
        if (m <= kDirectRows * kDirectChunks) {  // chunks of at most kDirectRows rows, as even as they go
            const int64_t chunks = (m + kDirectRows - 1) / kDirectRows;
            for (int64_t j = begin; j < end; ++j) {
                gguf::prefetch_ahead(wp + j * rb, rb, wp + end * rb);
                for (int64_t c = 0, r0 = 0; c < chunks; ++c) {
                    const int64_t rows = (m - r0) / (chunks - c);
                    row_chunk<T, O>(wp + j * rb, groups, a, r0, rows, yp + r0 * n + j, n);
                    r0 += rows;
                }
            }
            return;
        }
        RowBuffer w(a.k, a.gstride);
        for (int64_t j = begin; j < end; ++j) {
            const uint8_t* row = wp + j * rb;
            gguf::prefetch_ahead(row, rb, wp + end * rb);
            for (int64_t g = 0; g < groups; ++g) {
                auto store = [&](__m256i u, float s, float mm) {
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&w.u[g * kGroup]), u);
                    w.s[g] = s;
                    w.m[g] = mm;
                };
                unpack<T>(row + g * T::kBytes, store);
            }
            int64_t r = 0;
            for (; r + 4 <= m; r += 4) row_buffered<4, O>(w, groups, a, r, yp + r * n + j, n);
            switch (m - r) {
                case 1: row_buffered<1, O>(w, groups, a, r, yp + r * n + j, n); break;
                case 2: row_buffered<2, O>(w, groups, a, r, yp + r * n + j, n); break;
                case 3: row_buffered<3, O>(w, groups, a, r, yp + r * n + j, n); break;
                default: break;
            }
        }
    });
}

// --- types with integer sub-scales: blocks of 256 unpacked once to int16 ----------------------------
constexpr int64_t kUnit = 256, kUnitGroups = kUnit / kGroup;

// x quantized per row and block of 256: qa as int16, the step, per group step * sum(qa)
struct UnitAct {
    int64_t k = 0, units = 0;
    std::vector<int16_t> q;
    std::vector<float> step, gsum;
    UnitAct(int64_t m, int64_t k_) : k(k_), units(k_ / kUnit), q(m * k_), step(m * units), gsum(m * units * kUnitGroups) {}
};

// block `i` (row i / units) of x
template <class S>
void quantize_unit(const S* x, UnitAct& a, int64_t i) {
    float inv;
    const float step = a.step[i] = quant_step(x, kUnit, 32767.f, &inv);
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512i top = _mm512_set1_epi32(32767), bottom = _mm512_set1_epi32(-32767);
    for (int64_t g = 0; g < kUnitGroups; ++g) {
        __m512i sum = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {
            const int64_t j = g * kGroup + h * 16;
            const __m512i v = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load16(x + j), vi)), bottom), top);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(&a.q[i * kUnit + j]), _mm512_cvtepi32_epi16(v));
            sum = _mm512_add_epi32(sum, v);
        }
        a.gsum[i * kUnitGroups + g] = static_cast<float>(_mm512_reduce_add_epi32(sum)) * step;
    }
}

template <class S>
void quantize(const S* x, int64_t m, UnitAct& a) {
    at::parallel_for(0, m * a.units, 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) quantize_unit(x + i * kUnit, a, i);
    });
}

// one block of a weight row: values times sub-scales, the block's d, its 8 group offsets
struct Unit {
    alignas(64) int16_t w[kUnit];
    alignas(32) float m[kUnitGroups];
    float d = 0.f;
};

inline void put(Unit& u, int g, __m512i w) { _mm512_store_si512(reinterpret_cast<__m512i*>(u.w + g * kGroup), w); }

struct IQ4_XSv {  // d, scales_h (16 bits), scales_l[4], qs[128]
    static constexpr int64_t kValues = 256, kBytes = 136;
    static constexpr bool kOffset = false;
    static void unit(const uint8_t* b, Unit& u) {
        const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gguf::KVALUES_IQ4NL));
        const __m256i table = _mm256_set_m128i(t, t);
        uint16_t sh;
        std::memcpy(&sh, b + 2, 2);
        for (int ib = 0; ib < 8; ++ib) {
            const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 0x03) << 4);
            const __m512i v = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, gguf::nibbles32(b + 8 + ib * 16)));
            put(u, ib, _mm512_mullo_epi16(v, _mm512_set1_epi16(static_cast<int16_t>(ls - 32))));
        }
        u.d = f16(b);
    }
};

template <bool kFifthBit>
struct K45v {  // Q4_K (d, dmin, scales[12], qs[128]) and Q5_K (..., qh[32], qs[128])
    static constexpr int64_t kValues = 256, kBytes = kFifthBit ? 176 : 144;
    static constexpr bool kOffset = true;
    static void unit(const uint8_t* b, Unit& u) {
        const uint8_t* qs = b + (kFifthBit ? 48 : 16);
        const __m256i high = kFifthBit ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
        uint32_t sc[2], mn[2];
        gguf::k_scales_mins(b + 4, &sc[0], &sc[1], &mn[0], &mn[1]);
        _mm256_store_ps(u.m, _mm256_mul_ps(_mm256_set1_ps(-f16(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                               _mm_set_epi32(0, 0, static_cast<int>(mn[1]), static_cast<int>(mn[0]))))));
        for (int sub = 0; sub < 8; ++sub) {
            const int16_t s = static_cast<int16_t>((sc[sub / 4] >> (8 * (sub % 4))) & 0xFF);
            put(u, sub, _mm512_mullo_epi16(_mm512_cvtepu8_epi16(gguf::k45_values32<kFifthBit>(qs, high, sub)), _mm512_set1_epi16(s)));
        }
        u.d = f16(b);
    }
};

struct Q6_Kv {  // ql[128], qh[64], scales int8[16], d
    static constexpr int64_t kValues = 256, kBytes = 210;
    static constexpr bool kOffset = false;
    static void unit(const uint8_t* b, Unit& u) {
        // the 16 scales as int16, spread per group by one permute: values h * 128 + c * 32 + l take
        // scale h * 8 + c * 2 + l / 16
        const __m512i scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
        const __m512i halves = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);  // l / 16
        for (int h = 0; h < 2; ++h) {
            for (int c = 0; c < 4; ++c) {
                const __m512i scale = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_set1_epi16(static_cast<int16_t>(h * 8 + c * 2)), halves), scales);
                const __m512i v = _mm512_sub_epi16(_mm512_cvtepu8_epi16(gguf::q6_k_values32(b, h, c)), _mm512_set1_epi16(32));
                put(u, h * 4 + c, _mm512_mullo_epi16(v, scale));
            }
        }
        u.d = f16(b + 208);
    }
};

// one block of the weight row against row r of x: acc (16 lanes) and the offsets' macc (8 lanes)
template <class T>
inline void accumulate_unit(const Unit& u, const UnitAct& a, int64_t r, int64_t ui, __m512& acc, __m256& macc) {
    const int64_t i = r * a.units + ui;
    const int16_t* q = &a.q[i * kUnit];
    __m512i t0 = _mm512_setzero_si512(), t1 = _mm512_setzero_si512();  // two chains: one row need not wait
    for (int g = 0; g < kUnitGroups; g += 2) {
        t0 = _mm512_dpwssd_epi32(t0, _mm512_load_si512(u.w + g * kGroup), _mm512_loadu_si512(q + g * kGroup));
        t1 = _mm512_dpwssd_epi32(t1, _mm512_load_si512(u.w + (g + 1) * kGroup), _mm512_loadu_si512(q + (g + 1) * kGroup));
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(t0, t1)), _mm512_set1_ps(u.d * a.step[i]), acc);
    if constexpr (T::kOffset) macc = _mm256_fmadd_ps(_mm256_load_ps(u.m), _mm256_loadu_ps(&a.gsum[i * kUnitGroups]), macc);
}

template <class T, class O>
void run_units(const uint8_t* wp, int64_t rb, int64_t n, const UnitAct& a, int64_t m, O* yp) {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
        Unit u;
        std::vector<__m512> acc(m);
        std::vector<__m256> macc(m);
        for (int64_t j = begin; j < end; ++j) {
            std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
            std::fill(macc.begin(), macc.end(), _mm256_setzero_ps());
            gguf::prefetch_ahead(wp + j * rb, rb, wp + end * rb);
            for (int64_t ui = 0; ui < a.units; ++ui) {
                T::unit(wp + j * rb + ui * T::kBytes, u);
                for (int64_t r = 0; r < m; ++r) accumulate_unit<T>(u, a, r, ui, acc[r], macc[r]);
            }
            for (int64_t r = 0; r < m; ++r)
                yp[r * n + j] = static_cast<O>(_mm512_reduce_add_ps(acc[r]) + gguf::hsum8(macc[r]));
        }
    });
}

template <class T>
constexpr bool kIntegerScaled = T::kValues == kUnit;

// Calls f(T{}) with the unpacker of GGML type `type`; false where there is none.
template <class F>
bool with_type(int64_t type, F&& f) {
    switch (type) {
        case 2: f(Q4_0v{}); return true;
        case 3: f(Q4_1v{}); return true;
        case 6: f(Q5_0v{}); return true;
        case 7: f(Q5_1v{}); return true;
        case 8: f(Q8_0v{}); return true;
        case 12: f(K45v<false>{}); return true;
        case 13: f(K45v<true>{}); return true;
        case 14: f(Q6_Kv{}); return true;
        case 20: f(IQ4_NLv{}); return true;
        case 23: f(IQ4_XSv{}); return true;
        default: return false;
    }
}

struct Shape {
    int64_t values = 0, bytes = 0;
};

bool shape_of(int64_t type, Shape* s) {
    return with_type(type, [&](auto t) { *s = {decltype(t)::kValues, decltype(t)::kBytes}; });
}

template <class S, class O>
void run(int64_t type, const S* x, const uint8_t* wp, int64_t rb, int64_t n, int64_t m, int64_t k, O* yp) {
    with_type(type, [&](auto t) {
        using T = decltype(t);
        if constexpr (kIntegerScaled<T>) {
            UnitAct a(m, k);
            quantize(x, m, a);
            run_units<T, O>(wp, rb, n, a, m, yp);
        } else {
            Act a(m, k);
            quantize(x, m, a);
            run_linear<T, O>(wp, rb, n, a, m, yp);
        }
    });
}
#endif

}  // namespace

// Whether GGML type `type` takes the integer-sub-scale scheme (the K-quants, IQ4_XS).
bool integer_scaled(int64_t type) {
#ifdef RADIXSERVE_GGUF_VNNI
    bool out = false;
    with_type(type, [&](auto t) { out = kIntegerScaled<decltype(t)>; });
    return out;
#else
    (void)type;
    return false;
#endif
}

// Whether this build has the kernel for GGML type `type` (false everywhere without AVX512-VNNI).
bool supported(int64_t type) {
#ifdef RADIXSERVE_GGUF_VNNI
    Shape s;
    return shape_of(type, &s);
#else
    (void)type;
    return false;
#endif
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, int64_t type) {
#ifdef RADIXSERVE_GGUF_VNNI
    Shape s;
    TORCH_CHECK(shape_of(type, &s), "no VNNI kernel for GGML type ", type);
    TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
                "x must be float32 or bfloat16 [rows, in_features]");
    TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "weight blocks must be contiguous uint8 [N, row bytes]");
    const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
    TORCH_CHECK(k % s.values == 0 && w.size(1) == k / s.values * s.bytes, "weight rows of ", w.size(1),
                " bytes do not hold ", k, " values of GGML type ", type);
    torch::Tensor xc = x.contiguous();
    torch::Tensor y = torch::empty({m, n}, xc.options());
    if (m == 0) return y;
    const uint8_t* wp = w.data_ptr<uint8_t>();
    if (xc.scalar_type() == torch::kBFloat16)
        run(type, xc.data_ptr<c10::BFloat16>(), wp, w.size(1), n, m, k, y.data_ptr<c10::BFloat16>());
    else
        run(type, xc.data_ptr<float>(), wp, w.size(1), n, m, k, y.data_ptr<float>());
    return y;
#else
    (void)x, (void)w, (void)type;
    TORCH_CHECK(false, "this build has no AVX512-VNNI kernel for GGUF blocks");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("supported", &supported, "whether a GGML type has the VNNI kernel in this build");
    m.def("integer_scaled", &integer_scaled, "whether a GGML type takes the integer-sub-scale scheme");
    m.def("linear", &linear, "x [M, K] @ block weight [N, K].T by int8 dot products");
}
