"""GPU ranks: the allreduce strategy with every rank's weights, momentum and gradient on its GPU.

``python -m cnn.parallel.launch -n 2 --strategy allreduce --stage cuda-tuned`` (one GPU per rank,
picked by the rank's index on its node). The host-side strategies copy the gradient device → host
with ``get_grad``, step a host optimizer and copy all the weights host → device with
``set_params``, every step. Here the weights never leave the GPU; per step only the gradient
travels, by one of two paths, chosen once and said in one line at the start:

- **CUDA-aware MPI** (``MPIX_Query_cuda_support()`` says 1, or Open MPI's ``ompi_info`` says
  ``mpi_built_with_cuda_support:value:true``): the gradient's device buffer itself goes to
  ``MPI_Iallreduce`` — mpi4py reads its address from ``__cuda_array_interface__`` — after the
  compute stream is synchronised (MPI knows nothing of streams); the library moves it over
  NVLink/PCIe (GPUDirect) without a host copy the program can see. The sum is divided by P on the
  device and the update runs there.
- **Staged through pinned memory** (any other MPI): stage 6's gradient ring already copies each
  step's gradient to pinned host memory on its second stream as soon as the backward kernels are
  queued (``kernels/gradient_ring.py``); ``host_gradient`` waits for that copy alone. The pinned
  row is the send buffer of the ``Iallreduce``, the sum lands in a pinned receive buffer, is divided
  by P on the host and goes back into the same ring slot with one host → device copy on the compute
  stream, where the SGD kernel then reads it. Pinned memory is what makes both copies DMA
  transfers (53 GB/s on the H100 host measured, 6.8 GB/s pageable). A CUDA stage without a ring
  (``cuda``, ``cuda-fused``) uses ``get_grad`` instead.

``CNN_MPI_CUDA_AWARE=1`` (or ``0``) overrides the detection — for an MPI that is CUDA-aware but
does not say so, and for the tests: in Numba's CUDA simulator "device" arrays live in host memory,
so the CUDA-aware path runs there too (the simulator's array is handed over as the numpy array
it wraps).

What overlaps: the ring's copy runs on the copy stream while the compute stream fetches the loss;
the allreduce waits for the whole gradient. Overlapping it with the backward pass layer by layer
(``--overlap`` on the host stages) needs the ring to copy each layer's slice as its backward ends —
an event per bucket — which the ring does not offer yet. The NCCL path, and what each path costs
on an H100: ``docs/distributed.md``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import numpy as np
from mpi4py import MPI

from cnn.parallel import resume
from cnn.parallel.common import Run
from cnn.parallel.synchronous import evaluate_and_checkpoint
from cnn.parallel.timing import AVERAGE, COMPUTE, UPDATE

CUDA_AWARE_VARIABLE = "CNN_MPI_CUDA_AWARE"


def query_cuda_support() -> bool | None:
    """``MPIX_Query_cuda_support()`` of the MPI library this process loaded (Open MPI's extension;
    MPICH and MVAPICH have it too), or None where the library has no such function."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        function = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        if function is not None:
            return bool(function())
    return None


def ompi_built_with_cuda(ompi_info: str | None = None) -> bool | None:
    """Open MPI's answer (``ompi_info --parsable --all``: ``mpi_built_with_cuda_support:value``, in
    Open MPI 5 a synonym of ``opal_built_with_cuda_support``), or None without ``ompi_info``."""
    ompi_info = ompi_info or shutil.which("ompi_info", path=os.pathsep.join(
        [os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if not ompi_info:
        return None
    try:
        text = subprocess.run([ompi_info, "--parsable", "--all"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in text.splitlines():
        if line.endswith(("built_with_cuda_support:value:true", "built_with_cuda_support:value:false")) and \
                ("mpi_built_with_cuda_support" in line or "opal_built_with_cuda_support" in line):
            return line.endswith("true")
    return None


def cuda_aware_mpi() -> tuple[bool, str]:
    """(whether MPI takes device buffers, how that was found out)."""
    override = os.environ.get(CUDA_AWARE_VARIABLE)
    if override in ("0", "1"):
        return override == "1", f"{CUDA_AWARE_VARIABLE}={override}"
    answer = query_cuda_support()
    if answer is not None:
        return answer, f"MPIX_Query_cuda_support() = {int(answer)}"
    built = ompi_built_with_cuda()
    if built is not None:
        return built, f"ompi_info: mpi_built_with_cuda_support = {str(built).lower()}"
    return False, "neither MPIX_Query_cuda_support nor ompi_info answered"


def device_buffer(array):
    """What MPI is given for a device array: the array itself (mpi4py reads its
    ``__cuda_array_interface__``); in the simulator, the host array behind it."""
    from kernels.device import simulated

    return array._ary if simulated() else array


class DeviceExchange:
    """One step's averaging for a CUDA stage: by CUDA-aware MPI, or staged through pinned host memory."""

    def __init__(self, run: Run, stage):
        from kernels.device import cuda

        self.world, self.timer, self.stage = run.world, run.timer, stage
        self.cuda_aware, self.reason = cuda_aware_mpi()
        self.ring = hasattr(stage, "host_gradient")
        self.loss = np.zeros(1, np.float64)
        size = run.net.num_params
        if self.cuda_aware:
            self.path = "CUDA-aware MPI: the device gradient goes to MPI_Iallreduce"
            self.d_scale = cuda.to_device(np.array([1.0 / run.world.size], np.float32))
        else:
            self.reduced = cuda.pinned_array(size, dtype=np.float32)
            self.path = ("staged: the gradient ring's pinned host copy (copy stream) → MPI_Iallreduce → pinned → "
                         "the ring slot" if self.ring else "staged: get_grad → MPI_Iallreduce → pinned → device")

    def describe(self) -> str:
        return f"GPU ranks: {self.path} ({self.reason}); weights and momentum stay on the GPU"

    def __call__(self, loss: float, lr: float, config) -> float:
        """Average the gradient of the backward pass just queued, then the SGD step on the device."""
        comm, size = self.world.comm, self.world.size
        self.loss[0] = loss
        with self.timer.phase(AVERAGE, label="allreduce " + ("(device)" if self.cuda_aware else "(pinned host)")):
            requests = [comm.Iallreduce(MPI.IN_PLACE, self.loss, op=MPI.SUM)]
            if self.cuda_aware:
                self._reduce_on_device(requests)
            else:
                self._reduce_on_host(requests)
        with self.timer.phase(UPDATE):
            self.stage.update(lr, config.momentum, config.weight_decay)
        return float(self.loss[0] / size)

    def _reduce_on_device(self, requests) -> None:
        from kernels.gradient_ring import weighted_sum

        stage = self.stage
        stage.synchronize()                   # the backward kernels have written the gradient MPI reads
        gradient = stage.d_grad
        requests.append(self.world.comm.Iallreduce(MPI.IN_PLACE, device_buffer(gradient), op=MPI.SUM))
        self.world.wait(requests, "gradient allreduce (device buffers)")
        # g ← (1/P)·g in place: the ring's weighted sum over one slot with the weight 1/P
        weighted_sum(gradient.reshape((1, gradient.size)), self.d_scale, gradient, stage.launch)

    def _reduce_on_host(self, requests) -> None:
        stage = self.stage
        host = stage.host_gradient() if self.ring else stage.get_grad()     # the ring: waits for its copy only
        requests.append(self.world.comm.Iallreduce(host, self.reduced, op=MPI.SUM))
        self.world.wait(requests, "gradient allreduce (pinned host buffers)")
        self.reduced /= self.world.size
        stage.d_grad.copy_to_device(self.reduced, stream=stage.stream)     # before the update's kernel


def train(run: Run) -> dict:
    """The allreduce loop for GPU ranks: compute on the device, average the gradient, update on the device."""
    world, config, timer = run.world, run.config, run.timer
    if run.options.allreduce != "mpi" or run.options.overlap:
        raise ValueError("GPU ranks use MPI's allreduce (--allreduce mpi, no --overlap): the ring and the "
                         "layer-by-layer overlap run on host stages")
    stage = run.make_stage()
    params = run.initial_params(stage)
    momentum = np.zeros_like(params)
    start = resume.weights_and_momentum(run, params, momentum)
    stage.set_params(params)
    stage.set_momentum(momentum)
    run.state = stage                                     # a checkpoint copies the weights off the device
    exchange = DeviceExchange(run, stage)
    run.announce(exchange.describe())
    for step in range(start, run.total_steps):
        world.maybe_die(step)
        lr = run.lr(step)
        with timer.phase(COMPUTE):
            stage.load_batch(*run.shard(step, world.rank))
            stage.forward()
            stage.backward()
            loss = stage.fetch_loss()                     # waits for the compute stream: the kernels are done
        world.maybe_straggle(timer.current[COMPUTE])
        mean_loss = exchange(loss, lr, config)
        run.completed_steps = step + 1
        run.end_step(step, mean_loss, lr, workers=world.size)
        evaluate_and_checkpoint(run, stage, step)
    run.training_done()
    path = {"gpu_path": exchange.path, "cuda_aware_mpi": exchange.cuda_aware, "cuda_aware_how": exchange.reason}
    return {"extra": path, "rank_extra": path}
