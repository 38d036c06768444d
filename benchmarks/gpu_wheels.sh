#!/usr/bin/env bash
# Fetch, here, the wheels the GPU machine lacks (it has no network) into .whl/ (git-ignored), for
# benchmarks/gpu_check.sh to install there: optree (zfunc needs it) and isal (the swap files' fast crc32),
# built for that machine's CPython 3.12 on x86-64. Pass other NAME==VERSION to fetch those as well.
#
#   bash benchmarks/gpu_wheels.sh                  # then: device run, carry [".whl"], bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for spec in optree==0.20.0 isal==1.9.1 "$@"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
ls -l .whl
