"""The trainer: schedules, exact resume, divergence handling, atomic checkpoints, and a real-MNIST run."""

import numpy as np
import pytest

from cnn.data.synthetic import corner_digits
from cnn.gradcheck import rel_error
from cnn.model import INIT_SCHEMES, LOGITS_SCALE, get_network, init_params, param_views
from cnn.stages import get_stage
from cnn.stages.base import Stage
from cnn.train import (TrainConfig, TrainingDiverged, evaluate, load_checkpoint, lr_at, save_checkpoint,
                       train)


def tiny_data(n_train=96, n_test=40, seed=0):
    """Random 28×28 'digits' whose class is written into the mean brightness of a corner: learnable."""
    return corner_digits(n_train, n_test, seed)


def quiet(**overrides):
    settings = dict(model="lenet5", stage="numpy", epochs=2, batch_size=16, lr=0.02, progress=False)
    settings.update(overrides)
    return TrainConfig(**settings)


def test_lr_schedules():
    assert lr_at(quiet(schedule="constant", lr=0.1), 500, 100) == 0.1
    step = quiet(schedule="step", lr=0.1, step_epochs=2, gamma=0.5)
    assert [lr_at(step, s, 100) for s in (0, 199, 200, 399, 400)] == [0.1, 0.1, 0.05, 0.05, 0.025]
    warm = quiet(schedule="warmup", lr=0.1, lr_scale=4, warmup_epochs=2)
    assert lr_at(warm, 0, 100) == pytest.approx(0.1)
    assert lr_at(warm, 100, 100) == pytest.approx(0.25)       # halfway from 0.1 to 0.4
    assert lr_at(warm, 150, 100) == pytest.approx(0.325)      # per batch, not per epoch
    assert lr_at(warm, 200, 100) == pytest.approx(0.4)
    assert lr_at(warm, 999, 100) == pytest.approx(0.4)


@pytest.mark.parametrize("setting,message", [
    (dict(epochs=0), "epochs must be > 0"),
    (dict(momentum=1.5), "momentum must be in"),
    (dict(gamma=float("nan")), "gamma is nan, not finite"),
    (dict(seed=2**40), r"seed must be in \[0, 4294967295\]"),
    (dict(batch_size="64"), "batch-size must be an integer > 0, got '64'"),
    (dict(schedule="cosine"), "unknown schedule"),
    (dict(model="vgg"), "unknown model"),
    (dict(resume=True), "resume needs a checkpoint"),
])
def test_bad_settings_are_one_line_errors(setting, message):
    with pytest.raises(ValueError, match=message) as err:
        quiet(**setting).check()
    assert "\n" not in str(err.value)


def test_training_learns_and_records_history():
    data = tiny_data()
    history = train(quiet(epochs=3, eval_every=4, eval_subset=20), data)
    losses = [loss for _, loss, _, _ in history["steps"]]
    assert len(losses) == 3 * (96 // 16) and len(history["epochs"]) == 3
    assert np.mean(losses[-6:]) < np.mean(losses[:6])
    assert [e[0] for e in history["evals"]] == [4, 8, 12, 16]
    assert history["final_test_accuracy"] == history["epochs"][-1]["test_accuracy"]


class InterruptAfter:
    """Wraps a stage; raises KeyboardInterrupt on the n-th training step, as a user's Ctrl-C would."""

    run_steps = Stage.run_steps          # the default epoch loop, calling this wrapper's train_step

    def __init__(self, stage, steps):
        self.stage, self.steps_left = stage, steps

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def train_step(self, *args, **kwargs):
        self.steps_left -= 1
        if self.steps_left < 0:
            raise KeyboardInterrupt
        return self.stage.train_step(*args, **kwargs)


@pytest.mark.parametrize("interrupt_at", [4, 6, 9])   # mid-epoch, at an epoch boundary, mid second epoch
def test_resume_reproduces_the_uninterrupted_run(tmp_path, interrupt_at):
    data = tiny_data()
    uninterrupted = train(quiet(epochs=2), data)
    reference = get_stage("numpy")(get_network("lenet5")).init("he", 0)
    train(quiet(epochs=2), data, stage=reference)

    checkpoint = tmp_path / "run.npz"
    config = quiet(epochs=2, checkpoint=str(checkpoint), checkpoint_every=1)
    first = InterruptAfter(get_stage("numpy")(get_network("lenet5")).init("he", 0), interrupt_at)
    with pytest.raises(KeyboardInterrupt):
        train(config, data, stage=first)
    resumed = get_stage("numpy")(get_network("lenet5")).init("he", 99)   # different init: must be overwritten
    history = train(quiet(epochs=2, checkpoint=str(checkpoint), checkpoint_every=1, resume=True), data, stage=resumed)

    assert np.array_equal(resumed.get_params(), reference.get_params())
    assert np.array_equal(resumed.get_momentum(), reference.get_momentum())
    assert [s[1] for s in history["steps"]] == [s[1] for s in uninterrupted["steps"]]


class NanAfter(InterruptAfter):
    def train_step(self, *args, **kwargs):
        self.steps_left -= 1
        loss = self.stage.train_step(*args, **kwargs)
        return float("nan") if self.steps_left < 0 else loss


def test_divergence_stops_with_message_and_keeps_last_good_checkpoint(tmp_path):
    checkpoint = tmp_path / "run.npz"
    stage = NanAfter(get_stage("numpy")(get_network("lenet5")).init("he", 0), 5)
    with pytest.raises(TrainingDiverged, match=r"loss is nan at epoch 1, batch 6 \(lr=0.02\).*lower --lr") as err:
        train(quiet(checkpoint=str(checkpoint), checkpoint_every=1), tiny_data(), stage=stage)
    assert str(checkpoint) in str(err.value)
    saved = load_checkpoint(checkpoint)
    assert saved["batch"] == 5 and np.isfinite(saved["params"]).all()
    assert not list(tmp_path.glob("*.tmp"))


def test_checkpoint_is_atomic_and_damage_is_reported(tmp_path, monkeypatch):
    stage = get_stage("numpy")(get_network("lenet5")).init("he", 0)
    path = tmp_path / "ckpt.npz"

    def save(epoch):
        save_checkpoint(path, stage.get_params(), stage.get_momentum(), quiet(), epoch, 0, {"a": 1}, {"steps": []})
    save(1)
    good = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(np, "savez", crash)
    with pytest.raises(OSError):
        save(2)
    assert path.read_bytes() == good            # the old checkpoint survived the failed write
    assert list(tmp_path.iterdir()) == [path]   # and no temporary is left
    monkeypatch.undo()

    path.write_bytes(good[:100])
    with pytest.raises(ValueError, match="not a valid checkpoint"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "missing.npz")


def test_real_mnist_learns_quickly(real_mnist):
    """60 steps of LeNet-5 with stage numpy on real MNIST (batch 64, lr 0.02) already classify most test digits
    (chance: 10 %; seed 0 reaches 90 %, seeds 1 and 2 85-88 %). MNIST from tests/conftest.py's ``real_mnist``."""
    history = train(quiet(epochs=1, batch_size=64, limit_train=64 * 60, limit_test=1000, data_dir=str(real_mnist)))
    assert history["final_test_accuracy"] > 0.7


@pytest.mark.parametrize("net_name", ["lenet5", "alexnet-small"])
@pytest.mark.parametrize("scheme", INIT_SCHEMES)
def test_untrained_network_starts_near_the_loss_of_knowing_nothing(net_name, scheme):
    """Loss at initialisation ≈ ln(10), uniform guessing — not confidently wrong (He's full-size
    last layer started LeNet-5 at 3.5–10.8)."""
    net = get_network(net_name)
    images = np.random.default_rng(1).normal(0, 1, (32, *net.input_shape)).astype(np.float32)
    labels = np.arange(32) % 10
    for seed in range(3):
        stage = get_stage("numpy")(net).init(scheme, seed)
        loss = stage.evaluate_loss(images, labels)
        print(f"{net_name} {scheme} seed {seed}: initial loss {loss:.3f} (ln 10 = {np.log(10):.3f})")
        assert abs(loss - np.log(10)) < 0.3


def test_he_init_is_he_but_for_a_smaller_last_layer():
    """Hidden weights have standard deviation √(2/fan_in); the last layer LOGITS_SCALE times that."""
    net = get_network("alexnet-small")
    views = param_views(net, init_params(net, "he", seed=2))
    weight_layers = [index for index, params in enumerate(views) if "W" in params]
    for index in weight_layers:
        expected = np.sqrt(2.0 / net.layers[index].fans()[0])
        if index == weight_layers[-1]:
            expected *= LOGITS_SCALE
        assert rel_error(views[index]["W"].std(), expected) < 0.1, f"layer {index}"


def test_evaluate_counts_correct_predictions():
    stage = get_stage("numpy")(get_network("lenet5")).init("he", 0)
    _, _, images, labels = tiny_data(n_test=30)
    predicted = stage.predict(images).argmax(axis=1)
    labels = predicted.copy()
    labels[:6] = (labels[:6] + 1) % 10
    accuracy, loss = evaluate(stage, images, labels, batch_size=7)
    assert accuracy == pytest.approx(24 / 30) and loss > 0


def test_float64_training_matches_float32_closely():
    data = tiny_data(n_train=32)
    data64 = tuple(a.astype(np.float64) if a.dtype == np.float32 else a for a in data)
    h32 = train(quiet(epochs=1), data)
    h64 = train(quiet(epochs=1, dtype="float64"), data64)
    assert rel_error([s[1] for s in h32["steps"]], [s[1] for s in h64["steps"]]) < 1e-4


def test_pace_line_sets_a_compiling_first_epoch_apart():
    from cnn.train import epoch_seconds, pace_line

    def history(totals):
        return {"epochs": [{"train_seconds": total} for total in totals]}

    assert epoch_seconds(history([15.5, 16.4, 17.4])) == pytest.approx([15.5, 0.9, 1.0])
    assert pace_line(history([15.5, 16.4, 17.4])) == ("0.95 s of training per epoch after the first "
                                                      "(15.5 s, compilation included)")
    assert pace_line(history([5.0, 10.2])) == "5.10 s of training per epoch"
    assert pace_line(history([3.0])) == "3.00 s of training per epoch"


def test_a_distributed_checkpoint_resumes_at_the_same_image_whatever_the_batch_size(tmp_path):
    """cnn.parallel counts global batches; cnn.train goes on from the same image, or says why it cannot."""
    from cnn.train import batch_to_resume_at

    written_by_four_ranks = {"batch": 5, "parallel": {"images_into_epoch": 5 * 4 * 32}}
    assert batch_to_resume_at(written_by_four_ranks, 32, tmp_path) == 20
    assert batch_to_resume_at(written_by_four_ranks, 64, tmp_path) == 10
    with pytest.raises(ValueError, match="not a whole number of --batch-size 48 batches"):
        batch_to_resume_at(written_by_four_ranks, 48, tmp_path)
    assert batch_to_resume_at({"batch": 7, "parallel": None}, 48, tmp_path) == 7
