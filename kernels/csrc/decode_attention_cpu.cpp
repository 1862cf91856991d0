// Paged decode attention for CPU, reading the cache in place (one task per sequence on the AVX-512
// path, per (sequence, kv head) on the portable one).
// Each key and value row is read once, converted to float in registers and used by every query head
// of the group, so INT8 caches are never expanded into a float copy in memory.
//
// Two code paths: with AVX-512 and head_dim in {32, 64, 128} (every Llama-family model we load), the
// group size and head_dim are template parameters, so the group's queries and accumulators live in
// registers for the whole sequence; otherwise a portable loop does the same work.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float to_float(T value) {
  return static_cast<float>(value);
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
// Portable path
template <typename CacheT, typename ScaleT>
void decode_task_generic(const float* q, const CacheT* key_cache, const CacheT* value_cache,
                         const ScaleT* key_scales, const ScaleT* value_scales, const RowIndex& rows,
                         int64_t len, int64_t group, int64_t head_dim, std::vector<float>& scores,
                         std::vector<float>& acc, std::vector<float>& row_buffer, float* out) {
  scores.resize(group * len);
  acc.assign(group * head_dim, 0.f);
  row_buffer.resize(head_dim);
  float* row_f = row_buffer.data();
  for (int64_t t = 0; t < len; ++t) {
    const int64_t row = rows(t);
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
    const float mx = *std::max_element(s, s + len);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - mx);
      sum += s[t];
    }
    inv_sum[g] = 1.f / sum;
  }
  for (int64_t t = 0; t < len; ++t) {
    const int64_t row = rows(t);
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
// AVX-512 path
#if defined(__AVX512F__)
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

constexpr int64_t kPrefetchBlocks = 2;  // how far ahead of use a block is prefetched

inline void prefetch_bytes(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(p + offset, _MM_HINT_T0);
}

template <typename CacheT>
inline void prefetch_block(const CacheT* cache, const int32_t* table, int64_t b, int64_t num_blocks,
                           int64_t block_elems) {
  if (b < num_blocks) prefetch_bytes(cache + table[b] * block_elems, block_elems * sizeof(CacheT));
}

// One sequence, every head. The cache is walked block by block, and inside a block slot by slot with
// all kv heads of a slot side by side, so each block is read as one contiguous stretch; the next
// block is prefetched while this one is used (blocks sit anywhere in the pool).
template <int G, int D, typename CacheT, typename ScaleT>
void decode_sequence_avx512(const float* q,  // [kv_heads * G, D]
                            const CacheT* key_cache, const CacheT* value_cache, const ScaleT* key_scales,
                            const ScaleT* value_scales, const int32_t* table, int64_t len,
                            int64_t block_size, int64_t kv_heads, std::vector<float>& scores,
                            std::vector<float>& acc_buffer, float* out) {  // [kv_heads * G, D]
  constexpr int C = D / 16;  // 16-float chunks per row
  const int64_t heads = kv_heads * G;
  const int64_t slot_elems = kv_heads * D, block_elems = block_size * slot_elems;
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  scores.resize(heads * len + heads);
  float* s = scores.data();
  float* maxima = s + heads * len;
  for (int64_t h = 0; h < heads; ++h) maxima[h] = -INFINITY;
  for (int64_t b = 0; b < kPrefetchBlocks; ++b) prefetch_block(key_cache, table, b, num_blocks, block_elems);

  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t block = table[b], t0 = b * block_size, n = std::min(block_size, len - t0);
    prefetch_block(key_cache, table, b + kPrefetchBlocks, num_blocks, block_elems);
    const CacheT* kb = key_cache + block * block_elems;
    const ScaleT* kscale = key_scales ? key_scales + block * block_size * kv_heads : nullptr;
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      __m512 qv[G][C];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) qv[g][c] = load16(q + (kvh * G + g) * D + c * 16);
      float mx[G];
      for (int g = 0; g < G; ++g) mx[g] = maxima[kvh * G + g];
      for (int64_t t = 0; t < n; ++t) {
        const CacheT* k = kb + t * slot_elems + kvh * D;
        __m512 kv[C];
        for (int c = 0; c < C; ++c) kv[c] = load16(k + c * 16);
        const float ks = kscale ? to_float(kscale[t * kv_heads + kvh]) : 1.f;
        for (int g = 0; g < G; ++g) {
          __m512 dot = _mm512_mul_ps(qv[g][0], kv[0]);
          for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(qv[g][c], kv[c], dot);
          const float score = _mm512_reduce_add_ps(dot) * ks;
          s[(kvh * G + g) * len + t0 + t] = score;
          mx[g] = std::max(mx[g], score);
        }
      }
      for (int g = 0; g < G; ++g) maxima[kvh * G + g] = mx[g];
    }
  }

  for (int64_t b = 0; b < kPrefetchBlocks; ++b) prefetch_block(value_cache, table, b, num_blocks, block_elems);
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = s + h * len;
    const float m = maxima[h];
    float sum = 0.f;
    // vectorized expf (glibc libmvec under -ffast-math)
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sh[t] = std::exp(sh[t] - m);
      sum += sh[t];
    }
    maxima[h] = 1.f / sum;  // from here on: the softmax's normalizer
  }

  acc_buffer.assign(heads * D, 0.f);
  float* acc_all = acc_buffer.data();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t block = table[b], t0 = b * block_size, n = std::min(block_size, len - t0);
    prefetch_block(value_cache, table, b + kPrefetchBlocks, num_blocks, block_elems);
    const CacheT* vb = value_cache + block * block_elems;
    const ScaleT* vscale = value_scales ? value_scales + block * block_size * kv_heads : nullptr;
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      float* acc_group = acc_all + kvh * G * D;
      __m512 acc[G][C];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_loadu_ps(acc_group + g * D + c * 16);
      for (int64_t t = 0; t < n; ++t) {
        const CacheT* v = vb + t * slot_elems + kvh * D;
        __m512 vv[C];
        for (int c = 0; c < C; ++c) vv[c] = load16(v + c * 16);
        const float vs = vscale ? to_float(vscale[t * kv_heads + kvh]) : 1.f;
        for (int g = 0; g < G; ++g) {
          const __m512 w = _mm512_set1_ps(s[(kvh * G + g) * len + t0 + t] * vs);
          for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc_group + g * D + c * 16, acc[g][c]);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const __m512 inv = _mm512_set1_ps(maxima[h]);
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(out + h * D + c * 16, _mm512_mul_ps(_mm512_loadu_ps(acc_all + h * D + c * 16), inv));
  }
}

template <typename CacheT, typename ScaleT>
using SequenceFn = void (*)(const float*, const CacheT*, const CacheT*, const ScaleT*, const ScaleT*,
                            const int32_t*, int64_t, int64_t, int64_t, std::vector<float>&,
                            std::vector<float>&, float*);

template <int D, typename CacheT, typename ScaleT>
SequenceFn<CacheT, ScaleT> pick_group(int64_t group) {
  switch (group) {
    case 1: return decode_sequence_avx512<1, D, CacheT, ScaleT>;
    case 2: return decode_sequence_avx512<2, D, CacheT, ScaleT>;
    case 3: return decode_sequence_avx512<3, D, CacheT, ScaleT>;
    case 4: return decode_sequence_avx512<4, D, CacheT, ScaleT>;
    case 5: return decode_sequence_avx512<5, D, CacheT, ScaleT>;
    case 6: return decode_sequence_avx512<6, D, CacheT, ScaleT>;
    case 7: return decode_sequence_avx512<7, D, CacheT, ScaleT>;
    case 8: return decode_sequence_avx512<8, D, CacheT, ScaleT>;
    default: return nullptr;
  }
}

template <typename CacheT, typename ScaleT>
SequenceFn<CacheT, ScaleT> pick_task(int64_t group, int64_t head_dim) {
  switch (head_dim) {
    case 32: return pick_group<32, CacheT, ScaleT>(group);
    case 64: return pick_group<64, CacheT, ScaleT>(group);
    case 128: return pick_group<128, CacheT, ScaleT>(group);
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
                      int64_t block_size, int64_t max_blocks) {
  const int64_t group = num_heads / kv_heads;
#if defined(__AVX512F__)
  const SequenceFn<CacheT, ScaleT> fast = pick_task<CacheT, ScaleT>(group, head_dim);
  if (fast) {
    at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc;
      for (int64_t seq = begin; seq < end; ++seq) {
        const int64_t offset = seq * num_heads * head_dim;
        fast(query + offset, key_cache, value_cache, key_scales, value_scales, block_tables + seq * max_blocks,
             context_lens[seq], block_size, kv_heads, scores, acc, out + offset);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, row_buffer;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / kv_heads, kvh = task % kv_heads;
      const RowIndex rows{block_tables + seq * max_blocks, block_size, kv_heads, kvh};
      const int64_t offset = (seq * num_heads + kvh * group) * head_dim;
      decode_task_generic(query + offset, key_cache, value_cache, key_scales, value_scales, rows,
                          context_lens[seq], group, head_dim, scores, acc, row_buffer, out + offset);
    }
  });
}

template <typename CacheT, typename ScaleT>
void run(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const ScaleT* ks,
         const ScaleT* vs, const torch::Tensor& bt, const torch::Tensor& cl, torch::Tensor& out) {
  decode_attention<CacheT, ScaleT>(q.data_ptr<float>(), kc.data_ptr<CacheT>(), vc.data_ptr<CacheT>(), ks, vs,
                                   bt.data_ptr<int32_t>(), cl.data_ptr<int32_t>(), out.data_ptr<float>(),
                                   q.size(0), q.size(1), kc.size(2), kc.size(3), kc.size(1), bt.size(1));
}

}  // namespace

// query and out float32 [S, H, D] (scale folded into query); caches contiguous; block_tables and
// context_lens int32.
void paged_decode_attention_cpu(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                c10::optional<torch::Tensor> key_scales,
                                c10::optional<torch::Tensor> value_scales, torch::Tensor block_tables,
                                torch::Tensor context_lens, torch::Tensor out) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "query and out: float32");
  if (key_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(key_scales && value_scales, "int8 caches need scales");
    const auto& ks = *key_scales;
    const auto& vs = *value_scales;
    if (ks.scalar_type() == at::kHalf) {
      run<int8_t, at::Half>(query, key_cache, value_cache, ks.data_ptr<at::Half>(), vs.data_ptr<at::Half>(),
                            block_tables, context_lens, out);
    } else {
      TORCH_CHECK(ks.scalar_type() == at::kFloat, "scales must be float16 or float32");
      run<int8_t, float>(query, key_cache, value_cache, ks.data_ptr<float>(), vs.data_ptr<float>(), block_tables,
                         context_lens, out);
    }
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(), "decode_cache", [&] {
    run<scalar_t, float>(query, key_cache, value_cache, nullptr, nullptr, block_tables, context_lens, out);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention_cpu", &paged_decode_attention_cpu);
}
