/* Float rows times an int8 weight matrix with a scale per output channel, or per output
 * channel and group of input positions (W8A16):
 * out[m, n] = sum_g scale[n, g] * sum_{k in group g} x[m, k] * q[n, k] (+ bias[n]), in float32.
 *
 * The weight is packed once at load time (brook_int8_pack) into tiles of 16 output channels:
 * tile t holds q[16t .. 16t+15, k] for every k, 16 bytes per k, so one load brings 16
 * channels' weights for one input position and each is multiplied by a broadcast activation.
 * A tile's int8 values are widened to float32 once and used for up to ROWS rows of x, so a
 * batch pays the widening once per weight, and a single row streams the weight at the
 * memory's rate (int8: half the bytes of BF16). There is no horizontal sum; scales (one per
 * channel, or one per channel and group of input positions) multiply each group's sums.
 *
 * Three paths, chosen at run time by what the CPU has (brook_int8_isa): AVX-512, AVX2 + FMA
 * (the AVX2 machines this engine also serves) and portable C. They sum in the same order
 * (k ascending, per output), so they agree to float rounding of fused multiply-adds.
 * Built by brook_engine/layers/cpu_kernels.py, called from brook_engine/quant/cpu_int8.py.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"

#define TILE 16 /* output channels per packed tile */
#define ROWS 6  /* rows of x per pass over a tile pair */

/* Pack q [out, in] (row-major int8) into ceil(out / 16) tiles of [in][16]; the channels past
 * `out` in the last tile are zero. */
void brook_int8_pack(const int8_t *q, int8_t *packed, int64_t out, int64_t in) {
  const int64_t tiles = (out + TILE - 1) / TILE;
  memset(packed, 0, (size_t)(tiles * in * TILE));
  for (int64_t n = 0; n < out; n++) {
    int8_t *dst = packed + (n / TILE) * in * TILE + n % TILE;
    const int8_t *src = q + n * in;
    for (int64_t k = 0; k < in; k++) dst[k * TILE] = src[k];
  }
}

/* Every path below sums group by group: `group` input positions (all of them for one scale
 * per channel) into fresh sums, which are then scaled by that group's scales and added to
 * the totals. `scales` is [groups][stride] float32, a group's scales of 16 consecutive
 * channels side by side (brook_int8_matmul's caller lays them out so). */

/* The portable path: totals[m][c] for `rows` rows and the TILE channels of one tile. */
static void tile_c(const float *x, int64_t in, int64_t group, const float *scales,
                   int64_t stride, int rows, const int8_t *w, float *totals) {
  for (int m = 0; m < rows; m++) {
    float total[TILE] = {0};
    const float *xr = x + m * in;
    for (int64_t g0 = 0; g0 < in; g0 += group) {
      float sum[TILE] = {0};
      for (int64_t k = g0; k < g0 + group; k++) {
        const float xv = xr[k];
        const int8_t *wk = w + k * TILE;
        for (int c = 0; c < TILE; c++) sum[c] += xv * (float)wk[c];
      }
      const float *sc = scales + (g0 / group) * stride;
      for (int c = 0; c < TILE; c++) total[c] += sum[c] * sc[c];
    }
    memcpy(totals + m * 2 * TILE, total, sizeof(total));
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* One-row passes prefetch each tile's stream this many channels (x 16 bytes) ahead. */
#define AHEAD 128
#define TARGET512 __attribute__((target("avx512f,avx512bw,avx512vl"), noinline))
#define TARGET2 __attribute__((target("avx2,fma"), noinline))

static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl"))) __m512
widen_512(const int8_t *p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* AVX-512: two tiles (32 channels) by up to ROWS rows; totals is [ROWS][32]. */
TARGET512 static void pair_512(const float *x, int64_t in, int64_t group, const float *scales,
                               int64_t stride, int rows, const int8_t *w0, const int8_t *w1,
                               float *totals) {
  __m512 t0[ROWS], t1[ROWS];
  for (int m = 0; m < ROWS; m++) t0[m] = t1[m] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < in; g0 += group) {
    __m512 a0[ROWS], a1[ROWS];
    for (int m = 0; m < ROWS; m++) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g0 + group; k++) {
      const __m512 v0 = widen_512(w0 + k * TILE);
      const __m512 v1 = widen_512(w1 + k * TILE);
#pragma GCC unroll 6
      for (int m = 0; m < ROWS; m++) {
        if (m < rows) {
          const __m512 xv = _mm512_set1_ps(x[m * in + k]);
          a0[m] = _mm512_fmadd_ps(xv, v0, a0[m]);
          a1[m] = _mm512_fmadd_ps(xv, v1, a1[m]);
        }
      }
    }
    const float *sc = scales + (g0 / group) * stride;
    const __m512 s0 = _mm512_loadu_ps(sc), s1 = _mm512_loadu_ps(sc + TILE);
#pragma GCC unroll 6
    for (int m = 0; m < ROWS; m++) {
      if (m < rows) {
        t0[m] = _mm512_fmadd_ps(a0[m], s0, t0[m]);
        t1[m] = _mm512_fmadd_ps(a1[m], s1, t1[m]);
      }
    }
  }
  for (int m = 0; m < rows; m++) {
    _mm512_storeu_ps(totals + m * 2 * TILE, t0[m]);
    _mm512_storeu_ps(totals + m * 2 * TILE + TILE, t1[m]);
  }
}

/* AVX-512, one row, four whole tiles and groups of a multiple of four channels (the common
 * case): four channels a pass, one cache line of each tile's stream, prefetched AHEAD
 * channels ahead (the hardware prefetcher alone leaves the cores waiting on memory); two
 * sums per tile (even and odd channels) so eight multiply-adds are in flight. */
TARGET512 static void quad_512_full(const float *x, int64_t in, int64_t group,
                                    const float *scales, int64_t stride, const int8_t *w,
                                    float *totals) {
  __m512 t[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                 _mm512_setzero_ps()};
  const int64_t step = in * TILE;
  for (int64_t g0 = 0; g0 < in; g0 += group) {
    __m512 a[4], b[4];
    for (int j = 0; j < 4; j++) a[j] = b[j] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g0 + group; k += 4) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++)
        _mm_prefetch((const char *)(w + j * step + (k + AHEAD) * TILE), _MM_HINT_T0);
      const __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[k + 1]);
      const __m512 x2 = _mm512_set1_ps(x[k + 2]), x3 = _mm512_set1_ps(x[k + 3]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++) {
        const int8_t *p = w + j * step + k * TILE;
        a[j] = _mm512_fmadd_ps(x0, widen_512(p), a[j]);
        b[j] = _mm512_fmadd_ps(x1, widen_512(p + TILE), b[j]);
        a[j] = _mm512_fmadd_ps(x2, widen_512(p + 2 * TILE), a[j]);
        b[j] = _mm512_fmadd_ps(x3, widen_512(p + 3 * TILE), b[j]);
      }
    }
    const float *sc = scales + (g0 / group) * stride;
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
      t[j] = _mm512_fmadd_ps(_mm512_add_ps(a[j], b[j]), _mm512_loadu_ps(sc + j * TILE), t[j]);
  }
  for (int j = 0; j < 4; j++) _mm512_storeu_ps(totals + j * TILE, t[j]);
}

/* AVX-512, one row: four tiles at once, so four independent sums hide the multiply-add's
 * latency and four streams keep the prefetchers busy; totals is [64]. */
TARGET512 static void quad_512(const float *x, int64_t in, int64_t group, const float *scales,
                               int64_t stride, const int8_t *w, int tiles, float *totals) {
  __m512 t[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                 _mm512_setzero_ps()};
  const int64_t step = in * TILE;
  for (int64_t g0 = 0; g0 < in; g0 += group) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    for (int64_t k = g0; k < g0 + group; k++) {
      const __m512 xv = _mm512_set1_ps(x[k]);
      if ((k & 3) == 0) {
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
          if (j < tiles)
            _mm_prefetch((const char *)(w + j * step + (k + AHEAD) * TILE), _MM_HINT_T0);
      }
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++)
        if (j < tiles) a[j] = _mm512_fmadd_ps(xv, widen_512(w + j * step + k * TILE), a[j]);
    }
    const float *sc = scales + (g0 / group) * stride;
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
      if (j < tiles) t[j] = _mm512_fmadd_ps(a[j], _mm512_loadu_ps(sc + j * TILE), t[j]);
  }
  for (int j = 0; j < tiles; j++) _mm512_storeu_ps(totals + j * TILE, t[j]);
}

/* AVX2 + FMA: one tile (two halves of 8 channels) by up to 4 rows at a time; the totals
 * stay in `totals` ([ROWS][32]), touched once per group. */
TARGET2 static void tile_avx2(const float *x, int64_t in, int64_t group, const float *scales,
                              int64_t stride, int rows, const int8_t *w, float *totals) {
  for (int first = 0; first < rows; first += 4) {
    const int count = rows - first < 4 ? rows - first : 4;
    const float *xs = x + first * in;
    for (int m = 0; m < count; m++) {
      _mm256_storeu_ps(totals + (first + m) * 2 * TILE, _mm256_setzero_ps());
      _mm256_storeu_ps(totals + (first + m) * 2 * TILE + 8, _mm256_setzero_ps());
    }
    for (int64_t g0 = 0; g0 < in; g0 += group) {
      __m256 lo[4], hi[4];
      for (int m = 0; m < 4; m++) lo[m] = hi[m] = _mm256_setzero_ps();
      for (int64_t k = g0; k < g0 + group; k++) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(w + k * TILE));
        const __m256 vl = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        const __m256 vh = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++) {
          if (m < count) {
            const __m256 xv = _mm256_broadcast_ss(xs + m * in + k);
            lo[m] = _mm256_fmadd_ps(xv, vl, lo[m]);
            hi[m] = _mm256_fmadd_ps(xv, vh, hi[m]);
          }
        }
      }
      const float *sc = scales + (g0 / group) * stride;
      const __m256 sl = _mm256_loadu_ps(sc), sh = _mm256_loadu_ps(sc + 8);
      for (int m = 0; m < count; m++) {
        float *t = totals + (first + m) * 2 * TILE;
        _mm256_storeu_ps(t, _mm256_fmadd_ps(lo[m], sl, _mm256_loadu_ps(t)));
        _mm256_storeu_ps(t + 8, _mm256_fmadd_ps(hi[m], sh, _mm256_loadu_ps(t + 8)));
      }
    }
  }
}
#endif

/* The best path this CPU runs, capped at `limit` (tests force each path on one machine). */
int brook_int8_isa(int limit) { return vector_isa(limit); }

enum { KIND_F32 = 0, KIND_BF16 = 1 }; /* float16 callers widen in PyTorch */


/* out = x @ (q * scale).T + bias for x [rows, in] and out [rows, out_features] of `kind`
 * (float32 or bfloat16), packed q (brook_int8_pack), float32 `scales` [in / group][stride]
 * (stride: out_features rounded up to 16; one row of them for one scale per channel) and a
 * float32 bias (or NULL). Returns 0, or -1 (nothing written) for a group that does not
 * divide `in` or no memory for the widened activations. */
int brook_int8_matmul(const void *x, const int8_t *packed, const float *scales,
                      const float *bias, void *out, int64_t rows, int64_t out_features,
                      int64_t in, int64_t group, int kind, int isa, int threads) {
  if (group <= 0 || in % group != 0) return -1; /* the caller checks; never read past a row */
  const float *xf = (const float *)x;
  float *widened = NULL;
  if (kind != KIND_F32) { /* activations widened once per call, not once per tile */
    widened = (float *)malloc((size_t)(rows * in) * sizeof(float));
    if (widened == NULL) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * in > 65536)
    for (int64_t i = 0; i < rows * in; i++) widened[i] = bf16_to_float(((const uint16_t *)x)[i]);
    xf = widened;
  }
  const int64_t tiles = (out_features + TILE - 1) / TILE;
  const int64_t stride = tiles * TILE;
#if defined(__x86_64__) && defined(__GNUC__)
  if (rows == 1 && isa == ISA_AVX512) {
    /* Each thread takes an equal run of tiles (a layer of 36 tiles splits 18/18, not 5/4
     * groups of four), in groups of four. */
#pragma omp parallel num_threads(threads)
    {
      const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
      const int64_t begin = tiles * part / parts, end = tiles * (part + 1) / parts;
      for (int64_t t = begin; t < end; t += 4) {
        float totals[4 * TILE];
        const int count = (int)(end - t < 4 ? end - t : 4);
        const int64_t n0 = t * TILE;
        if (count == 4 && group % 4 == 0)
          quad_512_full(xf, in, group, scales + n0, stride, packed + t * in * TILE, totals);
        else
          quad_512(xf, in, group, scales + n0, stride, packed + t * in * TILE, count, totals);
        const int64_t n1 = n0 + count * TILE < out_features ? n0 + count * TILE : out_features;
        for (int64_t n = n0; n < n1; n++) {
          float v = totals[n - n0];
          if (bias != NULL) v += bias[n];
          store_kind(out, n, v, kind);
        }
      }
    }
    free(widened);
    return 0;
  }
#endif
  const int64_t pairs = (tiles + 1) / 2;
  const int64_t blocks = (rows + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int64_t b = 0; b < blocks; b++) {
    for (int64_t p = 0; p < pairs; p++) {
      float totals[ROWS * 2 * TILE];
      const int64_t first = b * ROWS;
      const int count = (int)(rows - first < ROWS ? rows - first : ROWS);
      const int64_t t0 = 2 * p;
      const int both = t0 + 1 < tiles;
      const int8_t *w0 = packed + t0 * in * TILE;
      const int8_t *w1 = both ? w0 + in * TILE : w0; /* a lone last tile is read twice */
      const float *s0 = scales + t0 * TILE;
      const float *s1 = both ? s0 + TILE : s0;
      const float *xb = xf + first * in;
#if defined(__x86_64__) && defined(__GNUC__)
      if (isa == ISA_AVX512 && both) {
        pair_512(xb, in, group, s0, stride, count, w0, w1, totals);
      } else if (isa == ISA_AVX512 || isa == ISA_AVX2) {
        tile_avx2(xb, in, group, s0, stride, count, w0, totals);
        if (both) tile_avx2(xb, in, group, s1, stride, count, w1, totals + TILE);
      } else
#endif
      {
        tile_c(xb, in, group, s0, stride, count, w0, totals);
        if (both) tile_c(xb, in, group, s1, stride, count, w1, totals + TILE);
      }
      const int64_t n_end = (t0 + 2) * TILE < out_features ? (t0 + 2) * TILE : out_features;
      for (int m = 0; m < count; m++) {
        for (int64_t n = t0 * TILE; n < n_end; n++) {
          float v = totals[m * 2 * TILE + (n - t0 * TILE)];
          if (bias != NULL) v += bias[n];
          store_kind(out, (first + m) * out_features + n, v, kind);
        }
      }
    }
  }
  free(widened);
  return 0;
}
