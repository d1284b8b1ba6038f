"""``index_select`` and ``index_add`` along axis 0: an embedding's rows, and its gradient.

Whole rows are copied (or added in index order, as numpy's ``add.at``: the reference's bits).
"""

from __future__ import annotations

import numpy as np

from . import native_kernel

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
