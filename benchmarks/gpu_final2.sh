#!/usr/bin/env bash
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_cuda_graphs_gpu.py 2>&1 | grep -E "passed|failed|Error|graphs vs|assert" | tail -5 | tee "$out/graphs-test.log"
M="--model dummy:llama-3-8b --attention-backend triton"
timeout 150 kvforge bench serve $M --num-prompts 20 --input-len 512 --output-len 128 --request-rate 1 --server-process --json "$out/serve.json" 2>&1 | grep -v Warn | tail -12 | tee "$out/serve.txt"
timeout 150 kvforge bench latency $M --batch-size 64 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --json "$out/latency.json" 2>&1 | grep -v Warn | tail -3 | tee "$out/latency.txt"
