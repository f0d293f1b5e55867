// Row-invariant linears for the CPU: y = x @ w^T (+ bias), float32 or bfloat16 (see cpu_ops.py).
//
// Each (row, feature) output is one dot product whose order of operations depends on nothing but
// the input width: lanes of a vector accumulate the input in order, one fused multiply-add per
// lane and step, and the 16 lane sums are added in the fixed tree of sum_lanes. So a row's bits
// are the same whether the call holds 1 row or 1,000, and whichever tile or thread computes it.
// That is what batch invariance needs (see specdec/attention.py), and oneDNN's bf16 GEMM does not
// give it on every CPU: measured here with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (a CPU with
// AVX512-BF16 but no AMX), a down projection's rows changed bits from 4 rows per call on.
//
// float32: 16 lanes of fused multiply-adds per step. bfloat16 with AVX512-BF16: vdpbf16ps, 32
// inputs per step, each lane adding the products of two neighbours (Intel defines its rounding;
// it is the same instruction in every path). bfloat16 without it: widened to float32 on load.
// A bf16 output is rounded once, after the bias is added in float32.
//
// Work is split over threads by blocks of kOutBlock features; within a block, tiles of up to
// kTileRows rows keep rows x kOutBlock sums in registers, so each weight vector loaded serves
// several rows. Rows are cut into as few tiles as hold them, of nearly equal size (5 rows run as
// one tile, not 4 + 1: a second pass over a block for one row cost a float32 step's linears 25.6
// ms, not 24.3). While a block's first tile runs, the next block's weights are prefetched into
// L2. Long inputs (prefill) run in chunks of kRowChunk rows, so that a chunk of x stays in L2
// while every weight block streams past it.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <type_traits>

#include "cpu_simd.h"

namespace {

using namespace specdec_cpu;

constexpr int64_t kOutBlock = 4;
constexpr int64_t kRowBlock = 4;  // rows per pass of the last out % kOutBlock features
constexpr int64_t kTileRows = 6;  // 6 * kOutBlock = 24 sums + 4 weight vectors + 1 input: 29 zmm
constexpr int64_t kRowChunk = 256;

#if defined(__AVX512F__)
inline __m512 load16_masked(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16_masked(const BFloat16* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// acc[r * B + b] = dot(x row m0 + r, w row n0 + b) in 16 lanes, for R rows and B features.
template <typename T, int R, int B>
inline void dot_tile(const T* x, const T* w, int64_t in, int64_t m0, int64_t n0, __m512* acc,
                     bool prefetch) {
  const T* wb = w + n0 * in;
  const T* next = wb + B * in;  // the next block's weights (past the end: prefetch is a hint)
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, BFloat16>) {
    constexpr int64_t kStep = 2 * kLanes;  // 32 bf16 inputs per vdpbf16ps
    int64_t k = 0;
    for (; k + kStep <= in; k += kStep) {
      __m512bh wv[B];
      for (int b = 0; b < B; b++) {
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(next + b * in + k), _MM_HINT_T1);
        wv[b] = (__m512bh)_mm512_loadu_si512(wb + b * in + k);
      }
      for (int r = 0; r < R; r++) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + r) * in + k);
        for (int b = 0; b < B; b++) acc[r * B + b] = _mm512_dpbf16_ps(acc[r * B + b], xv, wv[b]);
      }
    }
    if (k < in) {  // the last in % 32 inputs; zeros add nothing
      const __mmask32 mask = static_cast<__mmask32>((1ull << (in - k)) - 1);
      for (int r = 0; r < R; r++) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (m0 + r) * in + k);
        for (int b = 0; b < B; b++) {
          const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wb + b * in + k);
          acc[r * B + b] = _mm512_dpbf16_ps(acc[r * B + b], xv, wv);
        }
      }
    }
    return;
  }
#endif
  int64_t k = 0;
  for (; k + kLanes <= in; k += kLanes) {
    __m512 wv[B];
    for (int b = 0; b < B; b++) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(next + b * in + k), _MM_HINT_T1);
      wv[b] = load16(wb + b * in + k);
    }
    for (int r = 0; r < R; r++) {
      const __m512 xv = load16(x + (m0 + r) * in + k);
      for (int b = 0; b < B; b++) acc[r * B + b] = _mm512_fmadd_ps(xv, wv[b], acc[r * B + b]);
    }
  }
  if (k < in) {  // the last in % 16 inputs; masked lanes add fma(0, 0, sum) = sum
    const __mmask16 mask = static_cast<__mmask16>((1u << (in - k)) - 1);
    for (int r = 0; r < R; r++) {
      const __m512 xv = load16_masked(x + (m0 + r) * in + k, mask);
      for (int b = 0; b < B; b++)
        acc[r * B + b] = _mm512_fmadd_ps(xv, load16_masked(wb + b * in + k, mask), acc[r * B + b]);
    }
  }
}

// R <= kTileRows rows by kOutBlock features, their sums reduced 16 at a time by sum_lanes16.
template <typename T, int R>
inline void linear_tile(const T* x, const T* w, const T* bias, T* y, int64_t in, int64_t out,
                        int64_t m0, int64_t n0, bool prefetch) {
  constexpr int B = kOutBlock;
  constexpr int N = (R * B + 15) / 16 * 16;  // the rest stay zero
  __m512 acc[N];
  for (int i = 0; i < N; i++) acc[i] = _mm512_setzero_ps();
  dot_tile<T, R, B>(x, w, in, m0, n0, acc, prefetch);
  float sums[N];
  for (int i = 0; i < N; i += 16) _mm512_storeu_ps(sums + i, sum_lanes16(acc + i));
  for (int r = 0; r < R; r++)
    for (int b = 0; b < B; b++) {
      const float total = sums[r * B + b];
      y[(m0 + r) * out + n0 + b] = static_cast<T>(bias ? total + load(bias, n0 + b) : total);
    }
}

// One of the last out % kOutBlock features for R rows, each sum as sum_lanes adds it.
template <typename T, int R>
inline void linear_tail_feature(const T* x, const T* w, const T* bias, T* y, int64_t in,
                                int64_t out, int64_t m0, int64_t n) {
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  dot_tile<T, R, 1>(x, w, in, m0, n, acc, false);
  for (int r = 0; r < R; r++) {
    float lanes[kLanes];
    _mm512_storeu_ps(lanes, acc[r]);
    const float total = sum_lanes(lanes);
    y[(m0 + r) * out + n] = static_cast<T>(bias ? total + load(bias, n) : total);
  }
}
#else
// Without AVX-512: the same lanes and tree, a multiply and an add per step (no fusion here).
template <typename T, int R, int B>
inline void linear_rows_portable(const T* x, const T* w, const T* bias, T* y, int64_t in,
                                 int64_t out, int64_t m0, int64_t n0) {
  for (int r = 0; r < R; r++) {
    const T* xm = x + (m0 + r) * in;
    for (int b = 0; b < B; b++) {
      const T* wn = w + (n0 + b) * in;
      float lanes[kLanes] = {0};
      int64_t k = 0;
      for (; k + kLanes <= in; k += kLanes) {
#pragma omp simd
        for (int l = 0; l < kLanes; l++) lanes[l] += load(xm, k + l) * load(wn, k + l);
      }
      for (int64_t t = k; t < in; t++) lanes[t - k] += load(xm, t) * load(wn, t);
      const float total = sum_lanes(lanes);
      y[(m0 + r) * out + n0 + b] = static_cast<T>(bias ? total + load(bias, n0 + b) : total);
    }
  }
}

template <typename T, int R>
inline void linear_tile(const T* x, const T* w, const T* bias, T* y, int64_t in, int64_t out,
                        int64_t m0, int64_t n0, bool /*prefetch*/) {
  linear_rows_portable<T, R, kOutBlock>(x, w, bias, y, in, out, m0, n0);
}

template <typename T, int R>
inline void linear_tail_feature(const T* x, const T* w, const T* bias, T* y, int64_t in,
                                int64_t out, int64_t m0, int64_t n) {
  linear_rows_portable<T, R, 1>(x, w, bias, y, in, out, m0, n);
}
#endif

template <typename T>
inline void linear_feature_block(const T* x, const T* w, const T* bias, T* y, int64_t m_begin,
                                 int64_t m_end, int64_t in, int64_t out, int64_t n0) {
  const int64_t rows = m_end - m_begin;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  for (int64_t t = 0, m = m_begin; t < tiles; t++) {
    const int64_t size = (m_end - m + (tiles - t) - 1) / (tiles - t);  // even split, larger first
    const bool first = m == m_begin;
    switch (size) {
      case 6: linear_tile<T, 6>(x, w, bias, y, in, out, m, n0, first); break;
      case 5: linear_tile<T, 5>(x, w, bias, y, in, out, m, n0, first); break;
      case 4: linear_tile<T, 4>(x, w, bias, y, in, out, m, n0, first); break;
      case 3: linear_tile<T, 3>(x, w, bias, y, in, out, m, n0, first); break;
      case 2: linear_tile<T, 2>(x, w, bias, y, in, out, m, n0, first); break;
      default: linear_tile<T, 1>(x, w, bias, y, in, out, m, n0, first); break;
    }
    m += size;
  }
}

template <typename T>
void linear_rows(const T* x, const T* w, const T* bias, T* y, int64_t rows, int64_t in,
                 int64_t out) {
  const int64_t blocks = out / kOutBlock;
  for (int64_t m0 = 0; m0 < rows; m0 += kRowChunk) {
    const int64_t m1 = std::min(rows, m0 + kRowChunk);
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; blk++)
        linear_feature_block(x, w, bias, y, m0, m1, in, out, blk * kOutBlock);
    });
  }
  for (int64_t n = blocks * kOutBlock; n < out; n++) {
    int64_t m = 0;
    for (; m + kRowBlock <= rows; m += kRowBlock)
      linear_tail_feature<T, kRowBlock>(x, w, bias, y, in, out, m, n);
    for (; m < rows; m++) linear_tail_feature<T, 1>(x, w, bias, y, in, out, m, n);
  }
}

}  // namespace

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && weight.size(1) == x.size(1),
              "weight must be a contiguous [out, in] matrix of x's dtype matching x");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == x.scalar_type() &&
                    bias->numel() == weight.size(0),
                "bias must have x's dtype and one entry per output feature");
  auto y = torch::empty({x.size(0), weight.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "linear", [&] {
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, BFloat16>) {
      linear_rows(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                  has_bias ? bias->data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(),
                  x.size(0), x.size(1), weight.size(0));
    }
  });
  return y;
}
