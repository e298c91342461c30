"""Set every element of a device array to one value (the push-style kernels accumulate into zeros).

Thread-to-data mapping: thread k writes element k of the array seen as a flat vector.
(The driver's memset is not available in Numba's simulator, so a kernel does it.)
"""

from __future__ import annotations

import numpy as np

from kernels.device import cuda
from kernels.launch import grid_1d, launch


@cuda.jit
def fill_kernel(a, value):
    k = cuda.grid(1)
    if k < a.size:
        a[k] = value


def fill(a, value=0.0, launch=launch):
    """a[...] ← value, for a C-contiguous float32 device array of any shape."""
    launch(fill_kernel, *grid_1d(a.size), a.reshape(a.size), np.float32(value))
