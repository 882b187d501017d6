#!/usr/bin/env bash
# On the GPU machine (after `source .gpu/install.sh`): the core engine's GPU tests and throughput figures.
# Writes logs and JSON to $OUT (the device tool's output folder) or ./gpu-out.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -m gpu tests/gpu 2>&1 | tail -15 | tee "$out/gpu-tests.log"
python3 benchmarks/throughput.py --model dummy:llama-3-8b --num-prompts 256 --input-len 512 --output-len 256 \
  --attention-backend torch --vs hf-generate --hf-batch-size 256 --json "$out/llama3-8b.json" 2>&1 | grep -v Warn | tail -6 | tee "$out/llama3-8b.txt"
DEFAULT_GGUF=$(python3 -c "from kvforge.model_loader import default_model_path as d; print(d())")
python3 benchmarks/throughput.py --model "$DEFAULT_GGUF" --num-prompts 256 --input-len 512 --output-len 256 \
  --attention-backend torch --vs hf-generate --hf-batch-size 256 --json "$out/smollm2.json" 2>&1 | grep -v Warn | tail -6 | tee "$out/smollm2.txt"
