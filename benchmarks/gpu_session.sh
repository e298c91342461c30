#!/bin/sh
# Every GPU figure the course quotes, in parts that each fit one 10-minute call of a GPU machine.
# Results go to benchmarks/results/ (the device is in every file name); commit them afterwards.
#
#   sh benchmarks/gpu_session.sh check     # stage 7's gpu tests; cuda-ring and cuda-tuned beside PyTorch (eager
#                                          # and as one CUDA graph) on both networks; Nsight Compute kernel times
#   sh benchmarks/gpu_session.sh bench     # every gpu test; every stage + PyTorch, LeNet-5 b64 and AlexNet-small b128
#   sh benchmarks/gpu_session.sh profile   # stage 7's ablation, both networks
#   sh benchmarks/gpu_session.sh train     # cuda-tuned, LeNet-5, 10 epochs on MNIST
#   sh benchmarks/gpu_session.sh fused-net # stage 8: its gpu tests; cuda-tuned and cuda-fused-net beside PyTorch
#                                          # (eager and one CUDA graph) on both networks; Nsight Compute's time of
#                                          # each of its kernels (kernel 1 PREDICTED 25-70 us LeNet-5 b64, 339-568
#                                          # us AlexNet-small b128: kernels/fused_net_cost.py); 10 epochs of MNIST
#                                          # (about 3 minutes on an H200, 2026-11-28)
#   sh benchmarks/gpu_session.sh predict   # issue 22, ~3 min on an H200: everything the committed PREDICTION claims, measured —
#                                          # stages 4-7 on both networks (phase by phase and back to back), the
#                                          # ablation's two tiled-conv rows, Nsight Compute per kernel (if present);
#                                          # then predict-vs-measured-GPU-DATE.json: each prediction beside its measurement
#   sh benchmarks/gpu_session.sh a10       # assignment 10's solution kernels (untiled, tiled, register-blocked, and
#                                          # two slower variants) on a 2048^3 product: a10-tiled-dense-GPU-DATE.json
#
# The GPU machine may lack the Jupyter packages (nbformat): the test files that need them are then not
# collected, which pytest would count as errors; --continue-on-collection-errors runs the gpu tests of
# every other file (the GPU tests never need them).
#
# Parts chain: `sh benchmarks/gpu_session.sh bench train`. A GPU machine that cannot reach the
# network needs MNIST carried along (the four IDX .gz files in data/mnist/, git-ignored). numba-cuda
# 0.30.4 cannot import with numpy 2.5: where .whl/ holds a numpy wheel (pip download numpy==2.4.6
# for the machine's Python), it is installed into /tmp/site first and put on PYTHONPATH.
# Afterwards, on the development machine: `python -m cnn bench --update-readme` and
# `python -m cnn bench --update-docs` regenerate README and docs/profiling.md from the files.
set -u
export NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1
export CNN_DATA_DIR="${CNN_DATA_DIR:-data}"
PYTHON="${PYTHON:-python3}"
results=benchmarks/results
mkdir -p "$results"
[ $# -gt 0 ] || { echo "gpu_session.sh: which parts? check, bench, profile, train, fused-net, predict, a10" >&2; exit 2; }

if ls .whl/numpy-*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/numpy-*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" -c "import numpy, numba; from numba import cuda; print('numpy', numpy.__version__, 'numba', numba.__version__, cuda.get_current_device().name)"

ncu_kernels() {   # $1 model, $2 batch[, $3 stage]: every kernel of two training steps of the stage (cuda-tuned), Nsight Compute's times
    command -v ncu >/dev/null || { echo "ncu (Nsight Compute) is not on the PATH: no kernel table" >&2; return 0; }
    ncu --profile-from-start off --clock-control none --csv --log-file "$results/ncu-${3:-cuda-tuned}-$1-b$2.csv" \
        --metrics gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size,launch__registers_per_thread \
        "$PYTHON" -m cnn bench --profile "${3:-cuda-tuned}" --model "$1" --batch-size "$2" --data random --steps 2 --min-steps 1 --budget 1 \
        --out-dir "$results" > /dev/null
}

failures=0
run() {           # one measurement; a failure is reported and counted, the session goes on
    "$@" || { echo "gpu_session.sh: FAILED ($?): $*" >&2; failures=$((failures + 1)); }
}

for part in "$@"; do
    case "$part" in
    check)
        "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors tests/test_tiled_kernels.py tests/test_cuda_tuned.py \
            2>&1 | tee "$results/gpu-tests-stage7.log"
        run "$PYTHON" -m cnn bench --stage cuda-ring,cuda-tuned --model lenet5 --batch-size 64 --budget 15 --out-dir "$results"
        run "$PYTHON" -m cnn bench --stage cuda-ring,cuda-tuned --model alexnet-small --batch-size 128 --data random \
            --budget 15 --out-dir "$results"
        run ncu_kernels lenet5 64
        run ncu_kernels alexnet-small 128
        ;;
    bench)
        "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors 2>&1 | tee "$results/gpu-tests.log"
        run "$PYTHON" -m cnn bench --model lenet5 --batch-size 64 --stage numpy,numba-cpu,cuda,cuda-fused,cuda-ring,cuda-tuned \
            --out-dir "$results"
        run "$PYTHON" -m cnn bench --model alexnet-small --batch-size 128 --data random \
            --stage numba-cpu,cuda,cuda-fused,cuda-ring,cuda-tuned --out-dir "$results"
        ;;
    profile)
        for model_batch in "lenet5 64" "alexnet-small 128"; do
            set -- $model_batch
            run "$PYTHON" -m cnn bench --ablation --model "$1" --batch-size "$2" --out-dir "$results"
        done
        ;;
    ncu)                      # Nsight Compute kernel times of cuda-tuned, both networks
        run ncu_kernels lenet5 64
        run ncu_kernels alexnet-small 128
        ;;
    ablation-*)               # one model's ablation: ablation-lenet5-64, ablation-alexnet-small-128
        spec=${part#ablation-}
        run "$PYTHON" -m cnn bench --ablation --model "${spec%-*}" --batch-size "${spec##*-}" --out-dir "$results"
        ;;
    train)
        gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z')
        run "$PYTHON" -m cnn train --stage cuda-tuned --epochs 10 --no-progress \
            --out "$results/train-lenet5-cuda-tuned-10ep-$gpu-$(date +%F).json"
        ;;
    fused-net)                # stage 8 (issue 21)
        "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors tests/test_cuda_fused_net.py \
            2>&1 | tee "$results/gpu-tests-stage8.log"
        run "$PYTHON" -m cnn bench --stage cuda-tuned,cuda-fused-net --model lenet5 --batch-size 64 --budget 15 \
            --out-dir "$results"
        run "$PYTHON" -m cnn bench --stage cuda-tuned,cuda-fused-net --model alexnet-small --batch-size 128 \
            --data random --budget 15 --out-dir "$results"
        run ncu_kernels lenet5 64 cuda-fused-net
        run ncu_kernels alexnet-small 128 cuda-fused-net
        gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z')
        run "$PYTHON" -m cnn train --stage cuda-fused-net --epochs 10 --no-progress \
            --out "$results/train-lenet5-cuda-fused-net-10ep-$gpu-$(date +%F).json"
        ;;
    predict)                  # issue 22: what python -m cnn bench --predict claims, measured
        for model_batch in "lenet5 64 real" "alexnet-small 128 random"; do
            set -- $model_batch
            run "$PYTHON" -m cnn bench --stage cuda,cuda-fused,cuda-ring,cuda-tuned --model "$1" --batch-size "$2" \
                --data "$3" --budget 8 --reference none --out-dir "$results"
            run "$PYTHON" -m cnn bench --ablation --fixes tiled-conv --model "$1" --batch-size "$2" --out-dir "$results"
            run ncu_kernels "$1" "$2"
        done
        run "$PYTHON" -m cnn bench --predict --vs-measured --out-dir "$results"
        ;;
    a10)                      # the instructor guide's assignment-10 times, from a file (~1 minute)
        gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z')
        run "$PYTHON" assignments/instructor/time_a10.py --out "$results/a10-tiled-dense-$gpu-$(date +%F).json"
        ;;
    *)
        echo "gpu_session.sh: unknown part '$part' (check, bench, profile, train, fused-net, predict, a10, or ablation-MODEL-BATCH)" >&2
        exit 2
        ;;
    esac
done

if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu-results.tar.gz" "$results"
fi
echo "gpu_session.sh: $failures failed"
[ "$failures" -eq 0 ]
