#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh` (base group): the engine benchmarks of docs/benchmarks.md
# on the Llama-3-8B shape with random bf16 weights (`kvforge bench`, one fresh process per row):
#   throughput  256 x 512 in x 256 out (W1) with transformers `generate` in the same run, then the same
#               workload with --no-async-scheduling and with --max-num-batched-tokens 16384
#   latency     batch 64, 1024 in, 64 out: decode step against its bandwidth floor
#   serve       20 streaming requests at 1 req/s against a `kvforge serve` process (cold start included)
#   bash benchmarks/gpu_bench.sh [all|throughput|latency|serve] [engine flags...]
# Extra flags go to every run, e.g. `bash benchmarks/gpu_bench.sh throughput --attention-backend flashinfer`.
# JSON and tables go to $OUT (the device tool's output folder) or ./gpu-out; copy a run's JSON that a doc
# quotes to benchmarks/results/.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
what=${1:-all}; shift $(( $# > 0 ? 1 : 0 ))
case $what in all|throughput|latency|serve) ;; *) echo "usage: $0 [all|throughput|latency|serve] [engine flags...]" >&2; exit 2 ;; esac
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
M=(--model dummy:llama-3-8b "$@")
W1=(--num-prompts 256 --input-len 512 --output-len 256)
run() {  # run NAME TIMEOUT ARGS...: one fresh process, JSON to $out/NAME.json, its table to $out/NAME.txt
  local name=$1 limit=$2; shift 2
  timeout "$limit" kvforge bench "$@" --json "$out/$name.json" 2>&1 | grep -v -i warn | tail -8 | tee "$out/$name.txt"
}
if [[ $what == all || $what == throughput ]]; then
  run throughput 240 throughput "${M[@]}" "${W1[@]}" --vs hf-generate --hf-batch-size 256
  run throughput-sync 120 throughput "${M[@]}" "${W1[@]}" --no-async-scheduling
  run throughput-16k 120 throughput "${M[@]}" "${W1[@]}" --max-num-batched-tokens 16384
fi
if [[ $what == all || $what == latency ]]; then
  run latency 120 latency "${M[@]}" --batch-size 64 --input-len 1024 --output-len 64 --num-iters-warmup 2 --num-iters 5
fi
if [[ $what == all || $what == serve ]]; then
  run serve 150 serve "${M[@]}" --num-prompts 20 --input-len 512 --output-len 128 --request-rate 1 --server-process
fi
