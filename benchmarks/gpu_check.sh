#!/usr/bin/env bash
# The whole GPU check in one command, for the lent GPU machine as it is (Python 3.12, torch 2.11 + CUDA 13,
# cupy-cuda13x, numba; no network; no optree): installs what is missing from wheels carried in .whl/
# (benchmarks/gpu_wheels.sh fetches them here), records the environment, compiles every kernel with the
# machine's NVRTC (registers, spills), runs `pytest -m gpu -x` (GPU_CHECK_MAXFAIL=N: up to N failures) and benchmarks/gpu.py, and writes all of it
# (GPU_CHECK_NVRTC=0 / GPU_CHECK_PYTEST=0 skip a stage, GPU_CHECK_ONLY=a,b runs only those figures: a second call's split)
# under $OUT (default out/gpu_check), in under 8 minutes (each stage under a timeout; the benchmark gets
# what is left).
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine (device tool: carry [".whl"])
#   bash benchmarks/gpu_check.sh --dry-run  # here, without CUDA: the same stages, each checked, nothing timed
#
# Files under $OUT: check.log (this script's whole output), env.txt, nvrtc.txt, pytest.log, pytest.xml,
# gpu.json, gpu.txt. Exit status: 0 when every stage passed, else the number of stages that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "gpu_check.sh: unknown argument '$1' (expected --dry-run or nothing)" >&2; exit 2 ;;
esac
OUT="${OUT:-$PWD/out/gpu_check}"
mkdir -p "$OUT"
LIMIT_S="${GPU_CHECK_LIMIT_S:-470}"  # the whole check; the device lends 8 minutes for it
export PYTHONUNBUFFERED=1
SECONDS=0
FAILED=0

stage() { echo; echo "== [$SECONDS s] $*"; }
fail() { echo "FAILED: $*"; FAILED=$((FAILED + 1)); }

check() {

stage "wheels (.whl/)"
SITE=""
shopt -s nullglob
WHEELS=(.whl/*.whl)
if [ ${#WHEELS[@]} -eq 0 ]; then
  echo "no wheels in .whl/ (benchmarks/gpu_wheels.sh fetches optree for the GPU machine's Python 3.12)"
else
  printf '  %s\n' "${WHEELS[@]}"
  for w in "${WHEELS[@]}"; do
    case "$w" in *cp312*manylinux*x86_64*|*py3-none-any*) ;; *) fail "wheel $w is not for CPython 3.12 on x86-64";; esac
  done
  if [ $DRY -eq 0 ]; then
    SITE=/tmp/zfunc-site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "${WHEELS[@]}" || fail "pip install of the carried wheels"
  fi
fi
export PYTHONPATH="$PWD${SITE:+:$SITE}"

stage "environment"
{
  date -u
  [ $DRY -eq 0 ] && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 - <<'EOF'
import importlib.metadata as md, importlib.util, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
for name in ("optree", "numba", "numpy", "cupy-cuda13x", "nvidia-cuda-nvrtc", "transformers", "isal", "pytest"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "MISSING")
print("zfunc from", importlib.util.find_spec("zfunc").origin)
EOF
} 2>&1 | tee "$OUT/env.txt"
python3 -c "import zfunc, optree" || fail "import zfunc (optree must be importable: carry its wheel in .whl/)"
if [ $DRY -eq 0 ]; then
  python3 -c "import torch, cupy; assert torch.cuda.is_available(), 'no CUDA device'" || fail "CUDA and CuPy"
fi

stage "NVRTC: every kernel compiled for sm_90 (registers, spills)"
if [ "${GPU_CHECK_NVRTC:-1}" = 0 ]; then
  echo "skipped (GPU_CHECK_NVRTC=0)" | tee "$OUT/nvrtc.txt"
elif python3 -c "import cupy_backends" 2>/dev/null; then
  timeout 120 python3 -m zfunc.ops.gpu.nvrtc sm_90 > "$OUT/nvrtc.txt" 2>&1 || fail "NVRTC compile (see nvrtc.txt)"
  cat "$OUT/nvrtc.txt"
else
  echo "cupy_backends not installed: skipped" | tee "$OUT/nvrtc.txt"
fi

stage "pytest -m gpu -x"
# the kernels first (the engine rests on them), then the engine, then every other file with gpu tests
TESTS="tests/test_gpu_kernels.py tests/test_gpu_engine.py $(grep -l "pytest.mark.gpu" tests/test_*.py \
  | grep -v -e test_markers.py -e test_gpu_kernels.py -e test_gpu_engine.py | tr '\n' ' ')"
echo "files: $TESTS"
if [ "${GPU_CHECK_PYTEST:-1}" = 0 ]; then
  echo "skipped (GPU_CHECK_PYTEST=0)" > "$OUT/pytest.log"
elif [ $DRY -eq 1 ]; then
  timeout 120 python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider $TESTS > "$OUT/pytest.log" 2>&1 \
    || fail "pytest collection (see pytest.log)"
else
  # GPU_CHECK_MAXFAIL=N lets a first run on a new machine report up to N failures instead of stopping at one
  timeout 230 python3 -m pytest -m gpu --maxfail="${GPU_CHECK_MAXFAIL:-1}" -q -p no:cacheprovider -rfEs --junitxml="$OUT/pytest.xml" $TESTS \
    > "$OUT/pytest.log" 2>&1 || fail "pytest -m gpu (see pytest.log)"
fi
tail -n 25 "$OUT/pytest.log"

stage "benchmarks/gpu.py"
LEFT=$((LIMIT_S - SECONDS - 20))
if [ $DRY -eq 1 ]; then
  timeout 300 python3 benchmarks/gpu.py "$OUT" --dry-run --budget-s 240 ${GPU_CHECK_ONLY:+--only "$GPU_CHECK_ONLY"} \
    || fail "benchmarks/gpu.py --dry-run"
elif [ $LEFT -lt 60 ]; then
  fail "benchmarks/gpu.py: only $LEFT s left of $LIMIT_S"
else
  # GPU_CHECK_ONLY=a,b runs only those figures (benchmarks/gpu.py --only): a rerun for what the last one missed
  timeout $((LEFT + 15)) python3 benchmarks/gpu.py "$OUT" --budget-s "$LEFT" --host-gib 110 \
    ${GPU_CHECK_ONLY:+--only "$GPU_CHECK_ONLY"} || fail "benchmarks/gpu.py"
fi
for f in gpu.json gpu.txt; do [ -s "$OUT/$f" ] || fail "benchmarks/gpu.py wrote no $f"; done

stage "done in $SECONDS s: $FAILED stage(s) failed; files in $OUT"
ls -l "$OUT"
return $FAILED
}

check 2>&1 | tee "$OUT/check.log"
exit "${PIPESTATUS[0]}"
