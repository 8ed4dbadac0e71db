#!/usr/bin/env bash
# What a GPU machine runs for issue 17, in one pass (each part time-boxed, logs in $OUT): the
# GPU overhead benchmark (dkfac with default and bf16 statistics products vs SGD vs
# kfac-pytorch; ResNet-50 every configuration, ResNet-32 the amortised ones) while the GPU is
# quiet, then `make test`'s selection (`-m "not slow"`, the cuda-marked tests included) in
# parallel. Uses the machine's own python3 with torch (no network there: the project is
# installed without dependencies; kfac-pytorch comes as a wheel built from its public
# repository, passed as $KFAC_PYTORCH, or from the network where there is one).
#
#   OUT=runs/gpu_check KFAC_PYTORCH=.whl/kfac_pytorch-0.4.2-py3-none-any.whl \
#       bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-runs/gpu_check}
KFAC_PYTORCH=${KFAC_PYTORCH:-git+https://github.com/gpauloski/kfac-pytorch}
BENCH50_S=${BENCH50_S:-200}
BENCH32_S=${BENCH32_S:-60}
SUITE_S=${SUITE_S:-400}
WORKERS=${WORKERS:-15}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
  nproc
} > "$OUT/machine.txt" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || echo "editable install failed (PYTHONPATH still points at src)" >> "$OUT/install.log"
amortised=dkfac_eigen_10_100,dkfac_inverse_10_100,dkfac-bf16_eigen_10_100,dkfac-bf16_inverse_10_100
echo "== benchmark: ResNet-50, every configuration"
timeout -s INT "$BENCH50_S" python3 benchmarks/gpu_overhead.py --models resnet50 \
  --out "$OUT/resnet50" --install-kfac-pytorch "$KFAC_PYTORCH" --every-step-iters 3 \
  > "$OUT/bench_resnet50.log" 2>&1
echo "exit $?"; tail -22 "$OUT/bench_resnet50.log"
echo "== benchmark: ResNet-32, amortised"
timeout -s INT "$BENCH32_S" python3 benchmarks/gpu_overhead.py --models resnet32 \
  --out "$OUT/resnet32" --install-kfac-pytorch "$KFAC_PYTORCH" --host-waits "" \
  --configs "$amortised,kfac-pytorch_eigen_10_100,kfac-pytorch_inverse_10_100" \
  > "$OUT/bench_resnet32.log" 2>&1
echo "exit $?"; tail -12 "$OUT/bench_resnet32.log"
echo "== make test's selection (cuda tests included), $WORKERS workers"
timeout -s INT "$SUITE_S" python3 -m pytest -q -m "not slow" -p no:cacheprovider -rs \
  -n "$WORKERS" --junitxml "$OUT/suite.xml" tests > "$OUT/suite.log" 2>&1
echo "suite exit $?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/suite.log" | tail -25
