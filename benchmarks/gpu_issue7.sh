#!/usr/bin/env bash
# Issue 7 on the GPU machine, after `source .gpu/install.sh`:
#   bash benchmarks/gpu_issue7.sh tests    # every gpu-marked test
#   bash benchmarks/gpu_issue7.sh profile  # kernel split of prefill/decode steps, step kinds of a run
#   bash benchmarks/gpu_issue7.sh bench    # throughput vs transformers, sync ablation, latency, serving
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
M="--model dummy:llama-3-8b"
case "${1:-bench}" in
tests)
  timeout 500 python3 -m pytest -q -s -m gpu tests/gpu tests/core/test_swap.py tests/plugins/scheduling 2>&1 \
    | grep -E "passed|failed|Error|assert|identical|difference|graphs vs" | tail -20 | tee "$out/gpu-tests.log" ;;
profile)
  timeout 300 python3 benchmarks/kernel_profile.py --step-times 2>&1 | grep -v -i warn | tee "$out/kernel-profile.txt" ;;
bench)
  timeout 240 kvforge bench throughput $M --num-prompts 256 --input-len 512 --output-len 256 \
    --vs hf-generate --hf-batch-size 256 --json "$out/throughput.json" 2>&1 | grep -v -i warn | tail -8 | tee "$out/throughput.txt"
  timeout 120 kvforge bench throughput $M --num-prompts 256 --input-len 512 --output-len 256 --no-async-scheduling \
    --json "$out/throughput-sync.json" 2>&1 | grep -v -i warn | tail -1 | tee "$out/throughput-sync.txt"
  timeout 120 kvforge bench throughput $M --num-prompts 256 --input-len 512 --output-len 256 \
    --max-num-batched-tokens 16384 --json "$out/throughput-16k.json" 2>&1 | grep -v -i warn | tail -1 | tee "$out/throughput-16k.txt"
  timeout 120 kvforge bench latency $M --batch-size 64 --input-len 1024 --output-len 64 --num-iters-warmup 2 \
    --num-iters 5 --json "$out/latency.json" 2>&1 | grep -v -i warn | tail -4 | tee "$out/latency.txt"
  timeout 150 kvforge bench serve $M --num-prompts 20 --input-len 512 --output-len 128 --request-rate 1 \
    --server-process --json "$out/serve.json" 2>&1 | grep -v -i warn | tail -8 | tee "$out/serve.txt" ;;
esac
