// Counter-based Exp(1) noise for the sampler's exponential race (see cpu_ops.exponential_noise).
//
// Row i is keyed by the 64-bit key s = keys[i]; token v's uniform comes from the SplitMix64
// stream seeded at s (Steele, Lea and Flood 2014): its v-th output mix(s + (v + 1) * gamma),
// whose top 24 bits k give u = (k + 0.5) / 2^24 = (2k + 1) / 2^25, and E = -log(u) in float32.
// Each value is a function of (s, v) alone, so rows and chunks of a row are computed in any
// order, by any thread, and a key's row does not depend on what else the call holds.
//
// u has 25 significant bits, one more than a float32 holds, so the log is taken from the odd
// integer n = 2k + 1 itself: n = 2^e * m with m in [sqrt(1/2), sqrt(2)), m - 1 = (n - 2^e) / 2^e
// exact, and log m = 2 atanh(s) with s = (m - 1) / (m + 1), |s| < 0.172, by its series to s^9
// (truncation below 2e-9 relative). With AVX-512 (F and DQ, for the 64-bit multiplies) 16
// tokens run at once; the tokens past the last multiple of 16, and CPUs without AVX-512, run the
// scalar code, which does the same IEEE operations in the same order (the build uses
// -ffp-contract=off and neither path fuses a multiply-add), so every CPU gives the same bits.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define SPECDEC_NOISE_AVX512 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;  // SplitMix64's increment (golden ratio)
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ull;   // its finaliser's multipliers
constexpr uint64_t kMix2 = 0x94D049BB133111EBull;
constexpr int32_t kSqrtHalfOffset = 0x3f800000 - 0x3f3504f3;  // float bits of 1 minus sqrt(1/2)'s
constexpr float kLn2Hi = 0.693145751953125f;  // ln 2 in two parts; e * kLn2Hi is exact
constexpr float kLn2Lo = 1.428606765330187045e-06f;
constexpr float kInv3 = 1.0f / 3, kInv5 = 1.0f / 5, kInv7 = 1.0f / 7, kInv9 = 1.0f / 9;
constexpr int64_t kChunk = 4096;  // tokens per work item (a multiple of 16)

// The 24-bit index k of token v's uniform in the stream of `key`: the top 24 bits of the
// finaliser's output. Its last step, z ^ (z >> 31), changes bits 0..32 only, so it is left out.
inline int32_t uniform_index(uint64_t key, int64_t v) {
  uint64_t z = key + static_cast<uint64_t>(v + 1) * kGamma;
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return static_cast<int32_t>(z >> 40);
}

// -log((2k + 1) / 2^25) in float32, within 1.4 ulp of the exact value for every k < 2^24.
inline float neg_log_uniform(int32_t k) {
  const int32_t n = 2 * k + 1;
  const float nf = static_cast<float>(n);  // rounded above 2^24: it only picks e
  int32_t bits;
  std::memcpy(&bits, &nf, sizeof(bits));
  const int32_t e = ((bits + kSqrtHalfOffset) >> 23) - 127;  // n / 2^e in [sqrt(1/2), sqrt(2))
  const int32_t power = 1 << e;
  const float s = static_cast<float>(n - power) / static_cast<float>(n + power);  // (m-1)/(m+1)
  const float s2 = s * s;
  float q = kInv9;
  q = q * s2 + kInv7;
  q = q * s2 + kInv5;
  q = q * s2 + kInv3;
  const float two_s = s + s;
  const float log_m = two_s + two_s * (s2 * q);
  const float exponent = static_cast<float>(e - 25);
  return -(exponent * kLn2Hi + (exponent * kLn2Lo + log_m));
}

inline void store(float* out, int32_t k) { *out = neg_log_uniform(k); }
inline void store(double* out, int32_t k) { *out = (2.0 * k + 1.0) * 0x1p-25; }

#if defined(SPECDEC_NOISE_AVX512)
// uniform_index for tokens v0 .. v0 + 15.
inline __m512i uniform_index16(uint64_t key, int64_t v0) {
  const __m512i lanes = _mm512_mullo_epi64(_mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi64(static_cast<int64_t>(kGamma)));
  const uint64_t first = key + static_cast<uint64_t>(v0 + 1) * kGamma;
  const __m512i mix1 = _mm512_set1_epi64(static_cast<int64_t>(kMix1));
  const __m512i mix2 = _mm512_set1_epi64(static_cast<int64_t>(kMix2));
  __m256i half[2];
  for (int h = 0; h < 2; h++) {
    const uint64_t base = first + static_cast<uint64_t>(8 * h) * kGamma;
    __m512i z = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(base)), lanes);
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), mix1);
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), mix2);
    half[h] = _mm512_cvtepi64_epi32(_mm512_srli_epi64(z, 40));
  }
  return _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1);
}

// neg_log_uniform of 16 indices, operation for operation.
inline __m512 neg_log_uniform16(__m512i k) {
  const __m512i n = _mm512_add_epi32(_mm512_add_epi32(k, k), _mm512_set1_epi32(1));
  const __m512i bits = _mm512_castps_si512(_mm512_cvtepi32_ps(n));
  const __m512i e = _mm512_sub_epi32(
      _mm512_srai_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(kSqrtHalfOffset)), 23),
      _mm512_set1_epi32(127));
  const __m512i power = _mm512_sllv_epi32(_mm512_set1_epi32(1), e);
  const __m512 s = _mm512_div_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(n, power)),
                                 _mm512_cvtepi32_ps(_mm512_add_epi32(n, power)));
  const __m512 s2 = _mm512_mul_ps(s, s);
  __m512 q = _mm512_set1_ps(kInv9);
  q = _mm512_add_ps(_mm512_mul_ps(q, s2), _mm512_set1_ps(kInv7));
  q = _mm512_add_ps(_mm512_mul_ps(q, s2), _mm512_set1_ps(kInv5));
  q = _mm512_add_ps(_mm512_mul_ps(q, s2), _mm512_set1_ps(kInv3));
  const __m512 two_s = _mm512_add_ps(s, s);
  const __m512 log_m = _mm512_add_ps(two_s, _mm512_mul_ps(two_s, _mm512_mul_ps(s2, q)));
  const __m512 exponent = _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(25)));
  const __m512 sum =
      _mm512_add_ps(_mm512_mul_ps(exponent, _mm512_set1_ps(kLn2Hi)),
                    _mm512_add_ps(_mm512_mul_ps(exponent, _mm512_set1_ps(kLn2Lo)), log_m));
  return _mm512_sub_ps(_mm512_setzero_ps(), sum);
}

inline void store16(float* out, __m512i k) { _mm512_storeu_ps(out, neg_log_uniform16(k)); }
inline void store16(double* out, __m512i k) {
  const __m512i n = _mm512_add_epi32(_mm512_add_epi32(k, k), _mm512_set1_epi32(1));
  const __m512d scale = _mm512_set1_pd(0x1p-25);
  _mm512_storeu_pd(out, _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(n)), scale));
  _mm512_storeu_pd(out + 8,
                   _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(n, 1)), scale));
}
#endif

// out[i, v] for each key i and token v < vocab: E (float) or u (double, exactly).
template <typename Out>
void draw_rows(const int64_t* keys, Out* out, int64_t rows, int64_t vocab) {
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; item++) {
      const int64_t row = item / chunks, v0 = item % chunks * kChunk;
      const int64_t v1 = std::min(vocab, v0 + kChunk);
      const uint64_t key = static_cast<uint64_t>(keys[row]);
      Out* o = out + row * vocab;
      int64_t v = v0;
#if defined(SPECDEC_NOISE_AVX512)
      for (; v + 16 <= v1; v += 16) store16(o + v, uniform_index16(key, v));
#endif
      for (; v < v1; v++) store(o + v, uniform_index(key, v));
    }
  });
}

template <typename Out>
torch::Tensor draw(const torch::Tensor& keys, int64_t vocab, at::ScalarType dtype) {
  TORCH_CHECK(keys.device().is_cpu() && keys.scalar_type() == at::kLong && keys.dim() == 1,
              "keys must be a 1-D int64 CPU tensor");
  TORCH_CHECK(vocab >= 0, "vocab must not be negative");
  const auto contiguous = keys.contiguous();
  auto out = torch::empty({keys.size(0), vocab}, torch::dtype(dtype));
  draw_rows(contiguous.data_ptr<int64_t>(), out.data_ptr<Out>(), keys.size(0), vocab);
  return out;
}

}  // namespace

torch::Tensor exponential_noise(const torch::Tensor& keys, int64_t vocab) {
  return draw<float>(keys, vocab, at::kFloat);
}

torch::Tensor noise_uniforms(const torch::Tensor& keys, int64_t vocab) {
  return draw<double>(keys, vocab, at::kDouble);
}
