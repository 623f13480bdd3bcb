// Products of a few rows (a small decode batch, up to kMaxRows) by a weight packed for them.
// At one row a product reads each weight once and does two flops per weight read: it runs
// as fast as the weight streams from memory, so the kernel's job is to keep the loads going
// (several column blocks in flight, one weight load serving every row) and nothing else.
//
// Packed layouts (kernels/small_gemm.py packs them; N is padded to a multiple of kColumns
// with zero columns, K to the layout's multiple with zero rows):
//   bfloat16  [N / 16, K2 / 2, 16, 2]: block b, k pair p holds columns 16b..16b+15, each
//             with its two weights of rows 2p, 2p+1 side by side: what one vdpbf16ps
//             multiplies by a broadcast pair of x's values (K2 = K rounded up to 2);
//   int8      [N / 16, K4 / 4, 16, 4]: the same with four rows, for vpdpbusd, which
//             multiplies x's unsigned codes (four at a time) by the signed weights (K4 = K
//             rounded up to 4). The product of codes offset by 128 (quantization.py's zero
//             point) is corrected by 128 x the column's code sum, exactly, in int32.
//
// The functions below compute the columns of blocks [block_begin, block_end) for `rows`
// rows; callers split the blocks between threads. Where the build's CPU lacks the vector
// instructions (AVX512-BF16, AVX512-VNNI), the same layouts are computed by plain loops:
// correct, slower; kernels/small_gemm.py's `kernel_isa` tells the engine which it has.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define OCTAVO_SMALL_GEMM_BF16 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define OCTAVO_SMALL_GEMM_INT8 1
#endif
#if defined(OCTAVO_SMALL_GEMM_BF16) || defined(OCTAVO_SMALL_GEMM_INT8)
#include <immintrin.h>
#endif

namespace small_gemm {

constexpr int64_t kColumns = 16;  // columns of a block: one 512-bit register of float32
constexpr int kMaxRows = 8;
constexpr int32_t kZeroPoint = 128;
// K groups (pairs or quads) ahead of the ones being read that a tile asks the memory for, in
// each of its column blocks: at several rows a tile computes long enough between loads that
// the hardware prefetcher falls behind (at 8 rows the products ran at half the speed).
constexpr int64_t kPrefetchGroups = 32;

// Column blocks a tile computes at once, for `rows` rows: as many accumulators (rows x
// blocks) as the 32 vector registers hold beside x's broadcasts (one a row) and a loaded
// weight; at most eight (eight independent chains already keep the units busy at one row).
constexpr int tile_blocks(int rows) { return std::max(1, std::min(8, (30 - rows) / rows)); }

// out[r * out_stride + n] = bias[n] + sum_k x[r, k] w[k, n] in float32, for the tile's
// columns. x [rows, >= K2] bfloat16 bits, rows x_stride apart; w the packed weight.
struct Bf16Args {
  const uint16_t* x;
  int64_t x_stride;
  const uint16_t* w;
  int64_t k_pairs;      // K2 / 2
  const float* bias;    // [N padded] or nullptr
  float* out;
  int64_t out_stride;
};

// out[r * out_stride + n] = (sum_k (x[r, k] - 128) w[k, n]) * x_scale[r] * w_scale[n]
// + bias[n]: x's unsigned codes [rows, >= K4] rows x_stride apart; code_sums128[n] = 128 x
// the column's sum of codes.
struct Int8Args {
  const uint8_t* x;
  int64_t x_stride;
  const int8_t* w;
  int64_t k_quads;      // K4 / 4
  const float* x_scale;
  const float* w_scale;
  const int32_t* code_sums128;
  const float* bias;    // [N padded] or nullptr
  float* out;
  int64_t out_stride;
};

#if defined(OCTAVO_SMALL_GEMM_BF16)

template <int R, int CB>
inline void bf16_tile(const Bf16Args& a, int64_t block) {
  __m512 acc[R][CB];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t block_elems = a.k_pairs * 2 * kColumns;
  const uint16_t* w = a.w + block * block_elems;
  for (int64_t p = 0; p < a.k_pairs; ++p) {
    __m512bh xb[R];
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a.x + r * a.x_stride + 2 * p, sizeof pair);
      xb[r] = (__m512bh)_mm512_set1_epi32(pair);
    }
    for (int c = 0; c < CB; ++c) {
      const uint16_t* ahead = w + c * block_elems + (p + kPrefetchGroups) * 2 * kColumns;
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + c * block_elems + p * 2 * kColumns);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb[r], wv);
    }
  }
  for (int c = 0; c < CB; ++c) {
    const int64_t n = (block + c) * kColumns;
    const __m512 bias = a.bias ? _mm512_loadu_ps(a.bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(a.out + r * a.out_stride + n, _mm512_add_ps(acc[r][c], bias));
    }
  }
}

#else

template <int R, int CB>
inline void bf16_tile(const Bf16Args& a, int64_t block) {
  auto value = [](uint16_t bits) {
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &wide, sizeof f);
    return f;
  };
  const int64_t block_elems = a.k_pairs * 2 * kColumns;
  for (int c = 0; c < CB; ++c) {
    const uint16_t* w = a.w + (block + c) * block_elems;
    for (int r = 0; r < R; ++r) {
      float acc[kColumns] = {};
      for (int64_t p = 0; p < a.k_pairs; ++p) {
        const float x0 = value(a.x[r * a.x_stride + 2 * p]);
        const float x1 = value(a.x[r * a.x_stride + 2 * p + 1]);
        for (int64_t j = 0; j < kColumns; ++j) {
          acc[j] += x0 * value(w[(p * kColumns + j) * 2]) + x1 * value(w[(p * kColumns + j) * 2 + 1]);
        }
      }
      const int64_t n = (block + c) * kColumns;
      for (int64_t j = 0; j < kColumns; ++j) {
        a.out[r * a.out_stride + n + j] = acc[j] + (a.bias ? a.bias[n + j] : 0.0f);
      }
    }
  }
}

#endif

#if defined(OCTAVO_SMALL_GEMM_INT8)

template <int R, int CB>
inline void int8_tile(const Int8Args& a, int64_t block) {
  __m512i acc[R][CB];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_si512();
  const int64_t block_elems = a.k_quads * 4 * kColumns;
  const int8_t* w = a.w + block * block_elems;
  for (int64_t p = 0; p < a.k_quads; ++p) {
    __m512i xb[R];
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, a.x + r * a.x_stride + 4 * p, sizeof quad);
      xb[r] = _mm512_set1_epi32(quad);
    }
    for (int c = 0; c < CB; ++c) {
      const int8_t* ahead = w + c * block_elems + (p + kPrefetchGroups) * 4 * kColumns;
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(w + c * block_elems + p * 4 * kColumns);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], xb[r], wv);
    }
  }
  for (int c = 0; c < CB; ++c) {
    const int64_t n = (block + c) * kColumns;
    const __m512i sums = _mm512_loadu_si512(a.code_sums128 + n);
    const __m512 w_scale = _mm512_loadu_ps(a.w_scale + n);
    const __m512 bias = a.bias ? _mm512_loadu_ps(a.bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], sums));
      const __m512 scale = _mm512_mul_ps(w_scale, _mm512_set1_ps(a.x_scale[r]));
      _mm512_storeu_ps(a.out + r * a.out_stride + n, _mm512_fmadd_ps(exact, scale, bias));
    }
  }
}

#else

template <int R, int CB>
inline void int8_tile(const Int8Args& a, int64_t block) {
  const int64_t block_elems = a.k_quads * 4 * kColumns;
  for (int c = 0; c < CB; ++c) {
    const int8_t* w = a.w + (block + c) * block_elems;
    const int64_t n = (block + c) * kColumns;
    for (int r = 0; r < R; ++r) {
      int32_t acc[kColumns] = {};
      for (int64_t p = 0; p < a.k_quads; ++p) {
        for (int64_t j = 0; j < kColumns; ++j) {
          for (int64_t i = 0; i < 4; ++i) {
            acc[j] += static_cast<int32_t>(a.x[r * a.x_stride + 4 * p + i]) *
                      static_cast<int32_t>(w[(p * kColumns + j) * 4 + i]);
          }
        }
      }
      for (int64_t j = 0; j < kColumns; ++j) {
        const float exact = static_cast<float>(acc[j] - a.code_sums128[n + j]);
        a.out[r * a.out_stride + n + j] =
            exact * (a.w_scale[n + j] * a.x_scale[r]) + (a.bias ? a.bias[n + j] : 0.0f);
      }
    }
  }
}

#endif

// Blocks [begin, end) as tiles of tile_blocks(R), then single blocks.
template <int R, typename Args, void (*Full)(const Args&, int64_t), void (*One)(const Args&, int64_t)>
inline void run_blocks(const Args& a, int64_t begin, int64_t end) {
  constexpr int CB = tile_blocks(R);
  int64_t b = begin;
  for (; b + CB <= end; b += CB) Full(a, b);
  for (; b < end; ++b) One(a, b);
}

template <int R>
inline void bf16_rows(const Bf16Args& a, int64_t begin, int64_t end) {
  run_blocks<R, Bf16Args, bf16_tile<R, tile_blocks(R)>, bf16_tile<R, 1>>(a, begin, end);
}

template <int R>
inline void int8_rows(const Int8Args& a, int64_t begin, int64_t end) {
  run_blocks<R, Int8Args, int8_tile<R, tile_blocks(R)>, int8_tile<R, 1>>(a, begin, end);
}

// The product's columns of blocks [begin, end) for 1 <= rows <= kMaxRows.
inline void bf16_product(const Bf16Args& a, int rows, int64_t begin, int64_t end) {
  switch (rows) {
    case 1: return bf16_rows<1>(a, begin, end);
    case 2: return bf16_rows<2>(a, begin, end);
    case 3: return bf16_rows<3>(a, begin, end);
    case 4: return bf16_rows<4>(a, begin, end);
    case 5: return bf16_rows<5>(a, begin, end);
    case 6: return bf16_rows<6>(a, begin, end);
    case 7: return bf16_rows<7>(a, begin, end);
    default: return bf16_rows<8>(a, begin, end);
  }
}

inline void int8_product(const Int8Args& a, int rows, int64_t begin, int64_t end) {
  switch (rows) {
    case 1: return int8_rows<1>(a, begin, end);
    case 2: return int8_rows<2>(a, begin, end);
    case 3: return int8_rows<3>(a, begin, end);
    case 4: return int8_rows<4>(a, begin, end);
    case 5: return int8_rows<5>(a, begin, end);
    case 6: return int8_rows<6>(a, begin, end);
    case 7: return int8_rows<7>(a, begin, end);
    default: return int8_rows<8>(a, begin, end);
  }
}

// Thread `t` of `threads`'s share of `blocks` column blocks: [begin, end), in whole tiles
// where there are enough to go round.
inline void thread_blocks(int64_t blocks, int t, int threads, int64_t& begin, int64_t& end) {
  const int64_t per = (blocks + threads - 1) / threads;
  begin = std::min(blocks, per * t);
  end = std::min(blocks, begin + per);
}

}  // namespace small_gemm
