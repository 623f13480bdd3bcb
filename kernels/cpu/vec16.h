// Sixteen floats in one register, loaded from and stored to each storage dtype, for kernels
// whose register blocking the compiler will not find on its own: AVX-512 where the build's
// CPU has it, else a float[16] whose loops the compiler vectorizes as it can.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "float_cast.h"

#if defined(__AVX512F__)
#include <immintrin.h>

struct Vec16 {
  __m512 v;
  static Vec16 zero() { return {_mm512_setzero_ps()}; }
  static Vec16 broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec16 load(const c10::BFloat16* p) {  // bfloat16 is a float's top half
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16))};
  }
  static Vec16 load(const c10::Half* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  // this + a * b
  Vec16 fma(Vec16 a, Vec16 b) const { return {_mm512_fmadd_ps(a.v, b.v, v)}; }
  Vec16 operator+(Vec16 other) const { return {_mm512_add_ps(v, other.v)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(c10::BFloat16* p) const {  // rounded to nearest even, as c10's conversion
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  }
  void store(c10::Half* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

#else

struct Vec16 {
  float v[16];
  static Vec16 zero() { return broadcast(0.0f); }
  static Vec16 broadcast(float x) {
    Vec16 out;
    for (int i = 0; i < 16; ++i) out.v[i] = x;
    return out;
  }
  template <typename scalar_t>
  static Vec16 load(const scalar_t* p) {
    Vec16 out;
    for (int i = 0; i < 16; ++i) out.v[i] = to_float(p[i]);
    return out;
  }
  Vec16 fma(Vec16 a, Vec16 b) const {
    Vec16 out;
    for (int i = 0; i < 16; ++i) out.v[i] = v[i] + a.v[i] * b.v[i];
    return out;
  }
  Vec16 operator+(Vec16 other) const {
    Vec16 out;
    for (int i = 0; i < 16; ++i) out.v[i] = v[i] + other.v[i];
    return out;
  }
  template <typename scalar_t>
  void store(scalar_t* p) const {
    for (int i = 0; i < 16; ++i) p[i] = static_cast<scalar_t>(v[i]);
  }
};

#endif
