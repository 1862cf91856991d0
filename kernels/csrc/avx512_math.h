// Vectorized exponentials shared by the CPU kernels (AVX-512F).
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

namespace freight {

// 2^t: 2^n * 2^f with n = round(t), f in [-0.5, 0.5], degree-7 polynomial (relative error ~1e-7);
// t is clamped to [-126, 127], so it never overflows and tiny results stay normal.
inline __m512 exp2_16(__m512 t) {
  t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-126.f)), _mm512_set1_ps(127.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);  // (ln 2)^k / k!, k = 7 .. 0
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 exp16(__m512 x) { return exp2_16(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f))); }

}  // namespace freight
#endif
