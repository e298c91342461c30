"""Numba CUDA kernels of the course, one small module per operation (stages 4 to 7).

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

Stages 6 and 7 add:

    streams         a launcher that queues on a stream, events, allocation and copy counters
    gradient_ring   the ring of K gradient slots: SlotStates (pure Python) and GradientRing (device)
    gather          a batch gathered from a training set resident on the device
    fill_pair       two buffers zeroed in one launch
    dense_fused     the dense layer's products with bias/ReLU/mask/db epilogues, tile per shape
    dense_loss      last dense layer + softmax + cross-entropy + its gradient in one kernel
    conv_pool_smem  the fused conv-pool kernels with the block's filter in shared memory
    launch_config   block sizes and tiles chosen from each layer's shape

Stage 7's tiled products and device-resident epoch (issue 14):

    implicit_gemm   one tiled, register-blocked matrix-product kernel; loaders and epilogues plug in
    conv_gemm       convolution as an implicit GEMM: forward with bias/ReLU/pool, split-K dW, dX
    dense_gemm      the dense layers on the same tiled product
    device_epoch    a whole epoch on the device: gather by a step counter, scheduled SGD, loss log
    step_graph      one training step captured as a CUDA graph and replayed (eager in the simulator)

Stage 8's fused training step (issue 21), three kernels a step:

    fused_net_table   the network as an int32 layer table, and the block's shared-memory plan
    fused_net_layers  each kind of table row as device functions on one block's shared memory
    fused_net_window  the WINDOW rows (convolution, pooling), forward and backward
    fused_net_step    one kernel: gather, forward, loss and backward of a group of samples per block
    fused_net_sum_sgd the groups' weight gradients summed in a fixed order, fused with the SGD step
    fused_net_cost    what the fused step should cost on an H100, phase by phase (PREDICTED)

Stage 3's CPU loops, compiled with ``numba.njit``, live apart in ``kernels/cpu/`` (its own docstring).

Each module pairs its ``@cuda.jit`` kernels with plain functions that pick the launch
configuration and launch them on device arrays; ``cnn/stages/s4_cuda.py`` … ``s7_cuda_tuned.py``
chain those into a network.
"""
