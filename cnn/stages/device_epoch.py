"""An epoch run on the device, the host waiting once every K steps (stage 7's ``device-epoch`` and ``cuda-graph``).

The trainer hands a stage an epoch (``begin_epoch``: the sample order, a learning rate a step)
and asks for K steps at a time (``run_steps``). ``DeviceEpoch`` keeps what those steps need on
the device — read there by the kernels of ``kernels/device_epoch.py``, never passed from the host:

    state       int32 [step counter, first step whose loss was not finite (−1: none)]
    order       the epoch's shuffle, B sample indices a step       (uploaded once an epoch)
    lrs         one learning rate a step                            (uploaded once an epoch)
    loss_log    one mean loss a step, written by the step itself    (copied back once a request)

``run(first, count)`` sets the counter to ``first`` and queues ``count`` steps: each step the
stage's ``queue_step(slot)`` (the kernels, one by one), or — with ``cuda-graph`` — one replay of
that step recorded as a CUDA graph (``kernels/step_graph.py``). Step t writes gradient slot
t mod K of stage 6's ring, so the graphs are K: one per slot, each recorded right after the
first eager step that used its slot (that step compiles the kernels and allocates the buffers a
graph must find in place). Then one copy of the losses and the state, one wait, and the check
that the device ran exactly ``count`` steps.

A recorded graph holds the device addresses and the numbers it was recorded with: the batch
size, momentum and weight decay (scalar kernel arguments) and the arrays above. A new epoch with
the same ones reuses the graphs; anything else drops them, and the next steps record new ones.
"""

from __future__ import annotations

import numpy as np

from kernels.device import cuda
from kernels.step_graph import StepGraph, graphs_supported

INDEX = np.int32


def resident_set(stage, images, labels, which: str):
    """A labelled set checked against ``stage.net`` and copied to the device once: (float32 images, int32 labels)."""
    images, labels = np.ascontiguousarray(images, dtype=np.float32), np.asarray(labels)
    if images.ndim != 4 or images.shape[1:] != tuple(stage.net.input_shape):
        expected = ", ".join(map(str, stage.net.input_shape))
        raise ValueError(f"stage {stage.name!r}: the {which} images have shape {images.shape}, "
                         f"network {stage.net.name!r} expects (N, {expected})")
    if len(labels) and (labels.min() < 0 or labels.max() >= stage.net.num_classes):
        raise ValueError(f"stage {stage.name!r}: the {which} labels must lie in [0, {stage.net.num_classes})")
    return cuda.to_device(images), cuda.to_device(labels.astype(INDEX))


class DeviceEpoch:
    """The device side of a running epoch, and the loop that queues (or replays) its steps."""

    def __init__(self, stream, slots: int, queue_step, use_graphs: bool):
        self.stream, self.slots, self.queue_step = stream, slots, queue_step
        self.use_graphs = use_graphs and graphs_supported()
        self.host_state = cuda.pinned_array(2, dtype=INDEX)
        self.state = cuda.device_array(2, dtype=INDEX)
        self.counter, self.first_bad = self.state[0:1], self.state[1:2]
        self.order = self.lrs = self.loss_log = None
        self.host_order = self.host_lrs = self.host_losses = None
        self.graphs: dict[int, StepGraph] = {}
        self.recorded_with = None

    def begin(self, plan) -> None:
        """Upload the epoch's order and learning rates (through pinned memory, on the stream)."""
        steps, samples = plan.steps, plan.steps * plan.batch_size
        if self.order is None or len(self.order) < samples or len(self.lrs) < steps:
            self.drop_graphs()                         # new arrays: the recorded addresses are stale
            self.order, self.host_order = cuda.device_array(samples, INDEX), cuda.pinned_array(samples, INDEX)
            self.lrs, self.host_lrs = cuda.device_array(steps, np.float32), cuda.pinned_array(steps, np.float32)
            self.loss_log, self.host_losses = (cuda.device_array(steps, np.float32),
                                               cuda.pinned_array(steps, np.float32))
        if self.recorded_with != (plan.batch_size, plan.momentum, plan.weight_decay):
            self.drop_graphs()
            self.recorded_with = (plan.batch_size, plan.momentum, plan.weight_decay)
        self.stream.synchronize()                      # the pinned buffers are free to refill
        self.host_order[:samples] = plan.order[:samples]
        self.host_lrs[:steps] = plan.lrs
        self.order[:samples].copy_to_device(self.host_order[:samples], stream=self.stream)
        self.lrs[:steps].copy_to_device(self.host_lrs[:steps], stream=self.stream)

    def run(self, first: int, count: int) -> np.ndarray:
        """Steps first … first + count − 1: queued or replayed, then ONE wait; their losses (float64)."""
        self.host_state[:] = (first, -1)
        self.state.copy_to_device(self.host_state, stream=self.stream)
        for step in range(first, first + count):
            slot = step % self.slots
            if slot in self.graphs:
                self.graphs[slot].replay()
                continue
            self.queue_step(slot)
            if self.use_graphs:
                self.graphs[slot] = StepGraph(self.stream, lambda: self.queue_step(slot))
        losses = self.host_losses[first:first + count]
        self.loss_log[first:first + count].copy_to_host(losses, stream=self.stream)
        self.state.copy_to_host(self.host_state, stream=self.stream)
        self.stream.synchronize()
        if self.host_state[0] != first + count:
            raise RuntimeError(f"device epoch: asked for steps {first}-{first + count - 1}, "
                               f"but the step counter reached {self.host_state[0]}")
        return losses.astype(np.float64)

    def first_bad_step(self) -> int | None:
        """The first step of the last ``run`` whose loss was NaN or infinite (the device's flag), or None."""
        return None if self.host_state[1] < 0 else int(self.host_state[1])

    def drop_graphs(self) -> None:
        for graph in self.graphs.values():
            graph.close()
        self.graphs = {}
