// One row's per-token symmetric int8 quantization (quantization.py has the scheme), shared
// by quantize_rows and the small-row products that quantize their own input.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "float_cast.h"

constexpr float kInt8Max = 127.0f;
constexpr float kCodeZeroPoint = 128.0f;

// codes[c] = round(row[c] / scale) + 128 (half to even, as torch.round) for c < cols; returns
// scale = max |row| / 127, a tiny positive number for an all-zero row.
template <typename scalar_t>
inline float quantize_row(const scalar_t* row, int64_t cols, uint8_t* codes) {
  float top = 0.0f;
  for (int64_t c = 0; c < cols; ++c) {
    top = std::max(top, std::abs(to_float(row[c])));
  }
  const float s = std::max(top, std::numeric_limits<float>::min()) / kInt8Max;
  // An all-zero row's tiny scale has no finite inverse: its codes are the zero point
  // (0 x inf would be NaN, whose conversion to an integer is undefined).
  const float inverse = top > 0.0f ? std::min(1.0f / s, std::numeric_limits<float>::max()) : 0.0f;
  for (int64_t c = 0; c < cols; ++c) {
    const float code = std::nearbyint(to_float(row[c]) * inverse);
    codes[c] = static_cast<uint8_t>(code + kCodeZeroPoint);
  }
  return s;
}
