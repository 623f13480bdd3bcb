// LoRA adapters' share of a product for a step whose rows have different adapters, in one op
// (Punica's BGMV shape: an adapter slot per row). Torch needs a gather, two batched products
// and a scatter for it, each a pass over the step's rows.
//
// octavo_cpu::add_lora_(out, x, lora_a, lora_b, token_slots) -> ():
//   out          [T, N], rows contiguous: the base product's output, added to in place
//   x            [T, K], rows contiguous: the product's input
//   lora_a       [S, K, R] contiguous: each slot's A transposed, zero-padded to rank R
//   lora_b       [S, R, N] contiguous: each slot's B transposed, the scaling folded in
//   token_slots  int64 [T]: each row's slot, -1 for a row of no adapter (left unchanged)
// out[t] += (x[t] @ lora_a[s]) @ lora_b[s] for s = token_slots[t], in float32 whatever the
// storage dtype. Rows are grouped by slot, and in each group taken kRowBlock at a time: a
// block reads each row of its slot's factors once for all its rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "vec16.h"

namespace {

// Rows a block computes together: each factor row loaded serves kRowBlock rows, and a
// block's accumulators (kRowBlock x kTileVectors x 16 floats) fill 16 AVX-512 registers.
constexpr int64_t kRowBlock = 8;
constexpr int64_t kTileVectors = 2;
constexpr int64_t kLanes = 16;

// A block: up to kRowBlock rows of one slot, as positions in the grouped row order.
struct Block {
  int64_t first;  // into the grouped order
  int64_t rows;
  int64_t slot;
};

// shrunk[q] = x[row q of the block] @ lora_a[slot] for the block's rows, kLanes ranks at a
// time, from the rows converted to float once (`rows`, kRowBlock x in_features: a missing
// row is zeros).
template <typename scalar_t>
void shrink(const Block& block, const int64_t* order, const scalar_t* x, int64_t x_stride,
            const scalar_t* lora_a, int64_t rank, int64_t in_features, std::vector<float>& rows,
            float* shrunk) {
  rows.assign(kRowBlock * in_features, 0.0f);
  for (int64_t q = 0; q < block.rows; ++q) {
    const scalar_t* xq = x + order[block.first + q] * x_stride;
#pragma omp simd
    for (int64_t k = 0; k < in_features; ++k) rows[q * in_features + k] = to_float(xq[k]);
  }
  const scalar_t* a = lora_a + block.slot * in_features * rank;
  for (int64_t r = 0; r < rank; r += kLanes) {
    Vec16 acc[kRowBlock];
    for (int64_t q = 0; q < kRowBlock; ++q) acc[q] = Vec16::zero();
    for (int64_t k = 0; k < in_features; ++k) {
      const Vec16 ak = Vec16::load(a + k * rank + r);
      for (int64_t q = 0; q < kRowBlock; ++q) {
        acc[q] = acc[q].fma(Vec16::broadcast(rows[q * in_features + k]), ak);
      }
    }
    for (int64_t q = 0; q < block.rows; ++q) acc[q].store(shrunk + q * rank + r);
  }
}

// out[rows of the block, columns [col, col + kVectors * kLanes)] += shrunk rows @ lora_b[slot]
// there.
template <typename scalar_t, int64_t kVectors>
void expand(const Block& block, const int64_t* order, const float* shrunk,
            const scalar_t* lora_b, int64_t rank, int64_t out_features, int64_t col,
            scalar_t* out, int64_t out_stride) {
  Vec16 acc[kRowBlock][kVectors];
  for (int64_t q = 0; q < kRowBlock; ++q) {
    for (int64_t j = 0; j < kVectors; ++j) acc[q][j] = Vec16::zero();
  }
  const scalar_t* b = lora_b + block.slot * rank * out_features + col;
  for (int64_t r = 0; r < rank; ++r) {
    Vec16 br[kVectors];
    for (int64_t j = 0; j < kVectors; ++j) br[j] = Vec16::load(b + r * out_features + j * kLanes);
    for (int64_t q = 0; q < kRowBlock; ++q) {
      const Vec16 h = Vec16::broadcast(shrunk[q * rank + r]);
      for (int64_t j = 0; j < kVectors; ++j) acc[q][j] = acc[q][j].fma(h, br[j]);
    }
  }
  for (int64_t q = 0; q < block.rows; ++q) {
    scalar_t* row = out + order[block.first + q] * out_stride + col;
    for (int64_t j = 0; j < kVectors; ++j) {
      (Vec16::load(row + j * kLanes) + acc[q][j]).store(row + j * kLanes);
    }
  }
}

// The columns past the last whole vector, one at a time.
template <typename scalar_t>
void expand_tail(const Block& block, const int64_t* order, const float* shrunk,
                 const scalar_t* lora_b, int64_t rank, int64_t out_features, int64_t col,
                 scalar_t* out, int64_t out_stride) {
  const scalar_t* b = lora_b + block.slot * rank * out_features;
  for (int64_t q = 0; q < block.rows; ++q) {
    scalar_t* row = out + order[block.first + q] * out_stride;
    for (int64_t n = col; n < out_features; ++n) {
      float sum = to_float(row[n]);
      for (int64_t r = 0; r < rank; ++r) sum += shrunk[q * rank + r] * to_float(b[r * out_features + n]);
      row[n] = static_cast<scalar_t>(sum);
    }
  }
}

template <typename scalar_t>
void run_blocks(const std::vector<Block>& blocks, const int64_t* order, const at::Tensor& x,
                const at::Tensor& lora_a, const at::Tensor& lora_b, at::Tensor& out) {
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  const int64_t rank = lora_a.size(2), in_features = x.size(1), out_features = out.size(1);
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  const scalar_t* a_ptr = lora_a.data_ptr<scalar_t>();
  const scalar_t* b_ptr = lora_b.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  std::vector<float> shrunk(num_blocks * kRowBlock * rank);
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows;
    for (int64_t i = begin; i < end; ++i) {
      shrink(blocks[i], order, x_ptr, x.stride(0), a_ptr, rank, in_features, rows,
             shrunk.data() + i * kRowBlock * rank);
    }
  });
  // A task per (block, column tile), each writing its own part of out; the last tile of
  // each block also takes the columns past the last whole vector.
  constexpr int64_t kTile = kTileVectors * kLanes;
  const int64_t vectors = out_features / kLanes;
  const int64_t tiles = std::max<int64_t>((vectors + kTileVectors - 1) / kTileVectors, 1);
  at::parallel_for(0, num_blocks * tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / tiles, tile = task % tiles, col = tile * kTile;
      const float* h = shrunk.data() + i * kRowBlock * rank;
      const int64_t tile_vectors = std::min(kTileVectors, vectors - tile * kTileVectors);
      auto run = tile_vectors == 2 ? expand<scalar_t, 2> : expand<scalar_t, 1>;
      if (tile_vectors > 0) {
        run(blocks[i], order, h, b_ptr, rank, out_features, col, out_ptr, out.stride(0));
      }
      if (tile == tiles - 1 && vectors * kLanes < out_features) {
        expand_tail(blocks[i], order, h, b_ptr, rank, out_features, vectors * kLanes, out_ptr,
                    out.stride(0));
      }
    }
  });
}

void add_lora_(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a,
               const at::Tensor& lora_b, const at::Tensor& token_slots) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.stride(1) == 1 && x.stride(1) == 1,
              "out [T, N] and x [T, K] with contiguous rows");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3 && lora_a.is_contiguous() &&
                  lora_b.is_contiguous(),
              "lora_a [S, K, R] and lora_b [S, R, N] contiguous");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.is_contiguous(),
              "token_slots int64, contiguous");
  const int64_t num_tokens = out.size(0), out_features = out.size(1), in_features = x.size(1);
  const int64_t num_slots = lora_a.size(0), rank = lora_a.size(2);
  TORCH_CHECK(x.size(0) == num_tokens && token_slots.numel() == num_tokens, "T rows each");
  TORCH_CHECK(lora_a.size(1) == in_features && lora_b.size(0) == num_slots &&
                  lora_b.size(1) == rank && lora_b.size(2) == out_features,
              "factor shapes");
  TORCH_CHECK(rank % kLanes == 0, "the factors' rank is padded to a multiple of 16");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && lora_a.scalar_type() == out.scalar_type() &&
                  lora_b.scalar_type() == out.scalar_type(),
              "out, x and the factors share a dtype");
  // The rows grouped by slot (a counting sort), then cut into blocks.
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  std::vector<int64_t> starts(num_slots + 1, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "token_slots: a slot or -1");
    if (slots[t] >= 0) ++starts[slots[t] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) starts[s + 1] += starts[s];
  std::vector<int64_t> order(starts[num_slots]);
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] >= 0) order[next[slots[t]]++] = t;
  }
  std::vector<Block> blocks;
  for (int64_t s = 0; s < num_slots; ++s) {
    for (int64_t first = starts[s]; first < starts[s + 1]; first += kRowBlock) {
      blocks.push_back({first, std::min(kRowBlock, starts[s + 1] - first), s});
    }
  }
  switch (out.scalar_type()) {
    case at::kFloat: return run_blocks<float>(blocks, order.data(), x, lora_a, lora_b, out);
    case at::kBFloat16:
      return run_blocks<c10::BFloat16>(blocks, order.data(), x, lora_a, lora_b, out);
    case at::kHalf: return run_blocks<c10::Half>(blocks, order.data(), x, lora_a, lora_b, out);
    default: TORCH_CHECK(false, "add_lora_: float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(octavo_cpu, m) {
  m.def("add_lora_(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_b, Tensor token_slots) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(octavo_cpu, CPU, m) { m.impl("add_lora_", add_lora_); }
