#!/usr/bin/env bash
# On the GPU machine (base group only): CUDA-graph test, decode latency vs its floor, throughput vs
# transformers, serving latency at 1 req/s with cold start. Output under $OUT (or ./gpu-out).
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_cuda_graphs_gpu.py 2>&1 | grep -E "passed|failed|Error" | tail -3 | tee "$out/graphs-test.log"
M="--model dummy:llama-3-8b --attention-backend triton"
timeout 120 kvforge bench latency $M --batch-size 64 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 3 --json "$out/latency.json" 2>&1 | grep -v Warn | tail -6 | tee "$out/latency.txt"
timeout 200 kvforge bench throughput $M --num-prompts 256 --input-len 512 --output-len 256 --vs hf-generate --hf-batch-size 256 --json "$out/throughput.json" 2>&1 | grep -v Warn | tail -5 | tee "$out/throughput.txt"
timeout 150 kvforge bench serve $M --num-prompts 24 --input-len 512 --output-len 128 --request-rate 1 --server-process --json "$out/serve.json" 2>&1 | grep -v Warn | tail -8 | tee "$out/serve.txt"
