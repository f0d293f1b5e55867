// Float32 linears with the output features in the vector lanes (`pack_lanes`, `linear_lanes`).
//
// The weight is packed once as [blocks of 16 features][in][16]: for each input k, a block's 16
// weights are one 64-byte line. A tile of rows broadcasts x[m, k] and adds its products with the
// line to 16 sums, one per feature, so that every output is one chain of fused multiply-adds over
// the inputs in order, from zero:
//
//     y[m, n] = fma(x[m, in-1], w[n, in-1], ... fma(x[m, 1], w[n, 1], fma(x[m, 0], w[n, 0], 0)))
//
// plus the bias, added once in float32. Nothing else enters a sum: no lanes added across at the
// end, no order that depends on the tile, the thread, the row count or the vector width. So a
// row's bits are the same in a call of 1 row or 1,000, in a decode or a prompt chunk, on AVX2
// (8 lanes to a vector), on AVX-512 (16) and in the scalar loop (std::fma), which is what batch
// invariance needs (see specdec/attention.py).
//
// The row kernel this replaced held the weight as [out][in] and gave each (row, feature) 16
// partial sums that it added across at the end; each weight vector it loaded served at most 2
// rows on AVX2 (16 registers), and steps of more than 64 rows went to MKL. Here each weight line
// serves every row of a tile. Measured on 2 AVX2 cores (AMD EPYC) over the default model's 120
// decoder linears, against that row kernel: 1 row 1.06x, 3 rows 1.37x, 9 rows 1.56-1.63x, 64
// rows 1.53x; against MKL 0.97-1.03x at 256-512 rows (see specdec/models/linear.py).
//
// Tiles: a decode's single row takes 4 blocks at once (8 independent chains keep both FMA units
// busy while the weights stream from memory), 2 or 3 rows take 2 blocks, and more rows take one
// block in tiles of up to 5 rows (10 sums, 2 weight vectors and a broadcast input: 13 of the 16
// ymm registers); from kWideLaneRows rows on, tiles of 6 rows (12 sums in named registers, see
// six_row_sums in cpu_simd.h) with one smaller tile for the rest; with AVX-512, up to 16 rows
// take two blocks in tiles of up to 8 rows, and more rows four blocks in tiles of up to 6 (see
// kZmmRows). When a block has several tiles, they take
// the inputs kLaneChunk at a time, so that the block's 4 KB of weights for those inputs stay in
// L1 while every tile reads them; a tile's sums wait in memory between chunks (a store and a
// load do not change a float).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_simd.h"

namespace {

using namespace specdec_cpu;

constexpr int64_t kLaneBlock = 16;     // features per block: one 64-byte line per input
constexpr int64_t kLaneChunk = 64;     // inputs per pass when a block has several row tiles
constexpr int kLaneRows = 5;           // most rows in a tile of one block
constexpr int64_t kLaneRowChunk = 256; // rows per pass over the weights (x stays in L2)
constexpr int64_t kWideLaneRows = 12;  // chunks of this many rows or more take tiles of 6

struct LaneLayout {
  int64_t in, out, blocks;
  LaneLayout(int64_t in_, int64_t out_)
      : in(in_), out(out_), blocks((out_ + kLaneBlock - 1) / kLaneBlock) {}
  int64_t floats() const { return blocks * in * kLaneBlock; }
  const float* block(const float* w, int64_t b) const { return w + b * in * kLaneBlock; }
};

#if !defined(__AVX512F__)
// Without AVX-512 the tiles of many rows below are never taken (kZmmLanes false); the sizes
// only let the shared code compile.
constexpr bool kZmmLanes = false;
constexpr int kZmmRows = 1;
constexpr int kZmmBlocks = 1;
constexpr int64_t kZmmChunk = 1;
constexpr int64_t kZmmFewRows = 0;
constexpr int kZmmFewTileRows = 1;
constexpr int kZmmFewBlocks = 1;
constexpr int64_t kZmmFewChunk = 1;

#endif

#if defined(__AVX512F__)
// AVX-512: a block's 16 features are one vector, and the tiles of many rows take four blocks at
// once (kZmmRows rows x kZmmBlocks blocks: 24 sums, 4 weight vectors and a broadcast input of
// the 32 zmm registers), so that each input's 4 weight loads and 6 broadcasts feed 24 fused
// multiply-adds; the inputs go kZmmChunk at a time (the 4 blocks' 32 KB of weights for them stay
// in L1 while every tile of the row chunk reads them). The AVX2 code (8 features to a vector)
// ran here before. Side by side on 2 Intel cores with AVX-512 (and no BF16): a 1536 x 576
// linear went from 91 to 222 GFLOP/s at 8 rows, 77 to 289 at 64 and 87 to 276 at 256 (torch's
// oneDNN matmul: 137, 227, 262), and the default model's 1,000-token float32 prompt took 1.58x
// less time (medians of 3 runs each way); a decode step, bound by reading the weights, the same.
// Tiles of 8 rows x 2 blocks, inputs 64 at a time, took every row count until 2026-12-07.
// Against them, on 2 cores with AMX (the default model's four linear shapes, time as a share of
// MKL's, side by side in one process, the same bits), 6 x 4 with 128 inputs: 24 rows 0.60 ->
// 0.58, 64 rows 0.82 -> 0.79, 256 rows 1.06 -> 0.97, 512 rows 1.17 -> 1.03 (a float32
// embedding of the dataset's prompts, all prefill, went from 0.81x transformers to 0.94x). 6 x
// 4 with 64 inputs gave 1.07 at 512, 8 x 2 with 128 inputs 1.12, 12 x 2 1.14, 7 x 3 1.10, and 96
// to 192 inputs with 6 x 4 within 2% of 128.
constexpr bool kZmmLanes = true;
constexpr int kZmmRows = 6;
constexpr int kZmmBlocks = 4;
constexpr int64_t kZmmChunk = 128;
// Up to kZmmFewRows rows (a decode beside a few others, a verification), tiles of 8 rows x 2
// blocks, inputs 64 at a time, as before: 1-3% faster there than 6 x 4 (8 rows: 0.42 of MKL's
// time against 0.46; 9-16 rows 0.44-0.49 against 0.45-0.51).
constexpr int64_t kZmmFewRows = 16;
constexpr int kZmmFewTileRows = 8;
constexpr int kZmmFewBlocks = 2;
constexpr int64_t kZmmFewChunk = 64;

// sums[r][16 * b + j] for rows x[r] (`stride` apart) and the B blocks from wb, over inputs
// [k0, k1); the sums start from zero at k0 == 0 and from `sums` otherwise. `ahead`: the weights
// B blocks on (the next tile's), asked into L2 line by line as these are read.
template <int R, int B>
inline void lane_tile(const float* x, int64_t stride, const float* wb, const LaneLayout& l,
                      int64_t k0, int64_t k1, float* sums, bool ahead) {
  const int64_t block_floats = l.in * kLaneBlock;
  __m512 acc[R][B];
  for (int r = 0; r < R; r++)
    for (int b = 0; b < B; b++)
      acc[r][b] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * 16 * B + 16 * b);
  for (int64_t k = k0; k < k1; k++) {
    __m512 w[B];
    for (int b = 0; b < B; b++) {
      const float* line = wb + b * block_floats + k * kLaneBlock;
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(line + B * block_floats), _MM_HINT_T1);
      w[b] = _mm512_loadu_ps(line);
    }
    for (int r = 0; r < R; r++) {
      const __m512 xv = _mm512_set1_ps(x[r * stride + k]);
      for (int b = 0; b < B; b++) acc[r][b] = _mm512_fmadd_ps(xv, w[b], acc[r][b]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int b = 0; b < B; b++) _mm512_storeu_ps(sums + r * 16 * B + 16 * b, acc[r][b]);
}

inline void lane_tile6(const float* x, int64_t stride, const float* wb, const LaneLayout& l,
                       int64_t k0, int64_t k1, float* sums, bool ahead) {
  lane_tile<6, 1>(x, stride, wb, l, k0, k1, sums, ahead);
}
#elif defined(__AVX2__) && defined(__FMA__)
// sums[r][16 * b + j] for rows x[r] (`stride` apart) and the B blocks from wb, over inputs
// [k0, k1); the sums start from zero at k0 == 0 and from `sums` otherwise. `ahead`: the weights
// B blocks on (the next tile's), asked into L2 line by line as these are read.
template <int R, int B>
inline void lane_tile(const float* x, int64_t stride, const float* wb, const LaneLayout& l,
                      int64_t k0, int64_t k1, float* sums, bool ahead) {
  constexpr int V = 2 * B;  // vectors of 8 features
  const int64_t block_floats = l.in * kLaneBlock;
  __m256 acc[R][V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++)
      acc[r][v] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * 16 * B + 8 * v);
  for (int64_t k = k0; k < k1; k++) {
    if constexpr (B == 1) {
      const float* line = wb + k * kLaneBlock;
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(line + block_floats), _MM_HINT_T1);
      const __m256 w0 = _mm256_load_ps(line), w1 = _mm256_load_ps(line + 8);
      for (int r = 0; r < R; r++) {
        const __m256 xv = _mm256_broadcast_ss(x + r * stride + k);
        acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
      }
    } else {
      for (int v = 0; v < V; v++) {
        const float* line = wb + (v / 2) * block_floats + k * kLaneBlock;
        if (ahead && v % 2 == 0)
          _mm_prefetch(reinterpret_cast<const char*>(line + B * block_floats), _MM_HINT_T1);
        const __m256 wv = _mm256_load_ps(line + 8 * (v % 2));
        for (int r = 0; r < R; r++)
          acc[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * stride + k), wv, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) _mm256_storeu_ps(sums + r * 16 * B + 8 * v, acc[r][v]);
}

// Six rows of one block: lane_tile<6, 1>'s sums, kept in named registers.
inline void lane_tile6(const float* x, int64_t stride, const float* wb, const LaneLayout& l,
                       int64_t k0, int64_t k1, float* sums, bool ahead) {
  const float* rows[6] = {x, x + stride, x + 2 * stride, x + 3 * stride, x + 4 * stride,
                          x + 5 * stride};
  six_row_sums(rows, wb, k0, k1, sums, ahead ? wb + l.in * kLaneBlock : nullptr);
}
#else
// Without AVX2 and FMA: the same chains, one std::fma (correctly rounded, as the instruction) at
// a time.
template <int R, int B>
inline void lane_tile(const float* x, int64_t stride, const float* wb, const LaneLayout& l,
                      int64_t k0, int64_t k1, float* sums, bool /*ahead*/) {
  const int64_t block_floats = l.in * kLaneBlock;
  for (int r = 0; r < R; r++)
    for (int b = 0; b < B; b++)
      for (int64_t j = 0; j < kLaneBlock; j++) {
        float& s = sums[r * 16 * B + 16 * b + j];
        float acc = k0 == 0 ? 0.0f : s;
        const float* w = wb + b * block_floats + j;
        for (int64_t k = k0; k < k1; k++) acc = std::fma(x[r * stride + k], w[k * kLaneBlock], acc);
        s = acc;
      }
}

inline void lane_tile6(const float* x, int64_t stride, const float* wb, const LaneLayout& l,
                       int64_t k0, int64_t k1, float* sums, bool ahead) {
  lane_tile<6, 1>(x, stride, wb, l, k0, k1, sums, ahead);
}
#endif

// lane_tile<rows, blocks> for rows up to R and blocks up to B.
template <int R, int B>
inline void lane_tile_of(int64_t rows, int64_t blocks, const float* x, int64_t stride,
                         const float* wb, const LaneLayout& l, int64_t k0, int64_t k1, float* sums,
                         bool ahead) {
  if constexpr (B > 1) {
    if (blocks < B) return lane_tile_of<R, B - 1>(rows, blocks, x, stride, wb, l, k0, k1, sums, ahead);
  }
  if constexpr (R > 1) {
    if (rows < R) return lane_tile_of<R - 1, B>(rows, blocks, x, stride, wb, l, k0, k1, sums, ahead);
  }
  lane_tile<R, B>(x, stride, wb, l, k0, k1, sums, ahead);
}

// y[m0 + r, 16 * b0 + j] = sums[r][j] (+ bias), for `rows` rows and `width` sums a row.
inline void store_lanes(const float* sums, int64_t rows, int64_t width, const float* bias,
                        float* y, const LaneLayout& l, int64_t m0, int64_t b0) {
  const int64_t n0 = b0 * kLaneBlock, n = std::min(width, l.out - n0);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < n; j++) {
      const float total = sums[r * width + j];
      y[(m0 + r) * l.out + n0 + j] = bias ? total + bias[n0 + j] : total;
    }
}

// AVX-512, rows m0 .. m0 + chunk and the blocks [begin, end): B blocks at a time, tiles of up to
// R rows, the inputs `inputs` at a time where the chunk has several tiles.
template <int R, int B>
void zmm_blocks(const float* xc, int64_t chunk, const float* w, const float* bias, float* y,
                const LaneLayout& l, int64_t m0, int64_t begin, int64_t end, int64_t inputs) {
  std::vector<float> sums(chunk * B * kLaneBlock);  // [chunk][B blocks x 16]
  for (int64_t b = begin; b < end; b += B) {
    const int64_t blocks = std::min<int64_t>(B, end - b), width = blocks * kLaneBlock;
    const float* wb = l.block(w, b);
    const int64_t step = chunk <= R ? l.in : inputs;
    for (int64_t k0 = 0; k0 < l.in; k0 += step) {
      const int64_t k1 = std::min(l.in, k0 + step);
      for (int64_t m = 0; m < chunk; m += R)
        lane_tile_of<R, B>(std::min<int64_t>(R, chunk - m), blocks, xc + m * l.in, l.in, wb, l,
                           k0, k1, sums.data() + m * width, m == 0);
    }
    store_lanes(sums.data(), chunk, width, bias, y, l, m0, b);
  }
}

void lane_linear_rows(const float* x, const float* w, const float* bias, float* y, int64_t rows,
                      const LaneLayout& l) {
  for (int64_t m0 = 0; m0 < rows; m0 += kLaneRowChunk) {
    const int64_t m1 = std::min(rows, m0 + kLaneRowChunk), chunk = m1 - m0;
    const float* xc = x + m0 * l.in;
    // Each thread takes a run of blocks (parallel_for splits them evenly over the threads).
    at::parallel_for(0, l.blocks, 1, [&](int64_t begin, int64_t end) {
      if (chunk <= 3) {  // one tile of every row, several blocks at once
        const int64_t per_item = chunk == 1 ? 4 : 2;
        alignas(32) float sums[3 * 4 * kLaneBlock];
        for (int64_t b = begin; b < end; b += per_item) {
          const int64_t blocks = std::min(per_item, end - b);
          if (chunk == 1)
            lane_tile_of<1, 4>(1, blocks, xc, l.in, l.block(w, b), l, 0, l.in, sums, true);
          else
            lane_tile_of<3, 2>(chunk, blocks, xc, l.in, l.block(w, b), l, 0, l.in, sums, true);
          store_lanes(sums, chunk, blocks * kLaneBlock, bias, y, l, m0, b);
        }
        return;
      }
      if constexpr (kZmmLanes) {
        if (chunk <= kZmmFewRows)
          zmm_blocks<kZmmFewTileRows, kZmmFewBlocks>(xc, chunk, w, bias, y, l, m0, begin, end,
                                                     kZmmFewChunk);
        else
          zmm_blocks<kZmmRows, kZmmBlocks>(xc, chunk, w, bias, y, l, m0, begin, end, kZmmChunk);
        return;
      }
      // One block at a time, the inputs in chunks shared by its row tiles: from kWideLaneRows
      // rows on, tiles of 6 and the rest in smaller ones; below, tiles of nearly equal size
      // (9 rows: 5 + 4).
      const int64_t wide = chunk >= kWideLaneRows ? chunk / 6 : 0;
      const int64_t rest = chunk - 6 * wide;
      const int64_t tiles = wide + (rest + kLaneRows - 1) / kLaneRows;
      std::vector<float> sums(chunk * kLaneBlock);
      for (int64_t b = begin; b < end; b++) {
        const float* wb = l.block(w, b);
        const int64_t step = tiles == 1 ? l.in : kLaneChunk;
        for (int64_t k0 = 0; k0 < l.in; k0 += step) {
          const int64_t k1 = std::min(l.in, k0 + step);
          int64_t m = 0;
          for (; m < 6 * wide; m += 6)
            lane_tile6(xc + m * l.in, l.in, wb, l, k0, k1, sums.data() + m * kLaneBlock, m == 0);
          for (int64_t t = wide; t < tiles; t++) {
            const int64_t size = (chunk - m + (tiles - t) - 1) / (tiles - t);  // larger first
            lane_tile_of<kLaneRows, 1>(size, 1, xc + m * l.in, l.in, wb, l, k0, k1,
                                       sums.data() + m * kLaneBlock, m == 0);
            m += size;
          }
        }
        store_lanes(sums.data(), chunk, kLaneBlock, bias, y, l, m0, b);
      }
    });
  }
}

}  // namespace

torch::Tensor pack_lanes(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "weight must be a contiguous [out, in] float32 CPU matrix");
  const LaneLayout l(weight.size(1), weight.size(0));
  auto packed = torch::zeros({l.floats()}, weight.options());  // 1-D: the layout is ours
  const float* src = weight.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, l.blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b++)
      for (int64_t j = 0; j < kLaneBlock && b * kLaneBlock + j < l.out; j++)
        for (int64_t k = 0; k < l.in; k++)
          dst[(b * l.in + k) * kLaneBlock + j] = src[(b * kLaneBlock + j) * l.in + k];
  });
  return packed;
}

torch::Tensor linear_lanes(const torch::Tensor& x, const torch::Tensor& packed,
                           const c10::optional<torch::Tensor>& bias, int64_t out) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  x.scalar_type() == at::kFloat,
              "x must be a contiguous 2-D float32 CPU tensor");
  const LaneLayout l(x.size(1), out);
  TORCH_CHECK(packed.dim() == 1 && packed.is_contiguous() && packed.scalar_type() == at::kFloat &&
                  packed.numel() == l.floats(),
              "packed must come from pack_lanes of an [out, in] weight matching x");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr<float>()) % 32 == 0,
              "packed must be 32-byte aligned (pack_lanes' own tensor, or a copy of it)");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == out,
                "bias must be float32 with one entry per output feature");
  auto y = torch::empty({x.size(0), out}, x.options());
  lane_linear_rows(x.data_ptr<float>(), packed.data_ptr<float>(),
                   has_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), x.size(0), l);
  return y;
}
