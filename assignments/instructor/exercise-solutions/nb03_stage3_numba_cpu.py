"""Notebook 03, stage 3 `numba-cpu`: worked solutions of its three exercises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
from numba import njit, prange

from cnn.gradcheck import rel_error
from cnn.stages import s1_loops
from common import random_array


@njit
def dot(x, y):
    total = np.float32(0)
    for k in range(x.size):
        total += x[k] * y[k]
    return total


@njit(fastmath={"reassoc"})
def dot_reassoc(x, y):
    total = np.float32(0)
    for k in range(x.size):
        total += x[k] * y[k]
    return total


def best_of(call, repeats):
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def exercise_1(fast: bool) -> None:
    """`dot` with @njit and with @njit(fastmath={"reassoc"}): time both; why are the sums not bit-identical?

    Answer. Without `reassoc` the compiler must add the products in the order the loop says,
    ((x0y0 + x1y1) + x2y2) + …: each addition waits for the previous one (a chain of a million dependent
    float adds, about 4 cycles each) and no SIMD is possible. `reassoc` allows it to treat float addition as
    associative: it keeps 8 or 16 partial sums in SIMD registers (several registers, to hide the latency),
    adds 8–16 products per instruction and combines the partial sums at the end — typically 4–10× faster
    (see the times below). Floating-point addition is not associative — every addition rounds, and which
    numbers are added to which changes the roundings — so the two sums differ in their last bits; neither
    is "the" right one (both are within float32's error of the exact float64 sum; the blocked sum is
    usually the more accurate, because each partial sum is smaller).
    """
    size = 100_000 if fast else 1_000_000
    rng = np.random.default_rng(6)
    x, y = random_array(rng, size, dtype=np.float32), random_array(rng, size, dtype=np.float32)
    exact = float(np.dot(x.astype(np.float64), y.astype(np.float64)))
    plain, reassociated = dot(x, y), dot_reassoc(x, y)                      # compile both first
    plain_s, reassoc_s = best_of(lambda: dot(x, y), 5), best_of(lambda: dot_reassoc(x, y), 5)
    print(f"{size:,} float32 products: in order {plain!r} in {plain_s * 1e3:.3f} ms; reassoc {reassociated!r} in "
          f"{reassoc_s * 1e3:.3f} ms ({plain_s / reassoc_s:.1f}× faster); exact (float64) {exact!r}")
    print(f"bit-identical: {plain == reassociated}; errors against the exact sum: {abs(plain - exact):.2e}, "
          f"{abs(reassociated - exact):.2e}")
    scale = float(np.sum(np.abs(x.astype(np.float64) * y)))
    for value in (plain, reassociated):
        assert abs(value - exact) < 1e-4 * scale, "both are float32 sums of the same numbers"


@njit(parallel=True)
def filter_gradient_shared(dy, x, dW):
    """dW[f, c, p, q] = Σ_n,i,j dy[n, f, i, j]·x[n, c, i + p, j + q], all threads adding into ONE dW (a race)."""
    N, F, out_h, out_w = dy.shape
    C, K = x.shape[1], dW.shape[2]
    for n in prange(N):
        for f in range(F):
            for c in range(C):
                for p in range(K):
                    for q in range(K):
                        for i in range(out_h):
                            for j in range(out_w):
                                dW[f, c, p, q] += dy[n, f, i, j] * x[n, c, i + p, j + q]


@njit(parallel=True)
def filter_gradient_private(dy, x, parts):
    """The same sum with one dW per thread chunk (``parts[t]``), added up afterwards: no two chunks share a number."""
    N, F, out_h, out_w = dy.shape
    C, K, chunks = x.shape[1], parts.shape[3], parts.shape[0]
    for t in prange(chunks):
        for n in range(t, N, chunks):
            for f in range(F):
                for c in range(C):
                    for p in range(K):
                        for q in range(K):
                            for i in range(out_h):
                                for j in range(out_w):
                                    parts[t, f, c, p, q] += dy[n, f, i, j] * x[n, c, i + p, j + q]


def exercise_2(fast: bool) -> None:
    """All threads adding into one shared dW with prange over the batch: what goes wrong, and why not always?

    Answer. `dW[f, c, p, q] += v` is three steps — load, add, store — and with `prange` over the batch two
    threads working on different images update the same dW entries. When both load the same entry before
    either stores, one store overwrites the other and an addition is lost: dW comes out too small by a
    random amount, different from run to run. Numba does not turn an element update into a reduction
    (only `scalar += …` in a prange is one) and does not warn. It does not always show because a collision
    needs both threads on the same address within the few nanoseconds between load and store: with few
    threads, many addresses (F·C·K² = 2 400 here) and a lot of arithmetic between updates, most runs lose
    few or no additions, and a run on one thread (NUMBA_NUM_THREADS=1, or a busy machine that runs the
    threads one after the other) is always right — a race that passes on a laptop and fails on a 64-core
    server. `conv_block_backward` avoids it as `filter_gradient_private` does: each thread sums into its
    own copy of dW and the copies are added at the end.
    """
    import numba

    rng = np.random.default_rng(7)
    N, C, F, K, size = (16, 3, 8, 5, 10) if fast else (64, 6, 16, 5, 12)
    x = random_array(rng, N, C, size, size, dtype=np.float32)
    dy = random_array(rng, N, F, size - K + 1, size - K + 1, dtype=np.float32)
    _, expected, _ = s1_loops.conv_backward(dy.astype(np.float64), x.astype(np.float64),
                                            np.zeros((F, C, K, K)), 1, 0)
    parts = np.zeros((numba.get_num_threads(), F, C, K, K), np.float32)
    filter_gradient_private(dy, x, parts)
    private_error = rel_error(parts.sum(axis=0), expected)
    shared_errors = []
    for run in range(3 if fast else 10):
        dW = np.zeros((F, C, K, K), np.float32)
        filter_gradient_shared(dy, x, dW)
        shared_errors.append(rel_error(dW, expected))
    print(f"{numba.get_num_threads()} threads: private copies rel_error {private_error:.1e}; one shared dW, "
          f"run by run: " + ", ".join(f"{error:.1e}" for error in shared_errors)
          + "  (anything above ~1e-6 is lost additions)")
    assert private_error < 1e-5


def exercise_3(fast: bool) -> None:
    """Time the first and the second call of a fresh @njit function; what does cache=True change next session?

    Answer. The first call is where the compiling happens: Numba looks at the argument types, infers the
    type of every variable, lowers the function to LLVM IR, and LLVM optimises it and emits machine code —
    tens of milliseconds to seconds, against microseconds for the second call, which finds the compiled
    version for those types and just runs it. Each new Python session starts again from nothing, unless
    the function has `cache=True`: Numba then writes the machine code to a cache file (beside the source
    in `__pycache__`, or in NUMBA_CACHE_DIR) keyed by the function's source and the argument types, and the
    next session's first call loads it instead of compiling (the dispatcher's `stats.cache_hits` counts it)
    — what makes the course's stage 3 start in a second or so rather than tens of seconds. Changing the
    function's own source file (or Numba's version) invalidates the entry; changing a function it calls
    that lives in ANOTHER file does not — the cached machine code, with the old callee compiled into it,
    stays in use (after editing kernels/cpu/, delete kernels/cpu/__pycache__). (The very first call of a session also pays for
    Numba setting itself up, cache or not; the script below calls another function first so that what it
    times is the compiling, or the loading, alone.)
    """
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "fresh.py"
        script.write_text(textwrap.dedent("""
            import json, time
            import numpy as np
            from numba import njit

            @njit(cache=True)
            def warm_up():              # Numba sets itself up at a session's first call: not what we time
                return 1

            @njit(cache=True)
            def sum_of_squares(a):
                total = 0.0
                for value in a:
                    total += value * value
                return total

            warm_up()
            a = np.arange(1000.0)
            times = []
            for call in range(2):
                started = time.perf_counter()
                sum_of_squares(a)
                times.append(time.perf_counter() - started)
            hits = sum(sum_of_squares.stats.cache_hits.values())
            print(json.dumps({"first_s": times[0], "second_s": times[1], "cache_hits": hits}))
            """))
        environment = dict(os.environ, NUMBA_CACHE_DIR=str(Path(folder) / "cache"))
        sessions = [json.loads(subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True,
                                              env=environment, cwd=folder).stdout) for _ in range(2)]
    for number, session in enumerate(sessions, 1):
        print(f"session {number}: first call {session['first_s'] * 1e3:8.2f} ms, second call "
              f"{session['second_s'] * 1e6:6.1f} µs, loaded from the cache: {bool(session['cache_hits'])}")
    assert not sessions[0]["cache_hits"] and sessions[1]["cache_hits"], "the second session loads the machine code"
    assert sessions[0]["second_s"] < sessions[0]["first_s"], "the first call compiles"
