#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh` with the vllm groups brought (shared/gpu/README.md):
# kvforge against vLLM 0.26, same machine, same requests, one after the other (docs/benchmarks.md).
#   bash benchmarks/gpu_vs_vllm.sh offline-a   W1 (256 x 512 x 256) and the batch-1 request (512 in, 128 out)
#   bash benchmarks/gpu_vs_vllm.sh offline-b   W2 (uniform 512 x 1024+-90% x 256+-90%) and W3 (shared prefix)
#   bash benchmarks/gpu_vs_vllm.sh serve       `vllm bench serve` (vLLM's own client) against `kvforge serve`,
#                                              then against `vllm serve`: 512-token prompts, 128 out, Poisson
#                                              at 2, 8 and 32 req/s, a Llama-3-8B shape with SmolLM2's tokenizer
#                                              (ENGINES="kvforge vllm" and RATES="2 8 32" by default;
#                                              KVFORGE_SERVE_ARGS: more flags for kvforge serve)
#   bash benchmarks/gpu_vs_vllm.sh backends    W1 and batch 1 on kvforge alone with each attention backend
# Offline rows come from `kvforge bench ... --vs vllm` (vLLM in its own process, /tmp/vsite in front of its
# path). JSON goes to $OUT/results (or ./gpu-out/results); the tables to $OUT/*.txt.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out/results"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
M=(--model dummy:llama-3-8b)
VS=(--vs vllm --vllm-path /tmp/vsite)
run() {  # run NAME TIMEOUT ARGS...: `kvforge bench ARGS`, JSON to results/NAME.json, the table to NAME.txt
  local name=$1 limit=$2; shift 2
  timeout "$limit" kvforge bench "$@" --json "$out/results/$name.json" > "$out/$name.log" 2>&1
  echo "== $name (exit $?)"; grep -v -i -e warn -e '^\[vllm\]' "$out/$name.log" | tail -9 | tee "$out/$name.txt"
}
vllm_cli() { PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} python3 -c \
  "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()" "$@"; }
wait_health() {  # wait_health PORT SECONDS: prints the seconds it took
  python3 - "$1" "$2" <<'PY'
import sys, time, urllib.request
t0 = time.time()
while time.time() - t0 < float(sys.argv[2]):
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2).status == 200:
            print(f"{time.time() - t0:.1f}"); sys.exit(0)
    except Exception:
        time.sleep(0.1)
sys.exit(1)
PY
}
case ${1:-} in
  offline-a)
    run w1 420 throughput "${M[@]}" "${VS[@]}" --num-prompts 256 --input-len 512 --output-len 256
    run batch1 300 latency "${M[@]}" "${VS[@]}" --batch-size 1 --input-len 512 --output-len 128 \
      --num-iters-warmup 2 --num-iters 5 ;;
  offline-b)
    run w2 420 throughput "${M[@]}" "${VS[@]}" --dataset uniform --num-prompts 512 --input-len 1024 \
      --output-len 256 --range-ratio 0.9
    run w3 300 throughput "${M[@]}" "${VS[@]}" --dataset shared-prefix --num-prompts 256 --input-len 2048 \
      --prefix-len 1536 --output-len 128 ;;
  serve)
    dir=/tmp/llama3-8b-shape-smollm2-vocab
    [ -e "$dir/config.json" ] || python3 benchmarks/make_model_dir.py "$dir"
    port=8011
    for engine in ${ENGINES:-kvforge vllm}; do
      t0=$(date +%s.%N)
      if [[ $engine == kvforge ]]; then
        kvforge serve --model "$dir" --load-format dummy --port $port ${KVFORGE_SERVE_ARGS:-} > "$out/serve-$engine.log" 2>&1 &
      else
        vllm_cli serve "$dir" --load-format dummy --host 127.0.0.1 --port $port --dtype bfloat16 \
          > "$out/serve-$engine.log" 2>&1 &
      fi
      pid=$!
      ready=$(wait_health $port 400) || { echo "$engine did not start"; tail -30 "$out/serve-$engine.log"; kill $pid; continue; }
      echo "== $engine serve ready after $ready s (process start to /health 200)" | tee -a "$out/serve.txt"
      for rate in ${RATES:-2 8 32}; do
        n=$(( rate == 2 ? 100 : (rate == 8 ? 200 : 400) ))
        vllm_cli bench serve --backend openai --base-url http://127.0.0.1:$port --model "$dir" --tokenizer "$dir" \
          --dataset-name random --random-input-len 512 --random-output-len 128 --num-prompts $n \
          --request-rate $rate --ignore-eos --temperature 0 --seed 0 --percentile-metrics ttft,tpot,itl,e2el \
          --metric-percentiles 50,99 --save-result --result-dir "$out/results" \
          --result-filename "serve-$engine-rate$rate.json" > "$out/serve-$engine-rate$rate.log" 2>&1
        echo "-- $engine at $rate req/s (exit $?)" | tee -a "$out/serve.txt"
        sed -n '/Serving Benchmark Result/,/^=\+$/p' "$out/serve-$engine-rate$rate.log" | tee -a "$out/serve.txt"
      done
      kill $pid; wait $pid 2>/dev/null
    done ;;
  backends)
    for b in triton flashinfer flash_attn; do
      run "w1-$b" 300 throughput "${M[@]}" --attention-backend $b --num-prompts 256 --input-len 512 --output-len 256
      run "batch1-$b" 200 latency "${M[@]}" --attention-backend $b --batch-size 1 --input-len 512 --output-len 128 \
        --num-iters-warmup 2 --num-iters 5
    done ;;
  *) echo "usage: $0 offline-a|offline-b|serve|backends" >&2; exit 2 ;;
esac
