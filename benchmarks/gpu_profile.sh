#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh` (base group): where the time goes on the Llama-3-8B shape.
# benchmarks/kernel_profile.py splits a prefill and a decode step by kernel kind and a whole run by step kind;
# benchmarks/profile_step.py splits a synchronous step by phase (scheduling, input preparation, forward,
# sampling, output). Extra arguments go to both (e.g. `--attention-backend flashinfer`).
# Output in $OUT (the device tool's output folder) or ./gpu-out.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
timeout 300 python3 benchmarks/kernel_profile.py --step-times "$@" 2>&1 | grep -v -i warn | tee "$out/kernel-profile.txt"
timeout 200 python3 benchmarks/profile_step.py --output-len 64 "$@" 2>&1 | tail -16 | tee "$out/step-profile.txt"
