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
// full-range weight codes as well as the 7-bit codes of the oneDNN backend.
//
// With 7-bit weight codes (|w| <= 63: the oneDNN backend's without VNNI, whose codes this kernel shares) the
// AVX2 loop needs no sign trick: the activations enter shifted to unsigned once per call (x + 128, <= 255), so
// vpmaddubsw multiplies them by the weights as they are (pair sums <= 2 * 255 * 63 = 32130, exact) and
// 128 * sum(w) (per weight row, summed at load) comes off at the end: 3 instructions per 32 multiply-adds
// instead of 4, and no |x| per load. The caller passes those row sums only for 7-bit codes.
//
// With AVX-512 VNNI (the avx512 tier) a tile of 4 weight rows x 4 activation rows is kept in 16 zmm
// accumulators and fed 64 bytes per vpdpbusd, which multiplies u8 by s8: the weights enter shifted to
// unsigned (w + 128, one xor per weight load, shared by the tile's activation rows) and 128 * sum(x) is
// taken off each sum at the end, exact in int32 (|sum| < 1536 * 255 * 128 < 2^31 at K = 1536). That is one
// instruction per 64 multiply-adds against ~3.5 per 32 for the sign trick above, whose per-pair sign
// flips depend on both operands: at 16 rows the old loop ran 4x the instructions the weights' bytes need,
// and a decode step of a small batch was bound by them, not by memory.
//
// On that tier the weights are normally prepared as panels of 16 output columns instead
// (int8_vnni_panels.h: no per-tile reduction, so at Gemma's K = 640 twice this loop's rate); this loop keeps
// the [N, K] codes of AMX machines (whose tiles read them in place) below kAmxMinRows, and a K not a
// multiple of 4.
//
// With AMX-INT8 (Sapphire Rapids and later) the product runs on tiles instead, transposed so that the
// weights need no repacking: out^T [N, M] = w [N, K] . x^T, with a 16-row x 64-byte block of the weight
// matrix loaded in place as the A tile and the activations packed once per call into the B tiles' layout.
// One tile product is 16 x 16 x 64 multiply-adds, so up to a few dozen rows cost what reading the weights
// costs (figures at kAmxMinRows below).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "int8_vnni_panels.h"
#include "vnni_inplace.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowsPerTile = 4;  // weight rows multiplied together (4 accumulators, one x load each)
constexpr int64_t kGrainRows = 16;   // weight rows per parallel task
// The weights stream from memory once per product: a weight tile this many tiles ahead of use is
// prefetched into L2 (not L1, whose few fill buffers capped a core at ~13 GB/s). On the AVX-512 VM, one
// pass over SmolLM2's 134 MB of INT8 weights at 1 / 16 / 32 rows: 6.35 / 12.9 / 20.5 ms prefetching 4
// tiles ahead into L1, 5.1 / 9.9 / 15.6 ms 8 tiles ahead into L2 (16 and 32 ahead: no better); the AVX2
// loop, which prefetched nothing, 9.35 -> 5.5 ms at 1 row.
constexpr int64_t kPrefetchTiles = 8;

#if defined(__AVX2__)
inline void prefetch_tile(const int8_t* w, int64_t K, int64_t n, int64_t n_end) {
  const int64_t ahead = n + kPrefetchTiles * kRowsPerTile;
  if (ahead + kRowsPerTile > n_end) return;
  const char* p = reinterpret_cast<const char*>(w + ahead * K);
  for (int64_t offset = 0; offset < kRowsPerTile * K; offset += 64) _mm_prefetch(p + offset, _MM_HINT_T1);
}
#endif

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

// tile4 for 7-bit weight codes: xu = x + 128 as u8 (see the top), w_sums[n] = sum_k w[n, k].
void tile4_u8(const uint8_t* xu, const int8_t* w, const int32_t* w_sums, int32_t* out, int64_t M, int64_t K,
              int64_t N, int64_t n) {
  const int64_t k_vec = K - K % 32;
  const int8_t* w0 = w + n * K;
  const int8_t* w1 = w0 + K;
  const int8_t* w2 = w1 + K;
  const int8_t* w3 = w2 + K;
  const int8_t* rows[4] = {w0, w1, w2, w3};
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t m = 0; m < M; ++m) {
    const uint8_t* xm = xu + m * K;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < k_vec; k += 32) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + k));
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(
          _mm256_maddubs_epi16(xv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + k))), ones));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(
          _mm256_maddubs_epi16(xv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + k))), ones));
      a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(
          _mm256_maddubs_epi16(xv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w2 + k))), ones));
      a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(
          _mm256_maddubs_epi16(xv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w3 + k))), ones));
    }
    alignas(16) int32_t sums[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(sums), reduce4(a0, a1, a2, a3));
    for (int r = 0; r < 4; ++r) {
      int32_t tail = 0;  // the last K % 32 columns, shifted like the rest
      for (int64_t k = k_vec; k < K; ++k) tail += static_cast<int32_t>(xm[k]) * static_cast<int32_t>(rows[r][k]);
      out[m * N + n + r] = sums[r] + tail - 128 * w_sums[n + r];
    }
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define FREIGHT_INT8_VNNI512 1
constexpr int kActivationRowsPerTile = 4;

// The first `bytes` of a 64-byte step, at most all of them: masked loads read zeros past K.
inline __mmask64 live_bytes(int64_t bytes) { return bytes >= 64 ? ~__mmask64(0) : (__mmask64(1) << bytes) - 1; }

// The lane sums of four accumulators, as [sum(a), sum(b), sum(c), sum(d)].
inline __m128i reduce4(__m512i a, __m512i b, __m512i c, __m512i d) {
  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3], then [a, b, c, d] partials
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

// One 64-byte step of a tile: acc[r][j] += (w_j + 128) . x_r over the step's bytes (masked: zero bytes).
template <int MX>
__attribute__((always_inline)) inline void step_vnni(__m512i (&acc)[MX][4], const int8_t* wr, const int8_t* xr,
                                                     int64_t K, int64_t k, __mmask64 live) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i wv[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) wv[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(live, wr + j * K + k), flip);
#pragma GCC unroll 4
  for (int r = 0; r < MX; ++r) {
    const __m512i xv = _mm512_maskz_loadu_epi8(live, xr + r * K + k);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) freight::dpbusd(acc[r][j], wv[j], xv);
  }
}

// out[m0 + r, n .. n + 3] for r < MX: 4 weight rows (shifted to u8) against MX activation rows, 64 bytes
// a step; the last partial step loads under a mask.
template <int MX>
void tile_vnni(const int8_t* x, const int8_t* w, const int32_t* x_sums, int32_t* out, int64_t K, int64_t N,
               int64_t n, int64_t m0) {
  const int8_t* wr = w + n * K;
  const int8_t* xr = x + m0 * K;
  __m512i acc[MX][4];
#pragma GCC unroll 4
  for (int r = 0; r < MX; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
  const int64_t k_full = K - K % 64;
  for (int64_t k = 0; k < k_full; k += 64) step_vnni<MX>(acc, wr, xr, K, k, ~__mmask64(0));
  if (k_full < K) step_vnni<MX>(acc, wr, xr, K, k_full, live_bytes(K - k_full));
#pragma GCC unroll 4
  for (int r = 0; r < MX; ++r) {
    const __m128i sums = _mm_sub_epi32(reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]),
                                       _mm_set1_epi32(128 * x_sums[m0 + r]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (m0 + r) * N + n), sums);
  }
}

// sum_k x[m, k] for every row: the shift's correction.
std::vector<int32_t> row_sums(const int8_t* x, int64_t M, int64_t K) {
  std::vector<int32_t> sums(M);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t m = 0; m < M; ++m) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64)
      acc = _mm512_dpbusd_epi32(acc, ones, _mm512_maskz_loadu_epi8(live_bytes(K - k), x + m * K + k));
    sums[m] = _mm512_reduce_add_epi32(acc);
  }
  return sums;
}

#endif

// out[:, n_begin .. n_end) by the build's widest loop; x_sums (row_sums) only for the VNNI one; xu and w_sums
// (7-bit weight codes) only for the AVX2 one, which then takes tile4_u8.
void product_rows(const int8_t* x, const int8_t* w, const int32_t* x_sums, const uint8_t* xu, const int32_t* w_sums,
                  int32_t* out, int64_t M, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
#if defined(FREIGHT_INT8_VNNI512)
  for (; n + kRowsPerTile <= n_end; n += kRowsPerTile) {
    prefetch_tile(w, K, n, n_end);
    int64_t m = 0;
    for (; m + kActivationRowsPerTile <= M; m += kActivationRowsPerTile) tile_vnni<4>(x, w, x_sums, out, K, N, n, m);
    switch (M - m) {
      case 3: tile_vnni<3>(x, w, x_sums, out, K, N, n, m); break;
      case 2: tile_vnni<2>(x, w, x_sums, out, K, N, n, m); break;
      case 1: tile_vnni<1>(x, w, x_sums, out, K, N, n, m); break;
      default: break;
    }
  }
#elif defined(__AVX2__)
  for (; n + kRowsPerTile <= n_end; n += kRowsPerTile) {
    prefetch_tile(w, K, n, n_end);
    if (w_sums != nullptr) {
      tile4_u8(xu, w, w_sums, out, M, K, N, n);
    } else {
      tile4(x, w, out, M, K, N, n);
    }
  }
#else
  (void)xu;
  (void)w_sums;
#endif
  for (; n < n_end; ++n) {
    for (int64_t m = 0; m < M; ++m) out[m * N + n] = dot_generic(x + m * K, w + n * K, 0, K);
  }
}


// ---------------------------------------------------------------------------------------------------
// AMX-INT8. Tiles 0-3: accumulators, out^T for 16 weight rows x 16 activation rows (one per block of 16
// activation rows, up to 4 blocks at once); tile 4: the A operand, 16 weight rows x 64 bytes of K, read in
// place with stride K; tile 5: the B operand, 64 bytes of K x 16 activation rows in the pair-of-four layout
// tdpbssd reads ([k / 4][m][4]), packed once per call.
#if defined(__AVX512F__) && defined(__GNUC__) && __GNUC__ >= 11 && defined(__x86_64__)
#define FREIGHT_INT8_AMX 1
#include <immintrin.h>
#define FREIGHT_AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
constexpr int64_t kAmxRows = 16;       // weight rows (and activation rows) per tile
constexpr int64_t kAmxK = 64;          // bytes of K per tile product
constexpr int kAmxBlocks = 4;          // activation-row blocks accumulated at once (tiles 0-3)
constexpr int64_t kAmxPrefetch = 2;    // weight blocks prefetched ahead into L2
// Fewer activation rows take the VNNI loop: both stream the weights, and below 8 rows the tiles' fixed
// work (a full 16-row product, the transposed write) costs more than the loop's per-row work (2-core Xeon
// VM, one pass over 64 MB of SmolLM2's layers: 1.43 vs 1.75 ms at 1 row, 2.13 vs 1.84 at 8, 3.35 vs 1.93
// at 16, 5.82 vs 2.65 at 32, 10.9 vs 5.1 at 64)
constexpr int64_t kAmxMinRows = 8;
static_assert(kAmxRows % kGrainRows == 0, "the SIMD loop's tasks start where the tiles' rows end");

// Six tiles of 16 rows x 64 bytes.
constexpr freight::TileConfig kTileConfig{1, 0, {}, {64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16}};

// x [M, K] -> [ceil(M / 16)][K / 64][16 (k / 4)][16 (m)][4 (k % 4)], rows past M zero.
std::vector<int8_t> pack_activations(const int8_t* x, int64_t M, int64_t K) {
  const int64_t blocks = (M + kAmxRows - 1) / kAmxRows, chunks = K / kAmxK;
  std::vector<int8_t> packed(blocks * chunks * kAmxRows * kAmxK, 0);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t b = m / kAmxRows, col = m % kAmxRows;
    for (int64_t c = 0; c < chunks; ++c) {
      int8_t* tile = packed.data() + (b * chunks + c) * kAmxRows * kAmxK;
      for (int64_t r = 0; r < kAmxRows; ++r) std::memcpy(tile + r * kAmxK + col * 4, x + m * K + c * kAmxK + r * 4, 4);
    }
  }
  return packed;
}

// Accumulators 0 .. B-1 += the weight block at w (16 rows, stride K) times activation blocks first .. first+B-1.
// ahead: a later weight block (16 x K bytes, contiguous) to stream into L2, 16 lines per chunk of K, or null.
// Spread over the products rather than issued at once: a burst of 10 KB of prefetches fills the core's miss
// queue and stalls the tile products behind it (Gemma 3's LM head at 16 / 24 rows: 7.5 / 8.1 ms with the
// burst, 5.7 / 6.8 ms spread).
template <int B>
FREIGHT_AMX_TARGET inline void amx_block(const int8_t* w, const int8_t* xp, int64_t K, int64_t first,
                                         const char* ahead) {
  const int64_t chunks = K / kAmxK, block_bytes = chunks * kAmxRows * kAmxK;
  _tile_zero(0);
  if constexpr (B > 1) _tile_zero(1);
  if constexpr (B > 2) _tile_zero(2);
  if constexpr (B > 3) _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    if (ahead)
      for (int64_t line = 0; line < kAmxRows; ++line) _mm_prefetch(ahead + (c * kAmxRows + line) * 64, _MM_HINT_T1);
    _tile_loadd(4, w + c * kAmxK, K);
    const int8_t* b = xp + first * block_bytes + c * kAmxRows * kAmxK;
    _tile_loadd(5, b, kAmxK);
    _tile_dpbssd(0, 4, 5);
    if constexpr (B > 1) { _tile_loadd(5, b + block_bytes, kAmxK); _tile_dpbssd(1, 4, 5); }
    if constexpr (B > 2) { _tile_loadd(5, b + 2 * block_bytes, kAmxK); _tile_dpbssd(2, 4, 5); }
    if constexpr (B > 3) { _tile_loadd(5, b + 3 * block_bytes, kAmxK); _tile_dpbssd(3, 4, 5); }
  }
}

template <int B>
FREIGHT_AMX_TARGET inline void amx_store(int32_t (*acc)[kAmxRows][kAmxRows]) {
  _tile_stored(0, acc[0], kAmxRows * sizeof(int32_t));
  if constexpr (B > 1) _tile_stored(1, acc[1], kAmxRows * sizeof(int32_t));
  if constexpr (B > 2) _tile_stored(2, acc[2], kAmxRows * sizeof(int32_t));
  if constexpr (B > 3) _tile_stored(3, acc[3], kAmxRows * sizeof(int32_t));
}

// out[m0 + r, n .. n + 15] = acc[j][r] for r < rows: the accumulator tile transposed in registers (a 16 x 16
// int32 transpose: pairs of rows interleaved, then pairs of pairs, then the 128-bit lanes), since reading
// it back element by element cost more than the tile products (the loads wait on the tile store).
inline void store_transposed(const int32_t (*acc)[kAmxRows], int32_t* out, int64_t N, int64_t rows) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(acc[i]);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // s[g][c], lane L: column 4L + c of rows 4g .. 4g + 3
  __m512i s[4][4];
  for (int g = 0; g < 4; ++g) {
    s[g][0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    s[g][1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    s[g][2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    s[g][3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i u0 = _mm512_shuffle_i32x4(s[0][c], s[1][c], 0x44), u1 = _mm512_shuffle_i32x4(s[0][c], s[1][c], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(s[2][c], s[3][c], 0x44), u3 = _mm512_shuffle_i32x4(s[2][c], s[3][c], 0xEE);
    const __m512i columns[4] = {_mm512_shuffle_i32x4(u0, u2, 0x88), _mm512_shuffle_i32x4(u0, u2, 0xDD),
                                _mm512_shuffle_i32x4(u1, u3, 0x88), _mm512_shuffle_i32x4(u1, u3, 0xDD)};
    for (int L = 0; L < 4; ++L)
      if (4 * L + c < rows) _mm512_storeu_si512(out + (4 * L + c) * N, columns[L]);
  }
}

// out[:, n_begin .. n_end) for n_end - n_begin a multiple of 16, K a multiple of 64.
FREIGHT_AMX_TARGET void product_rows_amx(const int8_t* xp, const int8_t* w, int32_t* out, int64_t M, int64_t K,
                                         int64_t N, int64_t n_begin, int64_t n_end) {
  _tile_loadconfig(&kTileConfig);
  const int64_t m_blocks = (M + kAmxRows - 1) / kAmxRows;
  // [buffer][block][weight row][activation row]: a block's tiles are stored into one buffer while the other
  // buffer, stored a weight block earlier, is written out (loads right behind a tile store wait for it)
  alignas(64) int32_t acc[2][kAmxBlocks][kAmxRows][kAmxRows];
  int64_t pending_n = -1, pending_first = 0;  // the block stored into acc[1 - current], not yet written
  int pending_blocks = 0, current = 0;
  const auto write_pending = [&]() {
    for (int b = 0; b < pending_blocks; ++b) {
      const int64_t m0 = (pending_first + b) * kAmxRows;
      store_transposed(acc[1 - current][b], out + m0 * N + pending_n, N, std::min(kAmxRows, M - m0));
    }
  };
  for (int64_t n = n_begin; n < n_end; n += kAmxRows) {
    // the weight block two ahead streams into L2 while this one is multiplied (by the first activation blocks)
    const int64_t ahead_n = n + kAmxPrefetch * kAmxRows;
    const char* ahead = ahead_n < n_end ? reinterpret_cast<const char*>(w + ahead_n * K) : nullptr;
    const int8_t* wn = w + n * K;
    for (int64_t first = 0; first < m_blocks; first += kAmxBlocks) {
      const int blocks = static_cast<int>(std::min<int64_t>(kAmxBlocks, m_blocks - first));
      const char* prefetch = first == 0 ? ahead : nullptr;
      switch (blocks) {
        case 4: amx_block<4>(wn, xp, K, first, prefetch); amx_store<4>(acc[current]); break;
        case 3: amx_block<3>(wn, xp, K, first, prefetch); amx_store<3>(acc[current]); break;
        case 2: amx_block<2>(wn, xp, K, first, prefetch); amx_store<2>(acc[current]); break;
        default: amx_block<1>(wn, xp, K, first, prefetch); amx_store<1>(acc[current]); break;
      }
      if (pending_n >= 0) write_pending();
      pending_n = n, pending_first = first, pending_blocks = blocks;
      current = 1 - current;
    }
  }
  if (pending_n >= 0) write_pending();
  _tile_release();
}

// Whether this CPU has AMX-INT8 and the kernel lets this process use its tile registers.
bool amx_usable() {
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && freight::request_amx_tiles();
}
#endif

bool available_amx() {
#if defined(FREIGHT_INT8_AMX)
  static const bool usable = amx_usable();
  return usable;
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------------------------------
// Greedy picks of an INT8 LM head without its logits. A greedy step needs only each row's first maximal
// logit, yet the [M, vocab] float32 logits (67 MB at 64 rows of Gemma's 262,144 tokens) were written, read
// back by the max and, as int32 products, written and read once more: a few times the weights' own bytes.
// Here each task multiplies a block of weight rows into an L1/L2-resident int32 buffer and keeps a running
// maximum per activation row; the logits are the epilogue's own numbers (float(acc) * x_scale * w_scale,
// dequantize_rows' order), so the picks equal max(dim=-1) of the logits the unfused path writes, first
// index on ties and the first NaN winning, as torch's max does.
constexpr int64_t kPickBlock = 256;  // weight rows per block: 24 rows x 256 x 4 bytes of products stay in L1

struct RowPick {
  float value;
  int64_t index;
};

// a beats b (b found earlier): larger, or the first NaN.
inline bool beats(float a, float b) { return a > b || (std::isnan(a) && !std::isnan(b)); }

void pick_block(const int32_t* acc, int64_t M, int64_t width, const float* x_scale, const float* w_scale,
                int64_t n0, RowPick* picks) {
  for (int64_t m = 0; m < M; ++m) {
    const int32_t* a = acc + m * width;
    const float xs = x_scale[m];
    RowPick best = picks[m];
    int64_t c = 0;
#if defined(__AVX512F__)
    // 16 lanes at a time: the block's maximum first (NaNs checked apart: max_ps drops them), then the scalar
    // scan only where the row's best changes
    const __m512 xs_v = _mm512_set1_ps(xs);
    __m512 top = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    const int64_t body = width - width % 16;
    for (; c < body; c += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a + c)), xs_v),
                                     _mm512_loadu_ps(w_scale + c));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      top = _mm512_max_ps(top, v);
    }
    if (nan || beats(_mm512_reduce_max_ps(top), best.value)) c = 0;  // rescan the body in order
    else c = body;
#elif defined(__AVX2__)
    // the same with 8 lanes
    const __m256 xs_v = _mm256_set1_ps(xs);
    __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    const int64_t body = width - width % 8;
    for (; c < body; c += 8) {
      const __m256 v = _mm256_mul_ps(
          _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c))), xs_v),
          _mm256_loadu_ps(w_scale + c));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      top = _mm256_max_ps(top, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    const float block_max = *std::max_element(lanes, lanes + 8);
    if (_mm256_movemask_ps(nan) || beats(block_max, best.value)) c = 0;
    else c = body;
#endif
    for (; c < width; ++c) {
      const float v = static_cast<float>(a[c]) * xs * w_scale[c];
      if (beats(v, best.value)) best = {v, n0 + c};
    }
    picks[m] = best;
  }
}

// What the SIMD loop (product_rows) takes beside the codes: the activations' row sums (the VNNI loop's
// unsigned-activation correction), or with the row sums of 7-bit weight codes on AVX2 the activations + 128.
struct LoopExtras {
  std::vector<int32_t> x_sums;
  std::vector<uint8_t> xu;
  const int32_t* w_sum = nullptr;
};

LoopExtras loop_extras(const int8_t* x, int64_t M, int64_t K, int64_t N, const c10::optional<torch::Tensor>& w_sums) {
  LoopExtras extras;
#if defined(FREIGHT_INT8_VNNI512)
  extras.x_sums = row_sums(x, M, K);
#endif
#if defined(__AVX2__) && !defined(FREIGHT_INT8_VNNI512)
  if (w_sums.has_value()) {
    TORCH_CHECK(w_sums->dim() == 1 && w_sums->size(0) == N && w_sums->is_contiguous() &&
                    w_sums->scalar_type() == at::kInt,
                "w_sums must be a contiguous [N] int32 tensor");
    extras.w_sum = w_sums->const_data_ptr<int32_t>();
    extras.xu.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) extras.xu[i] = static_cast<uint8_t>(x[i]) ^ 0x80;  // x + 128
  }
#endif
  return extras;
}

// Each row's first maximal float(acc) * x_scale * w_scale over N columns, where product(n0, width, acc) writes
// the int32 products of columns [n0, n0 + width) into acc [M, width] (a task's buffer).
template <typename BlockProduct>
std::tuple<torch::Tensor, torch::Tensor> argmax_blocks(int64_t M, int64_t N, const float* xs, const float* ws,
                                                       const BlockProduct& product) {
  // One contiguous range of blocks per task, a few tasks per thread; the tasks' picks merge in order, so
  // the first index wins ties across tasks as within one.
  const int64_t blocks = (N + kPickBlock - 1) / kPickBlock;
  const int64_t tasks = std::min<int64_t>(blocks, 4 * at::get_num_threads());
  std::vector<RowPick> picks(tasks * M);
  at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    std::vector<int32_t> acc(M * kPickBlock);
    for (int64_t t = first; t < last; ++t) {
      const int64_t b_begin = blocks * t / tasks, b_end = blocks * (t + 1) / tasks;
      RowPick* mine = picks.data() + t * M;
      for (int64_t m = 0; m < M; ++m) mine[m] = {-INFINITY, b_begin * kPickBlock};
      for (int64_t b = b_begin; b < b_end; ++b) {
        const int64_t n0 = b * kPickBlock, width = std::min(kPickBlock, N - n0);
        product(n0, width, acc.data());
        pick_block(acc.data(), M, width, xs, ws + n0, n0, mine);
      }
    }
  });
  torch::Tensor indices = torch::empty({M}, torch::kLong), values = torch::empty({M}, torch::kFloat);
  int64_t* idx = indices.data_ptr<int64_t>();
  float* val = values.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    RowPick best = picks[m];
    for (int64_t t = 1; t < tasks; ++t)
      if (beats(picks[t * M + m].value, best.value)) best = picks[t * M + m];
    idx[m] = best.index;
    val[m] = best.value;
  }
  return {indices, values};
}

void check_scales(const torch::Tensor& x_scale, const torch::Tensor& w_scale, int64_t M, int64_t N) {
  TORCH_CHECK(x_scale.dim() == 1 && x_scale.size(0) == M && x_scale.is_contiguous() &&
                  x_scale.scalar_type() == at::kFloat, "x_scale must be a contiguous [M] float32 tensor");
  TORCH_CHECK(w_scale.dim() == 1 && w_scale.size(0) == N && w_scale.is_contiguous() &&
                  w_scale.scalar_type() == at::kFloat, "w_scale must be a contiguous [N] float32 tensor");
  TORCH_CHECK(N > 0, "the weight must have rows");
}

void check_codes(const torch::Tensor& x_q, const torch::Tensor& w_q) {
  TORCH_CHECK(x_q.dim() == 2 && x_q.is_contiguous() && x_q.scalar_type() == at::kChar,
              "x_q must be a contiguous [M, K] int8 tensor");
  TORCH_CHECK(w_q.dim() == 2 && w_q.is_contiguous() && w_q.scalar_type() == at::kChar,
              "w_q must be a contiguous [N, K] int8 tensor");
  TORCH_CHECK(x_q.size(1) == w_q.size(1), "x_q and w_q must have the same K");
}

#if defined(FREIGHT_INT8_VNNI512)
// x_q [M, K] against panels [ceil(N / 16), K / 4, 16, 4] uint8 (int8_vnni_panels.h): checked, with K.
int64_t check_panels(const torch::Tensor& x_q, const torch::Tensor& panels, int64_t N) {
  TORCH_CHECK(x_q.dim() == 2 && x_q.is_contiguous() && x_q.scalar_type() == at::kChar,
              "x_q must be a contiguous [M, K] int8 tensor");
  const int64_t K = x_q.size(1);
  TORCH_CHECK(panels.dim() == 4 && panels.is_contiguous() && panels.scalar_type() == at::kByte &&
                  panels.size(0) == (N + 15) / 16 && panels.size(1) * 4 == K && panels.size(2) == 16 &&
                  panels.size(3) == 4,
              "panels must be a contiguous [ceil(N / 16), K / 4, 16, 4] uint8 tensor for N = ", N, ", K = ", K);
  TORCH_CHECK(K <= 65536, "the panel product is exact for K up to 65536, got ", K);
  return K;
}

// What the panel product takes of x [M, K] beside the panels: the shift's correction 128 * sum_k x[m, k] per
// row, and the rows interleaved (freight_panels::interleave_rows).
struct PanelInputs {
  std::vector<int32_t> shift;
  std::vector<int8_t> interleaved;
};

PanelInputs panel_inputs(const int8_t* x, int64_t M, int64_t K) {
  PanelInputs inputs{row_sums(x, M, K), freight_panels::interleave_rows(x, M, K)};
  for (int32_t& s : inputs.shift) s *= 128;
  return inputs;
}
#endif

void check_out(const torch::Tensor& out, int64_t M, int64_t N) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kInt && out.size(0) == M &&
                  out.size(1) == N,
              "out must be a contiguous [M, N] int32 tensor");
}

}  // namespace

// Whether this build has the panel product (AVX-512 VNNI).
bool available_panels() {
#if defined(FREIGHT_INT8_VNNI512)
  return true;
#else
  return false;
#endif
}

// x_q [M, K] int8 with x_scale [M] float32 (per-token codes), w_q [N, K] int8 with w_scale [N] float32 ->
// (indices [M] int64, values [M] float32): per row the first maximal float(x_q @ w_q.T) * x_scale * w_scale.
// w_sums as for `product`.
std::tuple<torch::Tensor, torch::Tensor> argmax_product(torch::Tensor x_q, torch::Tensor x_scale, torch::Tensor w_q,
                                                        torch::Tensor w_scale, bool amx,
                                                        c10::optional<torch::Tensor> w_sums) {
  check_codes(x_q, w_q);
  const int64_t M = x_q.size(0), K = x_q.size(1), N = w_q.size(0);
  check_scales(x_scale, w_scale, M, N);
  const int8_t* x = x_q.const_data_ptr<int8_t>();
  const int8_t* w = w_q.const_data_ptr<int8_t>();
  const LoopExtras extras = loop_extras(x, M, K, N, w_sums);
  bool tiles = false;  // each block's 16-row multiples on AMX tiles, as `product` takes them
#if defined(FREIGHT_INT8_AMX)
  TORCH_CHECK(!amx || available_amx(), "AMX is not usable here");
  tiles = amx && M >= kAmxMinRows && K % kAmxK == 0;
  const std::vector<int8_t> xp = tiles ? pack_activations(x, M, K) : std::vector<int8_t>();
#else
  TORCH_CHECK(!amx, "built without AMX support");
#endif
  return argmax_blocks(M, N, x_scale.const_data_ptr<float>(), w_scale.const_data_ptr<float>(),
                       [&](int64_t n0, int64_t width, int32_t* acc) {
                         int64_t on_tiles = 0;
#if defined(FREIGHT_INT8_AMX)
                         if (tiles) {
                           on_tiles = width - width % kAmxRows;
                           if (on_tiles) product_rows_amx(xp.data(), w + n0 * K, acc, M, K, width, 0, on_tiles);
                         }
#endif
                         if (on_tiles < width)
                           product_rows(x, w + n0 * K, extras.x_sums.data(), extras.xu.data(),
                                        extras.w_sum ? extras.w_sum + n0 : nullptr, acc, M, K, width, on_tiles, width);
                       });
}

// argmax_product over the weight's panels (int8_vnni_panels.h) instead of its [N, K] codes: the same picks.
std::tuple<torch::Tensor, torch::Tensor> argmax_panels(torch::Tensor x_q, torch::Tensor x_scale, torch::Tensor panels,
                                                       int64_t N, torch::Tensor w_scale) {
#if defined(FREIGHT_INT8_VNNI512)
  const int64_t K = check_panels(x_q, panels, N), M = x_q.size(0);
  check_scales(x_scale, w_scale, M, N);
  const uint8_t* p = panels.const_data_ptr<uint8_t>();
  const PanelInputs in = panel_inputs(x_q.const_data_ptr<int8_t>(), M, K);
  return argmax_blocks(M, N, x_scale.const_data_ptr<float>(), w_scale.const_data_ptr<float>(),
                       [&](int64_t n0, int64_t width, int32_t* acc) {
                         freight_panels::panel_product(in.interleaved.data(), in.shift.data(), p, acc, width, M, K, N,
                                                       n0, n0 + width);
                       });
#else
  (void)x_q, (void)x_scale, (void)panels, (void)N, (void)w_scale;
  TORCH_CHECK(false, "built without AVX-512 VNNI: no panel product");
#endif
}

// out [M, N] int32 = x_q @ w.T over the weight's panels (int8_vnni_panels.h), exact.
void product_panels(torch::Tensor x_q, torch::Tensor panels, int64_t N, torch::Tensor out) {
#if defined(FREIGHT_INT8_VNNI512)
  const int64_t K = check_panels(x_q, panels, N), M = x_q.size(0);
  check_out(out, M, N);
  const uint8_t* p = panels.const_data_ptr<uint8_t>();
  int32_t* o = out.data_ptr<int32_t>();
  const PanelInputs in = panel_inputs(x_q.const_data_ptr<int8_t>(), M, K);
  constexpr int64_t grain = freight_panels::kPanelsPerStep * freight_panels::kColumns;  // one panel pair per task
  at::parallel_for(0, (N + grain - 1) / grain, 1, [&](int64_t first, int64_t last) {
    const int64_t n_begin = first * grain, n_end = std::min(N, last * grain);
    freight_panels::panel_product(in.interleaved.data(), in.shift.data(), p, o + n_begin, N, M, K, N, n_begin, n_end);
  });
#else
  (void)x_q, (void)panels, (void)N, (void)out;
  TORCH_CHECK(false, "built without AVX-512 VNNI: no panel product");
#endif
}

// x_q [M, K] int8, w_q [N, K] int8 (both contiguous) -> out [M, N] int32 (contiguous) = x_q @ w_q.T, exact.
// w_sums [N] int32 = w_q.sum(1), given only when every |w| <= 63 (the caller checks once, at load): the AVX2
// loop then takes the unsigned-activation form (see the top); other builds ignore it.
void product(torch::Tensor x_q, torch::Tensor w_q, torch::Tensor out, bool amx, c10::optional<torch::Tensor> w_sums) {
  check_codes(x_q, w_q);
  check_out(out, x_q.size(0), w_q.size(0));
  const int64_t M = x_q.size(0), K = x_q.size(1), N = w_q.size(0);
  const int8_t* x = x_q.const_data_ptr<int8_t>();
  const int8_t* w = w_q.const_data_ptr<int8_t>();
  int32_t* o = out.data_ptr<int32_t>();
  int64_t n_simd = 0;  // weight rows from here on take the SIMD loop
#if defined(FREIGHT_INT8_AMX)
  TORCH_CHECK(!amx || available_amx(), "AMX is not usable here");
  if (amx && M >= kAmxMinRows && K % kAmxK == 0 && N >= kAmxRows) {
    const std::vector<int8_t> xp = pack_activations(x, M, K);
    n_simd = N - N % kAmxRows;  // the last rows, fewer than a tile, stay with the loop
    at::parallel_for(0, n_simd / kAmxRows, 1, [&](int64_t first, int64_t last) {
      product_rows_amx(xp.data(), w, o, M, K, N, first * kAmxRows, last * kAmxRows);
    });
    if (n_simd == N) return;
  }
#else
  TORCH_CHECK(!amx, "built without AMX support");
#endif
  const LoopExtras extras = loop_extras(x, M, K, N, w_sums);
  // n_simd is a multiple of a tile's 16 rows, and so of kGrainRows
  at::parallel_for(n_simd / kGrainRows, (N + kGrainRows - 1) / kGrainRows, 1, [&](int64_t first, int64_t last) {
    product_rows(x, w, extras.x_sums.data(), extras.xu.data(), extras.w_sum, o, M, K, N, first * kGrainRows,
                 std::min(N, last * kGrainRows));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("product", &product, py::arg("x_q"), py::arg("w_q"), py::arg("out"), py::arg("amx"),
        py::arg("w_sums") = py::none());
  m.def("available_amx", &available_amx);
  m.def("argmax_product", &argmax_product, py::arg("x_q"), py::arg("x_scale"), py::arg("w_q"), py::arg("w_scale"),
        py::arg("amx"), py::arg("w_sums") = py::none());
  m.def("available_panels", &available_panels);
  m.def("product_panels", &product_panels, py::arg("x_q"), py::arg("panels"), py::arg("N"), py::arg("out"));
  m.def("argmax_panels", &argmax_panels, py::arg("x_q"), py::arg("x_scale"), py::arg("panels"), py::arg("N"),
        py::arg("w_scale"));
}
