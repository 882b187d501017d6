#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh` (base group; flashinfer and fa4a/fa4b for those backends'
# tests, which skip without them): every gpu-marked test, wherever it lives (tests/gpu, and the GPU cases of
# tests/core and tests/plugins). Extra arguments go to pytest (e.g. `-x tests/gpu/test_cuda_graphs_gpu.py`).
# The whole log is kept in $OUT (the device tool's output folder) or ./gpu-out.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 540 python3 -m pytest -q -m gpu -rfEs "$@" > "$out/gpu-tests.log" 2>&1
status=$?
tail -30 "$out/gpu-tests.log"
exit $status
