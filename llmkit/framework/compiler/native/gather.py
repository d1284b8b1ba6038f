"""``index_select`` and ``index_add`` along axis 0: an embedding's rows, and its gradient;
``gather`` and ``topk`` along the last axis: the score program's picks from every row's logits.

Whole rows are copied (or added in index order, as numpy's ``add.at``: the reference's bits).
"""

from __future__ import annotations

import numpy as np

from .attach import native_kernel

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


def _rows(x, index, axis=0):
    """Whole rows of x picked along axis 0 by an int64 index (the kernels' case)."""
    return x.ndim >= 1 and axis in (0, -x.ndim) and index.dtype == np.int64


native_kernel(
    "index_select",
    INDEX_SELECT,
    sizes=lambda x, index, axis=0: [x.shape[0], index.shape[0], x.nbytes // max(x.shape[0], 1)],
    applies=_rows,
)
native_kernel(
    "index_add",
    INDEX_ADD,
    sizes=lambda x, index, src, axis=0: [
        x.shape[0],
        index.shape[0],
        x.size // max(x.shape[0], 1),
        x.itemsize,
    ],
    applies=lambda x, index, src, axis=0: _rows(x, index, axis) and x.dtype.name in ("float32", "float64"),
)


GATHER_LAST = r"""
#include <string.h>
/* gather along the last axis: out[r, j] = x[r, index[r, j]] (negative indices count from the end,
   as numpy take_along_axis does), elements of any size.
   bufs: x [R, V], index [R, K] (int64), out [R, K], status. sizes: R, V, K, itemsize. */
void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  (void)nthreads;
  const int64_t R = sizes[0], V = sizes[1], K = sizes[2], item = sizes[3];
  const char *x = (const char *)bufs[0];
  const int64_t *index = (const int64_t *)bufs[1];
  char *out = (char *)bufs[2];
  int64_t *status = (int64_t *)bufs[3];
  for (int64_t i = 0; i < R * K; i++)
    if (index[i] < -V || index[i] >= V) { status[0] = 1; status[1] = i; return; }
  for (int64_t r = 0; r < R; r++)
    for (int64_t j = 0; j < K; j++) {
      const int64_t v = index[r * K + j] < 0 ? index[r * K + j] + V : index[r * K + j];
      memcpy(out + (r * K + j) * item, x + (r * V + v) * item, item);
    }
}
"""

TOPK_KEEP = r"""
/* The order of a stable sort of -x: larger first, the lower index first among equal values, NaNs
   last in index order. A total order, so a top K kept by it does not depend on the order in which
   the candidates come (linear.py's scoring head merges blocks from several threads). */
static inline int KERNEL_FN_before(double a, int64_t i, double b, int64_t j) { /* (a, i) before (b, j) */
  if (b != b) return a == a || i < j;
  return a == a && (a > b || (a == b && i < j));
}
/* (a, i) into a top K kept in that order (values v, ids id, n kept so far) */
#define KERNEL_FN_KEEP(T)                                                                          \
  static inline void KERNEL_FN_keep_##T(T *v, int64_t *id, int64_t *n, int64_t K, T a, int64_t i) { \
    if (*n == K && !KERNEL_FN_before(a, i, v[K - 1], id[K - 1])) return;                         \
    int64_t p = *n < K ? (*n)++ : K - 1;                                                         \
    for (; p > 0 && KERNEL_FN_before(a, i, v[p - 1], id[p - 1]); p--) v[p] = v[p - 1], id[p] = id[p - 1]; \
    v[p] = a, id[p] = i;                                                                         \
  }
"""

TOPK_LAST = (
    TOPK_KEEP
    + r"""
/* topk (largest) along the last axis, float32 (itemsize 4) or float64 (8): each row's K largest
   values in TOPK_KEEP's order. One pass per row keeps the K best in order; once K (none NaN) are
   kept, a block of 16 values none of which beats the K-th (nor is NaN) is passed over by one
   vectorized test. Rows are independent: threads take whole rows (the same result on any count).
   bufs: x [R, V], values [R, K], indices [R, K] (int64), status. sizes: R, V, K, itemsize. */
#define KERNEL_FN_BLOCK 16
#define KERNEL_FN_ROW(T)                                                                         \
  KERNEL_FN_KEEP(T)                                                                              \
  static void KERNEL_FN_row_##T(const T *x, int64_t V, int64_t K, T *val, int64_t *idx) {       \
    int64_t n = 0, v = 0;                                                                        \
    while (v < V) {                                                                              \
      if (n == K && v + KERNEL_FN_BLOCK <= V && val[K - 1] == val[K - 1]) {                      \
        const T kth = val[K - 1];                                                                \
        int any = 0;                                                                             \
        _Pragma("omp simd reduction(|:any)")                                                     \
        for (int64_t u = 0; u < KERNEL_FN_BLOCK; u++) any |= (x[v + u] > kth) | (x[v + u] != x[v + u]); \
        if (!any) { v += KERNEL_FN_BLOCK; continue; }                                            \
      }                                                                                          \
      const int64_t end = v + KERNEL_FN_BLOCK < V ? v + KERNEL_FN_BLOCK : V;                     \
      for (; v < end; v++) KERNEL_FN_keep_##T(val, idx, &n, K, x[v], v);                         \
    }                                                                                            \
  }
KERNEL_FN_ROW(float)
KERNEL_FN_ROW(double)
typedef struct { void *x, *val; int64_t *idx; int64_t V, K, item; } KERNEL_FN_job;
static void KERNEL_FN_one(void *arg, int64_t r, int64_t worker) { /* one claim: row r */
  (void)worker;
  const KERNEL_FN_job *j = (const KERNEL_FN_job *)arg;
  const int64_t V = j->V, K = j->K;
  if (j->item == 4)
    KERNEL_FN_row_float((const float *)j->x + r * V, V, K, (float *)j->val + r * K, j->idx + r * K);
  else
    KERNEL_FN_row_double((const double *)j->x + r * V, V, K, (double *)j->val + r * K, j->idx + r * K);
}
void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  const int64_t R = sizes[0], V = sizes[1], K = sizes[2], item = sizes[3];
  KERNEL_FN_job job = {bufs[0], bufs[1], (int64_t *)bufs[2], V, K, item};
  int64_t nt = R * V < 65536 ? 1 : nthreads < R ? nthreads : R; /* small inputs: no hand-off */
  if (nt < 1) nt = 1;
  llmkit_par_run(R, nt, KERNEL_FN_one, &job);
}
"""
)
TOPK_MAX_K = 64  # the insertion keeps K values in order: small K (scoring's 5), not a sort


def _last_axis(x, axis) -> bool:
    return x.ndim >= 1 and axis in (-1, x.ndim - 1)


def _flat_rows(x) -> tuple[int, int]:
    v = x.shape[-1] if x.ndim else 1
    return x.size // max(v, 1), v


native_kernel(
    "gather",
    GATHER_LAST,
    sizes=lambda x, index, axis=0: [*_flat_rows(x), index.shape[-1], x.itemsize],
    applies=lambda x, index, axis=0: _last_axis(x, axis) and index.dtype == np.int64,
)
native_kernel(
    "topk",
    TOPK_LAST,
    sizes=lambda x, k, axis=-1, largest=True: [*_flat_rows(x), k, x.itemsize],
    applies=lambda x, k, axis=-1, largest=True: (
        _last_axis(x, axis)
        and largest
        and k <= TOPK_MAX_K
        and np.dtype(x.dtype).name in ("float32", "float64")
    ),
)
