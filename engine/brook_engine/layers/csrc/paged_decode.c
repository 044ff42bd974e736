/* Decode attention over the paged KV cache on CPU: one query token per sequence, keys and
 * values read where they lie (no gather into a padded copy) and turned into float32 a
 * block at a time, whatever their storage type. Built at first use by
 * brook_engine/layers/cpu_decode.py and called through ctypes.
 *
 * Layouts (all contiguous):
 *   q       [decodes, heads, dim] float32 (heads = kv_heads * group; a group's query heads
 *           are adjacent, as in the model's projection)
 *   k, v    [kv_heads, slots, dim] in the storage type `kind`
 *   k_scale [kv_heads, slots] float32 or NULL (FP8 E4M3: one scale per token and head)
 *   tables  [decodes, width] int64 block ids; lens [decodes] int64 context lengths
 *   lut     256 floats: an 8-bit storage type's values (KIND_LUT8)
 *   out     [decodes, heads, dim] float32
 * Work is split over (sequence, KV head) pairs with OpenMP; it runs on the OpenMP runtime
 * torch itself loaded, so the two never keep rival thread pools.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_F16 = 2, KIND_I8 = 3, KIND_LUT8 = 4 };

/* exp(x) for x <= 0 (a score minus the largest); below -87 exp underflows float32 anyway. */
static inline float exp_nonpositive(float x) { return exp_in_range(x < -87.0f ? -87.0f : x); }

/* n consecutive stored values starting at element `at` of `base`, as float32. */
static void to_float(const void *base, int64_t at, int64_t n, int kind, const float *lut,
                     float *restrict dst) {
  switch (kind) {
  case KIND_F32:
    memcpy(dst, (const float *)base + at, (size_t)n * sizeof(float));
    break;
  case KIND_BF16: {
    const uint16_t *src = (const uint16_t *)base + at;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(src[i]);
    break;
  }
  case KIND_F16: {
    const _Float16 *src = (const _Float16 *)base + at;
    int64_t i = 0;
#if defined(__F16C__) /* gcc does not vectorize the conversion by itself */
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = (float)src[i];
    break;
  }
  case KIND_I8: {
    const int8_t *src = (const int8_t *)base + at;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = (float)src[i];
    break;
  }
  default: {
    const uint8_t *src = (const uint8_t *)base + at;
    for (int64_t i = 0; i < n; i++) dst[i] = lut[src[i]];
  }
  }
}

static const int64_t ITEM_BYTES[] = {4, 2, 2, 1, 1};

/* Ask for the rows of the sequence's next block while this one is computed: blocks lie
 * anywhere in the cache, so the hardware prefetcher cannot guess the next one. */
static inline void prefetch_rows(const void *base, int64_t at, int64_t bytes, int kind) {
  const char *p = (const char *)base + at * ITEM_BYTES[kind];
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

#if defined(__AVX512F__)
#define WIDE_ATTENTION 1
/* The four sums of a0..a3's lanes, in one register: a transposing add tree (10 operations
 * where four separate reductions take ~32). */
static inline __m128 sum4_512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  u = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  u = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(u);
}

/* 16 stored values from element `at` of `base` as float32, converted in registers (exact,
 * as to_float converts): the chunk's keys and values are read where they lie, with no
 * float32 copy written and read back. `kind` is a constant where inlined. */
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t at,
                                                           const int kind) {
  if (kind == KIND_BF16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  if (kind == KIND_F16)
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at)));
  if (kind == KIND_I8)
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + at))));
  return _mm512_loadu_ps((const float *)base + at);
}

/* v with its lanes 4q .. 4q + 3 replaced by r (q a constant where inlined). */
static inline __attribute__((always_inline)) __m512 with_quad(__m512 v, __m128 r, const int q) {
  switch (q) {
  case 0:
    return _mm512_insertf32x4(v, r, 0);
  case 1:
    return _mm512_insertf32x4(v, r, 1);
  case 2:
    return _mm512_insertf32x4(v, r, 2);
  default:
    return _mm512_insertf32x4(v, r, 3);
  }
}

/* Four keys' dot products (rows of 16 * cols values from element `at`) with query heads
 * g0 .. g0 + gt - 1: each key's columns loaded once for the tile's heads, the 4 * gt sums
 * kept as independent chains (one head's four chains alone waited on the multiply-add
 * latency), each over the columns in order, then reduced four keys together by the add
 * tree. */
static inline __attribute__((always_inline)) void quad_512(const float *qs, const void *kb,
                                                           int64_t at, int64_t i, int64_t g0,
                                                           __m128 *out, const int kind,
                                                           const int cols, const int gt) {
  const int64_t dim = 16 * cols;
  __m512 a[4][4];
#pragma GCC unroll 8
  for (int c = 0; c < cols; c++) {
    __m512 key[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) key[k] = load16(kb, at + (i + k) * dim + 16 * c, kind);
#pragma GCC unroll 4
    for (int g = 0; g < gt; g++) {
      const __m512 qv = _mm512_loadu_ps(qs + (g0 + g) * dim + 16 * c);
#pragma GCC unroll 4
      for (int k = 0; k < 4; k++)
        a[g][k] = c == 0 ? _mm512_mul_ps(qv, key[k]) : _mm512_fmadd_ps(qv, key[k], a[g][k]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < gt; g++) out[g] = sum4_512(a[g][0], a[g][1], a[g][2], a[g][3]);
}

/* Scores of n keys for heads g0 .. g0 + gt - 1: sixteen keys (a block of 16) a pass, their
 * scores stored whole — the softmax loops load them a vector at a time, and a load spanning
 * four narrower stores waits for them to reach the cache instead of being forwarded — then
 * four at a time, then the last n % 4 one at a time. */
static inline __attribute__((always_inline)) void scores_tile(
    const float *qs, const void *kb, int64_t at, int64_t n, int64_t g0, float *scores,
    int64_t stride, const int kind, const int cols, const int gt) {
  const int64_t dim = 16 * cols;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 whole[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
#pragma GCC unroll 4
    for (int quad = 0; quad < 4; quad++) {
      __m128 r[4];
      quad_512(qs, kb, at, i + 4 * quad, g0, r, kind, cols, gt);
#pragma GCC unroll 4
      for (int g = 0; g < gt; g++) whole[g] = with_quad(whole[g], r[g], quad);
    }
#pragma GCC unroll 4
    for (int g = 0; g < gt; g++) _mm512_storeu_ps(scores + (g0 + g) * stride + i, whole[g]);
  }
  for (; i + 4 <= n; i += 4) {
    __m128 r[4];
    quad_512(qs, kb, at, i, g0, r, kind, cols, gt);
#pragma GCC unroll 4
    for (int g = 0; g < gt; g++) _mm_storeu_ps(scores + (g0 + g) * stride + i, r[g]);
  }
  for (; i < n; i++) {
    __m512 a[4];
#pragma GCC unroll 8
    for (int c = 0; c < cols; c++) {
      const __m512 key = load16(kb, at + i * dim + 16 * c, kind);
#pragma GCC unroll 4
      for (int g = 0; g < gt; g++) {
        const __m512 qv = _mm512_loadu_ps(qs + (g0 + g) * dim + 16 * c);
        a[g] = c == 0 ? _mm512_mul_ps(qv, key) : _mm512_fmadd_ps(qv, key, a[g]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < gt; g++) scores[(g0 + g) * stride + i] = _mm512_reduce_add_ps(a[g]);
  }
}

/* acc[g] += sum_j p[g][j] * values[j] for query heads g0 .. g0 + gt - 1 (gt * cols <= 16):
 * each value row loaded once for the tile's heads, whose gt * cols sums stay in registers
 * across the chunk (independent chains, where one head at a time waited on the
 * multiply-add latency); each sum still in the order of j. */
static inline __attribute__((always_inline)) void values_tile(
    const void *vb, int64_t at, const float *vscale, int64_t n, int64_t g0,
    const float *scores, int64_t stride, float *acc, const int kind, const int cols,
    const int gt) {
  const int64_t dim = 16 * cols;
  __m512 a[4][8];
#pragma GCC unroll 4
  for (int g = 0; g < gt; g++)
#pragma GCC unroll 8
    for (int c = 0; c < cols; c++) a[g][c] = _mm512_loadu_ps(acc + (g0 + g) * dim + 16 * c);
  for (int64_t j = 0; j < n; j++) {
    __m512 row[8];
#pragma GCC unroll 8
    for (int c = 0; c < cols; c++) row[c] = load16(vb, at + j * dim + 16 * c, kind);
#pragma GCC unroll 4
    for (int g = 0; g < gt; g++) {
      const float s = scores[(g0 + g) * stride + j];
      const __m512 p = _mm512_set1_ps(vscale ? s * vscale[j] : s * 1.0f);
#pragma GCC unroll 8
      for (int c = 0; c < cols; c++) a[g][c] = _mm512_fmadd_ps(p, row[c], a[g][c]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < gt; g++)
#pragma GCC unroll 8
    for (int c = 0; c < cols; c++) _mm512_storeu_ps(acc + (g0 + g) * dim + 16 * c, a[g][c]);
}

/* The group's query heads in tiles of up to 4 (scores) and 16 / cols (values), each tile
 * size its own unrolled code. */
static inline __attribute__((always_inline)) void scores_kind(
    const float *qs, const void *kb, int64_t at, int64_t n, int64_t group, float *scores,
    int64_t stride, const int kind, const int dim) {
  const int cols = dim / 16;
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const int64_t gt = group - g0 < 4 ? group - g0 : 4;
    if (gt == 4)
      scores_tile(qs, kb, at, n, g0, scores, stride, kind, cols, 4);
    else if (gt == 3)
      scores_tile(qs, kb, at, n, g0, scores, stride, kind, cols, 3);
    else if (gt == 2)
      scores_tile(qs, kb, at, n, g0, scores, stride, kind, cols, 2);
    else
      scores_tile(qs, kb, at, n, g0, scores, stride, kind, cols, 1);
  }
}

static inline __attribute__((always_inline)) void values_kind(
    const void *vb, int64_t at, const float *vscale, int64_t n, int64_t group,
    const float *scores, int64_t stride, float *acc, const int kind, const int dim) {
  const int cols = dim / 16;
  const int64_t most = 16 / cols;
  for (int64_t g0 = 0; g0 < group; g0 += most) {
    const int64_t gt = group - g0 < most ? group - g0 : most;
    if (gt == 4)
      values_tile(vb, at, vscale, n, g0, scores, stride, acc, kind, cols, 4);
    else if (gt == 3)
      values_tile(vb, at, vscale, n, g0, scores, stride, acc, kind, cols, 3);
    else if (gt == 2)
      values_tile(vb, at, vscale, n, g0, scores, stride, acc, kind, cols, 2);
    else
      values_tile(vb, at, vscale, n, g0, scores, stride, acc, kind, cols, 1);
  }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define WIDE_ATTENTION 1
/* AVX2 + FMA: the same structure in 8-lane registers, with tiles the 16 registers hold: two
 * query heads' scores a pass of four keys, one head's value sums 64 columns at a time. */

/* 8 stored values from element `at` as float32, converted in registers (exact). */
static inline __attribute__((always_inline)) __m256 load8(const void *base, int64_t at,
                                                          const int kind) {
  if (kind == KIND_BF16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  if (kind == KIND_F16)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at)));
  if (kind == KIND_I8)
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + at))));
  return _mm256_loadu_ps((const float *)base + at);
}

/* The four sums of a0..a3's lanes, in one register (three horizontal adds and one add). */
static inline __m128 sum4_256(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* Four keys' dot products with query heads g0 .. g0 + gt - 1 (gt <= 2), each key's columns
 * loaded once for both heads, the 4 * gt chains independent. */
static inline __attribute__((always_inline)) void quad_256(
    const float *qs, const void *kb, int64_t at, int64_t i, int64_t g0, __m128 *out,
    const int kind, const int dim, const int gt) {
  const int cols = dim / 8;
  __m256 a[2][4];
#pragma GCC unroll 16
  for (int c = 0; c < cols; c++) {
    __m256 key[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) key[k] = load8(kb, at + (i + k) * dim + 8 * c, kind);
#pragma GCC unroll 2
    for (int g = 0; g < gt; g++) {
      const __m256 qv = _mm256_loadu_ps(qs + (g0 + g) * dim + 8 * c);
#pragma GCC unroll 4
      for (int k = 0; k < 4; k++)
        a[g][k] = c == 0 ? _mm256_mul_ps(qv, key[k]) : _mm256_fmadd_ps(qv, key[k], a[g][k]);
    }
  }
#pragma GCC unroll 2
  for (int g = 0; g < gt; g++) out[g] = sum4_256(a[g][0], a[g][1], a[g][2], a[g][3]);
}

/* Scores of n keys for heads g0 .. g0 + gt - 1: eight keys a pass stored whole (the
 * softmax's loads are as wide), then four, then one at a time. */
static inline __attribute__((always_inline)) void scores_tile(
    const float *qs, const void *kb, int64_t at, int64_t n, int64_t g0, float *scores,
    int64_t stride, const int kind, const int dim, const int gt) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128 lo[2], hi[2];
    quad_256(qs, kb, at, i, g0, lo, kind, dim, gt);
    quad_256(qs, kb, at, i + 4, g0, hi, kind, dim, gt);
#pragma GCC unroll 2
    for (int g = 0; g < gt; g++)
      _mm256_storeu_ps(scores + (g0 + g) * stride + i, _mm256_set_m128(hi[g], lo[g]));
  }
  for (; i + 4 <= n; i += 4) {
    __m128 r[2];
    quad_256(qs, kb, at, i, g0, r, kind, dim, gt);
#pragma GCC unroll 2
    for (int g = 0; g < gt; g++) _mm_storeu_ps(scores + (g0 + g) * stride + i, r[g]);
  }
  for (; i < n; i++) {
#pragma GCC unroll 2
    for (int g = 0; g < gt; g++) {
      __m256 a = _mm256_setzero_ps();
      for (int c = 0; c < dim / 8; c++)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qs + (g0 + g) * dim + 8 * c),
                            load8(kb, at + i * dim + 8 * c, kind), a);
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      const __m128 s = _mm_add_ps(h, _mm_movehl_ps(h, h));
      scores[(g0 + g) * stride + i] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
  }
}

static inline __attribute__((always_inline)) void scores_kind(
    const float *qs, const void *kb, int64_t at, int64_t n, int64_t group, float *scores,
    int64_t stride, const int kind, const int dim) {
  int64_t g0 = 0;
  for (; g0 + 2 <= group; g0 += 2) scores_tile(qs, kb, at, n, g0, scores, stride, kind, dim, 2);
  if (g0 < group) scores_tile(qs, kb, at, n, g0, scores, stride, kind, dim, 1);
}

/* One head's value sums over columns c0 .. c0 + 63 in eight registers across the chunk,
 * each in the order of j. */
static inline __attribute__((always_inline)) void values_64_256(
    const void *vb, int64_t at, const float *vscale, int64_t n, const float *sg, float *ag,
    const int kind, const int dim, const int c0) {
  __m256 a[8];
#pragma GCC unroll 8
  for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_ps(ag + c0 + 8 * c);
  for (int64_t j = 0; j < n; j++) {
    const __m256 p = _mm256_set1_ps(vscale ? sg[j] * vscale[j] : sg[j] * 1.0f);
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++)
      a[c] = _mm256_fmadd_ps(p, load8(vb, at + j * dim + c0 + 8 * c, kind), a[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < 8; c++) _mm256_storeu_ps(ag + c0 + 8 * c, a[c]);
}

static inline __attribute__((always_inline)) void values_kind(
    const void *vb, int64_t at, const float *vscale, int64_t n, int64_t group,
    const float *scores, int64_t stride, float *acc, const int kind, const int dim) {
  for (int64_t g = 0; g < group; g++)
#pragma GCC unroll 2
    for (int c0 = 0; c0 < dim; c0 += 64)
      values_64_256(vb, at, vscale, n, scores + g * stride, acc + g * dim, kind, dim, c0);
}
#endif

#if defined(WIDE_ATTENTION)
/* One function per (head size, storage type), so each is compiled for exactly its loads. */
typedef void (*scores_fn)(const float *, const void *, int64_t, int64_t, int64_t, float *,
                          int64_t);
typedef void (*values_fn)(const void *, int64_t, const float *, int64_t, int64_t,
                          const float *, int64_t, float *);
#define FUSED(NAME, KIND, DIM)                                                              \
  static __attribute__((noinline)) void scores_##NAME(const float *qs, const void *kb,        \
                                                      int64_t at, int64_t n, int64_t group,   \
                                                      float *scores, int64_t stride) {        \
    scores_kind(qs, kb, at, n, group, scores, stride, KIND, DIM);                            \
  }                                                                                          \
  static __attribute__((noinline)) void values_##NAME(                                       \
      const void *vb, int64_t at, const float *vscale, int64_t n, int64_t group,             \
      const float *scores, int64_t stride, float *acc) {                                     \
    values_kind(vb, at, vscale, n, group, scores, stride, acc, KIND, DIM);                  \
  }
FUSED(f32_64, KIND_F32, 64) FUSED(bf16_64, KIND_BF16, 64)
FUSED(f16_64, KIND_F16, 64) FUSED(i8_64, KIND_I8, 64)
FUSED(f32_128, KIND_F32, 128) FUSED(bf16_128, KIND_BF16, 128)
FUSED(f16_128, KIND_F16, 128) FUSED(i8_128, KIND_I8, 128)
/* [head size 64, 128][storage type]; an 8-bit type read through its table (KIND_LUT8) is
 * turned into float32 rows first and takes the float32 functions. */
static const scores_fn SCORES[2][4] = {{scores_f32_64, scores_bf16_64, scores_f16_64, scores_i8_64},
                                       {scores_f32_128, scores_bf16_128, scores_f16_128,
                                        scores_i8_128}};
static const values_fn VALUES[2][4] = {{values_f32_64, values_bf16_64, values_f16_64, values_i8_64},
                                       {values_f32_128, values_bf16_128, values_f16_128,
                                        values_i8_128}};
#endif

/* Keys handled per pass (a larger cache block takes several): bounds the scratch. */
enum { CHUNK = 32 };

/* One sequence against one KV head over tokens [first, len) of its context: its `group`
 * query heads' unnormalized outputs (part_acc [group, dim]), with each head's largest score
 * (part_max) and sum of exponentials (part_sum), in one pass with a running softmax
 * (flash-decoding style): each chunk of keys is scored, the running maximum moves, earlier
 * sums are rescaled, and the chunk's values are added while its keys are still in cache.
 * Keys and values are read once, block by block, the next block's rows prefetched. `dim`
 * is a constant where the caller passes one (64, 128), so the loops over it unroll and
 * vectorize fully. */
static inline __attribute__((always_inline)) int attend(
    const float *qs, const void *k, const void *v, const float *k_scale, const float *v_scale,
    const int64_t *table, int64_t first, int64_t len, float *part_acc, float *part_max,
    float *part_sum, int64_t group, const int64_t dim, int64_t head_base, int64_t block_size,
    int kind, const float *lut, float scale) {
#if defined(WIDE_ATTENTION)
  const int wide = dim == 64 ? 0 : dim == 128 ? 1 : -1; /* SCORES/VALUES' row, or none */
#else
  const int wide = -1;
#endif
  /* Read in place: float32, and every type but a table's 8 bits where the functions above
   * convert in registers; the others are turned into float32 rows a chunk at a time. */
  const int direct = kind == KIND_F32 || (wide >= 0 && kind != KIND_LUT8);
  const int64_t rows_floats = direct ? 0 : 2 * CHUNK * dim;
  /* acc [group, dim], scores [group, CHUNK], the running max and sum per query head, and
   * (for stored types other than float32) a chunk of keys and of values as float32 */
  float *acc = malloc(sizeof(float) * (size_t)(group * dim + group * CHUNK + 2 * group +
                                               rows_floats));
  if (acc == NULL) return -1;
  float *scores = acc + group * dim;
  float *run_max = scores + group * CHUNK;
  float *run_sum = run_max + group;
  float *rows_k = rows_floats ? run_sum + group : NULL;
  float *rows_v = rows_floats ? rows_k + CHUNK * dim : NULL;
  memset(acc, 0, sizeof(float) * (size_t)(group * dim));
  for (int64_t g = 0; g < group; g++) {
    run_max[g] = -INFINITY;
    run_sum[g] = 0.0f;
  }
  const int64_t block_bytes = block_size * dim * ITEM_BYTES[kind];

  for (int64_t t = first; t < len;) {
    const int64_t block = t / block_size, offset = t % block_size;
    int64_t n = (block + 1) * block_size < len ? block_size - offset : len - t;
    if (n > CHUNK) n = CHUNK;
    const int64_t slot = table[block] * block_size + offset;
    if (offset == 0 || t == first) {
      const int64_t next = block + 1;
      if (next * block_size < len) {
        const int64_t at = (head_base + table[next] * block_size) * dim;
        prefetch_rows(k, at, block_bytes, kind);
        prefetch_rows(v, at, block_bytes, kind);
        const int64_t scales = head_base + table[next] * block_size; /* FP8 E4M3 only */
        if (k_scale != NULL) prefetch_rows(k_scale, scales, block_size * 4, KIND_F32);
        if (v_scale != NULL) prefetch_rows(v_scale, scales, block_size * 4, KIND_F32);
      }
    }
    const int64_t at = (head_base + slot) * dim;
    const void *kb = k, *vb = v;
    int64_t from = at;
    int read_as = kind;
    if (!direct) {
      to_float(k, at, n * dim, kind, lut, rows_k);
      to_float(v, at, n * dim, kind, lut, rows_v);
      kb = rows_k, vb = rows_v, from = 0, read_as = KIND_F32;
    }
    /* the float32 rows the generic loops below read (only where read_as is float32) */
    const float *keys = (const float *)kb + from, *values = (const float *)vb + from;
    (void)read_as; /* read by the wide functions only, where this CPU has them */
    const float *kscale = k_scale ? k_scale + head_base + slot : NULL;
    const float *vscale = v_scale ? v_scale + head_base + slot : NULL;

    int64_t i = 0;
#if defined(WIDE_ATTENTION)
    if (wide >= 0) {
      SCORES[wide][read_as](qs, kb, from, n, group, scores, CHUNK);
      i = n;
    }
#endif
    /* Four keys at a time: four independent sums per query head keep the FMA units busy
     * (one sum is a chain of dependent adds). */
    for (; i + 4 <= n; i += 4) {
      const float *r0 = keys + i * dim, *r1 = r0 + dim, *r2 = r1 + dim, *r3 = r2 + dim;
      for (int64_t g = 0; g < group; g++) {
        const float *qg = qs + g * dim;
        float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
        for (int64_t d = 0; d < dim; d++) {
          const float x = qg[d];
          d0 += x * r0[d];
          d1 += x * r1[d];
          d2 += x * r2[d];
          d3 += x * r3[d];
        }
        float *sg = scores + g * CHUNK + i;
        sg[0] = d0;
        sg[1] = d1;
        sg[2] = d2;
        sg[3] = d3;
      }
    }
    for (; i < n; i++) {
      const float *row = keys + i * dim;
      for (int64_t g = 0; g < group; g++) {
        const float *qg = qs + g * dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; d++) dot += qg[d] * row[d];
        scores[g * CHUNK + i] = dot;
      }
    }

    for (int64_t g = 0; g < group; g++) {
      float *sg = scores + g * CHUNK;
      float peak = run_max[g];
#pragma omp simd reduction(max : peak)
      for (int64_t j = 0; j < n; j++) {
        sg[j] *= kscale ? kscale[j] * scale : scale;
        peak = sg[j] > peak ? sg[j] : peak;
      }
      /* The running maximum moved: what was summed so far shrinks by exp(old - new). */
      if (peak > run_max[g]) {
        const float shrink = exp_nonpositive(run_max[g] - peak);
        float *ag = acc + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) ag[d] *= shrink;
        run_sum[g] *= shrink;
        run_max[g] = peak;
      }
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < n; j++) {
        sg[j] = exp_nonpositive(sg[j] - peak);
        total += sg[j];
      }
      run_sum[g] += total;
    }

#if defined(WIDE_ATTENTION)
    if (wide >= 0) {
      VALUES[wide][read_as](vb, from, vscale, n, group, scores, CHUNK, acc);
      t += n;
      continue;
    }
#endif
    for (int64_t j = 0; j < n; j++) {
      const float *row = values + j * dim;
      const float token_scale = vscale ? vscale[j] : 1.0f;
      for (int64_t g = 0; g < group; g++) {
        const float p = scores[g * CHUNK + j] * token_scale;
        float *ag = acc + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) ag[d] += p * row[d];
      }
    }
    t += n;
  }

  memcpy(part_acc, acc, sizeof(float) * (size_t)(group * dim));
  memcpy(part_max, run_max, sizeof(float) * (size_t)group);
  memcpy(part_sum, run_sum, sizeof(float) * (size_t)group);
  free(acc);
  return 0;
}

/* The path this build's attention takes for heads of 64 and 128 (tests check the build they
 * loaded): 2 AVX-512, 1 AVX2 + FMA, 0 the generic loops. */
int brook_decode_path(void) {
#if defined(__AVX512F__)
  return 2;
#elif defined(WIDE_ATTENTION)
  return 1;
#else
  return 0;
#endif
}

/* A context shorter than this is never split between threads. */
enum { MIN_SPLIT = 64 };

/* With few (sequence, KV head) pairs — one sequence decoding has as many as KV heads — the
 * threads would idle: each pair's context is then split into parts, attended separately,
 * and the parts' softmax sums merged (exp(max_p - max) rescales each). */
int brook_paged_decode(const float *q, const void *k, const void *v, const float *k_scale,
                       const float *v_scale, const int64_t *tables, const int64_t *lens,
                       float *out, int64_t decodes, int64_t heads, int64_t kv_heads,
                       int64_t dim, int64_t slots, int64_t block_size, int64_t width,
                       int64_t window, int kind, const float *lut, float scale, int threads) {
  const int64_t group = heads / kv_heads;
  const int64_t pairs = decodes * kv_heads;
  int64_t longest = 0;
  for (int64_t s = 0; s < decodes; s++) longest = lens[s] > longest ? lens[s] : longest;
  if (window > 0 && longest > window) longest = window;
  int64_t parts = pairs >= 4 * (int64_t)threads ? 1 : (4 * (int64_t)threads + pairs - 1) / pairs;
  if (parts > longest / MIN_SPLIT) parts = longest / MIN_SPLIT;
  if (parts < 1) parts = 1;
  const int64_t stride = group * (dim + 2); /* one part's acc, max and sum */
  float *scratch = malloc(sizeof(float) * (size_t)(pairs * parts * stride));
  if (scratch == NULL) return -1;
  int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
  for (int64_t u = 0; u < pairs; u++) {
    for (int64_t p = 0; p < parts; p++) {
      const int64_t s = u / kv_heads, h = u % kv_heads;
      const int64_t len = lens[s];
      const int64_t start = (window > 0 && len > window) ? len - window : 0;
      const int64_t first = start + (len - start) * p / parts;
      const int64_t last = start + (len - start) * (p + 1) / parts;
      float *part = scratch + (u * parts + p) * stride;
      float *pmax = part + group * dim, *psum = pmax + group;
      if (first >= last) { /* an empty part: nothing to merge */
        for (int64_t g = 0; g < group; g++) pmax[g] = -INFINITY, psum[g] = 0.0f;
        memset(part, 0, sizeof(float) * (size_t)(group * dim));
        continue;
      }
      const float *qs = q + (s * heads + h * group) * dim;
      const int64_t *table = tables + s * width;
      int status;
      if (dim == 64)
        status = attend(qs, k, v, k_scale, v_scale, table, first, last, part, pmax, psum,
                        group, 64, h * slots, block_size, kind, lut, scale);
      else if (dim == 128)
        status = attend(qs, k, v, k_scale, v_scale, table, first, last, part, pmax, psum,
                        group, 128, h * slots, block_size, kind, lut, scale);
      else
        status = attend(qs, k, v, k_scale, v_scale, table, first, last, part, pmax, psum,
                        group, dim, h * slots, block_size, kind, lut, scale);
      if (status != 0) {
#pragma omp atomic write
        failed = 1;
      }
    }
  }
  if (!failed) {
    for (int64_t u = 0; u < pairs; u++) {
      const int64_t s = u / kv_heads, h = u % kv_heads;
      for (int64_t g = 0; g < group; g++) {
        float peak = -INFINITY, total = 0.0f;
        for (int64_t p = 0; p < parts; p++) {
          const float m = scratch[(u * parts + p) * stride + group * dim + g];
          peak = m > peak ? m : peak;
        }
        float *o = out + (s * heads + h * group + g) * dim;
        memset(o, 0, sizeof(float) * (size_t)dim);
        for (int64_t p = 0; p < parts; p++) {
          const float *part = scratch + (u * parts + p) * stride;
          const float m = part[group * dim + g];
          if (m == -INFINITY) continue;
          const float w = parts == 1 ? 1.0f : exp_nonpositive(m - peak);
          total += part[group * dim + group + g] * w;
          for (int64_t d = 0; d < dim; d++) o[d] += part[g * dim + d] * w;
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < dim; d++) o[d] *= inv;
      }
    }
  }
  free(scratch);
  return failed ? -1 : 0;
}

/* Store new keys and values at their cache slots, as they are (the cache holds the model's
 * own type): k, v [tokens, kv_heads, dim] with `token_stride` elements between tokens (views
 * of the projection's output), caches [kv_heads, slots, dim], `item` bytes per element.
 * A slot outside the cache stores nothing and returns -1 (the caller checks first). */
int brook_kv_store(const void *k, const void *v, void *k_cache, void *v_cache,
                   const int64_t *slot_ids, int64_t tokens, int64_t kv_heads, int64_t dim,
                   int64_t token_stride, int64_t slots, int64_t item) {
  for (int64_t t = 0; t < tokens; t++)
    if (slot_ids[t] < 0 || slot_ids[t] >= slots) return -1;
  const size_t row = (size_t)(dim * item);
  for (int64_t t = 0; t < tokens; t++) {
    const int64_t slot = slot_ids[t];
    for (int64_t h = 0; h < kv_heads; h++) {
      const int64_t src = (t * token_stride + h * dim) * item;
      const int64_t dst = ((h * slots + slot) * dim) * item;
      memcpy((char *)k_cache + dst, (const char *)k + src, row);
      memcpy((char *)v_cache + dst, (const char *)v + src, row);
    }
  }
  return 0;
}

/* `rows` rows (1 to 4, a constant where inlined) of x by 16 columns (from j0) of a
 * [dim, dim] map, each output summed over i in order: the sums stay in vector registers and
 * each map row is read once for the rows. */
static inline __attribute__((always_inline)) void map_block(const float *x, int64_t x_stride,
                                                            const float *m, float *dst,
                                                            int64_t dst_stride, int64_t dim,
                                                            int64_t j0, const int rows) {
  float a[4][16];
#pragma GCC unroll 4
  for (int r = 0; r < 4; r++)
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) a[r][j] = 0.0f;
  for (int64_t i = 0; i < dim; i++) {
    const float *mi = m + i * dim + j0;
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
      if (r < rows) {
        const float xi = x[r * x_stride + i];
#pragma omp simd
        for (int j = 0; j < 16; j++) a[r][j] += xi * mi[j];
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; r++)
    if (r < rows)
#pragma GCC unroll 16
      for (int j = 0; j < 16; j++) dst[r * dst_stride + j0 + j] = a[r][j];
}

#if defined(__AVX512F__)
/* The same block 64 columns wide in 16-float registers: 4 rows by 64 columns are 16
 * independent sums a step, enough to keep both multiply-add units busy (4 rows by 16
 * columns are 4 chains, each waiting on the last one's latency: half the rate). Written
 * with intrinsics because the compiler's own choice here is 8-float registers, too few to
 * hold the block. Same multiply-adds in the same order as map_block. */
static inline __attribute__((always_inline)) void map_block64(const float *x, int64_t x_stride,
                                                              const float *m, float *dst,
                                                              int64_t dst_stride, int64_t dim,
                                                              int64_t j0, const int rows) {
  __m512 a[4][4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; r++)
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i++) {
    const float *mi = m + i * dim + j0;
    const __m512 m0 = _mm512_loadu_ps(mi), m1 = _mm512_loadu_ps(mi + 16);
    const __m512 m2 = _mm512_loadu_ps(mi + 32), m3 = _mm512_loadu_ps(mi + 48);
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
      if (r < rows) {
        const __m512 xi = _mm512_set1_ps(x[r * x_stride + i]);
        a[r][0] = _mm512_fmadd_ps(xi, m0, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(xi, m1, a[r][1]);
        a[r][2] = _mm512_fmadd_ps(xi, m2, a[r][2]);
        a[r][3] = _mm512_fmadd_ps(xi, m3, a[r][3]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; r++)
    if (r < rows)
#pragma GCC unroll 4
      for (int c = 0; c < 4; c++) _mm512_storeu_ps(dst + r * dst_stride + j0 + 16 * c, a[r][c]);
}
#endif

/* One of the blocks above for a row count known where it is inlined. */
#define MAP_BLOCK(block)                                                                      \
  do {                                                                                        \
    if (rows == 4)                                                                            \
      block(x, x_stride, m, dst, dst_stride, dim, j0, 4);                                     \
    else if (rows == 3)                                                                       \
      block(x, x_stride, m, dst, dst_stride, dim, j0, 3);                                     \
    else if (rows == 2)                                                                       \
      block(x, x_stride, m, dst, dst_stride, dim, j0, 2);                                     \
    else                                                                                      \
      block(x, x_stride, m, dst, dst_stride, dim, j0, 1);                                     \
  } while (0)

/* `rows` (1 to 4) rows of x by the whole [dim, dim] map (dim a multiple of 16): 64 columns
 * at a time where the build has AVX-512, then 16; the order of each output's sum is the
 * same whatever the width, so results do not depend on the build. */
static void map_rows(const float *x, int64_t x_stride, const float *m, float *dst,
                     int64_t dst_stride, int64_t dim, int rows) {
  int64_t j0 = 0;
#if defined(__AVX512F__)
  for (; j0 + 64 <= dim; j0 += 64) MAP_BLOCK(map_block64);
#endif
  for (; j0 < dim; j0 += 16) MAP_BLOCK(map_block);
}

/* INT8 KV store: each token's key (value) row of each KV head turned by the layer's folded
 * map, y = x M[h] - offset[h] (centre, balance, rotation and scale in one [dim, dim] matrix
 * per head: Int8Params.maps in kv/cache.py), rounded to nearest-even as torch.round does,
 * clamped to +-127 and written at its slot (prefill reads the slots back, so what a
 * prompt's attention sees is what the cache holds).
 *   x            [tokens, kv_heads, dim] float32, rows token_stride floats apart
 *   map, offset  [kv_heads, dim, dim], [kv_heads, dim] float32
 *   cache        [kv_heads, slots, dim] int8
 * Each output is one sum over i in order. Work items (4 tokens, KV head) are split over
 * `threads` where there is enough work to wake them (a prefill chunk's rows).
 */
enum { INT8_MAX_DIM = 512 }; /* head sizes up to this (larger: torch's path) */

int brook_kv_store_int8(const float *x, const float *map, const float *offset, int8_t *cache,
                        const int64_t *slot_ids, int64_t tokens, int64_t kv_heads, int64_t dim,
                        int64_t token_stride, int64_t slots, int threads) {
  if (dim > INT8_MAX_DIM) return -2;
  for (int64_t t = 0; t < tokens; t++)
    if (slot_ids[t] < 0 || slot_ids[t] >= slots) return -1;
  const int64_t quads = (tokens + 3) / 4;
  const int parallel = tokens * kv_heads * dim * dim >= (int64_t)1 << 18;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static) collapse(2)
  for (int64_t b = 0; b < quads; b++) {
    for (int64_t h = 0; h < kv_heads; h++) {
      float turned[4 * INT8_MAX_DIM];
      const int64_t t0 = 4 * b;
      const int rows = (int)(tokens - t0 < 4 ? tokens - t0 : 4);
      const float *xb = x + t0 * token_stride + h * dim;
      const float *m = map + h * dim * dim;
      if (dim % 16 != 0) { /* a head size the blocks do not fit: a row at a time */
        for (int r = 0; r < rows; r++)
          for (int64_t j = 0; j < dim; j++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < dim; i++) sum += xb[r * token_stride + i] * m[i * dim + j];
            turned[r * dim + j] = sum;
          }
      } else {
        map_rows(xb, token_stride, m, turned, dim, dim, rows);
      }
      const float *off = offset + h * dim;
      for (int r = 0; r < rows; r++) {
        int8_t *dst = cache + (h * slots + slot_ids[t0 + r]) * dim;
        for (int64_t j = 0; j < dim; j++) {
          float y = nearbyintf(turned[r * dim + j] - off[j]);
          y = y != y ? 0.0f : y; /* NaN: a defined code (a cast of NaN is not) */
          y = y > 127.0f ? 127.0f : (y < -127.0f ? -127.0f : y);
          dst[j] = (int8_t)y;
        }
      }
    }
  }
  return 0;
}

/* An INT8 layer's query or output map: out[t, h] = x[t, h] M[h] (+ offset[h]), every head's
 * row of every token by its head's [dim, dim] matrix (Int8Params.maps in kv/cache.py: the
 * query turned to score the stored integers, the attention output turned back to the values
 * they stand for). Each output is one sum over i in order, whatever the token count, so a
 * row's result does not depend on its batch (a batched product's order may).
 *   x       [tokens, heads, dim] float32, rows token_stride floats apart
 *   map     [heads, dim, dim] float32; offset [heads, dim] float32 or NULL
 *   out     [tokens, heads, dim] float32, contiguous
 * Returns -2 where dim is not a multiple of 16 (the caller's torch path runs). Work items
 * (4 tokens, head) are split over `threads` where there is enough work to wake them. */
int brook_head_map(const float *x, const float *map, const float *offset, float *out,
                   int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride,
                   int threads) {
  if (dim % 16 != 0) return -2;
  const int64_t quads = (tokens + 3) / 4;
  const int parallel = tokens * heads * dim * dim >= (int64_t)1 << 18;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static) collapse(2)
  for (int64_t b = 0; b < quads; b++) {
    for (int64_t h = 0; h < heads; h++) {
      const int64_t t0 = 4 * b;
      const int rows = (int)(tokens - t0 < 4 ? tokens - t0 : 4);
      const float *xb = x + t0 * token_stride + h * dim;
      const float *m = map + h * dim * dim;
      float *dst = out + (t0 * heads + h) * dim;
      map_rows(xb, token_stride, m, dst, heads * dim, dim, rows);
      if (offset != NULL)
        for (int r = 0; r < rows; r++)
          for (int64_t j = 0; j < dim; j++) dst[r * heads * dim + j] += offset[h * dim + j];
    }
  }
  return 0;
}
