// One decode step of the state layers (Mamba2 and gated DeltaNet), one token per sequence of the batch:
//
// - causal_conv1d_update: the depthwise causal conv over each sequence's last K - 1 inputs and its new one;
// - selective_state_update: Mamba2's recurrence h' = exp(dt A) h + dt x B^T, y = h' C + D x (per head);
// - gated_delta_rule_update: S' = exp(g) S + k (beta (v - exp(g) S^T k))^T, o = S'^T q (per head).
//
// The definitions and argument conventions are those of tokenmill.layers.mamba.ops (the portable torch versions);
// tokenmill_cpu.state_ops documents the Python entry points. Why C++: a decode step of these ops is a few small
// products per head whose data (the state) is read and written once; torch runs each as a chain of eager ops,
// every one a pass over the state with its own temporary, and most of the time goes to per-op overhead at the
// batch sizes of a decode step. Here each (sequence, head) pair is one pass over its state row by row, the
// arithmetic in float32 registers (AVX-512, AVX2/FMA, or plain C++ loops, per the build's instruction set).
//
// States are read in float32, bfloat16 or float16 and the new states written as float32 (what the torch versions
// return); activations are float32, bfloat16 or float16, widened on load, outputs in the input's dtype.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
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
  float sum() const { return v; }
};
#endif

constexpr int64_t W = VecF::kWidth;

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

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// torch.nn.functional.softplus with its defaults (beta 1, linear above 20).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

std::tuple<at::Tensor, at::Tensor> causal_conv1d_update(const at::Tensor& x, const at::Tensor& conv_state,
                                                        const at::Tensor& weight,
                                                        const std::optional<at::Tensor>& bias, bool use_silu) {
  check_rows(x, "x", 2);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(0) == x.size(1) && weight.size(1) >= 2,
              "weight must be a contiguous [D, K] tensor (K >= 2) with D = x.size(1), got ", weight.sizes());
  const int64_t batch = x.size(0), dim = x.size(1), width = weight.size(1);
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(0) == batch && conv_state.size(1) == dim
                  && conv_state.size(2) == width - 1 && conv_state.stride(2) == 1 && conv_state.stride(1) == width - 1,
              "conv_state must be [B, D, K - 1] = [", batch, ", ", dim, ", ", width - 1,
              "] with contiguous [D, K - 1] rows, got ", conv_state.sizes(), " strides ", conv_state.strides());
  TORCH_CHECK(conv_state.scalar_type() == weight.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "x, conv_state and weight must have one dtype, got ", x.scalar_type(), ", ", conv_state.scalar_type(),
              ", ", weight.scalar_type());
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type() && bias->dim() == 1 && bias->size(0) == dim
                    && bias->is_contiguous(), "bias must be a contiguous [D] tensor of weight's dtype");
  }
  at::Tensor out = at::empty({batch, dim}, x.options());
  at::Tensor new_state = at::empty({batch, dim, width - 1}, weight.options());
  dispatch_float(x, "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    const T* sp = conv_state.const_data_ptr<T>();
    const T* wp = weight.const_data_ptr<T>();
    const T* bp = bias.has_value() ? bias->const_data_ptr<T>() : nullptr;
    T* op = out.data_ptr<T>();
    T* np = new_state.data_ptr<T>();
    const int64_t xs = x.stride(0), ss = conv_state.stride(0), keep = width - 1;
    at::parallel_for(0, batch * dim, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / dim, d = i % dim;
        const T* s = sp + b * ss + d * keep;
        const T* w = wp + d * width;
        T* ns = np + i * keep;
        const float xv = static_cast<float>(xp[b * xs + d]);
        float acc = bp != nullptr ? static_cast<float>(bp[d]) : 0.0f;
        for (int64_t j = 0; j < keep; ++j) acc += static_cast<float>(w[j]) * static_cast<float>(s[j]);
        acc += static_cast<float>(w[keep]) * xv;
        for (int64_t j = 0; j + 1 < keep; ++j) ns[j] = s[j + 1];
        ns[keep - 1] = xp[b * xs + d];
        op[b * dim + d] = static_cast<T>(use_silu ? silu(acc) : acc);
      }
    });
  });
  return {out, new_state};
}

std::tuple<at::Tensor, at::Tensor> selective_state_update(
    const at::Tensor& state, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
    const at::Tensor& C, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& dt_bias,
    bool dt_softplus, double dt_min, double dt_max) {
  check_rows(x, "x", 3);
  const int64_t batch = x.size(0), heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK(state.dim() == 4 && state.size(0) == batch && state.size(1) == heads && state.size(2) == head_dim
                  && state.stride(3) == 1 && state.stride(2) == state.size(3) && state.stride(1) == head_dim * state.size(3),
              "state must be [B, H, P, N] with contiguous [H, P, N] per sequence, got ", state.sizes(), " strides ",
              state.strides(), " for x ", x.sizes());
  const int64_t n_state = state.size(3);
  check_rows(B, "B", 3);
  check_rows(C, "C", 3);
  const int64_t groups = B.size(1);
  TORCH_CHECK(B.sizes() == C.sizes() && B.size(0) == batch && B.size(2) == n_state && groups > 0
                  && heads % groups == 0,
              "B and C must be [B, G, N] with G dividing the heads, got ", B.sizes(), " and ", C.sizes());
  TORCH_CHECK(B.scalar_type() == x.scalar_type() && C.scalar_type() == x.scalar_type(), "B and C must have x's dtype");
  TORCH_CHECK(dt.scalar_type() == at::kFloat && dt.dim() == 2 && dt.size(0) == batch && dt.size(1) == heads
                  && dt.stride(1) == 1, "dt must be a float32 [B, H] tensor with contiguous rows, got ", dt.sizes());
  const float* Ap = optional_param(A, "A", heads);
  const float* Dp = optional_param(D, "D", heads);
  const float* biasp = optional_param(dt_bias, "dt_bias", heads);
  at::Tensor y = at::empty({batch, heads, head_dim}, x.options());
  at::Tensor new_state = at::empty({batch, heads, head_dim, n_state}, state.options().dtype(at::kFloat));
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  const int64_t per_group = heads / groups;
  dispatch_float(x, "x", [&](auto xtag) {
    dispatch_float(state, "state", [&](auto stag) {
      using T = decltype(xtag);
      using S = decltype(stag);
      const T* xp = x.const_data_ptr<T>();
      const T* Bp = B.const_data_ptr<T>();
      const T* Cp = C.const_data_ptr<T>();
      const S* sp = state.const_data_ptr<S>();
      const float* dtp = dt.const_data_ptr<float>();
      T* yp = y.data_ptr<T>();
      float* np = new_state.data_ptr<float>();
      at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> buf(3 * n_state);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t b = i / heads, h = i % heads, g = h / per_group;
          float step = dtp[b * dt.stride(0) + h] + (biasp != nullptr ? biasp[h] : 0.0f);
          if (dt_softplus) step = softplus(step);
          step = std::min(std::max(step, lo), hi);
          const VecF decay = VecF::set1(std::exp(step * Ap[h]));
          const float* Bf = as_float(Bp + b * B.stride(0) + g * B.stride(1), buf.data(), n_state);
          const float* Cf = as_float(Cp + b * C.stride(0) + g * C.stride(1), buf.data() + n_state, n_state);
          const T* xrow = xp + b * x.stride(0) + h * x.stride(1);
          for (int64_t p = 0; p < head_dim; ++p) {
            const float xv = static_cast<float>(xrow[p]);
            const VecF xdt = VecF::set1(xv * step);
            const float* s = as_float(sp + b * state.stride(0) + (h * head_dim + p) * n_state,
                                      buf.data() + 2 * n_state, n_state);
            float* ns = np + (i * head_dim + p) * n_state;
            VecF acc = VecF::zero();
            for_each_lane_block(n_state, [&](int64_t n, int64_t lanes) {
              const VecF h_new = VecF::fma(VecF::load(s + n, lanes), decay,
                                           VecF::mul(xdt, VecF::load(Bf + n, lanes)));
              h_new.store(ns + n, lanes);
              acc = VecF::fma(h_new, VecF::load(Cf + n, lanes), acc);
            });
            yp[i * head_dim + p] = static_cast<T>(acc.sum() + (Dp != nullptr ? Dp[h] * xv : 0.0f));
          }
        }
      });
    });
  });
  return {y, new_state};
}

// x * rsqrt(sum(x^2) + eps) * scale, in place (transformers' and FLA's l2norm, eps 1e-6).
void l2_normalize(float* x, int64_t n, bool normalize, float scale) {
  if (normalize) {
    float sq = 0.0f;
    for (int64_t i = 0; i < n; ++i) sq += x[i] * x[i];
    scale /= std::sqrt(sq + 1e-6f);
  }
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

std::tuple<at::Tensor, at::Tensor> gated_delta_rule_update(const at::Tensor& state, const at::Tensor& q,
                                                           const at::Tensor& k, const at::Tensor& v,
                                                           const at::Tensor& g, const at::Tensor& beta,
                                                           bool use_qk_l2norm) {
  check_rows(q, "q", 3);
  check_rows(k, "k", 3);
  check_rows(v, "v", 3);
  const int64_t batch = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == batch && v.size(1) == heads,
              "q, k must be [B, H, Dk] and v [B, H, Dv], got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v must have one dtype");
  TORCH_CHECK(state.dim() == 4 && state.size(0) == batch && state.size(1) == heads && state.size(2) == dk
                  && state.size(3) == dv && state.stride(3) == 1 && state.stride(2) == dv && state.stride(1) == dk * dv,
              "state must be [B, H, Dk, Dv] with contiguous [H, Dk, Dv] per sequence, got ", state.sizes(),
              " strides ", state.strides());
  for (const auto* t : {&g, &beta}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == batch && t->size(1) == heads
                    && t->stride(1) == 1, "g and beta must be float32 [B, H] tensors with contiguous rows, got ",
                t->scalar_type(), " ", t->sizes());
  }
  at::Tensor o = at::empty({batch, heads, dv}, v.options());
  at::Tensor new_state = at::empty({batch, heads, dk, dv}, state.options().dtype(at::kFloat));
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  dispatch_float(v, "v", [&](auto xtag) {
    dispatch_float(state, "state", [&](auto stag) {
      using T = decltype(xtag);
      using S = decltype(stag);
      const S* sp = state.const_data_ptr<S>();
      float* np = new_state.data_ptr<float>();
      T* op = o.data_ptr<T>();
      at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
        // qf, kf [Dk]; vf, mem, delta, out, state row [Dv]
        std::vector<float> buf(2 * dk + 5 * dv);
        float *qf = buf.data(), *kf = qf + dk, *vf = kf + dk, *mem = vf + dv, *delta = mem + dv, *out = delta + dv,
              *row = out + dv;
        for (int64_t i = begin; i < end; ++i) {
          const int64_t b = i / heads, h = i % heads;
          const T* qrow = q.const_data_ptr<T>() + b * q.stride(0) + h * q.stride(1);
          const T* krow = k.const_data_ptr<T>() + b * k.stride(0) + h * k.stride(1);
          const T* vrow = v.const_data_ptr<T>() + b * v.stride(0) + h * v.stride(1);
          for (int64_t j = 0; j < dk; ++j) {
            qf[j] = static_cast<float>(qrow[j]);
            kf[j] = static_cast<float>(krow[j]);
          }
          for (int64_t j = 0; j < dv; ++j) vf[j] = static_cast<float>(vrow[j]);
          l2_normalize(qf, dk, use_qk_l2norm, q_scale);
          l2_normalize(kf, dk, use_qk_l2norm, 1.0f);
          const float decay = std::exp(g.const_data_ptr<float>()[b * g.stride(0) + h]);
          const VecF beta_v = VecF::set1(beta.const_data_ptr<float>()[b * beta.stride(0) + h]);
          const VecF decay_v = VecF::set1(decay);
          const S* s = sp + b * state.stride(0) + h * dk * dv;
          float* ns = np + i * dk * dv;
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
            const VecF err = VecF::sub(VecF::load(vf + c, lanes), VecF::mul(decay_v, VecF::load(mem + c, lanes)));
            VecF::mul(err, beta_v).store(delta + c, lanes);
            VecF::zero().store(out + c, lanes);
          });
          // pass 2: S' = decay S + k delta^T, written out, and out = S'^T q
          for (int64_t j = 0; j < dk; ++j) {
            const float* srow = as_float(s + j * dv, row, dv);
            const VecF kj = VecF::set1(kf[j]), qj = VecF::set1(qf[j]);
            for_each_lane_block(dv, [&](int64_t c, int64_t lanes) {
              const VecF updated = VecF::fma(VecF::load(srow + c, lanes), decay_v,
                                             VecF::mul(kj, VecF::load(delta + c, lanes)));
              updated.store(ns + j * dv + c, lanes);
              VecF::fma(updated, qj, VecF::load(out + c, lanes)).store(out + c, lanes);
            });
          }
          for (int64_t c = 0; c < dv; ++c) op[i * dv + c] = static_cast<T>(out[c]);
        }
      });
    });
  });
  return {o, new_state};
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
  m.def("state_update_isa() -> str", &state_update_isa);
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("causal_conv1d_update", &causal_conv1d_update);
  m.impl("selective_state_update", &selective_state_update);
  m.impl("gated_delta_rule_update", &gated_delta_rule_update);
}
