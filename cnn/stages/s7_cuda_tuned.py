"""Stage 7 ``cuda-tuned``: stage 6 with the fixes its profile asks for, each one a switch.

``CudaTunedStage(net, fixes=FIXES)`` is ``cuda-ring`` plus the fixes named in ``fixes`` (all of
them by default; ``fixes=()`` runs exactly stage 6's kernels), so that each can be measured on
its own — the ablation ``python -m cnn bench --ablation`` (``cnn/bench/ablation.py``).

The profile first (``cuda-ring``, where the time goes)
-------------------------------------------------------
Counted per training step in Numba's CUDA simulator by ``cnn/bench/census.py`` (counts are exact
there; times are not, so none is given). LeNet-5 and AlexNet-small, batch 2, 4 steps run as the
trainer runs them (``run_steps``: one request of 4 steps) — every count but the bytes is the same
at any batch size and layer width; bytes are per sample:

    python -m cnn bench --census                            (in the simulator add --reduced:
                                                             at full width it takes tens of minutes)

    per training step                          LeNet-5               AlexNet-small
                                        cuda-ring  cuda-tuned   cuda-ring  cuda-tuned
    kernel launches                            26          21          30          26
    array arguments of those launches          81         110          96         142
    host→device copies                          2        0.25           2        0.25
      bytes per sample                       3140           1       12292           1
    device→host copies (besides the ring)       1         0.5           1         0.5
    device allocations after warm-up            0           0           0           0
    host launch µs, numba-cuda#288's rate   455.1       523.6       534.0       668.6
    host launch µs, H100-measured rate     1190.1      1342.0      1394.8      1711.2

(Counted in the simulator with ``--reduced``, on the narrow copies of the two networks that the
tests use — same layers, so the same launches and arguments; the bytes are the full-size images'
28·28·4 and 3·32·32·4, plus a 4-byte label. cuda-tuned's copies are per request: the step
counter up, the loss log and the flags down, once for the 4 steps; the trainer asks for
``SYNC_EVERY`` = 100 at a time.)

The last two rows price the counts, neither is a measurement of this stage: at numba-cuda's own figures
(6.6 µs a launch plus 3.5 µs an array argument, NVIDIA/numba-cuda#288, on its developers' machine),
and at the rate MEASURED on the course's H100 (27.7 µs with one array argument, 87.5 µs with eight:
19.2 + 8.5 µs an array; ``benchmarks/results/probes-…json``, quoted below). Counted
kernel by kernel, cuda-tuned queues as many as cuda-ring (the tiled convolutions take 3–4 kernels a
block where the push kernels took 1–2); with ``cuda-graph`` on a GPU all of them are ONE graph launch
a step.

Measured on a GPU — the launch cost, and where the kernel time of a cuda-tuned step goes (Nsight
Compute; the kernel-by-kernel tables are in ``docs/profiling.md``), written by
``python -m cnn bench --update-docs`` from the committed results files, never by hand:

<!-- generated:gpu-profile start -->
    numba-cuda launch, host time: 27.7 µs with one array argument, 87.5 µs with eight; a CUDA graph replays
    1 µs a kernel (NVIDIA H100 80GB HBM3, 2026-11-23: benchmarks/results/probes-nvidia-h100-80gb-hbm3-2026-11-23-f5350bb.json)

    LeNet-5 b64, nvidia-h100-80gb-hbm3, 2026-11-23, commit f5350bb: 0.621 ms of kernel time a step; conv backward 70 %, conv forward 10 %, dense 17 %
        (benchmarks/results/ncu-cuda-tuned-lenet5-b64-nvidia-h100-80gb-hbm3-2026-11-23-f5350bb.csv)
    AlexNet-small b128, nvidia-h100-80gb-hbm3, 2026-11-23, commit f5350bb: 11.2 ms of kernel time a step; conv backward 82 %, conv forward 17 %, dense 2 %
        (benchmarks/results/ncu-cuda-tuned-alexnet-small-b128-nvidia-h100-80gb-hbm3-2026-11-23-f5350bb.csv)
    LeNet-5 b64, nvidia-h100-80gb-hbm3, 2026-11-23, the later run of that day: 1.07 ms of kernel time a step; conv backward 69 %, conv forward 13 %, dense 16 %
        (benchmarks/results/ncu-cuda-tuned-lenet5-b64-nvidia-h100-80gb-hbm3-2026-11-23.csv)
    AlexNet-small b128, nvidia-h100-80gb-hbm3, 2026-11-23, the later run of that day: 11.1 ms of kernel time a step; conv backward 84 %, conv forward 14 %, dense 2 %
        (benchmarks/results/ncu-cuda-tuned-alexnet-small-b128-nvidia-h100-80gb-hbm3-2026-11-23.csv)
    LeNet-5 b64, nvidia-h200, 2026-11-28: 0.412 ms of kernel time a step; conv backward 57 %, conv forward 16 %, dense 23 %
        (benchmarks/results/ncu-cuda-tuned-lenet5-b64-nvidia-h200-2026-11-28.csv)
    AlexNet-small b128, nvidia-h200, 2026-11-28: 2.62 ms of kernel time a step; conv backward 69 %, conv forward 25 %, dense 6 %
        (benchmarks/results/ncu-cuda-tuned-alexnet-small-b128-nvidia-h200-2026-11-28.csv)
<!-- generated:gpu-profile end -->

The host profile (cProfile or pyinstrument) and the per-kernel device times of cuda-ring itself —
NOT YET MEASURED ON A GPU. On a GPU machine::

    python -m cnn bench --profile cuda-ring --model lenet5 --batch-size 64 --data random
    python -m cnn bench --profile cuda-ring --model alexnet-small --batch-size 128 --data random
    nsys profile -o ring python -m cnn bench --stage cuda-ring --model lenet5 --batch-size 64 --data random
    ncu --set full -k regex:conv_relu_pool -c 4 python -m cnn bench --stage cuda-ring --steps 3 --warmup 1

The fixes (``FIXES``, in the order the ablation adds them)
---------------------------------------------------------
    resident-data   the training and test sets live on the device (``load_dataset``); ``begin_epoch``
                    uploads the epoch's order once; one gather kernel makes each batch
                    (``kernels/gather.py``): no host→device copy and no host-side gather per step.
    pinned-buffers  batches (when not resident) and the loss go through preallocated pinned host
                    buffers: DMA straight from them, no staging copy by the driver.
    overlap-copies  ``run_steps`` copies batch t+1 to the device on a second stream, into a second
                    set of input buffers, while step t computes (needs pinned-buffers).
    fused-loss      last Dense + bias + softmax + cross-entropy + dL/dlogits in one kernel
                    (``kernels/dense_loss.py``): 3 launches → 1, no logits round trip.
    fewer-launches  Dense layers as one launch forward (bias and ReLU in the product's epilogue) and
                    two backward (db summed by the dW kernel, the ReLU mask applied as dX is written);
                    every buffer the push kernels accumulate into zeroed by ONE launch
                    (``kernels/dense_fused.py``, ``kernels/fill_pair.py``).
    smem-weights    the fused conv kernels hold their block's filter in shared memory, and the push
                    backward adds dW and db up in shared memory before one global atomic per weight
                    and block (``kernels/conv_pool_smem.py``).
    launch-config   block sizes and matrix tiles chosen from each layer's shape so small layers still
                    fill the GPU (``kernels/launch_config.py``; configures the kernels of
                    fewer-launches and smem-weights, which it needs).
    tiled-conv      the profile's largest item — the conv backward kernels, 70 % (LeNet-5) and 82 %
                    (AlexNet-small) of the kernel time on an H100, direct loops with an atomic add per
                    tap — replaced: forward, dW and dX become implicit matrix products
                    (``kernels/implicit_gemm.py``, ``kernels/conv_gemm.py``) with shared-memory tiles
                    and a block of results in each thread's registers; bias, ReLU and pooling are
                    applied in registers; dX is pulled, dW split over blocks and summed in a fixed
                    order: no atomics, so a run is the same bit for bit every time. The dense layers go
                    through the same product (``kernels/dense_gemm.py``). Measured at commit ecf7081 it
                    made both networks slower (0.53x LeNet-5, 0.82x AlexNet-small alone, below): the
                    loaders divided integers for every element, and numba-cuda typed a 14-number tuple
                    three times a launch. Rewritten after the static sm_90 report (issue 22,
                    ``python -m cnn bench --static cuda-tuned``): no integer division in any loop, no
                    branch around a load, the next k-slice loaded while this one is multiplied, the
                    layer's sizes in one small array — PREDICTED below, measured since on an H200
                    (docs/profiling.md: its ablation and the prediction beside each measurement).
    device-epoch    the trainer's loop moves to the device: each step's batch, learning rate and loss
                    are looked up or written by the kernels at a step counter in device memory
                    (``kernels/device_epoch.py``, ``cnn/stages/device_epoch.py``); the host asks for
                    ``SYNC_EVERY`` steps at a time and waits once for their losses; evaluation is
                    scored on the device (needs resident-data and fused-loss).
    cuda-graph      that step — gather, forward, loss, backward, SGD, loss log — recorded once as a
                    CUDA graph and replayed: one launch a step instead of one per kernel
                    (``kernels/step_graph.py``; one graph per gradient slot of the ring). In the
                    simulator, which cannot record, the same step runs eagerly.

What the rewritten tiled-conv is PREDICTED to do on the H100 — from the machine code, by the model of
``cnn/bench/predict_step.py`` calibrated on the committed measurements (``python -m cnn bench --predict``
writes it; ``sh benchmarks/gpu_session.sh predict`` measures it):

<!-- generated:prediction start -->
    PREDICTED, not measured (benchmarks/results/predict-h100-sm90.json, commit 07d8998+; the model's error on every
    committed H100 step of stages 4-7 is at most 1.46x):
        lenet5 b64: 0.641 ms a step as one CUDA graph, 2.73 ms launched kernel by kernel
        alexnet-small b128: 2.89 ms a step as one CUDA graph, 3.41 ms launched kernel by kernel
        lenet5 b64, ablation '+ tiled-conv alone': tiled-conv buys x1.07 (3.2 -> 2.98 ms)
        lenet5 b64, ablation '…, launch-config, tiled-conv': tiled-conv buys x0.76 (2.06 -> 2.71 ms)
        alexnet-small b128, ablation '+ tiled-conv alone': tiled-conv buys x3.21 (14.6 -> 4.54 ms)
        alexnet-small b128, ablation '…, launch-config, tiled-conv': tiled-conv buys x2.12 (8.69 -> 4.1 ms)
<!-- generated:prediction end -->

The profile after, and what each fix bought
-------------------------------------------
``python -m cnn bench --ablation --model M --batch-size B`` times cuda-ring, each fix alone on top
of what it needs, and the fixes added one by one (``benchmarks/results/ablation-*.json``; refuses
in the simulator); ``python -m cnn bench --stage ...`` puts the stages beside PyTorch, eager and
as one CUDA graph, phase by phase and back to back. The measured tables are in
``docs/profiling.md``, generated from the committed results files.

Targets (H100, issue 14): LeNet-5 b64 ≤ 0.10 ms a step back to back (PyTorch as a CUDA graph:
0.284 ms); AlexNet-small b128 ≤ 0.50 ms (PyTorch as a graph: 0.673 ms; the arithmetic floor at
FP32 peak is about 0.14 ms); ``python -m cnn train --stage cuda-tuned --epochs 10`` ≤ 0.3 s of
training an epoch at ≥ 99.0 %.

Every fix but the three epoch fixes acts on each ``train_step``; those three act on the epoch API
the trainer uses (``cnn/stages/base.py``): ``load_dataset``, ``begin_epoch``, ``run_steps``,
``test_scores``.
"""

from __future__ import annotations

import numpy as np

from cnn.model import Dense, ReLU
from cnn.stages.device_epoch import DeviceEpoch, resident_set
from cnn.stages.s4_cuda import INDEX, layers_match
from cnn.stages.s5_cuda_fused import fusable
from cnn.stages.s6_cuda_ring import CudaRingStage
from cnn.stages.s7_blocks import DenseLossBlock, TunedConvPoolBlock, TunedDenseBlock, wire_masks
from kernels.dense_loss import MAX_CLASSES
from kernels.device import cuda
from kernels.device_epoch import finish_step, gather_step_batch, score_rows, sgd_scheduled, sum_scores
from kernels.fill_pair import zero_pair
from kernels.gather import gather_batch
from kernels.launch_config import LaunchConfig
from kernels.streams import new_event

FIXES = ("resident-data", "pinned-buffers", "overlap-copies", "fused-loss", "fewer-launches", "smem-weights",
         "launch-config", "tiled-conv", "device-epoch", "cuda-graph")
REQUIRES = {"overlap-copies": ("pinned-buffers",), "launch-config": ("fewer-launches", "smem-weights"),
            "device-epoch": ("resident-data", "fused-loss"), "cuda-graph": ("device-epoch",)}
SYNC_EVERY = 100              # device-epoch: steps the trainer asks for at once (one wait each)
EVAL_BATCH = 1000             # test images scored per forward pass on the device


def check_fixes(fixes) -> tuple[str, ...]:
    """The fixes in course order; one-line errors for an unknown fix or a missing prerequisite."""
    fixes = (fixes,) if isinstance(fixes, str) else tuple(fixes)
    unknown = [fix for fix in fixes if fix not in FIXES]
    if unknown:
        raise ValueError(f"stage 'cuda-tuned': unknown fix {unknown[0]!r}; choose from {', '.join(FIXES)}")
    for fix in fixes:
        missing = [need for need in REQUIRES.get(fix, ()) if need not in fixes]
        if missing:
            raise ValueError(f"stage 'cuda-tuned': fix {fix!r} needs {' and '.join(missing)} as well")
    return tuple(fix for fix in FIXES if fix in fixes)


def with_requirements(*fixes) -> tuple[str, ...]:
    """``fixes`` and everything they need, and what that needs in turn."""
    wanted, added = set(fixes), True
    while added:
        needs = {need for fix in wanted for need in REQUIRES.get(fix, ())}
        added = not needs <= wanted
        wanted |= needs
    return check_fixes(wanted)


class CudaTunedStage(CudaRingStage):
    name = "cuda-tuned"
    summary = ("Numba CUDA: stage 6 + profile-driven fixes (resident data, fused loss, fewer launches, tiled "
               "implicit-GEMM convolutions, the epoch on the device, one CUDA graph a step)")

    def __init__(self, net, dtype=np.float32, fixes=FIXES, slots: int = 2, **ring_options):
        self.fixes = check_fixes(fixes)
        self.config = LaunchConfig(self.has("launch-config"))
        self.fused_loss = (self.has("fused-loss") and isinstance(net.layers[-1], Dense)
                           and net.num_classes <= MAX_CLASSES)
        super().__init__(net, dtype, slots, **ring_options)
        self.input_stream = cuda.stream() if self.has("overlap-copies") else self.stream
        self.loaded = new_event()
        self.pinned = {}                     # (shape, dtype, buffer) -> pinned host staging array
        self.host_rows = {}                  # batch -> host array for the per-row losses
        if self.has("pinned-buffers"):
            self.host_loss = cuda.pinned_array(1, dtype=np.float32)
        self.d_train = self.d_test = None
        self.epoch_state = None
        if self.has("device-epoch"):
            self.steps_per_sync = SYNC_EVERY
            self.epoch_state = DeviceEpoch(self.stream, self.ring.slots, self.queue_device_step,
                                           self.has("cuda-graph"))

    def has(self, fix: str) -> bool:
        return fix in self.fixes

    # -- blocks ---------------------------------------------------------------------------------
    def build_blocks(self):
        blocks = super().build_blocks()
        wire_masks(blocks)
        self.arena_blocks = [block for position, block in enumerate(blocks)
                             if position > 0 and isinstance(block, TunedConvPoolBlock) and block.prezeroed]
        self.arena_views, self.arena_batch = {}, None
        return blocks

    def make_block(self, index):
        layers = self.net.layers
        if fusable(layers, index):
            return TunedConvPoolBlock(self, index)
        if isinstance(layers[index], Dense):
            relu, fused, tiled = layers_match(layers, index + 1, ReLU), self.has("fewer-launches"), self.has("tiled-conv")
            if self.fused_loss and index == len(layers) - 1:
                return DenseLossBlock(self, index, relu, fused, tiled)
            if fused or tiled:
                return TunedDenseBlock(self, index, relu, fused, tiled)
        return super().make_block(index)

    # -- forward, backward, loss ----------------------------------------------------------------
    def forward(self):
        if not self.fused_loss:
            return super().forward()
        x = self.d_images
        for block in self.blocks[:-1]:
            x = block.forward(x)
        batch = x.shape[0]
        self.d_dlogits = self.buffers.get("dlogits", (batch, self.net.num_classes))
        self.d_row_loss = self.buffers.get("row-loss", (batch,))
        self.blocks[-1].forward_loss(x, self.d_labels, self.d_dlogits, self.d_row_loss)

    def backward_blocks(self):
        if self.has("fewer-launches") and not self.has("tiled-conv"):      # tiled kernels overwrite: no zeroing
            arena = self.dx_arena(self.d_images.shape[0])
            zero_pair(self.d_grad, arena, self.config.threads(self.d_grad.size + arena.size), self.launch)
        super().backward_blocks()

    def dx_arena(self, batch: int):
        """One device array holding the dX of every block whose push kernel accumulates into it."""
        shapes = self.net.activation_shapes()
        sizes = [batch * int(np.prod(shapes[block.index])) for block in self.arena_blocks]
        arena = self.buffers.get("dx-arena", (max(1, sum(sizes)),))
        if self.arena_batch != batch:
            offsets = np.cumsum([0] + sizes)
            self.arena_views = {block.index: arena[start:start + size].reshape((batch, *shapes[block.index]))
                                for block, start, size in zip(self.arena_blocks, offsets, sizes)}
            self.arena_batch = batch
        return arena

    def fetch_loss(self):
        if not self.fused_loss:
            return super().fetch_loss()
        batch = self.d_row_loss.shape[0]
        if batch not in self.host_rows:
            self.host_rows[batch] = self.host_array((batch,), np.float32)
        rows = self.host_rows[batch]
        self.d_row_loss.copy_to_host(rows, stream=self.stream)
        self.stream.synchronize()
        return float(rows.sum(dtype=np.float64) / batch)

    # -- host → device: pinned staging, a second stream ---------------------------------------------
    def host_array(self, shape, dtype):
        return cuda.pinned_array(shape, dtype=dtype) if self.has("pinned-buffers") else np.empty(shape, dtype)

    def copy_in(self, device_array, host_array):
        if self.has("pinned-buffers"):
            key = (device_array.shape, np.dtype(device_array.dtype).str, self.input_buffer)
            if key not in self.pinned:
                self.pinned[key] = cuda.pinned_array(device_array.shape, dtype=device_array.dtype)
            np.copyto(self.pinned[key], host_array)
            host_array = self.pinned[key]
        device_array.copy_to_device(host_array, stream=self.input_stream)

    def load_batch(self, images, labels):
        super().load_batch(images, labels)
        if self.input_stream is not self.stream:             # overlap-copies: compute waits for the copy
            self.loaded.record(self.input_stream)
            self.loaded.wait(self.stream)

    # -- an epoch at a time: resident data, the loop on the device ------------------------------------
    def load_dataset(self, train_images, train_labels, test_images=None, test_labels=None):
        """With resident-data, the training and test sets are copied to the device here, once."""
        super().load_dataset(train_images, train_labels, test_images, test_labels)
        if not self.has("resident-data"):
            return
        self.d_train, self.d_train_labels = self._resident(train_images, train_labels, "training")
        if test_images is not None:
            self.d_test, self.d_test_labels = self._resident(test_images, test_labels, "test")
            self.d_correct = cuda.device_array(len(test_images), dtype=np.float32)
            self.d_test_losses = cuda.device_array(len(test_images), dtype=np.float32)
            self.d_totals, self.host_totals = cuda.device_array(2, np.float64), cuda.pinned_array(2, np.float64)
        if self.epoch_state is not None:
            self.epoch_state.drop_graphs()                # the graphs read the old training set

    def _resident(self, images, labels, which):
        return resident_set(self, images, labels, which)

    def begin_epoch(self, order, lrs, batch_size, momentum, weight_decay):
        super().begin_epoch(order, lrs, batch_size, momentum, weight_decay)
        if self.epoch_state is not None:
            self.epoch_state.begin(self.plan)
        elif self.has("resident-data"):
            self.d_order = cuda.to_device(self.plan.order.astype(INDEX))

    def run_steps(self, first, count):
        if self.epoch_state is not None:
            return self.epoch_state.run(first, count)
        if self.has("resident-data"):
            return self._run_resident_steps(first, count)
        if self.has("overlap-copies"):
            return self._run_overlapped_steps(first, count)
        return super().run_steps(first, count)

    def queue_device_step(self, slot: int) -> None:
        """One whole training step, every kernel reading the step from the device (``device-epoch``):
        gather the batch, forward + loss, backward into ring slot ``slot``, SGD, log the loss."""
        plan, epoch = self.plan, self.epoch_state
        self._step_start = self.launch.count
        images = self.buffers.get(("images", 0), (plan.batch_size, *self.net.input_shape))
        labels = self.buffers.get(("labels", 0), (plan.batch_size,), INDEX)
        gather_step_batch(self.d_train.reshape((len(self.d_train), images.size // plan.batch_size)),
                          self.d_train_labels, epoch.order, epoch.counter,
                          images.reshape((plan.batch_size, images.size // plan.batch_size)), labels, self.launch)
        self.d_images, self.d_labels = images, labels
        self.forward()
        self.d_grad, self.grad_views = self.slot_grads[slot]
        self.backward_blocks()
        sgd_scheduled(self.d_params, self.d_velocity, self.d_grad, epoch.lrs, epoch.counter, plan.momentum,
                      plan.weight_decay, self.launch)
        finish_step(self.d_row_loss, epoch.counter, epoch.loss_log, epoch.first_bad, self.launch)
        self.count_step_launches()

    def launches_per_step(self) -> int:
        """Kernels the host queued for the last step; 1 once it is replayed as a graph (``cuda-graph``)."""
        if self.epoch_state is not None and self.epoch_state.graphs:
            return 1
        return super().launches_per_step()

    def _train_phases(self, lr) -> float:
        """forward, backward, update and the loss of the batch already on the device."""
        self.forward()
        self.backward()
        self.update(lr, self.plan.momentum, self.plan.weight_decay)
        return self.fetch_loss()

    def _run_resident_steps(self, first, count):
        """resident-data without device-epoch: the batch gathered on the device, the loss fetched every step."""
        losses = np.empty(count)
        for i, step in enumerate(range(first, first + count)):
            self._gather_on_device(step)
            losses[i] = self._train_phases(self.plan.lrs[step])
        return losses

    def _gather_on_device(self, step):
        batch = self.plan.batch_size
        images = self.buffers.get(("images", self.input_buffer), (batch, *self.net.input_shape))
        labels = self.buffers.get(("labels", self.input_buffer), (batch,), INDEX)
        self._step_start = self.launch.count
        flat = images.reshape((batch, images.size // batch))
        gather_batch(self.d_train.reshape((len(self.d_train), flat.shape[1])), self.d_train_labels, self.d_order,
                     step * batch, flat, labels, self.config.threads(flat.size), self.launch)
        self.d_images, self.d_labels = images, labels

    def _run_overlapped_steps(self, first, count):
        """overlap-copies: batch t+1 copied (second stream, second set of input buffers) while step t computes."""
        (images, labels), losses = self.train_set, np.empty(count)
        rows = self.plan.batch_rows(first)
        self.load_batch(images[rows], labels[rows])
        for i, step in enumerate(range(first, first + count)):
            self.forward()
            self.backward()
            self.update(self.plan.lrs[step], self.plan.momentum, self.plan.weight_decay)
            if i + 1 < count:
                self.input_buffer = 1 - self.input_buffer
                rows = self.plan.batch_rows(step + 1)
                self.load_batch(images[rows], labels[rows])
            losses[i] = self.fetch_loss()
        return losses

    def test_scores(self, count=None):
        """With the test set resident: scored on the device, two numbers copied back."""
        if self.d_test is None:
            return super().test_scores(count)
        count = len(self.d_test) if count is None else min(count, len(self.d_test))
        for start in range(0, count, EVAL_BATCH):
            logits = self._forward_blocks(self.d_test[start:min(count, start + EVAL_BATCH)])
            score_rows(logits, self.d_test_labels, start, self.d_correct, self.d_test_losses, self.launch)
        sum_scores(self.d_correct, self.d_test_losses, count, self.d_totals, self.launch)
        self.d_totals.copy_to_host(self.host_totals, stream=self.stream)
        self.stream.synchronize()
        return int(round(self.host_totals[0])), float(self.host_totals[1])
