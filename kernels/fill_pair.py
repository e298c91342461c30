"""Zero two device arrays in ONE launch (stage 7's ``fewer-launches`` fix).

The push-form backward kernels add into buffers that must hold zeros first: the gradient of
every fused convolution block and the dX of every fused block but the first. Stage 5 zeroes
each with its own ``fill`` launch (3 launches a LeNet-5 step, 5 for AlexNet-small). Stage 7
keeps all those dX buffers in one device array (the "dX arena") and zeroes the whole gradient
slot with it: one launch.

Thread-to-data mapping: the two arrays seen as one vector of a.size + b.size floats; thread k
writes a[k] when k < a.size, else b[k − a.size].
"""

from __future__ import annotations

import numpy as np

from kernels.device import cuda
from kernels.launch import grid_1d, launch


@cuda.jit
def zero_pair_kernel(a, b):
    k = cuda.grid(1)
    if k < a.size:
        a[k] = np.float32(0.0)
    elif k < a.size + b.size:
        b[k - a.size] = np.float32(0.0)


def zero_pair(a, b, threads=128, launch=launch):
    """a[...] ← 0 and b[...] ← 0, for two C-contiguous float32 device arrays of any shapes."""
    launch(zero_pair_kernel, *grid_1d(a.size + b.size, threads), a.reshape(a.size), b.reshape(b.size))
