"""Notebook 09, stage 8 `cuda-fused-net`: worked solutions of its three exercises (in the simulator without a GPU)."""

from __future__ import annotations

from common import random_array, tiny_lenet, use_simulator_without_gpu

SIMULATED = use_simulator_without_gpu()      # before numba is imported

import numpy as np  # noqa: E402

from cnn.model import alexnet_small, lenet5  # noqa: E402
from cnn.stages import get_stage  # noqa: E402
from cnn.stages.s8_cuda_fused_net import layer_table  # noqa: E402
from kernels.fused_net_cost import HIGH, LOW, block_phases, phase_us, predict  # noqa: E402
from kernels.fused_net_step import H100_SHARED_LIMIT, THREADS  # noqa: E402
from kernels.fused_net_table import WORD  # noqa: E402

KIB = 1024
H100_SMS = 132


def exercise_1(fast: bool) -> None:
    """AlexNet-small's first convolution kept whole: would a sample fit? How many LeNet-5 samples fit a block?

    Answer. The first convolution's output is 32·32·32 = 32 768 floats a sample; kept with its gradient
    that is 2 · 32 768 · 4 B = 256 KiB — more than the 227 KiB an H100 block may have, before the input,
    the other layers and the switches. Stage 8 keeps what stage 5 kept: the pooled output (8 192 floats,
    32 KiB) and one switch a pooled output — one byte, the winner's row and column in its window: 8 KiB;
    the whole sample then needs 214.2 KiB (51.6 of them staged weights) and fits. A LeNet-5 sample needs
    33.4 KiB of buffers of its own, beside 19.4 KiB the block's samples share (staged weights, dW's
    parts), so 6 fit in a block. The stage still puts ONE sample in a block at batch 64, because a block
    runs on one SM: 64 blocks keep 64 of the H100's 132 SMs busy at once, while 11 blocks of 6 samples
    would keep 11 SMs busy, each working through 6 samples — several times longer. Samples are grouped only
    when the batch already gives every SM two blocks.
    """
    conv1 = alexnet_small().activation_shapes()[1]
    kept = 2 * int(np.prod(conv1)) * WORD
    pooled = int(np.prod(alexnet_small().activation_shapes()[3]))
    kept_pooled = pooled * WORD + pooled                         # the pooled output, and a byte a switch
    alexnet = layer_table(alexnet_small()).plan(1, H100_SHARED_LIMIT)
    lenet = layer_table(lenet5()).plan(1, H100_SHARED_LIMIT)
    own = sum(layer_table(lenet5()).words_per_sample().values()) * WORD
    shared = (lenet.regions["staging"] + lenet.regions["parts"]) * WORD
    fit = (H100_SHARED_LIMIT - shared) // own
    print(f"AlexNet-small conv1 output and its gradient: {kept / KIB:.0f} KiB (an H100 block: "
          f"{H100_SHARED_LIMIT / KIB:.0f} KiB); pooled output and switches: {kept_pooled / KIB:.0f} KiB; a whole sample "
          f"as stage 8 keeps it: {alexnet.shared_bytes / KIB:.1f} KiB ({alexnet.regions['staging'] * WORD / KIB:.1f} staged "
          f"weights)")
    print(f"LeNet-5: {own / KIB:.1f} KiB a sample, {shared / KIB:.1f} KiB shared by a block's samples, {fit} fit a block; "
          f"at batch 64 the stage takes {layer_table(lenet5()).samples_for(64, H100_SHARED_LIMIT, H100_SMS)} a block "
          f"({layer_table(lenet5()).samples_for(1024, H100_SHARED_LIMIT, H100_SMS)} at batch 1024)")
    assert kept == 256 * KIB > H100_SHARED_LIMIT and alexnet.shared_bytes < H100_SHARED_LIMIT
    assert kept_pooled == 40 * KIB
    assert fit == 6 and layer_table(lenet5()).samples_for(64, H100_SHARED_LIMIT, H100_SMS) == 1


def exercise_2(fast: bool) -> None:
    """Three steps twice and with another block size: the same bits? The partials added in reverse order?

    Answer. The three runs end with the same parameters bit for bit: every weight gradient is summed by
    one thread in a fixed order (its samples, its windows), the groups' partial sums are added by one
    thread a weight in group order, and nothing uses atomics — so neither the block size nor the order in
    which the GPU happens to schedule blocks can change a single addition. Adding the same partial sums
    in reverse group order with numpy gives a gradient that differs in the last bits for some weights:
    floating-point addition is not associative, (a + b) + c ≠ a + (b + c) in general. That is exactly what
    stage 5's atomics do: they add in whatever order the threads arrive, different from run to run, so
    its runs drift apart by rounding; stage 8 and stage 7's tiled kernels fix the order and are reproducible.
    """
    net, batch, threads = (tiny_lenet(), 4 if fast else 8, 32) if SIMULATED else (lenet5(), 64, THREADS)
    rng = np.random.default_rng(9)
    images = random_array(rng, 4 * batch, *net.input_shape, dtype=np.float32)
    labels = rng.integers(0, 10, 4 * batch)

    def run(block):
        stage = get_stage("cuda-fused-net")(net, threads=block).init("he", seed=0)
        stage.load_dataset(images, labels)
        stage.begin_epoch(np.arange(3 * batch), np.full(3, 0.05), batch, 0.9, 5e-4)
        stage.run_steps(0, 3)
        return stage

    runs = [run(threads), run(threads), run(2 * threads)]
    same = [np.array_equal(stage.get_params(), runs[0].get_params()) for stage in runs[1:]]
    partials = runs[0].d_partials.copy_to_host()
    in_order, reverse = np.zeros(partials.shape[1], np.float32), np.zeros(partials.shape[1], np.float32)
    for group in range(len(partials)):
        in_order += partials[group]
        reverse += partials[len(partials) - 1 - group]
    differ = int((reverse != runs[0].get_grad()).sum())
    print(f"same bits after 3 steps: {same}; the last step's gradient from {len(partials)} groups' partial sums: "
          f"in group order {'equal' if np.array_equal(in_order, runs[0].get_grad()) else 'NOT equal'} to the "
          f"stage's bit for bit, in reverse order {differ} of {partials.shape[1]} weights differ")
    assert all(same) and np.array_equal(in_order, runs[0].get_grad()) and differ > 0


def exercise_3(fast: bool) -> None:
    """The longest predicted phase of a LeNet-5 step; the step at batch 128 and 512; images a second.

    Answer. The longest phase, at both ends of the range, is the first Dense row's backward pass (row 2:
    256 inputs, 120 outputs): each of its dL/dx items reads a column of 120 weights from the L2 cache,
    16 loads at a time, so a thread waits on memory 8 times one after the other — 4 µs at the low end,
    10 µs at the high end, where a wait costs issue 22's calibrated 0.654 µs. (Next come conv2's dL/dx
    and conv1's forward pass.) At batch 128 the stage still puts one sample in a block: 128 blocks on 132
    SMs run in one wave, so kernel 1 takes the same time as at batch 64 and only the sum of twice as many
    partial rows grows — the step costs a little more (0.038–0.090 ms against 0.034–0.087) and the images
    a second nearly double (×1.8–1.9). At batch 512 a block takes two samples (the batch gives every SM
    two blocks): 256 blocks, two waves, each block doing twice the work in less than twice the time (more
    items keep more threads busy), so the step takes 2.1–2.4 times as long as at batch 128 and the images
    a second grow by ×1.7–1.9 again. Small batches leave most of the H100 idle; the fused kernel gains most
    from filling every SM. All of it PREDICTED: a GPU run of ``gpu_session.sh fused-net`` measures it.
    """
    builder, parameters = layer_table(lenet5()), lenet5().num_params
    phases = block_phases(builder, 1, THREADS)
    longest = {end: max(phases, key=lambda phase: phase_us(phase, end)) for end in (LOW, HIGH)}
    rates, steps = {}, {}
    for batch in (64, 128, 512):
        samples = builder.samples_for(batch, H100_SHARED_LIMIT, H100_SMS)
        prediction = predict(builder, parameters, batch, samples, THREADS, H100_SMS)
        steps[batch] = prediction
        rates[batch] = [batch / (ms / 1e3) for ms in prediction.step_ms]
        print(f"batch {batch:>3}: {samples} sample(s) a block, kernel 1 {prediction.kernel_1_us[0]:.0f}–"
              f"{prediction.kernel_1_us[1]:.0f} µs, step {prediction.step_ms[0]:.3f}–{prediction.step_ms[1]:.3f} ms, "
              f"{rates[batch][1]:,.0f}–{rates[batch][0]:,.0f} images/s (PREDICTED)")
    phase = longest[HIGH]
    print(f"longest phase: {phase.name}, {phase_us(phase, LOW):.1f}–{phase_us(phase, HIGH):.1f} µs")
    assert longest[LOW].name == longest[HIGH].name == "row 2 backward (dense)"
    assert steps[128].kernel_1_us == steps[64].kernel_1_us
    assert all(rates[128][k] > 1.8 * rates[64][k] for k in (0, 1))
    assert all(2 * steps[128].step_ms[k] < steps[512].step_ms[k] < 4 * steps[128].step_ms[k] for k in (0, 1))
    assert all(1.5 < rates[512][k] / rates[128][k] < 2.0 for k in (0, 1))
