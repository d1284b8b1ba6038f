"""``paged_attention`` and ``paged_kv_write``: the engine's KV cache, one query token at a time.

Like the products (``linear.py``), batch invariant by construction: nothing mixes two tokens, and
each sum runs in an order that depends only on its own token's sizes.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from .attach import native_kernel
from .simd import VEC

_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)
_I8 = np.dtype(np.int8)

PAGED_ATTENTION = (
    VEC
    + r"""
#include <stdlib.h>
#include <string.h>
/* paged_attention, one query token at a time, as the reference does for it: scores q.k * scale,
   minus their max, exp, divided by their sum, then the values summed with those weights in
   position order. Decode (every token its own segment): token n = (b, s) attends to positions
   0 .. kv_len[n]-1 of the sequence whose blocks are block_tables[n]. Prefill (segments: q_start,
   q_len): token q_start[i] + j of segment i sits at position kv_len[i] - q_len[i] + j of the
   sequence of block_tables[i] and attends to positions 0 .. up to itself. Nothing mixes two
   tokens, so a token's bits do not depend on the batch, the segmenting or the thread count. The
   query heads of one kv head are done together (each key and value read once for them).
   An int8 pool (q8) holds rows of D int8 codes and their float32 scale: a block's rows are
   dequantized (code * scale, as ops.paged.dequantize_kv) into scratch when read, then used as a
   float pool's.
   bufs: q [B, HQ, S, D], pool [L, 2, NB, BS, HK, D] (int8: D + 4), block_tables [NS, MB], kv_len [NS],
         (q_start [NS], q_len [NS],) out [B, HQ, S, D], status.
   sizes: B, HQ, S, D, NB, BS, HK, MB, layer, scale (double bits), segmented, NS, q8. */
/* rows n of block b of a pool half (keys or values): the pool's own floats, or dequantized into buf */
static inline __attribute__((always_inline)) const float *KERNEL_FN_rows(
    const char *half, int64_t b, int64_t n, int64_t BS, int64_t HK, int64_t q8, float *buf, const int64_t D) {
  if (!q8) return (const float *)half + b * BS * HK * D;
  const int8_t *src = (const int8_t *)half + b * BS * HK * (D + 4);
  for (int64_t r = 0; r < n * HK; r++, src += D + 4) {
    float s;
    memcpy(&s, src + D, sizeof s);
    for (int64_t d = 0; d < D; d++) buf[r * D + d] = (float)src[d] * s;
  }
  return buf;
}
/* One query token, all its heads, a KV block at a time: a block's rows (every kv head's key or
   value of BS positions, contiguous) are read once, for all the heads, while they are in L1;
   going head by head over the whole sequence read each row in HK strided passes. Every score and
   every output element is still the same chain as one head alone would compute: a score is one
   dot product (8 lanes, then the fixed tree), the outputs add the positions in order (a block
   continues from the running sums it stored). D is a constant where it is inlined.
   q: head hq at q + hq * qstride; out likewise; p: scratch [HQ][t]. */
static inline __attribute__((always_inline)) void KERNEL_FN_token(
    const float *q, int64_t qstride, const char *keys, const char *values, const int64_t *blocks,
    int64_t t, int64_t BS, int64_t row, int64_t q8, int64_t HK, int64_t G, float scale, float *out,
    int64_t ostride, float *p, float *buf, const int64_t D) {
  const int64_t d8 = D - D % 8, HQ = HK * G;
  for (int64_t i0 = 0; i0 < t; i0 += BS) { /* scores */
    const int64_t i1 = i0 + BS < t ? i0 + BS : t;
    const float *kb = KERNEL_FN_rows(keys, blocks[i0 / BS], i1 - i0, BS, HK, q8, buf, D);
    for (int64_t h = 0; h < HK; h++)
      for (int64_t g = 0; g < G; g++) {
        const float *qv = q + (h * G + g) * qstride;
        float *ph = p + (h * G + g) * t;
        int64_t i = i0;
        if (D % 8 == 0) /* eight positions at a time: their sums in one transposed tree */
          for (; i + 8 <= i1; i += 8) {
            KERNEL_FN_v acc[8];
            for (int r = 0; r < 8; r++) acc[r] = KERNEL_FN_splat(0.0f);
            for (int64_t d = 0; d < D; d += 8) {
              const KERNEL_FN_v qd = KERNEL_FN_ld(qv + d);
              for (int r = 0; r < 8; r++)
                acc[r] = KERNEL_FN_mac(acc[r], qd, KERNEL_FN_ld(kb + (i - i0 + r) * row + h * D + d));
            }
            KERNEL_FN_st(ph + i, KERNEL_FN_hsum8(acc) * KERNEL_FN_splat(scale));
          }
        for (; i < i1; i++) {
          const float *k = kb + (i - i0) * row + h * D;
          float s = 0.0f;
          if (d8) {
            KERNEL_FN_v acc = KERNEL_FN_splat(0.0f);
            for (int64_t d = 0; d < d8; d += 8)
              acc = KERNEL_FN_mac(acc, KERNEL_FN_ld(qv + d), KERNEL_FN_ld(k + d));
            s = KERNEL_FN_hsum(acc);
          }
          for (int64_t d = d8; d < D; d++) s = KERNEL_FN_smac(s, qv[d], k[d]);
          ph[i] = s * scale;
        }
      }
  }
  for (int64_t hq = 0; hq < HQ; hq++) { /* softmax of each head's scores: exp(s - max) ... */
    float *pg = p + hq * t, top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < t; i++) top = pg[i] > top ? pg[i] : top;
#pragma omp simd
    for (int64_t i = 0; i < t; i++) pg[i] = expf(pg[i] - top);
  }
  for (int64_t h0 = 0; h0 < HQ; h0 += 16) { /* ... / their sum, in position order, 16 heads side by side */
    const int64_t h1 = h0 + 16 < HQ ? h0 + 16 : HQ;
    float sum[16];
    for (int64_t hq = h0; hq < h1; hq++) sum[hq - h0] = 0.0f;
    for (int64_t i = 0; i < t; i++)
      for (int64_t hq = h0; hq < h1; hq++) sum[hq - h0] = sum[hq - h0] + p[hq * t + i];
    for (int64_t hq = h0; hq < h1; hq++) {
      float *pg = p + hq * t;
      const float s = sum[hq - h0];
      for (int64_t i = 0; i < t; i++) pg[i] = pg[i] / s;
    }
  }
  for (int64_t i0 = 0; i0 < t; i0 += BS) { /* values, in position order */
    const int64_t i1 = i0 + BS < t ? i0 + BS : t;
    const float *vb = KERNEL_FN_rows(values, blocks[i0 / BS], i1 - i0, BS, HK, q8, buf, D);
    for (int64_t h = 0; h < HK; h++)
      for (int64_t g = 0; g < G; g++) {
        const float *pg = p + (h * G + g) * t;
        float *o = out + (h * G + g) * ostride;
        if (D == 32 && g + 1 < G) { /* two heads' output rows in registers over the block (one value row) */
          const float *pg2 = pg + t;
          float *o2 = o + ostride;
          KERNEL_FN_v a0[4], a1[4];
          for (int c = 0; c < 4; c++) {
            a0[c] = i0 ? KERNEL_FN_ld(o + 8 * c) : KERNEL_FN_splat(0.0f);
            a1[c] = i0 ? KERNEL_FN_ld(o2 + 8 * c) : KERNEL_FN_splat(0.0f);
          }
          for (int64_t i = i0; i < i1; i++) {
            const float *v = vb + (i - i0) * row + h * D;
            const KERNEL_FN_v p0 = KERNEL_FN_splat(pg[i]), p1 = KERNEL_FN_splat(pg2[i]);
            for (int c = 0; c < 4; c++) {
              const KERNEL_FN_v vc = KERNEL_FN_ld(v + 8 * c);
              a0[c] = KERNEL_FN_mac(a0[c], p0, vc);
              a1[c] = KERNEL_FN_mac(a1[c], p1, vc);
            }
          }
          for (int c = 0; c < 4; c++) {
            KERNEL_FN_st(o + 8 * c, a0[c]);
            KERNEL_FN_st(o2 + 8 * c, a1[c]);
          }
          g++;
          continue;
        }
#if defined(__AVX512F__) && defined(__FMA__)
        if (D % 16 == 0 && D <= 128) { /* the same, 16 lanes per register: the same chain per element */
          __m512 acc[8];
          for (int64_t c = 0; c < D / 16; c++)
            acc[c] = i0 ? _mm512_loadu_ps(o + 16 * c) : _mm512_setzero_ps();
          for (int64_t i = i0; i < i1; i++) {
            const float *v = vb + (i - i0) * row + h * D;
            const __m512 pi = _mm512_set1_ps(pg[i]);
            for (int64_t c = 0; c < D / 16; c++)
              acc[c] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(v + 16 * c), acc[c]);
          }
          for (int64_t c = 0; c < D / 16; c++) _mm512_storeu_ps(o + 16 * c, acc[c]);
          continue;
        }
#endif
        if (D == 32 || D == 64) { /* the output row in registers over the block */
          KERNEL_FN_v acc[8];
          for (int64_t c = 0; c < D / 8; c++)
            acc[c] = i0 ? KERNEL_FN_ld(o + 8 * c) : KERNEL_FN_splat(0.0f);
          for (int64_t i = i0; i < i1; i++) {
            const float *v = vb + (i - i0) * row + h * D;
            const KERNEL_FN_v pi = KERNEL_FN_splat(pg[i]);
            for (int64_t c = 0; c < D / 8; c++) acc[c] = KERNEL_FN_mac(acc[c], pi, KERNEL_FN_ld(v + 8 * c));
          }
          for (int64_t c = 0; c < D / 8; c++) KERNEL_FN_st(o + 8 * c, acc[c]);
          continue;
        }
        if (i0 == 0)
          for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t i = i0; i < i1; i++) {
          const float *v = vb + (i - i0) * row + h * D;
          const KERNEL_FN_v pi = KERNEL_FN_splat(pg[i]);
          int64_t d = 0;
          for (; d < d8; d += 8)
            KERNEL_FN_st(o + d, KERNEL_FN_mac(KERNEL_FN_ld(o + d), pi, KERNEL_FN_ld(v + d)));
          for (; d < D; d++) o[d] = KERNEL_FN_smac(o[d], pg[i], v[d]);
        }
      }
  }
}

typedef struct {
  const float *q;
  float *out;
  const char *keys, *values;
  const int64_t *tables, *seg, *len;
  float *scratch;
  int64_t per_worker, S, D, MB, BS, row, q8, HK, G;
  float scale;
} KERNEL_FN_job;

/* one claim: query token n */
static void KERNEL_FN_one(void *arg, int64_t n, int64_t worker) {
  const KERNEL_FN_job *j = (const KERNEL_FN_job *)arg;
  const int64_t S = j->S, D = j->D, HQ = j->HK * j->G, b = n / S, s = n % S;
  if (j->seg[n] < 0) { /* in no segment: zeros, as the reference */
    for (int64_t h = 0; h < HQ; h++) memset(j->out + ((b * HQ + h) * S + s) * D, 0, sizeof(float) * D);
    return;
  }
  const int64_t *blocks = j->tables + j->seg[n] * j->MB;
  const int64_t at = (b * HQ * S + s) * D, hs = S * D; /* head 0 of token n in q and out; between heads */
  float *p = j->scratch + worker * j->per_worker, *buf = p + (j->per_worker - j->BS * j->row);
#define KERNEL_FN_TOKEN(DIM)                                                                          \
  KERNEL_FN_token(j->q + at, hs, j->keys, j->values, blocks, j->len[n], j->BS, j->row, j->q8, j->HK, \
                  j->G, j->scale, j->out + at, hs, p, buf, DIM)
  switch (D) { /* head dims inlined as constants: loops unrolled, rows kept in registers */
    case 32: KERNEL_FN_TOKEN(32); break;
    case 64: KERNEL_FN_TOKEN(64); break;
    case 128: KERNEL_FN_TOKEN(128); break;
    default: KERNEL_FN_TOKEN(D);
  }
}

void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  const int64_t B = sizes[0], HQ = sizes[1], S = sizes[2], D = sizes[3], NB = sizes[4], BS = sizes[5];
  const int64_t HK = sizes[6], MB = sizes[7], layer = sizes[8], G = HQ / HK;
  const int64_t segmented = sizes[10], NS = segmented ? sizes[11] : B * S, q8 = sizes[12];
  double scale64;
  memcpy(&scale64, &sizes[9], sizeof scale64);
  const float scale = (float)scale64;
  const float *q = (const float *)bufs[0];
  const char *pool = (const char *)bufs[1];
  const int64_t *tables = (const int64_t *)bufs[2], *kv_len = (const int64_t *)bufs[3];
  const int64_t *q_start = segmented ? (const int64_t *)bufs[4] : NULL;
  const int64_t *q_len = segmented ? (const int64_t *)bufs[5] : NULL;
  float *out = (float *)bufs[4 + 2 * segmented];
  int64_t *status = (int64_t *)bufs[5 + 2 * segmented];
  const int64_t N = B * S;
  /* per query token: its segment (-1: none, zeros out) and how many keys it sees */
  int64_t *seg = (int64_t *)malloc(sizeof(int64_t) * (N > 0 ? 2 * N : 1));
  if (!seg) { status[0] = 3; return; }
  int64_t *len = seg + N;
  for (int64_t n = 0; n < N; n++) seg[n] = -1;
  int64_t longest = 1;
  for (int64_t i = 0; i < NS; i++) { /* check everything before reading the pool */
    const int64_t t = kv_len[i], m = segmented ? q_len[i] : 1, st = segmented ? q_start[i] : i;
    if (m == 0) continue;
    if (m < 0 || m > t || t > MB * BS || st < 0 || st + m > N || st / S != (st + m - 1) / S) {
      status[0] = 1; status[1] = i; free(seg); return;
    }
    for (int64_t j = 0; j < (t + BS - 1) / BS; j++)
      if (tables[i * MB + j] < 0 || tables[i * MB + j] >= NB) {
        status[0] = 2; status[1] = i; free(seg); return;
      }
    for (int64_t j = 0; j < m; j++) { /* causal, bottom-right aligned: token j sits at t - m + j */
      if (seg[st + j] >= 0) { status[0] = 4; status[1] = i; free(seg); return; } /* overlap */
      seg[st + j] = i;
      len[st + j] = t - m + j + 1;
    }
    if (t > longest) longest = t;
  }
  const int64_t row = HK * D, half = NB * BS * HK * (q8 ? D + 4 : D * (int64_t)sizeof(float));
  const char *keys = pool + layer * 2 * half, *values = keys + half;
  /* tokens are independent: threads take whole tokens (at least 64 keys x heads of work each) */
  int64_t work = 0;
  for (int64_t n = 0; n < N; n++) work += seg[n] >= 0 ? len[n] * HQ : 0;
  int64_t nt = work < 4096 ? 1 : nthreads < N ? nthreads : N;
  if (nt < 1) nt = 1;
  const int64_t per_worker = HQ * longest + BS * row; /* scores, then a dequantized block */
  float *scratch = (float *)malloc(nt * per_worker * sizeof(float));
  if (!scratch) { status[0] = 3; free(seg); return; }
  KERNEL_FN_job job = {q, out, keys, values, tables, seg, len, scratch, per_worker,
                       S, D, MB, BS, row, q8, HK, G, scale};
  llmkit_par_run(N, nt, KERNEL_FN_one, &job);
  free(scratch);
  free(seg);
}
"""
)

PAGED_KV_WRITE = r"""
#include <string.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
/* paged_kv_write: token n = (b, s) of k and v [B, HK, S, D] goes to flat slot slots[n] of
   pool[layer, 0] and pool[layer, 1] (a negative slot: not stored). Any element type; an int8 pool
   (q8, float32 k and v) stores each row quantized as ops.paged.quantize_kv does: codes
   rint(x / s) with s = max|x| / 127 (0 where s is 0 or not finite), then s's 4 bytes.
   bufs: pool, k, v, slots [B*S], out (the pool itself when written in place), status.
   sizes: B, HK, S, D, NB*BS (slots per layer half), itemsize of k, layer, pool size in bytes, q8. */
static void KERNEL_FN_q8(int8_t *dst, const float *x, int64_t D) {
  float top = 0.0f;
  for (int64_t d = 0; d < D; d++) {
    const float a = fabsf(x[d]);
    top = a > top || a != a ? a : top; /* NaN wins, as numpy's max */
  }
  const float s = top / 127.0f;
  const int ok = s > 0.0f && s <= FLT_MAX;
  for (int64_t d = 0; d < D; d++) {
    const float c = ok ? rintf(x[d] / s) : 0.0f;
    dst[d] = (int8_t)(c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c);
  }
  memcpy(dst + D, &s, sizeof s);
}

void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  (void)nthreads;
  const int64_t B = sizes[0], HK = sizes[1], S = sizes[2], D = sizes[3], SLOTS = sizes[4];
  const int64_t item = sizes[5], layer = sizes[6], nbytes = sizes[7], q8 = sizes[8];
  const char *k = (const char *)bufs[1], *v = (const char *)bufs[2];
  const int64_t *slots = (const int64_t *)bufs[3];
  char *out = (char *)bufs[4];
  int64_t *status = (int64_t *)bufs[5];
  for (int64_t n = 0; n < B * S; n++)
    if (slots[n] >= SLOTS) { status[0] = 1; status[1] = n; return; }
  if (out != (char *)bufs[0]) memcpy(out, bufs[0], nbytes);
  const int64_t row = D * item, prow = q8 ? D + 4 : row, half = SLOTS * HK * prow;
  char *kdst = out + layer * 2 * half, *vdst = kdst + half;
  for (int64_t n = 0; n < B * S; n++) {
    if (slots[n] < 0) continue;
    const int64_t b = n / S, s = n % S;
    for (int64_t h = 0; h < HK; h++) {
      const int64_t src = ((b * HK + h) * S + s) * row, dst = (slots[n] * HK + h) * prow;
      if (q8) {
        KERNEL_FN_q8((int8_t *)(kdst + dst), (const float *)(k + src), D);
        KERNEL_FN_q8((int8_t *)(vdst + dst), (const float *)(v + src), D);
        continue;
      }
      memcpy(kdst + dst, k + src, row);
      memcpy(vdst + dst, v + src, row);
    }
  }
}
"""


def _attention_sizes(q, pool, block_tables, kv_len, q_start=None, q_len=None, layer=0, scale=None):
    b, hq, s, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    bits = struct.unpack("<q", struct.pack("<d", scale))[0]  # the kernel reads it back as a double
    geometry = [b, hq, s, d, pool.shape[2], pool.shape[3], pool.shape[4], block_tables.shape[1], layer, bits]
    return geometry + [int(q_start is not None), block_tables.shape[0], int(pool.dtype == _I8)]


def _attention_applies(q, pool, block_tables, kv_len, q_start=None, q_len=None, **attrs):
    ints = [t.dtype == _I64 for t in (block_tables, kv_len, q_start, q_len) if t is not None]
    return q.dtype == _F32 and pool.dtype in (_F32, _I8) and all(ints)


def _write_sizes(pool, k, v, slots, layer=0, inplace=False):
    b, h, s, d = k.shape
    q8 = int(pool.dtype == _I8)
    return [b, h, s, d, pool.shape[2] * pool.shape[3], k.itemsize, layer, pool.nbytes, q8]


native_kernel("paged_attention", PAGED_ATTENTION, sizes=_attention_sizes, applies=_attention_applies)
native_kernel(
    "paged_kv_write",
    PAGED_KV_WRITE,
    sizes=_write_sizes,
    applies=lambda pool, k, v, slots, **attrs: slots.dtype == _I64 and (pool.dtype != _I8 or k.dtype == _F32),
)
