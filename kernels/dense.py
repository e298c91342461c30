"""The dense layer as a shared-memory tiled matrix product.

Reference: ``cnn.stages.s1_loops.dense_forward`` / ``dense_backward`` (y = x Wᵀ + b with W of
shape (out, in)). All three products of the layer are one kernel, ``matmul_tiled_kernel``,
computing C = op(A) · op(B) where op transposes its argument when asked:

    forward    y  = x  · Wᵀ     (N, out)  = (N, in)  · (in, out)
    backward   dx = dy · W      (N, in)   = (N, out) · (out, in)
               dW = dyᵀ · x     (out, in) = (out, N) · (N, in)

The bias and the ReLU are added afterwards by ``bias_relu``; db by ``bias_relu.bias_grad``.

Thread-to-data mapping: a block of TILE × TILE threads computes one TILE × TILE tile of C;
thread (ty, tx) of block (bx, by) owns C[by·TILE + ty, bx·TILE + tx]. The inner dimension is
walked a tile at a time: each thread loads ONE element of the A tile and ONE of the B tile into
shared memory, the block synchronises, and every thread then reads TILE values of each from
shared memory — each global element is read once per block instead of once per thread
(TILE = 16 saves a factor 16 in global reads). Elements past the edge of A or B load as 0.
"""

from __future__ import annotations

import numpy as np

from kernels.device import cuda
from kernels.launch import grid_tiles, launch

TILE = 16


@cuda.jit(device=True)
def element(m, row, col, transposed, rows, cols):
    """op(m)[row, col], where op(m) = mᵀ when ``transposed``; 0 outside the rows × cols matrix op(m)."""
    if row >= rows or col >= cols:
        return np.float32(0.0)
    return m[col, row] if transposed else m[row, col]


@cuda.jit
def matmul_tiled_kernel(a, b, c, transpose_a, transpose_b):
    a_tile = cuda.shared.array((TILE, TILE), np.float32)
    b_tile = cuda.shared.array((TILE, TILE), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    rows, cols = c.shape[0], c.shape[1]
    inner = a.shape[0] if transpose_a else a.shape[1]
    total = np.float32(0.0)
    for start in range(0, inner, TILE):
        a_tile[ty, tx] = element(a, row, start + tx, transpose_a, rows, inner)
        b_tile[ty, tx] = element(b, start + ty, col, transpose_b, inner, cols)
        cuda.syncthreads()                      # both tiles loaded
        for k in range(TILE):
            total += a_tile[ty, k] * b_tile[k, tx]
        cuda.syncthreads()                      # everyone is done with the tiles before they are overwritten
    if row < rows and col < cols:
        c[row, col] = total


def matmul(a, b, c, transpose_a=False, transpose_b=False, launch=launch):
    """c ← op(a) · op(b) on 2-D device arrays."""
    launch(matmul_tiled_kernel, *grid_tiles(c.shape[0], c.shape[1], TILE), a, b, c, transpose_a, transpose_b)


def dense_forward(x, w, y, launch=launch):
    """y ← x · wᵀ (the bias comes after, from ``bias_relu``)."""
    matmul(x, w, y, transpose_b=True, launch=launch)


def dense_backward_data(dy, w, dx, launch=launch):
    """dx ← dy · w."""
    matmul(dy, w, dx, launch=launch)


def dense_backward_weights(dy, x, dw, launch=launch):
    """dw ← dyᵀ · x."""
    matmul(dy, x, dw, transpose_a=True, launch=launch)
