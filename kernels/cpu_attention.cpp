// bfloat16 attention on AMX tiles: cached_attention's path on CPUs with AMX-BF16 (see cpu_ops.cpp
// for the others).
//
// The vdpbf16ps kernel spends most of a long prompt's time on its dot products and on turning
// keys around so that one instruction scores 16 keys. Here the tile unit does both products:
//
//   scores   S^T = K Q^T: tile A is 16 cached keys as they lie in the cache (32 dims per tile),
//            tile B the rows' query dims in pairs, built once per work item; so keys are never
//            rearranged, and the 16 x n scores come back transposed (one 16 x 16 transpose).
//   values   O = P V: tile A is the rows' bf16 probabilities, 32 keys as they lie, tile B the
//            values of those keys interleaved by pairs of keys (one vpermt2w per pair and 16
//            dims), accumulated over the keys in order in four 16-dim output tiles.
//
// Softmax between the two is softmax_exp_row's, and probabilities are rounded to bf16 as the
// vector kernel rounds them.
//
// Batch invariance. The tile unit's bf16 dot product is not the chain of roundings vdpbf16ps
// makes (it keeps more of the products' bits), so this path's bits differ from the vector
// kernel's; a process takes one of them for every call. What invariance needs holds here, and
// was checked on the hardware before this was written: an element of a tile product depends
// on its row of A and its column of B alone, not on the tile's row or column count nor on
// which operand holds the keys. A query's scores are then those of its own query and keys, and
// its output the chain over blocks of 32 keys from key 0, whichever work item, tile or step
// holds it; keys it does not see have probability zero (and the values past the last key are
// written as zeros, so no stale slot can make a NaN).

#include <torch/extension.h>

#include "cpu_simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace {

using namespace specdec_cpu;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

constexpr int64_t kRows = 16;      // (query, head) rows per work item: a tile's columns, then rows
constexpr int64_t kKeys = 16;      // keys per score tile
constexpr int64_t kKeyPairs = 32;  // keys per probability tile, 16 pairs
constexpr int64_t kPiece = 64;     // output dims per pass over the values, four 16-dim tiles

// Scores: tile 0 = S^T [16 keys][n rows] float32; 1-2 = keys [16][32 dims]; 3-4 = the rows'
// queries [16 dim pairs][n rows] (two of each so that loads overlap the products).
inline void configure_scores(int64_t n) {
  TileConfig cfg;
  cfg.rows[0] = kKeys, cfg.colsb[0] = static_cast<uint16_t>(n * 4);
  for (int t = 1; t <= 2; t++) cfg.rows[t] = kKeys, cfg.colsb[t] = 64;
  for (int t = 3; t <= 4; t++) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(n * 4);
  _tile_loadconfig(&cfg);
}

// Values: tiles 0-3 = O [n rows][16 dims] float32; 4 = P [n rows][32 keys]; 5-6 = values
// [16 key pairs][16 dims x 2].
inline void configure_values(int64_t n) {
  TileConfig cfg;
  for (int t = 0; t <= 4; t++) cfg.rows[t] = static_cast<uint8_t>(n), cfg.colsb[t] = 64;
  for (int t = 5; t <= 6; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// True when keys c0 .. c0 + 15 sit in 16 consecutive slots (one block of 16 or more, or
// consecutive smaller ones), so that a tile reads them in place.
inline bool consecutive(const int64_t* slots) {
  const __m512i first = _mm512_set1_epi64(slots[0]);
  const __m512i step0 = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i step1 = _mm512_set_epi64(15, 14, 13, 12, 11, 10, 9, 8);
  const __mmask8 lo = _mm512_cmpeq_epi64_mask(_mm512_loadu_si512(slots), _mm512_add_epi64(first, step0));
  const __mmask8 hi =
      _mm512_cmpeq_epi64_mask(_mm512_loadu_si512(slots + 8), _mm512_add_epi64(first, step1));
  return lo == 0xFF && hi == 0xFF;
}

void attention_amx(const BFloat16* q, int64_t q_row_stride, const BFloat16* k_cache,
                   const BFloat16* v_cache, const int64_t* query_index, const int64_t* key_slots,
                   const int64_t* q_len, const int64_t* c_len, BFloat16* out, int64_t groups,
                   int64_t width, int64_t context, int64_t kv_heads, int64_t share,
                   int64_t head_dim, float scale) {
  const int64_t heads = kv_heads * share, pairs = head_dim / 2;
  const int64_t slot_stride = kv_heads * head_dim;
  // A work item is one sequence, one KV head and 16 of its rows, a row being a query and one of
  // the KV head's query heads (query-major), so each key is read once for the heads that share
  // it. Where that leaves a thread idle (one KV head, one sequence), one query head per item.
  const int64_t threads = at::get_num_threads();
  int64_t parts = kv_heads, item_heads = share;
  if (groups * kv_heads * ((width * share + kRows - 1) / kRows) < threads) parts = heads, item_heads = 1;
  const int64_t tiles = (width * item_heads + kRows - 1) / kRows;
  const int64_t items = groups * parts * tiles;
  const int64_t padded = (context + kKeyPairs - 1) / kKeyPairs * kKeyPairs;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    // sized to the call and left uninitialised: every entry read is written first
    const int64_t max_rows = std::min(kRows, width * item_heads);
    std::unique_ptr<float[]> scores(new float[max_rows * padded]);
    std::unique_ptr<uint16_t[]> probs(new uint16_t[max_rows * padded]);
    alignas(64) int32_t query_pairs[128 * kRows];  // [pair][16 rows], head dims <= 256
    alignas(64) float sums[kKeys * kRows];                 // a score tile, [16 keys][16]
    alignas(64) uint16_t keys[kKeys * 256];                // gathered keys, [16][head_dim]
    alignas(64) uint16_t values[4][16 * 32];               // [16 dims][16 key pairs x 2]
    alignas(64) float mixed[kRows * kPiece];               // an output piece, [n rows][64]
    int64_t visible[kRows];
    BFloat16* rows_out[kRows];
    const __m512i low_dims = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41,
                                              9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2,
                                              33, 1, 32, 0);
    const __m512i high_dims = _mm512_add_epi16(low_dims, _mm512_set1_epi16(16));
    const __m512i gather_index = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
    for (int64_t item = begin; item < end; item++) {
      const int64_t part = item % parts, g = item / (parts * tiles);
      // tiles in the order 0, last, 1, last - 1, ...: a later tile of a causal prompt sees more
      // keys, and the threads' contiguous shares of the items then cost about the same
      const int64_t t = (item / parts) % tiles, tile = t % 2 == 0 ? t / 2 : tiles - 1 - t / 2;
      const int64_t h = item_heads == share ? part : part / share;
      const int64_t head0 = item_heads == share ? part * share : part;
      const int64_t i0 = tile * kRows, i1 = std::min(width * item_heads, i0 + kRows);
      const int64_t real_end = std::min(i1, q_len[g] * item_heads);  // rows past it are padding
      for (int64_t i = std::max(i0, real_end); i < i1; i++) {
        BFloat16* o = out + ((g * width + i / item_heads) * heads + head0 + i % item_heads) * head_dim;
        std::fill_n(o, head_dim, BFloat16(0.0f));
      }
      const int64_t n = real_end - i0;
      if (n <= 0) continue;
      for (int64_t r = 0; r < n; r++) {
        const int64_t j = (i0 + r) / item_heads, qh = head0 + (i0 + r) % item_heads;
        visible[r] = c_len[g] - q_len[g] + j + 1;
        rows_out[r] = out + ((g * width + j) * heads + qh) * head_dim;
        const int32_t* qr = reinterpret_cast<const int32_t*>(
            q + query_index[g * width + j] * q_row_stride + qh * head_dim);
        for (int64_t p = 0; p < pairs; p++) query_pairs[p * kRows + r] = qr[p];
      }
      const int64_t seen = visible[n - 1];  // the last row sees the most keys
      const int64_t* slots = key_slots + g * context;

      configure_scores(n);
      for (int64_t c0 = 0; c0 < seen; c0 += kKeys) {
        const int64_t count = std::min(kKeys, seen - c0);
        // the next keys' and values' rows into L2 while these are scored: the block table
        // scatters a sequence over the pool, beyond the hardware prefetcher's reach
        for (int64_t c = c0 + kKeys; c < std::min(seen, c0 + 2 * kKeys); c++)
          for (int64_t byte = 0; byte < head_dim * 2; byte += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(k_cache + slots[c] * slot_stride + h * head_dim) + byte, _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(v_cache + slots[c] * slot_stride + h * head_dim) + byte, _MM_HINT_T1);
          }
        const BFloat16* key_rows;
        int64_t key_stride;
        if (count == kKeys && consecutive(slots + c0)) {
          key_rows = k_cache + slots[c0] * slot_stride + h * head_dim;
          key_stride = slot_stride * 2;
        } else {  // copied; past the last key, the last key again (finite, and never used)
          for (int64_t l = 0; l < kKeys; l++)
            std::memcpy(keys + l * head_dim,
                        k_cache + slots[c0 + std::min(l, count - 1)] * slot_stride + h * head_dim,
                        head_dim * 2);
          key_rows = reinterpret_cast<const BFloat16*>(keys);
          key_stride = head_dim * 2;
        }
        _tile_zero(0);
        for (int64_t d = 0; d < head_dim; d += 64) {  // dims d .. d + 31, then d + 32 .. d + 63
          _tile_loadd(1, key_rows + d, key_stride);
          _tile_loadd(3, query_pairs + d / 2 * kRows, kRows * 4);
          _tile_dpbf16ps(0, 1, 3);
          _tile_loadd(2, key_rows + d + 32, key_stride);
          _tile_loadd(4, query_pairs + (d / 2 + 16) * kRows, kRows * 4);
          _tile_dpbf16ps(0, 2, 4);
        }
        _tile_stored(0, sums, kRows * 4);
        const __m512 by = _mm512_set1_ps(scale);
        if (n <= 4) {  // row r's 16 scores are column r of the tile
          for (int64_t r = 0; r < n; r++)
            _mm512_storeu_ps(scores.get() + r * padded + c0,
                             _mm512_mul_ps(_mm512_i32gather_ps(gather_index, sums + r, 4), by));
        } else {
          __m512i block[kKeys];
          for (int64_t l = 0; l < kKeys; l++) block[l] = _mm512_load_si512(sums + l * kRows);
          transpose16(block);
          for (int64_t r = 0; r < n; r++)
            _mm512_storeu_ps(scores.get() + r * padded + c0,
                             _mm512_mul_ps(_mm512_castsi512_ps(block[r]), by));
        }
      }

      // Probabilities rounded to bf16 (as transformers' eager attention rounds them before the
      // product with the values), zero from each row's last key to the end of its 32-key block.
      const int64_t blocks_end = (seen + kKeyPairs - 1) / kKeyPairs * kKeyPairs;
      for (int64_t r = 0; r < n; r++) {
        float* sr = scores.get() + r * padded;
        uint16_t* pr = probs.get() + r * padded;
        const int64_t nv = visible[r];
        const __m512 inv = _mm512_set1_ps(softmax_exp_row(sr, nv));
        for (int64_t c = 0; c < blocks_end; c += kLanes) {
          const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail_mask(std::max<int64_t>(nv - c, 0)), sr + c), inv);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + c), (__m256i)_mm512_cvtneps_pbh(p));
        }
      }

      configure_values(n);
      for (int64_t piece = 0; piece < head_dim; piece += kPiece) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c0 = 0; c0 < seen; c0 += kKeyPairs) {
          for (int64_t kp = 0; kp < kKeyPairs / 2; kp++) {  // keys c, c + 1 interleaved by dim
            const int64_t c = c0 + 2 * kp;  // past the last key: zeros (its probability is 0)
            const BFloat16* va = v_cache + slots[std::min(c, seen - 1)] * slot_stride + h * head_dim + piece;
            const BFloat16* vb = v_cache + slots[std::min(c + 1, seen - 1)] * slot_stride + h * head_dim + piece;
            const __m512i zero = _mm512_setzero_si512();
            const __m512i a0 = c < seen ? _mm512_loadu_si512(va) : zero;
            const __m512i a1 = c < seen ? _mm512_loadu_si512(va + 32) : zero;
            const __m512i b0 = c + 1 < seen ? _mm512_loadu_si512(vb) : zero;
            const __m512i b1 = c + 1 < seen ? _mm512_loadu_si512(vb + 32) : zero;
            _mm512_store_si512(values[0] + kp * 32, _mm512_permutex2var_epi16(a0, low_dims, b0));
            _mm512_store_si512(values[1] + kp * 32, _mm512_permutex2var_epi16(a0, high_dims, b0));
            _mm512_store_si512(values[2] + kp * 32, _mm512_permutex2var_epi16(a1, low_dims, b1));
            _mm512_store_si512(values[3] + kp * 32, _mm512_permutex2var_epi16(a1, high_dims, b1));
          }
          _tile_loadd(4, probs.get() + c0, padded * 2);
          _tile_loadd(5, values[0], 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, values[1], 64);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(5, values[2], 64);
          _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(6, values[3], 64);
          _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, mixed, kPiece * 4);
        _tile_stored(1, mixed + 16, kPiece * 4);
        _tile_stored(2, mixed + 32, kPiece * 4);
        _tile_stored(3, mixed + 48, kPiece * 4);
        for (int64_t r = 0; r < n; r++)
          for (int64_t d = 0; d < kPiece; d += 32)
            _mm512_storeu_si512(rows_out[r] + piece + d,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(mixed + r * kPiece + d + 16),
                                                            _mm512_load_ps(mixed + r * kPiece + d)));
      }
    }
    _tile_release();
  });
}

#endif

}  // namespace

bool cached_attention_amx(const at::BFloat16* q, int64_t q_row_stride, const at::BFloat16* k_cache,
                          const at::BFloat16* v_cache, const int64_t* query_index,
                          const int64_t* key_slots, const int64_t* q_len, const int64_t* c_len,
                          at::BFloat16* out, int64_t groups, int64_t width, int64_t context,
                          int64_t kv_heads, int64_t share, int64_t head_dim, float scale) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if (head_dim % kPiece != 0 || head_dim > 256 || !amx_usable()) return false;
  attention_amx(q, q_row_stride, k_cache, v_cache, query_index, key_slots, q_len, c_len, out,
                groups, width, context, kv_heads, share, head_dim, scale);
  return true;
#else
  (void)q, (void)q_row_stride, (void)k_cache, (void)v_cache, (void)query_index, (void)key_slots;
  (void)q_len, (void)c_len, (void)out, (void)groups, (void)width, (void)context, (void)kv_heads;
  (void)share, (void)head_dim, (void)scale;
  return false;
#endif
}
