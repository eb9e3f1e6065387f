// x @ W^T for a weight kept in its GGUF blocks, by integer dot products (AVX512-VNNI): the decode
// batches of a bfloat16 model, where a step is bound by reading the weights and, past a few rows,
// by the arithmetic. float32 models keep gguf_dequant.cpp's float kernel (their reference is exact).
//
//   linear(x [M, K] f32|bf16, w u8 [N, row bytes], type) -> y [M, N] (x's dtype)
//
// Every supported type is read as groups of 32 values, each group 32 unsigned bytes u with a scale
// s and an offset m per 4 values (the lanes of one VNNI product), so that w = s * u + m:
//
//   Q4_0   u = q          s = d        m = -8 d           Q4_1   u = q       s = d      m = min
//   Q5_0   u = q          s = d        m = -16 d          Q5_1   u = q       s = d      m = min
//   Q8_0   u = q + 128    s = d        m = -128 d         IQ4_NL u = t[q]+128 s = d     m = -128 d
//   Q4_K/Q5_K  per sub-block of 32: s = d * scale, m = -dmin * min     IQ4_XS  as IQ4_NL, s per 32
//   Q6_K   u = q (6 bits), per 16 values s = d * scale, m = -32 s (lanes 0-3 and 4-7 differ)
//
// Each row of x is quantized per group of 32: qa = round(x / step), step = max|x| / 32639, so
// |qa| <= 127 * 256 + 127 and qa = 256 hi + lo with hi and lo both int8 (~15 bits: one int8 pass,
// llama.cpp's, moves a model's predictions several times more than its 4-bit weights do). Then
//
//   sum_i w_i x_i = sum_lanes  s * step * (256 * sum4(u hi) + sum4(u lo))  +  m * step * sum4(qa)
//
// where each sum4 over a lane's 4 values is exact integer arithmetic (vpdpbusd, u8 x s8), and the
// offset term's step * sum4(qa) is computed once per call with the quantization. Everything after
// the integer sums is float32. A row of x is computed the same way whatever M is (the same
// accumulation order in both paths below), so a request's tokens do not depend on its batch.
//
// Up to 24 rows, each weight group is unpacked into the dot products of up to 8 rows at once (a
// weight row once per 8 rows, from L1 after the first); past that, a weight row is unpacked once
// into a buffer (bytes, lane scales and offsets, in L1) that groups of 4 rows then read. Output
// rows are split over threads. (512-bit vectors over two groups measured no faster on an AMD
// EPYC, which runs them as two 256-bit halves.)
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

// x quantized: per row and group, hi and lo bytes in the values' order, the step, and per lane
// step * (sum of the lane's 4 qa)
struct Act {
    int64_t k = 0, groups = 0;
    std::vector<int8_t> hi, lo;
    std::vector<float> step, lane_sum;
    Act(int64_t m, int64_t k_) : k(k_), groups(k_ / kGroup), hi(m * k_), lo(m * k_), step(m * groups), lane_sum(m * groups * 8) {}
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <class S>
void quantize_group(const S* x, int8_t* hi, int8_t* lo, float* step, float* lane_sum) {
    const __m512 a = load16(x), b = load16(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    // a NaN or infinite value makes the step NaN and so every product of the row NaN, as in float
    // (max drops NaNs: they are looked for on their own)
    const bool bad = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q) || !std::isfinite(amax);
    const float inv = !bad && amax > 0.f ? kQMax / amax : 0.f;
    *step = bad ? std::numeric_limits<float>::quiet_NaN() : amax / kQMax;
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512i c128 = _mm512_set1_epi32(128);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vi)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vi));
    const __m512i ha = _mm512_srai_epi32(_mm512_add_epi32(qa, c128), 8), hb = _mm512_srai_epi32(_mm512_add_epi32(qb, c128), 8);
    const __m512i la = _mm512_sub_epi32(qa, _mm512_slli_epi32(ha, 8)), lb = _mm512_sub_epi32(qb, _mm512_slli_epi32(hb, 8));
    const __m256i h = _mm256_set_m128i(_mm512_cvtepi32_epi8(hb), _mm512_cvtepi32_epi8(ha));
    const __m256i l = _mm256_set_m128i(_mm512_cvtepi32_epi8(lb), _mm512_cvtepi32_epi8(la));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), l);
    const __m256i ones = _mm256_set1_epi8(1);
    const __m256i sh = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, h);
    const __m256i sum = _mm256_dpbusd_epi32(_mm256_slli_epi32(sh, 8), ones, l);
    _mm256_storeu_ps(lane_sum, _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(*step)));
}

template <class S>
void quantize(const S* x, int64_t m, Act& a) {
    at::parallel_for(0, m * a.groups, 256, [&](int64_t begin, int64_t end) {
        for (int64_t g = begin; g < end; ++g)
            quantize_group(x + g * kGroup, &a.hi[g * kGroup], &a.lo[g * kGroup], &a.step[g], &a.lane_sum[g * 8]);
    });
}

// --- the weight side: each type's groups of 32 as (u, s, m) ----------------------------------------
inline __m256 lanes(float v) { return _mm256_set1_ps(v); }

inline __m128i iq4_table() {  // the IQ4 values + 128, as unsigned bytes
    return _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gguf::KVALUES_IQ4NL)), _mm_set1_epi8(char(0x80)));
}

struct Q4_0v {
    static constexpr int64_t kValues = 32, kBytes = 18;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        const float d = f16(b);
        sink(0, gguf::nibbles32(b + 2), lanes(d), lanes(-8.f * d));
    }
};

struct Q4_1v {
    static constexpr int64_t kValues = 32, kBytes = 20;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        sink(0, gguf::nibbles32(b + 4), lanes(f16(b)), lanes(f16(b + 2)));
    }
};

struct Q5_0v {
    static constexpr int64_t kValues = 32, kBytes = 22;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        uint32_t qh;
        std::memcpy(&qh, b + 2, 4);
        const float d = f16(b);
        sink(0, _mm256_or_si256(gguf::nibbles32(b + 6), gguf::fifth_bits32(qh)), lanes(d), lanes(-16.f * d));
    }
};

struct Q5_1v {
    static constexpr int64_t kValues = 32, kBytes = 24;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        uint32_t qh;
        std::memcpy(&qh, b + 4, 4);
        sink(0, _mm256_or_si256(gguf::nibbles32(b + 8), gguf::fifth_bits32(qh)), lanes(f16(b)), lanes(f16(b + 2)));
    }
};

struct Q8_0v {
    static constexpr int64_t kValues = 32, kBytes = 34;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        const float d = f16(b);
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
        sink(0, _mm256_xor_si256(q, _mm256_set1_epi8(char(0x80))), lanes(d), lanes(-128.f * d));
    }
};

struct IQ4_NLv {
    static constexpr int64_t kValues = 32, kBytes = 18;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        const __m128i t = iq4_table();
        const float d = f16(b);
        sink(0, _mm256_shuffle_epi8(_mm256_set_m128i(t, t), gguf::nibbles32(b + 2)), lanes(d), lanes(-128.f * d));
    }
};

struct IQ4_XSv {  // d, scales_h (16 bits), scales_l[4], qs[128]
    static constexpr int64_t kValues = 256, kBytes = 136;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        const __m128i t = iq4_table();
        const __m256i table = _mm256_set_m128i(t, t);
        const float d = f16(b);
        uint16_t sh;
        std::memcpy(&sh, b + 2, 2);
        for (int ib = 0; ib < 8; ++ib) {
            const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 0x03) << 4);
            const float dl = d * static_cast<float>(ls - 32);
            sink(ib, _mm256_shuffle_epi8(table, gguf::nibbles32(b + 8 + ib * 16)), lanes(dl), lanes(-128.f * dl));
        }
    }
};

template <bool kFifthBit>
struct K45v {  // Q4_K (d, dmin, scales[12], qs[128]) and Q5_K (..., qh[32], qs[128])
    static constexpr int64_t kValues = 256, kBytes = kFifthBit ? 176 : 144;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        const float d = f16(b), dmin = f16(b + 2);
        const uint8_t* qs = b + (kFifthBit ? 48 : 16);
        const __m256i high = kFifthBit ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
        // the 8 sub-blocks' d * scale and -dmin * min, computed together (the same float products
        // one at a time would give), then broadcast one sub-block at a time
        uint32_t sc, sc_hi, mn, mn_hi;
        gguf::k_scales_mins(b + 4, &sc, &sc_hi, &mn, &mn_hi);
        const __m256 scf = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                             _mm_set_epi32(0, 0, static_cast<int>(sc_hi), static_cast<int>(sc)))));
        const __m256 mnf = _mm256_mul_ps(_mm256_set1_ps(-dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                             _mm_set_epi32(0, 0, static_cast<int>(mn_hi), static_cast<int>(mn)))));
        for (int sub = 0; sub < 8; ++sub) {
            const __m256i at = _mm256_set1_epi32(sub);
            const __m256i v = gguf::k45_values32<kFifthBit>(qs, high, sub);
            sink(sub, v, _mm256_permutevar8x32_ps(scf, at), _mm256_permutevar8x32_ps(mnf, at));
        }
    }
};

struct Q6_Kv {  // ql[128], qh[64], scales int8[16], d
    static constexpr int64_t kValues = 256, kBytes = 210;
    template <class Sink> static void run(const uint8_t* b, Sink& sink) {
        const float d = f16(b + 208);
        // d * scale of the 16 scales (values h * 128 + c * 32 + l take scale h * 8 + c * 2 + l / 16),
        // computed together: the same float products one at a time would give
        __m256 ds[2];
        for (int h = 0; h < 2; ++h)
            ds[h] = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 192 + 8 * h)))));
        for (int h = 0; h < 2; ++h) {
            for (int c = 0; c < 4; ++c) {  // values h * 128 + c * 32 + l, l < 32
                const __m256 s = _mm256_permutevar8x32_ps(ds[h], _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1,
                                                                                   2 * c + 1, 2 * c + 1, 2 * c + 1));
                sink(h * 4 + c, gguf::q6_k_values32(b, h, c), s, _mm256_mul_ps(s, lanes(-32.f)));
            }
        }
    }
};

// --- the dot products -------------------------------------------------------------------------------
using gguf::hsum8;

// rows r0 .. r0 + R of x against one weight group (u, s, m), the group's index g in the row
template <int R>
inline void accumulate(const Act& a, int64_t r0, int64_t g, __m256i u, __m256 s, __m256 m, __m256* acc, __m256* macc) {
    for (int r = 0; r < R; ++r) {
        const int64_t gi = (r0 + r) * a.groups + g;
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.hi[gi * kGroup]));
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.lo[gi * kGroup]));
        const __m256i t = _mm256_dpbusd_epi32(_mm256_slli_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, h), 8), u, l);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(s, _mm256_set1_ps(a.step[gi])), acc[r]);
        macc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(&a.lane_sum[gi * 8]), macc[r]);
    }
}

// O: float, or c10::BFloat16 (a bfloat16 model's output written as it is, no conversion pass)
template <int R, class O>
inline void finish(const __m256* acc, const __m256* macc, O* out, int64_t ldo) {
    for (int r = 0; r < R; ++r) out[r * ldo] = static_cast<O>(hsum8(_mm256_add_ps(acc[r], macc[r])));
}

// one weight row against R <= kDirectRows rows of x, unpacking each group straight into the products
template <class T, int R, class O>
void row_direct(const uint8_t* row, int64_t nb, const Act& a, int64_t r0, O* out, int64_t ldo) {
    __m256 acc[R], macc[R];
    for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        auto sink = [&](int i, __m256i u, __m256 s, __m256 m) { accumulate<R>(a, r0, b * (T::kValues / kGroup) + i, u, s, m, acc, macc); };
        T::run(row + b * T::kBytes, sink);
    }
    finish<R, O>(acc, macc, out, ldo);
}

// one weight row, unpacked into `u` (its bytes) and `sm` (per group: 8 lane scales, 8 offsets)
struct RowBuffer {
    std::vector<uint8_t> u;
    std::vector<float> sm;
    explicit RowBuffer(int64_t k) : u(k), sm(k / kGroup * 16) {}
};

template <int R, class O>
void row_buffered(const RowBuffer& w, int64_t groups, const Act& a, int64_t r0, O* out, int64_t ldo) {
    __m256 acc[R], macc[R];
    for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&w.u[g * kGroup]));
        accumulate<R>(a, r0, g, u, _mm256_loadu_ps(&w.sm[g * 16]), _mm256_loadu_ps(&w.sm[g * 16 + 8]), acc, macc);
    }
    finish<R, O>(acc, macc, out, ldo);
}

// one weight row against rows r0 .. r0 + rows (at most kDirectRows) of x
template <class T, class O>
void row_chunk(const uint8_t* row, int64_t nb, const Act& a, int64_t r0, int64_t rows, O* out, int64_t ldo) {
    switch (rows) {
        case 1: row_direct<T, 1, O>(row, nb, a, r0, out, ldo); break;
        case 2: row_direct<T, 2, O>(row, nb, a, r0, out, ldo); break;
        case 3: row_direct<T, 3, O>(row, nb, a, r0, out, ldo); break;
        case 4: row_direct<T, 4, O>(row, nb, a, r0, out, ldo); break;
        case 5: row_direct<T, 5, O>(row, nb, a, r0, out, ldo); break;
        case 6: row_direct<T, 6, O>(row, nb, a, r0, out, ldo); break;
        case 7: row_direct<T, 7, O>(row, nb, a, r0, out, ldo); break;
        default: row_direct<T, 8, O>(row, nb, a, r0, out, ldo); break;
    }
}

template <class T, class O>
void run_linear(const uint8_t* wp, int64_t rb, int64_t n, const Act& a, int64_t m, O* yp) {
    const int64_t nb = a.k / T::kValues;
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
        if (m <= kDirectRows * kDirectChunks) {  // chunks of at most kDirectRows rows, as even as they go
            const int64_t chunks = (m + kDirectRows - 1) / kDirectRows;
            for (int64_t j = begin; j < end; ++j) {
                for (int64_t c = 0, r0 = 0; c < chunks; ++c) {
                    const int64_t rows = (m - r0) / (chunks - c);
                    row_chunk<T, O>(wp + j * rb, nb, a, r0, rows, yp + r0 * n + j, n);
                    r0 += rows;
                }
            }
            return;
        }
        RowBuffer w(a.k);
        for (int64_t j = begin; j < end; ++j) {
            const uint8_t* row = wp + j * rb;
            for (int64_t b = 0; b < nb; ++b) {
                auto store = [&](int i, __m256i u, __m256 s, __m256 mm) {
                    const int64_t g = b * (T::kValues / kGroup) + i;
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&w.u[g * kGroup]), u);
                    _mm256_storeu_ps(&w.sm[g * 16], s);
                    _mm256_storeu_ps(&w.sm[g * 16 + 8], mm);
                };
                T::run(row + b * T::kBytes, store);
            }
            int64_t r = 0;
            for (; r + 4 <= m; r += 4) row_buffered<4, O>(w, a.groups, a, r, yp + r * n + j, n);
            switch (m - r) {
                case 1: row_buffered<1, O>(w, a.groups, a, r, yp + r * n + j, n); break;
                case 2: row_buffered<2, O>(w, a.groups, a, r, yp + r * n + j, n); break;
                case 3: row_buffered<3, O>(w, a.groups, a, r, yp + r * n + j, n); break;
                default: break;
            }
        }
    });
}

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

template <class O>
void run(int64_t type, const uint8_t* wp, int64_t rb, int64_t n, const Act& a, int64_t m, O* yp) {
    with_type(type, [&](auto t) { run_linear<decltype(t), O>(wp, rb, n, a, m, yp); });
}
#endif

}  // namespace

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
    Act a(m, k);
    if (xc.scalar_type() == torch::kBFloat16) {
        quantize(xc.data_ptr<c10::BFloat16>(), m, a);
        run(type, w.data_ptr<uint8_t>(), w.size(1), n, a, m, y.data_ptr<c10::BFloat16>());
    } else {
        quantize(xc.data_ptr<float>(), m, a);
        run(type, w.data_ptr<uint8_t>(), w.size(1), n, a, m, y.data_ptr<float>());
    }
    return y;
#else
    (void)x, (void)w, (void)type;
    TORCH_CHECK(false, "this build has no AVX512-VNNI kernel for GGUF blocks");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("supported", &supported, "whether a GGML type has the VNNI kernel in this build");
    m.def("linear", &linear, "x [M, K] @ block weight [N, K].T by int8 dot products");
}
