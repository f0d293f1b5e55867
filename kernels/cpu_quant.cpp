// Weight-only quantized linears for the CPU: y = x @ dequant(w)^T (+ bias), row-invariant (see
// cpu_quant.py for the layout and the torch reference).
//
// Weights come in groups of 32 inputs. int4 (asymmetric, as GGUF's Q4_1): w = d * q + m with a
// code q in 0..15 and a float16 scale d and minimum m per group. int8 (symmetric, as GGUF's
// Q8_0): w = d * q with q in -128..127 and a float16 scale per group. Activations stay in float:
// a bfloat16 x is widened to float32 exactly, and every product is a float32 fused multiply-add.
//
// A group's contribution to an output is computed as
//     d * sum_i q_i x_i  (+ m * sum_i x_i for int4)
// which reads each code once and multiplies by the scale once per group, not once per weight.
// The inner sum runs in two chains (even inputs and odd inputs, each in input order, from zero),
// added as c0 + c1; the group terms are added to the output's total group by group, in order.
// A group's chains start from zero, so consecutive groups overlap in the out-of-order core. Lanes of a vector are 16 output features, so there is no
// horizontal reduction. Nothing in that order depends on the row count, the tile or the thread,
// so a row's bits are the same in a one-row decode as in a 1,000-row prompt: what batch
// invariance needs (see specdec/attention.py). The scalar code (no AVX-512) computes each lane
// with the same fused multiply-adds in the same order, so it gives the same bits.
//
// Work is split over threads by blocks of 16 features; within a block, tiles of up to kQuantRows
// rows share each code vector loaded. Long inputs run in chunks of kQuantRowChunk rows.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <vector>

#include "cpu_simd.h"

namespace {

using namespace specdec_cpu;

constexpr int64_t kGroup = 32;     // inputs per quantization group
constexpr int64_t kFeatures = 16;  // output features per block: one vector of float32 sums
constexpr int kQuantRows = 8;      // rows per tile: 8 rows x (2 chains + 1 total) = 24 zmm
constexpr int64_t kQuantRowChunk = 128;

struct QuantLayout {
  int64_t in, out, bits, blocks, groups;
  // bytes of codes per block and group: 16 features x 32 inputs at `bits` each
  int64_t group_bytes() const { return kFeatures * kGroup * bits / 8; }
};

#if defined(__AVX512F__)

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

#else

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

template <typename T, int R, int BITS>
inline void quant_rows(const float* x, const float* xsum, const uint8_t* codes,
                       const c10::Half* scales, const c10::Half* mins, const T* bias, T* y,
                       const QuantLayout& l, int64_t m, int64_t block) {
  float totals[R * kFeatures];
  quant_tile<R, BITS>(x + m * l.in, xsum + m * l.groups, codes, scales, mins, l, block, totals);
  const int64_t n0 = block * kFeatures, width = std::min(kFeatures, l.out - n0);
  for (int r = 0; r < R; r++)
    for (int64_t j = 0; j < width; j++) {
      const float b = bias ? static_cast<float>(bias[n0 + j]) : 0.0f;
      y[(m + r) * l.out + n0 + j] = static_cast<T>(totals[r * kFeatures + j] + b);
    }
}

template <typename T, int BITS>
void quant_linear_rows(const float* x, const float* xsum, const uint8_t* codes,
                       const c10::Half* scales, const c10::Half* mins, const T* bias, T* y,
                       int64_t rows, const QuantLayout& l) {
  for (int64_t m0 = 0; m0 < rows; m0 += kQuantRowChunk) {
    const int64_t m1 = std::min(rows, m0 + kQuantRowChunk);
    at::parallel_for(0, l.blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; block++) {
        int64_t m = m0;
        for (; m + kQuantRows <= m1; m += kQuantRows)
          quant_rows<T, kQuantRows, BITS>(x, xsum, codes, scales, mins, bias, y, l, m, block);
        switch (m1 - m) {
#define SPECDEC_QUANT_TAIL(R) \
  case R: quant_rows<T, R, BITS>(x, xsum, codes, scales, mins, bias, y, l, m, block); break;
          SPECDEC_QUANT_TAIL(7) SPECDEC_QUANT_TAIL(6) SPECDEC_QUANT_TAIL(5) SPECDEC_QUANT_TAIL(4)
          SPECDEC_QUANT_TAIL(3) SPECDEC_QUANT_TAIL(2) SPECDEC_QUANT_TAIL(1)
#undef SPECDEC_QUANT_TAIL
          default: break;
        }
      }
    });
  }
}

}  // namespace

torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
                           const c10::optional<torch::Tensor>& bias, int64_t bits, int64_t out) {
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
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(has_mins == (bits == 4), "int4 weights need mins, int8 weights have none");
  if (has_mins)
    TORCH_CHECK(mins->is_contiguous() && mins->scalar_type() == at::kHalf &&
                    mins->numel() == scales.numel(),
                "mins must be packed float16, shaped as scales");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == x.scalar_type() &&
                    bias->numel() == out,
                "bias must have x's dtype and one entry per output feature");
  const auto x32 = x.to(at::kFloat).contiguous();
  std::vector<float> xsum(bits == 4 ? x.size(0) * l.groups : 0);
  if (bits == 4) group_sums(x32.data_ptr<float>(), xsum.data(), x.size(0), in);
  auto y = torch::empty({x.size(0), out}, x.options());
  const c10::Half* m = has_mins ? mins->data_ptr<c10::Half>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quant_linear", [&] {
    const auto run = bits == 4 ? quant_linear_rows<scalar_t, 4> : quant_linear_rows<scalar_t, 8>;
    run(x32.data_ptr<float>(), xsum.data(), codes.data_ptr<uint8_t>(),
        scales.data_ptr<c10::Half>(), m, has_bias ? bias->data_ptr<scalar_t>() : nullptr,
        y.data_ptr<scalar_t>(), x.size(0), l);
  });
  return y;
}
