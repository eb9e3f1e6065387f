// Paged decode attention on CPU: each decode row attends over its request's KV slots, read in place
// from the pool through req_to_token (no gather copy).
//
//   q            [B, H, D]        float32 or bfloat16, one new token per request
//   k_buf, v_buf [S, KVH, D]      the pool of one layer (row = one KV slot): float32, bfloat16,
//                                 float8 e4m3 / e5m2 or int8, a one-byte pool with
//   k_scale, v_scale [S, KVH]     float32, one per (slot, KV head): value = scale * stored (optional;
//                                 int8 and e4m3 pools always have them)
//   req_to_token [R, C] int64     req_to_token[req_pool_indices[b], t] = slot of token t of row b
//   seq_lens     [B] int64        tokens row b attends to (its new token included)
//   window       int              > 0: a sliding window, row b attends to its last `window` tokens
//                                 only, [seq_lens[b] - window, seq_lens[b]) (slots before that are
//                                 never read: the pool may have freed them)
//   returns      [B, H * D]       in q's dtype
//
// Work is cut into items (row, token range). An item walks its tokens in blocks of kBlock and, for
// each block, attends every KV head in turn: a token's K (and V) row of all heads is contiguous in
// the pool (KVH * D elements), so a block reads whole rows once, in order, and the rows of the
// block two ahead are prefetched while this one computes (AheadRows). (Items of one (row, KV head)
// each were measured slower: each read a third of every row, and the three passes over a row's
// pages left the hardware prefetcher less to work with.) The G = H / KVH query heads of one KV head are attended
// together, so each K/V vector is loaded once for G queries (grouped-query attention). Each head
// runs an online softmax in float32: scores for the block, a new running max, rescale of the
// running sum and accumulator, then P x V. Long contexts are split over several items (split-K) so
// that batch 1 keeps every thread busy; the items of a split row leave (max, sum, unnormalised
// acc) partials per head that a second pass merges exactly:
//
//   m = max_s m_s;   out = sum_s exp(m_s - m) acc_s / sum_s exp(m_s - m) l_s
//
// Items go to threads as contiguous runs of equal token cost (one run per thread), not by count:
// a ragged batch would otherwise leave one thread with all the long rows.
//
// With AVX-512 the inner loops are intrinsics specialised on G and D; with AVX2 + FMA and no
// AVX-512, the same in 8-float vectors (paged_attention_avx2.h, about 3x the plain loops at batch
// 1 x 800 tokens); anything else (another CPU, an unusual head shape, a build with
// -DRADIXSERVE_NO_AVX512 / -DRADIXSERVE_NO_AVX2) runs the plain C++ loops below, which compute
// the same thing.
//
// One-byte pools (mem/kv_format.py) are widened to float32 as they are loaded: float8 through the
// half-precision converter (e5m2 is the top byte of a float16; e4m3's exponent and mantissa bits
// moved into a float16's and the result times 2^8, subnormals included), int8 by an integer
// conversion. A scaled pool's scales multiply each token's scores (K) and probabilities (V, after
// the row sum is taken), so the dequantized rows are never formed. Half the bytes of bfloat16 to
// read, which is what bounds a decode step over long contexts.
//
// A bfloat16 pool on a CPU with AVX512-BF16 is read with bfloat16 dot products (vdpbf16ps, 32
// products per instruction). The scores take K as stored against q rounded to bfloat16 (exact for a
// bfloat16 model's q; the softmax scale is applied to the scores), two tokens per vector, which
// halves the horizontal-sum work; P x V takes the probabilities rounded to bfloat16 (the row sum
// uses the same rounded values) against V two tokens at a time. Measured about 20% faster than
// widening K and V to float32 (-DRADIXSERVE_NO_BF16_DOT, the path of other CPUs; tests compare the
// two). With one layer of batch 1 x 1,024 tokens in cache it takes ~12 ns per token and KV head on
// one thread, about 4.7 of them the call's fixed costs; of the rest, leaving out the scores saved
// ~5 ns (their lane shuffles more than their multiply-adds), the softmax ~1.6, P x V ~0.5. Streaming
// from memory, as in a real step, the reads bound it (see AheadRows, and read_kv_rows for the floor).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    !defined(RADIXSERVE_NO_AVX512)
#include <immintrin.h>
#define RADIXSERVE_AVX512 1
#if defined(__AVX512BF16__) && !defined(RADIXSERVE_NO_BF16_DOT)
#define RADIXSERVE_BF16_DOT 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(RADIXSERVE_NO_AVX2)
#include <immintrin.h>
#define RADIXSERVE_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 16;        // tokens per online-softmax step (one AVX-512 vector of scores)
constexpr int64_t kPrefetchBlocks = 2;  // rows are prefetched this many blocks ahead (AheadRows)
// A row is cut into pieces by its length alone, never by what else is in the batch: a row's result
// then does not depend on its batch (the rounding of a split row's merge differs from an unsplit
// row's), so decoding a token alone or among others, or verifying it in a speculative step, gives
// the same bits. kMaxPieces pieces keep batch 1 busy on a few threads.
constexpr int64_t kMinSplit = 128;    // never split a row into pieces shorter than this
constexpr int64_t kMaxPieces = 4;
constexpr int64_t kItemOverhead = 16;  // fixed cost of an item, in token equivalents, for the balance
// Below this many tokens per thread a problem runs on fewer threads. In a decode step the KV comes
// from memory (the weights streamed through the cache since the last step), ~4-5 GB/s per thread:
// a batch-1 row of 256 tokens took 53 us per layer on one thread and 37 on two (the step's
// attention 1.6 -> 1.1-1.3 ms; 512 here before). Waking the second thread costs a few us.
constexpr int64_t kMinTokensPerThread = 128;

struct Item {
  int64_t row;    // decode row b
  int64_t begin;  // token range [begin, end) of the row
  int64_t end;
  int64_t part;   // index of its partial result, or -1: the row is not split, write the output
};

struct Problem {
  const float* q;         // [B, H, D], float32, already multiplied by the softmax scale
  const void* k;          // [S, KVH, D]
  const void* v;
  const int64_t* r2t;     // [R, C]
  int64_t r2t_stride;
  const int64_t* rpi;     // [B]
  int64_t num_slots;      // S
  int64_t H, KVH, G, D;
  float* out;             // [B, H, D] float32
  float* part_acc;        // [P, H, D]
  float* part_m;          // [P, H]
  float* part_l;          // [P, H]
  const float* q_raw;     // [B, H, D], float32, not scaled (the bfloat16 dot products' input)
  float scale;
  const float* ks;        // [S, KVH] per-token K scales, or nullptr (then so is vs)
  const float* vs;
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e5m2 x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

// Where the block's tokens' scales start (slot * KVH) from their element offsets (slot * KVH * D):
// once per block, for every head.
inline void scale_rows(const int64_t* rows, int64_t n, int64_t D, int64_t* srow) {
  for (int64_t j = 0; j < n; ++j) srow[j] = rows[j] / D;
}

// The scales of KV head h for the block's tokens, 0 past its n tokens, times unit (what the loads
// leave out of the values).
inline void block_scales(const float* s, const int64_t* srow, int64_t n, int64_t h, float* out, float unit = 1.f) {
  for (int64_t j = 0; j < kBlock; ++j) out[j] = j < n ? s[srow[j] + h] * unit : 0.f;
}

// The vector loads of e4m3 return the values 2^-8 times too small (a float16 read of its bits); its
// scales, which it always has, take the 2^8 back once per token instead of once per value.
template <typename kv_t>
constexpr float kLoadUnit = std::is_same_v<kv_t, c10::Float8_e4m3fn> ? 256.f : 1.f;

// Where an item's result goes: straight into the output, normalised, or into its partial slot.
// acc: [H, D] unnormalised, m and l: [H].
inline void finish_item(const Problem& p, const Item& it, const float* acc, const float* m, const float* l) {
  const int64_t H = p.H, D = p.D;
  if (it.part < 0) {
    float* o = p.out + it.row * H * D;
    for (int64_t r = 0; r < H; ++r) {
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      for (int64_t d = 0; d < D; ++d) o[r * D + d] = acc[r * D + d] * inv;
    }
  } else {
    std::copy(acc, acc + H * D, p.part_acc + it.part * H * D);
    std::copy(m, m + H, p.part_m + it.part * H);
    std::copy(l, l + H, p.part_l + it.part * H);
  }
}

// The element offsets of tokens [t0, t0 + n) of a row (its slots) in the K/V buffers, one pool row
// (all KV heads) each. A slot outside the pool reads slot 0 and makes it return false: the caller
// reports the error after the loop instead of reading out of bounds.
inline bool slot_rows(const Problem& p, const int64_t* slots, int64_t t0, int64_t n, int64_t* rows) {
  bool ok = true;
  for (int64_t j = 0; j < n; ++j) {
    int64_t slot = slots[t0 + j];
    if (slot < 0 || slot >= p.num_slots) {
      ok = false;
      slot = 0;
    }
    rows[j] = slot * p.KVH * p.D;
  }
  return ok;
}

// Software prefetch of the block kPrefetchBlocks ahead, into L2, one KV head's slice of a token's K
// (or V) row at a time, issued inside the loops that read this block's same slice: a few lines per
// token instead of a burst of every line of the next block at its start. Measured at batch 32 x
// 1,024 tokens (scattered 16-token pages, 30 layers, so every row comes from memory), two threads:
// 13.5 GB/s with the burst into L1 one block ahead, 20-23 GB/s this way (a plain read of the same
// rows, nothing computed, reaches 26). The burst filled the core's miss queue and stalled the loads
// behind it; one block ahead was too close to hide the latency. A page size of 1 (consecutive
// tokens anywhere in the pool) leaves the hardware prefetcher nothing to follow either.
template <typename kv_t>
struct AheadRows {
  const char* k[kBlock];  // the K row (all heads) of each token of the block ahead, or nullptr
  const char* v[kBlock];
  int64_t head_bytes;

  AheadRows(const Problem& p, const int64_t* slots, int64_t t0, int64_t end)
      : head_bytes(p.D * static_cast<int64_t>(sizeof(kv_t))) {
    const int64_t row_bytes = p.KVH * head_bytes;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int64_t t = t0 + kPrefetchBlocks * kBlock + j;
      // a bad slot only makes a prefetch miss (prefetches never fault); its block reports it
      const int64_t off = t < end ? slots[t] * row_bytes : 0;
      k[j] = t < end ? static_cast<const char*>(p.k) + off : nullptr;
      v[j] = t < end ? static_cast<const char*>(p.v) + off : nullptr;
      if (p.ks != nullptr && t < end) {  // the token's scales, all heads: one line each
        __builtin_prefetch(p.ks + slots[t] * p.KVH, 0, 2);
        __builtin_prefetch(p.vs + slots[t] * p.KVH, 0, 2);
      }
    }
  }
  void fetch(const char* row, int64_t h) const {
    if (row == nullptr) return;
    const char* a = row + h * head_bytes;
    // locality 2: prefetcht1 on x86 (into L2); into L1 (prefetcht0) measured as slow as no prefetch
    for (int64_t b = 0; b < head_bytes; b += 64) __builtin_prefetch(a + b, 0, 2);
    if (reinterpret_cast<uintptr_t>(a) % 64 != 0) __builtin_prefetch(a + head_bytes - 1, 0, 2);
  }
  void k_of(int64_t j, int64_t h) const { fetch(k[j], h); }
  void v_of(int64_t j, int64_t h) const { fetch(v[j], h); }
};

// ------------------------------------------------------------------------------------------------
// Portable path: plain loops (the compiler vectorises what it can). Any G, any D.
// ------------------------------------------------------------------------------------------------
// q . k summed in 8 lanes (element d into lane d % 8), then the lanes in a fixed order: the lanes
// are independent sums the compiler can keep in one vector register, where one running sum would
// have to be added element by element (no reassociation: this file is built without -ffast-math).
template <typename kv_t>
inline float dot_lanes(const float* q, const kv_t* k, int64_t D) {
  float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    for (int i = 0; i < 8; ++i) lane[i] += q[d + i] * to_float(k[d + i]);
  for (; d < D; ++d) lane[0] += q[d] * to_float(k[d]);
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

template <typename kv_t>
bool attend_item_generic(const Problem& p, const Item& it) {
  const int64_t H = p.H, KVH = p.KVH, G = p.G, D = p.D;
  const kv_t* K = static_cast<const kv_t*>(p.k);
  const kv_t* V = static_cast<const kv_t*>(p.v);
  const int64_t* slots = p.r2t + p.rpi[it.row] * p.r2t_stride;
  const float* q = p.q + it.row * H * D;
  std::vector<float> acc(H * D, 0.f), m(H, -std::numeric_limits<float>::infinity()), l(H, 0.f);
  std::vector<float> s(G * kBlock);
  float ksc[kBlock], vsc[kBlock];
  std::fill(ksc, ksc + kBlock, 1.f);
  std::fill(vsc, vsc + kBlock, 1.f);
  bool ok = true;
  for (int64_t t0 = it.begin; t0 < it.end; t0 += kBlock) {
    const int64_t n = std::min(kBlock, it.end - t0);
    int64_t rows[kBlock];
    ok = slot_rows(p, slots, t0, n, rows) && ok;
    const AheadRows<kv_t> ahead(p, slots, t0, it.end);
    int64_t srow[kBlock];
    if (p.ks != nullptr) scale_rows(rows, n, D, srow);
    for (int64_t h = 0; h < KVH; ++h) {
      const float* qh = q + h * G * D;
      float* acc_h = &acc[h * G * D];
      if (p.ks != nullptr) {
        block_scales(p.ks, srow, n, h, ksc);
        block_scales(p.vs, srow, n, h, vsc);
      }
      for (int64_t j = 0; j < kBlock; ++j) ahead.k_of(j, h);
      for (int64_t j = 0; j < n; ++j) {
        const kv_t* kp = K + rows[j] + h * D;
        for (int64_t g = 0; g < G; ++g) s[g * kBlock + j] = dot_lanes(qh + g * D, kp, D) * ksc[j];
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = &s[g * kBlock];
        float& mg = m[h * G + g];
        float bm = sg[0];
        for (int64_t j = 1; j < n; ++j) bm = std::max(bm, sg[j]);
        const float mn = std::max(mg, bm);
        const float alpha = std::exp(mg - mn);  // 0 on the first block (m = -inf)
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          sg[j] = std::exp(sg[j] - mn);
          sum += sg[j];
        }
        l[h * G + g] = l[h * G + g] * alpha + sum;
        mg = mn;
        for (int64_t d = 0; d < D; ++d) acc_h[g * D + d] *= alpha;
      }
      for (int64_t j = 0; j < kBlock; ++j) ahead.v_of(j, h);
      for (int64_t j = 0; j < n; ++j) {
        const kv_t* vp = V + rows[j] + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = s[g * kBlock + j] * vsc[j];
          for (int64_t d = 0; d < D; ++d) acc_h[g * D + d] += w * to_float(vp[d]);
        }
      }
    }
  }
  finish_item(p, it, acc.data(), m.data(), l.data());
  return ok;
}

#ifdef RADIXSERVE_AVX512
// ------------------------------------------------------------------------------------------------
// AVX-512 path: G and D known at compile time so q and the accumulators live in registers.
// ------------------------------------------------------------------------------------------------
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  // bfloat16 is the top half of a float32: widen to 32 bits and shift into place
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Float8_e5m2* x) {  // e5m2 bits are a float16's top byte
  const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(h, 8));
}
inline __m512 load16(const c10::Float8_e4m3fn* x) {
  // sign-extended to 16 bits and shifted by 7: exponent and mantissa in bits 7-13, the sign in 14
  // and 15; clearing bit 14 leaves a float16 2^8 times too small (exponent bias 15 against e4m3's
  // 7), subnormals included: kLoadUnit
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF))));
}
inline __m512 load16(const int8_t* x) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))));
}

// exp for x <= 0 (scores minus their running max), about 1 ulp: exp(x) = 2^n exp(r) with
// n = round(x / ln 2), |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 (error < 1e-8 there).
// Inputs under -87 are clamped (exp(-87) ~ 1.6e-38, nothing next to the block's max term of 1).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2, split in two
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);  // for an exact n*ln2
  __m512 y = _mm512_set1_ps(1.f / 5040.f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 720.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 120.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 24.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 6.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// Sixteen horizontal sums at once: lane j of the result is the sum of the 16 lanes of x[j].
// A butterfly of lane shuffles (15 adds + 30 shuffles/blends) instead of 16 separate reductions.
inline __m512 hsum16x16(const __m512* x) {
  __m512 a[8], b[4], c[2];
  // level 1: pair (2i, 2i+1); each half of a 128-bit lane pair keeps partial sums of both
  for (int i = 0; i < 8; ++i) {
    const __m512 lo = _mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]);
    const __m512 hi = _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]);
    a[i] = _mm512_add_ps(lo, hi);  // per 128-bit lane: [x0a+x0c, x1a+x1c, x0b+x0d, x1b+x1d]
  }
  for (int i = 0; i < 4; ++i) {
    const __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1])));
    const __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1])));
    b[i] = _mm512_add_ps(lo, hi);  // per 128-bit lane: one partial sum for each of 4 inputs
  }
  // now b[i] lane k (k = 128-bit lane) holds sums of quarter k of inputs 4i..4i+3
  for (int i = 0; i < 2; ++i) {
    const __m512 lo = _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88);  // lanes 0,2 | 0,2
    const __m512 hi = _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD);  // lanes 1,3 | 1,3
    c[i] = _mm512_add_ps(lo, hi);
  }
  const __m512 lo = _mm512_shuffle_f32x4(c[0], c[1], 0x88);
  const __m512 hi = _mm512_shuffle_f32x4(c[0], c[1], 0xDD);
  return _mm512_add_ps(lo, hi);
}

// The 16 scores of a block from 8 vectors that each hold two tokens' partial sums (token 2t in
// lanes 0-7 of x[t], token 2t+1 in lanes 8-15): the first two levels of hsum16x16 on 8 inputs, then
// the halves of each 128-bit lane pair added, and the lanes put back in token order.
inline __m512 pair_sums_to_scores(const __m512* x) {
  __m512 a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    b[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // b[i], 128-bit lane k, element e: quarter k of x[4i + e]; quarters 0-1 are token 2(4i+e), 2-3
  // token 2(4i+e)+1. c = [tokens 0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15]
  const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512i order = _mm512_set_epi32(15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6, 2, 5, 1, 4, 0);
  return _mm512_permutexvar_ps(order, c);
}

#ifdef RADIXSERVE_BF16_DOT
template <typename kv_t>
constexpr bool kBf16Dot = std::is_same_v<kv_t, c10::BFloat16>;

// The bfloat16 V path widens 32 values (4 lanes of 8) into [lo, hi]: lo holds values 0-3 of each
// 128-bit lane, hi values 4-7. Put each run of 32 accumulators back in natural order.
inline void unpermute_rows(float* acc, int64_t chunks) {
  for (int64_t c = 0; c < chunks; ++c) {
    float* a = acc + c * 32;
    float t[32];
    for (int i = 0; i < 16; ++i) {
      t[(i / 4) * 8 + i % 4] = a[i];
      t[(i / 4) * 8 + 4 + i % 4] = a[16 + i];
    }
    std::copy(t, t + 32, a);
  }
}
#endif

template <typename kv_t, int G, int NC>
bool attend_item_avx512(const Problem& p, const Item& it) {
  constexpr int64_t D = NC * 16;
  const int64_t H = p.H, KVH = p.KVH;
  const kv_t* K = static_cast<const kv_t*>(p.k);
  const kv_t* V = static_cast<const kv_t*>(p.v);
  const int64_t* slots = p.r2t + p.rpi[it.row] * p.r2t_stride;
  const float* q = p.q + it.row * H * D;
  // running state of every head; a head's accumulators are in registers only while it is attended
  thread_local std::vector<float> state;
  state.assign(H * D + 2 * H + H * 16, 0.f);
  float* acc_all = state.data();
  float* m = acc_all + H * D;
  float* l = m + H;
  // each head's row sum kept as 16 lane sums (scaled with the accumulators) and added up once at
  // the end, instead of a horizontal sum per block
  float* lsum = l + H;
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  bool ok = true;
  alignas(64) float prob[G][kBlock];
#ifdef RADIXSERVE_BF16_DOT
  alignas(64) uint16_t prob_bh[G][kBlock];  // the same, rounded to bfloat16 (bits)
#endif
  int64_t rows[kBlock];  // element offset of each token's row (all heads), the same in K and V
  alignas(64) float ksc[kBlock], vsc[kBlock];  // an int8 pool's scales of the block, one head
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = it.begin; t0 < it.end; t0 += kBlock) {
    const int64_t n = std::min(kBlock, it.end - t0);
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    ok = slot_rows(p, slots, t0, n, rows) && ok;
    const AheadRows<kv_t> ahead(p, slots, t0, it.end);
    int64_t srow[kBlock];
    if (p.ks != nullptr) scale_rows(rows, n, D, srow);
    for (int64_t h = 0; h < KVH; ++h) {
      if (p.ks != nullptr) {
        block_scales(p.ks, srow, n, h, ksc, kLoadUnit<kv_t>);
        block_scales(p.vs, srow, n, h, vsc, kLoadUnit<kv_t>);
      }
      __m512 qv[G][NC], acc[G][NC];
      float* acc_h = acc_all + h * G * D;
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) {
          qv[g][c] = _mm512_loadu_ps(q + (h * G + g) * D + c * 16);
          acc[g][c] = _mm512_loadu_ps(acc_h + g * D + c * 16);
        }
#ifdef RADIXSERVE_BF16_DOT
      // q in bfloat16 pairs, unscaled: exact for a bfloat16 model's q (the scale is applied to the
      // scores), so the dot products read K as it is stored, without widening it
      // (16 values of q, twice: the two halves of a vector meet the same dims of two tokens' K)
      __m512bh qb[G][NC];
      if constexpr (kBf16Dot<kv_t>) {
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < NC; ++c) {
            const __m512 qc = _mm512_loadu_ps(p.q_raw + it.row * H * D + (h * G + g) * D + c * 16);
            qb[g][c] = _mm512_cvtne2ps_pbh(qc, qc);
          }
      }
#endif
      // scores: one 16-lane partial vector per (g, token), reduced 16 tokens at a time
      __m512 sc[G];
#ifdef RADIXSERVE_BF16_DOT
      if constexpr (kBf16Dot<kv_t>) {
        // two tokens per vector: 16 dims of token 2t's K in the low half, the same dims of token
        // 2t+1's in the high half, against q's 16 dims twice; 8 partial vectors per head for the
        // block instead of 16, and half the horizontal-sum work (pair_sums_to_scores)
        __m512 part[G][kBlock / 2];
        for (int64_t t = 0; t < kBlock / 2; ++t) {
          ahead.k_of(2 * t, h);
          ahead.k_of(2 * t + 1, h);
          if (2 * t >= n) {
            for (int g = 0; g < G; ++g) part[g][t] = _mm512_setzero_ps();
            continue;
          }
          const kv_t* k0 = K + rows[2 * t] + h * D;
          const kv_t* k1 = 2 * t + 1 < n ? K + rows[2 * t + 1] + h * D : k0;  // past n: masked below
          for (int g = 0; g < G; ++g) part[g][t] = _mm512_setzero_ps();
          for (int c = 0; c < NC; ++c) {
            const __m512i a = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0 + c * 16))),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k1 + c * 16)), 1);
            const auto ab = reinterpret_cast<__m512bh>(a);
            for (int g = 0; g < G; ++g) part[g][t] = _mm512_dpbf16_ps(part[g][t], ab, qb[g][c]);
          }
        }
        const __m512 sv = _mm512_set1_ps(p.scale);
        for (int g = 0; g < G; ++g) sc[g] = _mm512_mul_ps(pair_sums_to_scores(part[g]), sv);
      } else
#endif
      {
        __m512 part[G][kBlock];
        for (int64_t j = 0; j < kBlock; ++j) {
          ahead.k_of(j, h);
          if (j < n) {
            const kv_t* kp = K + rows[j] + h * D;
            __m512 kc[NC];
            for (int c = 0; c < NC; ++c) kc[c] = load16(kp + c * 16);
            for (int g = 0; g < G; ++g) {
              __m512 a = _mm512_mul_ps(qv[g][0], kc[0]);
              for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qv[g][c], kc[c], a);
              part[g][j] = a;
            }
          } else {
            for (int g = 0; g < G; ++g) part[g][j] = _mm512_setzero_ps();
          }
        }
        for (int g = 0; g < G; ++g) sc[g] = hsum16x16(part[g]);
        if (p.ks != nullptr)
          for (int g = 0; g < G; ++g) sc[g] = _mm512_mul_ps(sc[g], _mm512_load_ps(ksc));
      }
      // the new running maxima first, so that the G rescale factors take one vector exp (a libm
      // exp per head and block was ~20% of the kernel's time)
      alignas(64) float mnew[16], mdiff[16];
      for (int g = 0; g < G; ++g) {
        sc[g] = _mm512_mask_mov_ps(neg_inf, live, sc[g]);
        mnew[g] = std::max(m[h * G + g], _mm512_reduce_max_ps(sc[g]));
        mdiff[g] = m[h * G + g] - mnew[g];  // -inf on the first block: its factor is ~0 (exp16 clamps)
      }
      alignas(64) float alphas[16];
      _mm512_store_ps(alphas, exp16(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << G) - 1u), mdiff)));
      for (int g = 0; g < G; ++g) {
        float& mg = m[h * G + g];
        const __m512 sv = sc[g];
        const float mn = mnew[g];
        const float alpha = mg == mn ? 1.f : alphas[g];
        __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(mn))));
#ifdef RADIXSERVE_BF16_DOT
        if constexpr (kBf16Dot<kv_t>) {
          // P goes into the bfloat16 dot products rounded: the row sum takes the same values
          const __m256bh eb = _mm512_cvtneps_pbh(e);
          _mm256_store_si256(reinterpret_cast<__m256i*>(prob_bh[g]), reinterpret_cast<__m256i>(eb));
          e = _mm512_cvtpbh_ps(eb);
        }
#endif
        float* lv = lsum + (h * G + g) * 16;
        _mm512_storeu_ps(lv, _mm512_fmadd_ps(_mm512_loadu_ps(lv), _mm512_set1_ps(alpha), e));
        mg = mn;
        _mm512_store_ps(prob[g], p.vs != nullptr ? _mm512_mul_ps(e, _mm512_load_ps(vsc)) : e);
        if (alpha != 1.f) {
          const __m512 av = _mm512_set1_ps(alpha);
          for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], av);
        }
      }
#ifdef RADIXSERVE_BF16_DOT
      if constexpr (kBf16Dot<kv_t>) {
        // P x V two tokens at a time: the V rows of tokens j and j+1 interleaved value by value
        // (unpacklo/hi: values 0-3 / 4-7 of each 128-bit lane, the accumulators' permuted order
        // until the item ends) against the pair (p_j, p_j+1), 32 products per instruction
        const auto* pairs = reinterpret_cast<const int32_t*>(prob_bh);
        for (int64_t j = 0; j < kBlock; j += 2) {
          ahead.v_of(j, h);
          ahead.v_of(j + 1, h);
          if (j >= n) continue;
          const kv_t* v0 = V + rows[j] + h * D;
          const kv_t* v1 = j + 1 < n ? V + rows[j + 1] + h * D : nullptr;
          for (int c = 0; c < NC / 2; ++c) {
            const __m512i a = _mm512_loadu_si512(v0 + c * 32);
            const __m512i b = v1 != nullptr ? _mm512_loadu_si512(v1 + c * 32) : _mm512_setzero_si512();
            const auto lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
            const auto hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
            for (int g = 0; g < G; ++g) {
              const auto w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pairs[g * (kBlock / 2) + j / 2]));
              acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], lo, w);
              acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], hi, w);
            }
          }
        }
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_h + g * D + c * 16, acc[g][c]);
        continue;
      }
#endif
      for (int64_t j = 0; j < kBlock; ++j) {
        ahead.v_of(j, h);
        if (j >= n) continue;
        const kv_t* vp = V + rows[j] + h * D;
        __m512 vc[NC];
        for (int c = 0; c < NC; ++c) vc[c] = load16(vp + c * 16);
        for (int g = 0; g < G; ++g) {
          const __m512 w = _mm512_set1_ps(prob[g][j]);
          for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(w, vc[c], acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_h + g * D + c * 16, acc[g][c]);
    }
  }
#ifdef RADIXSERVE_BF16_DOT
  if constexpr (kBf16Dot<kv_t>) unpermute_rows(acc_all, H * D / 32);
#endif
  for (int64_t r = 0; r < H; ++r) l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(lsum + r * 16));
  finish_item(p, it, acc_all, m, l);
  return ok;
}
#endif  // RADIXSERVE_AVX512

#ifdef RADIXSERVE_AVX2
#include "paged_attention_avx2.h"
#endif

using ItemFn = bool (*)(const Problem&, const Item&);

template <typename kv_t>
ItemFn pick_kernel(int64_t G, int64_t D) {
#ifdef RADIXSERVE_AVX2
#define RADIXSERVE_CASE(g, nc) \
  if (G == g && D == nc * 8) return &attend_item_avx2<kv_t, g, nc>;
  RADIXSERVE_CASE(1, 8) RADIXSERVE_CASE(2, 8) RADIXSERVE_CASE(3, 8) RADIXSERVE_CASE(4, 8)
  RADIXSERVE_CASE(6, 8) RADIXSERVE_CASE(8, 8)
  RADIXSERVE_CASE(1, 16) RADIXSERVE_CASE(2, 16) RADIXSERVE_CASE(3, 16) RADIXSERVE_CASE(4, 16)
#undef RADIXSERVE_CASE
#endif
#ifdef RADIXSERVE_AVX512
#define RADIXSERVE_CASE(g, nc) \
  if (G == g && D == nc * 16) return &attend_item_avx512<kv_t, g, nc>;
  RADIXSERVE_CASE(1, 4) RADIXSERVE_CASE(2, 4) RADIXSERVE_CASE(3, 4) RADIXSERVE_CASE(4, 4)
  RADIXSERVE_CASE(6, 4) RADIXSERVE_CASE(8, 4)
  RADIXSERVE_CASE(1, 8) RADIXSERVE_CASE(2, 8) RADIXSERVE_CASE(3, 8) RADIXSERVE_CASE(4, 8)
#undef RADIXSERVE_CASE
#endif
  return &attend_item_generic<kv_t>;
}

// Cut the work into items and the items into one contiguous run per thread of about equal cost.
// Returns the number of threads to use (cuts has that many runs). Consecutive rows of one request
// (a speculative verify step's positions, each attended as a decode row) are emitted piece by
// piece: the rows' items over the same tokens run one after another, mostly on one thread, so the
// K/V they share is read from memory once and from cache after that. With a `window` (> 0) a row's
// span is its last `window` tokens, cut into pieces by the span's length as a shorter row's is.
int64_t plan(const int64_t* lens, const int64_t* rpi, int64_t B, int64_t window, int64_t threads,
             std::vector<Item>& items, std::vector<int64_t>& cuts, int64_t& num_parts) {
  const auto first_of = [window](int64_t len) { return window > 0 ? std::max<int64_t>(0, len - window) : 0; };
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += lens[b] - first_of(lens[b]);
  threads = std::max<int64_t>(1, std::min(threads, total / kMinTokensPerThread));
  num_parts = 0;
  items.clear();
  auto pieces_of = [](int64_t len) { return std::clamp<int64_t>(len / kMinSplit, 1, kMaxPieces); };
  for (int64_t first = 0, last; first < B; first = last) {
    last = first + 1;
    while (last < B && rpi[last] == rpi[first]) ++last;
    int64_t most = 0;
    for (int64_t b = first; b < last; ++b) most = std::max(most, pieces_of(lens[b] - first_of(lens[b])));
    for (int64_t s = 0; s < most; ++s) {
      for (int64_t b = first; b < last; ++b) {
        const int64_t start = first_of(lens[b]), len = lens[b] - start, pieces = pieces_of(len);
        if (s >= pieces) continue;
        // equal pieces, each a multiple of kBlock, so no piece is a short tail
        const int64_t step = ((len + pieces - 1) / pieces + kBlock - 1) / kBlock * kBlock;
        const int64_t begin = std::min(len, s * step), end = std::min(len, (s + 1) * step);
        items.push_back({b, start + begin, start + end, pieces > 1 ? num_parts++ : -1});
      }
    }
  }
  cuts.assign(threads + 1, static_cast<int64_t>(items.size()));
  cuts[0] = 0;
  int64_t cost = 0, all = 0;
  for (const Item& it : items) all += it.end - it.begin + kItemOverhead;
  int64_t t = 1;
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()) && t < threads; ++i) {
    cost += items[i].end - items[i].begin + kItemOverhead;
    while (t < threads && cost * threads >= all * t) cuts[t++] = i + 1;
  }
  return threads;
}

}  // namespace

namespace {

void check_pool(const torch::Tensor& k_buf, const torch::Tensor& v_buf) {
  TORCH_CHECK(k_buf.device().is_cpu() && v_buf.device().is_cpu(), "the KV pool must be CPU tensors");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.sizes() == v_buf.sizes(), "k_buf and v_buf must be [S, KVH, D] alike");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "k_buf and v_buf must share a dtype");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "the KV pool must be contiguous");
}

// The batch's rows as int64 arrays, each checked against the slot table: B of them.
std::pair<at::Tensor, at::Tensor> checked_rows(const torch::Tensor& req_to_token, const torch::Tensor& req_pool_indices,
                                               const torch::Tensor& seq_lens, int64_t B) {
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "req_to_token must be an int64 [R, C] table with contiguous rows");
  auto rpi = req_pool_indices.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(rpi.numel() == B && lens.numel() == B, "one req_pool_index and one seq_len per decode row");
  const int64_t* rpi_p = rpi.data_ptr<int64_t>();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(rpi_p[b] >= 0 && rpi_p[b] < req_to_token.size(0), "req_pool_index out of range");
    TORCH_CHECK(lens_p[b] >= 0 && lens_p[b] <= req_to_token.size(1), "seq_len longer than req_to_token");
  }
  return {rpi, lens};
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                                     torch::Tensor req_to_token, torch::Tensor req_pool_indices,
                                     torch::Tensor seq_lens, double scale, std::optional<torch::Tensor> k_scale,
                                     std::optional<torch::Tensor> v_scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, D]");
  check_pool(k_buf, v_buf);
  const at::ScalarType kv_type = k_buf.scalar_type();
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16 || k_buf.element_size() == 1,
              "KV pool dtype must be float32, bfloat16, float8_e4m3fn, float8_e5m2 or int8");
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "k_scale and v_scale come together");
  TORCH_CHECK(!k_scale.has_value() || k_buf.element_size() == 1, "only a one-byte pool has scales");
  TORCH_CHECK(k_scale.has_value() || (kv_type != at::kChar && kv_type != at::ScalarType::Float8_e4m3fn),
              "an int8 or float8_e4m3fn pool needs its scales");
  if (k_scale.has_value()) {
    for (const auto& s : {*k_scale, *v_scale})
      TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 && s.size(0) == k_buf.size(0) &&
                      s.size(1) == k_buf.size(1),
                  "k_scale / v_scale must be contiguous float32 [S, KVH]");
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t S = k_buf.size(0), KVH = k_buf.size(1);
  TORCH_CHECK(k_buf.size(2) == D, "q and the pool disagree on head_dim");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads must be a multiple of KV heads");
  const auto [rpi, lens] = checked_rows(req_to_token, req_pool_indices, seq_lens, B);
  const int64_t* rpi_p = rpi.data_ptr<int64_t>();
  const int64_t* lens_p = lens.data_ptr<int64_t>();

  // Plain arrays for q, the output and the partials, not tensors: at batch 1 a handful of small
  // tensor operations (convert, scale, zero, cast) took longer than attending a few hundred tokens.
  // The softmax scale is folded into q once, instead of into every score.
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  const int64_t n = B * H * D;
  const auto qc = q.contiguous();
  std::vector<float> q_raw(n), qf(n), out_f(n, 0.f);
  const float fscale = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    std::copy(qc.data_ptr<float>(), qc.data_ptr<float>() + n, q_raw.begin());
  } else {
    const c10::BFloat16* src = qc.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) q_raw[i] = static_cast<float>(src[i]);
  }
  for (int64_t i = 0; i < n; ++i) qf[i] = q_raw[i] * fscale;
  const int64_t max_threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<Item> items;
  std::vector<int64_t> cuts;
  int64_t P = 0;
  const int64_t threads = plan(lens_p, rpi_p, B, window, max_threads, items, cuts, P);
  const int64_t G = H / KVH;
  std::vector<float> part_acc(std::max<int64_t>(P, 1) * H * D), part_ml(2 * std::max<int64_t>(P, 1) * H);

  Problem p{qf.data(), k_buf.data_ptr(), v_buf.data_ptr(), req_to_token.data_ptr<int64_t>(),
            req_to_token.stride(0), rpi_p, S, H, KVH, G, D, out_f.data(),
            part_acc.data(), part_ml.data(), part_ml.data() + std::max<int64_t>(P, 1) * H,
            q_raw.data(), fscale,
            k_scale.has_value() ? k_scale->data_ptr<float>() : nullptr,
            v_scale.has_value() ? v_scale->data_ptr<float>() : nullptr};
  ItemFn fn = nullptr;
  switch (kv_type) {
    case at::kFloat: fn = pick_kernel<float>(G, D); break;
    case at::kBFloat16: fn = pick_kernel<c10::BFloat16>(G, D); break;
    case at::ScalarType::Float8_e4m3fn: fn = pick_kernel<c10::Float8_e4m3fn>(G, D); break;
    case at::ScalarType::Float8_e5m2: fn = pick_kernel<c10::Float8_e5m2>(G, D); break;
    case at::kChar: fn = pick_kernel<int8_t>(G, D); break;
    default: TORCH_CHECK(false, "KV pool dtype ", kv_type, " has no kernel");
  }
  std::atomic<bool> ok{true};
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    bool mine = true;
    for (int64_t t = t_begin; t < t_end; ++t)
      for (int64_t i = cuts[t]; i < cuts[t + 1]; ++i)
        if (items[i].end > items[i].begin) mine &= fn(p, items[i]);
    if (!mine) ok = false;
  });
  TORCH_CHECK(ok.load(), "req_to_token holds a slot outside the KV pool");

  if (P > 0) {
    // merge the partials of split rows: each row's items, in token order
    std::vector<std::vector<int64_t>> runs;  // the items of each split row
    std::vector<int64_t> run_of(B, -1);
    for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
      if (items[i].part < 0) continue;
      int64_t& r = run_of[items[i].row];
      if (r < 0) r = static_cast<int64_t>(runs.size()), runs.emplace_back();
      runs[r].push_back(i);
    }
    at::parallel_for(0, static_cast<int64_t>(runs.size()), 8, [&](int64_t r_begin, int64_t r_end) {
      for (int64_t ri = r_begin; ri < r_end; ++ri) {
        const std::vector<int64_t>& run = runs[ri];
        float* o = p.out + items[run.front()].row * H * D;
        for (int64_t r = 0; r < H; ++r) {
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t i : run)
            if (items[i].end > items[i].begin) mx = std::max(mx, p.part_m[items[i].part * H + r]);
          float denom = 0.f;
          float* og = o + r * D;
          for (int64_t i : run) {
            if (items[i].end <= items[i].begin) continue;  // an empty piece left no partial
            const int64_t part = items[i].part;
            const float w = std::exp(p.part_m[part * H + r] - mx);
            denom += w * p.part_l[part * H + r];
            const float* a = p.part_acc + (part * H + r) * D;
            for (int64_t d = 0; d < D; ++d) og[d] += w * a[d];
          }
          const float inv = denom > 0.f ? 1.f / denom : 0.f;
          for (int64_t d = 0; d < D; ++d) og[d] *= inv;
        }
      }
    });
  }
  auto out = at::empty({B, H * D}, q.options());
  if (q.scalar_type() == at::kFloat) {
    std::copy(out_f.begin(), out_f.end(), out.data_ptr<float>());
  } else {
    c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();  // rounded to nearest even, as Tensor.to
    for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(out_f[i]);
  }
  return out;
}

// Store new K/V rows into a one-byte pool, bit for bit what mem/kv_format.py's KVFormat.encode
// computes, in one call instead of its dozen tensor ops (at batch 1 those cost more than the
// attention): with scales (int8: top 127, rounded to nearest even; e4m3: top 448) each row of D
// values is divided by max|x| / top; without (e5m2) values are clamped to +-top. The float8
// conversions are c10's, the ones torch's .to() uses. k, v: [T, KVH, D] float32 or bfloat16.
template <typename kv_t>
void store_rows(const torch::Tensor& buf, const std::optional<torch::Tensor>& scale, const torch::Tensor& x,
                const int64_t* loc, float top) {
  const int64_t T = x.size(0), KVH = x.size(1), D = x.size(2);
  auto xf = x.to(at::kFloat).contiguous();
  const float* src = xf.data_ptr<float>();
  kv_t* dst = static_cast<kv_t*>(buf.data_ptr());
  float* sc = scale.has_value() ? scale->data_ptr<float>() : nullptr;
  at::parallel_for(0, T * KVH, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / KVH, h = r % KVH;
      const float* row = src + r * D;
      kv_t* out = dst + (loc[t] * KVH + h) * D;
      if (sc == nullptr) {
        for (int64_t d = 0; d < D; ++d) out[d] = kv_t(std::clamp(row[d], -top, top));
        continue;
      }
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(row[d]));
      const float s = amax / top;
      sc[loc[t] * KVH + h] = s;
      const float div = std::max(s, std::numeric_limits<float>::min());
      for (int64_t d = 0; d < D; ++d) {
        const float v = row[d] / div;
        if constexpr (std::is_same_v<kv_t, int8_t>)
          out[d] = static_cast<int8_t>(std::nearbyint(v));
        else
          out[d] = kv_t(std::clamp(v, -top, top));
      }
    }
  });
}

// Store new K/V rows into a float32 or bfloat16 pool: a copy, converted (rounded to nearest even, as
// Tensor.to) where the rows' dtype is not the pool's.
// A token's K (or V) row is read where it is when its heads are contiguous (a view into the
// fused qkv output, as the model passes it), else from a contiguous copy.
template <typename kv_t, typename x_t>
void copy_rows(const torch::Tensor& buf, const torch::Tensor& x, const int64_t* loc) {
  const int64_t T = x.size(0), row = x.size(1) * x.size(2);
  const bool rows_whole = x.stride(2) == 1 && x.stride(1) == x.size(2);
  const auto xc = rows_whole ? x : x.contiguous();
  const int64_t stride = rows_whole ? x.stride(0) : row;
  const x_t* src = xc.data_ptr<x_t>();
  kv_t* dst = static_cast<kv_t*>(buf.data_ptr());
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const x_t* s = src + t * stride;
      if constexpr (std::is_same_v<kv_t, x_t>) {
        std::copy(s, s + row, dst + loc[t] * row);
      } else {
        for (int64_t i = 0; i < row; ++i) dst[loc[t] * row + i] = kv_t(static_cast<float>(s[i]));
      }
    }
  });
}

template <typename kv_t>
void copy_kv(const torch::Tensor& k_buf, const torch::Tensor& v_buf, const torch::Tensor& k, const torch::Tensor& v,
             const int64_t* loc) {
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v must share a dtype");
  switch (k.scalar_type()) {
    case at::kFloat: copy_rows<kv_t, float>(k_buf, k, loc), copy_rows<kv_t, float>(v_buf, v, loc); break;
    case at::kBFloat16:
      copy_rows<kv_t, c10::BFloat16>(k_buf, k, loc), copy_rows<kv_t, c10::BFloat16>(v_buf, v, loc);
      break;
    default: TORCH_CHECK(false, "store_kv: k and v must be float32 or bfloat16");
  }
}

void store_kv(torch::Tensor k_buf, torch::Tensor v_buf, std::optional<torch::Tensor> k_scale,
              std::optional<torch::Tensor> v_scale, torch::Tensor loc, torch::Tensor k, torch::Tensor v, double top) {
  check_pool(k_buf, v_buf);
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "k_scale and v_scale come together");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_buf.size(1) && k.size(2) == k_buf.size(2),
              "k and v must be [T, KVH, D] like the pool's rows");
  auto l = loc.to(at::kLong).contiguous();
  TORCH_CHECK(l.numel() == k.size(0), "one slot per row");
  const int64_t* lp = l.data_ptr<int64_t>();
  for (int64_t t = 0; t < l.numel(); ++t) TORCH_CHECK(lp[t] >= 0 && lp[t] < k_buf.size(0), "slot outside the KV pool");
  const auto f = static_cast<float>(top);
  switch (k_buf.scalar_type()) {
    case at::kChar:
      TORCH_CHECK(k_scale.has_value(), "an int8 pool needs its scales");
      store_rows<int8_t>(k_buf, k_scale, k, lp, f);
      store_rows<int8_t>(v_buf, v_scale, v, lp, f);
      break;
    case at::ScalarType::Float8_e4m3fn:
      store_rows<c10::Float8_e4m3fn>(k_buf, k_scale, k, lp, f);
      store_rows<c10::Float8_e4m3fn>(v_buf, v_scale, v, lp, f);
      break;
    case at::ScalarType::Float8_e5m2:
      store_rows<c10::Float8_e5m2>(k_buf, k_scale, k, lp, f);
      store_rows<c10::Float8_e5m2>(v_buf, v_scale, v, lp, f);
      break;
    case at::kFloat:
      TORCH_CHECK(!k_scale.has_value(), "only a one-byte pool has scales");
      copy_kv<float>(k_buf, v_buf, k, v, lp);
      break;
    case at::kBFloat16:
      TORCH_CHECK(!k_scale.has_value(), "only a one-byte pool has scales");
      copy_kv<c10::BFloat16>(k_buf, v_buf, k, v, lp);
      break;
    default: TORCH_CHECK(false, "store_kv: pool dtype ", k_buf.scalar_type(), " has no store");
  }
}

// The floor a decode kernel is measured against: read every K and V row that
// paged_decode_attention would read for the same batch (same items, same threads), compute nothing
// but a sum, and prefetch the rows ahead so that scattered pages do not make it latency-bound.
// Returns the sum (so the reads cannot be optimised away).
double read_kv_rows(torch::Tensor k_buf, torch::Tensor v_buf, torch::Tensor req_to_token,
                    torch::Tensor req_pool_indices, torch::Tensor seq_lens, int64_t window) {
  check_pool(k_buf, v_buf);
  const int64_t B = req_pool_indices.numel(), S = k_buf.size(0);
  const auto [rpi, lens] = checked_rows(req_to_token, req_pool_indices, seq_lens, B);
  const int64_t* rpi_p = rpi.data_ptr<int64_t>();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  const int64_t words = k_buf.size(1) * k_buf.size(2) * k_buf.element_size() / 4;  // 32-bit words per row
  TORCH_CHECK(k_buf.size(1) * k_buf.size(2) * k_buf.element_size() % 4 == 0, "a pool row must be whole 32-bit words");
  const auto* K = static_cast<const uint32_t*>(k_buf.data_ptr());
  const auto* V = static_cast<const uint32_t*>(v_buf.data_ptr());
  std::vector<Item> items;
  std::vector<int64_t> cuts;
  int64_t parts = 0;
  const int64_t threads = plan(lens_p, rpi_p, B, window, std::max<int64_t>(1, at::get_num_threads()), items, cuts, parts);
  std::vector<uint64_t> sums(threads, 0);
  std::atomic<bool> ok{true};
  constexpr int64_t kAhead = kPrefetchBlocks * kBlock;
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t th = t_begin; th < t_end; ++th) {
      uint32_t acc[16] = {0};
      for (int64_t i = cuts[th]; i < cuts[th + 1]; ++i) {
        const Item& it = items[i];
        const int64_t* slots = req_to_token.data_ptr<int64_t>() + rpi_p[it.row] * req_to_token.stride(0);
        for (int64_t t = it.begin; t < it.end; ++t) {
          if (t + kAhead < it.end) {
            const int64_t ahead = slots[t + kAhead];
            const char* ka = reinterpret_cast<const char*>(K + ahead * words);
            const char* va = reinterpret_cast<const char*>(V + ahead * words);
            for (int64_t b = 0; b < words * 4; b += 64) {
              __builtin_prefetch(ka + b, 0, 2);
              __builtin_prefetch(va + b, 0, 2);
            }
          }
          const int64_t slot = slots[t];
          if (slot < 0 || slot >= S) {
            ok = false;
            continue;
          }
          const uint32_t* kr = K + slot * words;
          const uint32_t* vr = V + slot * words;
          for (int64_t w = 0; w < words; w += 16) {
            const int64_t n = std::min<int64_t>(16, words - w);
            for (int64_t x = 0; x < n; ++x) acc[x] += kr[w + x] ^ vr[w + x];
          }
        }
      }
      uint64_t s = 0;
      for (uint32_t a : acc) s += a;
      sums[th] = s;
    }
  });
  TORCH_CHECK(ok.load(), "req_to_token holds a slot outside the KV pool");
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  return static_cast<double>(total);
}

bool has_avx512_path() {
#ifdef RADIXSERVE_AVX512
  return true;
#else
  return false;
#endif
}

bool has_bf16_dot() {
#ifdef RADIXSERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_bf16_dot", &has_bf16_dot, "Whether a bfloat16 pool is read with bfloat16 dot products (AVX512-BF16)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention reading K/V in place from a paged pool through req_to_token", py::arg("q"),
        py::arg("k_buf"), py::arg("v_buf"), py::arg("req_to_token"), py::arg("req_pool_indices"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("window") = 0);
  m.def("store_kv", &store_kv, "Store new K/V rows into the pool (KVPool.write, KVFormat.encode included, in one call)");
  m.def("read_kv_rows", &read_kv_rows,
        "Read (and sum) every K/V row a decode call would read, computing nothing else: the memory floor",
        py::arg("k_buf"), py::arg("v_buf"), py::arg("req_to_token"), py::arg("req_pool_indices"), py::arg("seq_lens"),
        py::arg("window") = 0);
  m.def("has_avx512_path", &has_avx512_path, "Whether this build has the AVX-512 inner loops");
}
