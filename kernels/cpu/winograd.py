"""Conv 5 × 5 (stride 1) + bias (+ ReLU) + 2 × 2 max-pool by Winograd's minimal filtering F(2 × 2, 5 × 5): fewer
multiplications, not a faster loop.

Two outputs of a correlation with five taps, y_i = Σ_k g_k·d_{i+k}, take 10 multiplications directly; Winograd
(Lavin & Gray 2016, after Toom and Cook) takes them from six numbers d_0 … d_5 with 6:

    y = Aᵀ [(G g) ⊙ (Bᵀ d)]         Aᵀ: 2 × 6,  G: 6 × 5,  Bᵀ: 6 × 6   (``winograd_matrices``)

and a 2 × 2 tile of outputs from a 6 × 6 tile of input, nested: Y = Aᵀ [(G g Gᵀ) ⊙ (Bᵀ d B)] A — 36 products
where a direct correlation takes 100. Over C input channels the products become sums: for each of the 36
numbers ξ of a tile, one small matrix product

    U[ξ, f, c] = (G W[f, c] Gᵀ)[ξ]            once a step, every filter f and channel c (``winograd_weights``)
    V[ξ, c, t] = (Bᵀ d_{c,t} B)[ξ]            every input tile t (``_input_transform``)
    M[ξ, f, t] = Σ_c U[ξ, f, c]·V[ξ, c, t]     the multiply-adds: ``fma_4x4`` passes (``_products``)
    Y[f, t]    = Aᵀ M[·, f, t] A             the tile's 2 × 2 outputs: exactly one 2 × 2 pooling window

so each window is pooled from its tile as soon as the tile exists (``_pool_tiles``).

Layout. The padded input is split by the parity of its rows and columns (``load_by_parity``), samples
innermost as in ``layout.load_channel``: the number at offset (u, v) of every tile is then at ONE shift,
(u // 2, v // 2), of its parity plane, and each transform is a sum of shifted runs over every tile of every
sample of a block — SIMD loops (``combine4``: a row of Bᵀ has at most four nonzero numbers). As in the plane
kernels, the tiles of the columns past the output's width are computed and never read.

What it costs, a 16 × 16 plane of C = 32 channels into F = 32 filters, per sample: 5.9 MFLOP of products,
1.0 of transforms, 0.7 of output tiles — against 16.4 executed by the plane kernel (13.1 useful): 2.1x
fewer. Measured, and why the gain is smaller: ``cnn.stages.s3_numba_cpu``, item 8.

Thread → data: a work item is a block of samples (every filter: the transformed input serves them all); a
call takes items lo … hi−1 and writes their pooled outputs and switches.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kernels.cpu.layout import SAFE_FASTMATH, SIMD_ROUND, fma_4x4
from kernels.cpu.pool import first_max_of_four

POINTS = (0.0, 1.0, -1.0, 2.0, -2.0)     # where the polynomials are sampled (and ∞): small integers
MIN_CHANNELS = 16        # fewer input channels: the transforms outweigh the products saved (LeNet-5's conv 2,
                         # 6 channels: ~1.1x fewer multiply-adds on paper; conv 1 of AlexNet-small, 3: more)
TILE_NUMBERS = 1 << 18   # a block's transformed input V holds about this many numbers (1 MB in float32, half
                         # this machine's L2; measured: twice as many alike, four times 1.4x slower, half 1.3x)

# stage 3's 4 x 4 pass, inlined where it is called: a call hands over arrays, and Numba counts a reference
# for each (an atomic increment and decrement); inlined, the counts are pruned away. The caller's fastmath
# flags apply to the inlined body, so the callers here are compiled with SAFE_FASTMATH too.
fma_4x4_inlined = njit(fastmath=SAFE_FASTMATH, inline="always")(fma_4x4.py_func)


def winograd_matrices(points=POINTS, m=2, r=5):
    """Aᵀ (m × n), G (n × r) and Bᵀ (n × n), n = m + r − 1, of F(m, r) from n − 1 points and ∞ (float64):

    Aᵀ[i, j] = a_j^i,   G[j, k] = a_j^k / Π_{l≠j} (a_j − a_l)       (j < n − 1; the last column / row: ∞)

    and Bᵀ solved from the identity itself, y_i = Σ_k g_k·d_{i+k} = Σ_j Aᵀ[i, j]·(G g)_j·(Bᵀ d)_j for every g
    and d: linear in Bᵀ, m·r equations for each column."""
    n = m + r - 1
    if len(points) != n - 1 or len(set(points)) != n - 1:
        raise ValueError(f"F({m}, {r}) needs {n - 1} distinct points, not {points}")
    a = np.array(points, np.float64)
    AT, G = np.zeros((m, n)), np.zeros((n, r))
    for j in range(n - 1):
        AT[:, j] = a[j] ** np.arange(m)
        G[j] = a[j] ** np.arange(r) / np.prod([a[j] - a[l] for l in range(n - 1) if l != j])
    AT[m - 1, n - 1], G[n - 1, r - 1] = 1.0, 1.0
    system = np.einsum("ij,jk->ikj", AT, G).reshape(m * r, n)      # row (i, k), column j: Aᵀ[i, j]·G[j, k]
    BT = np.zeros((n, n))
    for l in range(n):
        wanted = np.array([1.0 if l == i + k else 0.0 for i in range(m) for k in range(r)])
        BT[:, l] = np.linalg.lstsq(system, wanted, rcond=None)[0]
        if np.abs(system @ BT[:, l] - wanted).max() > 1e-9:
            raise ValueError(f"F({m}, {r}) has no Bᵀ for the points {points}")
    return AT, G, np.round(BT, 12)


def _sparse_rows(matrix, terms):
    """Each row of ``matrix`` as ``terms`` (column, coefficient) pairs, its nonzeros first, padded with
    coefficient 0: (columns, coefficients), two arrays of rows × terms."""
    columns, coefficients = np.zeros((matrix.shape[0], terms), np.int64), np.zeros((matrix.shape[0], terms))
    for row in range(matrix.shape[0]):
        nonzero = np.flatnonzero(matrix[row])
        if nonzero.size > terms:
            raise ValueError(f"row {row} has {nonzero.size} nonzeros, more than {terms}")
        columns[row, :nonzero.size], coefficients[row, :nonzero.size] = nonzero, matrix[row, nonzero]
    return columns, coefficients


A_T, G_MATRIX, B_T = winograd_matrices()
B_COLUMNS, B_COEFFICIENTS = _sparse_rows(B_T, 4)
CORNERS = np.kron(A_T, A_T)      # (4, 36): corner 2a + b of a tile = Σ_ξ CORNERS[2a + b, ξ]·M[ξ], ξ = 6u + v


@njit(cache=True)
def uses_winograd(C, H, W, K, stride, pad, pool_size, pool_stride):
    """Whether a conv (C channels of H × W, K × K filters) + pool is taken this way: 5 × 5, stride 1, 2 × 2 windows
    every 2 pixels tiling an output of even height and width, and at least MIN_CHANNELS input channels."""
    return (K == 5 and stride == 1 and pool_size == 2 and pool_stride == 2 and (H + 2 * pad) % 2 == 0
            and (W + 2 * pad) % 2 == 0 and C >= MIN_CHANNELS)


@njit(cache=True)
def weights_shape(F, C):
    """The shape of U: (36 ξ, filter groups, channel groups, 4, 4)."""
    return 36, -(-F // 4), -(-C // 4), 4, 4


@njit(cache=True)
def weights_size(F, C):
    """How many numbers U holds (``weights_shape``)."""
    size = 1
    for extent in weights_shape(F, C):
        size *= extent
    return size


@njit(cache=True)
def winograd_weights(W, U):
    """U[ξ, g, h, i, j] = (G W[4g + i, 4h + j] Gᵀ)[ξ], ξ = 6u + v: 4 × 4 tiles for ``fma_4x4`` (0 past the last
    filter or channel; U comes zeroed)."""
    F, C, K = W.shape[0], W.shape[1], W.shape[2]
    half = np.zeros((6, K))
    for f in range(F):
        for c in range(C):
            for u in range(6):                      # half = G·W[f, c]
                for q in range(K):
                    total = 0.0
                    for p in range(K):
                        total += G_MATRIX[u, p] * W[f, c, p, q]
                    half[u, q] = total
            for u in range(6):                      # (G·W[f, c])·Gᵀ
                for v in range(6):
                    total = 0.0
                    for q in range(K):
                        total += half[u, q] * G_MATRIX[v, q]
                    U[6 * u + v, f // 4, c // 4, f % 4, c % 4] = total


@njit(cache=True)
def samples_per_tile_block(samples, C, H, W, pad):
    """Samples a block holds so that V (36 rows a channel, a number a tile of every sample) stays about
    TILE_NUMBERS, in blocks of (nearly) equal size."""
    tiles = ((H + 2 * pad) // 2) * ((W + 2 * pad) // 2)
    blocks = -(-samples // max(1, TILE_NUMBERS // (36 * 4 * -(-C // 4) * tiles)))
    return -(-samples // blocks)


@njit(cache=True)
def tile_blocks(x, pad):
    """Work items of the forward over the samples of x: its blocks of samples."""
    return -(-x.shape[0] // samples_per_tile_block(x.shape[0], x.shape[1], x.shape[2], x.shape[3], pad))


@njit(cache=True, fastmath=SAFE_FASTMATH, inline="always")
def combine4(Y, y_row, length, X, rows, starts, coefficients, term_row):
    """Y[y_row, k] = Σ_t coefficients[term_row, t]·X[rows[t], starts[t] + k] for k < length, four terms t in one
    pass (indexed in place, unsigned: no view, no wraparound; inlined: no call, no reference count)."""
    c0, c1, c2, c3 = (coefficients[term_row, 0], coefficients[term_row, 1], coefficients[term_row, 2],
                      coefficients[term_row, 3])
    r0, r1, r2, r3 = rows
    s0, s1, s2, s3 = np.uint64(starts[0]), np.uint64(starts[1]), np.uint64(starts[2]), np.uint64(starts[3])
    for k in range(np.uint64(length)):
        Y[y_row, k] = c0 * X[r0, s0 + k] + c1 * X[r1, s1 + k] + c2 * X[r2, s2 + k] + c3 * X[r3, s3 + k]


@njit(cache=True)
def load_by_parity(x, n0, count, c, pad, Wh, planes):
    """Channel c of samples n0 … n0+count−1, zero-padded, split by the parity of row and column:

    planes[4c + 2·(r % 2) + (q % 2), ((r // 2)·Wh + q // 2)·count + b] = padded x[n0 + b, c, r, q]

    (the padding is not written: the caller zeroes the planes)."""
    H, W = x.shape[2], x.shape[3]
    for b in range(count):
        for h in range(H):
            r = pad + h
            for w in range(W):
                q = pad + w
                planes[4 * c + 2 * (r % 2) + q % 2, ((r // 2) * Wh + q // 2) * count + b] = x[n0 + b, c, h, w]


@njit(cache=True, fastmath=SAFE_FASTMATH)
def _input_transform(planes, c, C4, Wh, count, run, coefficients, rows_half, V):
    """V[ξ·C4 + c, k] = (Bᵀ d B)[ξ] for the tile at every k of the run, in two passes of ``combine4``:

    rows_half[2u + e, k'] = Σ_u' Bᵀ[u, u']·plane(u' % 2, e)[k' + (u' // 2)·Wh·count]   (e: column parity)
    V[(6u + v)·C4 + c, k] = Σ_v' Bᵀ[v, v']·rows_half[2u + v' % 2, k + (v' // 2)·count]"""
    columns = B_COLUMNS
    wide = run + 2 * count                          # the second pass reads up to two columns further
    for u in range(6):
        for e in range(2):
            rows = (4 * c + 2 * (columns[u, 0] % 2) + e, 4 * c + 2 * (columns[u, 1] % 2) + e,
                    4 * c + 2 * (columns[u, 2] % 2) + e, 4 * c + 2 * (columns[u, 3] % 2) + e)
            starts = ((columns[u, 0] // 2) * Wh * count, (columns[u, 1] // 2) * Wh * count,
                      (columns[u, 2] // 2) * Wh * count, (columns[u, 3] // 2) * Wh * count)
            combine4(rows_half, 2 * u + e, wide, planes, rows, starts, coefficients, u)
    for u in range(6):
        for v in range(6):
            rows = (2 * u + columns[v, 0] % 2, 2 * u + columns[v, 1] % 2,
                    2 * u + columns[v, 2] % 2, 2 * u + columns[v, 3] % 2)
            starts = ((columns[v, 0] // 2) * count, (columns[v, 1] // 2) * count,
                      (columns[v, 2] // 2) * count, (columns[v, 3] // 2) * count)
            combine4(V, (6 * u + v) * C4 + c, run, rows_half, rows, starts, coefficients, v)


@njit(cache=True, fastmath=SAFE_FASTMATH)
def _products(M, V, U, g, C4, run):
    """M[4ξ + i, k] = Σ_c U[ξ, f, c]·V[ξ·C4 + c, k] for the group's filters f = 4g + i and every ξ: four filters
    × four channels a pass."""
    for xi in range(36):
        m0, m1, m2, m3 = M[4 * xi, :run], M[4 * xi + 1, :run], M[4 * xi + 2, :run], M[4 * xi + 3, :run]
        m0[:], m1[:], m2[:], m3[:] = 0, 0, 0, 0
        for h in range(U.shape[2]):
            c = xi * C4 + 4 * h
            fma_4x4_inlined(m0, m1, m2, m3, V, (c, c + 1, c + 2, c + 3), (0, 0, 0, 0), U[xi, g, h])


@njit(cache=True)
def _pool_tiles(Y, count, Th, Tw, Wh, Wo, bias, relu, out, switch, n0, f):
    """Each tile's four outputs (Y[2a + b] at the tile's position) + bias (+ ReLU), pooled into out[n, f] and
    switch[n, f]."""
    for s in range(count):
        for i in range(Th):
            for j in range(Tw):
                k = (i * Wh + j) * count + s
                out[n0 + s, f, i, j], switch[n0 + s, f, i, j] = first_max_of_four(
                    Y[0, k], Y[1, k], Y[2, k], Y[3, k], 2 * i * Wo + 2 * j, Wo, bias, relu)


@njit(cache=True, fastmath=SAFE_FASTMATH)
def winograd_forward(x, U, b, pad, relu, out, switch, lo, hi):
    """Work items lo ≤ item < hi (blocks of samples, ``tile_blocks``): conv + bias (+ ReLU) + 2 × 2 max-pool, U
    the transformed weights (``winograd_weights``).

    out[n, f, i, j]    = max over the corners (a, b) of Y[f, tile (i, j)][a, b] + b[f]     (then ReLU)
    switch[n, f, i, j] = (2i + a)·Wo + 2j + b of the first maximum (as ``pool.pool_plane``)"""
    N, C, F = x.shape[0], x.shape[1], out.shape[1]
    C4 = 4 * U.shape[2]
    Hp, Wp = x.shape[2] + 2 * pad, x.shape[3] + 2 * pad
    Hh, Wh, Th, Tw, Wo = Hp // 2, Wp // 2, (Hp - 4) // 2, (Wp - 4) // 2, Wp - 4
    per_block = samples_per_tile_block(N, C, x.shape[2], x.shape[3], pad)
    run = -(-Th * Wh * per_block // SIMD_ROUND) * SIMD_ROUND
    planes = np.empty((4 * C, Hh * Wh * per_block + 2 * (Wh + 1) * per_block + 2 * SIMD_ROUND), x.dtype)
    rows_half = np.zeros((12, run + 2 * per_block), x.dtype)
    V, M, Y = np.zeros((36 * C4, run), x.dtype), np.empty((36 * 4, run), x.dtype), np.empty((4, run), x.dtype)
    coefficients, corners = B_COEFFICIENTS.astype(x.dtype), np.empty((9, 4, 4), x.dtype)
    for h in range(9):                              # Aᵀ ⊗ Aᵀ as 4 × 4 tiles: 4 corners × 4 numbers ξ
        for i in range(4):
            for j in range(4):
                corners[h, i, j] = CORNERS[i, 4 * h + j]
    y0, y1, y2, y3 = Y[0], Y[1], Y[2], Y[3]
    for item in range(lo, hi):
        n0 = item * per_block
        count = min(per_block, N - n0)
        planes[:] = 0
        for c in range(C):
            load_by_parity(x, n0, count, c, pad, Wh, planes)
            _input_transform(planes, c, C4, Wh, count, run, coefficients, rows_half, V)
        for g in range(U.shape[1]):                 # four filters: their 36 products, then their tiles
            _products(M, V, U, g, C4, run)
            for f in range(4 * g, min(F, 4 * g + 4)):
                Y[:] = 0
                for h in range(9):
                    at = 16 * h + f - 4 * g         # M's rows 4ξ + (f − 4g) for ξ = 4h … 4h+3
                    fma_4x4_inlined(y0, y1, y2, y3, M, (at, at + 4, at + 8, at + 12), (0, 0, 0, 0), corners[h])
                _pool_tiles(Y, count, Th, Tw, Wh, Wo, b[f], relu, out, switch, n0, f)
