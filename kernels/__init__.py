"""Numba CUDA kernels of the course, one small module per operation (stages 4 and 5).

Read them in this order; each docstring names the CPU reference it is tested against and which
thread computes which element:

    device          the one ``from numba import cuda``; simulated(), gpu_unavailable_reason()
    launch          grid sizes from element counts, the launch counter, index helpers
    conv2d          direct convolution forward; backward in pull form (data, filter)
    bias_relu       bias + ReLU in one pass, ReLU backward, bias gradient (block reduction)
    reduction       sum across a block in shared memory
    maxpool         max-pool forward with argmax switches; backward in pull and push form
    dense           the dense layer as a shared-memory tiled matrix product
    softmax_xent    softmax cross-entropy and its gradient, one block
    sgd             SGD with momentum and weight decay on the flat vectors
    fill            set a device array to one value (push kernels accumulate into zeros)
    conv2d_push     convolution backward in push form, with atomics
    conv_pool_fused conv + bias + ReLU + max-pool in one kernel; its push-form backward

Each module pairs its ``@cuda.jit`` kernels with plain functions that pick the launch
configuration and launch them on device arrays; ``cnn/stages/s4_cuda.py`` and
``s5_cuda_fused.py`` chain those into a network.
"""
