"""One tiled, register-blocked matrix product whose operands need not exist: the implicit GEMM.

    C[r, c] = Σ_k A[r, k] · B[k, c]          r < M,  c < N,  k < K

Stage 7's ``tiled-conv`` fix runs every convolution (forward, dW, dX) and every dense layer as
this ONE product. What differs between them is where A and B come from and what happens to C:

- *loaders*, device functions that produce A[r, k] and B[k, c] on demand from the arrays that
  do exist. A convolution's B is the matrix of input patches (im2col), which is never built:
  its loader reads x[n, c, i·s + p − pad, j·s + q − pad] when the tile needs it — hence *implicit*.
- an *epilogue*, the device function that receives the thread's finished results and writes
  them out: with the bias added and the ReLU applied, or max-pooled, or as a split-K partial.

Thread-to-data mapping (Simon Boehm's SGEMM worklog, kernels 4-5: tiles in shared memory, then
a block of results in each thread's registers). With tiles (BM, BN, BK, TM, TN):

- block (bx, by, bz) computes the BM × BN tile of C at rows by·BM…, columns bx·BN…, summing
  over k in [bz·k_chunk, (bz+1)·k_chunk) — split-K, when one product is split over several
  blocks along k (their partial tiles are summed by a second kernel, in a fixed order).
- its T = (BM/TM)·(BN/TN) threads each hold a TM × TN block of results in registers:
      thread t = ty·(BN/TN) + tx:    acc[i, j] = C[row0 + i·(BM/TM) + ty,  col0 + j·(BN/TN) + tx]
  (strided, so that the 32 threads of a warp read 32 different shared-memory banks).
- for each BK-deep slice of k the block stages A[rows, slice] and B[slice, columns] in shared
  memory — thread t loads row t mod BM of A and column t mod BN of B (the same row and column
  for every slice, so the loaders' index arithmetic for them is done once, in ``*_setup``) —
  synchronises, and every thread does BK·TM·TN multiply-adds from shared memory:
      acc[i, j] += A_s[k, i·(BM/TM) + ty] · B_s[k, j·(BN/TN) + tx]
  A loaded value of A serves BN results and one of B serves BM: the direct kernels of stages 4-5
  read both operands from global memory for every multiply-add.
- the loads of slice s + 1 go to registers (``a_next``, ``b_next``) *before* slice s is multiplied,
  and are written to shared memory after it: a block waits for memory once, at its first slice,
  instead of once a slice (double buffering through registers, the SGEMM worklog's kernel 10). Every
  load reads an index inside its array — k is clamped to the last valid one and the value dropped
  afterwards — so a loader has no branch around its load, and a thread's loads of a slice are
  independent of one another: they are all in flight together (the static report,
  ``python -m cnn bench --static cuda-tuned``, shows what the machine code of each does).

The loader interface (each a ``@cuda.jit(device=True)`` function):

    a_row = a_setup(a_src, row)                   once per thread: what depends on the row only
    A[row, k] = a_load(a_src, a_row, k)           0 outside the matrix; k < inner always
    b_col = b_setup(b_src, col, threads_n)        once per thread: what depends on the column only
    B[k, col] = b_load(b_src, b_col, k)           (a loader must read inside its arrays even for a row
                                                  or column outside the matrix: clamp, then select 0)
    epilogue(out, row, threads_m, col, threads_n, acc)   once a thread, with its whole block of results:
                                                  acc[i, j] = C[row + i·threads_m, col + j·threads_n] — so that
                                                  what depends on the columns (a division) is done once

``a_src``, ``b_src`` and ``out`` are tuples of the arrays (and integers) the functions need.
``threads_n`` = BN/TN is passed along because a loader may give the columns of C its own meaning:
the pooled convolution numbers them so that the TN columns of ONE thread are the S × S positions
of one pooling window, and its epilogue pools them in registers (``kernels/conv_gemm.py``).

``gemm_kernel(...)`` compiles one kernel per combination of functions and tiles (shared arrays
need constant shapes); ``Tiles.for_rows`` picks tiles from the shape.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from numba import float32, uint32

from kernels.device import cuda
from kernels.launch import blocks_for, launch
from kernels.launch_config import multiprocessors

WARP = 32
SHARED_BYTES = 40 * 1024      # at most this much shared memory a block (of the 48 KiB a static array may take)
PREFETCH = 24                 # at most this many registers a thread for the next slice's elements


class Tiles(NamedTuple):
    """Block tile BM × BN, k-slice BK, and the TM × TN results each thread holds."""

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int

    @property
    def threads_m(self) -> int:
        return self.bm // self.tm

    @property
    def threads_n(self) -> int:
        return self.bn // self.tn

    @property
    def threads(self) -> int:
        return self.threads_m * self.threads_n

    @classmethod
    def for_shape(cls, rows: int, cols: int, inner: int, tn: int) -> "Tiles":
        """Tiles for a rows × cols product over ``inner``: the largest that still give every SM a block.

        At these sizes a block's time is mostly waiting for its loads, slice after slice, so
        blocks that run side by side matter more than the reuse a big tile buys. Candidates go
        from 32 threads along the columns (a warp) and TM = 8 down to 8 threads and TM = 1 (no TM
        much larger than the rows need); the first with a block per SM wins, else the last.
        """
        candidates = [cls(bm=tm * tn, bn=threads_n * tn, bk=8, tm=tm, tn=tn)
                      for threads_n in (32, 16, 8) for tm in (8, 4, 2, 1)
                      if tm <= threads_n and (tm == 1 or (tm // 2) * tn < rows)]
        for tiles in candidates:
            (blocks_x, blocks_y, _), _ = tiles.grid(rows, cols)
            if blocks_x * blocks_y >= multiprocessors():
                break
        return tiles.with_depth(inner)

    @classmethod
    def for_columns(cls, rows: int, cols: int, inner: int, tn: int) -> "Tiles":
        """Tiles with every row in one block (up to 8·TN) and blocks from the columns alone.

        For the convolutions, where loading an element of B costs far more than one of A (an
        input patch gathered through the window, against a row of filter weights): a block per
        few rows would load each element of B once per block of rows. The columns supply the
        blocks: a warp of 32 threads along them, or 16 or 8 when that leaves an SM without one.
        """
        for threads_n in (32, 16, 8):
            tiles = cls.for_rows(rows, tn, threads_n)
            (blocks_x, blocks_y, _), _ = tiles.grid(rows, cols)
            if blocks_x * blocks_y >= multiprocessors():
                break
        return tiles.with_depth(inner)

    @classmethod
    def for_rows(cls, rows: int, tn: int, threads_n: int = WARP, k_len: int = 8) -> "Tiles":
        """Tiles for a product with ``rows`` rows: TN = ``tn`` results a row per thread, BN/TN = ``threads_n``.

        BM/TM = TN threads along the rows (so that the T threads load whole columns of B),
        and TM the smallest power of two ≤ 8 that covers ``rows`` with them.
        """
        tm = 1
        while tm * tn < rows and tm < 8 and tm < threads_n:
            tm *= 2
        return cls(bm=tm * tn, bn=threads_n * tn, bk=8, tm=tm, tn=tn).with_depth(k_len)

    def with_depth(self, k_len: int) -> "Tiles":
        """These tiles with BK for a k range of ``k_len``: as deep as the k range asks (≤ 64), as long as a
        thread's next slice fits in ``PREFETCH`` registers and the slice in 40 KiB of shared memory.

        The next slice is loaded into registers while this one is multiplied, so a deeper slice hides
        no more latency — it only costs registers: past about 255 a thread, the compiler spills
        (the static report shows it: registers, spills, local stack)."""
        bk = 8
        while bk < 64 and k_len > 8 * bk:
            bk *= 2
        while bk > 8 and (bk * (self.bm + self.bn) * 4 > SHARED_BYTES
                          or -(-bk * self.bm // self.threads) - (-bk * self.bn // self.threads) > PREFETCH):
            bk //= 2
        return self._replace(bk=bk).checked()

    def checked(self) -> "Tiles":
        """These tiles, after checking every thread can load one row of A and one column of B."""
        if self.bm % self.tm or self.bn % self.tn:
            raise ValueError(f"{self}: TM must divide BM and TN must divide BN")
        if self.threads % self.bm or self.threads % self.bn or self.threads > 1024:
            raise ValueError(f"{self}: its {self.threads} threads must be a multiple of BM and of BN, at most 1024")
        return self

    def grid(self, rows: int, cols: int, splits: int = 1) -> tuple[tuple[int, int, int], int]:
        """((blocks over columns, blocks over rows, k splits), threads)."""
        return (blocks_for(cols, self.bn), blocks_for(rows, self.bm), splits), self.threads


@lru_cache(maxsize=None)
def gemm_kernel(a_setup, a_load, b_setup, b_load, epilogue, tiles: Tiles):
    """The implicit GEMM kernel for these loaders, this epilogue and these tiles (compiled once each)."""
    bm, bn, bk, tm, tn = tiles
    threads_m, threads_n, threads = tiles.threads_m, tiles.threads_n, tiles.threads
    a_k_step, b_k_step = threads // bm, threads // bn     # k rows of a slice one pass of the block loads
    a_per, b_per = -(-bk // a_k_step), -(-bk // b_k_step)  # elements of A and of B a thread stages a slice
    a_slice_size, b_slice_size = bk * bm, bk * bn          # (shared arrays need constant sizes)

    def implicit_gemm_kernel(a_src, b_src, out, inner, k_chunk):
        a_slice = cuda.shared.array(a_slice_size, float32)    # A_s[k, r] at k·BM + r; B_s[k, c] at k·BN + c
        b_slice = cuda.shared.array(b_slice_size, float32)
        acc = cuda.local.array((tm, tn), float32)
        a_next = cuda.local.array(a_per, float32)         # the next slice, loaded while this one is multiplied
        b_next = cuda.local.array(b_per, float32)
        a_frag = cuda.local.array(tm, float32)
        b_frag = cuda.local.array(tn, float32)
        t = cuda.threadIdx.x
        ty, tx = t // threads_n, t % threads_n
        row0, col0 = cuda.blockIdx.y * bm, cuda.blockIdx.x * bn
        k_begin = cuda.blockIdx.z * k_chunk
        k_end = min(inner, k_begin + k_chunk)
        a_r, a_k = t % bm, t // bm                        # this thread loads row a_r of A, column b_c of B
        b_c, b_k = t % bn, t // bn
        a_row = a_setup(a_src, row0 + a_r)
        b_col = b_setup(b_src, col0 + b_c, threads_n)
        for i in range(tm):
            for j in range(tn):
                acc[i, j] = float32(0.0)
        for e in range(a_per):                           # slice 0 into registers (the loop loads slice 1 on)
            k = k_begin + a_k + e * a_k_step              # each load reads inside the arrays (k clamped) and
            a_value = a_load(a_src, a_row, min(k, k_end - 1))        # its value is dropped after: no branch,
            a_next[e] = a_value if k < k_end else float32(0.0)       # so a thread's loads fly together
        for e in range(b_per):
            k = k_begin + b_k + e * b_k_step
            b_value = b_load(b_src, b_col, min(k, k_end - 1))
            b_next[e] = b_value if k < k_end else float32(0.0)
        for k0 in range(k_begin, k_end, bk):
            for e in range(a_per):
                if a_k + e * a_k_step < bk:               # (false only when a block has more threads than
                    a_slice[(a_k + e * a_k_step) * bm + a_r] = a_next[e]        # a slice has elements)
            for e in range(b_per):
                if b_k + e * b_k_step < bk:
                    b_slice[(b_k + e * b_k_step) * bn + b_c] = b_next[e]
            cuda.syncthreads()                            # the slice of A and B is in shared memory
            if k0 + bk < k_end:                           # the next slice's loads fly while this one is multiplied
                for e in range(a_per):
                    k = k0 + bk + a_k + e * a_k_step
                    a_value = a_load(a_src, a_row, min(k, k_end - 1))
                    a_next[e] = a_value if k < k_end else float32(0.0)
                for e in range(b_per):
                    k = k0 + bk + b_k + e * b_k_step
                    b_value = b_load(b_src, b_col, min(k, k_end - 1))
                    b_next[e] = b_value if k < k_end else float32(0.0)
            a_at, b_at = uint32(ty), uint32(tx)           # A_s[kk, ty] and B_s[kk, tx], unsigned: constant offsets
            for kk in range(bk):                          # from there, each shared load one instruction (a signed
                for i in range(tm):                       # index would be tested for wrapping around, each time)
                    a_frag[i] = a_slice[a_at + uint32(i * threads_m)]
                for j in range(tn):
                    b_frag[j] = b_slice[b_at + uint32(j * threads_n)]
                for i in range(tm):
                    for j in range(tn):
                        acc[i, j] += a_frag[i] * b_frag[j]
                a_at += uint32(bm)
                b_at += uint32(bn)
            cuda.syncthreads()                            # everyone is done with the slice before the next store
        epilogue(out, row0 + ty, threads_m, col0 + tx, threads_n, acc)

    # named after its epilogue (gemm_bias_relu_pool_store, gemm_pixel_store, ...) in profiles
    implicit_gemm_kernel.__name__ = implicit_gemm_kernel.__qualname__ = f"gemm_{function_name(epilogue)}"
    return cuda.jit(implicit_gemm_kernel)


def function_name(device_function) -> str:
    """The Python name of a ``cuda.jit`` function (the simulator's wrapper keeps it in ``fn``)."""
    python_function = getattr(device_function, "py_func", None) or getattr(device_function, "fn", device_function)
    return python_function.__name__


def split_k(inner: int, splits: int, bk: int) -> tuple[int, int]:
    """(k_chunk, splits): ``inner`` cut into at most ``splits`` chunks of a multiple of BK each, none empty."""
    k_chunk = blocks_for(blocks_for(inner, max(1, splits)), bk) * bk
    return k_chunk, blocks_for(inner, k_chunk)


def gemm(functions, tiles: Tiles, a_src, b_src, out, rows: int, cols: int, inner: int, splits: int = 1,
         launch=launch) -> None:
    """Queue C = A·B (rows × cols, over ``inner``) with ``functions`` = (a_setup, a_load, b_setup, b_load, epilogue).

    ``splits`` > 1 cuts k into chunks, one per ``blockIdx.z`` (``split_k`` says how many there are).
    """
    k_chunk, splits = split_k(inner, splits, tiles.bk)
    launch(gemm_kernel(*functions, tiles), *tiles.grid(rows, cols, splits), a_src, b_src, out, inner, k_chunk)


# -- loaders and epilogues shared by several products ---------------------------------------------
@cuda.jit(device=True)
def row_index(src, row):
    """a_setup of a plain matrix: the row itself."""
    return row


@cuda.jit(device=True)
def column_index(src, col, threads_n):
    """b_setup of a plain matrix: the column itself."""
    return col


@cuda.jit(device=True)
def matrix_rows(src, row, k):
    """a_load of a row-major matrix m = src[0]: A[row, k] = m[row, k]."""
    m = src[0]
    value = m[uint32(min(row, m.shape[0] - 1)), uint32(k)]   # always inside m: no branch around the load
    return value if row < m.shape[0] else float32(0.0)


@cuda.jit(device=True)
def matrix_cols(src, row, k):
    """a_load of a transposed matrix: A[row, k] = m[k, row]."""
    m = src[0]
    value = m[uint32(k), uint32(min(row, m.shape[1] - 1))]
    return value if row < m.shape[1] else float32(0.0)


@cuda.jit(device=True)
def matrix_b(src, col, k):
    """b_load of a row-major matrix: B[k, col] = m[k, col]."""
    m = src[0]
    value = m[uint32(k), uint32(min(col, m.shape[1] - 1))]
    return value if col < m.shape[1] else float32(0.0)


@cuda.jit(device=True)
def matrix_b_transposed(src, col, k):
    """b_load of a transposed matrix: B[k, col] = m[col, k]."""
    m = src[0]
    value = m[uint32(min(col, m.shape[0] - 1)), uint32(k)]
    return value if col < m.shape[0] else float32(0.0)


@cuda.jit(device=True)
def store_partial(out, row, threads_m, col, threads_n, acc):
    """Epilogue of split-K: partial[bz, row, ·] = this block's sums over its chunk of k (out = (partial,))."""
    partial = out[0]
    for i in range(acc.shape[0]):
        r = row + i * threads_m
        if r < partial.shape[1]:
            for j in range(acc.shape[1]):
                if col + j * threads_n < partial.shape[2]:
                    partial[cuda.blockIdx.z, r, col + j * threads_n] = acc[i, j]
