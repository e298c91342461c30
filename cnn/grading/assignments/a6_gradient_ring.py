"""Assignment 6's tests: the slot bookkeeping of the circular gradient buffer, and the accumulation kernel.

The student's ``SlotRing`` is compared with the library's ``kernels.gradient_ring.SlotStates``,
operation by operation, on random sequences the referee draws and replays on the reference: every
result, every error and every state must agree. Waiting is tested in the kernel with a thread (a
producer must wait for a slow consumer, and give up at its deadline) — what the kernel observes is
what the referee judges. The accumulation kernel is compared with the weighted sum in float64, and
with the gradient of a whole batch computed by the library.
"""

import threading
import time
from functools import partial

import numpy as np

from cnn.grading.family import Case, Family, LIBRARY, OwnWork, Verdict, close, normal
from cnn.grading.runners import launch_1d
from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU
from cnn.stages.s2_numpy import NumpyStage
from kernels.gradient_ring import RingStall, SlotStates

FREE, WRITING, READY = "free", "writing", "ready"
TRIALS, OPERATIONS = 10, 30


# -- the slot states: random sequences, replayed on the reference ----------------------------------------

def outcome(call):
    try:
        return call()
    except Exception as error:        # the kind of error is part of the behaviour
        return type(error).__name__


def snapshot(ring):
    return ([str(state) for state in ring.states], [sorted(held) for held in ring.holders], list(ring.step_in),
            int(ring.waits))


def replay(ring, operations) -> list:
    """[(outcome, snapshot)] of each operation (kind, slot, step, consumer) applied to ``ring``."""
    calls = {"claim": lambda slot, step, who: ring.claim(step, 0), "publish": lambda slot, step, who: ring.publish(slot),
             "release": lambda slot, step, who: ring.release(slot, who)}
    return [(outcome(lambda: calls[kind](slot, step, who)), snapshot(ring)) for kind, slot, step, who in operations]


def states_cases(rng, config, memory, consumers: tuple):
    trials, expected = [], []
    for _ in range(TRIALS):
        slots = int(rng.integers(1, 4))
        operations = [(str(rng.choice(["claim", "publish", "release"])), int(rng.integers(0, slots)),
                       int(rng.integers(0, 3 * slots)), str(rng.choice(list(consumers) + ["nobody"])))
                      for _ in range(OPERATIONS)]
        trials.append({"slots": slots, "operations": operations})
        expected.append(replay(SlotStates(slots, consumers), operations))

    def judge(outputs):
        for trial, mine, reference in zip(trials, outputs.get("trials") or [], expected):
            for (kind, slot, step, who), (got, state), (want, want_state) in zip(trial["operations"], mine, reference):
                where = f"{kind} (slot {slot}, step {step}, consumer {who!r})"
                if got != want:
                    return Verdict(False, message=f"{where}: you gave {got!r}, expected {want!r}")
                if list(state) != list(want_state):
                    return Verdict(False, message=f"after {where}:\n  yours    {list(state)}\n  expected {list(want_state)}")
        if len(outputs.get("trials") or []) != len(trials):
            return Verdict(False, message="not every sequence was replayed")
        return Verdict(True, f"{TRIALS} random sequences of {OPERATIONS} operations with consumers {consumers}: "
                             "every result, error and state as the reference's")
    yield Case(f"consumers {consumers}", {"consumers": consumers, "trials": trials}, [judge])


def run_states(inputs, ring_class, *others):
    return {"trials": [replay(ring_class(trial["slots"], inputs["consumers"]), trial["operations"])
                       for trial in inputs["trials"]]}


# -- waiting: what the kernel observes of a producer thread ----------------------------------------------

def ring_with_slot_0_held(ring_class):
    """Two slots, steps 0 and 1 published; the optimizer released both, the host still holds slot 0."""
    ring = ring_class(2, ("optimizer", "host"))
    for step in (0, 1):
        slot = ring.claim(step, 1.0)
        ring.publish(slot)
        ring.release(slot, "optimizer")
    return ring


def run_waiting(inputs, ring_class, *others):
    """Step 2 (slot 0 again) must wait while the host holds slot 0, then go on when it is released."""
    ring = ring_with_slot_0_held(ring_class)
    claimed = []
    producer = threading.Thread(target=lambda: claimed.append(ring.claim(2, 10.0)), daemon=True)
    producer.start()
    time.sleep(0.3)
    waited = producer.is_alive() and not claimed
    ring.release(0, "host")
    producer.join(5.0)
    return {"waited": bool(waited), "claimed": [int(slot) for slot in claimed], "waits": int(ring.waits),
            "state": str(ring.states[0])}


def waiting_cases(rng, config, memory):
    def judge(seen):
        if not seen.get("waited"):
            return Verdict(False, message="claim(2) must wait while the host still holds slot 0")
        if seen.get("claimed") != [0]:
            return Verdict(False, message=f"after the release, claim(2) should return slot 0, got {seen.get('claimed')}")
        if seen.get("waits") != 1 or seen.get("state") != WRITING:
            return Verdict(False, message=f"after the wait, waits is {seen.get('waits')} and slot 0 is "
                                          f"{seen.get('state')!r}; expected 1 and {WRITING!r}")
        return Verdict(True, "the producer waited for the slow consumer, and went on when it released the slot")
    yield Case("waiting", {}, [judge])


def run_deadline(inputs, ring_class, *others):
    """A consumer that never releases: claim(2, 0.3) must raise RingStall after its timeout instead of hanging."""
    ring = ring_with_slot_0_held(ring_class)
    started = time.perf_counter()
    try:
        ring.claim(2, 0.3)
        raised = None
    except RingStall:
        raised = "RingStall"
    except Exception as error:
        raised = type(error).__name__
    return {"raised": raised, "waited": time.perf_counter() - started}


def deadline_cases(rng, config, memory):
    def judge(seen):
        if seen.get("raised") != "RingStall":
            return Verdict(False, message=f"claim must raise RingStall when the slot is still held after the timeout "
                                          f"(it {'returned' if seen.get('raised') is None else 'raised ' + str(seen.get('raised'))})")
        waited = float(seen.get("waited", -1))
        if not 0.25 < waited < 5.0:
            return Verdict(False, message=f"claim gave up after {waited:.2f} s; the timeout was 0.3 s")
        return Verdict(True, f"a consumer that never releases: RingStall after {waited:.2f} s instead of a hang")
    yield Case("deadline", {}, [judge])


# -- the accumulation kernel -------------------------------------------------------------------------------

def weighted_sum_cases(rng, config, memory):
    for K, P in [(1, 37), (2, 300), (3, 129)]:             # one slot, several; lengths that are not a block's multiple
        slots, weights = normal(rng, K, P, dtype=np.float32), rng.random(K).astype(np.float32)
        what = f"weighted sum of {K} slots of {P}"
        yield Case(what, {"args": [slots, weights, np.full(P, np.nan, np.float32)]},
                   [close("out", weights.astype(np.float64) @ slots, 1e-6, what)])


def accumulation_cases(rng, config, memory):
    """The gradient of two micro-batches, accumulated, is the gradient of the two as one batch."""
    net = Network("small", (1, 8, 8), (Conv(1, 2, 3), ReLU(), MaxPool(2, 2), Flatten(), Dense(18, 5)))
    stage = NumpyStage(net).init("he", seed=int(rng.integers(1000)))
    sizes = [3, 5]
    images = normal(rng, sum(sizes), 1, 8, 8, dtype=np.float32)
    labels = rng.integers(0, 5, sum(sizes))
    micro = [stage.loss_and_grad(images[:3], labels[:3])[1], stage.loss_and_grad(images[3:], labels[3:])[1]]
    weights = np.array(sizes, np.float32) / sum(sizes)
    what = "accumulated micro-batch gradients vs one batch"
    yield Case(what, {"args": [np.stack(micro).astype(np.float32), weights, np.full(micro[0].size, np.nan, np.float32)]},
               [close("out", stage.loss_and_grad(images, labels)[1], 1e-5, what)])


RING = OwnWork(rules=LIBRARY + (("kernels.gradient_ring.RingStall", True),))
WEIGHTED_SUM = launch_1d(2, out=2)
FAMILIES = {
    "test_states_one_consumer": Family(partial(states_cases, consumers=("optimizer",)), run_states, RING),
    "test_states_two_consumers": Family(partial(states_cases, consumers=("optimizer", "host")), run_states, RING),
    "test_waiting": Family(waiting_cases, run_waiting, RING),
    "test_deadline": Family(deadline_cases, run_deadline, RING),
    "test_weighted_sum": Family(weighted_sum_cases, WEIGHTED_SUM),
    "test_accumulation": Family(accumulation_cases, WEIGHTED_SUM),
}
