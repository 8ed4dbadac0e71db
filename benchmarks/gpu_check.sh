#!/usr/bin/env bash
# What a GPU machine runs for issue 17, in one pass (each part time-boxed, logs in $OUT):
# the cuda-marked tests, the GPU overhead benchmark (dkfac vs SGD vs kfac-pytorch), then the
# rest of the suite in parallel. Uses the machine's own python3 with torch (no network
# there: the project is installed without dependencies; kfac-pytorch comes as a wheel built
# from its public repository, passed as $KFAC_PYTORCH, or from the network where there is one).
#
#   OUT=runs/gpu_check KFAC_PYTORCH=.whl/kfac_pytorch-0.4.2-py3-none-any.whl \
#       bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-runs/gpu_check}
KFAC_PYTORCH=${KFAC_PYTORCH:-git+https://github.com/gpauloski/kfac-pytorch}
CUDA_TESTS_S=${CUDA_TESTS_S:-150}
BENCH_S=${BENCH_S:-300}
SUITE_S=${SUITE_S:-120}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
  nproc
} > "$OUT/machine.txt" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || echo "editable install failed (PYTHONPATH still points at src)" >> "$OUT/install.log"
echo "== cuda tests"
timeout -s INT "$CUDA_TESTS_S" python3 -m pytest -q -m cuda -p no:cacheprovider -rs tests \
  > "$OUT/cuda_tests.log" 2>&1
echo "cuda tests exit $?"; tail -5 "$OUT/cuda_tests.log"
echo "== benchmark"
timeout -s INT "$BENCH_S" python3 benchmarks/gpu_overhead.py --out "$OUT" \
  --install-kfac-pytorch "$KFAC_PYTORCH" --every-step-iters 3 > "$OUT/bench.log" 2>&1
echo "benchmark exit $?"; tail -40 "$OUT/bench.log"
echo "== suite"
timeout -s INT "$SUITE_S" python3 -m pytest -q -m "not slow and not cuda" -p no:cacheprovider \
  -n 14 tests > "$OUT/suite.log" 2>&1
echo "suite exit $?"; tail -25 "$OUT/suite.log"
