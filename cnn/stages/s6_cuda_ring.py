"""Stage 6 ``cuda-ring``: gradients go into a ring of K device slots, copied out while the next step computes.

What changes against stage 5 (``cuda-fused``) — the arithmetic is stage 5's, kernel for kernel;
what moves is where the gradient goes and on which stream things run:

- The flat gradient is no longer one vector. A ``GradientRing`` (``kernels/gradient_ring.py``)
  holds K preallocated slots (K = ``slots``, default 2); the backward pass of step t writes slot
  t mod K, then the optimizer consumes it. After warm-up a step allocates nothing on the device
  (``tests/test_cuda_ring.py`` counts the allocations).
- Every kernel and batch copy of a step goes to the stage's own *compute stream*. As soon as the
  backward kernels are queued, the finished slot is copied to pinned host memory on a *copy
  stream*: that copy runs while the compute stream goes on with the update and the next step.
  ``stage.host_gradient(step)`` hands it out (for logging, a gradient-norm monitor, the MPI
  workers); ``gradient_norm(step)`` is one such reader.
- A slot is never overwritten while a consumer still needs it. Before step t writes slot s, the
  compute stream waits (on the device) for the copy of the slot's previous content, and the
  host waits while a host reader (``host_reader=True``) has not released it with
  ``ring.release_host(step)``: a lagging consumer slows the producer down, it never loses data.
- ``accumulate=True``: gradient accumulation over the K slots. ``update`` applies nothing for
  K − 1 micro-batches, then one step with the gradient of all K together,
      g = Σ_s (n_s / Σ n) · g_s        (each slot is a mean over its own n_s samples)
  which equals the gradient of the concatenated batch: an effective batch K times larger for the
  memory of one. ``accumulated_grad()`` returns g. (Calling ``backward`` twice with no ``update``
  in between, as ``loss_and_grad`` does, releases the unused slot and drops a partial group.)

Launches per step are stage 5's (26 for LeNet-5, 30 for AlexNet-small); with accumulation the
update costs 2 launches (``weighted_sum`` then ``sgd_momentum``) every K micro-batches and 0 in
between. ``fetch_loss`` copies on the compute stream, so it does not wait for the copy stream.

Overlap is measured, not claimed: ``python -m cnn bench --timeline`` (``cnn/bench/timeline.py``) records CUDA
events on both streams around every step and every copy and writes the intervals and the overlap
to ``benchmarks/results/ring-timeline-*.json``. NOT YET MEASURED ON A GPU. In Numba's simulator
streams run one after another and events carry no time, so the command refuses to run there.
"""

from __future__ import annotations

import numpy as np

from cnn.model import param_views
from cnn.stages.s5_cuda_fused import CudaFusedStage
from kernels import sgd
from kernels.device import cuda
from kernels.gradient_ring import DEFAULT_TIMEOUT_S, GradientRing, weighted_sum
from kernels.streams import StreamLaunchCounter


class CudaRingStage(CudaFusedStage):
    name = "cuda-ring"
    summary = "Numba CUDA: stage 5 + a ring of K gradient slots, copied to pinned host memory on a second stream"

    def __init__(self, net, dtype=np.float32, slots: int = 2, accumulate: bool = False, host_reader: bool = False,
                 timeout: float | None = DEFAULT_TIMEOUT_S, timing: bool = False):
        super().__init__(net, dtype)
        self.ring = GradientRing(net.num_params, slots, self.stream, host_reader, timeout, timing)
        self.slot_grads = [(view, param_views(net, view)) for view in self.ring.views]
        self.d_grad, self.grad_views = self.slot_grads[0]
        self.accumulate = accumulate
        self.steps_done = 0              # backward passes so far: step t writes slot t mod K
        self.unconsumed = None           # (step, slot) written by the last backward, not yet given to update
        self.group = []                  # accumulation: (slot, batch size) waiting for the K-th micro-batch
        self.d_weights = cuda.device_array(self.ring.slots, dtype=np.float32)
        self.d_accumulated = cuda.device_array(net.num_params, dtype=np.float32)
        self.host_loss = np.zeros(1, np.float32)

    def make_launcher(self):
        self.stream = cuda.stream()      # the compute stream: every kernel and batch copy of a step
        return StreamLaunchCounter(self.stream)

    # -- the phases that change -----------------------------------------------------------------
    def backward(self):
        self._release_unconsumed()
        step = self.steps_done
        slot, _ = self.ring.begin_write(step)
        self.d_grad, self.grad_views = self.slot_grads[slot]
        self.backward_blocks()
        self.ring.end_write(slot)
        self.unconsumed, self.steps_done = (step, slot), step + 1

    def backward_blocks(self):
        """The blocks' backward passes, writing into ``self.d_grad`` (stage 7 adds its zeroing launch here)."""
        super().backward()

    def update(self, lr, momentum, weight_decay):
        if self.unconsumed is None:
            raise RuntimeError(f"stage {self.name!r}: update() needs a gradient; call backward() first")
        _, slot = self.unconsumed
        self.unconsumed = None
        if not self.accumulate:
            super().update(lr, momentum, weight_decay)          # SGD from self.d_grad, the slot just written
            self.ring.consumed(slot)
            return
        self.group.append((slot, self.d_images.shape[0]))
        if len(self.group) == self.ring.slots:
            self._apply_accumulated(lr, momentum, weight_decay)
        else:
            self.count_step_launches()

    def fetch_loss(self):
        self.d_loss.copy_to_host(self.host_loss, stream=self.stream)
        self.stream.synchronize()                     # the compute stream only: the copy stream runs on
        return float(self.host_loss[0])

    # -- gradient accumulation --------------------------------------------------------------------
    def _apply_accumulated(self, lr, momentum, weight_decay):
        """One SGD step with g = Σ_s (n_s / Σ n) g_s over the K slots of the group; then they are free."""
        weights = np.zeros(self.ring.slots, np.float32)
        total = sum(size for _, size in self.group)
        for slot, size in self.group:
            weights[slot] = size / total
        self.d_weights.copy_to_device(weights, stream=self.stream)
        weighted_sum(self.ring.device, self.d_weights, self.d_accumulated, self.launch)
        sgd.sgd_momentum(self.d_params, self.d_velocity, self.d_accumulated, lr, momentum, weight_decay, self.launch)
        self.count_step_launches()
        for slot, _ in self.group:
            self.ring.consumed(slot)
        self.group = []

    def _release_unconsumed(self):
        """A gradient nobody passed to update (``loss_and_grad``): free its slot, and any partial group."""
        if self.unconsumed is not None:
            self.ring.consumed(self.unconsumed[1])
            self.unconsumed = None
            for slot, _ in self.group:
                self.ring.consumed(slot)
            self.group = []

    def accumulated_grad(self) -> np.ndarray:
        """The gradient the last accumulated update used (host copy): the gradient of the concatenated batch."""
        return self.d_accumulated.copy_to_host()

    # -- readers of the host copies ---------------------------------------------------------------
    def host_gradient(self, step: int | None = None) -> np.ndarray:
        """Pinned host copy of the gradient of ``step`` (default: the last one), a read-only view."""
        return self.ring.host_copy(self.steps_done - 1 if step is None else step)

    def gradient_norm(self, step: int | None = None) -> float:
        """‖g‖₂ of step ``step``, from its host copy: the monitor that needs no device time."""
        return float(np.linalg.norm(self.host_gradient(step).astype(np.float64)))


if __name__ == "__main__":      # the timeline is a benchmark command now
    raise SystemExit("python -m cnn.stages.s6_cuda_ring: moved to python -m cnn bench --timeline")
