"""``quant_linear``: a product with quantized weights, dequantized inside the loop.

The weights stay in the checkpoint's layout (``ops/quant.py``, docs/quantize.md): a row of codes
per output feature, read once per call (decode) or once per block of rows of x (5 with AVX-512, 2
with AVX2), and turned into floats in registers, next to the multiply-adds: the float matrix is
never stored. With AVX-512 a 4-bit code becomes its float through a 16-entry table indexed by the
nibble (one permute per 16 codes, about 1.7x the convert-based AVX2 path per core here). Like
``tiled_linear`` (``linear.py``), batch invariant by construction: each output is one row of x
against one row of codes, in an order that depends only on K and the group size.
"""

from __future__ import annotations

import math

import numpy as np

from ...ops.quant import weight_inputs
from .attach import native_kernel
from .quant_int import QUANT_INT, f16c_code, int_isa_code
from .simd import VEC

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)

QUANT_LINEAR = (
    VEC
    + r"""
#include <stdlib.h>
/* quant_linear: y[m, n] = hsum(v) + t, where, over the groups gi of row n in order, v (a vector of
   W lanes: 16 with AVX-512, else 8) takes scale[n, gi] * the group's vector sum (a multiply-add per
   group) and t (a float) scale[n, gi] * the sum of the group's columns short of a vector step, one
   by one. Each product is x[m, k] * (q[n, k] - zero[n, gi]), q - zero exact as a float. A group's
   vector sum goes one step at a time: W bytes of codes, which are W columns (8 bits) or 2W (4 bits:
   the low nibbles, even columns, against x's even entries into one accumulator, the high nibbles,
   odd columns, against its odd entries into another); steps go in pairs into accumulators (a0, a1)
   then (a2, a3) (8 bits: four steps into a0 .. a3), a last step into (a0, a1) (8 bits: a0, a1, a2
   in turn), and the sum is (a0 + a2) + (a1 + a3). hsum adds a vector's lanes by a fixed tree (16
   lanes: its two halves first). Every (m, n) is this same sequence whatever the number of rows,
   the row block or the thread: a row's result never depends on the other rows (batch invariance).
   A row of codes is read once per block of up to MB rows of x (their accumulators stay in
   registers) and turned into floats there: 4 bits, by a 16-entry table (q - zero) indexed with the
   nibbles (AVX-512), else integer subtract and convert. x is deinterleaved once per call for 4 bits.
   bufs: x [M, K], qweight ([N, K] int8 | [N, K / 2] uint8), scales [N, G], zeros [N, G] uint8?,
   y [M, N], status.  sizes: M, K, N, bits, group (columns; K for one group per row), has_zeros. */
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
enum { KERNEL_FN_W = 16, KERNEL_FN_MB = 5 }; /* lanes; rows of x per block (5 vectors each) */
typedef __m512 KERNEL_FN_q;
typedef __m512 KERNEL_FN_t; /* the per-group table of q - zero, q = 0 .. 15 */
static inline KERNEL_FN_q KERNEL_FN_qld(const float *p) { return _mm512_loadu_ps(p); }
static inline KERNEL_FN_q KERNEL_FN_qsplat(float a) { return _mm512_set1_ps(a); }
static inline KERNEL_FN_q KERNEL_FN_qmac(KERNEL_FN_q acc, KERNEL_FN_q a, KERNEL_FN_q b) {
  return _mm512_fmadd_ps(a, b, acc);
}
static inline float KERNEL_FN_qsum(KERNEL_FN_q v) {
  return KERNEL_FN_hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
static inline KERNEL_FN_t KERNEL_FN_table(int32_t zero) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_sub_ps(iota, _mm512_set1_ps((float)zero));
}
static inline __attribute__((always_inline)) void KERNEL_FN_unpack(const uint8_t *qp, const int bits,
                                                                   KERNEL_FN_t t, KERNEL_FN_q *lo,
                                                                   KERNEL_FN_q *hi) {
  const __m512i b = (bits == 4 ? _mm512_cvtepu8_epi32 : _mm512_cvtepi8_epi32)(
      _mm_loadu_si128((const __m128i *)qp));
  if (bits == 4) {
    *lo = _mm512_permutexvar_ps(b, t); /* the index's low 4 bits: the low nibble */
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t);
  } else {
    *lo = _mm512_cvtepi32_ps(b);
  }
}
#else
enum { KERNEL_FN_W = 8, KERNEL_FN_MB = 2 };
typedef KERNEL_FN_v KERNEL_FN_q;
typedef int32_t KERNEL_FN_t; /* the zero point */
static inline KERNEL_FN_q KERNEL_FN_qld(const float *p) { return KERNEL_FN_ld(p); }
static inline KERNEL_FN_q KERNEL_FN_qsplat(float a) { return KERNEL_FN_splat(a); }
static inline KERNEL_FN_q KERNEL_FN_qmac(KERNEL_FN_q acc, KERNEL_FN_q a, KERNEL_FN_q b) {
  return KERNEL_FN_mac(acc, a, b);
}
static inline float KERNEL_FN_qsum(KERNEL_FN_q v) { return KERNEL_FN_hsum(v); }
static inline KERNEL_FN_t KERNEL_FN_table(int32_t zero) { return zero; }
static inline __attribute__((always_inline)) void KERNEL_FN_unpack(const uint8_t *qp, const int bits,
                                                                   KERNEL_FN_t zero, KERNEL_FN_q *lo,
                                                                   KERNEL_FN_q *hi) {
#if defined(__AVX2__) && defined(__FMA__)
  if (bits == 4) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qp));
    const __m256i z = _mm256_set1_epi32(zero);
    *lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), z));
    *hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), z));
  } else {
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qp)));
  }
#else
  float a[8], b[8];
  for (int i = 0; i < 8; i++) {
    a[i] = bits == 4 ? (float)((int32_t)(qp[i] & 15) - zero) : (float)(int8_t)qp[i];
    b[i] = bits == 4 ? (float)((int32_t)(qp[i] >> 4) - zero) : 0.0f;
  }
  *lo = KERNEL_FN_ld(a);
  *hi = KERNEL_FN_ld(b);
#endif
}
#endif

typedef struct {
  const float *x, *xd, *s; /* xd: x deinterleaved (4 bits) */
  const uint8_t *q, *z;
  float *y;
  int64_t M, K, N, g, G, rows;
} KERNEL_FN_job;

static inline float KERNEL_FN_code(const uint8_t *qn, int64_t k, const int bits) {
  if (bits == 8) return (float)(int8_t)qn[k];
  return (float)(k % 2 ? qn[k / 2] >> 4 : qn[k / 2] & 15);
}

/* one step (W bytes of codes at qp) into accumulators A (and B) of every row; x of row r at
   xk + r * K (4 bits: its even entries there, its odd ones half on) */
#define KERNEL_FN_STEP(A, B)                                                                          \
  do {                                                                                                \
    KERNEL_FN_q lo, hi;                                                                               \
    KERNEL_FN_unpack(qp, bits, table, &lo, &hi);                                                      \
    for (int r = 0; r < mb; r++) {                                                                    \
      acc[r][A] = KERNEL_FN_qmac(acc[r][A], KERNEL_FN_qld(xk + r * K), lo);                           \
      if (bits == 4) acc[r][B] = KERNEL_FN_qmac(acc[r][B], KERNEL_FN_qld(xk + r * K + half), hi);     \
    }                                                                                                 \
    qp += KERNEL_FN_W;                                                                                \
    xk += KERNEL_FN_W;                                                                                \
  } while (0)

/* rows m0 .. m0+mb-1 of y at output n (mb and bits are constants where this is inlined) */
static inline __attribute__((always_inline)) void KERNEL_FN_block(const KERNEL_FN_job *j, int64_t n,
                                                                  int64_t m0, const int mb,
                                                                  const int bits) {
  const int64_t K = j->K, g = j->g, G = j->G, half = K / 2;
  const int64_t cols = bits == 4 ? 2 * KERNEL_FN_W : KERNEL_FN_W; /* columns per step */
  const uint8_t *qn = j->q + n * (bits == 4 ? half : K);
  const float *xrows = (bits == 4 ? j->xd : j->x) + m0 * K;
  KERNEL_FN_q yv[KERNEL_FN_MB]; /* per row: the groups' scaled vector sums */
  float yt[KERNEL_FN_MB];       /* per row: the groups' scaled sums of columns short of a step */
  for (int r = 0; r < mb; r++) {
    yv[r] = KERNEL_FN_qsplat(0.0f);
    yt[r] = 0.0f;
  }
  for (int64_t gi = 0; gi < G; gi++) {
    const int64_t k0 = gi * g, k1 = k0 + g < K ? k0 + g : K;
    const int32_t zero = j->z ? j->z[n * G + gi] : (bits == 4 ? 8 : 0);
    const KERNEL_FN_t table = KERNEL_FN_table(zero);
    const uint8_t *qp = qn + (bits == 4 ? k0 / 2 : k0);
    const float *xk = xrows + (bits == 4 ? k0 / 2 : k0);
    KERNEL_FN_q acc[KERNEL_FN_MB][4];
    for (int r = 0; r < mb; r++)
      for (int c = 0; c < 4; c++) acc[r][c] = KERNEL_FN_qsplat(0.0f);
    int64_t steps = (k1 - k0) / cols;
    if (bits == 4) {
      for (; steps >= 2; steps -= 2) {
        KERNEL_FN_STEP(0, 1);
        KERNEL_FN_STEP(2, 3);
      }
      if (steps) KERNEL_FN_STEP(0, 1);
    } else {
      for (; steps >= 4; steps -= 4) {
        KERNEL_FN_STEP(0, 0);
        KERNEL_FN_STEP(1, 1);
        KERNEL_FN_STEP(2, 2);
        KERNEL_FN_STEP(3, 3);
      }
      if (steps > 0) KERNEL_FN_STEP(0, 0); /* constant indices: the accumulators stay in registers */
      if (steps > 1) KERNEL_FN_STEP(1, 1);
      if (steps > 2) KERNEL_FN_STEP(2, 2);
    }
    const float scale = j->s[n * G + gi];
    const KERNEL_FN_q sv = KERNEL_FN_qsplat(scale);
    for (int r = 0; r < mb; r++)
      yv[r] = KERNEL_FN_qmac(yv[r], sv, (acc[r][0] + acc[r][2]) + (acc[r][1] + acc[r][3]));
    const int64_t k = k1 - (k1 - k0) % cols;
    if (k < k1)
      for (int r = 0; r < mb; r++) {
        const float *xm = j->x + (m0 + r) * K;
        float d = 0.0f;
        for (int64_t t = k; t < k1; t++)
          d = KERNEL_FN_smac(d, xm[t], KERNEL_FN_code(qn, t, bits) - (float)zero);
        yt[r] = KERNEL_FN_smac(yt[r], scale, d);
      }
  }
  for (int r = 0; r < mb; r++) j->y[(m0 + r) * j->N + n] = KERNEL_FN_qsum(yv[r]) + yt[r];
}

#define KERNEL_FN_ROWS(BITS)                                                                          \
  do {                                                                                                \
    int64_t m = 0;                                                                                    \
    for (; m + KERNEL_FN_MB <= j->M; m += KERNEL_FN_MB) KERNEL_FN_block(j, n, m, KERNEL_FN_MB, BITS);  \
    switch (j->M - m) { /* the last rows: a constant count, so the loops over rows unroll */        \
      case 4: KERNEL_FN_block(j, n, m, 4, BITS); break;                                               \
      case 3: KERNEL_FN_block(j, n, m, 3, BITS); break;                                               \
      case 2: KERNEL_FN_block(j, n, m, 2, BITS); break;                                               \
      case 1: KERNEL_FN_block(j, n, m, 1, BITS); break;                                               \
      default: break;                                                                                 \
    }                                                                                                 \
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

static void KERNEL_FN_float(void **bufs, const int64_t *sizes, int64_t nthreads) {
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
    + QUANT_INT
    + r"""
/* sizes: M, K, N, bits, group, has_zeros, act_bits (0: float x, 8: int8 blocks), isa (-1: auto),
   packed (act_bits 8: qweight in panels; 2: and scales float16), f16c (0: float16 scales widened in C) */
void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  if (sizes[6] == 8)
    KERNEL_FN_int8(bufs, 1, sizes + 2, sizes[0], sizes[1], sizes[3], sizes[4], sizes[5], sizes[7], sizes[8],
                   sizes[9], nthreads);
  else
    KERNEL_FN_float(bufs, sizes, nthreads);
}
"""
)


def _sizes(x, qweight, scales, zeros=None, bits=4, group_size=128, rows=0, act_bits=0, packed=0):
    k = x.shape[-1]
    return [
        math.prod(x.shape[:-1]),
        k,
        scales.shape[0],
        bits,
        k if group_size == -1 else group_size,
        zeros is not None,
        act_bits,
        int_isa_code(),
        packed,
        f16c_code(),
    ]


def _applies(x, qweight, scales, zeros=None, bits=4, group_size=128, rows=0, act_bits=0, packed=0):
    # any rows (the kernel computes every row alone); 4-bit groups of an even width (no byte
    # straddles two groups); the width known when the program is planned
    even = bits == 8 or group_size == -1 or group_size % 2 == 0
    k = x.shape[-1]
    if not (
        x.dtype == _F32 and scales.dtype == (_F16 if packed == 2 else _F32) and isinstance(k, int) and even
    ):
        return False
    return act_bits == 0 or (k if group_size == -1 else group_size) <= 65536  # int32 sums of a group


native_kernel("quant_linear", QUANT_LINEAR, sizes=_sizes, applies=_applies)


def _group_sizes(*xs, zeros=False, **attrs):  # quant_linear's of the first weight, W, every weight's N
    x, ws = weight_inputs(xs, zeros)
    return [*_sizes(x, *ws[0], **attrs), len(ws), *(w[1].shape[0] for w in ws)]


def _group_applies(*xs, zeros=False, **attrs):
    x, ws = weight_inputs(xs, zeros)
    return attrs["act_bits"] == 8 and all(_applies(x, *w, **attrs) for w in ws)


QUANT_LINEARS_ENTRY = r"""
/* quant_linears: sizes as quant_linear's (act_bits 8) of its first weight, then W and every weight's N */
void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  KERNEL_FN_int8(bufs, sizes[10], sizes + 11, sizes[0], sizes[1], sizes[3], sizes[4], sizes[5], sizes[7],
                 sizes[8], sizes[9], nthreads);
}
"""
native_kernel("quant_linears", QUANT_INT + QUANT_LINEARS_ENTRY, sizes=_group_sizes, applies=_group_applies)

DEQUANTIZE = r"""
#include <stdint.h>
/* dequantize: out[n, k] = (float)(q[n, k] - zero[n, k / g]) * scale[n, k / g], the difference exact
   and one rounding (the reference kernel's arithmetic); a quantized embedding's looked-up rows.
   bufs: qweight ([N, K] int8 | [N, K / 2] uint8), scales [N, G], zeros [N, G] uint8?, out [N, K],
   status.  sizes: N, K, bits, group (columns), has_zeros. */
void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  (void)nthreads;
  const int64_t N = sizes[0], K = sizes[1], bits = sizes[2], g = sizes[3], has_z = sizes[4];
  const int64_t G = K > 0 ? (K + g - 1) / g : 1;
  const uint8_t *q = (const uint8_t *)bufs[0], *z = has_z ? (const uint8_t *)bufs[2] : 0;
  const float *s = (const float *)bufs[1];
  float *out = (float *)bufs[2 + has_z];
  for (int64_t n = 0; n < N; n++)
    for (int64_t k = 0; k < K; k++) {
      const int64_t gi = k / g;
      int32_t c;
      if (bits == 8) c = (int8_t)q[n * K + k];
      else c = (k % 2 ? q[n * (K / 2) + k / 2] >> 4 : q[n * (K / 2) + k / 2] & 15) - (z ? z[n * G + gi] : 8);
      out[n * K + k] = (float)c * s[n * G + gi];
    }
}
"""


def _dq_sizes(qweight, scales, zeros=None, bits=4, group_size=128):
    k = qweight.shape[1] * (2 if bits == 4 else 1)
    return [qweight.shape[0], k, bits, k if group_size == -1 else group_size, zeros is not None]


def _dq_applies(qweight, scales, zeros=None, bits=4, group_size=128):
    return scales.dtype == _F32 and all(isinstance(d, int) for d in qweight.shape[1:])


native_kernel("dequantize", DEQUANTIZE, sizes=_dq_sizes, applies=_dq_applies)
