"""Assignment 8's tests: SGD with momentum, the training loop, and overfitting 16 images.

- the update is compared, step after step, with the library's ``sgd_momentum_update``;
- the loop trains a LeNet-5 of stage ``numpy`` in float64, initialised from the referee's seed, and must
  give the same losses, weights and velocity as the library's ``cnn.train.train`` on the same images —
  which the referee runs; the loop gets the library's update (``update=``), so part 2 does not depend
  on part 1;
- the overfit run (the cell before the two last tests) trains on the referee's 16 images with the
  student's settings, loop and update — the library's for a part left blank — and reports the weights
  it ends with; the referee computes the training accuracy and loss from those weights itself.
"""

import math
from functools import partial

import numpy as np

from cnn.config import TrainConfig
from cnn.grading.bytecode import is_blank
from cnn.grading.client import lend
from cnn.grading.family import Case, Family, LIBRARY, OwnWork, Verdict, close, normal
from cnn.model import get_network
from cnn.stages import get_stage
from cnn.stages.base import sgd_momentum_update, softmax_cross_entropy
from cnn.train import train

OVERFIT_IMAGES, MAX_STEPS = 16, 200


# -- part 1: the update ------------------------------------------------------------------------------------

SGD = {"plain": [("plain SGD (μ = 0, λ = 0)", 3, 0.1, 0.0, 0.0, False)],
       "momentum": [("momentum μ = 0.9", 5, 0.05, 0.9, 0.0, True), ("momentum μ = 0.5", 2, 0.3, 0.5, 0.0, True)],
       "weight decay": [("weight decay λ = 0.01, μ = 0.9", 4, 0.05, 0.9, 0.01, True),
                        ("weight decay λ = 0.1, μ = 0", 3, 0.1, 0.0, 0.1, False)]}


def in_place(name: str, before, what: str, how: str):
    """A judge: the caller's array ``name`` changed (the update works in place)."""
    def judge(outputs):
        changed = not np.array_equal(np.asarray(outputs.get(name)), before)
        return Verdict(changed, message=f"{what}: {name} did not change: update the caller's array in place ({how}), "
                                        f"not {name} = ...")
    return judge


def sgd_cases(rng, config, memory, kind):
    for what, steps, lr, momentum, weight_decay, start_velocity in SGD[kind]:
        params, size = normal(rng, 50), 50
        velocity = normal(rng, size) if start_velocity else np.zeros(size)
        gradients = [normal(rng, size) for _ in range(steps)]
        expected_params, expected_velocity = params.copy(), velocity.copy()
        for grad in gradients:
            sgd_momentum_update(expected_params, expected_velocity, grad, lr, momentum, weight_decay)
        judges = [in_place("params", params, what, "params -= ...")]
        if momentum or weight_decay or start_velocity:
            judges.append(in_place("velocity", velocity, what, "velocity *= ...; velocity += ..."))
        judges += [close("params", expected_params, 1e-12, f"{what}: params after {steps} steps"),
                   close("velocity", expected_velocity, 1e-12, f"{what}: velocity after {steps} steps")]
        yield Case(what, {"params": params, "velocity": velocity, "gradients": gradients,
                          "hyper": (lr, momentum, weight_decay)}, judges)


def run_sgd(inputs, update, *others):
    params, velocity = inputs["params"].copy(), inputs["velocity"].copy()
    for grad in inputs["gradients"]:
        update(params, velocity, grad, *inputs["hyper"])
    return {"params": params, "velocity": velocity}


# -- part 2: the loop, against cnn.train ---------------------------------------------------------------------

LOOPS = {"constant": [dict(epochs=2, count=10, batch_size=4), dict(epochs=1, count=9, batch_size=3)],
         "step": [dict(epochs=3, count=8, batch_size=4, step_epochs=1, gamma=0.5)]}
SETTINGS = dict(lr=0.01, momentum=0.9, weight_decay=5e-4)


def fresh_stage(init_seed: int, dtype=np.float64):
    """LeNet-5 on stage ``numpy``, He-initialised from ``init_seed``."""
    return get_stage("numpy")(get_network("lenet5"), dtype).init("he", init_seed)


def loop_cases(rng, config, memory, schedule):
    for case in LOOPS[schedule]:
        images, labels = normal(rng, case["count"], 1, 28, 28), rng.integers(0, 10, case["count"])
        seed, init_seed = int(rng.integers(1000)), int(rng.integers(1000))
        step_epochs, gamma = case.get("step_epochs", 1), case.get("gamma", 0.5)
        settings = dict(epochs=case["epochs"], batch_size=case["batch_size"], seed=seed, **SETTINGS)
        reference = fresh_stage(init_seed)
        history = train(TrainConfig(model="lenet5", stage="numpy", dtype="float64", schedule=schedule,
                                    step_epochs=step_epochs, gamma=gamma, progress=False, **settings),
                        data=(images, labels, images[:2], labels[:2]), stage=reference)
        losses = np.array([step[1] for step in history["steps"]])
        what = f"{case['epochs']} epochs of {case['count']} images in batches of {case['batch_size']}, {schedule} rate"

        def count(outputs, what=what, steps=len(losses)):
            got = outputs.get("losses")
            returned = 0 if got is None else len(got)
            return Verdict(returned == steps, message=f"{what}: {returned} losses returned for {steps} steps")
        inputs = {"images": images, "labels": labels, "init_seed": init_seed,
                  "settings": {**settings, "step_epochs": step_epochs if schedule == "step" else None, "gamma": gamma}}
        yield Case(what, inputs, [count, close("losses", losses, 1e-10, f"{what}: losses"),
                                  close("params", reference.get_params(), 1e-10, f"{what}: weights"),
                                  close("velocity", reference.get_momentum(), 1e-10, f"{what}: velocity")])


def run_loop(inputs, train_loop, *others):
    stage = fresh_stage(inputs["init_seed"])
    losses = train_loop(stage, inputs["images"], inputs["labels"], **inputs["settings"], update=lend(sgd_momentum_update))
    return {"losses": None if losses is None else [float(loss) for loss in losses],
            "params": stage.get_params(), "velocity": stage.get_momentum()}


def nan_cases(rng, config, memory):
    """A batch with a NaN in it makes the loss NaN: training must stop there, with FloatingPointError."""
    images, labels = normal(rng, 8, 1, 28, 28), rng.integers(0, 10, 8)
    images[5, 0, 3, 3] = np.nan

    def judge(seen):
        if seen.get("raised") != "FloatingPointError":
            raised = seen.get("raised")
            return Verdict(False, message="train_loop carried on with a NaN loss: raise FloatingPointError"
                           if raised is None else f"train_loop raised {raised} ({seen.get('message')}); a NaN loss "
                                                  f"should stop it with FloatingPointError")
        message = seen.get("message", "")
        if "epoch" not in message or "batch" not in message:
            return Verdict(False, message=f"the message should name the epoch and the batch: {message}")
        return Verdict(True, f"stopped with: {message}")
    yield Case("NaN", {"images": images, "labels": labels, "init_seed": int(rng.integers(1000)),
                       "seed": int(rng.integers(1000))}, [judge])


def run_nan(inputs, train_loop, *others):
    try:
        train_loop(fresh_stage(inputs["init_seed"]), inputs["images"], inputs["labels"], epochs=1, batch_size=4,
                   lr=0.01, seed=inputs["seed"], update=lend(sgd_momentum_update))
    except FloatingPointError as err:
        return {"raised": "FloatingPointError", "message": str(err)}
    except Exception as err:                  # reported: the referee says which error it should have been
        return {"raised": type(err).__name__, "message": str(err)}
    return {"raised": None}


# -- part 3: overfitting 16 images ---------------------------------------------------------------------------

def library_loop(stage, images, labels, epochs, batch_size, lr, momentum=0.9, weight_decay=0.0, seed=0,
                 step_epochs=None, gamma=0.1, update=None):
    """The library's training loop (``cnn.train.train``) with train_loop's signature: what the overfit run
    uses when train_loop was left blank."""

    config = TrainConfig(model=stage.net.name, stage="numpy", dtype=np.dtype(stage.dtype).name, epochs=epochs,
                         batch_size=batch_size, lr=lr, momentum=momentum, weight_decay=weight_decay, seed=seed,
                         schedule="constant" if step_epochs is None else "step", step_epochs=step_epochs or 1,
                         gamma=gamma, progress=False)
    history = train(config, data=(images, labels, images[:2], labels[:2]), stage=stage)
    return [step[1] for step in history["steps"]]


def overfit_run_cases(rng, config, memory):
    memory.pop("overfit", None)
    images, labels = normal(rng, OVERFIT_IMAGES, 1, 28, 28, dtype=np.float32), rng.integers(0, 10, OVERFIT_IMAGES)
    init_seed = int(rng.integers(1 << 30))

    def remember(outputs):
        stage = fresh_stage(init_seed, np.float32)
        stage.set_params(np.asarray(outputs["params"], dtype=np.float32))
        logits = stage.predict(images).astype(np.float64)
        accuracy = float(np.mean(logits.argmax(axis=1) == labels))
        losses = [float(loss) for loss in outputs.get("losses") or []]
        memory["overfit"] = {"losses": losses, "accuracy": accuracy,
                             "final": float(softmax_cross_entropy(logits, labels)[0]) if np.isfinite(logits).all()
                             else float("nan")}
        first = f"{losses[0]:.3f}" if losses else "?"
        return Verdict(True, f"{len(losses)} steps: loss {first} → {memory['overfit']['final']:.5f} on the 16 images, "
                             f"training accuracy {accuracy:.0%}")
    yield Case("overfit", {"images": images, "labels": labels, "init_seed": init_seed, "seed": int(rng.integers(1000))},
               [remember])


def run_overfit(inputs, settings, train_loop, update, *others):
    """Your settings, your loop and your update (the library's for a part left blank), on the referee's images."""
    steps = settings["epochs"] * (OVERFIT_IMAGES // settings["batch_size"])
    assert steps <= MAX_STEPS, f"OVERFIT asks for {steps} steps; memorise the 16 images in at most {MAX_STEPS}"
    loop = lend(library_loop) if is_blank(train_loop) else train_loop
    update = lend(sgd_momentum_update) if is_blank(update) else update
    stage = fresh_stage(inputs["init_seed"], np.float32)
    losses = loop(stage, inputs["images"], inputs["labels"], seed=inputs["seed"], update=update, **settings)
    return {"losses": [float(loss) for loss in losses or []], "params": stage.get_params()}


def overfit_judge(check):
    def cases(rng, config, memory):
        run = memory.get("overfit")

        def judge(outputs):
            if run is None:
                return Verdict(False, message="the overfit run (the cell before) did not finish: run it first")
            return check(run)
        yield Case("overfit", {}, [judge])
    return cases


def accuracy_verdict(run) -> Verdict:
    steps = len(run["losses"])
    return Verdict(run["accuracy"] == 1.0, "100 % of the 16 training images right",
                   f"training accuracy {run['accuracy']:.0%} after {steps} steps: the network should memorise "
                   f"16 images — check the update and the loop, then the learning rate")


def loss_verdict(run) -> Verdict:
    first, final = (run["losses"] or [float("nan")])[0], run["final"]
    if not abs(first - math.log(10)) < 0.7:
        return Verdict(False, message=f"the first loss is {first:.3f}: an untrained network should start near ln 10 = "
                                      f"2.303 (is the first loss recorded before any update?)")
    return Verdict(final < 0.05, f"loss {first:.3f} (ln 10 = 2.303) → {final:.5f}",
                   f"the loss fell from {first:.3f} to {final:.4f} only: it should reach nearly 0 (< 0.05)")


def nothing(inputs, *answers):
    return {}


LOOP = OwnWork(rules=LIBRARY + (("cnn.stages.*", True), ("*.train_step", False), ("*.update", False),
                                ("*.run_steps", False), ("*.begin_epoch", False)), other_parts=("sgd_momentum",))
FAMILIES = {
    "test_sgd_plain": Family(partial(sgd_cases, kind="plain"), run_sgd),
    "test_sgd_momentum": Family(partial(sgd_cases, kind="momentum"), run_sgd),
    "test_sgd_weight_decay": Family(partial(sgd_cases, kind="weight decay"), run_sgd),
    "test_loop_same_as_library": Family(partial(loop_cases, schedule="constant"), run_loop, LOOP),
    "test_loop_step_schedule": Family(partial(loop_cases, schedule="step"), run_loop, LOOP),
    "test_loop_stops_on_nan": Family(nan_cases, run_nan, LOOP),
    "overfit_run": Family(overfit_run_cases, run_overfit, own_work=None, sealed=False),
    "test_overfit_accuracy": Family(overfit_judge(accuracy_verdict), nothing, own_work=None),
    "test_overfit_loss": Family(overfit_judge(loss_verdict), nothing, own_work=None),
}
