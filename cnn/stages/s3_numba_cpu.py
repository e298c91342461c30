"""Stage 3 ``numba-cpu``: the loops of stage 1, compiled by Numba, run on every core, and fused.

The compiled loops live in ``kernels/cpu/`` (layout, pool, conv_pool, conv_patches, winograd, dense,
elementwise, network, thread_pool), as the CUDA kernels of stages 4-7 live in ``kernels/``; this module
turns a network into the program they run. What changes against stage 2:

- The loops come back — compiled. ``@njit`` turns loops into machine code, so a loop
  costs what it costs in C, and no im2col matrix is built. The convolution is written
  one weight at a time: ``z += W[f, c, p, q] · (input channel c shifted by (p, q))``.
- Memory layout for SIMD. A thread copies channel c of a block of samples, zero-padded,
  into a private scratch with the sample index innermost — (row, column, sample) order
  (``load_channel``) — and keeps its conv outputs in the same layout. The shift by
  (p, q) is then ONE offset for every output of every sample in the block, so the loops
  over rows, columns and samples collapse into one contiguous loop of a few thousand
  steps, which the compiler turns into SIMD fused multiply-adds. The K − 1 columns at the
  right edge of each row straddle two rows: they are computed too and never read (30 %
  extra work for LeNet-5's second conv; stacking the samples one under the other instead
  also wastes K − 1 rows per sample, 56 %, and measured ~40 % slower on that layer). Loop
  lengths are rounded up to a multiple of SIMD_ROUND so that no scalar tail loop runs;
  BLOCK_NUMBERS keeps a block's plane about L1-sized. A convolution of stride s > 1 is
  computed at stride 1 and read every s-th output: s² times the arithmetic, but one set
  of loops (no network of the course has one).
- Four by four in one pass. One weight at a time, ``z += w · x`` loads z, loads x and
  stores z for ONE multiply-add: the loop waits on memory, not on arithmetic. ``fma_4x4``
  adds four taps (c, p, q) into four filters' planes in one pass — 16 multiply-adds an
  element for 4 loads of x and 4 loads and 4 stores of z, the 16 weights held in registers
  (weights pre-arranged in 4 × 4 tiles, ``weight_tiles``). Backward, ``dot_4x4`` takes
  dW for four filters × four taps (16 running sums, 8 loads an element), and dx is the
  scatter ``dx[k + shift] += w·dz[k]`` rewritten as a gather over a zero margin, so that
  ``fma_4x4`` adds four (filter, tap) terms into four input channels at once. Filter and
  tap counts are padded to multiples of four with zero weights (LeNet-5's first conv: 6
  filters → 8, 25 taps → 28; a zero weight times an infinite input gives NaN instead of
  infinity: still not finite). 2 × 2 max-pooling and the ReLU gate of its backward are
  written as selects, not branches (random data mispredicts half of them).
- Conv + bias + ReLU + max-pool run as ONE kernel, as the CUDA stage 5 will do: the
  conv plane stays in cache and is pooled straight into the output, so only the pooled
  output and the argmax "switches" reach memory. Backward, the gradient at the conv
  output is rebuilt from the switches (the ReLU gate is "pooled output > 0") into the
  scratch plane, and dW, db, dx are taken from it, with no full-size intermediate
  array and no separate ReLU or pool pass. A Conv that is not followed by ReLU +
  MaxPool runs through the same kernel with ReLU and pooling off, then through the
  separate ReLU and max-pool kernels — so any network of layer specs works.
- One parallel region a phase (``kernels/cpu/network.py``). The stage's first version
  spread each layer over the threads in turn (``schedule="layers"``, kept for the
  benchmark): LeNet-5 made a dozen parallel regions a step, each ending at a barrier
  where every thread waits for the slowest — and on a busy machine the slowest is a thread
  that lost its core for a time slice, longer than the whole step. Now the work item is a
  block of 8 samples that ONE thread takes through the whole network — forward, loss,
  backward — its activations staying in that core's cache (the idea stage 8 takes to the
  GPU). Each block sums its convolutions' dW and db into its own copy; the copies are added
  in block order afterwards, and the dense layers' dW = dYᵀX and db are taken once for the
  whole batch (``gather_gradient``), so the gradient is the same, bit for bit, on any number
  of threads (no races, no atomics). ``train_step`` runs forward and backward in the same
  region: a step is two regions (the step, the gradient), not a dozen.
- Threads that let others run. Numba's OpenMP layer with ``OMP_WAIT_POLICY=passive``
  (``kernels/cpu/thread_pool.py``: a waiting thread sleeps instead of spinning on a core
  someone else needs), and a step uses only the cores that other work leaves free
  (``FreeCores``: the threads ready to run, from /proc/loadavg, smoothed over the last
  steps) — all cores on an idle machine, one when the others are busy, so that two
  threads are never the slower choice.
- ``fastmath`` only where it is safe: ``reassoc`` (the dot products of dW keep SIMD
  partial sums) and ``contract`` (fused multiply-add), never ``nnan``/``ninf``, so a
  diverging loss still shows up as NaN.
- Little Python per step: two compiled calls and the update; activation, switch and
  gradient buffers are allocated once per batch size and reused. The first layer skips
  dL/d(images), which training never needs (PyTorch skips it too); ``input_grad``
  computes it on demand. The SGD update is one compiled pass (``sgd_momentum_kernel``).
- Dense layers are compiled loops too: forward and dL/dx per block, four rows of W by four
  samples a pass (``add_dot_products``, ``add_product``); dW and db once for the whole batch
  (``gather_gradient``, item 5 below). numpy's BLAS is faster per FLOP
  (LeNet-5's three dense layers, forward + backward at batch 64 on one thread: 0.26 ms
  against 0.8 ms for the first compiled version), but OpenBLAS brings a second thread pool
  that fights Numba's for the same two cores: a whole step measured a median 18-23 ms with
  BLAS dense layers against 13-20 ms with the compiled ones (separate runs, alternated, on
  this machine while it was loaded).

What it bought. First version (a parallel region per layer, one weight per pass), measured on
the 2-core Intel Xeon development machine with no other job running (load 1.8; numba 0.68, torch
2.13 CPU; 2 threads each; LeNet-5, batch 64, float32, real MNIST; median of 120 steps a row, the
rows taking turns; benchmarks/results/numba_vs_torch-vm-2026-11-22.json): stage numpy 31.41 ms,
``fuse=False`` 7.61 ms, numba-cpu 5.35 ms, PyTorch 7.24 ms a step — numba-cpu / PyTorch 0.74;
fused against unfused 1.42x.

The changes since, measured on the development machine as it is now (2-core AMD EPYC with
AVX-512, shared with seven other jobs: 1-minute load average 12 to 42 during every run below,
so wall-clock times are inflated several times and noisy; ratios of rows timed in the same
turns are what to read, and the coordinator re-runs them on a quiet machine):

1. Per-core speed — the block schedule, then four by four. One thread, one LeNet-5 step at
   batch 64; a fresh process per version, the versions taking turns, 3 rounds of 40 steps; the
   thread's CPU time a step (less sensitive to the load than the wall clock); load 9.5-6.8::

       python benchmarks/numba_vs_torch.py --versions aefc889,335e2f5,4c3b21c,HEAD --threads 1 --repeats 40

       aefc889  first version (a region per layer)      4.66-4.85-4.86 ms  (min-median-max of 3 rounds)
       335e2f5  block schedule, 4 taps a pass, 2x2 pool 4.42-4.43-4.48 ms  0.91-0.92-0.95 x the previous
       4c3b21c  4 x 4 tiles, branchless pooling         3.05-3.12-3.22 ms  0.69-0.70-0.73 x the previous
       HEAD     passive threads, free cores only        3.06-3.19-3.29 ms  0.98-1.02-1.05 x the previous

   The block schedule changes little on one thread (it was made for the barriers); the 4 x 4
   passes take 30 % off; the thread policy costs nothing on one thread. Against PyTorch on one
   thread (the thread's CPU time, the two taking turns in one process, LeNet-5 b64, 5 rounds of
   10-20 steps; a throwaway script, not kept; five runs at loads 8-30): numba-cpu / PyTorch 0.42,
   0.46, 0.50, 0.54, 0.60 (3.3-4.3 ms against 5.2-9.3 ms). AlexNet-small b128 (3 rounds of 3
   steps, load 30): 157 against 136 ms, 1.15 — slower than PyTorch there: its wide convolutions
   (32-64 channels on 8-16 pixel planes) waste 23-44 % on the straddling columns and stream their
   blocks from L2; oneDNN's blocked kernels do better. Wall clock, rows taking turns
   (``python benchmarks/numba_vs_torch.py --model alexnet-small --repeats 12 --rows
   numba-cpu,torch-cpu``, load 15-20): 400 against 334 ms on 1 thread (1.20), 364 against 937 ms
   on 2 (0.39: PyTorch's spinning threads lose on the busy machine); numba-cpu 2 threads over 1:
   0.91x.

2. Threads on a busy machine. ``python benchmarks/numba_vs_torch.py --repeats 30 --loaded``
   (a competing process keeps one core busy; load 6 besides; the rows in a new random order every
   turn; benchmarks/results/numba_vs_torch-lenet5-b64-loaded-vm-2026-11-25.json), median ms a
   step, then 2 threads over 1::

       numba-cpu (blocks, free cores only)    12.2 on 1 thread, 13.1 on 2: 1.07x
       numba-cpu-fixed (blocks, always 2)      7.2 on 1 thread, 15.5 on 2: 2.14x
       numba-cpu-layers (the first schedule)  11.3 on 1 thread, 24.5 on 2: 2.17x
       PyTorch 2.13 (its OpenMP spins)        13.5 on 1 thread, 128 on 2:  9.55x

   numba-cpu / PyTorch: 0.91 on 1 thread (of the minima 0.66), 0.10 on 2. (An earlier run at
   load 10-16, before the rows' order was shuffled: numba-cpu 0.66x, -fixed 3.34x, -layers 17.6x,
   PyTorch 14.1x.) Passive waiting and one region a phase are not enough on a shared core (2.1x);
   using only the free cores (numba-cpu ran every region on 1 thread here) is. The rows of the
   same 1-thread code differ by up to 1.7x (12.2 against 7.2 ms): that is the noise of this load.

   The same rows with no competing process of ours (load 6 from the other jobs, ``--repeats 30``,
   numba_vs_torch-lenet5-b64-no-competitor-vm-2026-11-25.json), medians: numba-cpu 7.07 and 7.41
   ms (1.05x; it used 1 thread: the other jobs kept about one core busy), -fixed 7.15 and 15.9
   (2.22x), -layers 7.10 and 14.7 (2.06x), PyTorch 12.2 and 27.1 (2.23x), numpy 45.9 and 42.0 ms;
   numba-cpu / PyTorch 0.58 on 1 thread, 0.27 on 2. The fastest steps show what a free second core
   gives: numba-cpu-fixed 1.55 ms on 2 threads against 3.01 on 1; PyTorch 2.78 and 4.34 ms.

3. The quiet re-run (2026-11-28, the same 2-core machine with nothing else running: load 0.5-1.0,
   the benchmark's own; 4 runs of ``--repeats 60`` for LeNet-5, 3 of ``--model alexnet-small
   --repeats 12 --rows numba-cpu,numba-cpu-fixed,torch-cpu``; min-max of the runs' medians;
   benchmarks/results/numba_vs_torch-*-2026-11-28.json)::

       LeNet-5 b64          1 thread: numba-cpu 3.61-3.89 ms, PyTorch 4.32-4.64 ms   0.84-0.86
                            2 threads: numba-cpu-fixed 1.92-2.06, PyTorch 3.10-3.27  0.61-0.63
       AlexNet-small b128   1 thread: numba-cpu 106-114 ms, PyTorch 93.5-98.2 ms     1.13-1.16
                            2 threads: numba-cpu-fixed 52.6-58.7, PyTorch 48.9-51.3  1.08-1.15

   So issue 23's target (0.5x PyTorch) is not reached: 0.61-0.63x at best on LeNet-5, and on
   AlexNet-small this stage is still 8-16 % slower. In these runs the ``numba-cpu`` row itself
   (FreeCores) took one thread on most 2-thread steps (LeNet-5 3.52-3.85 ms): PyTorch's OpenMP
   threads, spinning in the same process between its turns, count as busy elsewhere. Without the
   PyTorch rows (``--rows numba-cpu,numba-cpu-fixed``) it takes both cores: 2.29 ms against
   -fixed's 2.20. (Found in 4.: in one process Numba runs on PyTorch's OpenMP, whose threads spin,
   and FreeCores counts Numba's own spinning threads as busy.)

4. No reference count a pass (2026-11-28, later, the same quiet machine: load 0.4-1.1). ``perf``, with
   gdb to name the JIT code, found a quarter of a LeNet-5 step in ``NRT_incref``/``NRT_decref``: Numba
   counts the references to an array's memory, and every view (``X[r]``, ``block[c, a:b]``) handed to a
   kernel that is not inlined is a locked increment and decrement — tens of cycles, as much as a short
   row's sums. ``fma_4x4`` and ``dot_4x4`` now take (array, rows, starts) and make their views inside,
   where Numba's reference-count pruning removes the pairs; ``add_rows_at`` indexes X's rows in place;
   ``add_patch`` indexes with unsigned integers (no negative-index wraparound to keep it from SIMD); the
   patch backward regroups its terms by position with one counting sort a sample (``by_position``),
   where ``window_groups`` divided and made views for every window. One thread, fresh processes taking
   turns, CPU time a step (min-median-max of the rounds)::

       python benchmarks/numba_vs_torch.py --versions acb28c9,3028e10 --threads 1 --repeats 40 --rounds 4

       LeNet-5 b64          acb28c9  3.38-3.40-3.42 ms    3028e10  2.47-2.49-2.50 ms   0.73-0.73-0.74 x
       AlexNet-small b128   acb28c9  103.1-103.9-104.6    3028e10  83.8-84.7-84.9      0.81-0.81-0.82 x
                            (--model alexnet-small --batch 128 --repeats 6 --rounds 3)

   Against PyTorch, rows taking turns in one process (4 runs of ``--repeats 60``; 3 of ``--model
   alexnet-small --repeats 12 --rows numba-cpu,numba-cpu-fixed,torch-cpu``; medians, the min-max of the
   runs; benchmarks/results/numba_vs_torch-*-2026-11-28-in-place-run*.json)::

       LeNet-5 b64          1 thread:  numba-cpu-fixed 2.48-2.59 ms, PyTorch 3.97-4.26    0.61-0.63
                            2 threads: numba-cpu-fixed 1.35-1.40,    PyTorch 2.85-3.09    0.45-0.48
       AlexNet-small b128   1 thread:  numba-cpu-fixed 82.6-86.6,    PyTorch 84.0-110     0.79-0.98
                            2 threads: numba-cpu-fixed 41.9-42.7,    PyTorch 42.8-59.9    0.71-0.98

   (the ratio is each run's own; PyTorch's AlexNet-small rows moved by 30 % between runs at the same
   load.) In this one process the two share one OpenMP, PyTorch's (imported first, its threads
   spinning): the Numba rows ran with that policy too, and the ``numba-cpu`` row's FreeCores, counting
   Numba's own spinning threads as busy, took one thread on 2-thread steps (2.57-2.63 ms) — which is
   why the same-threads comparison is ``numba-cpu-fixed``. On its own (2 processes each, 60 steps): this
   stage 1.60-1.64 ms on 2 threads with its passive threads (FreeCores took 2), 1.49-1.58 fixed; on
   PyTorch's spinning OpenMP 1.27-1.33 fixed — sleeping between regions costs ~0.2 ms a step here. And
   ``python -m cnn bench`` had timed PyTorch the other way round, on Numba's passive OpenMP (5.94-5.98
   ms): it now times PyTorch in a process of its own (``kernels/cpu/thread_pool.py``).

   A busy machine (``--loaded``, 3 runs of ``--repeats 30``): numba-cpu on all threads / one thread
   1.00 in all three; numba-cpu / PyTorch 0.60-0.61 on one thread, 0.36-0.37 on two. Ten MNIST epochs
   (``python -m cnn train --stage numba-cpu --epochs 10``, load 0.5-0.8): 99.33 %, 1.43-1.48 s of
   training an epoch after the first (1.64 s); benchmarks/results/train-lenet5-numba-cpu-10-epochs-vm-2026-11-28.json.

   Issue 23's 0.5x: reached on LeNet-5 on 2 threads (0.45-0.48), not on one thread (0.61-0.63), and
   AlexNet-small is now level with PyTorch or faster (0.71-0.98), not twice as fast. Where a step goes
   now (LeNet-5, one thread, perf): the 4 x 4 passes (fma_4x4 ~20 %, dot_4x4 ~8 %), pooling and
   unpooling (~13 %), add_rows_at and unfold (~10 %), the per-block zeroing (~5 %). The passes are
   load- and store-bound at 8 floats a vector (LLVM keeps 256-bit vectors on this CPU; 512-bit measured
   no faster); an FMA-bound kernel needs sums held in registers across the taps, which Numba cannot
   write for the plane layout.

5. The dense layers' weight gradient once a batch (``network.gather_gradient``): dW = dYᵀX and db from
   the whole batch in the step's second region, four output rows a work item, instead of per block
   of 8 into copies zeroed and summed every step (the copies now hold the convolutions' 2,572 of
   LeNet-5's 44,426 parameters). CPU time a step, fresh processes taking turns (load 0.7-1.0)::

       python benchmarks/numba_vs_torch.py --versions 9d3e95a,0477abf --threads 1 --repeats 40 --rounds 4

       LeNet-5 b64, 1 thread    9d3e95a 2.43-2.54-3.38 ms   0477abf 2.35-2.35-2.36 ms   0.70-0.93-0.97 x
       LeNet-5 b64, 2 threads   9d3e95a 1.49-1.51-1.58      0477abf 1.42-1.45-1.54      0.92-0.95-1.02 x
       AlexNet-small b128, 1    9d3e95a 91.3-92.1-93.6      0477abf 88.8-89.2-90.6      0.96-0.97-0.98 x

   (the 0.70 is a round where 9d3e95a's process was slowed; on 2 threads the CPU time is the main
   thread's, the wall-clock medians 1.61 and 1.51 ms.) A first 2-thread run is not quoted: its step
   processes set Numba's thread count before importing stage 3, which started Numba's OpenMP without
   the passive policy, and FreeCores, seeing the spinning threads, took one thread (fixed since).

6. No wraparound, no division (2026-11-28, later again; the machine slower than in 4-5: a930bd4, with
   0477abf's kernels, took 2.69-2.83 ms of CPU a LeNet-5 step, against 0477abf's 2.35-2.36 in 5).
   Numba cannot prove an index computed from signed integers non-negative, so it adds a fixup
   (index < 0 → index + size) to every access; in pooling's scalar loops that was ~a third of the
   instructions. Pooling and unpooling now take unsigned
   offsets, ``first_max_of_four`` returns the switch itself, and unpooling finds the winner's row with one
   compare (``pool._switch_row``) where it divided by the plane's width (~20 cycles): 1.6x and 1.8x faster
   a window (microbenchmarks). The copies between layouts (``load_channel``, ``channels_last``, ``unfold``)
   take unsigned offsets too (1.2-1.4x each), and the plane backward no longer zeroes its dz twice nor
   allocates a dx scratch for a first layer. CPU time a step, fresh processes taking turns (load 1.0-1.5)::

       python benchmarks/numba_vs_torch.py --versions a930bd4,HEAD --threads 1 --repeats 40 --rounds 4

       LeNet-5 b64          a930bd4 2.69-2.75-2.83 ms   045c52a 2.50-2.56-2.62 ms   0.90-0.92-0.98 x
       AlexNet-small b128   a930bd4 91.6-94.1-101.7     045c52a 88.8-89.4-92.8      0.91-0.94-0.98 x
                            (--model alexnet-small --batch 128 --repeats 6 --rounds 3)

   Against PyTorch, rows taking turns in one process (4 runs of ``--repeats 60``, 3 of ``--model
   alexnet-small --repeats 12 --rows numba-cpu,numba-cpu-fixed,torch-cpu``, 3 of ``--loaded --repeats
   30``; load 0.9-1.7; medians, min-max of the runs, each ratio its own run's;
   benchmarks/results/numba_vs_torch-*-2026-11-28-unsigned-run*.json)::

       LeNet-5 b64          1 thread:  numba-cpu-fixed 2.51-2.63 ms, PyTorch 5.33-5.66    0.46-0.47
                            2 threads: numba-cpu-fixed 1.41-1.50,    PyTorch 3.88-4.26    0.35-0.36
       AlexNet-small b128   1 thread:  numba-cpu-fixed 84.2-89.5,    PyTorch 97.0-109     0.82-0.87
                            2 threads: numba-cpu-fixed 41.8-44.5,    PyTorch 51.1-55.7    0.80-0.82
       LeNet-5, one core kept busy:   numba-cpu all threads / one thread 0.97 (each run);
                                      numba-cpu / PyTorch 0.47-0.48 (1 thread), 0.30-0.32 (2)

   PyTorch's own LeNet-5 step took 5.3-5.7 ms on one thread here against 4.0-4.3 in 4's runs: the
   machine was slower, PyTorch more than this stage; the ratios are each run's own, and on one thread
   they sit near issue 23's line (0.5), not far below it. Ten MNIST epochs: 99.33 %, 1.54-1.68 s of
   training an epoch (first 1.79); benchmarks/results/train-lenet5-numba-cpu-10-epochs-vm-2026-11-28-unsigned.json.

   Correcting 4: the 4 x 4 passes are not load-bound where their rows fit in L1. Alone, on 1,024 numbers,
   ``dot_4x4`` runs at 95 GFLOP/s and ``fma_4x4`` at 76 — the core's 256-bit FMA peak is ~96 at 3 GHz.
   (512-bit vectors, which LLVM uses once ``-prefer-256-bit`` is added to NUMBA_CPU_FEATURES: dot_4x4 123,
   fma_4x4 74.) Tried and not kept, each measured: pieces of 256-2,048 outputs a pass to keep the planes in
   L1 (alike, or slower); passes along each row of outputs, skipping the straddling columns (LeNet-5's conv
   2 forward 0.91x, but its conv 1 1.1x and AlexNet-small's conv 1 1.15x slower: short loops cost more than
   the columns they skip); LeNet-5's conv 2 forward a pooling window at a time (the forward 1.1-1.2x
   slower); BLOCK_NUMBERS 8192 (alike); the patch backward adding its rows straight into dx (1.2x slower:
   runs of 30 numbers); eight rows a pass in ``add_rows_at`` (AlexNet-small's conv 2 dW 0.93x, ~1 % of a
   step); dW a position at a time, each patch row added into its filters' rows in L1-sized pieces (1.4x
   slower: one load and one store of dW for every multiply-add).

   Why AlexNet-small stays above 0.5x — arithmetic. Its dense step is 8.8 GFLOP at batch 128 (forward
   3.15, backward 5.7), which PyTorch runs in 97-109 ms: 81-91 GFLOP/s. This stage skips the three
   quarters of the convolutions' backward that pooling zeroes (4.6 GFLOP left), so half PyTorch's time
   (48-54 ms) needs 85-95 GFLOP/s over the whole step — the 256-bit peak itself (half the 512-bit one, 7).
   Its passes run at 54 (conv 1), 74 (conv 2) and 84 (conv 3, windows) GFLOP/s forward and ~40 backward
   (the winners' patches: rank-one updates, a load for each multiply-add) — each program row timed alone
   on one thread, the batch in blocks of 8 (one run, medians of 3): forward 11.7, 22.6, 10.0 ms, backward
   12.4, 22.1, 10.6 ms of a ~90 ms step. Twice PyTorch's speed there needs fewer multiply-adds (Winograd
   or FFT convolutions) or kernels built for 512-bit vectors, not a better schedule: the same loops
   compiled wider measured no faster (7).

7. No reference counts a plane, and 512-bit vectors measured (2026-11-28, a new session, load 0.7-1.1).
   What 4 left of ``NRT_incref``/``NRT_decref`` was still 5 % of a LeNet-5 step (perf); breaking at
   ``NRT_incref`` in gdb and naming each caller's return address counted ~45 % of the calls in pooling and
   unpooling. A view made for a call costs a pair (``pool_plane(z[f, s:], ..., out[n, f], switch[n, f])``, a
   few hundred calls a step), and so does every array argument that a function hands on to another
   compiled function: Numba's pruning removes the pair of an argument only in a function that passes it
   nowhere (seen in the LLVM IR, ``inspect_llvm``). ``pool_plane`` and ``unpool_plane`` now take (array,
   first) and (arrays, n, f), the 2 × 2 loop is inside ``pool_plane`` instead of a function it called, and
   ``gradient_reaching`` takes numbers: none of the three keeps a pair. Alone, on AlexNet-small's conv 1
   planes: unpooling 3.0x faster a plane (5.6 → 1.85 µs: the old ``gradient_reaching`` took the arrays, a
   pair a window), pooling 1.06x. The step (``--versions 248f9ca,cad2753`` and the reverse order, CPU time,
   min-median-max of the rounds): LeNet-5 0.95-0.97-1.02x and 0.96-0.99-1.03x (6 rounds each; NRT 5.1 →
   2.6 % of the step); AlexNet-small 1.02-1.03-1.03x and 1.02-1.03-1.04x (4 rounds each), while a script
   timing both in turns of 10 steps found 0.98-1.00x — a step alike, within this machine's noise.
   Against PyTorch after it (168e0a3, 3 runs of ``--repeats 60``, load 1.2-1.3; the ratio each run's
   own; benchmarks/results/numba_vs_torch-lenet5-b64-no-competitor-vm-2026-11-28-refcount-run*.json)::

       LeNet-5 b64          1 thread:  numba-cpu-fixed 2.37-2.70 ms, PyTorch 4.95-5.21    0.48-0.52
                            2 threads: numba-cpu-fixed 1.35-1.48,    PyTorch 3.52-3.72    0.37-0.40

   On one thread the stage sits on issue 23's line (0.5), as in 6; on two it is well under it.

   The whole stage compiled for 512-bit vectors (NUMBA_CPU_FEATURES = the host's features plus
   ``-prefer-256-bit``; ``dot_4x4`` alone runs at 123 GFLOP/s there, above the 256-bit peak: the core
   has two 512-bit FMA units), against the default, fresh processes taking turns, 1 thread, median wall
   time of a step: LeNet-5 2.72-2.81 against 2.50-2.60 ms (4 rounds: 1.08-1.11x slower), AlexNet-small
   95.0-116 against 98.3-103 ms (3 rounds: 0.92-1.18x, no gain). The passes as written do not turn wider
   vectors into speed (``fma_4x4`` gained nothing even alone in L1; ``dot_4x4`` 1.3x alone, but the conv 3
   forward that runs it, timed alone, 9.5-10.4 against 10.3-11.0 ms, two runs): twice the 256-bit peak is
   there, but reaching it takes register-blocked kernels with their operands tiled for L1 — what oneDNN
   generates — a different kernel design, not the same loops wider.

   Tried after the pooling change and not kept (fresh processes taking turns, 1 thread, LeNet-5): a ReLU
   after a Dense folded into the Dense's program row (two rows and two passes fewer: the step
   0.93-1.00-1.07x, 6 rounds); the patch backward's v re-zeroed inside ``add_patch`` instead of by a call
   to memset a position (its conv 2 backward 0.60-0.62 against 0.58-0.60 ms at best, 3 runs: the store
   costs what the call did).

8. Fewer multiplications: Winograd's F(2 × 2, 5 × 5) (2026-11-28, a third session, load 0.8-1.5). 6 found
   the forward's passes near what they can do and named fewer multiply-adds as the way toward half
   PyTorch's time on AlexNet-small. ``kernels/cpu/winograd.py`` takes a 5 × 5 conv + 2 × 2 pool with at
   least 16 channels in (AlexNet-small's conv 2 and 3; none of LeNet-5's) by Winograd's minimal
   filtering: a 2 × 2 tile of outputs, one pooling window, from 36 products where the direct sum takes
   100; conv 2 then needs 7.6 MFLOP a sample, transforms included, against the planes' 16.4 executed —
   2.1x fewer on paper. Each path alone (``python benchmarks/conv_forward_paths.py --repeats 40``, the
   paths taking turns a call each, 8 samples, 1 thread, 3 runs; x the planes' speed): conv 2 Winograd
   1.34-1.37-1.38x (a window at a time 1.00-1.01-1.04x), conv 3 1.43-1.44-1.52x (windows
   1.37-1.37-1.40x); the weights' transform,
   0.2 and 0.45 ms a layer, is done once a step for every block (``network._winograd_rows``). Less than
   the arithmetic: the products are small matrix products (32 x 32 by a few hundred tiles, V and M kept
   in L2), ``fma_4x4`` passes of 160 numbers at ~76 GFLOP/s where the planes' runs of thousands reach
   ~86, and the transforms take a quarter of the time. Its first version gained little over the planes
   (1.02-1.17x, 8 runs): perf put 26 % of its time in ``NRT_incref``/``NRT_decref``, 2,304 calls a
   block each handed arrays and views; the passes are now inlined where they are called (Numba's
   ``inline="always"``: no call, and the counts are pruned away; 1.6 % left). The inlined body takes the
   caller's fastmath flags, so its callers carry SAFE_FASTMATH: without them the FMA loses its
   contraction and the reductions their SIMD (tried on the stage's other kernels: LeNet-5 1.8x slower).
   The step, ``--versions abca136,06dda2c`` and the reverse order, 1 thread, CPU time round by round:
   AlexNet-small 0.87-0.94-0.95x and 0.92-0.94-1.01x (5 rounds each; its forward alone 0.83-0.86-0.91x,
   6 rounds) — about 1.06x faster, the forward being half the step; LeNet-5 0.95-1.01-1.03x (6 rounds):
   alike. Compiling the float32 step costs 6-11 s more (below). Against PyTorch after it (3 runs of
   ``--model alexnet-small --repeats 20``, each ratio its run's own;
   benchmarks/results/numba_vs_torch-alexnet-small-b128-no-competitor-vm-2026-11-28-winograd-run*.json)::

       AlexNet-small b128   1 thread:  numba-cpu-fixed 90.9-91.5 ms, PyTorch 121.7-124.4    0.73-0.75
                            2 threads: numba-cpu-fixed 47.0-47.8,    PyTorch 62.3-64.7      0.74-0.75

   PyTorch's own step was slower on this day than in 6 (97-109 ms): part of the move from 0.82-0.87 is
   its. Still not 0.5: the backward, half the step, is untouched (the winners' patches at ~40 GFLOP/s:
   a dense Winograd would multiply the three quarters of dL/dz that pooling zeroes).

   Tried and not kept in the same session: the patch backward's dx added straight into its K runs with
   offsets (no v, no memset, no ``add_patch``), AlexNet-small's backward 1.02-1.06-1.07x slower (6
   rounds; 6 found the same on LeNet-5); ``fma_4x4`` and ``dot_4x4`` inlined into the plane and window
   kernels, their callers given SAFE_FASTMATH: LeNet-5 0.97-1.00-1.03x (6 rounds; the pairs left there
   are few); BLOCK_NUMBERS 1024 and 2048 against 4096, each also at 512 bits (AlexNet-small's step 101.9,
   97.0, 98.5 ms at 256 bits and 109.7, 102.7, 102.0 at 512, one run of 5 each: none faster). Not tried:
   LeNet-5's conv 1 has 6 filters in two groups of four: the half-empty group's passes cost ~0.11 ms
   forward and ~0.11 backward (its conv + pool timed alone with 4, 6 and 8 filters, batch 64); a pass
   for two filters would save about half of that, ~0.1 ms, ~4 % of a step.

9. A patch's runs read where they lie (2026-11-28, a fourth session; load 0.7-1.8). The backward of AlexNet-small's
   conv 2 and 3 — the winners' patches, a third of the step — copied every patch of a sample into a row of X first
   (16 × 16 × 800 numbers for conv 2, 819 KB, which every filter's gathered rows then streamed from L2). Where a
   patch's K runs of K·C numbers are long (K·C ≥ 96; 160 there) they are now read in the channels-last input itself
   (51 KB for conv 2, 18 KB for conv 3), and dx is added a kernel row p at a time so that W[:, p] stays in L1;
   LeNet-5's runs of 30 keep the unfolded rows (``conv_patches``: its table). One weighted sum of runs at offsets,
   ``layout.add_runs``, serves both ways where ``add_rows_at`` took only rows. Each layer over a whole batch (a block
   of 8 new samples a call, old and new taking turns in one process, 4 runs): conv 2's backward 0.86-0.88-0.91x,
   conv 3's 0.88-0.95-0.97x, LeNet-5's conv 2 0.97-0.99x. The step (``--versions 4db6a02,72a4cd4``, CPU time round
   by round): AlexNet-small 0.95-0.99-1.07x (8 rounds), LeNet-5 0.95-1.01-1.07x (6 rounds) — the ~3 % the layers
   predict is inside this machine's noise. Compiling the float32 step (cold caches, 3 runs each, taking turns):
   56.8-61.7 s of CPU, against 55.3-61.2 before.

   Why no more: ``add_runs`` alone, on numbers in L1, runs at 45-55 GFLOP/s (four loads, and a load and a store of
   the sums, for four multiply-adds; 512-bit vectors measured no faster, sums added as a tree no faster, eight terms
   a pass slower). Grouped by position instead (the filters that chose a position share its patch), one load
   would serve several filters, but each would store its own row of dW: as many stores. Half PyTorch's time on
   AlexNet-small (64-81 ms on one thread in the runs below) is not within reach of this design: a backward twice
   as fast would save ~20 ms of ~92, and the forward is near what its passes do (6-8); it takes register-tiled
   kernels, whose sums stay in registers across a whole reduction (oneDNN's design), which Numba's loops do not
   express: one of Winograd's products (4 filters × 32 channels × 160 tiles) written as a register tile — 4 × 16
   sums as named scalars, generated code, for LLVM to pack into vectors — ran at 11 GFLOP/s, where eight
   ``fma_4x4`` passes run at 51 (one thread, alone, in L1; sums over the channels taken a tile at a time: 8;
   these and ``add_runs``'s rates from throwaway scripts, not kept).

   Against PyTorch after it (3 runs of ``--model alexnet-small --repeats 20``, 3 of ``--repeats 60``, 3 of
   ``--loaded --repeats 30``; load 0.7-1.8; each ratio its run's own;
   benchmarks/results/numba_vs_torch-*-2026-11-28-runs-run*.json)::

       LeNet-5 b64          1 thread:  numba-cpu-fixed 2.74-2.95 ms, PyTorch 6.09-6.83    0.43-0.45
                            2 threads: numba-cpu-fixed 1.50-1.68,    PyTorch 4.58-5.30    0.31-0.33
       AlexNet-small b128   1 thread:  numba-cpu-fixed 91.9-95.1,    PyTorch 127-162      0.59-0.72
                            2 threads: numba-cpu-fixed 46.1-48.6,    PyTorch 66.5-91.3    0.53-0.69
       LeNet-5, one core kept busy:   numba-cpu all threads / one thread 0.89-1.00;
                                      numba-cpu / PyTorch 0.46-0.49 (1 thread), 0.20-0.24 (2)

   Both were slower than in 7 and 8 — PyTorch's LeNet-5 step 6.1-6.8 ms against 4.95-5.21 there, this stage's
   2.74-2.95 against 2.37-2.70 — PyTorch more: LeNet-5 under 0.5 on one thread is this day's ratio (0.48-0.52 in 7),
   and AlexNet-small's lowest ratios are of the third run, where PyTorch's step was the slowest (load 1.3-1.8).
   Ten MNIST epochs (``python -m cnn train --stage numba-cpu --epochs 10``, load 0.1-0.7): 99.33 %, 1.54-1.68 s
   of training an epoch after the first (2.00 s);
   benchmarks/results/train-lenet5-numba-cpu-10-epochs-vm-2026-11-28-runs.json.

The first call of the stage compiles its kernels: 51-58 s of CPU for the float32 step with the Winograd
path (8; 57-62 s after 9, on a slower day), against 45-48 s without it (2026-11-28, 3 runs each, cold
caches, taking turns; 40-43 s in an earlier session, the first version 12 s), then ``cache=True`` keeps
the machine code on disk. (Numba's cache is keyed by the caller's own file: after editing a kernel in
kernels/cpu/, delete kernels/cpu/__pycache__.)
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from cnn.machine import runnable_threads, usable_cores
from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU, window_count
from cnn.stages.base import HostStage, Ops, softmax_cross_entropy
from kernels.cpu.conv_pool import conv_block_backward, conv_block_forward
from kernels.cpu import network
from kernels.cpu.dense import dense_backward_kernel, dense_forward_kernel
from kernels.cpu.elementwise import relu_backward_kernel, relu_kernel, sgd_momentum_kernel
from kernels.cpu.pool import maxpool_backward_kernel, maxpool_kernel


# -- the same kernels behind the common op signatures (they allocate their outputs) -----------

def _no_switch(N, F):
    """An empty switch array for kernels called without pooling (never read)."""
    return np.empty((N, F, 0, 0), np.int64)


def conv_forward(x, W, b, stride, pad):
    x = np.ascontiguousarray(x)
    N, _, H, Wd = x.shape
    F, _, K, _ = W.shape
    y = np.empty((N, F, window_count(H, K, stride, pad), window_count(Wd, K, stride, pad)), x.dtype)
    conv_block_forward(x, np.ascontiguousarray(W, x.dtype), np.ascontiguousarray(b, x.dtype),
                       stride, pad, False, 0, 0, y, _no_switch(N, F), numba.get_num_threads())
    return y


def conv_backward(dy, x, W, stride, pad):
    x, dy = np.ascontiguousarray(x), np.ascontiguousarray(dy, x.dtype)
    dx, dW, db = np.empty_like(x), np.empty(W.shape, x.dtype), np.empty(W.shape[0], x.dtype)
    conv_block_backward(dy, dy, _no_switch(*dy.shape[:2]), x, np.ascontiguousarray(W, x.dtype),
                        stride, pad, False, 0, 0, dW, db, dx, True, numba.get_num_threads())
    return dx, dW, db


def relu_forward(x):
    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    relu_kernel(x.reshape(-1), y.reshape(-1))
    return y


def relu_backward(dy, y):
    y = np.ascontiguousarray(y)
    dy, dx = np.ascontiguousarray(dy, y.dtype), np.empty_like(y)
    relu_backward_kernel(dy.reshape(-1), y.reshape(-1), dx.reshape(-1))
    return dx


def maxpool_forward(x, size, stride):
    x = np.ascontiguousarray(x)
    N, C, H, W = x.shape
    shape = (N, C, window_count(H, size, stride), window_count(W, size, stride))
    y, argmax = np.empty(shape, x.dtype), np.empty(shape, np.int64)
    maxpool_kernel(x, size, stride, y, argmax)
    return y, argmax


def maxpool_backward(dy, argmax, x_shape, size, stride):
    dx = np.empty(x_shape, dy.dtype)
    maxpool_backward_kernel(np.ascontiguousarray(dy), np.ascontiguousarray(argmax, np.int64), size, stride, dx)
    return dx


def dense_forward(x, W, b):
    x = np.ascontiguousarray(x)
    y = np.empty((x.shape[0], W.shape[0]), x.dtype)
    dense_forward_kernel(x, np.ascontiguousarray(W, x.dtype), np.ascontiguousarray(b, x.dtype), y)
    return y


def dense_backward(dy, x, W):
    x = np.ascontiguousarray(x)
    dx, dW, db = np.empty_like(x), np.empty(W.shape, x.dtype), np.empty(W.shape[0], x.dtype)
    dense_backward_kernel(np.ascontiguousarray(dy, x.dtype), x, np.ascontiguousarray(W, x.dtype), dx, dW, db, True)
    return dx, dW, db


# -- the stage: a fusion plan, and buffers kept per batch size -------------------------------

class Step(NamedTuple):
    """One kernel call of the forward pass, covering ``layers`` starting at net.layers[first]."""

    kind: str        # "conv_relu_pool", "conv", "relu", "maxpool", "flatten", "dense"
    first: int
    layers: tuple


_KIND = {Conv: "conv", ReLU: "relu", MaxPool: "maxpool", Flatten: "flatten", Dense: "dense"}


def fusion_plan(net: Network, fuse: bool = True) -> list[Step]:
    """The layers grouped into kernel calls: every Conv → ReLU → MaxPool becomes one fused step (if ``fuse``)."""
    steps, layers, index = [], net.layers, 0
    while index < len(layers):
        group = layers[index:index + 3]
        if fuse and [type(layer) for layer in group] == [Conv, ReLU, MaxPool]:
            steps.append(Step("conv_relu_pool", index, group))
        else:
            steps.append(Step(_KIND[type(layers[index])], index, layers[index:index + 1]))
        index += len(steps[-1].layers)
    return steps


def _chw(shape) -> tuple:
    """A per-sample shape as (C, H, W): a vector of n numbers is (n, 1, 1)."""
    return tuple(shape) + (1,) * (3 - len(shape))


def block_program(net: Network, plan: list[Step]) -> np.ndarray:
    """The plan as ``kernels.cpu.network``'s program: one row of integers per kernel call (Flatten needs none:
    a sample's numbers are already in a row), each row's output in its own activation segment."""
    columns = network
    offsets = {(slot.layer, slot.name): slot.offset for slot in net.param_layout()}
    shapes, rows, source, end = net.activation_shapes(), [], -1, 0
    for step in plan:
        if step.kind == "flatten":
            continue
        layer, row = step.layers[0], np.zeros(columns.FIELDS, np.int64)
        row[columns.KIND] = {"conv_relu_pool": columns.CONV, "conv": columns.CONV, "relu": columns.RELU,
                             "maxpool": columns.MAXPOOL, "dense": columns.DENSE}[step.kind]
        shape_out = shapes[step.first + len(step.layers)]
        row[[columns.C_IN, columns.H_IN, columns.W_IN]] = _chw(shapes[step.first])
        row[[columns.C_OUT, columns.H_OUT, columns.W_OUT]] = _chw(shape_out)
        row[columns.IN_START], row[columns.OUT_START] = source, end
        source, end = end, end + int(np.prod(shape_out))
        if isinstance(layer, (Conv, Dense)):
            row[columns.W_AT], row[columns.B_AT] = offsets[step.first, "W"], offsets[step.first, "b"]
        if isinstance(layer, Conv):
            row[[columns.KERNEL, columns.STRIDE, columns.PAD]] = layer.kernel, layer.stride, layer.pad
        pool = step.layers[2] if step.kind == "conv_relu_pool" else layer
        if isinstance(pool, MaxPool):
            row[[columns.POOL_SIZE, columns.POOL_STRIDE]] = pool.size, pool.stride
        row[columns.APPLY_RELU] = step.kind == "conv_relu_pool"
        rows.append(row)
    return np.array(rows)


def block_summed_parameters(program: np.ndarray, num_params: int) -> int:
    """How many parameters, from the start of the flat vector, each block sums into its own copy: those before
    the first dense layer's — the convolutions' (``cnn.model`` builds no convolution after a dense layer: its
    output has no (C, H, W) to take); the dense layers' gradients are taken for the whole batch at once
    (``network.gather_gradient``)."""
    dense = [row for row in program if row[network.KIND] == network.DENSE]
    return int(min((row[network.W_AT] for row in dense), default=num_params))


class Buffers(NamedTuple):
    """Everything one batch size needs, allocated once: per step its output, switches and input gradient."""

    outputs: list
    switches: list
    input_grads: list


class BlockBuffers(NamedTuple):
    """What the block schedule needs for one batch size, allocated once (layout: ``kernels.cpu.network``)."""

    acts: np.ndarray          # every program row's output, one segment each
    switches: np.ndarray      # the argmax of the pooled rows, same layout
    grads: np.ndarray         # dL/d(every output), same layout
    grad_copies: np.ndarray   # (blocks, convolution parameters): block k's share of their gradient
    block_losses: np.ndarray  # (blocks,): block k's summed loss


class FreeCores:
    """How many threads the next step uses: Numba's thread count, less the cores that other work keeps busy.

    A parallel region ends when its slowest thread does. A thread that shares its core with another
    process runs in time slices of milliseconds — longer than a whole LeNet-5 step — so the step
    waits for it, and on a busy machine two threads are slower than one. Before each step the
    stage looks at how many other threads are ready to run (``cnn.machine.runnable_threads``,
    smoothed over the last steps so that one sample does not decide) and uses only the cores left
    free: all of them on an idle machine, one when the others are all taken.
    """

    SMOOTHING = 0.25        # weight of the newest sample: about the last four steps decide

    def __init__(self):
        self.busy_elsewhere = 0.0

    def __call__(self) -> int:
        return self.choose(numba.get_num_threads(), usable_cores(), runnable_threads())

    def choose(self, allowed: int, cores: int, runnable: int | None) -> int:
        """Threads for the next step, given the thread count allowed, the cores and the threads ready to run
        right now, the caller included (None: unknown, so all allowed)."""
        if runnable is None or allowed == 1:
            return allowed
        self.busy_elsewhere += self.SMOOTHING * (max(0, runnable - 1) - self.busy_elsewhere)
        return max(1, min(allowed, round(cores - self.busy_elsewhere)))


SCHEDULES = ("blocks", "layers")
NO_LABELS, NO_INPUT_GRAD = np.empty(0, np.int64), None


class NumbaCpuStage(HostStage):
    name = "numba-cpu"
    summary = "stage-1 loops compiled with Numba: threads over the batch, conv+ReLU+pool fused"
    ops = Ops(conv_forward, conv_backward, relu_forward, relu_backward,
              maxpool_forward, maxpool_backward, dense_forward, dense_backward)

    MAX_BUFFER_SETS = 4     # batch sizes kept (training, last partial batch, evaluation, ...)

    def __init__(self, net: Network, dtype=np.float32, fuse: bool = True, schedule: str = "blocks",
                 free_cores_only: bool = True):
        """``fuse=False`` runs every layer as its own kernel call; ``schedule="layers"`` spreads each layer over
        the threads in turn (the stage's first version, a barrier a layer) instead of each block of samples
        through the whole network (one parallel region a phase); ``free_cores_only=False`` always uses
        Numba's thread count (``FreeCores``; the layer schedule always does). The benchmark measures them."""
        if schedule not in SCHEDULES:
            raise ValueError(f"stage {self.name!r}: schedule must be one of {SCHEDULES}, not {schedule!r}")
        super().__init__(net, dtype)
        self.schedule = schedule
        self.free_cores = FreeCores() if free_cores_only else numba.get_num_threads
        self.threads_used: dict[int, int] = {}      # thread count -> phases run with it (the benchmark reports it)
        self.kernel_calls = fusion_plan(net, fuse)
        self.program = block_program(net, self.kernel_calls)
        self.block_summed = block_summed_parameters(self.program, net.num_params)
        self._buffer_sets: dict = {}
        self._backward_done = False      # input_grad exists between backward() and update()
        self._input_grad = None
        self._first_step_grad = None     # what the per-layer schedule's lazy ``input_grad`` needs

    # -- the phases -------------------------------------------------------------------------
    def forward(self):
        if self.schedule == "layers":
            return self._forward_by_layers()
        self._run_blocks(self.images, self.labels, forward=True, backward=False)

    def backward(self):
        if self.schedule == "layers":
            return self._backward_by_layers()
        self._run_blocks(self.images, self.labels, forward=False, backward=True)

    def train_step(self, images, labels, lr, momentum=0.9, weight_decay=0.0):
        """Forward and backward in ONE parallel region (each block goes down and back up on its thread), then the update."""
        if self.schedule == "layers":
            return super().train_step(images, labels, lr, momentum, weight_decay)
        self.load_batch(images, labels)
        self._run_blocks(self.images, self.labels, forward=True, backward=True)
        self.update(lr, momentum, weight_decay)
        return self.fetch_loss()

    def update(self, lr, momentum, weight_decay):
        dtype = self.dtype.type
        sgd_momentum_kernel(self.params, self.velocity, self.grad, dtype(lr), dtype(momentum), dtype(weight_decay))
        self._backward_done, self._first_step_grad = False, None    # the weights input_grad needs have changed

    def predict(self, images):
        images = np.ascontiguousarray(images, dtype=self.dtype)
        if self.schedule == "layers":
            logits, _ = self._forward_steps(images, self._buffers(images.shape[0], "predict"))
            return logits.copy()
        return self._run_blocks(images, NO_LABELS, forward=True, backward=False, purpose="predict")

    @property
    def input_grad(self):
        """dL/d(images), computed on first use after backward() (training never needs it)."""
        if not self._backward_done:
            raise RuntimeError(f"stage {self.name!r}: input_grad exists between backward() and update(); "
                               "call backward() first")
        if self._input_grad is None:
            if self.schedule == "layers":
                self._input_grad = self._step_backward(0, self._first_step_grad, need_dx=True).copy()
            else:
                self._input_grad = np.empty_like(self.images)
                self._run_blocks(self.images, self.labels, forward=False, backward=True, input_grad=self._input_grad)
        return self._input_grad

    # -- the block schedule: one parallel region a phase ------------------------------------------
    def _run_blocks(self, images, labels, forward, backward, input_grad=NO_INPUT_GRAD, purpose="train"):
        """``network.run_blocks`` on this batch; forward: the loss (with labels) and the logits; backward: the gradient."""
        batch, threads, allowed = images.shape[0], self.free_cores(), numba.get_num_threads()
        self.threads_used[threads] = self.threads_used.get(threads, 0) + 1
        buffers = self._block_buffers(batch, purpose)
        numba.set_num_threads(threads)      # the team itself, not only the work: a region waits for every thread it wakes
        try:
            network.run_blocks(self.program, self.params, images, labels, buffers.acts, buffers.switches,
                               buffers.grads, buffers.grad_copies, buffers.block_losses,
                               images[:0] if input_grad is None else input_grad, forward, backward, threads)
            if backward:
                network.gather_gradient(self.program, images, buffers.acts, buffers.grads, buffers.grad_copies,
                                        self.grad, threads)
        finally:
            numba.set_num_threads(allowed)
        if purpose == "train":                     # a new forward pass, or the gradient (and input_grad) of this one
            self._backward_done, self._input_grad = backward, input_grad
        if forward and labels.size:
            self.loss = float(buffers.block_losses.sum() / batch)
        last = self.program[-1]
        return buffers.acts[batch * last[network.OUT_START]:].reshape(batch, -1).copy()

    def _block_buffers(self, batch: int, purpose: str) -> BlockBuffers:
        key = ("blocks", batch, purpose)
        if key not in self._buffer_sets:
            self._forget_oldest_buffers()
            last = self.program[-1]
            per_sample = int(last[network.OUT_START] + last[network.C_OUT] * last[network.H_OUT] * last[network.W_OUT])
            blocks = -(-batch // network.BLOCK_SAMPLES)
            gradient_size = self.block_summed if purpose == "train" else 0     # predict never runs backward
            self._buffer_sets[key] = BlockBuffers(
                np.empty(batch * per_sample, self.dtype), np.empty(batch * per_sample, np.int64),
                np.empty(batch * per_sample, self.dtype), np.empty((blocks, gradient_size), self.dtype),
                np.zeros(blocks))
        return self._buffer_sets[key]

    def _forget_oldest_buffers(self):
        if len(self._buffer_sets) >= self.MAX_BUFFER_SETS:
            self._buffer_sets.pop(next(iter(self._buffer_sets)))

    # -- the layer schedule: every kernel call spread over the threads in turn ----------------------
    def _forward_by_layers(self):
        buffers = self._buffers(self.images.shape[0], "train")
        self.logits, self.step_inputs = self._forward_steps(self.images, buffers)
        self.step_buffers = buffers
        self.loss, self.dlogits = softmax_cross_entropy(self.logits, self.labels)
        self._backward_done, self._first_step_grad = False, None

    def _backward_by_layers(self):
        grad = self.dlogits
        for index in reversed(range(1, len(self.kernel_calls))):
            grad = self._step_backward(index, grad, need_dx=True)
        self._step_backward(0, grad, need_dx=False)
        self._first_step_grad, self._input_grad, self._backward_done = grad, None, True

    def _buffers(self, batch: int, purpose: str) -> Buffers:
        """The buffers of this batch size, made on first use (predict keeps its own set)."""
        key = ("layers", batch, purpose)
        if key not in self._buffer_sets:
            self._forget_oldest_buffers()
            shapes = self.net.activation_shapes()
            outputs, switches, input_grads = [], [], []
            for step in self.kernel_calls:
                shape_in, shape_out = shapes[step.first], shapes[step.first + len(step.layers)]
                pooled = step.kind in ("conv_relu_pool", "maxpool")
                outputs.append(np.empty((batch, *shape_out), self.dtype))
                switches.append(np.empty((batch, *shape_out), np.int64) if pooled else _no_switch(batch, 0))
                input_grads.append(np.empty((batch, *shape_in), self.dtype))
            self._buffer_sets[key] = Buffers(outputs, switches, input_grads)
        return self._buffer_sets[key]

    def _forward_steps(self, x, buffers: Buffers):
        """Run every step into its buffers; return the logits and each step's input."""
        inputs = []
        for step, out, switch in zip(self.kernel_calls, buffers.outputs, buffers.switches):
            inputs.append(x)
            params, layer = self.param_views[step.first], step.layers[0]
            if step.kind == "conv_relu_pool":
                pool = step.layers[2]
                conv_block_forward(x, params["W"], params["b"], layer.stride, layer.pad,
                                   True, pool.size, pool.stride, out, switch, numba.get_num_threads())
            elif step.kind == "conv":
                conv_block_forward(x, params["W"], params["b"], layer.stride, layer.pad,
                                   False, 0, 0, out, _no_switch(x.shape[0], layer.out_channels),
                                   numba.get_num_threads())
            elif step.kind == "relu":
                relu_kernel(x.reshape(-1), out.reshape(-1))
            elif step.kind == "maxpool":
                maxpool_kernel(x, layer.size, layer.stride, out, switch)
            elif step.kind == "flatten":
                out = x.reshape(x.shape[0], -1)
            else:
                dense_forward_kernel(x, params["W"], params["b"], out)
            x = out
        return x, inputs

    def _step_backward(self, index, grad_out, need_dx):
        """Backward through step ``index``: return dL/d(its input) (None if not need_dx), write its dW, db."""
        step, buffers = self.kernel_calls[index], self.step_buffers
        x, out, switch = self.step_inputs[index], buffers.outputs[index], buffers.switches[index]
        dx = buffers.input_grads[index]
        params, grads, layer = self.param_views[step.first], self.grad_views[step.first], step.layers[0]
        if step.kind in ("conv_relu_pool", "conv"):
            fused = step.kind == "conv_relu_pool"
            pool_size, pool_stride = (step.layers[2].size, step.layers[2].stride) if fused else (0, 0)
            if not fused:
                out, switch = grad_out, _no_switch(*grad_out.shape[:2])
            conv_block_backward(grad_out, out, switch, x, params["W"], layer.stride, layer.pad, fused,
                                pool_size, pool_stride, grads["W"], grads["b"], dx, need_dx, numba.get_num_threads())
        elif step.kind == "relu":
            relu_backward_kernel(grad_out.reshape(-1), out.reshape(-1), dx.reshape(-1))
        elif step.kind == "maxpool":
            maxpool_backward_kernel(grad_out, switch, layer.size, layer.stride, dx)
        elif step.kind == "flatten":
            return grad_out.reshape(x.shape)
        else:
            dense_backward_kernel(grad_out, x, params["W"], dx, grads["W"], grads["b"], need_dx)
        return dx if need_dx else None
