"""Sum across the threads of one block, in shared memory (the simulator has no warp shuffles).

``block_sum(values, t)``: thread t has written its partial sum to ``values[t]``; after the call
``values[0]`` holds the sum over the block. A tree: at each step the first half of the active
threads add the second half's values to their own, then the block synchronises.

    step = T/2, T/4, …, 1:   values[t] += values[t + step]   for t < step

``cuda.blockDim.x`` must be a power of two (``kernels.launch.reduction_threads`` gives one), and
every thread of the block must call it: ``cuda.syncthreads()`` inside waits for all of them.
"""

from __future__ import annotations

from kernels.device import cuda


@cuda.jit(device=True)
def block_sum(values, t):
    cuda.syncthreads()                  # every partial sum is written
    step = cuda.blockDim.x // 2
    while step > 0:
        if t < step:
            values[t] += values[t + step]
        cuda.syncthreads()
        step //= 2
