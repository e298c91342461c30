"""Stage 8 ``cuda-fused-net``: the whole training step in three kernels — seed 004's fusion taken to its end.

What changes against stage 7 (``cuda-tuned``)
----------------------------------------------
Stage 7 runs a step as 13–26 kernels (one CUDA graph) that pass every activation and gradient
through global memory. Stage 5 fused one convolution with its ReLU and pooling "to reduce our
memory footprint"; this stage fuses EVERYTHING a group of samples needs, the way tiny-cuda-nn's
"fully fused" networks do: at this size a step costs launches and round trips through memory, not
arithmetic (LeNet-5's step is about 0.1 GFLOP at batch 64: under 2 µs at the H100's FP32 peak).

    kernel 1  ``kernels/fused_net_step.py``   block g owns samples g·S … g·S + S − 1: it gathers them
              from the resident data set (the step counter picks the batch), runs every layer
              forward, the loss, and every layer backward — every activation, pooling switch and
              activation gradient in the block's shared memory, each convolution's weights staged
              there from the L2 cache before they are multiplied — and writes its weight gradients
              to row g of a partials buffer, nothing else but its losses
    kernel 2  ``kernels/fused_net_sum_sgd.py``  thread k adds partials[0, k] + partials[1, k] + …
              in that order and takes the SGD step (momentum, weight decay, lrs[counter]) on weight k
    kernel 3  stage 7's ``finish_step``: the mean loss logged at the counter, the counter advanced

No atomics anywhere: the same run gives the same bits every time (``tests/test_cuda_fused_net.py``
proves it), which stage 5's push kernels could not. Stage 7's machinery is reused as it is: the
data resident on the device, ``DeviceEpoch`` (the epoch's order and learning rates on the device,
a request of ``SYNC_EVERY`` steps, one wait), the step recorded once as a CUDA graph and replayed.
The test set is scored by kernel 1 in evaluation mode, all of it in one launch.

Which layers are fused, and why all of them fit
-----------------------------------------------
The network becomes a *layer table* (``kernels/fused_net_table.py``) that the one kernel walks:
a Conv with the ReLUs and the MaxPool after it is one WINDOW row (max(ReLU(z)) = ReLU(max(z)), so
either order is one row), a Dense with its ReLU one DENSE row, a Flatten nothing at all (a block
keeps each sample's activations in C order already); a pool that follows a pool, or a ReLU that
opens the network, is a WINDOW row with no convolution. Any network of the course's layer list
runs, the reduced copies and the odd shapes of the tests included. A pooled convolution never
stores its full output: each item computes the conv outputs of its pooling window and keeps only
the maximum and where it was — stage 5's idea, so AlexNet-small's first convolution (32×32×32
floats before pooling, 128 KiB) takes 32 KiB of pooled output and 8 KiB of switches (one byte a
window). Where even one sample does not fit in the 227 KiB a block may have, the stage refuses in
one line at construction (``ValueError: … cannot be fused: 1 sample(s) a block need …``), never a
wrong answer.

Shared memory a block, one sample (``TableBuilder.plan``; ``tests`` check the totals):

    KiB            input  outputs  gradients  switches  dW parts  staging   total   of 227 KiB (H100, one block)
    LeNet-5          3.1      5.2       24.0       1.1       5.3     14.1    52.7
    AlexNet-small   15.2     72.4       64.0      11.0       0.0     51.6   214.2

(outputs: each stored with the zero border of the convolution that reads it; gradients: two
buffers of the largest output taking turns backward, the forward pass's scratch meanwhile — a
Dense row's partial dot products, a split convolution's partial sums; staging: the weights being
multiplied, as many filter rows at a time as the rest of the 227 KiB leaves room for.) A block
holds S samples when the batch gives every SM two blocks anyway and they fit: S = 1 at batch 64
and 128.

Thread-to-data mapping (``kernels/fused_net_window.py`` and ``fused_net_layers.py`` have each
function's): thread t of a block takes items t, t + T, …; a forward convolution item is 8 filters
× the 4 positions of a 2×2 pooling window, a 4 × 8 register tile: a tap loads 4 inputs and 8 staged
weights for 32 multiply-adds (the weights the same for a warp's 32 lanes: broadcasts). A dW item
is one channel × 8 neighbouring taps of a filter row (pooled form: only each window's winner has a
gradient; the 8 inputs one address apart), a dL/dx item 8 channels at one input pixel. Where a
layer has fewer items than threads, the table splits the longest sums: LeNet-5's conv2 forward
into 6 slices of its 30 filter rows (192 items, not 32), its conv1 dW into 9 parts of its 144
windows (270 items, not 30), the parts added afterwards in a fixed order. Every value is summed by
one thread in a fixed order, and the splits are planned for the H100's 512 threads whatever a
block really has, so the bits depend on neither.

Compiled for sm_90 without a GPU (``python -m cnn bench --static cuda-fused-net``, issue 22's
report; the instruction counts of the inner loops are read from the same SASS):

    kernel 1                       before (commit cfa6962)            now
    registers, warps an SM         168, 12 (384 threads)              128, 16 (512 threads); no spill
    forward tap                    112 instructions, 16 FFMA (7.0)    208 for 4 taps, 128 FFMA (1.6)
    dW, a pooling window           59 instructions, 4 FFMA (14.8)     38.5, 8 FFMA (4.8)
    dL/dx, a window covering       87 instructions, 4 FFMA (21.8)     42, 8 FFMA (5.3)
    Dense forward, a multiply-add  18.5 instructions                  4.1
    Dense dL/dx, a multiply-add    21.5 instructions                  5.6
    kernel 2 (sum + SGD)           29 registers                       29 (``kernels/sgd.momentum_step``)

What changed, each found in the SASS: the convolution's weights come from shared memory, staged
once for all the block's items (they were a 64-bit global load per tap); inputs are stored with a
zero border, so no tap tests for the padding; the tile grew from 4 × 4 to 4 × 8; inner loops are
``while`` loops over an index (Numba's ``range`` keeps 3–5 instructions of trip count per iteration,
even unrolled); divisions are 32-bit (``split``: Numba divides in 64 bits, a test and a call to a
70-instruction routine); the switches are one byte (44 KiB → 11 KiB on AlexNet-small: room to
stage conv2's weights in 2 steps, not 4); the ReLU mask is applied by whoever writes a gradient,
not in a phase of its own.

What it buys — PREDICTED first, then measured
---------------------------------------------
Kernel 1 is one block a sample on 64 (LeNet-5) or 128 (AlexNet-small) of the H100's 132 SMs, one
wave: its time is one block's. ``kernels/fused_net_cost.py`` predicts it phase by phase from the
same layer table the kernel walks: a phase takes the largest of its instructions issued 4 a cycle,
its busiest warp's instructions one every 2 (low end) to 5.65 cycles (high end: issue 22's
calibration, a scheduler needs 22.6 warps an SM to hide latency and this kernel has 16), and its
shared-memory loads one a cycle; plus its waits for global memory (281 cycles to 0.654 µs each)
and its barriers. The partial sums go through HBM twice (G·P·4 bytes, at 3.35 TB/s); kernels 2 and
3 take at least 2.5 µs (low) or cost 5 µs more than their work (high, issue 22's floor); the graph
replays the 3 kernels at 1 µs each.

    ms a step, H100           stage 7 (MEASURED)  PyTorch graph (MEASURED)  cuda-fused-net (PREDICTED)
    LeNet-5 b64                      1.01                 0.255                  0.03 – 0.09
    AlexNet-small b128              11.0                  0.689                  0.37 – 0.60

(Stage 7 and PyTorch: ``benchmarks/results/bench-*-nvidia-h100-80gb-hbm3-2026-11-23.json``. The
first version of this stage was predicted at 0.07–0.12 and 0.77–1.51 ms by an earlier, more
optimistic model: 2–4 cycles an instruction, no memory waits.) So, by this prediction, the fused
step beats PyTorch's CUDA graph on both networks — LeNet-5 2.9–7.5×, AlexNet-small 1.14–1.87× —
and stage 7 by 11–30×; it reaches issue 21's targets (0.05 and 0.50 ms) only at the low end. What
the high end spends: AlexNet-small's dW (its loads feed one multiply-add each: the shared memory's
one load a cycle bounds it) and staging conv3's 200 KiB of weights in 4 steps; LeNet-5's waits on
global memory (Dense weights, staging) at 0.654 µs each. ``sh benchmarks/gpu_session.sh fused-net``
measures all of it on a GPU: the stage's gpu tests, the bench beside stage 7 and PyTorch (eager and
one graph) on both networks, Nsight Compute's time of each kernel, and 10 epochs of MNIST. What it
measured — written by ``python -m cnn bench --update-docs`` from the results files, never by hand;
each row says whether the measurement fell below, within or above the range predicted for the H100
(the H200 has the same 132 SMs at the same clock, and more, faster memory):

<!-- generated:gpu-measured start -->
Measured on NVIDIA H200, 2026-11-28 (python -m cnn bench; ms a training step, steps back to back, median of 5 runs and their range):

                         stage 7  PyTorch graph   cuda-fused-net        PREDICTED (H100)
    LeNet-5 b64            0.347          0.250   0.102 (0.102–0.103)   0.03 – 0.09: above
        (benchmarks/results/bench-lenet5-b64-intel-xeon-processor-nvidia-h200-2026-11-28-fused-net.json)
    AlexNet-small b128      2.43          0.670   0.599 (0.598–0.627)   0.37 – 0.60: within
        (benchmarks/results/bench-alexnet-small-b128-intel-xeon-processor-nvidia-h200-2026-11-28-fused-net.json)

Kernel 1 alone, Nsight Compute (its default replay flushes the caches before the kernel):

    LeNet-5 b64            111 µs   PREDICTED 25 – 70 µs: above  (nvidia-h200, 2026-11-28)
        (benchmarks/results/ncu-cuda-fused-net-lenet5-b64-nvidia-h200-2026-11-28.csv)
    AlexNet-small b128     886 µs   PREDICTED 339 – 568 µs: above  (nvidia-h200, 2026-11-28)
        (benchmarks/results/ncu-cuda-fused-net-alexnet-small-b128-nvidia-h200-2026-11-28.csv)

Training, 10 epochs of MNIST (LeNet-5, batch 64): 99.26% test accuracy,
    0.095 s of training an epoch after the first (9.7 s: it compiles every kernel)
        (benchmarks/results/train-lenet5-cuda-fused-net-10ep-nvidia-h200-2026-11-28.json)
<!-- generated:gpu-measured end -->
"""

from __future__ import annotations

import numpy as np

from cnn.model import Conv, Dense, Flatten, MaxPool, ReLU
from cnn.stages.base import Stage
from cnn.stages.device_epoch import DeviceEpoch, resident_set
from cnn.stages.s4_cuda import INDEX, CudaStage
from cnn.stages.s7_cuda_tuned import SYNC_EVERY
from kernels.device import cuda, simulated
from kernels.device_epoch import finish_step, sum_scores
from kernels.fused_net_cost import Prediction, predict
from kernels.fused_net_step import H100_SHARED_LIMIT, THREADS, fused_net_scores, fused_net_step, shared_memory_limit
from kernels.fused_net_sum_sgd import sum_partials, sum_sgd
from kernels.fused_net_table import TableBuilder
from kernels.launch import WARP
from kernels.launch_config import multiprocessors
from kernels.sgd import sgd_momentum
from kernels.streams import StreamLaunchCounter


def layer_table(net) -> TableBuilder:
    """The network as fused operations (``kernels/fused_net_table.py``), the parameter offsets from its layout."""
    builder = TableBuilder(net.input_shape)
    offsets = {slot.layer: slot.offset for slot in net.param_layout() if slot.name == "W"}
    for index, layer in enumerate(net.layers):
        if isinstance(layer, Conv):
            builder.conv(layer.out_channels, layer.kernel, layer.stride, layer.pad, offsets[index])
        elif isinstance(layer, ReLU):
            builder.relu()
        elif isinstance(layer, MaxPool):
            builder.pool(layer.size, layer.stride)
        elif isinstance(layer, Flatten):
            builder.flatten()
        elif isinstance(layer, Dense):
            builder.dense(layer.out_features, offsets[index])
        else:
            raise TypeError(f"stage 'cuda-fused-net': unknown layer {layer!r}")
    return builder


#: the H100's (and H200's) streaming multiprocessors, which the prediction is made for
H100_SMS = 132


def predicted_step(net, batch: int) -> Prediction:
    """``kernels/fused_net_cost.py``'s PREDICTED H100 step of ``net`` at ``batch`` (132 SMs, the samples a block
    the table would choose there): the figures of this module's docstring."""
    builder = layer_table(net)
    return predict(builder, net.num_params, batch, builder.samples_for(batch, H100_SHARED_LIMIT, H100_SMS), THREADS)


class CudaFusedNetStage(CudaStage):
    name = "cuda-fused-net"
    summary = ("Numba CUDA: a group of samples' whole forward, loss and backward in ONE kernel (every activation "
               "in shared memory), the gradient summed in a fixed order + SGD in a second: 3 kernels, one graph")
    ops = None                                # no kernel per operation: ``bench --op`` skips the stage

    def __init__(self, net, dtype=np.float32, samples_per_block: int | None = None, threads: int = THREADS,
                 poison: bool | None = None, graphs: bool = True, shared_bytes: int | None = None):
        try:
            self.builder = layer_table(net)
        except ValueError as err:
            raise ValueError(f"stage {self.name!r}: network {net.name!r} cannot be fused: {err}") from None
        self.samples_per_block, self.threads = samples_per_block, threads
        self.poison = simulated() if poison is None else poison
        self.tables = {}                      # samples a block -> Plan with its table on the device
        super().__init__(net, dtype)
        self.shared_limit = shared_memory_limit() if shared_bytes is None else shared_bytes
        if samples_per_block is not None and samples_per_block < 1:
            raise ValueError(f"stage {self.name!r}: samples_per_block must be at least 1, got {samples_per_block}")
        if threads < WARP or threads % WARP:
            raise ValueError(f"stage {self.name!r}: threads must be a positive multiple of {WARP}, got {threads}")
        self.table_for(samples_per_block or 1)                 # a network that cannot be fused fails here
        self.d_zero = cuda.to_device(np.zeros(1, INDEX))       # position 0: a batch that starts at row 0
        self.d_no_lrs = cuda.to_device(np.zeros(1, np.float32))
        self.identities, self.zero_labels = {}, {}     # count -> order 0, 1, …, count − 1 / labels 0 on the device
        self.d_train = self.d_test = None
        self.steps_per_sync = SYNC_EVERY
        self.epoch_state = DeviceEpoch(self.stream, 1, self.queue_device_step, use_graphs=graphs)

    def make_launcher(self):
        self.stream = cuda.stream()
        return StreamLaunchCounter(self.stream)

    def build_blocks(self):
        return []                             # no blocks: the whole network is one table

    # -- the layer table for a batch size --------------------------------------------------------
    def samples_for(self, batch: int) -> int:
        """Samples a block: as given, else the table's choice for this batch (``TableBuilder.samples_for``)."""
        if self.samples_per_block is not None:
            return self.samples_per_block
        return self.builder.samples_for(batch, self.shared_limit, multiprocessors())

    def table_for(self, samples: int):
        if samples not in self.tables:
            try:
                plan = self.builder.plan(samples, self.shared_limit, self.poison)
            except ValueError as err:
                raise ValueError(f"stage {self.name!r}: network {self.net.name!r} cannot be fused: {err}") from None
            self.tables[samples] = plan._replace(table=cuda.to_device(plan.table))
        return self.tables[samples]

    def identity(self, count: int):
        if count not in self.identities:
            self.identities[count] = cuda.to_device(np.arange(count, dtype=INDEX))
        return self.identities[count]

    def no_labels(self, count: int):
        if count not in self.zero_labels:
            self.zero_labels[count] = cuda.to_device(np.zeros(count, dtype=INDEX))
        return self.zero_labels[count]

    # -- one training step: the fused kernel, the sum, the update ----------------------------------
    def queue_fused_step(self, images, labels, order, position, batch: int) -> None:
        """Kernel 1 on the batch order[position·B …] of the (N, D) ``images``: row losses and partial sums."""
        plan = self.table_for(self.samples_for(batch))
        groups = -(-batch // plan.samples)
        self.d_partials = self.buffers.get("partials", (groups, self.net.num_params))
        self.d_row_loss = self.buffers.get("row-loss", (batch,))
        fused_net_step(plan, self.d_params, images, labels, order, position, batch, self.d_partials,
                       self.d_row_loss, self.threads, self.launch)

    def forward(self):
        """Kernel 1: forward, loss AND backward (they are one kernel); the gradient waits in the partials."""
        batch = self.d_images.shape[0]
        images = self.d_images.reshape((batch, self.d_images.size // batch))
        self.queue_fused_step(images, self.d_labels, self.identity(batch), self.d_zero, batch)

    def backward(self):
        """Kernel 2 without its update: the partial sums added into the flat gradient."""
        sum_partials(self.d_partials, self.d_grad, self.d_params, self.d_velocity, self.d_no_lrs, self.d_zero,
                     self.launch)

    def update(self, lr, momentum, weight_decay):
        sgd_momentum(self.d_params, self.d_velocity, self.d_grad, lr, momentum, weight_decay, self.launch)
        self.count_step_launches()

    def fetch_loss(self):
        rows = self.d_row_loss.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return float(rows.sum(dtype=np.float64) / len(rows))

    def predict(self, images):
        d_images = self._images(images, "predict-images")
        count = d_images.shape[0]
        logits = self.scores(d_images.reshape((count, d_images.size // count)), self.no_labels(count), count)
        return logits.copy_to_host(stream=self.stream)

    def scores(self, images, labels, count):
        """Kernel 1 in evaluation: logits, loss and right-or-wrong of samples 0 … count − 1; the logits."""
        logits = self.buffers.get("logits", (count, self.net.num_classes))
        self.d_scored_loss = self.buffers.get("scored-loss", (count,))
        self.d_correct = self.buffers.get("correct", (count,))
        fused_net_scores(self.table_for(self.samples_for(count)), self.d_params, images, labels, self.identity(count),
                         self.d_zero, count, logits, self.d_scored_loss, self.d_correct, self.threads, self.launch)
        return logits

    # -- an epoch on the device -----------------------------------------------------------------------
    def load_dataset(self, train_images, train_labels, test_images=None, test_labels=None):
        Stage.load_dataset(self, train_images, train_labels, test_images, test_labels)
        images, self.d_train_labels = resident_set(self, train_images, train_labels, "training")
        self.d_train = images.reshape((len(images), images.size // max(1, len(images))))
        if test_images is not None:
            images, self.d_test_labels = resident_set(self, test_images, test_labels, "test")
            self.d_test = images.reshape((len(images), images.size // max(1, len(images))))
            self.d_totals, self.host_totals = cuda.device_array(2, np.float64), cuda.pinned_array(2, np.float64)
        self.epoch_state.drop_graphs()                     # the graphs read the old training set

    def begin_epoch(self, order, lrs, batch_size, momentum, weight_decay):
        super().begin_epoch(order, lrs, batch_size, momentum, weight_decay)
        self.epoch_state.begin(self.plan)

    def run_steps(self, first, count):
        if self.d_train is None:
            raise RuntimeError(f"stage {self.name!r}: run_steps needs the data on the device; call load_dataset first")
        return self.epoch_state.run(first, count)

    def queue_device_step(self, slot: int) -> None:
        """The step the graph records: kernel 1 on the batch at the step counter, kernel 2 (sum + SGD at
        lrs[counter]), then stage 7's finish_step (the mean loss logged, the counter advanced)."""
        epoch, plan = self.epoch_state, self.plan
        self._step_start = self.launch.count
        self.queue_fused_step(self.d_train, self.d_train_labels, epoch.order, epoch.counter, plan.batch_size)
        sum_sgd(self.d_partials, self.d_grad, self.d_params, self.d_velocity, epoch.lrs, epoch.counter,
                plan.momentum, plan.weight_decay, self.launch)
        finish_step(self.d_row_loss, epoch.counter, epoch.loss_log, epoch.first_bad, self.launch)
        self.count_step_launches()

    def launches_per_step(self) -> int:
        """Kernels the host queued for the last step; 1 once steps are replayed as a CUDA graph."""
        return 1 if self.epoch_state.graphs else super().launches_per_step()

    def test_scores(self, count=None):
        """The test set scored on the device in one launch, then added up in a fixed order: two numbers back."""
        if self.d_test is None:
            return super().test_scores(count)
        count = len(self.d_test) if count is None else min(count, len(self.d_test))
        self.scores(self.d_test, self.d_test_labels, count)
        sum_scores(self.d_correct, self.d_scored_loss, count, self.d_totals, self.launch)
        self.d_totals.copy_to_host(self.host_totals, stream=self.stream)
        self.stream.synchronize()
        return int(round(self.host_totals[0])), float(self.host_totals[1])
