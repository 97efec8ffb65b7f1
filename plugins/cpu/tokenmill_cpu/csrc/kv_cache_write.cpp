// The paged KV cache write: each new token's key and value rows copied into its cache slot.
//
// Layout (tokenmill's torch_paged backend): kv_cache [2, Hkv, num_blocks, block_size, D], keys then values;
// slot s of KV head h is row s of that head's [num_blocks * block_size, D] run. The torch backend writes with
// one indexed assignment of the stacked keys and values; under torch.compile that becomes a serial copy of the
// stack followed by a scatter parallel over the two halves only, and eagerly a stack plus index_put_. Here every
// (token, K or V, head) row is one copy, read from q/k/v's projection output in place (any row and head stride),
// split between threads by token: about half the compiled copy's time in a 1,968-token mixed step, no measurable
// difference in 256-request decode steps (python benchmarks/prefill_attention.py; docs/benchmarks-history.md,
// "2026-12-03 Xeon (89db59a)"). A quantized cache (int8 / fp8, --kv-cache-dtype) gets each row quantized on the
// way (quantize_row), its rows kv_cache.size(4) elements wide.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

// One row quantized (tokenmill.attention.kv_cache_quant.quantize_kv, which this follows bit for bit): int8 codes
// round_half_even(x / scale) with scale = absmax / 127 (1 for an all-zero row), zero padding to `row` - 4 bytes,
// then the scale; fp8 values clamped to the format's largest finite value, then rounded to nearest-even (c10's
// conversions, which torch's casts use). The absolute maximum and the division and rounding are vectorized
// (AVX-512 / AVX2 through ATen's Vectorized); the codes are stored one by one (exact: whole numbers in
// [-127, 127]).
template <typename TS, typename TC>
void quantize_row(const TS* src, int64_t head_size, int64_t row, TC* dst, float* buf) {
  for (int64_t i = 0; i < head_size; ++i) buf[i] = static_cast<float>(src[i]);
  if constexpr (std::is_same_v<TC, int8_t>) {
    const int64_t vec_end = head_size - head_size % W;
    Vec vmax(0.f);
    for (int64_t i = 0; i < vec_end; i += W) vmax = at::vec::maximum(vmax, Vec::loadu(buf + i).abs());
    float absmax = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
    for (int64_t i = vec_end; i < head_size; ++i) absmax = std::max(absmax, std::abs(buf[i]));
    float scale = absmax / 127.f;
    if (!(scale > 0.f)) scale = 1.f;
    const Vec vscale(scale), lo(-127.f), hi(127.f);
    for (int64_t i = 0; i < vec_end; i += W)
      at::vec::clamp(((Vec::loadu(buf + i) / vscale).round()), lo, hi).store(buf + i);
    for (int64_t i = vec_end; i < head_size; ++i) buf[i] = std::clamp(std::nearbyint(buf[i] / scale), -127.f, 127.f);
    for (int64_t i = 0; i < head_size; ++i) dst[i] = static_cast<int8_t>(buf[i]);
    std::fill(dst + head_size, dst + row - static_cast<int64_t>(sizeof(float)), int8_t{0});
    std::memcpy(dst + row - static_cast<int64_t>(sizeof(float)), &scale, sizeof(float));
  } else {
    constexpr float limit = std::is_same_v<TC, c10::Float8_e4m3fn> ? 448.f : 57344.f;
    for (int64_t i = 0; i < head_size; ++i) dst[i] = TC(std::clamp(buf[i], -limit, limit));
  }
}

template <typename TS, typename TC>
void write_rows(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const int64_t* slots) {
  const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), head_size = k.size(2);
  const int64_t head_rows = kv_cache.size(2) * kv_cache.size(3);  // slots per KV head
  const int64_t row = kv_cache.size(4);  // elements per cache row (head_size, or an int8 row's codes and scale)
  const TS* k_ptr = k.const_data_ptr<TS>();
  const TS* v_ptr = v.const_data_ptr<TS>();
  TC* cache = kv_cache.data_ptr<TC>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  constexpr bool kQuantized = std::is_same_v<TC, int8_t> || std::is_same_v<TC, c10::Float8_e4m3fn>
                              || std::is_same_v<TC, c10::Float8_e5m2>;
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kQuantized ? head_size : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // a padding row (graph replay): nothing to write
      for (int64_t kv = 0; kv < 2; ++kv) {
        const TS* src = kv == 0 ? k_ptr + t * ks0 : v_ptr + t * vs0;
        const int64_t hs = kv == 0 ? ks1 : vs1;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          TC* dst = cache + ((kv * num_kv_heads + h) * head_rows + slot) * row;
          const TS* in = src + h * hs;
          if constexpr (kQuantized) {
            quantize_row(in, head_size, row, dst, buf.data());
          } else if constexpr (std::is_same_v<TS, TC>) {
            std::memcpy(dst, in, head_size * sizeof(TC));
          } else {
            for (int64_t i = 0; i < head_size; ++i) dst[i] = static_cast<TC>(static_cast<float>(in[i]));
          }
        }
      }
    }
  });
}

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must be [T, Hkv, D] tensors of one shape with contiguous rows, got ", k.sizes(), " and ",
              v.sizes());
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "k and v must have one dtype");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, Hkv, num_blocks, block_size, D] tensor");
  const at::ScalarType cache_type = kv_cache.scalar_type();
  // int8 rows: the codes padded to a multiple of 4 bytes, then the float32 scale (kv_cache_quant.kv_cache_row_size).
  const int64_t row = cache_type == at::kChar ? (k.size(2) + 3) / 4 * 4 + 4 : k.size(2);
  TORCH_CHECK(kv_cache.size(1) == k.size(1) && kv_cache.size(4) == row,
              "kv_cache's KV heads and head size must match k's (rows of ", row, " elements for head size ", k.size(2),
              "), got ", kv_cache.sizes(), " for ", k.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous()
                  && slot_mapping.size(0) == k.size(0),
              "slot_mapping must be a contiguous [T] int64 tensor, one slot for each of k's ", k.size(0), " rows");
  const bool same = cache_type == k.scalar_type();
  const bool narrowed = k.scalar_type() == at::kFloat && (cache_type == at::kBFloat16 || cache_type == at::kHalf);
  const bool quantized = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2;
  TORCH_CHECK(same || narrowed || quantized,
              "kv_cache must have k's dtype, be bfloat16 / float16 under float32 k, or be int8 / float8_e4m3fn / "
              "float8_e5m2");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t capacity = kv_cache.size(2) * kv_cache.size(3);
  for (int64_t t = 0; t < k.size(0); ++t) {  // before any write: a bad slot fails the call and changes nothing
    TORCH_CHECK(slots[t] < capacity, "slot_mapping[", t, "] = ", slots[t], " is outside the cache's ", capacity,
                " slots");
  }
  if (quantized) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cache", [&] {
      if (cache_type == at::kChar) {
        write_rows<scalar_t, int8_t>(k, v, kv_cache, slots);
      } else if (cache_type == at::kFloat8_e4m3fn) {
        write_rows<scalar_t, c10::Float8_e4m3fn>(k, v, kv_cache, slots);
      } else {
        write_rows<scalar_t, c10::Float8_e5m2>(k, v, kv_cache, slots);
      }
    });
  } else if (same) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cache", [&] {
      write_rows<scalar_t, scalar_t>(k, v, kv_cache, slots);
    });
  } else {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(kv_cache.scalar_type(), "write_kv_cache", [&] {
      write_rows<float, scalar_t>(k, v, kv_cache, slots);
    });
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("write_kv_cache", &write_kv_cache);
}
