// Vectorized math shared by the CPU kernels' AVX2 tier (AVX2 + FMA, 8 float lanes).
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

// Loops over template constants that index arrays of vectors are unrolled completely with this, so that the
// arrays live in registers: past ~200 instructions GCC stops unrolling on its own and keeps them in memory.
#define FREIGHT_UNROLL _Pragma("GCC unroll 64")
// Small vector helpers called from hot loops: left to itself GCC keeps some out of line, a call per few
// dozen FMAs.
#define FREIGHT_INLINE inline __attribute__((always_inline))

namespace freight {

// 2^t: 2^n * 2^f with n = round(t), f in [-0.5, 0.5], degree-7 polynomial (relative error ~1e-7);
// t is clamped to [-126, 127], so it never overflows and tiny results stay normal.
inline __m256 exp2_8(__m256 t) {
  t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-126.f)), _mm256_set1_ps(127.f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.525273380405984e-05f);  // (ln 2)^k / k!, k = 7 .. 0
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550410866482158e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.2402265069591007f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6931471805599453f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  // 2^n as float bits: (n + 127) << 23, n in [-126, 127]
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline __m256 exp8(__m256 x) { return exp2_8(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f))); }

// Horizontal sum and max of 8 lanes.
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float reduce_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The sums of four vectors' lanes, {sum a, sum b, sum c, sum d}: one reduction tree shared by the four,
// about half the work of four reduce_add8.
inline __m128 reduce_add8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // pairs of 128-bit halves
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// 8 consecutive elements as float32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const double* p) {
  return _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(p + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(p)));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#if defined(__F16C__)  // every AVX2 CPU has it; the AVX2 build tier passes -mf16c
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

}  // namespace freight
#endif
