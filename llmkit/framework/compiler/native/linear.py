"""``tiled_linear`` and ``tiled_linear_swiglu``: the engine's products, batch invariant by construction.

They serve the inference engine's steps, where the reference kernels' numpy calls (5-100 µs each,
on arrays of a few hundred numbers) cost more than the arithmetic. Batch invariance (docs/serve.md)
is a property of the code below, not of a library: no loop mixes two rows (tokens) of the batch,
and every sum runs in a fixed order that depends only on the sizes of its own row. The build flags
keep IEEE semantics (``-ffp-contract=off``, no ``-ffast-math``), so a kernel rounds exactly as
written here.
"""

from __future__ import annotations

import math

import numpy as np

from ...ops.paged import PANEL
from ...opspec import get
from .attach import native_kernel
from .gather import TOPK_KEEP, TOPK_MAX_K
from .simd import EXP, VEC

_F32 = np.dtype(np.float32)

_LINEAR = r"""
#include <stdlib.h>
#include <string.h>
/* tiled_linear, any tile size: y[m] = x[m] @ W (+ bias), each row its own product.
   W as [K, N] (transposed = 1): y[m, j] = fma(x[m, K-1], W[K-1, j], ... fma(x[m, 0], W[0, j], 0)),
   in k order, for every (m, j) whichever path computes it: so a row's bits do not depend on the
   other rows (the op's contract, for any `rows`) nor on the thread count. Below 16 rows (decode),
   eight rows of W stream at a time (contiguous reads) into 64-column blocks of y held in registers;
   for every row of x the same rows of W come again from L1. From 16 rows (prefill, large batches),
   a packed GEMM micro-kernel (KERNEL_FN_knp).
   W in panels (transposed = 2: [N / 16, K, 16], the op's panel=16): the same micro-kernel reads the
   panels as they are (KERNEL_FN_pp), for any number of rows: at 8 rows about 1.8x the [K, N] path.
   W as [N, K] (a weight that could not be stored transposed, e.g. tied embeddings, or a parameter
   the engine reads as training leaves it, RLHF): y[m, n] is a dot product of two contiguous rows in
   8 lanes (lane l sums the k = l mod 8 in order), the lanes added as a fixed tree (hsum), then the
   last K mod 8 terms; 2 x 4 such chains run side by side.
   bufs: x [M, K], w, bias [N]?, y [M, N], status.
   sizes: M, K, N, has_bias, transposed (0: W [N, K], 1: [K, N], 2: panels). */
/* columns [0, N) of y, rows of y and W ld apart (a thread's share of the columns) */
static void KERNEL_FN_kn(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N,
                         int64_t ld) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t j = 0; j < N; j++) y[m * ld + j] = 0.0f;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const float *wk = w + k * ld;
    int64_t j = 0;
    for (; j + 64 <= N; j += 64)
      for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K + k;
        float *ym = y + m * ld + j;
        KERNEL_FN_v a[8];
        _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) a[c] = KERNEL_FN_ld(ym + 8 * c);
        _Pragma("GCC unroll 8") for (int q = 0; q < 8; q++) {
          const KERNEL_FN_v xq = KERNEL_FN_splat(xm[q]);
          _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++)
            a[c] = KERNEL_FN_mac(a[c], xq, KERNEL_FN_ld(wk + q * ld + j + 8 * c));
        }
        _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) KERNEL_FN_st(ym + 8 * c, a[c]);
      }
    for (; j + 8 <= N; j += 8)
      for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K + k;
        KERNEL_FN_v a = KERNEL_FN_ld(y + m * ld + j);
        _Pragma("GCC unroll 8") for (int q = 0; q < 8; q++)
          a = KERNEL_FN_mac(a, KERNEL_FN_splat(xm[q]), KERNEL_FN_ld(wk + q * ld + j));
        KERNEL_FN_st(y + m * ld + j, a);
      }
    for (; j < N; j++)
      for (int64_t m = 0; m < M; m++) {
        float a = y[m * ld + j];
        for (int q = 0; q < 8; q++) a = KERNEL_FN_smac(a, x[m * K + k + q], wk[q * ld + j]);
        y[m * ld + j] = a;
      }
  }
  for (; k < K; k++) {
    const float *wk = w + k * ld;
    for (int64_t m = 0; m < M; m++) {
      const float xk = x[m * K + k];
      float *ym = y + m * ld;
      int64_t j = 0;
      for (; j + 8 <= N; j += 8)
        KERNEL_FN_st(ym + j, KERNEL_FN_mac(KERNEL_FN_ld(ym + j), KERNEL_FN_splat(xk), KERNEL_FN_ld(wk + j)));
      for (; j < N; j++) ym[j] = KERNEL_FN_smac(ym[j], xk, wk[j]);
    }
  }
}


/* 16 rows or more: a GEMM micro-kernel. W is taken KC rows at a time, copied (contiguous row reads)
   into 16-column panels [KC][16]; blocks of MR <= 6 rows x 2 vectors of y stay in registers over
   the chunk: 2 loads and MR broadcasts feed 2 MR FMAs. Every y[m, j] is still
   fma(x[m, K-1], W[K-1, j], ... fma(x[m, 0], W[0, j], 0)) in k order: the same bits as above. */
enum { KERNEL_FN_KC = 64, KERNEL_FN_PACK_ROWS = 16 }; /* W rows per chunk; rows of x from which to pack */
enum { KERNEL_FN_STREAM_X = 1 << 18 }; /* floats of x up to which panels are taken whole */
enum { KERNEL_FN_KCP = 256 };          /* else W rows per chunk of panels (x's chunk stays in L2) */
static inline __attribute__((always_inline)) void KERNEL_FN_mk(
    const float *x, int64_t K, int64_t kc, const float *p, float *y, int64_t ld, int first,
    const int MR, const int NV) {
  KERNEL_FN_v acc[6][2];
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < NV; c++) acc[r][c] = first ? KERNEL_FN_splat(0.0f) : KERNEL_FN_ld(y + r * ld + 8 * c);
  for (int64_t k = 0; k < kc; k++) {
    const KERNEL_FN_v b0 = KERNEL_FN_ld(p + k * 16), b1 = KERNEL_FN_ld(p + k * 16 + 8);
    for (int r = 0; r < MR; r++) {
      const KERNEL_FN_v xv = KERNEL_FN_splat(x[r * K + k]);
      acc[r][0] = KERNEL_FN_mac(acc[r][0], xv, b0);
      if (NV > 1) acc[r][1] = KERNEL_FN_mac(acc[r][1], xv, b1);
    }
  }
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < NV; c++) KERNEL_FN_st(y + r * ld + 8 * c, acc[r][c]);
}

#define KERNEL_FN_MK(MR)                                                                            \
  if (nv == 2) KERNEL_FN_mk(x + m * K + k0, K, kc, pp, y + m * ld + j, ld, k0 == 0, MR, 2);         \
  else KERNEL_FN_mk(x + m * K + k0, K, kc, pp, y + m * ld + j, ld, k0 == 0, MR, 1)
#define KERNEL_FN_ROWS(MK)                                                                          \
  int64_t m = 0;                                                                                    \
  for (; m + 6 <= M; m += 6) { MK(6); }                                                             \
  switch (M - m) {                                                                                  \
    case 5: MK(5); break;                                                                           \
    case 4: MK(4); break;                                                                           \
    case 3: MK(3); break;                                                                           \
    case 2: MK(2); break;                                                                           \
    case 1: MK(1); break;                                                                           \
    default: break;                                                                                 \
  }

#if defined(__AVX512F__) && defined(__FMA__)
/* Where the CPU has AVX-512 (the kernels are compiled for the machine that runs them): the same
   chains, 16 columns (one panel) per register, NP = 1 or 2 panels side by side, so an FMA does
   twice the work of the 8-lane one above (prefill about 1.4-2x faster on Zen 5). Each lane is still
   fma(x[m, k], W[k, j], acc) in k order: the same bits as the 8-lane path. */
static inline __attribute__((always_inline)) void KERNEL_FN_mkz(
    const float *x, int64_t K, int64_t kc, const float *p0, const float *p1, float *y, int64_t ld,
    int first, const int MR, const int NP) {
  __m512 acc[6][2];
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < NP; c++)
      acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ld + 16 * c);
  for (int64_t k = 0; k < kc; k++) {
    const __m512 b0 = _mm512_loadu_ps(p0 + k * 16), b1 = NP > 1 ? _mm512_loadu_ps(p1 + k * 16) : b0;
    for (int r = 0; r < MR; r++) {
      const __m512 xv = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, b0, acc[r][0]);
      if (NP > 1) acc[r][1] = _mm512_fmadd_ps(xv, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < NP; c++) _mm512_storeu_ps(y + r * ld + 16 * c, acc[r][c]);
}
#define KERNEL_FN_MKZ2(MR) \
  KERNEL_FN_mkz(x + m * K + k0, K, kc, pp, pp + ps, y + m * ld + j, ld, k0 == 0, MR, 2)
#define KERNEL_FN_MKZ1(MR) KERNEL_FN_mkz(x + m * K + k0, K, kc, pp, pp, y + m * ld + j, ld, k0 == 0, MR, 1)
#endif

/* For each 16-column panel q < panels (at base + q * ps, [kc][16]) and every block of rows: y's
   columns 16 q .. 16 q + 15 (the last panel may hold only NP - 16 q of them) take rows k0 .. k0+kc-1
   of W in. */
static void KERNEL_FN_panels(const float *x, int64_t M, int64_t K, int64_t k0, int64_t kc,
                             const float *base, int64_t ps, int64_t panels, int64_t NP, float *y,
                             int64_t ld) {
  int64_t q = 0;
#if defined(__AVX512F__) && defined(__FMA__)
  for (; q < panels && NP - q * 16 >= 16; q += NP - q * 16 >= 32 && q + 1 < panels ? 2 : 1) {
    const int64_t j = q * 16;
    const float *pp = base + q * ps;
    if (NP - j >= 32 && q + 1 < panels) {
      KERNEL_FN_ROWS(KERNEL_FN_MKZ2)
    } else {
      KERNEL_FN_ROWS(KERNEL_FN_MKZ1)
    }
  }
#endif
  for (; q < panels; q++) {
    const int64_t j = q * 16;
    const int nv = NP - j >= 16 ? 2 : 1;
    const float *pp = base + q * ps;
    KERNEL_FN_ROWS(KERNEL_FN_MK)
  }
}

static void KERNEL_FN_knp(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N,
                          int64_t ld, float *buf) {
  if (K == 0) { /* an empty sum */
    for (int64_t m = 0; m < M; m++)
      for (int64_t j = 0; j < N; j++) y[m * ld + j] = 0.0f;
    return;
  }
  const int64_t NP = N / 8 * 8; /* columns in whole vectors; the rest below, one by one */
  const int64_t panels = (NP + 15) / 16;
  for (int64_t k0 = 0; k0 < K; k0 += KERNEL_FN_KC) {
    const int64_t kc = K - k0 < KERNEL_FN_KC ? K - k0 : KERNEL_FN_KC;
    for (int64_t k = 0; k < kc; k++) { /* pack: row k0+k of W, contiguous, into every panel */
      const float *src = w + (k0 + k) * ld;
      for (int64_t q = 0; q < panels; q++) {
        float *dst = buf + (q * KERNEL_FN_KC + k) * 16;
        const int64_t c = NP - q * 16 < 16 ? NP - q * 16 : 16;
        memcpy(dst, src + q * 16, sizeof(float) * c);
        if (c < 16) memset(dst + c, 0, sizeof(float) * (16 - c));
      }
    }
    KERNEL_FN_panels(x, M, K, k0, kc, buf, KERNEL_FN_KC * 16, panels, NP, y, ld);
  }
  for (int64_t j = NP; j < N; j++)
    for (int64_t m = 0; m < M; m++) {
      float a = 0.0f;
      for (int64_t k = 0; k < K; k++) a = KERNEL_FN_smac(a, x[m * K + k], w[k * ld + j]);
      y[m * ld + j] = a;
    }
}

/* W already in panels (pw: [N / 16][K][16], packed once by whoever feeds the program): no copy.
   While x fits the caches (up to 1 MiB: decode batches, short prefills) every panel is taken
   whole, streaming W once, contiguously, with each block of y in registers over all of K (at
   batch 32 about 20% faster than chunks, prefill of 256 tokens about 15%); a larger x takes W KC
   rows at a time, so that its chunk of x stays in the caches across the panels. */
static void KERNEL_FN_pp(const float *x, const float *pw, float *y, int64_t M, int64_t K, int64_t N,
                         int64_t ld) {
  if (K == 0) {
    for (int64_t m = 0; m < M; m++)
      for (int64_t j = 0; j < N; j++) y[m * ld + j] = 0.0f;
    return;
  }
  const int64_t step = M * K <= KERNEL_FN_STREAM_X ? K : KERNEL_FN_KCP;
  for (int64_t k0 = 0; k0 < K; k0 += step) {
    const int64_t kc = K - k0 < step ? K - k0 : step;
    KERNEL_FN_panels(x, M, K, k0, kc, pw + k0 * 16, K * 16, N / 16, N, y, ld);
  }
}

/* A block of MR rows of x by NR rows of W, each output its own chain as above; the MR * NR chains
   interleave (independent accumulators: the FMA latency is hidden) and each row of W read serves
   MR rows of x. */
static inline __attribute__((always_inline)) void KERNEL_FN_nk_block(
    const float *x, const float *w, float *y, int64_t K, int64_t ld, const int MR, const int NR) {
  const int64_t k8 = K - K % 8;
  KERNEL_FN_v a[2][4];
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < NR; c++) a[r][c] = KERNEL_FN_splat(0.0f);
  for (int64_t k = 0; k < k8; k += 8) {
    KERNEL_FN_v xv[2];
    for (int r = 0; r < MR; r++) xv[r] = KERNEL_FN_ld(x + r * K + k);
    for (int c = 0; c < NR; c++) {
      const KERNEL_FN_v wv = KERNEL_FN_ld(w + c * K + k);
      for (int r = 0; r < MR; r++) a[r][c] = KERNEL_FN_mac(a[r][c], xv[r], wv);
    }
  }
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < NR; c++) {
      float s = KERNEL_FN_hsum(a[r][c]);
      for (int64_t k = k8; k < K; k++) s = KERNEL_FN_smac(s, x[r * K + k], w[c * K + k]);
      y[r * ld + c] = s;
    }
}

#define KERNEL_FN_NK(MR)                                                          \
  for (n = 0; n + 4 <= N; n += 4) KERNEL_FN_nk_block(xm, w + n * K, ym + n, K, ld, MR, 4); \
  switch (N - n) {                                                                \
    case 3: KERNEL_FN_nk_block(xm, w + n * K, ym + n, K, ld, MR, 3); break;      \
    case 2: KERNEL_FN_nk_block(xm, w + n * K, ym + n, K, ld, MR, 2); break;      \
    case 1: KERNEL_FN_nk_block(xm, w + n * K, ym + n, K, ld, MR, 1); break;      \
    default: break;                                                               \
  }

static void KERNEL_FN_nk(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N,
                         int64_t ld) {
  int64_t m = 0, n;
  for (; m + 2 <= M; m += 2) {
    const float *xm = x + m * K;
    float *ym = y + m * ld;
    KERNEL_FN_NK(2)
  }
  if (m < M) {
    const float *xm = x + m * K;
    float *ym = y + m * ld;
    KERNEL_FN_NK(1)
  }
}

"""

# Columns per claim of the thread pool (``par.py``) in the products below: whole 16-column panels
# (64-column blocks without panels), at least about 32K multiply-adds and at most about 8 claims per
# thread (a claim moves one cache line between the cores: the lm_head at batch 8 in 16-column
# claims took 10% longer).
_CHUNK = r"""
static inline int64_t KERNEL_FN_chunk_cols(int64_t M, int64_t K, int64_t N, int64_t nt, int panels) {
  const int64_t unit = panels ? 16 : 64, units = (N + unit - 1) / unit, per = unit * (M * K > 0 ? M * K : 1);
  const int64_t by_work = (32768 + per - 1) / per, by_count = (units + 8 * nt - 1) / (8 * nt);
  return unit * (by_work > by_count ? by_work : by_count);
}
"""

TILED_LINEAR = (
    VEC
    + _LINEAR
    + _CHUNK
    + r"""
typedef struct {
  const float *x, *w;
  float *y, *bufs;
  int64_t M, K, N, mode, cols, buf;
} KERNEL_FN_job;

/* one claim: columns c * cols .. of y, each computed as above whoever computes it */
static void KERNEL_FN_cols(void *arg, int64_t c, int64_t worker) {
  const KERNEL_FN_job *j = (const KERNEL_FN_job *)arg;
  const int64_t M = j->M, K = j->K, N = j->N, lo = c * j->cols, hi = lo + j->cols < N ? lo + j->cols : N;
  if (j->mode == 2) KERNEL_FN_pp(j->x, j->w + lo * K, j->y + lo, M, K, hi - lo, N);
  else if (j->mode == 1 && j->bufs)
    KERNEL_FN_knp(j->x, j->w + lo, j->y + lo, M, K, hi - lo, N, j->bufs + worker * j->buf);
  else if (j->mode == 1) KERNEL_FN_kn(j->x, j->w + lo, j->y + lo, M, K, hi - lo, N);
  else KERNEL_FN_nk(j->x, j->w + lo * K, j->y + lo, M, K, hi - lo, N);
}

void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  const int64_t M = sizes[0], K = sizes[1], N = sizes[2], has_bias = sizes[3], mode = sizes[4];
  float *y = (float *)bufs[2 + has_bias];
  /* Threads from 128K multiply-adds: in a replayed decode step (threads kept busy kernel after
     kernel) that measured faster at batch 8 than 4M, though a lone call of that size is faster on
     one thread. */
  int64_t nt = M * N * K < (1 << 17) || nthreads < 1 ? 1 : nthreads;
  const int64_t cols = KERNEL_FN_chunk_cols(M, K, N, nt, mode == 2), chunks = (N + cols - 1) / cols;
  if (nt > chunks) nt = chunks > 0 ? chunks : 1;
  KERNEL_FN_job job = {(const float *)bufs[0], (const float *)bufs[1], y, NULL, M, K, N, mode, cols,
                       KERNEL_FN_KC * (cols / 8 * 8 + 16)};
  if (mode == 1 && M >= KERNEL_FN_PACK_ROWS) job.bufs = (float *)malloc(sizeof(float) * nt * job.buf);
  llmkit_par_run(chunks, nt, KERNEL_FN_cols, &job);
  free(job.bufs);
  if (has_bias) {
    const float *bias = (const float *)bufs[2];
    for (int64_t m = 0; m < M; m++)
      for (int64_t j = 0; j < N; j++) y[m * N + j] = y[m * N + j] + bias[j];
  }
}
"""
)

TILED_LINEAR_SWIGLU = (
    VEC
    + _LINEAR
    + _CHUNK
    + r"""
/* tiled_linear_swiglu: y[m, j] = silu(x[m] . Wg[:, j]) * (x[m] . Wu[:, j]), both weights in
   16-column panels. Each product is tiled_linear's k-ordered FMA chain (KERNEL_FN_pp) and the
   SwiGLU is computed as the compiler's swiglu kernel does, element by element (@SIGMOID@: the op
   table's sigmoid template, filled in where the op is defined): a thread finishes its
   own columns while they are in its cache, and the gate and up products are never stored
   (claims of whole panels, as tiled_linear's).
   bufs: x [M, K], w_gate, w_up [N / 16, K, 16], y [M, N], status. sizes: M, K, N. */
typedef struct {
  const float *x, *wg, *wu;
  float *y, *scratch;
  int64_t M, K, N, cols;
} KERNEL_FN_job;

static void KERNEL_FN_cols(void *arg, int64_t c, int64_t worker) {
  const KERNEL_FN_job *job = (const KERNEL_FN_job *)arg;
  const int64_t M = job->M, K = job->K, N = job->N, cols = job->cols;
  const int64_t lo = c * cols, w = N - lo < cols ? N - lo : cols;
  float *g = job->scratch + worker * 2 * M * cols, *u = g + M * cols;
  KERNEL_FN_pp(job->x, job->wg + lo * K, g, M, K, w, cols);
  KERNEL_FN_pp(job->x, job->wu + lo * K, u, M, K, w, cols);
  for (int64_t m = 0; m < M; m++) {
    const float *gm = g + m * cols, *um = u + m * cols;
    float *ym = job->y + m * N + lo;
#pragma omp simd
    for (int64_t j = 0; j < w; j++) ym[j] = (gm[j] * @SIGMOID@) * um[j];
  }
}

void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  const int64_t M = sizes[0], K = sizes[1], N = sizes[2];
  int64_t *status = (int64_t *)bufs[4];
  int64_t nt = 2 * M * N * K < (1 << 17) || nthreads < 1 ? 1 : nthreads;
  const int64_t cols = KERNEL_FN_chunk_cols(M, 2 * K, N, nt, 1), chunks = (N + cols - 1) / cols;
  if (nt > chunks) nt = chunks > 0 ? chunks : 1;
  KERNEL_FN_job job = {(const float *)bufs[0], (const float *)bufs[1], (const float *)bufs[2],
                       (float *)bufs[3], NULL, M, K, N, cols};
  job.scratch = (float *)malloc(sizeof(float) * (size_t)(nt * 2 * (M > 0 ? M : 1) * cols));
  if (!job.scratch) { status[0] = 3; return; }
  llmkit_par_run(chunks, nt, KERNEL_FN_cols, &job);
  free(job.scratch);
}
"""
)


TILED_LINEAR_LOGPROBS = (
    VEC
    + EXP
    + _LINEAR
    + TOPK_KEEP
    + r"""
/* tiled_linear_logprobs: the score program's LM head. Threads claim blocks of CW columns (fixed:
   which columns a partial sum covers depends on neither the rows nor the threads); a claim
   computes its block of z for every row into its thread's scratch with tiled_linear's code (the
   same bits as tiled_linear's z), then, while it is in cache, per row: the block's max m and sum
   s = sum(exp(z - m)) (exp in float32, KERNEL_FN_exp; the sum in float64, 8 lanes in a fixed
   order; m taken as 0 when not finite, as the reference's logsumexp does), the target's logit if
   the block holds it, the rows logit_rows asks for, and the thread's running top K of the row
   (kept in the order of a stable sort of -z: larger first, then the lower index, NaNs last by
   index; a total order, so the top K do not depend on which thread saw which block). Then per
   row: lse = M + log(sum_b s_b exp(m_b - M)) over the blocks in order (M: the row's max, 0 when
   not finite), the threads' top K merged, z - lse.
   bufs: x [M, K], w (transposed 0: [N, K]; 2: panels), targets [M], logit_rows [R], logits [R, N],
   target_lp [M], top_lp [M, TK], top_ids [M, TK], status.
   sizes: M, K, N, mode (0 or 2), R, TK. */
enum { KERNEL_FN_CW = 256 };
typedef struct {
  const float *x, *w;
  const int64_t *targets, *rows;
  float *logits, *scratch, *bmax, *tz, *kv;
  double *bsum;
  int64_t *ki, *kn;
  int64_t M, K, N, mode, R, TK;
} KERNEL_FN_job;

static inline float KERNEL_FN_shift(float m) { return isfinite(m) ? m : 0.0f; }

typedef double KERNEL_FN_vd __attribute__((vector_size(32)));

/* the largest of y[0..w), NaN if one is */
static inline float KERNEL_FN_max(const float *y, int64_t w) {
  float mx = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
  for (int64_t c = 0; c < w; c++) mx = y[c] > mx ? y[c] : mx, nan |= y[c] != y[c];
  return nan ? NAN : mx;
}

/* acc[0], acc[1] (lanes 0-3, 4-7) += e's 8 lanes, in float64 */
static inline void KERNEL_FN_addd(KERNEL_FN_vd *acc, KERNEL_FN_v e) {
#if defined(__AVX2__) && defined(__FMA__)
  acc[0] += _mm256_cvtps_pd(_mm256_castps256_ps128(e));
  acc[1] += _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1));
#else
  float l[8];
  KERNEL_FN_st(l, e);
  for (int i = 0; i < 4; i++) acc[0][i] += l[i], acc[1][i] += l[4 + i];
#endif
}

KERNEL_FN_KEEP(float)

static void KERNEL_FN_block(void *arg, int64_t b, int64_t worker) {
  const KERNEL_FN_job *j = (const KERNEL_FN_job *)arg;
  const int64_t M = j->M, K = j->K, N = j->N, TK = j->TK, lo = b * KERNEL_FN_CW;
  const int64_t w = N - lo < KERNEL_FN_CW ? N - lo : KERNEL_FN_CW;
  float *y = j->scratch + worker * M * KERNEL_FN_CW;
  if (j->mode == 2) KERNEL_FN_pp(j->x, j->w + lo * K, y, M, K, w, KERNEL_FN_CW);
  else KERNEL_FN_nk(j->x, j->w + lo * K, y, M, K, w, KERNEL_FN_CW);
  for (int64_t m = 0; m < M; m++) {
    const float *ym = y + m * KERNEL_FN_CW;
    float mx = KERNEL_FN_max(ym, w);
    const KERNEL_FN_v sh = KERNEL_FN_splat(KERNEL_FN_shift(mx));
    KERNEL_FN_vd acc[2] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
    int64_t c = 0;
    for (; c + 8 <= w; c += 8) KERNEL_FN_addd(acc, KERNEL_FN_exp(KERNEL_FN_ld(ym + c) - sh));
    if (c < w) { /* a short last run, as if padded with -inf */
      float tail[8];
      for (int i = 0; i < 8; i++) tail[i] = i < w - c ? ym[c + i] : -INFINITY;
      KERNEL_FN_addd(acc, KERNEL_FN_exp(KERNEL_FN_ld(tail) - sh));
    }
    const KERNEL_FN_vd u = acc[0], h = acc[1];
    const double s = ((u[0] + h[0]) + (u[2] + h[2])) + ((u[1] + h[1]) + (u[3] + h[3]));
    j->bmax[b * M + m] = mx, j->bsum[b * M + m] = s; /* a block's partials together */
    float *v = j->kv + (worker * M + m) * TK;
    int64_t *id = j->ki + (worker * M + m) * TK, *n = j->kn + worker * M + m;
    /* 16 at a time; a run none of which can enter is passed over, and the block whose max is below
       the K-th kept */
    for (c = *n == TK && mx < v[TK - 1] ? w : 0; c < w;) {
      const int64_t end = c + 16 < w ? c + 16 : w;
      if (*n == TK && end - c == 16 && v[TK - 1] == v[TK - 1]) {
        const float kth = v[TK - 1], *yc = ym + c;
        int any = 0;
#pragma omp simd reduction(| : any)
        for (int u = 0; u < 16; u++) any |= (yc[u] >= kth) | (yc[u] != yc[u]);
        if (!any) { c = end; continue; }
      }
      for (; c < end; c++)
        if (*n < TK || !(ym[c] < v[TK - 1])) KERNEL_FN_keep_float(v, id, n, TK, ym[c], lo + c);
    }
    const int64_t t = j->targets[m] < 0 ? j->targets[m] + N : j->targets[m];
    if (t >= lo && t < lo + w) j->tz[m] = ym[t - lo];
  }
  for (int64_t r = 0; r < j->R; r++) {
    const int64_t row = j->rows[r] < 0 ? j->rows[r] + M : j->rows[r];
    memcpy(j->logits + r * N + lo, y + row * KERNEL_FN_CW, sizeof(float) * w);
  }
}

void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  const int64_t M = sizes[0], K = sizes[1], N = sizes[2], mode = sizes[3], R = sizes[4], TK = sizes[5];
  const int64_t *targets = (const int64_t *)bufs[2], *rows = (const int64_t *)bufs[3];
  double *target_lp = (double *)bufs[5], *top_lp = (double *)bufs[6];
  int64_t *top_ids = (int64_t *)bufs[7], *status = (int64_t *)bufs[8];
  for (int64_t m = 0; m < M; m++)
    if (targets[m] < -N || targets[m] >= N) { status[0] = 1; status[1] = m; return; }
  for (int64_t r = 0; r < R; r++)
    if (rows[r] < -M || rows[r] >= M) { status[0] = 2; status[1] = r; return; }
  const int64_t blocks = (N + KERNEL_FN_CW - 1) / KERNEL_FN_CW;
  int64_t nt = M * N * K < (1 << 17) || nthreads < 1 ? 1 : nthreads;
  if (nt > blocks) nt = blocks;
  KERNEL_FN_job job = {(const float *)bufs[0], (const float *)bufs[1], targets, rows, (float *)bufs[4],
                       NULL, NULL, NULL, NULL, NULL, NULL, NULL, M, K, N, mode, R, TK};
  job.scratch = (float *)malloc(sizeof(float) * (size_t)(nt * M * KERNEL_FN_CW));
  job.bmax = (float *)malloc(sizeof(float) * (size_t)(blocks * M));
  job.bsum = (double *)malloc(sizeof(double) * (size_t)(blocks * M));
  job.tz = (float *)malloc(sizeof(float) * (size_t)M);
  job.kv = (float *)malloc(sizeof(float) * (size_t)(nt * M * TK));
  job.ki = (int64_t *)malloc(sizeof(int64_t) * (size_t)(nt * M * TK));
  job.kn = (int64_t *)calloc((size_t)(nt * M), sizeof(int64_t));
  if (!job.scratch || !job.bmax || !job.bsum || !job.tz || !job.kv || !job.ki || !job.kn) {
    status[0] = 3;
  } else {
    llmkit_par_run(blocks, nt, KERNEL_FN_block, &job);
    for (int64_t m = 0; m < M; m++) {
      float mx = -INFINITY;
      int nan = 0;
      for (int64_t b = 0; b < blocks; b++) {
        const float v = job.bmax[b * M + m];
        nan |= v != v, mx = v > mx ? v : mx;
      }
      const double sh = nan ? 0.0 : KERNEL_FN_shift(mx);
      double s = 0.0;
      for (int64_t b = 0; b < blocks; b++) { /* an all -inf block adds nothing (not 0 * inf) */
        const double sb = job.bsum[b * M + m];
        if (sb != 0.0) s += sb * exp((double)KERNEL_FN_shift(job.bmax[b * M + m]) - sh);
      }
      const double lse = log(s) + sh;
      float *v = job.kv + m * TK; /* thread 0's top K, then the others' merged in */
      int64_t *id = job.ki + m * TK, *n = job.kn + m;
      for (int64_t t = 1; t < nt; t++)
        for (int64_t k = 0; k < job.kn[t * M + m]; k++)
          KERNEL_FN_keep_float(v, id, n, TK, job.kv[(t * M + m) * TK + k], job.ki[(t * M + m) * TK + k]);
      for (int64_t k = 0; k < TK; k++) top_lp[m * TK + k] = (double)v[k] - lse, top_ids[m * TK + k] = id[k];
      target_lp[m] = (double)job.tz[m] - lse;
    }
  }
  free(job.scratch), free(job.bmax), free(job.bsum), free(job.tz), free(job.kv), free(job.ki), free(job.kn);
}
"""
)


def _linear_sizes(x, weight, bias=None, rows=8, transposed=False, panel=0):
    k = x.shape[-1]
    rows = math.prod(x.shape[:-1])  # (not x.size // k: k may be 0)
    n = weight.shape[0] * panel if panel else weight.shape[1 if transposed else 0]
    return [rows, k, n, bias is not None, 2 if panel else int(transposed)]


def _linear_applies(x, weight, bias=None, rows=8, transposed=False, panel=0):
    # any tile size: the C kernel computes every row alone (the op's contract, for every `rows`)
    return weight.ndim == (3 if panel else 2) and all(t is None or t.dtype == _F32 for t in (x, weight, bias))


def _swiglu_sizes(x, w_gate, w_up, **attrs):
    return [math.prod(x.shape[:-1]), x.shape[-1], w_gate.shape[0] * w_gate.shape[2]]


def _swiglu_applies(x, w_gate, w_up, rows=8, transposed=False, panel=0):
    return panel == PANEL and all(t.dtype == _F32 for t in (x, w_gate, w_up))


native_kernel("tiled_linear", TILED_LINEAR, sizes=_linear_sizes, applies=_linear_applies)
native_kernel(
    "tiled_linear_swiglu",
    TILED_LINEAR_SWIGLU.replace("@SIGMOID@", get("sigmoid").c.format("gm[j]")),
    sizes=_swiglu_sizes,
    applies=_swiglu_applies,
)


def _tll_applies(x, weight, targets, logit_rows, k=5, rows=8, transposed=False, panel=0):
    # [N, K] or panels ([K, N] would need tiled_linear's shared-stride code: the reference runs it)
    return (
        x.ndim == 2
        and not transposed
        and k <= TOPK_MAX_K
        and _linear_applies(x, weight, None, rows, False, panel)
    )


native_kernel(
    "tiled_linear_logprobs",
    TILED_LINEAR_LOGPROBS,
    sizes=lambda x, weight, targets, logit_rows, k=5, rows=8, transposed=False, panel=0: [
        *_linear_sizes(x, weight, None, rows, transposed, panel)[:3],
        2 if panel else 0,
        logit_rows.shape[0],
        k,
    ],
    applies=_tll_applies,
)
