"""A training step recorded once as a CUDA graph and replayed with ONE launch (stage 7's ``cuda-graph``).

Launching a kernel from Python costs far more than the kernel runs at LeNet-5's size: numba-cuda
took 28 µs for a kernel with one array argument and 88 µs with eight on an H100 (probes in
``benchmarks/results/`` — most of it the Python work of preparing the arguments), and a step
queues 15–30 kernels. A CUDA graph takes that work out of the loop: while a stream is in
*capture* mode, the kernels queued on it are recorded instead of run, with their arguments;
``cuGraphInstantiate`` turns the record into an executable graph, and ``cuGraphLaunch`` queues all
of it at once — about 1 µs a kernel on the device, and one Python call per step.

What a captured step may contain follows from "the arguments are recorded":

- every value that changes between steps must be read by the kernels from device memory (the
  step counter, the shuffled order, the learning rates: ``kernels/device_epoch.py``), since a
  number passed at capture time is replayed as it was;
- every buffer must already exist and stay where it is: the step is run eagerly once before it
  is captured (compiling every kernel and allocating every buffer), and nothing in it may
  allocate, copy from pageable host memory, or wait for the device.

Numba has no graph API; its kernels are queued on a stream like any other work, so the NVIDIA
driver bindings numba-cuda itself uses capture them: ``cuStreamBeginCapture`` (relaxed mode),
the launches, ``cuStreamEndCapture``, ``cuGraphInstantiate``, then ``cuGraphLaunch`` per step.
Numba's CUDA simulator has no streams to capture: ``graphs_supported()`` is False there, and the
stage runs the same kernels eagerly instead (``tests/test_cuda_tuned.py`` checks both paths agree).
"""

from __future__ import annotations

from kernels.device import cuda, simulated


def graphs_supported() -> bool:
    """True on a real GPU (the simulator cannot capture)."""
    return not simulated()


def _driver():
    """numba-cuda's wrapper of the NVIDIA driver bindings (checks every return code) and the bindings' enums."""
    from numba.cuda.cudadrv.driver import binding, driver
    return driver, binding


class StepGraph:
    """The work ``queue_step()`` puts on ``stream``, captured once; ``replay()`` queues it again."""

    def __init__(self, stream, queue_step):
        if not graphs_supported():
            raise RuntimeError("CUDA graphs need a real GPU: the CUDA simulator cannot capture a stream")
        driver, binding = _driver()
        self.stream = stream
        mode = binding.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        with cuda.defer_cleanup():                     # no memory freed (a synchronising call) while capturing
            driver.cuStreamBeginCapture(stream.handle, mode)
            try:
                queue_step()
            finally:
                graph = driver.cuStreamEndCapture(stream.handle)
        self.graph = graph
        self.executable = driver.cuGraphInstantiate(graph, 0)

    def replay(self) -> None:
        """Queue the whole captured step on the stream (returns at once, like a kernel launch)."""
        driver, _ = _driver()
        driver.cuGraphLaunch(self.executable, self.stream.handle)

    def close(self) -> None:
        driver, _ = _driver()
        if self.executable is not None:
            driver.cuGraphExecDestroy(self.executable)
            driver.cuGraphDestroy(self.graph)
            self.executable = self.graph = None

    def __del__(self):
        try:
            self.close()
        except Exception:           # the driver may already be gone at interpreter exit
            pass
