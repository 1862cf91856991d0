// Causal prefill attention for CPU over packed variable-length sequences, bfloat16 in and out, using
// AVX-512 BF16 dot products (vdpbf16ps: 32 bf16 products summed in pairs into 16 float32 lanes).
//
// Used when a sequence's chunk is its whole context (no cached prefix): queries, keys and values are the
// step's own tensors. Flash-attention style: each task takes R query rows of one kv head's group and walks
// the keys in tiles of 32 with an online softmax, so scores are never stored. Keys and values are first
// repacked per (sequence, kv head) into the pair-interleaved layouts vdpbf16ps reads:
//   keys   [tile][d / 2][32 keys][2]   -> S[row, 32 keys] accumulates over d pairs (query pair broadcast)
//   values [tile][16 key pairs][d][2]  -> O[row, d]       accumulates over key pairs (prob pair broadcast)
// Float32 accumulation throughout; probabilities are rounded to bf16 for the P.V product, as bf16 SDPA does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "avx512_math.h"
#define FREIGHT_PREFILL_BF16 1
#endif

namespace {

constexpr int64_t kTile = 32;  // keys per tile

#ifdef FREIGHT_PREFILL_BF16
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

// R query rows (row r of the block: position pos[r], pointer q_rows[r]) against keys [0, max pos].
template <int D, int R>
void attend_rows(const uint16_t* const* q_rows, const int64_t* pos, int rows, const uint32_t* kp,
                 const uint32_t* vp, float scale_log2, uint16_t* const* out_rows) {
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
  int64_t last = 0;
  for (int r = 0; r < rows; ++r) last = std::max(last, pos[r]);
  const int64_t tiles = last / kTile + 1;
  alignas(64) uint16_t probs[R][kTile];
  for (int64_t tile = 0; tile < tiles; ++tile) {
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
      // keys past this row's position are masked (causal); that also masks the padding past the sequence
      const int64_t visible = std::min<int64_t>(kTile, std::max<int64_t>(0, pos[r] - key0 + 1));
      const __mmask16 m0 = visible >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << visible) - 1);
      const __mmask16 m1 = visible >= 32 ? __mmask16(0xFFFF)
                                         : (visible <= 16 ? __mmask16(0) : __mmask16((1u << (visible - 16)) - 1));
      const __m512 scale = _mm512_set1_ps(scale_log2);
      const __m512 x0 = _mm512_mask_mul_ps(_mm512_set1_ps(-1e30f), m0, s[r][0], scale);
      const __m512 x1 = _mm512_mask_mul_ps(_mm512_set1_ps(-1e30f), m1, s[r][1], scale);
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
      const __m512 mv = _mm512_set1_ps(m_new);
      // base-2 exponentials: scale_log2 carries log2(e)
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

template <int D, int R>
void prefill(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int32_t* seq_start,
             const int32_t* seq_len, int64_t num_seqs, int64_t H, int64_t KVH, float scale, uint16_t* out) {
  const int64_t G = H / KVH;
  // packed buffers: each (sequence, kv head) gets its length rounded up to whole tiles
  std::vector<int64_t> packed_offset(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = seq_len[s];
    packed_offset[s + 1] = packed_offset[s] + (len + kTile - 1) / kTile * kTile * KVH * (D / 2);
  }
  std::vector<uint32_t> kp(packed_offset[num_seqs]), vp(packed_offset[num_seqs]);
  at::parallel_for(0, num_seqs * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / KVH, h = task % KVH, len = seq_len[s];
      const int64_t padded = (len + kTile - 1) / kTile * kTile;
      const int64_t offset = packed_offset[s] + h * padded * (D / 2);
      pack_kv(k + (seq_start[s] * KVH + h) * D, v + (seq_start[s] * KVH + h) * D, KVH * D, len, D,
              kp.data() + offset, vp.data() + offset);
    }
  });
  // tasks: (sequence, kv head, block of R rows); rows run position-major over the group's heads
  std::vector<int64_t> task_start(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = seq_len[s] * G;
    task_start[s + 1] = task_start[s] + KVH * ((rows + R - 1) / R);
  }
  const float scale_log2 = scale * 1.4426950408889634f;
  at::parallel_for(0, task_start[num_seqs], 1, [&](int64_t begin, int64_t end) {
    int64_t s = std::upper_bound(task_start.begin(), task_start.end(), begin) - task_start.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= task_start[s + 1]) ++s;
      const int64_t len = seq_len[s], rows_total = len * G;
      const int64_t blocks = (rows_total + R - 1) / R, local = task - task_start[s];
      const int64_t h = local / blocks, first = (local % blocks) * R;
      const int rows = int(std::min<int64_t>(R, rows_total - first));
      const uint16_t* q_rows[R];
      uint16_t* out_rows[R];
      int64_t pos[R] = {};
      for (int r = 0; r < rows; ++r) {
        const int64_t row = first + r, p = row / G, g = row % G;
        const int64_t offset = ((seq_start[s] + p) * H + h * G + g) * D;
        q_rows[r] = q + offset;
        out_rows[r] = out + offset;
        pos[r] = p;
      }
      const int64_t padded = (len + kTile - 1) / kTile * kTile;
      const int64_t offset = packed_offset[s] + h * padded * (D / 2);
      attend_rows<D, R>(q_rows, pos, rows, kp.data() + offset, vp.data() + offset, scale_log2, out_rows);
    }
  });
}
#endif

}  // namespace

bool available() {
#ifdef FREIGHT_PREFILL_BF16
  return true;
#else
  return false;
#endif
}

// query [T, H, D], key/value [T, KVH, D], out [T, H, D]: bfloat16, contiguous. Sequence s is rows
// seq_start[s] .. seq_start[s] + seq_len[s] (int32 [S] each), its whole context; other rows of out are
// left as they are.
void prefill_attention_bf16(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor seq_start,
                            torch::Tensor seq_len, double scale, torch::Tensor out) {
#ifdef FREIGHT_PREFILL_BF16
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "bfloat16 tensors only");
  TORCH_CHECK(query.is_contiguous() && key.is_contiguous() && value.is_contiguous() && out.is_contiguous(),
              "contiguous tensors only");
  const int64_t H = query.size(1), KVH = key.size(1), D = query.size(2);
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  const auto* k = reinterpret_cast<const uint16_t*>(key.data_ptr<at::BFloat16>());
  const auto* v = reinterpret_cast<const uint16_t*>(value.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  TORCH_CHECK(seq_start.scalar_type() == at::kInt && seq_len.scalar_type() == at::kInt, "int32 seq_start, seq_len");
  const int32_t* starts = seq_start.data_ptr<int32_t>();
  const int32_t* lens = seq_len.data_ptr<int32_t>();
  const int64_t num_seqs = seq_start.size(0);
  if (D == 64) {
    prefill<64, 4>(q, k, v, starts, lens, num_seqs, H, KVH, float(scale), o);
  } else if (D == 128) {
    prefill<128, 2>(q, k, v, starts, lens, num_seqs, H, KVH, float(scale), o);
  } else {
    TORCH_CHECK(false, "head_dim must be 64 or 128");
  }
#else
  TORCH_CHECK(false, "built without AVX-512 BF16");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available);
  m.def("prefill_attention_bf16", &prefill_attention_bf16);
}
