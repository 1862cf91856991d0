// INT8 GEMM on AMX tiles for many rows (prefill chunks, large decode batches): out [M, N] int32 =
// x_q [M, K] @ w_q [N, K]^T, exact (s8 x s8 into int32, the same integers as every other INT8 path, so the
// caller's epilogue gives the same outputs whichever product ran).
//
// Why our own: oneDNN's u8 x s8 qlinear reaches 1-2.8 TOP/s on these shapes on a 2-core AMX VM and hands
// back float32 that the epilogue reads again; a tile GEMM blocked for the model's small K (576-2048) keeps
// a 32-row strip of activations in L1 for the whole row of weight blocks.
//
// Layout. The weights are packed once, at load, into the B operand's VNNI layout: for each block of 16
// output columns (weight rows) and each 64-byte chunk of K, a 16 x 64 tile whose row g holds, for each of
// the 16 columns, the 4 codes k = 4g .. 4g + 3 of the chunk ([N/16][K/64][16][16][4]); N is padded to a
// multiple of 32 with zero rows. The activations are read in place as the A operand (16 rows x 64 bytes,
// stride K). Tiles: 0-3 the accumulators of a 32 x 32 output block, 4-5 two A tiles (rows 0-15, 16-31),
// 6-7 two B tiles (columns 0-15, 16-31): four tile products per two A and two B loads.
// A last strip of fewer than 32 rows is copied into a zeroed 32-row buffer first (tile loads read whole
// tiles); blocks that reach past M or N are stored through a buffer and copied.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__x86_64__)
#include <immintrin.h>

#include "amx.h"
#include "int8_epilogue_avx512.h"
#define FREIGHT_GEMM_AMX 1
#define FREIGHT_AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
#endif

namespace {

constexpr int64_t kTile = 16;    // rows of a tile, and output columns of a B tile
constexpr int64_t kChunk = 64;   // bytes of K per tile product
constexpr int64_t kBlock = 32;   // rows and columns of an output block
constexpr int64_t kTileBytes = kTile * kChunk;

#if defined(FREIGHT_GEMM_AMX)
// Eight 16 x 64-byte tiles (palette 1).
const freight::TileConfig kConfig = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

bool amx_usable() {
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && freight::request_amx_tiles();
}

// One 32 x 32 block: a (rows 0-31 of the strip, stride lda), b0 / b1 (the two column blocks' packed tiles,
// chunk after chunk) -> c (stride ldc int32).
FREIGHT_AMX_TARGET inline void block_product(const int8_t* a, int64_t lda, const int8_t* b0, const int8_t* b1,
                                             int64_t chunks, int32_t* c, int64_t ldc) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < chunks; ++k) {
    _tile_loadd(4, a + k * kChunk, lda);
    _tile_loadd(5, a + kTile * lda + k * kChunk, lda);
    _tile_loadd(6, b0 + k * kTileBytes, kChunk);
    _tile_loadd(7, b1 + k * kTileBytes, kChunk);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  const int64_t stride = ldc * static_cast<int64_t>(sizeof(int32_t));
  _tile_stored(0, c, stride);
  _tile_stored(1, c + kTile, stride);
  _tile_stored(2, c + kTile * ldc, stride);
  _tile_stored(3, c + kTile * ldc + kTile, stride);
}

// Where a block's products go: the int32 products themselves, or the epilogue's floats (the same row
// functions as the passes after the library GEMMs: y = acc * x_scale * w_scale (+ bias) (+ residual), or
// silu(gate) * up where the block's two column halves are a gate block and its up block).
template <typename OutT>
struct Epilogue {
  const float* x_scale = nullptr;   // [M]
  const float* w_scale = nullptr;   // [N] (plain); gated: gate scales [I], then up scales at w_scale + I
  const OutT* bias = nullptr;       // [N] or null
  const OutT* residual = nullptr;   // [M, N] or null
  OutT* out = nullptr;              // [M, N], or [M, I] gated
  bool gated = false;
  int64_t I = 0;                    // gated: output columns
};

template <typename OutT>
inline void finish_block(const int32_t* c, const Epilogue<OutT>& e, int64_t m0, int64_t rows, int64_t cb, int64_t N) {
  if (e.gated) {
    const int64_t n0 = cb * kTile, cols = std::min(kTile, e.I - n0);
    for (int64_t r = 0; r < rows; ++r)
      freight_epilogue::silu_mul_row(c + r * kBlock, c + r * kBlock + kTile, e.x_scale[m0 + r], e.w_scale + n0,
                                     e.w_scale + e.I + n0, e.out + (m0 + r) * e.I + n0, cols);
    return;
  }
  const int64_t n0 = cb * kBlock, cols = std::min(kBlock, N - n0);
  for (int64_t r = 0; r < rows; ++r)
    freight_epilogue::dequantize_row(c + r * kBlock, e.x_scale[m0 + r], e.w_scale + n0, e.bias ? e.bias + n0 : nullptr,
                                     e.residual ? e.residual + (m0 + r) * N + n0 : nullptr, e.out + (m0 + r) * N + n0,
                                     cols);
}

// Output strips [strip_begin, strip_end) of 32 rows, column blocks [col_begin, col_end) of 32 columns. With
// an epilogue (e != null) each block's products go through it from L1; else they are stored to out.
template <typename OutT>
FREIGHT_AMX_TARGET void product_range(const int8_t* x, const int8_t* packed, int32_t* out, const Epilogue<OutT>* e,
                                      int64_t M, int64_t K, int64_t N, int64_t strip_begin, int64_t strip_end,
                                      int64_t col_begin, int64_t col_end) {
  _tile_loadconfig(&kConfig);
  const int64_t chunks = K / kChunk, column_block_bytes = chunks * kTileBytes;
  std::vector<int8_t> tail_rows;  // the last strip, zero-padded to 32 rows
  alignas(64) int32_t block[kBlock * kBlock];
  for (int64_t s = strip_begin; s < strip_end; ++s) {
    const int64_t m0 = s * kBlock, rows = std::min(kBlock, M - m0);
    const int8_t* a = x + m0 * K;
    if (rows < kBlock) {
      tail_rows.assign(kBlock * K, 0);
      std::memcpy(tail_rows.data(), a, rows * K);
      a = tail_rows.data();
    }
    for (int64_t cb = col_begin; cb < col_end; ++cb) {
      const int64_t n0 = cb * kBlock, cols = std::min(kBlock, N - n0);
      const int8_t* b0 = packed + 2 * cb * column_block_bytes;
      if (e == nullptr && rows == kBlock && cols == kBlock) {
        block_product(a, K, b0, b0 + column_block_bytes, chunks, out + m0 * N + n0, N);
        continue;
      }
      block_product(a, K, b0, b0 + column_block_bytes, chunks, block, kBlock);
      if (e != nullptr) {
        finish_block(block, *e, m0, rows, cb, N);
        continue;
      }
      for (int64_t r = 0; r < rows; ++r) std::memcpy(out + (m0 + r) * N + n0, block + r * kBlock, cols * sizeof(int32_t));
    }
  }
  _tile_release();
}

// Every strip and column block of an [M, N] product, split across threads. Many strips: a thread takes
// whole strips (its activations stay in L1 across the weights); few: column groups give every thread work.
template <typename OutT>
void run_product(const int8_t* x, const int8_t* packed, int32_t* out, const Epilogue<OutT>* e, int64_t M, int64_t K,
                 int64_t N) {
  const int64_t strips = (M + kBlock - 1) / kBlock, col_blocks = (N + kBlock - 1) / kBlock;
  const int64_t threads = at::get_num_threads();
  const int64_t groups = std::min(col_blocks, std::max<int64_t>(1, (4 * threads + strips - 1) / strips));
  const int64_t group_width = (col_blocks + groups - 1) / groups;
  at::parallel_for(0, strips * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / groups, g = item % groups;
      const int64_t c0 = g * group_width, c1 = std::min(col_blocks, c0 + group_width);
      if (c0 < c1) product_range<OutT>(x, packed, out, e, M, K, N, s, s + 1, c0, c1);
    }
  });
}
#endif

bool available() {
#if defined(FREIGHT_GEMM_AMX)
  static const bool usable = amx_usable();
  return usable;
#else
  return false;
#endif
}

int64_t padded_columns(int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

}  // namespace

// w_q [N, K] int8 contiguous, K a multiple of 64 -> the packed B tiles [padded N / 16, K / 64, 16, 64] int8.
torch::Tensor pack_weight(torch::Tensor w_q) {
  TORCH_CHECK(w_q.dim() == 2 && w_q.is_contiguous() && w_q.scalar_type() == at::kChar,
              "w_q must be a contiguous [N, K] int8 tensor");
  const int64_t N = w_q.size(0), K = w_q.size(1);
  TORCH_CHECK(K % kChunk == 0, "K must be a multiple of 64, got ", K);
  const int64_t chunks = K / kChunk, blocks = padded_columns(N) / kTile;
  torch::Tensor packed = torch::zeros({blocks, chunks, kTile, kChunk}, w_q.options());
  const int8_t* w = w_q.const_data_ptr<int8_t>();
  int8_t* p = packed.data_ptr<int8_t>();
  at::parallel_for(0, N, kTile, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; ++k)
        p[((n / kTile * chunks + k / kChunk) * kTile + (k % kChunk) / 4) * kChunk + (n % kTile) * 4 + k % 4] = w[n * K + k];
  });
  return packed;
}

// x_q [M, K] int8, packed = pack_weight(w_q) of an [N, K] weight -> out [M, N] int32 (contiguous) = x_q @ w_q.T.
void product(torch::Tensor x_q, torch::Tensor packed, torch::Tensor out) {
  TORCH_CHECK(x_q.dim() == 2 && x_q.is_contiguous() && x_q.scalar_type() == at::kChar,
              "x_q must be a contiguous [M, K] int8 tensor");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kInt && out.size(0) == x_q.size(0),
              "out must be a contiguous [M, N] int32 tensor");
  const int64_t M = x_q.size(0), K = x_q.size(1), N = out.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(0) == padded_columns(N) / kTile && packed.size(1) * kChunk == K &&
                  packed.size(2) == kTile && packed.size(3) == kChunk,
              "packed must be pack_weight() of an [N, K] weight with this K and N");
  TORCH_CHECK(available(), "AMX-INT8 is not usable here");
#if defined(FREIGHT_GEMM_AMX)
  if (M == 0) return;
  run_product<float>(x_q.const_data_ptr<int8_t>(), packed.const_data_ptr<int8_t>(), out.data_ptr<int32_t>(), nullptr,
                     M, K, N);
#endif
}

namespace {

void check_epilogue_args(const torch::Tensor& x_q, const torch::Tensor& packed, const torch::Tensor& x_scale,
                         const torch::Tensor& w_scale, const torch::Tensor& out, int64_t N, int64_t scales) {
  TORCH_CHECK(x_q.dim() == 2 && x_q.is_contiguous() && x_q.scalar_type() == at::kChar,
              "x_q must be a contiguous [M, K] int8 tensor");
  const int64_t M = x_q.size(0), K = x_q.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(0) == padded_columns(N) / kTile && packed.size(1) * kChunk == K &&
                  packed.size(2) == kTile && packed.size(3) == kChunk,
              "packed must be pack_weight() of an [N, K] weight with this K and N = ", N);
  TORCH_CHECK(x_scale.dim() == 1 && x_scale.size(0) == M && x_scale.is_contiguous() &&
                  x_scale.scalar_type() == at::kFloat, "x_scale must be a contiguous [M] float32 tensor");
  TORCH_CHECK(w_scale.dim() == 1 && w_scale.size(0) == scales && w_scale.is_contiguous() &&
                  w_scale.scalar_type() == at::kFloat, "w_scale must be a contiguous [N] float32 tensor");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == M &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be a contiguous float32 or bfloat16 [M, *] tensor");
  TORCH_CHECK(available(), "AMX-INT8 is not usable here");
}

// f(OutT{}) for out's dtype (float32 or bfloat16, checked above).
template <typename F>
void dispatch_out(const torch::Tensor& out, F&& f) {
  if (out.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    f(at::BFloat16{});
  }
}

}  // namespace

// y = (x_q @ w_q.T) * x_scale[:, None] * w_scale (+ bias) (+ residual) into out [M, N] (float32 or bfloat16),
// the epilogue applied to each block in L1.
void linear(torch::Tensor x_q, torch::Tensor packed, torch::Tensor x_scale, torch::Tensor w_scale,
            c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual, torch::Tensor out) {
  const int64_t N = out.size(1);
  check_epilogue_args(x_q, packed, x_scale, w_scale, out, N, N);
  for (const auto* t : {&bias, &residual})
    if (t->has_value())
      TORCH_CHECK((*t)->is_contiguous() && (*t)->scalar_type() == out.scalar_type(),
                  "bias and residual must be contiguous, in out's dtype");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N), "bias must be [N]");
  TORCH_CHECK(!residual.has_value() || residual->sizes() == out.sizes(), "residual must be [M, N]");
#if defined(FREIGHT_GEMM_AMX)
  dispatch_out(out, [&](auto zero) {
    using scalar_t = decltype(zero);
    Epilogue<scalar_t> e;
    e.x_scale = x_scale.const_data_ptr<float>();
    e.w_scale = w_scale.const_data_ptr<float>();
    e.bias = bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr;
    e.residual = residual.has_value() ? residual->const_data_ptr<scalar_t>() : nullptr;
    e.out = out.data_ptr<scalar_t>();
    run_product<scalar_t>(x_q.const_data_ptr<int8_t>(), packed.const_data_ptr<int8_t>(), nullptr, &e, x_q.size(0),
                          x_q.size(1), N);
  });
#endif
}

// out [M, I] = silu(gate) * up of the products with a gated packing (pack_weight(w_q, gated=True) of the
// [2 * I, K] gate-then-up weight, I a multiple of 16); w_scale [2 * I]: gate scales, then up scales.
void silu_mul(torch::Tensor x_q, torch::Tensor packed, torch::Tensor x_scale, torch::Tensor w_scale,
              torch::Tensor out) {
  const int64_t I = out.size(1);
  TORCH_CHECK(I % kTile == 0, "the gated product needs I a multiple of 16, got ", I);
  check_epilogue_args(x_q, packed, x_scale, w_scale, out, 2 * I, 2 * I);
#if defined(FREIGHT_GEMM_AMX)
  dispatch_out(out, [&](auto zero) {
    using scalar_t = decltype(zero);
    Epilogue<scalar_t> e;
    e.x_scale = x_scale.const_data_ptr<float>();
    e.w_scale = w_scale.const_data_ptr<float>();
    e.out = out.data_ptr<scalar_t>();
    e.gated = true;
    e.I = I;
    run_product<scalar_t>(x_q.const_data_ptr<int8_t>(), packed.const_data_ptr<int8_t>(), nullptr, &e, x_q.size(0),
                          x_q.size(1), 2 * I);
  });
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, py::arg("w_q"));
  m.def("product", &product, py::arg("x_q"), py::arg("packed"), py::arg("out"));
  m.def("linear", &linear, py::arg("x_q"), py::arg("packed"), py::arg("x_scale"), py::arg("w_scale"), py::arg("bias"),
        py::arg("residual"), py::arg("out"));
  m.def("silu_mul", &silu_mul, py::arg("x_q"), py::arg("packed"), py::arg("x_scale"), py::arg("w_scale"),
        py::arg("out"));
  m.def("available", &available);
}
