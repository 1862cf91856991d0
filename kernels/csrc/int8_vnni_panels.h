// The small-batch int8 product on AVX-512 VNNI over weights packed in panels of 16 output columns.
//
// Why a second layout: the row-major loop (tile_vnni in int8_small_batch_cpu.cpp) multiplies 4 weight rows by
// 4 activation rows and must sum each accumulator's 16 lanes at the end of every tile: at K = 640 (Gemma 3)
// that reduction and the tile's loads cost about as much as its 10 steps of products, and the loop ran Gemma's
// [64, 640] x [262144, 640] LM head at half the tier's INT8 rate. Packed as panels, one zmm load holds 4 bytes
// of K for 16 output columns, an activation's 4 bytes are broadcast to every lane, and vpdpbusd accumulates
// 16 outputs at once: the accumulators are the outputs themselves, with no reduction, and each weight load
// feeds MR products. This is the register-blocked form of every GEMM library's VNNI kernel.
//
// Layout: panels [ceil(N / 16)][K / 4][16][4] uint8 = w + 128 (the shift vpdpbusd's unsigned operand needs,
// done once at load; rows past N are zero codes), so out[m, n] = sum_k (w[n, k] + 128) * x[m, k]
// - 128 * sum_k x[m, k], exact in int32 for K up to 2^16 (|partial| <= K * 255 * 128 < 2^31).
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vnni_inplace.h"

namespace freight_panels {

constexpr int64_t kColumns = 16;   // output columns per panel (one zmm of int32)
constexpr int64_t kDepth = 4;      // bytes of K per vpdpbusd lane
constexpr int kPanelsPerStep = 2;  // NR: panels multiplied together (2 weight loads per step)
constexpr int kRowsPerStep = 12;   // MR: activation rows multiplied together (24 accumulators)

// The store mask of a panel whose columns end at `valid` (< 16 for the last panel of an N not divisible by 16).
inline __mmask16 column_mask(int64_t valid) {
  if (valid <= 0) return 0;
  return valid >= kColumns ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
}

// Rows per chunk of the activations: a chunk's rows are multiplied by every panel pair before the next chunk
// starts, and its interleaved activations (192 x K bytes: 120 KB at K = 640) stay in L2 meanwhile.
constexpr int64_t kRowChunk = 16 * kRowsPerStep;

// x [M, K] int8 -> per chunk of kRowChunk rows (the last one shorter), [K / 4][chunk rows][4]: the 4 bytes of
// K that one step broadcasts lie side by side for the chunk's rows, so a row block's broadcasts read at fixed
// offsets from one pointer (12 row pointers would not fit the general registers beside the loop's own), and
// a chunk's steps lie close together (interleaving all of a prefill's rows put each step 16 KB from the last,
// a page, and the TLB misses halved the product's rate at 4096 rows).
inline std::vector<int8_t> interleave_rows(const int8_t* x, int64_t M, int64_t K) {
  std::vector<int8_t> xi(M * K);
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, M - m0);
    int8_t* chunk = xi.data() + m0 * K;
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < K; k += kDepth)
        __builtin_memcpy(chunk + k * rows + m * kDepth, x + (m0 + m) * K + k, kDepth);
  }
  return xi;
}

// out[r, j * 16 + c] for r < MR, j < NR (masked by mask[j]) = the panels' product with MR activation rows.
// panel: the first panel's bytes; panel_bytes: K * 16 (the stride to the next panel); xi: the row block's
// first row in interleave_rows' layout, in a chunk of `chunk` rows (its steps lie chunk * 4 bytes apart);
// shift[r] = 128 * sum_k x[r, k].
// PF: also pull a later panel group (at prefetch) into L2, one line per step per panel (the first row block of
// a group streams the next group while the others find theirs cached).
template <int MR, int NR, bool PF>
__attribute__((always_inline)) inline void panel_block(const uint8_t* panel, int64_t panel_bytes, const int8_t* xi,
                                                       int64_t chunk, int64_t K, const int32_t* shift, int32_t* out,
                                                       int64_t ldo, const __mmask16* mask, const char* prefetch) {
  __m512i acc[MR][NR];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_si512();
  const int64_t step = chunk * kDepth;
  const uint8_t* w = panel;
  for (int64_t k = 0; k < K; k += kDepth, w += kColumns * kDepth, xi += step) {
    __m512i wv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_si512(w + j * panel_bytes);
    if constexpr (PF) {
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) _mm_prefetch(prefetch + j * panel_bytes + (w - panel), _MM_HINT_T1);
    }
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xi + r * kDepth));
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) freight::dpbusd(acc[r][j], wv[j], xb);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    const __m512i s = _mm512_set1_epi32(shift[r]);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j)
      _mm512_mask_storeu_epi32(out + r * ldo + j * kColumns, mask[j], _mm512_sub_epi32(acc[r][j], s));
  }
}

// panel_block for any 1 <= rows <= MR (the last row block of M).
template <int NR, bool PF>
inline void panel_block_rows(int64_t rows, const uint8_t* panel, int64_t panel_bytes, const int8_t* xi,
                             int64_t chunk, int64_t K, const int32_t* shift, int32_t* out, int64_t ldo, const __mmask16* mask,
                             const char* prefetch) {
  switch (rows) {
#define FREIGHT_PANEL_CASE(R) \
  case R: panel_block<R, NR, PF>(panel, panel_bytes, xi, chunk, K, shift, out, ldo, mask, prefetch); break;
    FREIGHT_PANEL_CASE(12) FREIGHT_PANEL_CASE(11) FREIGHT_PANEL_CASE(10) FREIGHT_PANEL_CASE(9)
    FREIGHT_PANEL_CASE(8) FREIGHT_PANEL_CASE(7) FREIGHT_PANEL_CASE(6) FREIGHT_PANEL_CASE(5)
    FREIGHT_PANEL_CASE(4) FREIGHT_PANEL_CASE(3) FREIGHT_PANEL_CASE(2) FREIGHT_PANEL_CASE(1)
#undef FREIGHT_PANEL_CASE
    default: break;
  }
}

// out[m, c - n_begin] (row stride ldo) for every m < M and output column c in [n_begin, n_end), n_begin a
// multiple of 16: xi the activations in interleave_rows' layout, panels [ceil(N / 16)][K / 4][16][4] (see the
// top), N the weight's row count. Row chunks outer, then panel pairs, then row blocks: a pair (2 * K * 16
// bytes) stays in L1 while the chunk's row blocks pass, the chunk in L2 while the pairs pass; the weights
// are read once per chunk.
inline void panel_product(const int8_t* xi, const int32_t* shift, const uint8_t* panels, int32_t* out, int64_t ldo,
                          int64_t M, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t panel_bytes = K * kColumns, pair = kPanelsPerStep * kColumns;
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t chunk = std::min(kRowChunk, M - m0);
    const int8_t* xc = xi + m0 * K;
    for (int64_t c = n_begin; c < n_end; c += pair) {
      const uint8_t* panel = panels + (c / kColumns) * panel_bytes;
      const int64_t valid = std::min(n_end, N) - c;
      const __mmask16 mask[2] = {column_mask(valid), column_mask(valid - kColumns)};
      const int64_t ahead = c + 2 * pair;  // the pair after next
      const char* prefetch = ahead + pair <= n_end ? reinterpret_cast<const char*>(panel + 2 * pair * K) : nullptr;
      for (int64_t m = 0; m < chunk; m += kRowsPerStep) {
        const int64_t rows = std::min<int64_t>(kRowsPerStep, chunk - m);
        int32_t* o = out + (m0 + m) * ldo + (c - n_begin);
        const int8_t* x = xc + m * kDepth;
        const int32_t* sh = shift + m0 + m;
        if (valid <= kColumns)
          panel_block_rows<1, false>(rows, panel, panel_bytes, x, chunk, K, sh, o, ldo, mask, nullptr);
        else if (m == 0 && prefetch)
          panel_block_rows<2, true>(rows, panel, panel_bytes, x, chunk, K, sh, o, ldo, mask, prefetch);
        else
          panel_block_rows<2, false>(rows, panel, panel_bytes, x, chunk, K, sh, o, ldo, mask, nullptr);
      }
    }
  }
}

}  // namespace freight_panels
#endif
