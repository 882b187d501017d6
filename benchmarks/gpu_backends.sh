#!/usr/bin/env bash
# On the GPU machine (after `source .gpu/install.sh` with the flashinfer, fa4a, fa4b and base groups):
# the attention backends' GPU tests and the attention benchmark. Output under $OUT (or ./gpu-out).
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
python3 -c "import flashinfer, torch; print('flashinfer', flashinfer.__version__, 'torch', torch.__version__)" 2>&1 | tail -1
python3 -c "from flash_attn.cute import flash_attn_varlen_func; print('fa4 ok')" 2>&1 | tail -1
timeout 420 python3 -m pytest -q -m gpu -x tests/gpu/test_triton_backend_gpu.py tests/gpu/test_cuda_graphs_gpu.py \
  tests/gpu/test_gpu_backends.py 2>&1 | tail -30 | tee "$out/gpu-tests.log"
timeout 150 python3 benchmarks/attention.py --json "$out/attention.json" 2>&1 | tail -30 | tee "$out/attention.txt"
