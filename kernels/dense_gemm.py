"""The dense layer through the implicit GEMM of ``kernels/implicit_gemm.py`` (stage 7's ``tiled-conv``).

Reference: ``cnn.stages.s1_loops.dense_forward`` / ``dense_backward``; x (N, in), W (out, in), b (out,).
The three products of a dense layer are the same kernel as the convolutions', with plain matrix
loaders (the operands exist here; only their transposes are read in place):

    forward   y = x · Wᵀ + b, ReLU when one follows     N × out,  A = x,  B[k, o] = W[o, k]
    dW, db    [dW | db] = dzᵀ · [x | 1]                 out × (in + 1): the column of ones sums dz
                                                        over the batch, which is db (as for the conv)
    dX        dx = dz · W, zeroed where x ≤ 0 when the  N × in
              ReLU below is folded in (``mask``)

Compared with ``kernels/dense_fused.py`` (one element a thread, 16 × 16 tiles), each thread keeps
a TM × TN block of results in registers, and db needs no epilogue of its own.
"""

from __future__ import annotations

from numba import float32, uint32

from kernels.device import cuda
from kernels.implicit_gemm import (Tiles, column_index, gemm, matrix_b, matrix_b_transposed, matrix_cols, matrix_rows,
                                   row_index)
from kernels.launch import launch

TN = 4


@cuda.jit(device=True)
def matrix_b_with_ones(src, col, k):
    """B[k, col] = m[k, col], and 1 in the extra column col = m.shape[1]."""
    m = src[0]
    value = m[uint32(k), uint32(min(col, m.shape[1] - 1))]    # always inside m: no branch around the load
    if col < m.shape[1]:
        return value
    return float32(1.0) if col == m.shape[1] else float32(0.0)


@cuda.jit(device=True)
def bias_relu_store(out, n, rows_step, col, threads_n, acc):
    """y[n, o] = acc + b[o], then max(·, 0) when ``relu`` (out = (y, b, relu))."""
    y, b, relu = out
    for i in range(acc.shape[0]):
        row = n + i * rows_step
        if row < y.shape[0]:
            for j in range(acc.shape[1]):
                o = col + j * threads_n
                if o < y.shape[1]:
                    value = acc[i, j] + b[o]
                    y[row, o] = max(value, float32(0.0)) if relu else value


@cuda.jit(device=True)
def weight_grad_store(out, o, rows_step, col, threads_n, acc):
    """dw[o, i] for i < in, and db[o] from the column of ones (out = (dw, db))."""
    dw, db = out
    for i in range(acc.shape[0]):
        row = o + i * rows_step
        if row < dw.shape[0]:
            for j in range(acc.shape[1]):
                column = col + j * threads_n
                if column < dw.shape[1]:
                    dw[row, column] = acc[i, j]
                elif column == dw.shape[1]:
                    db[row] = acc[i, j]


@cuda.jit(device=True)
def masked_store(out, n, rows_step, col, threads_n, acc):
    """dx[n, i] = acc, or 0 where mask[n, i] ≤ 0 when ``use_mask`` (out = (dx, mask, use_mask))."""
    dx, mask, use_mask = out
    for i in range(acc.shape[0]):
        row = n + i * rows_step
        if row < dx.shape[0]:
            for j in range(acc.shape[1]):
                column = col + j * threads_n
                if column < dx.shape[1]:
                    dx[row, column] = acc[i, j] if not use_mask or mask[row, column] > 0 else float32(0.0)


FORWARD = (row_index, matrix_rows, column_index, matrix_b_transposed, bias_relu_store)
PARAMS = (row_index, matrix_cols, column_index, matrix_b_with_ones, weight_grad_store)
DATA = (row_index, matrix_rows, column_index, matrix_b, masked_store)


def dense_forward(x, w, b, y, relu, launch=launch):
    """y ← x · wᵀ + b, then ReLU when ``relu``: one launch."""
    rows, cols = y.shape
    gemm(FORWARD, Tiles.for_shape(rows, cols, x.shape[1], TN), (x,), (w,), (y, b, relu), rows, cols, x.shape[1], launch=launch)


def dense_backward_params(dz, x, dw, db, launch=launch):
    """dw ← dzᵀ · x and db ← Σ_n dz: one launch."""
    rows, cols = dw.shape[0], dw.shape[1] + 1
    gemm(PARAMS, Tiles.for_shape(rows, cols, dz.shape[0], TN), (dz,), (x,), (dw, db), rows, cols, dz.shape[0], launch=launch)


def dense_backward_data(dz, w, dx, mask=None, launch=launch):
    """dx ← dz · w, zeroed where ``mask`` ≤ 0 when given (the ReLU of the layer below): one launch."""
    rows, cols = dx.shape
    out = (dx, dx if mask is None else mask, mask is not None)
    gemm(DATA, Tiles.for_shape(rows, cols, dz.shape[1], TN), (dz,), (w,), out, rows, cols, dz.shape[1], launch=launch)
