"""Stage 6 ``cuda-ring``: the ring protocol on its own (pure Python), then the stage against stage 2.

The protocol tests need no CUDA: ``SlotStates`` is the bookkeeping the device ring uses. The
stage tests run in Numba's simulator on a tiny network (every simulated thread costs a fraction of
a millisecond); the full-size networks are checked by the tests marked ``gpu``.
"""

import threading

import numpy as np
import pytest
from test_cuda_stages import HYPER, TOL, compare_training, prepared, random_batch, start_params

from cnn.bench.timeline import ring_timeline
from cnn.cli import main
from cnn.gradcheck import rel_error
from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU, alexnet_small, lenet5
from cnn.stages import get_stage, stage_names
from cnn.stages.s2_numpy import NumpyStage
from cnn.stages.s6_cuda_ring import CudaRingStage
from kernels.device import simulated
from kernels.gradient_ring import FREE, READY, WRITING, RingStall, SlotStates
from kernels.streams import AllocationCounter, CopyCounter

# one fused conv block (its gradient goes through stage 5's push kernel) and one dense layer
TINY = Network("tiny", (1, 6, 6), (Conv(1, 2, 3), ReLU(), MaxPool(2, 2), Flatten(), Dense(8, 3)))


# -- the protocol, without CUDA ----------------------------------------------------------------------
def test_slots_go_round_free_writing_ready_free():
    states = SlotStates(2, ("optimizer", "copy"))
    for step in range(5):
        slot = states.claim(step)
        assert slot == step % 2 and states.state(slot) == WRITING
        states.publish(slot)
        assert states.state(slot) == READY
        states.release(slot, "copy")
        assert states.state(slot) == READY          # the optimizer still holds it
        states.release(slot, "optimizer")
        assert states.state(slot) == FREE
    assert states.waits == 0


def test_protocol_misuse_is_refused_in_one_line():
    states = SlotStates(2, ("optimizer",))
    slot = states.claim(0)
    with pytest.raises(RuntimeError, match="already being written"):
        states.claim(2)
    with pytest.raises(RuntimeError, match="does not hold"):
        states.release(slot, "optimizer")
    states.publish(slot)
    with pytest.raises(RuntimeError, match="not writing"):
        states.publish(slot)
    with pytest.raises(ValueError, match="at least 1 slot"):
        SlotStates(0, ("optimizer",))


def test_lagging_consumer_makes_the_producer_wait_never_overwrite():
    """Slot 0 is still held by a slow consumer when step 2 wants it: the producer blocks until the release."""
    states, order = SlotStates(2, ("logger",)), []
    for step in range(2):
        states.publish(states.claim(step))          # steps 0 and 1 written, the logger reads neither yet

    def producer():
        order.append(("claimed", states.claim(2)))

    thread = threading.Thread(target=producer)
    thread.start()
    assert states.producer_waiting.wait(timeout=30)      # the producer is blocked on slot 0 ...
    assert order == [] and states.state(0) == READY and states.step_in[0] == 0   # ... which still holds step 0
    order.append("released")
    states.release(0, "logger")
    thread.join(timeout=30)
    assert order == ["released", ("claimed", 0)] and states.waits == 1 and states.step_in[0] == 2


def test_a_consumer_that_never_releases_stalls_the_producer_with_one_line():
    states = SlotStates(1, ("mpi-worker",))
    states.publish(states.claim(0))
    with pytest.raises(RingStall, match="step 1 waited 0.05 s for slot 0, still held by mpi-worker since step 0"):
        states.claim(1, timeout=0.05)
    assert states.state(0) == READY and states.step_in[0] == 0


# -- the stage in the simulator ----------------------------------------------------------------------
def test_registry_order():
    names = stage_names()
    assert names[names.index("cuda-fused") + 1:names.index("cuda-fused") + 3] == ["cuda-ring", "cuda-tuned"]
    assert get_stage("cuda-ring") is CudaRingStage


def test_ring_stage_trains_like_numpy_without_allocating():
    """K = 2 slots, 3 steps (slot 0 is reused); host copies, launches, and no device allocation after step 1."""
    net = TINY
    params = start_params(net)
    ring, ref = prepared(CudaRingStage, net, np.float32, params), prepared(NumpyStage, net, np.float64, params)
    grads = []
    for step in range(3):
        images, labels = random_batch(net, 2, seed=step)
        with AllocationCounter() as allocations, CopyCounter() as copies:
            loss = ring.train_step(images, labels, **HYPER)
        assert (copies.to_device, copies.to_host) == (2, 2)     # images, labels in; gradient slot, loss out
        assert rel_error(loss, ref.train_step(images.astype(np.float64), labels, **HYPER)) < TOL
        grads.append(ref.get_grad())
        assert rel_error(ring.get_grad(), grads[-1]) < TOL
        if step > 0:
            assert allocations.count == 0, f"step {step} allocated on the device: {allocations.calls}"
    assert rel_error(ring.get_params(), ref.get_params()) < TOL
    assert rel_error(ring.get_momentum(), ref.get_momentum()) < TOL
    for step in (1, 2):                                     # the last K steps are still in the ring
        assert rel_error(ring.host_gradient(step), grads[step]) < TOL
    assert ring.gradient_norm() == pytest.approx(np.linalg.norm(grads[2]), rel=1e-5)
    # stage 5's kernels, no more: conv block 1 + 2 (fill, push; no dX), dense 2 + 3, loss, update
    assert ring.launches_per_step() == 10
    with pytest.raises(ValueError, match="step 0 is not in the ring"):
        ring.host_gradient(0)


def test_accumulated_gradient_is_the_gradient_of_the_concatenated_batch():
    """Micro-batches of 1 and 2 samples in K = 2 slots = one SGD step on the 3 samples together."""
    net, params = TINY, start_params(TINY)
    ring = CudaRingStage(net, slots=2, accumulate=True, timeout=5)
    with pytest.raises(RuntimeError, match="call backward"):
        ring.update(**HYPER)
    ring.set_params(params)
    ring.set_momentum(np.zeros_like(params))
    ref = prepared(NumpyStage, net, np.float64, params)
    images, labels = random_batch(net, 3, seed=7)
    ring.train_step(images[:1], labels[:1], **HYPER)
    assert rel_error(ring.get_params(), params) < 1e-7           # nothing applied after the first micro-batch
    ring.train_step(images[1:], labels[1:], **HYPER)
    ref.train_step(images.astype(np.float64), labels, **HYPER)
    assert rel_error(ring.accumulated_grad(), ref.get_grad()) < TOL
    assert rel_error(ring.get_params(), ref.get_params()) < TOL
    assert rel_error(ring.get_momentum(), ref.get_momentum()) < TOL
    for _ in range(3):                                           # gradients nobody updates with free their slots
        assert rel_error(ring.loss_and_grad(images, labels)[1], ref.loss_and_grad(images, labels)[1]) < TOL


def test_lagging_host_reader_makes_the_ring_stage_wait():
    """A host reader holds step 0's copy: step 2's backward waits until it lets go, and the copy stays intact."""
    net = TINY
    ring = CudaRingStage(net, slots=2, host_reader=True, timeout=60).init("xavier", 3)
    batches = [random_batch(net, 2, seed=step) for step in range(3)]
    ring.train_step(*batches[0], **HYPER)
    grad_step0 = ring.get_grad()
    ring.train_step(*batches[1], **HYPER)
    seen = {}

    def reader():          # a logger that is slow to finish with step 0 (it touches no CUDA, only the ring)
        seen["waiting"] = ring.ring.states.producer_waiting.wait(timeout=60)
        seen["copy"] = np.array(ring.ring.host[0])
        ring.ring.release_host(0)

    thread = threading.Thread(target=reader)
    thread.start()
    ring.train_step(*batches[2], **HYPER)           # blocks in backward until the reader releases slot 0
    thread.join(timeout=60)
    assert seen["waiting"] and ring.ring.states.waits == 1
    assert rel_error(seen["copy"], grad_step0) < 1e-7        # step 0's copy was not overwritten while held
    assert rel_error(ring.host_gradient(2), ring.get_grad()) < 1e-7
    ring.ring.timeout = 0.05                               # nobody releases step 1: the next step stalls, loudly
    with pytest.raises(RingStall, match="slot 1, still held by host since step 1"):
        ring.train_step(*batches[0], **HYPER)


def test_timeline_refuses_in_the_simulator():
    if not simulated():
        pytest.skip("a real GPU runs the timeline (see the gpu test)")
    with pytest.raises(RuntimeError, match="simulator"):
        ring_timeline(CudaRingStage(TINY, timing=True), [random_batch(TINY, 2, 0)], (0.01, 0.9, 0.0))
    assert main(["bench", "--timeline"]) == 2


# -- full size, on a GPU -----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("net, batch", [(lenet5(), 16), (alexnet_small(), 8)], ids=["lenet5", "alexnet-small"])
def test_full_size_ring_trains_like_numpy(net, batch):
    stage = compare_training(CudaRingStage, net, batch, steps=3, tol=1e-4)
    images, labels = random_batch(net, batch, seed=5)
    with AllocationCounter() as allocations:
        stage.train_step(images, labels, **HYPER)
    assert allocations.count == 0, allocations.calls
    assert rel_error(stage.host_gradient(), stage.get_grad()) < 1e-7


@pytest.mark.gpu
def test_timeline_reports_both_streams():
    net = lenet5()
    stage = CudaRingStage(net, timing=True).init("he", 0)
    timeline = ring_timeline(stage, [random_batch(net, 64, seed) for seed in range(4)], (0.01, 0.9, 0.0), steps=5)
    assert len(timeline["steps"]) == 5
    for row in timeline["steps"]:
        start, end = row["copy_ms"]
        assert 0 <= start <= end and 0 <= row["overlap_ms"] <= end - start + 1e-6
