// Quantized linears for the CPU: y = x @ dequant(w)^T (+ bias), row-invariant (see cpu_quant.py
// for the layouts and the torch reference). Two kinds of tile share one driver: float
// activations (quantization "int4"/"int8", weight-only) and int8 activations ("w4a8"/"w8a8",
// further down).
//
// Weights come in groups of 32 inputs. int4 (asymmetric, as GGUF's Q4_1): w = d * q + m with a
// code q in 0..15 and a float16 scale d and minimum m per group. int8 (symmetric, as GGUF's
// Q8_0): w = d * q with q in -128..127 and a float16 scale per group. With float activations a
// bfloat16 x is widened to float32 exactly, and every product is a float32 fused multiply-add.
//
// A group's contribution to an output is computed as
//     d * sum_i q_i x_i  (+ m * sum_i x_i for int4)
// which reads each code once and multiplies by the scale once per group, not once per weight.
// The inner sum runs in two chains (even inputs and odd inputs, each in input order, from zero),
// added as c0 + c1; the group terms are added to the output's total group by group, in order.
// A group's chains start from zero, so consecutive groups overlap in the out-of-order core.
// Lanes of a vector are 16 output features, so there is no horizontal reduction. Nothing in that
// order depends on the row count, the tile or the thread, so a row's bits are the same in a
// one-row decode as in a 1,000-row prompt: what batch invariance needs (see specdec/attention.py).
// The AVX2 code (no AVX-512) and the scalar code (neither) compute each lane with the same
// operations in the same order, so they give the same bits.
//
// Work is split over threads by blocks of 16 features; within a block, tiles of up to 8 rows
// share each code vector loaded (with int8 activations on a CPU with AMX, tiles of 16 rows run on
// the tile unit first, with the same bits: see "int8 activations on AMX tiles"; with float
// activations on AVX2, chunks of 12 rows or more run wide tiles from widened codes, see
// quant_wide_group). Long inputs run in chunks of kQuantRowChunk rows.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "cpu_simd.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace specdec_cpu;

constexpr int64_t kGroup = 32;     // inputs per quantization group
constexpr int64_t kFeatures = 16;  // output features per block: one vector of float32 sums
constexpr int kQuantRows = 8;      // rows per tile: 8 rows x (2 chains + 1 total) = 24 zmm
constexpr int64_t kQuantRowChunk = 128;
constexpr int kA8Rows = 8;  // rows per int8-activation tile: measured against 4 and 6, best
// How far ahead (in groups) the int8-activation tile prefetches codes: 4 KiB of int4 codes.
// Measured side by side on matrices too large for the caches: 0, 4, 8, 16, 32 and 64; 16 best.
constexpr int64_t kPrefetchGroups = 16;
constexpr int kWideRows = 3;          // rows per wide tile, where the CPU has them (AVX2)
constexpr int64_t kWideMinRows = 12;  // chunks of fewer rows take the usual tiles
constexpr int64_t kWideGroups = 4;    // groups widened at a time (8 KB), each tile runs them all

struct QuantLayout {
  int64_t in, out, bits, blocks, groups;
  // bytes of codes per block and group: 16 features x 32 inputs at `bits` each
  int64_t group_bytes() const { return kFeatures * kGroup * bits / 8; }
};

#if defined(__AVX512F__)

constexpr bool kWideTiles = false;  // the AVX-512 tile holds 8 rows by 16 features already
// Tiles of up to this many rows prefetch their codes kPrefetchGroups ahead: a decode step's
// int4 linears and int8 head are bound by reading them. Side by side, an int4 decode step of the
// default model took 1.25x less time (5 runs of 1,200 tokens each way, AVX-512), 1.1x built
// for AVX2 (3 runs each way, on the same Intel CPU).
constexpr int kFloatPrefetchRows = 2;

template <int R, int BITS>
inline void quant_tile(const float* x, const float* xsum, const uint8_t* codes,
                       const c10::Half* scales, const c10::Half* mins, const QuantLayout& l,
                       int64_t block, float* totals /* [R][16] */) {
  __m512 total[R];
  for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
  const uint8_t* c = codes + block * l.groups * l.group_bytes();
  for (int64_t g = 0; g < l.groups; g++, c += l.group_bytes()) {
    __m512 chain[R][2];
    for (int r = 0; r < R; r++) chain[r][0] = chain[r][1] = _mm512_setzero_ps();
    const float* xg = x + g * kGroup;
    if (R <= kFloatPrefetchRows)  // few rows: bound by reading the codes (see kFloatPrefetchRows)
      for (int64_t line = 0; line < l.group_bytes(); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchGroups * l.group_bytes() + line), _MM_HINT_T0);
    if (BITS == 4) {
      // codes 0..15 as floats by table lookup: vpermps reads only an index's low 4 bits
      const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma GCC unroll 16
      for (int64_t p = 0; p < kGroup / 2; p++) {  // inputs 2p (low nibble) and 2p + 1 (high)
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + p * kFeatures)));
        const __m512 lo = _mm512_permutexvar_ps(v, table);
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        for (int r = 0; r < R; r++) {
          const float* xr = xg + r * l.in;
          chain[r][0] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xr[2 * p]), chain[r][0]);
          chain[r][1] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xr[2 * p + 1]), chain[r][1]);
        }
      }
    } else {
#pragma GCC unroll 32
      for (int64_t i = 0; i < kGroup; i++) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i * kFeatures))));
        for (int r = 0; r < R; r++)
          chain[r][i % 2] = _mm512_fmadd_ps(w, _mm512_set1_ps(xg[r * l.in + i]), chain[r][i % 2]);
      }
    }
    const int64_t s = (block * l.groups + g) * kFeatures;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + s)));
    const __m512 m = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                       reinterpret_cast<const __m256i*>(mins + s)))
                                 : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
      const __m512 sum = _mm512_add_ps(chain[r][0], chain[r][1]);
      total[r] = _mm512_fmadd_ps(sum, d, total[r]);
      if (BITS == 4)
        total[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * l.groups + g]), total[r]);
    }
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(totals + r * kFeatures, total[r]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr int kFloatPrefetchRows = 2;  // as on AVX-512

// AVX2: the AVX-512 tile's operations, 8 features to a vector. `NH` halves of the block's 16
// features (both for a few rows, one for more, so that a tile's sums fit in 16 registers), and
// each lane computes what the AVX-512 lane computes, in the same order: the same bits.
template <int R, int BITS, int NH>
inline void quant_half_tile(const float* x, const float* xsum, const uint8_t* codes,
                            const c10::Half* scales, const c10::Half* mins, const QuantLayout& l,
                            int64_t block, int h0, float* totals /* [R][16] */) {
  __m256 total[R][NH];
  for (int r = 0; r < R; r++)
    for (int h = 0; h < NH; h++) total[r][h] = _mm256_setzero_ps();
  const uint8_t* c = codes + block * l.groups * l.group_bytes() + h0 * 8;
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  for (int64_t g = 0; g < l.groups; g++, c += l.group_bytes()) {
    if (R <= kFloatPrefetchRows)  // few rows: bound by reading the codes
      for (int64_t line = 0; line < l.group_bytes(); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchGroups * l.group_bytes() + line), _MM_HINT_T0);
    __m256 chain[R][NH][2];
    for (int r = 0; r < R; r++)
      for (int h = 0; h < NH; h++) chain[r][h][0] = chain[r][h][1] = _mm256_setzero_ps();
    const float* xg = x + g * kGroup;
    if (BITS == 4) {
#pragma GCC unroll 16
      for (int64_t p = 0; p < kGroup / 2; p++) {  // inputs 2p (low nibble) and 2p + 1 (high)
        for (int h = 0; h < NH; h++) {
          const __m256i v = _mm256_cvtepu8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + p * kFeatures + h * 8)));
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, nibble));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
          for (int r = 0; r < R; r++) {
            const float* xr = xg + r * l.in;
            chain[r][h][0] = _mm256_fmadd_ps(lo, _mm256_set1_ps(xr[2 * p]), chain[r][h][0]);
            chain[r][h][1] = _mm256_fmadd_ps(hi, _mm256_set1_ps(xr[2 * p + 1]), chain[r][h][1]);
          }
        }
      }
    } else {
#pragma GCC unroll 32
      for (int64_t i = 0; i < kGroup; i++) {
        for (int h = 0; h < NH; h++) {
          const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i * kFeatures + h * 8))));
          for (int r = 0; r < R; r++)
            chain[r][h][i % 2] =
                _mm256_fmadd_ps(w, _mm256_set1_ps(xg[r * l.in + i]), chain[r][h][i % 2]);
        }
      }
    }
    for (int h = 0; h < NH; h++) {
      const int64_t s = (block * l.groups + g) * kFeatures + (h0 + h) * 8;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + s)));
      const __m256 m = BITS == 4 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                       reinterpret_cast<const __m128i*>(mins + s)))
                                 : _mm256_setzero_ps();
      for (int r = 0; r < R; r++) {
        const __m256 sum = _mm256_add_ps(chain[r][h][0], chain[r][h][1]);
        total[r][h] = _mm256_fmadd_ps(sum, d, total[r][h]);
        if (BITS == 4)
          total[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r * l.groups + g]), total[r][h]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < NH; h++) _mm256_storeu_ps(totals + r * kFeatures + (h0 + h) * 8, total[r][h]);
}

// Rows in tiles of 4 (1 to 3 at the end); 1 or 2 rows take both halves in one pass.
template <int R, int BITS>
inline void quant_rows_avx2(const float* x, const float* xsum, const uint8_t* codes,
                            const c10::Half* scales, const c10::Half* mins, const QuantLayout& l,
                            int64_t block, float* totals) {
  if constexpr (R <= 2) {
    quant_half_tile<R, BITS, 2>(x, xsum, codes, scales, mins, l, block, 0, totals);
  } else {
    constexpr int T = R < 4 ? R : 4;
    for (int h = 0; h < 2; h++)
      quant_half_tile<T, BITS, 1>(x, xsum, codes, scales, mins, l, block, h, totals);
    if constexpr (R > 4)
      quant_rows_avx2<R - 4, BITS>(x + 4 * l.in, xsum + 4 * l.groups, codes, scales, mins, l,
                                   block, totals + 4 * kFeatures);
  }
}

template <int R, int BITS>
inline void quant_tile(const float* x, const float* xsum, const uint8_t* codes,
                       const c10::Half* scales, const c10::Half* mins, const QuantLayout& l,
                       int64_t block, float* totals /* [R][16] */) {
  quant_rows_avx2<R, BITS>(x, xsum, codes, scales, mins, l, block, totals);
}

// Prompt chunks (kWideMinRows rows or more) go a few groups at a time: a block's codes for
// kWideGroups groups are widened to float32 once, a panel [4 x 32 inputs][16 features] (8 KB)
// that stays in L1, and every tile of 3 rows of the chunk reads it group by group, 12 chains (even and odd inputs of 3 rows and 2 halves) in named
// registers, with two weight vectors and an input: 15 ymm. The rows' totals wait in a buffer
// between groups. Each lane's operations are quant_half_tile's, in its order (the chains from
// zero over the group, their sum times the scale, the minimum times the row's group sum): the
// same bits. quant_half_tile's 4-row tiles widen every code vector again per tile, 5 vector
// operations on the FMA pipes per 8 multiply-adds. On 2 AVX2 cores (AMD EPYC, Zen 3), 64-512
// rows of the default model's shapes, against those tiles: int8 1.2-1.5x (about 105 -> 145
// GFLOP/s), int4 1.04-1.13x (about 125 -> 135; at 12 rows 0.96-0.97x, within the noise); whole
// prompts of 512 and 1,000 tokens int8 1.23-1.25x, int4 1.04-1.15x. Two things mattered: GCC
// folded the weight loads into the multiply-adds, so each was loaded once per row, not once per
// step (the asm statement below keeps them in registers: 2x), and a panel of the whole block
// (36-96 KB) read by each tile in turn streamed from L2 (0.65-0.9x).
constexpr bool kWideTiles = true;

// Group g of `block` as float32 codes, panel[i][16] for input i of the group.
template <int BITS>
inline void widen_group(const uint8_t* codes, const QuantLayout& l, int64_t block, int64_t g,
                        float* panel) {
  const uint8_t* c = codes + (block * l.groups + g) * l.group_bytes();
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  for (int h = 0; h < 2; h++) {
    if (BITS == 4) {
      for (int64_t p = 0; p < kGroup / 2; p++) {
        const __m256i v = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + p * kFeatures + h * 8)));
        _mm256_storeu_ps(panel + 2 * p * kFeatures + h * 8,
                         _mm256_cvtepi32_ps(_mm256_and_si256(v, nibble)));
        _mm256_storeu_ps(panel + (2 * p + 1) * kFeatures + h * 8,
                         _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)));
      }
    } else {
      for (int64_t i = 0; i < kGroup; i++)
        _mm256_storeu_ps(panel + i * kFeatures + h * 8,
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                             reinterpret_cast<const __m128i*>(c + i * kFeatures + h * 8)))));
    }
  }
}

// One group for rows x[0..2] (each at the group's first input; xsum[r]: the row's group sum):
// totals[r][0..15] += (even chain + odd chain) * d (+ m * xsum[r] for int4). The chains are
// named variables: held in arrays, GCC stored them to the stack at every step (see six_row_sums in
// cpu_simd.h).
template <int BITS>
inline void quant_wide_group(const float* const* x, const float* xsum, const float* panel,
                             const c10::Half* d16, const c10::Half* m16, float* const* totals) {
  const float *x0 = x[0], *x1 = x[1], *x2 = x[2];
  __m256 e0l = _mm256_setzero_ps(), e0h = e0l, o0l = e0l, o0h = e0l, e1l = e0l, e1h = e0l;
  __m256 o1l = e0l, o1h = e0l, e2l = e0l, e2h = e0l, o2l = e0l, o2h = e0l;
#pragma GCC unroll 16
  for (int64_t i = 0; i < kGroup; i += 2) {
    __m256 w0 = _mm256_loadu_ps(panel + i * kFeatures), w1 = _mm256_loadu_ps(panel + i * kFeatures + 8);
    asm("" : "+x"(w0), "+x"(w1));  // loaded once into registers, not once per row
    __m256 xv = _mm256_broadcast_ss(x0 + i);
    e0l = _mm256_fmadd_ps(w0, xv, e0l), e0h = _mm256_fmadd_ps(w1, xv, e0h);
    xv = _mm256_broadcast_ss(x1 + i);
    e1l = _mm256_fmadd_ps(w0, xv, e1l), e1h = _mm256_fmadd_ps(w1, xv, e1h);
    xv = _mm256_broadcast_ss(x2 + i);
    e2l = _mm256_fmadd_ps(w0, xv, e2l), e2h = _mm256_fmadd_ps(w1, xv, e2h);
    w0 = _mm256_loadu_ps(panel + (i + 1) * kFeatures), w1 = _mm256_loadu_ps(panel + (i + 1) * kFeatures + 8);
    asm("" : "+x"(w0), "+x"(w1));
    xv = _mm256_broadcast_ss(x0 + i + 1);
    o0l = _mm256_fmadd_ps(w0, xv, o0l), o0h = _mm256_fmadd_ps(w1, xv, o0h);
    xv = _mm256_broadcast_ss(x1 + i + 1);
    o1l = _mm256_fmadd_ps(w0, xv, o1l), o1h = _mm256_fmadd_ps(w1, xv, o1h);
    xv = _mm256_broadcast_ss(x2 + i + 1);
    o2l = _mm256_fmadd_ps(w0, xv, o2l), o2h = _mm256_fmadd_ps(w1, xv, o2h);
  }
  const __m256 sums[kWideRows][2] = {{_mm256_add_ps(e0l, o0l), _mm256_add_ps(e0h, o0h)},
                                     {_mm256_add_ps(e1l, o1l), _mm256_add_ps(e1h, o1h)},
                                     {_mm256_add_ps(e2l, o2l), _mm256_add_ps(e2h, o2h)}};
  for (int h = 0; h < 2; h++) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d16 + 8 * h)));
    const __m256 m = BITS == 4 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                     reinterpret_cast<const __m128i*>(m16 + 8 * h)))
                               : _mm256_setzero_ps();
    for (int r = 0; r < kWideRows; r++) {
      float* t = totals[r] + 8 * h;
      __m256 total = _mm256_fmadd_ps(sums[r][h], d, _mm256_loadu_ps(t));
      if (BITS == 4) total = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r]), total);
      _mm256_storeu_ps(t, total);
    }
  }
}

#else

constexpr bool kWideTiles = false;

// The same operations lane by lane: std::fma rounds once, as the vector instruction does.
template <int R, int BITS>
inline void quant_tile(const float* x, const float* xsum, const uint8_t* codes,
                       const c10::Half* scales, const c10::Half* mins, const QuantLayout& l,
                       int64_t block, float* totals /* [R][16] */) {
  for (int r = 0; r < R; r++)
    for (int j = 0; j < kFeatures; j++) totals[r * kFeatures + j] = 0.0f;
  const uint8_t* c = codes + block * l.groups * l.group_bytes();
  for (int64_t g = 0; g < l.groups; g++, c += l.group_bytes()) {
    float chain[R][2][kFeatures] = {};
    const float* xg = x + g * kGroup;
    for (int64_t i = 0; i < kGroup; i++) {
      for (int j = 0; j < kFeatures; j++) {
        float w;
        if (BITS == 4) {
          const uint8_t byte = c[(i / 2) * kFeatures + j];
          w = static_cast<float>(i % 2 ? byte >> 4 : byte & 0xF);
        } else {
          w = static_cast<float>(static_cast<int8_t>(c[i * kFeatures + j]));
        }
        for (int r = 0; r < R; r++)
          chain[r][i % 2][j] = std::fma(w, xg[r * l.in + i], chain[r][i % 2][j]);
      }
    }
    const int64_t s = (block * l.groups + g) * kFeatures;
    for (int r = 0; r < R; r++)
      for (int j = 0; j < kFeatures; j++) {
        float* t = totals + r * kFeatures + j;
        const float sum = chain[r][0][j] + chain[r][1][j];
        *t = std::fma(sum, static_cast<float>(scales[s + j]), *t);
        if (BITS == 4)
          *t = std::fma(static_cast<float>(mins[s + j]), xsum[r * l.groups + g], *t);
      }
  }
}

#endif

// Each row's group sums of x, in a fixed order: lanes j and j + 16 first, then sum_lanes' tree.
void group_sums(const float* x, float* xsum, int64_t rows, int64_t in) {
  const int64_t groups = in / kGroup;
  at::parallel_for(0, rows * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
      const float* xg = x + (i / groups) * in + (i % groups) * kGroup;
      float lanes[kLanes];
      for (int j = 0; j < kLanes; j++) lanes[j] = xg[j] + xg[j + kLanes];
      xsum[i] = sum_lanes(lanes);
    }
  });
}

// --- int8 activations (quantization "w4a8" / "w8a8") -------------------------------------------
//
// Each row's inputs are quantized group by group, as llama.cpp quantizes activations for its
// integer dot products (Q8_0): dx = max |x| / 127 over the group's 32 inputs, qx = round(x / dx)
// (x times the float32 reciprocal, rounded half to even) in -127..127; a group whose dx is below
// the smallest normal float is all zeros. The integer sums are exact, so only the float steps
// below fix a row's bits, and they depend on nothing but the row:
//     int4:  S = sum q qx (0..15 x -127..127)     y += dx * (dw * S + mw * sum qx)
//     int8:  S = sum q qx (-128..127 x -127..127)  y += dx * (dw * S)
// computed as t = float(S) * dw, t = fma(mw, float(sum qx), t), y = fma(t, dx, y), group by group.
// With AVX-512 VNNI, vpdpbusd multiplies 64 unsigned by 64 signed bytes and adds each 4 products
// into an int32 lane: 64 multiply-adds per instruction against 16 for a float FMA. Lane j is
// output feature j, so the layout (see cpu_quant.py) gives lane j four consecutive inputs of its
// feature and the row's matching four activation bytes are broadcast to every lane. The unsigned
// operand must be the int4 codes, or, for int8 weights, the activations offset by 128 (qx ^ 0x80);
// the offset's 128 * sum q per group and feature is stored beside the scales and taken back off.

struct Int8Rows {
  std::vector<uint8_t> q;  // [rows][in] qx as int8, or qx + 128 as uint8 (int8 weights)
  std::vector<float> d;    // [rows][groups] dx
  std::vector<float> s;    // [rows][groups] float(sum qx)
};

// One group of 32 inputs as int8 codes (offset by 128 for int8 weights); its dx and float(sum qx).
// A bfloat16 input is widened to float32 as it is read (exactly), not copied to a float tensor
// first: that copy, a torch op of its own, cost each few-row call about 1.3 us.
template <typename T>
inline void quantize_group(const T* x, bool offset, uint8_t* q, float* d_out, float* s_out) {
#if defined(__AVX512F__)
  const __m512 a = load16(x), b = load16(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
#else
  float amax = 0.0f;
  for (int64_t k = 0; k < kGroup; k++) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
#endif
  float d = amax / 127.0f;
  if (!(d >= std::numeric_limits<float>::min())) d = 0.0f;  // also catches NaN
  const float inverse = d == 0.0f ? 0.0f : 1.0f / d;
#if defined(__AVX512F__)
  // cvtps rounds by MXCSR (half to even, as nearbyint); the clamp is the scalar code's
  const __m512 inv = _mm512_set1_ps(inverse);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i qa = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), lo), hi);
  const __m512i qb = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)), lo), hi);
  const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  __m128i ba = _mm512_cvtepi32_epi8(qa), bb = _mm512_cvtepi32_epi8(qb);
  if (offset) {
    ba = _mm_xor_si128(ba, _mm_set1_epi8(static_cast<char>(0x80)));
    bb = _mm_xor_si128(bb, _mm_set1_epi8(static_cast<char>(0x80)));
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), ba);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), bb);
#else
  int32_t sum = 0;
  for (int64_t k = 0; k < kGroup; k++) {
    const float v = std::nearbyint(static_cast<float>(x[k]) * inverse);  // half to even
    const int32_t c = v >= 127.0f ? 127 : (v <= -127.0f ? -127 : static_cast<int32_t>(v));
    sum += c;
    q[k] = static_cast<uint8_t>(offset ? c + 128 : c);
  }
#endif
  *d_out = d;
  *s_out = static_cast<float>(sum);
}

template <typename T>
Int8Rows quantize_rows(const T* x, int64_t rows, int64_t in, bool offset) {
  const int64_t groups = in / kGroup;
  Int8Rows a{std::vector<uint8_t>(rows * in), std::vector<float>(rows * groups),
             std::vector<float>(rows * groups)};
  at::parallel_for(0, rows * groups, 256, [&](int64_t begin, int64_t end) {
    // rows are contiguous, so group i of all rows' groups starts at input 32 i
    for (int64_t i = begin; i < end; i++)
      quantize_group(x + i * kGroup, offset, a.q.data() + i * kGroup, &a.d[i], &a.s[i]);
  });
  return a;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)

inline __m512i broadcast4(const uint8_t* p) {  // 4 bytes into every int32 lane
  int32_t v;
  __builtin_memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// The float steps of one group for 16 features: what turns a row's int32 sums S (offset by
// 128 * sum q for int8 weights) into its share of the outputs. Every tile that computes S, on
// whatever unit, ends with this, so a row's bits never depend on the unit.
template <int BITS>
struct GroupScales {
  __m512 d, mn = _mm512_setzero_ps();
  __m512i offset = _mm512_setzero_si512();
  GroupScales(const c10::Half* scales, const void* extra, const QuantLayout& l, int64_t block,
              int64_t g) {
    const int64_t s = (block * l.groups + g) * kFeatures;
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + s)));
    if (BITS == 4)
      mn = _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(extra) + block * l.groups + g));
    else
      offset = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256(
                   static_cast<const __m256i*>(extra) + block * l.groups + g)), 7);
  }
  // total + dx * (float(S) * dw (+ mw * float(sum qx))), for the row whose group is `rg`
  __m512 add(__m512 total, __m512i sums, const Int8Rows& a, int64_t rg) const {
    const __m512i sum = _mm512_sub_epi32(sums, offset);
    __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), d);
    if (BITS == 4) t = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.s[rg]), t);
    return _mm512_fmadd_ps(t, _mm512_set1_ps(a.d[rg]), total);
  }
};

template <int R, int BITS>
inline void int8_tile(const Int8Rows& a, int64_t m, const uint8_t* codes, const c10::Half* scales,
                      const void* extra, const QuantLayout& l, int64_t block,
                      float* totals /* [R][16] */) {
  __m512 total[R];
  for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
  const uint8_t* c = codes + block * l.groups * l.group_bytes();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < l.groups; g++, c += l.group_bytes()) {
    // int32 sums, exact in any order: two chains per row hide vpdpbusd's latency when the rows
    // are few; with many rows, one chain each keeps the tile in registers
    constexpr int C = R >= 4 ? 1 : 2;
    __m512i chain[R][2];
    for (int r = 0; r < R; r++) chain[r][0] = chain[r][1] = _mm512_setzero_si512();
    const uint8_t* q = a.q.data() + m * l.in + g * kGroup;
    // Decode steps are bound by reading the codes from memory: ask for them a few groups early.
    for (int64_t line = 0; line < l.group_bytes(); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchGroups * l.group_bytes() + line), _MM_HINT_T0);
    if (BITS == 4) {
      for (int k = 0; k < 4; k++) {  // low nibbles: inputs 4k..4k+3; high: 16 + 4k..16 + 4k+3
        const __m512i raw = _mm512_loadu_si512(c + k * 64);
        const __m512i lo = _mm512_and_si512(raw, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        for (int r = 0; r < R; r++) {
          chain[r][0] = _mm512_dpbusd_epi32(chain[r][0], lo, broadcast4(q + r * l.in + 4 * k));
          chain[r][C - 1] = _mm512_dpbusd_epi32(chain[r][C - 1], hi, broadcast4(q + r * l.in + 16 + 4 * k));
        }
      }
    } else {
      for (int t = 0; t < 8; t++) {  // inputs 4t..4t+3
        const __m512i w = _mm512_loadu_si512(c + t * 64);
        for (int r = 0; r < R; r++)
          chain[r][t % C] = _mm512_dpbusd_epi32(chain[r][t % C], broadcast4(q + r * l.in + 4 * t), w);
      }
    }
    const GroupScales<BITS> gs(scales, extra, l, block, g);
    for (int r = 0; r < R; r++) {
      const __m512i both = C == 2 ? _mm512_add_epi32(chain[r][0], chain[r][1]) : chain[r][0];
      total[r] = gs.add(total[r], both, a, (m + r) * l.groups + g);
    }
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(totals + r * kFeatures, total[r]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// AVX2 without VNNI: vpmaddubsw multiplies unsigned by signed bytes and adds adjacent products
// into int16, then vpmaddwd adds pairs of those into int32 lanes: the four products of a lane's
// quad, as vpdpbusd adds them. Nothing saturates: int4 codes 0..15 times activations -127..127
// pair to at most 3,810; int8 weights go as |w| times the activation carrying w's sign (qx never
// -128), at most 2 x 128 x 127 = 32,512, so S = sum w qx directly, without the +128 offset. The
// sums are exact and the float steps are the scalar code's, in its order: the same bits.
// 8 features to a vector (half `h` of the block), rows in tiles of up to 4 (llama.cpp's AVX2
// Q4_1 and Q8_0 dot products multiply the same way). A decode's single row takes both halves in
// one pass, and int4 sums stay in int16 lanes for a whole group (see int8_half_tile); with the
// codes prefetched as on AVX-512, the default model's 120 decoder linears of a w4a8 decode step
// (66 MB) went from 22-25 to 29-34 GB/s on 2 cores, and 9-row verifications 1.2x. Tiles of 2-4
// rows of int4 codes take both halves too, low nibbles then high ones, so that each activation
// broadcast feeds 16 features (1.1x a tile, measured alone on one AVX2 core).
inline __m256i quad_sums(__m256i u, __m256i s) {  // int32 lanes: 4 products u8 x s8, added
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

inline __m256i broadcast4(const uint8_t* p) {  // 4 bytes into every int32 lane
  int32_t v;
  __builtin_memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// `NH` halves of the block's 16 features from half h0 (both for one row, so that the row's
// activation bytes are broadcast once for 16 features; one for more rows, so that the sums fit
// in 16 registers).
template <int R, int BITS, int NH>
inline void int8_half_tile(const Int8Rows& a, int64_t m, const uint8_t* codes,
                           const c10::Half* scales, const void* extra, const QuantLayout& l,
                           int64_t block, int h0, float* totals /* [R][16] */) {
  __m256 total[R][NH];
  for (int r = 0; r < R; r++)
    for (int h = 0; h < NH; h++) total[r][h] = _mm256_setzero_ps();
  const uint8_t* c = codes + block * l.groups * l.group_bytes() + h0 * 32;
  const __m256i nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < l.groups; g++, c += l.group_bytes()) {
    __m256i sum[R][NH];
    const uint8_t* q = a.q.data() + m * l.in + g * kGroup;
    if (h0 == 0)  // steps of a few rows read the codes from memory: ask for them a few groups early
      for (int64_t line = 0; line < l.group_bytes(); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchGroups * l.group_bytes() + line), _MM_HINT_T0);
    if (BITS == 4) {
      // Each vpmaddubsw pair is at most 2 x 15 x 127 = 3,810, so a group's eight of them add up
      // in int16 lanes (at most 30,480) before one vpmaddwd widens them: fewer instructions than
      // widening every pair, and the same exact S.
      // (Any order of those adds gives the same S: every partial sum is within +-30,480.)
      __m256i acc[R][NH];
      for (int k = 0; k < 4; k++) {  // low nibbles: inputs 4k..4k+3; high: 16 + 4k..16 + 4k+3
        if constexpr (R > 1 && NH == 2) {  // both halves, one nibble at a time: fewer registers
          for (int high = 0; high < 2; high++) {
            __m256i w[NH];
            for (int h = 0; h < NH; h++) {
              const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + k * 64 + h * 32));
              w[h] = _mm256_and_si256(high ? _mm256_srli_epi16(raw, 4) : raw, nibble);
            }
            for (int r = 0; r < R; r++) {
              const __m256i x = broadcast4(q + r * l.in + 16 * high + 4 * k);
              for (int h = 0; h < NH; h++) {
                const __m256i p = _mm256_maddubs_epi16(w[h], x);
                acc[r][h] = k == 0 && !high ? p : _mm256_add_epi16(acc[r][h], p);
              }
            }
          }
        } else {
          __m256i lo[NH], hi[NH];
          for (int h = 0; h < NH; h++) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + k * 64 + h * 32));
            lo[h] = _mm256_and_si256(raw, nibble);
            hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
          }
          for (int r = 0; r < R; r++) {
            const __m256i xl = broadcast4(q + r * l.in + 4 * k), xh = broadcast4(q + r * l.in + 16 + 4 * k);
            for (int h = 0; h < NH; h++) {
              const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                                    _mm256_maddubs_epi16(hi[h], xh));
              acc[r][h] = k == 0 ? pair : _mm256_add_epi16(acc[r][h], pair);
            }
          }
        }
      }
      for (int r = 0; r < R; r++)
        for (int h = 0; h < NH; h++) sum[r][h] = _mm256_madd_epi16(acc[r][h], _mm256_set1_epi16(1));
    } else {
      for (int r = 0; r < R; r++)
        for (int h = 0; h < NH; h++) sum[r][h] = _mm256_setzero_si256();
      for (int t = 0; t < 8; t++) {  // inputs 4t..4t+3; the activations are stored offset by 128
        for (int h = 0; h < NH; h++) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + t * 64 + h * 32));
          const __m256i magnitude = _mm256_abs_epi8(w);  // -128 gives 0x80: 128 as unsigned
          for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_xor_si256(broadcast4(q + r * l.in + 4 * t), flip);
            sum[r][h] = _mm256_add_epi32(sum[r][h], quad_sums(magnitude, _mm256_sign_epi8(x, w)));
          }
        }
      }
    }
    for (int h = 0; h < NH; h++) {
      const int64_t s = (block * l.groups + g) * kFeatures + (h0 + h) * 8;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + s)));
      const __m256 mn = BITS == 4 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                        static_cast<const c10::Half*>(extra) + s)))
                                  : _mm256_setzero_ps();
      for (int r = 0; r < R; r++) {  // total + dx * (float(S) * dw (+ mw * float(sum qx)))
        const int64_t rg = (m + r) * l.groups + g;
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(sum[r][h]), d);
        if (BITS == 4) t = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.s[rg]), t);
        total[r][h] = _mm256_fmadd_ps(t, _mm256_set1_ps(a.d[rg]), total[r][h]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < NH; h++) _mm256_storeu_ps(totals + r * kFeatures + (h0 + h) * 8, total[r][h]);
}

template <int R, int BITS>
inline void int8_tile(const Int8Rows& a, int64_t m, const uint8_t* codes, const c10::Half* scales,
                      const void* extra, const QuantLayout& l, int64_t block,
                      float* totals /* [R][16] */) {
  constexpr int T = R < 4 ? R : 4;
  if constexpr (R == 1) {
    int8_half_tile<1, BITS, 2>(a, m, codes, scales, extra, l, block, 0, totals);
  } else {
    if constexpr (BITS == 4) {  // both halves at once (see int8_half_tile)
      int8_half_tile<T, BITS, 2>(a, m, codes, scales, extra, l, block, 0, totals);
    } else {
      for (int h = 0; h < 2; h++)
        int8_half_tile<T, BITS, 1>(a, m, codes, scales, extra, l, block, h, totals);
    }
    if constexpr (R > 4)
      int8_tile<R - 4, BITS>(a, m + 4, codes, scales, extra, l, block, totals + 4 * kFeatures);
  }
}

#else

// The same sums lane by lane (integers: exact in any order), then the same float steps.
template <int R, int BITS>
inline void int8_tile(const Int8Rows& a, int64_t m, const uint8_t* codes, const c10::Half* scales,
                      const void* extra, const QuantLayout& l, int64_t block,
                      float* totals /* [R][16] */) {
  for (int r = 0; r < R; r++)
    for (int j = 0; j < kFeatures; j++) totals[r * kFeatures + j] = 0.0f;
  const uint8_t* c = codes + block * l.groups * l.group_bytes();
  for (int64_t g = 0; g < l.groups; g++, c += l.group_bytes()) {
    const int64_t s = (block * l.groups + g) * kFeatures;
    for (int j = 0; j < kFeatures; j++) {
      int32_t w[kGroup];
      for (int64_t i = 0; i < kGroup; i++) {  // input i of feature j, in the layout's place
        const int64_t quad = i / 4, b = i % 4;
        if (BITS == 4) {
          const uint8_t byte = c[(quad % 4) * 64 + j * 4 + b];
          w[i] = quad < 4 ? byte & 0xF : byte >> 4;
        } else {
          w[i] = static_cast<int8_t>(c[quad * 64 + j * 4 + b]);
        }
      }
      const float d = static_cast<float>(scales[s + j]);
      for (int r = 0; r < R; r++) {
        const uint8_t* q = a.q.data() + (m + r) * l.in + g * kGroup;
        int32_t sum = 0;
        for (int64_t i = 0; i < kGroup; i++)
          sum += w[i] * (BITS == 4 ? static_cast<int32_t>(static_cast<int8_t>(q[i]))
                                   : static_cast<int32_t>(q[i]));
        if (BITS == 8) sum -= 128 * static_cast<const int16_t*>(extra)[s + j];
        const int64_t rg = (m + r) * l.groups + g;
        float t = static_cast<float>(sum) * d;
        if (BITS == 4) t = std::fma(static_cast<float>(static_cast<const c10::Half*>(extra)[s + j]), a.s[rg], t);
        float* total = totals + r * kFeatures + j;
        *total = std::fma(t, a.d[rg], *total);
      }
    }
  }
}

#endif

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512VNNI__)
#define SPECDEC_AMX_INT8 1
#else
#define SPECDEC_AMX_INT8 0
#endif

#if SPECDEC_AMX_INT8
// ---- int8 activations on AMX tiles ----
//
// Where the CPU has AMX, tiles of 16 rows (prompt chunks, wide batches) compute a group's int32
// sums S for 16 rows and 16 features in one TDPBSSD (int4 codes 0..15 against qx, both read as
// signed) or TDPBUSD (qx + 128 against int8 codes): 8,192 multiply-adds an instruction against
// vpdpbusd's 64. Tile A is 16 rows of the group's 32 activation bytes, read in place; tile B is
// the group's weights as 8 quads x 16 features x 4 bytes: the int8 layout itself, and the int4
// one with its nibbles split into bytes. Integer sums are exact in any order, and the float steps
// after them are GroupScales', so a row's bits are the same here as in the vpdpbusd tile (and a
// row-count change that moves a row between the two changes nothing): tested bit for bit.
constexpr int kAmxRows = 16;
constexpr int kAmxGroups = 4;  // groups in flight, one sum tile each, so the tile unit overlaps

// Tiles 0-3: 16 rows x 16 features of int32 sums, one per group in flight; 4-5: 16 rows x 32
// activation bytes; 6-7: the weights, 8 quads x 64 bytes (activations and weights alternate, so
// that a group's loads need not wait for the previous group's product).
inline void configure_int8_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; t++) {
    cfg.rows[t] = t < 6 ? kAmxRows : kGroup / 4;
    cfg.colsb[t] = t == 4 || t == 5 ? kGroup : kFeatures * 4;
  }
  _tile_loadconfig(&cfg);
}

// Group i in flight: its sums into tile C from activations in tile A and weights in tile B (tile
// numbers are literal: the intrinsics paste them into the instruction).
#define SPECDEC_GROUP_SUMS(C, A, B, i)                       \
  do {                                                       \
    _tile_zero(C);                                           \
    _tile_loadd(A, q + (i) * kGroup, l.in);                  \
    _tile_loadd(B, w[i], 64);                                \
    if (BITS == 4) _tile_dpbssd(C, A, B);                    \
    else _tile_dpbusd(C, A, B);                              \
    _tile_stored(C, sums + (i) * kAmxRows * kFeatures, 64);  \
  } while (0)

template <int BITS>
inline void amx_int8_tile(const Int8Rows& a, int64_t m, const uint8_t* codes,
                          const c10::Half* scales, const void* extra, const QuantLayout& l,
                          int64_t block, float* totals /* [16][16] */) {
  __m512 total[kAmxRows];
  for (int r = 0; r < kAmxRows; r++) total[r] = _mm512_setzero_ps();
  alignas(64) uint8_t split[kAmxGroups][kGroup / 4 * 64];  // int4 codes, one byte each
  // Two sets of sums: the tile unit computes the next groups' while the vector code scales these.
  alignas(64) int32_t stored[2][kAmxGroups * kAmxRows * kFeatures];
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const uint8_t* c = codes + block * l.groups * l.group_bytes();
  auto sums_of = [&](int64_t g0, int32_t* sums) {  // groups g0.. into `sums`, on the tile unit
    const int n = static_cast<int>(std::min<int64_t>(kAmxGroups, l.groups - g0));
    const uint8_t* w[kAmxGroups];
    for (int i = 0; i < n; i++) {
      const uint8_t* cg = c + (g0 + i) * l.group_bytes();
      w[i] = cg;
      if (BITS == 4) {  // low nibbles: inputs 4k..4k+3 (quad k); high: 16 + 4k.. (quad 4 + k)
        for (int k = 0; k < 4; k++) {
          const __m512i raw = _mm512_loadu_si512(cg + k * 64);
          _mm512_store_si512(split[i] + k * 64, _mm512_and_si512(raw, nibble));
          _mm512_store_si512(split[i] + (4 + k) * 64,
                             _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble));
        }
        w[i] = split[i];
      }
    }
    const uint8_t* q = a.q.data() + m * l.in + g0 * kGroup;
    SPECDEC_GROUP_SUMS(0, 4, 6, 0);
    if (n > 1) SPECDEC_GROUP_SUMS(1, 5, 7, 1);
    if (n > 2) SPECDEC_GROUP_SUMS(2, 4, 6, 2);
    if (n > 3) SPECDEC_GROUP_SUMS(3, 5, 7, 3);
  };
  sums_of(0, stored[0]);
  for (int64_t g0 = 0, j = 0; g0 < l.groups; g0 += kAmxGroups, j ^= 1) {
    if (g0 + kAmxGroups < l.groups) sums_of(g0 + kAmxGroups, stored[j ^ 1]);
    const int n = static_cast<int>(std::min<int64_t>(kAmxGroups, l.groups - g0));
    for (int i = 0; i < n; i++) {  // groups in order, as every tile adds them
      const GroupScales<BITS> gs(scales, extra, l, block, g0 + i);
      const int32_t* si = stored[j] + i * kAmxRows * kFeatures;
      for (int r = 0; r < kAmxRows; r++)
        total[r] = gs.add(total[r], _mm512_load_si512(si + r * kFeatures), a, (m + r) * l.groups + g0 + i);
    }
  }
  for (int r = 0; r < kAmxRows; r++) _mm512_storeu_ps(totals + r * kFeatures, total[r]);
}
#undef SPECDEC_GROUP_SUMS
#endif

// --- the driver: threads over blocks of 16 features, tiles of rows within a block -------------

template <int BITS>
struct FloatTile {  // float activations
  static constexpr int kRows = kQuantRows;
  static constexpr bool kAmx = false;  // float sums: no tile unit gives the vector code's bits
  const float *x, *xsum;
  const uint8_t* codes;
  const c10::Half *scales, *mins;
  const QuantLayout& l;
  static constexpr bool kWide = kWideTiles;
  template <int R>
  void run(int64_t m, int64_t block, float* totals) const {
    quant_tile<R, BITS>(x + m * l.in, xsum + m * l.groups, codes, scales, mins, l, block, totals);
  }
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
  // totals[m - m0][16] for rows m0 .. m1 - 1 and the features of `block` (see quant_wide_group);
  // `panel` holds kWideGroups x kGroup x 16 floats
  void wide(int64_t m0, int64_t m1, int64_t block, float* totals, float* panel) const {
    std::fill_n(totals, (m1 - m0) * kFeatures, 0.0f);
    float spare[kFeatures];  // a short tile's repeated rows add here
    for (int64_t g0 = 0; g0 < l.groups; g0 += kWideGroups) {
      const int64_t g1 = std::min(l.groups, g0 + kWideGroups);
      for (int64_t g = g0; g < g1; g++)
        widen_group<BITS>(codes, l, block, g, panel + (g - g0) * kGroup * kFeatures);
      for (int64_t m = m0; m < m1; m += kWideRows) {
        int64_t rows[kWideRows];
        float* tr[kWideRows];
        for (int r = 0; r < kWideRows; r++) {
          rows[r] = std::min<int64_t>(m + r, m1 - 1);
          tr[r] = m + r < m1 ? totals + (m + r - m0) * kFeatures : spare;
        }
        for (int64_t g = g0; g < g1; g++) {  // groups in order: each total's adds in order
          const float* xr[kWideRows];
          float sr[kWideRows];
          for (int r = 0; r < kWideRows; r++)
            xr[r] = x + rows[r] * l.in + g * kGroup,
            sr[r] = BITS == 4 ? xsum[rows[r] * l.groups + g] : 0.0f;
          const int64_t s = (block * l.groups + g) * kFeatures;
          quant_wide_group<BITS>(xr, sr, panel + (g - g0) * kGroup * kFeatures, scales + s,
                                 BITS == 4 ? mins + s : nullptr, tr);
        }
      }
    }
  }
#endif
};

template <int BITS>
struct Int8Tile {  // int8 activations
  static constexpr int kRows = kA8Rows;
  static constexpr bool kAmx = SPECDEC_AMX_INT8;  // tiles of 16 rows on AMX, where it is usable
  static constexpr bool kWide = false;
  const Int8Rows& a;
  const uint8_t* codes;
  const c10::Half* scales;
  const void* extra;  // mins (int4, float16) or sums of codes (int8, int16)
  const QuantLayout& l;
  template <int R>
  void run(int64_t m, int64_t block, float* totals) const {
#if SPECDEC_AMX_INT8
    if constexpr (R == kAmxRows) {
      amx_int8_tile<BITS>(a, m, codes, scales, extra, l, block, totals);
      return;
    }
#endif
    int8_tile<R, BITS>(a, m, codes, scales, extra, l, block, totals);
  }
};

// y for `rows` rows from m and the features of `block`, from their sums totals[rows][16].
template <typename T>
inline void store_rows(const float* totals, int64_t rows, const T* bias, T* y,
                       const QuantLayout& l, int64_t m, int64_t block) {
  const int64_t n0 = block * kFeatures, width = std::min(kFeatures, l.out - n0);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < width; j++) {
      const float b = bias ? static_cast<float>(bias[n0 + j]) : 0.0f;
      y[(m + r) * l.out + n0 + j] = static_cast<T>(totals[r * kFeatures + j] + b);
    }
}

template <typename T, int R, typename Tile>
inline void tile_rows(const Tile& tile, const T* bias, T* y, const QuantLayout& l, int64_t m,
                      int64_t block) {
  float totals[R * kFeatures];
  tile.template run<R>(m, block, totals);
  store_rows(totals, R, bias, y, l, m, block);
}

template <typename T, typename Tile>
void quant_linear_rows(const Tile& tile, const T* bias, T* y, int64_t rows, const QuantLayout& l) {
  for (int64_t m0 = 0; m0 < rows; m0 += kQuantRowChunk) {
    const int64_t m1 = std::min(rows, m0 + kQuantRowChunk);
    at::parallel_for(0, l.blocks, 1, [&](int64_t begin, int64_t end) {
      [[maybe_unused]] bool configured = false;
      std::unique_ptr<float[]> wide;  // wide tiles' totals, then a group's widened codes
      for (int64_t block = begin; block < end; block++) {
        int64_t m = m0;
        if constexpr (Tile::kWide) {
          if (m1 - m0 >= kWideMinRows) {
            if (!wide) wide.reset(new float[(kQuantRowChunk + kWideGroups * kGroup) * kFeatures]);
            float* totals = wide.get();
            tile.wide(m0, m1, block, totals, totals + kQuantRowChunk * kFeatures);
            store_rows(totals, m1 - m0, bias, y, l, m0, block);
            continue;
          }
        }
#if SPECDEC_AMX_INT8
        if constexpr (Tile::kAmx) {
          if (m1 - m0 >= kAmxRows && amx_usable()) {
            if (!configured) configure_int8_tiles();
            configured = true;
            for (; m + kAmxRows <= m1; m += kAmxRows) tile_rows<T, kAmxRows>(tile, bias, y, l, m, block);
          }
        }
#endif
        for (; m + Tile::kRows <= m1; m += Tile::kRows)
          tile_rows<T, Tile::kRows>(tile, bias, y, l, m, block);
        switch (m1 - m) {
#define SPECDEC_QUANT_TAIL(R) \
  case R: tile_rows<T, R>(tile, bias, y, l, m, block); break;
          SPECDEC_QUANT_TAIL(7) SPECDEC_QUANT_TAIL(6) SPECDEC_QUANT_TAIL(5) SPECDEC_QUANT_TAIL(4)
          SPECDEC_QUANT_TAIL(3) SPECDEC_QUANT_TAIL(2) SPECDEC_QUANT_TAIL(1)
#undef SPECDEC_QUANT_TAIL
          default: break;
        }
      }
#if SPECDEC_AMX_INT8
      if (configured) _tile_release();
#endif
    });
  }
}

}  // namespace

torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& scales, const c10::optional<torch::Tensor>& extra,
                           const c10::optional<torch::Tensor>& bias, int64_t bits, int64_t out,
                           bool int8_activations) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a contiguous 2-D float32 or bfloat16 CPU tensor");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t in = x.size(1);
  TORCH_CHECK(in % kGroup == 0, "the input width must be a multiple of 32 (one group)");
  const QuantLayout l{in, out, bits, (out + kFeatures - 1) / kFeatures, in / kGroup};
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte &&
                  codes.numel() == l.blocks * l.groups * l.group_bytes(),
              "codes must be the packed uint8 codes of an [out, in] weight matching x");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.numel() == l.blocks * l.groups * kFeatures,
              "scales must be the packed float16 scales, one per 16 features and group");
  const bool has_extra = extra.has_value() && extra->defined();
  const bool sums = int8_activations && bits == 8;  // int8 x int8 needs the codes' group sums
  TORCH_CHECK(has_extra == (bits == 4 || sums),
              bits == 4 ? "int4 weights need mins"
                        : (sums ? "int8 weights with int8 activations need the codes' group sums"
                                : "int8 weights with float activations take no mins"));
  if (has_extra)
    TORCH_CHECK(extra->is_contiguous() && extra->scalar_type() == (sums ? at::kShort : at::kHalf) &&
                    extra->numel() == scales.numel(),
                sums ? "sums must be packed int16, shaped as scales"
                     : "mins must be packed float16, shaped as scales");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == x.scalar_type() &&
                    bias->numel() == out,
                "bias must have x's dtype and one entry per output feature");
  auto y = torch::empty({x.size(0), out}, x.options());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const c10::Half* d = scales.data_ptr<c10::Half>();
  const void* e = has_extra ? extra->data_ptr() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quant_linear", [&] {
    const scalar_t* b = has_bias ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    if (int8_activations) {
      if constexpr (std::is_same_v<scalar_t, double>) {
        TORCH_CHECK(false, "unreachable: x is float32 or bfloat16");  // the dispatch's third type
      } else {
        const Int8Rows a = quantize_rows(x.data_ptr<scalar_t>(), x.size(0), in, bits == 8);
        if (bits == 4) quant_linear_rows(Int8Tile<4>{a, c, d, e, l}, b, yp, x.size(0), l);
        else quant_linear_rows(Int8Tile<8>{a, c, d, e, l}, b, yp, x.size(0), l);
      }
      return;
    }
    const auto x32 = x.to(at::kFloat).contiguous();
    std::vector<float> xsum(bits == 4 ? x.size(0) * l.groups : 0);
    if (bits == 4) group_sums(x32.data_ptr<float>(), xsum.data(), x.size(0), in);
    const auto* mins = static_cast<const c10::Half*>(e);
    if (bits == 4)
      quant_linear_rows(FloatTile<4>{x32.data_ptr<float>(), xsum.data(), c, d, mins, l}, b, yp, x.size(0), l);
    else
      quant_linear_rows(FloatTile<8>{x32.data_ptr<float>(), xsum.data(), c, d, mins, l}, b, yp, x.size(0), l);
  });
  return y;
}
