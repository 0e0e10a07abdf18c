#!/usr/bin/env bash
# GPU checks, run as one script on a machine with a CUDA device and PyTorch (python3). In order:
#   1. QACT's CUDA tests (tests/test_cuda.py -k qact: the Triton path against the eager torch path,
#      the compiled block against the eager one, a training step captured in a CUDA graph), 90 s;
#   2. benchmarks/bench_qact_compile.py on the GPU: BN-QACT-BN vs BN-ReLU-BN fwd+bwd at the four
#      benchmark shapes, eager, compiled and captured in a CUDA graph (both sides alike), and a
#      compiled ResNet-18 training step
#      (32x32, batch 128), QACT vs its bn-relu-bn twin, 200 s;
#   3. benchmarks/bench_evaluate_device.py on the GPU: evaluate() of a ResNet-18 on 10,000 32x32
#      images x 19 CIFAR-10-C corruptions x 5 severities (softmax, temperature, kNN heads): images
#      per second, the forward passes' share of the wall time, the GPU's busy share, 150 s;
#   4. the QACT benchmark on the machine's CPU cores, for the ratio, 150 s, and the evaluation on
#      64 images there, 60 s (500 took 738 s on 2 cores: the grid is 96 cells, each a forward pass);
#   5. the QACT paper's reference code beside shiftguard's QACT (benchmarks/bench_peer_qact.py), block
#      against block on the GPU, when a checkout of it is in .peer/quantile_activation (git-ignored:
#      carry it to the device machine), 60 s;
#   6. what is left of the budget: the remaining CUDA tests, benchmarks/bench_device.py and the
#      retrieval comparison benchmarks/bench_retrieval.py (shiftguard vs pytorch-metric-learning).
# Logs and JSON go to $OUT (default benchmarks/results/device); the script prints the path of each
# JSON file as it is written (bench_qact_compile_cuda.json, bench_qact_compile_cpu.json, ...).
#
# Time: each part runs under `timeout`, and never longer than what is left of DEADLINE_S (480 s =
# 8 minutes for the whole script), so a hang cannot take the budget of the parts after it; a part
# with under 10 s left is skipped and says so. A stopped part leaves its log (and the QACT
# benchmark's JSON the rows it finished).
#
# SMOKE=1: the reduced run this script is checked with on a machine without a GPU: tiny shapes
# (bench_qact_compile.py --smoke, compiled with aot_eager), the CUDA parts skipped with the reason
# printed, no retrieval comparison.
#
# Packages the image lacks (pytorch-metric-learning, faiss-cpu) are installed from .whl/ when
# present; the folder is git-ignored, so a copy of the tree must carry it along.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/device}
DEADLINE_S=${DEADLINE_S:-480}
SMOKE=${SMOKE:-0}
mkdir -p "$OUT"
SECONDS=0

# run_part CAP LOG COMMAND...: COMMAND under `timeout` of CAP seconds or of what is left of DEADLINE_S
# (less 10 s for the kill and the steps after it), whichever is less; its output is tee'd into LOG.
run_part() {
    local cap=$1 log=$2
    shift 2
    local left=$((DEADLINE_S - SECONDS - 10))
    if ((left < cap)); then cap=$left; fi
    if ((cap < 10)); then
        echo "skipped (${SECONDS} s of the ${DEADLINE_S} s budget spent): $*" | tee "$log"
        return 0
    fi
    echo "# timeout ${cap} s: $*" | tee "$log"
    timeout --kill-after=5 "$cap" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    if ((rc == 124 || rc == 137)); then echo "# STOPPED by timeout after ${cap} s" | tee -a "$log"; fi
    echo "# exit ${rc}; ${SECONDS} s into the script" | tee -a "$log"
}

: >"$OUT/gpu.txt"
# Not inside a pipeline: the exported PYTHONPATH must reach the parts below.
if ls .whl/*.whl >/dev/null 2>&1; then
    ls .whl/*.whl >>"$OUT/gpu.txt"
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >>"$OUT/gpu.txt" 2>&1; then
        export PYTHONPATH=/tmp/site
    else
        echo "# installing .whl/*.whl failed: the parts that need them report it" >>"$OUT/gpu.txt"
    fi
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"
    echo "cpu cores: $(getconf _NPROCESSORS_ONLN)"
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    $PY -c "import triton; print('triton', triton.__version__)" || echo "no triton: QACT runs its eager torch code on the GPU"
} 2>&1 | tee -a "$OUT/gpu.txt"
CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

if ((SMOKE)); then
    QARGS=(--smoke --backend aot_eager)
    EARGS=(--smoke)
else
    QARGS=()
    EARGS=()
fi
if ((CUDA)); then
    # pytest-timeout (in the image) stops a single hanging test after 90 s; without it the option is ignored.
    run_part 90 "$OUT/cuda_qact_tests.txt" $PY -m pytest -q -p no:cacheprovider -o addopts="" -o timeout=90 \
        --durations=10 tests/test_cuda.py -k qact
    run_part 200 "$OUT/bench_qact_compile_cuda.txt" $PY benchmarks/bench_qact_compile.py --device cuda --out "$OUT" \
        "${QARGS[@]}"
    run_part 150 "$OUT/bench_evaluate_device_cuda.txt" $PY benchmarks/bench_evaluate_device.py --device cuda \
        --out "$OUT" "${EARGS[@]}"
else
    echo "skipped: no CUDA device (QACT CUDA tests, GPU benchmarks; no GPU figure is measured)" |
        tee "$OUT/cuda_qact_tests.txt" "$OUT/bench_qact_compile_cuda.txt" "$OUT/bench_evaluate_device_cuda.txt"
fi
run_part 150 "$OUT/bench_qact_compile_cpu.txt" $PY benchmarks/bench_qact_compile.py --device cpu --out "$OUT" \
    "${QARGS[@]}"
run_part 60 "$OUT/bench_evaluate_device_cpu.txt" $PY benchmarks/bench_evaluate_device.py --device cpu --n 64 \
    --out "$OUT" "${EARGS[@]}"
PEER=.peer/quantile_activation
if [[ -d $PEER ]]; then
    if ((CUDA)); then PEER_DEVICE=cuda; else PEER_DEVICE=cpu; fi
    if ((CUDA)) || ((SMOKE)); then
        run_part 60 "$OUT/bench_peer_qact.txt" $PY benchmarks/bench_peer_qact.py --peer "$PEER" \
            --device "$PEER_DEVICE" --out "$OUT" "${EARGS[@]}"
    fi
else
    echo "skipped: no checkout of the reference QACT code in $PEER (the peer figure)" | tee "$OUT/bench_peer_qact.txt"
fi
if ((CUDA)); then
    run_part 100 "$OUT/cuda_tests.txt" $PY -m pytest -q -p no:cacheprovider -o addopts="" -o timeout=90 \
        --durations=15 tests/test_cuda.py -k "not qact" "tests/test_corruptions.py::test_runs_on_gpu_with_the_same_contract"
    run_part 150 "$OUT/bench_device.txt" $PY benchmarks/bench_device.py --out "$OUT"
fi
if ((SMOKE)); then
    echo "skipped in SMOKE mode: the retrieval comparison" | tee "$OUT/bench_retrieval.txt"
else
    run_part 240 "$OUT/bench_retrieval.txt" $PY benchmarks/bench_retrieval.py --sizes 100000 300000 --repeats 1 \
        --pml-cap-gb 60 --out "$OUT/bench_retrieval.json"
fi
echo "device_check: ${SECONDS} s; files in $OUT:"
ls -l "$OUT"
