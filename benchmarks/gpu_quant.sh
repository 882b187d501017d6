#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh` (base group; vllm-* groups for `vllm`): the quantization
# figures of docs/quantization.md on the Llama-3-8B shape with random weights quantized on load, one fresh
# process per row (`kvforge bench`), JSON and tables to $OUT (the device tool's output folder) or ./gpu-out.
#   kernels   benchmarks/quant_kernels.py: per-layer GEMM times, bf16 vs fp8 (_scaled_mm / Triton) vs int4
#   engine    W1 (256 x 512 x 256) and batch 1 (512 in, 128 out) for bf16, fp8 (both GEMMs) and int4
#   kv        W2-like long context (512 prompts, 1024 +-90% in, 256 +-90% out) with a bf16 and an fp8 KV cache
#   vllm      vLLM 0.26 --quantization fp8 on W1 and batch 1 in the same script as kvforge fp8
#   bash benchmarks/gpu_quant.sh [kernels|engine|kv|vllm] [engine flags...]
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
what=${1:-engine}; shift $(( $# > 0 ? 1 : 0 ))
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
M=(--model dummy:llama-3-8b "$@")
W1=(--num-prompts 256 --input-len 512 --output-len 256)
B1=(--batch-size 1 --input-len 512 --output-len 128 --num-iters-warmup 2 --num-iters 5)
run() {  # run NAME TIMEOUT ARGS...: one fresh process, JSON to $out/NAME.json, its table to $out/NAME.txt
  local name=$1 limit=$2; shift 2
  timeout "$limit" kvforge bench "$@" --json "$out/$name.json" 2>&1 | grep -v -i warn | tail -8 | tee "$out/$name.txt"
}
triton_gemm=$(mktemp --suffix .toml); printf '[plugins.fp8]\ngemm = "triton"\n' > "$triton_gemm"
case $what in
  kernels)
    timeout 300 python3 benchmarks/quant_kernels.py --out "$out/quant_kernels.json" 2>&1 | tee "$out/quant_kernels.txt" | tail -80
    timeout 240 python3 benchmarks/quant_kernels.py --sweep 2>&1 | tee "$out/quant_sweep.txt" | tail -60 ;;
  engine)
    for q in bf16 fp8 fp8-triton int4; do
      case $q in bf16) a=() ;; fp8) a=(--quantization fp8) ;; fp8-triton) a=(--quantization fp8 --config "$triton_gemm") ;;
                 int4) a=(--quantization int4) ;; esac
      run "w1-$q" 200 throughput "${M[@]}" "${W1[@]}" "${a[@]}"
      run "b1-$q" 150 latency "${M[@]}" "${B1[@]}" "${a[@]}"
    done ;;
  kv)
    for kv in auto fp8; do
      run "w2-kv-$kv" 300 throughput "${M[@]}" --dataset uniform --num-prompts 512 --input-len 1024 --output-len 256 \
        --range-ratio 0.9 --kv-cache-dtype "$kv"
    done ;;
  vllm)
    run w1-fp8-vs-vllm 500 throughput "${M[@]}" "${W1[@]}" --quantization fp8 --vs vllm --vllm-path /tmp/vsite
    run b1-fp8-vs-vllm 400 latency "${M[@]}" "${B1[@]}" --quantization fp8 --vs vllm --vllm-path /tmp/vsite ;;
  *) echo "usage: $0 [kernels|engine|kv|vllm] [engine flags...]" >&2; exit 2 ;;
esac
