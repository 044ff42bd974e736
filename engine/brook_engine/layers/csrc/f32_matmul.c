/* Float32 rows times a float32 weight: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
 *
 * The weight is packed once at load time (brook_f32_pack) into pairs of 16-channel tiles:
 * pair p holds w[32p .. 32p+31, k] for every k, 128 bytes per k, so one pass over a pair is
 * one forward stream of memory and each input position brings 32 channels' weights in two
 * vector loads. Those are used for up to MR rows of x (each row's value broadcast), so a
 * decode batch of 2-64 rows reads the weight once per MR rows, from memory only the first
 * time (a pair, 74 KiB at 576 inputs, stays in the core's cache for the other row blocks).
 * There is no horizontal sum and no packing per call: at 2-64 rows this beats oneDNN's
 * inner product on its own packed layout by 1.07-1.45x, and ties it on 2,048-row prefill
 * chunks (tests/bench/small_m_rate.py prints both).
 *
 * Every output is one chain of multiply-adds in k order, whatever the row count, the
 * blocking, the thread split or the path, so a row's result does not depend on the batch
 * it shares a step with (and the paths agree exactly where the C compiler contracts the
 * portable loop into fused multiply-adds, as -march builds do).
 *
 * Three paths, chosen at run time by what the CPU has: AVX-512 (12 rows x 32 channels in 24
 * registers), AVX2 + FMA (3 rows x 32 channels in 12) and portable C (a row at a time).
 * Built by brook_engine/layers/cpu_kernels.py, called from brook_engine/layers/cpu_matmul.py.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "kernel_math.h"

#define PAIR 32 /* output channels per packed pair */
#define CHUNK 96 /* rows per work item of a large batch (a few hundred KiB of x) */

/* Pack w [out, in] (row-major, out a multiple of PAIR) into out / 32 pairs of [in][32]. */
void brook_f32_pack(const float *w, float *packed, int64_t out, int64_t in, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < out; n++) {
    float *dst = packed + (n / PAIR) * in * PAIR + n % PAIR;
    const float *src = w + n * in;
    for (int64_t k = 0; k < in; k++) dst[k * PAIR] = src[k];
  }
}

/* The portable path: `rows` rows of x by one pair, into out (row stride ldo). */
static void block_c(const float *x, int64_t in, int rows, const float *w, float *out,
                    int64_t ldo) {
  for (int m = 0; m < rows; m++) {
    float sum[PAIR] = {0};
    const float *xr = x + m * in;
    for (int64_t k = 0; k < in; k++) {
      const float xv = xr[k];
      const float *wk = w + k * PAIR;
      for (int c = 0; c < PAIR; c++) sum[c] += xv * wk[c];
    }
    memcpy(out + m * ldo, sum, sizeof(sum));
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define MR512 12 /* rows per AVX-512 block: 24 sums, 2 weights and a broadcast in 32 zmm */
#define MR2 3    /* rows per AVX2 block: 12 sums and the broadcasts in 16 ymm */
#define AHEAD 16 /* input positions (of 128 bytes) the weight stream is prefetched ahead */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define T2 __attribute__((target("avx2,fma")))

/* AVX-512: `rows` (a constant where inlined) rows by one pair, over inputs [k0, k1): the
 * sums start at zero where k0 is 0, else from acc ([rows][32]), and end in out where k1 is
 * `in`, else in acc (a pair's inputs taken in parts: rows_by_pair). */
static inline __attribute__((always_inline)) T512 void block_512(const float *x, int64_t in,
                                                                const float *w, float *acc,
                                                                float *out, int64_t ldo,
                                                                int64_t k0, int64_t k1,
                                                                const int rows) {
  __m512 a0[MR512], a1[MR512];
#pragma GCC unroll 12
  for (int m = 0; m < MR512; m++) a0[m] = a1[m] = _mm512_setzero_ps();
  if (k0 != 0)
#pragma GCC unroll 12
    for (int m = 0; m < rows; m++) {
      a0[m] = _mm512_loadu_ps(acc + m * PAIR);
      a1[m] = _mm512_loadu_ps(acc + m * PAIR + 16);
    }
  for (int64_t k = k0; k < k1; k++) {
    _mm_prefetch((const char *)(w + (k + AHEAD) * PAIR), _MM_HINT_T0);
    _mm_prefetch((const char *)(w + (k + AHEAD) * PAIR + 16), _MM_HINT_T0);
    const __m512 v0 = _mm512_loadu_ps(w + k * PAIR), v1 = _mm512_loadu_ps(w + k * PAIR + 16);
#pragma GCC unroll 12
    for (int m = 0; m < MR512; m++) {
      if (m < rows) {
        const __m512 xv = _mm512_set1_ps(x[m * in + k]);
        a0[m] = _mm512_fmadd_ps(xv, v0, a0[m]);
        a1[m] = _mm512_fmadd_ps(xv, v1, a1[m]);
      }
    }
  }
  float *dst = k1 == in ? out : acc;
  const int64_t ld = k1 == in ? ldo : PAIR;
#pragma GCC unroll 12
  for (int m = 0; m < rows; m++) {
    _mm512_storeu_ps(dst + m * ld, a0[m]);
    _mm512_storeu_ps(dst + m * ld + 16, a1[m]);
  }
}

/* AVX2 + FMA: `rows` rows by one pair over inputs [k0, k1), as block_512; the weights are
 * read as the multiply-adds' memory operands (12 sums and the broadcasts fill the 16 ymm
 * registers). */
static inline __attribute__((always_inline)) T2 void block_avx2(const float *x, int64_t in,
                                                               const float *w, float *acc,
                                                               float *out, int64_t ldo,
                                                               int64_t k0, int64_t k1,
                                                               const int rows) {
  __m256 a[MR2][4];
#pragma GCC unroll 3
  for (int m = 0; m < MR2; m++)
    a[m][0] = a[m][1] = a[m][2] = a[m][3] = _mm256_setzero_ps();
  if (k0 != 0)
#pragma GCC unroll 3
    for (int m = 0; m < rows; m++)
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++) a[m][j] = _mm256_loadu_ps(acc + m * PAIR + 8 * j);
  for (int64_t k = k0; k < k1; k++) {
    _mm_prefetch((const char *)(w + (k + AHEAD) * PAIR), _MM_HINT_T0);
    _mm_prefetch((const char *)(w + (k + AHEAD) * PAIR + 16), _MM_HINT_T0);
    const float *wk = w + k * PAIR;
#pragma GCC unroll 3
    for (int m = 0; m < MR2; m++) {
      if (m < rows) {
        const __m256 xv = _mm256_broadcast_ss(x + m * in + k);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) a[m][j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wk + 8 * j), a[m][j]);
      }
    }
  }
  float *dst = k1 == in ? out : acc;
  const int64_t ld = k1 == in ? ldo : PAIR;
#pragma GCC unroll 3
  for (int m = 0; m < rows; m++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(dst + m * ld + 8 * j, a[m][j]);
}

/* One function per row count, so each block's loop is unrolled for exactly its rows. */
typedef void (*block_fn)(const float *, int64_t, const float *, float *, float *, int64_t,
                         int64_t, int64_t);
#define ROWS512(R)                                                                           \
  static T512 __attribute__((noinline)) void rows512_##R(                                    \
      const float *x, int64_t in, const float *w, float *acc, float *out, int64_t ldo,       \
      int64_t k0, int64_t k1) {                                                              \
    block_512(x, in, w, acc, out, ldo, k0, k1, R);                                           \
  }
#define ROWS2(R)                                                                             \
  static T2 __attribute__((noinline)) void rows2_##R(const float *x, int64_t in,             \
                                                     const float *w, float *acc, float *out, \
                                                     int64_t ldo, int64_t k0, int64_t k1) {  \
    block_avx2(x, in, w, acc, out, ldo, k0, k1, R);                                          \
  }
ROWS512(1) ROWS512(2) ROWS512(3) ROWS512(4) ROWS512(5) ROWS512(6)
ROWS512(7) ROWS512(8) ROWS512(9) ROWS512(10) ROWS512(11) ROWS512(12)
ROWS2(1) ROWS2(2) ROWS2(3)
static const block_fn BLOCK512[MR512 + 1] = {
    0, rows512_1, rows512_2, rows512_3, rows512_4, rows512_5, rows512_6,
    rows512_7, rows512_8, rows512_9, rows512_10, rows512_11, rows512_12};
static const block_fn BLOCK2[MR2 + 1] = {0, rows2_1, rows2_2, rows2_3};
#endif

/* The best path this CPU runs, capped at `limit` (tests force each path on one machine). */
int brook_f32_isa(int limit) { return vector_isa(limit); }

/* `rows` rows (starting at x and out, at most CHUNK) by pair p, in blocks of at most the
 * path's rows, the rows spread evenly over the blocks (16 rows: 8 + 8, not 12 + 4). Where
 * there are several blocks, the pair's inputs are taken KPART at a time and every block runs
 * over each part before the next (its sums kept in acc between parts): the weights then
 * stream from memory once while all the blocks' multiply-adds run, instead of the first
 * block waiting on memory and the others running after it from cache (16 rows took 1.45x
 * the time of 12, one block; tests/bench/small_m_rate.py). A part's sums carry over
 * exactly, so each output is the same chain of multiply-adds in k order. */
#define KPART 64 /* inputs per part: 8 KiB of a pair, in L1 for the blocks after the first */
#define PART_ROWS 48 /* up to here the weights' stream takes as long as the multiply-adds */

static void rows_by_pair(const float *x, int64_t in, int64_t rows, const float *w, float *out,
                         int64_t ldo, int isa) {
  const int most = isa == ISA_AVX512 ? MR512 : isa == ISA_AVX2 ? MR2 : 1;
  const int64_t blocks = (rows + most - 1) / most;
  float acc[CHUNK * PAIR]; /* the blocks' sums between parts */
  const int64_t step = isa != ISA_C && blocks > 1 && rows <= PART_ROWS ? KPART : in;
  int64_t k0 = 0;
  do { /* at least once: with no inputs at all every output is 0 (+ bias) */
    const int64_t k1 = k0 + step < in ? k0 + step : in;
    int64_t first = 0;
    for (int64_t b = 0; b < blocks; b++) {
      const int count = (int)((rows - first) / (blocks - b));
      const float *xb = x + first * in;
      float *ob = out + first * ldo;
#if defined(__x86_64__) && defined(__GNUC__)
      if (isa == ISA_AVX512)
        BLOCK512[count](xb, in, w, acc + first * PAIR, ob, ldo, k0, k1);
      else if (isa == ISA_AVX2)
        BLOCK2[count](xb, in, w, acc + first * PAIR, ob, ldo, k0, k1);
      else
#endif
        block_c(xb, in, count, w, ob, ldo); /* whole pairs: step is `in` */
      first += count;
    }
    k0 = k1;
  } while (k0 < in);
}

/* out [rows, out_features] = x [rows, in] @ w.T + bias, w packed by brook_f32_pack, bias
 * float32 or NULL. Work items are (chunk of at most CHUNK rows, pair), split evenly between
 * the threads: a decode batch is one chunk, so each thread streams its own run of pairs.
 * The chunks share the rows evenly (128 rows: 64 + 64, not 96 + 32, which left one thread
 * a third of the other's work). */
void brook_f32_matmul(const float *x, const float *packed, const float *bias, float *out,
                      int64_t rows, int64_t out_features, int64_t in, int isa, int threads) {
  const int64_t pairs = out_features / PAIR;
  const int64_t chunks = (rows + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int64_t c = 0; c < chunks; c++) {
    for (int64_t p = 0; p < pairs; p++) {
      const int64_t first = c * rows / chunks;
      const int64_t count = (c + 1) * rows / chunks - first;
      float *o = out + first * out_features + p * PAIR;
      rows_by_pair(x + first * in, in, count, packed + p * in * PAIR, o, out_features, isa);
      if (bias != NULL)
        for (int64_t m = 0; m < count; m++)
          for (int j = 0; j < PAIR; j++) o[m * out_features + j] += bias[p * PAIR + j];
    }
  }
}
