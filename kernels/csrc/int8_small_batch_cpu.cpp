// The int8 product of a small batch: x_q [M, K] int8 times w_q [N, K] int8 -> [M, N] int32, for M up to a
// few dozen rows (decode steps of a small batch: the tail of a shard, a job of a few long documents).
//
// Why a kernel of our own: at such M a product is bound by reading the weights once, and the library
// GEMMs are not. oneDNN's u8 x s8 qlinear on the 2-core AVX2 VM takes 10 ms for the [49152, 576] LM head
// at M = 1 (2.8 GB/s of weights) and loses to float32 up to M = 16 on the layer shapes; torch._int_mm runs
// at 3-6 GOP/s there. This kernel streams each weight row once and multiplies it with every activation
// row while it sits in L1.
//
// Exact on AVX2 without VNNI through the sign trick: vpmaddubsw multiplies |x| (u8, <= 127) by sign(x) * w
// (s8, |.| <= 127), so each int16 pair sum is at most 2 * 127 * 127 = 32258 and never saturates, with
// full-range weight codes as well as the 7-bit codes of the oneDNN backend. With AVX-512 VNNI the same
// operands go through vpdpbusd, which adds in int32 directly.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowsPerTile = 4;  // weight rows multiplied together (4 accumulators, one x load each)
constexpr int64_t kGrainRows = 16;   // weight rows per parallel task

int32_t dot_generic(const int8_t* x, const int8_t* w, int64_t k_begin, int64_t K) {
  int32_t sum = 0;
  for (int64_t k = k_begin; k < K; ++k) sum += static_cast<int32_t>(x[k]) * static_cast<int32_t>(w[k]);
  return sum;
}

#if defined(__AVX2__)
// acc += |x| * (sign(x) * w) over 32 bytes, summed into 8 int32 lanes.
inline __m256i multiply_add(__m256i acc, __m256i x_abs, __m256i x, __m256i w) {
  const __m256i w_signed = _mm256_sign_epi8(w, x);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, x_abs, w_signed);
#else
  const __m256i pairs = _mm256_maddubs_epi16(x_abs, w_signed);  // int16 pair sums, exact (see above)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// The lane sums of four accumulators, as [sum(a), sum(b), sum(c), sum(d)].
inline __m128i reduce4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_hadd_epi32(a, b);
  const __m256i cd = _mm256_hadd_epi32(c, d);
  const __m256i abcd = _mm256_hadd_epi32(ab, cd);  // per 128-bit half: partial sums of a, b, c, d
  return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

// out[m, n .. n + 3] for every row m: the four weight rows stay in L1 while all M rows pass over them.
void tile4(const int8_t* x, const int8_t* w, int32_t* out, int64_t M, int64_t K, int64_t N, int64_t n) {
  const int64_t k_vec = K - K % 32;
  const int8_t* w0 = w + n * K;
  const int8_t* w1 = w0 + K;
  const int8_t* w2 = w1 + K;
  const int8_t* w3 = w2 + K;
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* xm = x + m * K;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < k_vec; k += 32) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + k));
      const __m256i xa = _mm256_abs_epi8(xv);
      a0 = multiply_add(a0, xa, xv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + k)));
      a1 = multiply_add(a1, xa, xv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + k)));
      a2 = multiply_add(a2, xa, xv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w2 + k)));
      a3 = multiply_add(a3, xa, xv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w3 + k)));
    }
    alignas(16) int32_t sums[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(sums), reduce4(a0, a1, a2, a3));
    const int8_t* rows[4] = {w0, w1, w2, w3};
    for (int r = 0; r < 4; ++r) out[m * N + n + r] = sums[r] + dot_generic(xm, rows[r], k_vec, K);
  }
}
#endif

void product_rows(const int8_t* x, const int8_t* w, int32_t* out, int64_t M, int64_t K, int64_t N, int64_t n_begin,
                  int64_t n_end) {
  int64_t n = n_begin;
#if defined(__AVX2__)
  for (; n + kRowsPerTile <= n_end; n += kRowsPerTile) tile4(x, w, out, M, K, N, n);
#endif
  for (; n < n_end; ++n) {
    for (int64_t m = 0; m < M; ++m) out[m * N + n] = dot_generic(x + m * K, w + n * K, 0, K);
  }
}

}  // namespace

// x_q [M, K] int8, w_q [N, K] int8 (both contiguous) -> out [M, N] int32 (contiguous) = x_q @ w_q.T, exact.
void product(torch::Tensor x_q, torch::Tensor w_q, torch::Tensor out) {
  TORCH_CHECK(x_q.dim() == 2 && x_q.is_contiguous() && x_q.scalar_type() == at::kChar,
              "x_q must be a contiguous [M, K] int8 tensor");
  TORCH_CHECK(w_q.dim() == 2 && w_q.is_contiguous() && w_q.scalar_type() == at::kChar,
              "w_q must be a contiguous [N, K] int8 tensor");
  TORCH_CHECK(x_q.size(1) == w_q.size(1), "x_q and w_q must have the same K");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kInt && out.size(0) == x_q.size(0) &&
                  out.size(1) == w_q.size(0),
              "out must be a contiguous [M, N] int32 tensor");
  const int64_t M = x_q.size(0), K = x_q.size(1), N = w_q.size(0);
  const int8_t* x = x_q.const_data_ptr<int8_t>();
  const int8_t* w = w_q.const_data_ptr<int8_t>();
  int32_t* o = out.data_ptr<int32_t>();
  at::parallel_for(0, (N + kGrainRows - 1) / kGrainRows, 1, [&](int64_t first, int64_t last) {
    product_rows(x, w, o, M, K, N, first * kGrainRows, std::min(N, last * kGrainRows));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("product", &product); }
