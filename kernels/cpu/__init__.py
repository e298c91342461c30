"""Stage 3's kernels: the loops of stage 1 compiled by Numba for the CPU, threaded, fused (``cnn/stages/s3_numba_cpu.py``).

Read them in this order (stage 3's docstring tells why each is written the way it is):

    layout       the (row, column, sample) scratch layout; the SIMD loops axpy and dot over it
    pool         max-pool of one plane (bias and ReLU folded in), its backward; the standalone kernels
    conv_pool    conv + bias (+ ReLU) (+ max-pool) as one threaded kernel; its backward
    dense        the dense layer, threads over (sample, output) pairs and rows
    elementwise  ReLU, its backward, the SGD update: one pass over flat vectors

Only ``numba.njit`` here, never Numba's CUDA target: a CPU-only install runs stage 3.
"""
