"""Stage 3's kernels: the loops of stage 1 compiled by Numba for the CPU, threaded, fused (``cnn/stages/s3_numba_cpu.py``).

Read them in this order (stage 3's docstring tells why each is written the way it is):

    layout       the (row, column, sample) scratch layout; the SIMD loops over it (axpy, fma_4x4, dot_4x4)
    pool         max-pool of one plane (bias and ReLU folded in), its backward; the standalone kernels
    conv_pool    conv + bias (+ ReLU) (+ max-pool) for a range of work items; one layer over the threads
    dense        the dense layer, threads over (sample, output) pairs and rows
    elementwise  ReLU, its backward, the SGD update: one pass over flat vectors
    network      a whole training step: each thread takes blocks of samples through every layer
    thread_pool  how the threads wait between parallel regions (set here, before any kernel runs)

Only ``numba.njit`` here, never Numba's CUDA target: a CPU-only install runs stage 3.
"""

from kernels.cpu.thread_pool import prefer_passive_openmp

prefer_passive_openmp()
