/* exp(x) written out so that loops over it vectorize, which a libm call does not. Shared by
 * the CPU kernels of this folder; part of their build key (brook_engine/layers/cpu_kernels.py).
 */
#ifndef BROOK_FAST_EXP_H
#define BROOK_FAST_EXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

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

#endif
