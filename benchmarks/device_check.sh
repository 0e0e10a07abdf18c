#!/usr/bin/env bash
# GPU checks, run as one script on a machine with a CUDA device and PyTorch (python3):
# the CUDA tests and benchmarks/bench_device.py. Logs and JSON go to $OUT (default
# benchmarks/results/device). Meant to finish within 5 minutes on one H100/H200.
# Packages the image lacks (pytorch-metric-learning) are taken from .whl/ when present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/device}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py \
    "tests/test_corruptions.py::test_runs_on_gpu_with_the_same_contract" 2>&1 | tee "$OUT/cuda_tests.txt"
timeout 200 python3 benchmarks/bench_device.py --out "$OUT" 2>&1 | tee "$OUT/bench_device.txt"
