"""Notebook 07, stage 6 `cuda-ring`: worked solutions of its three exercises (in the simulator without a GPU)."""

from __future__ import annotations

import inspect

from common import random_array, tiny_lenet, use_simulator_without_gpu

SIMULATED = use_simulator_without_gpu()      # before numba is imported

import numpy as np  # noqa: E402

from cnn.gradcheck import rel_error  # noqa: E402
from cnn.stages import get_stage  # noqa: E402
from kernels.gradient_ring import GradientRing, RingStall, SlotStates  # noqa: E402


def ring_timeline(slots: int, compute: float, reads: list[float]) -> dict:
    """Producer and host reader around a ring of ``slots`` slots, in time units, with SlotStates' bookkeeping.

    The producer computes a step's gradient in ``compute`` units, writes it into slot step mod K and
    publishes it; the host reader reads the published slots in order, read k taking ``reads[k]`` units, and
    releases each when done. A claim of a slot the reader still holds must wait until that read ends."""
    ring, now, reader_free, read_ends, waited = SlotStates(slots, ("host",)), 0.0, 0.0, {}, 0.0
    for step, read in enumerate(reads):
        for held, end in read_ends.items():                    # reads that have ended by now release their slot
            if end <= now and ring.holds(held, "host"):
                ring.release(held, "host")
        slot = ring.slot_of(step)
        try:
            ring.claim(step, timeout=0)
        except RingStall:                                      # still being read: wait for the read to end
            waited += read_ends[slot] - now
            now = read_ends[slot]
            ring.release(slot, "host")
            ring.claim(step, timeout=0)
        now += compute
        ring.publish(slot)
        reader_free = max(now, reader_free) + read
        read_ends[slot] = reader_free
    return {"time_per_step": now / len(reads), "waited_per_step": waited / len(reads), "claims_that_waited": ring.waits}


def exercise_1(fast: bool) -> None:
    """SlotStates(1, ("optimizer", "host")): the producer with a slow host reader; what do 2 and 3 slots buy?

    Answer. With one slot, step t + 1 needs the slot the reader is still reading: every claim waits for
    the read to end, so a step costs compute + read — producer and reader take turns, never overlap, and
    a slow reader slows training by its whole read time. A second slot lets the producer write step t + 1
    while the reader reads step t: the two overlap, and as long as a read takes no longer than a step the
    producer never waits (a step costs max(compute, read)). If reads are on average slower than steps, no
    number of slots helps — the reader is the bottleneck and the producer must slow to its pace (that is
    the rule: it never loses data). A third slot helps when the reader is fast *on average* but irregular
    (a logger that sometimes flushes to disk, a host thread that is sometimes descheduled): the extra slot
    is a buffer that absorbs a long read while the following short ones catch up. The simulation below
    (SlotStates' own bookkeeping on a time line, compute = 1 unit a step) shows all three cases.
    """
    steps = 40 if fast else 400
    cases = {"steady reader, 0.8 a read": [0.8] * steps,
             "bursty reader, 0.5 0.5 0.5 2.0 (mean 0.875)": [0.5, 0.5, 0.5, 2.0] * (steps // 4)}
    found = {}
    for label, reads in cases.items():
        for slots in (1, 2, 3):
            found[label, slots] = result = ring_timeline(slots, 1.0, reads)
            print(f"{label:<44} K={slots}: {result['time_per_step']:.2f} a step, producer waited "
                  f"{result['waited_per_step']:.2f} a step ({result['claims_that_waited']} claims waited)")
    steady, bursty = list(cases)
    assert abs(found[steady, 1]["time_per_step"] - 1.8) < 0.05, "one slot: compute and read take turns"
    assert found[steady, 2]["waited_per_step"] == 0 == found[steady, 3]["waited_per_step"], "two slots overlap them"
    assert found[bursty, 2]["waited_per_step"] > 0 == found[bursty, 3]["waited_per_step"], "a third absorbs bursts"


def exercise_2(fast: bool) -> None:
    """begin_write waits on an event, not with cuda.synchronize(): what would a host synchronisation cost?

    Answer. `copied[slot].wait(compute_stream)` is an instruction queued on the GPU: the *compute stream*
    waits for the copy out of that slot to finish, while the host returns at once and goes on queuing the
    rest of the step. `cuda.synchronize()` would instead block the host until everything queued on every
    stream has finished — the previous step's kernels and its copy. Only then would the host start
    launching the next step's kernels, one by one, each costing several µs of host time (6.6 µs plus
    ~3.5 µs per array argument, numba-cuda's numbers), while the GPU sits idle with an empty queue. Every
    step would pay the full host launch time of the step in series with the GPU time instead of hidden
    under it — for LeNet-5's 26 launches and 81 array arguments about 450 µs a step by that model, many
    times the ~50 µs of arithmetic — plus the synchronisation's own latency (~10 µs), and the copy stream's overlap
    would be gone too. The numbers below are the launch count of stage 6 and that model.
    """
    source = inspect.getsource(GradientRing.begin_write)
    print(source)
    assert ".wait(self.compute_stream)" in source and "synchronize" not in source
    net = tiny_lenet() if SIMULATED else None
    if net is None:
        from cnn.model import lenet5
        net = lenet5()
    stage = get_stage("cuda-ring")(net).init("he", seed=0)
    rng = np.random.default_rng(13)
    batch = 2 if SIMULATED else 64
    stage.train_step(random_array(rng, batch, *net.input_shape, dtype=np.float32), rng.integers(0, 10, batch), 0.05)
    launches = stage.launches_per_step()
    print(f"{net.name} on stage cuda-ring: {launches} launches a step -> at least {launches * 6.6:.0f} µs of host "
          f"launch time a step, exposed in full if the host synchronised before each step's launches")
    assert launches > 20


def exercise_3(fast: bool) -> None:
    """accumulate=True with K = 4: which learning rate, compared with batch `batch` without accumulation?

    Answer. Each slot holds the *mean* gradient of its micro-batch, and the update uses their weighted
    mean, Σ_s (n_s/Σn) g_s: exactly the mean gradient of the 4·batch images as one batch (checked below on
    stage cuda-ring with 4 slots against stage numpy on the concatenated batch). So accumulation is
    training with batch 4·batch — one update where there were four — and the learning rate to use is the
    one for batch 4·batch: by the linear scaling rule of notebook 14, 4× the rate that suits batch
    `batch`, reached with a warmup (`TrainConfig(schedule="warmup", lr_scale=4)`). Keeping the small-batch
    rate makes four times fewer steps of the same size: it trains slower per image. (The rule's limits
    apply too: for large K the step k·η assumes the gradient barely changes over the k steps it replaces.)
    """
    net = tiny_lenet() if SIMULATED else None
    if net is None:
        from cnn.model import lenet5
        net = lenet5()
    batch, slots = (1, 4) if SIMULATED else (16, 4)
    rng = np.random.default_rng(14)
    images = random_array(rng, slots * batch, *net.input_shape, dtype=np.float32)
    labels = rng.integers(0, 10, slots * batch)
    accumulating = get_stage("cuda-ring")(net, slots=slots, accumulate=True).init("he", seed=0)
    for s in range(slots):
        accumulating.train_step(images[s * batch:(s + 1) * batch], labels[s * batch:(s + 1) * batch], 0.05, 0.9, 5e-4)
    _, expected = get_stage("numpy")(net).init("he", seed=0).loss_and_grad(images, labels)
    error = rel_error(accumulating.accumulated_grad(), expected)
    print(f"{slots} micro-batches of {batch}, accumulated, against one batch of {slots * batch}: rel_error {error:.1e}")
    assert error < 1e-4
