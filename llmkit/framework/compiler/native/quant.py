"""``quant_linear``: a product with quantized weights, dequantized inside the loop.

The weights stay in the checkpoint's layout (``ops/quant.py``, docs/quantize.md): a row of codes
per output feature, read once per call (decode) or once per block of up to three rows of x, and
turned into floats in registers, next to the multiply-adds: the float matrix is never stored. Like
``tiled_linear`` (``linear.py``), batch invariant by construction: each output is one row of x
against one row of codes, in an order that depends only on K and the group size.
"""

from __future__ import annotations

import math

import numpy as np

from ..par import DECLARE as PAR
from . import native_kernel
from .simd import VEC

_F32 = np.dtype(np.float32)

QUANT_LINEAR = (
    VEC
    + PAR
    + r"""
#include <stdlib.h>
/* quant_linear: y[m, n] = sum over the groups gi of row n, in order, of scale[n, gi] * d[m, n, gi],
   each a multiply-add onto the running sum, where d[m, n, gi] = sum over the group's columns k of
   x[m, k] * (q[n, k] - zero[n, gi]) (q - zero exact in integers, then a float). A group's sum runs in
   four accumulators of 8 lanes: 4 bits, 32 columns at a time: the even columns of the first 16 into
   a0, their odd ones into a1, of the next 16 into a2, a3; 8 bits, four vectors of 8 into a0 .. a3;
   then the group's remaining whole vectors (4 bits: a0, a1; 8 bits: a0, a1, a2 in turn), then
   d = hsum((a0 + a2) + (a1 + a3)) and the group's last columns one by one. Every (m, n) is this same
   sequence whatever the number of rows, the row block or the thread: a row's result never depends
   on the other rows (batch invariance).
   A row of codes is read once per block of up to 3 rows of x (4 accumulators each stay in
   registers) and turned into floats there; 4 bits: 8 bytes are 16 columns, their low nibbles (even
   columns) against x's even entries, their high nibbles against the odd ones (x is deinterleaved
   once per call).
   bufs: x [M, K], qweight ([N, K] int8 | [N, K / 2] uint8), scales [N, G], zeros [N, G] uint8?,
   y [M, N], status.  sizes: M, K, N, bits, group (columns; K for one group per row), has_zeros. */
enum { KERNEL_FN_MB = 3 }; /* rows of x per block */

typedef struct {
  const float *x, *xd, *s; /* xd: x deinterleaved (4 bits) */
  const uint8_t *q, *z;
  float *y;
  int64_t M, K, N, g, G, rows;
} KERNEL_FN_job;

/* codes minus the zero point, as floats: 8 bits, columns k .. k+7 (lo); 4 bits, the 8 bytes of
   columns k .. k+15: lo = their low nibbles (the even columns), hi = their high nibbles (odd) */
static inline __attribute__((always_inline)) void KERNEL_FN_unpack(const uint8_t *qn, int64_t k,
                                                                   const int bits, int32_t zero,
                                                                   KERNEL_FN_v *lo, KERNEL_FN_v *hi) {
#if defined(__AVX2__) && defined(__FMA__)
  if (bits == 4) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qn + k / 2)));
    const __m256i z = _mm256_set1_epi32(zero);
    *lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), z));
    *hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), z));
  } else {
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qn + k))));
  }
#else
  float a[8], b[8];
  for (int i = 0; i < 8; i++) {
    a[i] = bits == 4 ? (float)((int32_t)(qn[k / 2 + i] & 15) - zero) : (float)(int8_t)qn[k + i];
    b[i] = bits == 4 ? (float)((int32_t)(qn[k / 2 + i] >> 4) - zero) : 0.0f;
  }
  *lo = KERNEL_FN_ld(a);
  *hi = KERNEL_FN_ld(b);
#endif
}

static inline float KERNEL_FN_code(const uint8_t *qn, int64_t k, const int bits) {
  if (bits == 8) return (float)(int8_t)qn[k];
  return (float)(k % 2 ? qn[k / 2] >> 4 : qn[k / 2] & 15);
}

/* one vector of columns at k (8 for 8 bits, 16 for 4) into accumulators A (and B) of every row */
#define KERNEL_FN_STEP(A, B)                                                                          \
  do {                                                                                                \
    KERNEL_FN_v lo, hi;                                                                               \
    KERNEL_FN_unpack(qn, k, bits, zero, &lo, &hi);                                                    \
    for (int r = 0; r < mb; r++) {                                                                    \
      if (bits == 4) {                                                                                \
        const float *xe = j->xd + (m0 + r) * K + k / 2;                                               \
        acc[r][A] = KERNEL_FN_mac(acc[r][A], KERNEL_FN_ld(xe), lo);                                   \
        acc[r][B] = KERNEL_FN_mac(acc[r][B], KERNEL_FN_ld(xe + K / 2), hi);                           \
      } else {                                                                                        \
        acc[r][A] = KERNEL_FN_mac(acc[r][A], KERNEL_FN_ld(j->x + (m0 + r) * K + k), lo);              \
      }                                                                                               \
    }                                                                                                 \
    k += step;                                                                                        \
  } while (0)

/* rows m0 .. m0+mb-1 of y at output n (mb and bits are constants where this is inlined) */
static inline __attribute__((always_inline)) void KERNEL_FN_block(const KERNEL_FN_job *j, int64_t n,
                                                                  int64_t m0, const int mb,
                                                                  const int bits) {
  const int64_t K = j->K, g = j->g, G = j->G, step = bits == 4 ? 16 : 8;
  const uint8_t *qn = j->q + n * (bits == 4 ? K / 2 : K);
  float y[KERNEL_FN_MB];
  for (int r = 0; r < mb; r++) y[r] = 0.0f;
  for (int64_t gi = 0; gi < G; gi++) {
    const int64_t k1 = (gi + 1) * g < K ? (gi + 1) * g : K;
    const int32_t zero = j->z ? j->z[n * G + gi] : (bits == 4 ? 8 : 0);
    KERNEL_FN_v acc[KERNEL_FN_MB][4];
    for (int r = 0; r < mb; r++)
      for (int c = 0; c < 4; c++) acc[r][c] = KERNEL_FN_splat(0.0f);
    int64_t k = gi * g;
    if (bits == 4) {
      while (k + 2 * step <= k1) {
        KERNEL_FN_STEP(0, 1);
        KERNEL_FN_STEP(2, 3);
      }
      if (k + step <= k1) KERNEL_FN_STEP(0, 1);
    } else {
      while (k + 4 * step <= k1) {
        KERNEL_FN_STEP(0, 0);
        KERNEL_FN_STEP(1, 1);
        KERNEL_FN_STEP(2, 2);
        KERNEL_FN_STEP(3, 3);
      }
      for (int c = 0; c < 3 && k + step <= k1; c++) KERNEL_FN_STEP(c, c);
    }
    const float scale = j->s[n * G + gi];
    for (int r = 0; r < mb; r++) {
      const float *xm = j->x + (m0 + r) * K;
      float d = KERNEL_FN_hsum((acc[r][0] + acc[r][2]) + (acc[r][1] + acc[r][3]));
      for (int64_t t = k; t < k1; t++)
        d = KERNEL_FN_smac(d, xm[t], KERNEL_FN_code(qn, t, bits) - (float)zero);
      y[r] = KERNEL_FN_smac(y[r], scale, d);
    }
  }
  for (int r = 0; r < mb; r++) j->y[(m0 + r) * j->N + n] = y[r];
}

#define KERNEL_FN_ROWS(BITS)                                                                          \
  do {                                                                                                \
    int64_t m = 0;                                                                                    \
    for (; m + KERNEL_FN_MB <= j->M; m += KERNEL_FN_MB) KERNEL_FN_block(j, n, m, KERNEL_FN_MB, BITS);  \
    if (j->M - m == 2) KERNEL_FN_block(j, n, m, 2, BITS);                                             \
    if (j->M - m == 1) KERNEL_FN_block(j, n, m, 1, BITS);                                             \
  } while (0)

/* one claim: outputs c * rows .. (c + 1) * rows - 1 */
static void KERNEL_FN_outputs(void *arg, int64_t c, int64_t worker) {
  (void)worker;
  const KERNEL_FN_job *j = (const KERNEL_FN_job *)arg;
  const int64_t n1 = (c + 1) * j->rows < j->N ? (c + 1) * j->rows : j->N;
  for (int64_t n = c * j->rows; n < n1; n++) {
    if (j->xd) KERNEL_FN_ROWS(4);
    else KERNEL_FN_ROWS(8);
  }
}

void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  const int64_t M = sizes[0], K = sizes[1], N = sizes[2], bits = sizes[3], g = sizes[4], has_z = sizes[5];
  int64_t *status = (int64_t *)bufs[4 + has_z];
  KERNEL_FN_job j = {(const float *)bufs[0], NULL, (const float *)bufs[2], (const uint8_t *)bufs[1],
                     has_z ? (const uint8_t *)bufs[3] : NULL, (float *)bufs[3 + has_z], M, K, N, g,
                     (K + g - 1) / g, 1};
  if (j.G < 1) j.G = 1;
  float *xd = NULL;
  if (bits == 4) { /* each row of x: its even columns, then its odd ones */
    xd = (float *)malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));
    if (!xd) { status[0] = 3; return; }
    for (int64_t m = 0; m < M; m++)
      for (int64_t i = 0; i < K / 2; i++) {
        xd[m * K + i] = j.x[m * K + 2 * i];
        xd[m * K + K / 2 + i] = j.x[m * K + 2 * i + 1];
      }
    j.xd = xd;
  }
  int64_t nt = M * N * K < (1 << 17) || nthreads < 1 ? 1 : nthreads;
  j.rows = (N + 8 * nt - 1) / (8 * nt); /* about 8 claims per thread */
  if (j.rows < 1) j.rows = 1;
  const int64_t chunks = (N + j.rows - 1) / j.rows;
  if (nt > chunks) nt = chunks > 0 ? chunks : 1;
  llmkit_par_for(chunks, nt, KERNEL_FN_outputs, &j);
  free(xd);
}
"""
)


def _sizes(x, qweight, scales, zeros=None, bits=4, group_size=128, rows=0):
    k = x.shape[-1]
    return [
        math.prod(x.shape[:-1]),
        k,
        qweight.shape[0],
        bits,
        k if group_size == -1 else group_size,
        zeros is not None,
    ]


def _applies(x, qweight, scales, zeros=None, bits=4, group_size=128, rows=0):
    # any rows (the kernel computes every row alone); 4-bit groups of an even width (no byte
    # straddles two groups); the width known when the program is planned
    even = bits == 8 or group_size == -1 or group_size % 2 == 0
    return x.dtype == _F32 and scales.dtype == _F32 and isinstance(x.shape[-1], int) and even


native_kernel("quant_linear", QUANT_LINEAR, sizes=_sizes, applies=_applies)
