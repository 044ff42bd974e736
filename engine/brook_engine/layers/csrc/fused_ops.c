/* Fused element-wise steps of a decoder layer on CPU: each replaces a chain of small
 * PyTorch operations (and the temporaries between them) by one pass over the rows. Built
 * with the decode-attention kernel into one library by brook_engine/layers/cpu_kernels.py
 * and called through ctypes from brook_engine/layers/cpu_fused.py.
 *
 * Each function rounds where the PyTorch sequence it replaces rounds (to the model's
 * 16-bit type after every operation PyTorch runs in that type), so results match the
 * portable path up to the order of a sum; floating-point contraction is off in this file so
 * that a product and the sum after it are not fused into one rounding.
 *
 * Types (`kind`): 0 float32, 1 bfloat16, 2 float16. Tensors are contiguous, row-major.
 * Rows are split over OpenMP threads when there is enough work to pay for waking them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernel_math.h"

#pragma GCC optimize("fp-contract=off")

enum { F32 = 0, BF16 = 1, F16 = 2 };

/* Below this many elements a call runs on the calling thread: waking the pool costs more
 * than it saves (a single decode row is 576-3,072 elements). */
#define PARALLEL_MIN 32768

/* f rounded to the storage type (what PyTorch's result in that type holds). */
static inline float round_to(float f, int kind) {
  if (kind == BF16) return bf16_to_float(float_to_bf16(f));
  if (kind == F16) return (float)(_Float16)f;
  return f;
}


/* exp(x) over the whole float range. Beyond float32's range it returns infinity (as expf
 * does), so that
 * silu(g) = g / (1 + exp(-g)) is -0 for very negative g and NaN at -infinity, as PyTorch's. */
static inline float exp_any(float x) {
  const int overflow = x > 88.7228f;
  const float e = exp_in_range(x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x));
  return overflow ? INFINITY : e;
}

/* One row of brook_add_rms_norm, for a `kind` known where it is inlined: with the type's
 * loads and stores fixed, its loops run in vector registers (with `kind` a variable they
 * ran an element at a time). */
static inline __attribute__((always_inline)) void norm_row(const void *x, const void *delta,
                                                           const void *weight, void *out,
                                                           void *residual, int64_t base,
                                                           int64_t hidden, float eps,
                                                           const int kind) {
  float sum = 0.0f;
  if (delta != NULL) {
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; i++) {
      const float v = round_to(load_kind(x, base + i, kind) + load_kind(delta, base + i, kind), kind);
      store_kind(residual, base + i, v, kind);
      sum += v * v;
    }
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; i++) {
      const float v = load_kind(x, base + i, kind);
      sum += v * v;
    }
  }
  const void *src = delta != NULL ? residual : x;
  const float scale = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; i++) {
    const float normed = round_to(load_kind(src, base + i, kind) * scale, kind);
    store_kind(out, base + i, load_kind(weight, i, kind) * normed, kind);
  }
}

/* residual = x + delta (or x when delta is NULL; then residual may be NULL), rounded to the
 * type; out = weight * rms_norm(residual in float32) with the normalized value rounded to
 * the type before the weight multiplies it — RMSNorm's forward in layers/norm.py. */
void brook_add_rms_norm(const void *x, const void *delta, const void *weight, void *out,
                        void *residual, int64_t rows, int64_t hidden, float eps, int kind,
                        int threads) {
  const int parallel = rows > 1 && rows * hidden >= PARALLEL_MIN;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    if (kind == F32)
      norm_row(x, delta, weight, out, residual, r * hidden, hidden, eps, F32);
    else if (kind == BF16)
      norm_row(x, delta, weight, out, residual, r * hidden, hidden, eps, BF16);
    else
      norm_row(x, delta, weight, out, residual, r * hidden, hidden, eps, F16);
  }
}

/* out[r] = silu(gate[r]) * up[r] for gate_up [rows, 2 * inter] (gate first), silu's value
 * rounded to the type before the product, as F.silu(gate) * up computes it. */
/* One row of brook_silu_mul, for a `kind` known where it is inlined: with the type's loads
 * and stores fixed, the loop (exp included) runs in vector registers. */
static inline __attribute__((always_inline)) void silu_mul_row(const void *gate_up, void *out,
                                                               int64_t in, int64_t at,
                                                               int64_t inter, const int kind) {
#pragma omp simd
  for (int64_t i = 0; i < inter; i++) {
    const float g = load_kind(gate_up, in + i, kind);
    const float silu = round_to(g / (1.0f + exp_any(-g)), kind);
    store_kind(out, at + i, silu * load_kind(gate_up, in + inter + i, kind), kind);
  }
}

void brook_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int kind,
                    int threads) {
  const int parallel = rows * inter >= PARALLEL_MIN;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    const int64_t in = r * 2 * inter, at = r * inter;
    if (kind == F32)
      silu_mul_row(gate_up, out, in, at, inter, F32);
    else if (kind == BF16)
      silu_mul_row(gate_up, out, in, at, inter, BF16);
    else
      silu_mul_row(gate_up, out, in, at, inter, F16);
  }
}

/* One head of one token of brook_rotary, for a `kind` known where it is inlined. */
static inline __attribute__((always_inline)) void rotary_head(void *x, const void *cos,
                                                              const void *sin, int64_t at,
                                                              int64_t c, int64_t half,
                                                              const int kind) {
#pragma omp simd
  for (int64_t i = 0; i < half; i++) {
    const float a = load_kind(x, at + i, kind), b = load_kind(x, at + half + i, kind);
    const float lo = round_to(a * load_kind(cos, c + i, kind), kind) +
                     round_to(-b * load_kind(sin, c + i, kind), kind);
    const float hi = round_to(b * load_kind(cos, c + half + i, kind), kind) +
                     round_to(a * load_kind(sin, c + half + i, kind), kind);
    store_kind(x, at + i, lo, kind);
    store_kind(x, at + half + i, hi, kind);
  }
}

/* Rotary embedding in place on the first `rotated` heads of x [tokens, heads, dim] with
 * cos, sin [tokens, dim] (already looked up by position): x * cos + rotate_half(x) * sin,
 * each product and the sum rounded to the type (layers/rotary.apply_rotary). */
void brook_rotary(void *x, const void *cos, const void *sin, int64_t tokens, int64_t heads,
                  int64_t rotated, int64_t dim, int kind, int threads) {
  const int64_t half = dim / 2;
  const int parallel = tokens * rotated * dim >= PARALLEL_MIN;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
  for (int64_t t = 0; t < tokens; t++) {
    for (int64_t h = 0; h < rotated; h++) {
      const int64_t at = (t * heads + h) * dim, c = t * dim;
      if (kind == F32)
        rotary_head(x, cos, sin, at, c, half, F32);
      else if (kind == BF16)
        rotary_head(x, cos, sin, at, c, half, BF16);
      else
        rotary_head(x, cos, sin, at, c, half, F16);
    }
  }
}
