// Paged decode attention on a CPU, reading each sequence's keys and values where they lie
// in the cache: no gathered copy of them (what plain torch must make) is ever written.
//
// octavo_cpu::decode_attention(q, k_cache, v_cache, key_slots, seq_lens, scale, out):
//   q, out     [N, H, D]: one query token per sequence (q may be a strided view; D contiguous)
//   k_cache,   [num_slots, H_kv, D] contiguous: a layer's cache, block-major slots
//   v_cache
//   key_slots  int64 [N, >= max seq_len]: the cache slot of each key position
//   seq_lens   int32 [N]: keys per sequence, this step's included (already stored)
// out[n, h] = softmax(q[n, h] . K[n, h // G]^T * scale) V[n, h // G], G = H / H_kv, in float32
// whatever the storage dtype. Work is split on torch's intra-op threads into a task per
// sequence (all its heads), or per (sequence, K/V head) when sequences are few; a task reads
// each key once for all G query heads sharing it.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "decode_attention.h"

namespace {

void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& key_slots, const at::Tensor& seq_lens, double scale,
                      at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 3,
              "q, out [N, H, D]; cache [slots, H_kv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out: head_dim contiguous");
  TORCH_CHECK(key_slots.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kInt,
              "key_slots int64, seq_lens int32");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, cache and out share a dtype");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(2) == head_dim, "head shapes");
  const int64_t group = num_heads / num_kv_heads;
  // A task per sequence streams through its blocks; with fewer sequences than a few per
  // thread, a task per K/V head keeps every thread busy instead.
  const int64_t kv_per_task =
      num_seqs >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / kv_per_task;
  const int64_t slot_stride = k_cache.stride(0);
  const int64_t* slots = key_slots.data_ptr<int64_t>();
  const int64_t slots_row = key_slots.stride(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
        const scalar_t* q_ptr = q.data_ptr<scalar_t>();
        const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
        const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
        scalar_t* out_ptr = out.data_ptr<scalar_t>();
        at::parallel_for(0, num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
          std::vector<float> scores, acc, query;
          for (int64_t task = begin; task < end; ++task) {
            const int64_t n = task / tasks_per_seq;
            const int64_t kv_begin = (task % tasks_per_seq) * kv_per_task;
            auto run = head_dim == 64 ? decode_task<scalar_t, 64, scalar_t, scalar_t>
                                      : decode_task<scalar_t, 0, scalar_t, scalar_t>;
            run(q_ptr + n * q.stride(0), q.stride(1), k_ptr, v_ptr, slot_stride,
                        slots + n * slots_row, lens[n], kv_begin, kv_begin + kv_per_task,
                        group, head_dim, static_cast<float>(scale),
                        out_ptr + n * out.stride(0), out.stride(1), scores, acc, query);
          }
        });
      });
}

}  // namespace

TORCH_LIBRARY(octavo_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor key_slots, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(octavo_cpu, CPU, m) { m.impl("decode_attention", decode_attention); }
