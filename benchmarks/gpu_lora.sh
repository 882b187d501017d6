#!/usr/bin/env bash
# On the GPU machine (H200), with the base and vllm-* groups brought (shared/gpu/README.md): the LoRA target of
# the issue. First the LoRA GPU tests (tests/gpu/test_lora*_gpu.py, log in tests.txt), then benchmarks/lora_w1.py:
# W1 (256 x 512 in x 256 out) on the Llama-3-8B shape, request i under adapter i % 8 (rank 16), as (a) kvforge's
# base model, (b) kvforge + the 8 adapters, (c) vLLM 0.26 + the same 8 adapters, each in a process of its own.
# Under $OUT (or ./gpu-out): lora_w1.json (written after each side, so a run cut short keeps what it measured),
# lora_w1.txt (the table and the two targets), lora_w1.log (everything, vLLM's log lines prefixed [vllm]).
#   bash benchmarks/gpu_lora.sh [all|tests|bench] [--no-vllm] [more benchmarks/lora_w1.py flags]
# BUDGET (default 580): the seconds the whole command may take; the benchmark gets what the tests leave.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
what=all
case ${1:-} in all|tests|bench) what=$1; shift ;; esac
source .gpu/install.sh > /dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
if [[ $what != bench ]]; then
  timeout 180 python3 -m pytest -q -rfEs -p no:cacheprovider tests/gpu/test_lora*_gpu.py > "$out/tests.txt" 2>&1
  echo "== LoRA GPU tests (exit $?)"; tail -15 "$out/tests.txt"
fi
if [[ $what != tests ]]; then
  limit=$(( ${BUDGET:-580} - SECONDS )); (( limit < 60 )) && limit=60
  timeout "$limit" python3 benchmarks/lora_w1.py --vllm-path /tmp/vsite --out "$out/lora_w1.json" "$@" \
    > "$out/lora_w1.log" 2>&1
  echo "== lora_w1 (exit $?, limit $limit s)"
  # the table and the verdicts: from the workload line on, without vLLM's lines and warnings
  grep -v -i -e warn -e '^\[vllm\]' "$out/lora_w1.log" | sed -n '/ on .*requests, /,$p' | tee "$out/lora_w1.txt"
  [ -s "$out/lora_w1.txt" ] || tail -40 "$out/lora_w1.log"
fi
