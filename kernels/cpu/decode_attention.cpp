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

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "float_cast.h"

namespace {

// Rows ahead of the one being read that a task asks the memory for: a row's compute is too
// short for the hardware prefetcher, which also stops at each block's end.
constexpr int64_t kPrefetchRows = 6;
constexpr int64_t kCacheLine = 64;

template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t bytes) {
  const char* start = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += kCacheLine) {
    __builtin_prefetch(start + offset, 0, 2);
  }
}

// Key position p's row in `cache` (its heads from kv_offset on), the row kPrefetchRows ahead
// asked of the memory on the way.
template <typename scalar_t>
inline const scalar_t* row_at(const scalar_t* cache, const int64_t* slots, int64_t p,
                              int64_t seq_len, int64_t slot_stride, int64_t kv_offset,
                              int64_t row_bytes) {
  if (p + kPrefetchRows < seq_len) {
    prefetch_row(cache + slots[p + kPrefetchRows] * slot_stride + kv_offset, row_bytes);
  }
  return cache + slots[p] * slot_stride + kv_offset;
}

// One task: sequence `n`'s query heads [kv_begin * G, kv_end * G), which read K/V heads
// [kv_begin, kv_end). Per key position the task reads those heads' part of the slot's row,
// contiguous, so that a task over all heads streams through each block of the cache.
// kHeadDim: the head size known when compiled (64, GPT-2's: loops of fixed length, which
// the compiler unrolls), or 0 for `dynamic_head_dim`.
template <typename scalar_t, int64_t kHeadDim>
void decode_task(const scalar_t* q, int64_t q_head_stride, const scalar_t* k_cache,
                 const scalar_t* v_cache, int64_t slot_stride, const int64_t* slots,
                 int64_t seq_len, int64_t kv_begin, int64_t kv_end, int64_t group,
                 int64_t dynamic_head_dim, float scale, scalar_t* out, int64_t out_head_stride,
                 std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& query) {
  const int64_t head_dim = kHeadDim ? kHeadDim : dynamic_head_dim;
  const int64_t heads = (kv_end - kv_begin) * group;
  const int64_t first = kv_begin * group;  // the task's first query head
  scores.resize(heads * seq_len);
  acc.assign(heads * head_dim, 0.0f);
  query.resize(heads * head_dim);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < head_dim; ++d) {
      query[h * head_dim + d] = to_float(q[(first + h) * q_head_stride + d]) * scale;
    }
  }
  const int64_t kv_offset = kv_begin * head_dim;
  const int64_t row_bytes = (kv_end - kv_begin) * head_dim * sizeof(scalar_t);
  // Pass 1: the scores.
  for (int64_t p = 0; p < seq_len; ++p) {
    const scalar_t* row = row_at(k_cache, slots, p, seq_len, slot_stride, kv_offset, row_bytes);
    for (int64_t h = 0; h < heads; ++h) {
      const scalar_t* key = row + (h / group) * head_dim;
      const float* qh = query.data() + h * head_dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) {
        dot += qh[d] * to_float(key[d]);
      }
      scores[h * seq_len + p] = dot;
    }
  }
  // Softmax weights, unnormalized: exp(score - the head's largest).
  std::vector<float> total(heads);
  for (int64_t h = 0; h < heads; ++h) {
    float* row = scores.data() + h * seq_len;
    const float top = *std::max_element(row, row + seq_len);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t p = 0; p < seq_len; ++p) {
      row[p] = std::exp(row[p] - top);
      sum += row[p];
    }
    total[h] = sum;
  }
  // Pass 2: the weighted values.
  for (int64_t p = 0; p < seq_len; ++p) {
    const scalar_t* row = row_at(v_cache, slots, p, seq_len, slot_stride, kv_offset, row_bytes);
    for (int64_t h = 0; h < heads; ++h) {
      const scalar_t* value = row + (h / group) * head_dim;
      const float weight = scores[h * seq_len + p];
      float* a = acc.data() + h * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) {
        a[d] += weight * to_float(value[d]);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inverse = 1.0f / total[h];
    for (int64_t d = 0; d < head_dim; ++d) {
      out[(first + h) * out_head_stride + d] = static_cast<scalar_t>(acc[h * head_dim + d] * inverse);
    }
  }
}

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
            auto run = head_dim == 64 ? decode_task<scalar_t, 64> : decode_task<scalar_t, 0>;
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
