// The memory passes around torch._int_mm on CPU, each fused into one pass over the rows:
//   quantize_rows: float rows -> int8 rows + one float32 scale per row (symmetric, absmax / 127);
//   dequantize_rows: int32 products -> y = acc * x_scale[row] * w_scale[col] (+ bias) (+ residual);
//   dequantize_silu_mul: the gate and up products -> silu(gate) * up, never storing gate or up as floats.
// Unfused, each of these is four to six full passes over an [M, N] tensor, which at prefill sizes cost
// more than the integer matmul itself.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "avx512_math.h"

namespace {

constexpr float kScaleEps = 1e-8f;  // kernels/_checks.py INT8_SCALE_EPS: an all-zero row stays zeros

template <typename T>
inline float to_float(T value) {
  return static_cast<float>(value);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FREIGHT_AVX512 1
// 16 lanes at a time; `n` < 16 only at a row's tail (masked loads and stores).
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {
  // round to nearest even, as torch's float -> bfloat16 conversion (NaN stays NaN)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(rounded));
}

using freight::exp16;

template <typename InT>
void quantize_row(const InT* x, int8_t* q, float* scale_out, int64_t cols) {
  __m512 absmax = _mm512_setzero_ps();
  for (int64_t c = 0; c < cols; c += 16)
    absmax = _mm512_max_ps(absmax, _mm512_abs_ps(load16(x + c, tail_mask(cols - c))));
  const float scale = std::max(_mm512_reduce_max_ps(absmax) / 127.f, kScaleEps);
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 m = tail_mask(cols - c);
    // an exact division and round-half-to-even, as torch's x / scale and round() do
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(x + c, m), scale_v),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
    _mm_mask_storeu_epi8(q + c, m, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  *scale_out = scale;
}

template <typename OutT>
void dequantize_row(const int32_t* acc, float xs, const float* w_scale, const OutT* bias, const OutT* residual,
                    OutT* out, int64_t cols) {
  const __m512 xs_v = _mm512_set1_ps(xs);
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 m = tail_mask(cols - c);
    __m512 y = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, acc + c));
    y = _mm512_mul_ps(_mm512_mul_ps(y, xs_v), _mm512_maskz_loadu_ps(m, w_scale + c));
    if (bias) y = _mm512_add_ps(y, load16(bias + c, m));
    if (residual) y = _mm512_add_ps(y, load16(residual + c, m));
    store16(out + c, y, m);
  }
}

template <typename OutT>
void silu_mul_row(const int32_t* gate, const int32_t* up, float xs, const float* w_gate, const float* w_up,
                  OutT* out, int64_t cols) {
  const __m512 xs_v = _mm512_set1_ps(xs);
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 m = tail_mask(cols - c);
    const __m512 g = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, gate + c)), xs_v),
                                   _mm512_maskz_loadu_ps(m, w_gate + c));
    const __m512 u = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, up + c)), xs_v),
                                   _mm512_maskz_loadu_ps(m, w_up + c));
    // 1 / (1 + e^-g): a 14-bit reciprocal estimate refined by one Newton step (about 1e-7 relative)
    const __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    __m512 sig = _mm512_rcp14_ps(denom);
    sig = _mm512_mul_ps(sig, _mm512_fnmadd_ps(denom, sig, _mm512_set1_ps(2.f)));
    store16(out + c, _mm512_mul_ps(_mm512_mul_ps(g, sig), u), m);
  }
}

template <typename T>
constexpr bool kVectorized = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;
#else
template <typename T>
constexpr bool kVectorized = false;
#endif

// Portable rows: the same arithmetic, one element at a time.
template <typename InT>
void quantize_row_generic(const InT* x, int8_t* q, float* scale_out, int64_t cols) {
  float absmax = 0.f;
  for (int64_t c = 0; c < cols; ++c) absmax = std::max(absmax, std::fabs(to_float(x[c])));
  const float scale = std::max(absmax / 127.f, kScaleEps);
  for (int64_t c = 0; c < cols; ++c)
    q[c] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(to_float(x[c]) / scale))));
  *scale_out = scale;
}

template <typename OutT>
void dequantize_row_generic(const int32_t* acc, float xs, const float* w_scale, const OutT* bias,
                            const OutT* residual, OutT* out, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    float y = static_cast<float>(acc[c]) * xs * w_scale[c];
    if (bias) y += to_float(bias[c]);
    if (residual) y += to_float(residual[c]);
    out[c] = static_cast<OutT>(y);
  }
}

template <typename OutT>
void silu_mul_row_generic(const int32_t* gate, const int32_t* up, float xs, const float* w_gate,
                          const float* w_up, OutT* out, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    const float g = static_cast<float>(gate[c]) * xs * w_gate[c];
    const float u = static_cast<float>(up[c]) * xs * w_up[c];
    out[c] = static_cast<OutT>(g / (1.f + std::exp(-g)) * u);
  }
}

template <typename InT>
void quantize_rows_kernel(const InT* x, int8_t* q, float* scales, int64_t rows, int64_t cols) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#ifdef FREIGHT_AVX512
      if constexpr (kVectorized<InT>) {
        quantize_row(x + r * cols, q + r * cols, scales + r, cols);
        continue;
      }
#endif
      quantize_row_generic(x + r * cols, q + r * cols, scales + r, cols);
    }
  });
}

template <typename OutT>
void dequantize_rows_kernel(const int32_t* acc, const float* x_scale, const float* w_scale, const OutT* bias,
                            const OutT* residual, int64_t residual_stride, OutT* out, int64_t out_stride,
                            int64_t rows, int64_t cols) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const OutT* res = residual ? residual + r * residual_stride : nullptr;
#ifdef FREIGHT_AVX512
      if constexpr (kVectorized<OutT>) {
        dequantize_row(acc + r * cols, x_scale[r], w_scale, bias, res, out + r * out_stride, cols);
        continue;
      }
#endif
      dequantize_row_generic(acc + r * cols, x_scale[r], w_scale, bias, res, out + r * out_stride, cols);
    }
  });
}

template <typename OutT>
void dequantize_silu_mul_kernel(const int32_t* gate, const int32_t* up, const float* x_scale, const float* w_gate,
                                const float* w_up, OutT* out, int64_t out_stride, int64_t rows, int64_t cols) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#ifdef FREIGHT_AVX512
      if constexpr (kVectorized<OutT>) {
        silu_mul_row(gate + r * cols, up + r * cols, x_scale[r], w_gate, w_up, out + r * out_stride, cols);
        continue;
      }
#endif
      silu_mul_row_generic(gate + r * cols, up + r * cols, x_scale[r], w_gate, w_up, out + r * out_stride, cols);
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-D tensor");
}

void check_row_view(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.size(0) == like.size(0) && t.size(1) == like.size(1), name,
              " must be a [M, N] view with contiguous rows");
}

}  // namespace

// x [M, K] float32/bfloat16/float16 -> (q [M, K] int8, scale [M] float32), written into q and scale.
void quantize_rows(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  check_rows(x, "x");
  check_rows(q, "q");
  TORCH_CHECK(q.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat, "q int8, scale float32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    quantize_rows_kernel<scalar_t>(x.data_ptr<scalar_t>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(),
                                   x.size(0), x.size(1));
  });
}

// acc [M, N] int32 contiguous, x_scale [M], w_scale [N] float32; bias [N] in out's dtype; residual and
// out [M, N] views with contiguous rows (column slices of wider tensors are fine).
void dequantize_rows(torch::Tensor acc, torch::Tensor x_scale, torch::Tensor w_scale,
                     c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual, torch::Tensor out) {
  check_rows(acc, "acc");
  check_row_view(out, acc, "out");
  TORCH_CHECK(acc.scalar_type() == at::kInt, "acc must be int32");
  if (residual) check_row_view(*residual, acc, "residual");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_rows", [&] {
    dequantize_rows_kernel<scalar_t>(acc.data_ptr<int32_t>(), x_scale.data_ptr<float>(), w_scale.data_ptr<float>(),
                                     bias ? bias->data_ptr<scalar_t>() : nullptr,
                                     residual ? residual->data_ptr<scalar_t>() : nullptr,
                                     residual ? residual->stride(0) : 0, out.data_ptr<scalar_t>(), out.stride(0),
                                     acc.size(0), acc.size(1));
  });
}

// gate, up [M, I] int32 contiguous (the two halves' products), w_gate, w_up [I] -> out [M, I] view with
// contiguous rows = silu(gate) * up.
void dequantize_silu_mul(torch::Tensor gate, torch::Tensor up, torch::Tensor x_scale, torch::Tensor w_gate,
                         torch::Tensor w_up, torch::Tensor out) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  check_row_view(out, gate, "out");
  TORCH_CHECK(gate.scalar_type() == at::kInt && up.scalar_type() == at::kInt && gate.sizes() == up.sizes(),
              "gate and up: int32 [M, I]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_silu_mul", [&] {
    dequantize_silu_mul_kernel<scalar_t>(gate.data_ptr<int32_t>(), up.data_ptr<int32_t>(), x_scale.data_ptr<float>(),
                                         w_gate.data_ptr<float>(), w_up.data_ptr<float>(), out.data_ptr<scalar_t>(),
                                         out.stride(0), gate.size(0), gate.size(1));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows);
  m.def("dequantize_rows", &dequantize_rows);
  m.def("dequantize_silu_mul", &dequantize_silu_mul);
}
