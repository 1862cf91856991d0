// Paged decode attention for CPU, reading the cache in place (one task per run of rows of a sequence on the
// SIMD paths, per (row, kv head) on the portable one).
// Each key and value row is read once, converted to float in registers and used by every query head
// of the group, so INT8 caches are never expanded into a float copy in memory. On the SIMD paths a run of
// rows of one sequence (a decode row and the draft tokens speculation verifies after it) reads each block
// once for the whole run: draft rows then cost arithmetic, not another pass over the cache.
//
// INT8 keys on the AVX-512 path are scored against the query rounded to INT8 per head (scale max|q| / 127),
// by VNNI on 16 transposed slots at a time: a draft row's scores then cost a quarter of the float
// products and no horizontal sums (score_block_vnni). The rounding adds error of the size the INT8 cache
// already has (the query's codes are as fine as the keys'); greedy agreement with float32 stays within its
// spread (README, Engine).
//
// Three code paths, picked by the ISA the build targets: with AVX-512 (or else AVX2 + FMA) and head_dim
// in {32, 64, 128} (every Llama-family model we load), the group size and head_dim are template
// parameters, so the group's working set is laid out at compile time; otherwise a portable loop does the
// same work. AVX-512 keeps the group's queries and accumulators in its 32 zmm registers for the whole
// sequence; AVX2's 16 ymm registers cannot (a group of 3 heads of 64 dims has 24 vectors of queries and 24
// of accumulators), so it reads the queries as FMA memory operands from L1 and accumulates the values a
// few 8-float chunks at a time. head_dim 256 (Gemma 2 and 3) takes the same templates.
//
// Sliding-window attention (window W > 0): the row at position p = context - 1 attends only slots t with
// p - W < t <= p. Every path walks just those slots, from the window's first block, masking the slots before
// the window start inside it: blocks wholly before the window are never read (they are freed and reused by
// other sequences, so they may hold anything) and a long context costs its window, not its length. Which
// slots a row walks is computed once for all paths (first_slot). Soft-capping (Gemma 2) maps each score,
// softmax scale applied, to cap * tanh(score / cap) before the softmax, in the same tier-independent code
// on every path (soft_cap.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "balanced_parallel.h"
#include "soft_cap.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include "avx512_math.h"
#define FREIGHT_DECODE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "avx2_math.h"
#define FREIGHT_DECODE_AVX2 1
#endif

namespace {

template <typename T>
inline float to_float(T value) {
  return static_cast<float>(value);
}

// The first slot a row with `context` slots attends: context - window with a sliding window (window > 0),
// else 0. The row attends slots [first_slot, context).
inline int64_t first_slot(int64_t context, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, context - window) : 0;
}

// Where slot `pos` of kv head `kvh` of a sequence lives, in rows of head_dim elements.
struct RowIndex {
  const int32_t* table;
  int64_t block_size, kv_heads, kvh;
  inline int64_t operator()(int64_t pos) const {
    return (static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size) * kv_heads + kvh;
  }
};

// ---------------------------------------------------------------------------------------------------
// Portable path: one (row, kv head), slots [begin, end).
template <typename CacheT, typename ScaleT>
void decode_task_generic(const float* q, const CacheT* key_cache, const CacheT* value_cache,
                         const ScaleT* key_scales, const ScaleT* value_scales, const RowIndex& rows,
                         int64_t begin, int64_t end, float soft_cap, int64_t group, int64_t head_dim,
                         std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& row_buffer,
                         float* out) {
  const int64_t len = end - begin;
  scores.resize(group * len);  // [group, len]: slot begin + t at column t
  acc.assign(group * head_dim, 0.f);
  row_buffer.resize(head_dim);
  float* row_f = row_buffer.data();
  for (int64_t t = 0; t < len; ++t) {
    const int64_t row = rows(begin + t);
    const CacheT* k = key_cache + row * head_dim;
    const float ks = key_scales ? to_float(key_scales[row]) : 1.f;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) row_f[d] = to_float(k[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row_f[d];
      scores[g * len + t] = dot * ks;
    }
  }
  std::vector<float> inv_sum(group);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * len;
    const float mx = soft_cap > 0.f ? freight::soft_cap_scores(s, len, soft_cap) : *std::max_element(s, s + len);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - mx);
      sum += s[t];
    }
    inv_sum[g] = 1.f / sum;
  }
  for (int64_t t = 0; t < len; ++t) {
    const int64_t row = rows(begin + t);
    const CacheT* v = value_cache + row * head_dim;
    const float vs = value_scales ? to_float(value_scales[row]) : 1.f;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) row_f[d] = to_float(v[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[g * len + t] * vs;
      float* a = acc.data() + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += w * row_f[d];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = acc[g * head_dim + d] * inv_sum[g];
}

// ---------------------------------------------------------------------------------------------------
// Shared by the SIMD paths
#if defined(FREIGHT_DECODE_AVX512) || defined(FREIGHT_DECODE_AVX2)
constexpr int64_t kPrefetchBlocks = 2;  // how far ahead of use a block is prefetched

// Always inlined, as is its caller: GCC 12's mod-ref analysis finds an out-of-line function that only
// prefetches free of side effects and deletes its calls (no prefetch was left in this kernel's build).
__attribute__((always_inline)) inline void prefetch_bytes(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(p + offset, _MM_HINT_T0);
}

// Block b's rows and, for INT8 caches, its scales (a separate array, so a second miss per block otherwise).
template <typename CacheT, typename ScaleT>
__attribute__((always_inline)) inline void prefetch_block_and_scales(const CacheT* cache, const ScaleT* scales,
                                                                    const int32_t* table, int64_t b, int64_t num_blocks,
                                                                    int64_t block_elems, int64_t block_slots) {
  if (b >= num_blocks) return;
  prefetch_bytes(cache + table[b] * block_elems, block_elems * sizeof(CacheT));
  if (scales) prefetch_bytes(scales + table[b] * block_slots, block_slots * sizeof(ScaleT));
}

// (q, key_cache, value_cache, key_scales, value_scales, table, len, rows, block_size, kv_heads, window,
//  soft_cap, scores, acc_buffer, out): see decode_sequence_avx512
template <typename CacheT, typename ScaleT>
using SequenceFn = void (*)(const float*, const CacheT*, const CacheT*, const ScaleT*, const ScaleT*,
                            const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                            std::vector<float>&, std::vector<float>&, float*);

// Row r of a run (context len + r) attends slots [first_slot(len + r, window), len + r); the run's score rows
// hold slots [first, last), first = the first row's first slot, last = the last row's context.
struct RunSlots {
  int64_t len, window, first, last;
  RunSlots(int64_t len, int64_t rows, int64_t window)
      : len(len), window(window), first(first_slot(len, window)), last(len + rows - 1) {}
  int64_t begin(int64_t r) const { return first_slot(len + r, window); }
  int64_t end(int64_t r) const { return len + r; }
  int64_t stride() const { return last - first; }  // of the score rows
};
#endif

// ---------------------------------------------------------------------------------------------------
// AVX-512 path
#if defined(FREIGHT_DECODE_AVX512)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const at::BFloat16* p) {  // bf16 is the top half of a float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const double* p) {
  const __m256 low = _mm512_cvtpd_ps(_mm512_loadu_pd(p)), high = _mm512_cvtpd_ps(_mm512_loadu_pd(p + 8));
  return _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1);
}

// out[i] = sum of the 16 floats of rows[i], for 16 rows at once: pairs of rows are interleaved and added,
// then pairs of pairs, then the four 128-bit lanes are transposed and added (31 vector ops in all).
inline __m512 sum_rows16(const float (*rows)[16]) {
  __m512 pairs[8];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = _mm512_load_ps(rows[2 * i]), b = _mm512_load_ps(rows[2 * i + 1]);
    // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  __m512 quads[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    // per 128-bit lane: the lane's sums of rows 4i .. 4i + 3
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // lanes (0, 1, 2, 3) of quads[i] hold partial sums of rows 4i .. 4i + 3: add the lanes across
  const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
  const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, 0x88), _mm512_shuffle_f32x4(q01, q23, 0xDD));
}

// Softmax numerators of one score row in place, s[0, len) -> exp(s - max); returns 1 / their sum. Explicit
// vectors with a masked tail, so a row's result does not depend on where it sits in memory.
inline float softmax_numerators(float* s, int64_t len, float max) {
  const __m512 mv = _mm512_set1_ps(max);
  __m512 sv = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 live = len - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - t)) - 1);
    const __m512 e = freight::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), mv));
    _mm512_mask_storeu_ps(s + t, live, e);
    sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(live, e));
  }
  return 1.f / _mm512_reduce_add_ps(sv);
}

// In place: lane t of r[j] becomes lane j of the old r[t] (a 16 x 16 transpose of 32-bit elements): pairs
// are interleaved by 32 and 64 bits inside each 128-bit lane, then the lanes are exchanged (64 shuffles).
inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 4; ++i) {
    t[4 * i + 0] = _mm512_unpacklo_epi32(r[4 * i], r[4 * i + 1]);
    t[4 * i + 1] = _mm512_unpackhi_epi32(r[4 * i], r[4 * i + 1]);
    t[4 * i + 2] = _mm512_unpacklo_epi32(r[4 * i + 2], r[4 * i + 3]);
    t[4 * i + 3] = _mm512_unpackhi_epi32(r[4 * i + 2], r[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane L: u[4i + k] holds column 4L + k of rows 4i .. 4i + 3
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k gathers lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// One query head as INT8 for the VNNI key scores: symmetric, scale max|q| / 127, codes rounded to nearest
// even. Writes D codes; returns the scale and, in *sum, the codes' sum (the unsigned-key correction).
template <int D>
inline float quantize_query(const float* q, int8_t* codes, int32_t* sum) {
  constexpr int C = D / 16;
  __m512 top = _mm512_setzero_ps();
  for (int c = 0; c < C; ++c) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(q + c * 16)));
  const float max = _mm512_reduce_max_ps(top);
  // divss itself: under -ffast-math a plain division may become a multiply by a reciprocal, and the codes
  // must round exactly as the reference's (a product on a .5 tie would round either way)
  const float inverse = max > 0.f ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(127.f), _mm_set_ss(max))) : 0.f;
  const __m512 inv = _mm512_set1_ps(inverse);
  __m512i total = _mm512_setzero_si512();
  for (int c = 0; c < C; ++c) {
    const __m512i code = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + c * 16), inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + c * 16), _mm512_cvtepi32_epi8(code));
    total = _mm512_add_epi32(total, code);
  }
  *sum = _mm512_reduce_add_epi32(total);
  return max / 127.f;
}

// Whether the AVX-512 path scores an INT8 cache with VNNI at this head_dim (whole 64-byte key rows).
constexpr bool vnni_key_rows(int64_t head_dim) { return head_dim % 64 == 0; }
template <typename CacheT, int D>
constexpr bool kVnniKeys = std::is_same_v<CacheT, int8_t> && vnni_key_rows(D);

// Scores of one block's INT8 keys for a run of rows, by VNNI: per kv head, 16 slots at a time are transposed
// so that one vpdpbusd adds 4 dimensions of all 16 slots' dot products (no horizontal sums), and the
// transposed keys serve every row and head of the group. vpdpbusd multiplies unsigned by signed bytes: the
// keys are offset by 128 (their sign bit flipped) and 128 x the query's code sum is taken off again, so the
// integer dot product is exact; the score is it times the query's and the slot's scales. Slots of the block
// before `u_begin` (before the run's first slot) are never read; each row's lanes are masked to its slots.
template <int G, int D, typename ScaleT>
__attribute__((always_inline)) inline void score_block_vnni(
    const int8_t* kb,  // [block_size, kv_heads, D] this block's keys
    const ScaleT* kscale,  // [block_size, kv_heads]
    const int8_t* qcodes, const float* qscales, const float* qsums,  // [rows, heads, D], [rows, heads] x 2
    const RunSlots& run, int64_t rows, int64_t t0, int64_t u_begin, int64_t n_block, int64_t kv_heads,
    float* s,  // [rows, heads, run.stride()]
    float* maxima) {
  const int64_t heads = kv_heads * G, slot_elems = kv_heads * D, stride = run.stride();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
    for (int64_t u0 = u_begin; u0 < n_block; u0 += 16) {
      const int64_t m = std::min<int64_t>(16, n_block - u0);  // the run's last row reaches furthest
      alignas(64) int32_t kt[D / 4][16];  // [4-byte group of the key row, slot]: codes + 128
      for (int c = 0; c < D / 64; ++c) {
        __m512i slots[16];
        for (int64_t t = 0; t < 16; ++t)  // past the block's last slot: zeros, masked below
          slots[t] = t < m ? _mm512_xor_si512(_mm512_loadu_si512(kb + (u0 + t) * slot_elems + kvh * D + c * 64), flip)
                           : _mm512_setzero_si512();
        transpose16x16_epi32(slots);
        for (int j = 0; j < 16; ++j) _mm512_store_si512(kt[c * 16 + j], slots[j]);
      }
      alignas(64) float ks[16];
      for (int64_t t = 0; t < 16; ++t) ks[t] = t < m ? to_float(kscale[(u0 + t) * kv_heads + kvh]) : 0.f;
      const __m512 kscales = _mm512_load_ps(ks);
      for (int64_t r = 0; r < rows; ++r) {
        // this row's lanes here: [lo, n), within the slots loaded (a window can start the run mid-block, and
        // then 16 lanes from u0 reach past the block: those must not count, not even towards the maximum)
        const int64_t n = std::min<int64_t>(m, run.end(r) - t0 - u0);
        const int64_t lo = std::max<int64_t>(0, run.begin(r) - t0 - u0);
        if (n <= lo) continue;
        const __mmask16 live = __mmask16(((1u << n) - 1) & ~((1u << lo) - 1));
        const int64_t first = r * heads + kvh * G;  // the group's first head in this row
        __m512i even[G], odd[G];  // two chains a head, to hide vpdpbusd's latency
        for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm512_setzero_si512();
        for (int j = 0; j < D / 4; j += 2) {
          const __m512i k0 = _mm512_load_si512(kt[j]), k1 = _mm512_load_si512(kt[j + 1]);
          for (int g = 0; g < G; ++g) {
            int32_t w0, w1;
            std::memcpy(&w0, qcodes + (first + g) * D + 4 * j, 4);
            std::memcpy(&w1, qcodes + (first + g) * D + 4 * j + 4, 4);
            even[g] = _mm512_dpbusd_epi32(even[g], k0, _mm512_set1_epi32(w0));
            odd[g] = _mm512_dpbusd_epi32(odd[g], k1, _mm512_set1_epi32(w1));
          }
        }
        for (int g = 0; g < G; ++g) {
          const int64_t h = first + g;
          const __m512 dot = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even[g], odd[g])),
                                           _mm512_set1_ps(qsums[h]));
          const __m512 scores = _mm512_mul_ps(dot, _mm512_mul_ps(kscales, _mm512_set1_ps(qscales[h])));
          _mm512_mask_storeu_ps(s + h * stride + (t0 + u0 - run.first), live, scores);
          maxima[h] = std::max(maxima[h], _mm512_mask_reduce_max_ps(live, scores));
        }
      }
    }
}

// One sequence, every head, for a run of `rows` query rows at consecutive positions (a decode row and the
// draft tokens after it): row r attends to slots [first_slot(len + r, window), len + r) (RunSlots). The cache is
// walked block by block from the block of the run's first slot, and inside a block slot by slot with all kv
// heads of a slot side by side, so each block is read as one contiguous stretch, once for all rows; the next
// block is prefetched while this one is used (blocks sit anywhere in the pool). Each row does exactly the
// arithmetic it would do alone. soft_cap > 0 caps the scores (soft_cap.h).
template <int G, int D, typename CacheT, typename ScaleT>
void decode_sequence_avx512(const float* q,  // [rows, kv_heads * G, D]
                            const CacheT* key_cache, const CacheT* value_cache, const ScaleT* key_scales,
                            const ScaleT* value_scales, const int32_t* table, int64_t len, int64_t rows,
                            int64_t block_size, int64_t kv_heads, int64_t window, float soft_cap,
                            std::vector<float>& scores, std::vector<float>& acc_buffer,
                            float* out) {  // [rows, kv_heads * G, D]
  constexpr int C = D / 16;  // 16-float chunks per row
  const int64_t heads = kv_heads * G, row_elems = heads * D;
  const int64_t slot_elems = kv_heads * D, block_elems = block_size * slot_elems;
  const RunSlots slots(len, rows, window);
  const int64_t stride = slots.stride();  // score column j: slot slots.first + j
  const int64_t first_block = slots.first / block_size, num_blocks = (slots.last + block_size - 1) / block_size;
  scores.resize(rows * heads * (stride + 1));
  float* s = scores.data();                     // [rows, heads, stride]
  float* maxima = s + rows * heads * stride;    // [rows, heads]
  for (int64_t h = 0; h < rows * heads; ++h) maxima[h] = -INFINITY;
  const int64_t block_slots = block_size * kv_heads;
  for (int64_t b = first_block; b < first_block + kPrefetchBlocks; ++b)
    prefetch_block_and_scales(key_cache, key_scales, table, b, num_blocks, block_elems, block_slots);

  // INT8 keys are scored against INT8 queries with VNNI; the queries' codes, scales and code sums sit in
  // acc_buffer until the value pass needs it ([rows, heads, D] codes, then [rows, heads] scales and sums)
  int8_t* qcodes = nullptr;
  float *qscales = nullptr, *qsums = nullptr;
  if constexpr (kVnniKeys<CacheT, D>) {
    acc_buffer.resize(rows * row_elems);  // D floats a head: room for D codes and two floats
    qcodes = reinterpret_cast<int8_t*>(acc_buffer.data());
    qscales = acc_buffer.data() + rows * heads * D / 4;
    qsums = qscales + rows * heads;
    for (int64_t h = 0; h < rows * heads; ++h) {
      int32_t sum;
      qscales[h] = quantize_query<D>(q + h * D, qcodes + h * D, &sum);
      qsums[h] = static_cast<float>(128 * sum);  // exact: |sum| <= 127 * D
    }
  }

  for (int64_t b = first_block; b < num_blocks; ++b) {
    const int64_t block = table[b], t0 = b * block_size;
    prefetch_block_and_scales(key_cache, key_scales, table, b + kPrefetchBlocks, num_blocks, block_elems,
                              block_slots);
    const CacheT* kb = key_cache + block * block_elems;
    const ScaleT* kscale = key_scales ? key_scales + block * block_slots : nullptr;
    if constexpr (kVnniKeys<CacheT, D>) {
      score_block_vnni<G, D>(kb, kscale, qcodes, qscales, qsums, slots, rows, t0,
                             std::max<int64_t>(0, slots.first - t0), std::min(block_size, slots.last - t0),
                             kv_heads, s, maxima);
      continue;
    }
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
      for (int64_t r = 0; r < rows; ++r) {
        // this row's slots in the block: [lo, n)
        const int64_t n = std::min(block_size, slots.end(r) - t0);
        const int64_t lo = std::max<int64_t>(0, slots.begin(r) - t0);
        if (n <= lo) continue;  // the row's slots end before the block or start after it
        const float* qr = q + r * row_elems;
        float* sr = s + r * heads * stride;
        const int64_t col = t0 - slots.first;  // score column of the block's slot 0 (col + lo >= 0)
        float* mr = maxima + r * heads;
        __m512 qv[G][C];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) qv[g][c] = load16(qr + (kvh * G + g) * D + c * 16);
        // 16 slots at a time: each (slot, head) dot product is left as 16 partial sums, and the 16 slots'
        // partials are reduced together by one transposing tree (a horizontal sum per dot costs 3x more)
        for (int64_t u0 = lo; u0 < n; u0 += 16) {
          const int64_t m = std::min<int64_t>(16, n - u0);
          const __mmask16 live = m == 16 ? __mmask16(0xFFFF) : __mmask16((1u << m) - 1);
          alignas(64) float partial[G][16][16];
          alignas(64) float ks[16];
          for (int64_t t = 0; t < m; ++t) {
            const CacheT* k = kb + (u0 + t) * slot_elems + kvh * D;
            __m512 kv[C];
            for (int c = 0; c < C; ++c) kv[c] = load16(k + c * 16);
            for (int g = 0; g < G; ++g) {
              __m512 dot = _mm512_mul_ps(qv[g][0], kv[0]);
              for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(qv[g][c], kv[c], dot);
              _mm512_store_ps(partial[g][t], dot);
            }
            ks[t] = kscale ? to_float(kscale[(u0 + t) * kv_heads + kvh]) : 1.f;
          }
          for (int64_t t = m; t < 16; ++t) {  // past the row's last slot: finite filler, masked below
            for (int g = 0; g < G; ++g) _mm512_store_ps(partial[g][t], _mm512_setzero_ps());
            ks[t] = 0.f;
          }
          const __m512 scales = _mm512_load_ps(ks);
          for (int g = 0; g < G; ++g) {
            const __m512 scores = _mm512_mul_ps(sum_rows16(partial[g]), scales);
            _mm512_mask_storeu_ps(sr + (kvh * G + g) * stride + (col + u0), live, scores);
            mr[kvh * G + g] = std::max(mr[kvh * G + g], _mm512_mask_reduce_max_ps(live, scores));
          }
        }
      }
  }

  for (int64_t b = first_block; b < first_block + kPrefetchBlocks; ++b)
    prefetch_block_and_scales(value_cache, value_scales, table, b, num_blocks, block_elems, block_slots);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t lo = slots.begin(r), n = slots.end(r) - lo;
    for (int64_t h = 0; h < heads; ++h) {
      float* row = s + (r * heads + h) * stride + lo - slots.first;
      float* mh = maxima + r * heads + h;
      if (soft_cap > 0.f) *mh = freight::soft_cap_scores(row, n, soft_cap);
      *mh = softmax_numerators(row, n, *mh);  // from here on: 1 / the sum
    }
  }

  acc_buffer.assign(rows * row_elems, 0.f);
  float* acc_all = acc_buffer.data();  // [rows, heads, D]
  for (int64_t b = first_block; b < num_blocks; ++b) {
    const int64_t block = table[b], t0 = b * block_size;
    prefetch_block_and_scales(value_cache, value_scales, table, b + kPrefetchBlocks, num_blocks, block_elems,
                              block_slots);
    const CacheT* vb = value_cache + block * block_elems;
    const ScaleT* vscale = value_scales ? value_scales + block * block_slots : nullptr;
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = std::min(block_size, slots.end(r) - t0);
        const int64_t lo = std::max<int64_t>(0, slots.begin(r) - t0);
        if (n <= lo) continue;
        const float* sr = s + r * heads * stride;
        const int64_t col = t0 - slots.first;  // score column of the block's slot 0 (col + lo >= 0)
        float* acc_group = acc_all + r * row_elems + kvh * G * D;
        __m512 acc[G][C];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) acc[g][c] = _mm512_loadu_ps(acc_group + g * D + c * 16);
        for (int64_t t = lo; t < n; ++t) {
          const CacheT* v = vb + t * slot_elems + kvh * D;
          __m512 vv[C];
          for (int c = 0; c < C; ++c) vv[c] = load16(v + c * 16);
          const float vs = vscale ? to_float(vscale[t * kv_heads + kvh]) : 1.f;
          for (int g = 0; g < G; ++g) {
            const __m512 w = _mm512_set1_ps(sr[(kvh * G + g) * stride + (col + t)] * vs);
            for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc_group + g * D + c * 16, acc[g][c]);
      }
  }
  for (int64_t h = 0; h < rows * heads; ++h) {
    const __m512 inv = _mm512_set1_ps(maxima[h]);
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(out + h * D + c * 16, _mm512_mul_ps(_mm512_loadu_ps(acc_all + h * D + c * 16), inv));
  }
}

// The sequence function of this build's SIMD path.
template <int G, int D, typename CacheT, typename ScaleT>
constexpr SequenceFn<CacheT, ScaleT> kSequenceFn = decode_sequence_avx512<G, D, CacheT, ScaleT>;
#endif

// ---------------------------------------------------------------------------------------------------
// AVX2 path: the AVX-512 path's walk with 8-float lanes, its register budget cut to fit 16 ymm registers.
#if defined(FREIGHT_DECODE_AVX2)
using freight::load8;

// Slots scored per step: TT slots x G heads make up to 8 independent dot products (accumulator chains),
// enough to hide the FMA latency; their sums are reduced four at a time by one shared tree.
constexpr int score_slots_per_step(int G) { return G >= 8 ? 1 : 8 / G; }

// s[g * s_stride + tt] = (q_g . k_tt) * scale_tt for the TT slots from k (row tt at k + tt * k_stride, its
// scale at k_scale[tt * scale_stride], or 1 without scales); the queries are FMA memory operands.
template <int G, int D, int TT, typename CacheT, typename ScaleT>
FREIGHT_INLINE void score_slots(const float* q,  // [G, D]
                                const CacheT* k, int64_t k_stride, const ScaleT* k_scale, int64_t scale_stride,
                                float* s, int64_t s_stride) {
  constexpr int C = D / 8, N = TT * G, R = (N + 3) / 4;
  __m256 dot[4 * R];  // [tt * G + g], zero padded to whole reductions
  FREIGHT_UNROLL
  for (int i = 0; i < 4 * R; ++i) dot[i] = _mm256_setzero_ps();
  FREIGHT_UNROLL
  for (int c = 0; c < C; ++c)
    FREIGHT_UNROLL
    for (int tt = 0; tt < TT; ++tt) {
      const __m256 kc = load8(k + tt * k_stride + c * 8);
      FREIGHT_UNROLL
      for (int g = 0; g < G; ++g)
        dot[tt * G + g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c * 8), kc, dot[tt * G + g]);
    }
  alignas(16) float sums[4 * R];
  FREIGHT_UNROLL
  for (int r = 0; r < R; ++r)
    _mm_store_ps(sums + 4 * r,
                 freight::reduce_add8x4(dot[4 * r], dot[4 * r + 1], dot[4 * r + 2], dot[4 * r + 3]));
  FREIGHT_UNROLL
  for (int tt = 0; tt < TT; ++tt) {
    const float ks = k_scale ? to_float(k_scale[tt * scale_stride]) : 1.f;
    FREIGHT_UNROLL
    for (int g = 0; g < G; ++g) s[g * s_stride + tt] = sums[tt * G + g] * ks;
  }
}

// 8-float chunks of the value rows accumulated per pass: G x CW accumulators, G broadcast weights and one
// value vector stay within the 16 registers.
template <int G, int C>
constexpr int value_chunks_per_pass() {
  int cw = C;
  while (cw > 1 && G * cw + G + 1 > 16) cw /= 2;
  return cw;
}

// acc[g, :] += sum_t w[g * w_stride + t] * v_t over n slots (row t at v + t * v_stride).
template <int G, int D, typename CacheT>
FREIGHT_INLINE void accumulate_values(const float* w, int64_t w_stride, const CacheT* v, int64_t v_stride,
                                      int64_t n, float* acc_out) {  // [G, D]
  constexpr int C = D / 8, CW = value_chunks_per_pass<G, C>();
  for (int c0 = 0; c0 < C; c0 += CW) {
    __m256 acc[G][CW];
    FREIGHT_UNROLL
    for (int g = 0; g < G; ++g)
      FREIGHT_UNROLL
      for (int c = 0; c < CW; ++c) acc[g][c] = _mm256_loadu_ps(acc_out + g * D + (c0 + c) * 8);
    for (int64_t t = 0; t < n; ++t) {
      __m256 wg[G];
      FREIGHT_UNROLL
      for (int g = 0; g < G; ++g) wg[g] = _mm256_broadcast_ss(w + g * w_stride + t);
      FREIGHT_UNROLL
      for (int c = 0; c < CW; ++c) {
        const __m256 vc = load8(v + t * v_stride + (c0 + c) * 8);
        FREIGHT_UNROLL
        for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(wg[g], vc, acc[g][c]);
      }
    }
    FREIGHT_UNROLL
    for (int g = 0; g < G; ++g)
      FREIGHT_UNROLL
      for (int c = 0; c < CW; ++c) _mm256_storeu_ps(acc_out + g * D + (c0 + c) * 8, acc[g][c]);
  }
}

// In place: s[0, len) -> exp(s - max); returns 1 / sum.
inline float softmax_numerators(float* s, int64_t len) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
  float m = freight::reduce_max8(mv);
  for (; t < len; ++t) m = std::max(m, s[t]);
  mv = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (t = 0; t + 8 <= len; t += 8) {
    const __m256 e = freight::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = freight::reduce_add8(sv);
  for (; t < len; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return 1.f / sum;
}


// One sequence, every head, for a run of rows at consecutive positions, walked as in
// decode_sequence_avx512: block by block (read once for all rows), all kv heads of a slot side by side,
// the next blocks prefetched.
template <int G, int D, typename CacheT, typename ScaleT>
void decode_sequence_avx2(const float* q,  // [rows, kv_heads * G, D]
                          const CacheT* key_cache, const CacheT* value_cache, const ScaleT* key_scales,
                          const ScaleT* value_scales, const int32_t* table, int64_t len, int64_t rows,
                          int64_t block_size, int64_t kv_heads, int64_t window, float soft_cap,
                          std::vector<float>& scores, std::vector<float>& acc_buffer,
                          float* out) {  // [rows, kv_heads * G, D]
  constexpr int TT = score_slots_per_step(G);
  const int64_t heads = kv_heads * G, row_elems = heads * D;
  const int64_t slot_elems = kv_heads * D, block_elems = block_size * slot_elems;
  const int64_t block_slots = block_size * kv_heads;
  const RunSlots slots(len, rows, window);
  const int64_t stride = slots.stride();  // score column j: slot slots.first + j
  const int64_t first_block = slots.first / block_size, num_blocks = (slots.last + block_size - 1) / block_size;
  scores.resize(rows * heads * (stride + 1));
  float* s = scores.data();                   // [rows, heads, stride]
  float* inv_sum = s + rows * heads * stride;  // [rows, heads]
  for (int64_t b = first_block; b < first_block + kPrefetchBlocks; ++b)
    prefetch_block_and_scales(key_cache, key_scales, table, b, num_blocks, block_elems, block_slots);

  for (int64_t b = first_block; b < num_blocks; ++b) {
    const int64_t block = table[b], t0 = b * block_size;
    prefetch_block_and_scales(key_cache, key_scales, table, b + kPrefetchBlocks, num_blocks, block_elems,
                              block_slots);
    const CacheT* kb = key_cache + block * block_elems;
    const ScaleT* kscale = key_scales ? key_scales + block * block_slots : nullptr;
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
      for (int64_t r = 0; r < rows; ++r) {
        // this row's slots in the block: [lo, n)
        const int64_t n = std::min(block_size, slots.end(r) - t0);
        const int64_t lo = std::max<int64_t>(0, slots.begin(r) - t0);
        if (n <= lo) continue;  // the row's slots end before the block or start after it
        const float* qh = q + r * row_elems + kvh * G * D;
        float* sh = s + (r * heads + kvh * G) * stride;
        const int64_t col = t0 - slots.first;  // score column of the block's slot 0 (col + lo >= 0)
        const ScaleT* ks = kscale ? kscale + kvh : nullptr;
        int64_t t = lo;
        for (; t + TT <= n; t += TT)
          score_slots<G, D, TT>(qh, kb + t * slot_elems + kvh * D, slot_elems, ks ? ks + t * kv_heads : nullptr,
                                kv_heads, sh + (col + t), stride);
        for (; t < n; ++t)
          score_slots<G, D, 1>(qh, kb + t * slot_elems + kvh * D, slot_elems, ks ? ks + t * kv_heads : nullptr,
                               kv_heads, sh + (col + t), stride);
      }
  }

  for (int64_t b = first_block; b < first_block + kPrefetchBlocks; ++b)
    prefetch_block_and_scales(value_cache, value_scales, table, b, num_blocks, block_elems, block_slots);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t lo = slots.begin(r), n = slots.end(r) - lo;
    for (int64_t h = 0; h < heads; ++h) {
      float* row = s + (r * heads + h) * stride + lo - slots.first;
      if (soft_cap > 0.f) freight::soft_cap_scores(row, n, soft_cap);
      inv_sum[r * heads + h] = softmax_numerators(row, n);
    }
  }

  acc_buffer.assign(rows * row_elems, 0.f);
  float* acc_all = acc_buffer.data();  // [rows, heads, D]
  for (int64_t b = first_block; b < num_blocks; ++b) {
    const int64_t block = table[b], t0 = b * block_size;
    prefetch_block_and_scales(value_cache, value_scales, table, b + kPrefetchBlocks, num_blocks, block_elems,
                              block_slots);
    const CacheT* vb = value_cache + block * block_elems;
    const ScaleT* vscale = value_scales ? value_scales + block * block_slots : nullptr;
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = std::min(block_size, slots.end(r) - t0);
        const int64_t lo = std::max<int64_t>(0, slots.begin(r) - t0);
        if (n <= lo) continue;
        float* sh = s + (r * heads + kvh * G) * stride + (t0 + lo - slots.first);  // the row's first slot here
        if (vscale)  // the weights take the value scales: each weight is used once
          for (int64_t t = lo; t < n; ++t) {
            const float vs = to_float(vscale[t * kv_heads + kvh]);
            for (int g = 0; g < G; ++g) sh[g * stride + (t - lo)] *= vs;
          }
        accumulate_values<G, D>(sh, stride, vb + lo * slot_elems + kvh * D, slot_elems, n - lo,
                                acc_all + r * row_elems + kvh * G * D);
      }
  }
  for (int64_t h = 0; h < rows * heads; ++h) {
    const __m256 inv = _mm256_set1_ps(inv_sum[h]);
    for (int c = 0; c < D / 8; ++c)
      _mm256_storeu_ps(out + h * D + c * 8, _mm256_mul_ps(_mm256_loadu_ps(acc_all + h * D + c * 8), inv));
  }
}

// The sequence function of this build's SIMD path.
template <int G, int D, typename CacheT, typename ScaleT>
constexpr SequenceFn<CacheT, ScaleT> kSequenceFn = decode_sequence_avx2<G, D, CacheT, ScaleT>;
#endif

#if defined(FREIGHT_DECODE_AVX512) || defined(FREIGHT_DECODE_AVX2)
template <int D, typename CacheT, typename ScaleT>
SequenceFn<CacheT, ScaleT> pick_group(int64_t group) {
  switch (group) {
    case 1: return kSequenceFn<1, D, CacheT, ScaleT>;
    case 2: return kSequenceFn<2, D, CacheT, ScaleT>;
    case 3: return kSequenceFn<3, D, CacheT, ScaleT>;
    case 4: return kSequenceFn<4, D, CacheT, ScaleT>;
    case 5: return kSequenceFn<5, D, CacheT, ScaleT>;
    case 6: return kSequenceFn<6, D, CacheT, ScaleT>;
    case 7: return kSequenceFn<7, D, CacheT, ScaleT>;
    case 8: return kSequenceFn<8, D, CacheT, ScaleT>;
    default: return nullptr;
  }
}

template <typename CacheT, typename ScaleT>
SequenceFn<CacheT, ScaleT> pick_task(int64_t group, int64_t head_dim) {
  switch (head_dim) {
    case 32: return pick_group<32, CacheT, ScaleT>(group);
    case 64: return pick_group<64, CacheT, ScaleT>(group);
    case 128: return pick_group<128, CacheT, ScaleT>(group);
    case 256: return pick_group<256, CacheT, ScaleT>(group);
    default: return nullptr;
  }
}
#endif

template <typename CacheT, typename ScaleT>
void decode_attention(const float* query,  // [num_seqs, num_heads, head_dim], softmax scale folded in
                      const CacheT* key_cache,  // [num_blocks, block_size, kv_heads, head_dim]
                      const CacheT* value_cache,
                      const ScaleT* key_scales,  // [num_blocks, block_size, kv_heads] or nullptr
                      const ScaleT* value_scales,
                      const int32_t* block_tables,  // [num_seqs, max_blocks]
                      const int32_t* context_lens,  // [num_seqs]
                      float* out,                   // [num_seqs, num_heads, head_dim]
                      int64_t num_seqs, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t max_blocks, int64_t window, float soft_cap) {
  const int64_t group = num_heads / kv_heads;
  // a row costs the slots it attends plus a fixed part (queries, softmax, output) worth a few dozen slots
  const auto slots_of = [&](int64_t row) {
    return context_lens[row] - first_slot(context_lens[row], window) + 32;
  };
#if defined(FREIGHT_DECODE_AVX512) || defined(FREIGHT_DECODE_AVX2)
  const SequenceFn<CacheT, ScaleT> fast = pick_task<CacheT, ScaleT>(group, head_dim);
  if (fast) {
    // A run of rows that continue one sequence (a decode row and its draft tokens: the same block table,
    // each row one position further) reads the cache once for the run. Threads split the rows, not the runs,
    // so that a few long runs (a tail of one or two speculating sequences) still keep every thread busy; a
    // run cut by a thread boundary is read once by each side.
    const int64_t table_bytes = max_blocks * static_cast<int64_t>(sizeof(int32_t));
    const auto continues = [&](int64_t row) {
      return context_lens[row] == context_lens[row - 1] + 1 &&
             std::memcmp(block_tables + row * max_blocks, block_tables + (row - 1) * max_blocks, table_bytes) == 0;
    };
    freight::parallel_for_balanced(num_seqs, slots_of, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc;
      for (int64_t first = begin, last; first < end; first = last) {
        for (last = first + 1; last < end && continues(last);) ++last;
        const int64_t offset = first * num_heads * head_dim;
        fast(query + offset, key_cache, value_cache, key_scales, value_scales, block_tables + first * max_blocks,
             context_lens[first], last - first, block_size, kv_heads, window, soft_cap, scores, acc,
             out + offset);
      }
    });
    return;
  }
#endif
  const auto cost = [&](int64_t task) { return slots_of(task / kv_heads); };
  freight::parallel_for_balanced(num_seqs * kv_heads, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, row_buffer;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / kv_heads, kvh = task % kv_heads, len = context_lens[seq];
      const RowIndex rows{block_tables + seq * max_blocks, block_size, kv_heads, kvh};
      const int64_t offset = (seq * num_heads + kvh * group) * head_dim;
      decode_task_generic(query + offset, key_cache, value_cache, key_scales, value_scales, rows,
                          first_slot(len, window), len, soft_cap, group, head_dim, scores, acc, row_buffer,
                          out + offset);
    }
  });
}

template <typename CacheT, typename ScaleT>
void run(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const ScaleT* ks,
         const ScaleT* vs, const torch::Tensor& bt, const torch::Tensor& cl, torch::Tensor& out, int64_t window,
         float soft_cap) {
  decode_attention<CacheT, ScaleT>(q.data_ptr<float>(), kc.data_ptr<CacheT>(), vc.data_ptr<CacheT>(), ks, vs,
                                   bt.data_ptr<int32_t>(), cl.data_ptr<int32_t>(), out.data_ptr<float>(),
                                   q.size(0), q.size(1), kc.size(2), kc.size(3), kc.size(1), bt.size(1), window,
                                   soft_cap);
}

}  // namespace

// query and out float32 [S, H, D] (scale folded into query); caches contiguous; block_tables and
// context_lens int32. window: 0, or the slots a row attends (sliding window, the row's own included);
// soft_cap: 0, or c > 0 for scores c * tanh(score / c).
void paged_decode_attention_cpu(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                c10::optional<torch::Tensor> key_scales,
                                c10::optional<torch::Tensor> value_scales, torch::Tensor block_tables,
                                torch::Tensor context_lens, torch::Tensor out, int64_t window, double soft_cap) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "query and out: float32");
  TORCH_CHECK_VALUE(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK_VALUE(soft_cap >= 0.0 && std::isfinite(soft_cap), "soft_cap must be finite and >= 0 (0: none), got ",
                    soft_cap);
  const float cap = static_cast<float>(soft_cap);
  // here rather than in Python: two reductions and two syncs per layer were a tenth of a one-row step
  const int64_t width = block_tables.size(1) * key_cache.size(1);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < context_lens.size(0); ++i)
    TORCH_CHECK_VALUE(lens[i] >= 1 && lens[i] <= width, "context_lens must lie in [1, ", width,
                      "] (block_tables width x block_size), got ", lens[i], " at sequence ", i);
  if (key_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(key_scales && value_scales, "int8 caches need scales");
    const auto& ks = *key_scales;
    const auto& vs = *value_scales;
    if (ks.scalar_type() == at::kHalf) {
      run<int8_t, at::Half>(query, key_cache, value_cache, ks.data_ptr<at::Half>(), vs.data_ptr<at::Half>(),
                            block_tables, context_lens, out, window, cap);
    } else {
      TORCH_CHECK(ks.scalar_type() == at::kFloat, "scales must be float16 or float32");
      run<int8_t, float>(query, key_cache, value_cache, ks.data_ptr<float>(), vs.data_ptr<float>(), block_tables,
                         context_lens, out, window, cap);
    }
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(), "decode_cache", [&] {
    run<scalar_t, float>(query, key_cache, value_cache, nullptr, nullptr, block_tables, context_lens, out, window,
                         cap);
  });
}

// Whether this build scores an INT8 cache with VNNI against the query rounded to INT8 (the tests' reference
// rounds it too): the AVX-512 path at a compiled (head_dim, group) with whole 64-byte key rows.
bool scores_int8_queries(int64_t head_dim, int64_t group) {
#if defined(FREIGHT_DECODE_AVX512)
  return vnni_key_rows(head_dim) && pick_task<int8_t, float>(group, head_dim) != nullptr;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention_cpu", &paged_decode_attention_cpu, py::arg("query"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("key_scales"), py::arg("value_scales"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("out"), py::arg("window") = 0, py::arg("soft_cap") = 0.0);
  m.def("scores_int8_queries", &scores_int8_queries);
}
