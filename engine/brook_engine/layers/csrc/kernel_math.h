/* Small numeric pieces the CPU kernels of this folder share: BF16 conversions and an exp
 * written out so that loops over it vectorize, which a libm call does not, and the product
 * kernels' choice of vector path. Part of the kernels' build key
 * (brook_engine/layers/cpu_kernels.py). */
#ifndef BROOK_KERNEL_MATH_H
#define BROOK_KERNEL_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* bfloat16 bits -> float32 (exact). */
static inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* float32 -> bfloat16 bits, rounding to nearest even as PyTorch does (NaN kept NaN). */
static inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

/* Element i of a tensor of type `kind` (0 float32, 1 bfloat16, 2 float16, the kernels'
 * numbering) as float32, and f stored into one (rounded to nearest even). */
static inline float load_kind(const void *p, int64_t i, int kind) {
  if (kind == 0) return ((const float *)p)[i];
  if (kind == 1) return bf16_to_float(((const uint16_t *)p)[i]);
  return (float)((const _Float16 *)p)[i];
}

static inline void store_kind(void *p, int64_t i, float f, int kind) {
  if (kind == 0)
    ((float *)p)[i] = f;
  else if (kind == 1)
    ((uint16_t *)p)[i] = float_to_bf16(f);
  else
    ((_Float16 *)p)[i] = (_Float16)f;
}

/* exp(x) for x in [-87, 88]: x = k ln2 + r with |r| <= ln2/2, exp(r) by its Taylor
 * polynomial to degree 7 (relative error below 1e-7), 2^k built in the exponent bits. */
static inline float exp_in_range(float x) {
  const float k = floorf(x * 1.44269504f + 0.5f);
  const float r = (x - k * 0.693145752f) - k * 1.42860677e-6f;
  float p = 1.98412698e-4f;
  p = p * r + 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = ((int32_t)k + 127) << 23;
  float two_k;
  memcpy(&two_k, &bits, sizeof two_k);
  return p * two_k;
}

/* The vector paths of the product kernels (int8_matmul.c, f32_matmul.c): the best this CPU
 * runs, capped at `limit`. */
enum { ISA_C = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

static inline int vector_isa(int limit) {
  int isa = ISA_C;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = ISA_AVX2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    isa = ISA_AVX512;
#endif
  return isa < limit ? isa : limit;
}

#endif
