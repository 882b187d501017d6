#!/usr/bin/env bash
# On the GPU machine: engine throughput per attention backend (Llama-3-8B shape, random bf16 weights),
# transformers generate in the same run, and the step profile. Output under $OUT (or ./gpu-out).
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
W="--model dummy:llama-3-8b --num-prompts 256 --input-len 512 --output-len 256"
for b in triton flashinfer flash_attn; do
  timeout 150 python3 benchmarks/throughput.py $W --attention-backend $b --json "$out/tp-$b.json" 2>&1 | grep -v Warn | tail -3 | tee -a "$out/throughput.txt"
done
timeout 120 python3 benchmarks/throughput.py $W --attention-backend triton --enforce-eager --json "$out/tp-triton-eager.json" 2>&1 | grep -v Warn | tail -2 | tee -a "$out/throughput.txt"
timeout 150 python3 benchmarks/profile_step.py --model dummy:llama-3-8b --num-prompts 256 --input-len 512 --output-len 64 --attention-backend triton 2>&1 | tail -16 | tee "$out/profile.txt"
