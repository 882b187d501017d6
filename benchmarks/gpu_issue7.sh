#!/usr/bin/env bash
# Issue 7 on the GPU machine (after `source .gpu/install.sh`): GPU tests, kernel profile, throughput.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -q -x -m gpu tests/gpu tests/core/test_swap.py 2>&1 | grep -E "passed|failed|Error|assert|identical" | tail -8 | tee "$out/gpu-tests.log"
timeout 200 python3 benchmarks/kernel_profile.py --runs 2 --step-times 2>&1 | grep -v -i warn | tee "$out/kernel-profile.txt" | grep -E "==|gemm|elementwise|attention|kind|only|carrying|steps"
