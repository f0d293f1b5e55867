// Fused CPU kernels for a decoder layer (see cpu_ops.py).
//
// A decode step streams every weight matrix through the caches, which evicts the interpreter's
// and the dispatcher's working set; each small torch op after a matrix product then costs
// 5-40 us instead of 1-2. These kernels do in one call what takes torch 2 to 9 calls: RMSNorm
// (with the residual add before it), SiLU(gate) * up, RoPE on q and k in place, the K/V cache
// write, and attention to keys read by slot from the paged cache (bf16 attention on AMX tiles is
// in cpu_attention.cpp). Linears are in cpu_linear.cpp; the loads and sums the files share are in
// cpu_simd.h.
//
// Every row is computed alone, in an order that does not depend on how many rows a call holds,
// so results are batch-invariant. Elementwise steps round to the tensor's dtype exactly where
// torch's eager ops do (the build uses -ffp-contract=off, so no multiply-add is fused behind our
// back); sums (RMSNorm, dot products, softmax) and exp run in orders of their own, fixed here.
// With AVX-512, the linears and attention use explicit fused multiply-adds, the same in every
// code path a row can take, and 16-lane sums added in one fixed tree (sum_lanes); with AVX2
// alone, the same 16 lanes as two vectors of 8, so the same bits. The elementwise kernels are
// written once over cpu_simd.h's `Vec` (16 lanes or 8) and give the scalar code's bits: before
// AVX2 had that code, a 512-token bf16 prompt spent 0.12 s in SiLU alone on 2 cores.

#include <torch/extension.h>

#include "cpu_simd.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <memory>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace specdec_cpu;

// Sum of squares of one row, in float32: 16 running sums over the row, then added in order.
template <typename T>
inline float sum_of_squares(const T* x, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
#if SPECDEC_VECTOR
  if constexpr (kVectorised<T>) {
    Vec sums[kLanes / kVecLanes];
    for (auto& v : sums) v = vec_set1(0.0f);
    for (; i + kLanes <= n; i += kLanes)
      for (int h = 0; h < kLanes / kVecLanes; h++) {
        const Vec v = vec_load(x + i + h * kVecLanes);
        sums[h] = sums[h] + v * v;
      }
    for (int h = 0; h < kLanes / kVecLanes; h++) __builtin_memcpy(acc + h * kVecLanes, &sums[h], sizeof(Vec));
  }
#endif
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; j++) {
      float v = load(x, i + j);
      acc[j] += v * v;
    }
  }
  float sum = 0.0f;
  for (int j = 0; j < kLanes; j++) sum += acc[j];
  for (; i < n; i++) sum += load(x, i) * load(x, i);
  return sum;
}

// The elementwise kernels below run whole vectors, then the rest of the row in scalar code: the
// same operations lane by lane, so the same bits.

// out = weight * T(x * rsqrt(mean(x^2) + eps)), normalised in float32 as transformers does.
template <typename T>
inline void rms_norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
  const float inv = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  int64_t i = 0;
#if SPECDEC_VECTOR
  if constexpr (kVectorised<T>)
    for (; i + kVecLanes <= n; i += kVecLanes)
      vec_store(out + i, vec_load(weight + i) * vec_round(vec_load(x + i) * vec_set1(inv), out));
#endif
#pragma omp simd
  for (int64_t j = i; j < n; j++) out[j] = static_cast<T>(load(weight, j) * round_to<T>(load(x, j) * inv));
}

// res += x, rounded to T.
template <typename T>
inline void add_row(T* res, const T* x, int64_t n) {
  int64_t i = 0;
#if SPECDEC_VECTOR
  if constexpr (kVectorised<T>)
    for (; i + kVecLanes <= n; i += kVecLanes) vec_store(res + i, vec_load(res + i) + vec_load(x + i));
#endif
#pragma omp simd
  for (int64_t j = i; j < n; j++) res[j] = static_cast<T>(load(res, j) + load(x, j));
}

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) rms_norm_row(x + r * n, weight, out + r * n, n, eps);
  });
}

template <typename T>
void add_rms_norm_rows(T* residual, const T* x, const T* weight, T* out, int64_t rows, int64_t n,
                       float eps) {
  at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      T* res = residual + r * n;
      add_row(res, x + r * n, n);
      rms_norm_row(res, weight, out + r * n, n, eps);
    }
  });
}

// o = T(silu(gate)) * up for one row of n.
template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* o, int64_t n) {
  int64_t i = 0;
#if SPECDEC_VECTOR
  if constexpr (kVectorised<T>)
    for (; i + kVecLanes <= n; i += kVecLanes) {
      const Vec g = vec_load(gate + i);
      const Vec silu = g / (vec_set1(1.0f) + vec_exp(-g));
      vec_store(o + i, vec_round(silu, o) * vec_load(up + i));
    }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; j++) {
    const float g = load(gate, j);
    o[j] = static_cast<T>(round_to<T>(g / (1.0f + exp_approx(-g))) * load(up, j));
  }
}

// out = T(silu(gate)) * up, where each row of gate_up is [gate | up].
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++)
      silu_mul_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, out + r * n, n);
  });
}

// Rotate the first `heads` heads of each row in place: x * cos + rotate_half(x) * sin, with
// rotate_half(x) = [-x2, x1], each product and the sum rounded to T as torch's ops round them.
template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t rows, int64_t row_stride, int64_t heads,
               int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      const T* c = cos + r * head_dim;
      const T* s = sin + r * head_dim;
      for (int64_t h = 0; h < heads; h++) {
        T* v = x + r * row_stride + h * head_dim;
        int64_t i = 0;
#if SPECDEC_VECTOR
        if constexpr (kVectorised<T>)
          for (; i + kVecLanes <= half; i += kVecLanes) {
            const Vec x1 = vec_load(v + i), x2 = vec_load(v + i + half);
            const Vec lo = vec_round(x1 * vec_load(c + i), v) + vec_round(-x2 * vec_load(s + i), v);
            const Vec hi = vec_round(x2 * vec_load(c + i + half), v) + vec_round(x1 * vec_load(s + i + half), v);
            vec_store(v + i, lo);
            vec_store(v + i + half, hi);
          }
#endif
#pragma omp simd
        for (int64_t j = i; j < half; j++) {
          const float x1 = load(v, j), x2 = load(v, j + half);
          const float lo = round_to<T>(x1 * load(c, j)) + round_to<T>(-x2 * load(s, j));
          const float hi = round_to<T>(x2 * load(c, j + half)) + round_to<T>(x1 * load(s, j + half));
          v[j] = static_cast<T>(lo);
          v[j + half] = static_cast<T>(hi);
        }
      }
    }
  });
}

// Attention of a padded group of sequences to keys read from the paged cache by slot.
//
// For sequence g, query j (of q_len[g]) sits at position c_len[g] - q_len[g] + j and sees the
// keys at positions 0 .. that position. Without AVX-512 or AVX2 (see cached_attention_rows_vec for
// the vectorised form), a work item is one sequence, one KV head and a tile of up to kQueryTile
// of its queries, with the `share` query heads of that KV head: kShare * tile score rows. Keys
// are taken kLanes at a time and transposed into a small buffer, so that one vector holds the
// scores of kLanes keys and each score is a plain sum over the head dimension, in order: no
// horizontal reduction, and a score's bits depend only on its query and key, never on the tile
// or the batch. Softmax and the weighted sum of values run per row, in key order.
constexpr int64_t kQueryTile = 16;

template <typename T>
void cached_attention_rows(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache,
                           const int64_t* query_index, const int64_t* key_slots,
                           const int64_t* q_len, const int64_t* c_len, T* out, int64_t groups,
                           int64_t width, int64_t context, int64_t kv_heads, int64_t share,
                           int64_t head_dim, float scale) {
  const int64_t tiles = (width + kQueryTile - 1) / kQueryTile;
  const int64_t items = groups * kv_heads * tiles;
  const int64_t slot_stride = kv_heads * head_dim;
  const int64_t padded_context = (context + kLanes - 1) / kLanes * kLanes;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = kQueryTile * share;
    std::vector<float> queries(max_rows * head_dim), acc(max_rows * head_dim);
    std::vector<float> scores(max_rows * padded_context), keys_t(head_dim * kLanes);
    std::vector<float> value_row(head_dim);
    std::vector<int64_t> visible(max_rows);
    for (int64_t item = begin; item < end; item++) {
      const int64_t tile = item % tiles, h = (item / tiles) % kv_heads;
      const int64_t g = item / (tiles * kv_heads);
      const int64_t j0 = tile * kQueryTile, j1 = std::min(width, j0 + kQueryTile);
      const int64_t real_end = std::min(j1, q_len[g]);  // queries past q_len[g] are padding
      for (int64_t j = std::max(j0, real_end); j < j1; j++) {
        T* o = out + ((g * width + j) * kv_heads + h) * share * head_dim;
        for (int64_t i = 0; i < share * head_dim; i++) o[i] = static_cast<T>(0.0f);
      }
      if (real_end <= j0) continue;
      const int64_t rows = (real_end - j0) * share;  // row r: query j0 + r / share, head r % share
      for (int64_t r = 0; r < rows; r++) {
        const int64_t j = j0 + r / share;
        visible[r] = c_len[g] - q_len[g] + j + 1;
        const T* qr = q + query_index[g * width + j] * q_row_stride + (h * share + r % share) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) queries[r * head_dim + d] = load(qr, d);
      }
      const int64_t seen = visible[rows - 1];  // the last query sees the most keys
      const int64_t* slots = key_slots + g * context;
      for (int64_t c0 = 0; c0 < seen; c0 += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, seen - c0);
        for (int64_t l = 0; l < kLanes; l++) {  // keys c0 .. c0 + 15 as [head_dim][16]
          const T* key = k_cache + slots[c0 + std::min(l, n - 1)] * slot_stride + h * head_dim;
          for (int64_t d = 0; d < head_dim; d++) keys_t[d * kLanes + l] = load(key, d);
        }
        for (int64_t r = 0; r < rows; r++) {
          if (c0 >= visible[r]) continue;
          const float* qr = queries.data() + r * head_dim;
          float dot[kLanes] = {0};
          for (int64_t d = 0; d < head_dim; d++) {
            const float qd = qr[d];
            const float* kd = keys_t.data() + d * kLanes;
#pragma omp simd
            for (int l = 0; l < kLanes; l++) dot[l] += qd * kd[l];
          }
          float* sr = scores.data() + r * padded_context + c0;
#pragma omp simd
          for (int l = 0; l < kLanes; l++) sr[l] = dot[l] * scale;
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * head_dim, 0.0f);
      for (int64_t r = 0; r < rows; r++) {
        float* sr = scores.data() + r * padded_context;
        const int64_t nv = visible[r];
        float top = sr[0];
        for (int64_t c = 1; c < nv; c++) top = std::max(top, sr[c]);
#pragma omp simd
        for (int64_t c = 0; c < nv; c++) sr[c] = exp_approx(sr[c] - top);
        float total = 0.0f;
        for (int64_t c = 0; c < nv; c++) total += sr[c];
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t c = 0; c < nv; c++) sr[c] *= inv;
      }
      for (int64_t c = 0; c < seen; c++) {
        const T* value = v_cache + slots[c] * slot_stride + h * head_dim;
        for (int64_t d = 0; d < head_dim; d++) value_row[d] = load(value, d);
        for (int64_t r = 0; r < rows; r++) {
          if (c >= visible[r]) continue;
          const float p = scores[r * padded_context + c];
          float* a = acc.data() + r * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; d++) a[d] += p * value_row[d];
        }
      }
      for (int64_t r = 0; r < rows; r++) {
        const int64_t j = j0 + r / share;
        T* o = out + ((g * width + j) * kv_heads + h) * share * head_dim + (r % share) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) o[d] = static_cast<T>(acc[r * head_dim + d]);
      }
    }
  });
}

#if SPECDEC_VECTOR
// The same attention with AVX-512 or AVX2, for head dims that are a multiple of 16. Each score is
// a dot product over the head dimension in 16 lanes (one fused multiply-add per 16 dims, in
// order), its lanes added as sum_lanes adds them: sum_lanes16 gives the scores of 16 keys at once.
// Softmax sums run in 16 lanes and the same tree; each output element is a sum over the keys in
// order. A row's bits depend on its own query and keys only, and AVX2 (16 lanes as two vectors of
// 8) computes the AVX-512 bits.
//
// Work. A unit is one sequence, one query tile and one query head, numbered with the head
// fastest; the threads take equal runs of units, and a thread serves the units of a run that
// share a KV head as one item, reading each key and value once for all of them. A KV head read
// once per query head (as this kernel did first) cost a single float32 decode 2.5x the bytes, and
// a 9-row verification at 1,600 keys ran at 5 GB/s; splitting by units rather than by KV heads
// keeps a lone decode (3 KV heads, 9 query heads) spread evenly over the threads. Query tiles
// are numbered 0, last, 1, last - 1, ..., so that the threads' runs of a causal prompt cost the
// same: in plain order, on 2 threads, an 830-token prompt took 1.5-1.6x as long.
// vectors of the head dim kept in registers at once, for kFloatValueRows rows (AVX2 has 16
// registers, AVX-512 32)
constexpr int64_t kHeadChunks = kVecLanes == 16 ? 4 : 3;  // AVX2: 3 was 1.03x 2 or 4 (4 rows, or 2)
constexpr int64_t kFloatValueRows = 4;  // rows whose outputs are summed in one pass over the values
constexpr int64_t kPrefetch = 32;  // keys ahead of the scores being computed whose rows are fetched
// keys ahead of the values being summed whose rows weigh_values<..., true> fetches (the spread
// path's values, which no pass over the keys fetched before)
constexpr int64_t kValueFetch = 24;

// acc[r] += p[r][c] * value[c] for R rows and C vectors of the head dim from `offset`, over each
// key c row r sees (its first visible[r]), then row r is stored to outs[r] + the piece's start;
// kFetch asks for the values kValueFetch keys ahead.
// Out of line: inlined into the kernel's item loop, GCC kept the R x C sums in memory, a load
// and a store around every multiply-add; on its own it keeps them in registers (the same adds in
// the same order, so the same bits): a 9-row float32 verification at 1,000 keys 259 -> 193 us,
// a 930-token prompt chunk (batch-invariant mode) 16.7 -> 12.1 ms a layer.
template <typename T, int R, int C, bool kFetch = false>
__attribute__((noinline)) void weigh_values(const T* v_cache, const int64_t* slots,
                                            int64_t slot_stride, int64_t offset,
                                            const float* const* probs, const int64_t* visible,
                                            T* const* outs) {
  Vec acc[R][C];
  for (int r = 0; r < R; r++)
    for (int ch = 0; ch < C; ch++) acc[r][ch] = vec_set1(0.0f);
  int64_t seen = 0;
  for (int r = 0; r < R; r++) seen = std::max(seen, visible[r]);
  for (int64_t c = 0; c < seen; c++) {
    if constexpr (kFetch)
      if (c + kValueFetch < seen)
        _mm_prefetch(reinterpret_cast<const char*>(v_cache + slots[c + kValueFetch] * slot_stride + offset), _MM_HINT_T0);
    const T* value = v_cache + slots[c] * slot_stride + offset;
    Vec v[C];
    for (int ch = 0; ch < C; ch++) v[ch] = vec_load(value + ch * kVecLanes);
    for (int r = 0; r < R; r++) {
      if (c >= visible[r]) continue;
      const Vec p = vec_set1(probs[r][c]);
      for (int ch = 0; ch < C; ch++) acc[r][ch] = vec_fma(p, v[ch], acc[r][ch]);
    }
  }
  for (int r = 0; r < R; r++) {
    float row[C * kVecLanes];
    __builtin_memcpy(row, acc[r], sizeof(acc[r]));
    for (int i = 0; i < C * kVecLanes; i++) outs[r][i] = static_cast<T>(row[i]);
  }
}

// weigh_values for R rows over the whole head dim (`chunks` vectors), kHeadChunks at a time.
template <typename T, int R>
inline void weigh_values_chunks(int64_t chunks, const T* v_cache, const int64_t* slots,
                                int64_t slot_stride, int64_t offset, const float* const* probs,
                                const int64_t* visible, T* const* outs) {
  for (int64_t ch = 0; ch < chunks; ch += kHeadChunks) {
    const int64_t d = ch * kVecLanes;
    T* shifted[R];
    for (int r = 0; r < R; r++) shifted[r] = outs[r] + d;
    switch (std::min<int64_t>(kHeadChunks, chunks - ch)) {
#define SPECDEC_WEIGH(C)                                                                       \
  case C:                                                                                      \
    weigh_values<T, R, C>(v_cache, slots, slot_stride, offset + d, probs, visible, shifted); \
    break;
      SPECDEC_WEIGH(1)
      SPECDEC_WEIGH(2)
      SPECDEC_WEIGH(3)
      SPECDEC_WEIGH(4)
#undef SPECDEC_WEIGH
    }
  }
}

// Softmax over the first nv scores of a row, in place: softmax_exp_row (cpu_simd.h), then one
// multiply by the inverse.
inline void softmax_row(float* sr, int64_t nv) {
  const float inv = softmax_exp_row(sr, nv);
#pragma omp simd
  for (int64_t c = 0; c < nv; c++) sr[c] *= inv;
}

// The scaled scores of one query against 16 keys (rows of `chunks` * 16 float32 dims), into
// dst[0..15]: per key, 16 lanes of fused multiply-adds over the head dim in order, then the tree.
inline void score_keys16(const float* query, const float* const* keys, int64_t chunks, float scale,
                         float* dst) {
#if defined(__AVX512F__)
  __m512 dot[kLanes];
  for (int l = 0; l < kLanes; l++) dot[l] = _mm512_setzero_ps();
  for (int64_t ch = 0; ch < chunks; ch++) {
    const __m512 qv = _mm512_loadu_ps(query + ch * kLanes);
    for (int l = 0; l < kLanes; l++)
      dot[l] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys[l] + ch * kLanes), dot[l]);
  }
  _mm512_storeu_ps(dst, _mm512_mul_ps(sum_lanes16(dot), _mm512_set1_ps(scale)));
#else
  // 4 keys at a time: their 8 chains (lanes 0-7 and 8-15 of each) fill the FMA pipes, 16
  // registers do not hold all 32 at once
  __m256 dot[2 * kLanes], sums[2];
  for (int l0 = 0; l0 < kLanes; l0 += 4) {
    __m256 acc[8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t ch = 0; ch < chunks; ch++) {
      const __m256 lo = _mm256_loadu_ps(query + ch * kLanes), hi = _mm256_loadu_ps(query + ch * kLanes + 8);
      for (int i = 0; i < 4; i++) {
        const float* key = keys[l0 + i] + ch * kLanes;
        acc[2 * i] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(key), acc[2 * i]);
        acc[2 * i + 1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(key + 8), acc[2 * i + 1]);
      }
    }
    for (int i = 0; i < 8; i++) dot[2 * l0 + i] = acc[i];
  }
  sum_lanes16(dot, sums);
  for (int i = 0; i < 2; i++) _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(sums[i], _mm256_set1_ps(scale)));
#endif
}

// One float32 sequence's decode or verification at a long context, spread over the threads by
// keys and then by value dims instead of by KV heads (cached_attention_rows_vec sends such calls
// here).
//
// By KV heads, a lone decode of the default model (3 KV heads, 2 threads) read one head's keys
// on both threads, 4/3 of the bytes, and each head's slice of a slot is a third of the slot's
// row, so a thread read 256 of every 768 bytes: at 2,000 keys a layer's attention took 300 us
// with its cache in memory, 10 GB/s, against 31 GB/s that 2 threads stream (AVX2, 2 cores).
// Spread, 220 us; at 700 keys 129 -> 96 us; an int4 decode step at 800 keys 1.17x faster. In
// bfloat16 (keys widened to float32 on AVX2) it was 0.82-0.97x up to 1,000 keys, and a
// 9-query verification, bound by its scores' arithmetic, gained nothing. Here:
//   1. scores: each thread takes a run of whole 16-key groups and scores every row (every query
//      and query head) against them, reading each slot's keys for all heads at once;
//   2. softmax: a row on one thread;
//   3. values: units of one KV head and a slice of the head dim (a cache line of values), each
//      over all keys in order for that head's rows.
// Every score, softmax and output element goes through the functions and the order of
// cached_attention_rows_vec (score_keys16 per key, softmax_row per row, weigh_values' chain over
// the keys per output vector, which does not depend on how many vectors or rows a call holds), so
// a row gets the same bits whichever path its call takes.
constexpr int64_t kSpreadKeys = 512;     // contexts from which a lone sequence is spread
constexpr int64_t kSpreadQueries = 16;   // and queries up to which (decodes, verifications)

template <typename T>
void cached_attention_spread(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache,
                             const int64_t* query_index, const int64_t* slots, int64_t q_len,
                             int64_t c_len, T* out, int64_t width, int64_t kv_heads,
                             int64_t share, int64_t head_dim, float scale) {
  const int64_t heads = kv_heads * share, chunks = head_dim / kLanes;
  const int64_t slot_stride = kv_heads * head_dim, out_stride = heads * head_dim;
  const int64_t padded = (c_len + kLanes - 1) / kLanes * kLanes;
  const int64_t rows = heads * q_len;  // row r: query head r / q_len, query r % q_len
  for (int64_t j = q_len; j < width; j++)  // padding queries
    for (int64_t d = 0; d < out_stride; d++) out[j * out_stride + d] = static_cast<T>(0.0f);
  std::unique_ptr<float[]> queries(new float[rows * head_dim]);
  std::unique_ptr<float[]> scores(new float[rows * padded]);
  std::vector<int64_t> visible(rows);
  std::vector<const float*> probs(rows);
  std::vector<T*> outs(rows);
  for (int64_t r = 0; r < rows; r++) {
    const int64_t qh = r / q_len, j = r % q_len;
    visible[r] = c_len - q_len + j + 1;
    const T* qr = q + query_index[j] * q_row_stride + qh * head_dim;
    for (int64_t d = 0; d < head_dim; d++) queries[r * head_dim + d] = load(qr, d);
    probs[r] = scores.get() + r * padded;
    outs[r] = out + j * out_stride + qh * head_dim;
  }

  // 1. scores, by runs of 16-key groups
  const int64_t row_bytes = slot_stride * static_cast<int64_t>(sizeof(T));
  at::parallel_for(0, padded / kLanes, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> converted(kv_heads * kLanes * head_dim);
    std::vector<const float*> key_rows(kv_heads * kLanes);
    for (int64_t group = begin; group < end; group++) {
      const int64_t c0 = group * kLanes, n = std::min<int64_t>(kLanes, c_len - c0);
      for (int64_t c = c0 + kPrefetch; c < std::min(c_len, c0 + kPrefetch + kLanes); c++)
        for (int64_t b = 0; b < row_bytes; b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(k_cache + slots[c] * slot_stride) + b, _MM_HINT_T0);
      for (int64_t h = 0; h < kv_heads; h++)
        for (int64_t l = 0; l < kLanes; l++) {  // past the last key, the last key again
          const T* key = k_cache + slots[c0 + std::min(l, n - 1)] * slot_stride + h * head_dim;
          if constexpr (std::is_same_v<T, float>) {
            key_rows[h * kLanes + l] = key;
          } else {
            float* row = converted.data() + (h * kLanes + l) * head_dim;
            for (int64_t i = 0; i < head_dim; i += kVecLanes) vec_store(row + i, vec_load(key + i));
            key_rows[h * kLanes + l] = row;
          }
        }
      for (int64_t r = 0; r < rows; r++)
        if (c0 < visible[r])
          score_keys16(queries.get() + r * head_dim, key_rows.data() + r / q_len / share * kLanes,
                       chunks, scale, scores.get() + r * padded + c0);
    }
  });
  // 2. softmax
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) softmax_row(scores.get() + r * padded, visible[r]);
  });
  // 3. values: a unit is a KV head and `piece` vectors of its dims (a cache line, at most 3
  // vectors: the cases below), for the head's share * q_len rows, kFloatValueRows at a time
  static_assert(kFloatValueRows == 4, "the cases below take up to 4 rows");
  const int64_t vectors = head_dim / kVecLanes;
  const int64_t line = 64 / (kVecLanes * static_cast<int64_t>(sizeof(T)));
  const int64_t piece = std::clamp<int64_t>(line, 1, std::min<int64_t>(kHeadChunks, 3));
  const int64_t pieces = (vectors + piece - 1) / piece, head_rows = share * q_len;
  at::parallel_for(0, kv_heads * pieces, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; unit++) {
      const int64_t h = unit / pieces, first = (unit % pieces) * piece;
      const int64_t count = std::min(piece, vectors - first), d = first * kVecLanes;
      for (int64_t r0 = h * head_rows; r0 < (h + 1) * head_rows; r0 += kFloatValueRows) {
        T* shifted[kFloatValueRows];
        const int64_t n = std::min(kFloatValueRows, (h + 1) * head_rows - r0);
        for (int64_t r = 0; r < n; r++) shifted[r] = outs[r0 + r] + d;
        const float* const* p = probs.data() + r0;
        const int64_t* seen = visible.data() + r0;
        const int64_t offset = h * head_dim + d;
#define SPECDEC_UNIT(R, C)                                                            \
  if (n == R && count == C) {                                                         \
    weigh_values<T, R, C, true>(v_cache, slots, slot_stride, offset, p, seen, shifted); \
    continue;                                                                         \
  }
        SPECDEC_UNIT(1, 1) SPECDEC_UNIT(1, 2) SPECDEC_UNIT(1, 3)
        SPECDEC_UNIT(2, 1) SPECDEC_UNIT(2, 2) SPECDEC_UNIT(2, 3)
        SPECDEC_UNIT(3, 1) SPECDEC_UNIT(3, 2) SPECDEC_UNIT(3, 3)
        SPECDEC_UNIT(4, 1) SPECDEC_UNIT(4, 2) SPECDEC_UNIT(4, 3)
#undef SPECDEC_UNIT
      }
    }
  });
}

template <typename T>
void cached_attention_rows_vec(const T* q, int64_t q_row_stride, const T* k_cache,
                                  const T* v_cache, const int64_t* query_index,
                                  const int64_t* key_slots, const int64_t* q_len,
                                  const int64_t* c_len, T* out, int64_t groups, int64_t width,
                                  int64_t context, int64_t kv_heads, int64_t share,
                                  int64_t head_dim, float scale) {
  if (std::is_same_v<T, float> && groups == 1 && width <= kSpreadQueries && c_len[0] >= kSpreadKeys &&
      at::get_num_threads() > 1) {
    cached_attention_spread(q, q_row_stride, k_cache, v_cache, query_index, key_slots, q_len[0],
                            c_len[0], out, width, kv_heads, share, head_dim, scale);
    return;
  }
  const int64_t tiles = (width + kQueryTile - 1) / kQueryTile;
  const int64_t heads = kv_heads * share, chunks = head_dim / kLanes;
  const int64_t units = groups * tiles * heads;
  const int64_t slot_stride = kv_heads * head_dim, out_stride = heads * head_dim;
  const int64_t padded_context = (context + kLanes - 1) / kLanes * kLanes;
  const int64_t max_rows = share * std::min(width, kQueryTile);
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(max_rows * head_dim), keys(kLanes * head_dim);
    // locals, not the captured references and the vector: GCC reloaded both from memory after
    // every store of the keys' conversion loop (a bf16 decode at 1,200 keys: 70 -> 62 us a layer)
    const int64_t dim = head_dim;
    float* const key_buffer = keys.data();
    std::unique_ptr<float[]> scores(new float[max_rows * padded_context]);  // rows' scores
    std::vector<int64_t> visible(max_rows);
    std::vector<const float*> key_rows(kLanes);
    std::vector<const float*> probs(max_rows);
    std::vector<T*> outs(max_rows);
    for (int64_t first = begin; first < end;) {  // units first .. last - 1: one item
      // tiles 0, last, 1, last - 1, ... (as the bf16 paths take them): a causal prompt's later
      // tiles see more keys; in plain order the second of 2 threads did 3x the first's work
      const int64_t qh0 = first % heads, t = (first / heads) % tiles;
      const int64_t tile = t % 2 == 0 ? t / 2 : tiles - 1 - t / 2;
      const int64_t g = first / (heads * tiles), h = qh0 / share;
      const int64_t last = std::min(end, first - qh0 + (h + 1) * share);
      const int64_t qh1 = qh0 + (last - first);  // query heads qh0 .. qh1 - 1 of KV head h
      first = last;
      const int64_t j0 = tile * kQueryTile, j1 = std::min(width, j0 + kQueryTile);
      const int64_t real_end = std::min(j1, q_len[g]);  // queries past q_len[g] are padding
      T* out_g = out + g * width * out_stride;  // query j, head qh: + j * out_stride + qh * dim
      for (int64_t j = std::max(j0, real_end); j < j1; j++)
        for (int64_t d = qh0 * head_dim; d < qh1 * head_dim; d++)
          out_g[j * out_stride + d] = static_cast<T>(0.0f);
      if (real_end <= j0) continue;
      int64_t rows = 0, seen = 0;  // row r: one query head and one query
      for (int64_t qh = qh0; qh < qh1; qh++)
        for (int64_t j = j0; j < real_end; j++, rows++) {
          visible[rows] = c_len[g] - q_len[g] + j + 1;
          seen = std::max(seen, visible[rows]);
          const T* qr = q + query_index[g * width + j] * q_row_stride + qh * head_dim;
          for (int64_t d = 0; d < head_dim; d++) queries[rows * head_dim + d] = load(qr, d);
          probs[rows] = scores.get() + rows * padded_context;
          outs[rows] = out_g + j * out_stride + qh * head_dim;
        }
      const int64_t* slots = key_slots + g * context;
      const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(T));
      for (int64_t c = 0; c < std::min(seen, kPrefetch); c++)  // the first blocks' rows
        for (int64_t b = 0; b < row_bytes; b += 64) {
          const int64_t at = slots[c] * slot_stride + h * head_dim;
          _mm_prefetch(reinterpret_cast<const char*>(k_cache + at) + b, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(v_cache + at) + b, _MM_HINT_T1);
        }
      for (int64_t c0 = 0; c0 < seen; c0 += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, seen - c0);
        // The cache is read by slot, one head's slice of each: too scattered for the hardware
        // prefetchers (a cold float32 decode read it at 12 GB/s). Ask for the keys kPrefetch
        // ahead, and for the values into L2, where the pass over the values finds them.
        for (int64_t c = c0 + kPrefetch; c < std::min(seen, c0 + kPrefetch + kLanes); c++) {
          const int64_t at = slots[c] * slot_stride + h * head_dim;
          for (int64_t b = 0; b < row_bytes; b += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(k_cache + at) + b, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(v_cache + at) + b, _MM_HINT_T1);
          }
        }
        for (int64_t l = 0; l < kLanes; l++) {  // keys c0 .. c0 + 15, as float32 rows
          const T* key = k_cache + slots[c0 + std::min(l, n - 1)] * slot_stride + h * dim;
          if constexpr (std::is_same_v<T, float>) {
            key_rows[l] = key;  // read in place
          } else {
            float* row = key_buffer + l * dim;
            for (int64_t i = 0; i < dim; i += kVecLanes) vec_store(row + i, vec_load(key + i));
            key_rows[l] = row;
          }
        }
        for (int64_t r = 0; r < rows; r++)
          if (c0 < visible[r])
            score_keys16(queries.data() + r * head_dim, key_rows.data(), chunks, scale,
                         scores.get() + r * padded_context + c0);
      }
      for (int64_t r = 0; r < rows; r++) softmax_row(scores.get() + r * padded_context, visible[r]);
      for (int64_t r = 0; r < rows; r += kFloatValueRows) {
        const float* const* p = probs.data() + r;
        switch (std::min<int64_t>(kFloatValueRows, rows - r)) {
#define SPECDEC_ROWS(R)                                                                      \
  case R:                                                                                    \
    weigh_values_chunks<T, R>(head_dim / kVecLanes, v_cache, slots, slot_stride, h * head_dim, p, \
                              visible.data() + r, outs.data() + r);                          \
    break;
          SPECDEC_ROWS(1)
          SPECDEC_ROWS(2)
          SPECDEC_ROWS(3)
          SPECDEC_ROWS(4)
#undef SPECDEC_ROWS
        }
      }
    }
  });
}
#endif

#if defined(__AVX512BF16__)
// bfloat16 attention with the scores on vdpbf16ps (head dims that are a multiple of 32), for CPUs
// without AMX (with it, cpu_attention.cpp's tiles run instead, with bits of their own). A work
// item is one sequence, one KV head and a tile of its queries, with the `share` query heads of
// that KV head as rows of the tile (or, when there are too few items to keep every thread busy,
// one query head), so that each key is read and rearranged once for all of them. Keys are taken
// 16 at a time and transposed into pairs, [dim / 2][16 keys] of 32-bit words, so one vdpbf16ps
// adds a query's products for one pair of dims to 16 keys' scores at once: a score is the chain
// over its pairs in order (vdpbf16ps rounds each product into the sum, odd dim first), the first
// half of the pairs and the second in two chains added at the end, and nothing depends on the
// tile, the item or the batch. Softmax and the weighted values are those of the float32 path.
constexpr int64_t kScoreRows = 4;  // rows whose chains interleave (two chains each)
constexpr int64_t kMaxPairs = 128;  // head dims up to 256
constexpr int64_t kValueRows = 6;   // rows per pass over the values: 6 x 4 sums + 4 value pairs
constexpr int64_t kNarrowWidth = 4;  // queries a sequence at most, and keys per query at least,
constexpr int64_t kKeysPerRow = 160;  // for items of a KV head (see cached_attention_bf16)

// The scores of R rows against the 16 keys whose pairs are in kt ([pairs][16]), scaled.
template <int R>
inline void pair_scores(const int32_t* const* queries, const __m512i* kt, int64_t pairs,
                        float scale, float* const* out) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_ps();
  const int64_t half = pairs / 2;
  for (int64_t p = 0; p < half; p++)
    for (int r = 0; r < R; r++) {
      lo[r] = _mm512_dpbf16_ps(lo[r], (__m512bh)_mm512_set1_epi32(queries[r][p]), (__m512bh)kt[p]);
      hi[r] = _mm512_dpbf16_ps(hi[r], (__m512bh)_mm512_set1_epi32(queries[r][half + p]),
                               (__m512bh)kt[half + p]);
    }
  for (int r = 0; r < R; r++)
    _mm512_storeu_ps(out[r], _mm512_mul_ps(_mm512_add_ps(lo[r], hi[r]), _mm512_set1_ps(scale)));
}

// out[r] = the probabilities of row r (bf16, in key pairs) times the values, for R rows and the
// 64 dims from `offset`: one vdpbf16ps per row, key pair and 16 dims. The values of keys c and
// c + 1 are interleaved by dim (unpack), so each sum is the chain over the key pairs in order.
// Row r takes the first pairs[r] pairs (its last key's partner has probability zero).
template <int R>
inline void weigh_value_pairs(const BFloat16* v_cache, const int64_t* slots, int64_t seen,
                              int64_t slot_stride, int64_t offset, const int32_t* const* probs,
                              const int64_t* pairs, BFloat16* const* outs) {
  __m512 acc[R][4];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
  const int64_t last = pairs[R - 1];  // rows see more keys as they go
  for (int64_t kp = 0; kp < last; kp++) {
    const int64_t c0 = 2 * kp, c1 = std::min(2 * kp + 1, seen - 1);  // past the end: weight 0
    const BFloat16* a = v_cache + slots[c0] * slot_stride + offset;
    const BFloat16* b = v_cache + slots[c1] * slot_stride + offset;
    const __m512i a0 = _mm512_loadu_si512(a), a1 = _mm512_loadu_si512(a + 32);
    const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 32);
    const __m512i v[4] = {_mm512_unpacklo_epi16(a0, b0), _mm512_unpackhi_epi16(a0, b0),
                          _mm512_unpacklo_epi16(a1, b1), _mm512_unpackhi_epi16(a1, b1)};
    for (int r = 0; r < R; r++) {
      if (kp >= pairs[r]) continue;
      const __m512bh p = (__m512bh)_mm512_set1_epi32(probs[r][kp]);
      for (int i = 0; i < 4; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], p, (__m512bh)v[i]);
    }
  }
  // unpack left dims 8L..8L+3 of each 128-bit lane L in the low vector, 8L+4..8L+7 in the high
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second =
      _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int r = 0; r < R; r++)
    for (int half = 0; half < 2; half++) {
      const __m512 lo = acc[r][2 * half], hi = acc[r][2 * half + 1];
      BFloat16* o = outs[r] + 32 * half;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, first, hi)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, second, hi)));
    }
}

template <typename T>
void cached_attention_bf16(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache,
                           const int64_t* query_index, const int64_t* key_slots,
                           const int64_t* q_len, const int64_t* c_len, T* out, int64_t groups, int64_t width, int64_t context,
                           int64_t kv_heads, int64_t share, int64_t head_dim, float scale) {
  static_assert(std::is_same_v<T, BFloat16>, "bfloat16 only");
  if (cached_attention_amx(q, q_row_stride, k_cache, v_cache, query_index, key_slots, q_len, c_len,
                           out, groups, width, context, kv_heads, share, head_dim, scale))
    return;  // AMX tiles, where the CPU has them (cpu_attention.cpp)
  const int64_t tiles = (width + kQueryTile - 1) / kQueryTile;
  const int64_t heads = kv_heads * share, pairs = head_dim / 2;
  // An item is a tile of one sequence's queries with every head, so that each cached key slot
  // (all KV heads side by side) is read from memory once; where that leaves fewer than four
  // items per thread, one KV head, or one query head, per item.
  const int64_t threads = at::get_num_threads();
  int64_t split = 1;  // parts per (sequence, tile): 1, kv_heads or heads
  if (groups * tiles < 4 * threads) split = groups * tiles * kv_heads < 4 * threads ? heads : kv_heads;
  // An item of one query head transposes its KV head's keys once per query head, `share` times
  // in all: an even spread over the threads that pays only while the keys are few or the rows
  // per item many. Past kKeysPerRow keys a row, a few rows are done per KV head instead (a
  // lone decode of the default model, 3 KV heads and 9 query heads on 2 threads, attended 361
  // and 1,000 keys 1.4x and 1.65x faster so; 2 rows 1.2x at 1,000; 128 keys the same).
  if (split == heads && width <= kNarrowWidth && context >= kKeysPerRow * width) split = kv_heads;
  const int64_t items = groups * tiles * split;
  const int64_t item_heads = split == heads ? 1 : share;  // query heads per KV head of an item
  const int64_t item_kv = split == 1 ? kv_heads : 1;     // KV heads of an item
  const int64_t slot_stride = kv_heads * head_dim;
  const int64_t padded_context = (context + kLanes - 1) / kLanes * kLanes;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    // Sized to the call (a decode's 3 rows, not a tile's 48) and left uninitialised: every
    // entry read is written first. Zeroed buffers of a tile's size cost decodes a third of
    // their time (fresh pages to fault in and clear on every call).
    const int64_t max_rows = std::min(kQueryTile, width) * item_heads;
    std::unique_ptr<float[]> scores(new float[max_rows * padded_context]);
    std::unique_ptr<uint16_t[]> probs16(new uint16_t[max_rows * padded_context]);
    std::vector<int64_t> visible(max_rows);
    std::vector<float> inverse(max_rows);
    std::vector<const int32_t*> queries(max_rows);
    std::vector<BFloat16*> outputs(max_rows);
    std::vector<const int32_t*> prob_rows(max_rows);
    std::vector<int64_t> pair_count(max_rows);
    __m512i kt[kMaxPairs];
    for (int64_t item = begin; item < end; item++)
    for (int64_t kv = 0; kv < item_kv; kv++) {
      const int64_t part = item % split, g = item / (split * tiles);
      // tiles in the order 0, last, 1, last - 1, ...: a later tile of a causal prompt sees more
      // keys, and the threads' contiguous shares of the items then cost about the same
      const int64_t t = (item / split) % tiles, tile = t % 2 == 0 ? t / 2 : tiles - 1 - t / 2;
      const int64_t h = split == 1 ? kv : (split == kv_heads ? part : part / share);
      const int64_t head0 = split == heads ? part : h * share;  // the first query head
      const int64_t j0 = tile * kQueryTile, j1 = std::min(width, j0 + kQueryTile);
      const int64_t real_end = std::min(j1, q_len[g]);  // queries past q_len[g] are padding
      for (int64_t j = std::max(j0, real_end); j < j1; j++)
        for (int64_t i = 0; i < item_heads; i++)
          std::fill_n(out + ((g * width + j) * heads + head0 + i) * head_dim, head_dim,
                      BFloat16(0.0f));
      if (real_end <= j0) continue;
      const int64_t rows = (real_end - j0) * item_heads;  // row r: query j0 + r / item_heads
      for (int64_t r = 0; r < rows; r++) {
        const int64_t j = j0 + r / item_heads, qh = head0 + r % item_heads;
        visible[r] = c_len[g] - q_len[g] + j + 1;
        queries[r] = reinterpret_cast<const int32_t*>(q + query_index[g * width + j] * q_row_stride +
                                                      qh * head_dim);
        outputs[r] = out + ((g * width + j) * heads + qh) * head_dim;
      }
      const int64_t seen = visible[rows - 1];  // the last query sees the most keys
      const int64_t* slots = key_slots + g * context;
      // The next 16 keys' and values' rows are prefetched into L2 while these are scored: the
      // block table scatters a sequence over the pool, beyond the hardware prefetcher's reach.
      // An item of every head fetches whole slots on its first KV head, for the others too.
      const bool fetch = split != 1 || kv == 0;
      const int64_t fetch_offset = split == 1 ? 0 : h * head_dim;
      const int64_t fetch_bytes = (split == 1 ? slot_stride : head_dim) * 2;
      for (int64_t c0 = 0; c0 < seen; c0 += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, seen - c0);
        if (fetch)
          for (int64_t c = c0 + kLanes; c < std::min(seen, c0 + 2 * kLanes); c++)
            for (int64_t byte = 0; byte < fetch_bytes; byte += 64) {
              _mm_prefetch(reinterpret_cast<const char*>(k_cache + slots[c] * slot_stride + fetch_offset) + byte, _MM_HINT_T1);
              _mm_prefetch(reinterpret_cast<const char*>(v_cache + slots[c] * slot_stride + fetch_offset) + byte, _MM_HINT_T1);
            }
        for (int64_t b = 0; b < pairs; b += kLanes) {  // 16 pairs of 16 keys at a time
          __m512i block[kLanes];
          for (int64_t l = 0; l < kLanes; l++) {
            const BFloat16* key = k_cache + slots[c0 + std::min(l, n - 1)] * slot_stride + h * head_dim;
            block[l] = _mm512_loadu_si512(key + 2 * b);
          }
          transpose16(block);
          for (int64_t i = 0; i < kLanes; i++) kt[b + i] = block[i];
        }
        int64_t first = 0;  // rows that see none of these keys are skipped
        while (first < rows && visible[first] <= c0) first++;
        for (int64_t r = first; r < rows; r += kScoreRows) {
          float* dst[kScoreRows];
          const int64_t count = std::min<int64_t>(kScoreRows, rows - r);
          for (int64_t i = 0; i < count; i++) dst[i] = scores.get() + (r + i) * padded_context + c0;
          switch (count) {
            case 4: pair_scores<4>(queries.data() + r, kt, pairs, scale, dst); break;
            case 3: pair_scores<3>(queries.data() + r, kt, pairs, scale, dst); break;
            case 2: pair_scores<2>(queries.data() + r, kt, pairs, scale, dst); break;
            default: pair_scores<1>(queries.data() + r, kt, pairs, scale, dst); break;
          }
        }
      }
      for (int64_t r = 0; r < rows; r++) inverse[r] = softmax_exp_row(scores.get() + r * padded_context, visible[r]);
      // Probabilities rounded to bf16 (as transformers' eager attention rounds them before
      // the product with the values), in key pairs, zero past each row's last key.
      for (int64_t r = 0; r < rows; r++) {
        const float* sr = scores.get() + r * padded_context;
        uint16_t* pr = probs16.get() + r * padded_context;
        const int64_t nv = visible[r];
        const __m512 inv = _mm512_set1_ps(inverse[r]);  // softmax_row's normalising multiply
        for (int64_t c = 0; c < nv; c += kLanes) {
          const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail_mask(nv - c), sr + c), inv);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + c), (__m256i)_mm512_cvtneps_pbh(p));
        }
        if (nv % 2) pr[nv] = 0;  // the partner of an odd row's last key
        pair_count[r] = (nv + 1) / 2;
        prob_rows[r] = reinterpret_cast<const int32_t*>(pr);
      }
      for (int64_t piece = 0; piece < head_dim; piece += 64) {
        for (int64_t r = 0; r < rows; r += kValueRows) {
          BFloat16* dst[kValueRows];
          const int64_t count = std::min<int64_t>(kValueRows, rows - r);
          for (int64_t i = 0; i < count; i++) dst[i] = outputs[r + i] + piece;
          const int64_t offset = h * head_dim + piece;
          switch (count) {
#define SPECDEC_ROWS(R)                                                                   \
  case R:                                                                                 \
    weigh_value_pairs<R>(v_cache, slots, seen, slot_stride, offset, prob_rows.data() + r, \
                         pair_count.data() + r, dst);                                     \
    break;
            SPECDEC_ROWS(1)
            SPECDEC_ROWS(2)
            SPECDEC_ROWS(3)
            SPECDEC_ROWS(4)
            SPECDEC_ROWS(5)
            SPECDEC_ROWS(6)
#undef SPECDEC_ROWS
          }
        }
      }
    }
  });
}
#endif

// Write each token's key and value rows into the cache at its slot.
template <typename T>
void write_kv_rows(const T* k, const T* v, int64_t k_stride, int64_t v_stride, T* k_cache,
                   T* v_cache, const int64_t* slots, int64_t tokens, int64_t row) {
  for (int64_t t = 0; t < tokens; t++) {
    std::copy(k + t * k_stride, k + t * k_stride + row, k_cache + slots[t] * row);
    std::copy(v + t * v_stride, v + t * v_stride + row, v_cache + slots[t] * row);
  }
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [rows, features]");
  TORCH_CHECK(t.stride(1) == 1, name, "'s rows must be contiguous");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

void check_like(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be contiguous on the CPU");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have the input's dtype");
}

}  // namespace

// The ops, called from Python and from the decoder stack (cpu_stack.cpp).

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  check_like(weight, x, "weight");
  TORCH_CHECK(weight.numel() == x.size(1), "weight must have one entry per feature");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                  x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

torch::Tensor add_rms_norm_(torch::Tensor& residual, const torch::Tensor& x,
                            const torch::Tensor& weight, double eps) {
  check_rows(residual, "residual");
  TORCH_CHECK(residual.is_contiguous(), "residual must be contiguous");
  check_like(x, residual, "x");
  check_like(weight, residual, "weight");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x must have the residual's shape");
  TORCH_CHECK(weight.numel() == x.size(1), "weight must have one entry per feature");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm_", [&] {
    add_rms_norm_rows(residual.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                      weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                      x.size(1), static_cast<float>(eps));
  });
  return out;
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.is_contiguous(), "gate_up must be contiguous");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must hold gate and up halves");
  const int64_t n = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), n}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), n);
  });
  return out;
}

void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
           int64_t head_dim) {
  check_rows(x, "x");
  check_like(cos, x, "cos");
  check_like(sin, x, "sin");
  TORCH_CHECK(head_dim % 2 == 0 && heads * head_dim <= x.size(1), "heads do not fit the rows");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == head_dim &&
                  sin.sizes() == cos.sizes(),
              "cos and sin must be [rows, head_dim]");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rope_", [&] {
    rope_rows(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
              x.size(0), x.stride(0), heads, head_dim);
  });
}

void write_kv_(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
               torch::Tensor& v_cache, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must be [tokens, kv_heads, dim]");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
                  v.stride(1) == v.size(2),
              "each token's k and v heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "the caches must be contiguous and alike");
  TORCH_CHECK(k_cache.scalar_type() == k.scalar_type() && v.scalar_type() == k.scalar_type(),
              "k, v and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0),
              "slot_mapping must be int64 with one slot per token");
  const int64_t row = k.size(1) * k.size(2);
  TORCH_CHECK(k_cache.numel() % row == 0 && k_cache.size(-1) * k_cache.size(-2) == row,
              "cache rows must hold kv_heads * dim values");
  const int64_t slots = k_cache.numel() / row;
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); t++)
    TORCH_CHECK(sm[t] >= 0 && sm[t] < slots, "slot ", sm[t], " is outside the cache");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, k.scalar_type(), "write_kv_", [&] {
    write_kv_rows(k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), k.stride(0), v.stride(0),
                  k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), sm, k.size(0), row);
  });
}

torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& query_index,
                               const torch::Tensor& key_slots, const torch::Tensor& q_len,
                               const torch::Tensor& c_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [tokens, heads, dim] with contiguous heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "the caches must be contiguous [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  for (const auto* t : {&query_index, &key_slots, &q_len, &c_len})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices must be int64");
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && heads % kv_heads == 0, "head shapes do not match");
  const int64_t groups = query_index.size(0), width = query_index.size(1);
  const int64_t context = key_slots.size(1);
  TORCH_CHECK(key_slots.size(0) == groups && q_len.numel() == groups && c_len.numel() == groups,
              "one row of indices per sequence");
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const int64_t *ql = q_len.data_ptr<int64_t>(), *cl = c_len.data_ptr<int64_t>();
  const int64_t *qi = query_index.data_ptr<int64_t>(), *ks = key_slots.data_ptr<int64_t>();
  for (int64_t g = 0; g < groups; g++) {
    TORCH_CHECK(ql[g] >= 1 && ql[g] <= width && cl[g] >= ql[g] && cl[g] <= context,
                "sequence ", g, " has bad query or context lengths");
    for (int64_t j = 0; j < ql[g]; j++)
      TORCH_CHECK(qi[g * width + j] >= 0 && qi[g * width + j] < q.size(0), "bad query index");
    for (int64_t c = 0; c < cl[g]; c++)
      TORCH_CHECK(ks[g * context + c] >= 0 && ks[g * context + c] < slots, "bad key slot");
  }
  auto out = torch::empty({groups, width, heads, head_dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "cached_attention", [&] {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<scalar_t, BFloat16>) if (head_dim % 64 == 0 && head_dim <= 2 * kMaxPairs) {
      cached_attention_bf16<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
                            v_cache.data_ptr<scalar_t>(), qi, ks, ql, cl,
                            out.data_ptr<scalar_t>(), groups, width, context, kv_heads,
                            heads / kv_heads, head_dim, static_cast<float>(scale));
      return;
    }
#endif
#if SPECDEC_VECTOR
    if constexpr (kVectorised<scalar_t>) if (head_dim % kLanes == 0) {
      cached_attention_rows_vec(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
                                v_cache.data_ptr<scalar_t>(), qi, ks, ql, cl,
                                out.data_ptr<scalar_t>(), groups, width, context, kv_heads,
                                heads / kv_heads, head_dim, static_cast<float>(scale));
      return;
    }
#endif
    cached_attention_rows(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
                          v_cache.data_ptr<scalar_t>(), qi, ks, ql, cl,
                          out.data_ptr<scalar_t>(), groups, width, context, kv_heads,
                          heads / kv_heads, head_dim, static_cast<float>(scale));
  });
  return out;
}

// cpu_sampling.cpp
torch::Tensor exponential_noise(const torch::Tensor& keys, int64_t vocab);
torch::Tensor noise_uniforms(const torch::Tensor& keys, int64_t vocab);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "weight * RMSNorm(x), per row");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place; weight * RMSNorm(residual)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for rows [gate | up]");
  m.def("rope_", &rope_, "rotate the first `heads` heads of each row in place");
  m.def("pack_pairs", &pack_pairs, "a bf16 [out, in] weight in the pair layout of linear_pairs (1-D)");
  m.def("linear_pairs", &linear_pairs, "x @ weight.T + bias for bf16 rows, weight packed");
  m.def("pack_lanes", &pack_lanes, "a float32 [out, in] weight in the lane layout of linear_lanes (1-D)");
  m.def("linear_lanes", &linear_lanes, "x @ weight.T + bias for float32 rows, weight packed");
  m.def("quant_linear", &quant_linear, "x @ dequant(w).T + bias, w int4/int8 in groups of 32, x float or int8");
  m.def("write_kv_", &write_kv_, "store each token's k and v rows at its cache slot");
  m.def("cached_attention", &cached_attention, "a padded group's attention to cached keys");
  m.def("exponential_noise", &exponential_noise, "Exp(1) noise [keys, vocab], counter-based");
  m.def("noise_uniforms", &noise_uniforms, "the uniforms behind exponential_noise, float64");
  register_decoder_stack(m);
}
