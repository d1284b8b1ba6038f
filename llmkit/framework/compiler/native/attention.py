"""Attention as one kernel each way: ``scaled_dot_product_attention`` and its backward op
``scaled_dot_product_attention_grad`` (flash attention, as in Dao et al. 2022, for CPUs), and their
``_lse`` forms (the forward also writes each row's log-sum-exp, which the backward then reads).

Decomposed, attention is four GEMMs around a softmax over an ``[B, Hq, S, T]`` tensor that is
written and read back several times, and causal masking still computes every masked score. These
kernels never materialize it: a tile of ``BR`` query rows meets ``BC`` keys at a time, in L1.

- forward: scores ``S = (q * scale) k^T`` for the tile, an online softmax (running row max ``m``
  and sum ``l``; earlier partial outputs rescaled by ``exp(m_old - m_new)``), then ``acc += P v``;
  ``out = acc / l``. Key tiles wholly above the causal diagonal are never visited; in a diagonal
  tile the products go 6 rows at a time over the keys the group's last row sees, and masked keys
  are -inf by a lane mask. The softmax runs in phases over all the tile's rows (their dependency
  chains overlap; alpha a vector of rows; sums kept in vector lanes). One task per (batch, kv
  head, set of query tiles).
- backward: one task per (batch, kv head), so its ``dk``/``dv`` rows and the ``dq`` rows of its
  query heads are its own (no atomics). Per query tile: the rows' log-sum-exp (a first pass over
  the keys), then per key tile ``P = exp(S - lse)``, ``dS = P * (g v^T - rowsum(g * out))``,
  ``dv += P^T g``, ``dk += dS^T (q * scale)``, ``dq += dS k`` (times scale at the end).

The GEMM-like products are one register-tiled micro-kernel (``mm``: 6 rows x 2 vectors of
accumulators, fused multiply-adds where the CPU has FMA, GCC/Clang vector extensions; ``mmt`` reads
its left operand transposed); score tiles are computed over whole vectors of their visible keys
only. Rows are padded to whole vectors in the kernel's own scratch buffers, so any head dim works;
q, k, v, g and out are read through their strides (the model's transposed views are not copied
first; k and v go through 8 x 8 register transposes where AVX2 has them). exp is ``simd.EXP``'s
polynomial in float32 with its Horner steps fused (libm's in float64), a vector at a time.
Numerics: sums run in a different order than BLAS and the reference softmax (float32 within
~1e-6 relative); NaN in a row spreads through that row as in the reference.

A program gets these kernels where the op has no mask (``is_causal`` or none), a float32/float64
dtype and static head counts and dims: ``decompose`` then leaves the op whole; anything else is
decomposed and fused. Each kernel is rendered for its op (head dims, dtype, scale and causality
are constants of the C), so ``source`` is a function of the op's types and attributes.
"""

from __future__ import annotations

import math
import re

import numpy as np

from .attach import native_kernel
from .simd import EXP, VEC

BR, BC = 32, 64  # query rows and keys per tile: the score tile (8 KiB in float32) stays in L1
VECTOR_BYTES = 32  # AVX2 / NEON x2; wider machines still vectorize each half
# simd.EXP with its 7 Horner steps fused (one rounding each where the CPU has FMA): a quarter fewer
# instructions; the polynomial is the same (tiled_linear_logprobs keeps simd.EXP as it is)
_EXP = re.sub(r"p = p \* r \+ ([^,;]+)", r"p = KERNEL_FN_mac(\1, p, r)", EXP)
assert _EXP.count("KERNEL_FN_mac") == 7, "simd.EXP's Horner steps changed form"

_HELPERS = r"""
#ifndef LLMKIT_ATTENTION_@S@
#define LLMKIT_ATTENTION_@S@
#include <stdlib.h>
#include <string.h>
typedef @T@ attn_vec_@S@ __attribute__((vector_size(@VB@)));
typedef @T@ attn_uvec_@S@ __attribute__((vector_size(@VB@), aligned(sizeof(@T@))));
typedef @I@ attn_ivec_@S@ __attribute__((vector_size(@VB@)));
#define LD_@S@(p) (*(const attn_uvec_@S@ *)(p))
#define ST_@S@(p, x) (*(attn_uvec_@S@ *)(p) = (x))

/* a * b + c, fused (one rounding) where the CPU has FMA: the build's -ffp-contract=off keeps
   a * b + c apart everywhere else */
#if defined(__FMA__) && @VB@ == 32
#include <immintrin.h>
#define FMA_@S@(a, b, c) ((attn_vec_@S@)_mm256_fmadd_@PS@((a), (b), (c)))
#else
#define FMA_@S@(a, b, c) ((a) * (b) + (c))
#endif

/* C[M][N] = (acc ? C : 0) + A B, A[i][k] at A[i*lda + k] (mm) or A[k*lda + i] (mmt), B[K][N]
   row-major, N a multiple of the vector width W. Register tiles of R rows x V vectors (6 x 2: 12
   accumulators, 2 of B and 1 broadcast of A in the 16 vector registers), then smaller at the edges. */
#define ATTN_TILE(NAME, R, V, AT)                                                                   \
static inline void NAME(int64_t i, int64_t j, int64_t K, const @T@ *restrict A, int64_t lda,      \
                        const @T@ *restrict B, int64_t ldb, @T@ *restrict C, int64_t ldc, int acc) { \
  const int64_t W = @W@;                                                                           \
  attn_vec_@S@ s[R][V];                                                                            \
  _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                              \
    _Pragma("GCC unroll 4") for (int v = 0; v < V; v++)                                            \
      s[r][v] = acc ? LD_@S@(C + (i + r) * ldc + j + v * W) : (attn_vec_@S@){0};                  \
  const @T@ *b = B + j;                                                                            \
  for (int64_t k = 0; k < K; k++, b += ldb) {                                                      \
    attn_vec_@S@ bv[V];                                                                            \
    _Pragma("GCC unroll 4") for (int v = 0; v < V; v++) bv[v] = LD_@S@(b + v * W);                \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                          \
      const attn_vec_@S@ x = AT(r) - (attn_vec_@S@){0};                                            \
      _Pragma("GCC unroll 4") for (int v = 0; v < V; v++) s[r][v] = FMA_@S@(x, bv[v], s[r][v]);  \
    }                                                                                              \
  }                                                                                                \
  _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                              \
    _Pragma("GCC unroll 4") for (int v = 0; v < V; v++) ST_@S@(C + (i + r) * ldc + j + v * W, s[r][v]); \
}
#define ATTN_MM(NAME, AT)                                                                          \
ATTN_TILE(NAME##_6x2, 6, 2, AT) ATTN_TILE(NAME##_6x1, 6, 1, AT)                                    \
ATTN_TILE(NAME##_4x2, 4, 2, AT) ATTN_TILE(NAME##_4x1, 4, 1, AT)                                    \
ATTN_TILE(NAME##_2x2, 2, 2, AT) ATTN_TILE(NAME##_2x1, 2, 1, AT)                                    \
ATTN_TILE(NAME##_1x2, 1, 2, AT) ATTN_TILE(NAME##_1x1, 1, 1, AT)                                    \
static void NAME(int64_t M, int64_t K, int64_t N, const @T@ *restrict A, int64_t lda,             \
                 const @T@ *restrict B, int64_t ldb, @T@ *restrict C, int64_t ldc, int acc) {      \
  const int64_t W = @W@;                                                                           \
  int64_t i = 0;                                                                                   \
  for (; i + 6 <= M; i += 6) {                                                                     \
    int64_t j = 0;                                                                                 \
    for (; j + 2 * W <= N; j += 2 * W) NAME##_6x2(i, j, K, A, lda, B, ldb, C, ldc, acc);           \
    if (j < N) NAME##_6x1(i, j, K, A, lda, B, ldb, C, ldc, acc);                                   \
  }                                                                                                \
  if (i + 4 <= M) {                                                                                \
    int64_t j = 0;                                                                                 \
    for (; j + 2 * W <= N; j += 2 * W) NAME##_4x2(i, j, K, A, lda, B, ldb, C, ldc, acc);           \
    if (j < N) NAME##_4x1(i, j, K, A, lda, B, ldb, C, ldc, acc);                                   \
    i += 4;                                                                                        \
  }                                                                                                \
  for (; i + 2 <= M; i += 2) {                                                                     \
    int64_t j = 0;                                                                                 \
    for (; j + 2 * W <= N; j += 2 * W) NAME##_2x2(i, j, K, A, lda, B, ldb, C, ldc, acc);           \
    if (j < N) NAME##_2x1(i, j, K, A, lda, B, ldb, C, ldc, acc);                                   \
  }                                                                                                \
  if (i < M) {                                                                                     \
    int64_t j = 0;                                                                                 \
    for (; j + 2 * W <= N; j += 2 * W) NAME##_1x2(i, j, K, A, lda, B, ldb, C, ldc, acc);           \
    if (j < N) NAME##_1x1(i, j, K, A, lda, B, ldb, C, ldc, acc);                                   \
  }                                                                                                \
}
#define CW_@S@(cols) (((cols) + @W@ - 1) / @W@ * @W@)  /* score columns computed: whole vectors */
#define ATTN_A(r) A[(i + (r)) * lda + k]
#define ATTN_AT(r) A[k * lda + i + (r)]
ATTN_MM(attn_mm_@S@, ATTN_A)
ATTN_MM(attn_mmt_@S@, ATTN_AT)
#undef ATTN_A
#undef ATTN_AT
#undef ATTN_MM
#undef ATTN_TILE

/* n elements of scratch, 64-byte aligned, zeroed (padding lanes must hold finite values) */
static @T@ *attn_scratch_@S@(int64_t n) {
  void *p = NULL;
  if (posix_memalign(&p, 64, (size_t)n * sizeof(@T@) + 64)) return NULL;
  memset(p, 0, (size_t)n * sizeof(@T@));
  return (@T@ *)p;
}

/* rows [r0, r0 + n) of a strided [rows, cols] matrix, times scale, into dst[r][ld] */
static void attn_rows_@S@(@T@ *restrict dst, int64_t ld, const @T@ *restrict src, int64_t r0,
                          int64_t n, int64_t cols, int64_t rs, int64_t cs, @T@ scale) {
  for (int64_t r = 0; r < n; r++)
    for (int64_t c = 0; c < cols; c++) dst[r * ld + c] = src[(r0 + r) * rs + c * cs] * scale;
}

/* the same rows transposed: dst[c][ld], column r; 8 rows at a time (their cache lines stay in L1
   while each column's 8 take them in), 8 x 8 blocks through AVX2's shuffles where it has them */
static void attn_cols_@S@(@T@ *restrict dst, int64_t ld, const @T@ *restrict src, int64_t n,
                          int64_t cols, int64_t rs, int64_t cs) {
  int64_t r0 = 0;
#if defined(__AVX2__) && defined(__FMA__) && @F32@
  for (; cs == 1 && cols % 8 == 0 && r0 + 8 <= n; r0 += 8)
    for (int64_t c0 = 0; c0 < cols; c0 += 8) {
      __m256 a[8], t[8];
      for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(src + (r0 + i) * rs + c0);
      for (int i = 0; i < 8; i += 2)
        t[i] = _mm256_unpacklo_ps(a[i], a[i + 1]), t[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
      for (int i = 0; i < 8; i += 4)
        for (int j = 0; j < 2; j++)
          a[i + 2 * j] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0x44),
          a[i + 2 * j + 1] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0xEE);
      for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + (c0 + i) * ld + r0, _mm256_permute2f128_ps(a[i], a[i + 4], 0x20));
        _mm256_storeu_ps(dst + (c0 + i + 4) * ld + r0, _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
      }
    }
#endif
  for (; r0 < n; r0 += 8)
    for (int64_t c = 0; c < cols; c++)
      for (int64_t r = r0; r < (n - r0 < 8 ? n : r0 + 8); r++) dst[c * ld + r] = src[r * rs + c * cs];
}

/* a tile's rows 6 at a time (the micro-kernel's row tile): rows [g0, g0 + gm), the last seeing the
   tile's first nv keys, so that a causal diagonal tile's products skip most of its masked part */
#define ATTN_GROUPS(rows, i0, j0, cols)                                                           \
  for (int64_t g0 = 0, gm, nv; g0 < (rows); g0 += 6)                                              \
    if (gm = (rows) - g0 < 6 ? (rows) - g0 : 6,                                                    \
        nv = attn_visible(causal, (i0) + g0 + gm - 1, OFF, (j0), (cols)), 1)

/* keys of a score row its query may see: all n, or those up to the causal diagonal */
static inline int64_t attn_visible(int causal, int64_t row, int64_t off, int64_t j0, int64_t n) {
  if (!causal) return n;
  const int64_t lim = row + off - j0 + 1;
  return lim < 0 ? 0 : lim < n ? lim : n;
}

#endif

/* exp of each lane: float's polynomial (simd.EXP), double's libm lane by lane */
static inline attn_vec_@S@ KERNEL_FN_exp_@S@(attn_vec_@S@ x) {
#if @F32@
  return (attn_vec_@S@)KERNEL_FN_exp((KERNEL_FN_v)x);
#else
  for (int i = 0; i < @W@; i++) x[i] = exp(x[i]);
  return x;
#endif
}

/* One online-softmax step of a tile's score rows s[r][BC] (r < rows, query i0 + r meets keys j0 ..
   j0 + cols): each row's running max m[r] and sums lv[r] (W lanes, added up at the end) take in
   its visible keys, s becomes exp(s - m_new) over whole vectors of cols (0 past the visible keys:
   they are set to -inf by a lane mask, no branch per row), and alpha[r] is what the row's earlier
   partial sums must be scaled by. In phases over all rows, so that the rows' dependency chains
   overlap; exp(-inf) is 0, so a row that has seen nothing yet gets 0s. */
static inline void KERNEL_FN_online(@T@ *restrict s, int64_t rows, int causal, int64_t i0, int64_t off,
                                    int64_t j0, int64_t cols, @T@ *restrict m, attn_vec_@S@ *restrict lv,
                                    @T@ *restrict alpha) {
  const int64_t cw = CW_@S@(cols);
  const int masked = cols < cw || attn_visible(causal, i0, off, j0, cols) < cols;
  const attn_ivec_@S@ lane = @IOTA@;
  const attn_vec_@S@ ninf = -INFINITY - (attn_vec_@S@){0};
  @T@ mn[@BR@], ms[@BR@] = {0};  /* the new max; the same, 0 where it is still -inf */
  for (int64_t r = 0; r < rows; r++) {
    @T@ *restrict sr = s + r * @BC@;
    const attn_ivec_@S@ n = (@I@)attn_visible(causal, i0 + r, off, j0, cols) - (attn_ivec_@S@){0};
    for (int64_t c = 0; masked && c < cw; c += @W@) {
      const attn_ivec_@S@ keep = lane + (@I@)c < n;
      ST_@S@(sr + c, (attn_vec_@S@)(((attn_ivec_@S@)LD_@S@(sr + c) & keep) | ((attn_ivec_@S@)ninf & ~keep)));
    }
    @T@ mx = m[r];
    #pragma omp simd reduction(max:mx)
    for (int64_t c = 0; c < cw; c++) mx = sr[c] > mx ? sr[c] : mx;
    mn[r] = mx;
    ms[r] = mx == -INFINITY ? 0 : mx;
  }
  for (int64_t r = 0; r < rows; r += @W@)
    ST_@S@(alpha + r, KERNEL_FN_exp_@S@(LD_@S@(m + r) - LD_@S@(ms + r)));
  for (int64_t r = 0; r < rows; r++) {
    @T@ *restrict sr = s + r * @BC@;
    const attn_vec_@S@ mv = ms[r] - (attn_vec_@S@){0};
    attn_vec_@S@ acc = lv[r] * (alpha[r] - (attn_vec_@S@){0});
    for (int64_t c = 0; c < cw; c += @W@) {
      const attn_vec_@S@ e = KERNEL_FN_exp_@S@(LD_@S@(sr + c) - mv);
      ST_@S@(sr + c, e);
      acc += e;
    }
    lv[r] = acc;
    m[r] = mn[r];
  }
}

/* the lanes of v added up */
static inline @T@ KERNEL_FN_lanes_@S@(attn_vec_@S@ v) {
  @T@ sum = 0;
  for (int i = 0; i < @W@; i++) sum += v[i];
  return sum;
}
"""

_PARAMS = r"""
  enum { D = @D@, DV = @DV@, DP = @DP@, DVP = @DVP@, BR = @BR@, BC = @BC@, W = @W@ };
  const int causal = @CAUSAL@;
  const @T@ scale = @SCALE@;
  const int64_t NB = sizes[0], HQ = sizes[1], HK = sizes[2], S = sizes[3], T = sizes[4];
  const int64_t G = HQ / HK, OFF = T - S;  /* query i sees keys j <= i + OFF when causal */
  const int64_t TP = (T + BC - 1) / BC * BC, LT = TP + 2 * W;  /* LT: no power-of-two row stride */
  (void)causal, (void)scale, (void)G, (void)OFF;
"""

# Tasks run on the thread pool (par.py), each worker with its own scratch buffers (a kernel's
# ``scratch``: names and sizes in elements), which the kernel allocates before it hands tasks out.
_TASKS = r"""
typedef struct { @T@ *@BUFFERS@; } KERNEL_FN_scratch;
typedef struct {
  void **bufs;
  const int64_t *sizes;
  int64_t parts;
  KERNEL_FN_scratch *scratch; /* [threads] */
} KERNEL_FN_job;

static void KERNEL_FN_task(void *arg, int64_t task, int64_t worker) {
  const KERNEL_FN_job *job = (const KERNEL_FN_job *)arg;
  void **bufs = job->bufs;
  const int64_t *sizes = job->sizes, parts = job->parts;
  const KERNEL_FN_scratch sc = job->scratch[worker];
  (void)parts;
@ARGS@
@PARAMS@
@TASK@
}

void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
@PARAMS@
  const int64_t nt = (S * T * HQ * NB >= 32768) ? nthreads : 1;
@PARTS@  const int64_t tasks = @TASKS@;
  KERNEL_FN_job job = {bufs, sizes, @NPARTS@, (KERNEL_FN_scratch *)calloc(nt, sizeof(KERNEL_FN_scratch))};
  for (int64_t w = 0; w < nt; w++) {
@ALLOC@
  }
  llmkit_par_run(tasks, nt, KERNEL_FN_task, &job);
  for (int64_t w = 0; w < nt; w++) {
@FREE@
  }
  free(job.scratch);
}
"""

# forward (flash): one task per (batch, kv head), split into interleaved sets of query tiles only
# when there are too few (batch, kv head) pairs to share
_FORWARD = dict(
    args=r"""
  const @T@ *restrict q = (const @T@ *)bufs[0];
  const @T@ *restrict k = (const @T@ *)bufs[1];
  const @T@ *restrict v = (const @T@ *)bufs[2];
  @T@ *restrict o = (@T@ *)bufs[3];
  @T@ *restrict lse = @LSE@ ? (@T@ *)bufs[4] : NULL;  /* each row's log-sum-exp, for the backward */
  const int64_t *qs = sizes + 5, *ks = sizes + 9, *vs = sizes + 13, *os = sizes + 17, *ls = sizes + 21;
""",
    scratch=(
        ("kT", "D * LT"),  # k^T [D][LT]
        ("vr", "TP * DVP"),  # v rows [TP][DVP]
        ("qb", "BR * DP"),  # the tile's queries times scale [BR][DP]
        ("sb", "BR * BC"),  # scores, then probabilities [BR][BC]
        ("acc", "BR * DVP"),  # unnormalized output rows [BR][DVP]
    ),
    tasks="NB * HK * parts",
    parts=r"""
  const int64_t tiles = (S + BR - 1) / BR;
  int64_t parts = (4 * nt + NB * HK - 1) / (NB * HK);
  parts = parts < 1 ? 1 : parts > tiles ? tiles : parts;
""",
    task=r"""
  const int64_t tiles = (S + BR - 1) / BR;
  @T@ m[BR], alpha[BR];
  attn_vec_@S@ lv[BR];
  const int64_t part = task % parts, b = task / parts / HK, hk = task / parts % HK;
  int64_t kmax = T;  /* keys the part's last tile sees */
  if (causal) {
    const int64_t last = ((tiles - 1 - part) / parts * parts + part) * BR;
    const int64_t e = (last + BR < S ? last + BR : S) + OFF;
    kmax = e < 0 ? 0 : e < T ? e : T;
  }
  attn_cols_@S@(sc.kT, LT, k + b * ks[0] + hk * ks[1], kmax, D, ks[2], ks[3]);
  attn_rows_@S@(sc.vr, DVP, v + b * vs[0] + hk * vs[1], 0, kmax, DV, vs[2], vs[3], 1);
  for (int64_t g = 0; g < G; g++) {
    const int64_t h = hk * G + g;
    @T@ *oh = o + b * os[0] + h * os[1];
    for (int64_t i0 = part * BR; i0 < S; i0 += parts * BR) {
      const int64_t rows = S - i0 < BR ? S - i0 : BR;
      int64_t kend = T;
      if (causal) kend = i0 + rows + OFF < 0 ? 0 : i0 + rows + OFF < T ? i0 + rows + OFF : T;
      attn_rows_@S@(sc.qb, DP, q + b * qs[0] + h * qs[1], i0, rows, D, qs[2], qs[3], scale);
      for (int64_t r = 0; r < BR; r++) { m[r] = -INFINITY; lv[r] = (attn_vec_@S@){0}; }
      memset(sc.acc, 0, sizeof(@T@) * BR * DVP);
      for (int64_t j0 = 0; j0 < kend; j0 += BC) {
        const int64_t cols = kend - j0 < BC ? kend - j0 : BC;
        ATTN_GROUPS(rows, i0, j0, cols)
          attn_mm_@S@(gm, D, CW_@S@(nv), sc.qb + g0 * DP, DP, sc.kT + j0, LT, sc.sb + g0 * BC, BC, 0);
        KERNEL_FN_online(sc.sb, rows, causal, i0, OFF, j0, cols, m, lv, alpha);
        for (int64_t r = 0; r < rows; r++)
          for (int64_t d = 0; d < DVP; d++) sc.acc[r * DVP + d] *= alpha[r];
        ATTN_GROUPS(rows, i0, j0, cols)
          attn_mm_@S@(gm, nv, DVP, sc.sb + g0 * BC, BC, sc.vr + j0 * DVP, DVP, sc.acc + g0 * DVP, DVP, 1);
      }
      for (int64_t r = 0; r < rows; r++) {
        const @T@ l = KERNEL_FN_lanes_@S@(lv[r]);
        for (int64_t d = 0; d < DV; d++) oh[(i0 + r) * os[2] + d * os[3]] = sc.acc[r * DVP + d] / l;
        if (@LSE@) lse[b * ls[0] + h * ls[1] + (i0 + r) * ls[2]] = m[r] + log(l);
      }
    }
  }
""",
)

# scaled_dot_product_attention_grad (flash): one task per (batch, kv head)
_BACKWARD = dict(
    args=r"""
  enum { L = @LSE@ };  /* 1: the forward's log-sum-exp is bufs[2] ([B, Hq, S]): no first pass */
  const @T@ *restrict go = (const @T@ *)bufs[0];
  const @T@ *restrict o = (const @T@ *)bufs[1];
  const @T@ *restrict lse = L ? (const @T@ *)bufs[2] : NULL;
  const @T@ *restrict q = (const @T@ *)bufs[2 + L];
  const @T@ *restrict k = (const @T@ *)bufs[3 + L];
  const @T@ *restrict v = (const @T@ *)bufs[4 + L];
  @T@ *restrict dq = (@T@ *)bufs[5 + L];
  @T@ *restrict dk = (@T@ *)bufs[6 + L];
  @T@ *restrict dv = (@T@ *)bufs[7 + L];
  const int64_t *gs = sizes + 5, *os = sizes + 9, *ls = sizes + 13, *qs = sizes + 13 + 3 * L;
  const int64_t *ks = qs + 4, *vs = qs + 8, *dqs = qs + 12, *dks = qs + 16, *dvs = qs + 20;
""",
    scratch=(
        ("kT", "D * LT"),  # k^T [D][LT]
        ("vT", "DV * LT"),  # v^T [DV][LT]
        ("kr", "TP * DP"),  # k rows [TP][DP]
        ("dkr", "TP * DP"),  # dk rows
        ("dvr", "TP * DVP"),  # dv rows
        ("qb", "BR * DP"),  # the tile's queries times scale
        ("gb", "BR * DVP"),  # their output gradients
        ("ob", "BR * DVP"),  # their outputs
        ("dqb", "BR * DP"),  # their dq (before the scale)
        ("sb", "BR * BC"),  # scores, then P
        ("pb", "BR * BC"),  # g v^T, then dS
    ),
    tasks="NB * HK",
    parts="",
    task=r"""
  @T@ m[BR], di[BR], alpha[BR];
  attn_vec_@S@ lv[BR];
  const int64_t b = task / HK, hk = task % HK;
  const @T@ *kh = k + b * ks[0] + hk * ks[1], *vh = v + b * vs[0] + hk * vs[1];
  attn_cols_@S@(sc.kT, LT, kh, T, D, ks[2], ks[3]);
  attn_cols_@S@(sc.vT, LT, vh, T, DV, vs[2], vs[3]);
  attn_rows_@S@(sc.kr, DP, kh, 0, T, D, ks[2], ks[3], 1);
  memset(sc.dkr, 0, sizeof(@T@) * TP * DP);
  memset(sc.dvr, 0, sizeof(@T@) * TP * DVP);
  for (int64_t g = 0; g < G; g++) {
    const int64_t h = hk * G + g;
    const @T@ *oh = o + b * os[0] + h * os[1], *gh = go + b * gs[0] + h * gs[1];
    for (int64_t i0 = 0; i0 < S; i0 += BR) {
      const int64_t rows = S - i0 < BR ? S - i0 : BR;
      attn_rows_@S@(sc.qb, DP, q + b * qs[0] + h * qs[1], i0, rows, D, qs[2], qs[3], scale);
      attn_rows_@S@(sc.gb, DVP, gh, i0, rows, DV, gs[2], gs[3], 1);
      attn_rows_@S@(sc.ob, DVP, oh, i0, rows, DV, os[2], os[3], 1);
      for (int64_t r = 0; r < rows; r++) {  /* rowsum(g * out) = sum_j P_j (g v^T)_j */
        attn_vec_@S@ sum = {0};
        for (int64_t d = 0; d < DVP; d += W) sum += LD_@S@(sc.gb + r * DVP + d) * LD_@S@(sc.ob + r * DVP + d);
        di[r] = KERNEL_FN_lanes_@S@(sum);
      }
      for (int64_t r = 0; r < BR; r++) { m[r] = -INFINITY; lv[r] = (attn_vec_@S@){0}; }
      memset(sc.dqb, 0, sizeof(@T@) * BR * DP);
      int64_t kend = T;
      if (causal) kend = i0 + rows + OFF < 0 ? 0 : i0 + rows + OFF < T ? i0 + rows + OFF : T;
      if (L) {  /* the forward kept each row's log-sum-exp */
        for (int64_t r = 0; r < rows; r++) m[r] = lse[b * ls[0] + h * ls[1] + (i0 + r) * ls[2]];
      } else {
        for (int64_t j0 = 0; j0 < kend; j0 += BC) {  /* pass 1: each row's log-sum-exp */
          const int64_t cols = kend - j0 < BC ? kend - j0 : BC;
          ATTN_GROUPS(rows, i0, j0, cols)
            attn_mm_@S@(gm, D, CW_@S@(nv), sc.qb + g0 * DP, DP, sc.kT + j0, LT, sc.sb + g0 * BC, BC, 0);
          KERNEL_FN_online(sc.sb, rows, causal, i0, OFF, j0, cols, m, lv, alpha);
        }
        for (int64_t r = 0; r < rows; r++) m[r] += log(KERNEL_FN_lanes_@S@(lv[r]));
      }
      for (int64_t j0 = 0; j0 < kend; j0 += BC) {  /* pass 2: the gradients */
        const int64_t cols = kend - j0 < BC ? kend - j0 : BC;
        ATTN_GROUPS(rows, i0, j0, cols) {
          attn_mm_@S@(gm, D, CW_@S@(nv), sc.qb + g0 * DP, DP, sc.kT + j0, LT, sc.sb + g0 * BC, BC, 0);
          attn_mm_@S@(gm, DV, CW_@S@(nv), sc.gb + g0 * DVP, DVP, sc.vT + j0, LT, sc.pb + g0 * BC, BC, 0);
        }
        for (int64_t r = 0; r < rows; r++) {
          @T@ *sr = sc.sb + r * BC, *dr = sc.pb + r * BC;
          const int64_t n = attn_visible(causal, i0 + r, OFF, j0, cols);
          const attn_vec_@S@ lse = m[r] - (attn_vec_@S@){0}, d0 = di[r] - (attn_vec_@S@){0};
          for (int64_t c = 0; c < n; c += W) {  /* whole vectors: lanes past n are zeroed below */
            const attn_vec_@S@ p = KERNEL_FN_exp_@S@(LD_@S@(sr + c) - lse);
            ST_@S@(sr + c, p);
            ST_@S@(dr + c, p * (LD_@S@(dr + c) - d0));
          }
          for (int64_t c = n; c < BC; c++) { sr[c] = 0; dr[c] = 0; }
        }
        for (int64_t c0 = 0; c0 < cols; c0 += 6) {  /* keys 6 at a time, from the first row that sees them */
          const int64_t cm = cols - c0 < 6 ? cols - c0 : 6, f = causal ? j0 + c0 - i0 - OFF : 0;
          const int64_t r1 = f < 0 ? 0 : f < rows ? f : rows, k1 = j0 + c0, o1 = r1 * BC + c0;
          attn_mmt_@S@(cm, rows - r1, DVP, sc.sb + o1, BC, sc.gb + r1 * DVP, DVP, sc.dvr + k1 * DVP, DVP, 1);
          attn_mmt_@S@(cm, rows - r1, DP, sc.pb + o1, BC, sc.qb + r1 * DP, DP, sc.dkr + k1 * DP, DP, 1);
        }
        ATTN_GROUPS(rows, i0, j0, cols)
          attn_mm_@S@(gm, nv, DP, sc.pb + g0 * BC, BC, sc.kr + j0 * DP, DP, sc.dqb + g0 * DP, DP, 1);
      }
      @T@ *dqh = dq + b * dqs[0] + h * dqs[1];
      for (int64_t r = 0; r < rows; r++)
        for (int64_t d = 0; d < D; d++) dqh[(i0 + r) * dqs[2] + d * dqs[3]] = sc.dqb[r * DP + d] * scale;
    }
  }
  @T@ *dkh = dk + b * dks[0] + hk * dks[1], *dvh = dv + b * dvs[0] + hk * dvs[1];
  for (int64_t t = 0; t < T; t++) {
    for (int64_t d = 0; d < D; d++) dkh[t * dks[2] + d * dks[3]] = sc.dkr[t * DP + d];
    for (int64_t d = 0; d < DV; d++) dvh[t * dvs[2] + d * dvs[3]] = sc.dvr[t * DVP + d];
  }
""",
)


def _kernel(parts: dict) -> str:
    """One attention kernel: its task function and the kernel that hands the tasks to the pool."""
    names = [n for n, _ in parts["scratch"]]
    subs = {
        "@BUFFERS@": ", *".join(names),
        "@ARGS@": parts["args"],
        "@TASK@": parts["task"],
        "@TASKS@": parts["tasks"],
        "@PARTS@": parts["parts"].lstrip("\n"),
        "@NPARTS@": "parts" if parts["parts"] else "1",
        "@ALLOC@": "\n".join(
            f"    job.scratch[w].{n} = attn_scratch_@S@({size});" for n, size in parts["scratch"]
        ),
        "@FREE@": "\n".join(f"    free(job.scratch[w].{n});" for n in names),
    }
    src = _TASKS
    for key, val in subs.items():
        src = src.replace(key, val)
    return src


_CTYPES = {"float32": "float", "float64": "double"}


def _flash(op: str, body: str, n_in: int, lse: bool = False) -> None:
    """Attach the kernel ``body`` to ``op``, which has ``n_in`` tensor inputs when it has no mask
    (the last three are q, k, v); ``lse``: the forward writes, the backward reads, the log-sum-exp."""

    def applies(*metas, is_causal=False, scale=None) -> bool:
        if len(metas) != n_in:
            return False  # a mask: decomposed and fused instead
        q, k, v = metas[-3:]
        static = (q.shape[1], q.shape[3], k.shape[1], v.shape[3])
        return q.dtype.name in _CTYPES and all(isinstance(d, int) and d > 0 for d in static)

    def source(*metas, is_causal=False, scale=None) -> str:
        q, _, v = metas[-3:]
        dt = q.dtype
        d, dv = q.shape[3], v.shape[3]
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        ctype = _CTYPES[dt.name]
        w = VECTOR_BYTES // dt.itemsize
        subs = {
            "@PARAMS@": _PARAMS,
            "@T@": ctype,
            "@I@": "int32_t" if dt.itemsize == 4 else "int64_t",
            "@IOTA@": "{" + ", ".join(map(str, range(w))) + "}",
            "@S@": "f32" if dt.itemsize == 4 else "f64",
            "@VB@": str(VECTOR_BYTES),
            "@PS@": "ps" if dt.itemsize == 4 else "pd",
            "@F32@": "1" if dt.itemsize == 4 else "0",
            "@W@": str(w),
            "@D@": str(d),
            "@DV@": str(dv),
            "@DP@": str(-(-d // w) * w),
            "@DVP@": str(-(-dv // w) * w),
            "@BR@": str(BR),
            "@BC@": str(BC),
            "@CAUSAL@": "1" if is_causal else "0",
            "@LSE@": "1" if lse else "0",
            "@SCALE@": f"(({ctype}){float(np.asarray(scale, dt))!r})",
        }
        src = VEC + _EXP + _HELPERS + body
        for key, val in subs.items():
            src = src.replace(key, val)
        return src

    def sizes(*arrays, is_causal=False, scale=None) -> list[int]:
        """B, Hq, Hk, S, T, then the strides (in elements) of every input and output."""
        q, k, v = arrays[-3:]
        if n_in == 3:
            outs = [q.shape[:3] + v.shape[3:]] + ([q.shape[:3]] if lse else [])
        else:
            outs = [q.shape, k.shape, v.shape]
        out = [q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2]]
        for a in arrays:
            out += [s // a.itemsize for s in a.strides]
        for shape in outs:  # outputs are fresh, contiguous arrays
            out += [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        return out

    native_kernel(op, source, sizes=sizes, applies=applies, strided=True, eager=not (lse and n_in > 3))


_flash("scaled_dot_product_attention", _kernel(_FORWARD), 3)
_flash("scaled_dot_product_attention_grad", _kernel(_BACKWARD), 5)
_flash("scaled_dot_product_attention_lse", _kernel(_FORWARD), 3, lse=True)
_flash("scaled_dot_product_attention_lse_grad", _kernel(_BACKWARD), 6, lse=True)
