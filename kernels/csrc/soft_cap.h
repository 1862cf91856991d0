// Attention-logit soft-capping (Gemma 2's attn_logit_softcapping): a score s, softmax scale applied,
// becomes cap * tanh(s / cap) before masking and the softmax. Shared by the attention kernels of every ISA
// tier: plain arithmetic on GCC vectors, so each tier runs the same operations on each score.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace freight {

// tanh(x) for a float or a GCC vector of floats (__m256, __m512, CapVector): Eigen's rational approximation
// (|error| < 4e-7 on [-7.9, 7.9]; past that tanh is 1 to within that), x itself where |x| < 4e-4. No libm
// call, so it vectorizes at every width and a lane's result does not depend on the width.
template <typename V>
__attribute__((always_inline)) inline V tanh_rational(V x) {
  constexpr float kClamp = 7.90531110763549805f, kTiny = 0.0004f;
  const V c = x < -kClamp ? -kClamp : (x > kClamp ? kClamp : x);
  const V c2 = c * c;
  V p = c2 * -2.76076847742355e-16f + 2.00018790482477e-13f;  // odd numerator, in c2
  p = c2 * p + -8.60467152213735e-11f;
  p = c2 * p + 5.12229709037114e-08f;
  p = c2 * p + 1.48572235717979e-05f;
  p = c2 * p + 6.37261928875436e-04f;
  p = c2 * p + 4.89352455891786e-03f;
  V q = c2 * 1.19825839466702e-06f + 1.18534705686654e-04f;  // even denominator
  q = c2 * q + 2.26843463243900e-03f;
  q = c2 * q + 4.89352518554385e-03f;
  const V r = c * p / q;
  return (c < kTiny && c > -kTiny) ? c : r;
}

#if defined(__AVX__)
constexpr int64_t kCapLanes = 8;
#else
constexpr int64_t kCapLanes = 4;  // one SSE or NEON register: a wider vector would be passed in memory
#endif
typedef float CapVector __attribute__((vector_size(kCapLanes * sizeof(float))));

// s[0, n) -> cap * tanh(s / cap) in place; returns the largest result (-inf for n = 0). kCapLanes scores at a
// time, the tail through a zero-padded vector, so each score takes the same instructions wherever it sits in
// its row (a draft row of a decode run comes out bit for bit as it does alone).
inline float soft_cap_scores(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap;
  float top = -INFINITY;
  for (int64_t t = 0; t < n; t += kCapLanes) {
    const int64_t m = std::min(kCapLanes, n - t);
    CapVector v = {};
    if (m == kCapLanes) std::memcpy(&v, s + t, sizeof(v));
    else std::memcpy(&v, s + t, m * sizeof(float));
    v = tanh_rational(v * inv) * cap;
    if (m == kCapLanes) std::memcpy(s + t, &v, sizeof(v));
    else std::memcpy(s + t, &v, m * sizeof(float));
    for (int64_t i = 0; i < m; ++i) top = std::max(top, v[i]);
  }
  return top;
}

}  // namespace freight
