"""What stage 8's fused step should cost on an H100 — PREDICTED from its layer table, never measured here.

Kernel 1 (``kernels/fused_net_step.py``) runs one block a group of samples, one block an SM (AlexNet-
small's shared memory holds one block; LeNet-5's 64 blocks find 132 SMs), so at batch 64 or 128 all
its blocks run at once, in one wave, and its time is ONE block's: the sum of its phases, a phase
being the code between two ``syncthreads``. The model walks the same layer table the kernel walks
(``kernels/fused_net_table.py``: slices, staging steps, halos) and gives each phase

    cycles = max(issue, chain, shared) + round trips × LATENCY + barriers × BARRIER_CYCLES

    issue    every warp's instructions / 4: an SM issues at most one instruction a cycle from each
             of its 4 schedulers
    chain    the busiest warp's instructions × CYCLES_A_WARP: a warp waits on its own instructions'
             latencies unless other warps fill the gaps. Issue 22's calibration on the H100 (stages
             4-7, ``cnn/bench/predict_step.py``) found that a scheduler issues at full rate only with
             ISSUE_WARPS = 22.6 warps an SM to choose from, i.e. a warp alone manages one instruction
             every 22.6 / 4 = 5.65 cycles (the high end); 2 cycles is a warp with independent work
             in hand, as the register tiles here have (the low end)
    shared   shared-memory wavefronts: an SM serves one 32-lane load a cycle (a broadcast counts once);
             a forward tile's 4 input loads hit 2-way bank conflicts at the high end (neighbouring
             lanes read inputs 2 words apart: pooling stride × convolution stride)
    latency  global loads a warp waits for one after another: the gather, each staging step, the
             Dense rows' weights — L2 hits, 281 cycles (an H100 die's L2 latency measured in
             ``markdewing/AI_kernels``, latency/README.md, GH200 row) at the low end, issue 22's
             calibrated MEMORY_LATENCY of 0.654 µs (load, use and the barrier) at the high end

A thread's instructions come from the machine code: each inner loop's instructions an iteration
(``PER_ITERATION``), read from the SASS of kernel 1 compiled for sm_90 (``python -m cnn bench --static
cuda-fused-net``: its "hot loop" is the forward tile; the others are the report's ``inner_loops``),
and each item's decode, set-up and epilogue (``PER_ITEM``) from probe kernels that call one device
function each — their static counts, which include branches not taken, so an upper bound.

Kernel 2 reads the G × P partial sums (G groups, P parameters) and kernel 1 writes them: at least
G·P·4 bytes at HBM's 3.35 TB/s each (AlexNet-small's 75 MB do not stay in the 50 MB L2). Kernels 2
and 3 take no less than the shortest kernel measured (2.5 µs, low end); at the high end every kernel
costs issue 22's calibrated KERNEL_FLOOR of 5 µs on top of its work, as ``predict_step`` charges it.
A CUDA graph replays each of the 3 kernels at 1 µs (MEASURED, ``benchmarks/results/probes-*``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from kernels.fused_net_table import CHANNEL_TILE, DENSE, FILTER_TILE, LANES, POSITIONS, TAP_TILE, THREADS

CLOCK_HZ = 1.98e9                    # H100 SXM boost clock
SCHEDULERS = 4                       # an SM's warp schedulers: at most 4 instructions issued a cycle
WARP = 32
ISSUE_WARPS = 22.6                   # issue 22's calibration (cnn/bench/predict_step.CALIBRATED): see above
MEMORY_LATENCY_US = 0.654            # the same calibration: one round trip to memory, load to use
KERNEL_FLOOR_US = 5.0                # the same calibration: what a kernel costs beyond its work
SHORTEST_KERNEL_US = 2.5             # the shortest kernel Nsight Compute measured on the H100 (issue 22)
L2_LATENCY_CYCLES = 281              # markdewing/AI_kernels latency/README.md (GH200: an H100 die)
BARRIER_CYCLES = 40
HBM_BYTES_PER_S = 3.35e12
GRAPH_REPLAY_US = 1.0                # MEASURED: a graph replays a kernel in 1 µs


class Ends(NamedTuple):
    """The two ends of the prediction's range."""

    cycles_a_warp: float             # a warp alone: cycles an instruction
    latency_cycles: float            # one round trip to global memory
    conflicts: float                 # wavefronts a forward tile's input load takes
    floor_us: float                  # what kernels 2 and 3 cost at least (low) / every kernel adds (high)


LOW = Ends(2.0, L2_LATENCY_CYCLES, 1.0, SHORTEST_KERNEL_US)
HIGH = Ends(ISSUE_WARPS / SCHEDULERS, MEMORY_LATENCY_US * 1e-6 * CLOCK_HZ, 2.0, KERNEL_FLOOR_US)

#: instructions one inner-loop iteration executes, and its shared-memory loads (SASS, sm_90, this commit)
PER_ITERATION = {
    "forward tap": (208 / 4, 48 / 4),     # accumulate_tile: one tap, 4 positions × 8 filters = 32 FFMA (unrolled 4)
    "weight window": (77 / 2, 20 / 2),    # weight_gradient: one pooling window, 8 taps = 8 FFMA (unrolled 2)
    "dx window": (84 / 2, 20 / 2),        # accumulate_input_gradient: a winner whose filter covers the pixel
    "dx window missed": (22, 2),          # … and one that does not (its gradient and switch read, the test)
    "bias window": (44 / 16, 1),          # bias_gradient (unrolled 16)
    "dense multiply-add": (65 / 16, 1),   # dense_forward's lane loop (unrolled 16)
    "dense lane sum": (82, 32),           # dense_forward: one output's 32 lane sums added
    "dense dW": (16, 2),                  # dense_backward: one weight of one sample, and its store
    "dense dx": (90 / 16, 1),             # dense_backward: one output of dL/dx's sum (unrolled 16)
    "forward piece": (300 / 4, 0),        # stage_rows in a forward step: 32 weights a warp (a batch holds 4)
    "backward piece": (120 / 4, 0),       # stage_rows for dL/dx
    "gathered float": (209 / 4, 0),       # load_samples (a batch holds 4)
    "zeroed word": (45 / 4, 0),
    "reduced slice": (6, 1),              # reduce_slices: one slice of one window position
    "pooled position": (30, 1),           # reduce_slices / pool_forward: a window position compared
}
#: instructions of an item outside its inner loops (probe kernels' static counts: an upper bound)
PER_ITEM = {
    "conv item": 200,                     # conv_geometry and the clearing of 32 sums
    "conv step": 400,                     # accumulate_step: the item decoded again, its offsets, the tap loop's tail
    "pool tile": 500,                     # pool_tile: bias, 8 filters × 4 positions, 8 outputs and switches
    "store tile": 150,                    # store_tile: 32 sums to the scratch
    "reduce item": 350,
    "dW item": 300,                       # decode, the first window's place, 8 partial sums stored
    "db item": 60,
    "dx item": 1000,                      # decode, the windows that may cover the pixel, 8 gated stores
    "dense lane": 40,
    "dense dx item": 40,
    "pool item": 120,
    "routed item": 200,
    "loss": 600,                          # softmax_loss for 10 classes: max, exp, log, the gradient
}


class Phase(NamedTuple):
    name: str
    warps: list                        # instructions of each warp
    shared: float                      # shared-memory wavefronts (loads)
    trips: float                       # global round trips its busiest warp waits for
    barriers: int


def warp_instructions(costs, threads: int) -> list:
    """Thread t takes items t, t + T, …: each warp's instructions, a round costing its costliest lane."""
    costs = list(costs)
    warps = [0.0] * (threads // WARP)
    for first in range(0, len(costs), threads):
        chunk = costs[first:first + threads]
        for w in range(0, len(chunk), WARP):
            warps[w // WARP] += max(chunk[w:w + WARP])
    return warps


def phase(name, costs, threads, shared_per_item=0.0, trips=0.0, barriers=1) -> Phase:
    costs = list(costs)
    return Phase(name, warp_instructions(costs, threads), shared_per_item * len(costs) / WARP, trips, barriers)


def phase_cycles(p: Phase, ends: Ends) -> float:
    busiest = max(p.warps, default=0.0)
    issue = sum(p.warps) / SCHEDULERS
    return (max(issue, busiest * ends.cycles_a_warp, p.shared) + p.trips * ends.latency_cycles
            + p.barriers * BARRIER_CYCLES)


def phase_us(p: Phase, ends: Ends) -> float:
    return phase_cycles(p, ends) / CLOCK_HZ * 1e6


# -- the phases of each kind of row -----------------------------------------------------------------------------
def staging(name, rows, length, threads, steps, piece="forward piece") -> list[Phase]:
    """``steps`` copies of ``rows`` rows of ``length`` weights each into shared memory (stage_rows)."""
    warps = threads // WARP
    pieces = math.ceil(rows / warps) * math.ceil(length / WARP)
    batches = math.ceil(pieces / 4)
    cost = [PER_ITERATION[piece][0] * 4 * batches] * threads
    return [phase(f"{name} staging", cost, threads, trips=batches, barriers=2 if steps > 1 else 1)] * steps


def conv_forward(row: dict, n: int, threads: int, position: int) -> list[Phase]:
    slices, kernel = row["SLICES"], row["K"]
    groups = math.ceil(row["POOL"] ** 2 / POSITIONS)
    windows = row["HO"] * row["WO"]
    items = n * slices * math.ceil(row["F"] / FILTER_TILE) * groups * windows
    rows_total = row["C"] * kernel
    steps = rows_total // slices // row["STEP_ROWS"]
    split = slices > 1 or groups > 1
    name = f"row {position} forward (conv)"
    tap, tap_loads = PER_ITERATION["forward tap"]
    step_cost = PER_ITEM["conv step"] + row["STEP_ROWS"] * kernel * tap
    finish = PER_ITEM["store tile"] if split else PER_ITEM["pool tile"]
    stage = staging(name, slices * row["F"], row["STEP_ROWS"] * kernel, threads, steps)
    phases = []
    if steps == 1:
        phases += stage
        phases.append(phase(name, [PER_ITEM["conv item"] + step_cost + finish] * items, threads,
                            shared_per_item=tap_loads * row["STEP_ROWS"] * kernel, trips=0 if split else 1))
    else:
        for first in range(0, items, threads):
            active = min(threads, items - first)
            for step in range(steps):
                phases += stage[:1]
                cost = step_cost + (PER_ITEM["conv item"] if step == 0 else 0) + (finish if step == steps - 1 else 0)
                phases.append(phase(name, [cost] * active, threads, shared_per_item=tap_loads * row["STEP_ROWS"]
                                    * kernel, trips=int(step == steps - 1 and not split), barriers=0))
    if split:
        positions = row["POOL"] ** 2
        reduce = PER_ITEM["reduce item"] + positions * (slices * PER_ITERATION["reduced slice"][0]
                                                        + PER_ITERATION["pooled position"][0])
        phases.append(phase(f"row {position} forward (adding {slices} slices)", [reduce] * (n * row["F"] * windows),
                            threads, shared_per_item=positions * slices, trips=1))
    return phases


def windows_over(position: int, kernel: int, stride: int, count: int) -> range:
    """The outputs i < count whose window [i·stride, i·stride + kernel) holds ``position`` (kernels.launch.covering_windows)."""
    first = 0 if position < kernel else (position - kernel) // stride + 1
    return range(first, min(count - 1, position // stride) + 1)


def covering(row: dict) -> tuple[float, float]:
    """Per input pixel, on average: the pooling windows dL/dx checks (as ``conv_input_gradients`` finds them), and
    how many of them have a winner whose filter lies over the pixel (the winner anywhere in its window, each
    position equally likely)."""
    kernel, stride, pad, size, step = row["K"], row["STRIDE"], row["PAD"], row["POOL"], row["PSTRIDE"]
    checked = hit = 0.0
    for y in range(row["H"]):
        for x in range(row["W"]):
            rows, columns = windows_over(y + pad, kernel, stride, row["HC"]), windows_over(x + pad, kernel, stride,
                                                                                           row["WC"])
            if not rows or not columns:
                continue
            for i in range(windows_over(rows[0], size, step, row["HO"])[0], windows_over(rows[-1], size, step,
                                                                                         row["HO"])[-1] + 1):
                for j in range(windows_over(columns[0], size, step, row["WO"])[0],
                               windows_over(columns[-1], size, step, row["WO"])[-1] + 1):
                    checked += 1
                    hit += sum(i * step + a in rows and j * step + b in columns
                               for a in range(size) for b in range(size)) / size ** 2
    pixels = row["H"] * row["W"]
    return checked / pixels, hit / pixels


def conv_backward(row: dict, n: int, threads: int, position: int, need_dx: bool) -> list[Phase]:
    filters, channels, kernel = row["F"], row["C"], row["K"]
    tiles = math.ceil(channels / CHANNEL_TILE)
    windows = row["HO"] * row["WO"]
    name = f"row {position} backward (conv)"
    window, window_loads = PER_ITERATION["weight window"]
    parts = row["DW_PARTS"]
    weights = [PER_ITEM["dW item"] + n * math.ceil(windows / parts) * window] * (parts * filters * channels * kernel
                                                                                 * math.ceil(kernel / TAP_TILE))
    biases = [PER_ITEM["db item"] + n * windows * PER_ITERATION["bias window"][0]] * filters
    dx_steps = filters // row["DX_FILTERS"] if need_dx else 0
    staged = 0.0
    if dx_steps == 1:                                     # staged by every thread beside the dW items
        pieces = math.ceil(filters * channels / (threads // WARP)) * math.ceil(kernel * kernel / WARP)
        staged = PER_ITERATION["backward piece"][0] * 4 * math.ceil(pieces / 4)
    first = phase(f"{name}: dW, db", [cost + staged / max(1, math.ceil((len(weights) + filters) / threads))
                                     for cost in weights + biases], threads,
                  shared_per_item=window_loads * n * windows / parts, trips=1 if dx_steps == 1 else 0)
    phases = [first]
    if parts > 1:
        phases.append(phase(f"{name}: dW, adding {parts} parts", [PER_ITEM["db item"] + parts * 3]
                            * (filters * channels * kernel * kernel), threads, shared_per_item=parts))
    if need_dx:
        checked, hit = covering(row)
        per_filter = hit * PER_ITERATION["dx window"][0] + (checked - hit) * PER_ITERATION["dx window missed"][0]
        loads = hit * PER_ITERATION["dx window"][1] + (checked - hit) * PER_ITERATION["dx window missed"][1]
        items = n * tiles * row["H"] * row["W"]
        if dx_steps == 1:
            phases.append(phase(f"{name}: dL/dx", [PER_ITEM["dx item"] + filters * per_filter] * items, threads,
                                shared_per_item=filters * loads))
        else:
            stage = staging(name, row["DX_FILTERS"] * channels, kernel * kernel, threads, 1, "backward piece")[0]
            for first_item in range(0, items, threads):
                active = min(threads, items - first_item)
                for step in range(dx_steps):
                    phases.append(stage)
                    cost = row["DX_FILTERS"] * per_filter + (PER_ITEM["dx item"] if step == 0 else 0)
                    phases.append(phase(f"{name}: dL/dx", [cost] * active, threads,
                                        shared_per_item=row["DX_FILTERS"] * loads, barriers=0))
    return phases


def pool_phases(row: dict, n: int, threads: int, position: int, need_dx: bool) -> tuple[list, list]:
    outputs = n * row["F"] * row["HO"] * row["WO"]
    forward = [phase(f"row {position} forward (pool)", [PER_ITEM["pool item"] + row["POOL"] ** 2
                                                         * PER_ITERATION["pooled position"][0]] * outputs, threads)]
    inputs = n * row["C"] * row["H"] * row["W"] if need_dx else 0
    backward = [phase(f"row {position} backward (pool)", [PER_ITEM["routed item"]] * inputs, threads)]
    return forward, backward


def dense_phases(row: dict, n: int, threads: int, position: int, need_dx: bool) -> tuple[list, list]:
    inputs, outputs = row["C"], row["F"]
    name = f"row {position} {{}} (dense)"
    per_lane = math.ceil(inputs / LANES)
    lanes = phase(name.format("forward"), [PER_ITEM["dense lane"] + per_lane * PER_ITERATION["dense multiply-add"][0]]
                  * (n * outputs * LANES), threads, shared_per_item=per_lane, trips=math.ceil(per_lane / 16))
    sums = phase(name.format("forward"), [PER_ITERATION["dense lane sum"][0]] * (n * outputs), threads,
                 shared_per_item=LANES, trips=1)
    weights = [n * PER_ITERATION["dense dW"][0]] * (inputs * outputs)
    data = [PER_ITEM["dense dx item"] + outputs * PER_ITERATION["dense dx"][0]] * (n * inputs if need_dx else 0)
    backward = phase(name.format("backward"), [n * 4.0] * outputs + weights + data, threads,
                     shared_per_item=2 * n, trips=math.ceil(outputs / 16) if need_dx else 0)
    return [lanes, sums], [backward]


def block_phases(builder, samples: int, threads: int = THREADS, plan=None) -> list[Phase]:
    """Kernel 1's phases for one block of ``samples`` samples, in the order they run (``plan``: the table the
    stage would run, ``builder.plan(samples, H100 limit)`` by default)."""
    from kernels.fused_net_table import _FIELD_NAMES

    table = (plan or builder.plan(samples, 227 * 1024)).table
    rows = [dict(zip(_FIELD_NAMES, map(int, fields))) for fields in table[1:]]
    size = math.prod(builder.input_shape)
    padded = builder.input_words() + sum(row["F"] * (row["HO"] + 2 * row["OPAD"]) * (row["WO"] + 2 * row["OPAD"])
                                         for row in rows if row["OPAD"])
    batches = math.ceil(size / (threads * 4))
    forward = [phase("zero borders", [PER_ITERATION["zeroed word"][0] * math.ceil(samples * padded / threads)]
                     * threads, threads),
               phase("gather", [PER_ITERATION["gathered float"][0] * 4 * batches * samples] * threads, threads,
                     trips=samples * (batches + 1))]
    backward = []
    for position, row in enumerate(rows):
        need_dx = position > 0
        if row["KIND"] == DENSE:
            ahead, back = dense_phases(row, samples, threads, position, need_dx)
        elif row["K"]:
            ahead, back = conv_forward(row, samples, threads, position), conv_backward(row, samples, threads,
                                                                                       position, need_dx)
        else:
            ahead, back = pool_phases(row, samples, threads, position, need_dx)
        forward += ahead
        backward = back + backward
    loss = phase("loss", [PER_ITEM["loss"]] * samples, threads, barriers=1)
    return forward + [loss] + backward


class Prediction(NamedTuple):
    kernel_1_us: tuple[float, float]  # (low, high)
    sum_sgd_us: tuple[float, float]
    finish_us: tuple[float, float]
    graph_us: float

    @property
    def step_ms(self) -> tuple[float, float]:
        return tuple((self.kernel_1_us[k] + self.sum_sgd_us[k] + self.finish_us[k] + self.graph_us) / 1e3
                     for k in (0, 1))


def predict(builder, parameters: int, batch: int, samples: int, threads: int = THREADS, sms: int = 132) -> Prediction:
    """The PREDICTED H100 time of one training step (steps back to back, one graph a step)."""
    groups = math.ceil(batch / samples)
    waves = math.ceil(groups / sms)
    phases = block_phases(builder, samples, threads)
    partials_us = groups * parameters * 4 / HBM_BYTES_PER_S * 1e6
    kernel_1, sum_sgd, finish = [], [], []
    for ends in (LOW, HIGH):
        work = waves * sum(phase_us(p, ends) for p in phases)
        sgd = partials_us + parameters * 4 * 4 / HBM_BYTES_PER_S * 1e6      # the partials, then w, v, grad, w
        if ends is LOW:
            kernel_1.append(max(work, partials_us))
            sum_sgd.append(max(sgd, ends.floor_us))
            finish.append(ends.floor_us)
        else:
            kernel_1.append(max(work, partials_us) + ends.floor_us)
            sum_sgd.append(sgd + ends.floor_us)
            finish.append(ends.floor_us)
    return Prediction(tuple(kernel_1), tuple(sum_sgd), tuple(finish), 3 * GRAPH_REPLAY_US)
