// Per-row (per-token) symmetric int8 quantization of a step's activations, and the rescaling
// of an int8 product's rows, each one op where torch takes several small ones (the
// difference is most of a layer's work at one row; quantization.py has the scheme).
//
// octavo_cpu::quantize_rows(x [R, C]) -> (q uint8 [R, C], scale float32 [R, 1]):
//   scale = max |x[r]| / 127 (a tiny positive number for an all-zero row),
//   q = round(x / scale) + 128, as torch.round (half to even): symmetric codes stored
//   unsigned, zero point 128 (quantization.py says why).
// octavo_cpu::rescale_rows_(out [R, N], scale float32 [R, 1], bias [N]?) -> ():
//   out[r] = out[r] * scale[r] + bias, in place, computed in float32.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "row_quantize.h"

namespace {

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x [R, C] with contiguous rows");
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor q = at::empty({rows, cols}, x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  uint8_t* q_ptr = q.data_ptr<uint8_t>();
  float* scale_ptr = scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    const scalar_t* x_ptr = x.data_ptr<scalar_t>();
    const int64_t row_stride = x.stride(0);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scale_ptr[r] = quantize_row(x_ptr + r * row_stride, cols, q_ptr + r * cols);
      }
    });
  });
  return {q, scale};
}

void rescale_rows_(at::Tensor& out, const at::Tensor& scale,
                   const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1, "out [R, N] with contiguous rows");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() >= out.size(0), "scale");
  const int64_t rows = out.size(0), cols = out.size(1);
  const float* scale_ptr = scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "rescale_rows_", [&] {
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const scalar_t* bias_ptr = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    const int64_t row_stride = out.stride(0);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = out_ptr + r * row_stride;
        const float s = scale_ptr[r];
        for (int64_t c = 0; c < cols; ++c) {
          const float b = bias_ptr ? static_cast<float>(bias_ptr[c]) : 0.0f;
          row[c] = static_cast<scalar_t>(static_cast<float>(row[c]) * s + b);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(octavo_cpu, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("rescale_rows_(Tensor(a!) out, Tensor scale, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(octavo_cpu, CPU, m) {
  m.impl("quantize_rows", quantize_rows);
  m.impl("rescale_rows_", rescale_rows_);
}
