// Decode attention over a paged KV cache, reading each request's blocks in place.
//
// Layout (tokenmill's torch_paged backend): kv_cache [2, Hkv, num_blocks, block_size, D], keys then values.
// One work item is one (request, KV head) pair: its G = Hq / Hkv query heads share every key and value row,
// so each row is loaded from memory once and used G times. Scores are kept in a per-thread buffer, the
// softmax is exact (max, exp, sum over the whole context), and the weighted sum of values accumulates in
// float32 for every input dtype. The cache may hold bfloat16 or float16 under float32 queries (a float32 model
// with --kv-cache-dtype bfloat16), or int8 / fp8 under float32 queries (--kv-cache-dtype int8 | fp8_e4m3 |
// fp8_e5m2; the rows of tokenmill.attention.kv_cache_quant): rows are widened as they are loaded. With a
// sliding window W only the last W positions are attended to and the blocks before them are never touched; with
// a soft cap c the scaled scores become c * tanh(s / c).
//
// The loop waits on memory, not arithmetic: every block is a separate 4 KiB run (one KV head's 16 rows) that the
// hardware prefetchers do not see coming. So each thread lists the blocks it will read, in reading order (per work
// item its key blocks, then its value blocks), and while it reads one block it asks for the block 32 KiB further
// down that list into L2 and for the next one into L1, a share of each before every step of rows it reads (1 KiB
// of rows, rounded up to four; ReadAhead). That brings a decode step of 256 requests x 192 tokens near the floor
// of reading K and V once (Zen 4: 76-80 ms against a floor of 72-80 ms, where asking for whole blocks at a time
// took 103-109 ms; docs/benchmarks.md, "Decode attention kernel").

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

// W elements of src as float32.
template <typename T>
inline Vec load_float(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src);
  } else {
    __at_align__ float tmp[W];
    for (int64_t i = 0; i < W; ++i) tmp[i] = static_cast<float>(src[i]);
    return Vec::loadu(tmp);
  }
}

// ATen's conversions: vectorized on AVX-512 and AVX2 (bf16: shift into the high half; fp16: F16C), a scalar
// loop in the default build.
template <>
inline Vec load_float<at::BFloat16>(const at::BFloat16* src) {
  Vec out;
  at::vec::load_fp32_from_bf16(src, out);
  return out;
}
template <>
inline Vec load_float<at::Half>(const at::Half* src) {
  Vec out;
  at::vec::load_fp32_from_fp16(src, out);
  return out;
}

// Quantized caches (tokenmill.attention.kv_cache_quant): int8 codes (their row's scale is applied to the row's
// score and probability, never to every element) and fp8 values with scale 1.0. One vector of codes widened to
// float32: on AVX-512 and AVX2 int8 is a sign extension, e5m2 is the upper byte of a float16 (F16C widens it),
// and e4m3 is rebuilt as float32 bits (sign, then exponent and mantissa shifted into place) times 2^120, the
// difference of the two exponent biases, which turns its subnormals (exponent field 0) into the right values too.
// The e4m3 NaN code (0x7F / 0xFF) is never written (the write saturates at 448), so it is not special-cased.
// The default build converts one element at a time (c10's conversions).
#if defined(CPU_CAPABILITY_AVX512)
template <>
inline Vec load_float<int8_t>(const int8_t* src) {
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)))));
}
template <>
inline Vec load_float<c10::Float8_e5m2>(const c10::Float8_e5m2* src) {
  const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return Vec(_mm512_cvtph_ps(_mm256_slli_epi16(h, 8)));
}
template <>
inline Vec load_float<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* src) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7F)), 20),
                                       _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24));
  return Vec(_mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f)));
}
#elif defined(CPU_CAPABILITY_AVX2)
template <>
inline Vec load_float<int8_t>(const int8_t* src) {
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)))));
}
template <>
inline Vec load_float<c10::Float8_e5m2>(const c10::Float8_e5m2* src) {
  const __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  return Vec(_mm256_cvtph_ps(_mm_slli_epi16(h, 8)));
}
template <>
inline Vec load_float<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* src) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20),
                                       _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24));
  return Vec(_mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f)));
}
#endif

// Cache element types whose rows carry a float32 scale in their last 4 bytes (an int8 cache).
template <typename TC>
constexpr bool kScaledRows = std::is_same_v<TC, int8_t>;

// The scale of a cache row of `row` elements (int8: in its last 4 bytes).
template <typename TC>
inline float row_scale(const TC* r, int64_t row) {
  float s;
  std::memcpy(&s, reinterpret_cast<const char*>(r + row) - sizeof(float), sizeof(float));
  return s;
}

inline float hsum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);
#else
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
#endif
}

constexpr int64_t kMaxGroup = 8;  // query heads per KV head handled together (register accumulators)

// Largest of x[0..n).
inline float max_of(const float* x, int64_t n) {
  const int64_t n_vec = n - n % W;
  Vec vmax(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < n_vec; t += W) vmax = at::vec::maximum(vmax, Vec::loadu(x + t));
  float mx = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (int64_t t = n_vec; t < n; ++t) mx = std::max(mx, x[t]);
  return mx;
}

// x[t] = exp(x[t] - mx) for t < n, in place; returns their sum.
inline float exp_sub_sum(float* x, int64_t n, float mx) {
  const int64_t n_vec = n - n % W;
  Vec vsum(0.f);
  const Vec vmx(mx);
  for (int64_t t = 0; t < n_vec; t += W) {
    const Vec e = (Vec::loadu(x + t) - vmx).exp_u20();
    e.store(x + t);
    vsum = vsum + e;
  }
  float sum = hsum(vsum);
  for (int64_t t = n_vec; t < n; ++t) {
    x[t] = std::exp(x[t] - mx);
    sum += x[t];
  }
  return sum;
}

// Exact softmax of x[0..n) in place.
inline void softmax_inplace(float* x, int64_t n) {
  const float sum = exp_sub_sum(x, n, max_of(x, n));
  const int64_t n_vec = n - n % W;
  const Vec inv(1.f / sum);
  for (int64_t t = 0; t < n_vec; t += W) (Vec::loadu(x + t) * inv).store(x + t);
  for (int64_t t = n_vec; t < n; ++t) x[t] /= sum;
}

// Scores of `rows` key rows (ldk elements apart) against G query heads (qf: [G, D] float32, pre-scaled), written
// to scores[g * stride + r]. G is a template parameter so the accumulators stay in registers.
template <int G, typename T>
inline void qk_rows(const float* qf, const T* k, int64_t ldk, int64_t rows, int64_t head_size, int64_t vec_end,
                    float* scores, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r, k += ldk) {
    Vec acc[G];
    for (int g = 0; g < G; ++g) acc[g] = Vec(0.f);
    for (int64_t i = 0; i < vec_end; i += W) {
      const Vec kv = load_float(k + i);
      for (int g = 0; g < G; ++g) acc[g] = at::vec::fmadd(Vec::loadu(qf + g * head_size + i), kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) {
      float dot = hsum(acc[g]);
      for (int64_t i = vec_end; i < head_size; ++i) dot += qf[g * head_size + i] * static_cast<float>(k[i]);
      scores[g * stride + r] = dot;
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
constexpr int kAccRegs = 24;  // accumulators one loop keeps in registers (of 32 vector registers)
constexpr int kHeadChunk = 4;  // query heads scored together (4 x 4 accumulators)
#else
constexpr int kAccRegs = 12;  // of 16 vector registers
// Three heads per pass (12 accumulators besides the key and query vectors): SmolLM2-135M's 3 query heads per KV
// head in one pass over the keys instead of two (2 + 1): about 9% less of the kernel's own work with the blocks in
// cache (python benchmarks/attention_kernel.py --blocks shared --kernel-only, AVX2 build); no change where memory
// is the limit (docs/benchmarks-history.md, "2026-12-04 Xeon (05568d9)").
constexpr int kHeadChunk = 3;
#endif
constexpr int kMaxChunk = 8;  // vectors of D per value loop

// out[g, i0 : i0 + C * W] += sum_r probs[g * stride + r] * v[r, i0 : i0 + C * W] for g < G (out: [G, D] float32):
// each probability is broadcast once per row, and each value vector is loaded once for the G heads.
template <int G, int C, typename T>
inline void pv_chunk(const float* probs, int64_t stride, const T* v, int64_t ldv, int64_t rows, int64_t head_size,
                     int64_t i0, float* out) {
  Vec acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = Vec::loadu(out + g * head_size + i0 + c * W);
  for (int64_t r = 0; r < rows; ++r) {
    Vec p[G];
    for (int g = 0; g < G; ++g) p[g] = Vec(probs[g * stride + r]);
    const T* vr = v + r * ldv + i0;
    for (int c = 0; c < C; ++c) {
      const Vec vv = load_float(vr + c * W);
      for (int g = 0; g < G; ++g) acc[g][c] = at::vec::fmadd(p[g], vv, acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c].store(out + g * head_size + i0 + c * W);
}

// pv_chunk<G, n> for a run-time n <= kMaxChunk.
template <int G, int C = 1, typename T>
inline void pv_chunk_n(int64_t n, const float* probs, int64_t stride, const T* v, int64_t ldv, int64_t rows,
                       int64_t head_size, int64_t i0, float* out) {
  if constexpr (C < kMaxChunk) {
    if (n > C) return pv_chunk_n<G, C + 1>(n, probs, stride, v, ldv, rows, head_size, i0, out);
  }
  pv_chunk<G, C>(probs, stride, v, ldv, rows, head_size, i0, out);
}

// out[g, :] += sum_r probs[g * stride + r] * v[r, :] for `rows` value rows ldv elements apart (out: [G, D]
// float32), D in chunks of as many vectors as the G heads' accumulators leave registers for.
template <int G, typename T>
inline void pv_rows(const float* probs, int64_t stride, const T* v, int64_t ldv, int64_t rows, int64_t head_size,
                    int64_t vec_end, float* out) {
  constexpr int C = std::min(kMaxChunk, std::max(1, kAccRegs / G));
  int64_t i0 = 0;
  for (; i0 + C * W <= vec_end; i0 += C * W) pv_chunk<G, C>(probs, stride, v, ldv, rows, head_size, i0, out);
  if (i0 < vec_end) pv_chunk_n<G>((vec_end - i0) / W, probs, stride, v, ldv, rows, head_size, i0, out);
  for (int64_t i = vec_end; i < head_size; ++i)
    for (int64_t r = 0; r < rows; ++r) {
      const float vi = static_cast<float>(v[r * ldv + i]);
      for (int g = 0; g < G; ++g) out[g * head_size + i] += probs[g * stride + r] * vi;
    }
}

#if defined(CPU_CAPABILITY_AVX512)
#define TOKENMILL_REDUCE4 1
// The totals of four 16-lane partial sums, as four floats.
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  z = _mm512_add_ps(z, _mm512_permute_ps(z, 0x4E));  // 128-bit lane k now holds a_k's sum in every element
  z = _mm512_add_ps(z, _mm512_permute_ps(z, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), z));
}
#elif defined(CPU_CAPABILITY_AVX2)
#define TOKENMILL_REDUCE4 1
// The totals of four 8-lane partial sums, as four floats.
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // lane halves: a0..a3 partials
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif

#ifdef TOKENMILL_REDUCE4
// Scores of `rows` key rows against GC query heads (qf: [GC, D] float32, pre-scaled, D % W == 0), four key rows
// at a time: each key vector is loaded once for the GC heads, and one horizontal reduction serves four scores (a
// per-row reduction costs more than the row's multiply-adds at D = 64).
template <int GC, typename T>
inline void qk_heads4(const float* qf, const T* k, int64_t ldk, int64_t rows, int64_t head_size, float* scores,
                      int64_t stride) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    const T* kr = k + r * ldk;
    Vec a[GC][4];
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < 4; ++j) a[g][j] = Vec(0.f);
    for (int64_t i = 0; i < head_size; i += W) {
      const Vec k0 = load_float(kr + i), k1 = load_float(kr + ldk + i), k2 = load_float(kr + 2 * ldk + i),
                k3 = load_float(kr + 3 * ldk + i);
      for (int g = 0; g < GC; ++g) {
        const Vec qv = Vec::loadu(qf + g * head_size + i);
        a[g][0] = at::vec::fmadd(qv, k0, a[g][0]);
        a[g][1] = at::vec::fmadd(qv, k1, a[g][1]);
        a[g][2] = at::vec::fmadd(qv, k2, a[g][2]);
        a[g][3] = at::vec::fmadd(qv, k3, a[g][3]);
      }
    }
    for (int g = 0; g < GC; ++g) _mm_storeu_ps(scores + g * stride + r, reduce4(a[g][0], a[g][1], a[g][2], a[g][3]));
  }
  for (; r < rows; ++r)
    for (int g = 0; g < GC; ++g) {
      Vec a(0.f);
      for (int64_t i = 0; i < head_size; i += W)
        a = at::vec::fmadd(Vec::loadu(qf + g * head_size + i), load_float(k + r * ldk + i), a);
      scores[g * stride + r] = hsum(a);
    }
}

// Scores of `rows` key rows against `group` query heads (qf: [group, D]), kHeadChunk heads per pass over the rows
// (the block's rows stay in L1 between passes).
template <typename T>
inline void qk_rows4(const float* qf, int64_t group, const T* k, int64_t ldk, int64_t rows, int64_t head_size,
                     float* scores, int64_t stride) {
  for (int64_t g0 = 0; g0 < group; g0 += kHeadChunk) {
    const float* q = qf + g0 * head_size;
    float* out = scores + g0 * stride;
    switch (std::min<int64_t>(kHeadChunk, group - g0)) {
      case 1: qk_heads4<1>(q, k, ldk, rows, head_size, out, stride); break;
      case 3: qk_heads4<3>(q, k, ldk, rows, head_size, out, stride); break;
#if defined(CPU_CAPABILITY_AVX512)
      case 4: qk_heads4<4>(q, k, ldk, rows, head_size, out, stride); break;
#endif
      default: qk_heads4<2>(q, k, ldk, rows, head_size, out, stride); break;
    }
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define TOKENMILL_BF16_DOT 1

// Scores of `rows` bfloat16 key rows against `group` bfloat16 query rows (qb: [group, D], D % 32 == 0) with
// the AVX-512 BF16 pair dot product (exact bf16 products, float32 sums), four rows per horizontal reduction.
inline void qk_rows_bf16(const at::BFloat16* qb, int64_t group, const at::BFloat16* k, int64_t rows,
                         int64_t head_size, float scale, float* scores, int64_t stride) {
  const __m128 vscale = _mm_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g) {
    const at::BFloat16* qg = qb + g * head_size;
    float* out = scores + g * stride;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      const at::BFloat16* kr = k + r * head_size;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i < head_size; i += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + i);
        a0 = _mm512_dpbf16_ps(a0, qv, (__m512bh)_mm512_loadu_si512(kr + i));
        a1 = _mm512_dpbf16_ps(a1, qv, (__m512bh)_mm512_loadu_si512(kr + head_size + i));
        a2 = _mm512_dpbf16_ps(a2, qv, (__m512bh)_mm512_loadu_si512(kr + 2 * head_size + i));
        a3 = _mm512_dpbf16_ps(a3, qv, (__m512bh)_mm512_loadu_si512(kr + 3 * head_size + i));
      }
      _mm_storeu_ps(out + r, _mm_mul_ps(reduce4(a0, a1, a2, a3), vscale));
    }
    for (; r < rows; ++r) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t i = 0; i < head_size; i += 32)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qg + i), (__m512bh)_mm512_loadu_si512(k + r * head_size + i));
      out[r] = _mm512_reduce_add_ps(a) * scale;
    }
  }
}
#endif

// Calls fn(std::integral_constant<int, n>) for 1 <= n <= kMaxGroup.
template <typename Fn>
inline void with_group(int64_t n, Fn&& fn) {
  switch (n) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{}); break;
  }
}

// How far ahead of its reads a thread asks for cache blocks, and how much it asks for at a time (bytes). On Zen 4
// (python benchmarks/attention_kernel.py --blocks engine) 16 or 64 KiB ahead measured the same as 32 and 2 KiB
// steps the same as 1 KiB; a whole 4 KiB block per step was about 20% slower, no L1 prefetch of the next block
// about 4% (docs/benchmarks-history.md, "2026-12-06 Zen 4 (2556c4c)").
constexpr int64_t kAheadBytes = 32 * 1024;
constexpr int64_t kStepBytes = 1024;

// Asks for the cache lines of bytes [lo, hi) of p into L1 (kLocality 3) or L2 (kLocality 2).
template <int kLocality>
inline void prefetch_lines(const void* p, int64_t lo, int64_t hi) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = lo & ~int64_t{63}; off < hi; off += 64) __builtin_prefetch(c + off, 0, kLocality);
  // GCC 12 counts __builtin_prefetch as free of side effects, marks a function that only prefetches as const
  // and deletes its calls when it is not inlined early (ReadAhead::prefetch's were: no prefetch instruction was
  // left in its loops). An empty volatile asm is a side effect it keeps.
  asm volatile("" : : "r"(c));
}

// Prefetches along one thread's reading order of cache blocks (`order`: the start of each block, in the order the
// thread reads them). While block c is read, block c + distance (kAheadBytes ahead) is asked for into L2 and block
// c + 1 into L1, a step at a time: prefetch(lo, hi) before the rows whose bytes are [lo, hi) of block c are read,
// then advance() when block c is done. Asking for a block's lines in steps keeps a steady number of misses in
// flight while the core computes.
template <typename TC>
class ReadAhead {
 public:
  ReadAhead(const std::vector<const TC*>& order, int64_t block_bytes)
      : order_(order), block_bytes_(block_bytes),
        distance_(std::max<int64_t>(1, kAheadBytes / std::max<int64_t>(block_bytes, 1))) {
    for (int64_t c = 0; c < std::min<int64_t>(distance_, size()); ++c) prefetch_lines<2>(order_[c], 0, block_bytes_);
  }

  // Bytes [lo, hi) of the blocks ahead; the step that reads the current block's last rows passes hi = -1 (to the
  // end of the block: a block whose rows are read only in part still has all of its successors' lines asked for).
  void prefetch(int64_t lo, int64_t hi) const {
    if (hi < 0) hi = block_bytes_;
    if (cur_ + distance_ < size()) prefetch_lines<2>(order_[cur_ + distance_], lo, hi);
    if (cur_ + 1 < size()) prefetch_lines<3>(order_[cur_ + 1], lo, hi);
  }

  void advance() { ++cur_; }

 private:
  int64_t size() const { return static_cast<int64_t>(order_.size()); }

  const std::vector<const TC*>& order_;
  const int64_t block_bytes_, distance_;
  int64_t cur_ = 0;
};

// TQ: query and output dtype; TC: cache dtype (TQ, or bfloat16 / float16 / int8 / fp8 under float32 queries).
// A cache row is kv_cache.size(4) elements: D, or for int8 the D codes padded to 4 bytes and the row's float32
// scale, which multiplies the row's score (keys) and probability (values).
template <typename TQ, typename TC>
void decode_kernel(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                   const at::Tensor& seq_lens, double scale, int64_t sliding_window, double soft_cap,
                   at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_size = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads, table_width = block_table.size(1);
  const int64_t vec_end = head_size - head_size % W;
  const TQ* q_ptr = q.const_data_ptr<TQ>();
  const int64_t row = kv_cache.size(4);  // elements per cache row
  const TC* k_base = kv_cache.const_data_ptr<TC>();
  const TC* v_base = k_base + num_kv_heads * num_blocks * block_size * row;
  const int32_t* bt = block_table.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  TQ* out_ptr = out.data_ptr<TQ>();
  const int64_t q_stride = q.stride(0), head_stride = q.stride(1);
  const int64_t head_cache = num_blocks * block_size * row;  // elements per KV head
  const int64_t block_elems = block_size * row;
  const float fscale = static_cast<float>(scale);
  const float cap = static_cast<float>(soft_cap);
  // First position request s attends to (positions before it, and their blocks, are never read).
  auto first_pos = [&](int64_t len) -> int64_t {
    return sliding_window > 0 ? std::max<int64_t>(len - sliding_window, 0) : 0;
  };
  // Fail before the parallel region: an out-of-range block id would read outside the cache.
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] <= table_width * block_size, "seq_lens[", s, "] = ", lens[s], " needs more blocks than the ",
                table_width, " of its block table row");
    const int64_t len = std::max<int32_t>(lens[s], 0);
    const int64_t used = (len + block_size - 1) / block_size;
    for (int64_t j = first_pos(len) / block_size; j < used; ++j) {
      const int32_t blk = bt[s * table_width + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block table entry ", blk, " of request ", s, " is out of range");
    }
  }

  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(TC));
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(TC));
  // Rows read between two rounds of prefetches: kStepBytes of them, rounded up to a multiple of 4 (the key loop
  // scores four rows per horizontal reduction, so steps of 4k rows keep its groups, and its sums, those of one
  // pass over the block; 1 KiB is 4 rows of float32 at D = 64, 8 of bfloat16).
  const int64_t step_rows = (std::max<int64_t>(1, kStepBytes / row_bytes) + 3) / 4 * 4;

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_size), acc(group * head_size), scores;
    std::vector<float> scaled(kScaledRows<TC> ? group * step_rows : 0);  // a step's probabilities times row scales
#ifdef TOKENMILL_BF16_DOT
    constexpr bool kBf16 = std::is_same_v<TQ, at::BFloat16> && std::is_same_v<TC, at::BFloat16>;
    const bool bf16_dot = kBf16 && head_size % 32 == 0;
    std::vector<at::BFloat16> qb(bf16_dot ? group * head_size : 0);
#endif
    // Every block this thread reads, in the order it reads them: per work item the key blocks of the attended
    // range, then the same range's value blocks.
    auto block_range = [&](int64_t item) {  // blocks [first, stop) hold the positions the item's request attends to
      const int64_t len = std::max<int32_t>(lens[item / num_kv_heads], 0);
      return std::make_pair(first_pos(len) / block_size, (len + block_size - 1) / block_size);
    };
    int64_t total = 0;
    for (int64_t item = begin; item < end; ++item) {
      const auto [first, stop] = block_range(item);
      total += 2 * (stop - first);
    }
    std::vector<const TC*> order;
    order.reserve(total);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
      const auto [first, stop] = block_range(item);
      for (const TC* base : {k_base, v_base})
        for (int64_t j = first; j < stop; ++j)
          order.push_back(base + h * head_cache + bt[s * table_width + j] * block_elems);
    }
    ReadAhead<TC> ahead(order, block_bytes);

    // Scores of rows key rows from k (ldk = D) against this item's query heads.
    auto score_rows = [&](const TC* k, int64_t rows, float* out_scores, int64_t n) {
#ifdef TOKENMILL_BF16_DOT
      if constexpr (kBf16) {
        if (bf16_dot) return qk_rows_bf16(qb.data(), group, k, rows, head_size, fscale, out_scores, n);
      }
#endif
#ifdef TOKENMILL_REDUCE4
      if (vec_end == head_size) return qk_rows4(qf.data(), group, k, row, rows, head_size, out_scores, n);
#endif
      for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
        with_group(std::min(kMaxGroup, group - g0), [&](auto ng) {
          qk_rows<decltype(ng)::value>(qf.data() + g0 * head_size, k, row, rows, head_size, vec_end,
                                        out_scores + g0 * n, n);
        });
      }
    };
    // score_rows, then each int8 row's score times the row's scale.
    auto score_scaled_rows = [&](const TC* k, int64_t rows, float* out_scores, int64_t n) {
      score_rows(k, rows, out_scores, n);
      if constexpr (kScaledRows<TC>) {
        for (int64_t r = 0; r < rows; ++r) {
          const float sc = row_scale(k + r * row, row);
          for (int64_t g = 0; g < group; ++g) out_scores[g * n + r] *= sc;
        }
      }
    };
    // acc += probs-weighted sum of rows value rows from v.
    auto sum_rows = [&](const TC* v, int64_t rows, const float* probs, int64_t n) {
      for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
        with_group(std::min(kMaxGroup, group - g0), [&](auto ng) {
          pv_rows<decltype(ng)::value>(probs + g0 * n, n, v, row, rows, head_size, vec_end,
                                        acc.data() + g0 * head_size);
        });
      }
    };
    // sum_rows with each int8 row's probability times the row's scale.
    auto sum_scaled_rows = [&](const TC* v, int64_t rows, const float* probs, int64_t n) {
      if constexpr (kScaledRows<TC>) {
        for (int64_t r = 0; r < rows; ++r) {
          const float sc = row_scale(v + r * row, row);
          for (int64_t g = 0; g < group; ++g) scaled[g * rows + r] = probs[g * n + r] * sc;
        }
        sum_rows(v, rows, scaled.data(), rows);
      } else {
        sum_rows(v, rows, probs, n);
      }
    };

    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = std::max<int32_t>(lens[s], 0);
      const int64_t begin = first_pos(len);
      const int64_t n = len - begin;  // positions attended to: begin .. len - 1
      std::fill(acc.begin(), acc.end(), 0.f);
      if (n > 0) {
        for (int64_t g = 0; g < group; ++g) {
          const TQ* src = q_ptr + s * q_stride + (h * group + g) * head_stride;
          for (int64_t i = 0; i < head_size; ++i) qf[g * head_size + i] = static_cast<float>(src[i]) * fscale;
#ifdef TOKENMILL_BF16_DOT
          if constexpr (kBf16) {
            if (bf16_dot) std::copy(src, src + head_size, qb.data() + g * head_size);
          }
#endif
        }
        scores.resize(group * n);
        const int32_t* blocks = bt + s * table_width;
        // Block j holds positions [j * block_size, (j + 1) * block_size); the first one read may start inside.
        const int64_t j0 = begin / block_size;
        // Calls fn(n, r0) on a block's rows [r0, r0 + n), step_rows at a time, prefetching the same bytes of the
        // blocks ahead before each step.
        auto in_steps = [&](int64_t rows, auto&& fn) {
          for (int64_t r0 = 0; r0 < rows; r0 += step_rows) {
            const int64_t r1 = std::min(rows, r0 + step_rows);
            ahead.prefetch(r0 * row_bytes, r1 == rows ? -1 : r1 * row_bytes);
            fn(r1 - r0, r0);
          }
          ahead.advance();
        };
        // Scores: one pass over the keys, each row used by the G query heads of this KV head.
        for (int64_t j = j0, t0 = j0 * block_size; t0 < len; t0 += block_size, ++j) {
          const int64_t skip = std::max<int64_t>(begin - t0, 0);  // rows of this block before the window
          const TC* k_blk = k_base + h * head_cache + blocks[j] * block_elems + skip * row;
          float* out_scores = scores.data() + (t0 + skip - begin);
          in_steps(std::min(block_size, len - t0) - skip, [&](int64_t rows, int64_t r0) {
            score_scaled_rows(k_blk + r0 * row, rows, out_scores + r0, n);
          });
        }
        if (cap > 0.f) {
          for (int64_t i = 0; i < group * n; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
        }
        for (int64_t g = 0; g < group; ++g) softmax_inplace(scores.data() + g * n, n);
        // Weighted sum of the values, again one pass over the rows.
        for (int64_t j = j0, t0 = j0 * block_size; t0 < len; t0 += block_size, ++j) {
          const int64_t skip = std::max<int64_t>(begin - t0, 0);
          const TC* v_blk = v_base + h * head_cache + blocks[j] * block_elems + skip * row;
          const float* probs = scores.data() + (t0 + skip - begin);
          in_steps(std::min(block_size, len - t0) - skip, [&](int64_t rows, int64_t r0) {
            sum_scaled_rows(v_blk + r0 * row, rows, probs + r0, n);
          });
        }
      }
      TQ* dst = out_ptr + s * num_heads * head_size + h * group * head_size;
      for (int64_t i = 0; i < group * head_size; ++i) dst[i] = static_cast<TQ>(acc[i]);
    }
  });
}

// Causal attention of a prompt chunk: the Lq query rows are the last Lq positions of an S-row context (S = Lq
// for a fresh prompt), so query row t sits at position p = S - Lq + t and attends to positions
// max(0, p - W + 1) .. p (all of 0 .. p without a window). A bidirectional chunk (an encoder's sequence, causal
// false, no window) has every query row attend to all S rows.
//
// Where a KV head's key and value rows lie apart (a fresh prompt's views of the fused projection), one work item is
// a tile of query rows for one KV head: the tile's rows x G query heads (about kTileVectors query vectors) pass
// over the context's keys and values in blocks of kKeyBlock rows, with a running softmax (a running
// maximum and sum per query vector, the partial sums rescaled when the maximum grows; Milakov and Gimelshein,
// "Online normalizer calculation for softmax", 2018, as FlashAttention uses it). Each key and value block is read
// from memory once per tile and then used from L1 by every query vector of the tile, where one query row at a time
// (the whole softmax at once) reads all of its context again from L2 or L3 for every row.
//
// Key blocks lie on a fixed grid (multiples of kKeyBlock from row 0), and within a block the scoring loop's groups
// of four keys are aligned to multiples of four, so a query row's result depends only on its own context: the same
// bits whichever tile, chunk or batch it is computed in. Keys outside a row's causal range or window within a
// block are given probability 0 (their value rows add exactly zero). Contiguous rows go one query row at a time
// (prefill_row; see prefill_chunks for why).
template <typename T>
struct PrefillChunk {
  const T* q;  // [Lq, Hq, D], strides qs0 / qs1
  const T* k;  // [S, Hkv, D], strides ks0 / ks1
  const T* v;  // likewise
  T* out;      // [Lq, Hq * D] rows ldo elements apart
  int64_t len, offset, qs0, qs1, ks0, ks1, vs0, vs1, ldo;
  bool causal = true;  // false: every query row sees the whole context (encoder-only attention)
};

constexpr int64_t kTileVectors = 24;  // query vectors (rows x G) per tile
constexpr int64_t kKeyBlock = 64;     // key rows per pass of a tile; must be a multiple of 4

// First context row query row t of chunk c attends to (positions before it are outside the window).
template <typename T>
inline int64_t first_row(const PrefillChunk<T>& c, int64_t t, int64_t sliding_window) {
  return sliding_window > 0 ? std::max<int64_t>(c.offset + t - sliding_window + 1, 0) : 0;
}

// One past the last context row query row t of chunk c attends to: its own position (causal) or the context's end.
template <typename T>
inline int64_t end_row(const PrefillChunk<T>& c, int64_t t) {
  return c.causal ? c.offset + t + 1 : c.offset + c.len;
}

// Per-thread buffers of prefill_tile and prefill_row: qf and acc [vectors, D], scores [vectors, score_cols] (a
// key block of a tile, or a row's whole context), and the running maximum and sum of each query vector (tiles).
struct PrefillBuffers {
  std::vector<float> qf, acc, scores, mx, sum;
  PrefillBuffers(int64_t vectors, int64_t head_size, int64_t score_cols)
      : qf(vectors * head_size), acc(vectors * head_size), scores(vectors * score_cols), mx(vectors), sum(vectors) {}
};

// Scores of `rows` key rows against n query vectors (qf: [n, D], pre-scaled) into scores[i * kKeyBlock + r].
template <typename T>
inline void tile_scores(const float* qf, int64_t n, const T* k, int64_t ldk, int64_t rows, int64_t head_size,
                        int64_t vec_end, float* scores) {
#ifdef TOKENMILL_REDUCE4
  if (vec_end == head_size) return qk_rows4(qf, n, k, ldk, rows, head_size, scores, kKeyBlock);
#endif
  for (int64_t i0 = 0; i0 < n; i0 += kMaxGroup) {
    with_group(std::min(kMaxGroup, n - i0), [&](auto ng) {
      qk_rows<decltype(ng)::value>(qf + i0 * head_size, k, ldk, rows, head_size, vec_end, scores + i0 * kKeyBlock,
                                   kKeyBlock);
    });
  }
}

// Turns the scores s[0..n) of one query vector into probabilities for keys [lo, hi) of the block (0 elsewhere)
// against the running maximum *mx and sum *sum, both updated; returns the factor by which the vector's partial
// output must be scaled (1 when the maximum did not grow). A vector with no key in the block keeps its state.
inline float online_softmax(float* s, int64_t n, int64_t lo, int64_t hi, float* mx, float* sum) {
  if (lo >= hi) {
    std::fill(s, s + n, 0.f);
    return 1.f;
  }
  const float m_new = std::max(*mx, max_of(s + lo, hi - lo));
  const float alpha = std::exp(*mx - m_new);  // *mx = -inf before the first block: 0 (sum and output are 0)
  const float block_sum = exp_sub_sum(s + lo, hi - lo, m_new);
  std::fill(s, s + lo, 0.f);
  std::fill(s + hi, s + n, 0.f);
  *sum = *sum * alpha + block_sum;
  *mx = m_new;
  return alpha;
}

// out[i, :] += sum_r probs[i * kKeyBlock + r] * v[r, :] for n query vectors (out: [n, D]), kPvGroup vectors per
// pass over the block's value rows.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kPvGroup = 6;  // 6 vectors x 4 chunks of 16 = 24 accumulators: D = 64 in one pass
#else
constexpr int kPvGroup = 3;
#endif
template <typename T>
inline void tile_values(const float* probs, int64_t n, const T* v, int64_t ldv, int64_t rows, int64_t head_size,
                        int64_t vec_end, float* out) {
  for (int64_t i0 = 0; i0 < n; i0 += kPvGroup) {
    with_group(std::min<int64_t>(kPvGroup, n - i0), [&](auto ng) {
      pv_rows<decltype(ng)::value>(probs + i0 * kKeyBlock, kKeyBlock, v, ldv, rows, head_size, vec_end,
                                   out + i0 * head_size);
    });
  }
}

// Query rows [t0, t1) of chunk c against KV head h (see the comment above PrefillChunk).
template <typename T>
inline void prefill_tile(const PrefillChunk<T>& c, int64_t t0, int64_t t1, int64_t h, int64_t group,
                         int64_t head_size, int64_t vec_end, float fscale, int64_t sliding_window, PrefillBuffers& b) {
  const int64_t n = (t1 - t0) * group;  // query vectors: i = (t - t0) * group + g
  float* qf = b.qf.data();
  float* acc = b.acc.data();
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = c.q + t * c.qs0 + (h * group + g) * c.qs1;
      float* dst = qf + ((t - t0) * group + g) * head_size;
      for (int64_t i = 0; i < head_size; ++i) dst[i] = static_cast<float>(src[i]) * fscale;
    }
  std::fill(acc, acc + n * head_size, 0.f);
  std::fill(b.mx.begin(), b.mx.begin() + n, -std::numeric_limits<float>::infinity());
  std::fill(b.sum.begin(), b.sum.begin() + n, 0.f);
  const int64_t context = c.offset + c.len;                    // S: the rows k and v have
  const int64_t hi = end_row(c, t1 - 1);                       // one past the last row's last key
  const int64_t lo = first_row(c, t0, sliding_window);         // the first row's window start (the smallest)
  const int64_t hi4 = std::min(context, (hi + 3) / 4 * 4);     // read on the grid of four (see above)
  for (int64_t kb = lo / kKeyBlock * kKeyBlock; kb < hi; kb += kKeyBlock) {
    const int64_t rows = std::min(kb + kKeyBlock, hi4) - kb;
    const T* kblk = c.k + kb * c.ks0 + h * c.ks1;
    const T* vblk = c.v + kb * c.vs0 + h * c.vs1;
    // The next block's rows into L2 while this one is computed: rows of one head lie a whole projection row apart
    // (several KiB), a stride the hardware prefetchers do not follow across pages.
    const int64_t next_rows = std::min(kb + 2 * kKeyBlock, hi4) - (kb + kKeyBlock);
    for (int64_t r = 0; r < next_rows; ++r) {
      prefetch_lines<2>(kblk + (kKeyBlock + r) * c.ks0, 0, head_size * static_cast<int64_t>(sizeof(T)));
      prefetch_lines<2>(vblk + (kKeyBlock + r) * c.vs0, 0, head_size * static_cast<int64_t>(sizeof(T)));
    }
    tile_scores(qf, n, kblk, c.ks0, rows, head_size, vec_end, b.scores.data());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t jlo = std::max<int64_t>(first_row(c, t, sliding_window) - kb, 0);
      const int64_t jhi = std::min(end_row(c, t) - kb, rows);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = (t - t0) * group + g;
        const float alpha = online_softmax(b.scores.data() + i * kKeyBlock, rows, jlo, jhi, &b.mx[i], &b.sum[i]);
        if (alpha != 1.f) {
          float* a = acc + i * head_size;
          for (int64_t d = 0; d < head_size; ++d) a[d] *= alpha;
        }
      }
    }
    tile_values(b.scores.data(), n, vblk, c.vs0, rows, head_size, vec_end, acc);
  }
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t i = (t - t0) * group + g;
      const float inv = 1.f / b.sum[i];
      T* dst = c.out + t * c.ldo + (h * group + g) * head_size;
      for (int64_t d = 0; d < head_size; ++d) dst[d] = static_cast<T>(acc[i * head_size + d] * inv);
    }
}

// Query row t of chunk c against KV head h, the whole softmax at once, with per-thread buffers qf / acc ([G, D])
// and scores ([G, S]): the way for contiguous key and value rows (see prefill_chunks).
template <typename T>
inline void prefill_row(const PrefillChunk<T>& c, int64_t t, int64_t h, int64_t group, int64_t head_size,
                        int64_t vec_end, float fscale, int64_t sliding_window, float* qf, float* acc, float* scores) {
  const int64_t first = first_row(c, t, sliding_window);
  const int64_t n = end_row(c, t) - first;
  for (int64_t g = 0; g < group; ++g) {
    const T* src = c.q + t * c.qs0 + (h * group + g) * c.qs1;
    for (int64_t i = 0; i < head_size; ++i) qf[g * head_size + i] = static_cast<float>(src[i]) * fscale;
  }
  const T* kh = c.k + first * c.ks0 + h * c.ks1;
  const T* vh = c.v + first * c.vs0 + h * c.vs1;
#ifdef TOKENMILL_REDUCE4
  if (vec_end == head_size) {
    qk_rows4(qf, group, kh, c.ks0, n, head_size, scores, n);
  } else
#endif
  {
    for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
      with_group(std::min(kMaxGroup, group - g0), [&](auto ng) {
        qk_rows<decltype(ng)::value>(qf + g0 * head_size, kh, c.ks0, n, head_size, vec_end, scores + g0 * n, n);
      });
    }
  }
  for (int64_t g = 0; g < group; ++g) softmax_inplace(scores + g * n, n);
  std::fill(acc, acc + group * head_size, 0.f);
  for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
    with_group(std::min(kMaxGroup, group - g0), [&](auto ng) {
      pv_rows<decltype(ng)::value>(scores + g0 * n, n, vh, c.vs0, n, head_size, vec_end, acc + g0 * head_size);
    });
  }
  T* dst = c.out + t * c.ldo + h * group * head_size;
  for (int64_t i = 0; i < group * head_size; ++i) dst[i] = static_cast<T>(acc[i]);
}

// The chunks' work in one parallel region: chunk c owns items [item_start[c], item_start[c + 1]), item = tile *
// Hkv + KV head, and each thread takes a contiguous run of items of about equal cost (key rows read times query
// vectors, plus a fixed per-item part), so a long prompt next to short ones is split between threads like the rest.
// Tiles (prefill_tile) when a head's key or value rows lie apart (views of the fused QKV projection: a fresh
// prompt's), single rows (prefill_row) when they are contiguous (a context gathered from the cache, head-major):
// the hardware prefetchers stream contiguous rows, and re-reading them per query row measured faster than tiles
// there (97-102 against 106-120 ms per layer), while on strided rows tiles took a fresh 2,048-token prompt from
// 45-49 to 33-38 ms per layer (python benchmarks/prefill_attention.py; docs/benchmarks.md, "Prefill attention
// kernel").
template <typename T>
void prefill_chunks(const std::vector<PrefillChunk<T>>& chunks, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_size, double scale, int64_t sliding_window) {
  const int64_t group = num_heads / num_kv_heads, vec_end = head_size - head_size % W;
  const bool contiguous = chunks.empty() || (chunks[0].ks0 == head_size && chunks[0].vs0 == head_size);
  const int64_t tile_rows = contiguous ? 1 : std::max<int64_t>(1, kTileVectors / group);
  const int64_t item_cost = 16 * tile_rows * group;  // query copy, output and set-up, in key rows x vectors
  const float fscale = static_cast<float>(scale);
  std::vector<int64_t> item_start(chunks.size() + 1, 0);
  for (size_t c = 0; c < chunks.size(); ++c)
    item_start[c + 1] = item_start[c] + (chunks[c].len + tile_rows - 1) / tile_rows * num_kv_heads;
  const int64_t num_items = item_start.back();
  if (num_items == 0) return;
  std::vector<int64_t> cost(num_items + 1, 0);  // cost[i]: total cost of items before i
  for (size_t c = 0; c < chunks.size(); ++c) {
    for (int64_t i = 0; i < item_start[c + 1] - item_start[c]; ++i) {
      const int64_t t0 = i / num_kv_heads * tile_rows, t1 = std::min(t0 + tile_rows, chunks[c].len);
      const int64_t keys = end_row(chunks[c], t1 - 1) - first_row(chunks[c], t0, sliding_window);
      cost[item_start[c] + i + 1] = cost[item_start[c] + i] + keys * (t1 - t0) * group + item_cost;
    }
  }
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), num_items);
  int64_t max_ctx = 0;
  for (const auto& c : chunks) max_ctx = std::max(max_ctx, c.offset + c.len);
  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    PrefillBuffers b(tile_rows * group, head_size, contiguous ? max_ctx : kKeyBlock);
    // Part p covers the items whose cost prefix lies in [total * p / parts, total * (p + 1) / parts).
    auto bound = [&](int64_t p) -> int64_t {
      return std::lower_bound(cost.begin(), cost.end() - 1, cost.back() * p / parts) - cost.begin();
    };
    const int64_t begin = part_begin == 0 ? 0 : bound(part_begin);
    const int64_t end = part_end == parts ? num_items : bound(part_end);
    if (begin >= end) return;
    size_t c = std::upper_bound(item_start.begin(), item_start.end(), begin) - item_start.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= item_start[c + 1]) ++c;
      const int64_t local = item - item_start[c];
      const int64_t t0 = local / num_kv_heads * tile_rows, t1 = std::min(t0 + tile_rows, chunks[c].len);
      if (contiguous) {
        prefill_row(chunks[c], t0, local % num_kv_heads, group, head_size, vec_end, fscale, sliding_window,
                    b.qf.data(), b.acc.data(), b.scores.data());
      } else {
        prefill_tile(chunks[c], t0, t1, local % num_kv_heads, group, head_size, vec_end, fscale, sliding_window, b);
      }
    }
  });
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                             int64_t sliding_window) {
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: no window)");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k and v must be [L, H, D] tensors");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k and v need contiguous rows");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) >= q.size(0) && k.size(2) == q.size(2),
              "k and v must be [S, Hkv, D] with S >= q's L and q's D, got ", k.sizes(), " and ", v.sizes(), " for q ",
              q.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0 && q.size(2) > 0,
              "q's heads must be a positive multiple of k's, with a head size above 0");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k and v must have one dtype");
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    const std::vector<PrefillChunk<scalar_t>> chunks{{q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(),
                                                      v.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                                      q.size(0), k.size(0) - q.size(0), q.stride(0), q.stride(1),
                                                      k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                                      out.stride(0)}};
    prefill_chunks(chunks, q.size(1), k.size(1), q.size(2), scale, sliding_window);
  });
  return out;
}

// Several fresh prompts of one step at once: prompt i is rows starts[i] .. ends[i] - 1 of q, k and v (its own
// keys and values are its whole context); out's rows of those ranges are written, others are left alone. With
// causal false (an encoder step's sequences) each row attends to its whole prompt.
void prefill_attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ranges,
                              double scale, int64_t sliding_window, at::Tensor& out, bool causal) {
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: no window)");
  TORCH_CHECK(causal || sliding_window == 0, "a sliding window needs causal attention");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k and v must be [T, H, D] tensors");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k and v need contiguous rows");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "k and v must be [T, Hkv, D] with q's T and D, got ", k.sizes(), " and ", v.sizes(), " for q ",
              q.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0 && q.size(2) > 0,
              "q's heads must be a positive multiple of k's, with a head size above 0");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type()
                  && out.scalar_type() == q.scalar_type(), "q, k, v and out must have one dtype");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == q.size(0) && out.size(1) == q.size(1) * q.size(2) && out.stride(1) == 1,
              "out must be [T, Hq * D] with contiguous rows, got ", out.sizes());
  TORCH_CHECK(ranges.scalar_type() == at::kInt && ranges.dim() == 2 && ranges.size(1) == 2 && ranges.is_contiguous(),
              "ranges must be a contiguous [N, 2] int32 tensor of (start, end) rows");
  TORCH_CHECK(out.size(0) <= 1 || out.stride(0) >= out.size(1), "out's rows must not overlap");
  const int32_t* r = ranges.const_data_ptr<int32_t>();
  for (int64_t i = 0; i < ranges.size(0); ++i) {
    TORCH_CHECK(0 <= r[2 * i] && r[2 * i] < r[2 * i + 1] && r[2 * i + 1] <= q.size(0), "ranges[", i, "] = (",
                r[2 * i], ", ", r[2 * i + 1], ") is not a non-empty range of q's ", q.size(0), " rows");
    TORCH_CHECK(i == 0 || r[2 * i] >= r[2 * i - 1], "ranges must be in order and disjoint; ranges[", i,
                "] starts before ranges[", i - 1, "] ends");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention_varlen", [&] {
    const scalar_t* qp = q.const_data_ptr<scalar_t>();
    const scalar_t* kp = k.const_data_ptr<scalar_t>();
    const scalar_t* vp = v.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    std::vector<PrefillChunk<scalar_t>> chunks;
    chunks.reserve(ranges.size(0));
    for (int64_t i = 0; i < ranges.size(0); ++i) {
      const int64_t s0 = r[2 * i], len = r[2 * i + 1] - s0;
      chunks.push_back({qp + s0 * q.stride(0), kp + s0 * k.stride(0), vp + s0 * v.stride(0), op + s0 * out.stride(0),
                        len, 0, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                        out.stride(0), causal});
    }
    prefill_chunks(chunks, q.size(1), k.size(1), q.size(2), scale, sliding_window);
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                        const at::Tensor& seq_lens, double scale, int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: no window)");
  TORCH_CHECK(soft_cap >= 0, "soft_cap must be >= 0 (0: no soft cap)");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, Hq, D] with contiguous rows");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, Hkv, num_blocks, block_size, D] tensor");
  const at::ScalarType cache_type = kv_cache.scalar_type();
  const bool widened = q.scalar_type() == at::kFloat && (cache_type == at::kBFloat16 || cache_type == at::kHalf);
  const bool quantized = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2;
  TORCH_CHECK(cache_type == q.scalar_type() || widened || (quantized && q.scalar_type() == at::kFloat),
              "kv_cache must have q's dtype, or be bfloat16 / float16 / int8 / float8_e4m3fn / float8_e5m2 under "
              "float32 q");
  TORCH_CHECK(kv_cache.size(1) > 0 && kv_cache.size(3) > 0 && q.size(2) > 0,
              "kv_cache needs at least one KV head, a block size and a head size above 0");
  // int8 rows: the codes padded to a multiple of 4 bytes, then the float32 scale (kv_cache_quant.kv_cache_row_size).
  const int64_t row = cache_type == at::kChar ? (q.size(2) + 3) / 4 * 4 + 4 : q.size(2);
  TORCH_CHECK(kv_cache.size(4) == row && q.size(1) % kv_cache.size(1) == 0,
              "q's heads must be a multiple of kv_cache's KV heads, with rows of ", row, " elements for head size ",
              q.size(2), ", got ", kv_cache.sizes());
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.is_contiguous()
                  && block_table.size(0) == q.size(0), "block_table must be a contiguous [B, nb] int32 tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.numel() == q.size(0) && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous [B] int32 tensor");
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (cache_type == at::kChar) {
    decode_kernel<float, int8_t>(q, kv_cache, block_table, seq_lens, scale, sliding_window, soft_cap, out);
  } else if (cache_type == at::kFloat8_e4m3fn) {
    decode_kernel<float, c10::Float8_e4m3fn>(q, kv_cache, block_table, seq_lens, scale, sliding_window, soft_cap, out);
  } else if (cache_type == at::kFloat8_e5m2) {
    decode_kernel<float, c10::Float8_e5m2>(q, kv_cache, block_table, seq_lens, scale, sliding_window, soft_cap, out);
  } else if (widened) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(kv_cache.scalar_type(), "paged_decode", [&] {
      decode_kernel<float, scalar_t>(q, kv_cache, block_table, seq_lens, scale, sliding_window, soft_cap, out);
    });
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
      decode_kernel<scalar_t, scalar_t>(q, kv_cache, block_table, seq_lens, scale, sliding_window, soft_cap, out);
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenmill_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, float scale, "
        "int sliding_window=0, float soft_cap=0.0) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int sliding_window=0) -> Tensor");
  m.def("prefill_attention_varlen(Tensor q, Tensor k, Tensor v, Tensor ranges, float scale, int sliding_window, "
        "Tensor(a!) out, bool causal=True) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("prefill_attention_varlen", &prefill_attention_varlen);
}
