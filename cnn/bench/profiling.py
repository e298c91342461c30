"""``python -m cnn bench --profile STAGE``: where one stage's training steps spend their time.

On the host, a profile of the steps (pyinstrument when installed, else cProfile by cumulative
time); on a GPU, the device time of every kernel, from CUDA events put around each launch by
``KernelTimer``. Those steps are also the range Nsight Compute records when started with
``--profile-from-start off`` (``benchmarks/gpu_session.sh profile`` does that)::

    ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum,\
        sm__throughput.avg.pct_of_peak_sustained_elapsed python -m cnn bench --profile cuda-tuned --steps 2
"""

from __future__ import annotations

import time

import numpy as np

from cnn.bench.measure import repetitions
from cnn.bench.workload import benchmark_batches, course_hyperparameters


class KernelTimer:
    """While active, puts two CUDA events around every Numba kernel launch: per-kernel device times.

    The events sit on the default stream, so a kernel's time includes the launch gap when the GPU
    was idle before it; for kernels of a few microseconds read it as an upper bound.
    """

    def __enter__(self):
        from numba import cuda
        from numba.cuda import dispatcher

        self.records, self._class = [], dispatcher._LaunchConfiguration
        self._original, timer = self._class.__call__, self

        def timed_launch(configuration, *kernel_args):
            start, end = cuda.event(timing=True), cuda.event(timing=True)
            start.record()
            result = timer._original(configuration, *kernel_args)
            end.record()
            kernel = getattr(configuration.dispatcher, "py_func", configuration.dispatcher)
            timer.records.append((getattr(kernel, "__name__", str(kernel)), start, end))
            return result
        self._class.__call__ = timed_launch
        return self

    def __exit__(self, *exc):
        self._class.__call__ = self._original

    def summary(self) -> list[tuple[str, int, float]]:
        """(kernel, launches, total ms), the most expensive first."""
        from numba import cuda

        cuda.synchronize()
        totals = {}
        for name, start, end in self.records:
            launches, total = totals.get(name, (0, 0.0))
            totals[name] = (launches + 1, total + cuda.event_elapsed_time(start, end))
        return sorted(((name, n, ms) for name, (n, ms) in totals.items()), key=lambda item: -item[2])


def host_profile(call, top: int = 25) -> str:
    """Text of a host profile of ``call()``: pyinstrument when installed, else cProfile (by cumulative time)."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(call)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
        return "host profile (cProfile, by cumulative time):\n" + text.getvalue()
    profiler = Profiler()
    profiler.start()
    call()
    profiler.stop()
    return "host profile (pyinstrument):\n" + profiler.output_text(unicode=True)


def profile_stage(name: str, net, batches, args) -> str:
    """The report of ``--profile``: host profile of training steps, then per-kernel device times."""
    from cnn.stages import cuda_unavailable_reason, get_stage

    stage_class = get_stage(name)
    stage = stage_class(net, np.dtype(args.dtype)).init("he", args.seed)
    hyper = course_hyperparameters()
    started = time.perf_counter()
    for images, labels in batches[:2]:
        stage.train_step(images, labels, *hyper)
    steps = repetitions((time.perf_counter() - started) / 2, args.budget, args.steps, 1)

    def steps_call():
        for step in range(steps):
            stage.train_step(*batches[step % len(batches)], *hyper)
    lines = [f"stage {name}: {steps} training steps of {net.name}, batch {len(batches[0][1])}",
             host_profile(steps_call)]
    if stage_class.device != "cuda":
        lines.append(f"per-kernel device times: stage {name} runs on the CPU, it launches no kernels")
    elif cuda_unavailable_reason():
        lines.append(f"per-kernel device times: only on a GPU ({cuda_unavailable_reason()})")
    else:
        from numba import cuda

        cuda.profile_start()          # the range Nsight Compute records with --profile-from-start off
        with KernelTimer() as timer:
            steps_call()
        cuda.profile_stop()
        lines.append(kernel_table(timer.summary(), steps))
    return "\n".join(lines)


def kernel_table(summary, steps: int) -> str:
    total = sum(ms for _, _, ms in summary) or 1.0
    lines = [f"per-kernel device times (CUDA events around each launch, {steps} steps):",
             f"{'kernel':<40} {'launches/step':>13} {'ms/step':>9} {'µs/launch':>10} {'share':>6}"]
    for name, launches, ms in summary:
        lines.append(f"{name:<40} {launches / steps:>13.1f} {ms / steps:>9.3f} {1e3 * ms / launches:>10.1f} "
                     f"{ms / total:>6.1%}")
    return "\n".join(lines)


def cmd_profile(args) -> int:
    from cnn.model import get_network

    net = get_network(args.model)
    batches, _ = benchmark_batches(net, args)
    print(profile_stage(args.profile, net, batches, args))
    return 0
