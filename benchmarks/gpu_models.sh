#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh` (base group; vllm-* groups for the `--vs vllm` rows): the
# model-coverage figures of docs/models.md, random weights of each shape, one fresh process per row
# (`kvforge bench`), JSON and tables to $OUT (the device tool's output folder) or ./gpu-out.
#   moe      W1 (256 x 512 x 256) on the Qwen3-30B-A3B and gpt-oss-20b shapes, kvforge then vLLM 0.26, same script
#   gemma    W1 and batch 1 (512 in, 128 out) on the Gemma-3-27B shape
#   kernel   benchmarks/fused_moe.py: the fused MoE kernel against torch (and vLLM's when importable)
#   w1       W1 on the Llama-3-8B shape (the hot-path regression check against docs/benchmarks.md)
#   bash benchmarks/gpu_models.sh [moe|gemma|kernel|w1] [engine flags...]
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
what=${1:-moe}; shift $(( $# > 0 ? 1 : 0 ))
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
W1=(--num-prompts 256 --input-len 512 --output-len 256)
B1=(--batch-size 1 --input-len 512 --output-len 128 --num-iters-warmup 2 --num-iters 5)
run() {  # run NAME TIMEOUT ARGS...: one fresh process, JSON to $out/NAME.json, its table to $out/NAME.txt
  local name=$1 limit=$2; shift 2
  timeout "$limit" kvforge bench "$@" --json "$out/$name.json" 2>&1 | grep -v -i warn | tail -8 | tee "$out/$name.txt"
}
case $what in
  moe)
    for m in qwen3-30b-a3b gpt-oss-20b; do
      run "w1-$m-vs-vllm" 560 throughput --model "dummy:$m" "${W1[@]}" --vs vllm --vllm-path /tmp/vsite "$@"
    done ;;
  gemma)
    run w1-gemma-3-27b 300 throughput --model dummy:gemma-3-27b "${W1[@]}" "$@"
    run b1-gemma-3-27b 200 latency --model dummy:gemma-3-27b "${B1[@]}" "$@" ;;
  kernel)
    timeout 300 python3 benchmarks/fused_moe.py --vllm-path /tmp/vsite --out "$out/fused_moe.json" 2>&1 | tee "$out/fused_moe.txt" | tail -40 ;;
  w1)
    run w1-llama-3-8b 200 throughput --model dummy:llama-3-8b "${W1[@]}" "$@" ;;
  *) echo "usage: $0 [moe|gemma|kernel|w1] [engine flags...]" >&2; exit 2 ;;
esac
