"""What every benchmark trains on: the course's hyperparameters and a few batches of real or random images."""

from __future__ import annotations

import numpy as np


def course_hyperparameters() -> tuple[float, float, float]:
    """(lr, momentum, weight decay) of the course's default training recipe (cnn.train.TrainConfig)."""
    from cnn.train import TrainConfig

    defaults = TrainConfig()
    return defaults.lr, defaults.momentum, defaults.weight_decay


def benchmark_batches(net, args, count: int = 8) -> tuple[list, str]:
    """``count`` (images, labels) batches of ``args.batch_size`` and a description of where they came from."""
    dtype, size = np.dtype(args.dtype), args.batch_size
    if args.data == "random":
        rng = np.random.default_rng(args.seed)
        images = rng.standard_normal((count * size, *net.input_shape)).astype(dtype)
        labels, source = rng.integers(0, net.num_classes, count * size), "random"
    else:
        images, labels, source = _real_images(args.model, args.data_dir, count * size, dtype)
    if len(images) < size:
        raise ValueError(f"{source}: {len(images)} training images, fewer than one batch of {size}")
    return [(images[i:i + size], labels[i:i + size]) for i in range(0, len(images) - size + 1, size)], source


def _real_images(model: str, data_dir, count: int, dtype):
    """The first ``count`` training images of the model's dataset, normalised, with their labels."""
    from cnn import data
    from cnn.train import DATASET_OF_MODEL

    name = DATASET_OF_MODEL.get(model)
    if name is None:
        raise ValueError(f"model {model!r} has no dataset of its own; use --data random")
    dataset = data.load_mnist(data_dir) if name == "mnist" else data.load_cifar10(data_dir)
    images = data.normalize(dataset.train_images[:count], dataset.mean, dataset.std, dtype)
    return images, dataset.train_labels[:count].astype(np.int64), f"{name} ({dataset.source})"
