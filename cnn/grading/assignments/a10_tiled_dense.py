"""Assignment 10's tests: the dense layer y = x Wᵀ + b as a tiled and a register-blocked CUDA kernel.

Values: each kernel launched on blocks of TILE × TILE threads, y pre-filled with NaN, compared with stage 1
in float64 (tolerance 1e-5, float32 arithmetic). Speed: the memory traffic, counted by running the
kernel's Python source on the product of whole tiles SAMPLES × INPUTS · (INPUTS × OUTPUTS)ᵀ
(``cnn.grading.traffic.count_cuda``). The limits are computed here from the shapes — the untiled kernel
reads K numbers of x and K of W per output — and never from anything in the notebook. A counted run
must compute the right y and read every input at least once; a kernel that inspects its arguments is
refused. The shared-memory family needs a kernel that keeps its operands in shared tiles at all: one
that reads none scores nothing there.

``TILE``, ``REGISTERS``, ``WIDE`` and ``PADDED`` are the sizes the notebook's kernels are written for and
the tests launch them with (TILE is 8 in the simulator, 16 on a GPU).
"""

from functools import partial

import numpy as np

from cnn.grading.bytecode import python_function
from cnn.grading.family import Case, Family, Verdict, close, normal
from cnn.grading.runners import once_per_answer
from cnn.grading.traffic import compiled_code_problems, count_cuda
from cnn.stages import s1_loops
from kernels.device import cuda, simulated

REGISTERS = 4                 # part 2: the outputs each thread computes


def tile_size() -> int:
    return 8 if simulated() else 16


def __getattr__(name):        # the sizes depend on where the kernels run, asked only in the kernel
    sizes = {"TILE": tile_size, "WIDE": lambda: tile_size() * REGISTERS, "PADDED": lambda: tile_size() * REGISTERS + 1}
    if name in sizes:
        return sizes[name]()
    raise AttributeError(name)


def blocks(count: int, per_block: int) -> int:
    return -(-count // per_block)


def _tile(config) -> int:
    tile = config.get("tile")
    if tile not in (8, 16):
        raise ValueError(f"TILE is {tile!r}: the tests launch blocks of 8 × 8 threads in the simulator, 16 × 16 on a GPU")
    return tile


def _product(rng, samples: int, inputs: int, outputs: int):
    """float32 x, W, b of one product, and y = x Wᵀ + b computed by stage 1 in float64."""
    x, w, b = (normal(rng, samples, inputs, dtype=np.float32), normal(rng, outputs, inputs, dtype=np.float32),
               normal(rng, outputs, dtype=np.float32))
    return x, w, b, s1_loops.dense_forward(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64))


def _dense_case(product, tile, columns, judges=()):
    x, w, b, expected = product
    (samples, inputs), outputs = x.shape, w.shape[0]
    what = f"y, x ({samples}, {inputs}) · Wᵀ ({inputs}, {outputs})"
    launch = {"grid": (blocks(outputs, columns), blocks(samples, tile)), "threads": (tile, tile)}
    return Case(what, {"args": [x, w, b, np.full(expected.shape, np.nan, np.float32)], **launch},
                [*judges[:1], close("y", expected, 1e-5, what), *judges[1:]])


# -- values -------------------------------------------------------------------------------------------------

def value_cases(rng, config, memory, blocked: bool, ragged: bool):
    """Whole tiles, or shapes that are not multiples of TILE (partial tiles at the edges, K < TILE, a batch of 1)."""
    tile = _tile(config)
    wide = tile * REGISTERS
    shapes = {(False, False): [(tile, tile, tile), (2 * tile, 4 * tile, tile), (tile, 2 * tile, 2 * tile)],
              (True, False): [(tile, tile, wide), (2 * tile, 4 * tile, 2 * wide), (tile, 2 * tile, wide)],
              (False, True): [(5, 13, 7), (1, 3, 2), (tile + 3, 2 * tile + 1, tile - 1)],
              (True, True): [(5, 13, 7), (1, 3, 2), (tile + 3, 2 * tile + 1, wide + 5)]}[blocked, ragged]
    for samples, inputs, outputs in shapes:
        yield _dense_case(_product(rng, samples, inputs, outputs), tile, wide if blocked else tile)


def run_launch(inputs, kernel, *others):
    args = [cuda.to_device(value) for value in inputs["args"]]
    kernel[tuple(inputs["grid"]), tuple(inputs["threads"])](*args)
    return {"y": args[3].copy_to_host()}


# -- traffic --------------------------------------------------------------------------------------------------

def refused(outputs):
    problems = outputs.get("refused") or []
    return Verdict(not problems, message=problems[0] if problems else "")


def read_every_input(outputs):
    """A correct product reads every number of x and of W at least once: fewer means reads the counter missed."""
    for name in ("x", "w"):
        reads, size = int(outputs.get(f"loads_{name}", 0)), int(outputs.get(f"size_{name}", 0))
        if reads < size:
            return Verdict(False, message=f"{outputs.get('kernel')}: the counter saw {reads} reads of {name}, whose {size} "
                                          f"numbers any correct kernel reads at least once: it read {name} around the "
                                          f"counter — refused")
    return Verdict(True)


def global_reads(name: str, shared_by: int, tile: int):
    """Global reads of ``name`` per output: at most 1.25 / ``shared_by`` of the untiled kernel's K."""
    inputs, outputs_per = 4 * tile, 2 * tile * tile * REGISTERS

    def judge(outputs):
        reads, allowed = int(outputs.get(f"loads_{name}", 0)) / outputs_per, 1.25 * inputs / shared_by
        kernel = outputs.get("kernel")
        line = (f"{kernel}: {reads:.2f} global reads of {name} per output; untiled {inputs:.2f}; allowed {allowed:.2f} "
                f"(each number copied into a tile serves {shared_by} outputs)")
        return Verdict(reads <= allowed, line, f"{kernel} reads {name} {reads:.2f} times per output from global memory, "
                                               f"the untiled kernel {inputs:.2f}: each thread should copy one element of "
                                               f"the {name} tile per step into shared memory and read the rest of the "
                                               f"tile from there (at most {allowed:.2f} global reads per output)")
    return judge


def y_written_once(tile: int):
    output_elements = 2 * tile * tile * REGISTERS

    def judge(outputs):
        stores, loads = int(outputs.get("stores_y", 0)) / output_elements, int(outputs.get("loads_y", 0)) / output_elements
        line = f"y: {stores:.2f} writes and {loads:.2f} reads per output; b: {int(outputs.get('loads_b', 0)) / output_elements:.2f} reads"
        if stores != 1 or loads != 0:
            return Verdict(False, line, f"{outputs.get('kernel')} writes y {stores:g} times and reads it {loads:g} times per "
                                        f"output: sum in a local variable (a register) and write each output once, at the end")
        return Verdict(int(outputs.get("loads_b", 0)) <= output_elements, line, "read each bias once per output at most")
    return judge


def shared_reads(tile: int):
    """Register blocking: operands from shared tiles, (1 + REGISTERS) / REGISTERS shared reads per multiply-add."""
    multiply_adds = 2 * tile * tile * REGISTERS * 4 * tile

    def judge(outputs):
        kernel, loads = outputs.get("kernel"), int(outputs.get("shared_loads", 0))
        if loads == 0 or int(outputs.get("shared_stores", 0)) == 0:
            return Verdict(False, message=f"{kernel} reads shared memory 0 times: it keeps no tile in shared memory, so "
                                          f"there is nothing for register blocking to save — copy the x and W tiles "
                                          f"into shared memory first (part 1), then reuse each x value from a register")
        per_multiply_add, allowed = loads / multiply_adds, 1.05 * (1 + REGISTERS) / REGISTERS
        line = (f"shared-memory reads per multiply-add: yours {per_multiply_add:.2f}; allowed {allowed:.2f} = "
                f"(1 + REGISTERS) / REGISTERS, with 5 % to spare (plain tiling reads 2)")
        return Verdict(per_multiply_add <= allowed, line,
                       f"{kernel} reads shared memory {per_multiply_add:.2f} times per multiply-add: read x_tile[ty, k] once "
                       f"into a local variable and use it for all {REGISTERS} outputs ({(1 + REGISTERS) / REGISTERS:.2f} "
                       f"reads per multiply-add)")
    return judge


def traffic_cases(rng, config, memory, blocked: bool, judges):
    """The product whose traffic is graded, made of whole tiles: 2·TILE samples, 4·TILE inputs, WIDE outputs —
    one per kernel and per kernel's session, so that its families judge one counted run."""
    tile = _tile(config)
    key = ("traffic", blocked, tile)
    if key not in memory:
        memory[key] = _product(rng, 2 * tile, 4 * tile, tile * REGISTERS)
    yield _dense_case(memory[key], tile, tile * REGISTERS if blocked else tile,
                      judges=[refused, read_every_input, *(judge(tile) for judge in judges)])


@once_per_answer
def run_counted(inputs, kernel, *others):
    """The kernel run from its Python source on counting arrays: its y, its counts, and any refusal."""
    x, w, b, y = inputs["args"]
    name = python_function(kernel).__name__
    problems = compiled_code_problems(kernel)
    if problems:
        return {"kernel": name, "refused": problems, "y": y}
    traffic = count_cuda(kernel, tuple(inputs["grid"]), tuple(inputs["threads"]), x, w, b, y)
    counts = {f"{kind}_{array}": getattr(traffic, kind)(array) for kind in ("loads", "stores") for array in "xwby"}
    return {"kernel": name, "y": y, "size_x": x.size, "size_w": w.size, "shared_loads": traffic.shared_loads(),
            "shared_stores": traffic.shared_stores(), **counts}


def _reads(name, shared_by_wide=False):
    return lambda tile: global_reads(name, tile * REGISTERS if shared_by_wide else tile, tile)


def _config(*kernels) -> dict:
    return {"tile": tile_size()}


def family(cases, run) -> Family:
    return Family(cases, run, config=_config)


FAMILIES = {
    "test_tiled_whole_tiles": family(partial(value_cases, blocked=False, ragged=False), run_launch),
    "test_tiled_ragged": family(partial(value_cases, blocked=False, ragged=True), run_launch),
    "test_tiled_reads_x": family(partial(traffic_cases, blocked=False, judges=[_reads("x")]), run_counted),
    "test_tiled_reads_w": family(partial(traffic_cases, blocked=False, judges=[_reads("w")]), run_counted),
    "test_tiled_writes_y_once": family(partial(traffic_cases, blocked=False, judges=[y_written_once]), run_counted),
    "test_blocked_whole_tiles": family(partial(value_cases, blocked=True, ragged=False), run_launch),
    "test_blocked_ragged": family(partial(value_cases, blocked=True, ragged=True), run_launch),
    "test_blocked_global_reads": family(partial(traffic_cases, blocked=True,
                                                judges=[_reads("x", True), _reads("w"), y_written_once]), run_counted),
    "test_blocked_shared_reads": family(partial(traffic_cases, blocked=True,
                                                judges=[_reads("x", True), _reads("w"), shared_reads]), run_counted),
}
