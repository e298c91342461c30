"""The dense layer in two launches per direction fewer: stage 4's tiled product with an epilogue (stage 7).

Reference: ``cnn.stages.s1_loops.dense_forward`` / ``dense_backward`` and ``relu_forward`` /
``relu_backward``. Stage 4 runs a Dense → ReLU block as 2 kernels forward (product, bias_relu)
and 4 backward (relu_backward, bias_grad, dW product, dX product). Here:

    forward    y  = ReLU(x · Wᵀ + b)          ONE launch: bias and ReLU applied as each y element is written
    backward   dW = dzᵀ · x,  db = Σ_n dz      ONE launch: the blocks of tile column 0 also add up the
                                             rows of the dzᵀ tiles they load — that sum is db
               dX = (dz · W) ⊙ [x > 0]        ONE launch: the ReLU mask of the layer BELOW is applied
                                             as dX is written, so that layer receives its dz ready

where dz = dL/d(pre-activation) of this layer. With the mask applied on the way down, no
relu_backward launch is left, and the bias gradient needs no launch of its own.

Thread-to-data mapping, as ``kernels.dense.matmul_tiled_kernel`` (whose ``element`` loader this
reuses): a block of T × T threads owns one T × T tile of C = op(A) · op(B); thread (ty, tx) owns
C[by·T + ty, bx·T + tx]; the inner dimension is walked T at a time through two shared tiles.
Then the epilogue, on the thread's one element, with ``extra`` the epilogue's one array:

    EPILOGUE_NONE      C[r, c] = acc                               (extra unused)
    EPILOGUE_BIAS      C[r, c] = acc + extra[c]                    (extra = the bias)
    EPILOGUE_BIAS_RELU C[r, c] = max(acc + extra[c], 0)
    EPILOGUE_MASK      C[r, c] = acc if extra[r, c] > 0 else 0     (extra = the layer's input x)
    EPILOGUE_ROW_SUMS  C[r, c] = acc, and thread (ty, 0) of each block with bx = 0 adds up row ty
                       of every A tile it loads: extra[r] = Σ_k op(A)[r, k]   (extra = db)

The tile edge T and the epilogue are compile-time constants: ``tiled_kernel(T, epilogue)``
compiles one kernel per pair (shared arrays need a constant shape; a constant epilogue leaves no
branch in the kernel, and each launch passes exactly the arrays it uses — numba-cuda's launch
cost grows with every array argument). ``kernels.launch_config`` picks T per layer shape.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from kernels.dense import element
from kernels.device import cuda
from kernels.launch import grid_tiles, launch

EPILOGUE_NONE, EPILOGUE_BIAS, EPILOGUE_BIAS_RELU, EPILOGUE_MASK, EPILOGUE_ROW_SUMS = 0, 1, 2, 3, 4


@lru_cache(maxsize=None)
def tiled_kernel(tile: int, epilogue: int):
    """The tiled product for T = ``tile`` with ``epilogue`` (compiled once per pair)."""
    adds_bias = epilogue in (EPILOGUE_BIAS, EPILOGUE_BIAS_RELU)      # constants of the compiled kernel:
    applies_relu = epilogue == EPILOGUE_BIAS_RELU                       # the branches they guard are removed
    masks = epilogue == EPILOGUE_MASK                                   # when false, so ``extra`` is only
    sums_rows = epilogue == EPILOGUE_ROW_SUMS                           # indexed as the epilogue's array is

    @cuda.jit
    def tiled_epilogue_kernel(a, b, c, transpose_a, transpose_b, extra):
        a_tile = cuda.shared.array((tile, tile), np.float32)
        b_tile = cuda.shared.array((tile, tile), np.float32)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        row = cuda.blockIdx.y * tile + ty
        col = cuda.blockIdx.x * tile + tx
        rows, cols = c.shape[0], c.shape[1]
        inner = a.shape[0] if transpose_a else a.shape[1]
        sums_row = sums_rows and cuda.blockIdx.x == 0 and tx == 0
        total = np.float32(0.0)
        row_total = np.float32(0.0)
        for start in range(0, inner, tile):
            a_tile[ty, tx] = element(a, row, start + tx, transpose_a, rows, inner)
            b_tile[ty, tx] = element(b, start + ty, col, transpose_b, inner, cols)
            cuda.syncthreads()                      # both tiles loaded
            for k in range(tile):
                total += a_tile[ty, k] * b_tile[k, tx]
            if sums_row:
                for k in range(tile):
                    row_total += a_tile[ty, k]
            cuda.syncthreads()                      # everyone is done with the tiles before they are overwritten
        if row < rows and col < cols:
            if adds_bias:
                total += extra[col]
                if applies_relu:
                    total = max(total, np.float32(0.0))
            if masks:
                if extra[row, col] <= 0:
                    total = np.float32(0.0)
            c[row, col] = total
        if sums_rows:
            if sums_row and row < rows:
                extra[row] = row_total

    return tiled_epilogue_kernel


def product(a, b, c, tile, epilogue=EPILOGUE_NONE, extra=None, transpose_a=False, transpose_b=False, launch=launch):
    """c ← epilogue(op(a) · op(b)), ``extra`` as the epilogue needs it (see the module docstring)."""
    launch(tiled_kernel(tile, epilogue), *grid_tiles(c.shape[0], c.shape[1], tile), a, b, c, transpose_a, transpose_b,
           c if extra is None else extra)


def dense_forward(x, w, b, y, relu, tile, launch=launch):
    """y ← x · wᵀ + b, then ReLU when ``relu``: one launch."""
    product(x, w, y, tile, EPILOGUE_BIAS_RELU if relu else EPILOGUE_BIAS, b, transpose_b=True, launch=launch)


def dense_backward_params(dz, x, dw, db, tile, launch=launch):
    """dw ← dzᵀ · x and db ← Σ_n dz: one launch."""
    product(dz, x, dw, tile, EPILOGUE_ROW_SUMS, db, transpose_a=True, launch=launch)


def dense_backward_data(dz, w, dx, tile, mask=None, launch=launch):
    """dx ← dz · w, zeroed where ``mask`` ≤ 0 (the ReLU of the layer below, when given): one launch."""
    product(dz, w, dx, tile, EPILOGUE_NONE if mask is None else EPILOGUE_MASK, mask, launch=launch)
