"""Launch configurations (how many blocks of how many threads) and the index arithmetic kernels share.

Every kernel in this package is launched through ``launch(kernel, grid, block, *args)`` or a
``LaunchCounter``, which does the same and counts: the benchmark reports launches per training
step, the overhead that kernel fusion removes.

Grid shapes:

- ``grid_1d(count)``: one thread per element, ``THREADS_PER_BLOCK`` threads a block (fewer, rounded
  up to a warp of 32, when ``count`` is small), enough blocks to cover ``count``.
- ``grid_tiles(rows, cols, tile)``: one ``tile × tile`` block per tile of a rows × cols output.
- ``reduction_threads(count)``: a power of two ≤ ``REDUCE_THREADS`` for one-block tree reductions.
"""

from __future__ import annotations

from kernels.device import cuda

THREADS_PER_BLOCK = 128
WARP = 32
REDUCE_THREADS = 128          # the shared-memory size of every block reduction (a power of two)


def blocks_for(count: int, per_block: int) -> int:
    """ceil(count / per_block), at least one block."""
    return max(1, -(-count // per_block))


def grid_1d(count: int, threads: int = THREADS_PER_BLOCK) -> tuple[int, int]:
    """(blocks, threads) giving at least one thread per element of a ``count``-element array."""
    threads = min(threads, blocks_for(count, WARP) * WARP)
    return blocks_for(count, threads), threads


def grid_tiles(rows: int, cols: int, tile: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((blocks_x, blocks_y), (tile, tile)): block (bx, by) covers columns bx·tile… and rows by·tile…"""
    return (blocks_for(cols, tile), blocks_for(rows, tile)), (tile, tile)


def reduction_threads(count: int) -> int:
    """Threads for a one-block tree reduction over ``count`` values: the next power of two, at most REDUCE_THREADS."""
    threads = 1
    while threads < min(count, REDUCE_THREADS):
        threads *= 2
    return threads


def launch(kernel, grid, block, *args) -> None:
    """kernel[grid, block](*args): queue one kernel on the default stream (returns before it finishes)."""
    kernel[grid, block](*args)


class LaunchCounter:
    """``launch`` that also counts: ``counter.count`` is the number of kernels queued so far."""

    def __init__(self):
        self.count = 0

    def __call__(self, kernel, grid, block, *args) -> None:
        self.count += 1
        kernel[grid, block](*args)


@cuda.jit(device=True)
def unravel4(index, shape):
    """(a, b, c, d) of the element at flat C-order ``index`` in an array of 4-D ``shape``."""
    d = index % shape[3]
    index //= shape[3]
    c = index % shape[2]
    index //= shape[2]
    b = index % shape[1]
    return index // shape[1], b, c, d


@cuda.jit(device=True)
def covering_windows(pos, kernel, stride, n_out):
    """(first, last): the output indices i whose window [i·s, i·s + K) contains input position ``pos``.

    The device twin of ``cnn.stages.s1_loops._covering_windows``; the range is empty when first > last.
    i·s ≤ pos < i·s + K   ⇔   (pos − K)/s < i ≤ pos/s
    """
    first = 0 if pos < kernel else (pos - kernel) // stride + 1
    last = min(n_out - 1, pos // stride)
    return first, last
