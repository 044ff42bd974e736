/* One row times a BF16 weight matrix on CPU: out = x @ weight.T (+ bias), the product a
 * decode step of one sequence makes in every layer. It reads the weight once, as it lies
 * (row-major [out, in], the model's own values), eight rows at a time with AVX512-BF16 dot
 * products that accumulate in float32, and rounds each sum to BF16 once, as PyTorch's BF16
 * product does. PyTorch's own kernels stream a BF16 matrix at about half the memory rate here
 * for a single row. Built by brook_engine/layers/cpu_kernels.py, called from cpu_fused.py.
 *
 * The kernel is compiled for AVX512-BF16 whatever the library's baseline, and callers ask
 * brook_one_row_bf16_supported() first: on a CPU without the instructions it must not run.
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "kernel_math.h"

#define ROWS 8 /* weight rows per pass: eight streams keep the prefetchers busy */
#define TARGET __attribute__((target("avx512f,avx512bw,avx512bf16"), noinline))

/* Rows [first, last) of the output. */
TARGET static void dot_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                            uint16_t *out, int64_t first, int64_t last, int64_t in) {
  const int64_t full = in / 32 * 32;
  const __mmask32 tail = (__mmask32)((1ull << (in - full)) - 1ull);
  int64_t r = first;
  for (; r + ROWS <= last; r += ROWS) {
    __m512 acc[ROWS];
    for (int j = 0; j < ROWS; j++) acc[j] = _mm512_setzero_ps();
    const uint16_t *rows = w + r * in;
    const int ahead = r + 2 * ROWS <= last; /* the next pass's rows, where there is one */
    for (int64_t i = 0; i < full; i += 32) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i));
      for (int j = 0; j < ROWS; j++) {
        if (ahead) _mm_prefetch((const char *)(rows + (ROWS + j) * in + i), _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(rows + j * in + i));
        acc[j] = _mm512_dpbf16_ps(acc[j], wv, xv);
      }
    }
    if (tail) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + full);
      for (int j = 0; j < ROWS; j++) {
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, rows + j * in + full);
        acc[j] = _mm512_dpbf16_ps(acc[j], wv, xv);
      }
    }
    for (int j = 0; j < ROWS; j++) {
      float sum = _mm512_reduce_add_ps(acc[j]);
      if (bias != NULL) sum += bf16_to_float(bias[r + j]);
      out[r + j] = float_to_bf16(sum);
    }
  }
  for (; r < last; r++) {
    __m512 acc = _mm512_setzero_ps();
    const uint16_t *row = w + r * in;
    for (int64_t i = 0; i < full; i += 32) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i));
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(row + i)), xv);
    }
    if (tail) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + full);
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(tail, row + full), xv);
    }
    float sum = _mm512_reduce_add_ps(acc);
    if (bias != NULL) sum += bf16_to_float(bias[r]);
    out[r] = float_to_bf16(sum);
  }
}

int brook_one_row_bf16_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

/* x [in], weight [out_features, in], bias [out_features] or NULL, out [out_features]; all
 * BF16 and contiguous. Each thread takes a contiguous share of the rows, in whole passes. */
void brook_one_row_bf16(const uint16_t *x, const uint16_t *weight, const uint16_t *bias,
                        uint16_t *out, int64_t out_features, int64_t in, int threads) {
  const int64_t passes = (out_features + ROWS - 1) / ROWS;
  /* Below ~64 KiB of weights one thread is faster than waking a second. */
  const int parallel = threads > 1 && out_features * in >= 32768;
#pragma omp parallel num_threads(threads) if (parallel)
  {
    int64_t team = 1, me = 0;
#ifdef _OPENMP
    extern int omp_get_num_threads(void);
    extern int omp_get_thread_num(void);
    team = omp_get_num_threads();
    me = omp_get_thread_num();
#endif
    const int64_t first = passes * me / team * ROWS;
    int64_t last = passes * (me + 1) / team * ROWS;
    if (last > out_features) last = out_features;
    if (first < last) dot_rows(x, weight, bias, out, first, last, in);
  }
}

#else /* no AVX512-BF16 kernel for this architecture or compiler */

int brook_one_row_bf16_supported(void) { return 0; }

void brook_one_row_bf16(const uint16_t *x, const uint16_t *weight, const uint16_t *bias,
                        uint16_t *out, int64_t out_features, int64_t in, int threads) {
  (void)x, (void)weight, (void)bias, (void)out, (void)out_features, (void)in, (void)threads;
}

#endif
