"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): quantize a weight column by column, each time spreading the column's error over the
columns not yet quantized so that the layer's output on calibration inputs moves least.

For a linear ``y = x Wᵀ`` with calibration inputs ``X`` [N, in], the error ``‖X Wᵀ − X Qᵀ‖²`` has
Hessian ``H = 2 XᵀX / N`` (the same for every output row). Quantizing column ``i`` to ``q`` with the
inverse Hessian ``H⁻¹`` of the columns still free, the best update of those columns is
``W[:, F] −= (w − q) / [H⁻¹]ᵢᵢ · [H⁻¹]ᵢ,F``. Taking the upper Cholesky factor ``U`` of ``H⁻¹``
(``H⁻¹ = UᵀU``), row ``i`` of ``U`` is exactly ``[H⁻¹]ᵢ,F / sqrt([H⁻¹]ᵢᵢ)`` for the free set after
removing columns ``< i`` one by one, so one factorization serves every step (the paper's Cholesky
reformulation). Updates are applied lazily: inside a block of columns at once, to the columns after
it in one matrix product per block.

Groups: without act-order, a group's scale and zero come from its (already updated) weights when
its first column is reached; blocks are whole groups so that they are. With ``act_order`` columns
go in order of decreasing ``diag(H)``, and, to keep the format's contiguous groups, every group's
parameters are fixed up front from the original weights ("static groups"). Per-channel (one group)
parameters are always fixed up front.

Rows are independent (each sees the same ``H``), so the work is done in fixed blocks of ``ROWS``
rows (``row_blocks``): a block's bits never depend on which other rows were quantized with it, and
ranks that share a weight's blocks (``llmkit.quant.multirank``) give the one-process result exactly.
Likewise ``XᵀX`` is summed in fixed blocks of ``ROWS`` of its rows.
"""

from __future__ import annotations

import numpy as np

from .format import QuantConfig, QuantError, QuantizedWeight, group_params, join, quantize_codes, store

BLOCK = 128  # columns per lazy-update block
ROWS = 64  # weight rows (and rows of XᵀX) per unit of work


def row_blocks(n: int) -> list[slice]:
    """``[0, n)`` in consecutive blocks of ``ROWS`` (the last may be shorter)."""
    return [slice(a, min(a + ROWS, n)) for a in range(0, n, ROWS)]


class Hessian:
    """Running ``2 XᵀX / N`` of a linear's inputs, fed batch by batch: each batch's ``XᵀX`` (float32
    products of ``ROWS`` of its rows at a time: BLAS speed, about 1e-6 relative error, far below the
    damping) summed in float64. ``rows``: the row blocks to keep (default all; a rank keeps its own)."""

    def __init__(self, in_features: int, rows: list[slice] | None = None) -> None:
        self.rows = row_blocks(in_features) if rows is None else rows
        self.sum = np.zeros((sum(b.stop - b.start for b in self.rows), in_features))
        self.count = 0

    @staticmethod
    def gram(x: np.ndarray, rows: list[slice]) -> tuple[np.ndarray, int]:
        """``(XᵀX[rows], N)`` of inputs ``x`` [..., in] (computed once for linears that share an input)."""
        x = np.asarray(x, np.float32).reshape(-1, x.shape[-1])  # (N, in)
        return np.concatenate([np.zeros((0, x.shape[1]), np.float32)] + [x[:, b].T @ x for b in rows]), len(x)

    def add(self, x: np.ndarray) -> None:
        self.add_gram(*self.gram(x, self.rows))

    def add_gram(self, xtx: np.ndarray, n: int) -> None:
        self.sum += xtx
        self.count += n

    def value(self) -> np.ndarray:
        """``2 XᵀX / N`` [rows kept, in]: the whole Hessian when every row block is kept."""
        return 2.0 * self.sum / max(self.count, 1)


def gptq(
    w: np.ndarray,
    h: np.ndarray,
    cfg: QuantConfig,
    act_order: bool = False,
    damp: float = 0.01,
    rows: list[slice] | None = None,
) -> QuantizedWeight:
    """Quantize ``w`` [out, in] against the Hessian ``h`` [in, in] of its inputs (see the module docstring).

    ``damp`` adds ``damp * mean(diag(h))`` to the diagonal, so ``h`` is safely positive definite;
    inputs that were always zero (a zero diagonal) get weight zero, as they never matter. ``rows``:
    the row blocks to quantize (default all, ``row_blocks(out)``); the result holds them in order.
    """
    h = np.array(h, np.float64)
    n_in = h.shape[0]
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(n_in)
    h = h[np.ix_(perm, perm)]
    u = _inverse_factor(h, damp)
    rows = row_blocks(len(w)) if rows is None else rows
    return join([_gptq_rows(w[b], u, perm, dead, cfg, act_order) for b in rows], n_in, cfg)


def _inverse_factor(h: np.ndarray, damp: float) -> np.ndarray:
    """Upper ``U`` with ``(H + λI)⁻¹ = UᵀU``, ``λ = damp · mean(diag H)``. ``H`` is made exactly
    symmetric first: its float32 Gram blocks give ``Hᵢⱼ`` and ``Hⱼᵢ`` different roundings (~1e-7
    relative), which ``inv`` amplifies by ``‖H⁻¹‖²`` until the lower triangle ``cholesky`` reads of
    ``H⁻¹`` is no longer positive definite. The inverse comes from ``H``'s own Cholesky factor (so it is
    symmetric by construction); where that fails, the damping grows tenfold, up to 4 times."""
    if not np.isfinite(h).all():
        raise QuantError(f"GPTQ: the Hessian has {np.sum(~np.isfinite(h))} non-finite entries (activations)")
    h = (h + h.T) / 2
    mean = np.mean(np.diag(h))
    for lam in damp * mean * 10.0 ** np.arange(5):
        try:
            li = np.linalg.inv(np.linalg.cholesky(h + lam * np.eye(len(h))))  # L⁻¹, H + λI = LLᵀ
            hinv = li.T @ li
            return np.linalg.cholesky((hinv + hinv.T) / 2).T
        except np.linalg.LinAlgError:
            continue
    raise QuantError(
        f"GPTQ: the Hessian [{len(h)}x{len(h)}] of the calibration inputs is not positive definite even "
        f"with damping {10000 * damp:g} x mean(diag) (mean(diag) = {mean:.3g})"
    )


def _gptq_rows(
    w: np.ndarray, u: np.ndarray, perm: np.ndarray, dead: np.ndarray, cfg: QuantConfig, act_order: bool
) -> QuantizedWeight:
    """GPTQ of the rows ``w`` [rows, in], given ``U`` (of the permuted Hessian) and the column order."""
    w = np.array(w, np.float64)
    w[:, dead] = 0.0
    n_out, n_in = w.shape
    g = cfg.group_width(n_in)
    scales = np.empty((n_out, cfg.groups(n_in)), np.float32)
    zeros = np.empty(scales.shape, np.int64)
    static = act_order or cfg.group_size == -1
    if static:
        for j in range(scales.shape[1]):
            scales[:, j], zeros[:, j] = group_params(
                w[:, j * g : (j + 1) * g], cfg.bits, cfg.sym, cfg.scale_dtype
            )
    w = w[:, perm]
    q = np.empty((n_out, n_in), np.int64)
    block = BLOCK if static else g * max(1, BLOCK // g)  # dynamic groups never straddle two blocks
    for i1 in range(0, n_in, block):
        i2 = min(i1 + block, n_in)
        w1, u1 = w[:, i1:i2].copy(), u[i1:i2, i1:i2]
        err = np.empty_like(w1)
        for i in range(i2 - i1):
            col = perm[i1 + i]
            j = col // g
            if not static and col % g == 0:
                scales[:, j], zeros[:, j] = group_params(w1[:, i : i + g], cfg.bits, cfg.sym, cfg.scale_dtype)
            s, z = scales[:, j].astype(np.float64), zeros[:, j]
            q[:, col] = quantize_codes(w1[:, i], s, z, cfg.bits)
            err[:, i] = (w1[:, i] - (q[:, col] - z) * s) / u1[i, i]
            w1[:, i:] -= np.outer(err[:, i], u1[i, i:])
        w[:, i2:] -= err @ u[i1:i2, i2:]
    return store(q, scales, zeros, cfg)
