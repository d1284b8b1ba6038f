"""Hand-written C kernels of the ops that have one (``OpSpec.native``, see :class:`spec.Native`).

They serve the inference engine's decode step, where the reference kernels' numpy calls (5-100 µs
each, on arrays of a few hundred numbers) cost more than the arithmetic. Each is one function with
the compiler's kernel signature; ``KERNEL_FN`` (every name a kernel defines starts with it) becomes
its hashed name when it is built (``compiler/build.py``). The build flags keep IEEE semantics
(``-ffp-contract=off``, no ``-ffast-math``), so a kernel rounds exactly as written here.

Batch invariance (docs/serve.md) is a property of the code below, not of a library: no loop mixes
two rows (tokens) of the batch, and every sum runs in a fixed order that depends only on the sizes
of its own row.
"""

from __future__ import annotations

from ..par import DECLARE as _PAR

# Multiply-accumulate helpers: fused (one rounding) where the CPU has FMA, else multiply then add;
# the vector lanes and the scalar tails round the same way, so a column's result does not depend
# on whether it fell in a vector or in the tail.
_VEC = r"""
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 KERNEL_FN_v;
static inline KERNEL_FN_v KERNEL_FN_ld(const float *p) { return _mm256_loadu_ps(p); }
static inline void KERNEL_FN_st(float *p, KERNEL_FN_v v) { _mm256_storeu_ps(p, v); }
static inline KERNEL_FN_v KERNEL_FN_splat(float a) { return _mm256_set1_ps(a); }
static inline KERNEL_FN_v KERNEL_FN_mac(KERNEL_FN_v acc, KERNEL_FN_v a, KERNEL_FN_v b) {
  return _mm256_fmadd_ps(a, b, acc);
}
static inline float KERNEL_FN_smac(float acc, float a, float b) { return fmaf(a, b, acc); }
#else
typedef float KERNEL_FN_v __attribute__((vector_size(32)));
typedef float KERNEL_FN_vu __attribute__((vector_size(32), aligned(4)));
static inline KERNEL_FN_v KERNEL_FN_ld(const float *p) { return *(const KERNEL_FN_vu *)p; }
static inline void KERNEL_FN_st(float *p, KERNEL_FN_v v) { *(KERNEL_FN_vu *)p = v; }
static inline KERNEL_FN_v KERNEL_FN_splat(float a) { return (KERNEL_FN_v){a, a, a, a, a, a, a, a}; }
static inline KERNEL_FN_v KERNEL_FN_mac(KERNEL_FN_v acc, KERNEL_FN_v a, KERNEL_FN_v b) {
  return acc + a * b;
}
static inline float KERNEL_FN_smac(float acc, float a, float b) { return acc + a * b; }
#endif
/* sum of the 8 lanes as a fixed tree: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) */
static inline float KERNEL_FN_hsum(KERNEL_FN_v v) {
#if defined(__AVX2__) && defined(__FMA__)
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1)));
#else
  float l[8];
  KERNEL_FN_st(l, v);
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
#endif
}
/* the 8 sums hsum(a[0]) .. hsum(a[7]) as one vector, each by the same tree (a transpose on the way) */
static inline KERNEL_FN_v KERNEL_FN_hsum8(const KERNEL_FN_v *a) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 p[4]; /* pair (2r, 2r+1): [l0+l4, l1+l5, l2+l6, l3+l7] of each */
  for (int r = 0; r < 4; r++)
    p[r] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * r], a[2 * r + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * r], a[2 * r + 1], 0x31));
  /* (l0+l4)+(l2+l6) and (l1+l5)+(l3+l7): [A0 B0 A2 B2 | A1 B1 A3 B3], then for 4..7 */
  const __m256 q0 = _mm256_add_ps(_mm256_shuffle_ps(p[0], p[1], 0x44), _mm256_shuffle_ps(p[0], p[1], 0xEE));
  const __m256 q1 = _mm256_add_ps(_mm256_shuffle_ps(p[2], p[3], 0x44), _mm256_shuffle_ps(p[2], p[3], 0xEE));
  /* A + B: [s0 s2 s4 s6 | s1 s3 s5 s7], then into order */
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(q0, q1, 0x88), _mm256_shuffle_ps(q0, q1, 0xDD));
  return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#else
  float l[8];
  for (int r = 0; r < 8; r++) l[r] = KERNEL_FN_hsum(a[r]);
  return KERNEL_FN_ld(l);
#endif
}
"""

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
   W as [N, K] (a weight that could not be stored transposed, e.g. tied embeddings): y[m, n] is a
   dot product of two contiguous rows in 8 lanes (lane l sums the k = l mod 8 in order), the lanes
   added as a fixed tree (hsum), then the last K mod 8 terms.
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

/* For each 16-column panel q < panels (at base + q * ps, [kc][16]) and every block of rows: y's
   columns 16 q .. 16 q + 15 (the last panel may hold only NP - 16 q of them) take rows k0 .. k0+kc-1
   of W in. */
static void KERNEL_FN_panels(const float *x, int64_t M, int64_t K, int64_t k0, int64_t kc,
                             const float *base, int64_t ps, int64_t panels, int64_t NP, float *y,
                             int64_t ld) {
  for (int64_t q = 0; q < panels; q++) {
    const int64_t j = q * 16;
    const int nv = NP - j >= 16 ? 2 : 1;
    const float *pp = base + q * ps;
    int64_t m = 0;
    for (; m + 6 <= M; m += 6) { KERNEL_FN_MK(6); }
    switch (M - m) {
      case 5: KERNEL_FN_MK(5); break;
      case 4: KERNEL_FN_MK(4); break;
      case 3: KERNEL_FN_MK(3); break;
      case 2: KERNEL_FN_MK(2); break;
      case 1: KERNEL_FN_MK(1); break;
      default: break;
    }
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
  const int64_t step = M * K <= KERNEL_FN_STREAM_X ? K : KERNEL_FN_KC;
  for (int64_t k0 = 0; k0 < K; k0 += step) {
    const int64_t kc = K - k0 < step ? K - k0 : step;
    KERNEL_FN_panels(x, M, K, k0, kc, pw + k0 * 16, K * 16, N / 16, N, y, ld);
  }
}

static void KERNEL_FN_nk(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N,
                         int64_t ld) {
  const int64_t k8 = K - K % 8;
  for (int64_t m = 0; m < M; m++) {
    const float *xm = x + m * K;
    for (int64_t n = 0; n < N; n++) {
      const float *wn = w + n * K;
      KERNEL_FN_v a = KERNEL_FN_splat(0.0f);
      for (int64_t k = 0; k < k8; k += 8) a = KERNEL_FN_mac(a, KERNEL_FN_ld(xm + k), KERNEL_FN_ld(wn + k));
      float s = KERNEL_FN_hsum(a);
      for (int64_t k = k8; k < K; k++) s = KERNEL_FN_smac(s, xm[k], wn[k]);
      y[m * ld + n] = s;
    }
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
    _VEC
    + _LINEAR
    + _PAR
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
  llmkit_par_for(chunks, nt, KERNEL_FN_cols, &job);
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
    _VEC
    + _LINEAR
    + _PAR
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
  llmkit_par_for(chunks, nt, KERNEL_FN_cols, &job);
  free(job.scratch);
}
"""
)

PAGED_ATTENTION = (
    _VEC
    + _PAR
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
   bufs: q [B, HQ, S, D], pool [L, 2, NB, BS, HK, D], block_tables [NS, MB], kv_len [NS],
         (q_start [NS], q_len [NS],) out [B, HQ, S, D], status.
   sizes: B, HQ, S, D, NB, BS, HK, MB, layer, scale (double bits), segmented, NS. */
/* One query token, all its heads, a KV block at a time: a block's rows (every kv head's key or
   value of BS positions, contiguous) are read once, for all the heads, while they are in L1;
   going head by head over the whole sequence read each row in HK strided passes. Every score and
   every output element is still the same chain as one head alone would compute: a score is one
   dot product (8 lanes, then the fixed tree), the outputs add the positions in order (a block
   continues from the running sums it stored). D is a constant where it is inlined.
   q: head hq at q + hq * qstride; out likewise; p: scratch [HQ][t]. */
static inline __attribute__((always_inline)) void KERNEL_FN_token(
    const float *q, int64_t qstride, const float *keys, const float *values, const int64_t *blocks,
    int64_t t, int64_t BS, int64_t row, int64_t block, int64_t HK, int64_t G, float scale, float *out,
    int64_t ostride, float *p, const int64_t D) {
  const int64_t d8 = D - D % 8, HQ = HK * G;
  for (int64_t i0 = 0; i0 < t; i0 += BS) { /* scores */
    const int64_t i1 = i0 + BS < t ? i0 + BS : t;
    const float *kb = keys + blocks[i0 / BS] * block;
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
    const float *vb = values + blocks[i0 / BS] * block;
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
  const float *keys, *values;
  const int64_t *tables, *seg, *len;
  float *scratch;
  int64_t per_worker, S, D, MB, BS, row, block, HK, G;
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
  float *p = j->scratch + worker * j->per_worker;
#define KERNEL_FN_TOKEN(DIM)                                                                             \
  KERNEL_FN_token(j->q + at, hs, j->keys, j->values, blocks, j->len[n], j->BS, j->row, j->block, j->HK, \
                  j->G, j->scale, j->out + at, hs, p, DIM)
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
  const int64_t segmented = sizes[10], NS = segmented ? sizes[11] : B * S;
  double scale64;
  memcpy(&scale64, &sizes[9], sizeof scale64);
  const float scale = (float)scale64;
  const float *q = (const float *)bufs[0], *pool = (const float *)bufs[1];
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
  const int64_t row = HK * D, block = BS * row;
  const float *keys = pool + (layer * 2) * NB * block, *values = keys + NB * block;
  /* tokens are independent: threads take whole tokens (at least 64 keys x heads of work each) */
  int64_t work = 0;
  for (int64_t n = 0; n < N; n++) work += seg[n] >= 0 ? len[n] * HQ : 0;
  int64_t nt = work < 4096 ? 1 : nthreads < N ? nthreads : N;
  if (nt < 1) nt = 1;
  float *scratch = (float *)malloc(nt * HQ * longest * sizeof(float));
  if (!scratch) { status[0] = 3; free(seg); return; }
  KERNEL_FN_job job = {q, out, keys, values, tables, seg, len, scratch, HQ * longest,
                       S, D, MB, BS, row, block, HK, G, scale};
  llmkit_par_for(N, nt, KERNEL_FN_one, &job);
  free(scratch);
  free(seg);
}
"""
)

PAGED_KV_WRITE = r"""
#include <string.h>
/* paged_kv_write: token n = (b, s) of k and v [B, HK, S, D] goes to flat slot slots[n] of
   pool[layer, 0] and pool[layer, 1] (a negative slot: not stored). Any element type.
   bufs: pool, k, v, slots [B*S], out (the pool itself when written in place), status.
   sizes: B, HK, S, D, NB*BS (slots per layer half), itemsize, layer, pool size in bytes. */
void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  (void)nthreads;
  const int64_t B = sizes[0], HK = sizes[1], S = sizes[2], D = sizes[3], SLOTS = sizes[4];
  const int64_t item = sizes[5], layer = sizes[6], nbytes = sizes[7];
  const char *k = (const char *)bufs[1], *v = (const char *)bufs[2];
  const int64_t *slots = (const int64_t *)bufs[3];
  char *out = (char *)bufs[4];
  int64_t *status = (int64_t *)bufs[5];
  for (int64_t n = 0; n < B * S; n++)
    if (slots[n] >= SLOTS) { status[0] = 1; status[1] = n; return; }
  if (out != (char *)bufs[0]) memcpy(out, bufs[0], nbytes);
  const int64_t row = D * item, half = SLOTS * HK * row;
  char *kdst = out + layer * 2 * half, *vdst = kdst + half;
  for (int64_t n = 0; n < B * S; n++) {
    if (slots[n] < 0) continue;
    const int64_t b = n / S, s = n % S;
    for (int64_t h = 0; h < HK; h++) {
      const int64_t src = ((b * HK + h) * S + s) * row, dst = (slots[n] * HK + h) * row;
      memcpy(kdst + dst, k + src, row);
      memcpy(vdst + dst, v + src, row);
    }
  }
}
"""

INDEX_SELECT = r"""
#include <string.h>
/* index_select along axis 0: out[i] = x[index[i]] (negative indices count from the end, as numpy
   take does), whole rows of any element type.
   bufs: x [R, ...], index [N] (int64), out [N, ...], status. sizes: R, N, row bytes. */
void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  (void)nthreads;
  const int64_t R = sizes[0], N = sizes[1], row = sizes[2];
  const char *x = (const char *)bufs[0];
  const int64_t *index = (const int64_t *)bufs[1];
  char *out = (char *)bufs[2];
  int64_t *status = (int64_t *)bufs[3];
  for (int64_t i = 0; i < N; i++)
    if (index[i] < -R || index[i] >= R) { status[0] = 1; status[1] = i; return; }
  for (int64_t i = 0; i < N; i++) {
    const int64_t r = index[i] < 0 ? index[i] + R : index[i];
    memcpy(out + i * row, x + r * row, row);
  }
}
"""

INDEX_ADD = r"""
#include <string.h>
/* index_add along axis 0: out = x, then out[index[i]] += src[i] for i = 0, 1, ... in order (as
   numpy's add.at: repeated indices accumulate in index order, so the bits are the reference's).
   float32 (itemsize 4) or float64 (8). bufs: x [R, C...], index [N] (int64), src [N, C...], out,
   status. sizes: R, N, elements per row, itemsize. */
void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  (void)nthreads;
  const int64_t R = sizes[0], N = sizes[1], C = sizes[2], item = sizes[3];
  const int64_t *index = (const int64_t *)bufs[1];
  int64_t *status = (int64_t *)bufs[4];
  for (int64_t i = 0; i < N; i++)
    if (index[i] < -R || index[i] >= R) { status[0] = 1; status[1] = i; return; }
  if (bufs[3] != bufs[0]) memcpy(bufs[3], bufs[0], (size_t)(R * C * item));
  for (int64_t i = 0; i < N; i++) {
    const int64_t r = index[i] < 0 ? index[i] + R : index[i];
    if (item == 4) {
      float *o = (float *)bufs[3] + r * C;
      const float *a = (const float *)bufs[2] + i * C;
      for (int64_t c = 0; c < C; c++) o[c] = o[c] + a[c];
    } else {
      double *o = (double *)bufs[3] + r * C;
      const double *a = (const double *)bufs[2] + i * C;
      for (int64_t c = 0; c < C; c++) o[c] = o[c] + a[c];
    }
  }
}
"""
