// The small per-layer ops of the Llama forward, each one pass over its rows instead of a chain of
// torch calls (every torch op reads and writes the whole activation and pays its dispatch):
//
//   rms_norm(x, w, eps)                 -> out           HF's LlamaRMSNorm
//   add_rms_norm(x, residual, w, eps)   -> out           residual += x (in place), out = norm(residual)
//   rope_(qk, cos, sin)                                  rotate q and k heads in place (half-split)
//   silu_mul(gate_up)                   -> out           silu(gate) * up, gate_up = [gate | up]
//   argmax_rows(x)                      -> idx           torch.argmax(x, dim=-1), float32 rows (greedy sampling)
//
// Tensors are float32 or bfloat16, rows with a contiguous last dimension (any row stride: qk is a
// view into the fused qkv GEMM's output). The math is float32 and rounds where the torch reference
// (llama.py) rounds: in bfloat16 every intermediate the reference stores as a bf16 tensor is rounded
// to bf16 here too (round to nearest even, as c10 does), so rope and the residual add are exact
// and the norms differ from the reference only by the order of the sum of squares; silu uses its
// own exp (about 1 ulp of float32), so silu_mul can differ by one bf16 rounding step. In float32
// nothing is contracted into an FMA that the reference computes as two ops (-ffp-contract=off).
//
// Rows are split over threads only when there is enough work per thread (kMinElemsPerThread):
// waking the second thread costs microseconds on a quiet machine and milliseconds on a busy one,
// and a batch-1 decode step's ops are a few microseconds each.
//
// The loops over a row are intrinsics, 16 floats at a time with AVX-512 or 8 with AVX2 + FMA;
// anything else (or a build with -DRADIXSERVE_NO_SIMD) runs the plain C++ loops, which compute the
// same thing (silu through std::exp instead of the vector exp).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) || defined(__AVX2__) && defined(__FMA__)) && \
    !defined(RADIXSERVE_NO_SIMD)
#include <immintrin.h>
#define RADIXSERVE_SIMD 1
#endif

namespace {

constexpr int64_t kMinElemsPerThread = 32768;

using bf16 = c10::BFloat16;

// ------------------------------------------------------------------------------------------------
// Scalar helpers: load as float, round to the storage type (identity for float).
// ------------------------------------------------------------------------------------------------
inline float ld(const float* p) { return *p; }
inline float ld(const bf16* p) { return static_cast<float>(*p); }
inline void st(float* p, float v) { *p = v; }
inline void st(bf16* p, float v) { *p = bf16(v); }  // round to nearest even, NaN kept
template <typename T> inline float rnd(float v) { return v; }
template <> inline float rnd<bf16>(float v) { return static_cast<float>(bf16(v)); }

#ifdef RADIXSERVE_SIMD
// ------------------------------------------------------------------------------------------------
// One vector of kW floats: AVX-512 (16) where the CPU has it, else AVX2 + FMA (8). The kernels
// below are written once against these.
// ------------------------------------------------------------------------------------------------
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
constexpr int64_t kW = 16;
using vf = __m512;
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf vclamp(vf x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, vset(lo)), vset(hi)); }
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
inline vf vld(const float* p) { return _mm512_loadu_ps(p); }
inline vf vld(const bf16* p) {  // bfloat16 is the top half of a float32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// float32 -> bfloat16 bits in the low half of each lane, rounded to nearest even as c10 does
// (NaN -> 0x7FC0)
inline __m512i bf16_bits(vf v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
inline vf bf16_round(vf v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
inline void vst(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void vst(bf16* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
inline vf vexp2i(vf y, vf n) { return _mm512_scalef_ps(y, n); }  // y * 2^n
#else
constexpr int64_t kW = 8;
using vf = __m256;
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf vclamp(vf x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, vset(lo)), vset(hi)); }
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float vsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vld(const float* p) { return _mm256_loadu_ps(p); }
inline vf vld(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256i bf16_bits(vf v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
inline vf bf16_round(vf v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
inline void vst(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void vst(bf16* p, vf v) {
  const __m256i r = bf16_bits(v);  // each lane <= 0xFFFF: the unsigned saturating pack keeps it
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
// y * 2^n for integral n in [-150, 128]: two exponent-only factors, each a normal float, so a
// result past the float range still overflows to inf and a tiny one underflows as expf's does
inline vf vexp2i(vf y, vf n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1);
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  const auto pow2 = [](__m256i k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(y, pow2(n1)), pow2(n2));
}
#endif

template <typename T> inline vf vrnd(vf v) { return v; }
template <> inline vf vrnd<bf16>(vf v) { return bf16_round(v); }

// exp over the whole float range, about 1 ulp: exp(x) = 2^n exp(r), n = round(x / ln 2),
// |r| <= ln2 / 2, exp(r) by its Taylor series to r^7; inf above ~88.7 and 0 below ~-103 as expf.
// NaN stays NaN.
inline vf vexp(vf x) {
  x = vclamp(x, -104.f, 89.f);
  const vf n = vround(vmul(x, vset(1.44269504088896341f)));
  vf r = vfnma(n, vset(0.693145751953125f), x);  // ln2 split in two for an exact n*ln2
  r = vfnma(n, vset(1.428606765330187045e-06f), r);
  vf y = vset(1.f / 5040.f);
  y = vfma(y, r, vset(1.f / 720.f));
  y = vfma(y, r, vset(1.f / 120.f));
  y = vfma(y, r, vset(1.f / 24.f));
  y = vfma(y, r, vset(1.f / 6.f));
  y = vfma(y, r, vset(0.5f));
  y = vfma(y, r, vset(1.f));
  y = vfma(y, r, vset(1.f));
  return vexp2i(y, n);
}
#endif

// Rows [0, rows) in chunks of at least kMinElemsPerThread elements each.
template <typename F>
void for_rows(int64_t rows, int64_t row_elems, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kMinElemsPerThread / std::max<int64_t>(1, row_elems));
  if (rows <= grain) {
    f(0, rows);
    return;
  }
  at::parallel_for(0, rows, grain, f);
}

// ------------------------------------------------------------------------------------------------
// RMSNorm, optionally after the residual add. Reference (llama.py RMSNorm), per row:
//   float32:  y = (x * r) * w
//   bfloat16: y = bf16(w * bf16(x * r))          r = 1 / sqrt(mean(x^2) + eps), x in float32
// ------------------------------------------------------------------------------------------------
template <typename T>
inline float sum_sq(const T* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef RADIXSERVE_SIMD
  vf acc = vset(0.f);
  for (; i + kW <= n; i += kW) {
    const vf v = vld(x + i);
    acc = vfma(v, v, acc);
  }
  s = vsum(acc);
#endif
  for (; i < n; ++i) s += ld(x + i) * ld(x + i);
  return s;
}

// residual[i] = round(residual[i] + x[i]), then the sum of squares of the stored values
template <typename T>
inline float add_sum_sq(const T* x, T* res, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef RADIXSERVE_SIMD
  vf acc = vset(0.f);
  for (; i + kW <= n; i += kW) {
    const vf v = vrnd<T>(vadd(vld(res + i), vld(x + i)));
    vst(res + i, v);
    acc = vfma(v, v, acc);
  }
  s = vsum(acc);
#endif
  for (; i < n; ++i) {
    const float v = rnd<T>(ld(res + i) + ld(x + i));
    st(res + i, v);
    s += v * v;
  }
  return s;
}

template <typename T>
inline void scale_row(const T* x, const T* w, T* y, int64_t n, float r) {
  int64_t i = 0;
#ifdef RADIXSERVE_SIMD
  const vf rv = vset(r);
  for (; i + kW <= n; i += kW) vst(y + i, vmul(vrnd<T>(vmul(vld(x + i), rv)), vld(w + i)));
#endif
  for (; i < n; ++i) st(y + i, rnd<T>(ld(x + i) * r) * ld(w + i));
}

template <typename T>
void norm_rows(const T* x, int64_t x_stride, T* res, int64_t res_stride, const T* w, T* y, int64_t rows,
               int64_t n, float eps) {
  for_rows(rows, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * x_stride;
      const T* src = xr;
      float ss;
      if (res != nullptr) {
        T* rr = res + r * res_stride;
        ss = add_sum_sq(xr, rr, n);
        src = rr;
      } else {
        ss = sum_sq(xr, n);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      scale_row(src, w, y + r * n, n, inv);
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, n] with a contiguous last dimension");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

torch::Tensor norm_impl(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                        const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == n && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [n] tensor of x's dtype");
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x in shape and dtype");
  }
  auto y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float>(x.data_ptr<float>(), x.stride(0), residual ? residual->data_ptr<float>() : nullptr,
                     residual ? residual->stride(0) : 0, w.data_ptr<float>(), y.data_ptr<float>(), rows, n,
                     static_cast<float>(eps));
  } else {
    norm_rows<bf16>(x.data_ptr<bf16>(), x.stride(0), residual ? residual->data_ptr<bf16>() : nullptr,
                    residual ? residual->stride(0) : 0, w.data_ptr<bf16>(), y.data_ptr<bf16>(), rows, n,
                    static_cast<float>(eps));
  }
  return y;
}

// ------------------------------------------------------------------------------------------------
// RoPE, half-split (rotate_half) convention, in place. Reference (llama.py _apply_rope), per head
// with halves x1, x2 and the row's cos, sin of D/2 values each:
//   [x1 * cos - x2 * sin, x2 * cos + x1 * sin]      every product and sum rounded to T
// ------------------------------------------------------------------------------------------------
template <typename T>
void rope_rows(T* qk, int64_t row_stride, int64_t head_stride, int64_t heads, int64_t half, const T* cos,
               const T* sin, int64_t rows) {
  for_rows(rows, heads * half * 2, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* c = cos + r * half;
      const T* s = sin + r * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = qk + r * row_stride + h * head_stride;
        T* x2 = x1 + half;
        int64_t i = 0;
#ifdef RADIXSERVE_SIMD
        for (; i + kW <= half; i += kW) {
          const vf a = vld(x1 + i), b = vld(x2 + i), cv = vld(c + i), sv = vld(s + i);
          vst(x1 + i, vsub(vrnd<T>(vmul(a, cv)), vrnd<T>(vmul(b, sv))));
          vst(x2 + i, vadd(vrnd<T>(vmul(b, cv)), vrnd<T>(vmul(a, sv))));
        }
#endif
        for (; i < half; ++i) {
          const float a = ld(x1 + i), b = ld(x2 + i), cv = ld(c + i), sv = ld(s + i);
          const float o1 = rnd<T>(a * cv) - rnd<T>(b * sv);
          const float o2 = rnd<T>(b * cv) + rnd<T>(a * sv);
          st(x1 + i, o1);
          st(x2 + i, o2);
        }
      }
    }
  });
}

void rope_(torch::Tensor qk, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(qk.device().is_cpu(), "qk must be a CPU tensor");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "qk must be [T, heads, D] with a contiguous last dimension");
  TORCH_CHECK(qk.scalar_type() == at::kFloat || qk.scalar_type() == at::kBFloat16, "qk must be float32 or bfloat16");
  const int64_t T = qk.size(0), heads = qk.size(1), D = qk.size(2);
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D / 2 && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "cos and sin must be contiguous [T, D/2]");
  TORCH_CHECK(cos.scalar_type() == qk.scalar_type() && sin.scalar_type() == qk.scalar_type(),
              "cos and sin must have qk's dtype");
  if (T == 0) return;
  if (qk.scalar_type() == at::kFloat) {
    rope_rows<float>(qk.data_ptr<float>(), qk.stride(0), qk.stride(1), heads, D / 2, cos.data_ptr<float>(),
                     sin.data_ptr<float>(), T);
  } else {
    rope_rows<bf16>(qk.data_ptr<bf16>(), qk.stride(0), qk.stride(1), heads, D / 2, cos.data_ptr<bf16>(),
                    sin.data_ptr<bf16>(), T);
  }
}

// ------------------------------------------------------------------------------------------------
// SiLU(gate) * up. Reference (llama.py MLP): bf16 rounds silu's output, then the product.
// silu(g) = g / (1 + exp(-g)), as torch computes it.
// ------------------------------------------------------------------------------------------------
template <typename T>
void silu_mul_rows(const T* gu, int64_t gu_stride, T* out, int64_t rows, int64_t n) {
  for_rows(rows, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * gu_stride;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t i = 0;
#ifdef RADIXSERVE_SIMD
      const vf one = vset(1.f);
      for (; i + kW <= n; i += kW) {
        const vf gv = vld(g + i);
        const vf sv = vrnd<T>(vdiv(gv, vadd(one, vexp(vsub(vset(0.f), gv)))));
        vst(o + i, vmul(sv, vld(u + i)));
      }
#endif
      for (; i < n; ++i) {
        const float gv = ld(g + i);
        st(o + i, rnd<T>(gv / (1.f + std::exp(-gv))) * ld(u + i));
      }
    }
  });
}

torch::Tensor silu_mul(const torch::Tensor& gu) {
  check_rows(gu, "gate_up");
  const int64_t rows = gu.size(0);
  TORCH_CHECK(gu.size(1) % 2 == 0, "gate_up must have an even width ([gate | up])");
  const int64_t n = gu.size(1) / 2;
  auto out = at::empty({rows, n}, gu.options());
  if (rows == 0) return out;
  if (gu.scalar_type() == at::kFloat)
    silu_mul_rows<float>(gu.data_ptr<float>(), gu.stride(0), out.data_ptr<float>(), rows, n);
  else
    silu_mul_rows<bf16>(gu.data_ptr<bf16>(), gu.stride(0), out.data_ptr<bf16>(), rows, n);
  return out;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return norm_impl(x, c10::nullopt, w, eps);
}

torch::Tensor add_rms_norm(const torch::Tensor& x, torch::Tensor residual, const torch::Tensor& w, double eps) {
  return norm_impl(x, residual, w, eps);
}

// The index of each float32 row's largest value, as torch.argmax(dim=-1) picks it: the first of
// equal maxima, the first NaN where a row has one. One vector pass for the maximum and whether a NaN
// is there, then a scan for its first occurrence (torch's own loop carries the index through every
// comparison: 2 ns a value, 0.1 ms a token over a 49k vocabulary).
int64_t argmax_row(const float* x, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t j = 0;
#if defined(RADIXSERVE_SIMD) && defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(mx);
  __mmask16 bad = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vm = _mm512_max_ps(vm, v);
  }
  mx = _mm512_reduce_max_ps(vm);
  nan = bad != 0;
#endif
  for (; j < n; ++j) {
    nan |= std::isnan(x[j]);
    mx = x[j] > mx ? x[j] : mx;
  }
  int64_t i = 0;
#if defined(RADIXSERVE_SIMD) && defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(mx);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (nan ? std::isnan(x[i]) : x[i] == mx) return i;
  return 0;
}

torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "argmax_rows takes float32 [B, V], V > 0");
  const auto xc = x.contiguous();
  const int64_t B = xc.size(0), V = xc.size(1);
  auto out = at::empty({B}, xc.options().dtype(at::kLong));
  const float* p = xc.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B, std::max<int64_t>(1, kMinElemsPerThread / V), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) o[b] = argmax_row(p + b * V, V);
  });
  return out;
}

int64_t simd_width() {
#ifdef RADIXSERVE_SIMD
  return kW;
#else
  return 1;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (HF LlamaRMSNorm rounding)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm of residual");
  m.def("rope_", &rope_, "Rotate q/k heads in place (half-split RoPE) by per-row cos/sin");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [gate | up] rows");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) of a float32 [B, V]: first maximum, first NaN");
  m.def("simd_width", &simd_width, "Floats per vector of this build's loops (16 AVX-512, 8 AVX2, 1 plain C++)");
}
