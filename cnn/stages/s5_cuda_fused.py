"""Stage 5 ``cuda-fused``: convolution + bias + ReLU + max-pool in one kernel, push-style backprop.

What changes against stage 4 (``cuda``): every Conv → ReLU → MaxPool run of layers becomes ONE
block (``FusedConvPoolBlock``) with two kernels from ``kernels/conv_pool_fused.py``:

- forward: each thread owns one *pooled* output, computes the convolution at every position of
  its pooling window in registers, adds the bias, applies the ReLU, and keeps the max and where it
  was. Only the pooled output and the argmax switches are written: the full-resolution
  convolution output (4× the pooled size for 2×2 pools) never exists in device memory.
- backward, push (scatter) form: each thread owns one element of the pooled gradient and pushes
  it to its window's winner — db[f], the C·K·K weights of dW[f] and the C·K·K input pixels of dX
  under the winner's window — with ``cuda.atomic.add`` where threads collide.

Everything else (dense layers, softmax, SGD, and any Conv not followed by ReLU + MaxPool) is
stage 4's code: this class only overrides ``make_block``. Stage 4's pull kernels stay beside the
push ones; ``ops`` here uses the push kernels for ``conv_backward`` and ``maxpool_backward``, so
``bench --op`` compares pull (stage ``cuda``) with push (stage ``cuda-fused``) one op at a time.

Launches per training step (``launches_per_step()``, counted): LeNet-5 34 → 26, AlexNet-small
42 → 30. Each fused block runs 1 forward kernel instead of 3 (conv, bias_relu, maxpool) and 3
backward kernels instead of 5 (the push kernel and two ``fill`` launches that zero the buffers its
atomics accumulate into, against maxpool, relu, bias, filter and data); 2 instead of 4 for the
network's first layer, which needs no dX.

Memory saved against stage 4 — ``memory_saved(net, batch)`` computes it from the shapes
(model: every kernel reads each buffer it uses once and writes each buffer it produces once,
perfect caching inside a kernel; only what differs between the two stages is counted):

    footprint  stage 4 keeps the conv output y and its gradient (the pool's dx), 2 buffers of
               N·F·Hc·Wc floats per block; stage 5 keeps neither.
    forward    stage 4 writes y, bias_relu reads and rewrites it, maxpool reads it: 4 passes.
    backward   stage 4: maxpool-backward writes dY, relu-backward reads dY and y and writes dZ,
               bias, filter and data kernels each read dZ: 7 passes (6 for the first layer).
               Stage 5 instead reads the pooled y once more and zeroes dW, db and dX.

                              LeNet-5            LeNet-5   AlexNet-small   AlexNet-small
                              batch 1           batch 64         batch 1       batch 128
    footprint saved          35.0 KiB           2.19 MiB       352.0 KiB       44.00 MiB
    forward traffic saved    70.0 KiB           4.38 MiB       704.0 KiB       88.00 MiB
    backward traffic saved   91.2 KiB           6.32 MiB       710.1 KiB      127.20 MiB
    traffic saved, total    161.2 KiB          10.69 MiB        1.38 MiB      215.20 MiB
    pull multiply-adds         0.39 M            25.19 M         22.12 M       2831.16 M   (stage 4 conv backward)
    push atomic adds, max      0.10 M             6.37 M          5.54 M        709.23 M   (stage 5 conv backward)

(``python -c "from cnn.stages.s5_cuda_fused import memory_saved; print(memory_saved('lenet5', 64))"``
prints the per-block rows.)

The trade-off — atomic contention (push) against redundant work and reads (pull). Numbers from
the shape analysis in ``memory_saved`` (nothing in this list is a timing; the timings follow it):

- Push touches only the pooling winners: P = N·F·Hp·Wp threads (¼ of the conv outputs for 2×2
  pools, fewer still where the ReLU is inactive), each issuing up to 1 + C·K²·2 atomic adds.
  But every active thread of filter f adds into the SAME db[f] and the same C·K² weights of
  dW[f]: N·Hp·Wp writers per address (LeNet-5 conv2 at batch 64: 1024 writers on each of
  2 416 addresses; AlexNet-small conv1 at batch 128: 32 768 writers), and the hardware
  serialises colliding atomics. Input pixels see at most F·⌈K/s⌉² writers (non-overlapping pools).
- Pull (stage 4) writes every gradient element exactly once with no atomics, but it walks all
  N·F·Hc·Wc conv positions, three quarters of which carry a zero gradient after a 2×2 pool, and
  re-reads each dY element from C·K² filter threads and K²/s² input threads: 4× the multiply-adds
  of push for 2×2 pools (``pull_multiply_adds`` vs ``push_atomic_adds_max`` in memory_saved).

Measured on a real GPU — written by ``python -m cnn bench --update-docs`` from the committed results
files (``benchmarks/results/``), never by hand:

<!-- generated:gpu-table start -->
Measured on NVIDIA H200, 2026-11-28 (python -m cnn bench; ms a training step, median, phase by phase):

                         cuda (pull)  cuda-fused (push)   launches a step
    LeNet-5 b64                 8.56               3.97          34 -> 26
        (the later run of that day: benchmarks/results/bench-lenet5-b64-intel-xeon-processor-nvidia-h200-2026-11-28.json)
    AlexNet-small b128          31.9               14.8          42 -> 30
        (the later run of that day: benchmarks/results/bench-alexnet-small-b128-intel-xeon-processor-nvidia-h200-2026-11-28.json)

The single operations (conv_backward, maxpool_backward, pull against push) have not been timed on a GPU yet:
    python -m cnn bench --op conv-backward --stage cuda,cuda-fused
    python -m cnn bench --op maxpool-backward --stage cuda,cuda-fused
<!-- generated:gpu-table end -->

The simulator cannot give these: it runs threads one block at a time in Python and its events
return no timing.
"""

from __future__ import annotations

import numpy as np

from cnn.model import Conv, MaxPool, Network, ReLU, get_network, window_count
from cnn.stages.base import Ops
from cnn.stages.s4_cuda import (INDEX, Block, CudaStage, conv_forward, dense_backward, dense_forward,
                                device_empty, device_zeros, layers_match, maxpool_forward, pool_output_shape,
                                relu_backward, relu_forward, to_device)
from kernels import conv2d_push, conv_pool_fused, maxpool
from kernels.fill import fill

FLOAT_BYTES = 4


# -- host wrappers of the push kernels (the ``Ops`` entries that differ from stage 4) -------------
def conv_backward_push(dy, x, W, stride, pad):
    dx, dW, db = device_zeros(x.shape), device_zeros(W.shape), device_zeros(W.shape[:1])
    conv2d_push.conv2d_backward_push(to_device(dy), to_device(x), to_device(W), dx, dW, db, stride, pad)
    return dx.copy_to_host(), dW.copy_to_host(), db.copy_to_host()


def maxpool_backward_push(dy, argmax, x_shape, size, stride):
    dx = device_zeros(x_shape)
    maxpool.maxpool_backward_push(to_device(dy), to_device(argmax, INDEX), dx)
    return dx.copy_to_host()


def conv_relu_pool_forward(x, W, b, stride, pad, size, pool_stride):
    """(y, switches) = maxpool(ReLU(conv(x, W) + b)) in one kernel; switches index the conv-output plane."""
    batch, _, height, width = x.shape
    filters, _, kernel, _ = W.shape
    conv_h, conv_w = window_count(height, kernel, stride, pad), window_count(width, kernel, stride, pad)
    shape = pool_output_shape((batch, filters, conv_h, conv_w), size, pool_stride)
    y, switches = device_empty(shape), device_empty(shape, INDEX)
    conv_pool_fused.conv_relu_pool_forward(to_device(x), to_device(W), to_device(b), y, switches,
                                           stride, pad, size, pool_stride, conv_w)
    return y.copy_to_host(), switches.copy_to_host()


def conv_relu_pool_backward(dy, y, switches, x, W, stride, pad):
    """(dx, dW, db) of the fused block, in push form."""
    conv_w = window_count(x.shape[3], W.shape[2], stride, pad)
    dx, dW, db = device_zeros(x.shape), device_zeros(W.shape), device_zeros(W.shape[:1])
    conv_pool_fused.conv_relu_pool_backward_push(to_device(dy), to_device(y), to_device(switches, INDEX),
                                                 to_device(x), to_device(W), dx, dW, db, stride, pad, conv_w)
    return dx.copy_to_host(), dW.copy_to_host(), db.copy_to_host()


# -- the fused block and the stage -----------------------------------------------------------------
def fusable(layers, index) -> bool:
    """Conv → ReLU → MaxPool starting at ``index``: the run one fused kernel replaces."""
    return layers_match(layers, index, Conv, ReLU, MaxPool)


class FusedConvPoolBlock(Block):
    """Conv → ReLU → MaxPool as one forward kernel and one push-style backward kernel."""

    layer_count = 3

    def __init__(self, stage, index):
        super().__init__(stage, index)
        self.pool = stage.net.layers[index + 2]
        self.conv_width = stage.net.activation_shapes()[index + 1][2]
        slots = [slot for slot in stage.net.param_layout() if slot.layer == index]
        self.param_range = slots[0].offset, slots[-1].offset + slots[-1].size

    @property
    def param_grads(self):
        """dW and db, adjacent in the flat gradient — whichever vector ``stage.d_grad`` is now (stage 6 moves it)."""
        start, end = self.param_range
        return self.stage.d_grad[start:end]

    def forward(self, x):
        self.x = x
        shape = (x.shape[0], *self.out_shape)
        self.y, self.switches = self.buffer("y", shape), self.buffer("switches", shape, INDEX)
        conv_pool_fused.conv_relu_pool_forward(
            x, self.params["W"], self.params["b"], self.y, self.switches, self.layer.stride, self.layer.pad,
            self.pool.size, self.pool.stride, self.conv_width, self.launch)
        return self.y

    def backward(self, dy, need_dx):
        fill(self.param_grads, 0.0, self.launch)            # the atomics accumulate into zeros
        dx = self.buffer("dx", self.x.shape) if need_dx else self.stage.no_dx
        if need_dx:
            fill(dx, 0.0, self.launch)
        conv_pool_fused.conv_relu_pool_backward_push(
            dy, self.y, self.switches, self.x, self.params["W"], dx, self.grads["W"], self.grads["b"],
            self.layer.stride, self.layer.pad, self.conv_width, need_dx, self.launch)
        return dx if need_dx else None


class CudaFusedStage(CudaStage):
    name = "cuda-fused"
    summary = "Numba CUDA: conv+bias+ReLU+max-pool fused in one kernel, push-style (atomic) backward"
    ops = Ops(conv_forward, conv_backward_push, relu_forward, relu_backward,
              maxpool_forward, maxpool_backward_push, dense_forward, dense_backward)

    def __init__(self, net, dtype=np.float32):
        super().__init__(net, dtype)
        self.no_dx = device_empty((1, 1, 1, 1))             # passed when dX is not wanted; never written

    def make_block(self, index):
        if fusable(self.net.layers, index):
            return FusedConvPoolBlock(self, index)
        return super().make_block(index)                     # stage 4's kernels for everything else


# -- what fusion saves, from the shapes alone ------------------------------------------------------
def memory_saved(net: Network | str, batch: int) -> dict:
    """Device memory footprint and traffic stage 5 saves against stage 4, and the backward work of each.

    Per fused block (conv output S = N·F·Hc·Wc floats, pooled P = N·F·Hp·Wp, input X = N·C·H·W):
      footprint_bytes         = 4 · 2S                     (conv output y and its gradient)
      forward_traffic_bytes   = 4 · 4S                     (conv write, bias_relu read+write, pool read)
      backward_traffic_bytes  = 4 · (7S or 6S  −  P − |W| − F − X)   (X only when dX is computed)
      pull_multiply_adds      = F·C·K²·N·Hc·Wc · (2, or 1 without dX)      stage 4, upper bound
      push_atomic_adds_max    = P · (1 + C·K² · (2, or 1 without dX))       stage 5, upper bound
      writers_per_weight      = N·Hp·Wp                    atomic adds landing on each dW/db address
    The model: each kernel reads each buffer it uses once and writes each buffer it produces once.
    """
    net = get_network(net) if isinstance(net, str) else net
    shapes = net.activation_shapes()
    rows = []
    for index in range(len(net.layers)):
        if not fusable(net.layers, index):
            continue
        conv = net.layers[index]
        (channels, height, width), conv_shape, pooled = shapes[index], shapes[index + 1], shapes[index + 3]
        conv_out = batch * int(np.prod(conv_shape))
        pooled_out = batch * int(np.prod(pooled))
        inputs = batch * channels * height * width
        with_dx = index > 0
        taps = channels * conv.kernel ** 2
        weights = conv.out_channels * taps
        zeroed = weights + conv.out_channels + (inputs if with_dx else 0)
        rows.append({
            "layers": f"{index}-{index + 2}",
            "conv_output": conv_shape, "pooled": pooled,
            "footprint_bytes": FLOAT_BYTES * 2 * conv_out,
            "forward_traffic_bytes": FLOAT_BYTES * 4 * conv_out,
            "backward_traffic_bytes": FLOAT_BYTES * ((7 if with_dx else 6) * conv_out - pooled_out - zeroed),
            "pull_multiply_adds": weights * conv_out // conv.out_channels * (2 if with_dx else 1),
            "push_atomic_adds_max": pooled_out * (1 + taps * (2 if with_dx else 1)),
            "writers_per_weight": pooled_out // conv.out_channels,
        })
    totals = {key: sum(row[key] for row in rows)
              for key in ("footprint_bytes", "forward_traffic_bytes", "backward_traffic_bytes",
                          "pull_multiply_adds", "push_atomic_adds_max")}
    totals["traffic_bytes"] = totals["forward_traffic_bytes"] + totals["backward_traffic_bytes"]
    return {"network": net.name, "batch": batch, "blocks": rows, **totals}
