// y = x @ W^T for a weight W stored in GGUF-style blocks of 32, for the few-row inputs of decode,
// where the step is bound by reading the weights: the weights stay in their 4 or 8 bits and are
// read once per call, however many rows x has.
//
//   block_linear(x [M, K] f32|bf16, w u8 [N, row bytes], bits) -> y [M, N] (x's dtype)
//
// A block of 32 weights of one output row holds a scale d, a minimum m and 32 unsigned integers u:
//
//   bits 4 (GGUF Q4_1): u in [0, 15], 16 bytes, byte i = u[i] | u[i + 16] << 4       w = u * d + m
//   bits 8 (Q8_0 with an offset): u = q + 128 in [1, 255], 32 bytes                   w = u * d + m
//                                 (m = -128 d, so w = q * d exactly as Q8_0)
//
// A row of w is one output row's blocks: its integers (K/2 bytes at 4 bits, K at 8), then its K/32
// scales d, then its K/32 minimums m (float16), so that a thread reads one sequential stream.
//
// Each row of x is quantized per block of 32 in two int8 passes: hi = round(a / da) with
// da = max|a| / 127 (llama.cpp's one pass), then lo = round((a / da - hi) * 256), the rounding error
// of the first; a = step * qa with step = da / 256 and qa = 256 hi + lo (~15 bits). So
//
//   sum_i w_i a_i = d * step * sum_i u_i qa_i + m * (step * sum_i qa_i)
//
// and the inner sum is exact integer arithmetic (AVX512-VNNI: 64 u8 x s8 products per instruction,
// one per pass, combined as (s_hi << 8) + s_lo). The only rounding besides the activation's step is
// float32 accumulation across blocks. Each row of x is computed the same way whatever M is, so a
// request's output does not depend on the batch it runs in.
//
// Memory map of one 64-byte load (4-bit), blocks b..b+3 of a weight row, and the activation bytes
// quantize_rows lays out to meet it:
//
//   weight bytes   | b: u0|u16 .. u15|u31 | b+1: ... | b+2: ... | b+3: ... |
//   & 0x0F         | b: u0 .. u15         | b+1: u0 .. u15 | ...            -> with act "lo" group
//   >> 4           | b: u16 .. u31        | b+1: u16 .. u31 | ...           -> with act "hi" group
//
// so int32 lane l of the VNNI accumulator holds a partial sum of block b + l / 4 (8-bit: one load
// is 2 blocks in their natural order, lane l belongs to block b + l / 8). A per-lane scale vector
// (d of the lane's block times da) turns the integer lanes into float partial sums.
//
// Output rows are split over threads (two threads paid even for the 576 x 576 projection).
//
// The kernel needs AVX512-VNNI (and BW, VL). Elsewhere the module builds without it: simd() is false
// and block_linear refuses, and the Python side runs ATen's kernels instead (quant.py).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    !defined(RADIXSERVE_NO_SIMD)
#include <immintrin.h>
#define RADIXSERVE_VNNI 1
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroupBytes = 64;  // one weight load: 4 blocks at 4 bits, 2 at 8 bits
// Rows ahead whose bytes are prefetched: the hardware prefetcher alone left a batch-1 step's GEMMs
// about 15% slower (measured 4 and 8 alike, 0 worse; the LM head gained most).
constexpr int64_t kPrefetchRows = 4;
// An activation is two int8 passes, a = da * (hi + lo / 256): the second carries what rounding to
// int8 left, so activations keep ~15 bits (one pass of int8 moved the model's predictions several
// times more than the 4-bit weights did; docs/model.md).
constexpr int kResidualBits = 8;
constexpr float kResidual = 256.f;

// One row of x, quantized: int8 values laid out for the weight loads, per-lane scales per group
// (16 floats: da of the lane's block), and da * sum(qa) per block for the minimum term.
struct QuantRows {
  int64_t groups = 0, blocks_padded = 0, act_bytes = 0;
  std::vector<int8_t> qa;    // [M, groups * 2 * 64] (4-bit: lo 64 then hi 64) or [M, groups * 64]
  std::vector<float> lane;   // [M, groups, 16]
  std::vector<float> amin;   // [M, blocks_padded]  da * sum(qa), zero past the last block
};

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

// Reused per thread: a decode step makes ~150 of these calls, each a few microseconds of work.
template <typename T>
const QuantRows& quantize_rows(const T* x, int64_t rows, int64_t k, int64_t stride, int bits) {
  thread_local QuantRows q;
  const int64_t nb = k / kBlock;
  const int64_t per_group = bits == 4 ? 4 : 2;
  q.groups = (nb + per_group - 1) / per_group;
  q.blocks_padded = (nb + 15) / 16 * 16;
  const int64_t group_act = bits == 4 ? 2 * kGroupBytes : kGroupBytes;  // one int8 pass of a group
  q.act_bytes = q.groups * 2 * group_act;
  q.qa.resize(rows * q.act_bytes);
  q.lane.resize(rows * q.groups * 16);
  q.amin.resize(rows * q.blocks_padded);
  // the padding past the last block must read as zeros
  std::fill(q.qa.begin(), q.qa.begin() + rows * q.act_bytes, int8_t(0));
  std::fill(q.lane.begin(), q.lane.begin() + rows * q.groups * 16, 0.f);
  std::fill(q.amin.begin(), q.amin.begin() + rows * q.blocks_padded, 0.f);
  const int64_t lanes_per_block = 16 / per_group;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * stride;
    int8_t* qr = q.qa.data() + r * q.act_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      float v[kBlock];
      float amax = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) {
        v[i] = to_float(xr[b * kBlock + i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float da = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const int64_t g = b / per_group, j = b % per_group;
      int8_t qv[kBlock], rv[kBlock];
      int32_t sum = 0;
      for (int64_t i = 0; i < kBlock; ++i) {
        const float t = v[i] * inv;
        const float hi = std::nearbyint(t);
        const float lo = std::nearbyint((t - hi) * kResidual);  // |t - hi| <= 1/2: within +-128
        qv[i] = static_cast<int8_t>(hi);
        rv[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, lo)));
        sum += static_cast<int32_t>(kResidual) * qv[i] + rv[i];
      }
      int8_t* at = qr + g * 2 * group_act;
      if (bits == 4) {  // element i of block j goes with nibble (i < 16 ? lo : hi) of byte i % 16
        std::memcpy(at + j * 16, qv, 16);
        std::memcpy(at + kGroupBytes + j * 16, qv + 16, 16);
        std::memcpy(at + group_act + j * 16, rv, 16);
        std::memcpy(at + group_act + kGroupBytes + j * 16, rv + 16, 16);
      } else {
        std::memcpy(at + j * kBlock, qv, kBlock);
        std::memcpy(at + group_act + j * kBlock, rv, kBlock);
      }
      const float step = da / kResidual;  // the value of one unit of the combined integer
      q.amin[r * q.blocks_padded + b] = step * static_cast<float>(sum);
      float* lane = q.lane.data() + (r * q.groups + g) * 16 + j * lanes_per_block;
      for (int64_t l = 0; l < lanes_per_block; ++l) lane[l] = step;
    }
  }
  return q;
}

#ifdef RADIXSERVE_VNNI
// R rows of x against one weight row: the weight bytes are loaded and unpacked once per group.
template <int R, int Bits>
inline void dot_rows(const uint8_t* w, const at::Half* d, const at::Half* m, const QuantRows& q, int64_t r0,
                     int64_t nb, float* out) {
  constexpr int64_t per_group = Bits == 4 ? 4 : 2;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // lane l -> block l / (16 / per_group) of the group
  const __m512i lane_block = Bits == 4 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                       : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t groups = q.groups;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t blocks = std::min<int64_t>(per_group, nb - g * per_group);
    const int64_t bytes = blocks * kBlock * Bits / 8;
    const __mmask64 kb = bytes == 64 ? ~__mmask64(0) : ((__mmask64(1) << bytes) - 1);
    const __m512i raw = _mm512_maskz_loadu_epi8(kb, w + g * kGroupBytes);
    const __m128i dh = _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << blocks) - 1), d + g * per_group);
    const __m512 dw = _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(_mm_cvtph_ps(dh)));
    if constexpr (Bits == 4) {
      const __m512i lo = _mm512_and_si512(raw, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = q.qa.data() + (r0 + r) * q.act_bytes + g * 4 * kGroupBytes;
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(a));
        s = _mm512_dpbusd_epi32(s, hi, _mm512_loadu_si512(a + kGroupBytes));
        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(a + 2 * kGroupBytes));
        t = _mm512_dpbusd_epi32(t, hi, _mm512_loadu_si512(a + 3 * kGroupBytes));
        s = _mm512_add_epi32(_mm512_slli_epi32(s, kResidualBits), t);
        const __m512 da = _mm512_loadu_ps(q.lane.data() + ((r0 + r) * groups + g) * 16);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(da, dw), acc[r]);
      }
    } else {
      for (int r = 0; r < R; ++r) {
        const int8_t* a = q.qa.data() + (r0 + r) * q.act_bytes + g * 2 * kGroupBytes;
        const __m512i s = _mm512_add_epi32(
            _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), raw, _mm512_loadu_si512(a)), kResidualBits),
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), raw, _mm512_loadu_si512(a + kGroupBytes)));
        const __m512 da = _mm512_loadu_ps(q.lane.data() + ((r0 + r) * groups + g) * 16);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(da, dw), acc[r]);
      }
    }
  }
  // the minimum term: sum over blocks of m * da * sum(qa)
  for (int64_t b = 0; b < nb; b += 16) {
    const int64_t left = std::min<int64_t>(16, nb - b);
    const __mmask16 km = left == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 mw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(km, m + b));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(q.amin.data() + (r0 + r) * q.blocks_padded + b), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}
// Column j of y (one weight row against every row of x), stored in y's dtype.
template <int Bits, typename T>
void run_rows(const uint8_t* w, const at::Half* d, const at::Half* m, const QuantRows& q, int64_t rows, int64_t nb,
              T* y, int64_t n) {
  float out[4];
  for (int64_t r = 0; r < rows; r += 4) {
    const int64_t take = std::min<int64_t>(4, rows - r);
    switch (take) {
      case 4: dot_rows<4, Bits>(w, d, m, q, r, nb, out); break;
      case 3: dot_rows<3, Bits>(w, d, m, q, r, nb, out); break;
      case 2: dot_rows<2, Bits>(w, d, m, q, r, nb, out); break;
      default: dot_rows<1, Bits>(w, d, m, q, r, nb, out); break;
    }
    for (int64_t i = 0; i < take; ++i) y[(r + i) * n] = static_cast<T>(out[i]);
  }
}

template <typename T>
void run_all(const uint8_t* w, const QuantRows& q, int64_t rows, int64_t n, int64_t nb, int64_t bits, T* y) {
  const int64_t qs_bytes = nb * kBlock * bits / 8;
  const int64_t stride = qs_bytes + 4 * nb;
  // ~16 KiB of weights per task at the least: small layers stay on one thread, where waking the
  // second one would cost more than it saves
  const int64_t grain = std::max<int64_t>(1, 16384 / stride);
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t j = n0; j < n1; ++j) {
      const uint8_t* row = w + j * stride;
      if (j + kPrefetchRows < n1) {
        const char* p = reinterpret_cast<const char*>(row + kPrefetchRows * stride);
        for (int64_t o = 0; o < stride; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
      }
      const at::Half* d = reinterpret_cast<const at::Half*>(row + qs_bytes);
      if (bits == 4) {
        run_rows<4>(row, d, d + nb, q, rows, nb, y + j, n);
      } else {
        run_rows<8>(row, d, d + nb, q, rows, nb, y + j, n);
      }
    }
  });
}
#endif  // RADIXSERVE_VNNI

torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t bits) {
#ifndef RADIXSERVE_VNNI
  TORCH_CHECK(false, "block_linear needs AVX512-VNNI, which this build does not have");
#endif
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  const int64_t nb = k / kBlock;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2 && w.size(1) == k * bits / 8 + 4 * nb,
              "w must be contiguous uint8 [N, K * bits / 8 + K / 8]");
  const int64_t stride = x.stride(0);
  const QuantRows& q = x.scalar_type() == at::kFloat
                           ? quantize_rows(x.data_ptr<float>(), rows, k, stride, static_cast<int>(bits))
                           : quantize_rows(x.data_ptr<at::BFloat16>(), rows, k, stride, static_cast<int>(bits));
  torch::Tensor y = torch::empty({rows, n}, x.options());
#ifdef RADIXSERVE_VNNI
  if (x.scalar_type() == at::kFloat) {
    run_all(w.data_ptr<uint8_t>(), q, rows, n, nb, bits, y.data_ptr<float>());
  } else {
    run_all(w.data_ptr<uint8_t>(), q, rows, n, nb, bits, y.data_ptr<at::BFloat16>());
  }
#endif
  return y;
}

bool simd() {
#ifdef RADIXSERVE_VNNI
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_linear", &block_linear, "x @ W^T for W in blocks of 32 (4-bit Q4_1, or 8-bit with an offset)");
  m.def("simd", &simd, "Whether this build has the AVX512-VNNI kernel (else block_linear refuses)");
}
