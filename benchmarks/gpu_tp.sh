#!/usr/bin/env bash
# On the nvidia-h200-x2 machine, after `source .gpu/install.sh`: tensor parallelism figures of
# docs/distributed.md, one fresh process per row (benchmarks/tp_peers.py), rows appended to $OUT/tp.txt.
#   bash benchmarks/gpu_tp.sh 8b        dummy:llama-3-8b, TP=1, TP=2, PP=2: W1 and the batch-1 decode step
#   bash benchmarks/gpu_tp.sh 70b       dummy:llama-3-70b TP=2, kvforge
#   bash benchmarks/gpu_tp.sh 70b-vllm  the same with vLLM 0.26 (the vllm groups brought)
#   bash benchmarks/gpu_tp.sh 8b-vllm   dummy:llama-3-8b TP=2 with vLLM 0.26
#   bash benchmarks/gpu_tp.sh scale     (2 or 4 GPUs) the all-reduce probe, then dummy:llama-3-8b TP=1, TP=2
#                                       (also NCCL only, and a profile of each rank), PP=2, and TP=4 on 4 GPUs
#   bash benchmarks/gpu_tp.sh rows      (2 or 4 GPUs) the scale rows alone: TP=1, TP=2, PP=2, TP=4 on 4 GPUs
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$out/gpu.txt"
run() {  # run TIMEOUT ARGS...
  local limit=$1; shift
  timeout "$limit" python3 benchmarks/tp_peers.py "$@" > "$out/last.log" 2>&1
  local rc=$?
  grep '^ROW' "$out/last.log" | tee -a "$out/tp.txt"
  [[ $rc == 0 ]] || { echo "rc=$rc: $*" | tee -a "$out/tp.txt"; tail -25 "$out/last.log"; }
}
case ${1:-8b} in
  8b)  # one GPU, two GPUs tensor-parallel, two GPUs as two pipeline stages
    run 200 --engine kvforge --preset llama-3-8b --tp 1 --w1 --batch1
    run 200 --engine kvforge --preset llama-3-8b --tp 2 --w1 --batch1
    run 200 --engine kvforge --preset llama-3-8b --pp 2 --w1 --batch1 ;;
  70b)
    run 280 --engine kvforge --preset llama-3-70b --tp 2 --w1 --batch1 ;;
  70b-vllm)
    PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} run 480 --engine vllm --preset llama-3-70b --tp 2 --w1 --batch1 ;;
  scale)
    gpus=$(nvidia-smi -L | wc -l)
    timeout 120 python3 benchmarks/nccl_probe.py --gpus 2 2>&1 | grep -e '^ROW' -e Error | tee -a "$out/tp.txt"
    (( gpus >= 4 )) && timeout 120 python3 benchmarks/nccl_probe.py --gpus 4 2>&1 | grep -e '^ROW' -e Error | tee -a "$out/tp.txt"
    run 150 --engine kvforge --preset llama-3-8b --tp 1 --w1 --batch1
    run 150 --engine kvforge --preset llama-3-8b --tp 2 --w1 --batch1 --profile --trace-dir /tmp/tp2-trace
    python3 benchmarks/tp_trace_summary.py /tmp/tp2-trace 2>&1 | tee -a "$out/tp.txt"
    run 150 --engine kvforge --preset llama-3-8b --tp 2 --batch1 --engine-arg disable_custom_all_reduce=true
    run 150 --engine kvforge --preset llama-3-8b --pp 2 --w1 --batch1
    (( gpus >= 4 )) && run 150 --engine kvforge --preset llama-3-8b --tp 4 --w1 --batch1
    true ;;
  rows)  # (2 or 4 GPUs) the scale rows alone: TP=1, TP=2, PP=2, and TP=4 on 4 GPUs
    gpus=$(nvidia-smi -L | wc -l)
    run 150 --engine kvforge --preset llama-3-8b --tp 1 --w1 --batch1
    run 150 --engine kvforge --preset llama-3-8b --tp 2 --w1 --batch1
    run 150 --engine kvforge --preset llama-3-8b --pp 2 --w1 --batch1
    (( gpus >= 4 )) && run 150 --engine kvforge --preset llama-3-8b --tp 4 --w1 --batch1
    true ;;
  8b-vllm)
    PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} run 300 --engine vllm --preset llama-3-8b --tp 2 --w1 --batch1 ;;
esac
