// Row-invariant bfloat16 linears for the CPU: y = x @ w^T (+ bias) (see cpu_ops.py; float32 is in
// cpu_lanes.cpp).
//
// Each (row, feature) output is one sum whose order of operations depends on nothing but the
// input width, so a row's bits are the same whether the call holds 1 row or 1,000, and whichever
// tile or thread computes it. That is what batch invariance needs (see specdec/attention.py), and
// oneDNN's bf16 GEMM does not give it on every CPU: measured here with
// ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (a CPU with AVX512-BF16 but no AMX), a down projection's
// rows changed bits from 4 rows per call on.
//
// bfloat16 (`pack_pairs`, `linear_pairs`): the weight is packed once into blocks of 16 features
// whose inputs are interleaved in pairs (the layout Intel's VNNI instructions and AMX tiles read;
// see "weights packed in input pairs" below). With AMX, every row count runs on tiles (see
// "bfloat16 on AMX tiles"). Without it, one vdpbf16ps adds, for 16 features at once, the products
// of one input pair (broadcast) and each feature's weight pair: a feature's sum is a single chain
// over the input pairs in order, from zero, with no horizontal reduction at the end. Tiles of up
// to kPairRows rows by the kGroupBlocks blocks of a group keep 16 chains in registers; each
// weight vector loaded serves every row of the tile, and each broadcast input pair every block.
// Without AVX512-BF16, each pair is two float32 fused multiply-adds, even input first (the
// products of two bf16 values are exact in float32, so the scalar code computes the same); with
// AVX2 alone, 8 features to a vector (see the AVX2 pair_tile for its tile shapes; chunks of 12
// rows or more read each block's weights from a float32 panel widened once, see wide_tile). The
// two instructions do not round alike: measured here, vdpbf16ps adds the odd product and then the
// even one, each rounded, and AMX matches neither that nor five other orders tried, so a machine
// never mixes them. A bf16 output is rounded once, after the bias is added in float32.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <memory>
#include <type_traits>
#include <vector>

// AMX tiles for bf16 (the staging copies use AVX-512, which every AMX CPU has)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define SPECDEC_AMX 1
#else
#define SPECDEC_AMX 0
#endif

#include "cpu_simd.h"

namespace {

using namespace specdec_cpu;

// ---- bfloat16: weights packed in input pairs ----
//
// The packed weight, for groups of kGroupBlocks blocks of 16 features, and steps of 16 input
// pairs (32 inputs): [groups][steps][kGroupBlocks][16 pairs][16 features][2 inputs]. Features
// past `out` and pairs past the row are zeros. One step of one block is 1 KB, an AMX B tile; a
// group's weights are one contiguous stream, read front to back by whichever thread takes the
// group, which is what the hardware prefetcher follows best when a decode streams them from
// memory.

constexpr int64_t kPairBlock = 16;  // features per block: one register of float32 sums
constexpr int64_t kStepPairs = 16;  // input pairs per step
constexpr int kGroupBlocks = 2;     // blocks per group
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr int kPairRows = 5;  // rows per tile of one block: 5 x 2 sums + even, odd weights + 2 inputs
#else
constexpr int kPairRows = 8;  // rows per register tile: 8 x 2 sums + 2 weights + 1 input
#endif
constexpr int64_t kPairRowChunk = 256;
constexpr int64_t kStepWords = kGroupBlocks * kStepPairs * kPairBlock;  // 32-bit pairs per step

struct PairLayout {
  int64_t in, out, pairs, steps, groups;
  PairLayout(int64_t in_, int64_t out_)
      : in(in_), out(out_), pairs((in_ + 1) / 2), steps((pairs + kStepPairs - 1) / kStepPairs),
        groups((out_ + kGroupBlocks * kPairBlock - 1) / (kGroupBlocks * kPairBlock)) {}
  int64_t words() const { return groups * steps * kStepWords; }
  // index of the 32-bit pair (feature n, inputs 2p, 2p + 1)
  int64_t word(int64_t n, int64_t p) const {
    const int64_t block = n / kPairBlock, g = block / kGroupBlocks, c = block % kGroupBlocks;
    return (g * steps + p / kStepPairs) * kStepWords + (c * kStepPairs + p % kStepPairs) * kPairBlock +
           n % kPairBlock;
  }
};

// The two bf16 inputs 2 * p and 2 * p + 1 of a row as one 32-bit word (the odd one a zero past
// the end of an odd-width row), low half first, as the packed weight holds its pairs.
inline uint32_t input_pair(const BFloat16* row, int64_t p, int64_t in) {
  uint16_t lo, hi = 0;
  __builtin_memcpy(&lo, row + 2 * p, 2);
  if (2 * p + 1 < in) __builtin_memcpy(&hi, row + 2 * p + 1, 2);
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

inline float bf16_bits_to_float(uint32_t bits16) {
  const uint32_t bits = bits16 << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// y[m, n] for rows m of one group (or of `features` features from n0); `sum(r, j)` gives row r's
// float32 sum for feature n0 + j.
template <typename Sum>
inline void store_group(const Sum& sum, const BFloat16* bias, BFloat16* y, int64_t out,
                        int64_t m0, int rows, int64_t n0,
                        int64_t features = kGroupBlocks * kPairBlock) {
  const int64_t n = std::min<int64_t>(features, out - n0);
  for (int r = 0; r < rows; r++)
    for (int64_t j = 0; j < n; j++) {
      const float total = sum(r, j);
      y[(m0 + r) * out + n0 + j] = static_cast<BFloat16>(bias ? total + load(bias, n0 + j) : total);
    }
}

#if defined(__AVX512F__)
inline void pair_step(const __m512i xv, const __m512i* wv, __m512* acc) {
  for (int c = 0; c < kGroupBlocks; c++) {
#if defined(__AVX512BF16__)
    acc[c] = _mm512_dpbf16_ps(acc[c], (__m512bh)xv, (__m512bh)wv[c]);
#else
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m512 x_even = _mm512_castsi512_ps(_mm512_slli_epi32(xv, 16));
    const __m512 x_odd = _mm512_castsi512_ps(_mm512_and_si512(xv, high));
    acc[c] = _mm512_fmadd_ps(x_even, _mm512_castsi512_ps(_mm512_slli_epi32(wv[c], 16)), acc[c]);
    acc[c] = _mm512_fmadd_ps(x_odd, _mm512_castsi512_ps(_mm512_and_si512(wv[c], high)), acc[c]);
#endif
  }
}

// Rows m0 .. m0 + R - 1 against group g: each of the R x 64 sums one chain over the input pairs.
template <int R>
inline void pair_tile(const BFloat16* x, const uint32_t* w, const PairLayout& l,
                      const BFloat16* bias, BFloat16* y, int64_t m0, int64_t g) {
  __m512 acc[R * kGroupBlocks];
  for (int i = 0; i < R * kGroupBlocks; i++) acc[i] = _mm512_setzero_ps();
  const uint32_t* wg = w + g * l.steps * kStepWords;
  const int32_t* rows[R];  // each row as 32-bit input pairs
  for (int r = 0; r < R; r++) rows[r] = reinterpret_cast<const int32_t*>(x + (m0 + r) * l.in);
  const int64_t whole = l.in / 2;  // pairs with both inputs inside the row
  for (int64_t p = 0; p < l.pairs; p++) {
    const uint32_t* wp = wg + (p / kStepPairs) * kStepWords + (p % kStepPairs) * kPairBlock;
    __m512i wv[kGroupBlocks];
    for (int c = 0; c < kGroupBlocks; c++) {
      // the same line of the next group (the next in memory) into L2: a decode streams the
      // weights, and so prefetched they came 1.2x faster than with the hardware's prefetch alone
      const uint32_t* ahead = wp + c * kStepPairs * kPairBlock + l.steps * kStepWords;
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
      wv[c] = _mm512_loadu_si512(wp + c * kStepPairs * kPairBlock);
    }
    for (int r = 0; r < R; r++) {
      const int32_t pair = p < whole ? rows[r][p]
                                     : static_cast<int32_t>(input_pair(x + (m0 + r) * l.in, p, l.in));
      pair_step(_mm512_set1_epi32(pair), wv, acc + r * kGroupBlocks);
    }
  }
  alignas(64) float sums[R * kGroupBlocks * kPairBlock];
  for (int i = 0; i < R * kGroupBlocks; i++) _mm512_store_ps(sums + i * kPairBlock, acc[i]);
  store_group([&](int r, int64_t j) { return sums[r * kGroupBlocks * kPairBlock + j]; }, bias, y,
              l.out, m0, R, g * kGroupBlocks * kPairBlock);
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: the scalar code's chains (even product, then odd, each a fused multiply-add of an exact
// product: the same bits), 8 features to a vector. A tile is R rows by B consecutive blocks of 16
// features from block b0 (counted over all groups): 2B vectors of R sums. Each pair step adds two
// dependent products to a sum, so a tile needs many sums for the FMA units to stay busy: a
// decode's single row takes 4 blocks (8 chains: 12.9 GB/s a core, against 10.7 with the 4 of one
// group and 20 for a plain sum), up to 3 rows 2 blocks, more rows 1 block and up to
// 5 rows (10 sums, a block's even and odd weights widened to float32, two inputs: 16 ymm
// registers). The rows come widened to float32 beforehand (`xf`, `stride` floats apart, zeros
// past an odd width), so an input is one broadcast load.
template <int R, int B>
inline void pair_tile(const float* xf, int64_t stride, const uint32_t* w, const PairLayout& l,
                      const BFloat16* bias, BFloat16* y, int64_t m0, int64_t b0) {
  constexpr int V = 2 * B;  // vectors of 8 features
  __m256 acc[R][V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) acc[r][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t group_words = l.steps * kStepWords;
  const uint32_t* blocks[B];
  for (int b = 0; b < B; b++) {
    const int64_t block = b0 + b;
    blocks[b] = w + (block / kGroupBlocks) * group_words + (block % kGroupBlocks) * kStepPairs * kPairBlock;
  }
  for (int64_t p = 0; p < l.pairs; p++) {
    const int64_t at = (p / kStepPairs) * kStepWords + (p % kStepPairs) * kPairBlock;
    for (int v = 0; v < V; v++) {
      const uint32_t* wv_at = blocks[v / 2] + at + 8 * (v % 2);
      // the same line B blocks on (the next tile's, 1 or 2 groups on) into L2, as the AVX-512
      // tile prefetches the next group's
      if (v % 2 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(wv_at + (B + 1) / 2 * group_words), _MM_HINT_T1);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wv_at));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
      for (int r = 0; r < R; r++) {
        acc[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xf + r * stride + 2 * p), even, acc[r][v]);
        acc[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xf + r * stride + 2 * p + 1), odd, acc[r][v]);
      }
    }
  }
  alignas(32) float sums[R][8 * V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) _mm256_store_ps(sums[r] + 8 * v, acc[r][v]);
  store_group([&](int r, int64_t j) { return sums[r][j]; }, bias, y, l.out, m0, R, b0 * kPairBlock,
              8 * V);
}

// pair_tile<size, blocks>, for `size` up to R and `blocks` up to B.
template <int R, int B>
inline void pair_tile_of(int64_t size, int64_t blocks, const float* xf, int64_t stride,
                         const uint32_t* w, const PairLayout& l, const BFloat16* bias, BFloat16* y,
                         int64_t m0, int64_t b0) {
  if constexpr (B > 1) {
    if (blocks < B) return pair_tile_of<R, B - 1>(size, blocks, xf, stride, w, l, bias, y, m0, b0);
  }
  if constexpr (R > 1) {
    if (size < R) return pair_tile_of<R - 1, B>(size, blocks, xf, stride, w, l, bias, y, m0, b0);
  }
  pair_tile<R, B>(xf, stride, w, l, bias, y, m0, b0);
}

// Prompt chunks: a tile of 6 rows and one block computes pair_tile's sums (each a chain of fused
// multiply-adds over the inputs in order, the even input of a pair before the odd: the same bits)
// from a float32 panel of the block's weights, [2 * pairs][16 features], widened once per chunk
// for all its rows. pair_tile widens every weight vector again for each tile of 5 rows, and its
// 10 sums take two dependent products a step. Here 6 rows x 16 features are 12 chains of one
// product a step (with two weight vectors and an input, 15 ymm registers). On 2 AVX2 cores (AMD
// EPYC), 128-830 rows of the default model's shapes: 74-117 -> 124-181 GFLOP/s (1.5-1.7x; MKL's
// float32 GEMM 137-176), whole bf16 prompts of 128-1,000 tokens 1.38-1.41x. With fewer rows the
// spare rows of a partial tile cost more than the panel saves: 9 rows (a verification of 8
// drafts) ran 0.92x, 12-24 rows 1.32-1.35x.
constexpr int kWideRows = 6;
constexpr int64_t kWideMinRows = 12;  // chunks of fewer rows keep pair_tile (see pair_tile_of)

// The block of 16 features from `block` (counted over all groups) as float32 [2 * pairs][16].
inline void widen_block(const uint32_t* w, const PairLayout& l, int64_t block, float* panel) {
  const uint32_t* b = w + (block / kGroupBlocks) * l.steps * kStepWords +
                      (block % kGroupBlocks) * kStepPairs * kPairBlock;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < l.pairs; p++) {
    const uint32_t* at = b + (p / kStepPairs) * kStepWords + (p % kStepPairs) * kPairBlock;
    for (int v = 0; v < 2; v++) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 8 * v));
      _mm256_storeu_ps(panel + (2 * p) * kPairBlock + 8 * v,
                       _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)));
      _mm256_storeu_ps(panel + (2 * p + 1) * kPairBlock + 8 * v,
                       _mm256_castsi256_ps(_mm256_and_si256(wv, high)));
    }
  }
}

// Rows m0 .. m0 + rows - 1 (rows <= 6) against one block's panel. A tile of fewer rows computes
// its last row again in the spare places and keeps only its own.
inline void wide_tile(const float* xf, int64_t stride, int64_t rows, const float* panel,
                      const PairLayout& l, const BFloat16* bias, BFloat16* y, int64_t m0,
                      int64_t block) {
  const float* x[kWideRows];
  for (int r = 0; r < kWideRows; r++) x[r] = xf + std::min<int64_t>(r, rows - 1) * stride;
  alignas(32) float sums[kWideRows][kPairBlock];
  // past an odd width: a zero input, a zero weight
  six_row_sums(x, panel, 0, 2 * l.pairs, sums[0], nullptr);
  store_group([&](int r, int64_t j) { return sums[r][j]; }, bias, y, l.out, m0,
              static_cast<int>(rows), block * kPairBlock, kPairBlock);
}

void pair_linear_rows(const BFloat16* x, const uint32_t* w, const BFloat16* bias, BFloat16* y,
                      int64_t rows, const PairLayout& l) {
  const int64_t stride = 2 * l.pairs;
  const int64_t total_blocks = l.groups * kGroupBlocks;  // the packed weight's, padding included
  std::vector<float> xf;
  for (int64_t m0 = 0; m0 < rows; m0 += kPairRowChunk) {
    const int64_t m1 = std::min(rows, m0 + kPairRowChunk);
    xf.assign((m1 - m0) * stride, 0.0f);
    at::parallel_for(m0, m1, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; m++)
        for (int64_t k = 0; k < l.in; k++) xf[(m - m0) * stride + k] = load(x + m * l.in, k);
    });
    // Work items: B blocks each (see pair_tile), every row of the chunk.
    const int64_t chunk = m1 - m0;
    if (chunk >= kWideMinRows) {
      at::parallel_for(0, total_blocks, 1, [&](int64_t begin, int64_t end) {
        std::unique_ptr<float[]> panel(new float[2 * l.pairs * kPairBlock]);
        for (int64_t block = begin; block < end; block++) {
          if (block * kPairBlock >= l.out) continue;  // padding only
          widen_block(w, l, block, panel.get());
          for (int64_t m = m0; m < m1; m += kWideRows)
            wide_tile(xf.data() + (m - m0) * stride, stride, std::min<int64_t>(kWideRows, m1 - m),
                      panel.get(), l, bias, y, m, block);
        }
      });
      continue;
    }
    const int64_t per_item = chunk == 1 ? 4 : (chunk <= 3 ? 2 : 1);
    const int64_t items = (total_blocks + per_item - 1) / per_item;
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; item++) {
        const int64_t b0 = item * per_item;
        if (b0 * kPairBlock >= l.out) continue;  // padding blocks only
        const int64_t blocks = std::min(per_item, total_blocks - b0);
        if (chunk == 1) {
          pair_tile_of<1, 4>(1, blocks, xf.data(), stride, w, l, bias, y, m0, b0);
          continue;
        }
        if (chunk <= 3) {
          pair_tile_of<3, 2>(chunk, blocks, xf.data(), stride, w, l, bias, y, m0, b0);
          continue;
        }
        const int64_t tiles = (chunk + kPairRows - 1) / kPairRows;
        for (int64_t t = 0, m = m0; t < tiles; t++) {
          const int64_t size = (m1 - m + (tiles - t) - 1) / (tiles - t);  // even split
          pair_tile_of<kPairRows, 1>(size, 1, xf.data() + (m - m0) * stride, stride, w, l, bias, y,
                                     m, b0);
          m += size;
        }
      }
    });
  }
}
#else
template <int R>
inline void pair_tile(const BFloat16* x, const uint32_t* w, const PairLayout& l,
                      const BFloat16* bias, BFloat16* y, int64_t m0, int64_t g) {
  constexpr int64_t kWidth = kGroupBlocks * kPairBlock;
  for (int r = 0; r < R; r++) {
    const BFloat16* row = x + (m0 + r) * l.in;
    float acc[kWidth] = {0};
    for (int64_t p = 0; p < l.pairs; p++) {
      const uint32_t pair = input_pair(row, p, l.in);
      const float x_even = bf16_bits_to_float(pair & 0xFFFF), x_odd = bf16_bits_to_float(pair >> 16);
      for (int64_t j = 0; j < kWidth; j++) {
        const uint32_t wp = w[l.word(g * kWidth + j, p)];
        acc[j] += x_even * bf16_bits_to_float(wp & 0xFFFF);
        acc[j] += x_odd * bf16_bits_to_float(wp >> 16);
      }
    }
    store_group([&](int, int64_t j) { return acc[j]; }, bias, y, l.out, m0 + r, 1, g * kWidth);
  }
}
#endif

#if defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
void pair_linear_rows(const BFloat16* x, const uint32_t* w, const BFloat16* bias, BFloat16* y,
                      int64_t rows, const PairLayout& l) {
  for (int64_t m0 = 0; m0 < rows; m0 += kPairRowChunk) {
    const int64_t m1 = std::min(rows, m0 + kPairRowChunk);
    at::parallel_for(0, l.groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; g++) {
        const int64_t tiles = (m1 - m0 + kPairRows - 1) / kPairRows;
        for (int64_t t = 0, m = m0; t < tiles; t++) {
          const int64_t size = (m1 - m + (tiles - t) - 1) / (tiles - t);  // even split
          switch (size) {
            case 8: pair_tile<8>(x, w, l, bias, y, m, g); break;
            case 7: pair_tile<7>(x, w, l, bias, y, m, g); break;
            case 6: pair_tile<6>(x, w, l, bias, y, m, g); break;
            case 5: pair_tile<5>(x, w, l, bias, y, m, g); break;
            case 4: pair_tile<4>(x, w, l, bias, y, m, g); break;
            case 3: pair_tile<3>(x, w, l, bias, y, m, g); break;
            case 2: pair_tile<2>(x, w, l, bias, y, m, g); break;
            default: pair_tile<1>(x, w, l, bias, y, m, g); break;
          }
          m += size;
        }
      }
    });
  }
}
#endif

#if SPECDEC_AMX
// ---- bfloat16 on AMX tiles ----
//
// On CPUs with AMX, every bf16 row goes through the tile unit instead (a machine takes one path
// for every row count, so rows stay invariant). TDPBF16PS adds to a tile of float32 sums C[m][n]
// the products of the 32 inputs of one step of row m (tile A) with the same 32 inputs of feature
// n (tile B: one step of one block of the packed weight). A sum depends on its own row and
// feature only, never on the other rows of the tile, so tiles of any row count give a row the
// same bits; rows whose width is not a whole number of steps are copied with zeros after them.

// Tiles 0-1: `rows` x 16 float32 sums; 4: `rows` x 32 bf16 inputs; 5-6: 16 pairs x 16 features.
inline void configure_tiles(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; t++) {
    cfg.rows[t] = static_cast<uint8_t>(t < 5 ? rows : 16);
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Rows of x (`stride` bf16 apart, whole steps wide) against group g, into sums[2][rows][16].
inline void amx_group(const BFloat16* x, int64_t stride, const uint32_t* w, const PairLayout& l,
                      int64_t g, float* sums, bool stage) {
  static_assert(kGroupBlocks == 2, "one C tile per block of the group: tiles 0 and 1");
  _tile_zero(0);
  _tile_zero(1);
  constexpr int64_t kTileWords = kStepPairs * kPairBlock;
  constexpr int64_t kLineWords = 16;
  const uint32_t* wg = w + g * l.steps * kStepWords;
  // A chunk of at most 16 rows (a decode, a small verification) reads each weight once, from
  // memory: it is copied a step at a time with vector loads, each line's twin in the next group
  // prefetched into L2 beside it, and the tiles load from that copy. Tile loads straight from
  // memory streamed a decode's weights at about 28 GB/s here, the vector copy at about 36; tiles
  // of more rows reuse each B tile and load it directly.
  alignas(64) uint32_t staged[kStepWords];
  for (int64_t s = 0; s < l.steps; s++) {
    const uint32_t* ws = wg + s * kStepWords;
    if (stage) {
      for (int64_t i = 0; i < kStepWords; i += kLineWords) {
        _mm_prefetch(reinterpret_cast<const char*>(ws + i + l.steps * kStepWords), _MM_HINT_T1);
        _mm512_store_si512(staged + i, _mm512_loadu_si512(ws + i));
      }
      ws = staged;
    }
    _tile_loadd(4, x + s * 2 * kStepPairs, stride * 2);
    _tile_loadd(5, ws, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, ws + kTileWords, 64);
    _tile_dpbf16ps(1, 4, 6);
  }
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + 256, 64);
}

void amx_linear_rows(const BFloat16* x, const uint32_t* w, const BFloat16* bias, BFloat16* y,
                     int64_t rows, const PairLayout& l) {
  const int64_t width = l.steps * 2 * kStepPairs;  // inputs per row, padded to whole steps
  for (int64_t m0 = 0; m0 < rows; m0 += kPairRowChunk) {
    const int64_t m1 = std::min(rows, m0 + kPairRowChunk);
    std::vector<BFloat16> padded;  // the chunk's rows with zeros to whole steps, if needed
    const BFloat16* xs = x + m0 * l.in;
    if (width != l.in) {
      padded.assign((m1 - m0) * width, BFloat16(0.0f));
      for (int64_t m = m0; m < m1; m++)
        std::copy(x + m * l.in, x + (m + 1) * l.in, padded.begin() + (m - m0) * width);
      xs = padded.data();
    }
    at::parallel_for(0, l.groups, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float sums[kGroupBlocks * 16 * kPairBlock];
      int configured = 0;
      for (int64_t g = begin; g < end; g++)
        for (int64_t m = m0; m < m1; m += 16) {
          const int r = static_cast<int>(std::min<int64_t>(16, m1 - m));
          if (r != configured) {
            configure_tiles(r);
            configured = r;
          }
          amx_group(xs + (m - m0) * width, width, w, l, g, sums, m1 - m0 <= 16);
          store_group(
              [&](int i, int64_t j) { return sums[(j / kPairBlock) * 256 + i * 16 + j % kPairBlock]; },
              bias, y, l.out, m, r, g * kGroupBlocks * kPairBlock);
        }
      if (configured) _tile_release();
    });
  }
}
#endif

}  // namespace

torch::Tensor pack_pairs(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16,
              "weight must be a contiguous [out, in] bfloat16 CPU matrix");
  const PairLayout l(weight.size(1), weight.size(0));
  auto packed = torch::zeros({l.words() * 2}, weight.options());  // 1-D: the layout is ours
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<BFloat16>());
  uint16_t* p = reinterpret_cast<uint16_t*>(packed.data_ptr<BFloat16>());
  at::parallel_for(0, l.out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++)
      for (int64_t k = 0; k < l.in; k++) p[l.word(n, k / 2) * 2 + k % 2] = w[n * l.in + k];
  });
  return packed;
}

torch::Tensor linear_pairs(const torch::Tensor& x, const torch::Tensor& packed,
                           const c10::optional<torch::Tensor>& bias, int64_t out) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  x.scalar_type() == at::kBFloat16,
              "x must be a contiguous 2-D bfloat16 CPU tensor");
  const PairLayout l(x.size(1), out);
  TORCH_CHECK(packed.dim() == 1 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && packed.numel() == l.words() * 2,
              "packed must come from pack_pairs of an [out, in] weight matching x");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kBFloat16 &&
                    bias->numel() == out,
                "bias must be bfloat16 with one entry per output feature");
  auto y = torch::empty({x.size(0), out}, x.options());
  const BFloat16* xp = x.data_ptr<BFloat16>();
  const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<BFloat16>());
  const BFloat16* b = has_bias ? bias->data_ptr<BFloat16>() : nullptr;
#if SPECDEC_AMX
  if (amx_usable()) {
    amx_linear_rows(xp, w, b, y.data_ptr<BFloat16>(), x.size(0), l);
    return y;
  }
#endif
  pair_linear_rows(xp, w, b, y.data_ptr<BFloat16>(), x.size(0), l);
  return y;
}
