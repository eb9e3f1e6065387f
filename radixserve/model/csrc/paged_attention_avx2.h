// The paged decode kernel's AVX2 + FMA path (CPUs without AVX-512): the generic item loop of
// paged_attention.cpp with G and D known at compile time, 8 floats a vector. Included by
// paged_attention.cpp inside its anonymous namespace, after Problem, Item, AheadRows, slot_rows
// and finish_item. Per block of 16 tokens and KV head:
//   scores   one partial vector per (query head, token): D / 8 multiply-adds, then 8 of them
//            reduced together (hsum8x8) instead of one horizontal sum each
//   softmax  the running max, a vector exp (exp8) of the 16 scores and of the G rescale factors
//   P x V    per 8 dims of V, the G heads' accumulators in registers over the block's tokens
// The item's state (accumulators, max, row sum) lives in a per-thread buffer between blocks.
// Every row's result depends on its own tokens only, as on the other paths.
#pragma once

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
// one-byte pools, as the AVX-512 loads (float8 through the float16 converter, F16C)
inline __m256 load8(const c10::Float8_e5m2* x) {
  const __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
  return _mm256_cvtph_ps(_mm_slli_epi16(h, 8));
}
inline __m256 load8(const c10::Float8_e4m3fn* x) {  // 2^8 times too small: kLoadUnit
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBFFF))));
}
inline __m256 load8(const int8_t* x) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x))));
}

// exp for x <= 0 (scores minus their running max), as exp16 of the AVX-512 path: 2^n exp(r),
// n = round(x / ln 2), exp(r) by its Taylor series to r^7; inputs under -87 are clamped.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 y = _mm256_set1_ps(1.f / 5040.f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 720.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 120.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 24.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 6.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Eight horizontal sums at once: lane i of the result is the sum of the 8 lanes of x[i].
inline __m256 hsum8x8(const __m256* x) {
  const __m256 a0 = _mm256_hadd_ps(x[0], x[1]), a1 = _mm256_hadd_ps(x[2], x[3]);
  const __m256 a2 = _mm256_hadd_ps(x[4], x[5]), a3 = _mm256_hadd_ps(x[6], x[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  // b0: [x0 x1 x2 x3 (low 128 bits) | x0 x1 x2 x3 (high)], partial sums of each half; b1 the same for x4-x7
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

template <typename kv_t, int G, int NC>
bool attend_item_avx2(const Problem& p, const Item& it) {
  static_assert(G <= 8, "the G rescale factors take one vector exp");
  constexpr int64_t D = NC * 8;
  const int64_t H = p.H, KVH = p.KVH;
  const kv_t* K = static_cast<const kv_t*>(p.k);
  const kv_t* V = static_cast<const kv_t*>(p.v);
  const int64_t* slots = p.r2t + p.rpi[it.row] * p.r2t_stride;
  const float* q = p.q + it.row * H * D;
  thread_local std::vector<float> state;
  state.assign(H * D + 2 * H, 0.f);
  float* acc_all = state.data();
  float* m = acc_all + H * D;
  float* l = m + H;
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  bool ok = true;
  alignas(32) float prob[G][kBlock];
  alignas(32) float ksc[kBlock], vsc[kBlock];  // an int8 pool's scales of the block, one head
  int64_t rows[kBlock];
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = it.begin; t0 < it.end; t0 += kBlock) {
    const int64_t n = std::min(kBlock, it.end - t0);
    ok = slot_rows(p, slots, t0, n, rows) && ok;
    const AheadRows<kv_t> ahead(p, slots, t0, it.end);
    // lanes of the block's two score vectors that hold a token (n < 16 only in an item's last block)
    alignas(32) int32_t live_bits[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) live_bits[j] = j < n ? -1 : 0;
    const __m256 live0 = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(live_bits)));
    const __m256 live1 = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(live_bits + 8)));
    int64_t srow[kBlock];
    if (p.ks != nullptr) scale_rows(rows, n, D, srow);
    for (int64_t h = 0; h < KVH; ++h) {
      const float* qh = q + h * G * D;
      float* acc_h = acc_all + h * G * D;
      if (p.ks != nullptr) {
        block_scales(p.ks, srow, n, h, ksc, kLoadUnit<kv_t>);
        block_scales(p.vs, srow, n, h, vsc, kLoadUnit<kv_t>);
      }
      __m256 part[G][kBlock];
      for (int64_t j = 0; j < kBlock; ++j) {
        ahead.k_of(j, h);
        if (j >= n) {
          for (int g = 0; g < G; ++g) part[g][j] = _mm256_setzero_ps();
          continue;
        }
        const kv_t* kp = K + rows[j] + h * D;
        __m256 kc[NC];
        for (int c = 0; c < NC; ++c) kc[c] = load8(kp + c * 8);
        for (int g = 0; g < G; ++g) {
          __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qh + g * D), kc[0]);
          for (int c = 1; c < NC; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + c * 8), kc[c], a);
          part[g][j] = a;
        }
      }
      __m256 sc[G][2];
      alignas(32) float mdiff[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      float mnew[G];
      for (int g = 0; g < G; ++g) {
        __m256 s0 = hsum8x8(part[g]), s1 = hsum8x8(part[g] + 8);
        if (p.ks != nullptr) {
          s0 = _mm256_mul_ps(s0, _mm256_load_ps(ksc));
          s1 = _mm256_mul_ps(s1, _mm256_load_ps(ksc + 8));
        }
        sc[g][0] = _mm256_blendv_ps(neg_inf, s0, live0);
        sc[g][1] = _mm256_blendv_ps(neg_inf, s1, live1);
        mnew[g] = std::max(m[h * G + g], hmax8(_mm256_max_ps(sc[g][0], sc[g][1])));
        mdiff[g] = m[h * G + g] - mnew[g];  // -inf on the first block: its factor is ~0
      }
      alignas(32) float alphas[8];
      _mm256_store_ps(alphas, exp8(_mm256_load_ps(mdiff)));
      for (int g = 0; g < G; ++g) {
        float& mg = m[h * G + g];
        const float alpha = mg == mnew[g] ? 1.f : alphas[g];
        const __m256 mv = _mm256_set1_ps(mnew[g]);
        const __m256 e0 = _mm256_and_ps(live0, exp8(_mm256_sub_ps(sc[g][0], mv)));
        const __m256 e1 = _mm256_and_ps(live1, exp8(_mm256_sub_ps(sc[g][1], mv)));
        // P x V takes a scaled pool's V scales with the probabilities (the row sum does not)
        _mm256_store_ps(prob[g], p.vs != nullptr ? _mm256_mul_ps(e0, _mm256_load_ps(vsc)) : e0);
        _mm256_store_ps(prob[g] + 8, p.vs != nullptr ? _mm256_mul_ps(e1, _mm256_load_ps(vsc + 8)) : e1);
        const __m256 s = _mm256_add_ps(e0, e1);
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        l[h * G + g] = l[h * G + g] * alpha + _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
        mg = mnew[g];
        if (alpha != 1.f) {
          const __m256 av = _mm256_set1_ps(alpha);
          for (int c = 0; c < NC; ++c)
            _mm256_storeu_ps(acc_h + g * D + c * 8, _mm256_mul_ps(_mm256_loadu_ps(acc_h + g * D + c * 8), av));
        }
      }
      for (int64_t j = 0; j < kBlock; ++j) ahead.v_of(j, h);
      for (int c = 0; c < NC; ++c) {
        __m256 acc[G];
        for (int g = 0; g < G; ++g) acc[g] = _mm256_loadu_ps(acc_h + g * D + c * 8);
        for (int64_t j = 0; j < n; ++j) {
          const __m256 vc = load8(V + rows[j] + h * D + c * 8);
          for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(&prob[g][j]), vc, acc[g]);
        }
        for (int g = 0; g < G; ++g) _mm256_storeu_ps(acc_h + g * D + c * 8, acc[g]);
      }
    }
  }
  finish_item(p, it, acc_all, m, l);
  return ok;
}
