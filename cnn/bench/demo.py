"""``python -m cnn bench --demo`` (``make demo``): benchmark, train the fastest stage, draw every picture.

One run: the stage benchmark on real MNIST; the fastest stage trained one epoch with the course's
recipe (a progress bar with the loss, the test accuracy and images/s) while its predictions on a
fixed grid of test digits are recorded (before training, after 50 steps, at the end); a short
learning curve of every fast stage; then the pictures (digits learning, the first layer's filters,
the learning curves). LeNet-5 must reach ``DEMO_MIN_ACCURACY`` after that one epoch, or the demo fails.

Everything goes to ``results/`` (``DEMO_DIR``, git-ignored) unless ``--out-dir`` says otherwise: the
committed ``benchmarks/results/`` is rewritten only on purpose (``benchmarks/reproduce.sh``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from cnn.bench.results import USER_RESULTS_DIR, write_json
from cnn.bench.step_timing import benchmark, save_benchmark
from cnn.bench.tables import markdown_table
from cnn.bench.workload import course_hyperparameters
from cnn.formatting import fmt_ms

DEMO_DIR = USER_RESULTS_DIR

#: LeNet-5 after one epoch of MNIST with the course's recipe must reach this, or the demo fails
DEMO_MIN_ACCURACY = 0.97


def class_probabilities(logits: np.ndarray) -> np.ndarray:
    """softmax over the last axis: p = exp(z − max z) / Σ exp(z − max z)."""
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


class SnapshotStage:
    """Wraps a stage for ``cnn.train.train`` and records predictions on fixed images at chosen steps.

    Everything else is the wrapped stage's own: ``train`` cannot tell the difference.
    """

    def __init__(self, stage, images: np.ndarray, at_steps):
        self._stage, self._images, self._at = stage, images, set(at_steps)
        self.steps_done, self.snapshots = 0, {}

    def __getattr__(self, name):
        return getattr(self._stage, name)

    def snapshot(self, label) -> np.ndarray:
        self.snapshots[label] = class_probabilities(self._stage.predict(self._images).astype(np.float64))
        return self.snapshots[label]

    def train_step(self, *args, **kwargs):
        loss = self._stage.train_step(*args, **kwargs)
        self.steps_done += 1
        if self.steps_done in self._at:
            self.snapshot(self.steps_done)
        return loss

    def run_steps(self, first: int, count: int) -> np.ndarray:
        """The wrapped stage's ``run_steps`` (how ``cnn.train`` trains), cut at every snapshot step."""
        losses = []
        while count > 0:
            upcoming = [step - self.steps_done for step in self._at if step > self.steps_done]
            chunk = min([count, *upcoming])
            losses.append(self._stage.run_steps(first, chunk))
            first, count, self.steps_done = first + chunk, count - chunk, self.steps_done + chunk
            if self.steps_done in self._at:
                self.snapshot(self.steps_done)
        return np.concatenate(losses) if losses else np.empty(0)


def fastest_stage(result: dict) -> str:
    if not result["stages"]:
        raise ValueError("no stage could be benchmarked, so there is none to train")
    return max(result["stages"], key=lambda row: row["images_per_s"])["name"]


def train_with_snapshots(stage_name: str, data, grid_images, args, snapshot_step: int = 50, epochs: int = 1,
                         progress: bool = False):
    """Train ``stage_name`` for ``epochs`` with the course's recipe, snapshotting predictions on ``grid_images``.

    Snapshots: before training (0), after ``snapshot_step`` steps, after the last epoch ("end").
    ``progress``: the trainer's progress bar (loss, test accuracy, images/s).
    """
    from cnn.model import get_network
    from cnn.stages import get_stage
    from cnn.train import TrainConfig, train

    steps_per_epoch = len(data[0]) // args.batch_size
    config = TrainConfig(model=args.model, stage=stage_name, epochs=epochs, batch_size=args.batch_size,
                         seed=args.seed, dtype=args.dtype, eval_every=max(1, min(25, steps_per_epoch // 20)),
                         eval_subset=1000, progress=progress)
    stage = get_stage(stage_name)(get_network(args.model), np.dtype(args.dtype)).init(config.init, args.seed)
    watched = SnapshotStage(stage, grid_images, [snapshot_step])
    watched.snapshot(0)
    history = train(config, data, stage=watched)
    watched.snapshot("end")
    return history, watched.snapshots, stage


def learning_curve_runs(result: dict, data, args, steps: int, max_seconds: float = 120.0, progress=print) -> dict:
    """``steps`` steps of every benchmarked stage with the same seed; stages too slow for it are said to be skipped."""
    from cnn.train import TrainConfig, train

    histories = {}
    train_x, train_y, test_x, test_y = data
    limited = (train_x[:steps * args.batch_size], train_y[:steps * args.batch_size], test_x, test_y)
    for row in result["stages"]:
        estimate = row["step_ms"]["median"] * steps / 1e3
        if estimate > max_seconds:
            progress(f"learning curves: skipped {row['name']}: {steps} steps would take ~{estimate / 60:.0f} min "
                     f"({fmt_ms(row['step_ms']['median'])} ms per step)")
            continue
        config = TrainConfig(model=args.model, stage=row["name"], epochs=1, batch_size=args.batch_size,
                             seed=args.seed, dtype=args.dtype, eval_every=max(1, steps // 10), eval_subset=500,
                             progress=False)
        progress(f"learning curves: {steps} steps of stage {row['name']} ...")
        histories[row["name"]] = train(config, limited)
    return histories


def grid_indices(labels: np.ndarray, count: int = 12) -> np.ndarray:
    """``count`` test images, each class in turn (0, 1, …, 9, 0, …), the first of each not yet taken."""
    chosen = []
    classes = np.unique(labels)
    for turn in range(count):
        wanted = classes[turn % len(classes)]
        candidates = [i for i in np.flatnonzero(labels == wanted) if i not in chosen]
        chosen.append(int(candidates[0]))
    return np.array(chosen)


def demo(args, data=None, progress=print) -> dict:
    """The ``make demo`` job; returns where everything went and the final test accuracy.

    ``data`` = (train_x, train_y, test_x, test_y) normalised; by default ``args.model``'s dataset
    (MNIST for LeNet-5). Pictures show the normalised images: imshow rescales each one, so they
    look exactly like the raw pixels.
    """
    from cnn.model import get_network
    from cnn.train import DATASET_OF_MODEL, TrainConfig, load_dataset

    started = time.perf_counter()
    net = get_network(args.model)
    if data is None:
        data = load_dataset(TrainConfig(model=args.model, dtype=args.dtype, data_dir=args.data_dir))
    progress(f"data: {len(data[0])} training and {len(data[2])} test images")
    size = args.batch_size
    batches = [(data[0][i:i + size], data[1][i:i + size]) for i in range(0, 8 * size, size)]
    result = benchmark(args, net, batches, data_source=DATASET_OF_MODEL[args.model], progress=progress)
    json_path = save_benchmark(result, args.out, plots=True)
    progress("\n" + markdown_table(result) + "\n")

    stage_name = fastest_stage(result)
    lr, momentum, decay = course_hyperparameters()
    progress(f"training stage {stage_name} (the fastest here) for one epoch: lr {lr:g}, momentum {momentum:g}, "
             f"weight decay {decay:g}, batch {size} ...")
    indices = grid_indices(data[3])
    history, snapshots, stage = train_with_snapshots(stage_name, data, data[2][indices], args,
                                                     progress=getattr(args, "progress", True))
    curves = (learning_curve_runs(result, data, args, args.demo_curve_steps, progress=progress)
              if args.demo_curve_steps else {})
    for run in [history, *curves.values()]:      # each history says what machine, at what load, as the demo began
        run["machine"] = result["machine"]
    paths = {"results": str(json_path), **result["plots"],
             **demo_pictures(args, net, data, indices, stage_name, history, snapshots, stage, curves)}
    seconds = time.perf_counter() - started
    accuracy = history["final_test_accuracy"]
    progress("\n".join(f"{key:<12} {path}" for key, path in paths.items()))
    progress(f"final test accuracy of stage {stage_name} after one epoch: {accuracy:.2%}; demo took {seconds:.0f} s")
    return {"paths": paths, "final_test_accuracy": accuracy, "stage": stage_name, "seconds": seconds,
            "result": result}


def demo_pictures(args, net, data, indices, stage_name, history, snapshots, stage, curves) -> dict:
    """Write the demo's histories and pictures to ``args.pictures_dir`` (default: ``args.out``); {picture: path}."""
    from cnn import plots as pictures

    out = Path(args.pictures_dir or args.out)
    write_json(out / f"demo-history-{stage_name}.json", history)
    steps = history["epochs"][-1]["step"]
    titles = {0: "before training", 50: "after 50 steps", "end": f"after 1 epoch ({steps} steps)"}
    paths = {"digits": out / "digits-learning.png", "filters": out / "filters.png",
             "epoch_curve": out / f"learning-curve-{stage_name}.png"}
    pictures.digit_grid(data[2][indices], data[3][indices],
                        [(titles[key], probabilities) for key, probabilities in snapshots.items()],
                        save_to=paths["digits"],
                        title=f"{net.name}, stage {stage_name}: its predictions on test digits as it learns")
    pictures.filters_and_feature_maps(net, stage.get_params(), data[2][indices[0]], save_to=paths["filters"])
    pictures.learning_curves({stage_name: history}, save_to=paths["epoch_curve"],
                             title=f"stage {stage_name}: one epoch of {net.name}")
    if curves:
        paths["curves"] = out / "learning-curves.png"
        pictures.learning_curves(curves, save_to=paths["curves"],
                                 title=f"{args.demo_curve_steps} steps of every fast stage, same seed")
        for name, run in curves.items():
            write_json(out / f"demo-curve-{name}.json", run)
    return {key: str(path) for key, path in paths.items()}


def cmd_demo(args) -> int:
    if args.data != "real":
        raise ValueError("--demo trains on the real dataset; leave out --data random")
    report = demo(args)
    if args.model == "lenet5" and report["final_test_accuracy"] < DEMO_MIN_ACCURACY:
        print(f"python -m cnn bench --demo: test accuracy {report['final_test_accuracy']:.2%} after one epoch is "
              f"below the {DEMO_MIN_ACCURACY:.0%} LeNet-5 reaches with the course's recipe", file=sys.stderr)
        return 1
    return 0
