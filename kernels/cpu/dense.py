"""The dense layer on the CPU as compiled loops: threads over (sample, output) pairs forward, over rows backward.

(numpy's BLAS is faster per FLOP, but brings a second thread pool that fights Numba's for the
same cores; stage 3's docstring has the measurements.)
"""

from __future__ import annotations

from numba import njit, prange

from kernels.cpu.layout import axpy, dot


@njit(cache=True)
def _dense_weight_grad_row(dy, x, o, dW_o):
    """dW[o] = Σ_n dy[n, o] · x[n]; returns db[o] = Σ_n dy[n, o]."""
    dW_o[:] = 0
    total = dy.dtype.type(0)
    for n in range(x.shape[0]):
        axpy(dW_o, dy[n, o], x[n])
        total += dy[n, o]
    return total


@njit(cache=True)
def _dense_input_grad_row(dy, W, n, dx_n):
    """dx[n] = Σ_o dy[n, o] · W[o]."""
    dx_n[:] = 0
    for o in range(W.shape[0]):
        axpy(dx_n, dy[n, o], W[o])


@njit(parallel=True, cache=True)
def dense_forward_kernel(x, W, b, y):
    """y[n, o] = Σ_i x[n, i] · W[o, i] + b[o]; threads take (sample, output) pairs."""
    N, O = y.shape
    for item in prange(N * O):
        n, o = item // O, item % O
        y[n, o] = dot(x[n], W[o]) + b[o]


@njit(parallel=True, cache=True)
def dense_backward_kernel(dy, x, W, dx, dW, db, need_dx):
    """dW = dyᵀ·x and db = Σ_n dy (threads take rows o of dW), then dx = dy·W (threads take samples n).

    Every row has one owner, so there is nothing to reduce.
    """
    N, O = dy.shape
    for o in prange(O):
        db[o] = _dense_weight_grad_row(dy, x, o, dW[o])
    if need_dx:
        for n in prange(N):
            _dense_input_grad_row(dy, W, n, dx[n])
