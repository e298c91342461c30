"""The network: a list of layer specs, and ONE flat vector that holds every parameter.

A network here is data, not code. ``Network.layers`` is a tuple of small frozen
dataclasses (``Conv``, ``ReLU``, ``MaxPool``, ``Flatten``, ``Dense``); the stages
in ``cnn/stages/`` walk that list and run their own version of each layer.
Softmax cross-entropy always closes the network.

All parameters live in one contiguous array ``flat`` (float32 or float64)::

    flat = [ W1 | b1 | W2 | b2 | ... ]         (C order inside each block)

and ``param_views(net, flat)`` hands out per-layer numpy *views* into it, so a
layer writes ``views[i]["W"][...] = ...`` and the flat vector sees the change.
Gradients and momentum use the same layout. Keeping everything flat is what
makes the later stages simple: an SGD update is one loop over one vector, a
circular gradient buffer holds K such vectors, and an MPI allreduce sends one
buffer instead of a message per layer.

Shapes follow the usual NCHW convention: activations are (N, C, H, W),
convolution weights (F, C, K, K), dense weights (out, in) with y = x Wᵀ + b.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


def window_count(size: int, kernel: int, stride: int, pad: int = 0) -> int:
    """Number of positions a window of ``kernel`` takes along an axis of ``size``.

    out = floor((size + 2·pad − kernel) / stride) + 1
    """
    return (size + 2 * pad - kernel) // stride + 1


@dataclass(frozen=True)
class Conv:
    """2-D convolution (cross-correlation), F filters of shape (C, K, K).

    y[n, f, i, j] = b[f] + Σ_c Σ_p Σ_q  W[f, c, p, q] · x_pad[n, c, i·s + p, j·s + q]
    """

    in_channels: int
    out_channels: int
    kernel: int
    stride: int = 1
    pad: int = 0

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(shape) != 3 or shape[0] != self.in_channels:
            raise ValueError(f"{self}: expects input (C={self.in_channels}, H, W), got {shape}")
        _, height, width = shape
        out_h = window_count(height, self.kernel, self.stride, self.pad)
        out_w = window_count(width, self.kernel, self.stride, self.pad)
        if out_h < 1 or out_w < 1:
            raise ValueError(f"{self}: a {self.kernel}x{self.kernel} kernel does not fit input {shape}")
        return (self.out_channels, out_h, out_w)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"W": (self.out_channels, self.in_channels, self.kernel, self.kernel),
                "b": (self.out_channels,)}

    def fans(self) -> tuple[int, int]:
        area = self.kernel * self.kernel
        return self.in_channels * area, self.out_channels * area


@dataclass(frozen=True)
class ReLU:
    """y = max(x, 0), element-wise."""

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}


@dataclass(frozen=True)
class MaxPool:
    """Max over size×size windows taken every ``stride`` pixels (windows overlap when stride < size).

    y[n, c, i, j] = max_{p,q < size} x[n, c, i·s + p, j·s + q]
    """

    size: int = 2
    stride: int = 2

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(shape) != 3:
            raise ValueError(f"{self}: expects input (C, H, W), got {shape}")
        channels, height, width = shape
        out_h = window_count(height, self.size, self.stride)
        out_w = window_count(width, self.size, self.stride)
        if out_h < 1 or out_w < 1:
            raise ValueError(f"{self}: a {self.size}x{self.size} window does not fit input {shape}")
        return (channels, out_h, out_w)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}


@dataclass(frozen=True)
class Flatten:
    """(C, H, W) → (C·H·W,), in C order."""

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (int(np.prod(shape)),)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}


@dataclass(frozen=True)
class Dense:
    """Fully connected layer: y = x Wᵀ + b with W of shape (out, in)."""

    in_features: int
    out_features: int

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if shape != (self.in_features,):
            raise ValueError(f"{self}: expects input ({self.in_features},), got {shape}")
        return (self.out_features,)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"W": (self.out_features, self.in_features), "b": (self.out_features,)}

    def fans(self) -> tuple[int, int]:
        return self.in_features, self.out_features


Layer = Conv | ReLU | MaxPool | Flatten | Dense


class ParamSlot(NamedTuple):
    """Where one parameter tensor sits inside the flat vector."""

    layer: int
    name: str          # "W" or "b"
    shape: tuple[int, ...]
    offset: int
    size: int


@dataclass(frozen=True)
class Network:
    """A sequence of layers applied to inputs of ``input_shape`` = (C, H, W)."""

    name: str
    input_shape: tuple[int, int, int]
    layers: tuple[Layer, ...]

    def __post_init__(self):
        self.activation_shapes()  # fail at construction if the shapes do not chain

    def activation_shapes(self) -> list[tuple[int, ...]]:
        """Per-sample shape entering each layer, then the output shape (len = layers + 1)."""
        shapes = [tuple(self.input_shape)]
        for index, layer in enumerate(self.layers):
            try:
                shapes.append(layer.output_shape(shapes[-1]))
            except ValueError as err:
                raise ValueError(f"network {self.name!r}, layer {index}: {err}") from None
        if len(shapes[-1]) != 1:
            raise ValueError(f"network {self.name!r}: must end in a vector of class scores, got {shapes[-1]}")
        return shapes

    @property
    def num_classes(self) -> int:
        return self.activation_shapes()[-1][0]

    def param_layout(self) -> list[ParamSlot]:
        slots, offset = [], 0
        for index, layer in enumerate(self.layers):
            for name, shape in layer.param_shapes().items():
                size = int(np.prod(shape))
                slots.append(ParamSlot(index, name, shape, offset, size))
                offset += size
        return slots

    @property
    def num_params(self) -> int:
        return sum(slot.size for slot in self.param_layout())


def param_views(net: Network, flat: np.ndarray) -> list[dict[str, np.ndarray]]:
    """Per-layer dicts of views into ``flat``: ``views[i]["W"]`` aliases the weights of layer i."""
    if flat.ndim != 1 or flat.size != net.num_params:
        raise ValueError(f"flat vector has shape {flat.shape}, network {net.name!r} needs ({net.num_params},)")
    views: list[dict[str, np.ndarray]] = [{} for _ in net.layers]
    for slot in net.param_layout():
        views[slot.layer][slot.name] = flat[slot.offset:slot.offset + slot.size].reshape(slot.shape)
    return views


INIT_SCHEMES = ("uniform", "xavier", "he")
LOGITS_SCALE = 0.1   # he: the last layer's standard deviation, relative to He's


def init_params(net: Network, scheme: str = "he", seed: int = 0, dtype=np.float32) -> np.ndarray:
    """A fresh flat parameter vector; biases start at zero.

    - ``uniform``: W ~ U(−0.05, 0.05), the fix for exploding early gradients of a 2017 course
      report that trained a stripped-down AlexNet on CIFAR-10 (``alexnet_small``).
    - ``xavier``:  W ~ U(−a, a), a = √(6 / (fan_in + fan_out))   (Glorot & Bengio, 2010).
    - ``he``:      W ~ N(0, 2 / fan_in)                            (He et al., 2015; suits ReLU),
                   except the last layer's, which starts 10× smaller (``LOGITS_SCALE``).

    He's variance keeps the size of the activations from layer to layer through conv+ReLU
    pairs, but not through max-pooling: the max of four values is larger than a typical one.
    Drawn full size, the last layer turns that growth into class scores spread by several
    units, and the untrained network is confidently wrong (LeNet-5's loss on MNIST starts at
    3.5–10.8 over seeds 0–4). Scaled down it starts near ln(10) = 2.30, the loss of a network
    that knows nothing (2.31–2.43) — the first sanity check of any training run.
    ``uniform`` and ``xavier`` already start there and are left as they are.
    """
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"unknown init scheme {scheme!r}; choose one of {', '.join(INIT_SCHEMES)}")
    rng = np.random.default_rng(seed)
    last_index = net.param_layout()[-1].layer
    flat = np.zeros(net.num_params, dtype=dtype)
    views = param_views(net, flat)
    for index, (layer, params) in enumerate(zip(net.layers, views)):
        if "W" not in params:
            continue
        fan_in, fan_out = layer.fans()
        shape = params["W"].shape
        if scheme == "uniform":
            params["W"][...] = rng.uniform(-0.05, 0.05, shape)
        elif scheme == "xavier":
            bound = np.sqrt(6.0 / (fan_in + fan_out))
            params["W"][...] = rng.uniform(-bound, bound, shape)
        else:
            scale = LOGITS_SCALE if index == last_index else 1.0
            params["W"][...] = rng.normal(0.0, scale * np.sqrt(2.0 / fan_in), shape)
    return flat


def lenet5() -> Network:
    """LeNet-5 for MNIST (28×28×1), with ReLU and max-pooling as most modern versions use."""
    return Network("lenet5", (1, 28, 28), (
        Conv(1, 6, 5), ReLU(), MaxPool(2, 2),      # 6×24×24 → 6×12×12
        Conv(6, 16, 5), ReLU(), MaxPool(2, 2),     # 16×8×8  → 16×4×4
        Flatten(),
        Dense(256, 120), ReLU(),
        Dense(120, 84), ReLU(),
        Dense(84, 10),
    ))


def alexnet_small() -> Network:
    """The stripped-down AlexNet for CIFAR-10 (32×32×3) of a 2017 course report on a parameter server over MPI."""
    return Network("alexnet-small", (3, 32, 32), (
        Conv(3, 32, 5, pad=2), ReLU(), MaxPool(2, 2),    # 32×32×32 → 32×16×16
        Conv(32, 32, 5, pad=2), ReLU(), MaxPool(2, 2),   # 32×16×16 → 32×8×8
        Conv(32, 64, 5, pad=2), ReLU(), MaxPool(2, 2),   # 64×8×8   → 64×4×4
        Flatten(),
        Dense(1024, 64), ReLU(),
        Dense(64, 32), ReLU(),
        Dense(32, 10),
    ))


NETWORKS = {"lenet5": lenet5, "alexnet-small": alexnet_small}


def reduced(net: Network, input_size: int, widths) -> Network:
    """``net`` with the same layer kinds, kernels, strides, pads and pools, narrower and on a smaller input.

    ``widths`` gives the output channels of each Conv and the width of each hidden Dense, in order;
    the last Dense keeps the number of classes. In Numba's CUDA simulator every thread costs a
    fraction of a millisecond, so the CUDA stages are checked there on these copies: the same
    kernels and launches, a hundred times fewer threads.
    """
    widths, shape, layers = iter(widths), (net.input_shape[0], input_size, input_size), []
    last_dense = max(i for i, layer in enumerate(net.layers) if isinstance(layer, Dense))
    for index, layer in enumerate(net.layers):
        if isinstance(layer, Conv):
            layer = Conv(shape[0], next(widths), layer.kernel, layer.stride, layer.pad)
        elif isinstance(layer, Dense):
            layer = Dense(shape[0], layer.out_features if index == last_dense else next(widths))
        layers.append(layer)
        shape = layer.output_shape(shape)
    return Network(f"{net.name}-reduced", (net.input_shape[0], input_size, input_size), tuple(layers))


#: (input size, widths) of each network's reduced copy for the simulator
REDUCED = {"lenet5": (16, (2, 3, 6, 5)),                  # 16 → 12 → 6 → 2 → 1
           "alexnet-small": (8, (2, 3, 4, 6, 5))}         # pad 2: 8 → 4 → 2 → 1


def get_network(name: str, reduced_copy: bool = False) -> Network:
    """The network called ``name``; with ``reduced_copy``, its narrow copy for the simulator (``REDUCED``)."""
    if name not in NETWORKS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(NETWORKS)}")
    net = NETWORKS[name]()
    return reduced(net, *REDUCED[name]) if reduced_copy else net
