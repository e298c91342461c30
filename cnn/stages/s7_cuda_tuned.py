"""Stage 7 ``cuda-tuned``: stage 6 with the fixes its profile asks for, each one a switch.

``CudaTunedStage(net, fixes=FIXES)`` is ``cuda-ring`` plus the fixes named in ``fixes`` (all of
them by default; ``fixes=()`` runs exactly stage 6's kernels), so that each can be measured on
its own — the ablation ``python -m cnn bench --ablation`` (``cnn/bench/ablation.py``).

The profile first (``cuda-ring``, where the time goes)
-------------------------------------------------------
Counted per training step in Numba's CUDA simulator by ``cnn/bench/census.py`` (counts are exact
there; times are not, so none is given). LeNet-5 and AlexNet-small, batch 2 — every count but
the bytes is the same at any batch size and layer width; bytes are per sample:

    python -m cnn bench --census                            (in the simulator add --reduced:
                                                             at full width it takes tens of minutes)

    per training step                          LeNet-5               AlexNet-small
                                        cuda-ring  cuda-tuned   cuda-ring  cuda-tuned
    kernel launches                            26          16          30          18
    array arguments of those launches          81          75          96          88
    host→device copies                          2           0           2           0
      bytes per sample                       3140           0       12292           0
    device→host copies (besides the ring)       1           1           1           1
    device allocations after warm-up            0           0           0           0
    modelled host launch cost (µs)          455.1       368.1       534.0       426.8

(Counted in the simulator with ``--reduced``, on the narrow copies of the two networks that the
tests use — same layers, so the same launches and arguments; the bytes are the full-size images'
28·28·4 and 3·32·32·4, plus a 4-byte label.)

The last row is a model, not a measurement: 6.6 µs a launch plus 3.5 µs an array argument,
numba-cuda's own numbers (NVIDIA/numba-cuda#288). At ~0.5 ms it is the same order as the
0.5 ms AlexNet-small target for the whole step: launches and host work are the first thing to cut.

Where the device time goes, per kernel, and the host profile (cProfile or pyinstrument) come
from a GPU — NOT YET MEASURED ON A GPU. Fill in from a GPU machine with::

    python -m cnn bench --profile cuda-ring --model lenet5 --batch-size 64 --data random
    python -m cnn bench --profile cuda-ring --model alexnet-small --batch-size 128 --data random
    nsys profile -o ring python -m cnn bench --stages cuda-ring --model lenet5 --batch-size 64 --data random
    ncu --set full -k regex:conv_relu_pool -c 4 python -m cnn bench --stages cuda-ring --steps 3 --warmup 1

The fixes (``FIXES``, in the order the ablation adds them)
---------------------------------------------------------
    resident-data   the training set lives on the device (``load_dataset``); ``shuffle`` uploads one
                    index vector an epoch; one gather kernel makes each batch (``kernels/gather.py``).
                    No host→device copy and no host-side gather per step.
    pinned-buffers  batches (when not resident) and the loss go through preallocated pinned host
                    buffers: DMA straight from them, no staging copy by the driver.
    overlap-copies  ``train_steps`` copies batch t+1 to the device on a second stream, into a second
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

The profile after, and what each fix bought — NOT YET MEASURED ON A GPU
------------------------------------------------------------------------
Fill in from a GPU machine with (writes ``benchmarks/results/ablation-*.json``; refuses in the
simulator)::

    python -m cnn bench --ablation --model lenet5 --batch-size 64
    python -m cnn bench --ablation --model alexnet-small --batch-size 128
    python -m cnn bench --stages cuda,cuda-fused,cuda-ring,cuda-tuned --model lenet5 --batch-size 64
    python -m cnn bench --stages cuda,cuda-fused,cuda-ring,cuda-tuned --model alexnet-small --batch-size 128 \\
        --data random

    | step time (ms, median)       | LeNet-5 b=64 | AlexNet-small b=128 |
    |------------------------------|--------------|---------------------|
    | cuda-ring                    | TODO         | TODO                |
    | + each fix alone (7 rows)    | TODO         | TODO                |
    | cuda-tuned (all fixes)       | TODO         | TODO                |
    | PyTorch (cuDNN), same GPU    | TODO         | TODO                |

Targets: ``cuda-tuned`` within 1.5× of PyTorch's step on LeNet-5; AlexNet-small batch 128 under
0.5 ms on an H100-class GPU.

The trainer and the benchmark use the ordinary ``Stage`` phases (a host batch a step), which
every fix but resident-data and overlap-copies speeds up; those two need the dataset API:
``load_dataset(images, labels)``, ``shuffle(seed)``, ``load_batch_at(start, batch_size)``,
``train_steps(steps, batch_size, lr, momentum, weight_decay)``.
"""

from __future__ import annotations

import numpy as np

from cnn.model import Dense, ReLU
from cnn.stages.s4_cuda import INDEX, DenseBlock, layers_match
from cnn.stages.s5_cuda_fused import FusedConvPoolBlock, fusable
from cnn.stages.s6_cuda_ring import CudaRingStage
from kernels import bias_relu, conv_pool_fused, dense_fused
from kernels.conv_pool_smem import conv_relu_pool_backward_smem, conv_relu_pool_forward_smem, fits
from kernels.dense_loss import MAX_CLASSES, dense_softmax_xent
from kernels.device import cuda
from kernels.fill import fill
from kernels.fill_pair import zero_pair
from kernels.gather import gather_batch
from kernels.launch_config import LaunchConfig
from kernels.streams import new_event

FIXES = ("resident-data", "pinned-buffers", "overlap-copies", "fused-loss", "fewer-launches", "smem-weights",
         "launch-config")
REQUIRES = {"overlap-copies": ("pinned-buffers",), "launch-config": ("fewer-launches", "smem-weights")}


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
    """``fixes`` and everything they need."""
    wanted = set(fixes)
    for fix in fixes:
        wanted.update(REQUIRES.get(fix, ()))
    return check_fixes(wanted)


# -- blocks with switches: off, each is stage 5's or stage 4's block -------------------------------
class TunedConvPoolBlock(FusedConvPoolBlock):
    """Conv → ReLU → MaxPool: shared-memory filter kernels (``smem``), buffers zeroed by the stage (``prezeroed``)."""

    def __init__(self, stage, index):
        super().__init__(stage, index)
        self.smem = stage.has("smem-weights") and fits(self.layer.in_channels, self.layer.kernel)
        self.prezeroed = stage.has("fewer-launches")

    def forward(self, x):
        if not self.smem:
            return super().forward(x)
        self.x = x
        shape = (x.shape[0], *self.out_shape)
        self.y, self.switches = self.buffer("y", shape), self.buffer("switches", shape, INDEX)
        conv_relu_pool_forward_smem(x, self.params["W"], self.params["b"], self.y, self.switches, self.layer.stride,
                                    self.layer.pad, self.pool.size, self.pool.stride, self.conv_width,
                                    self.stage.config.threads(self.y.size), self.launch)
        return self.y

    def backward(self, dy, need_dx):
        if not (self.smem or self.prezeroed):
            return super().backward(dy, need_dx)
        dx = self.zeroed_dx(need_dx)
        args = (dy, self.y, self.switches, self.x, self.params["W"], dx, self.grads["W"], self.grads["b"],
                self.layer.stride, self.layer.pad, self.conv_width, need_dx)
        if self.smem:
            conv_relu_pool_backward_smem(*args, threads=self.stage.config.threads(dy.size), launch=self.launch)
        else:
            conv_pool_fused.conv_relu_pool_backward_push(*args, launch=self.launch)
        return dx if need_dx else None

    def zeroed_dx(self, need_dx):
        """dX (or the unused placeholder), zeroed, with this block's dW and db zeroed too."""
        if self.prezeroed:                                   # the stage's zero_pair launch did it
            return self.stage.arena_views[self.index] if need_dx else self.stage.no_dx
        fill(self.param_grads, 0.0, self.launch)
        if not need_dx:
            return self.stage.no_dx
        dx = self.buffer("dx", self.x.shape)
        fill(dx, 0.0, self.launch)
        return dx


class TunedDenseBlock(DenseBlock):
    """Dense (+ ReLU): stage 4's 2 + 4 launches, or with ``fused`` 1 + 2 (``kernels/dense_fused.py``).

    ``mask_dx``: this block's input came out of a ReLU whose block expects dz ready-made, so
    dX is written already masked by x > 0. ``masked_from_above``: the block above does that
    for this block's ReLU, so no relu_backward is left to launch here.
    """

    def __init__(self, stage, index, relu, fused):
        super().__init__(stage, index, relu)
        self.fused, self.mask_dx, self.masked_from_above = fused, False, False

    def tile(self, rows, cols):
        return self.stage.config.tile(rows, cols)

    def masks_own_relu(self) -> bool:
        return not self.masked_from_above

    def layer_forward(self, x, y):
        if not self.fused:
            return super().layer_forward(x, y)
        dense_fused.dense_forward(x, self.params["W"], self.params["b"], y, self.relu, self.tile(*y.shape),
                                  self.launch)

    def layer_backward(self, dy, dx):
        if not self.fused:
            return super().layer_backward(dy, dx)
        weights = self.params["W"]
        dense_fused.dense_backward_params(dy, self.x, self.grads["W"], self.grads["b"], self.tile(*weights.shape),
                                          self.launch)
        if dx is not None:
            dense_fused.dense_backward_data(dy, weights, dx, self.tile(*dx.shape), self.x if self.mask_dx else None,
                                            self.launch)


class DenseLossBlock(TunedDenseBlock):
    """The last Dense layer; ``forward_loss`` adds softmax, the loss and dL/dlogits in the same kernel."""

    def forward_loss(self, x, labels, dlogits, row_loss):
        self.x = x
        self.y = self.buffer("y", (x.shape[0], *self.out_shape))
        dense_softmax_xent(x, self.params["W"], self.params["b"], labels, self.y, dlogits, row_loss, self.launch)


def wire_masks(blocks) -> None:
    """Let each fused Dense block mask the dX it writes when the block below is a fused Dense + ReLU."""
    for lower, upper in zip(blocks, blocks[1:]):
        if (isinstance(lower, TunedDenseBlock) and lower.fused and lower.relu
                and isinstance(upper, TunedDenseBlock) and upper.fused):
            upper.mask_dx, lower.masked_from_above = True, True


# -- the stage -------------------------------------------------------------------------------------
class CudaTunedStage(CudaRingStage):
    name = "cuda-tuned"
    summary = ("Numba CUDA: stage 6 + profile-driven fixes (resident data, pinned/overlapped copies, fused loss, "
               "fewer launches, tuned launches, shared-memory filters)")

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
        self.dataset_size = 0

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
            relu = layers_match(layers, index + 1, ReLU)
            if self.fused_loss and index == len(layers) - 1:
                return DenseLossBlock(self, index, relu, self.has("fewer-launches"))
            if self.has("fewer-launches"):
                return TunedDenseBlock(self, index, relu, True)
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
        if self.has("fewer-launches"):
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

    # -- the dataset API: resident data, shuffling by index ------------------------------------------
    def load_dataset(self, images, labels, seed: int = 0) -> None:
        """Keep a training set for ``load_batch_at`` / ``train_steps``; on the device with resident-data."""
        images = np.ascontiguousarray(images, dtype=np.float32)
        labels = np.asarray(labels)
        if images.ndim != 4 or images.shape[1:] != tuple(self.net.input_shape) or len(images) != len(labels):
            expected = ", ".join(map(str, self.net.input_shape))
            raise ValueError(f"stage {self.name!r}: load_dataset needs images (N, {expected}) and N labels, "
                             f"got {images.shape} and {labels.shape}")
        if len(labels) == 0 or labels.min() < 0 or labels.max() >= self.net.num_classes:
            raise ValueError(f"stage {self.name!r}: dataset labels must lie in [0, {self.net.num_classes})")
        self.dataset_size, self.epoch, self.cursor, self.seed = len(images), 0, 0, seed
        if self.has("resident-data"):
            self.d_data = cuda.to_device(images.reshape(len(images), -1))
            self.d_data_labels = cuda.to_device(labels.astype(INDEX))
            self.d_order = cuda.device_array(len(images), dtype=INDEX)
        else:
            self.host_data, self.host_labels = images, labels
        self.shuffle(seed)

    def shuffle(self, seed: int) -> None:
        """A new order of the samples (on the device with resident-data: one index vector)."""
        self.order = np.random.default_rng(seed).permutation(self.dataset_size)
        if self.has("resident-data"):
            self.d_order.copy_to_device(self.order.astype(INDEX), stream=self.stream)

    def load_batch_at(self, start: int, batch_size: int) -> None:
        """The batch of samples order[start : start + batch_size], instead of ``load_batch``."""
        if not 0 <= start <= self.dataset_size - batch_size or batch_size < 1:
            raise ValueError(f"stage {self.name!r}: batch [{start}, {start + batch_size}) is outside the "
                             f"{self.dataset_size} samples given to load_dataset")
        if not self.has("resident-data"):
            chosen = self.order[start:start + batch_size]
            return self.load_batch(self.host_data[chosen], self.host_labels[chosen])
        images = self.buffers.get(("images", self.input_buffer), (batch_size, *self.net.input_shape))
        labels = self.buffers.get(("labels", self.input_buffer), (batch_size,), INDEX)
        self._step_start = self.launch.count
        flat = images.reshape((batch_size, images.size // batch_size))
        gather_batch(self.d_data, self.d_data_labels, self.d_order, start, flat, labels,
                     self.config.threads(flat.size), self.launch)
        self.d_images, self.d_labels = images, labels

    def _load_next(self, batch_size: int) -> None:
        per_epoch = self.dataset_size // batch_size
        if per_epoch < 1:
            raise ValueError(f"stage {self.name!r}: batch size {batch_size} is larger than the "
                             f"{self.dataset_size} samples given to load_dataset")
        if self.cursor == per_epoch:
            self.epoch, self.cursor = self.epoch + 1, 0
            self.shuffle(self.seed + self.epoch)
        self.load_batch_at(self.cursor * batch_size, batch_size)
        self.cursor += 1

    def train_steps(self, steps: int, batch_size: int, lr: float, momentum: float = 0.9,
                    weight_decay: float = 0.0) -> list[float]:
        """``steps`` SGD steps over the dataset of ``load_dataset``, reshuffled every epoch; the losses.

        With overlap-copies the next batch is copied (second stream, second set of input buffers)
        while the current step computes; the loss is fetched after that copy is queued.
        """
        if not self.dataset_size:
            raise RuntimeError(f"stage {self.name!r}: train_steps needs load_dataset(images, labels) first")
        overlap, losses = self.has("overlap-copies"), []
        if overlap:
            self._load_next(batch_size)
        for step in range(steps):
            if not overlap:
                self._load_next(batch_size)
            self.forward()
            self.backward()
            self.update(lr, momentum, weight_decay)
            if overlap and step + 1 < steps:
                self.input_buffer = 1 - self.input_buffer
                self._load_next(batch_size)
            losses.append(self.fetch_loss())
        return losses


if __name__ == "__main__":      # the census and the ablation are benchmark commands now
    raise SystemExit("python -m cnn.stages.s7_cuda_tuned: moved to python -m cnn bench --census | --ablation")
