"""The optimizers and algorithms of issue 17, each checked against what it must equal.

Adagrad's update against its formula; L-BFGS on a known quadratic (it reaches the minimiser) and
its two-loop direction against H·g with H built by the BFGS update (by hand on a 2-d case, with
numpy on a larger one). Without MPI: ``test_parallel_algorithms_mpi.py`` runs them in the strategies.
"""

from __future__ import annotations

import numpy as np
import pytest

from cnn.parallel import lbfgs
from cnn.parallel.lbfgs import LBFGS, dense_inverse_hessian
from cnn.parallel.optimizers import HostAdagrad, HostSGD, server_optimizer
from cnn.train import TrainConfig


# -- Adagrad ------------------------------------------------------------------------------------------

def test_adagrad_update_follows_its_formula():
    rng = np.random.default_rng()
    params = rng.standard_normal(50)
    config = TrainConfig(lr=0.1, weight_decay=1e-3)
    opt = server_optimizer(params, config, "adagrad")
    assert isinstance(opt, HostAdagrad)
    theta, sum_squares = params.copy(), np.zeros(50)
    for _ in range(5):
        grad = rng.standard_normal(50) * rng.uniform(0.1, 10)
        opt.step(grad, 0.1)
        g = grad + 1e-3 * theta                          # g ← g + λθ;  G ← G + g²;  θ ← θ − η g / (√G + ε)
        sum_squares += g * g
        theta = theta - 0.1 * g / (np.sqrt(sum_squares) + 1e-10)
    np.testing.assert_allclose(opt.params, theta, rtol=1e-13)
    np.testing.assert_allclose(opt.get_momentum(), sum_squares, rtol=1e-13)
    assert np.max(np.abs(opt.params - params)) > 0.1      # it moved: the test can fail


def test_adagrad_first_step_moves_every_parameter_by_the_rate():
    """With G = g² after one step, θ − η·g/|g| moves each parameter by η whatever its gradient's size."""
    params = np.zeros(4)
    opt = HostAdagrad(params, TrainConfig(weight_decay=0.0))
    opt.step(np.array([1e-3, -5.0, 200.0, -0.25]), 0.01)
    np.testing.assert_allclose(opt.params, [-0.01, 0.01, -0.01, 0.01], rtol=1e-6)


def test_unknown_server_rule_is_one_line():
    with pytest.raises(ValueError, match="unknown server rule 'adam'; choose one of sgd, adagrad"):
        server_optimizer(np.zeros(3), TrainConfig(), "adam")
    assert isinstance(server_optimizer(np.zeros(3), TrainConfig()), HostSGD)


# -- L-BFGS ---------------------------------------------------------------------------------------------

def random_quadratic(rng, size):
    """f(x) = ½ xᵀAx − bᵀx with A symmetric positive definite: minimiser A⁻¹b."""
    m = rng.standard_normal((size, size))
    a, b = m @ m.T + size * np.eye(size), rng.standard_normal(size)
    return (lambda x: (0.5 * x @ a @ x - b @ x, a @ x - b)), np.linalg.solve(a, b)


def test_lbfgs_reaches_the_minimiser_of_a_quadratic():
    rng = np.random.default_rng()
    function, minimiser = random_quadratic(rng, 20)
    opt = LBFGS(np.zeros(20), history=5, first_step=0.01)
    reports = [opt.step(function) for _ in range(25)]
    assert np.linalg.norm(opt.params - minimiser) < 1e-8 * np.linalg.norm(minimiser)
    assert sum(report.step_length == 1.0 for report in reports[:10]) >= 5     # quasi-Newton steps are taken whole
    losses = [report.loss for report in reports]
    assert all(later <= earlier + 1e-12 for earlier, later in zip(losses, losses[1:]))


def test_two_loop_direction_by_hand():
    """One pair s = (1, 0), y = (2, 1): ρ = 1/2, γ = sᵀy/yᵀy = 2/5, and the BFGS update of γI gives
    H = [[0.6, −0.2], [−0.2, 0.4]] (H·y = s: the secant equation). For g = (1, 1), H·g = (0.4, 0.2)."""
    opt = LBFGS(np.zeros(2))
    assert opt.remember(np.array([1.0, 0.0]), np.array([2.0, 1.0]))
    np.testing.assert_allclose(opt.direction(np.array([1.0, 1.0])), [0.4, 0.2], rtol=1e-15)
    np.testing.assert_allclose(dense_inverse_hessian(list(opt.pairs), 2), [[0.6, -0.2], [-0.2, 0.4]], rtol=1e-15)
    assert not opt.remember(np.array([1.0, 0.0]), np.array([-1.0, 3.0]))      # sᵀy < 0: refused


def test_two_loop_direction_equals_the_dense_bfgs_matrix():
    rng = np.random.default_rng()
    function, _ = random_quadratic(rng, 8)
    opt = LBFGS(rng.standard_normal(8), history=3, first_step=0.05)
    for _ in range(5):                      # 5 iterations, memory 3: the oldest pairs dropped out
        opt.step(function)
    assert len(opt.pairs) == 3
    grad = rng.standard_normal(8)
    hessian_inverse = dense_inverse_hessian(list(opt.pairs), 8)
    np.testing.assert_allclose(opt.direction(grad), hessian_inverse @ grad, rtol=1e-10)
    # the secant equation H·y = s holds exactly for the newest pair
    np.testing.assert_allclose(hessian_inverse @ opt.pairs[-1][1], opt.pairs[-1][0], rtol=1e-10)


def test_lbfgs_line_search_gives_up_without_moving():
    """A direction along which the loss only grows: every trial fails, θ stays, the memory is cleared."""
    opt = LBFGS(np.array([1.0, 1.0]), max_tries=3)
    opt.remember(np.array([1.0, 0.0]), np.array([2.0, 1.0]))
    report = opt.step(lambda x: (float(x @ x) if np.allclose(x, 1) else 1e9, 2 * x))
    assert report.step_length == 0.0 and report.evaluations == 4
    np.testing.assert_array_equal(opt.params, [1.0, 1.0])
    assert opt.rejected == 1 and not opt.pairs


def test_lbfgs_pairs_survive_a_checkpoint():
    rng = np.random.default_rng()
    function, _ = random_quadratic(rng, 6)
    opt = LBFGS(np.zeros(6), history=4, first_step=0.05)
    for _ in range(3):
        opt.step(function)
    copy = LBFGS(opt.params, history=4)
    copy.load_pairs(opt.pairs_as_rows())
    grad = rng.standard_normal(6)
    np.testing.assert_array_equal(copy.direction(grad), opt.direction(grad))


def test_weight_decay_is_part_of_the_objective():
    decayed = lbfgs.with_weight_decay(lambda x: (0.0, np.zeros_like(x)), 0.5)
    loss, grad = decayed(np.array([2.0, 0.0]))
    assert loss == pytest.approx(1.0) and list(grad) == [1.0, 0.0]



# -- model parallelism: where to cut -------------------------------------------------------------------

def test_the_balanced_cut_splits_a_convolution_when_no_plain_cut_balances():
    """Synthetic costs: conv2's block (layers 3-5) is 70 of the 100 units of work, 6 of them fixed
    (paid by both shares) and 4 a filter, so no plain cut balances; 8 of its 16 filters on each side
    do: rank 0 15 + 6 + 4·8 = 53, rank 1 6 + 4·8 + 15 = 53, against 85 / 15 after Flatten."""
    from cnn.model import get_network
    from cnn.parallel import partition

    net = get_network("lenet5")
    layers = np.array([10, 2, 3, 60, 4, 6, 0, 10, 1, 2, 1, 1], float)
    costs = partition.Costs(layers, {0: (4.0, 11 / 6), 3: (6.0, 4.0)})
    best = partition.balanced_partition(net, costs)
    assert best == partition.Partition(3, 8)
    assert partition.rank_costs(net, costs, best) == pytest.approx((53, 53))
    assert max(partition.rank_costs(net, costs, partition.default_cut(net))) == 85      # after Flatten
    even = partition.Costs(np.ones(12), {0: (1.0, 0.0), 3: (1.0, 0.0)})                 # evenly spread
    assert partition.balanced_partition(net, even) == partition.Partition(6)            # a plain cut wins ties
    assert partition.Costs.from_json(costs.as_json()).blocks == costs.blocks


@pytest.mark.parametrize("split", ["3:5", "0:2", "5", "7"])
def test_the_pieces_hold_every_parameter_once(split):
    from cnn.model import get_network
    from cnn.parallel import partition

    net = get_network("lenet5")
    front, back = partition.pieces(net, partition.parse_split(split, net))
    flat = np.random.default_rng().standard_normal(net.num_params)
    rebuilt = np.zeros_like(flat)
    for piece in front + back:
        partition.put(net, rebuilt, piece, partition.take(net, flat, piece))
    np.testing.assert_array_equal(rebuilt, flat)
    assert sum(piece.num_params for piece in front + back) == net.num_params


@pytest.mark.parametrize("text, fragment", [
    ("4:2", "layer 4 of lenet5 is ReLU, not a convolution; the convolutions are layers 0, 3"),
    ("3:16", "layer 3 has 16 output channels: C must lie in 1 … 15"),
    ("12", "the cut must leave layers on both ranks: 1 to 11"),
    ("x", "give K (a layer index) or K:C"),
])
def test_impossible_splits_are_one_line(text, fragment):
    from cnn.model import get_network
    from cnn.parallel.partition import parse_split

    with pytest.raises(ValueError) as refusal:
        parse_split(text, get_network("lenet5"))
    assert fragment in str(refusal.value) and "\n" not in str(refusal.value)


def test_the_probe_times_every_layer_and_splits_each_convolution_block():
    from cnn.model import get_network
    from cnn.parallel.partition import measure_costs
    from cnn.stages import get_stage

    costs = measure_costs(get_network("lenet5"), get_stage("numpy"), batch=2, repeats=1)
    assert costs.layers.shape == (12,) and np.all(costs.layers > 0)
    assert sorted(costs.blocks) == [0, 3] and all(fixed >= 0 and per >= 0 for fixed, per in costs.blocks.values())


def test_the_strategies_table_marks_the_machine_of_each_row():
    """Rows from two machines: each row carries its machine's mark, one line per machine says which;
    runs recorded before an option existed are labelled with what they ran."""
    import json
    from pathlib import Path

    from cnn.parallel import report

    recorded = json.loads((Path(__file__).resolve().parent.parent / "benchmarks" / "results" /
                           "parallel_strategies.json").read_text())
    old = next(s for s in recorded if s["strategy"] == "easgd" and s["options"]["easgd_mode"] == "async"
               and "steps_when_first_worker_finished" not in s)
    other = json.loads(json.dumps(old))
    other["machine"] = {**old["machine"], "host": "laptop", "cores": 2}
    text = report.machine_lines([old, other])
    assert text.startswith("[A] Measured on") and "\n\n[B] Measured on" in text and "2 cores" in text
    table = report.strategy_table([old, other])
    assert "[A] |" in table and "[B] |" in table
    assert report.label(old).startswith("easgd (round-robin")          # recorded when "async" named it
    assert report.label({"strategy": "sandblaster", "options": {}}) == "sandblaster (sgd)"
