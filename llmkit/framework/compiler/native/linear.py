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
from .simd import VEC

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
