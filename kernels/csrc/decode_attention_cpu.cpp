// Paged decode attention for CPU: one task per (sequence, kv head), reading the cache in place.
// Each key and value row is read once, converted to float in registers and used by every query head
// of the group, so INT8 caches are never expanded into a float copy in memory.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename CacheT, typename ScaleT, typename OutT>
void decode_attention_kernel(
    const float* query,        // [num_seqs, num_heads, head_dim], softmax scale folded in
    const CacheT* key_cache,   // [num_blocks, block_size, kv_heads, head_dim]
    const CacheT* value_cache,
    const ScaleT* key_scales,  // [num_blocks, block_size, kv_heads] or nullptr
    const ScaleT* value_scales,
    const int32_t* block_tables,  // [num_seqs, max_blocks]
    const int32_t* context_lens,  // [num_seqs]
    OutT* out,                    // [num_seqs, num_heads, head_dim]
    int64_t num_seqs, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks) {
  const int64_t group = num_heads / kv_heads;
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * head_dim);
    std::vector<float> krow_buffer(head_dim);
    float* krow = krow_buffer.data();
    int64_t block_row = 0;  // row index of (current block, offset 0, this kv head)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / kv_heads, kvh = task % kv_heads;
      const int64_t len = context_lens[seq];
      const int32_t* table = block_tables + seq * max_blocks;
      const float* q = query + (seq * num_heads + kvh * group) * head_dim;
      scores.assign(group * len, 0.f);
      // walk block by block: no division per token
      for (int64_t t = 0; t < len; ++t) {
        if (t % block_size == 0) block_row = static_cast<int64_t>(table[t / block_size]) * block_size * kv_heads + kvh;
        const int64_t row = block_row + (t % block_size) * kv_heads;
        const CacheT* k = key_cache + row * head_dim;
        const float ks = key_scales ? static_cast<float>(key_scales[row]) : 1.f;
        // convert the row once, then every query head of the group reads it from L1
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) krow[d] = static_cast<float>(k[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * krow[d];
          scores[g * len + t] = dot * ks;
        }
      }
      std::vector<float> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float mx = *std::max_element(s, s + len);
        float sum = 0.f;
        // vectorized expf (glibc libmvec): the exponentials are a large share of the kernel's time
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - mx);
          sum += s[t];
        }
        inv_sum[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        if (t % block_size == 0) block_row = static_cast<int64_t>(table[t / block_size]) * block_size * kv_heads + kvh;
        const int64_t row = block_row + (t % block_size) * kv_heads;
        const CacheT* v = value_cache + row * head_dim;
        const float vs = value_scales ? static_cast<float>(value_scales[row]) : 1.f;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) krow[d] = static_cast<float>(v[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * len + t] * vs;
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += w * krow[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        OutT* o = out + (seq * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<OutT>(acc[g * head_dim + d] * inv_sum[g]);
      }
    }
  });
}

template <typename CacheT, typename ScaleT>
void dispatch_out(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
                  const ScaleT* ks, const ScaleT* vs, const torch::Tensor& bt, const torch::Tensor& cl,
                  torch::Tensor& out) {
  const auto args = std::make_tuple(q.size(0), q.size(1), kc.size(2), kc.size(3), kc.size(1), bt.size(1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "decode_out", [&] {
    decode_attention_kernel<CacheT, ScaleT, scalar_t>(
        q.data_ptr<float>(), kc.data_ptr<CacheT>(), vc.data_ptr<CacheT>(), ks, vs,
        bt.data_ptr<int32_t>(), cl.data_ptr<int32_t>(), out.data_ptr<scalar_t>(),
        std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args), std::get<4>(args),
        std::get<5>(args));
  });
}

}  // namespace

// query float32 [S, H, D] (scale folded in); caches contiguous; block_tables and context_lens int32.
void paged_decode_attention_cpu(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                c10::optional<torch::Tensor> key_scales,
                                c10::optional<torch::Tensor> value_scales, torch::Tensor block_tables,
                                torch::Tensor context_lens, torch::Tensor out) {
  if (key_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(key_scales && value_scales, "int8 caches need scales");
    const auto& ks = *key_scales;
    const auto& vs = *value_scales;
    if (ks.scalar_type() == at::kHalf) {
      dispatch_out<int8_t, at::Half>(query, key_cache, value_cache, ks.data_ptr<at::Half>(),
                                     vs.data_ptr<at::Half>(), block_tables, context_lens, out);
    } else {
      TORCH_CHECK(ks.scalar_type() == at::kFloat, "scales must be float16 or float32");
      dispatch_out<int8_t, float>(query, key_cache, value_cache, ks.data_ptr<float>(), vs.data_ptr<float>(),
                                  block_tables, context_lens, out);
    }
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(), "decode_cache", [&] {
    dispatch_out<scalar_t, float>(query, key_cache, value_cache, nullptr, nullptr, block_tables,
                                  context_lens, out);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention_cpu", &paged_decode_attention_cpu);
}
