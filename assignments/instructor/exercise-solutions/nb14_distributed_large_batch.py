"""Notebook 14, large batches: worked solutions of its three exercises."""

from __future__ import annotations

import numpy as np

from cnn.train import TrainConfig, TrainingDiverged, load_dataset, train

ETA = 0.02            # the notebook's learning rate for one worker's batch


def exercise_1(fast: bool) -> None:
    """One process, batch 512, at η, at 16·η at once, and at 16·η with warmup: which diverges, and when?

    Answer. At η the loss falls steadily but slowly — 16 times fewer steps an epoch than batch 32, each no
    longer than before. At 16·η = 0.32 from the first step the loss leaps at once (several times ln 10 at
    step 2) and goes on exploding: the first steps, on freshly initialised weights where the loss is steep
    and curved, are far beyond the stable step size; the network ends at chance, or the loss becomes NaN
    and `train` stops with its one-line error. With warmup the first steps are small and harmless, and the
    loss starts to fall — until the rising rate passes about 0.1 (with momentum 0.9), a few steps into the
    ramp: then the loss jumps too and the network collapses to chance, later and far less violently than
    without warmup (the loss stays near ln 10 instead of exploding), but it fails all the same. Warmup
    removes the *early* instability, Goyal et al.'s point; it cannot make a rate stable that is too large
    for the problem — for LeNet-5 at this momentum anything much above 0.1, whatever the batch: the rule's
    ceiling, the subject of the next exercise. (The notebook's recorded runs scale by k = 4 only, to
    4·η = 0.08, with warmup.)
    """
    steps = 8 if fast else 117                        # 117 steps of 512 = one epoch of MNIST
    data = load_dataset(TrainConfig(limit_train=512 * steps, limit_test=200 if fast else None))
    variants = {"η": dict(lr=ETA, schedule="constant"), "16·η at once": dict(lr=16 * ETA, schedule="constant"),
                "16·η with warmup": dict(lr=ETA, schedule="warmup", lr_scale=16, warmup_epochs=1.0 if fast else 0.5)}
    losses = {}
    for label, variant in variants.items():
        config = TrainConfig(stage="numpy", epochs=1, batch_size=512, momentum=0.9, progress=False, **variant)
        try:
            history = train(config, data)
            losses[label] = np.array([loss for _, loss, _, _ in history["steps"]])
            worst = int(np.argmax(losses[label]))
            print(f"{label:<17} losses {np.round(losses[label][:12], 2).tolist()}{' …' if steps > 12 else ''}; highest "
                  f"{losses[label][worst]:.2f} at step {worst + 1}; test accuracy {history['final_test_accuracy']:.1%}")
        except TrainingDiverged as error:
            losses[label] = np.array([np.inf])
            print(f"{label:<17} {error}")
    at_once, warmup = losses["16·η at once"], losses["16·η with warmup"]
    assert losses["η"][-1] < losses["η"][0] - 0.5, "η learns"
    assert at_once[:3].max() > 3 * losses["η"][0], "16·η blows up at once"
    assert warmup[:2].max() <= losses["η"][0] + 0.05, "warmup's first steps are harmless"
    assert warmup.max() < at_once.max() / 2 and warmup[-1] > losses["η"][-1], "later, milder, but it fails too"


def exercise_2(fast: bool) -> None:
    """Why does the linear scaling rule break down for very large k?

    Answer. The rule says one step of k·η on a batch of k·b ≈ k steps of η on batches of b. The k small
    steps use k gradients, each taken where the weights have got to by then; the one large step uses the
    average gradient at the *starting* point for all of them. The two agree only while the gradient
    barely changes over the distance the k small steps cover — that is, while k·η is small against the
    loss's curvature: on a quadratic with curvature λ, k steps multiply the error by (1 − ηλ)^k, one big
    step by (1 − kηλ), equal to first order only when kηλ ≪ 1. And past kηλ = 2 the single step overshoots
    so far that it diverges, however small η was: a hard ceiling on k·η set by the largest curvature (in
    practice a few thousand images of global batch for ImageNet-sized models, where Goyal et al. saw the
    rule fail). The table below is the quadratic's.
    """
    curvature, eta = 1.0, 0.01
    print("   k    k small steps: (1 − ηλ)^k    one step of kη: (1 − kηλ)")
    for k in (1, 4, 16, 64, 150, 250):
        small, large = (1 - eta * curvature) ** k, 1 - k * eta * curvature
        print(f"{k:>4}    {small:10.4f}                   {large:10.4f}{'   diverges' if abs(large) > 1 else ''}")
    assert abs((1 - eta) ** 4 - (1 - 4 * eta)) < 1e-3 and abs(1 - 250 * eta) > 1 > (1 - eta) ** 250


def largest_stable_rate(delay: int) -> float:
    """Largest ηλ for which w_{t+1} = w_t − ηλ·w_{t−d} converges: every root of z^{d+1} − z^d + ηλ in |z| < 1."""
    def stable(rate):
        polynomial = np.zeros(delay + 2)
        polynomial[0] = 1.0
        polynomial[1] -= 1.0
        polynomial[-1] += rate
        return np.max(np.abs(np.roots(polynomial))) < 1.0
    low, high = 0.0, 2.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if stable(middle) else (low, middle)
    return low


def exercise_3(fast: bool) -> None:
    """The asynchronous strategies keep η constant: why would scaling it with the number of workers be wrong for Downpour?

    Answer. The linear scaling rule is about *one* update computed from k times more images. Downpour makes
    no larger updates: the server applies every worker's gradient as a separate update, so with P workers
    it already takes P steps of η in the time one worker takes one — the rate per image is unchanged and
    there is nothing to compensate. Scaling η by P would make each of those P updates P times larger.
    Worse, those gradients are *stale*: each was computed on weights about P − 1 updates old. A gradient
    step with delay τ is stable only for a much smaller rate than a fresh one — on a quadratic with
    curvature λ, w ← w − ηλ·w(τ steps ago) converges only while ηλ < 2·sin(π / (2(2τ + 1))), about
    π/(2τ + 1) (computed below from the roots: 2 with no delay, 1 with a delay of one, 0.45 with three…). More
    workers mean more staleness and call for a *smaller* rate, not a larger one (Downpour used Adagrad
    partly for this; the staleness-aware rules divide η by the staleness).
    """
    bounds = {delay: largest_stable_rate(delay) for delay in range(8)}
    for delay, bound in bounds.items():
        print(f"delay τ = {delay}: stable while ηλ < {bound:.3f}   (2·sin(π / (2(2τ + 1))) = "
              f"{2 * np.sin(np.pi / (2 * (2 * delay + 1))):.3f})")
    values = list(bounds.values())
    assert all(abs(bound - 2 * np.sin(np.pi / (2 * (2 * delay + 1)))) < 1e-6 for delay, bound in bounds.items())
    assert all(later < earlier for earlier, later in zip(values, values[1:]))
