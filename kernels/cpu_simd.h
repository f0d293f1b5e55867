// Shared pieces of the CPU kernels (cpu_ops.cpp, cpu_linear.cpp, cpu_lanes.cpp, cpu_quant.cpp): loads that widen
// to float32, rounding as torch rounds, a vectorisable exp, the fixed tree in which 16 lane sums
// are added, and access to AMX tiles. Every kernel that sums uses these, so a sum's order is
// written down in one place.
#pragma once

#include <torch/extension.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace specdec_cpu {

using at::BFloat16;

template <typename T>
inline float load(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// x rounded to T, returned as float: what a torch op producing a T tensor hands the next op.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

constexpr int kLanes = 16;  // float32 lanes of one AVX-512 register; fixes the summation order

// e^x for float32, in straight-line arithmetic that vectorises (glibc's expf does not): x =
// n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for an exact n ln2), e^r by its degree-7
// Taylor polynomial (error below 1e-8, so within an ulp), times 2^n built in the exponent bits.
// Below -87.3 it gives 0 and above 88 infinity (expf underflows and overflows a little further).
inline float exp_approx(float x) {
  const float clamped = std::min(std::max(x, -87.3f), 88.0f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = (clamped - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  __builtin_memcpy(&two_n, &bits, sizeof(two_n));
  const float y = p * two_n;
  return x < -87.3f ? 0.0f : (x > 88.0f ? __builtin_inff() : y);
}

// The lanes of a 16-lane sum added in a fixed tree (halves, quarters, then pairs).
inline float sum_lanes(const float* lanes) {
  float half[8], quarter[4];
  for (int i = 0; i < 8; i++) half[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; i++) quarter[i] = half[i] + half[i + 4];
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

#if defined(__AVX512F__)
// The 16 lane sums of v[0..15], as sum_lanes adds them (the same pairs at each level), for all
// 16 at once: shuffles bring the pairs of one level into matching lanes, one add per level and
// pair of vectors. Lane j of the result is sum_lanes(v[j]).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 half[8], quarter[4], eighth[2];
  for (int i = 0; i < 8; i++) {  // lanes l and l + 8: [v0 l0-7 | v1 l0-7] + [v0 l8-15 | v1 l8-15]
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; i++) {  // halves h and h + 4: 128-bit lanes 0, 2 against 1, 3
    const __m512 a = half[2 * i], b = half[2 * i + 1];
    quarter[i] =
        _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int i = 0; i < 2; i++) {  // quarters q0 + q2 and q1 + q3, within each 128-bit lane
    const __m512 a = quarter[2 * i], b = quarter[2 * i + 1];
    eighth[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  const __m512 total = _mm512_add_ps(_mm512_shuffle_ps(eighth[0], eighth[1], 0x88),
                                     _mm512_shuffle_ps(eighth[0], eighth[1], 0xDD));
  // total holds the sums in the order the shuffles left them; put sum j in lane j
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, total);
}

// 16 elements of p as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp_approx for 16 lanes, the same operations in the same order (so the same bits; the build has
// no contraction into fused multiply-adds).
inline __m512 exp_approx16(__m512 x) {
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(clamped, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187045e-06f)));
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  const float coeffs[] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
  for (float c : coeffs) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(88.0f), _CMP_GT_OQ), y,
                           _mm512_set1_ps(__builtin_inff()));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ), y,
                              _mm512_setzero_ps());
}

// Up to 16 elements of p (the rest zero) as float32, and back, rounded as torch rounds.
inline __m512 load16_masked(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16_masked(const BFloat16* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// float32 -> bfloat16 bits, rounding to nearest even as c10::BFloat16 does (NaN: its quiet NaN)
inline __m256i to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0)));
}
inline void store16_masked(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
inline void store16_masked(BFloat16* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, to_bf16_bits(v));
}
// v rounded to T and widened back: what the next torch op reads
inline __m512 round16(__m512 v, const float*) { return v; }
inline __m512 round16(__m512 v, const BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
}
inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

// Softmax of the first nv scores of a row, up to its normalising multiply: the maximum, the
// exponentials in place, their 16 lane sums added in sum_lanes' tree; returns the inverse of the
// sum, which the caller multiplies in (the bf16 paths as they round the probabilities).
inline float softmax_exp_row(float* sr, int64_t nv) {
  const int64_t full = nv / kLanes * kLanes;
  const __mmask16 tail = static_cast<__mmask16>((1u << (nv - full)) - 1);
  __m512 top = _mm512_set1_ps(-__builtin_inff());
  for (int64_t c = 0; c < full; c += kLanes) top = _mm512_max_ps(top, _mm512_loadu_ps(sr + c));
  top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, sr + full));
  const float peak = _mm512_reduce_max_ps(top);  // a maximum is exact in any order
  const __m512 shift = _mm512_set1_ps(peak);
  __m512 total = _mm512_setzero_ps();
  for (int64_t c = 0; c < nv; c += kLanes) {  // exp_approx(sr[c] - peak), summed in 16 lanes
    const __mmask16 mask = tail_mask(nv - c);
    const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sr + c), shift));
    _mm512_mask_storeu_ps(sr + c, mask, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
  }
  float lanes[kLanes];
  _mm512_storeu_ps(lanes, total);
  return 1.0f / sum_lanes(lanes);
}

// Transpose 16 rows of 16 32-bit words (r[i] = row i) in place: r[j] = word j of every row.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2 alone: the AVX-512 helpers above for vectors of 8 lanes, the same operations in the same
// order (so the same bits). A 16-lane sum is two vectors, lanes 0-7 and 8-15.

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {  // widened exactly: the bf16 bits are float32's high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// float32 -> bfloat16 bits in the low 16 of each 32-bit lane, rounded as to_bf16_bits rounds
inline __m256i to_bf16_lanes8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                                              _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(BFloat16* p, __m256 v) {
  const __m256i packed = _mm256_packus_epi32(to_bf16_lanes8(v), _mm256_setzero_si256());
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}
inline __m256 round8(__m256 v, const float*) { return v; }
inline __m256 round8(__m256 v, const BFloat16*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(to_bf16_lanes8(v), 16));
}

inline __m256 exp_approx8(__m256 x) {  // exp_approx16's steps
  const __m256 clamped = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(clamped, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(1.428606765330187045e-06f)));
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  const float coeffs[] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
  for (float c : coeffs) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(x, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  return _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ));
}

// The 16-lane sums of 16 pairs of vectors, as sum_lanes adds them: v[2 * i] holds lanes 0-7 of sum
// i and v[2 * i + 1] lanes 8-15. Lane j of the result pair (lanes 0-7, then 8-15) is sum j.
inline void sum_lanes16(const __m256* v, __m256* out) {
  __m256 half[16], quarter[8], eighth[4], total[2];
  for (int i = 0; i < 16; i++) half[i] = _mm256_add_ps(v[2 * i], v[2 * i + 1]);  // l + (l + 8)
  for (int i = 0; i < 8; i++) {  // halves h and h + 4 of sums 2i and 2i + 1: [2i q0-3 | 2i+1 q0-3]
    const __m256 a = half[2 * i], b = half[2 * i + 1];
    quarter[i] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  for (int i = 0; i < 4; i++) {  // q0 + q2 and q1 + q3 of four sums
    const __m256 a = quarter[2 * i], b = quarter[2 * i + 1];
    eighth[i] = _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE));
  }
  for (int i = 0; i < 2; i++) {  // (q0 + q2) + (q1 + q3): sums 8i + {0, 2, 4, 6 | 1, 3, 5, 7}
    const __m256 a = eighth[2 * i], b = eighth[2 * i + 1];
    total[i] = _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
  }
  const __m256i order = _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0);  // sum j to lane j
  for (int i = 0; i < 2; i++) out[i] = _mm256_permutevar8x32_ps(total[i], order);
}

// softmax_exp_row (above) in vectors of 8: the same exponentials and the same 16 lane sums.
// Scores past nv, up to the next multiple of 16, are overwritten (with zeros).
inline float softmax_exp_row(float* sr, int64_t nv) {
  const int64_t padded = (nv + kLanes - 1) / kLanes * kLanes;
  for (int64_t c = nv; c < padded; c++) sr[c] = -__builtin_inff();  // exp_approx8 gives 0
  // The maximum in 4 vectors (a maximum is exact in any order; a scalar loop cost a long prompt
  // row about as much as its scores)
  __m256 top[4];
  for (auto& t : top) t = _mm256_set1_ps(-__builtin_inff());
  int64_t at = 0;
  for (; at + 32 <= padded; at += 32)
    for (int i = 0; i < 4; i++) top[i] = _mm256_max_ps(top[i], _mm256_loadu_ps(sr + at + 8 * i));
  for (; at < padded; at += 8) top[0] = _mm256_max_ps(top[0], _mm256_loadu_ps(sr + at));
  alignas(32) float peaks[8];
  _mm256_store_ps(peaks, _mm256_max_ps(_mm256_max_ps(top[0], top[1]), _mm256_max_ps(top[2], top[3])));
  float peak = peaks[0];
  for (int i = 1; i < 8; i++) peak = std::max(peak, peaks[i]);
  const __m256 shift = _mm256_set1_ps(peak);
  __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t c = 0; c < padded; c += 8) {
    const __m256 e = exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(sr + c), shift));
    _mm256_storeu_ps(sr + c, e);
    total[(c / 8) % 2] = _mm256_add_ps(total[(c / 8) % 2], e);
  }
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, total[0]);
  _mm256_store_ps(lanes + 8, total[1]);
  return 1.0f / sum_lanes(lanes);
}
#endif

// Elementwise kernels, written once for AVX-512 (16 lanes) or AVX2 (8): `Vec` is the widest
// float32 vector, with GCC's vector operators (+ - * / and unary minus, each rounded alone: the
// build contracts nothing), and vec_* the loads, stores and steps the helpers above provide.
#if defined(__AVX512F__)
#define SPECDEC_VECTOR 1
using Vec = __m512;
constexpr int kVecLanes = 16;
template <typename T>
inline Vec vec_load(const T* p) { return load16(p); }
inline void vec_store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void vec_store(BFloat16* p, Vec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v)); }
template <typename T>
inline Vec vec_round(Vec v, const T* p) { return round16(v, p); }
inline Vec vec_exp(Vec v) { return exp_approx16(v); }
inline Vec vec_set1(float x) { return _mm512_set1_ps(x); }
inline Vec vec_fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__AVX2__) && defined(__FMA__)
#define SPECDEC_VECTOR 1
using Vec = __m256;
constexpr int kVecLanes = 8;
template <typename T>
inline Vec vec_load(const T* p) { return load8(p); }
template <typename T>
inline void vec_store(T* p, Vec v) { store8(p, v); }
template <typename T>
inline Vec vec_round(Vec v, const T* p) { return round8(v, p); }
inline Vec vec_exp(Vec v) { return exp_approx8(v); }
inline Vec vec_set1(float x) { return _mm256_set1_ps(x); }
inline Vec vec_fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#else
#define SPECDEC_VECTOR 0
#endif

// T has vector code (float32 and bfloat16).
template <typename T>
constexpr bool kVectorised = SPECDEC_VECTOR && (std::is_same_v<T, float> || std::is_same_v<T, BFloat16>);

#if defined(__AMX_TILE__)
// An AMX tile configuration (palette 1): each tile's rows and bytes per row.
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// Linux hands a process the AMX state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); it is asked once, and where it refuses the vector kernels run instead.
inline bool amx_usable() {
  static const bool usable = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return usable;
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Six rows of float32 sums against a block of 16 features laid out [input][16] (a float32
// weight packed in lanes, cpu_lanes.cpp, or a bf16 block widened into a panel, cpu_linear.cpp):
// sums[r][j] += x[r][k] * block[k][j] for k = k0 .. k1 - 1 in order, one fused multiply-add at a
// time, from zero at k0 == 0 (else from `sums`). `ahead`: lines to ask into L2 beside these (the
// next block's), or null. Twelve named vectors, not an array: with the sums in arrays (one of
// 6 x 2, or two of 6, inlined or not) GCC stored all twelve to the stack at every step, and a
// tile ran at half the speed.
inline void six_row_sums(const float* const* x, const float* block, int64_t k0, int64_t k1,
                         float* sums, const float* ahead) {
  const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3], *x4 = x[4], *x5 = x[5];
  __m256 lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, lo4, hi4, lo5, hi5;
  if (k0 == 0) {
    lo0 = hi0 = lo1 = hi1 = lo2 = hi2 = lo3 = hi3 = lo4 = hi4 = lo5 = hi5 = _mm256_setzero_ps();
  } else {
#define SPECDEC_SIX_LOAD(r)                \
  lo##r = _mm256_loadu_ps(sums + 16 * r);  \
  hi##r = _mm256_loadu_ps(sums + 16 * r + 8);
    SPECDEC_SIX_LOAD(0) SPECDEC_SIX_LOAD(1) SPECDEC_SIX_LOAD(2)
    SPECDEC_SIX_LOAD(3) SPECDEC_SIX_LOAD(4) SPECDEC_SIX_LOAD(5)
#undef SPECDEC_SIX_LOAD
  }
  for (int64_t k = k0; k < k1; k++) {
    const float* line = block + 16 * k;
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(ahead + 16 * k), _MM_HINT_T1);
    const __m256 w0 = _mm256_loadu_ps(line), w1 = _mm256_loadu_ps(line + 8);
#define SPECDEC_SIX_ROW(r)                           \
  {                                                  \
    const __m256 xv = _mm256_broadcast_ss(x##r + k); \
    lo##r = _mm256_fmadd_ps(xv, w0, lo##r);          \
    hi##r = _mm256_fmadd_ps(xv, w1, hi##r);          \
  }
    SPECDEC_SIX_ROW(0) SPECDEC_SIX_ROW(1) SPECDEC_SIX_ROW(2)
    SPECDEC_SIX_ROW(3) SPECDEC_SIX_ROW(4) SPECDEC_SIX_ROW(5)
#undef SPECDEC_SIX_ROW
  }
  const __m256 all[12] = {lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, lo4, hi4, lo5, hi5};
  for (int i = 0; i < 12; i++) _mm256_storeu_ps(sums + 8 * i, all[i]);
}
#endif

}  // namespace specdec_cpu

// The kernels' entry points that other files call (the decoder stack, cpu_stack.cpp, calls them
// all; cpu_ops.cpp binds them for Python).
// cpu_ops.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor& residual, const torch::Tensor& x,
                            const torch::Tensor& weight, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
           int64_t head_dim);
void write_kv_(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
               torch::Tensor& v_cache, const torch::Tensor& slot_mapping);
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& query_index,
                               const torch::Tensor& key_slots, const torch::Tensor& q_len,
                               const torch::Tensor& c_len, double scale);
// cpu_attention.cpp: cached_attention for bf16 on AMX tiles; false (nothing done) where the build
// or the CPU has no AMX-BF16 or the head dim is not a multiple of 64
bool cached_attention_amx(const at::BFloat16* q, int64_t q_row_stride, const at::BFloat16* k_cache,
                          const at::BFloat16* v_cache, const int64_t* query_index,
                          const int64_t* key_slots, const int64_t* q_len, const int64_t* c_len,
                          at::BFloat16* out, int64_t groups, int64_t width, int64_t context,
                          int64_t kv_heads, int64_t share, int64_t head_dim, float scale);
// cpu_linear.cpp
torch::Tensor pack_pairs(const torch::Tensor& weight);
torch::Tensor linear_pairs(const torch::Tensor& x, const torch::Tensor& packed,
                           const c10::optional<torch::Tensor>& bias, int64_t out);
// cpu_lanes.cpp
torch::Tensor pack_lanes(const torch::Tensor& weight);
torch::Tensor linear_lanes(const torch::Tensor& x, const torch::Tensor& packed,
                           const c10::optional<torch::Tensor>& bias, int64_t out);
// cpu_quant.cpp
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& scales, const c10::optional<torch::Tensor>& extra,
                           const c10::optional<torch::Tensor>& bias, int64_t bits, int64_t out,
                           bool int8_activations);
// cpu_stack.cpp
void register_decoder_stack(pybind11::module& m);
