"""Notebook 05, stage 4 `cuda`: worked solutions of its three exercises (in the simulator without a GPU)."""

from __future__ import annotations

from common import random_array, tiny_lenet, use_simulator_without_gpu

SIMULATED = use_simulator_without_gpu()      # before numba is imported

import numpy as np  # noqa: E402

from cnn.gradcheck import rel_error  # noqa: E402
from cnn.model import Conv, Dense, MaxPool, ReLU, lenet5  # noqa: E402
from cnn.stages import get_stage, s1_loops  # noqa: E402
from kernels.device import cuda  # noqa: E402
from kernels.launch import grid_1d  # noqa: E402


@cuda.jit
def filter_gradient_partial_kernel(dy, x, partial, stride, pad):
    """Thread k ↔ (s, f, c, p, q), row-major over partial (S, F, C, K, K): the dW sum over images n ≡ s (mod S)."""
    k = cuda.grid(1)
    if k >= partial.size:
        return
    slices, filters, channels, K = partial.shape[0], partial.shape[1], partial.shape[2], partial.shape[3]
    q = k % K
    p = (k // K) % K
    c = (k // (K * K)) % channels
    f = (k // (K * K * channels)) % filters
    s = k // (K * K * channels * filters)
    height, width = x.shape[2], x.shape[3]
    total = np.float32(0)
    for n in range(s, dy.shape[0], slices):
        for i in range(dy.shape[2]):
            h = i * stride + p - pad
            if 0 <= h < height:
                for j in range(dy.shape[3]):
                    col = j * stride + q - pad
                    if 0 <= col < width:
                        total += dy[n, f, i, j] * x[n, c, h, col]
    partial[s, f, c, p, q] = total


@cuda.jit
def sum_partials_kernel(partial, dw):
    """Thread k ↔ one element of dw (flat): the sum of its S partial sums."""
    k = cuda.grid(1)
    if k >= dw.size:
        return
    flat_partial, flat_dw = partial.reshape(partial.shape[0], dw.size), dw.reshape(dw.size)
    total = np.float32(0)
    for s in range(partial.shape[0]):
        total += flat_partial[s, k]
    flat_dw[k] = total


def filter_gradient_split(dy, x, w_shape, stride, pad, slices):
    """dW with S·F·C·K·K threads in two launches: partial sums over S slices of the batch, then their sum."""
    d_partial = cuda.device_array((slices, *w_shape), dtype=np.float32)
    d_dw = cuda.device_array(w_shape, dtype=np.float32)
    filter_gradient_partial_kernel[grid_1d(d_partial.size)](cuda.to_device(dy), cuda.to_device(x), d_partial,
                                                            stride, pad)
    sum_partials_kernel[grid_1d(d_dw.size)](d_partial, d_dw)
    return d_dw.copy_to_host()


def exercise_1(fast: bool) -> None:
    """conv2d_backward_filter_kernel has only F·C·K·K threads, each looping over the batch: why poor? A better one.

    Answer. A GPU hides memory latency by switching among many resident warps: an H100 has 132
    multiprocessors of up to 2 048 resident threads each, so it wants tens of thousands of threads in
    flight. LeNet-5's first layer gives this kernel F·C·K·K = 6·1·25 = 150 threads — five warps, five
    multiprocessors busy and the other 127 idle — and each thread runs a serial loop over the whole
    batch, 64·24·24 = 36 864 multiply-adds, with nothing to overlap its memory waits with. The fix is to
    give the batch dimension threads too: split the batch into S slices, let thread (s, f, c, p, q) sum
    only the images n ≡ s (mod S) into partial[s, f, c, p, q] — S·150 threads, each S times less work —
    and add the S partial sums in a second small kernel (or with one atomic add per thread into dW,
    the push idea of stage 5). With S = 64, 9 600 threads of 576 terms each. Below, that two-kernel
    version is checked against stage 1 (in float64).
    """
    rng = np.random.default_rng(9)
    N, C, H, F, K, stride, pad, slices = (4, 2, 7, 3, 3, 1, 1, 2) if fast else (16, 1, 12, 6, 5, 1, 0, 8)
    x, w = random_array(rng, N, C, H, H, dtype=np.float32), random_array(rng, F, C, K, K, dtype=np.float32)
    out = (H + 2 * pad - K) // stride + 1
    dy = random_array(rng, N, F, out, out, dtype=np.float32)
    _, expected, _ = s1_loops.conv_backward(dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64),
                                            stride, pad)
    got = filter_gradient_split(dy, x, w.shape, stride, pad, slices)
    print(f"dW with {slices}·{F * C * K * K} threads in two launches, against stage 1: "
          f"rel_error {rel_error(got, expected):.1e}")
    first = next(layer for layer in lenet5().layers if isinstance(layer, Conv))
    threads = first.out_channels * first.in_channels * first.kernel ** 2
    print(f"LeNet-5's first layer: {threads} threads ({-(-threads // 32)} warps); split over 64 slices of a batch "
          f"of 64: {64 * threads:,} threads of {24 * 24:,} terms each")
    assert rel_error(got, expected) < 1e-5 and threads == 150


def launches_by_hand(net) -> dict:
    """Kernels of one stage-4 training step, counted from the notebook's table, by phase.

    Conv or Dense (+ ReLU): forward = the layer's kernel + bias_relu; backward = relu_backward (when a ReLU
    follows) + bias_grad + the weight gradient + the input gradient (not for the first layer, whose input is
    the images). MaxPool: one kernel each way. Flatten: a reshape, no kernel. Then softmax_xent, and sgd_momentum."""
    layers, forward, backward = net.layers, 0, 0
    for index, layer in enumerate(layers):
        first = index == 0
        if isinstance(layer, (Conv, Dense)):
            relu = index + 1 < len(layers) and isinstance(layers[index + 1], ReLU)
            forward += 2
            backward += int(relu) + 2 + (0 if first else 1)
        elif isinstance(layer, MaxPool):
            forward += 1
            backward += 0 if first else 1
    return {"forward": forward, "loss": 1, "backward": backward, "update": 1}


def exercise_2(fast: bool) -> None:
    """Count the launches of one step by hand from the table, and check launches_per_step().

    Answer. LeNet-5 is Conv ReLU Pool Conv ReLU Pool Flatten Dense ReLU Dense ReLU Dense. Forward: 2 per
    Conv or Dense (the layer, then bias_relu) ×5 = 10, plus 1 per MaxPool ×2 = 12. Loss: softmax_xent, 1.
    Backward, from the top: the last Dense 3 (bias_grad, weights, data — no ReLU after it), each Dense with
    a ReLU 4 (relu_backward first) ×2 = 8, each MaxPool 1 ×2 = 2, the second Conv 4, the first Conv 3 (no
    gradient for the images): 20. Update: sgd_momentum, 1. Total 12 + 1 + 20 + 1 = 34 — what
    `launches_per_step()` reports (on a GPU for LeNet-5; in the simulator below for a LeNet-5 with the same
    layer kinds on 12×12 images, which launches exactly the same kernels).
    """
    by_hand = launches_by_hand(lenet5())
    print(f"LeNet-5 by hand: {by_hand} = {sum(by_hand.values())}")
    net = lenet5() if not SIMULATED else tiny_lenet()
    stage = get_stage("cuda")(net).init("he", seed=0)
    rng = np.random.default_rng(10)
    batch = 2 if SIMULATED else 64
    stage.train_step(random_array(rng, batch, *net.input_shape, dtype=np.float32), rng.integers(0, 10, batch), 0.05)
    print(f"{net.name}: launches_per_step() = {stage.launches_per_step()}, "
          f"by hand {sum(launches_by_hand(net).values())}")
    assert sum(by_hand.values()) == 34 == stage.launches_per_step() == sum(launches_by_hand(net).values())


def warp_segments(address_of_thread, threads=32, segment_bytes=128) -> float:
    """Mean number of 128-byte memory segments one warp touches, for thread k reading float address_of_thread(k)."""
    touched = []
    for first in range(0, len(address_of_thread) - threads + 1, threads):
        addresses = 4 * address_of_thread[first:first + threads]
        touched.append(len(np.unique(addresses // segment_bytes)))
    return float(np.mean(touched))


def exercise_3(fast: bool) -> None:
    """Consecutive threads differ in j: which memory do neighbours read from x? And with n fastest?

    Answer. Thread k reads x[n, c, i·s + p − P, j·s + q − P] at tap (c, p, q). With j the fastest index,
    the 32 threads of a warp have the same n, c and (mostly) the same i, and consecutive j: at stride 1
    they read 32 consecutive floats of one row (a row of LeNet-5's first layer output is 24 wide, so a warp
    covers a row and a bit of the next) — the loads coalesce into 2 or 3 128-byte transactions, and the
    same filter weight w[f, c, p, q] is one broadcast. Unravelled with n fastest, the 32 threads of a warp
    would be 32 different images at the same (f, i, j): their reads are C·H·W floats apart (784 for MNIST),
    one 128-byte transaction per thread, 32 per warp load — roughly 10× the memory traffic for the same
    arithmetic, and the writes of y scatter the same way. The counts below are computed from the index
    arithmetic alone (no GPU needed).
    """
    N, C, H, F, K = 64, 1, 28, 6, 5                      # LeNet-5's first convolution, batch 64
    out = H - K + 1
    threads = np.arange(N * F * out * out)

    def x_address(n, i, j):                              # flat index of x[n, 0, i, j]: the tap (c, p, q) = (0, 0, 0)
        return (n * C * H + i) * H + j
    n, _, i, j = np.unravel_index(threads, (N, F, out, out))          # the kernel's order: j fastest
    j_fastest = x_address(n, i, j)
    _, i, j, n = np.unravel_index(threads, (F, out, out, N))          # n fastest
    n_fastest = x_address(n, i, j)
    rows = {"j fastest (the kernel's mapping)": warp_segments(j_fastest), "n fastest": warp_segments(n_fastest)}
    for label, segments in rows.items():
        print(f"{label:<34} {segments:5.2f} 128-byte segments of x per warp load")
    assert rows["j fastest (the kernel's mapping)"] <= 3 and rows["n fastest"] == 32
