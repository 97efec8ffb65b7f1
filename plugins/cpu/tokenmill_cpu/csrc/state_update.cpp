// The state layers (Mamba2 and gated DeltaNet): one decode step, one token per sequence of the batch, and the
// prefill of one sequence, which runs the same per-token step in order (same bits as decoding it token by token):
//
// - causal_conv1d_update / causal_conv1d_fn: the depthwise causal conv over the last K - 1 inputs and the new one;
// - selective_state_update / selective_scan: Mamba2's recurrence h' = exp(dt A) h + dt x B^T, y = h' C + D x;
// - gated_delta_rule_update / gated_delta_rule_scan: S' = exp(g) S + k (beta (v - exp(g) S^T k))^T, o = S'^T q.
//
// The definitions and argument conventions are those of tokenmill.layers.mamba.ops (the portable torch versions);
// tokenmill_cpu.state_ops documents the Python entry points. Why C++: a decode step of these ops is a few small
// products per head whose data (the state) is read and written once; torch runs each as a chain of eager ops,
// every one a pass over the state with its own temporary, and most of the time goes to per-op overhead at the
// batch sizes of a decode step. Here each (sequence, head) pair is one pass over its state row by row, the
// arithmetic in float32 registers (AVX-512, AVX2/FMA, or plain C++ loops, per the build's instruction set). The
// prefill keeps each head's state in cache while it walks the prompt, where the portable chunked forms run many
// small products and a triangular solve per chunk (docs/benchmarks.md, "State-layer kernels").
//
// States are read in float32, bfloat16 or float16 and the new states written as float32 (what the torch versions
// return); activations are float32, bfloat16 or float16, widened on load, outputs in the input's dtype.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
#define TOKENMILL_STATE_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define TOKENMILL_STATE_AVX2 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// A register of kWidth floats, with loads and stores of the first n < kWidth lanes for row tails.
#if defined(TOKENMILL_STATE_AVX512)
struct VecF {
  static constexpr int64_t kWidth = 16;
  __m512 v;
  static VecF zero() { return {_mm512_setzero_ps()}; }
  static VecF set1(float x) { return {_mm512_set1_ps(x)}; }
  static VecF load(const float* p, int64_t n) {
    return {n >= kWidth ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p)};
  }
  void store(float* p, int64_t n) const {
    if (n >= kWidth) {
      _mm512_storeu_ps(p, v);
    } else {
      _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
    }
  }
  static VecF fma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
  static VecF mul(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static VecF sub(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static VecF add(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
  static VecF div(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
  static VecF min(VecF a, VecF b) { return {_mm512_min_ps(a.v, b.v)}; }
  static VecF max(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
  static VecF round(VecF a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  static VecF pow2(VecF n) {  // 2^n for integral n in [-126, 127]
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23);
    return {_mm512_castsi512_ps(bits)};
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
};
#elif defined(TOKENMILL_STATE_AVX2)
struct VecF {
  static constexpr int64_t kWidth = 8;
  __m256 v;
  static __m256i mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static VecF zero() { return {_mm256_setzero_ps()}; }
  static VecF set1(float x) { return {_mm256_set1_ps(x)}; }
  static VecF load(const float* p, int64_t n) {
    return {n >= kWidth ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask(n))};
  }
  void store(float* p, int64_t n) const {
    if (n >= kWidth) {
      _mm256_storeu_ps(p, v);
    } else {
      _mm256_maskstore_ps(p, mask(n), v);
    }
  }
  static VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static VecF mul(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
  static VecF sub(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
  static VecF add(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
  static VecF div(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
  static VecF min(VecF a, VecF b) { return {_mm256_min_ps(a.v, b.v)}; }
  static VecF max(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
  static VecF round(VecF a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  static VecF pow2(VecF n) {  // 2^n for integral n in [-126, 127]
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
    return {_mm256_castsi256_ps(bits)};
  }
  float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#else
struct VecF {
  static constexpr int64_t kWidth = 1;
  float v;
  static VecF zero() { return {0.0f}; }
  static VecF set1(float x) { return {x}; }
  static VecF load(const float* p, int64_t) { return {*p}; }
  void store(float* p, int64_t) const { *p = v; }
  static VecF fma(VecF a, VecF b, VecF c) { return {a.v * b.v + c.v}; }
  static VecF mul(VecF a, VecF b) { return {a.v * b.v}; }
  static VecF sub(VecF a, VecF b) { return {a.v - b.v}; }
  static VecF add(VecF a, VecF b) { return {a.v + b.v}; }
  static VecF div(VecF a, VecF b) { return {a.v / b.v}; }
  float sum() const { return v; }
};
#endif

// SiLU, x / (1 + exp(-x)), over a register. The vector builds evaluate exp as 2^n e^r (n = round(x / ln 2),
// |r| <= ln 2 / 2, ln 2 in two parts so that r is exact) with e^r's Taylor polynomial of degree 6 (truncation below
// 1e-7 relative): within a few units of float32 rounding, like glibc's expf, at register width where expf is one
// call per lane.
inline VecF silu(VecF x) {
#if defined(TOKENMILL_STATE_AVX512) || defined(TOKENMILL_STATE_AVX2)
  const VecF t = VecF::min(VecF::max(VecF::sub(VecF::zero(), x), VecF::set1(-87.0f)), VecF::set1(88.0f));
  const VecF n = VecF::round(VecF::mul(t, VecF::set1(1.44269504088896341f)));
  VecF r = VecF::fma(n, VecF::set1(-0.693145751953125f), t);
  r = VecF::fma(n, VecF::set1(-1.428606765330187e-06f), r);
  VecF p = VecF::set1(1.0f / 720.0f);
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) p = VecF::fma(p, r, VecF::set1(c));
  return VecF::div(x, VecF::add(VecF::set1(1.0f), VecF::mul(p, VecF::pow2(n))));
#else
  return {x.v / (1.0f + std::exp(-x.v))};
#endif
}

constexpr int64_t W = VecF::kWidth;

// Work items per thread chunk for items of `elements` state or channel elements each: at least ATen's grain (32,768
// elements), so a small decode step runs on the calling thread. Waking the thread pool for a few microseconds of
// work cost whole scheduler time slices on a loaded machine (2-thread runs of benchmarks/state_update_kernels.py).
inline int64_t grain(int64_t elements) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, elements)); }

// Calls f(i, n) over [0, len) in register-wide steps, n = lanes of the step (kWidth, or fewer at the tail).
template <typename F>
inline void for_each_lane_block(int64_t len, F&& f) {
  for (int64_t i = 0; i < len; i += W) f(i, len - i < W ? len - i : W);
}

// The row src[0 .. n) as floats: src itself for float rows, else widened into buf.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

// Calls f(T{}) with T the C++ type of a float32, bfloat16 or float16 tensor's dtype.
template <typename F>
void dispatch_float(const at::Tensor& t, const char* name, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

void check_rows(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.sizes());
  TORCH_CHECK(t.stride(dim - 1) == 1, name, " must have contiguous rows (last stride 1), got strides ", t.strides());
}

const float* optional_param(const std::optional<at::Tensor>& t, const char* name, int64_t size) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == size && t->is_contiguous(), name,
              " must be a contiguous float32 [", size, "] tensor, got ", t->scalar_type(), " ", t->sizes());
  return t->const_data_ptr<float>();
}

// torch.nn.functional.softplus with its defaults (beta 1, linear above 20).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// ---------------------------------------------------------------- causal conv1d
//
// Channels go in blocks of kChannels, across register lanes: the weights are transposed to [K, D] floats once per
// call, the window of each block to K - 1 rows of kChannels floats (oldest first). conv_block computes one token's
// outputs of a block; the decode step and the prefill both use it, so a prompt gives the same bits as its tokens
// decoded one at a time.

constexpr int64_t kChannels = 64;

struct ConvWeights {
  std::vector<float> w;  // [K, D]
  std::vector<float> bias;  // [D], zeros without a bias
};

template <typename T>
ConvWeights transpose_weights(const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t dim = weight.size(0), width = weight.size(1);
  ConvWeights out{std::vector<float>(width * dim), std::vector<float>(dim, 0.0f)};
  const T* wp = weight.const_data_ptr<T>();
  for (int64_t d = 0; d < dim; ++d) {
    for (int64_t j = 0; j < width; ++j) out.w[j * dim + d] = static_cast<float>(wp[d * width + j]);
  }
  if (bias.has_value()) {
    const T* bp = bias->const_data_ptr<T>();
    for (int64_t d = 0; d < dim; ++d) out.bias[d] = static_cast<float>(bp[d]);
  }
  return out;
}

// out[c] = bias[c] + sum_j w[j, c] rows[j][c] + w[K - 1, c] x[c] for the n channels of a block (SiLU optional);
// w and bias point at the block's first channel, w's rows are dim apart.
template <typename T>
inline void conv_block(const float* const* rows, const float* x, const float* w, const float* bias, int64_t dim,
                       int64_t keep, int64_t n, bool use_silu, float* acc_buf, T* out) {
  for_each_lane_block(n, [&](int64_t c, int64_t lanes) {
    VecF acc = VecF::load(bias + c, lanes);
    for (int64_t j = 0; j < keep; ++j) {
      acc = VecF::fma(VecF::load(w + j * dim + c, lanes), VecF::load(rows[j] + c, lanes), acc);
    }
    acc = VecF::fma(VecF::load(w + keep * dim + c, lanes), VecF::load(x + c, lanes), acc);
    (use_silu ? silu(acc) : acc).store(acc_buf + c, lanes);
  });
  for (int64_t c = 0; c < n; ++c) out[c] = static_cast<T>(acc_buf[c]);
}

void check_conv_weight(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(0) == x.size(1) && weight.size(1) >= 2,
              "weight must be a contiguous [D, K] tensor (K >= 2) with D = x.size(1), got ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must have one dtype, got ", x.scalar_type(),
              " and ", weight.scalar_type());
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type() && bias->dim() == 1 && bias->size(0) == x.size(1)
                    && bias->is_contiguous(), "bias must be a contiguous [D] tensor of weight's dtype");
  }
}

std::tuple<at::Tensor, at::Tensor> causal_conv1d_update(const at::Tensor& x, const at::Tensor& conv_state,
                                                        const at::Tensor& weight,
                                                        const std::optional<at::Tensor>& bias, bool use_silu) {
  check_rows(x, "x", 2);
  check_conv_weight(x, weight, bias);
  const int64_t batch = x.size(0), dim = x.size(1), width = weight.size(1), keep = width - 1;
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(0) == batch && conv_state.size(1) == dim
                  && conv_state.size(2) == keep && conv_state.stride(2) == 1 && conv_state.stride(1) == keep,
              "conv_state must be [B, D, K - 1] = [", batch, ", ", dim, ", ", keep,
              "] with contiguous [D, K - 1] rows, got ", conv_state.sizes(), " strides ", conv_state.strides());
  TORCH_CHECK(conv_state.scalar_type() == weight.scalar_type(), "conv_state must have weight's dtype, got ",
              conv_state.scalar_type());
  at::Tensor out = at::empty({batch, dim}, x.options());
  at::Tensor new_state = at::empty({batch, dim, keep}, weight.options());
  const int64_t blocks = (dim + kChannels - 1) / kChannels;
  dispatch_float(x, "x", [&](auto tag) {
    using T = decltype(tag);
    const ConvWeights cw = transpose_weights<T>(weight, bias);
    const T* xp = x.const_data_ptr<T>();
    const T* sp = conv_state.const_data_ptr<T>();
    T* op = out.data_ptr<T>();
    T* np = new_state.data_ptr<T>();
    at::parallel_for(0, batch * blocks, grain(kChannels * width), [&](int64_t begin, int64_t end) {
      std::vector<float> window(keep * kChannels), xr(kChannels), acc(kChannels);
      std::vector<const float*> rows(keep);
      for (int64_t j = 0; j < keep; ++j) rows[j] = window.data() + j * kChannels;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / blocks, d0 = (i % blocks) * kChannels, n = std::min(kChannels, dim - d0);
        const T* s = sp + b * conv_state.stride(0) + d0 * keep;
        const T* xb = xp + b * x.stride(0) + d0;
        for (int64_t c = 0; c < n; ++c) {
          for (int64_t j = 0; j < keep; ++j) window[j * kChannels + c] = static_cast<float>(s[c * keep + j]);
          xr[c] = static_cast<float>(xb[c]);
        }
        conv_block(rows.data(), xr.data(), cw.w.data() + d0, cw.bias.data() + d0, dim, keep, n, use_silu, acc.data(),
                   op + b * dim + d0);
        T* ns = np + (b * dim + d0) * keep;
        for (int64_t c = 0; c < n; ++c) {
          for (int64_t j = 0; j + 1 < keep; ++j) ns[c * keep + j] = s[c * keep + j + 1];
          ns[c * keep + keep - 1] = xb[c];
        }
      }
    });
  });
  return {out, new_state};
}

// Prefill of one sequence: conv_block over its tokens in order, the window of each block of channels a ring of
// K - 1 rows (blocks split between threads).
std::tuple<at::Tensor, at::Tensor> causal_conv1d_fn(const at::Tensor& x, const at::Tensor& weight,
                                                    const std::optional<at::Tensor>& bias,
                                                    const std::optional<at::Tensor>& conv_state, bool use_silu) {
  check_rows(x, "x", 2);
  check_conv_weight(x, weight, bias);
  const int64_t length = x.size(0), dim = x.size(1), width = weight.size(1), keep = width - 1;
  if (conv_state.has_value()) {
    TORCH_CHECK(conv_state->dim() == 2 && conv_state->size(0) == dim && conv_state->size(1) == keep
                    && conv_state->is_contiguous() && conv_state->scalar_type() == weight.scalar_type(),
                "conv_state must be a contiguous [D, K - 1] = [", dim, ", ", keep, "] tensor of weight's dtype, got ",
                conv_state->scalar_type(), " ", conv_state->sizes());
  }
  at::Tensor out = at::empty({length, dim}, x.options());
  at::Tensor new_state = at::empty({dim, keep}, weight.options());
  dispatch_float(x, "x", [&](auto tag) {
    using T = decltype(tag);
    const ConvWeights cw = transpose_weights<T>(weight, bias);
    const T* xp = x.const_data_ptr<T>();
    const T* sp = conv_state.has_value() ? conv_state->const_data_ptr<T>() : nullptr;
    T* op = out.data_ptr<T>();
    T* np = new_state.data_ptr<T>();
    const int64_t blocks = (dim + kChannels - 1) / kChannels;
    at::parallel_for(0, blocks, grain(kChannels * width * length), [&](int64_t begin, int64_t end) {
      std::vector<float> ring(keep * kChannels), acc(kChannels), xr(kChannels);
      std::vector<const float*> rows(keep);
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t d0 = blk * kChannels, n = std::min(kChannels, dim - d0);
        for (int64_t c = 0; c < n; ++c) {
          for (int64_t j = 0; j < keep; ++j) {
            ring[j * kChannels + c] = sp != nullptr ? static_cast<float>(sp[(d0 + c) * keep + j]) : 0.0f;
          }
        }
        int64_t oldest = 0;  // ring row holding the oldest input of the window
        for (int64_t t = 0; t < length; ++t) {
          const T* xt = xp + t * x.stride(0) + d0;
          for (int64_t c = 0; c < n; ++c) xr[c] = static_cast<float>(xt[c]);
          for (int64_t j = 0; j < keep; ++j) rows[j] = ring.data() + ((oldest + j) % keep) * kChannels;
          conv_block(rows.data(), xr.data(), cw.w.data() + d0, cw.bias.data() + d0, dim, keep, n, use_silu,
                     acc.data(), op + t * dim + d0);
          std::copy(xr.begin(), xr.begin() + n, ring.begin() + oldest * kChannels);
          oldest = (oldest + 1) % keep;
        }
        for (int64_t c = 0; c < n; ++c) {
          for (int64_t j = 0; j < keep; ++j) {
            np[(d0 + c) * keep + j] = static_cast<T>(ring[((oldest + j) % keep) * kChannels + c]);
          }
        }
      }
    });
  });
  return {out, new_state};
}

// ---------------------------------------------------------------- Mamba2 recurrence

inline float ssm_step_size(float dt, const float* bias, int64_t h, bool dt_softplus, float lo, float hi) {
  float step = dt + (bias != nullptr ? bias[h] : 0.0f);
  if (dt_softplus) step = softplus(step);
  return std::min(std::max(step, lo), hi);
}

// One token of one head: ns[p, n] = s[p, n] exp(step A) + step x[p] B[n], y[p] = ns[p, :] . C + D x[p]. ns may be
// s (the prefill keeps the state in place); buf holds N floats.
template <typename T, typename S>
inline void ssm_head_step(const S* s, float* ns, const T* xrow, const float* Bf, const float* Cf, float step,
                          float A, const float* D, int64_t head_dim, int64_t n_state, float* buf, T* yrow) {
  const VecF decay = VecF::set1(std::exp(step * A));
  for (int64_t p = 0; p < head_dim; ++p) {
    const float xv = static_cast<float>(xrow[p]);
    const VecF xdt = VecF::set1(xv * step);
    const float* row = as_float(s + p * n_state, buf, n_state);
    float* out = ns + p * n_state;
    VecF acc = VecF::zero();
    for_each_lane_block(n_state, [&](int64_t n, int64_t lanes) {
      const VecF h_new = VecF::fma(VecF::load(row + n, lanes), decay, VecF::mul(xdt, VecF::load(Bf + n, lanes)));
      h_new.store(out + n, lanes);
      acc = VecF::fma(h_new, VecF::load(Cf + n, lanes), acc);
    });
    yrow[p] = static_cast<T>(acc.sum() + (D != nullptr ? *D * xv : 0.0f));
  }
}

struct SsmArgs {
  int64_t heads, head_dim, n_state, per_group;
  const float *A, *D, *dt_bias;
  bool dt_softplus;
  float lo, hi;
};

SsmArgs check_ssm(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                  const at::Tensor& C, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& dt_bias,
                  int64_t n_state, bool dt_softplus, double dt_min, double dt_max) {
  check_rows(x, "x", 3);
  check_rows(B, "B", 3);
  check_rows(C, "C", 3);
  const int64_t rows = x.size(0), heads = x.size(1), groups = B.size(1);
  TORCH_CHECK(B.sizes() == C.sizes() && B.size(0) == rows && B.size(2) == n_state && groups > 0 && heads % groups == 0,
              "B and C must be [", rows, ", G, ", n_state, "] with G dividing the heads, got ", B.sizes(), " and ",
              C.sizes());
  TORCH_CHECK(B.scalar_type() == x.scalar_type() && C.scalar_type() == x.scalar_type(), "B and C must have x's dtype");
  TORCH_CHECK(dt.scalar_type() == at::kFloat && dt.dim() == 2 && dt.size(0) == rows && dt.size(1) == heads
                  && dt.stride(1) == 1, "dt must be a float32 [", rows, ", H] tensor with contiguous rows, got ",
              dt.sizes());
  return {heads, x.size(2), n_state, heads / groups, optional_param(A, "A", heads), optional_param(D, "D", heads),
          optional_param(dt_bias, "dt_bias", heads), dt_softplus, static_cast<float>(dt_min),
          static_cast<float>(dt_max)};
}

std::tuple<at::Tensor, at::Tensor> selective_state_update(
    const at::Tensor& state, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
    const at::Tensor& C, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& dt_bias,
    bool dt_softplus, double dt_min, double dt_max) {
  TORCH_CHECK(state.dim() == 4, "state must be [B, H, P, N], got ", state.sizes());
  const SsmArgs a = check_ssm(x, dt, A, B, C, D, dt_bias, state.size(3), dt_softplus, dt_min, dt_max);
  const int64_t batch = x.size(0), n_state = a.n_state, head_size = a.head_dim * n_state;
  TORCH_CHECK(state.size(0) == batch && state.size(1) == a.heads && state.size(2) == a.head_dim
                  && state.stride(3) == 1 && state.stride(2) == n_state && state.stride(1) == head_size,
              "state must be [B, H, P, N] with contiguous [H, P, N] per sequence, got ", state.sizes(), " strides ",
              state.strides(), " for x ", x.sizes());
  at::Tensor y = at::empty({batch, a.heads, a.head_dim}, x.options());
  at::Tensor new_state = at::empty({batch, a.heads, a.head_dim, n_state}, state.options().dtype(at::kFloat));
  dispatch_float(x, "x", [&](auto xtag) {
    dispatch_float(state, "state", [&](auto stag) {
      using T = decltype(xtag);
      using S = decltype(stag);
      at::parallel_for(0, batch * a.heads, grain(head_size), [&](int64_t begin, int64_t end) {
        std::vector<float> buf(3 * n_state);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t b = i / a.heads, h = i % a.heads, g = h / a.per_group;
          const float step = ssm_step_size(dt.const_data_ptr<float>()[b * dt.stride(0) + h], a.dt_bias, h,
                                           a.dt_softplus, a.lo, a.hi);
          const float* Bf = as_float(B.const_data_ptr<T>() + b * B.stride(0) + g * B.stride(1), buf.data(), n_state);
          const float* Cf = as_float(C.const_data_ptr<T>() + b * C.stride(0) + g * C.stride(1), buf.data() + n_state,
                                     n_state);
          ssm_head_step(state.const_data_ptr<S>() + b * state.stride(0) + h * head_size,
                        new_state.data_ptr<float>() + i * head_size,
                        x.const_data_ptr<T>() + b * x.stride(0) + h * x.stride(1), Bf, Cf, step, a.A[h],
                        a.D != nullptr ? a.D + h : nullptr, a.head_dim, n_state, buf.data() + 2 * n_state,
                        y.data_ptr<T>() + i * a.head_dim);
        }
      });
    });
  });
  return {y, new_state};
}

// Prefill of one sequence: ssm_head_step token by token, the state of each head kept in the float32 result (heads
// split between threads).
std::tuple<at::Tensor, at::Tensor> selective_scan(
    const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
    const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& dt_bias,
    const std::optional<at::Tensor>& initial_state, bool dt_softplus, double dt_min, double dt_max) {
  const SsmArgs a = check_ssm(x, dt, A, B, C, D, dt_bias, B.dim() == 3 ? B.size(2) : 0, dt_softplus, dt_min, dt_max);
  const int64_t length = x.size(0), n_state = a.n_state, head_size = a.head_dim * n_state;
  at::Tensor state = at::zeros({a.heads, a.head_dim, n_state}, x.options().dtype(at::kFloat));
  if (initial_state.has_value()) {
    TORCH_CHECK(initial_state->sizes() == state.sizes(), "initial_state must be [H, P, N] = ", state.sizes(),
                ", got ", initial_state->sizes());
    state.copy_(*initial_state);
  }
  at::Tensor y = at::empty({length, a.heads, a.head_dim}, x.options());
  dispatch_float(x, "x", [&](auto xtag) {
    using T = decltype(xtag);
    at::parallel_for(0, a.heads, grain(head_size * length), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(3 * n_state);
      for (int64_t h = begin; h < end; ++h) {
        const int64_t g = h / a.per_group;
        float* st = state.data_ptr<float>() + h * head_size;
        for (int64_t t = 0; t < length; ++t) {
          const float step = ssm_step_size(dt.const_data_ptr<float>()[t * dt.stride(0) + h], a.dt_bias, h,
                                           a.dt_softplus, a.lo, a.hi);
          const float* Bf = as_float(B.const_data_ptr<T>() + t * B.stride(0) + g * B.stride(1), buf.data(), n_state);
          const float* Cf = as_float(C.const_data_ptr<T>() + t * C.stride(0) + g * C.stride(1),
                                     buf.data() + n_state, n_state);
          ssm_head_step(static_cast<const float*>(st), st, x.const_data_ptr<T>() + t * x.stride(0) + h * x.stride(1),
                        Bf, Cf, step, a.A[h], a.D != nullptr ? a.D + h : nullptr, a.head_dim, n_state,
                        buf.data() + 2 * n_state, y.data_ptr<T>() + (t * a.heads + h) * a.head_dim);
        }
      }
    });
  });
  return {y, state};
}

// ---------------------------------------------------------------- gated delta rule

// x * rsqrt(sum(x^2) + eps) * scale, in place (transformers' and FLA's l2norm, eps 1e-6).
void l2_normalize(float* x, int64_t n, bool normalize, float scale) {
  if (normalize) {
    float sq = 0.0f;
    for (int64_t i = 0; i < n; ++i) sq += x[i] * x[i];
    scale /= std::sqrt(sq + 1e-6f);
  }
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

// One token of one head: S' = exp(g) S + k (beta (v - exp(g) S^T k))^T, o = S'^T q. ns may be s (the prefill
// keeps the state in place): each row is read before it is written. buf holds 2 Dk + 5 Dv floats.
template <typename T, typename S>
inline void delta_head_step(const S* s, float* ns, const T* qrow, const T* krow, const T* vrow, float g, float beta,
                            int64_t dk, int64_t dv, bool use_qk_l2norm, float* buf, T* orow) {
  float *qf = buf, *kf = qf + dk, *vf = kf + dk, *mem = vf + dv, *delta = mem + dv, *out = delta + dv, *row = out + dv;
  for (int64_t j = 0; j < dk; ++j) {
    qf[j] = static_cast<float>(qrow[j]);
    kf[j] = static_cast<float>(krow[j]);
  }
  for (int64_t j = 0; j < dv; ++j) vf[j] = static_cast<float>(vrow[j]);
  l2_normalize(qf, dk, use_qk_l2norm, 1.0f / std::sqrt(static_cast<float>(dk)));
  l2_normalize(kf, dk, use_qk_l2norm, 1.0f);
  const VecF decay = VecF::set1(std::exp(g));
  const VecF beta_v = VecF::set1(beta);
  // pass 1: mem = S^T k (undecayed), then delta = beta (v - decay mem)
  for_each_lane_block(dv, [&](int64_t c, int64_t lanes) { VecF::zero().store(mem + c, lanes); });
  for (int64_t j = 0; j < dk; ++j) {
    const float* srow = as_float(s + j * dv, row, dv);
    const VecF kj = VecF::set1(kf[j]);
    for_each_lane_block(dv, [&](int64_t c, int64_t lanes) {
      VecF::fma(VecF::load(srow + c, lanes), kj, VecF::load(mem + c, lanes)).store(mem + c, lanes);
    });
  }
  for_each_lane_block(dv, [&](int64_t c, int64_t lanes) {
    const VecF err = VecF::sub(VecF::load(vf + c, lanes), VecF::mul(decay, VecF::load(mem + c, lanes)));
    VecF::mul(err, beta_v).store(delta + c, lanes);
    VecF::zero().store(out + c, lanes);
  });
  // pass 2: S' = decay S + k delta^T, written out, and out = S'^T q
  for (int64_t j = 0; j < dk; ++j) {
    const float* srow = as_float(s + j * dv, row, dv);
    const VecF kj = VecF::set1(kf[j]), qj = VecF::set1(qf[j]);
    for_each_lane_block(dv, [&](int64_t c, int64_t lanes) {
      const VecF updated = VecF::fma(VecF::load(srow + c, lanes), decay, VecF::mul(kj, VecF::load(delta + c, lanes)));
      updated.store(ns + j * dv + c, lanes);
      VecF::fma(updated, qj, VecF::load(out + c, lanes)).store(out + c, lanes);
    });
  }
  for (int64_t c = 0; c < dv; ++c) orow[c] = static_cast<T>(out[c]);
}

void check_delta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                 const at::Tensor& beta) {
  check_rows(q, "q", 3);
  check_rows(k, "k", 3);
  check_rows(v, "v", 3);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == q.size(0) && v.size(1) == q.size(1),
              "q, k must be [B, H, Dk] and v [B, H, Dv], got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v must have one dtype");
  for (const auto* t : {&g, &beta}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == q.size(0) && t->size(1) == q.size(1)
                    && t->stride(1) == 1, "g and beta must be float32 [", q.size(0), ", H] tensors with contiguous "
                "rows, got ", t->scalar_type(), " ", t->sizes());
  }
}

std::tuple<at::Tensor, at::Tensor> gated_delta_rule_update(const at::Tensor& state, const at::Tensor& q,
                                                           const at::Tensor& k, const at::Tensor& v,
                                                           const at::Tensor& g, const at::Tensor& beta,
                                                           bool use_qk_l2norm) {
  check_delta(q, k, v, g, beta);
  const int64_t batch = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(state.dim() == 4 && state.size(0) == batch && state.size(1) == heads && state.size(2) == dk
                  && state.size(3) == dv && state.stride(3) == 1 && state.stride(2) == dv && state.stride(1) == dk * dv,
              "state must be [B, H, Dk, Dv] with contiguous [H, Dk, Dv] per sequence, got ", state.sizes(),
              " strides ", state.strides());
  at::Tensor o = at::empty({batch, heads, dv}, v.options());
  at::Tensor new_state = at::empty({batch, heads, dk, dv}, state.options().dtype(at::kFloat));
  dispatch_float(v, "v", [&](auto xtag) {
    dispatch_float(state, "state", [&](auto stag) {
      using T = decltype(xtag);
      using S = decltype(stag);
      at::parallel_for(0, batch * heads, grain(dk * dv), [&](int64_t begin, int64_t end) {
        std::vector<float> buf(2 * dk + 5 * dv);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t b = i / heads, h = i % heads;
          delta_head_step(state.const_data_ptr<S>() + b * state.stride(0) + h * dk * dv,
                          new_state.data_ptr<float>() + i * dk * dv,
                          q.const_data_ptr<T>() + b * q.stride(0) + h * q.stride(1),
                          k.const_data_ptr<T>() + b * k.stride(0) + h * k.stride(1),
                          v.const_data_ptr<T>() + b * v.stride(0) + h * v.stride(1),
                          g.const_data_ptr<float>()[b * g.stride(0) + h],
                          beta.const_data_ptr<float>()[b * beta.stride(0) + h], dk, dv, use_qk_l2norm, buf.data(),
                          o.data_ptr<T>() + i * dv);
        }
      });
    });
  });
  return {o, new_state};
}

// Prefill of one sequence: delta_head_step token by token, the state of each head kept in the float32 result
// (heads split between threads).
std::tuple<at::Tensor, at::Tensor> gated_delta_rule_scan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         const at::Tensor& g, const at::Tensor& beta,
                                                         const std::optional<at::Tensor>& initial_state,
                                                         bool use_qk_l2norm) {
  check_delta(q, k, v, g, beta);
  const int64_t length = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  at::Tensor state = at::zeros({heads, dk, dv}, v.options().dtype(at::kFloat));
  if (initial_state.has_value()) {
    TORCH_CHECK(initial_state->sizes() == state.sizes(), "initial_state must be [H, Dk, Dv] = ", state.sizes(),
                ", got ", initial_state->sizes());
    state.copy_(*initial_state);
  }
  at::Tensor o = at::empty({length, heads, dv}, v.options());
  dispatch_float(v, "v", [&](auto xtag) {
    using T = decltype(xtag);
    at::parallel_for(0, heads, grain(dk * dv * length), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(2 * dk + 5 * dv);
      for (int64_t h = begin; h < end; ++h) {
        float* st = state.data_ptr<float>() + h * dk * dv;
        for (int64_t t = 0; t < length; ++t) {
          delta_head_step(static_cast<const float*>(st), st, q.const_data_ptr<T>() + t * q.stride(0) + h * q.stride(1),
                          k.const_data_ptr<T>() + t * k.stride(0) + h * k.stride(1),
                          v.const_data_ptr<T>() + t * v.stride(0) + h * v.stride(1),
                          g.const_data_ptr<float>()[t * g.stride(0) + h],
                          beta.const_data_ptr<float>()[t * beta.stride(0) + h], dk, dv, use_qk_l2norm, buf.data(),
                          o.data_ptr<T>() + (t * heads + h) * dv);
        }
      }
    });
  });
  return {o, state};
}

// Same form as dense_gemm_isa(): the instruction set this file's build flags chose.
std::string state_update_isa() {
#if defined(TOKENMILL_STATE_AVX512)
  return "avx512";
#elif defined(TOKENMILL_STATE_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("causal_conv1d_update(Tensor x, Tensor conv_state, Tensor weight, Tensor? bias, bool silu)"
        " -> (Tensor, Tensor)");
  m.def("selective_state_update(Tensor state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D,"
        " Tensor? dt_bias, bool dt_softplus, float dt_min, float dt_max) -> (Tensor, Tensor)");
  m.def("gated_delta_rule_update(Tensor state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta,"
        " bool use_qk_l2norm) -> (Tensor, Tensor)");
  m.def("causal_conv1d_fn(Tensor x, Tensor weight, Tensor? bias, Tensor? conv_state, bool silu) -> (Tensor, Tensor)");
  m.def("selective_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? dt_bias,"
        " Tensor? initial_state, bool dt_softplus, float dt_min, float dt_max) -> (Tensor, Tensor)");
  m.def("gated_delta_rule_scan(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state,"
        " bool use_qk_l2norm) -> (Tensor, Tensor)");
  m.def("state_update_isa() -> str", &state_update_isa);
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("causal_conv1d_update", &causal_conv1d_update);
  m.impl("selective_state_update", &selective_state_update);
  m.impl("gated_delta_rule_update", &gated_delta_rule_update);
  m.impl("causal_conv1d_fn", &causal_conv1d_fn);
  m.impl("selective_scan", &selective_scan);
  m.impl("gated_delta_rule_scan", &gated_delta_rule_scan);
}
