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

#include <cstdint>
#include <cstring>

namespace {

inline float f16(const uint8_t* p) {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

constexpr int QK_K = 256;
constexpr int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

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
        case 2: *f = {q4_0, 32, 18}; return true;
        case 3: *f = {q4_1, 32, 20}; return true;
        case 6: *f = {q5_0, 32, 22}; return true;
        case 7: *f = {q5_1, 32, 24}; return true;
        case 8: *f = {q8_0, 32, 34}; return true;
        case 10: *f = {q2_k, 256, 84}; return true;
        case 11: *f = {q3_k, 256, 110}; return true;
        case 12: *f = {q4_k, 256, 144}; return true;
        case 13: *f = {q5_k, 256, 176}; return true;
        case 14: *f = {q6_k, 256, 210}; return true;
        case 20: *f = {iq4_nl, 32, 18}; return true;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("dequantize", &dequantize, "GGUF blocks (uint8) of a GGML type to float32");
    m.def("supported", &supported, "whether a GGML type has a dequantizer here");
}
