"""The one small interface every stage implements, and the host-side plumbing the CPU stages share.

A *stage* is one complete implementation of the network's training step. The
trainer, the tests, the benchmark and the notebooks only ever talk to this
interface, so swapping ``--stage numpy`` for ``--stage cuda-fused`` changes how
the arithmetic is done and nothing else.

One training step is split into the phases the benchmark times separately::

    load_batch(images, labels)   host → device copy (a dtype cast on the CPU)
    forward()                    logits and loss, kept inside the stage
    backward()                   the flat gradient  dL/dθ
    update(lr, momentum, wd)     SGD with momentum and L2 weight decay on the flat vectors
    fetch_loss()                 device → host copy of the loss

``train_step`` chains them. Parameters, gradient and momentum are flat vectors
laid out by ``cnn.model.param_views``; a GPU stage keeps them on the device and
only copies them when asked through ``get_params`` / ``set_params``.

The trainer drives a stage an epoch at a time, which lets a GPU stage keep the data and the loop
on the device (stage 7's ``device-epoch`` and ``cuda-graph``)::

    load_dataset(train_x, train_y, test_x, test_y)       once
    begin_epoch(order, lrs, batch_size, momentum, wd)    each epoch: step s trains on the samples
                                                         order[s·B:(s+1)·B] at learning rate lrs[s]
    run_steps(first, count)                              steps first … first+count−1; their losses
    test_scores(count)                                   (correct, summed loss) on the test set

The defaults here run those with the phases above, a host batch a step, so a stage that does
not override them (every CPU stage) trains exactly as ``train_step`` does. ``steps_per_sync``
says how many steps the trainer asks for at once: 1 here, more where each request costs a wait
for the device.
"""

from __future__ import annotations

from typing import Callable, ClassVar, NamedTuple

import numpy as np

from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU, init_params, param_views


def pad_images(x: np.ndarray, pad: int) -> np.ndarray:
    """Zero-pad the two spatial axes of an (N, C, H, W) batch by ``pad`` on every side."""
    return np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad))) if pad else x


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of a softmax over classes, and its gradient with respect to the logits.

    p = softmax(z) = exp(z − max z) / Σ exp(z − max z)      (shifting by max z avoids overflow)
    L = −(1/N) Σ_n log p[n, y_n]
    dL/dz = (p − onehot(y)) / N
    """
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    batch = np.arange(logits.shape[0])
    loss = -log_probs[batch, labels].mean()
    dlogits = np.exp(log_probs)
    dlogits[batch, labels] -= 1.0
    dlogits /= logits.shape[0]
    return float(loss), dlogits


def sgd_momentum_update(params, velocity, grad, lr: float, momentum: float, weight_decay: float) -> None:
    """In place, on flat vectors (PyTorch's convention, so the two can be compared step for step):

    v ← μ·v + (g + λ·θ)
    θ ← θ − η·v
    """
    velocity *= momentum
    velocity += grad
    velocity += weight_decay * params
    params -= lr * velocity


def score_batches(stage, images: np.ndarray, labels: np.ndarray, batch_size: int = 1000) -> tuple[int, float]:
    """(correct answers, summed cross-entropy) of ``stage.predict`` over a labelled set, a batch at a time."""
    correct, loss_sum = 0, 0.0
    for start in range(0, len(images), batch_size):
        logits = stage.predict(images[start:start + batch_size]).astype(np.float64)
        batch_labels = labels[start:start + batch_size]
        correct += int((logits.argmax(axis=1) == batch_labels).sum())
        loss_sum += softmax_cross_entropy(logits, batch_labels)[0] * len(batch_labels)
    return correct, loss_sum


class EpochPlan(NamedTuple):
    """What ``begin_epoch`` was told: step s trains on order[s·B:(s+1)·B] at learning rate lrs[s]."""

    order: np.ndarray
    lrs: np.ndarray
    batch_size: int
    momentum: float
    weight_decay: float

    @property
    def steps(self) -> int:
        return len(self.lrs)

    def batch_rows(self, step: int) -> np.ndarray:
        return self.order[step * self.batch_size:(step + 1) * self.batch_size]


class Stage:
    """Interface of every stage. Subclasses set ``name`` and implement the five phases."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    device: ClassVar[str] = "cpu"          # "cpu" or "cuda"
    dtypes: ClassVar[tuple] = (np.float32, np.float64)
    steps_per_sync: int = 1                # steps the trainer asks run_steps for at once

    def __init__(self, net: Network, dtype=np.float32):
        if np.dtype(dtype) not in [np.dtype(d) for d in self.dtypes]:
            raise ValueError(f"stage {self.name!r} supports {[np.dtype(d).name for d in self.dtypes]}, "
                             f"not {np.dtype(dtype).name}")
        self.net = net
        self.dtype = np.dtype(dtype)

    # -- parameters in and out (host flat vectors, copies) ------------------------------------
    def get_params(self) -> np.ndarray: raise NotImplementedError
    def set_params(self, flat: np.ndarray) -> None: raise NotImplementedError
    def get_momentum(self) -> np.ndarray: raise NotImplementedError
    def set_momentum(self, flat: np.ndarray) -> None: raise NotImplementedError
    def get_grad(self) -> np.ndarray: raise NotImplementedError

    # -- the phases of one training step ------------------------------------------------------
    def load_batch(self, images: np.ndarray, labels: np.ndarray) -> None: raise NotImplementedError
    def forward(self) -> None: raise NotImplementedError
    def backward(self) -> None: raise NotImplementedError
    def update(self, lr: float, momentum: float, weight_decay: float) -> None: raise NotImplementedError
    def fetch_loss(self) -> float: raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on the CPU); the benchmark calls it between phases."""

    def predict(self, images: np.ndarray) -> np.ndarray:
        """Logits for a batch, as a host array."""
        raise NotImplementedError

    # -- conveniences built from the phases ---------------------------------------------------
    def init(self, scheme: str = "he", seed: int = 0) -> "Stage":
        self.set_params(init_params(self.net, scheme, seed, self.dtype))
        self.set_momentum(np.zeros(self.net.num_params, self.dtype))
        return self

    def train_step(self, images, labels, lr: float, momentum: float = 0.9, weight_decay: float = 0.0) -> float:
        self.load_batch(images, labels)
        self.forward()
        self.backward()
        self.update(lr, momentum, weight_decay)
        return self.fetch_loss()

    def evaluate_loss(self, images, labels) -> float:
        """Loss at the current parameters: forward only."""
        self.load_batch(images, labels)
        self.forward()
        return self.fetch_loss()

    def loss_and_grad(self, images, labels) -> tuple[float, np.ndarray]:
        """Loss and flat gradient at the current parameters, without updating them."""
        self.load_batch(images, labels)
        self.forward()
        self.backward()
        return self.fetch_loss(), self.get_grad()

    # -- an epoch at a time (the trainer's entry points) ----------------------------------------
    def load_dataset(self, train_images, train_labels, test_images=None, test_labels=None) -> None:
        """Keep the sets the epoch methods index into (a GPU stage may copy them to the device, once)."""
        if len(train_images) != len(train_labels):
            raise ValueError(f"stage {self.name!r}: {len(train_images)} training images but {len(train_labels)} labels")
        self.train_set = (train_images, train_labels)
        self.test_set = (test_images, test_labels)

    def begin_epoch(self, order, lrs, batch_size: int, momentum: float, weight_decay: float) -> None:
        """The epoch about to run: step s trains on samples order[s·B:(s+1)·B] at learning rate lrs[s]."""
        order, lrs = np.asarray(order), np.asarray(lrs, dtype=np.float64)
        if len(order) < len(lrs) * batch_size:
            raise ValueError(f"stage {self.name!r}: {len(lrs)} steps of {batch_size} need {len(lrs) * batch_size} "
                             f"samples in the order, got {len(order)}")
        self.plan = EpochPlan(order, lrs, batch_size, momentum, weight_decay)

    def run_steps(self, first: int, count: int) -> np.ndarray:
        """Steps first … first + count − 1 of the epoch, one ``train_step`` each; their losses (float64)."""
        (images, labels), plan = self.train_set, self.plan
        losses = np.empty(count)
        for i, step in enumerate(range(first, first + count)):
            rows = plan.batch_rows(step)
            losses[i] = self.train_step(images[rows], labels[rows], plan.lrs[step], plan.momentum, plan.weight_decay)
        return losses

    def test_scores(self, count: int | None = None) -> tuple[int, float]:
        """(correct answers, summed cross-entropy) on the first ``count`` samples of the loaded test set."""
        images, labels = self.test_set
        return score_batches(self, images[:count], labels[:count])


class Ops(NamedTuple):
    """One stage's version of each layer operation, all with the same signatures.

    The ``bench --op`` command and the tests compare these across stages one operation at a time.
    ``argmax`` holds, for each pooled output, the flat index (row·W + col) of its winner within
    the input plane.
    """

    conv_forward: Callable       # (x, W, b, stride, pad) -> y
    conv_backward: Callable      # (dy, x, W, stride, pad) -> (dx, dW, db)
    relu_forward: Callable       # (x) -> y
    relu_backward: Callable      # (dy, y) -> dx
    maxpool_forward: Callable    # (x, size, stride) -> (y, argmax)
    maxpool_backward: Callable   # (dy, argmax, x_shape, size, stride) -> dx
    dense_forward: Callable      # (x, W, b) -> y
    dense_backward: Callable     # (dy, x, W) -> (dx, dW, db)


class HostStage(Stage):
    """A CPU stage that runs the network layer by layer with its own ``ops``.

    Subclasses only provide ``ops``; this class walks ``net.layers``, keeps what each
    backward pass needs, and writes gradients straight into the flat gradient vector.
    """

    ops: ClassVar[Ops]

    def __init__(self, net: Network, dtype=np.float32):
        super().__init__(net, dtype)
        self.params = np.zeros(net.num_params, self.dtype)
        self.grad = np.zeros_like(self.params)
        self.velocity = np.zeros_like(self.params)
        self.param_views = param_views(net, self.params)
        self.grad_views = param_views(net, self.grad)

    def get_params(self): return self.params.copy()
    def set_params(self, flat): self.params[...] = flat
    def get_momentum(self): return self.velocity.copy()
    def set_momentum(self, flat): self.velocity[...] = flat
    def get_grad(self): return self.grad.copy()

    def load_batch(self, images, labels):
        self.images = np.ascontiguousarray(images, dtype=self.dtype)
        self.labels = np.asarray(labels, dtype=np.int64)

    def forward(self):
        self.logits, self.saved = self._forward_layers(self.images)
        self.loss, self.dlogits = softmax_cross_entropy(self.logits, self.labels)

    def backward(self):
        grad_out = self.dlogits
        for index in reversed(range(len(self.net.layers))):
            grad_out = self._layer_backward(index, grad_out)
        self.input_grad = grad_out      # dL/d(images): the gradient check tests it too

    def update(self, lr, momentum, weight_decay):
        sgd_momentum_update(self.params, self.velocity, self.grad, lr, momentum, weight_decay)

    def fetch_loss(self):
        return self.loss

    def predict(self, images):
        logits, _ = self._forward_layers(np.ascontiguousarray(images, dtype=self.dtype))
        return logits

    def _forward_layers(self, x):
        """Run every layer; return the logits and, per layer, what its backward pass needs."""
        ops, saved = self.ops, []
        for layer, params in zip(self.net.layers, self.param_views):
            if isinstance(layer, Conv):
                saved.append(x)
                x = ops.conv_forward(x, params["W"], params["b"], layer.stride, layer.pad)
            elif isinstance(layer, ReLU):
                x = ops.relu_forward(x)
                saved.append(x)
            elif isinstance(layer, MaxPool):
                shape = x.shape
                x, argmax = ops.maxpool_forward(x, layer.size, layer.stride)
                saved.append((argmax, shape))
            elif isinstance(layer, Flatten):
                saved.append(x.shape)
                x = x.reshape(x.shape[0], -1)
            elif isinstance(layer, Dense):
                saved.append(x)
                x = ops.dense_forward(x, params["W"], params["b"])
            else:
                raise TypeError(f"unknown layer {layer!r}")
        return x, saved

    def _layer_backward(self, index, grad_out):
        """Backward through layer ``index``: return dL/d(input), write dL/dW and dL/db into ``self.grad``."""
        layer, saved = self.net.layers[index], self.saved[index]
        params, grads, ops = self.param_views[index], self.grad_views[index], self.ops
        if isinstance(layer, Conv):
            grad_in, grads["W"][...], grads["b"][...] = ops.conv_backward(
                grad_out, saved, params["W"], layer.stride, layer.pad)
            return grad_in
        if isinstance(layer, ReLU):
            return ops.relu_backward(grad_out, saved)
        if isinstance(layer, MaxPool):
            argmax, shape = saved
            return ops.maxpool_backward(grad_out, argmax, shape, layer.size, layer.stride)
        if isinstance(layer, Flatten):
            return grad_out.reshape(saved)
        grad_in, grads["W"][...], grads["b"][...] = ops.dense_backward(grad_out, saved, params["W"])
        return grad_in
