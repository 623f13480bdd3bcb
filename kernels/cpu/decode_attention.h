// One decode-attention task over the paged cache (a sequence's query heads of some K/V
// heads), shared by the decode_attention op and the fused decode step (gpt2_decode.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "float_cast.h"

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
template <typename scalar_t, int64_t kHeadDim, typename q_t, typename out_t>
void decode_task(const q_t* q, int64_t q_head_stride, const scalar_t* k_cache,
                 const scalar_t* v_cache, int64_t slot_stride, const int64_t* slots,
                 int64_t seq_len, int64_t kv_begin, int64_t kv_end, int64_t group,
                 int64_t dynamic_head_dim, float scale, out_t* out, int64_t out_head_stride,
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
      out[(first + h) * out_head_stride + d] = static_cast<out_t>(acc[h * head_dim + d] * inverse);
    }
  }
}
