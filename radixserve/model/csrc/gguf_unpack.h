// GGUF block layouts shared by the dequantizer (gguf_dequant.cpp) and the integer dot-product
// kernel (gguf_vnni.cpp): scales, small tables, the AVX2 unpacking of their values, a lane sum.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace gguf {

inline float f16(const uint8_t* p) {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Software prefetch of the weight bytes kPrefetchAhead past a row, issued as the row starts (into
// L1): a thread's rows are consecutive in memory, and the hardware prefetcher stops at each 4 KiB
// page of the file's mapping. Every kernel that walks weight rows calls it. On an AMX Xeon, two
// threads streaming one layer's weights through the VNNI kernel at one row: Q5_0 7.5-7.9 -> 9.3-10.4
// GB/s, Q8_0 10.3-11.1 -> 15.0-16.0, Q4_K 7.1-8.3 -> 8.2-10.1, Q6_K +2-4% (1, 2, 3, 4 and 8 KiB ahead
// tried: 2 and 3 the best; into L2 no better).
constexpr int64_t kPrefetchAhead = 2048;
inline void prefetch_ahead(const uint8_t* row, int64_t rb, const uint8_t* end) {
    const uint8_t* p = row + kPrefetchAhead;
    const uint8_t* stop = p + rb < end ? p + rb : end;
    for (; p < stop; p += 64) __builtin_prefetch(p, 0, 3);
}

constexpr int QK_K = 256;
constexpr int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Q4_K / Q5_K: 8 sub-blocks of 32, each a 6-bit scale and a 6-bit min packed in 12 bytes.
inline void k_scale_min(const uint8_t* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 0x3F;
        *m = s[j + 4] & 0x3F;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
        *m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

// Q4_K / Q5_K: all 8 sub-blocks' scales (bytes 0-3 of `sc`: sub-blocks 0-3, of `sc_hi`: 4-7) and
// mins likewise, from the 12 packed bytes at once (k_scale_min's arithmetic on 4 bytes per word)
inline void k_scales_mins(const uint8_t* s, uint32_t* sc, uint32_t* sc_hi, uint32_t* mn, uint32_t* mn_hi) {
    uint32_t a, b, c;
    std::memcpy(&a, s, 4);
    std::memcpy(&b, s + 4, 4);
    std::memcpy(&c, s + 8, 4);
    *sc = a & 0x3F3F3F3Fu;
    *mn = b & 0x3F3F3F3Fu;
    *sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
    *mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
}

#if defined(__AVX2__)
inline float hsum8(__m256 v) {  // the sum of the 8 lanes
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

inline __m256i nibbles32(const uint8_t* qs) {  // 16 bytes -> their 16 low nibbles, then 16 high
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

// byte i = 0x10 where bit i of `bits` is set, else 0 (Q5_0/Q5_1's fifth bits, in nibbles32's order)
inline __m256i fifth_bits32(uint32_t bits) {
    // each 128-bit lane holds the 4 bytes of `bits` (broadcast); byte i takes byte i / 8 of them
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(bits)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i want = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));  // bit i % 8
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, want), want);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// Q4_K / Q5_K: the 32 unsigned values of sub-block `sub` (qs: the block's 4-bit values; high: Q5_K's
// 32 bytes of fifth bits, bit `sub` of byte l for value l)
template <bool kFifthBit>
inline __m256i k45_values32(const uint8_t* qs, __m256i high, int sub) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (sub / 2) * 32));
    __m256i v = _mm256_and_si256(sub % 2 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
    if (kFifthBit) {
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(sub)), _mm256_set1_epi8(1));
        v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
    }
    return v;
}

// Q6_K (ql[128], qh[64], ...): the 32 unsigned 6-bit values h * 128 + c * 32 + l, l < 32
inline __m256i q6_k_values32(const uint8_t* b, int h, int c) {
    const __m256i lb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + h * 64 + (c % 2) * 32));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + h * 32));
    const __m256i lo = _mm256_and_si256(c / 2 ? _mm256_srli_epi16(lb, 4) : lb, _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * c)), _mm256_set1_epi8(0x03));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}
#endif

}  // namespace gguf
