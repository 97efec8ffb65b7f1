// The paged KV cache write: each new token's key and value rows copied into its cache slot.
//
// Layout (tokenmill's torch_paged backend): kv_cache [2, Hkv, num_blocks, block_size, D], keys then values;
// slot s of KV head h is row s of that head's [num_blocks * block_size, D] run. The torch backend writes with
// one indexed assignment of the stacked keys and values; under torch.compile that becomes a serial copy of the
// stack followed by a scatter parallel over the two halves only, and eagerly a stack plus index_put_. Here every
// (token, K or V, head) row is one copy, read from q/k/v's projection output in place (any row and head stride),
// split between threads by token: about half the compiled copy's time in a 1,968-token mixed step, no measurable
// difference in 256-request decode steps (python benchmarks/prefill_attention.py; docs/benchmarks-history.md,
// "2026-12-03 Xeon (89db59a)").

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

namespace {

template <typename TS, typename TC>
void write_rows(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const int64_t* slots) {
  const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), head_size = k.size(2);
  const int64_t head_rows = kv_cache.size(2) * kv_cache.size(3);  // slots per KV head
  const TS* k_ptr = k.const_data_ptr<TS>();
  const TS* v_ptr = v.const_data_ptr<TS>();
  TC* cache = kv_cache.data_ptr<TC>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // a padding row (graph replay): nothing to write
      for (int64_t kv = 0; kv < 2; ++kv) {
        const TS* src = kv == 0 ? k_ptr + t * ks0 : v_ptr + t * vs0;
        const int64_t hs = kv == 0 ? ks1 : vs1;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          TC* dst = cache + ((kv * num_kv_heads + h) * head_rows + slot) * head_size;
          const TS* row = src + h * hs;
          if constexpr (std::is_same_v<TS, TC>) {
            std::memcpy(dst, row, head_size * sizeof(TC));
          } else {
            for (int64_t i = 0; i < head_size; ++i) dst[i] = static_cast<TC>(static_cast<float>(row[i]));
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
  TORCH_CHECK(kv_cache.size(1) == k.size(1) && kv_cache.size(4) == k.size(2),
              "kv_cache's KV heads and head size must match k's, got ", kv_cache.sizes(), " for ", k.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous()
                  && slot_mapping.size(0) == k.size(0),
              "slot_mapping must be a contiguous [T] int64 tensor, one slot for each of k's ", k.size(0), " rows");
  const bool same = kv_cache.scalar_type() == k.scalar_type();
  const bool narrowed = k.scalar_type() == at::kFloat
                        && (kv_cache.scalar_type() == at::kBFloat16 || kv_cache.scalar_type() == at::kHalf);
  TORCH_CHECK(same || narrowed, "kv_cache must have k's dtype, or be bfloat16 / float16 under float32 k");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t capacity = kv_cache.size(2) * kv_cache.size(3);
  for (int64_t t = 0; t < k.size(0); ++t) {  // before any write: a bad slot fails the call and changes nothing
    TORCH_CHECK(slots[t] < capacity, "slot_mapping[", t, "] = ", slots[t], " is outside the cache's ", capacity,
                " slots");
  }
  if (same) {
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
