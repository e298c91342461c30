"""Assignment 11's tests: a ring allreduce, a synchronous parameter-server step and an EASGD exchange.

The ranks run as threads of the kernel (``cnn.grading.ranks``), each with its own vector drawn by the
referee; the referee computes the sums, the library's SGD step (``sgd_momentum_update``) and the elastic
averaging itself, and compares every rank's result. The traffic each rank reports having sent — numbers
and messages per link, counted by the simulated ranks — is graded against a ring's: at most
2·(P−1)·⌈N/P⌉ numbers in 2·(P−1) messages per rank.
"""

from functools import partial

import numpy as np

from cnn.grading.family import Case, Family, LIBRARY, OwnWork, Verdict, close, normal
from cnn.grading.ranks import run_ranks
from cnn.stages.base import sgd_momentum_update

RING = {"divisible": [(2, 12), (3, 24), (4, 100)],          # P ranks, N a multiple of P
        "uneven": [(3, 10), (4, 7), (5, 3)],                # chunks of different sizes, some empty (N < P)
        "traffic": [(4, 1000)]}


def ring_cases(rng, config, memory, kind):
    for ranks, length in RING[kind]:
        vectors = [normal(rng, length) for _ in range(ranks)]
        total = np.sum(vectors, axis=0)
        judges = [close(f"rank {rank}", total, 1e-12, f"P = {ranks}, N = {length}: rank {rank}'s result")
                  for rank in range(ranks)]
        if kind == "traffic":
            judges.append(ring_traffic(ranks, length))
        yield Case(f"P = {ranks}, N = {length}", {"vectors": vectors}, judges)


def ring_traffic(ranks: int, length: int):
    chunk = -(-length // ranks)
    numbers, messages = 2 * (ranks - 1) * chunk, 2 * (ranks - 1)

    def judge(outputs):
        for rank in range(ranks):
            sent, sent_messages = int(outputs["sent"][rank]), int(outputs["messages"][rank])
            if sent > numbers:
                return Verdict(False, message=f"rank {rank} sent {sent} numbers; a ring sends at most {numbers}: cut the "
                                              f"vector into P chunks and pass one chunk per step to the right neighbour")
            if sent_messages > messages:
                return Verdict(False, message=f"rank {rank} sent {sent_messages} messages; a ring sends {messages}: one "
                                              f"chunk per step, P − 1 steps of reduce-scatter and P − 1 of all-gather")
        return Verdict(True, f"a ring sends at most 2·(P−1)·⌈N/P⌉ = {numbers} numbers in 2·(P−1) = {messages} messages "
                             f"per rank; a gather to rank 0 and a broadcast back send (P−1)·N = {(ranks - 1) * length} "
                             f"from rank 0\n" + outputs.get("summary", ""))
    return judge


def run_ring(inputs, ring_allreduce, *others):
    vectors = inputs["vectors"]
    results, traffic = run_ranks(len(vectors), ring_allreduce, per_rank=[(vector.copy(),) for vector in vectors])
    return {**{f"rank {rank}": result for rank, result in enumerate(results)}, **_traffic(traffic, len(vectors))}


def _traffic(traffic, ranks: int) -> dict:
    return {"sent": [traffic.sent(rank) for rank in range(ranks)], "received": [traffic.received(rank) for rank in range(ranks)],
            "messages": [traffic.messages_sent(rank) for rank in range(ranks)], "summary": traffic.summary()}


SERVER = dict(length=20, lr=0.1, momentum=0.9, weight_decay=1e-3)


def server_cases(rng, config, memory, ranks_list, check_velocity: bool):
    for ranks in ranks_list:
        params, velocity = normal(rng, SERVER["length"]), normal(rng, SERVER["length"])
        gradients = [normal(rng, SERVER["length"]) for _ in range(ranks)]
        hyper = (SERVER["lr"], SERVER["momentum"], SERVER["weight_decay"])
        expected_params, expected_velocity = params.copy(), velocity.copy()
        sgd_momentum_update(expected_params, expected_velocity, np.mean(gradients, axis=0), *hyper)
        if check_velocity:
            judges = [close("velocity 0", expected_velocity, 1e-12, f"P = {ranks}: the server's velocity after the step")]
        else:
            judges = [close(f"params {rank}", expected_params, 1e-12, f"P = {ranks}: rank {rank}'s weights after the step")
                      for rank in range(ranks)] + [server_link(ranks)]
        yield Case(f"P = {ranks}", {"params": params, "velocity": velocity, "gradients": gradients, "hyper": hyper}, judges)


def server_link(ranks: int):
    """Not a limit: what the server's link carried, beside what each link of a ring allreduce would."""
    ring = 2 * 2 * (ranks - 1) * -(-SERVER["length"] // ranks)        # sent + received by each rank of a ring
    return lambda outputs: Verdict(True, f"P = {ranks}, N = {SERVER['length']}: the server's link carried "
                                         f"{int(outputs['sent'][0]) + int(outputs['received'][0])} numbers; each link of a "
                                         f"ring allreduce would carry {ring}")


def run_server(inputs, parameter_server_step, *others):
    hyper = inputs["hyper"]

    def step(comm, params, velocity, grad):
        parameter_server_step(comm, params, velocity, grad, *hyper)
        return params, velocity
    states = [(inputs["params"].copy(), inputs["velocity"].copy(), gradient) for gradient in inputs["gradients"]]
    results, traffic = run_ranks(len(states), step, per_rank=states)
    outputs = {}
    for rank, (params, velocity) in enumerate(results):
        outputs[f"params {rank}"], outputs[f"velocity {rank}"] = params, velocity
    return {**outputs, **_traffic(traffic, len(states))}


EASGD = dict(length=30, lr=0.05, rho=4.0)


def easgd_cases(rng, config, memory, ranks_list, kind):
    for ranks in ranks_list:
        weights = [normal(rng, EASGD["length"]) for _ in range(ranks)]
        alpha, center = EASGD["lr"] * EASGD["rho"], weights[0]
        expected = [center + alpha * sum(w - center for w in weights[1:])] + [w - alpha * (w - center) for w in weights[1:]]
        if kind == "workers":
            judges = [close(f"rank {rank}", expected[rank], 1e-12, f"P = {ranks}: worker {rank}'s weights")
                      for rank in range(1, ranks)]
        elif kind == "center":
            judges = [close("rank 0", expected[0], 1e-12, f"P = {ranks}: the center")]
        else:
            judges = [easgd_traffic(ranks, EASGD["length"])]
        yield Case(f"P = {ranks}", {"weights": weights, "alpha": (EASGD["lr"], EASGD["rho"])}, judges)


def easgd_traffic(ranks: int, length: int):
    def judge(outputs):
        for worker in range(1, ranks):
            sent, received = int(outputs["sent"][worker]), int(outputs["received"][worker])
            if sent != length or received != length:
                return Verdict(False, message=f"worker {worker} sent {sent} and received {received} numbers: an exchange "
                                              f"moves one vector of {length} each way (its weights out, the center back)")
        if int(outputs["sent"][0]) != (ranks - 1) * length:
            return Verdict(False, message=f"the master sent {outputs['sent'][0]} numbers: the center once to each worker")
        return Verdict(True, outputs.get("summary", ""))
    return judge


def run_easgd(inputs, easgd_exchange, *others):
    lr, rho = inputs["alpha"]

    def exchange(comm, weights):
        easgd_exchange(comm, weights, lr, rho)
        return weights
    results, traffic = run_ranks(len(inputs["weights"]), exchange, per_rank=[(w.copy(),) for w in inputs["weights"]])
    return {**{f"rank {rank}": result for rank, result in enumerate(results)}, **_traffic(traffic, len(results))}


#: the simulated communicator's calls, and the update the server is asked to apply, are allowed
OWN_WORK = OwnWork(rules=LIBRARY + (("cnn.grading.ranks.*", True), ("cnn.stages.base.sgd_momentum_update", True)))
FAMILIES = {
    "test_ring_divisible": Family(partial(ring_cases, kind="divisible"), run_ring, OWN_WORK),
    "test_ring_uneven": Family(partial(ring_cases, kind="uneven"), run_ring, OWN_WORK),
    "test_ring_traffic": Family(partial(ring_cases, kind="traffic"), run_ring, OWN_WORK),
    "test_server_weights": Family(partial(server_cases, ranks_list=(2, 3, 5), check_velocity=False), run_server, OWN_WORK),
    "test_server_velocity": Family(partial(server_cases, ranks_list=(2, 4), check_velocity=True), run_server, OWN_WORK),
    "test_easgd_workers": Family(partial(easgd_cases, ranks_list=(2, 3, 5), kind="workers"), run_easgd, OWN_WORK),
    "test_easgd_center": Family(partial(easgd_cases, ranks_list=(2, 3, 5), kind="center"), run_easgd, OWN_WORK),
    "test_easgd_traffic": Family(partial(easgd_cases, ranks_list=(4,), kind="traffic"), run_easgd, OWN_WORK),
}
