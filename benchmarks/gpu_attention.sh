#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh` with the base, flashinfer, fa4a and fa4b groups: one
# attention layer per backend (benchmarks/attention.py: decode and prefill cases, Llama-3-8B heads, block
# size 16); a backend whose library is missing is skipped and says why. Extra arguments go to attention.py
# (e.g. `--block-size 128`). Output in $OUT (the device tool's output folder) or ./gpu-out.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
python3 -c "from flash_attn.cute import flash_attn_varlen_func; print('flash_attn.cute (FA4) ok')" 2>&1 | tail -1
timeout 300 python3 benchmarks/attention.py --json "$out/attention.json" "$@" 2>&1 | tail -30 | tee "$out/attention.txt"
