"""Time assignment 10's solution kernels on a GPU and write the times, with the device, to a results file.

    python assignments/instructor/time_a10.py --out benchmarks/results/a10-tiled-dense-<gpu>-<date>.json
    sh benchmarks/gpu_session.sh a10          # the same, in a GPU session

The kernels are the instructor's solutions, read from the source notebook (assignments/source/
a10_tiled_dense): the untiled kernel, the tiled one, the register-blocked one — and two variants of the
register-blocked kernel the notebook warns about: its W tile's rows not padded (PADDED = WIDE: every
store of a warp in one shared-memory bank) and its four sums in a ``cuda.local.array`` instead of four
variables (local memory, off-chip). Each is checked against float64 numpy first, then timed on a
SIZE × SIZE by SIZE × SIZE product with CUDA events: ``--repeats`` launches between two events make one
sample, and the kernels take turns for ``--rounds`` rounds, so a slow moment of the machine falls on all
of them. The file holds every sample and min–median–max per kernel, in ms per launch.

Without a GPU it refuses, unless ``--simulator`` (a tiny product in Numba's CUDA simulator, which proves
the command works; its times mean nothing and the file says ``"simulated": true``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE.parent / "source" / "a10_tiled_dense" / "a10_tiled_dense.ipynb"

LOCAL_ARRAY_SUMS = '''
@cuda.jit
def dense_blocked_local_array_kernel(x, w, b, y):
    """The register-blocked kernel with its four sums in a cuda.local.array instead of four variables."""
    x_tile = cuda.shared.array((TILE, TILE), np.float32)
    w_tile = cuda.shared.array((TILE, PADDED), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    row, first = cuda.blockIdx.y * TILE + ty, cuda.blockIdx.x * WIDE
    samples, inputs, outputs = x.shape[0], x.shape[1], w.shape[0]
    sums = cuda.local.array(REGISTERS, np.float32)
    for r in range(REGISTERS):
        sums[r] = np.float32(0.0)
    for start in range(0, inputs, TILE):
        k = start + tx
        x_tile[ty, tx] = x[row, k] if row < samples and k < inputs else np.float32(0.0)
        for r in range(REGISTERS):
            w_row = first + ty + r * TILE
            w_tile[tx, ty + r * TILE] = w[w_row, k] if w_row < outputs and k < inputs else np.float32(0.0)
        cuda.syncthreads()
        for kk in range(TILE):
            value = x_tile[ty, kk]
            for r in range(REGISTERS):
                sums[r] += value * w_tile[kk, tx + r * TILE]
        cuda.syncthreads()
    for r in range(REGISTERS):
        col = first + tx + r * TILE
        if row < samples and col < outputs:
            y[row, col] = sums[r] + b[col]
'''


def kernels(namespace: dict) -> dict:
    """{name: (kernel, columns a block computes)}: the notebook's solutions and the two variants."""
    # The notebook read as plain JSON (nbformat 4: a cell's source is a list of lines), so that a GPU machine
    # without the Jupyter packages can run this script.
    notebook = json.loads(NOTEBOOK.read_text())
    cells = {cell["metadata"].get("nbgrader", {}).get("grade_id"): "".join(cell["source"])
             for cell in notebook["cells"]}
    exec(cells["untiled"].split("\nuntiled = ")[0], namespace)
    exec(cells["tiled_kernel"], namespace)
    exec(cells["blocked_kernel"], namespace)
    unpadded = cells["blocked_kernel"].replace("(TILE, PADDED)", "(TILE, WIDE)").replace(
        "def dense_blocked_kernel", "def dense_blocked_unpadded_kernel")
    assert unpadded.count("(TILE, WIDE)") == 1, "the blocked kernel no longer declares its W tile (TILE, PADDED)"
    exec(unpadded, namespace)
    exec(LOCAL_ARRAY_SUMS, namespace)
    tile, wide = namespace["TILE"], namespace["WIDE"]
    return {"untiled": (namespace["dense_untiled_kernel"], tile), "tiled": (namespace["dense_tiled_kernel"], tile),
            "register-blocked": (namespace["dense_blocked_kernel"], wide),
            "register-blocked, W tile rows unpadded": (namespace["dense_blocked_unpadded_kernel"], wide),
            "register-blocked, sums in cuda.local.array": (namespace["dense_blocked_local_array_kernel"], wide)}


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1], "samples": samples}


def measure(size: int, repeats: int, rounds: int) -> dict:
    import numpy as np

    from cnn.grading.assignments.a10_tiled_dense import PADDED, REGISTERS, TILE, WIDE
    from kernels.device import cuda, simulated

    namespace = {"cuda": cuda, "np": np, "TILE": TILE, "REGISTERS": REGISTERS, "WIDE": WIDE, "PADDED": PADDED}
    chosen = kernels(namespace)
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(shape).astype(np.float32) for shape in ((size, size), (size, size), (size,)))
    expected = x.astype(np.float64) @ w.astype(np.float64).T + b
    devices = [cuda.to_device(array) for array in (x, w, b)]
    y = cuda.device_array((size, size), np.float32)

    def launch(kernel, columns):
        grid = (-(-size // columns), -(-size // TILE))
        kernel[grid, (TILE, TILE)](*devices, y)

    for name, (kernel, columns) in chosen.items():            # right before timed; compiled by the first launch
        launch(kernel, columns)
        error = np.abs(y.copy_to_host() - expected).max() / np.abs(expected).max()
        if not error < 1e-4:
            raise SystemExit(f"time_a10: the {name} kernel is wrong (relative error {error:.1e}); nothing timed")
    samples = {name: [] for name in chosen}
    start, end = cuda.event(), cuda.event()
    for _ in range(rounds):
        for name, (kernel, columns) in chosen.items():
            start.record()
            for _ in range(repeats):
                launch(kernel, columns)
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / repeats)
    device = "Numba's CUDA simulator" if simulated() else cuda.get_current_device().name
    device = device.decode() if isinstance(device, bytes) else device
    return {"device": device, "simulated": simulated(), "date": datetime.date.today().isoformat(),
            "product": f"({size}, {size}) · ({size}, {size})ᵀ, float32", "tile": TILE, "registers": REGISTERS,
            "repeats_per_sample": repeats, "rounds": rounds, "unit": "ms per launch",
            "kernels": {name: None if simulated() else summary(times) for name, times in samples.items()},
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the results file to write (JSON)")
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10, help="launches per sample")
    parser.add_argument("--rounds", type=int, default=5, help="samples per kernel, the kernels taking turns")
    parser.add_argument("--simulator", action="store_true", help="run a tiny product in the CUDA simulator")
    args = parser.parse_args(argv)
    if args.simulator:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    from kernels.device import gpu_unavailable_reason, simulated

    if simulated() and not args.simulator:
        print("time_a10: no GPU here (the CUDA simulator is on); a simulated time means nothing — "
              "run it on a GPU, or pass --simulator to check the command on a tiny product", file=sys.stderr)
        return 2
    reason = gpu_unavailable_reason()
    if reason:
        print(f"time_a10: {reason}", file=sys.stderr)
        return 2
    from cnn.atomic import replaced_on_success

    record = measure(args.size, args.repeats, args.rounds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with replaced_on_success(out) as temporary:
        temporary.write_text(json.dumps(record, indent=1) + "\n")
    for name, times in record["kernels"].items():
        shown = f"{times['min']:9.3f} {times['median']:9.3f} {times['max']:9.3f} ms (min, median, max)" if times else "checked"
        print(f"{name:<44} {shown}")
    print(f"time_a10: {record['device']}, written to {out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    sys.exit(main())
