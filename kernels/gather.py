"""A batch gathered on the device from a training set that lives there (stage 7's ``resident-data`` fix).

Stages 4–6 copy every batch from the host: N·C·H·W floats and N labels a step through PCIe, and
the host first gathers the shuffled samples into a contiguous array. When the whole training
set is resident on the device (MNIST: 60 000 × 784 floats = 188 MB; CIFAR-10: 614 MB) a step
copies nothing: the shuffled order is an index vector on the device, uploaded once an epoch,
and one kernel gathers the batch.

Thread-to-data mapping: the images are seen as rows of D = C·H·W floats. Thread k of the batch
(B × D elements) copies one float:

    b = k // D,  d = k mod D,  s = order[start + b]
    batch_images[b, d] = images[s, d]          and, for d = 0,   batch_labels[b] = labels[s]

Consecutive threads read consecutive floats of one sample (coalesced), whatever the order.
"""

from __future__ import annotations

from kernels.device import cuda
from kernels.launch import grid_1d, launch


@cuda.jit(device=True)
def gathered_from(order, start, k, per_sample):
    """(b, d, s): float k of the batch is element d of row b, copied from sample s = order[start + b]."""
    b, d = k // per_sample, k % per_sample
    return b, d, order[start + b]


@cuda.jit(device=True)
def gather_element(images, labels, order, start, k, batch_images, batch_labels):
    """Thread k's float of the batch: row b = k // D, element d = k mod D, from sample order[start + b]."""
    if k < batch_images.size:
        b, d, source = gathered_from(order, start, k, batch_images.shape[1])
        batch_images[b, d] = images[source, d]
        if d == 0:
            batch_labels[b] = labels[source]


@cuda.jit
def gather_batch_kernel(images, labels, order, start, batch_images, batch_labels):
    gather_element(images, labels, order, start, cuda.grid(1), batch_images, batch_labels)


def gather_batch(images, labels, order, start, batch_images, batch_labels, threads=128, launch=launch):
    """batch_images[b] ← images[order[start + b]] (rows of D floats), and the labels likewise."""
    launch(gather_batch_kernel, *grid_1d(batch_images.size, threads),
           images, labels, order, start, batch_images, batch_labels)
