// Float32 linear layers: y[M, N] = x[M, K] @ W^T, W prepacked in panels.
//
// Why not torch's op: F.linear (MKL sgemm) re-lays out the whole weight on every call, and MKL's and oneDNN's
// packed GEMMs, which do not, take more time than these loops at every row count measured (python
// benchmarks/packed_linear.py; docs/benchmarks.md, "Dense matmuls"). A decode step's weights stream from memory once
// per step; at a few dozen rows the multiply-adds per weight byte are just above what the cores can do per byte
// of memory bandwidth, so the product is only fast when the next weights are already in flight while the
// current ones are multiplied. These loops prefetch the next panel while they multiply the current one.
// At prefill row counts the loops stay ahead as well (Zen 3, one SmolLM2-135M step's matmuls at 2,048 rows: 4,960
// ms against oneDNN's 5,382; same section).
//
// Layout (tokenmill_cpu/dense_linear.py packs it): panels of kPanel output rows, panel p = W[p * kPanel :
// (p + 1) * kPanel, :] transposed to [K][kPanel], zero rows past N; packed [P, K, kPanel] with P = ceil(N / kPanel).
// A micro-kernel keeps kRows x kPanel sums in registers: per input channel k it loads the panel's kPanel weights
// once and multiplies them by the kRows broadcast activations x[m, k]. Threads take contiguous ranges of panels;
// the rows are taken in blocks of about kBlockBytes of activations, each block by all of a thread's panels.
//   AVX-512: kPanel 48 (three 16-lane vectors), kRows 8  (24 accumulators of 32 registers)
//   AVX2:    kPanel 16 (two 8-lane vectors),    kRows 6  (12 accumulators of 16 registers)
//   other:   kPanel 16, plain C++ loops (same sums, in the same order per output).
// Every output is one ordered sum over k, so the result does not depend on the row count or thread count.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
#define TOKENMILL_GEMM_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define TOKENMILL_GEMM_AVX2 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <strings.h>
#include <type_traits>

namespace {

#if defined(TOKENMILL_GEMM_AVX512)
constexpr int64_t kPanel = 48;
constexpr int kRows = 8;
#elif defined(TOKENMILL_GEMM_AVX2)
constexpr int64_t kPanel = 16;
constexpr int kRows = 6;
#else
constexpr int64_t kPanel = 16;
constexpr int kRows = 4;
#endif

// Where the next panel is prefetched to: L2 (PREFETCHT1) on Intel CPUs, L1 (PREFETCHT0) elsewhere;
// TOKENMILL_CPU_GEMM_PREFETCH=l1|l2 overrides (read once per process). On a Xeon with AMX, L2 took 5-25% less time
// at 1-16 rows and the same at 32 and 256 (docs/benchmarks-history.md, "2026-12-03 Xeon (910cad0)"): a software
// prefetch into L1 holds one of the core's few L1 miss buffers until its line arrives, and a panel is too large
// for L1 anyway. AMD CPUs keep the L1 prefetch, which was tuned on Zen 4 ("2026-12-02 Zen 4 (46f8ad6)", same file).
bool prefetch_to_l2() {
  static const bool to_l2 = [] {
    const char* env = std::getenv("TOKENMILL_CPU_GEMM_PREFETCH");
    if (env != nullptr && strcasecmp(env, "l1") == 0) return false;
    if (env != nullptr && strcasecmp(env, "l2") == 0) return true;
#if defined(__x86_64__) || defined(__i386__)
    return __builtin_cpu_is("intel") != 0;
#else
    return false;
#endif
  }();
  return to_l2;
}

// Prefetches one panel's worth of cache lines, spread over the k blocks of the current panel (kLocality: 3 into
// L1, 2 into L2).
template <int kLocality>
struct Prefetcher {
  const char* next = nullptr;  // the next panel of this thread, or nullptr
  const char* end = nullptr;
  int64_t stride = 0;  // bytes per block of kKBlock k iterations (a multiple of 64)
  int64_t lines_per_k = 0;  // > 0: issue this many lines after each k instead of a block's lines at once
  inline void step() {
#if defined(TOKENMILL_GEMM_AVX512) || defined(TOKENMILL_GEMM_AVX2)
    if (next < end) {
      const char* stop = std::min(next + stride, end);
      for (const char* c = next; c < stop; c += 64) __builtin_prefetch(c, 0, kLocality);
      next = stop;
    }
#endif
  }
};

// Input channels between two prefetch steps: checking the prefetcher at every k cost about a fifth of the
// micro-kernel's rate on Zen 3 (its branch and loads sit in the multiply-add loop; docs/benchmarks-history.md,
// "2026-12-02 Zen 3 (e02e8db)").
constexpr int64_t kKBlock = 8;

// Activation bytes per row block: a large product (a prefill step's thousands of rows) takes its rows in blocks of
// about this size, so that each block stays in L2 while every panel of the thread passes over it. Unblocked, all
// rows were read again for each panel, from L3 or memory once they outgrew L2 (on Zen 3 the panel kernel was the
// slowest path at 512 and 2,048 rows before the blocks and the fastest after; docs/benchmarks-history.md,
// "2026-12-02 Zen 3 (e02e8db)").
constexpr int64_t kBlockBytes = 256 * 1024;

// Calls step(k) for k = 0 .. K - 1 in order, stepping the prefetcher after every kKBlock of them. Where a block
// needs a cache line or more per k (few rows: one row group per panel), AVX-512 spreads the lines over the block's
// k iterations: at 8 rows that took about 15% less time than 24 prefetches at once after 8 iterations on Zen 4,
// and made no difference at 1, 32 and 256 rows (docs/benchmarks-history.md, "2026-12-02 Zen 4 (46f8ad6)").
template <int kLocality, typename Step>
__attribute__((always_inline)) inline void for_each_k(int64_t K, Prefetcher<kLocality>& pf, Step&& step) {
  int64_t k = 0;
#if defined(TOKENMILL_GEMM_AVX512)
  if (pf.lines_per_k > 0) {
    const int64_t lines = pf.lines_per_k;
    for (; k + kKBlock <= K; k += kKBlock) {
      const char* c = pf.next;
      if (pf.end - c >= kKBlock * lines * 64) {
#pragma GCC unroll 8
        for (int64_t kk = 0; kk < kKBlock; ++kk) {
          step(k + kk);
          for (int64_t i = 0; i < lines; ++i) __builtin_prefetch(c + (kk * lines + i) * 64, 0, kLocality);
        }
        pf.next = c + kKBlock * lines * 64;
      } else {  // the panel's last lines (or none left): the block-at-once path stops at its end
#pragma GCC unroll 8
        for (int64_t kk = 0; kk < kKBlock; ++kk) step(k + kk);
        pf.step();
      }
    }
  }
#endif
  for (; k + kKBlock <= K; k += kKBlock) {
#pragma GCC unroll 8
    for (int64_t kk = 0; kk < kKBlock; ++kk) step(k + kk);
    pf.step();
  }
  for (; k < K; ++k) step(k);
}

// y[r, 0:kPanel] = sum_k x[r, k] * panel[k, 0:kPanel] for r < R (ldx, ldy: row strides in elements).
template <int R, int kLocality>
inline void micro_kernel(const float* x, int64_t ldx, const float* panel, int64_t K, float* y, int64_t ldy,
                         Prefetcher<kLocality>& pf) {
#if defined(TOKENMILL_GEMM_AVX512)
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = _mm512_setzero_ps();
  auto k_step = [&](int64_t k) __attribute__((always_inline)) {
    const float* b = panel + k * kPanel;
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), b2 = _mm512_loadu_ps(b + 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
    }
  };
  for_each_k(K, pf, k_step);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 3; ++j) _mm512_storeu_ps(y + r * ldy + 16 * j, acc[r][j]);
#elif defined(TOKENMILL_GEMM_AVX2)
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) acc[r][j] = _mm256_setzero_ps();
  auto k_step = [&](int64_t k) __attribute__((always_inline)) {
    const float* b = panel + k * kPanel;
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  };
  for_each_k(K, pf, k_step);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(y + r * ldy + 8 * j, acc[r][j]);
#else
  float acc[R][kPanel] = {};
  for_each_k(K, pf, [&](int64_t k) {
    const float* b = panel + k * kPanel;
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + k];
      for (int64_t j = 0; j < kPanel; ++j) acc[r][j] += a * b[j];
    }
  });
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], sizeof(acc[r]));
#endif
}

// Calls fn(std::integral_constant<int, rows>{}) for 1 <= rows <= R: a micro-kernel's row count as a template
// argument, so that its accumulators stay in registers.
template <int R, typename Fn>
inline void with_rows(int rows, Fn&& fn) {
  if constexpr (R > 0) {
    if (rows == R) {
      fn(std::integral_constant<int, R>{});
      return;
    }
    with_rows<R - 1>(rows, fn);
  }
}

// One panel for all M rows; columns past N go to a scratch tile. With a bias ([N], or nullptr) each row group's
// outputs get it added while they are still in L1 (an epilogue: no second pass over y).
template <int kLocality>
void panel_product(const float* x, int64_t M, int64_t K, const float* panel, int64_t col0, int64_t N, float* y,
                   Prefetcher<kLocality>& pf, const float* bias) {
  const int64_t cols = std::min<int64_t>(kPanel, N - col0);
  alignas(64) float tile[kRows * kPanel];
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
    float* out = cols == kPanel ? y + m0 * N + col0 : tile;
    const int64_t ldy = cols == kPanel ? N : kPanel;
    with_rows<kRows>(rows, [&](auto r) { micro_kernel<decltype(r)::value>(x + m0 * K, K, panel, K, out, ldy, pf); });
    if (cols < kPanel)
      for (int r = 0; r < rows; ++r) std::memcpy(y + (m0 + r) * N + col0, tile + r * kPanel, cols * sizeof(float));
    if (bias != nullptr)
      for (int r = 0; r < rows; ++r) {
        float* row = y + (m0 + r) * N + col0;
        for (int64_t j = 0; j < cols; ++j) row[j] += bias[col0 + j];
      }
  }
}

// The P panels of ws ([P, panel_elems]) against M rows of K input channels: threads take contiguous ranges of
// panels; the rows go in blocks of about kBlockBytes of activations (a multiple of group_rows, the micro-kernel's
// row count, so that the row groups, and with them every sum, are those of one unblocked pass), each block by all
// of a thread's panels; while product(m0, rows, p, panel, pf) multiplies one panel its prefetcher pf fetches the
// next, spread over the k_steps steps of each of its row groups.
template <int kLocality, typename T, typename Product>
void run_panels(int64_t M, int64_t K, int64_t P, int64_t panel_elems, int64_t group_rows, int64_t k_steps,
                const T* ws, Product&& product) {
  const int64_t block_rows =
      std::max<int64_t>(group_rows, kBlockBytes / (K * static_cast<int64_t>(sizeof(T))) / group_rows * group_rows);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
      const int64_t rows = std::min(block_rows, M - m0);
      for (int64_t p = p0; p < p1; ++p) {
        const T* panel = ws + p * panel_elems;
        Prefetcher<kLocality> pf;
        if (p + 1 < p1) {
          const int64_t bytes = panel_elems * static_cast<int64_t>(sizeof(T));
          const int64_t iters = std::max<int64_t>(((rows + group_rows - 1) / group_rows) * (k_steps / kKBlock), 1);
          pf.next = reinterpret_cast<const char*>(panel + panel_elems);
          pf.end = pf.next + bytes;
          pf.stride = 64 * ((bytes / 64 + iters - 1) / iters);
          if (pf.stride >= kKBlock * 64) pf.lines_per_k = (pf.stride / 64 + kKBlock - 1) / kKBlock;
        }
        product(m0, rows, p, panel, pf);
      }
    }
  });
}

at::Tensor dense_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "dense_gemm: CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "dense_gemm: float32 x and packed weight expected, got ", x.scalar_type(), " and ",
              packed.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "dense_gemm: x must be a contiguous [M, K] tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kPanel,
              "dense_gemm: packed weight must be a contiguous [P, K, ", kPanel, "] tensor, got ", packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "dense_gemm: x has ", K, " input channels, the packed weight ", packed.size(1));
  TORCH_CHECK(n > (P - 1) * kPanel && n <= P * kPanel, "dense_gemm: ", n, " output rows do not fit ", P,
              " panels of ", kPanel);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                "dense_gemm: bias must be a contiguous float32 [", n, "] tensor, got ", bias->sizes());
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || K == 0) return has_bias ? y.copy_(bias->expand({M, n})) : y.zero_();
  const float* xs = x.data_ptr<float>();
  const float* ws = packed.data_ptr<float>();
  const float* bs = has_bias ? bias->data_ptr<float>() : nullptr;
  float* ys = y.data_ptr<float>();
  const int64_t panel_floats = K * kPanel;
  auto product = [&](int64_t m0, int64_t rows, int64_t p, const float* panel, auto& pf) {
    panel_product(xs + m0 * K, rows, K, panel, p * kPanel, n, ys + m0 * n, pf, bs);
  };
  if (prefetch_to_l2()) {
    run_panels<2>(M, K, P, panel_floats, kRows, K, ws, product);
  } else {
    run_panels<3>(M, K, P, panel_floats, kRows, K, ws, product);
  }
  return y;
}

// ---- bfloat16 weights and activations, few rows (AVX-512 BF16) ----
//
// Why not oneDNN (what bfloat16 linear layers run otherwise): at the few rows of a decode step with one or a few
// requests, the product is a pass over the weights, and oneDNN's packed bfloat16 matmul does not keep enough of
// them in flight (on a Xeon with AMX it streamed a step's 270 MB of weights in 14.8-15.2 ms inside a one-request
// decode step; docs/benchmarks-history.md, "2026-12-03 Xeon (910cad0)"). These loops
// are the float32 panel loops above with the AVX-512 BF16 pair dot product (vdpbf16ps: exact bfloat16 products,
// float32 sums) in place of the multiply-add; at a few dozen rows and more the pair dot product is the limit and
// oneDNN (AMX tiles where the CPU has them) is faster, so tokenmill_cpu/dense_linear.py uses this kernel only up to
// a measured row count (docs/benchmarks.md, "Dense matmuls").
//
// Layout: panels of kPanelBf16 output rows over K / 2 input-channel pairs, packed [P, K / 2, 2 * kPanelBf16]:
// element (p, c, 2 j + t) = W[p * kPanelBf16 + j, 2 c + t] (zero rows past N), so that one 32-bit lane holds the
// two weights one output row takes from the pair (x[2 c], x[2 c + 1]). K must be even. Outputs are rounded to
// bfloat16 (nearest even) once, from the float32 sums.
constexpr int64_t kPanelBf16 = 48;
constexpr int kRowsBf16 = 8;

#if defined(TOKENMILL_GEMM_AVX512) && defined(__AVX512BF16__)
#define TOKENMILL_GEMM_BF16 1
#endif

// y[r, 0:cols] = sum_c x[r, 2c:2c+2] . panel[c, :, 0:2] for r < R, as float32 (ldx, ldy: row strides in elements).
template <int R, int kLocality>
inline void micro_kernel_bf16(const at::BFloat16* x, int64_t ldx, const at::BFloat16* panel, int64_t pairs,
                              float* y, int64_t ldy, Prefetcher<kLocality>& pf) {
#if defined(TOKENMILL_GEMM_BF16)
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = _mm512_setzero_ps();
  auto c_step = [&](int64_t c) __attribute__((always_inline)) {
    const at::BFloat16* b = panel + c * 2 * kPanelBf16;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 32),
                   b2 = (__m512bh)_mm512_loadu_si512(b + 64);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * c, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
    }
  };
  for_each_k(pairs, pf, c_step);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 3; ++j) _mm512_storeu_ps(y + r * ldy + 16 * j, acc[r][j]);
#else
  float acc[R][kPanelBf16] = {};
  for_each_k(pairs, pf, [&](int64_t c) {
    const at::BFloat16* b = panel + c * 2 * kPanelBf16;
    for (int r = 0; r < R; ++r) {
      const float a0 = static_cast<float>(x[r * ldx + 2 * c]), a1 = static_cast<float>(x[r * ldx + 2 * c + 1]);
      for (int64_t j = 0; j < kPanelBf16; ++j)
        acc[r][j] += a0 * static_cast<float>(b[2 * j]) + a1 * static_cast<float>(b[2 * j + 1]);
    }
  });
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], sizeof(acc[r]));
#endif
}

// One panel for all M rows: float32 sums in a tile, then rounded into y's columns col0 .. col0 + cols.
template <int kLocality>
void panel_product_bf16(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* panel, int64_t col0,
                        int64_t N, at::BFloat16* y, Prefetcher<kLocality>& pf) {
  const int64_t cols = std::min<int64_t>(kPanelBf16, N - col0);
  alignas(64) float tile[kRowsBf16 * kPanelBf16];
  for (int64_t m0 = 0; m0 < M; m0 += kRowsBf16) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowsBf16, M - m0));
    with_rows<kRowsBf16>(rows, [&](auto r) {
      micro_kernel_bf16<decltype(r)::value>(x + m0 * K, K, panel, K / 2, tile, kPanelBf16, pf);
    });
    for (int r = 0; r < rows; ++r) {
      at::BFloat16* out = y + (m0 + r) * N + col0;
      const float* sums = tile + r * kPanelBf16;
#if defined(TOKENMILL_GEMM_BF16)
      if (cols == kPanelBf16) {
        for (int j = 0; j < 3; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * j),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums + 16 * j)));
        continue;
      }
#endif
      for (int64_t j = 0; j < cols; ++j) out[j] = static_cast<at::BFloat16>(sums[j]);
    }
  }
}

at::Tensor dense_gemm_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "dense_gemm_bf16: CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "dense_gemm_bf16: bfloat16 x and packed weight expected, got ", x.scalar_type(), " and ",
              packed.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "dense_gemm_bf16: x must be a contiguous [M, K] tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == 2 * kPanelBf16,
              "dense_gemm_bf16: packed weight must be a contiguous [P, K / 2, ", 2 * kPanelBf16, "] tensor, got ",
              packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(K % 2 == 0 && packed.size(1) * 2 == K, "dense_gemm_bf16: x has ", K,
              " input channels, the packed weight ", 2 * packed.size(1), " (an even count is needed)");
  TORCH_CHECK(n > (P - 1) * kPanelBf16 && n <= P * kPanelBf16, "dense_gemm_bf16: ", n,
              " output rows do not fit ", P, " panels of ", kPanelBf16);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || K == 0) return y.zero_();
  const at::BFloat16* xs = x.const_data_ptr<at::BFloat16>();
  const at::BFloat16* ws = packed.const_data_ptr<at::BFloat16>();
  at::BFloat16* ys = y.data_ptr<at::BFloat16>();
  const int64_t panel_elems = K * kPanelBf16;
  auto product = [&](int64_t m0, int64_t rows, int64_t p, const at::BFloat16* panel, auto& pf) {
    panel_product_bf16(xs + m0 * K, rows, K, panel, p * kPanelBf16, n, ys + m0 * n, pf);
  };
  if (prefetch_to_l2()) {
    run_panels<2>(M, K, P, panel_elems, kRowsBf16, K / 2, ws, product);
  } else {
    run_panels<3>(M, K, P, panel_elems, kRowsBf16, K / 2, ws, product);
  }
  return y;
}

// Where the panel matmuls prefetch their next panel to: "l2", "l1", or "none" (the plain C++ build issues none).
std::string dense_gemm_prefetch() {
#if defined(TOKENMILL_GEMM_AVX512) || defined(TOKENMILL_GEMM_AVX2)
  return prefetch_to_l2() ? "l2" : "l1";
#else
  return "none";
#endif
}

std::string dense_gemm_bf16_isa() {
#if defined(TOKENMILL_GEMM_BF16)
  return "avx512_bf16";
#else
  return "scalar";
#endif
}

int64_t dense_gemm_panel() { return kPanel; }

// Same form as quant_linear_isa(): each kernel file reports the ISA its own build flags chose.
std::string dense_gemm_isa() {
#if defined(TOKENMILL_GEMM_AVX512)
  return "avx512";
#elif defined(TOKENMILL_GEMM_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("dense_gemm(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
  m.def("dense_gemm_panel() -> int", &dense_gemm_panel);
  m.def("dense_gemm_isa() -> str", &dense_gemm_isa);
  m.def("dense_gemm_bf16(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("dense_gemm_bf16_panel() -> int", [] { return kPanelBf16; });
  m.def("dense_gemm_bf16_isa() -> str", &dense_gemm_bf16_isa);
  m.def("dense_gemm_prefetch() -> str", &dense_gemm_prefetch);
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("dense_gemm", &dense_gemm);
  m.impl("dense_gemm_bf16", &dense_gemm_bf16);
}
