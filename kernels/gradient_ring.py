"""A circular buffer of K flat gradient slots on the device (stage 6 ``cuda-ring``).

Why a ring: the backward pass of step t writes its gradient into slot t mod K while the slot of
step t − 1 is still being used — copied to pinned host memory on a second stream (for logging,
gradient-norm monitoring, the MPI workers of the distributed part) or summed with the others
for gradient accumulation. All K slots are allocated once; a step allocates nothing.

The rule that makes it safe: **a slot is never overwritten before every consumer of its last
content has finished with it.** Two classes keep that rule:

``SlotStates`` — the bookkeeping alone, pure Python (no CUDA), so the protocol can be tested
and taught on its own. Each slot moves through three states::

        claim(step)            publish(slot)             release(slot, consumer) by the last consumer
  FREE ───────────► WRITING ───────────────► READY ─────────────────────────────────────────► FREE

``claim(step)`` takes slot step mod K for the producer and WAITS (blocks the calling thread)
while that slot is still READY with consumers that have not released it — a lagging consumer
slows the producer down, it never loses data. After ``timeout`` seconds it raises ``RingStall``
instead of hanging forever.

``GradientRing`` — the slots on the device, with CUDA events for what the host cannot see::

    begin_write(step)  claim the slot; make the compute stream wait (on the device, the host goes
                       on) for event copied[slot]: the previous copy of this slot has left it
    end_write(slot)    record written[slot] on the compute stream; the copy stream waits for it,
                       copies the slot into pinned host row ``host[slot]``, records copied[slot]
    consumed(slot)     the optimizer's kernel reading the slot is queued (on the compute stream,
                       so it runs before any later write there): release "optimizer"
    host_copy(step)    the host waits for copied[slot] and reads the pinned row
    release_host(step) the host reader is done (only when the ring was made with host_reader=True)

Consumers of a slot: "optimizer", and "host" when a host reader holds the pinned copies (it
must call ``release_host``). The device-to-host copy is ordered by events alone.

``weighted_sum(slots, weights, out)``: out[k] = Σ_s weights[s] · slots[s, k] — the gradient of
the concatenated batch from K micro-batch gradients, with weights[s] = n_s / Σ n (each slot holds
a mean over its own n_s samples). Thread k owns element k.
"""

from __future__ import annotations

import threading

import numpy as np

from kernels.device import cuda
from kernels.launch import grid_1d, launch
from kernels.streams import new_event

FREE, WRITING, READY = "free", "writing", "ready"
DEFAULT_TIMEOUT_S = 60.0


class RingStall(RuntimeError):
    """The producer waited ``timeout`` seconds for a slot that a consumer never released."""


class SlotStates:
    """Which of K slots the producer may write, and which consumers still hold each one.

    ``waits`` counts the claims that had to wait; ``producer_waiting`` is set while one does
    (a test or a notebook can watch it). Thread-safe: consumers may release from other threads.
    """

    def __init__(self, slots: int, consumers: tuple[str, ...]):
        if int(slots) < 1:
            raise ValueError(f"a gradient ring needs at least 1 slot, got {slots}")
        self.slots, self.consumers = int(slots), tuple(consumers)
        self.states = [FREE] * self.slots
        self.holders = [set() for _ in range(self.slots)]      # consumers that still hold each slot
        self.step_in = [None] * self.slots                     # the step whose gradient each slot holds
        self.waits = 0
        self.producer_waiting = threading.Event()
        self._changed = threading.Condition()

    def slot_of(self, step: int) -> int:
        return step % self.slots

    def claim(self, step: int, timeout: float | None = DEFAULT_TIMEOUT_S) -> int:
        """Take slot ``step mod K`` for writing; wait while consumers still hold it."""
        slot = self.slot_of(step)
        with self._changed:
            if self.states[slot] == WRITING:
                raise RuntimeError(f"gradient ring: slot {slot} is already being written (step {self.step_in[slot]})")
            if self.holders[slot]:
                self.waits += 1
                self.producer_waiting.set()
                freed = self._changed.wait_for(lambda: not self.holders[slot], timeout)
                self.producer_waiting.clear()
                if not freed:
                    raise RingStall(f"gradient ring: step {step} waited {timeout} s for slot {slot}, still held by "
                                    f"{', '.join(sorted(self.holders[slot]))} since step {self.step_in[slot]}")
            self.states[slot], self.step_in[slot] = WRITING, step
            return slot

    def publish(self, slot: int) -> None:
        """The producer finished writing ``slot``: every consumer now holds it until it releases it."""
        with self._changed:
            if self.states[slot] != WRITING:
                raise RuntimeError(f"gradient ring: publish of slot {slot}, which is {self.states[slot]}, not writing")
            self.states[slot] = READY
            self.holders[slot] = set(self.consumers)
            self._changed.notify_all()

    def release(self, slot: int, consumer: str) -> None:
        """``consumer`` is done with ``slot``; the last one to release frees it for the producer."""
        with self._changed:
            if consumer not in self.holders[slot]:
                raise RuntimeError(f"gradient ring: {consumer!r} released slot {slot}, which it does not hold")
            self.holders[slot].discard(consumer)
            if not self.holders[slot]:
                self.states[slot] = FREE
            self._changed.notify_all()

    def holds(self, slot: int, consumer: str) -> bool:
        with self._changed:
            return consumer in self.holders[slot]

    def state(self, slot: int) -> str:
        return self.states[slot]


@cuda.jit
def weighted_sum_kernel(slots, weights, out):
    k = cuda.grid(1)
    if k < out.size:
        total = np.float32(0.0)
        for s in range(slots.shape[0]):
            total += weights[s] * slots[s, k]
        out[k] = total


def weighted_sum(slots, weights, out, launch=launch):
    """out[k] ← Σ_s weights[s] · slots[s, k]  (slots (K, P), weights (K,) float32, out (P,))."""
    launch(weighted_sum_kernel, *grid_1d(out.size), slots, weights, out)


class GradientRing:
    """K flat gradient slots of ``size`` floats on the device, each copied to pinned host memory when written.

    ``compute_stream``: where the producer (backward) and the optimizer run; the copies get a
    stream of their own. ``host_reader``: a host consumer (logger, MPI worker) holds each copy
    until ``release_host``. ``timing``: two timing events around every copy, kept in
    ``copy_log`` as (step, start, end) — for measuring the overlap on a GPU, not for training.
    """

    def __init__(self, size: int, slots: int = 2, compute_stream=0, host_reader: bool = False,
                 timeout: float | None = DEFAULT_TIMEOUT_S, timing: bool = False):
        consumers = ("optimizer", "host") if host_reader else ("optimizer",)
        self.states = SlotStates(slots, consumers)
        self.size, self.timeout = int(size), timeout
        self.compute_stream, self.copy_stream = compute_stream, cuda.stream()
        self.device = cuda.device_array((self.states.slots, self.size), dtype=np.float32)
        self.host = cuda.pinned_array((self.states.slots, self.size), dtype=np.float32)
        self.views = [self.device[slot] for slot in range(self.states.slots)]     # flat (P,) views, made once
        self.written = [new_event() for _ in self.views]
        self.copied = [new_event() for _ in self.views]
        self.timing, self.copy_log = timing, []

    @property
    def slots(self) -> int:
        return self.states.slots

    def begin_write(self, step: int):
        """(slot, its flat device view) for the gradient of ``step``; waits for the slot's consumers first."""
        slot = self.states.claim(step, self.timeout)
        self.copied[slot].wait(self.compute_stream)      # device-side: the previous copy out of this slot is done
        return slot, self.views[slot]

    def end_write(self, slot: int) -> None:
        """The backward kernels writing ``slot`` are queued: queue its copy to the pinned host row after them."""
        self.written[slot].record(self.compute_stream)
        self.written[slot].wait(self.copy_stream)
        if self.timing:
            self.copy_log.append((self.states.step_in[slot], new_event(True), new_event(True)))
            self.copy_log[-1][1].record(self.copy_stream)
        self.views[slot].copy_to_host(self.host[slot], stream=self.copy_stream)
        if self.timing:
            self.copy_log[-1][2].record(self.copy_stream)
        self.copied[slot].record(self.copy_stream)
        self.states.publish(slot)

    def consumed(self, slot: int) -> None:
        """The optimizer's use of ``slot`` is queued on the compute stream: it no longer holds the slot."""
        self.states.release(slot, "optimizer")

    def slot_of_step(self, step: int) -> int:
        slot = self.states.slot_of(step)
        if self.states.step_in[slot] != step or self.states.state(slot) == WRITING:
            raise ValueError(f"gradient ring: step {step} is not in the ring (it holds steps "
                             f"{sorted(s for s in self.states.step_in if s is not None)})")
        return slot

    def host_copy(self, step: int) -> np.ndarray:
        """The pinned host copy of step ``step``'s gradient (read-only view), once its copy has finished."""
        slot = self.slot_of_step(step)
        self.copied[slot].synchronize()
        view = self.host[slot].view()
        view.flags.writeable = False
        return view

    def release_host(self, step: int) -> None:
        """The host reader is done with step ``step``'s copy (rings made with ``host_reader=True``)."""
        self.states.release(self.slot_of_step(step), "host")
