/* One decoder layer for one token on CPU, in one call: a single sequence decoding runs each
 * layer as about ten kernels of this library (norm, products, rotary, KV write, attention,
 * activation) separated by Python and PyTorch dispatch, which costs as much as the kernels'
 * own work at this size. This function runs the same kernels, in the same order, with the
 * same roundings (to the model's type where the PyTorch sequence rounds), so its outputs are
 * the Python path's bit for bit. Called from brook_engine/models/decode_row.py, which checks
 * that the layer is one it can run (float weights it reads plain, float32 weights in Brook's
 * packed layout, W8A16's tiled int8 weights, a cache that stores keys and values as they
 * are, one process).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"

void brook_add_rms_norm(const void *x, const void *delta, const void *weight, void *out,
                        void *residual, int64_t rows, int64_t hidden, float eps, int kind,
                        int threads);
void brook_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int kind,
                    int threads);
void brook_rotary(void *x, const void *cos, const void *sin, int64_t tokens, int64_t heads,
                  int64_t rotated, int64_t dim, int kind, int threads);
int brook_one_row(const void *x, const void *weight, const void *bias, void *out,
                  int64_t out_features, int64_t in, int xkind, int wkind, int isa, int threads);
int brook_int8_matmul(const void *x, const int8_t *packed, const float *scales,
                      const float *bias, void *out, int64_t rows, int64_t out_features,
                      int64_t in, int64_t group, int kind, int isa, int threads);
void brook_f32_matmul(const float *x, const float *packed, const float *bias, float *out,
                      int64_t rows, int64_t out_features, int64_t in, int isa, int threads);
int brook_kv_store(const void *k, const void *v, void *k_cache, void *v_cache,
                   const int64_t *slot_ids, int64_t tokens, int64_t kv_heads, int64_t dim,
                   int64_t token_stride, int64_t slots, int64_t item);
int brook_paged_decode(const float *q, const void *k, const void *v, const float *k_scale,
                       const float *v_scale, const int64_t *tables, const int64_t *lens,
                       float *out, int64_t decodes, int64_t heads, int64_t kv_heads,
                       int64_t dim, int64_t slots, int64_t block_size, int64_t width,
                       int64_t window, int kind, const float *lut, float scale, int threads);

/* One projection's weight: plain [out, in] of `kind` (0 float32, 1 bf16, 2 fp16) with a bias
 * of the model's type, or (kind 3) int8 in brook_int8_pack's tiles with float32 `scales`
 * ([in / group][out rounded up to 16]) and a float32 bias, or (kind 4, float32 models only)
 * float32 in brook_f32_pack's pairs with a float32 bias; bias NULL where there is none. */
typedef struct {
  const void *weight, *bias;
  const float *scales;
  int64_t group;
  int32_t kind;
} brook_row_product;

enum { WEIGHT_INT8 = 3, WEIGHT_F32_PACKED = 4 };

/* A layer's weights and cache, set once. */
typedef struct {
  const void *input_norm, *post_norm; /* [hidden] */
  brook_row_product qkv, o, gate_up, down;
  void *k_cache, *v_cache; /* [kv_heads, slots, dim], model type */
  int64_t hidden, heads, kv_heads, dim, inter, slots, block_size;
  float eps, scale;
} brook_row_layer;

/* out [out_features] = x [in] times the projection, by the kernel its weight's kind takes
 * (isas[kind]: that kernel's path). */
static int product(const brook_row_product *p, const void *x, void *out, int64_t out_features,
                   int64_t in, int kind, const int *isas, int threads) {
  if (p->kind == WEIGHT_INT8)
    return brook_int8_matmul(x, (const int8_t *)p->weight, p->scales, (const float *)p->bias,
                             out, 1, out_features, in, p->group, kind, isas[WEIGHT_INT8],
                             threads);
  if (p->kind == WEIGHT_F32_PACKED) {
    if (kind != 0) return -1; /* float32 activations only (the caller checks) */
    brook_f32_matmul((const float *)x, (const float *)p->weight, (const float *)p->bias,
                     (float *)out, 1, out_features, in, isas[WEIGHT_F32_PACKED], threads);
    return 0;
  }
  return brook_one_row(x, p->weight, p->bias, out, out_features, in, kind, p->kind,
                       isas[p->kind], threads);
}

/* Scratch a layer writes between its kernels, sized for the model (shared by its layers). */
typedef struct {
  void *normed, *qkv, *attn, *o, *gate_up, *act; /* model type */
  float *q32, *attn32;
} brook_row_scratch;

/* x [hidden] (the residual stream) and delta [hidden] or NULL (the previous layer's MLP
 * output) in; residual_out = x + delta and delta_out = this layer's MLP output. cos, sin
 * [dim] of the token's position; slot: where its key and value go; table [width] and len:
 * its sequence's blocks and length (the new token included). Returns 0, or -1 when a kernel
 * failed (a slot outside the cache, no memory): nothing more is run. */
int brook_decode_row_layer(const brook_row_layer *L, const brook_row_scratch *S, const void *x,
                           const void *delta, void *residual_out, void *delta_out,
                           const void *cos, const void *sin, const int64_t *slot,
                           const int64_t *table, const int64_t *len, int64_t width,
                           int64_t window, int kind, const int *isas, int threads) {
  const int64_t H = L->heads, KV = L->kv_heads, D = L->dim, hidden = L->hidden;
  const int64_t width_qkv = (H + 2 * KV) * D;
  const int64_t item = kind == 0 ? 4 : 2;
  const void *residual = delta != NULL ? residual_out : x;
  brook_add_rms_norm(x, delta, L->input_norm, S->normed, delta != NULL ? residual_out : NULL,
                     1, hidden, L->eps, kind, threads);
  if (product(&L->qkv, S->normed, S->qkv, width_qkv, hidden, kind, isas, threads))
    return -1;
  brook_rotary(S->qkv, cos, sin, 1, H + 2 * KV, H + KV, D, kind, threads);
  const char *qkv = (const char *)S->qkv;
  if (brook_kv_store(qkv + H * D * item, qkv + (H + KV) * D * item, L->k_cache, L->v_cache,
                     slot, 1, KV, D, width_qkv, L->slots, item))
    return -1;
  for (int64_t i = 0; i < H * D; i++) S->q32[i] = load_kind(S->qkv, i, kind);
  if (brook_paged_decode(S->q32, L->k_cache, L->v_cache, NULL, NULL, table, len, S->attn32, 1,
                         H, KV, D, L->slots, L->block_size, width, window, kind, NULL, L->scale,
                         threads))
    return -1;
  for (int64_t i = 0; i < H * D; i++) store_kind(S->attn, i, S->attn32[i], kind);
  if (product(&L->o, S->attn, S->o, hidden, H * D, kind, isas, threads))
    return -1;
  /* residual_out = (this layer's input stream) + the attention, element by element (in
   * place where the stream is residual_out already); the MLP's input is its norm. */
  brook_add_rms_norm(residual, S->o, L->post_norm, S->normed, residual_out, 1, hidden, L->eps,
                     kind, threads);
  if (product(&L->gate_up, S->normed, S->gate_up, 2 * L->inter, hidden, kind, isas, threads))
    return -1;
  brook_silu_mul(S->gate_up, S->act, 1, L->inter, kind, threads);
  if (product(&L->down, S->act, delta_out, hidden, L->inter, kind, isas, threads))
    return -1;
  return 0;
}
