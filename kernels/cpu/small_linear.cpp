// A linear layer's product for a few rows (up to small_gemm::kMaxRows) by its weight packed
// in small_gemm.h's layouts: the product a decode step of one to a few sequences runs at
// the speed its weight streams from memory (kernels/small_gemm.py has the Python side).
//
// octavo_cpu::small_linear_bf16(x [R, K] bfloat16, packed, bias float32 [N padded]?,
//                               out_features) -> [R, out_features] bfloat16
// octavo_cpu::small_linear_int8(x [R, K], codes, w_scale float32, code_sums128 int32,
//                               bias float32?, out_features) -> [R, out_features], x's dtype
//   x's rows quantized per token as quantize_rows does, then the int8 product, rescaled.
// Both: float32 accumulation, the result rounded once to the output dtype; x's rows
// contiguous; the columns split between torch's intra-op threads.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "row_quantize.h"
#include "small_gemm.h"

namespace {

using small_gemm::kColumns;

void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x [R, K] with contiguous rows");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= small_gemm::kMaxRows, "1 to ",
              small_gemm::kMaxRows, " rows");
}

// The float32 result [R, N padded] as [R, out_features] of `dtype`.
at::Tensor narrowed(const std::vector<float>& out, int64_t rows, int64_t padded, int64_t n,
                    at::ScalarType dtype) {
  at::Tensor result = at::empty({rows, n}, at::TensorOptions().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "small_linear_out", [&] {
    scalar_t* dst = result.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < n; ++c) dst[r * n + c] = static_cast<scalar_t>(out[r * padded + c]);
    }
  });
  return result;
}

at::Tensor small_linear_bf16(const at::Tensor& x, const at::Tensor& packed,
                             const std::optional<at::Tensor>& bias, int64_t out_features) {
  check_rows(x);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  packed.dim() == 4 && packed.size(2) == kColumns && packed.size(3) == 2 &&
                  packed.is_contiguous(),
              "bfloat16 x and a weight packed [N/16, K2/2, 16, 2]");
  const int64_t rows = x.size(0), k = x.size(1), k_pairs = packed.size(1);
  const int64_t blocks = packed.size(0), padded = blocks * kColumns;
  TORCH_CHECK(k_pairs == (k + 1) / 2 && out_features <= padded, "shapes");
  // x's rows with K padded to K2 (a zero), as the kernel reads pairs.
  std::vector<uint16_t> xs(rows * k_pairs * 2, 0);
  const uint16_t* x_ptr = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(x_ptr + r * x.stride(0), x_ptr + r * x.stride(0) + k, xs.data() + r * k_pairs * 2);
  }
  std::vector<float> out(rows * padded);
  const small_gemm::Bf16Args args{
      xs.data(), k_pairs * 2, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
      k_pairs, bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data(), padded};
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    small_gemm::bf16_product(args, static_cast<int>(rows), begin, end);
  });
  return narrowed(out, rows, padded, out_features, x.scalar_type());
}

at::Tensor small_linear_int8(const at::Tensor& x, const at::Tensor& codes,
                             const at::Tensor& w_scale, const at::Tensor& code_sums128,
                             const std::optional<at::Tensor>& bias, int64_t out_features) {
  check_rows(x);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 4 && codes.size(2) == kColumns &&
                  codes.size(3) == 4 && codes.is_contiguous(),
              "int8 codes packed [N/16, K4/4, 16, 4]");
  const int64_t rows = x.size(0), k = x.size(1), k_quads = codes.size(1);
  const int64_t blocks = codes.size(0), padded = blocks * kColumns;
  TORCH_CHECK(k_quads == (k + 3) / 4 && out_features <= padded, "shapes");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == padded &&
                  code_sums128.scalar_type() == at::kInt && code_sums128.numel() == padded,
              "w_scale float32 and code_sums128 int32, [N padded]");
  std::vector<uint8_t> xq(rows * k_quads * 4, static_cast<uint8_t>(kCodeZeroPoint));
  std::vector<float> x_scale(rows);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "small_linear_int8", [&] {
    const scalar_t* x_ptr = x.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {
      x_scale[r] = quantize_row(x_ptr + r * x.stride(0), k, xq.data() + r * k_quads * 4);
    }
  });
  std::vector<float> out(rows * padded);
  const small_gemm::Int8Args args{xq.data(), k_quads * 4, codes.data_ptr<int8_t>(), k_quads,
                                  x_scale.data(), w_scale.data_ptr<float>(),
                                  code_sums128.data_ptr<int32_t>(),
                                  bias.has_value() ? bias->data_ptr<float>() : nullptr,
                                  out.data(), padded};
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    small_gemm::int8_product(args, static_cast<int>(rows), begin, end);
  });
  return narrowed(out, rows, padded, out_features, x.scalar_type());
}

// The vector kernels this build has ("bfloat16", "int8"); the others run as plain loops.
std::vector<std::string> small_gemm_kernels() {
  std::vector<std::string> found;
#if defined(OCTAVO_SMALL_GEMM_BF16)
  found.emplace_back("bfloat16");
#endif
#if defined(OCTAVO_SMALL_GEMM_INT8)
  found.emplace_back("int8");
#endif
  return found;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(octavo_cpu, m) {
  m.def("small_linear_bf16(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("small_linear_int8(Tensor x, Tensor codes, Tensor w_scale, Tensor code_sums128, "
        "Tensor? bias, int out_features) -> Tensor");
  m.def("small_gemm_kernels() -> str[]", small_gemm_kernels);
}

TORCH_LIBRARY_IMPL(octavo_cpu, CPU, m) {
  m.impl("small_linear_bf16", small_linear_bf16);
  m.impl("small_linear_int8", small_linear_int8);
}
