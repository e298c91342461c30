#!/bin/sh
# Regenerate the committed benchmark results of this machine, then README's results table.
#
#   CNN_DATA_DIR=/path/to/data sh benchmarks/reproduce.sh
#
# 1. the demo, told to write into the committed folder (make demo writes to results/): every available
#    stage timed (LeNet-5, batch 64, real MNIST) -> benchmarks/results/bench-lenet5-b64-*.json
#    and its speedup/breakdown plots; the fastest stage trained one epoch, the learning pictures
#    (digits-learning.png, filters.png, learning-curves.png, ...) written beside them
# 2. host<->device copies against size (host memcpy on a machine without a GPU)
# 3. README.md's tables between the bench-table markers (the newest run of each machine and workload,
#    and older runs that timed stages no newer one did) and its GPU findings; then the measured blocks
#    of docs/profiling.md and the stage docstrings (GPU files only: unchanged unless those changed)
# Run it on a quiet machine: the results note the load average they were taken under.
set -e
python -m cnn bench --demo --out-dir benchmarks/results
python -m cnn bench --memory --out-dir benchmarks/results
python -m cnn bench --update-readme
python -m cnn bench --update-docs
