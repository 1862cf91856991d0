// The memory passes around a CPU int8 GEMM (torch._int_mm, or oneDNN's u8 x s8 qlinear), each fused into
// one pass over the rows:
//   quantize_rows: float rows -> int8 rows + one float32 scale per row (symmetric, absmax / 127); or uint8
//     rows holding q + 128, the unsigned activations oneDNN's qlinear takes with zero point 128;
//   dequantize_rows: int32 or float32 products -> y = acc * x_scale[row] * w_scale[col] (+ bias) (+ residual);
//   dequantize_silu_mul: the gate and up products -> act(gate) * up (SiLU, or GELU's tanh form), never storing
//     gate or up as floats;
//   rms_norm: LlamaRMSNorm in one pass per row (the torch ops are six passes and two dtype copies);
//   rms_norm_quantize: rms_norm then quantize_rows in one pass, for a W8A8 product's input;
//   write_kv_int8: a step's keys or values -> their paged INT8 cache slots, quantized per (token, kv head)
//     the same way, with the scale stored beside them (kernels/kv_cache.py).
// Unfused, each of these is four to six full passes over an [M, N] tensor, which at prefill sizes cost
// more than the integer matmul itself.
//
// Code paths, picked by the ISA the build targets: AVX-512 (16 lanes, masked tails), else AVX2 + FMA
// (8 lanes, the row's last cols % 8 elements through the portable code), else portable loops. The SIMD
// paths take float32 and bfloat16; float16 always runs the portable loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "avx2_math.h"
#include "avx512_math.h"
#include "gate.h"
#include "int8_epilogue_avx512.h"

namespace {

constexpr float kScaleEps = 1e-8f;  // kernels/_checks.py INT8_SCALE_EPS: an all-zero row stays zeros

template <typename T>
inline float to_float(T value) {
  return static_cast<float>(value);
}

// round(x / scale) clamped to [-127, 127]: an exact division and round-half-to-even, as torch's
// x / scale and round() do, so the codes match kernels/int8_linear.py quantize_per_token_torch exactly.
inline int32_t quantize_value(float x, float scale) {
  return static_cast<int32_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x / scale))));
}

// A code as stored: int8 q, or uint8 q + 128 (oneDNN's asymmetric u8 activations, zero point 128).
template <typename QT>
inline QT to_code(int32_t q) {
  return static_cast<QT>(std::is_same_v<QT, uint8_t> ? q + 128 : q);
}

// ---------------------------------------------------------------------------------------------------
// Portable rows (also the AVX2 rows' tails past the last multiple of 8)
template <typename InT>
float absmax_generic(const InT* x, int64_t cols) {
  float absmax = 0.f;
  for (int64_t c = 0; c < cols; ++c) absmax = std::max(absmax, std::fabs(to_float(x[c])));
  return absmax;
}

template <typename InT, typename QT>
void quantize_codes_generic(const InT* x, QT* q, float scale, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) q[c] = to_code<QT>(quantize_value(to_float(x[c]), scale));
}

template <typename InT, typename QT>
void quantize_row_generic(const InT* x, QT* q, float* scale_out, int64_t cols) {
  const float scale = std::max(absmax_generic(x, cols) / 127.f, kScaleEps);
  quantize_codes_generic(x, q, scale, cols);
  *scale_out = scale;
}

template <typename AccT, typename OutT>
void dequantize_row_generic(const AccT* acc, float xs, const float* w_scale, const OutT* bias,
                            const OutT* residual, OutT* out, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    float y = static_cast<float>(acc[c]) * xs * w_scale[c];
    if (bias) y += to_float(bias[c]);
    if (residual) y += to_float(residual[c]);
    out[c] = static_cast<OutT>(y);
  }
}

// RMSNorm of one row in LlamaRMSNorm's order: y = x * rsqrt(mean(x^2) + eps) in float32, rounded to the
// row's dtype, then weight * y rounded again (for float32 the roundings are no-ops).
template <typename T>
void rms_norm_row_generic(const T* x, const T* weight, float eps, T* out, int64_t cols) {
  float squares = 0.f;
  for (int64_t c = 0; c < cols; ++c) squares += to_float(x[c]) * to_float(x[c]);
  const float inv = 1.f / std::sqrt(squares / float(cols) + eps);
  for (int64_t c = 0; c < cols; ++c) {
    const float y = to_float(static_cast<T>(to_float(x[c]) * inv));
    out[c] = static_cast<T>(to_float(weight[c]) * y);
  }
}

using freight::Gate;

template <Gate G, typename AccT, typename OutT>
void gated_mul_row_generic(const AccT* gate, const AccT* up, float xs, const float* w_gate, const float* w_up,
                           OutT* out, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    const float g = static_cast<float>(gate[c]) * xs * w_gate[c];
    const float u = static_cast<float>(up[c]) * xs * w_up[c];
    out[c] = static_cast<OutT>(freight::gate_activation<G>(g) * u);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FREIGHT_SIMD 1
// ---------------------------------------------------------------------------------------------------
// AVX-512: 16 lanes at a time; `n` < 16 only at a row's tail (masked loads and stores).
using namespace freight_epilogue;  // tail_mask, load16, store16, dequantize_row, gated_mul_row

using freight::exp16;

// float32 lanes rounded to bfloat16 (nearest even) and widened back, as torch's .to(bfloat16).float()
inline __m512 round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(int(0xFFFF0000u))));
}
inline __m512 round_to(const float*, __m512 v) { return v; }
inline __m512 round_to(const at::BFloat16*, __m512 v) { return round_bf16(v); }

template <typename T>
void rms_norm_row(const T* x, const T* weight, float eps, T* out, int64_t cols) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t c = 0; c < cols; c += 16) {
    const __m512 v = load16(x + c, tail_mask(cols - c));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / float(cols) + eps));
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 m = tail_mask(cols - c);
    const __m512 y = round_to(x, _mm512_mul_ps(load16(x + c, m), inv));
    store16(out + c, _mm512_mul_ps(load16(weight + c, m), y), m);
  }
}

template <typename InT, typename QT>
void quantize_row(const InT* x, QT* q, float* scale_out, int64_t cols) {
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
    __m128i codes = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v));
    if constexpr (std::is_same_v<QT, uint8_t>) codes = _mm_xor_si128(codes, _mm_set1_epi8(char(0x80)));  // q + 128
    _mm_mask_storeu_epi8(q + c, m, codes);
  }
  *scale_out = scale;
}

#elif defined(__AVX2__) && defined(__FMA__)
#define FREIGHT_SIMD 1
// ---------------------------------------------------------------------------------------------------
// AVX2 + FMA: 8 lanes at a time over the row's first cols - cols % 8 elements; AVX2 has no 8- or 16-bit
// masked loads and stores, so the few elements past them run the portable code.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const int32_t* p) {
  return _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// float32 lanes rounded to bfloat16 (nearest even) and widened back, as torch's .to(bfloat16).float()
inline __m256 round_bf16_8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(int(0xFFFF0000u))));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  // round to nearest even, as torch's float -> bfloat16 conversion (NaN stays NaN)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  // 8 values in [0, 0xFFFF]: the unsigned-saturating pack keeps them as they are
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// 8 codes in [-127, 127] (int32 lanes) -> 8 bytes: int8 q, or uint8 q + 128 (flipping the sign bit)
template <typename QT>
inline void store_codes8(QT* p, __m256i q) {
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  __m128i bytes = _mm_packs_epi16(words, words);
  if constexpr (std::is_same_v<QT, uint8_t>) bytes = _mm_xor_si128(bytes, _mm_set1_epi8(char(0x80)));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), bytes);
}

using freight::exp8;
using freight::reduce_max8;

template <typename InT, typename QT>
void quantize_row(const InT* x, QT* q, float* scale_out, int64_t cols) {
  const int64_t body = cols - cols % 8;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 absmax = _mm256_setzero_ps();
  for (int64_t c = 0; c < body; c += 8) absmax = _mm256_max_ps(absmax, _mm256_and_ps(load8(x + c), abs_mask));
  const float row_absmax = std::max(reduce_max8(absmax), absmax_generic(x + body, cols - body));
  const float scale = std::max(row_absmax / 127.f, kScaleEps);
  const __m256 scale_v = _mm256_set1_ps(scale);
  for (int64_t c = 0; c < body; c += 8) {
    // an exact division and round-half-to-even, as torch's x / scale and round() do
    __m256 v = _mm256_round_ps(_mm256_div_ps(load8(x + c), scale_v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
    store_codes8(q + c, _mm256_cvtps_epi32(v));
  }
  quantize_codes_generic(x + body, q + body, scale, cols - body);
  *scale_out = scale;
}

template <typename AccT, typename OutT>
void dequantize_row(const AccT* acc, float xs, const float* w_scale, const OutT* bias, const OutT* residual,
                    OutT* out, int64_t cols) {
  const int64_t body = cols - cols % 8;
  const __m256 xs_v = _mm256_set1_ps(xs);
  for (int64_t c = 0; c < body; c += 8) {
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(load8(acc + c), xs_v), _mm256_loadu_ps(w_scale + c));
    if (bias) y = _mm256_add_ps(y, load8(bias + c));
    if (residual) y = _mm256_add_ps(y, load8(residual + c));
    store8(out + c, y);
  }
  dequantize_row_generic(acc + body, xs, w_scale + body, bias ? bias + body : nullptr,
                         residual ? residual + body : nullptr, out + body, cols - body);
}

template <Gate G, typename AccT, typename OutT>
void gated_mul_row(const AccT* gate, const AccT* up, float xs, const float* w_gate, const float* w_up, OutT* out,
                   int64_t cols) {
  const int64_t body = cols - cols % 8;
  const __m256 xs_v = _mm256_set1_ps(xs);
  for (int64_t c = 0; c < body; c += 8) {
    const __m256 g = _mm256_mul_ps(_mm256_mul_ps(load8(gate + c), xs_v), _mm256_loadu_ps(w_gate + c));
    const __m256 u = _mm256_mul_ps(_mm256_mul_ps(load8(up + c), xs_v), _mm256_loadu_ps(w_up + c));
    __m256 z = g;  // gate.h's z(g)
    if constexpr (G == Gate::kGeluTanh)
      z = _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(freight::kGeluCubic),
                                           _mm256_set1_ps(freight::kGeluLinear)));
    // 1 / (1 + e^-z): a 12-bit reciprocal estimate refined by one Newton step (about 2e-7 relative)
    const __m256 denom = _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), z)));
    __m256 sig = _mm256_rcp_ps(denom);
    sig = _mm256_mul_ps(sig, _mm256_fnmadd_ps(denom, sig, _mm256_set1_ps(2.f)));
    store8(out + c, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
  }
  gated_mul_row_generic<G>(gate + body, up + body, xs, w_gate + body, w_up + body, out + body, cols - body);
}
#endif

#ifdef FREIGHT_SIMD
template <typename T>
constexpr bool kVectorized = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;
#else
template <typename T>
constexpr bool kVectorized = false;
#endif

// One row's codes and scale, by this build's row function (the one every quantizing kernel here uses).
template <typename InT, typename QT>
inline void quantize_one_row(const InT* x, QT* q, float* scale, int64_t cols) {
#ifdef FREIGHT_SIMD
  if constexpr (kVectorized<InT>) {
    quantize_row(x, q, scale, cols);
    return;
  }
#endif
  quantize_row_generic(x, q, scale, cols);
}

template <typename InT, typename QT>
void quantize_rows_kernel(const InT* x, QT* q, float* scales, int64_t rows, int64_t cols) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_one_row(x + r * cols, q + r * cols, scales + r, cols);
  });
}

template <typename AccT, typename OutT>
void dequantize_rows_kernel(const AccT* acc, int64_t acc_stride, const float* x_scale, const float* w_scale,
                            const OutT* bias, const OutT* residual, int64_t residual_stride, OutT* out,
                            int64_t out_stride, int64_t rows, int64_t cols) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const AccT* a = acc + r * acc_stride;
      const OutT* res = residual ? residual + r * residual_stride : nullptr;
#ifdef FREIGHT_SIMD
      if constexpr (kVectorized<OutT>) {
        dequantize_row(a, x_scale[r], w_scale, bias, res, out + r * out_stride, cols);
        continue;
      }
#endif
      dequantize_row_generic(a, x_scale[r], w_scale, bias, res, out + r * out_stride, cols);
    }
  });
}

template <Gate G, typename AccT, typename OutT>
void dequantize_gated_mul_kernel(const AccT* gate, const AccT* up, int64_t acc_stride, const float* x_scale,
                                 const float* w_gate, const float* w_up, OutT* out, int64_t out_stride,
                                 int64_t rows, int64_t cols) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const AccT* g = gate + r * acc_stride;
      const AccT* u = up + r * acc_stride;
#ifdef FREIGHT_SIMD
      if constexpr (kVectorized<OutT>) {
        gated_mul_row<G>(g, u, x_scale[r], w_gate, w_up, out + r * out_stride, cols);
        continue;
      }
#endif
      gated_mul_row_generic<G>(g, u, x_scale[r], w_gate, w_up, out + r * out_stride, cols);
    }
  });
}

template <typename InT, typename ScaleT>
void write_kv_int8_kernel(const InT* src, int64_t token_stride, int64_t head_stride, const int64_t* slots,
                          int8_t* cache, ScaleT* scale_cache, int64_t tokens, int64_t heads, int64_t dim) {
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const InT* x = src + t * token_stride + h * head_stride;
        const int64_t row = slots[t] * heads + h;
        float scale;
#ifdef FREIGHT_SIMD
        if constexpr (kVectorized<InT>) {
          quantize_row(x, cache + row * dim, &scale, dim);
          scale_cache[row] = static_cast<ScaleT>(scale);
          continue;
        }
#endif
        quantize_row_generic(x, cache + row * dim, &scale, dim);
        scale_cache[row] = static_cast<ScaleT>(scale);  // float16: round to nearest even, as torch's .to()
      }
    }
  });
}

// One row of RMSNorm, by this build's row function (the one both norm kernels here use).
template <typename T>
inline void norm_one_row(const T* x, const T* weight, float eps, T* out, int64_t cols) {
#ifdef FREIGHT_SIMD
  if constexpr (kVectorized<T>) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    rms_norm_row(x, weight, eps, out, cols);
    return;
#endif
  }
#endif
  rms_norm_row_generic(x, weight, eps, out, cols);
}

template <typename T>
void rms_norm_kernel(const T* x, const T* weight, float eps, T* out, int64_t rows, int64_t cols) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_one_row(x + r * cols, weight, eps, out + r * cols, cols);
  });
}

// RMSNorm then per-token quantization, one pass over the rows: each normalized row is made in an L1 buffer
// by norm_one_row (rounded to T, as rms_norm writes it) and quantized from there by quantize_one_row, so the
// codes and scales are those of quantize_rows(rms_norm(x)), bit for bit, without writing and reading back the
// normalized [rows, cols] tensor.
template <typename T>
void rms_norm_quantize_kernel(const T* x, const T* weight, float eps, int8_t* q, float* scales, int64_t rows,
                              int64_t cols) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> normed(cols);
    for (int64_t r = begin; r < end; ++r) {
      norm_one_row(x + r * cols, weight, eps, normed.data(), cols);
      quantize_one_row(normed.data(), q + r * cols, scales + r, cols);
    }
  });
}

// Rotary embedding in place, bfloat16: for each head's first `rot` dims, halves x1, x2 become
// x1 * cos1 + x2 * ssin1 and x2 * cos2 + x1 * ssin2 (ssin: sin with the first half negated), each product
// rounded to bfloat16 and then the sum, exactly as the torch expression x * cos + swapped * ssin computes
// it in bfloat16 (worker/engine/rope.py): the same bits, in one pass instead of four.
inline at::BFloat16 rope_value(float a, float ca, float b, float sb) {
  const float first = static_cast<float>(static_cast<at::BFloat16>(a * ca));
  const float second = static_cast<float>(static_cast<at::BFloat16>(b * sb));
  return static_cast<at::BFloat16>(first + second);
}

void rope_kernel(at::BFloat16* x, int64_t row_stride, const at::BFloat16* cos, const at::BFloat16* ssin,
                 int64_t rows, int64_t heads, int64_t head_dim, int64_t rot) {
  const int64_t half = rot / 2;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* c = cos + r * rot;
      const at::BFloat16* s = ssin + r * rot;
      for (int64_t h = 0; h < heads; ++h) {
        at::BFloat16* v = x + r * row_stride + h * head_dim;
        int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
        for (; i + 16 <= half; i += 16) {
          const __m512 x1 = load16(v + i, 0xFFFF), x2 = load16(v + half + i, 0xFFFF);
          const __m512 t1 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, load16(c + i, 0xFFFF))),
                                          round_bf16(_mm512_mul_ps(x2, load16(s + i, 0xFFFF))));
          const __m512 t2 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, load16(c + half + i, 0xFFFF))),
                                          round_bf16(_mm512_mul_ps(x1, load16(s + half + i, 0xFFFF))));
          store16(v + i, t1, 0xFFFF);
          store16(v + half + i, t2, 0xFFFF);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= half; i += 8) {
          const __m256 x1 = load8(v + i), x2 = load8(v + half + i);
          const __m256 t1 = _mm256_add_ps(round_bf16_8(_mm256_mul_ps(x1, load8(c + i))),
                                          round_bf16_8(_mm256_mul_ps(x2, load8(s + i))));
          const __m256 t2 = _mm256_add_ps(round_bf16_8(_mm256_mul_ps(x2, load8(c + half + i))),
                                          round_bf16_8(_mm256_mul_ps(x1, load8(s + half + i))));
          store8(v + i, t1);
          store8(v + half + i, t2);
        }
#endif
        for (; i < half; ++i) {
          const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[half + i]);
          v[i] = rope_value(x1, static_cast<float>(c[i]), x2, static_cast<float>(s[i]));
          v[half + i] = rope_value(x2, static_cast<float>(c[half + i]), x1, static_cast<float>(s[half + i]));
        }
      }
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

void check_vector(const torch::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.is_contiguous() && t.scalar_type() == at::kFloat, name,
              " must be a contiguous float32 vector of ", n);
}

// Calls f with acc's data as const int32_t* or const float*.
template <typename F>
void with_accumulator(const torch::Tensor& acc, F&& f) {
  if (acc.scalar_type() == at::kInt) {
    f(acc.const_data_ptr<int32_t>());
  } else {
    TORCH_CHECK(acc.scalar_type() == at::kFloat, "products must be int32 or float32");
    f(acc.const_data_ptr<float>());
  }
}

template <typename Ptr>
using pointee_t = std::remove_const_t<std::remove_pointer_t<Ptr>>;

}  // namespace

// x [M, K] float32/bfloat16/float16 -> (q [M, K], scale [M] float32), written into q and scale. q is int8
// (the codes) or uint8 (codes + 128, for oneDNN's u8 activations with zero point 128).
void quantize_rows(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  check_rows(x, "x");
  check_rows(q, "q");
  TORCH_CHECK(q.sizes() == x.sizes(), "q must have x's shape");
  check_vector(scale, x.size(0), "scale");
  TORCH_CHECK(q.scalar_type() == at::kChar || q.scalar_type() == at::kByte, "q must be int8 or uint8");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    if (q.scalar_type() == at::kChar) {
      quantize_rows_kernel(xp, q.data_ptr<int8_t>(), scale.data_ptr<float>(), x.size(0), x.size(1));
    } else {
      quantize_rows_kernel(xp, q.data_ptr<uint8_t>(), scale.data_ptr<float>(), x.size(0), x.size(1));
    }
  });
}

// acc [M, N] int32 or float32 with contiguous rows, x_scale [M], w_scale [N] float32; bias [N] in out's
// dtype; residual and out [M, N] views with contiguous rows (column slices of wider tensors are fine).
void dequantize_rows(torch::Tensor acc, torch::Tensor x_scale, torch::Tensor w_scale,
                     c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual, torch::Tensor out) {
  TORCH_CHECK(acc.dim() == 2 && acc.stride(1) == 1, "acc must be a 2-D view with contiguous rows");
  check_row_view(out, acc, "out");
  check_vector(x_scale, acc.size(0), "x_scale");
  check_vector(w_scale, acc.size(1), "w_scale");
  if (residual) {
    check_row_view(*residual, acc, "residual");
    TORCH_CHECK(residual->scalar_type() == out.scalar_type(), "residual must have out's dtype");
  }
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == acc.size(1) && bias->is_contiguous() &&
                    bias->scalar_type() == out.scalar_type(),
                "bias must be a contiguous [N] vector in out's dtype");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_rows", [&] {
    with_accumulator(acc, [&](auto acc_ptr) {
      dequantize_rows_kernel<pointee_t<decltype(acc_ptr)>, scalar_t>(
          acc_ptr, acc.stride(0), x_scale.const_data_ptr<float>(), w_scale.const_data_ptr<float>(),
          bias ? bias->const_data_ptr<scalar_t>() : nullptr, residual ? residual->const_data_ptr<scalar_t>() : nullptr,
          residual ? residual->stride(0) : 0, out.data_ptr<scalar_t>(), out.stride(0), acc.size(0), acc.size(1));
    });
  });
}

// gate, up [M, I] int32 or float32 views with contiguous rows and one row stride (two contiguous products,
// or the two column halves of one [M, 2 * I] product), w_gate, w_up [I] -> out [M, I] view with contiguous
// rows = act(gate) * up, act "silu" or "gelu_tanh" (gate.h).
void dequantize_silu_mul(torch::Tensor gate, torch::Tensor up, torch::Tensor x_scale, torch::Tensor w_gate,
                         torch::Tensor w_up, torch::Tensor out, const std::string& activation) {
  TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "activation must be silu or gelu_tanh, got ",
              activation);
  const bool gelu = activation == "gelu_tanh";
  TORCH_CHECK(gate.dim() == 2 && gate.stride(1) == 1, "gate must be a 2-D view with contiguous rows");
  check_row_view(up, gate, "up");
  TORCH_CHECK(up.stride(0) == gate.stride(0) && up.scalar_type() == gate.scalar_type(),
              "gate and up must share dtype and row stride");
  check_row_view(out, gate, "out");
  check_vector(x_scale, gate.size(0), "x_scale");
  check_vector(w_gate, gate.size(1), "w_gate");
  check_vector(w_up, gate.size(1), "w_up");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_silu_mul", [&] {
    with_accumulator(gate, [&](auto gate_ptr) {
      using AccT = pointee_t<decltype(gate_ptr)>;
      const auto run = [&](auto kernel) {
        kernel(gate_ptr, up.const_data_ptr<AccT>(), gate.stride(0), x_scale.const_data_ptr<float>(),
               w_gate.const_data_ptr<float>(), w_up.const_data_ptr<float>(), out.data_ptr<scalar_t>(), out.stride(0),
               gate.size(0), gate.size(1));
      };
      if (gelu) run(dequantize_gated_mul_kernel<Gate::kGeluTanh, AccT, scalar_t>);
      else run(dequantize_gated_mul_kernel<Gate::kSilu, AccT, scalar_t>);
    });
  });
}

// src [T, KVH, D] float32/bfloat16/float16, rows of D contiguous (any token and head strides); slots [T]
// int64 -> cache [S, KVH, D] int8 (contiguous) rows slots[t] quantized as quantize_rows does, and their scales
// into scale_cache [S, KVH] (float32 or float16, contiguous).
void write_kv_int8(torch::Tensor src, torch::Tensor slots, torch::Tensor cache, torch::Tensor scale_cache) {
  TORCH_CHECK(src.dim() == 3 && src.stride(2) == 1, "src must be [T, KVH, D] with contiguous rows");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.scalar_type() == at::kChar &&
                  cache.size(1) == src.size(1) && cache.size(2) == src.size(2),
              "cache must be a contiguous int8 [S, KVH, D]");
  TORCH_CHECK(scale_cache.dim() == 2 && scale_cache.is_contiguous() && scale_cache.size(0) == cache.size(0) &&
                  scale_cache.size(1) == cache.size(1),
              "scale_cache must be a contiguous [S, KVH]");
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous() && slots.scalar_type() == at::kLong &&
                  slots.size(0) == src.size(0),
              "slots must be a contiguous int64 [T]");
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < cache.size(0), "slot ", slot[t], " of token ", t, " is outside the cache");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "write_kv_int8", [&] {
    const scalar_t* x = src.const_data_ptr<scalar_t>();
    int8_t* q = cache.data_ptr<int8_t>();
    const int64_t T = src.size(0), KVH = src.size(1), D = src.size(2);
    if (scale_cache.scalar_type() == at::kFloat) {
      write_kv_int8_kernel(x, src.stride(0), src.stride(1), slot, q, scale_cache.data_ptr<float>(), T, KVH, D);
    } else {
      TORCH_CHECK(scale_cache.scalar_type() == at::kHalf, "scale_cache must be float32 or float16");
      write_kv_int8_kernel(x, src.stride(0), src.stride(1), slot, q, scale_cache.data_ptr<at::Half>(), T, KVH, D);
    }
  });
}

// x [M, H] float32 or bfloat16 (contiguous), weight [H] of x's dtype -> out [M, H]: LlamaRMSNorm's result
// (its order of operations; the sum of squares in another order, so bfloat16 results may differ from torch's
// in the last bit of a few elements).
void rms_norm(torch::Tensor x, torch::Tensor weight, double eps, torch::Tensor out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "out must be like x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [H] vector of x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel(x.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(), float(eps),
                    out.data_ptr<scalar_t>(), x.size(0), x.size(1));
  });
}

// x [M, H] float32 or bfloat16 (contiguous), weight [H] of x's dtype -> q [M, H] int8 and scale [M] float32:
// the codes and scales of quantize_rows(rms_norm(x, weight, eps)), in one pass.
void rms_norm_quantize(torch::Tensor x, torch::Tensor weight, double eps, torch::Tensor q, torch::Tensor scale) {
  check_rows(x, "x");
  check_rows(q, "q");
  TORCH_CHECK(q.sizes() == x.sizes() && q.scalar_type() == at::kChar, "q must be an int8 tensor of x's shape");
  check_vector(scale, x.size(0), "scale");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [H] vector of x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm_quantize", [&] {
    rms_norm_quantize_kernel(x.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(), float(eps),
                             q.data_ptr<int8_t>(), scale.data_ptr<float>(), x.size(0), x.size(1));
  });
}

// x [T, heads, head_dim] bfloat16 (head_dim contiguous, heads side by side; rows may be strided, e.g. the
// query and key heads of a fused qkv output), cos and ssin [T, rot] bfloat16 contiguous (rot even, <= head_dim):
// rotated in place; dims past rot are left as they are.
void rope(torch::Tensor x, torch::Tensor cos, torch::Tensor ssin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be a bfloat16 [T, heads, head_dim] tensor with each row's heads contiguous");
  for (const auto* t : {&cos, &ssin})
    TORCH_CHECK(t->dim() == 2 && t->is_contiguous() && t->scalar_type() == at::kBFloat16 && t->size(0) == x.size(0),
                "cos and ssin must be contiguous bfloat16 [T, rot] tensors");
  const int64_t rot = cos.size(1);
  TORCH_CHECK(ssin.size(1) == rot && rot % 2 == 0 && rot <= x.size(2), "rot must be even and at most head_dim");
  rope_kernel(x.data_ptr<at::BFloat16>(), x.stride(0), cos.const_data_ptr<at::BFloat16>(),
              ssin.const_data_ptr<at::BFloat16>(), x.size(0), x.size(1), x.size(2), rot);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows);
  m.def("dequantize_rows", &dequantize_rows);
  m.def("dequantize_silu_mul", &dequantize_silu_mul, py::arg("gate"), py::arg("up"), py::arg("x_scale"),
        py::arg("w_gate"), py::arg("w_up"), py::arg("out"), py::arg("activation") = "silu");
  m.def("write_kv_int8", &write_kv_int8);
  m.def("rms_norm", &rms_norm);
  m.def("rms_norm_quantize", &rms_norm_quantize);
  m.def("rope", &rope);
}
