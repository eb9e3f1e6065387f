// x @ W^T for a GGUF weight by AMX int8 tiles (tdpbusd), with an arithmetic that does not depend on
// how many rows x has: the decode rows of a bfloat16 model and the rows of a speculative verify
// step, where a row's result must be what decoding it alone computes.
//
//   pack(w u8 [N, row bytes], type) -> packed u8        (once, at load: the same bytes, re-laid)
//   linear(x [M, K] f32|bf16, packed, type, n, k) -> y [M, N] in x's dtype   (M <= kMaxRows)
//
// Types with a float16 scale per 32 values: Q4_0 (w = d (q - 8)), Q4_1 (w = d q + m), Q8_0 (w = d q).
// The weight is packed per block of 16 output rows and group of 32 inputs into what the tile unit
// reads as its B operand (8 rows of 16 columns x 4 bytes: column c holds output row c's inputs
// 4r .. 4r + 3): 4-bit types keep two values a byte (B bytes p and p + 256 in one byte's low and
// high nibble; unpacked by two masks a group), Q8_0 keeps its bytes; then the 16 rows' d (and m)
// as float16. A packed weight is as large as the file's blocks (rows padded to a multiple of 16).
//
// Each row of x is quantized per span of 256 values: qa = round(x / step), step = max|x| / 32639,
// split qa = 256 hi + lo with hi in [-127, 127] and lo in [-128, 127]; the A operand holds hi + 128
// and lo + 128 as unsigned bytes (tdpbusd multiplies unsigned by signed bytes), one tile row each,
// and, while there is room, a row of ones whose products are the group's weight sums. A group's
//
//   S = sum_k q_k qa_k = 256 (C_hi - 128 sw) + (C_lo - 128 sw),      sw = sum_k q_k
//
// is exact integer arithmetic, and the float part is the same sequence of operations for every row:
//
//   inner += float(S) * d          per group of the span, in order
//   acc   += m * (step * sum qa)   per group (Q4_1)
//   acc   += inner * step          at the end of each span
//
// so a row's result is the same bits whatever rows come with it. While the tile unit multiplies
// group g, the vector units finish group g - 1 (two C, A and B tiles in turn).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__) && defined(__linux__) && !defined(RADIXSERVE_NO_SIMD)
#include <immintrin.h>

#include "amx_tiles.h"

#define RADIXSERVE_AMX8 1
#endif

namespace {

constexpr int64_t kGroup = 32, kSpan = 256, kCols = 16;
constexpr int64_t kMaxRows = 8;  // rows of x per call: hi and lo rows of each fill a 16-row tile
constexpr float kQMax = 32639.f;  // 127 * 256 + 127

struct Format {
    int bits;     // 4 or 8
    bool offset;  // a float16 m per group (Q4_1)
    int64_t block_bytes;
};

bool format_of(int64_t type, Format* f) {
    switch (type) {
        case 2: *f = {4, false, 18}; return true;  // Q4_0
        case 3: *f = {4, true, 20}; return true;   // Q4_1
        case 8: *f = {8, false, 34}; return true;  // Q8_0
        default: return false;
    }
}

// bytes of one packed (16 rows x 32 inputs) group: B payload, then d, then m
int64_t record_bytes(const Format& f) { return (f.bits == 4 ? 256 : 512) + 32 + (f.offset ? 32 : 0); }

// The value of input k of a GGUF block as the B operand takes it (a signed byte).
int8_t block_value(const Format& f, int64_t type, const uint8_t* blk, int k) {
    if (f.bits == 8) return static_cast<int8_t>(blk[2 + k]);
    const uint8_t byte = blk[(f.offset ? 4 : 2) + k % 16];
    const int u = k < 16 ? (byte & 15) : (byte >> 4);
    return static_cast<int8_t>(type == 2 ? u - 8 : u);
}

torch::Tensor pack(const torch::Tensor& w, int64_t type) {
    Format f{};
    TORCH_CHECK(format_of(type, &f), "no AMX int8 packing for GGML type ", type);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be contiguous uint8 [N, row bytes]");
    const int64_t n = w.size(0), rb = w.size(1), groups = rb / f.block_bytes;
    TORCH_CHECK(groups * f.block_bytes == rb, "row bytes are not whole blocks");
    const int64_t blocks = (n + kCols - 1) / kCols, rec = record_bytes(f);
    torch::Tensor out = torch::zeros({blocks, groups * rec}, torch::kUInt8);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    uint8_t* op = out.data_ptr<uint8_t>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t bl = b0; bl < b1; ++bl)
            for (int64_t g = 0; g < groups; ++g) {
                uint8_t* r = op + (bl * groups + g) * rec;
                int8_t B[512] = {};
                uint16_t* d = reinterpret_cast<uint16_t*>(r + (f.bits == 4 ? 256 : 512));
                for (int64_t c = 0; c < kCols && bl * kCols + c < n; ++c) {
                    const uint8_t* blk = wp + (bl * kCols + c) * rb + g * f.block_bytes;
                    std::memcpy(d + c, blk, 2);
                    if (f.offset) std::memcpy(d + kCols + c, blk + 2, 2);
                    for (int k = 0; k < kGroup; ++k) B[(k / 4) * 64 + c * 4 + k % 4] = block_value(f, type, blk, k);
                }
                if (f.bits == 8) {
                    std::memcpy(r, B, 512);
                } else {
                    for (int p = 0; p < 256; ++p)
                        r[p] = static_cast<uint8_t>((B[p] & 15) | ((B[p + 256] & 15) << 4));
                }
            }
    });
    return out;
}

#ifdef RADIXSERVE_AMX8
// x quantized: per group, A rows (hi rows, lo rows, then a row of ones where there is room);
// per row and span its step; per row and group step * sum(qa)
struct Act {
    int64_t m = 0, groups = 0, spans = 0, arows = 0;
    std::vector<uint8_t> a;
    std::vector<float> step, gsum;
};

template <typename T>
void quantize(const T* x, int64_t m, int64_t k, Act& q) {
    q.m = m;
    q.groups = k / kGroup;
    q.spans = (k + kSpan - 1) / kSpan;
    q.arows = 2 * m < kCols ? 2 * m + 1 : 2 * m;
    q.a.assign(q.groups * q.arows * kGroup, 1);
    q.step.assign(m * q.spans, 0.f);
    q.gsum.assign(m * q.groups, 0.f);
    for (int64_t i = 0; i < m; ++i) {
        const T* xr = x + i * k;
        for (int64_t s = 0; s < q.spans; ++s) {
            const int64_t k0 = s * kSpan, k1 = std::min(k, k0 + kSpan);
            float mx = 0.f;
            for (int64_t j = k0; j < k1; ++j) mx = std::max(mx, std::fabs(static_cast<float>(xr[j])));
            const float step = mx / kQMax, inv = mx > 0.f ? kQMax / mx : 0.f;
            q.step[i * q.spans + s] = step;
            for (int64_t g = k0 / kGroup; g < k1 / kGroup; ++g) {
                uint8_t* hi = q.a.data() + (g * q.arows + i) * kGroup;
                uint8_t* lo = q.a.data() + (g * q.arows + m + i) * kGroup;
                int32_t sum = 0;
                for (int64_t j = 0; j < kGroup; ++j) {
                    const int32_t qa = static_cast<int32_t>(std::nearbyint(static_cast<float>(xr[g * kGroup + j]) * inv));
                    const int32_t h = (qa + 128) >> 8;
                    hi[j] = static_cast<uint8_t>(h + 128);
                    lo[j] = static_cast<uint8_t>(qa - 256 * h + 128);
                    sum += qa;
                }
                q.gsum[i * q.groups + g] = step * static_cast<float>(sum);
            }
        }
    }
}

// One block of 16 output rows against the M rows of x.
template <int M, int Bits, bool Offset, typename O>
void run_block(const uint8_t* rec0, int64_t rec, const Act& q, O* y, int64_t ldy, int64_t cols) {
    constexpr bool kOnes = 2 * M < kCols;
    constexpr int64_t kPayload = Bits == 4 ? 256 : 512;
    const int64_t groups = q.groups, arows = q.arows;
    alignas(64) uint8_t bbuf[2][512];
    alignas(64) int32_t cbuf[kCols * kCols];
    __m512i sums[2];
    __m512 acc[M], inner[M];
    for (int i = 0; i < M; ++i) acc[i] = inner[i] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi8(1), eight = _mm512_set1_epi8(8);
    const uint8_t* act = q.a.data();
    auto issue = [&](int64_t g) {
        const int b = static_cast<int>(g & 1);
        const uint8_t* r = rec0 + g * rec;
        const uint8_t* bsrc = r;
        // the payload four groups ahead (past the weight's end a prefetch is only a hint, never a fault)
        for (int64_t o = 0; o < kPayload; o += 64) _mm_prefetch(reinterpret_cast<const char*>(r + 4 * rec + o), _MM_HINT_T0);
        __m512i sw = _mm512_setzero_si512();
        if constexpr (Bits == 4) {
            for (int p = 0; p < 4; ++p) {
                const __m512i v = _mm512_loadu_si512(r + p * 64);
                __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                if constexpr (!Offset) {  // Q4_0's q - 8, sign-extended from 4 bits: (u ^ 8) - 8
                    lo = _mm512_sub_epi8(_mm512_xor_si512(lo, eight), eight);
                    hi = _mm512_sub_epi8(_mm512_xor_si512(hi, eight), eight);
                }
                _mm512_store_si512(bbuf[b] + p * 64, lo);
                _mm512_store_si512(bbuf[b] + 256 + p * 64, hi);
                if constexpr (!kOnes) sw = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sw, ones, lo), ones, hi);
            }
            bsrc = bbuf[b];
        } else if constexpr (!kOnes) {
            for (int p = 0; p < 8; ++p) sw = _mm512_dpbusd_epi32(sw, ones, _mm512_loadu_si512(r + p * 64));
        }
        sums[b] = sw;
        if (b == 0) {
            _tile_loadd(4, bsrc, 64);
            _tile_loadd(2, act + g * arows * kGroup, kGroup);
            _tile_zero(0);
            _tile_dpbusd(0, 2, 4);
        } else {
            _tile_loadd(5, bsrc, 64);
            _tile_loadd(3, act + g * arows * kGroup, kGroup);
            _tile_zero(1);
            _tile_dpbusd(1, 3, 5);
        }
    };
    auto finish = [&](int64_t g) {
        const int b = static_cast<int>(g & 1);
        if (b == 0) {
            _tile_stored(0, cbuf, 64);
        } else {
            _tile_stored(1, cbuf, 64);
        }
        const uint8_t* r = rec0 + g * rec + kPayload;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)));
        const __m512i sw = kOnes ? _mm512_load_si512(cbuf + 2 * M * kCols) : sums[b];
        const __m512i corr = _mm512_add_epi32(_mm512_slli_epi32(sw, 15), _mm512_slli_epi32(sw, 7));  // 128 * 257 sw
        for (int i = 0; i < M; ++i) {
            const __m512i hi = _mm512_load_si512(cbuf + i * kCols), lo = _mm512_load_si512(cbuf + (M + i) * kCols);
            const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo), corr);
            inner[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, inner[i]);
        }
        if constexpr (Offset) {
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 32)));
            for (int i = 0; i < M; ++i) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(q.gsum[i * groups + g]), acc[i]);
        }
        if ((g + 1) % (kSpan / kGroup) == 0 || g + 1 == groups) {
            for (int i = 0; i < M; ++i) {
                acc[i] = _mm512_fmadd_ps(inner[i], _mm512_set1_ps(q.step[i * q.spans + g / (kSpan / kGroup)]), acc[i]);
                inner[i] = _mm512_setzero_ps();
            }
        }
    };
    issue(0);
    for (int64_t g = 1; g < groups; ++g) {
        issue(g);
        finish(g - 1);
    }
    finish(groups - 1);
    const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
    for (int i = 0; i < M; ++i) {
        if constexpr (std::is_same_v<O, float>) {
            _mm512_mask_storeu_ps(y + i * ldy, keep, acc[i]);
        } else {  // rounded to nearest even, as Tensor.to
            const __m256bh h = _mm512_cvtneps_pbh(acc[i]);
            _mm256_mask_storeu_epi16(y + i * ldy, keep, reinterpret_cast<const __m256i&>(h));
        }
    }
}

template <int Bits, bool Offset, typename O>
void run_rows(const uint8_t* pp, int64_t rec, const Act& q, int64_t n, O* y) {
    const int64_t blocks = (n + kCols - 1) / kCols, m = q.m;
    // ~8 KiB of weights per task at the least (a 576-wide layer's block is ~6 KiB)
    const int64_t grain = std::max<int64_t>(1, 8192 / (q.groups * rec));
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
        amx::TileConfig c;
        for (int t = 0; t < 2; ++t) c.rows[t] = static_cast<uint8_t>(q.arows), c.colsb[t] = 64;           // C
        for (int t = 2; t < 4; ++t) c.rows[t] = static_cast<uint8_t>(q.arows), c.colsb[t] = kGroup;       // A
        for (int t = 4; t < 6; ++t) c.rows[t] = kGroup / 4, c.colsb[t] = 64;                              // B
        _tile_loadconfig(&c);
        for (int64_t bl = b0; bl < b1; ++bl) {
            const uint8_t* rec0 = pp + bl * q.groups * rec;
            const int64_t cols = std::min<int64_t>(kCols, n - bl * kCols);
            O* yb = y + bl * kCols;
            switch (m) {
#define RADIXSERVE_ROWS(R) \
    case R: run_block<R, Bits, Offset, O>(rec0, rec, q, yb, n, cols); break;
                RADIXSERVE_ROWS(1) RADIXSERVE_ROWS(2) RADIXSERVE_ROWS(3) RADIXSERVE_ROWS(4)
                RADIXSERVE_ROWS(5) RADIXSERVE_ROWS(6) RADIXSERVE_ROWS(7) RADIXSERVE_ROWS(8)
#undef RADIXSERVE_ROWS
                default: break;
            }
        }
        _tile_release();
    });
}
#endif  // RADIXSERVE_AMX8

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t type, int64_t n, int64_t k) {
    Format f{};
    TORCH_CHECK(format_of(type, &f), "no AMX int8 kernel for GGML type ", type);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == k && k % kGroup == 0, "x must be [M, K] with K a multiple of 32");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
    const int64_t m = x.size(0), groups = k / kGroup, rec = record_bytes(f);
    TORCH_CHECK(m >= 1 && m <= kMaxRows, "x must have 1 to ", kMaxRows, " rows");
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                    packed.size(0) == (n + kCols - 1) / kCols && packed.size(1) == groups * rec,
                "packed is not this weight's pack()");
    torch::Tensor y = torch::empty({m, n}, x.options());
#ifdef RADIXSERVE_AMX8
    TORCH_CHECK(amx::permitted(), "the kernel may not use the AMX tile registers here");
    const torch::Tensor xc = x.contiguous();
    Act q;
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    auto run = [&](auto* yp) {
        if (f.bits == 8) {
            run_rows<8, false>(pp, rec, q, n, yp);
        } else if (f.offset) {
            run_rows<4, true>(pp, rec, q, n, yp);
        } else {
            run_rows<4, false>(pp, rec, q, n, yp);
        }
    };
    if (x.scalar_type() == at::kFloat) {
        quantize(xc.data_ptr<float>(), m, k, q);
        run(y.data_ptr<float>());
    } else {
        quantize(xc.data_ptr<at::BFloat16>(), m, k, q);
        run(y.data_ptr<at::BFloat16>());
    }
#else
    TORCH_CHECK(false, "this build has no AMX int8 kernel");
#endif
    return y;
}

bool available() {
#ifdef RADIXSERVE_AMX8
    return amx::permitted();
#else
    return false;
#endif
}

bool supported(int64_t type) {
    Format f{};
    return format_of(type, &f);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("pack", &pack, "a GGUF weight [N, row bytes] laid out for linear (the same bytes, per 16 rows)");
    m.def("linear", &linear, "x [M <= 8, K] @ the packed weight's W.T, in x's dtype");
    m.def("available", &available, "whether this build and CPU run linear (AMX int8 tiles)");
    m.def("supported", &supported, "whether a GGML type can be packed");
    m.def("max_rows", [] { return kMaxRows; }, "rows of x a call takes at most");
}
