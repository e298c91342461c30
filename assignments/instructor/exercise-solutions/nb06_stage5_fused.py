"""Notebook 06, stage 5 `cuda-fused`: worked solutions of its three exercises (in the simulator without a GPU)."""

from __future__ import annotations

import sys

from common import random_array, use_simulator_without_gpu

SIMULATED = use_simulator_without_gpu()      # before numba is imported

import numpy as np  # noqa: E402

from cnn.gradcheck import rel_error  # noqa: E402
from cnn.stages import s1_loops  # noqa: E402
from cnn.stages.s5_cuda_fused import conv_relu_pool_backward, conv_relu_pool_forward, memory_saved  # noqa: E402
from kernels.device import cuda  # noqa: E402
from kernels.launch import grid_1d  # noqa: E402


@cuda.jit
def push_filter_gradient_plain(dy, x, dw):
    """A copy of the push filter gradient with `dw[...] +=` instead of cuda.atomic.add: thread k ↔ dy[n, f, i, j]."""
    k = cuda.grid(1)
    if k >= dy.size:
        return
    filters, out_h, out_w = dy.shape[1], dy.shape[2], dy.shape[3]
    j = k % out_w
    i = (k // out_w) % out_h
    f = (k // (out_w * out_h)) % filters
    n = k // (out_w * out_h * filters)
    g = dy[n, f, i, j]
    for c in range(x.shape[1]):
        for p in range(dw.shape[2]):
            for q in range(dw.shape[3]):
                dw[f, c, p, q] += g * x[n, c, i + p, j + q]        # the race: load, add, store


def exercise_1(fast: bool) -> None:
    """`dw[f, c, p, q] += ...` instead of cuda.atomic.add: on a GPU, and why might the simulator not catch it?

    Answer. On a GPU the kernel gives wrong, run-to-run different dW: all the threads of filter f (N·Ho·Wo
    of them) add into the same C·K² weights; `+=` is a load, an add and a store, and warps run in
    lock-step by the dozen, so many threads load the same old value and all but one of their additions are
    lost — dW comes out several times too small. The simulator usually gets it right: it runs each CUDA
    thread as a Python thread, and Python threads take turns holding the interpreter lock, switching only
    every 5 ms (`sys.getswitchinterval()`). A push thread's whole body takes far less than that, so it
    almost always runs from its first load to its last store without another thread in between — the
    threads effectively run one after another, and no addition is lost. Make the interpreter switch every
    microsecond (`sys.setswitchinterval(1e-6)`) and the same kernel loses additions in the simulator too,
    as shown below: the race was always there, the schedule hid it. That is why the assignment (a5) reads
    the kernels' code for atomics instead of trusting the simulated values.
    """
    rng = np.random.default_rng(11)
    x, dy = random_array(rng, 2, 2, 6, 6, dtype=np.float32), random_array(rng, 2, 2, 4, 4, dtype=np.float32)
    _, expected, _ = s1_loops.conv_backward(dy.astype(np.float64), x.astype(np.float64), np.zeros((2, 2, 3, 3)), 1, 0)

    def errors(runs):
        found = []
        for _ in range(runs):
            d_dw = cuda.to_device(np.zeros((2, 2, 3, 3), np.float32))
            push_filter_gradient_plain[grid_1d(dy.size)](cuda.to_device(dy), cuda.to_device(x), d_dw)
            found.append(rel_error(d_dw.copy_to_host(), expected))
        return found
    usual = errors(3)
    print(f"switch interval {sys.getswitchinterval() * 1e3:g} ms: rel_error of dW "
          + ", ".join(f"{e:.1e}" for e in usual))
    if not SIMULATED:
        return
    interval = sys.getswitchinterval()
    try:
        sys.setswitchinterval(1e-6)
        frequent = errors(5)
    finally:
        sys.setswitchinterval(interval)
    print("switch interval 1 µs: rel_error of dW " + ", ".join(f"{e:.1e}" for e in frequent) + "  (additions lost)")
    assert max(frequent) > 1e-3, "with frequent thread switches the simulator shows the race"


def exercise_2(fast: bool) -> None:
    """3×3 pooling windows at stride 2: how many pooled outputs can share one winner? Make one win four.

    Answer. Windows start every 2 positions and are 3 wide, so along one axis a position belongs to two
    windows when it sits on their shared edge (an even index inside the plane: positions 2, 4, … are both
    the last of one window and the first of the next) and to one otherwise; in two dimensions a position
    can be in up to 2 × 2 = 4 windows. Below: a 1×1 convolution with weight 1 and bias 0 makes the conv
    output equal to the ReLU of the input, and a 5×5 input with one large value at (2, 2) — the corner
    shared by the four windows of the 2×2 pooled output — makes that position win all four. The fused
    backward must then add all four dy values into dx at (2, 2) (atomically: four threads push into the
    same address) and leave every other pixel at zero; it does, matching stage 1's three separate layers.
    """
    rng = np.random.default_rng(12)
    x = -np.abs(random_array(rng, 1, 1, 5, 5, dtype=np.float32))
    x[0, 0, 2, 2] = 10.0
    W, b = np.ones((1, 1, 1, 1), np.float32), np.zeros(1, np.float32)
    y, switches = conv_relu_pool_forward(x, W, b, 1, 0, 3, 2)
    dy = random_array(rng, *y.shape, dtype=np.float32)
    dx, dW, db = conv_relu_pool_backward(dy, y, switches, x, W, 1, 0)
    x64, W64, b64 = (a.astype(np.float64) for a in (x, W, b))
    relu = s1_loops.relu_forward(s1_loops.conv_forward(x64, W64, b64, 1, 0))
    _, argmax = s1_loops.maxpool_forward(relu, 3, 2)
    dconv = s1_loops.relu_backward(s1_loops.maxpool_backward(dy.astype(np.float64), argmax, relu.shape, 3, 2), relu)
    dx_ref, dW_ref, db_ref = s1_loops.conv_backward(dconv, x64, W64, 1, 0)
    print(f"pooled output {y.shape[2:]}, switches {switches.ravel().tolist()} (12 = row 2 · 5 + column 2): one winner")
    print(f"dx at (2, 2) = {dx[0, 0, 2, 2]:.6f}, the sum of the four dy = {dy.sum():.6f}; "
          f"rel_error dx {rel_error(dx, dx_ref):.1e}, dW {rel_error(dW, dW_ref):.1e}, db {rel_error(db, db_ref):.1e}")
    assert (switches == 12).all()
    assert np.isclose(dx[0, 0, 2, 2], dy.sum(), rtol=1e-5) and np.count_nonzero(dx) == 1
    assert rel_error(dx, dx_ref) < 1e-5 and rel_error(dW, dW_ref) < 1e-5


def exercise_3(fast: bool) -> None:
    """Writers per weight of LeNet-5's second convolution at batch 64, and how to reduce the contention.

    Answer. Every push thread of filter f — one per pooled output of that filter, N·Hp·Wp = 64·4·4 = 1 024
    of them — adds into each of the filter's C·K² = 150 weights and into db[f]: 1 024 atomic adds land on
    every dW address (`memory_saved(...)["blocks"][1]["writers_per_weight"]`), and the hardware executes
    atomics on one address one after another. The remedy is a two-level sum: the threads of a block that
    work on the same filter first add their contributions into a copy of the filter's dW in *shared
    memory* (fast on-chip atomics, or a tree reduction with __syncthreads), then one thread per weight adds
    the block's total into global dW with a single atomic. Global atomics per weight drop from N·Hp·Wp to
    the number of blocks that hold filter f's threads: with blocks of 128 threads, 1 024 / 128 = 8 — what
    stage 7's `smem-weights` fix does. (Shared memory is small, 48–228 kB a multiprocessor, but C·K²
    floats per filter — 600 bytes here — fit easily.)
    """
    row = memory_saved("lenet5", 64)["blocks"][1]
    writers = row["writers_per_weight"]
    pooled_h, pooled_w = row["pooled"][1:]
    print(f"LeNet-5 second convolution (layers {row['layers']}), batch 64: pooled output {row['pooled']}, "
          f"{writers} atomic adds on each dW address; with block sums over 128 threads: {-(-writers // 128)}")
    assert writers == 64 * pooled_h * pooled_w == 1024 and -(-writers // 128) == 8
