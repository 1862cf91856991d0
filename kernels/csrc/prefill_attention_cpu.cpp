// Causal prefill attention for CPU over packed variable-length sequences, two kernels:
//   - bfloat16 in and out, using AVX-512 BF16 dot products (vdpbf16ps: 32 bf16 products summed in pairs
//     into 16 float32 lanes);
//   - float32 in and out, using AVX2 + FMA (8 float32 lanes; built on every x86 tier from AVX2 up).
//
// Each chunk's queries attend to its whole context: the step's own keys and values, after a cached prefix
// (if any) that the caller gathered from the paged cache in front of them (see Chunks). Flash-attention style: each task takes R query rows of one kv head's group and walks
// the keys in tiles with an online softmax, so scores are never stored; all sequences of the step run in
// one parallel loop. The bf16 kernel first repacks keys and values per (sequence, kv head) into the
// pair-interleaved layouts vdpbf16ps reads:
//   keys   [tile][d / 2][32 keys][2]   -> S[row, 32 keys] accumulates over d pairs (query pair broadcast)
//   values [tile][16 key pairs][d][2]  -> O[row, d]       accumulates over key pairs (prob pair broadcast)
// Float32 accumulation throughout; probabilities are rounded to bf16 for the P.V product, as bf16 SDPA does.
// The float32 kernel repacks only the keys (see its section).
// On CPUs with AMX (Sapphire Rapids and later), bf16 runs the same packed layouts through AMX tiles
// (tdpbf16ps: a 16 x 32 by 32 x 16 bf16 product per instruction, 8x vdpbf16ps's work); see its section.
// head_dim 64, 128 and 256 (Gemma 2 and 3).
//
// Sliding-window attention (window W > 0): the query at context index i sees keys j with i - W < j <= i. Each
// chunk's context is first cut to the keys its first query can see (trim_to_window: nothing before is read or
// packed), each task starts its key walk at the tile of its rows' first visible key, and tiles reaching
// before a row's window are masked like the causal diagonal. Soft-capping (Gemma 2) maps each score, softmax
// scale applied, to cap * tanh(score / cap) before masking (Scoring, soft_cap.h): the same arithmetic in every
// kernel.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "amx.h"
#include "balanced_parallel.h"
#include "soft_cap.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "avx512_math.h"
#define FREIGHT_PREFILL_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include "avx2_math.h"
#define FREIGHT_PREFILL_F32 1
#endif

namespace {

// The step's chunks: chunk s has q_len[s] query rows from row q_start[s] of the query (and out) tensor, and
// attends causally to kv_len[s] >= q_len[s] key/value rows from row kv_start[s] of the key/value tensors, its
// whole context so far: query j sits at position kv_len - q_len + j (a cached prefix comes first).
struct Chunks {
  const int32_t* q_start;
  const int32_t* q_len;
  const int32_t* kv_start;
  const int32_t* kv_len;
  int64_t num;
};

// Which keys a row sees and how its raw scores s = q . k become the base-2 logits the kernels' softmax takes:
// s x scale x log2(e), or with a soft cap c, c x tanh(s x scale / c) x log2(e).
struct Scoring {
  float scale_log2;       // softmax scale x log2(e)
  float cap_in, cap_out;  // with a soft cap c: scale / c and c x log2(e); cap_in = 0: no cap
  int64_t window;         // sliding window: a row at position p sees keys [p - window + 1, p]; 0: [0, p]

  Scoring(double scale, double cap, int64_t window)
      : scale_log2(float(scale * 1.4426950408889634)),
        cap_in(cap > 0 ? float(scale / cap) : 0.f),
        cap_out(cap > 0 ? float(cap * 1.4426950408889634) : 0.f),
        window(window) {}
  int64_t first_key(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
  bool capped() const { return cap_in > 0.f; }
  // Logits of raw scores (float or a SIMD vector of them).
  template <typename V>
  V logits(V s) const {
    return capped() ? freight::tanh_rational(s * cap_in) * cap_out : s * scale_log2;
  }
  // For a kernel that folds query_scale() into its queries: logits of those scores.
  float query_scale() const { return capped() ? cap_in : scale_log2; }
  template <typename V>
  V logits_of_folded(V s) const {
    return capped() ? freight::tanh_rational(s) * cap_out : s;
  }
};

// Keys attended by task `task` of the loops below (sequence s, kv head, R rows starting at row `first` of
// its position-major rows): R rows at about position prefix + (first + R / 2) / G each, at most the window,
// plus a fixed part.
inline int64_t task_cost(int64_t task, const std::vector<int64_t>& task_start, const Chunks& chunks, int64_t G,
                         int64_t R, int64_t window) {
  const int64_t s = std::upper_bound(task_start.begin(), task_start.end(), task) - task_start.begin() - 1;
  const int64_t rows_total = chunks.q_len[s] * G, blocks = (rows_total + R - 1) / R;
  const int64_t first = ((task - task_start[s]) % blocks) * R;
  const int64_t pos = chunks.kv_len[s] - chunks.q_len[s] + (first + R / 2) / G;
  return R * ((window > 0 ? std::min(pos + 1, window) : pos) + 16);
}

// The first key of a task's R rows (positions pos[0, rows)) and their last position.
inline void key_range(const int64_t* pos, int rows, const Scoring& scoring, int64_t& first, int64_t& last) {
  first = INT64_MAX;
  last = 0;
  for (int r = 0; r < rows; ++r) {
    first = std::min(first, scoring.first_key(pos[r]));
    last = std::max(last, pos[r]);
  }
}

#ifdef FREIGHT_PREFILL_BF16
constexpr int64_t kTile = 32;  // keys per tile
using freight::exp2_16;

inline uint32_t pair(uint16_t low, uint16_t high) { return uint32_t(low) | (uint32_t(high) << 16); }

// Repack one (sequence, kv head): keys and values of positions [0, len) of rows src[pos * stride + d].
void pack_kv(const uint16_t* k, const uint16_t* v, int64_t stride, int64_t len, int64_t D, uint32_t* kp,
             uint32_t* vp) {
  const int64_t tiles = (len + kTile - 1) / kTile;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    uint32_t* kt = kp + tile * (D / 2) * kTile;
    uint32_t* vt = vp + tile * (kTile / 2) * D;
    for (int64_t j = 0; j < kTile; ++j) {
      const int64_t pos = tile * kTile + j;
      const uint16_t* kr = pos < len ? k + pos * stride : nullptr;
      for (int64_t p = 0; p < D / 2; ++p) kt[p * kTile + j] = kr ? pair(kr[2 * p], kr[2 * p + 1]) : 0u;
    }
    for (int64_t jp = 0; jp < kTile / 2; ++jp) {
      const int64_t pos = tile * kTile + 2 * jp;
      const uint16_t* v0 = pos < len ? v + pos * stride : nullptr;
      const uint16_t* v1 = pos + 1 < len ? v + (pos + 1) * stride : nullptr;
      for (int64_t d = 0; d < D; ++d) vt[jp * D + d] = pair(v0 ? v0[d] : 0, v1 ? v1[d] : 0);
    }
  }
}

// The masks of a 32-key tile starting at key0 for a row that sees keys [first, pos] (causal, and the sliding
// window when first > 0; also hides the padding past the context).
inline void tile_masks(int64_t first, int64_t pos, int64_t key0, __mmask16& m0, __mmask16& m1) {
  const int64_t end = std::min<int64_t>(kTile, std::max<int64_t>(0, pos - key0 + 1));  // lanes [begin, end)
  const int64_t begin = std::min<int64_t>(kTile, std::max<int64_t>(0, first - key0));
  const uint64_t lanes = ((uint64_t{1} << end) - 1) & ~((uint64_t{1} << begin) - 1);
  m0 = __mmask16(lanes & 0xFFFF);
  m1 = __mmask16(lanes >> 16);
}

// R query rows (row r of the block: position pos[r], pointer q_rows[r]) against the keys they see, from the
// tile of the first.
template <int D, int R>
void attend_rows(const uint16_t* const* q_rows, const int64_t* pos, int rows, const uint32_t* kp,
                 const uint32_t* vp, const Scoring& scoring, uint16_t* const* out_rows) {
  constexpr int C = D / 16;  // output chunks of 16 floats
  __m512 o[R][C];
  float m[R], l[R];
  uint32_t qpair[R][D / 2];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) o[r][c] = _mm512_setzero_ps();
    m[r] = -1e30f;
    l[r] = 0.f;
    if (r < rows) std::memcpy(qpair[r], q_rows[r], D * sizeof(uint16_t));
    else std::memset(qpair[r], 0, sizeof(qpair[r]));
  }
  int64_t first, last;
  key_range(pos, rows, scoring, first, last);
  const int64_t tiles = last / kTile + 1;
  alignas(64) uint16_t probs[R][kTile];
  for (int64_t tile = first / kTile; tile < tiles; ++tile) {
    const uint32_t* kt = kp + tile * (D / 2) * kTile;
    __m512 s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * kTile);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + p * kTile + 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(int(qpair[r][p]));
        s[r][0] = _mm512_dpbf16_ps(s[r][0], qb, k0);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], qb, k1);
      }
    }
    const int64_t key0 = tile * kTile;
    for (int r = 0; r < R; ++r) {
      __mmask16 m0, m1;
      tile_masks(scoring.first_key(pos[r]), pos[r], key0, m0, m1);
      const __m512 x0 = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), m0, scoring.logits(s[r][0]));
      const __m512 x1 = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), m1, scoring.logits(s[r][1]));
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
      const __m512 mv = _mm512_set1_ps(m_new);
      // base-2 exponentials: the logits carry log2(e)
      const __m512 p0 = _mm512_maskz_mov_ps(m0, exp2_16(_mm512_sub_ps(x0, mv)));
      const __m512 p1 = _mm512_maskz_mov_ps(m1, exp2_16(_mm512_sub_ps(x1, mv)));
      const float alpha = std::exp2(m[r] - m_new);
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      m[r] = m_new;
      const __m512 av = _mm512_set1_ps(alpha);
      for (int c = 0; c < C; ++c) o[r][c] = _mm512_mul_ps(o[r][c], av);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs[r]), (__m256i)_mm512_cvtneps_pbh(p0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs[r] + 16), (__m256i)_mm512_cvtneps_pbh(p1));
    }
    const uint32_t* vt = vp + tile * (kTile / 2) * D;
    for (int jp = 0; jp < kTile / 2; ++jp) {
      __m512bh vv[C];
      for (int c = 0; c < C; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vt + jp * D + c * 16);
      for (int r = 0; r < R; ++r) {
        uint32_t pp;
        std::memcpy(&pp, probs[r] + 2 * jp, sizeof(pp));
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(int(pp));
        for (int c = 0; c < C; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], pb, vv[c]);
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_rows[r] + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[r][c], inv)));
  }
}

// One task's rows: R query rows of one (sequence, kv head) against its packed keys and values.
using AttendRows = void (*)(const uint16_t* const*, const int64_t*, int, const uint32_t*, const uint32_t*,
                            const Scoring&, uint16_t* const*);

template <int D, int R>
void prefill(const uint16_t* q, const uint16_t* k, const uint16_t* v, const Chunks& chunks, int64_t H, int64_t KVH,
             const Scoring& scoring, uint16_t* out, AttendRows attend, void (*begin_range)() = nullptr,
             void (*end_range)() = nullptr) {
  const int64_t G = H / KVH, num_seqs = chunks.num;
  // packed buffers: each (sequence, kv head) gets its context rounded up to whole tiles
  std::vector<int64_t> packed_offset(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = chunks.kv_len[s];
    packed_offset[s + 1] = packed_offset[s] + (len + kTile - 1) / kTile * kTile * KVH * (D / 2);
  }
  std::vector<uint32_t> kp(packed_offset[num_seqs]), vp(packed_offset[num_seqs]);
  at::parallel_for(0, num_seqs * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / KVH, h = task % KVH, len = chunks.kv_len[s];
      const int64_t padded = (len + kTile - 1) / kTile * kTile;
      const int64_t offset = packed_offset[s] + h * padded * (D / 2);
      const int64_t first = (chunks.kv_start[s] * KVH + h) * D;
      pack_kv(k + first, v + first, KVH * D, len, D, kp.data() + offset, vp.data() + offset);
    }
  });
  // tasks: (sequence, kv head, block of R rows); rows run position-major over the group's heads
  std::vector<int64_t> task_start(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = chunks.q_len[s] * G;
    task_start[s + 1] = task_start[s] + KVH * ((rows + R - 1) / R);
  }
  const auto cost = [&](int64_t task) { return task_cost(task, task_start, chunks, G, R, scoring.window); };
  freight::parallel_for_balanced(task_start[num_seqs], cost, [&](int64_t begin, int64_t end) {
    if (begin_range) begin_range();
    int64_t s = std::upper_bound(task_start.begin(), task_start.end(), begin) - task_start.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= task_start[s + 1]) ++s;
      const int64_t len = chunks.kv_len[s], prefix = len - chunks.q_len[s], rows_total = chunks.q_len[s] * G;
      const int64_t blocks = (rows_total + R - 1) / R, local = task - task_start[s];
      const int64_t h = local / blocks, first = (local % blocks) * R;
      const int rows = int(std::min<int64_t>(R, rows_total - first));
      const uint16_t* q_rows[R];
      uint16_t* out_rows[R];
      int64_t pos[R] = {};
      for (int r = 0; r < rows; ++r) {
        const int64_t row = first + r, p = row / G, g = row % G;
        const int64_t offset = ((chunks.q_start[s] + p) * H + h * G + g) * D;
        q_rows[r] = q + offset;
        out_rows[r] = out + offset;
        pos[r] = prefix + p;
      }
      const int64_t padded = (len + kTile - 1) / kTile * kTile;
      const int64_t offset = packed_offset[s] + h * padded * (D / 2);
      attend(q_rows, pos, rows, kp.data() + offset, vp.data() + offset, scoring, out_rows);
    }
    if (end_range) end_range();
  });
}

// ---------------------------------------------------------------------------------------------------
// AMX (bfloat16, head_dim 64, 128 or 256): tasks of 16 query rows. All eight tiles are 16 rows x 64 bytes.
// Scores of a 32-key tile: S (tmm0: keys 0-15, tmm1: keys 16-31) = Q (tmm2, 32 of d at a time) x K (tmm3:
// the packed keys read in place, 16 d-pairs x 16 keys), summed over d. AMX cannot rescale accumulators, so
// the softmax takes passes instead of running: the first computes every tile's scores into a per-thread
// buffer (16 rows x the task's keys, in L2) and the rows' maxima, kept per lane (no horizontal max per tile;
// the logits are monotone in the raw scores, so the maxima are taken raw); the second turns them into
// exp2(logit - max) rounded to bf16, in a second buffer; the third multiplies those (tmm0) by the values
// (tmm1: 16 key pairs x 16 d, read in place) into O, 64 of d at a time (tmm4-7), over every key tile (at
// head_dim 64, one set of O tiles, tile by tile inside the second pass). Only the tiles at a row block's
// diagonal or window edge are masked.
#if defined(__GNUC__) && __GNUC__ >= 11 && defined(__x86_64__)
#define FREIGHT_PREFILL_AMX 1
#define FREIGHT_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
constexpr int kRowsAmx = 16;

// Every tile 16 rows x 64 bytes.
constexpr freight::TileConfig kTileConfig{1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

FREIGHT_AMX_TARGET void amx_begin() { _tile_loadconfig(&kTileConfig); }

FREIGHT_AMX_TARGET void amx_end() { _tile_release(); }

// s[16][32] = q[16][D] . keys of tile `tile` (unscaled), through tmm0-3.
template <int D>
FREIGHT_AMX_TARGET inline void amx_scores(const uint16_t (*q)[D], const uint32_t* kt, float (*s)[kTile]) {
  constexpr int64_t k_stride = kTile * sizeof(uint32_t);  // one d-pair row of the packed keys
  _tile_zero(0);
  _tile_zero(1);
  for (int c = 0; c < D / 32; ++c) {
    _tile_loadd(2, &q[0][c * 32], D * sizeof(uint16_t));
    _tile_loadd(3, kt + c * 16 * kTile, k_stride);
    _tile_dpbf16ps(0, 2, 3);
    _tile_loadd(3, kt + c * 16 * kTile + 16, k_stride);
    _tile_dpbf16ps(1, 2, 3);
  }
  _tile_stored(0, &s[0][0], kTile * sizeof(float));
  _tile_stored(1, &s[0][16], kTile * sizeof(float));
}

// 2^t for t <= 0, for probabilities that are rounded to bfloat16 next: degree-4 polynomial on f in [-0.5, 0.5]
// (relative error < 5e-5, far under bf16's 2^-9 rounding), no upper clamp (t is a logit minus its row max).
FREIGHT_AMX_TARGET inline __m512 exp2_probs(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.618129107628477e-03f);  // (ln 2)^k / k!, k = 4 .. 0
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// A 64-byte-aligned pointer into `buffer`, grown to hold `count` elements.
template <typename T>
T* aligned_scratch(std::vector<T>& buffer, size_t count) {
  buffer.resize(count + 64 / sizeof(T));
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
}

template <int D>
FREIGHT_AMX_TARGET void attend_rows_amx(const uint16_t* const* q_rows, const int64_t* pos, int rows,
                                        const uint32_t* kp, const uint32_t* vp, const Scoring& scoring,
                                        uint16_t* const* out_rows) {
  constexpr int R = kRowsAmx;
  thread_local std::vector<float> score_buffer;    // [tiles][R][kTile] raw scores
  thread_local std::vector<uint16_t> prob_buffer;  // [tiles][R][kTile] bf16 probabilities
  alignas(64) uint16_t q[R][D];
  alignas(64) float o[R][D];
  alignas(64) float lanes[R][16];  // per-lane maxima of the raw scores, then lane sums of the probabilities
  float m[R];
  const __m512 hidden = _mm512_set1_ps(-1e30f);
  for (int r = 0; r < R; ++r) {
    if (r < rows) std::memcpy(q[r], q_rows[r], D * sizeof(uint16_t));
    else std::memset(q[r], 0, sizeof(q[r]));
    _mm512_store_ps(lanes[r], hidden);
  }
  int64_t first, last;
  key_range(pos, rows, scoring, first, last);
  // tiles in [full_from, full_to) are visible to every row whole: no masks there
  int64_t min_pos = INT64_MAX, max_first = 0;
  for (int r = 0; r < rows; ++r) {
    min_pos = std::min(min_pos, pos[r]);
    max_first = std::max(max_first, scoring.first_key(pos[r]));
  }
  const int64_t first_tile = first / kTile, tiles = last / kTile + 1, count = tiles - first_tile;
  const int64_t full_from = (max_first + kTile - 1) / kTile, full_to = (min_pos + 1) / kTile;
  const auto full = [&](int64_t tile) { return tile >= full_from && tile < full_to; };
  float* const scores = aligned_scratch(score_buffer, size_t(count * R * kTile));
  uint16_t* const probs = aligned_scratch(prob_buffer, size_t(count * R * kTile));
  const auto scores_of = [&](int64_t tile) { return reinterpret_cast<float (*)[kTile]>(scores + (tile - first_tile) * R * kTile); };
  const auto probs_of = [&](int64_t tile) { return reinterpret_cast<uint16_t (*)[kTile]>(probs + (tile - first_tile) * R * kTile); };

  for (int64_t tile = first_tile; tile < tiles; ++tile) {  // pass 1: scores, and the rows' maxima
    float (*s)[kTile] = scores_of(tile);
    amx_scores<D>(q, kp + tile * (D / 2) * kTile, s);
    if (full(tile)) {
      for (int r = 0; r < rows; ++r)
        _mm512_store_ps(lanes[r], _mm512_max_ps(_mm512_load_ps(lanes[r]),
                                                _mm512_max_ps(_mm512_load_ps(s[r]), _mm512_load_ps(s[r] + 16))));
      continue;
    }
    for (int r = 0; r < rows; ++r) {
      __mmask16 m0, m1;
      tile_masks(scoring.first_key(pos[r]), pos[r], tile * kTile, m0, m1);
      const __m512 x0 = _mm512_mask_mov_ps(hidden, m0, _mm512_load_ps(s[r]));
      const __m512 x1 = _mm512_mask_mov_ps(hidden, m1, _mm512_load_ps(s[r] + 16));
      _mm512_store_ps(lanes[r], _mm512_max_ps(_mm512_load_ps(lanes[r]), _mm512_max_ps(x0, x1)));
    }
  }
  for (int r = 0; r < rows; ++r) {
    m[r] = _mm512_reduce_max_ps(scoring.logits(_mm512_set1_ps(_mm512_reduce_max_ps(_mm512_load_ps(lanes[r])))));
    _mm512_store_ps(lanes[r], _mm512_setzero_ps());  // now the probabilities' lane sums
  }
  // a row's logits minus its max (one FMA without a soft cap)
  const __m512 scale = _mm512_set1_ps(scoring.scale_log2);
  const bool capped = scoring.capped();
  const auto shifted = [&](__m512 raw, __m512 mv) {
    return capped ? _mm512_sub_ps(scoring.logits(raw), mv) : _mm512_fmsub_ps(raw, scale, mv);
  };
  constexpr int64_t v_stride = D * sizeof(uint32_t);  // one key-pair row of the packed values
  // P (tmm0) x the values of `tile`, d columns [c0, c0 + 64), into O (tmm4-7)
  const auto multiply_values = [&](int64_t tile, int c0) FREIGHT_AMX_TARGET {
    const uint32_t* vt = vp + tile * (kTile / 2) * D + c0;
    _tile_loadd(0, &probs_of(tile)[0][0], kTile * sizeof(uint16_t));
    _tile_loadd(1, vt, v_stride);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(1, vt + 16, v_stride);
    _tile_dpbf16ps(5, 0, 1);
    _tile_loadd(1, vt + 32, v_stride);
    _tile_dpbf16ps(6, 0, 1);
    _tile_loadd(1, vt + 48, v_stride);
    _tile_dpbf16ps(7, 0, 1);
  };
  const auto zero_o = []() FREIGHT_AMX_TARGET {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
  };
  const auto store_o = [&](int c0) FREIGHT_AMX_TARGET {
    _tile_stored(4, &o[0][c0], D * sizeof(float));
    _tile_stored(5, &o[0][c0 + 16], D * sizeof(float));
    _tile_stored(6, &o[0][c0 + 32], D * sizeof(float));
    _tile_stored(7, &o[0][c0 + 48], D * sizeof(float));
  };
  if constexpr (D == 64) zero_o();  // one set of O tiles: passes 2 and 3 run together, tile by tile
  for (int64_t tile = first_tile; tile < tiles; ++tile) {  // pass 2: probabilities, rounded to bf16
    float (*s)[kTile] = scores_of(tile);
    uint16_t (*p)[kTile] = probs_of(tile);
    const bool masked = !full(tile);
    for (int r = 0; r < rows; ++r) {
      __mmask16 m0 = 0xFFFF, m1 = 0xFFFF;
      if (masked) tile_masks(scoring.first_key(pos[r]), pos[r], tile * kTile, m0, m1);
      const __m512 mv = _mm512_set1_ps(m[r]);
      const __m512 p0 = _mm512_maskz_mov_ps(m0, exp2_probs(shifted(_mm512_load_ps(s[r]), mv)));
      const __m512 p1 = _mm512_maskz_mov_ps(m1, exp2_probs(shifted(_mm512_load_ps(s[r] + 16), mv)));
      _mm512_store_ps(lanes[r], _mm512_add_ps(_mm512_load_ps(lanes[r]), _mm512_add_ps(p0, p1)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(p[r]), (__m256i)_mm512_cvtneps_pbh(p0));
      _mm256_store_si256(reinterpret_cast<__m256i*>(p[r] + 16), (__m256i)_mm512_cvtneps_pbh(p1));
    }
    for (int r = rows; r < R; ++r) std::memset(p[r], 0, sizeof(p[r]));  // padding rows weigh nothing
    if constexpr (D == 64) multiply_values(tile, 0);
  }
  if constexpr (D == 64) {
    store_o(0);
  } else {
    for (int c0 = 0; c0 < D; c0 += 64) {  // pass 3: probabilities times values, 64 of d at a time
      zero_o();
      for (int64_t tile = first_tile; tile < tiles; ++tile) multiply_values(tile, c0);
      store_o(c0);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(lanes[r])));
    for (int c = 0; c < D / 16; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_rows[r] + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o[r] + c * 16), inv)));
  }
}

// Whether this CPU has AMX-BF16 and the kernel lets this process use its tile registers.
bool amx_usable() {
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && freight::request_amx_tiles();
}
#endif
#endif

// ---------------------------------------------------------------------------------------------------
// float32, AVX2 + FMA (8 float lanes; also what AVX-512 machines run for float32 queries).
// Each task takes R query rows of one kv head's group and walks the keys in tiles of 16 with an online
// softmax. The keys are first repacked per (sequence, kv head) d-major, [tile][D][16 keys], so that
// S[row, 16 keys] accumulates over d with the query element broadcast and no horizontal sums; values are
// read in place, O[row, d] accumulating over keys with the probability broadcast.
#ifdef FREIGHT_PREFILL_F32
constexpr int64_t kTileF32 = 16;  // keys per tile: two vectors of S per row
constexpr int kRowsF32 = 6;       // query rows per task: 6 x 2 S accumulators + 2 key vectors + 1 broadcast

// Keys of positions [0, len) of rows k[pos * stride + d], transposed to [tile][d][16], zero padded.
void pack_keys_f32(const float* k, int64_t stride, int64_t len, int64_t D, float* kp) {
  const int64_t tiles = (len + kTileF32 - 1) / kTileF32;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    float* kt = kp + tile * D * kTileF32;
    for (int64_t j = 0; j < kTileF32; ++j) {
      const int64_t pos = tile * kTileF32 + j;
      const float* kr = pos < len ? k + pos * stride : nullptr;
      for (int64_t d = 0; d < D; ++d) kt[d * kTileF32 + j] = kr ? kr[d] : 0.f;
    }
  }
}

// R query rows (row r: position pos[r], pointers q_rows[r], out_rows[r]) against the keys they see, from the
// tile of the first: key tiles from kp, value rows v + key * v_stride. Rows past `rows` are padding (copies of
// row 0), never written.
template <int D>
void attend_rows_f32(const float* const* q_rows, const int64_t* pos, int rows, const float* kp, const float* v,
                     int64_t v_stride, const Scoring& scoring, float* const* out_rows) {
  constexpr int R = kRowsF32, C = D / 8;
  constexpr int CW = 2;  // output chunks per pass over a tile's values: R x 2 accumulators + 2 value vectors
  alignas(32) float q[R][D];  // times scoring.query_scale(): the scores are base-2 logits, or tanh's argument
  alignas(32) float o[R][D];
  alignas(32) float p[R][kTileF32];  // scores, then probabilities, of the current tile
  alignas(32) float m[8];            // running max per row (lanes past R unused)
  alignas(32) float l[R][8];         // running sum per row, 8 partial sums
  const __m256 qscale = _mm256_set1_ps(scoring.query_scale());
  int64_t row_pos[R], row_first[R];  // each row's position and first visible key
  for (int r = 0; r < R; ++r) {
    const float* src = q_rows[r < rows ? r : 0];
    row_pos[r] = pos[r < rows ? r : 0];
    row_first[r] = scoring.first_key(row_pos[r]);
    for (int c = 0; c < C; ++c) {
      _mm256_store_ps(q[r] + c * 8, _mm256_mul_ps(_mm256_loadu_ps(src + c * 8), qscale));
      _mm256_store_ps(o[r] + c * 8, _mm256_setzero_ps());
    }
  }
  // finite, so that a tile where a row sees no key (before its window) leaves it at -1e30 with zero weights
  _mm256_store_ps(m, _mm256_set1_ps(-1e30f));
  for (int r = 0; r < R; ++r) _mm256_store_ps(l[r], _mm256_setzero_ps());
  int64_t first, last;
  key_range(pos, rows, scoring, first, last);
  // keys before this are hidden from some row: tiles starting before it need the window's mask
  int64_t windowed_until = 0;
  for (int r = 0; r < rows; ++r) windowed_until = std::max(windowed_until, row_first[r]);
  const __m256 lane0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), lane1 = _mm256_add_ps(lane0, _mm256_set1_ps(8.f));
  for (int64_t key0 = first / kTileF32 * kTileF32; key0 <= last; key0 += kTileF32) {
    // S = Q . K^T for the tile, accumulated in registers over d
    const float* kt = kp + key0 * D;  // [D][16]
    __m256 s[R][2];
    FREIGHT_UNROLL
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m256 k0 = _mm256_load_ps(kt + d * kTileF32), k1 = _mm256_load_ps(kt + d * kTileF32 + 8);
      FREIGHT_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256 qb = _mm256_broadcast_ss(q[r] + d);
        s[r][0] = _mm256_fmadd_ps(qb, k0, s[r][0]);
        s[r][1] = _mm256_fmadd_ps(qb, k1, s[r][1]);
      }
    }
    FREIGHT_UNROLL
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(p[r], scoring.logits_of_folded(s[r][0]));
      _mm256_store_ps(p[r] + 8, scoring.logits_of_folded(s[r][1]));
    }

    // online softmax. Keys past a row's position are masked (causal), which also masks the padding past the
    // sequence; only a tile reaching past the block's first (smallest) position has any. So are keys before a
    // row's window; only a tile starting before the last row's window has any.
    const bool masked = key0 + kTileF32 - 1 > row_pos[0] || key0 < windowed_until;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    alignas(32) float m_new[8];
    _mm256_store_ps(m_new, _mm256_load_ps(m));
    for (int r = 0; r < R; ++r) {
      __m256 s0 = _mm256_load_ps(p[r]), s1 = _mm256_load_ps(p[r] + 8);
      if (masked) {  // lanes of keys [row_first, row_pos] stay
        const __m256 upto = _mm256_set1_ps(float(row_pos[r] - key0));
        const __m256 from = _mm256_set1_ps(float(std::max<int64_t>(row_first[r] - key0, -1)));
        s0 = _mm256_blendv_ps(ninf, s0, _mm256_and_ps(_mm256_cmp_ps(lane0, upto, _CMP_LE_OQ),
                                                      _mm256_cmp_ps(lane0, from, _CMP_GE_OQ)));
        s1 = _mm256_blendv_ps(ninf, s1, _mm256_and_ps(_mm256_cmp_ps(lane1, upto, _CMP_LE_OQ),
                                                      _mm256_cmp_ps(lane1, from, _CMP_GE_OQ)));
        _mm256_store_ps(p[r], s0);
        _mm256_store_ps(p[r] + 8, s1);
      }
      m_new[r] = std::max(m[r], freight::reduce_max8(_mm256_max_ps(s0, s1)));
    }
    // rescaling of the rows' running sums and outputs: one exp2 for all rows
    alignas(32) float alpha[8];
    const __m256 m_new_v = _mm256_load_ps(m_new);
    _mm256_store_ps(alpha, freight::exp2_8(_mm256_sub_ps(_mm256_load_ps(m), m_new_v)));
    _mm256_store_ps(m, m_new_v);
    for (int r = 0; r < R; ++r) {
      const __m256 mv = _mm256_set1_ps(m[r]), s0 = _mm256_load_ps(p[r]), s1 = _mm256_load_ps(p[r] + 8);
      __m256 p0 = freight::exp2_8(_mm256_sub_ps(s0, mv)), p1 = freight::exp2_8(_mm256_sub_ps(s1, mv));
      if (masked) {  // exp2_8 clamps its argument at -126: a masked score needs its zero set
        p0 = _mm256_andnot_ps(_mm256_cmp_ps(s0, ninf, _CMP_EQ_OQ), p0);
        p1 = _mm256_andnot_ps(_mm256_cmp_ps(s1, ninf, _CMP_EQ_OQ), p1);
      }
      _mm256_store_ps(l[r], _mm256_fmadd_ps(_mm256_load_ps(l[r]), _mm256_set1_ps(alpha[r]), _mm256_add_ps(p0, p1)));
      _mm256_store_ps(p[r], p0);
      _mm256_store_ps(p[r] + 8, p1);
    }

    // O = alpha * O + P . V, CW chunks of O at a time; keys of the tile that no row sees are never read
    // (they may lie past the tensor's end)
    const int64_t keys = std::min<int64_t>(kTileF32, last - key0 + 1);
    const float* vt = v + key0 * v_stride;
    for (int c0 = 0; c0 < C; c0 += CW) {
      __m256 acc[R][CW];
      FREIGHT_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_set1_ps(alpha[r]);
        FREIGHT_UNROLL
        for (int c = 0; c < CW; ++c) acc[r][c] = _mm256_mul_ps(_mm256_load_ps(o[r] + (c0 + c) * 8), a);
      }
      for (int64_t j = 0; j < keys; ++j) {
        __m256 vv[CW];
        FREIGHT_UNROLL
        for (int c = 0; c < CW; ++c) vv[c] = _mm256_loadu_ps(vt + j * v_stride + (c0 + c) * 8);
        FREIGHT_UNROLL
        for (int r = 0; r < R; ++r) {
          const __m256 pb = _mm256_broadcast_ss(p[r] + j);
          FREIGHT_UNROLL
          for (int c = 0; c < CW; ++c) acc[r][c] = _mm256_fmadd_ps(pb, vv[c], acc[r][c]);
        }
      }
      FREIGHT_UNROLL
      for (int r = 0; r < R; ++r)
        FREIGHT_UNROLL
        for (int c = 0; c < CW; ++c) _mm256_store_ps(o[r] + (c0 + c) * 8, acc[r][c]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const __m256 inv = _mm256_set1_ps(1.f / freight::reduce_add8(_mm256_load_ps(l[r])));
    for (int c = 0; c < C; ++c)
      _mm256_storeu_ps(out_rows[r] + c * 8, _mm256_mul_ps(_mm256_load_ps(o[r] + c * 8), inv));
  }
}

template <int D>
void prefill_f32(const float* q, const float* k, const float* v, const Chunks& chunks, int64_t H, int64_t KVH,
                 const Scoring& scoring, float* out) {
  constexpr int R = kRowsF32;
  const int64_t G = H / KVH, num_seqs = chunks.num;
  // packed keys: each (sequence, kv head) gets its context rounded up to whole tiles
  std::vector<int64_t> packed_offset(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t padded = (chunks.kv_len[s] + kTileF32 - 1) / kTileF32 * kTileF32;
    packed_offset[s + 1] = packed_offset[s] + padded * KVH * D;
  }
  const at::Tensor packed = at::empty({packed_offset[num_seqs]}, at::kFloat);  // 64-byte aligned
  float* kp = packed.data_ptr<float>();
  at::parallel_for(0, num_seqs * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / KVH, h = task % KVH, len = chunks.kv_len[s];
      const int64_t padded = (len + kTileF32 - 1) / kTileF32 * kTileF32;
      pack_keys_f32(k + (chunks.kv_start[s] * KVH + h) * D, KVH * D, len, D, kp + packed_offset[s] + h * padded * D);
    }
  });
  // tasks: (sequence, kv head, block of R rows); rows run position-major over the group's heads, so a block's
  // rows share their keys
  std::vector<int64_t> task_start(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s)
    task_start[s + 1] = task_start[s] + KVH * ((chunks.q_len[s] * G + R - 1) / R);
  const auto cost = [&](int64_t task) { return task_cost(task, task_start, chunks, G, R, scoring.window); };
  freight::parallel_for_balanced(task_start[num_seqs], cost, [&](int64_t begin, int64_t end) {
    int64_t s = std::upper_bound(task_start.begin(), task_start.end(), begin) - task_start.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= task_start[s + 1]) ++s;
      const int64_t len = chunks.kv_len[s], prefix = len - chunks.q_len[s], rows_total = chunks.q_len[s] * G;
      const int64_t blocks = (rows_total + R - 1) / R, local = task - task_start[s];
      const int64_t h = local / blocks, first = (local % blocks) * R;
      const int rows = int(std::min<int64_t>(R, rows_total - first));
      const float* q_rows[R];
      float* out_rows[R];
      int64_t pos[R] = {};
      for (int r = 0; r < rows; ++r) {
        const int64_t row = first + r, p = row / G, g = row % G;
        const int64_t offset = ((chunks.q_start[s] + p) * H + h * G + g) * D;
        q_rows[r] = q + offset;
        out_rows[r] = out + offset;
        pos[r] = prefix + p;
      }
      const int64_t padded = (len + kTileF32 - 1) / kTileF32 * kTileF32;
      attend_rows_f32<D>(q_rows, pos, rows, kp + packed_offset[s] + h * padded * D,
                         v + (chunks.kv_start[s] * KVH + h) * D, KVH * D, scoring, out_rows);
    }
  });
}
#endif

}  // namespace

bool available_bf16() {
#ifdef FREIGHT_PREFILL_BF16
  return true;
#else
  return false;
#endif
}

// The AMX path: this build has it, the CPU has AMX-BF16, and the OS let the process use the tiles (asked once).
bool available_amx() {
#if defined(FREIGHT_PREFILL_BF16) && defined(FREIGHT_PREFILL_AMX)
  static const bool usable = amx_usable();
  return usable;
#else
  return false;
#endif
}

bool available_f32() {
#ifdef FREIGHT_PREFILL_F32
  return true;
#else
  return false;
#endif
}

// The chunk description (int32 [S] each) as Chunks, checked against the tensors' rows.
Chunks chunks_of(const torch::Tensor& q_start, const torch::Tensor& q_len, const torch::Tensor& kv_start,
                 const torch::Tensor& kv_len, int64_t q_rows, int64_t kv_rows) {
  for (const auto* t : {&q_start, &q_len, &kv_start, &kv_len}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->dim() == 1 && t->size(0) == q_start.size(0),
                "q_start, q_len, kv_start, kv_len: contiguous int32 [num_chunks] each");
  }
  const Chunks chunks{q_start.data_ptr<int32_t>(), q_len.data_ptr<int32_t>(), kv_start.data_ptr<int32_t>(),
                      kv_len.data_ptr<int32_t>(), q_start.size(0)};
  for (int64_t s = 0; s < chunks.num; ++s) {
    TORCH_CHECK(chunks.q_len[s] >= 0 && chunks.q_len[s] <= chunks.kv_len[s], "chunk ", s, ": q_len must be in [0, kv_len]");
    TORCH_CHECK(chunks.q_start[s] >= 0 && chunks.q_start[s] + chunks.q_len[s] <= q_rows, "chunk ", s, ": query rows out of range");
    TORCH_CHECK(chunks.kv_start[s] >= 0 && chunks.kv_start[s] + chunks.kv_len[s] <= kv_rows, "chunk ", s, ": key rows out of range");
  }
  return chunks;
}

// With a sliding window, each chunk's context cut to the keys its first query (at kv_len - q_len) sees: those
// before are never read nor packed, so a chunk after a long cached prefix costs its window, not the prefix.
// Positions move with the context's start, so each query keeps the same keys. `storage` holds the moved
// starts and lengths the result points to.
Chunks trim_to_window(const Chunks& chunks, int64_t window, std::vector<int32_t>& storage) {
  if (window <= 0) return chunks;
  storage.resize(2 * chunks.num);
  int32_t* kv_start = storage.data();
  int32_t* kv_len = kv_start + chunks.num;
  for (int64_t s = 0; s < chunks.num; ++s) {
    const int32_t skip = int32_t(std::max<int64_t>(0, chunks.kv_len[s] - chunks.q_len[s] - window + 1));
    kv_start[s] = chunks.kv_start[s] + skip;
    kv_len[s] = chunks.kv_len[s] - skip;
  }
  return Chunks{chunks.q_start, chunks.q_len, kv_start, kv_len, chunks.num};
}

void check_options(int64_t window, double soft_cap) {
  TORCH_CHECK_VALUE(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK_VALUE(soft_cap >= 0.0 && std::isfinite(soft_cap), "soft_cap must be finite and >= 0 (0: none), got ",
                    soft_cap);
}

// query [T, H, D], key/value [TK, KVH, D], out [T, H, D]: bfloat16, contiguous; the chunks as in Chunks. Rows
// of out outside every chunk are left as they are.
// amx: run through AMX tiles (available_amx() must hold).
// window: 0, or the keys a query sees (sliding window, itself included); soft_cap: 0, or c > 0 for scores
// c * tanh(score / c).
void prefill_attention_bf16(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor q_start,
                            torch::Tensor q_len, torch::Tensor kv_start, torch::Tensor kv_len, double scale,
                            torch::Tensor out, bool amx, int64_t window, double soft_cap) {
#ifdef FREIGHT_PREFILL_BF16
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "bfloat16 tensors only");
  TORCH_CHECK(query.is_contiguous() && key.is_contiguous() && value.is_contiguous() && out.is_contiguous(),
              "contiguous tensors only");
  check_options(window, soft_cap);
  const int64_t H = query.size(1), KVH = key.size(1), D = query.size(2);
  std::vector<int32_t> trimmed;
  const Chunks chunks =
      trim_to_window(chunks_of(q_start, q_len, kv_start, kv_len, query.size(0), key.size(0)), window, trimmed);
  const Scoring scoring(scale, soft_cap, window);
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  const auto* k = reinterpret_cast<const uint16_t*>(key.data_ptr<at::BFloat16>());
  const auto* v = reinterpret_cast<const uint16_t*>(value.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  if (amx && (D == 64 || D == 128 || D == 256)) {
#ifdef FREIGHT_PREFILL_AMX
    TORCH_CHECK(available_amx(), "AMX is not usable here");
    if (D == 64) prefill<64, kRowsAmx>(q, k, v, chunks, H, KVH, scoring, o, attend_rows_amx<64>, amx_begin, amx_end);
    else if (D == 128)
      prefill<128, kRowsAmx>(q, k, v, chunks, H, KVH, scoring, o, attend_rows_amx<128>, amx_begin, amx_end);
    else prefill<256, kRowsAmx>(q, k, v, chunks, H, KVH, scoring, o, attend_rows_amx<256>, amx_begin, amx_end);
#else
    TORCH_CHECK(false, "built without AMX support");
#endif
  } else if (D == 64) {
    prefill<64, 4>(q, k, v, chunks, H, KVH, scoring, o, attend_rows<64, 4>);
  } else if (D == 128) {
    prefill<128, 2>(q, k, v, chunks, H, KVH, scoring, o, attend_rows<128, 2>);
  } else if (D == 256) {  // one row a task: its 16 output vectors fill half the registers, as 2 rows of 128 do
    prefill<256, 1>(q, k, v, chunks, H, KVH, scoring, o, attend_rows<256, 1>);
  } else {
    TORCH_CHECK(false, "head_dim must be 64, 128 or 256");
  }
#else
  TORCH_CHECK(false, "built without AVX-512 BF16");
#endif
}

// As prefill_attention_bf16, float32 tensors.
void prefill_attention_f32(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor q_start,
                           torch::Tensor q_len, torch::Tensor kv_start, torch::Tensor kv_len, double scale,
                           torch::Tensor out, int64_t window, double soft_cap) {
#ifdef FREIGHT_PREFILL_F32
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "float32 tensors only");
  TORCH_CHECK(query.is_contiguous() && key.is_contiguous() && value.is_contiguous() && out.is_contiguous(),
              "contiguous tensors only");
  check_options(window, soft_cap);
  const int64_t H = query.size(1), KVH = key.size(1), D = query.size(2);
  std::vector<int32_t> trimmed;
  const Chunks chunks =
      trim_to_window(chunks_of(q_start, q_len, kv_start, kv_len, query.size(0), key.size(0)), window, trimmed);
  const Scoring scoring(scale, soft_cap, window);
  const float* q = query.data_ptr<float>();
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  float* o = out.data_ptr<float>();
  if (D == 64) {
    prefill_f32<64>(q, k, v, chunks, H, KVH, scoring, o);
  } else if (D == 128) {
    prefill_f32<128>(q, k, v, chunks, H, KVH, scoring, o);
  } else if (D == 256) {
    prefill_f32<256>(q, k, v, chunks, H, KVH, scoring, o);
  } else {
    TORCH_CHECK(false, "head_dim must be 64, 128 or 256");
  }
#else
  TORCH_CHECK(false, "built without AVX2 + FMA");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available_bf16", &available_bf16);
  m.def("available_f32", &available_f32);
  m.def("available_amx", &available_amx);
  m.def("prefill_attention_bf16", &prefill_attention_bf16, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("q_start"), py::arg("q_len"), py::arg("kv_start"), py::arg("kv_len"), py::arg("scale"),
        py::arg("out"), py::arg("amx"), py::arg("window") = 0, py::arg("soft_cap") = 0.0);
  m.def("prefill_attention_f32", &prefill_attention_f32, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("q_start"), py::arg("q_len"), py::arg("kv_start"), py::arg("kv_len"), py::arg("scale"),
        py::arg("out"), py::arg("window") = 0, py::arg("soft_cap") = 0.0);
}
