"""What stage 8's fused step should cost on an H100 — PREDICTED from its layer table, never measured here.

Kernel 1 (``kernels/fused_net_step.py``) runs one block a group of samples, one block an SM (its
168 registers a thread leave room for 12 warps; AlexNet-small's 164 KiB of shared memory for one
block), so at batch 64 or 128 all its blocks run at once, in one wave, and its time is ONE block's:
the sum over its phases (separated by ``syncthreads``) of the phase's longest thread.

    phase time = CYCLES_PER_INSTRUCTION × (instructions of the busiest thread) / 1.98 GHz + a barrier

A thread's instructions in a phase: for each of its items (t, t + T, …), ``ITEM`` instructions to
decode and store it, plus its inner-loop iterations × the instructions one iteration takes. Those
counts were read from the machine code: each device function of ``kernels/fused_net_layers.py``
compiled alone for sm_90 (numba-cuda → libNVVM → ``ptxas -arch=sm_90`` → ``nvdisasm``), the
instructions of its inner loop divided by the iterations the loop body holds (notebook 09 §5 does
it again). A warp issues one instruction every ``CYCLES_PER_INSTRUCTION`` cycles: 4 when its
instructions wait on one another — the 16 warps issue 22's calibration needs for a full rate,
spread over 12 — down to 2 where a loop has independent work to issue (the 16 multiply-adds of a
forward tile). The two give the prediction's range.

Kernel 2 reads G × P floats of partial sums (G groups, P parameters) at HBM's 3.35 TB/s; kernels 2
and 3 take at least issue 22's 2.5 µs each (the shortest kernel Nsight Compute measured); a CUDA
graph replays the 3 kernels at 1 µs each (MEASURED on the H100, ``benchmarks/results/probes-*``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from kernels.fused_net_table import DENSE, LANES

CLOCK_HZ = 1.98e9                    # H100 SXM boost clock
CYCLES_PER_INSTRUCTION = (2, 4)      # a warp's issue interval: independent work … issue 22's calibration
BARRIER_CYCLES = 40
HBM_BYTES_PER_S = 3.35e12
KERNEL_FLOOR_US = 2.5                # issue 22: the shortest kernel measured on the H100
GRAPH_REPLAY_US = 1.0                # MEASURED: a graph replays a kernel in 1 µs
#: instructions one inner-loop iteration takes (SASS, sm_90, this commit's kernels)
PER_ITERATION = {
    "forward tap": 112 / 1,          # window_forward: one tap of the 4 filters × 4 positions tile (16 FFMA)
    "weight window": 118 / 2,        # weight_gradient: one pooling window, 4 channels (the loop holds 2)
    "bias window": 12,               # bias_gradient: one pooling window
    "dx window": 174 / 2,            # conv_input_gradient: one pooling window checked, 4 channels
    "dense multiply-add": 74 / 4,    # dense_forward's lane loop (unrolled 4 times)
    "dense lane sum": 14,            # dense_forward: adding one lane's sum
    "dense dW": 65 / 4,              # dense_backward: one weight, one sample
    "dense dx": 86 / 4,              # dense_backward: one output of dL/dx's sum
    "relu mask": 12,
    "gather": 20,
}
ITEM = 150                           # decoding an item (integer divisions), setting up, storing


class Phase(NamedTuple):
    name: str
    instructions: float               # of the busiest thread


def busiest(costs, threads: int) -> float:
    """Thread t takes items t, t + T, …: the largest sum of item costs any thread gets."""
    costs = list(costs)
    return max((sum(costs[t::threads]) for t in range(min(threads, len(costs)))), default=0.0)


def window_phases(row: dict, position: int, samples: int, threads: int) -> tuple[Phase, Phase]:
    filters, channels, kernel = row["F"], row["C"], row["K"]
    outputs = samples * (math.ceil(filters / 4) if kernel else filters) * row["HO"] * row["WO"]
    taps = math.ceil(row["POOL"] ** 2 / 4) * channels * kernel * kernel
    forward = busiest([ITEM + taps * PER_ITERATION["forward tap"]] * outputs, threads)
    blocks, windows = math.ceil(channels / 4), row["HO"] * row["WO"]
    weights = [ITEM + samples * windows * PER_ITERATION["weight window"]] * (filters * blocks * kernel * kernel)
    biases = [ITEM + samples * windows * PER_ITERATION["bias window"]] * (filters if kernel else 0)
    reach = math.ceil((kernel + row["POOL"] - 1) / row["PSTRIDE"]) ** 2     # windows a dL/dx item checks, a filter
    data = [ITEM + filters * reach * PER_ITERATION["dx window"]] * (samples * blocks * row["H"] * row["W"]
                                                                    if position and kernel else 0)
    mask = busiest([PER_ITERATION["relu mask"]] * (samples * filters * windows if row["RELU"] else 0), threads)
    return (Phase(f"row {position} forward (window)", forward),
            Phase(f"row {position} backward (window)", mask + busiest(weights + biases + data, threads)))


def dense_phases(row: dict, position: int, samples: int, threads: int) -> tuple[Phase, Phase]:
    inputs, outputs = row["C"], row["F"]
    lanes = busiest([ITEM / 5 + math.ceil(inputs / LANES) * PER_ITERATION["dense multiply-add"]]
                    * (samples * outputs * LANES), threads)
    sums = busiest([LANES * PER_ITERATION["dense lane sum"]] * (samples * outputs), threads)
    weights = math.ceil(inputs / threads) * outputs * samples * PER_ITERATION["dense dW"]
    data = busiest([samples * PER_ITERATION["dense dW"]] * outputs
                   + [outputs * PER_ITERATION["dense dx"]] * (samples * inputs if position else 0), threads)
    mask = busiest([PER_ITERATION["relu mask"]] * (samples * outputs if row["RELU"] else 0), threads)
    return (Phase(f"row {position} forward (dense)", lanes + sums),
            Phase(f"row {position} backward (dense)", mask + weights + data))


def block_phases(builder, samples: int, threads: int) -> list[Phase]:
    """Kernel 1's phases for one block of ``samples`` samples, in the order they run."""
    size = math.prod(builder.input_shape)
    forward, backward = [Phase("gather", busiest([PER_ITERATION["gather"]] * (samples * size), threads))], []
    for position, row in enumerate(builder.rows):
        phases = (dense_phases if row["KIND"] == DENSE else window_phases)(row, position, samples, threads)
        forward.append(phases[0])
        backward.insert(0, phases[1])
    return forward + backward


def phase_us(phase: Phase, cycles_per_instruction: float) -> float:
    return (cycles_per_instruction * phase.instructions + BARRIER_CYCLES) / CLOCK_HZ * 1e6


class Prediction(NamedTuple):
    kernel_1_us: tuple[float, float]  # (low, high): 2 and 4 cycles an instruction
    sum_sgd_us: float
    finish_us: float
    graph_us: float

    @property
    def step_ms(self) -> tuple[float, float]:
        rest = self.sum_sgd_us + self.finish_us + self.graph_us
        return tuple((kernel + rest) / 1e3 for kernel in self.kernel_1_us)


def predict(builder, parameters: int, batch: int, samples: int, threads: int, sms: int = 132) -> Prediction:
    """The PREDICTED H100 time of one training step (steps back to back, one graph a step)."""
    groups = math.ceil(batch / samples)
    waves = math.ceil(groups / sms)
    phases = block_phases(builder, samples, threads)
    kernel_1 = tuple(waves * sum(phase_us(phase, cpi) for phase in phases) for cpi in CYCLES_PER_INSTRUCTION)
    sum_sgd = max(KERNEL_FLOOR_US, groups * parameters * 4 / HBM_BYTES_PER_S * 1e6)
    return Prediction(kernel_1, sum_sgd, KERNEL_FLOOR_US, 3 * GRAPH_REPLAY_US)
