#!/usr/bin/env bash
# GPU checks, run as one script on a machine with a CUDA device and PyTorch (python3): the CUDA
# tests, benchmarks/bench_device.py and, on the machine's CPU cores, the retrieval comparison
# benchmarks/bench_retrieval.py (shiftguard vs pytorch-metric-learning's AccuracyCalculator at 100k
# and 300k embeddings). Logs and JSON go to $OUT (default benchmarks/results/device), six files:
# gpu.txt, cuda_tests.txt, bench_device.txt, bench_device.json, bench_retrieval.txt,
# bench_retrieval.json.
#
# Time: each part runs under `timeout` (CUDA tests 150 s, bench_device 200 s, retrieval 240 s), and
# never longer than what is left of DEADLINE_S (510 s = 8.5 minutes for the whole script), so a hang
# cannot take the budget of the parts after it; a part with under 10 s left is skipped and says so.
# A stopped part leaves its log (and bench_retrieval.json the sizes it finished).
#
# Packages the image lacks (pytorch-metric-learning, faiss-cpu) are installed from .whl/ when
# present; the folder is git-ignored, so a copy of the tree must carry it along.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/device}
DEADLINE_S=${DEADLINE_S:-510}
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
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    echo "cpu cores: $(getconf _NPROCESSORS_ONLN)"
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
    python3 -c "import faiss, pytorch_metric_learning as p; print('faiss', faiss.__version__, '| pml', p.__version__)"
} 2>&1 | tee -a "$OUT/gpu.txt"

# pytest-timeout (in the image) stops a single hanging test after 90 s; without it the option is ignored.
run_part 150 "$OUT/cuda_tests.txt" python3 -m pytest -q -p no:cacheprovider -o addopts="" -o timeout=90 \
    --durations=15 tests/test_cuda.py "tests/test_corruptions.py::test_runs_on_gpu_with_the_same_contract"
run_part 200 "$OUT/bench_device.txt" python3 benchmarks/bench_device.py --out "$OUT"
run_part 240 "$OUT/bench_retrieval.txt" python3 benchmarks/bench_retrieval.py --sizes 100000 300000 --repeats 1 \
    --pml-cap-gb 60 --out "$OUT/bench_retrieval.json"
echo "device_check: ${SECONDS} s; files in $OUT:"
ls -l "$OUT"
