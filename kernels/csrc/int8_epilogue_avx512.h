// The AVX-512 epilogue of the INT8 products, shared by every kernel that turns exact integer products into
// floats (int8_linear_cpu.cpp's passes, the AMX GEMM's fused epilogue): one copy of the arithmetic, so a
// row's outputs are the same bits whichever product multiplied it.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <torch/extension.h>

#include <immintrin.h>

#include "avx512_math.h"
#include "gate.h"

namespace freight_epilogue {

using freight::exp16;

// 16 lanes at a time; `n` < 16 only at a row's tail (masked loads and stores).
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const int32_t* p, __mmask16 m) { return _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, p)); }
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

template <typename AccT, typename OutT>
void dequantize_row(const AccT* acc, float xs, const float* w_scale, const OutT* bias, const OutT* residual,
                    OutT* out, int64_t cols) {
  const __m512 xs_v = _mm512_set1_ps(xs);
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 m = tail_mask(cols - c);
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(load16(acc + c, m), xs_v), _mm512_maskz_loadu_ps(m, w_scale + c));
    if (bias) y = _mm512_add_ps(y, load16(bias + c, m));
    if (residual) y = _mm512_add_ps(y, load16(residual + c, m));
    store16(out + c, y, m);
  }
}

using freight::Gate;

// z(g) of gate.h, 16 lanes
template <Gate G>
inline __m512 sigmoid_argument16(__m512 g) {
  if constexpr (G == Gate::kSilu) {
    return g;
  } else {
    const __m512 g2 = _mm512_mul_ps(g, g);
    return _mm512_mul_ps(
        g, _mm512_fmadd_ps(g2, _mm512_set1_ps(freight::kGeluCubic), _mm512_set1_ps(freight::kGeluLinear)));
  }
}

template <Gate G, typename AccT, typename OutT>
void gated_mul_row(const AccT* gate, const AccT* up, float xs, const float* w_gate, const float* w_up, OutT* out,
                   int64_t cols) {
  const __m512 xs_v = _mm512_set1_ps(xs);
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 m = tail_mask(cols - c);
    const __m512 g = _mm512_mul_ps(_mm512_mul_ps(load16(gate + c, m), xs_v), _mm512_maskz_loadu_ps(m, w_gate + c));
    const __m512 u = _mm512_mul_ps(_mm512_mul_ps(load16(up + c, m), xs_v), _mm512_maskz_loadu_ps(m, w_up + c));
    // 1 / (1 + e^-z): a 14-bit reciprocal estimate refined by one Newton step (about 1e-7 relative)
    const __m512 z = sigmoid_argument16<G>(g);
    const __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), z)));
    __m512 sig = _mm512_rcp14_ps(denom);
    sig = _mm512_mul_ps(sig, _mm512_fnmadd_ps(denom, sig, _mm512_set1_ps(2.f)));
    store16(out + c, _mm512_mul_ps(_mm512_mul_ps(g, sig), u), m);
  }
}

template <typename AccT, typename OutT>
void silu_mul_row(const AccT* gate, const AccT* up, float xs, const float* w_gate, const float* w_up, OutT* out,
                  int64_t cols) {
  gated_mul_row<Gate::kSilu>(gate, up, xs, w_gate, w_up, out, cols);
}

}  // namespace freight_epilogue
#endif
