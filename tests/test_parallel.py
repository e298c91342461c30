"""Tests for cnn.parallel: every strategy launched with mpiexec on a tiny learnable dataset.

The synchronous strategies (ps-sync, allreduce, sandblaster, model-parallel) must give the weights
of one process trained with the whole global batch (cnn.train), up to float32 rounding; the
asynchronous ones (downpour, hogwild, easgd) must learn and report sane staleness; a rank killed
mid-run must never hang the job nor lose the weights. Ranks are oversubscribed (-n 4 on two cores
is fine): the tests check results, never times.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("mpi4py")

from cnn import data  # noqa: E402
from cnn.model import get_network  # noqa: E402
from cnn.parallel import costmodel, launch  # noqa: E402
from cnn.parallel.allreduce import chunk_bounds  # noqa: E402
from cnn.stages import get_stage  # noqa: E402
from cnn.train import TrainConfig, load_dataset, train  # noqa: E402

try:
    MPIEXEC = launch.find_mpiexec()
except FileNotFoundError:
    MPIEXEC = None

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed")]

TRAIN, TEST = 256, 64
LAUNCH_TIMEOUT = 180          # a hung job fails the test instead of the suite
QUICK_LOSS_TIMEOUT = 2.0      # --peer-timeout of the fault tests
# Stale gradients plus heavy momentum make the tiny problem's start erratic: calmer settings.
ASYNC = {"init": "xavier", "momentum": 0.5}


def write_learnable_mnist(directory, seed: int = 0) -> None:
    """A tiny MNIST-shaped dataset LeNet-5 learns in two epochs: each class is a sparse random
    pattern of bright pixels, and each image keeps a random 80 % of its class's pattern."""
    rng = np.random.default_rng(seed)
    patterns = rng.random((10, 28, 28)) < 0.12

    def images_and_labels(count):
        labels = rng.integers(0, 10, count)
        kept = rng.random((count, 28, 28)) < 0.8
        images = (patterns[labels] & kept) * rng.integers(150, 256, (count, 28, 28))
        return images.astype(np.uint8), labels.astype(np.uint8)

    arrays = (*images_and_labels(TRAIN), *images_and_labels(TEST))
    for name, array in zip(data.MNIST_FILES, arrays):
        data.write_idx(directory / f"{name}.gz", array)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-mnist")
    write_learnable_mnist(directory)
    return directory


def run_parallel(strategy, ranks, data_dir, tmp_path, name="run", **options):
    """Launch a run on the tiny data; returns the Launch (summary, returncode, stdout, stderr)."""
    options = {"data_dir": str(data_dir), "batch_size": 8, "epochs": 1, "lr": 0.02, "progress": False,
               "peer_timeout": 60, "checkpoint": str(tmp_path / f"{name}.npz"), **options}
    return launch.launch(strategy, ranks, summary=str(tmp_path / f"{name}.json"), timeout=LAUNCH_TIMEOUT, **options)


def checkpoint_of(path) -> dict:
    with np.load(path) as archive:
        return {key: archive[key] for key in ("params", "momentum", "epoch", "batch")}


def one_process(data_dir, batch_size, limit_train=None, **settings) -> np.ndarray:
    """The weights cnn.train reaches in one process with the global batch, from the same initial weights."""
    settings.setdefault("warmup_epochs", 0.25)      # cnn.parallel's default for a one-epoch run: a quarter of it
    config = TrainConfig(data_dir=str(data_dir), batch_size=batch_size, epochs=1, lr=0.02, progress=False,
                         limit_train=limit_train, **settings)
    stage = get_stage("numpy")(get_network("lenet5")).init(config.init, config.seed)
    history = train(config, load_dataset(config), stage)
    return stage.get_params(), history


def relative_error(got, expected) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def initial_params():
    return get_stage("numpy")(get_network("lenet5")).init("he", 0).get_params()


def assert_same_weights(got, expected, tolerance=1e-5):
    assert relative_error(got, expected) < tolerance, relative_error(got, expected)
    assert relative_error(expected, initial_params()) > 1e-2      # training moved them: the test can fail


def assert_succeeded(result):
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.summary is not None and result.summary["status"] == "completed", result.stderr[-2000:]


def assert_ran_to_the_end(result):
    """Every step ran. (A run of a few steps, as the exactness tests use, may end below the accuracy
    that counts as learned: it then says so and exits with 1 — its weights are what is checked.)"""
    assert result.summary is not None, result.stderr[-2000:]
    assert result.summary["status"] in ("completed", "did not learn"), result.stderr[-2000:]
    assert result.returncode == (0 if result.summary["status"] == "completed" else 1), result.stderr[-2000:]


# -- the synchronous strategies equal one process with the global batch ---------------------------

@pytest.mark.parametrize("strategy, ranks, options", [
    ("ps-sync", 2, {}),
    ("ps-sync", 4, {}),
    ("allreduce", 2, {"allreduce": "mpi"}),
    ("allreduce", 4, {"allreduce": "ring"}),
])
def test_synchronous_strategy_equals_one_process_with_the_global_batch(strategy, ranks, options, data_dir, tmp_path):
    timeline = tmp_path / "timeline.json"
    result = run_parallel(strategy, ranks, data_dir, tmp_path, limit_train=128, timeline=str(timeline), **options)
    assert_ran_to_the_end(result)
    summary = result.summary
    config = summary["config"]
    assert config["schedule"] == "warmup" and config["lr_scale"] == ranks     # Horovod: lr × workers, warmup
    expected, history = one_process(data_dir, 8 * ranks, limit_train=128, schedule="warmup", lr_scale=ranks)
    assert_same_weights(checkpoint_of(tmp_path / "run.npz")["params"], expected)
    # the loss averaged across ranks is the loss of the global batch
    losses = np.array([step[1] for step in summary["history"]["steps"]])
    np.testing.assert_allclose(losses, [step[1] for step in history["steps"]], rtol=1e-4)
    assert summary["final_test_accuracy"] == pytest.approx(history["final_test_accuracy"], abs=1 / TEST)
    events = json.loads(timeline.read_text())["traceEvents"]
    assert {event["pid"] for event in events} == set(range(ranks))
    assert {"compute", "gradient averaging"} <= {event.get("cat") for event in events}


def test_ring_allreduce_equals_mpi_allreduce_and_the_exact_sum():
    script = """
import numpy as np
from mpi4py import MPI
from cnn.parallel.world import World
from cnn.parallel.allreduce import ring_allreduce, mpi_allreduce
world = World(MPI.COMM_WORLD, timeout=60)
for length in (1, 3, 4, 5, 1000, 44427):
    vectors = [np.random.default_rng([length, r]).standard_normal(length).astype(np.float32) for r in range(world.size)]
    exact = np.sum(np.array(vectors, np.float64), axis=0)
    ring = ring_allreduce(world, vectors[world.rank].copy())
    mpi = mpi_allreduce(world, vectors[world.rank].copy())
    scale = np.abs(np.array(vectors)).sum(axis=0)
    assert np.all(np.abs(ring - exact) <= 1e-6 * scale + 1e-7), (length, np.abs(ring - exact).max())
    assert np.all(np.abs(ring - mpi) <= 1e-6 * scale + 1e-7), (length, np.abs(ring - mpi).max())
print("ok", world.rank)
"""
    argv = [MPIEXEC, *launch.launcher_flags(MPIEXEC, 4, fault_tolerant=False), "-n", "4", sys.executable,
            "-m", "mpi4py", "-c", script]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=launch.environment())
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.split()) == sorted("ok 0 ok 1 ok 2 ok 3".split())


def test_sandblaster_equals_one_process_although_a_straggler_gets_duplicates(data_dir, tmp_path):
    """A 10-times straggler (it sleeps 9 times its own compute time, so a busy machine slows it as
    much as the other) hands most of the batch to the fast worker; the weights are still exact."""
    result = run_parallel("sandblaster", 3, data_dir, tmp_path, optimizer="sgd", limit_train=128, portions=4,
                          slow_rank=2, slow_down=10)
    assert_ran_to_the_end(result)
    assert result.summary["duplicates"] >= 1
    done_by = result.summary["portions_done_by"]
    assert done_by["1"] > done_by.get("2", 0)                  # the fast worker did more of the batch
    expected, _ = one_process(data_dir, 16, limit_train=128, schedule="warmup", lr_scale=2)
    assert_same_weights(checkpoint_of(tmp_path / "run.npz")["params"], expected)


def test_sandblaster_duplicates_only_late_portions(data_dir, tmp_path):
    """--backup-after 0 gives a duplicate to every worker that is idle while a portion of the batch
    is still out; with a threshold no portion is late enough, although one worker is 4 times
    slower. The coordinator counts those idle moments, so the test holds whatever the OS schedules
    (under load an eager run can finish a batch without any idle moment: a worker still busy with
    a stale duplicate of the previous batch)."""
    common = dict(limit_train=128, portions=4)
    eager = run_parallel("sandblaster", 3, data_dir, tmp_path, optimizer="sgd", name="eager", backup_after=0, **common)
    patient = run_parallel("sandblaster", 3, data_dir, tmp_path, optimizer="sgd", name="patient", backup_after=1000,
                           slow_rank=2, slow_down=4, **common)
    assert_ran_to_the_end(eager)
    assert_ran_to_the_end(patient)
    assert eager.summary["duplicates"] == eager.summary["idle_with_portions_out"] >= 1
    assert patient.summary["duplicates"] == 0 < patient.summary["idle_with_portions_out"]


def test_backup_rule_picks_the_least_copied_late_portion():
    from cnn.parallel.sandblaster import choose_backup

    out_since = {0: 10.0, 1: 12.0, 2: 13.5}           # portion -> when its oldest copy went out
    copies = {0: 2, 1: 1, 2: 1}
    assert choose_backup(out_since, copies, late_after=0.0, now=14.0) in (1, 2)    # eager: any, least copied
    assert choose_backup(out_since, copies, late_after=1.0, now=14.0) == 1         # 2 is out for 0.5 s only
    assert choose_backup(out_since, copies, late_after=3.0, now=14.0) == 0         # only 0 is out for 4 s
    assert choose_backup(out_since, copies, late_after=5.0, now=14.0) is None      # none is late
    assert choose_backup(out_since, copies, late_after=None, now=14.0) is None     # no portion timed yet
    assert choose_backup({}, {}, late_after=0.0, now=14.0) is None


def test_model_parallel_with_pipelining_equals_one_process(data_dir, tmp_path):
    result = run_parallel("model-parallel", 2, data_dir, tmp_path, limit_train=64, micro_batches=3)
    assert_ran_to_the_end(result)
    expected, history = one_process(data_dir, 8, limit_train=64)
    assert_same_weights(checkpoint_of(tmp_path / "run.npz")["params"], expected)
    losses = [step[1] for step in result.summary["history"]["steps"]]
    np.testing.assert_allclose(losses, [step[1] for step in history["steps"]], rtol=1e-4)


# -- the asynchronous strategies learn, with sane staleness ------------------------------------------

def assert_learned(summary):
    first_losses = [step[1] for step in summary["history"]["steps"][:5]]
    assert summary["final_test_loss"] < 0.5 * np.mean(first_losses)
    assert summary["final_test_accuracy"] >= 0.7                 # chance is 0.1


def test_downpour_learns_and_reports_staleness(data_dir, tmp_path):
    result = run_parallel("downpour", 3, data_dir, tmp_path, epochs=2, n_fetch=2, **ASYNC)
    assert_succeeded(result)
    summary = result.summary
    assert_learned(summary)
    staleness = summary["staleness"]
    steps_per_replica = 2 * TRAIN // (2 * 8)
    assert staleness["count"] == summary["updates"] == 2 * steps_per_replica     # one push per step per replica
    assert sum(staleness["histogram"].values()) == staleness["count"]
    assert 0 <= staleness["mean"] <= staleness["max"] < staleness["count"]
    assert staleness["max"] >= 1                                   # with fetches every 2 steps, never all fresh


def test_hogwild_learns_without_locks_and_counts_staleness(data_dir, tmp_path):
    result = run_parallel("hogwild", 3, data_dir, tmp_path, epochs=2, **ASYNC)
    assert_succeeded(result)
    summary = result.summary
    assert_learned(summary)
    staleness = summary["staleness"]
    assert staleness["count"] == summary["updates"] == 3 * 2 * (TRAIN // (3 * 8))
    assert 0 <= staleness["mean"] <= staleness["max"] < staleness["count"]


@pytest.mark.parametrize("mode", ["sync", "round-robin", "async"])
def test_easgd_center_learns(mode, data_dir, tmp_path):
    result = run_parallel("easgd", 3, data_dir, tmp_path, epochs=2, easgd_mode=mode, tau=2, **ASYNC)
    assert_succeeded(result)
    assert result.summary["mode"] == mode and result.summary["rho"] == pytest.approx(0.9 / (2 * 0.02))
    assert result.summary["final_test_accuracy"] >= 0.7


# -- without MPI: bad input, the cost model, the launcher ----------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["--strategy", "nope"], "invalid choice: 'nope'"),
    (["--strategy", "allreduce", "--batch-size", "0"], "--batch-size: 0 must be > 0"),
    (["--strategy", "downpour", "--kill-rank", "1"], "--kill-rank and --kill-at-step go together"),
])
def test_bad_flags_give_one_line(argv, fragment, capsys):
    from cnn.parallel.cli import main

    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and fragment in error


def test_impossible_layouts_are_one_line_errors():
    from cnn.parallel import model_parallel, sandblaster

    with pytest.raises(ValueError, match="exactly 2 ranks, not 3"):
        model_parallel.layout(3, None)
    with pytest.raises(ValueError, match=r"--split 3: .* before layer 7, 8, 9, 10"):
        model_parallel.split_network(get_network("lenet5"), 3)
    with pytest.raises(ValueError, match="--portions 9 is more than the 8 images"):
        sandblaster.portion_bounds(8, 9)


def test_split_network_halves_chain_and_share_the_flat_layout():
    from cnn.parallel.model_parallel import split_network

    net = get_network("lenet5")
    front, back = split_network(net, None)
    assert front.activation_shapes()[-1] == back.activation_shapes()[0] == (256,)
    assert front.num_params + back.num_params == net.num_params
    assert front.layers + back.layers == net.layers


def test_cost_model_formulas_and_fit():
    rng = np.random.default_rng()
    alpha, beta = rng.uniform(1e-6, 1e-4), rng.uniform(1e-10, 1e-9)
    sizes = np.array([8, 512, 32768, 2 ** 20])
    fitted_alpha, fitted_beta = costmodel.fit_alpha_beta(sizes, alpha + sizes * beta)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6) and fitted_beta == pytest.approx(beta, rel=1e-6)
    workers, nbytes = np.arange(2, 1025), 4 * 44426
    assert np.all(costmodel.ps_link_bytes(workers, nbytes) == 2 * (workers - 1) * nbytes)
    assert np.all(costmodel.ring_link_bytes(workers, nbytes) < 2 * nbytes)
    ps, ring = costmodel.ps_seconds(workers, nbytes, alpha, beta), costmodel.ring_seconds(workers, nbytes, alpha, beta)
    assert ps[0] == pytest.approx(2 * (alpha + nbytes * beta))     # P = 2: one exchange each way
    assert np.all(ring[1:] < ps[1:])                                # a ring beats the server from 3 workers on
    latency_only = costmodel.ring_seconds(workers, nbytes, alpha, 0.0)
    assert np.allclose(latency_only, costmodel.ps_seconds(workers, nbytes, alpha, 0.0))


def test_chunk_bounds_cover_the_vector_in_nearly_equal_parts():
    for length, parts in [(10, 3), (44427, 4), (2, 4)]:
        bounds = chunk_bounds(length, parts)
        assert bounds[0] == 0 and bounds[-1] == length and len(bounds) == parts + 1
        assert np.ptp(np.diff(bounds)) <= 1
