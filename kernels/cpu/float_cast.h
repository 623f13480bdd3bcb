// Storage dtype -> float for the CPU operators: bfloat16 by its bits (the top half of a
// float), which compilers vectorize; c10::BFloat16's own conversion goes through a function
// they do not.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

template <typename scalar_t>
inline float to_float(scalar_t x) {
  return static_cast<float>(x);
}
template <>
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
