"""Stage 3's forward paths for a conv + ReLU + 2 × 2 max-pool, each checked against the planes and timed on a
layer's shape, one thread: the planes (``conv_pool._plane_forward``), a pooling window at a time
(``conv_patches.window_forward``) and Winograd's F(2 × 2, 5 × 5) (``winograd.winograd_forward``).

    python benchmarks/conv_forward_paths.py [--repeats 20] [--samples 8]

The stage picks one path per layer (``conv_pool._conv_block_forward_chunk``); this times them all, as llm.c's
dev/cuda files time their kernel versions, the paths taking turns a call each. Every call takes ``--samples`` samples (8: a block of stage 3's
network schedule); transforming the weights for Winograd, which the stage does once a step, is timed apart
(``+ weights``). Prints, per layer, each path's median time and its speed against the planes (above 1:
faster), and each path's largest difference from the planes (relative to their largest output).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kernels.cpu import thread_pool  # noqa: F401  (stage 3's OpenMP settings, before Numba's threads start)
from kernels.cpu.conv_pool import _plane_forward, conv_items
from kernels.cpu.conv_patches import window_forward
from kernels.cpu.winograd import tile_blocks, weights_shape, winograd_forward, winograd_weights

LAYERS = {                                   # C, H = W, F; 5 × 5 filters, pad 2, ReLU, 2 × 2 pool every 2
    "AlexNet-small conv 2": (32, 16, 32),
    "AlexNet-small conv 3": (32, 8, 64),
}


def _median_ms(call, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def time_paths(channels, size, filters, samples, repeats, rng):
    """{path: (median ms, largest difference from the planes)} for one layer, and the weight transform's ms."""
    x = rng.normal(size=(samples, channels, size, size)).astype(np.float32)
    W = (rng.normal(size=(filters, channels, 5, 5)) / np.sqrt(25 * channels)).astype(np.float32)
    b = rng.normal(size=filters).astype(np.float32)
    shape = (samples, filters, size // 2, size // 2)
    U = np.zeros(weights_shape(filters, channels), np.float32)
    plane_items = conv_items(x, W, 1, 2, 0, 0, False)      # asked without pooling: the planes' work items
    paths = {
        "planes": lambda out, switch: _plane_forward(x, W, b, 1, 2, True, 2, 2, out, switch, 0, plane_items),
        "windows": lambda out, switch: window_forward(x, W, b, 2, True, out, switch, 0, samples),
        "winograd": lambda out, switch: winograd_forward(x, U, b, 2, True, out, switch, 0, tile_blocks(x, 2)),
    }
    winograd_weights(W, U)
    outputs = {name: np.empty(shape, np.float32) for name in paths}
    switch = np.empty(shape, np.int64)
    times = {name: [] for name in paths}
    for name, path in paths.items():
        path(outputs[name], switch)
    for _ in range(repeats):                       # the paths take turns, a call each
        for name, path in paths.items():
            start = time.perf_counter()
            path(outputs[name], switch)
            times[name].append(time.perf_counter() - start)
    results = {name: 1e3 * float(np.median(values)) for name, values in times.items()}
    weights_ms = _median_ms(lambda: winograd_weights(W, U), repeats)
    scale = np.abs(outputs["planes"]).max()
    return {name: (results[name], float(np.abs(outputs[name] - outputs["planes"]).max() / scale))
            for name in paths}, weights_ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls of each path (default 20)")
    parser.add_argument("--samples", type=int, default=8, help="samples a call (default 8: stage 3's block)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.samples < 1:
        parser.error("--repeats and --samples must be at least 1")
    import numba
    numba.set_num_threads(1)
    rng = np.random.default_rng()
    print(f"{'layer':<22} {'path':<9} {'ms':>7} {'x planes':>8} {'max rel diff':>12}")
    for layer, (channels, size, filters) in LAYERS.items():
        paths, weights_ms = time_paths(channels, size, filters, args.samples, args.repeats, rng)
        planes_ms = paths["planes"][0]
        for name, (ms, difference) in paths.items():
            print(f"{layer:<22} {name:<9} {ms:7.3f} {planes_ms / ms:8.2f} {difference:12.1e}")
        print(f"{layer:<22} {'+ weights':<9} {weights_ms:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
