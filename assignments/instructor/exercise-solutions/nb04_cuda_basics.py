"""Notebook 04, CUDA basics: worked solutions of its three exercises (in the simulator without a GPU)."""

from __future__ import annotations

import inspect

from common import use_simulator_without_gpu

SIMULATED = use_simulator_without_gpu()      # before numba is imported

import numpy as np  # noqa: E402

from kernels import launch  # noqa: E402
from kernels.bias_relu import relu_forward_kernel  # noqa: E402
from kernels.device import cuda  # noqa: E402


@cuda.jit
def relu_kernel(x, y):
    k = cuda.grid(1)
    if k < x.size:
        y[k] = max(x[k], np.float32(0.0))


def exercise_1(fast: bool) -> None:
    """A kernel relu_kernel(x, y) launched with grid_1d, against np.maximum; why np.float32(0.0) and not 0.0?

    Answer. `relu_kernel` above: thread k = cuda.grid(1) checks k < x.size and writes
    y[k] = max(x[k], np.float32(0.0)); `launch.grid_1d(x.size)` gives enough blocks of THREADS_PER_BLOCK
    threads for every element. It agrees exactly with np.maximum(x, 0). The literal 0.0 is a Python
    float, which Numba types as float64: max(float32, float64) is computed in float64 and converted back on
    the store. On a GPU that means double-precision instructions — on most GPUs 1/32 to 1/64 of the float32
    rate (1/2 on data-centre parts like the H100), plus two conversions per element — for a value that is
    exactly representable in float32 anyway. `np.float32(0.0)` keeps the whole expression in float32. The
    simulator runs the kernel as Python with numpy scalars and cannot show the difference: the rule has to
    be kept by reading the code (or by inspecting the PTX on a GPU: `relu_kernel.inspect_asm()`).
    """
    rng = np.random.default_rng(8)
    x = rng.standard_normal(1000 if SIMULATED else 1 << 20).astype(np.float32)
    d_y = cuda.device_array(x.size, dtype=np.float32)
    relu_kernel[launch.grid_1d(x.size)](cuda.to_device(x), d_y)
    y = d_y.copy_to_host()
    print(f"relu_kernel on {x.size} floats, grid {launch.grid_1d(x.size)}: equal to np.maximum: "
          f"{np.array_equal(y, np.maximum(x, 0))}, dtype {y.dtype}")
    assert np.array_equal(y, np.maximum(x, 0))
    library = inspect.getsource(getattr(relu_forward_kernel, "py_func", getattr(relu_forward_kernel, "fn", None)))
    print(library)
    assert "np.float32(0" in library, "the library's ReLU kernel compares with a float32 zero"


@cuda.jit
def where_am_i_2d(block_of, warp_lane_of):
    """Each thread writes, at (row y, column x) = cuda.grid(2) reversed, its block and its linear number in
    the block, threadIdx.y·blockDim.x + threadIdx.x (the order in which warps are cut)."""
    x, y = cuda.grid(2)
    if y < block_of.shape[0] and x < block_of.shape[1]:
        block_of[y, x] = cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x
        warp_lane_of[y, x] = cuda.threadIdx.y * cuda.blockDim.x + cuda.threadIdx.x


def exercise_2(fast: bool) -> None:
    """where_am_i with 2-D blocks [(2, 2), (4, 4)] and cuda.grid(2): which index should walk along a row?

    Answer. cuda.grid(2) returns (x, y) with x = blockIdx.x·blockDim.x + threadIdx.x. The hardware numbers
    the threads of a block threadIdx.x fastest (linear id = threadIdx.y·blockDim.x + threadIdx.x) and cuts
    warps of 32 consecutive linear ids, so the threads of a warp differ mostly in x. For coalesced access
    x must therefore walk along a row of a C-ordered array — index it as a[y, x], x the *last* index,
    where neighbouring elements are neighbouring addresses: the 32 threads of a warp then read 32
    consecutive floats, one or two 128-byte transactions. Written a[x, y], neighbouring threads would read
    addresses a whole row apart: one transaction per thread. The printout shows it: along a row of the 8×8
    array the linear ids of a block go 0, 1, 2, 3.
    """
    shape = (8, 8)
    block_of, lane_of = (cuda.device_array(shape, dtype=np.int32) for _ in range(2))
    where_am_i_2d[(2, 2), (4, 4)](block_of, lane_of)
    block_of, lane_of = block_of.copy_to_host(), lane_of.copy_to_host()
    print("block of each element (row y, column x):\n", block_of)
    print("linear thread number in its block:\n", lane_of)
    steps_along_rows = np.diff(lane_of[:, :4], axis=1)
    assert (steps_along_rows == 1).all(), "along a row, consecutive threads of a block"
    assert (np.diff(lane_of[:4, 0]) == 4).all(), "down a column, threads a block-width apart"


@cuda.jit
def where_am_i_unchecked(block_of, thread_of, element_of):
    k = cuda.grid(1)                         # no bounds check: threads 20..23 write past the end
    block_of[k] = cuda.blockIdx.x
    thread_of[k] = cuda.threadIdx.x
    element_of[k] = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x


def exercise_3(fast: bool) -> None:
    """where_am_i without its bounds check, on 20 elements with [3, 8]: what does the simulator say? On a GPU?

    Answer. The launch has 3·8 = 24 threads for 20 elements; threads 20–23 index past the end. The
    simulator checks every index as numpy does and stops with an IndexError naming the index ("index 20
    is out of bounds for axis 0 with size 20") in the thread <<<(2,0,0),(4,0,0)>>>. A real GPU checks
    nothing: the four stores land in whatever lies after the array — often another of your arrays, or the
    allocator's padding — so the kernel "works" and some other value is silently corrupted, or, if the
    address is unmapped, an "illegal address" error surfaces later at some unrelated synchronisation and
    leaves the CUDA context unusable. A wrong answer without an error, far from its cause, is the worst
    kind of bug, which is why every kernel starts with its bounds check (and `compute-sanitizer` exists).
    """
    arrays = [cuda.device_array(20, dtype=np.int32) for _ in range(3)]
    try:
        where_am_i_unchecked[3, 8](*arrays)
        cuda.synchronize()
        outcome = None
    except Exception as error:         # the simulator's IndexError (wrapped or not)
        outcome = error
    print(f"launch [3, 8] on 20 elements without a bounds check: {type(outcome).__name__}: {outcome}")
    if SIMULATED:
        assert outcome is not None and "out of bounds" in str(outcome)
