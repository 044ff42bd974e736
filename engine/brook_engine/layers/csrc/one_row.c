/* One row times a weight matrix on CPU: out = x @ weight.T (+ bias), the product a
 * decode step of one sequence makes in every layer: a pure stream of the weights. The weight
 * is read once, as it lies (row-major [out, in]), several rows per pass, each value widened
 * to float32 in registers; sums are float32 and each is rounded once to the output type, as
 * PyTorch's 16-bit product does. Built by brook_engine/layers/cpu_kernels.py, called from
 * cpu_fused.py.
 *
 * Types: the weight is float32, bfloat16 or float16 (`wkind`); x, bias and out share one
 * type (`xkind`: float32, bfloat16 or float16). A float32 weight is read as it is (the
 * stream is twice a 16-bit one's; its paths are the f32 functions below). Paths (`isa`,
 * brook_one_row_isa):
 *   3  AVX512-BF16 dot products (bfloat16 x and weight only), eight rows a pass;
 *   2  AVX-512 widening, eight rows a pass;
 *   1  AVX2 + FMA (+ F16C for float16 weights) widening, four rows a pass;
 *   0  portable C.
 * Each path is compiled for its own target whatever the library's baseline; callers take the
 * path brook_one_row_isa() returns, never a better one (a missing instruction kills the
 * process).
 *
 * BF16 widening without shuffles: a 32-bit lane holding two bfloat16 values gives the low one
 * as a float by a left shift of 16 and the high one by masking the low half off. So x is
 * widened once per call into an order where each block of 2V values (V lanes per register)
 * holds its even elements, then its odd ones, and every weight load feeds two FMAs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_F16 = 2 };
enum { ISA_AVX512BF16 = ISA_AVX512 + 1 }; /* beyond the product kernels' paths (kernel_math.h) */

#define PASS 8 /* rows per thread share's unit: every path's pass divides it */

/* out[r] = sum (+ bias[r]), rounded once to the output type. */
static inline void finish(float sum, int64_t r, const void *bias, void *out, int kind) {
  if (bias != NULL) sum += load_kind(bias, r, kind);
  store_kind(out, r, sum, kind);
}

/* x widened to float32, blocks of `block` values reordered evens-then-odds (block 0: as it
 * is); the tail after the last whole block stays in order. */
static void widen_x(const void *x, int kind, int64_t in, int64_t block, float *xf) {
  const int64_t full = block > 0 ? in / block * block : 0;
  for (int64_t b = 0; b < full; b += block)
    for (int64_t j = 0; j < block / 2; j++) {
      xf[b + j] = load_kind(x, b + 2 * j, kind);
      xf[b + block / 2 + j] = load_kind(x, b + 2 * j + 1, kind);
    }
  for (int64_t i = full; i < in; i++) xf[i] = load_kind(x, i, kind);
}

static inline float weight_at(const uint16_t *w, int64_t i, int wkind) {
  return wkind == KIND_BF16 ? bf16_to_float(w[i]) : (float)((const _Float16 *)w)[i];
}

/* The tail of a row past `full`, in order (x widened in order there). */
static inline float tail_sum(const float *xf, const uint16_t *row, int64_t full, int64_t in,
                             int wkind) {
  float sum = 0.0f;
  for (int64_t i = full; i < in; i++) sum += weight_at(row, i, wkind) * xf[i];
  return sum;
}

/* Portable: rows [first, last), x widened in order. Sixteen independent sums per row, so
 * the compiler vectorizes the loop without reordering any sum. */
static void rows_c(const float *xf, const uint16_t *w, const void *bias, void *out,
                   int64_t first, int64_t last, int64_t in, int wkind, int xkind) {
  const int64_t full = in / 16 * 16;
  for (int64_t r = first; r < last; r++) {
    const uint16_t *row = w + r * in;
    float acc[16] = {0};
    if (wkind == KIND_BF16) {
      for (int64_t i = 0; i < full; i += 16)
        for (int j = 0; j < 16; j++) {
          const uint32_t bits = (uint32_t)row[i + j] << 16;
          float f;
          memcpy(&f, &bits, sizeof f);
          acc[j] += f * xf[i + j];
        }
    } else {
      const _Float16 *half = (const _Float16 *)row;
      for (int64_t i = 0; i < full; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += (float)half[i + j] * xf[i + j];
    }
    float sum = tail_sum(xf, row, full, in, wkind);
    for (int j = 0; j < 16; j++) sum += acc[j];
    finish(sum, r, bias, out, xkind);
  }
}

/* The tail of a float32 row past `full`, in order. */
static inline float tail_sum_f32(const float *xf, const float *row, int64_t full, int64_t in) {
  float sum = 0.0f;
  for (int64_t i = full; i < in; i++) sum += row[i] * xf[i];
  return sum;
}

/* Portable, float32 weights: sixteen independent sums per row, as rows_c. */
static void rows_f32_c(const float *xf, const float *w, const void *bias, void *out,
                       int64_t first, int64_t last, int64_t in, int xkind) {
  const int64_t full = in / 16 * 16;
  for (int64_t r = first; r < last; r++) {
    const float *row = w + r * in;
    float acc[16] = {0};
    for (int64_t i = 0; i < full; i += 16)
      for (int j = 0; j < 16; j++) acc[j] += row[i + j] * xf[i + j];
    float sum = tail_sum_f32(xf, row, full, in);
    for (int j = 0; j < 16; j++) sum += acc[j];
    finish(sum, r, bias, out, xkind);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TARGET2 __attribute__((target("avx2,fma,f16c"), noinline))
#define TARGET512 __attribute__((target("avx512f,avx512bw"), noinline))
#define TARGET512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16"), noinline))

static inline __attribute__((always_inline, target("avx2,fma"))) float hsum_256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* AVX2: four rows a pass. bfloat16: blocks of 16 (x evens then odds); float16: blocks of 8
 * (x in order), converted by F16C. The next pass's rows are prefetched. */
TARGET2 static void rows_avx2(const float *xf, const uint16_t *w, const void *bias, void *out,
                              int64_t first, int64_t last, int64_t in, int wkind, int xkind) {
  const int bf16 = wkind == KIND_BF16;
  const int64_t block = bf16 ? 16 : 8;
  const int64_t full = in / block * block;
  const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
  int64_t r = first;
  for (; r + 4 <= last; r += 4) {
    __m256 a[4], b[4];
    for (int j = 0; j < 4; j++) a[j] = b[j] = _mm256_setzero_ps();
    const uint16_t *rows = w + r * in;
    const int ahead = r + 8 <= last;
    if (bf16) {
      for (int64_t i = 0; i < full; i += 16) {
        const __m256 xe = _mm256_loadu_ps(xf + i), xo = _mm256_loadu_ps(xf + i + 8);
        for (int j = 0; j < 4; j++) {
          if (ahead) _mm_prefetch((const char *)(rows + (4 + j) * in + i), _MM_HINT_T0);
          const __m256i v = _mm256_loadu_si256((const __m256i *)(rows + j * in + i));
          a[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), xe, a[j]);
          b[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)), xo, b[j]);
        }
      }
    } else {
      int64_t i = 0;
      for (; i + 16 <= full; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(xf + i), x1 = _mm256_loadu_ps(xf + i + 8);
        for (int j = 0; j < 4; j++) {
          if (ahead) _mm_prefetch((const char *)(rows + (4 + j) * in + i), _MM_HINT_T0);
          const uint16_t *p = rows + j * in + i;
          a[j] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), x0, a[j]);
          b[j] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))), x1,
                                 b[j]);
        }
      }
      for (; i < full; i += 8) {
        const __m256 x0 = _mm256_loadu_ps(xf + i);
        for (int j = 0; j < 4; j++) {
          const __m128i h = _mm_loadu_si128((const __m128i *)(rows + j * in + i));
          a[j] = _mm256_fmadd_ps(_mm256_cvtph_ps(h), x0, a[j]);
        }
      }
    }
    for (int j = 0; j < 4; j++) {
      const float sum = hsum_256(_mm256_add_ps(a[j], b[j]));
      finish(sum + tail_sum(xf, rows + j * in, full, in, wkind), r + j, bias, out, xkind);
    }
  }
  for (; r < last; r++) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    const uint16_t *row = w + r * in;
    for (int64_t i = 0; i < full; i += block) {
      if (bf16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(row + i));
        a = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
                            _mm256_loadu_ps(xf + i), a);
        b = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)),
                            _mm256_loadu_ps(xf + i + 8), b);
      } else {
        const __m128i h = _mm_loadu_si128((const __m128i *)(row + i));
        a = _mm256_fmadd_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(xf + i), a);
      }
    }
    const float sum = hsum_256(_mm256_add_ps(a, b));
    finish(sum + tail_sum(xf, row, full, in, wkind), r, bias, out, xkind);
  }
}

/* AVX-512 widening: eight rows a pass; bfloat16 blocks of 32 (x evens then odds), float16
 * blocks of 16 (x in order). */
TARGET512 static void rows_512(const float *xf, const uint16_t *w, const void *bias, void *out,
                               int64_t first, int64_t last, int64_t in, int wkind, int xkind) {
  const int bf16 = wkind == KIND_BF16;
  const int64_t block = bf16 ? 32 : 16;
  const int64_t full = in / block * block;
  const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
  int64_t r = first;
  for (; r + 8 <= last; r += 8) {
    __m512 a[8], b[8];
    for (int j = 0; j < 8; j++) a[j] = b[j] = _mm512_setzero_ps();
    const uint16_t *rows = w + r * in;
    const int ahead = r + 16 <= last;
    for (int64_t i = 0; i < full; i += block) {
      if (bf16) {
        const __m512 xe = _mm512_loadu_ps(xf + i), xo = _mm512_loadu_ps(xf + i + 16);
        for (int j = 0; j < 8; j++) {
          if (ahead) _mm_prefetch((const char *)(rows + (8 + j) * in + i), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512((const void *)(rows + j * in + i));
          a[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), xe, a[j]);
          b[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, high)), xo, b[j]);
        }
      } else {
        const __m512 x0 = _mm512_loadu_ps(xf + i);
        for (int j = 0; j < 8; j++) {
          if (ahead && i % 32 == 0)
            _mm_prefetch((const char *)(rows + (8 + j) * in + i), _MM_HINT_T0);
          const __m256i h = _mm256_loadu_si256((const __m256i *)(rows + j * in + i));
          a[j] = _mm512_fmadd_ps(_mm512_cvtph_ps(h), x0, a[j]);
        }
      }
    }
    for (int j = 0; j < 8; j++) {
      const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a[j], b[j]));
      finish(sum + tail_sum(xf, rows + j * in, full, in, wkind), r + j, bias, out, xkind);
    }
  }
  for (; r < last; r++) {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    const uint16_t *row = w + r * in;
    for (int64_t i = 0; i < full; i += block) {
      if (bf16) {
        const __m512i v = _mm512_loadu_si512((const void *)(row + i));
        a = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
                            _mm512_loadu_ps(xf + i), a);
        b = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, high)),
                            _mm512_loadu_ps(xf + i + 16), b);
      } else {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(row + i));
        a = _mm512_fmadd_ps(_mm512_cvtph_ps(h), _mm512_loadu_ps(xf + i), a);
      }
    }
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    finish(sum + tail_sum(xf, row, full, in, wkind), r, bias, out, xkind);
  }
}

/* AVX2, float32 weights: four rows a pass, two sums per row (16 values a step); the next
 * pass's rows are prefetched. */
TARGET2 static void rows_f32_avx2(const float *xf, const float *w, const void *bias, void *out,
                                  int64_t first, int64_t last, int64_t in, int xkind) {
  const int64_t full = in / 16 * 16;
  int64_t r = first;
  for (; r + 4 <= last; r += 4) {
    __m256 a[4], b[4];
    for (int j = 0; j < 4; j++) a[j] = b[j] = _mm256_setzero_ps();
    const float *rows = w + r * in;
    const int ahead = r + 8 <= last;
    for (int64_t i = 0; i < full; i += 16) {
      const __m256 x0 = _mm256_loadu_ps(xf + i), x1 = _mm256_loadu_ps(xf + i + 8);
      for (int j = 0; j < 4; j++) {
        const float *p = rows + j * in + i;
        if (ahead) {
          _mm_prefetch((const char *)(p + 4 * in), _MM_HINT_T0);
          _mm_prefetch((const char *)(p + 4 * in + 8), _MM_HINT_T0);
        }
        a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(p), x0, a[j]);
        b[j] = _mm256_fmadd_ps(_mm256_loadu_ps(p + 8), x1, b[j]);
      }
    }
    for (int j = 0; j < 4; j++) {
      const float sum = hsum_256(_mm256_add_ps(a[j], b[j]));
      finish(sum + tail_sum_f32(xf, rows + j * in, full, in), r + j, bias, out, xkind);
    }
  }
  for (; r < last; r++) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    const float *row = w + r * in;
    for (int64_t i = 0; i < full; i += 16) {
      a = _mm256_fmadd_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(xf + i), a);
      b = _mm256_fmadd_ps(_mm256_loadu_ps(row + i + 8), _mm256_loadu_ps(xf + i + 8), b);
    }
    const float sum = hsum_256(_mm256_add_ps(a, b));
    finish(sum + tail_sum_f32(xf, row, full, in), r, bias, out, xkind);
  }
}

/* AVX-512, float32 weights: eight rows a pass, one sum per row (16 values a step, a cache
 * line); the next pass's rows are prefetched. */
TARGET512 static void rows_f32_512(const float *xf, const float *w, const void *bias, void *out,
                                   int64_t first, int64_t last, int64_t in, int xkind) {
  const int64_t full = in / 16 * 16;
  int64_t r = first;
  for (; r + 8 <= last; r += 8) {
    __m512 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
    const float *rows = w + r * in;
    const int ahead = r + 16 <= last;
    for (int64_t i = 0; i < full; i += 16) {
      const __m512 x0 = _mm512_loadu_ps(xf + i);
      for (int j = 0; j < 8; j++) {
        const float *p = rows + j * in + i;
        if (ahead) _mm_prefetch((const char *)(p + 8 * in), _MM_HINT_T0);
        a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(p), x0, a[j]);
      }
    }
    for (int j = 0; j < 8; j++) {
      const float sum = _mm512_reduce_add_ps(a[j]);
      finish(sum + tail_sum_f32(xf, rows + j * in, full, in), r + j, bias, out, xkind);
    }
  }
  for (; r < last; r++) {
    __m512 a = _mm512_setzero_ps();
    const float *row = w + r * in;
    for (int64_t i = 0; i < full; i += 16)
      a = _mm512_fmadd_ps(_mm512_loadu_ps(row + i), _mm512_loadu_ps(xf + i), a);
    const float sum = _mm512_reduce_add_ps(a);
    finish(sum + tail_sum_f32(xf, row, full, in), r, bias, out, xkind);
  }
}

/* AVX512-BF16: bfloat16 x and weight, pairs of products summed by the dot instruction in
 * float32; eight rows a pass. */
TARGET512BF16 static void rows_512bf16(const uint16_t *x, const uint16_t *w, const void *bias,
                                       void *out, int64_t first, int64_t last, int64_t in) {
  const int64_t full = in / 32 * 32;
  const __mmask32 tail = (__mmask32)((1ull << (in - full)) - 1ull);
  int64_t r = first;
  for (; r + 8 <= last; r += 8) {
    __m512 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
    const uint16_t *rows = w + r * in;
    const int ahead = r + 16 <= last;
    for (int64_t i = 0; i < full; i += 32) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i));
      for (int j = 0; j < 8; j++) {
        if (ahead) _mm_prefetch((const char *)(rows + (8 + j) * in + i), _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(rows + j * in + i));
        acc[j] = _mm512_dpbf16_ps(acc[j], wv, xv);
      }
    }
    if (tail) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + full);
      for (int j = 0; j < 8; j++) {
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, rows + j * in + full);
        acc[j] = _mm512_dpbf16_ps(acc[j], wv, xv);
      }
    }
    for (int j = 0; j < 8; j++) finish(_mm512_reduce_add_ps(acc[j]), r + j, bias, out, KIND_BF16);
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
    finish(_mm512_reduce_add_ps(acc), r, bias, out, KIND_BF16);
  }
}
#endif

/* The best path for these types on this CPU, capped at `limit` (tests force each path on
 * one machine). */
int brook_one_row_isa(int limit, int xkind, int wkind) {
  int isa = ISA_C;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    isa = ISA_AVX2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) isa = ISA_AVX512;
  if (isa == ISA_AVX512 && xkind == KIND_BF16 && wkind == KIND_BF16 &&
      __builtin_cpu_supports("avx512bf16"))
    isa = ISA_AVX512BF16;
#else
  (void)xkind, (void)wkind;
#endif
  return isa < limit ? isa : limit;
}

/* x [in], weight [out_features, in], bias [out_features] or NULL, out [out_features], all
 * contiguous. Each thread takes a contiguous share of the rows. Returns 0, or -1 when the
 * scratch for x could not be allocated (nothing written). */
int brook_one_row(const void *x, const void *weight, const void *bias, void *out,
                  int64_t out_features, int64_t in, int xkind, int wkind, int isa, int threads) {
  if (isa == ISA_AVX512BF16 && (xkind != KIND_BF16 || wkind != KIND_BF16)) isa = ISA_AVX512;
  float *xf = NULL;
  if (isa != ISA_AVX512BF16) {
    /* BF16 blocks of two registers' lanes, evens then odds; float32, float16 (and C) in
     * order. */
    const int64_t block = isa == ISA_C || wkind != KIND_BF16 ? 0 : (isa == ISA_AVX2 ? 16 : 32);
    xf = (float *)malloc((size_t)(in + 16) * sizeof(float));
    if (xf == NULL) return -1;
    widen_x(x, xkind, in, block, xf);
  }
  const int64_t passes = (out_features + PASS - 1) / PASS;
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
    const int64_t first = passes * me / team * PASS;
    int64_t last = passes * (me + 1) / team * PASS;
    if (last > out_features) last = out_features;
    if (first < last) {
      const float *wf = (const float *)weight;
      const uint16_t *wh = (const uint16_t *)weight;
#if defined(__x86_64__) && defined(__GNUC__)
      if (wkind == KIND_F32 && isa >= ISA_AVX512)
        rows_f32_512(xf, wf, bias, out, first, last, in, xkind);
      else if (wkind == KIND_F32 && isa == ISA_AVX2)
        rows_f32_avx2(xf, wf, bias, out, first, last, in, xkind);
      else if (isa == ISA_AVX512BF16)
        rows_512bf16((const uint16_t *)x, wh, bias, out, first, last, in);
      else if (isa == ISA_AVX512)
        rows_512(xf, wh, bias, out, first, last, in, wkind, xkind);
      else if (isa == ISA_AVX2)
        rows_avx2(xf, wh, bias, out, first, last, in, wkind, xkind);
      else
#endif
      if (wkind == KIND_F32)
        rows_f32_c(xf, wf, bias, out, first, last, in, xkind);
      else
        rows_c(xf, wh, bias, out, first, last, in, wkind, xkind);
    }
  }
  free(xf);
  return 0;
}
