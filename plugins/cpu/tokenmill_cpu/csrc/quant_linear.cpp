// Weight-quantized linear layers for small batches: y[M, N] = x[M, K] @ W^T with W in 8 or 4 bits.
//
// Formats (GGUF's, so a GGUF checkpoint's codes come back exactly; packing in tokenmill_cpu/quant_linear.py):
//   q8: blocks of 32 input channels, w = d * q, q in -127..127, d float16           (GGUF Q8_0)
//   q4: blocks of 32 input channels, w = d * q + m, q in 0..15, d and m float16     (GGUF Q4_1)
//       or, given no minimums, w = d * (q - 8), d float16                           (GGUF Q4_0: 4.5 bits a weight)
//       or d = D * sc, m = M * mn with 8-bit sc, mn per block and float16 D, M per 8 blocks (GGUF Q4_K's
//       super-blocks: 4.625 bits a weight; D * sc and M * mn are exact in float32)
//
// Activations are quantized per row in blocks of 32 to 14-bit integers c (scale amax / 8191), each stored as
// two bytes, c = 128 * hi + lo with hi in -64..63 and lo in 0..127. A block's dot product is then two exact
// integer sums made with the AVX-512 VNNI instruction vpdpbusd (unsigned 8-bit x signed 8-bit, four products
// per 32-bit lane): sum q c = 128 * sum q hi + sum q lo. Why not plain 8-bit activations (llama.cpp's Q8_0 /
// Q8_1, one vpdpbusd): on SmolLM2-135M the greedy answers then left the float32 reference after 10-16 tokens
// on average instead of about 37 (likely activation outliers, such as the MLP down projection's inputs, that
// coarsen their whole block). Why not int16 activations with vpdpwssd (two products per lane): the same
// accuracy, but widening the weights to 16 bits made a one-request step compute-bound (docs/benchmarks.md,
// "Quantized matmul kernels").
//
// Weight layout: panels of 16 output rows. Within a panel, every 64 bytes feed one 16-lane vpdpbusd: lane r
// holds row r's four consecutive input channels, so a broadcast of four activation bytes serves all 16 rows,
// the scales are loaded as 16 contiguous float16 and no horizontal sum is needed.
//   q8 panel: [K / 4][16 rows][4] bytes, each q + 128 (unsigned; the +128 is taken out with the activation sums)
//   q4 panel: [K / 8][16 rows][4] bytes, low nibble = channel 8j + i, high nibble = channel 8j + 4 + i
//   scales (and q4's mins): [N / 16][K / 32][16] float16; q4 without mins ([N / 16][0][16]) takes the 8 out of
//   its codes as q8 takes out its 128, with the activation sums (sum (q - 8) c = sum q c - 8 sum c, exact), so a
//   decode step, which streams every weight once, reads 10% fewer bytes than with float16 minimums; with 8-bit
//   sc, mn: scales and mins are [N / 16][K / 32][16] uint8 and super_scales [N / 16][K / 256][2][16] float16 (D, M)
// AVX2 + FMA + F16C (every x86-64-v3 CPU, e.g. AMD Zen 1-3, Intel Haswell and later; AVX-512 CPUs without VNNI)
// run the same panels through vpmaddubsw (unsigned 8-bit x signed 8-bit, pairs summed to 16 bits) and vpmaddwd:
//   q4: codes 0..15 are the unsigned operand; a pair sum is at most 2 * 15 * 127 = 3810, so the 16-bit sums of
//       the 8 four-channel groups of a block are added in 16 bits (<= 30480, no saturation) and widened once
//       per block;
//   q8: codes q + 128 would overflow the 16-bit pair sums, so the signs move to the activations (llama.cpp's
//       trick): |q| x sign(q) * hi, |q| x sign(q) * lo, pair sums at most 2 * 127 * 127 = 32258.
// Both are exact: the same integer sums as the VNNI path and the scalar loops, so the three builds agree to
// float32 rounding of the final scale products. Anything else (or a build for ATen's DEFAULT capability) runs
// plain C++ loops with the same integer sums.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define TOKENMILL_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENMILL_AVX2 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

namespace {

constexpr int64_t kRows = 16;   // output rows per panel
constexpr int64_t kBlock = 32;  // input channels per scale
constexpr int64_t kMaxTile = 4; // activation rows sharing one pass over a panel
constexpr float kActMax = 8191.f;  // 14-bit activation codes

// Activation rows in blocks of 32: the two bytes of every code, per block the code scale, the sums of the
// bytes (to take out q8's +128) and the exact float sum (q4's minimum term). Buffers are left uninitialized
// (every element is written): zero-filling them cost as much as quantizing.
struct QuantizedActivations {
  QuantizedActivations(int64_t M, int64_t K)
      : hi(new int8_t[M * K]), lo(new int8_t[M * K]), scales(new float[M * K / kBlock]),
        hi_sums(new int32_t[M * K / kBlock]), lo_sums(new int32_t[M * K / kBlock]), fsums(new float[M * K / kBlock]) {}
  std::unique_ptr<int8_t[]> hi, lo;           // [M, K]: code >> 7 (-64..63), code & 127 (0..127)
  std::unique_ptr<float[]> scales;            // [M, K / 32]
  std::unique_ptr<int32_t[]> hi_sums, lo_sums;  // [M, K / 32]
  std::unique_ptr<float[]> fsums;             // [M, K / 32]
};

// How a q4 panel stores its blocks' minimums: float16 per block, none (codes centred at 8) or, with the scales,
// as 8-bit factors of per-super-block float16 values. q8 panels use kNone (their scales are float16).
enum class Mins { kHalf, kNone, kSub };

// One panel's block scales (and q4 minimums); which pointers are set depends on Mins.
struct PanelScales {
  const at::Half* d = nullptr;      // [K / 32][16] float16 scales (kHalf, kNone)
  const at::Half* mins = nullptr;   // [K / 32][16] float16 minimums (kHalf)
  const uint8_t* sub_d = nullptr;   // [K / 32][16] 8-bit scale factors (kSub)
  const uint8_t* sub_m = nullptr;   // [K / 32][16] 8-bit minimum factors (kSub)
  const at::Half* super = nullptr;  // [K / 256][2][16] float16: scale, minimum (kSub)
};

#ifdef TOKENMILL_VNNI
template <typename T>
inline __m512 load_float16(const T* p) {  // double: instantiated by the dispatch, rejected before it runs
  float tmp[16];
  for (int i = 0; i < 16; ++i) tmp[i] = static_cast<float>(p[i]);
  return _mm512_loadu_ps(tmp);
}
template <>
inline __m512 load_float16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load_float16<at::BFloat16>(const at::BFloat16* p) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}
template <>
inline __m512 load_float16<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// The AVX2 twin of load_float16 above: one loader per ISA, chosen at compile time.
#ifdef TOKENMILL_AVX2
template <typename T>
inline __m256 load8_float(const T* p) {  // double: instantiated by the dispatch, rejected before it runs
  float tmp[8];
  for (int i = 0; i < 8; ++i) tmp[i] = static_cast<float>(p[i]);
  return _mm256_loadu_ps(tmp);
}
template <>
inline __m256 load8_float<float>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <>
inline __m256 load8_float<at::BFloat16>(const at::BFloat16* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
template <>
inline __m256 load8_float<at::Half>(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline int32_t hsum8_epi32(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
}
// Four vectors of 8 int32 (each in -128..127) -> 32 int8 in order.
inline void store32_epi8(int8_t* dst, const __m256i* v) {
  const __m256i p01 = _mm256_packs_epi32(v[0], v[1]), p23 = _mm256_packs_epi32(v[2], v[3]);  // lane-interleaved
  const __m256i b = _mm256_packs_epi16(p01, p23);
  // packs works per 128-bit lane: dwords now hold elements 0-3, 8-11, 16-19, 24-27, 4-7, 12-15, 20-23, 28-31
  const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
}
#endif

// One block of 32 activations (see QuantizedActivations); i indexes the block.
template <typename T>
inline void quantize_block(const T* src, int64_t i, QuantizedActivations& a) {
  int8_t* hi = a.hi.get() + i * kBlock;
  int8_t* lo = a.lo.get() + i * kBlock;
#ifdef TOKENMILL_VNNI
  const __m512 x0 = load_float16(src), x1 = load_float16(src + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  a.fsums[i] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? kActMax / amax : 0.f);
  const __m512i low7 = _mm512_set1_epi32(127);
  __m512i hsum = _mm512_setzero_si512(), lsum = _mm512_setzero_si512();
  for (int half = 0; half < 2; ++half) {
    // cvtps_epi32 rounds to nearest even (the default MXCSR mode), as nearbyint below; |x * inv| <= 8191.
    const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(half ? x1 : x0, inv));
    const __m512i h = _mm512_srai_epi32(c, 7), l = _mm512_and_si512(c, low7);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + half * 16), _mm512_cvtepi32_epi8(h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + half * 16), _mm512_cvtepi32_epi8(l));
    hsum = _mm512_add_epi32(hsum, h);
    lsum = _mm512_add_epi32(lsum, l);
  }
  a.hi_sums[i] = _mm512_reduce_add_epi32(hsum);
  a.lo_sums[i] = _mm512_reduce_add_epi32(lsum);
#elif defined(TOKENMILL_AVX2)
  __m256 x[4];
  for (int j = 0; j < 4; ++j) x[j] = load8_float(src + 8 * j);
  const __m256 sign_mask = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_andnot_ps(sign_mask, x[0]), vsum = x[0];
  for (int j = 1; j < 4; ++j) {
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign_mask, x[j]));
    vsum = _mm256_add_ps(vsum, x[j]);
  }
  const float amax = hmax8(vmax);
  a.fsums[i] = hsum8(vsum);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? kActMax / amax : 0.f);
  const __m256i low7 = _mm256_set1_epi32(127);
  __m256i hsum = _mm256_setzero_si256(), lsum = _mm256_setzero_si256();
  __m256i h[4], l[4];
  for (int j = 0; j < 4; ++j) {
    // cvtps_epi32 rounds to nearest even (the default MXCSR mode), as nearbyint below; |x * inv| <= 8191.
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(x[j], inv));
    h[j] = _mm256_srai_epi32(c, 7);
    l[j] = _mm256_and_si256(c, low7);
    hsum = _mm256_add_epi32(hsum, h[j]);
    lsum = _mm256_add_epi32(lsum, l[j]);
  }
  store32_epi8(hi, h);
  store32_epi8(lo, l);
  a.hi_sums[i] = hsum8_epi32(hsum);
  a.lo_sums[i] = hsum8_epi32(lsum);
#else
  float vals[kBlock];
  float amax = 0.f, sum = 0.f;
  for (int64_t k = 0; k < kBlock; ++k) {
    vals[k] = static_cast<float>(src[k]);
    amax = std::max(amax, std::fabs(vals[k]));
    sum += vals[k];
  }
  const float inv = amax > 0.f ? kActMax / amax : 0.f;
  int32_t hsum = 0, lsum = 0;
  for (int64_t k = 0; k < kBlock; ++k) {
    const int32_t c = std::clamp(static_cast<int32_t>(std::nearbyint(vals[k] * inv)), -8191, 8191);
    hi[k] = static_cast<int8_t>(c >> 7);  // arithmetic shift: floor(c / 128)
    lo[k] = static_cast<int8_t>(c & 127);
    hsum += hi[k];
    lsum += lo[k];
  }
  a.fsums[i] = sum;
  a.hi_sums[i] = hsum;
  a.lo_sums[i] = lsum;
#endif
  a.scales[i] = amax / kActMax;
}

template <typename T>
void quantize_activations(const at::Tensor& x, int64_t M, int64_t K, QuantizedActivations& a) {
  const T* src = x.data_ptr<T>();
  const int64_t nb = K / kBlock;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) quantize_block(src + m * x.stride(0) + b * kBlock, m * nb + b, a);
}

#ifdef TOKENMILL_VNNI
inline __m512 load_u8_float(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Block b's 16 scales and minimums (zero for kNone).
template <Mins MINS>
inline void block_scales(const PanelScales& s, int64_t b, __m512& scale, __m512& mn) {
  if constexpr (MINS == Mins::kSub) {
    const at::Half* sup = s.super + (b / 8) * 2 * kRows;
    scale = _mm512_mul_ps(load_u8_float(s.sub_d + b * kRows), load_float16(sup));
    mn = _mm512_mul_ps(load_u8_float(s.sub_m + b * kRows), load_float16(sup + kRows));
  } else {
    scale = load_float16(s.d + b * kRows);
    mn = MINS == Mins::kHalf ? load_float16(s.mins + b * kRows) : _mm512_setzero_ps();
  }
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// MT activation rows against one panel; out[m * 16 + r] in float32.
template <int MT, bool Q4, Mins MINS>
void panel_tile(const uint8_t* w, const PanelScales& s, int64_t K, const QuantizedActivations& a, int64_t m0,
                float* out) {
  const int64_t nb = K / kBlock;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 accf[MT];
  for (int m = 0; m < MT; ++m) accf[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc_hi[MT], acc_lo[MT];
    const int8_t* xh[MT];
    const int8_t* xl[MT];
    for (int m = 0; m < MT; ++m) {
      const int64_t i = (m0 + m) * nb + b;
      xh[m] = a.hi.get() + i * kBlock;
      xl[m] = a.lo.get() + i * kBlock;
      // q8 stores q + 128: sum (q + 128) x = sum q x + 128 sum x, so each lane starts at -128 sum x (q4 without
      // mins: at -8 sum x).
      constexpr int32_t offset = Q4 ? (MINS == Mins::kNone ? 8 : 0) : 128;
      acc_hi[m] = _mm512_set1_epi32(-offset * a.hi_sums[i]);
      acc_lo[m] = _mm512_set1_epi32(-offset * a.lo_sums[i]);
    }
    if constexpr (Q4) {
      const uint8_t* wb = w + b * kBlock * kRows / 2;
      for (int g = 0; g < kBlock / 8; ++g) {
        const __m512i v = _mm512_loadu_si512(wb + g * 64);
        const __m512i w0 = _mm512_and_si512(v, low4);
        const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int m = 0; m < MT; ++m) {
          acc_hi[m] = _mm512_dpbusd_epi32(acc_hi[m], w0, broadcast4(xh[m] + g * 8));
          acc_hi[m] = _mm512_dpbusd_epi32(acc_hi[m], w1, broadcast4(xh[m] + g * 8 + 4));
          acc_lo[m] = _mm512_dpbusd_epi32(acc_lo[m], w0, broadcast4(xl[m] + g * 8));
          acc_lo[m] = _mm512_dpbusd_epi32(acc_lo[m], w1, broadcast4(xl[m] + g * 8 + 4));
        }
      }
    } else {
      const uint8_t* wb = w + b * kBlock * kRows;
      for (int j = 0; j < kBlock / 4; ++j) {
        const __m512i v = _mm512_loadu_si512(wb + j * 64);
        for (int m = 0; m < MT; ++m) {
          acc_hi[m] = _mm512_dpbusd_epi32(acc_hi[m], v, broadcast4(xh[m] + j * 4));
          acc_lo[m] = _mm512_dpbusd_epi32(acc_lo[m], v, broadcast4(xl[m] + j * 4));
        }
      }
    }
    __m512 scale, mn;
    block_scales<MINS>(s, b, scale, mn);
    for (int m = 0; m < MT; ++m) {
      const __m512i acc = _mm512_add_epi32(_mm512_slli_epi32(acc_hi[m], 7), acc_lo[m]);  // sum q c, exact
      const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(a.scales[(m0 + m) * nb + b]));
      accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), s, accf[m]);
    }
    if constexpr (Q4 && MINS != Mins::kNone) {
      for (int m = 0; m < MT; ++m) accf[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.fsums[(m0 + m) * nb + b]), accf[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * kRows, accf[m]);
}
#endif

#ifdef TOKENMILL_AVX2
inline __m256 load8_u8_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Rows 8h..8h+7 of block b: scales and minimums (zero for kNone), as block_scales.
template <Mins MINS>
inline void block_scales_avx2(const PanelScales& s, int64_t b, int h, __m256& scale, __m256& mn) {
  if constexpr (MINS == Mins::kSub) {
    const at::Half* sup = s.super + (b / 8) * 2 * kRows + h * 8;
    scale = _mm256_mul_ps(load8_u8_float(s.sub_d + b * kRows + h * 8), load8_float(sup));
    mn = _mm256_mul_ps(load8_u8_float(s.sub_m + b * kRows + h * 8), load8_float(sup + kRows));
  } else {
    scale = load8_float(s.d + b * kRows + h * 8);
    mn = MINS == Mins::kHalf ? load8_float(s.mins + b * kRows + h * 8) : _mm256_setzero_ps();
  }
}

inline __m256i broadcast4_avx2(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// MT activation rows against one panel with AVX2 (see the header); out[m * 16 + r] in float32. Each 64-byte
// group of the panel is two registers: rows 0-7 (h = 0) and rows 8-15 (h = 1).
template <int MT, bool Q4, Mins MINS>
void panel_tile_avx2(const uint8_t* w, const PanelScales& s, int64_t K, const QuantizedActivations& a, int64_t m0,
                     float* out) {
  const int64_t nb = K / kBlock;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 accf[MT][2];
  for (int m = 0; m < MT; ++m) accf[m][0] = accf[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i acc_hi[MT][2], acc_lo[MT][2];  // Q4: 16-bit pair sums; q8: 32-bit sums
    const int8_t* xh[MT];
    const int8_t* xl[MT];
    for (int m = 0; m < MT; ++m) {
      const int64_t i = (m0 + m) * nb + b;
      xh[m] = a.hi.get() + i * kBlock;
      xl[m] = a.lo.get() + i * kBlock;
      for (int h = 0; h < 2; ++h) acc_hi[m][h] = acc_lo[m][h] = _mm256_setzero_si256();
    }
    if constexpr (Q4) {
      const uint8_t* wb = w + b * kBlock * kRows / 2;
      for (int g = 0; g < kBlock / 8; ++g) {
        __m256i w0[2], w1[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 64 + h * 32));
          w0[h] = _mm256_and_si256(v, low4);
          w1[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        for (int m = 0; m < MT; ++m) {
          const __m256i h0 = broadcast4_avx2(xh[m] + g * 8), h1 = broadcast4_avx2(xh[m] + g * 8 + 4);
          const __m256i l0 = broadcast4_avx2(xl[m] + g * 8), l1 = broadcast4_avx2(xl[m] + g * 8 + 4);
          for (int h = 0; h < 2; ++h) {
            acc_hi[m][h] = _mm256_add_epi16(acc_hi[m][h], _mm256_add_epi16(_mm256_maddubs_epi16(w0[h], h0),
                                                                           _mm256_maddubs_epi16(w1[h], h1)));
            acc_lo[m][h] = _mm256_add_epi16(acc_lo[m][h], _mm256_add_epi16(_mm256_maddubs_epi16(w0[h], l0),
                                                                           _mm256_maddubs_epi16(w1[h], l1)));
          }
        }
      }
      for (int m = 0; m < MT; ++m) {
        const int64_t i = (m0 + m) * nb + b;
        for (int h = 0; h < 2; ++h) {
          acc_hi[m][h] = _mm256_madd_epi16(acc_hi[m][h], ones16);
          acc_lo[m][h] = _mm256_madd_epi16(acc_lo[m][h], ones16);
          if constexpr (MINS == Mins::kNone) {  // without mins: sum (q - 8) c = sum q c - 8 sum c
            acc_hi[m][h] = _mm256_sub_epi32(acc_hi[m][h], _mm256_set1_epi32(8 * a.hi_sums[i]));
            acc_lo[m][h] = _mm256_sub_epi32(acc_lo[m][h], _mm256_set1_epi32(8 * a.lo_sums[i]));
          }
        }
      }
    } else {
      const uint8_t* wb = w + b * kBlock * kRows;
      for (int j = 0; j < kBlock / 4; ++j) {
        __m256i wa[2], ws[2];
        for (int h = 0; h < 2; ++h) {
          ws[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + j * 64 + h * 32)), flip);
          wa[h] = _mm256_sign_epi8(ws[h], ws[h]);  // |q| (q >= -127)
        }
        for (int m = 0; m < MT; ++m) {
          const __m256i hb = broadcast4_avx2(xh[m] + j * 4), lb = broadcast4_avx2(xl[m] + j * 4);
          for (int h = 0; h < 2; ++h) {
            acc_hi[m][h] = _mm256_add_epi32(
                acc_hi[m][h], _mm256_madd_epi16(_mm256_maddubs_epi16(wa[h], _mm256_sign_epi8(hb, ws[h])), ones16));
            acc_lo[m][h] = _mm256_add_epi32(
                acc_lo[m][h], _mm256_madd_epi16(_mm256_maddubs_epi16(wa[h], _mm256_sign_epi8(lb, ws[h])), ones16));
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 scale, mn;
      block_scales_avx2<MINS>(s, b, h, scale, mn);
      for (int m = 0; m < MT; ++m) {
        const int64_t i = (m0 + m) * nb + b;
        const __m256i acc = _mm256_add_epi32(_mm256_slli_epi32(acc_hi[m][h], 7), acc_lo[m][h]);  // sum q c, exact
        const __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(a.scales[i]));
        accf[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), s, accf[m][h]);
        if constexpr (Q4 && MINS != Mins::kNone) accf[m][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.fsums[i]), accf[m][h]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * kRows + h * 8, accf[m][h]);
}
#endif

// Portable path: the same formats and the same integer block sums.
template <bool Q4, Mins MINS>
void panel_tile_scalar(const uint8_t* w, const PanelScales& s, int64_t K, const QuantizedActivations& a, int64_t m0,
                       int64_t mt, float* out) {
  const int64_t nb = K / kBlock;
  for (int64_t m = 0; m < mt; ++m) {
    const int64_t row = m0 + m;
    for (int64_t r = 0; r < kRows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
          int32_t q;
          if constexpr (Q4) {
            const uint8_t byte = w[(k / 8) * 64 + r * 4 + k % 4];
            q = ((k % 8) < 4 ? (byte & 0x0F) : (byte >> 4)) - (MINS == Mins::kNone ? 8 : 0);
          } else {
            q = static_cast<int32_t>(w[(k / 4) * 64 + r * 4 + k % 4]) - 128;
          }
          isum += q * (128 * a.hi[row * K + k] + a.lo[row * K + k]);
        }
        float scale, mn = 0.f;
        if constexpr (MINS == Mins::kSub) {
          const at::Half* sup = s.super + (b / 8) * 2 * kRows;
          scale = static_cast<float>(s.sub_d[b * kRows + r]) * static_cast<float>(sup[r]);
          mn = static_cast<float>(s.sub_m[b * kRows + r]) * static_cast<float>(sup[kRows + r]);
        } else {
          scale = static_cast<float>(s.d[b * kRows + r]);
          if constexpr (MINS == Mins::kHalf) mn = static_cast<float>(s.mins[b * kRows + r]);
        }
        acc += static_cast<float>(isum) * (scale * a.scales[row * nb + b]);
        if constexpr (Q4 && MINS != Mins::kNone) acc += mn * a.fsums[row * nb + b];
      }
      out[m * kRows + r] = acc;
    }
  }
}

template <bool Q4, Mins MINS>
void run_tile(const uint8_t* w, const PanelScales& s, int64_t K, const QuantizedActivations& a,
              int64_t m0, int64_t mt, float* out) {
#ifdef TOKENMILL_VNNI
  switch (mt) {
    case 1: return panel_tile<1, Q4, MINS>(w, s, K, a, m0, out);
    case 2: return panel_tile<2, Q4, MINS>(w, s, K, a, m0, out);
    case 3: return panel_tile<3, Q4, MINS>(w, s, K, a, m0, out);
    default: return panel_tile<4, Q4, MINS>(w, s, K, a, m0, out);
  }
#elif defined(TOKENMILL_AVX2)
  switch (mt) {
    case 1: return panel_tile_avx2<1, Q4, MINS>(w, s, K, a, m0, out);
    case 2: return panel_tile_avx2<2, Q4, MINS>(w, s, K, a, m0, out);
    case 3:
      panel_tile_avx2<2, Q4, MINS>(w, s, K, a, m0, out);
      return panel_tile_avx2<1, Q4, MINS>(w, s, K, a, m0 + 2, out + 2 * kRows);
    default:
      panel_tile_avx2<2, Q4, MINS>(w, s, K, a, m0, out);
      return panel_tile_avx2<2, Q4, MINS>(w, s, K, a, m0 + 2, out + 2 * kRows);
  }
#else
  panel_tile_scalar<Q4, MINS>(w, s, K, a, m0, mt, out);
#endif
}

template <bool Q4>
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const at::Tensor& mins, const std::optional<at::Tensor>& super_scales) {
  const char* name = Q4 ? "q4_linear" : "q8_linear";
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": x must be [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              name, ": x must be float32, bfloat16 or float16");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K > 0 && K % kBlock == 0, name, ": input features must be a positive multiple of 32, got ", K);
  const int64_t panel_bytes = Q4 ? K * kRows / 2 : K * kRows;
  const auto packed_dtype = at::kByte;
  TORCH_CHECK(packed.scalar_type() == packed_dtype && packed.dim() == 2 && packed.is_contiguous()
                  && packed.size(1) == panel_bytes,
              name, ": packed must be a contiguous uint8 [N / 16, ", panel_bytes,
              "] tensor for K = ", K);
  const int64_t P = packed.size(0), N = P * kRows, nb = K / kBlock;
  // q4 with 8-bit factors of super-block values: uint8 scales and mins
  const bool sub = Q4 && scales.scalar_type() == at::kByte;
  const auto scale_dtype = sub ? at::kByte : at::kHalf;
  auto check_scales = [&](const at::Tensor& s, const char* what) {
    TORCH_CHECK(s.scalar_type() == scale_dtype && s.is_contiguous() && s.dim() == 3 && s.size(0) == P
                    && s.size(1) == nb && s.size(2) == kRows,
                name, ": ", what, " must be a contiguous ", sub ? "uint8" : "float16",
                " [N / 16, K / 32, 16] tensor");
  };
  check_scales(scales, "scales");
  // q4 without minimums (codes centred at 8): mins is [N / 16, 0, 16]
  const bool sym = Q4 && !sub && mins.dim() == 3 && mins.size(0) == P && mins.size(1) == 0 && mins.size(2) == kRows;
  if (Q4 && !sym) check_scales(mins, "mins (or [N / 16, 0, 16]: none)");
  if (sub) {
    TORCH_CHECK(nb % 8 == 0, name, ": 8-bit scales need input features a multiple of 256, got ", K);
    TORCH_CHECK(super_scales.has_value() && super_scales->scalar_type() == at::kHalf && super_scales->is_contiguous()
                    && super_scales->dim() == 4 && super_scales->size(0) == P && super_scales->size(1) == nb / 8
                    && super_scales->size(2) == 2 && super_scales->size(3) == kRows,
                name, ": 8-bit scales need super_scales, a contiguous float16 [N / 16, K / 256, 2, 16] tensor");
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  QuantizedActivations a(M, K);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_activations",
                                  [&] { quantize_activations<scalar_t>(x, M, K, a); });
  const auto* w = static_cast<const uint8_t*>(packed.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_linear", [&] {
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, P, 8, [&](int64_t begin, int64_t end) {
      float tile[kMaxTile * kRows];
      for (int64_t p = begin; p < end; ++p) {
        // The panel (K * 16 bytes or half that) stays in L1/L2 while every tile of activation rows reads it.
        for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
          const int64_t mt = std::min(kMaxTile, M - m0);
          const uint8_t* wp = w + p * panel_bytes;
          PanelScales ps;
          if (sub) {
            ps.sub_d = static_cast<const uint8_t*>(scales.data_ptr()) + p * nb * kRows;
            ps.sub_m = static_cast<const uint8_t*>(mins.data_ptr()) + p * nb * kRows;
            ps.super = super_scales->data_ptr<at::Half>() + p * (nb / 8) * 2 * kRows;
            run_tile<Q4, Mins::kSub>(wp, ps, K, a, m0, mt, tile);
          } else {
            ps.d = scales.data_ptr<at::Half>() + p * nb * kRows;
            if (Q4 && !sym) {
              ps.mins = mins.data_ptr<at::Half>() + p * nb * kRows;
              run_tile<Q4, Mins::kHalf>(wp, ps, K, a, m0, mt, tile);
            } else {
              run_tile<Q4, Mins::kNone>(wp, ps, K, a, m0, mt, tile);
            }
          }
          for (int64_t m = 0; m < mt; ++m)
            for (int64_t r = 0; r < kRows; ++r)
              y[(m0 + m) * N + p * kRows + r] = static_cast<scalar_t>(tile[m * kRows + r]);
        }
      }
    });
  });
  return out;
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  return quant_linear<false>(x, packed, scales, scales, std::nullopt);
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins,
                     const std::optional<at::Tensor>& super_scales) {
  return quant_linear<true>(x, packed, scales, mins, super_scales);
}

bool has_vnni() {
#ifdef TOKENMILL_VNNI
  return true;
#else
  return false;
#endif
}

// Which code path this build runs: "avx512_vnni", "avx2" or "scalar".
std::string quant_linear_isa() {
#if defined(TOKENMILL_VNNI)
  return "avx512_vnni";
#elif defined(TOKENMILL_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("q8_linear(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, Tensor? super_scales=None) -> Tensor");
  m.def("quant_linear_has_vnni() -> bool", &has_vnni);
  m.def("quant_linear_isa() -> str", &quant_linear_isa);
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("q8_linear", &q8_linear);
  m.impl("q4_linear", &q4_linear);
}
