"""Stage 4 ``cuda``: the first CUDA port — one kernel per operation, everything resident on the GPU.

What changes against the CPU stages: every layer runs as Numba CUDA kernels from ``kernels/``,
one thread per output element (the thread-to-data mapping is in each kernel's docstring):

    Conv     conv2d_forward, then bias_relu (bias, and the ReLU when one follows, in one pass)
    MaxPool  maxpool_forward (values + argmax switches)
    Dense    matmul_tiled (x·Wᵀ through shared-memory tiles), then bias_relu
    loss     softmax_xent (one block: loss and dL/dlogits)
    update   sgd_momentum on the flat vectors

Backward passes are in *pull* (gather) form, like stage 1: each thread owns one element of the
gradient it writes and reads everything that contributes to it — no two threads write the same
address, so there are no atomics, at the price of redundant reads. Stage 5 (``cuda-fused``)
swaps in push-style kernels for the convolution blocks.

Parameters, gradients and momentum never leave the device: three flat float32 device vectors
with per-layer views from ``cnn.model.param_views`` (device arrays slice and reshape like numpy
arrays). Activations live in device buffers reused from step to step (one set per batch size
seen). Each step copies the batch host→device and, in ``fetch_loss``, one float back — what a
straightforward first port does. The first layer skips dL/d(images), which training never needs.

``launches_per_step()`` counts the kernels one training step queues: 34 for LeNet-5, 42 for
AlexNet-small. Each costs host time whatever it computes — numba-cuda's own measurement is
6.6 µs with no arguments plus ~3.5–4 µs per array argument (NVIDIA/numba-cuda#288) — which is
what the fused stage 5 cuts. Measured speed: the stage table in README.md (``python -m cnn bench``
on a GPU machine).

``ops`` holds host-array wrappers around the kernels (copy in, launch, copy out) with the common
signatures of ``cnn.stages.base.Ops``, for the tests and ``bench --op``.
"""

from __future__ import annotations

import numpy as np

from cnn.model import Conv, Dense, Flatten, MaxPool, ReLU, param_views, window_count
from cnn.stages import StageUnavailable
from cnn.stages.base import Ops, Stage
from kernels import bias_relu, conv2d, dense, maxpool, sgd, softmax_xent
from kernels.device import cuda, gpu_unavailable_reason
from kernels.launch import LaunchCounter, launch

FLOAT = np.float32
INDEX = np.int32          # argmax switches and labels on the device


# -- layers as kernel sequences on device arrays (shared by the stage and by ``ops``) --------------
def conv_layer_forward(x, w, b, y, stride, pad, relu, launch=launch):
    """y ← conv(x, w) + b, then ReLU when ``relu``: two kernels."""
    conv2d.conv2d_forward(x, w, y, stride, pad, launch)
    bias_relu.bias_relu(y, b, relu, launch)


def conv_layer_backward(dy, x, w, dx, dw, db, stride, pad, launch=launch):
    """db, dw and (unless dx is None) dx from dy, in pull form: three kernels, no atomics."""
    bias_relu.bias_grad(dy, db, launch)
    conv2d.conv2d_backward_filter(dy, x, dw, stride, pad, launch)
    if dx is not None:
        conv2d.conv2d_backward_data(dy, w, dx, stride, pad, launch)


def dense_layer_forward(x, w, b, y, relu, launch=launch):
    """y ← x·wᵀ + b, then ReLU when ``relu``."""
    dense.dense_forward(x, w, y, launch)
    bias_relu.bias_relu(y, b, relu, launch)


def dense_layer_backward(dy, x, w, dx, dw, db, launch=launch):
    """db = Σ_n dy,  dw = dyᵀ·x,  dx = dy·w (skipped when dx is None)."""
    bias_relu.bias_grad(dy, db, launch)
    dense.dense_backward_weights(dy, x, dw, launch)
    if dx is not None:
        dense.dense_backward_data(dy, w, dx, launch)


# -- host wrappers: copy in, launch, copy out (the ``Ops`` of this stage) --------------------------
def to_device(array, dtype=FLOAT):
    return cuda.to_device(np.ascontiguousarray(array, dtype=dtype))


def device_empty(shape, dtype=FLOAT):
    return cuda.device_array(shape, dtype=dtype)


def device_zeros(shape, dtype=FLOAT):
    return cuda.to_device(np.zeros(shape, dtype=dtype))


def conv_output_shape(x_shape, w_shape, stride, pad):
    (batch, _, height, width), (filters, _, kernel, _) = x_shape, w_shape
    return batch, filters, window_count(height, kernel, stride, pad), window_count(width, kernel, stride, pad)


def pool_output_shape(x_shape, size, stride):
    batch, channels, height, width = x_shape
    return batch, channels, window_count(height, size, stride), window_count(width, size, stride)


def conv_forward(x, W, b, stride, pad):
    y = device_empty(conv_output_shape(x.shape, W.shape, stride, pad))
    conv_layer_forward(to_device(x), to_device(W), to_device(b), y, stride, pad, relu=False)
    return y.copy_to_host()


def conv_backward(dy, x, W, stride, pad):
    dx, dW, db = device_empty(x.shape), device_empty(W.shape), device_empty(W.shape[:1])
    conv_layer_backward(to_device(dy), to_device(x), to_device(W), dx, dW, db, stride, pad)
    return dx.copy_to_host(), dW.copy_to_host(), db.copy_to_host()


def relu_forward(x):
    y = device_empty(x.shape)
    bias_relu.relu_forward(to_device(x), y)
    return y.copy_to_host()


def relu_backward(dy, y):
    dx = device_empty(dy.shape)
    bias_relu.relu_backward(to_device(dy), to_device(y), dx)
    return dx.copy_to_host()


def maxpool_forward(x, size, stride):
    shape = pool_output_shape(x.shape, size, stride)
    y, argmax = device_empty(shape), device_empty(shape, INDEX)
    maxpool.maxpool_forward(to_device(x), y, argmax, size, stride)
    return y.copy_to_host(), argmax.copy_to_host()


def maxpool_backward(dy, argmax, x_shape, size, stride):
    dx = device_empty(x_shape)
    maxpool.maxpool_backward(to_device(dy), to_device(argmax, INDEX), dx, size, stride)
    return dx.copy_to_host()


def dense_forward(x, W, b):
    y = device_empty((x.shape[0], W.shape[0]))
    dense_layer_forward(to_device(x), to_device(W), to_device(b), y, relu=False)
    return y.copy_to_host()


def dense_backward(dy, x, W):
    dx, dW, db = device_empty(x.shape), device_empty(W.shape), device_empty(W.shape[:1])
    dense_layer_backward(to_device(dy), to_device(x), to_device(W), dx, dW, db)
    return dx.copy_to_host(), dW.copy_to_host(), db.copy_to_host()


# -- the network as blocks of layers, each a few kernels on device buffers -------------------------
class DeviceBuffers:
    """Device arrays kept from step to step, one per (key, shape, dtype): a new batch size gets its own."""

    def __init__(self):
        self.arrays = {}

    def get(self, key, shape, dtype=FLOAT):
        full_key = (key, tuple(shape), np.dtype(dtype).str)
        if full_key not in self.arrays:
            self.arrays[full_key] = device_empty(shape, dtype)
        return self.arrays[full_key]


class Block:
    """``layer_count`` consecutive layers from ``net.layers[index]`` on, run as a unit.

    ``forward(x)`` returns the block's output (a device array it owns); ``backward(dy, need_dx)``
    writes the block's parameter gradients into the stage's flat gradient and returns dL/dx
    (None when ``need_dx`` is False: the network's first block). ``backward`` may overwrite dy.
    """

    layer_count = 1

    def __init__(self, stage: "CudaStage", index: int):
        self.stage, self.index = stage, index
        self.layer = stage.net.layers[index]
        shapes = stage.net.activation_shapes()
        self.out_shape = shapes[index + self.layer_count]
        self.launch = stage.launch

    def buffer(self, name, shape, dtype=FLOAT):
        return self.stage.buffers.get((self.index, name), shape, dtype)

    @property
    def params(self):
        return self.stage.param_views[self.index]

    @property
    def grads(self):
        return self.stage.grad_views[self.index]


class LayerReluBlock(Block):
    """A Conv or Dense layer, and the ReLU after it when there is one (applied in the bias kernel).

    Subclasses say which kernels run the layer: ``layer_forward(x, y)`` and
    ``layer_backward(dy, dx)`` (dx is None for the network's first block).
    """

    def __init__(self, stage, index, relu: bool):
        self.layer_count, self.relu = (2 if relu else 1), relu
        super().__init__(stage, index)

    def forward(self, x):
        self.x = x
        self.y = self.buffer("y", (x.shape[0], *self.out_shape))
        self.layer_forward(x, self.y)
        return self.y

    def backward(self, dy, need_dx):
        if self.relu and self.masks_own_relu():
            bias_relu.relu_backward(dy, self.y, dy, self.launch)        # in place
        dx = self.buffer("dx", self.x.shape) if need_dx else None
        self.layer_backward(dy, dx)
        return dx

    def masks_own_relu(self) -> bool:
        """Whether this block applies its ReLU's mask to dy (stage 7 can leave it to the block above)."""
        return True


class ConvBlock(LayerReluBlock):
    def layer_forward(self, x, y):
        conv_layer_forward(x, self.params["W"], self.params["b"], y, self.layer.stride, self.layer.pad,
                           self.relu, self.launch)

    def layer_backward(self, dy, dx):
        conv_layer_backward(dy, self.x, self.params["W"], dx, self.grads["W"], self.grads["b"],
                            self.layer.stride, self.layer.pad, self.launch)


class DenseBlock(LayerReluBlock):
    def layer_forward(self, x, y):
        dense_layer_forward(x, self.params["W"], self.params["b"], y, self.relu, self.launch)

    def layer_backward(self, dy, dx):
        dense_layer_backward(dy, self.x, self.params["W"], dx, self.grads["W"], self.grads["b"], self.launch)


class ReluBlock(Block):
    """A ReLU with no Conv or Dense right before it."""

    def forward(self, x):
        self.y = self.buffer("y", x.shape)
        bias_relu.relu_forward(x, self.y, self.launch)
        return self.y

    def backward(self, dy, need_dx):
        if not need_dx:
            return None
        dx = self.buffer("dx", self.y.shape)
        bias_relu.relu_backward(dy, self.y, dx, self.launch)
        return dx


class PoolBlock(Block):
    """MaxPool: values and argmax switches forward, the pull kernel backward."""

    def forward(self, x):
        self.x_shape = x.shape
        shape = (x.shape[0], *self.out_shape)
        self.y, self.argmax = self.buffer("y", shape), self.buffer("argmax", shape, INDEX)
        maxpool.maxpool_forward(x, self.y, self.argmax, self.layer.size, self.layer.stride, self.launch)
        return self.y

    def backward(self, dy, need_dx):
        if not need_dx:
            return None
        dx = self.buffer("dx", self.x_shape)
        maxpool.maxpool_backward(dy, self.argmax, dx, self.layer.size, self.layer.stride, self.launch)
        return dx


class FlattenBlock(Block):
    """A reshape of the same device memory: no kernel."""

    def forward(self, x):
        self.x_shape = x.shape
        return x.reshape((x.shape[0], x.size // x.shape[0]))

    def backward(self, dy, need_dx):
        return dy.reshape(self.x_shape) if need_dx else None


def layers_match(layers, index, *kinds) -> bool:
    """True when ``layers[index:]`` starts with layers of the given kinds, in order."""
    following = layers[index:index + len(kinds)]
    return len(following) == len(kinds) and all(isinstance(layer, kind) for layer, kind in zip(following, kinds))


class CudaStage(Stage):
    name = "cuda"
    summary = "Numba CUDA: one kernel per operation, pull-form backward, parameters resident on the GPU"
    device = "cuda"
    dtypes = (np.float32,)
    ops = Ops(conv_forward, conv_backward, relu_forward, relu_backward,
              maxpool_forward, maxpool_backward, dense_forward, dense_backward)
    stream = 0          # the stream of a step's kernels and batch copies (0: the default; stage 6 makes its own)
    input_buffer = 0    # which set of device input buffers load_batch fills (stage 7 alternates two)

    def __init__(self, net, dtype=np.float32):
        super().__init__(net, dtype)
        reason = gpu_unavailable_reason()
        if reason:
            raise StageUnavailable(f"stage {self.name!r} needs a CUDA GPU: {reason}")
        self.launch = self.make_launcher()
        self.buffers = DeviceBuffers()
        self.d_params, self.d_grad, self.d_velocity = (device_zeros(net.num_params) for _ in range(3))
        self.param_views = param_views(net, self.d_params)
        self.grad_views = param_views(net, self.d_grad)
        self.d_loss = device_zeros(1)
        self.blocks = self.build_blocks()
        self._step_start = None
        self._last_step_launches = None

    def make_launcher(self) -> LaunchCounter:
        """How this stage queues its kernels: counted, on the default stream (stage 6 uses a stream of its own)."""
        return LaunchCounter()

    # -- how the layers are grouped: stage 5 overrides ``make_block`` --------------------------
    def build_blocks(self) -> list[Block]:
        blocks, index = [], 0
        while index < len(self.net.layers):
            blocks.append(self.make_block(index))
            index += blocks[-1].layer_count
        return blocks

    def make_block(self, index: int) -> Block:
        """The block that starts at layer ``index``; a Conv or Dense takes the ReLU after it along."""
        layer, relu_next = self.net.layers[index], layers_match(self.net.layers, index + 1, ReLU)
        if isinstance(layer, Conv):
            return ConvBlock(self, index, relu_next)
        if isinstance(layer, Dense):
            return DenseBlock(self, index, relu_next)
        if isinstance(layer, ReLU):
            return ReluBlock(self, index)
        if isinstance(layer, MaxPool):
            return PoolBlock(self, index)
        if isinstance(layer, Flatten):
            return FlattenBlock(self, index)
        raise TypeError(f"stage {self.name!r}: unknown layer {layer!r}")

    # -- parameters in and out ------------------------------------------------------------------
    def _flat(self, flat, what):
        flat = np.ascontiguousarray(flat, dtype=FLOAT)
        if flat.shape != (self.net.num_params,):
            raise ValueError(f"stage {self.name!r}: {what} has shape {flat.shape}, "
                             f"network {self.net.name!r} needs ({self.net.num_params},)")
        return flat

    def get_params(self): return self.d_params.copy_to_host()
    def set_params(self, flat): self.d_params.copy_to_device(self._flat(flat, "params"))
    def get_momentum(self): return self.d_velocity.copy_to_host()
    def set_momentum(self, flat): self.d_velocity.copy_to_device(self._flat(flat, "momentum"))
    def get_grad(self): return self.d_grad.copy_to_host()

    # -- the phases of a training step ----------------------------------------------------------
    def _images(self, images, key):
        images = np.ascontiguousarray(images, dtype=FLOAT)
        if images.ndim != 4 or images.shape[1:] != tuple(self.net.input_shape) or images.shape[0] < 1:
            raise ValueError(f"stage {self.name!r}: images have shape {images.shape}, "
                             f"network {self.net.name!r} expects (N, {', '.join(map(str, self.net.input_shape))})")
        d_images = self.buffers.get(key, images.shape)
        self.copy_in(d_images, images)
        return d_images

    def copy_in(self, device_array, host_array) -> None:
        """Host → device copy of a step's input (stage 7 stages it through pinned memory)."""
        device_array.copy_to_device(host_array, stream=self.stream)

    def load_batch(self, images, labels):
        self.d_images = self._images(images, ("images", self.input_buffer))
        labels = np.asarray(labels)
        batch, classes = self.d_images.shape[0], self.net.num_classes
        if labels.shape != (batch,) or not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"stage {self.name!r}: labels must be {batch} integers, got {labels.dtype} of shape {labels.shape}")
        if labels.min() < 0 or labels.max() >= classes:
            raise ValueError(f"stage {self.name!r}: labels must lie in [0, {classes}), got [{labels.min()}, {labels.max()}]")
        self.d_labels = self.buffers.get(("labels", self.input_buffer), labels.shape, INDEX)
        self.copy_in(self.d_labels, labels.astype(INDEX))
        self._step_start = self.launch.count

    def _forward_blocks(self, x):
        for block in self.blocks:
            x = block.forward(x)
        return x

    def forward(self):
        logits = self._forward_blocks(self.d_images)
        self.d_dlogits = self.buffers.get("dlogits", logits.shape)
        softmax_xent.softmax_xent(logits, self.d_labels, self.d_loss, self.d_dlogits, self.launch)

    def backward(self):
        grad = self.d_dlogits
        for position in reversed(range(len(self.blocks))):
            grad = self.blocks[position].backward(grad, need_dx=position > 0)

    def update(self, lr, momentum, weight_decay):
        sgd.sgd_momentum(self.d_params, self.d_velocity, self.d_grad, lr, momentum, weight_decay, self.launch)
        self.count_step_launches()

    def count_step_launches(self) -> None:
        """A training step ends here: remember how many kernels it queued since ``load_batch``."""
        if self._step_start is not None:
            self._last_step_launches = self.launch.count - self._step_start
            self._step_start = None

    def fetch_loss(self):
        return float(self.d_loss.copy_to_host()[0])

    def synchronize(self):
        cuda.synchronize()

    def predict(self, images):
        return self._forward_blocks(self._images(images, "predict-images")).copy_to_host()

    def launches_per_step(self) -> int:
        """Kernels queued by the last complete training step (load_batch → forward → backward → update)."""
        if self._last_step_launches is None:
            raise RuntimeError(f"stage {self.name!r}: no training step has run yet; call train_step once first")
        return self._last_step_launches
