// A whole GPT-2 decode step of a few sequences (up to small_gemm::kMaxRows) in one call: the
// embeddings, every block (LayerNorm, the QKV product, K/V stored into the paged cache and
// attention read in place, the output product and residual, LayerNorm, the MLP with its
// tanh GELU, the residual) and the final LayerNorm. At batch 1 a token's products take a
// few milliseconds; run op by op, the layers' small ops and the Python between them took as
// long again. Here one parallel region runs the step: the threads split each product's
// columns (small_gemm.h) and the attention's (sequence, K/V head) tasks, and meet at a
// barrier where a phase needs the previous one's whole rows.
//
// torch.classes.octavo_cpu.GPT2Decoder(tensors, dims, scales, eps), built once from the
// model (engine/worker/fused_decode.py says what each holds):
//   tensors  [wte, wpe, ln_f.weight, ln_f.bias] then per layer, 20 each: [ln_1.weight,
//            ln_1.bias, c_attn x 4, attn.c_proj x 4, ln_2.weight, ln_2.bias, c_fc x 4,
//            mlp.c_proj x 4]. A product's 4 are small_gemm.py's
//            SmallWeight: packed (bfloat16 or int8 codes), bias, w_scale, code_sums128
//            (float32 / int32, padded; an empty tensor for a bias or int8 part it has none
//            of). LayerNorm parameters float32; embeddings in the model's dtype.
//   dims     [n_layer, n_embd, n_head, n_kv_head, head_dim, inner, q_head_stride, k_base,
//            v_base, kv_head_stride]: the last four place each head's q, k and v in
//            c_attn's output (q of head h at h * q_head_stride, k of K/V head g at k_base +
//            g * kv_head_stride, v likewise from v_base).
//   scales   each layer's attention scale.
// forward(input_ids int64 [R], positions int64 [R], kv_cache [L, 2, blocks, block_size,
//         H_kv, D] of the model's dtype, slot_mapping int64 [R] (-1: store nothing),
//         block_tables int32 [R, width], seq_lens int32 [R]) -> hidden [R, n_embd], the
//         model's dtype: ln_f of the last block's residual stream. Each row is one sequence
//         decoding the token at positions[r], its K/V stored at slot_mapping[r] and its
//         attention reading the seq_lens[r] keys the block table places.
// The residual stream and every intermediate stay float32; only the products' inputs are
// rounded (to bfloat16, or quantized per token to int8) and the cache holds the model's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "decode_attention.h"
#include "row_quantize.h"
#include "small_gemm.h"

namespace {

using small_gemm::kColumns;

constexpr int64_t kTensorsPerProduct = 4;
constexpr int64_t kTensorsPerLayer = 20;
constexpr int64_t kGlobalTensors = 4;
// sqrt(2 / pi): the tanh GELU's 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
constexpr float kGeluScale = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

const float* data_or_null(const at::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

// One product's packed weight, read through raw pointers inside the parallel region.
struct Product {
  bool int8 = false;
  const void* packed = nullptr;
  int64_t groups = 0;   // k pairs (bfloat16) or quads (int8)
  int64_t blocks = 0;   // column blocks of 16
  const float* bias = nullptr;
  const float* w_scale = nullptr;
  const int32_t* code_sums128 = nullptr;

  Product() = default;
  explicit Product(const at::Tensor* t) {  // t[0..3]: packed, bias, w_scale, code_sums128
    TORCH_CHECK(t[0].dim() == 4 && t[0].size(2) == kColumns && t[0].is_contiguous(),
                "a packed weight [N/16, groups, 16, 2 or 4]");
    int8 = t[0].scalar_type() == at::kChar;
    TORCH_CHECK(int8 ? t[0].size(3) == 4 : (t[0].scalar_type() == at::kBFloat16 && t[0].size(3) == 2),
                "bfloat16 pairs or int8 quads");
    packed = t[0].data_ptr();
    blocks = t[0].size(0);
    groups = t[0].size(1);
    bias = data_or_null(t[1]);
    if (int8) {
      TORCH_CHECK(t[2].numel() == blocks * kColumns && t[3].numel() == blocks * kColumns,
                  "int8 scales and code sums, one per padded column");
      w_scale = t[2].data_ptr<float>();
      code_sums128 = t[3].data_ptr<int32_t>();
    }
  }

  int64_t padded_in() const { return groups * (int8 ? 4 : 2); }
  int64_t padded_out() const { return blocks * kColumns; }
};

struct Layer {
  const float* ln1_w;
  const float* ln1_b;
  Product attn, proj;
  const float* ln2_w;
  const float* ln2_b;
  Product fc, mproj;
  float scale;
};

// A product's input rows: bfloat16 bits or unsigned codes with per-row scales, K padded.
struct Inputs {
  std::vector<uint16_t> bf16;
  std::vector<uint8_t> codes;
  std::vector<float> scale;
  int64_t stride = 0;
};

inline uint16_t bf16_bits(float x) {
  return c10::BFloat16(x).x;  // rounded to nearest even
}

void layer_norm(const float* x, int64_t n, const float* w, const float* b, float eps, float* out) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  const float mean = sum / static_cast<float>(n);
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += (x[i] - mean) * (x[i] - mean);
  const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] - mean) * rstd * w[i] + b[i];
}

// The tanh GELU as x * sigmoid(2u) (the same function: 0.5 (1 + tanh u) = sigmoid(2u)), in
// a form the compiler vectorizes through the vector exp. The exponent is capped below expf's
// overflow (~88.7, reached from x < -10.3): under -ffast-math the quotient by an infinite
// denominator may be computed through a reciprocal estimate, which gives NaN, not 0.
inline void gelu_tanh(float* x, int64_t n) {
  constexpr float kMaxExponent = 80.0f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float u = kGeluScale * (v + kGeluCubic * v * v * v);
    x[i] = v / (1.0f + std::exp(std::min(-2.0f * u, kMaxExponent)));
  }
}

class GPT2Decoder : public torch::CustomClassHolder {
 public:
  GPT2Decoder(std::vector<at::Tensor> tensors, std::vector<int64_t> dims,
              std::vector<double> scales, double eps)
      : tensors_(std::move(tensors)), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(dims.size() == 10, "dims: 10 integers");
    n_layer_ = dims[0], n_embd_ = dims[1], n_head_ = dims[2], n_kv_head_ = dims[3];
    head_dim_ = dims[4], inner_ = dims[5], q_head_stride_ = dims[6], k_base_ = dims[7];
    v_base_ = dims[8], kv_head_stride_ = dims[9];
    TORCH_CHECK(static_cast<int64_t>(tensors_.size()) == kGlobalTensors + kTensorsPerLayer * n_layer_,
                "4 + 20 tensors a layer");
    TORCH_CHECK(static_cast<int64_t>(scales.size()) == n_layer_, "an attention scale a layer");
    TORCH_CHECK(n_head_ % n_kv_head_ == 0, "query heads a multiple of K/V heads");
    const at::Tensor* t = tensors_.data();
    dtype_ = t[0].scalar_type();
    TORCH_CHECK(dtype_ == at::kBFloat16 || dtype_ == at::kFloat, "bfloat16 or float32 model");
    for (int64_t i = 0; i < kGlobalTensors; ++i) TORCH_CHECK(t[i].is_contiguous(), "contiguous");
    ln_f_w_ = t[2].data_ptr<float>();
    ln_f_b_ = t[3].data_ptr<float>();
    for (int64_t l = 0; l < n_layer_; ++l) {
      const at::Tensor* p = t + kGlobalTensors + l * kTensorsPerLayer;
      Layer layer{p[0].data_ptr<float>(), p[1].data_ptr<float>(), Product(p + 2), Product(p + 6),
                  p[10].data_ptr<float>(), p[11].data_ptr<float>(), Product(p + 12),
                  Product(p + 16), static_cast<float>(scales[l])};
      check_product(layer.attn, n_embd_);
      check_product(layer.proj, n_embd_);
      check_product(layer.fc, n_embd_);
      check_product(layer.mproj, inner_);
      TORCH_CHECK(layer.proj.padded_out() >= n_embd_ && layer.fc.padded_out() >= inner_ &&
                      layer.mproj.padded_out() >= n_embd_,
                  "product widths");
      layers_.push_back(layer);
    }
  }

  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions,
                     const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens) {
    const int64_t rows = input_ids.size(0);
    TORCH_CHECK(rows >= 1 && rows <= small_gemm::kMaxRows, "1 to 8 sequences");
    TORCH_CHECK(input_ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                    slot_mapping.scalar_type() == at::kLong &&
                    block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
                "int64 ids, positions and slots; int32 block tables and seq_lens");
    TORCH_CHECK(positions.size(0) == rows && slot_mapping.size(0) == rows &&
                    block_tables.size(0) == rows && seq_lens.size(0) == rows,
                "one entry a sequence");
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == n_layer_ && kv_cache.size(1) == 2 &&
                    kv_cache.size(4) == n_kv_head_ && kv_cache.size(5) == head_dim_ &&
                    kv_cache.is_contiguous() && kv_cache.scalar_type() == dtype_,
                "kv_cache [L, 2, blocks, block_size, H_kv, D] contiguous, the model's dtype");
    TORCH_CHECK(block_tables.is_contiguous() && input_ids.is_contiguous() &&
                    positions.is_contiguous() && slot_mapping.is_contiguous() &&
                    seq_lens.is_contiguous(),
                "contiguous inputs");
    at::Tensor hidden = at::empty({rows, n_embd_}, tensors_[0].options());
    if (dtype_ == at::kBFloat16) {
      run<c10::BFloat16>(rows, input_ids, positions, kv_cache, slot_mapping, block_tables,
                         seq_lens, hidden);
    } else {
      run<float>(rows, input_ids, positions, kv_cache, slot_mapping, block_tables, seq_lens,
                 hidden);
    }
    return hidden;
  }

 private:
  void check_product(const Product& p, int64_t in_features) const {
    TORCH_CHECK(p.padded_in() >= in_features && p.padded_in() < in_features + 4, "product depth");
    TORCH_CHECK(p.int8 || dtype_ == at::kBFloat16, "bfloat16 weights need a bfloat16 model");
  }

  // x's rows [R, n] (float32) as a product's input, zero up to its padded depth.
  static void prepare(const Product& p, const float* x, int64_t x_stride, int64_t n,
                      int64_t r_begin, int64_t r_end, Inputs& in) {
    for (int64_t r = r_begin; r < r_end; ++r) {
      const float* row = x + r * x_stride;
      if (p.int8) {
        uint8_t* codes = in.codes.data() + r * in.stride;
        in.scale[r] = quantize_row(row, n, codes);
        std::fill(codes + n, codes + p.padded_in(), static_cast<uint8_t>(kCodeZeroPoint));
      } else {
        uint16_t* out = in.bf16.data() + r * in.stride;
        for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(row[i]);
        std::fill(out + n, out + p.padded_in(), uint16_t{0});
      }
    }
  }

  // out[r, n] for the thread's columns [n_begin, n_end) of the product (bias added).
  static void product(const Product& p, const Inputs& in, int rows, int t, int threads,
                      float* out, int64_t out_stride, int64_t& n_begin, int64_t& n_end) {
    int64_t b_begin, b_end;
    small_gemm::thread_blocks(p.blocks, t, threads, b_begin, b_end);
    n_begin = b_begin * kColumns, n_end = b_end * kColumns;
    if (b_begin == b_end) return;
    if (p.int8) {
      const small_gemm::Int8Args args{in.codes.data(), in.stride, static_cast<const int8_t*>(p.packed),
                                      p.groups, in.scale.data(), p.w_scale, p.code_sums128,
                                      p.bias, out, out_stride};
      small_gemm::int8_product(args, rows, b_begin, b_end);
    } else {
      const small_gemm::Bf16Args args{in.bf16.data(), in.stride, static_cast<const uint16_t*>(p.packed),
                                      p.groups, p.bias, out, out_stride};
      small_gemm::bf16_product(args, rows, b_begin, b_end);
    }
  }

  template <typename scalar_t>
  void run(int64_t rows, const at::Tensor& input_ids, const at::Tensor& positions,
           const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
           const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& hidden) {
    const int64_t C = n_embd_, D = head_dim_, H = n_head_, Hkv = n_kv_head_;
    const int64_t group = H / Hkv;
    const int64_t qkv_stride = layers_[0].attn.padded_out();
    const int64_t inner_stride = layers_[0].fc.padded_out();
    const int64_t block_size = kv_cache.size(3);
    const int64_t slot_stride = Hkv * D;  // a cache slot's row
    const int64_t layer_stride = kv_cache.stride(0), kv_stride = kv_cache.stride(1);
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int64_t table_width = block_tables.size(1);
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    const int64_t num_slots = kv_cache.size(2) * block_size;
    const int64_t vocab = tensors_[0].size(0), n_positions = tensors_[1].size(0);
    int64_t max_len = 0;
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(lens[r] >= 1 && (lens[r] + block_size - 1) / block_size <= table_width,
                  "a seq_len its block table cannot hold");
      TORCH_CHECK(ids[r] >= 0 && ids[r] < vocab && pos[r] >= 0 && pos[r] < n_positions &&
                      slots[r] < num_slots,
                  "a token id, position or slot out of range");
      max_len = std::max<int64_t>(max_len, lens[r]);
    }
    // Every key position's cache slot, checked here: nothing may throw in the parallel region.
    std::vector<int64_t> key_slots(rows * max_len);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t p = 0; p < lens[r]; ++p) {
        const int64_t block = tables[r * table_width + p / block_size];
        TORCH_CHECK(block >= 0 && block < kv_cache.size(2), "a block id out of range");
        key_slots[r * max_len + p] = block * block_size + p % block_size;
      }
    }
    const scalar_t* wte = tensors_[0].data_ptr<scalar_t>();
    const scalar_t* wpe = tensors_[1].data_ptr<scalar_t>();
    scalar_t* cache = kv_cache.data_ptr<scalar_t>();
    scalar_t* out = hidden.data_ptr<scalar_t>();

    // Float32 rows: the residual stream, a LayerNorm's or attention's output, qkv, the MLP.
    const int64_t delta_stride = layers_[0].proj.padded_out();  // = mlp.c_proj's: C padded
    std::vector<float> h(rows * C), normed(rows * C), attended(rows * C), qkv(rows * qkv_stride),
        mid(rows * inner_stride), delta(rows * delta_stride);
    const int64_t in_stride = ((std::max(C, inner_) + 3) / 4) * 4;
    Inputs in;
    in.stride = in_stride;
    in.scale.assign(rows, 0.0f);
    in.codes.assign(rows * in_stride, static_cast<uint8_t>(kCodeZeroPoint));
    in.bf16.assign(rows * in_stride, 0);
    const int nrows = static_cast<int>(rows);

#pragma omp parallel num_threads(at::get_num_threads())
    {
      const int t = omp_get_thread_num(), threads = omp_get_num_threads();
      const int64_t per = (rows + threads - 1) / threads;
      const int64_t r_begin = std::min<int64_t>(rows, per * t), r_end = std::min<int64_t>(rows, r_begin + per);
      std::vector<float> scores, acc, query;
      int64_t n_begin, n_end;

      for (int64_t r = r_begin; r < r_end; ++r) {
        for (int64_t c = 0; c < C; ++c) {
          h[r * C + c] = to_float(wte[ids[r] * C + c]) + to_float(wpe[pos[r] * C + c]);
        }
      }
      // The thread's rows of the residual stream, normalized, as product p's input.
      auto normed_input = [&](const float* w, const float* b, const Product& p) {
        for (int64_t r = r_begin; r < r_end; ++r) {
          layer_norm(h.data() + r * C, C, w, b, eps_, normed.data() + r * C);
        }
        prepare(p, normed.data(), C, C, r_begin, r_end, in);
      };
      // The residual stream plus product p of x's rows [R, n] (x_stride apart).
      auto add_product = [&](const Product& p, const float* x, int64_t x_stride, int64_t n) {
        prepare(p, x, x_stride, n, r_begin, r_end, in);
#pragma omp barrier
        product(p, in, nrows, t, threads, delta.data(), delta_stride, n_begin, n_end);
        add_columns(h.data(), C, delta.data(), delta_stride, rows, n_begin, std::min(n_end, C));
#pragma omp barrier
      };
#pragma omp barrier
      for (int64_t l = 0; l < n_layer_; ++l) {
        const Layer& L = layers_[l];
        scalar_t* k_cache = cache + l * layer_stride;
        scalar_t* v_cache = k_cache + kv_stride;
        normed_input(L.ln1_w, L.ln1_b, L.attn);
#pragma omp barrier
        product(L.attn, in, nrows, t, threads, qkv.data(), qkv_stride, n_begin, n_end);
#pragma omp barrier
        // Every row's new K/V is stored before any row reads: rows of one sequence (a draft
        // verified position by position) read the keys the rows before them bring.
        for (int64_t task = t; task < rows * Hkv; task += threads) {
          const int64_t r = task / Hkv, g = task % Hkv;
          if (slots[r] < 0) continue;
          const float* row = qkv.data() + r * qkv_stride;
          scalar_t* k_dst = k_cache + slots[r] * slot_stride + g * D;
          scalar_t* v_dst = v_cache + slots[r] * slot_stride + g * D;
          const float* k_src = row + k_base_ + g * kv_head_stride_;
          const float* v_src = row + v_base_ + g * kv_head_stride_;
          for (int64_t d = 0; d < D; ++d) {
            k_dst[d] = static_cast<scalar_t>(k_src[d]);
            v_dst[d] = static_cast<scalar_t>(v_src[d]);
          }
        }
#pragma omp barrier
        // Attention: a task per (sequence, K/V head) reads its keys in the cache for the G
        // query heads sharing it; q of head h at h * q_head_stride, the task's from g * G on.
        for (int64_t task = t; task < rows * Hkv; task += threads) {
          const int64_t r = task / Hkv, g = task % Hkv;
          const float* row = qkv.data() + r * qkv_stride;
          auto task_fn = D == 64 ? decode_task<scalar_t, 64, float, float>
                                 : decode_task<scalar_t, 0, float, float>;
          task_fn(row, q_head_stride_, k_cache, v_cache, slot_stride,
                  key_slots.data() + r * max_len, lens[r], g, g + 1, group, D, L.scale,
                  attended.data() + r * C, D, scores, acc, query);
        }
#pragma omp barrier
        add_product(L.proj, attended.data(), C, C);
        normed_input(L.ln2_w, L.ln2_b, L.fc);
#pragma omp barrier
        product(L.fc, in, nrows, t, threads, mid.data(), inner_stride, n_begin, n_end);
        for (int64_t r = 0; r < rows && n_begin < n_end; ++r) {
          gelu_tanh(mid.data() + r * inner_stride + n_begin, n_end - n_begin);
        }
#pragma omp barrier
        add_product(L.mproj, mid.data(), inner_stride, inner_);
      }
      for (int64_t r = r_begin; r < r_end; ++r) {
        layer_norm(h.data() + r * C, C, ln_f_w_, ln_f_b_, eps_, normed.data() + r * C);
        for (int64_t c = 0; c < C; ++c) out[r * C + c] = static_cast<scalar_t>(normed[r * C + c]);
      }
    }
  }

  // h[r, n] += delta[r, n] for columns [begin, end) of every row.
  static void add_columns(float* h, int64_t h_stride, const float* delta, int64_t delta_stride,
                          int64_t rows, int64_t begin, int64_t end) {
    for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
      for (int64_t c = begin; c < end; ++c) h[r * h_stride + c] += delta[r * delta_stride + c];
    }
  }

  std::vector<at::Tensor> tensors_;
  std::vector<Layer> layers_;
  at::ScalarType dtype_;
  float eps_;
  const float* ln_f_w_;
  const float* ln_f_b_;
  int64_t n_layer_, n_embd_, n_head_, n_kv_head_, head_dim_, inner_;
  int64_t q_head_stride_, k_base_, v_base_, kv_head_stride_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(octavo_cpu, m) {
  m.class_<GPT2Decoder>("GPT2Decoder")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>, double>())
      .def("forward", &GPT2Decoder::forward);
}
