"""The same network in PyTorch, parameter for parameter: the yardstick of the benchmark.

``torch_model(net)`` builds an ``nn.Sequential`` from our layer specs. Our flat
vector keeps each layer's weight then bias in C order, with Conv W as (F, C, K, K)
and Dense W as (out, in) — exactly the shapes of ``nn.Conv2d.weight`` and
``nn.Linear.weight`` — so the flat layout *is* the order of ``model.parameters()``
and the mapping is a copy per tensor, no transpose::

    load_flat_params(model, flat)      our flat vector  → torch parameters
    flat_grad(model)                   torch .grad      → our flat layout

PyTorch is optional (``pip install -e '.[bench]'``); it is imported only when a
function here is called.
"""

from __future__ import annotations

import numpy as np

from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU

TORCH_MISSING = "PyTorch is optional: pip install -e '.[bench]'"


def _torch():
    try:
        import torch
    except ImportError:
        raise ImportError(TORCH_MISSING) from None
    return torch


def _torch_layer(nn, layer):
    if isinstance(layer, Conv):
        return nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel, layer.stride, layer.pad)
    if isinstance(layer, ReLU):
        return nn.ReLU()
    if isinstance(layer, MaxPool):
        return nn.MaxPool2d(layer.size, layer.stride)
    if isinstance(layer, Flatten):
        return nn.Flatten()
    if isinstance(layer, Dense):
        return nn.Linear(layer.in_features, layer.out_features)
    raise TypeError(f"no PyTorch equivalent for layer {layer!r}")


def torch_model(net: Network, dtype=np.float32):
    """``nn.Sequential`` with the layers of ``net`` in order, on the CPU, in ``dtype``."""
    torch = _torch()
    model = torch.nn.Sequential(*[_torch_layer(torch.nn, layer) for layer in net.layers])
    return model.to(getattr(torch, np.dtype(dtype).name))


def load_flat_params(model, flat: np.ndarray) -> None:
    """Copy our flat parameter vector into the model's parameters (same order, same shapes)."""
    torch = _torch()
    parameters = list(model.parameters())
    total = sum(p.numel() for p in parameters)
    if flat.ndim != 1 or flat.size != total:
        raise ValueError(f"flat vector has shape {flat.shape}, the torch model needs ({total},)")
    offset = 0
    with torch.no_grad():
        for parameter in parameters:
            block = flat[offset:offset + parameter.numel()].reshape(parameter.shape)
            parameter.copy_(torch.from_numpy(np.ascontiguousarray(block)))
            offset += parameter.numel()


def flat_params(model) -> np.ndarray:
    """The model's parameters as one flat vector in our layout."""
    return np.concatenate([p.detach().cpu().numpy().ravel() for p in model.parameters()])


def flat_grad(model) -> np.ndarray:
    """The gradient left by ``loss.backward()``, as one flat vector in our layout."""
    return np.concatenate([p.grad.detach().cpu().numpy().ravel() for p in model.parameters()])


def torch_loss_and_grad(model, images: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy and its flat gradient at the model's current parameters."""
    torch = _torch()
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(images)), torch.from_numpy(labels))
    loss.backward()
    return loss.item(), flat_grad(model)


def sgd_optimizer(model, lr: float, momentum: float = 0.9, weight_decay: float = 0.0):
    """torch.optim.SGD: the same update rule as ``cnn.stages.base.sgd_momentum_update``."""
    return _torch().optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def torch_train_step(model, optimizer, x, y) -> float:
    """One step: forward, cross-entropy, backward, SGD update; ``x``/``y`` numpy arrays or tensors."""
    torch = _torch()
    x = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    y = torch.from_numpy(np.asarray(y, dtype=np.int64)) if not isinstance(y, torch.Tensor) else y
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()
