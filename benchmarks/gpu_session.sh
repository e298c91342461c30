#!/bin/sh
# What the CUDA stages owe to a real GPU, in parts that each fit one 10-minute call of the device
# tool, every result written to benchmarks/results/ and packed into $OUT/gpu-results.tar.gz.
#
#   sh benchmarks/gpu_session.sh tests     # NUMBA_ENABLE_CUDASIM=0 pytest -m gpu (full-size checks)
#   sh benchmarks/gpu_session.sh bench     # every stage + PyTorch, LeNet-5 b64 (MNIST) and AlexNet-small b128
#   sh benchmarks/gpu_session.sh profile   # cuda-ring's profile and timeline, stage 7's ablation, census
#   sh benchmarks/gpu_session.sh train     # cuda-fused and cuda-tuned, LeNet-5, 10 epochs on MNIST
#
# A GPU machine that cannot reach the network needs MNIST carried along: copy the four IDX .gz
# files into data/mnist/ (git-ignored, 11 MB) and name `data` in the device tool's `carry`.
# Afterwards, on the development machine: unpack the archive at the repository root, then
# `python -m cnn bench --update-readme`, fill the "not yet measured on a GPU" tables of
# cnn/stages/s5_cuda_fused.py, s7_cuda_tuned.py and docs/profiling.md, and commit.
set -eu
export NUMBA_ENABLE_CUDASIM=0
export CNN_DATA_DIR="${CNN_DATA_DIR:-data}"
results=benchmarks/results
mkdir -p "$results"

part="${1:?which part: tests, bench, profile or train}"
case "$part" in
tests)
    python -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$results/gpu-tests.log"
    ;;
bench)
    python -m cnn bench --model lenet5 --batch-size 64
    python -m cnn bench --stages numpy,numba-cpu,cuda,cuda-fused,cuda-ring,cuda-tuned \
        --model alexnet-small --batch-size 128 --data random
    ;;
profile)
    for model_batch in "lenet5 64" "alexnet-small 128"; do
        set -- $model_batch
        python -m cnn bench --profile cuda-ring --model "$1" --batch-size "$2" --data random \
            > "$results/profile-cuda-ring-$1.txt"
        python -m cnn bench --timeline --model "$1" --batch-size "$2" --steps 20
        python -m cnn bench --ablation --model "$1" --batch-size "$2"
        python -m cnn bench --profile cuda-tuned --model "$1" --batch-size "$2" --data random \
            > "$results/profile-cuda-tuned-$1.txt"
    done
    python -m cnn bench --census > "$results/census.txt"
    ;;
train)
    for stage in cuda-fused cuda-tuned; do
        python -m cnn train --stage "$stage" --epochs 10 --out "$results/train-lenet5-$stage-gpu.json"
    done
    ;;
*)
    echo "gpu_session.sh: unknown part '$part' (tests, bench, profile or train)" >&2
    exit 2
    ;;
esac

if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu-results.tar.gz" "$results"
fi
